//! The outbound proxy's counters (`docs/observability.md#metrics`).
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::Forbidden;
use crate::{metrics::label_value_as_str, state::OutboundOutcome};

/// Which way bytes went, seen from the client: `sent` client -> upstream, `received` upstream -> client.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum Direction {
    Sent,
    Received,
}

impl Direction {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Received => "received",
        }
    }
}

/// Why the proxy ended a connection that had not failed by itself.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum Timeout {
    /// No byte either way for the idle timeout.
    Idle,
    /// One side closed and the other did not take a write for the write timeout.
    Write,
}

impl Timeout {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Write => "write",
        }
    }
}

label_value_as_str!(Direction, Timeout, Forbidden);

impl prometheus_client::encoding::EncodeLabelValue for OutboundOutcome {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.metric_label())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: OutboundOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: Direction,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutLabels {
    timeout: Timeout,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: Forbidden,
}

#[derive(Debug, Default)]
pub(crate) struct ProxyMetrics {
    outbound: Family<OutcomeLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    active: Gauge,
    splice_fallbacks: Counter,
    timeouts: Family<TimeoutLabels, Counter>,
    refused_destinations: Family<ReasonLabels, Counter>,
    flows_unclaimed: Counter,
}

impl ProxyMetrics {
    pub(crate) fn outbound(&self, outcome: OutboundOutcome) {
        self.outbound
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub(crate) fn bytes(&self, direction: Direction, n: u64) {
        self.bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n);
    }

    /// A connection relayed by copy because the splice pipes did not fit the descriptor budget.
    pub(crate) fn splice_fallback(&self) {
        self.splice_fallbacks.inc();
    }

    /// A connection the proxy reset because it timed out.
    pub(crate) fn timed_out(&self, timeout: Timeout) {
        self.timeouts
            .get_or_create(&TimeoutLabels { timeout })
            .inc();
    }

    /// A destination the proxy would not dial for a pod (the connection was reset).
    pub(crate) fn refused_destination(&self, reason: Forbidden) {
        self.refused_destinations
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// A connection to the proxy that no steered `connect()` filed a destination for (a pod
    /// connecting to the proxy's port itself, or reusing the address of a connection long gone).
    pub(crate) fn flow_unclaimed(&self) {
        self.flows_unclaimed.inc();
    }

    /// Counts a proxied connection as open until the returned guard drops.
    pub(crate) fn track_active(&self) -> ActiveGuard {
        self.active.inc();
        ActiveGuard(self.active.clone())
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "outbound_connections",
            "Outbound connections by outcome",
            self.outbound.clone(),
        );
        registry.register(
            "outbound_bytes",
            "Bytes proxied, by direction seen from the client",
            self.bytes.clone(),
        );
        registry.register(
            "active_connections",
            "Proxied connections open now",
            self.active.clone(),
        );
        registry.register(
            "splice_fallbacks",
            "Connections relayed by copy because the splice pipes did not fit the descriptor budget",
            self.splice_fallbacks.clone(),
        );
        registry.register(
            "outbound_timeouts",
            "Proxied connections reset because they timed out (idle, or a peer that never reads)",
            self.timeouts.clone(),
        );
        registry.register(
            "outbound_refused_destinations",
            "Proxied connections reset because their destination is one the proxy never dials for a pod (loopback, unspecified, link-local, the node's own, or denied by --deny-destination), by reason",
            self.refused_destinations.clone(),
        );
        registry.register(
            "outbound_unclaimed",
            "Connections to the proxy that no steered connect() filed a destination for: reset",
            self.flows_unclaimed.clone(),
        );
    }
}

/// Decrements the active-connections gauge on drop, whatever path the connection ends on.
pub(crate) struct ActiveGuard(Gauge);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        metrics::{encode, registry_of},
        state::OutboundOutcome,
    };

    #[test]
    fn exports_outcomes_bytes_and_active_gauge() {
        let metrics = ProxyMetrics::default();
        metrics.outbound(OutboundOutcome::Passthrough);
        metrics.outbound(OutboundOutcome::NoHealthyUpstream);
        metrics.bytes(Direction::Sent, 10);
        let guard = metrics.track_active();
        let text = encode(&registry_of(|r| metrics.register(r))).unwrap();
        assert!(
            text.contains(r#"redirect_outbound_connections_total{outcome="passthrough"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"redirect_outbound_connections_total{outcome="no_healthy_upstream"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"redirect_outbound_bytes_total{direction="sent"} 10"#),
            "{text}"
        );
        assert!(text.contains("redirect_active_connections 1"), "{text}");
        drop(guard);
        let text = encode(&registry_of(|r| metrics.register(r))).unwrap();
        assert!(text.contains("redirect_active_connections 0"), "{text}");
    }
}
