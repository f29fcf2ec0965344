//! The agent's counters, exported as Prometheus text on the admin server's `/metrics`.
//!
//! The data path only touches atomics here; encoding happens on the admin thread.
use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{
        DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
    },
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
    },
    registry::Registry,
};

use crate::{proxy::Forbidden, redirect::RedirectMaps, state::OutboundOutcome};

/// Which way bytes went, seen from the client: `sent` client -> upstream, `received` upstream -> client.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Direction {
    Sent,
    Received,
}

impl Direction {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Received => "received",
        }
    }
}

/// How a DNS query was handled (`docs/observability.md#metrics`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DnsOutcome {
    Answered,
    Forwarded,
    /// A forwarded question answered from the cache of the upstream's replies.
    Cached,
    Servfail,
    /// Not a DNS message: dropped, never forwarded.
    Malformed,
}

impl DnsOutcome {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Answered => "answered",
            Self::Forwarded => "forwarded",
            Self::Cached => "cached",
            Self::Servfail => "servfail",
            Self::Malformed => "malformed",
        }
    }
}

/// What a configuration load did.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    /// Applied; nothing in error.
    Ok,
    /// Applied; some objects left out (their last good version kept where there was one).
    Partial,
    /// Nothing applied: the directory could not be read.
    Failed,
}

impl ReloadResult {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Partial => "partial",
            Self::Failed => "failed",
        }
    }
}

/// Every kind a rejected-objects gauge is kept for, so each series exists (at 0) from the start.
pub const REJECTED_KINDS: [&str; 10] = [
    "Namespace",
    "ServiceEntry",
    "Service",
    "Pod",
    "WorkloadEntry",
    "IstioOperator",
    "ConfigMap",
    "MeshConfig",
    "File",
    "Document",
];

/// Where a hidden service was skipped.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Lookup {
    Outbound,
    Dns,
}

impl Lookup {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Dns => "dns",
        }
    }
}

/// A resource the agent caps (see `budget`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum BudgetKind {
    /// Descriptors of the outbound proxy (sockets and pipes).
    Fds,
    Connections,
    DnsForwards,
    DnsTcpClients,
    /// Ephemeral ports of the node toward one upstream address (open, or in TIME_WAIT).
    UpstreamPorts,
}

impl BudgetKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Fds => "fds",
            Self::Connections => "connections",
            Self::DnsForwards => "dns_forwards",
            Self::DnsTcpClients => "dns_tcp_clients",
            Self::UpstreamPorts => "upstream_ports",
        }
    }
}

/// Why a budget said no.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Refusal {
    /// The client holds its whole share.
    ClientShare,
    /// The node-wide limit is reached.
    NodeLimit,
    /// The descriptors a connection needs are not in the budget.
    Fds,
}

impl Refusal {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ClientShare => "client_share",
            Self::NodeLimit => "node_limit",
            Self::Fds => "fds",
        }
    }
}

/// Which limit a budget gauge is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Scope {
    Node,
    Client,
}

impl Scope {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Client => "client",
        }
    }
}

/// Why the proxy ended a connection that had not failed by itself.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Timeout {
    /// No byte either way for the idle timeout.
    Idle,
    /// One side closed and the other did not take a write for the write timeout.
    Write,
}

impl Timeout {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Write => "write",
        }
    }
}

macro_rules! label_value_as_str {
    ($($ty:ty),*) => {$(
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
                fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}
impl EncodeLabelValue for OutboundOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, self.metric_label())
    }
}

label_value_as_str!(
    Direction,
    DnsOutcome,
    ReloadResult,
    Lookup,
    BudgetKind,
    Refusal,
    Scope,
    Timeout,
    Forbidden
);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetLabels {
    budget: BudgetKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    budget: BudgetKind,
    scope: Scope,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    budget: BudgetKind,
    reason: Refusal,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutLabels {
    timeout: Timeout,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: OutboundOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsLabels {
    outcome: DnsOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: ReloadResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: Forbidden,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    lookup: Lookup,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: Direction,
}

/// Every counter the agent keeps. Cheap to clone handles are held by the proxy.
#[derive(Debug, Default)]
pub struct Metrics {
    outbound: Family<OutcomeLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    active: Gauge,
    dns: Family<DnsLabels, Counter>,
    dns_cache_entries: Gauge,
    reloads: Family<ReloadLabels, Counter>,
    rejected: Family<KindLabels, Gauge>,
    hidden: Family<LookupLabels, Counter>,
    identity_mismatches: Counter,
    budget_used: Family<BudgetLabels, Gauge>,
    budget_limit: Family<LimitLabels, Gauge>,
    budget_refusals: Family<RefusalLabels, Counter>,
    splice_fallbacks: Counter,
    timeouts: Family<TimeoutLabels, Counter>,
    kube_watch_errors: Family<KindLabels, Counter>,
    status_writes: Family<ResultLabels, Counter>,
    refused_destinations: Family<ReasonLabels, Counter>,
    flows_unclaimed: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

impl Metrics {
    pub fn outbound(&self, outcome: OutboundOutcome) {
        self.outbound
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn bytes(&self, direction: Direction, n: u64) {
        self.bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n);
    }

    pub fn dns(&self, outcome: DnsOutcome) {
        self.dns.get_or_create(&DnsLabels { outcome }).inc();
    }

    /// The gauge the DNS answer cache keeps at its number of entries.
    pub fn dns_cache_entries(&self) -> Gauge {
        self.dns_cache_entries.clone()
    }

    pub fn reload(&self, result: ReloadResult) {
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
    }

    /// The objects in error after a load, by kind (each kind of [`REJECTED_KINDS`] set, 0 when none).
    pub fn rejected<'a>(&self, kinds: impl IntoIterator<Item = &'a str>) {
        let mut counts = [0i64; REJECTED_KINDS.len()];
        for kind in kinds {
            if let Some(i) = REJECTED_KINDS.iter().position(|k| *k == kind) {
                counts[i] += 1;
            }
        }
        for (kind, count) in REJECTED_KINDS.iter().zip(counts) {
            self.rejected.get_or_create(&KindLabels { kind }).set(count);
        }
    }

    /// A service the client may not see was skipped while deciding for it.
    pub fn hidden(&self, lookup: Lookup) {
        self.hidden_by(lookup, 1);
    }

    /// `n` hides at once (those the kernel counted since the last look).
    pub fn hidden_by(&self, lookup: Lookup, n: u64) {
        self.hidden
            .get_or_create(&LookupLabels { lookup })
            .inc_by(n);
    }

    /// A connection whose cgroup names another pod than the one holding its source IP.
    pub fn identity_mismatch(&self) {
        self.identity_mismatches.inc();
    }

    /// A budget's limits, set once when the budget is made.
    pub fn budget_limits(&self, budget: BudgetKind, node: usize, client: Option<usize>) {
        let set = |scope, n: usize| {
            self.budget_limit
                .get_or_create(&LimitLabels { budget, scope })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        set(Scope::Node, node);
        if let Some(client) = client {
            set(Scope::Client, client);
        }
    }

    /// How much of a budget is held now, node-wide.
    pub fn budget_used(&self, budget: BudgetKind, used: usize) {
        self.budget_used
            .get_or_create(&BudgetLabels { budget })
            .set(i64::try_from(used).unwrap_or(i64::MAX));
    }

    pub fn budget_refused(&self, budget: BudgetKind, reason: Refusal) {
        self.budget_refusals
            .get_or_create(&RefusalLabels { budget, reason })
            .inc();
    }

    /// A connection relayed by copy because the splice pipes did not fit the descriptor budget.
    pub fn splice_fallback(&self) {
        self.splice_fallbacks.inc();
    }

    /// A connection the proxy reset because it timed out.
    pub fn timed_out(&self, timeout: Timeout) {
        self.timeouts
            .get_or_create(&TimeoutLabels { timeout })
            .inc();
    }

    /// A watch on the Kubernetes API failed (it retries by itself).
    pub fn kube_watch_error(&self, kind: &'static str) {
        self.kube_watch_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// A ServiceEntry status write (`ok`, `conflict`, `gone`, `error`).
    pub fn status_write(&self, result: &'static str) {
        self.status_writes
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// A destination the proxy would not dial for a pod (the connection was reset).
    pub fn refused_destination(&self, reason: Forbidden) {
        self.refused_destinations
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// A connection to the proxy that no steered `connect()` filed a destination for (a pod
    /// connecting to the proxy's port itself, or reusing the address of a connection long gone).
    pub fn flow_unclaimed(&self) {
        self.flows_unclaimed.inc();
    }

    /// Counts a proxied connection as open until the returned guard drops.
    pub fn track_active(self: &Arc<Self>) -> ActiveGuard {
        self.active.inc();
        ActiveGuard(self.clone())
    }

    /// A registry exporting these metrics, plus the eBPF counters when programs are attached.
    pub fn registry(self: &Arc<Self>, redirect_maps: Option<Arc<RedirectMaps>>) -> Registry {
        let mut registry = Registry::with_prefix("redirect");
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
        registry.register("dns_queries", "DNS queries by outcome", self.dns.clone());
        registry.register(
            "dns_cache_entries",
            "Upstream DNS answers held in the cache",
            self.dns_cache_entries.clone(),
        );
        registry.register(
            "config_reloads",
            "Configuration loads: applied (ok), applied with objects left out (partial), nothing applied (failed)",
            self.reloads.clone(),
        );
        registry.register(
            "config_objects_rejected",
            "Objects in error in the configuration now, by kind: left out, or kept at their last good version (File: a file not read to its end)",
            self.rejected.clone(),
        );
        registry.register(
            "services_hidden",
            "Times a service the client may not see was skipped during resolution",
            self.hidden.clone(),
        );
        registry.register(
            "client_identity_mismatches",
            "Connections and DNS-over-TCP queries served as an unknown client because the connecting process's cgroup belongs to another pod than the one the registry gives its address to",
            self.identity_mismatches.clone(),
        );
        registry.register(
            "budget_used",
            "What the agent holds now, node-wide, of each budget",
            self.budget_used.clone(),
        );
        registry.register(
            "budget_limit",
            "Each budget's node-wide limit and one client's share of it",
            self.budget_limit.clone(),
        );
        registry.register(
            "budget_refusals",
            "Requests refused because a budget was reached, by budget and reason",
            self.budget_refusals.clone(),
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
            "kube_watch_errors",
            "Failures of the watches on the Kubernetes API, by kind (each watch retries by itself)",
            self.kube_watch_errors.clone(),
        );
        registry.register(
            "status_writes",
            "ServiceEntry status writes by this agent as the cluster's status writer, by result",
            self.status_writes.clone(),
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
        if let Some(maps) = redirect_maps {
            registry.register_collector(Box::new(EbpfEvents(maps)));
        }
        registry
    }
}

/// Decrements the active-connections gauge on drop, whatever path the connection ends on.
pub struct ActiveGuard(Arc<Metrics>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.dec();
    }
}

/// Reads the programs' per-CPU counters at scrape time.
#[derive(Debug)]
struct EbpfEvents(Arc<RedirectMaps>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

impl Collector for EbpfEvents {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let counts = self.0.event_counts();
        let mut family = encoder.encode_descriptor(
            "ebpf_events",
            "Events counted by the eBPF programs (summed over CPUs)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (stat, total) in counts {
            let labels = EventLabels { event: stat.name() };
            ConstCounter::new(total).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Renders a registry in the Prometheus text format.
pub fn encode(registry: &Registry) -> Result<String, fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_outcomes_bytes_and_active_gauge() {
        let metrics = Arc::new(Metrics::default());
        metrics.outbound(OutboundOutcome::Passthrough);
        metrics.outbound(OutboundOutcome::NoHealthyUpstream);
        metrics.bytes(Direction::Sent, 10);
        let guard = metrics.track_active();
        let text = encode(&metrics.registry(None)).unwrap();
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
        let text = encode(&metrics.registry(None)).unwrap();
        assert!(text.contains("redirect_active_connections 0"), "{text}");
    }

    #[test]
    fn rejected_objects_are_a_gauge_by_kind() {
        let metrics = Arc::new(Metrics::default());
        metrics.rejected(["ServiceEntry", "ServiceEntry", "File"]);
        let text = encode(&metrics.registry(None)).unwrap();
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="ServiceEntry"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="File"} 1"#),
            "{text}"
        );
        // Fixed: back to 0, the series kept.
        metrics.rejected([]);
        let text = encode(&metrics.registry(None)).unwrap();
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="ServiceEntry"} 0"#),
            "{text}"
        );
    }
}
