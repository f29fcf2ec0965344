//! The DNS proxy's counters (`docs/observability.md#metrics`).
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::metrics::label_value_as_str;

/// How a DNS query was handled.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum DnsOutcome {
    Answered,
    Forwarded,
    /// A forwarded question answered from the cache of the upstream's replies.
    Cached,
    Servfail,
    /// Not a DNS message: dropped, never forwarded.
    Malformed,
}

impl DnsOutcome {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Answered => "answered",
            Self::Forwarded => "forwarded",
            Self::Cached => "cached",
            Self::Servfail => "servfail",
            Self::Malformed => "malformed",
        }
    }
}

label_value_as_str!(DnsOutcome);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsLabels {
    outcome: DnsOutcome,
}

#[derive(Debug, Default)]
pub(crate) struct DnsMetrics {
    queries: Family<DnsLabels, Counter>,
    cache_entries: Gauge,
}

impl DnsMetrics {
    pub(crate) fn query(&self, outcome: DnsOutcome) {
        self.queries.get_or_create(&DnsLabels { outcome }).inc();
    }

    /// The gauge the DNS answer cache keeps at its number of entries.
    pub(crate) fn cache_entries(&self) -> Gauge {
        self.cache_entries.clone()
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "dns_queries",
            "DNS queries by outcome",
            self.queries.clone(),
        );
        registry.register(
            "dns_cache_entries",
            "Upstream DNS answers held in the cache",
            self.cache_entries.clone(),
        );
    }
}
