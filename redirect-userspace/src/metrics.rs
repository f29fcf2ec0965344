//! The agent's counters, exported as Prometheus text on the admin server's `/metrics`. Each
//! subsystem owns and registers its families (`proxy::ProxyMetrics`, `dns::DnsMetrics`,
//! `budget::BudgetMetrics`); this module holds the few that cut across (configuration loads, the
//! decisions made for clients, the Kubernetes API) and what every family needs (the label macro,
//! the encoder). It imports no subsystem: the agent puts every family in one registry. The
//! kernel's counters are collectors the agent adds (`redirect`, the fast path).
//!
//! The data path only touches atomics here; encoding happens on the admin thread.
use std::fmt;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// Implements `EncodeLabelValue` for label enums with a `const fn as_str`.
macro_rules! label_value_as_str {
    ($($ty:ty),*) => {$(
        impl prometheus_client::encoding::EncodeLabelValue for $ty {
            fn encode(
                &self,
                encoder: &mut prometheus_client::encoding::LabelValueEncoder,
            ) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}
pub(crate) use label_value_as_str;

/// What a configuration load did.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum ReloadResult {
    /// Applied; nothing in error.
    Ok,
    /// Applied; some objects left out (their last good version kept where there was one).
    Partial,
    /// Nothing applied: the directory could not be read.
    Failed,
}

impl ReloadResult {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Partial => "partial",
            Self::Failed => "failed",
        }
    }
}

/// Every kind a rejected-objects gauge is kept for, so each series exists (at 0) from the start.
pub(crate) const REJECTED_KINDS: [&str; 10] = [
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
pub(crate) enum Lookup {
    Outbound,
    Dns,
}

impl Lookup {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Dns => "dns",
        }
    }
}

label_value_as_str!(ReloadResult, Lookup);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: ReloadResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    lookup: Lookup,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The families that cut across subsystems. Each subsystem owns and registers its own (the agent
/// puts them all in one registry).
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub config: ConfigMetrics,
    pub clients: ClientMetrics,
    pub kube: KubeMetrics,
}

impl Metrics {
    /// A registry of these families alone.
    #[cfg(test)]
    pub(crate) fn registry(&self) -> Registry {
        registry_of(|r| self.register(r))
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        self.config.register(registry);
        self.clients.register(registry);
        self.kube.register(registry);
    }
}

/// The prefix of the agent's own families (Istio's standard ones have theirs).
pub(crate) const PREFIX: &str = "redirect";

/// A registry with what `register` puts in it under the agent's prefix.
pub(crate) fn registry_of(register: impl FnOnce(&mut Registry)) -> Registry {
    let mut registry = Registry::default();
    register(registry.sub_registry_with_prefix(PREFIX));
    registry
}

/// Configuration loads, from the directory or the Kubernetes API.
#[derive(Debug, Default)]
pub(crate) struct ConfigMetrics {
    reloads: Family<ReloadLabels, Counter>,
    rejected: Family<KindLabels, Gauge>,
}

impl ConfigMetrics {
    pub(crate) fn reload(&self, result: ReloadResult) {
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
    }

    /// The objects in error after a load, by kind (each kind of [`REJECTED_KINDS`] set, 0 when none).
    pub(crate) fn rejected<'a>(&self, kinds: impl IntoIterator<Item = &'a str>) {
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

    fn register(&self, registry: &mut Registry) {
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
    }
}

/// What was decided for clients, by the proxy, the DNS proxy and the kernel alike.
#[derive(Debug, Default)]
pub(crate) struct ClientMetrics {
    hidden: Family<LookupLabels, Counter>,
    identity_mismatches: Counter,
}

impl ClientMetrics {
    /// A service the client may not see was skipped while deciding for it.
    pub(crate) fn hidden(&self, lookup: Lookup) {
        self.hidden_by(lookup, 1);
    }

    /// `n` hides at once (those the kernel counted since the last look).
    pub(crate) fn hidden_by(&self, lookup: Lookup, n: u64) {
        self.hidden
            .get_or_create(&LookupLabels { lookup })
            .inc_by(n);
    }

    /// A client whose cgroup names another pod than the one holding its source IP.
    pub(crate) fn identity_mismatch(&self) {
        self.identity_mismatches.inc();
    }

    fn register(&self, registry: &mut Registry) {
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
    }
}

/// The Kubernetes API: its watches and the status this agent writes as the cluster's writer.
#[derive(Debug, Default)]
pub(crate) struct KubeMetrics {
    watch_errors: Family<KindLabels, Counter>,
    status_writes: Family<ResultLabels, Counter>,
}

impl KubeMetrics {
    /// A watch on the Kubernetes API failed (it retries by itself).
    pub(crate) fn watch_error(&self, kind: &'static str) {
        self.watch_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// A ServiceEntry status write (`ok`, `conflict`, `gone`, `error`).
    pub(crate) fn status_write(&self, result: &'static str) {
        self.status_writes
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "kube_watch_errors",
            "Failures of the watches on the Kubernetes API, by kind (each watch retries by itself)",
            self.watch_errors.clone(),
        );
        registry.register(
            "status_writes",
            "ServiceEntry status writes by this agent as the cluster's status writer, by result",
            self.status_writes.clone(),
        );
    }
}

/// Renders a registry in the Prometheus text format.
pub(crate) fn encode(registry: &Registry) -> Result<String, fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_objects_are_a_gauge_by_kind() {
        let metrics = Metrics::default();
        metrics
            .config
            .rejected(["ServiceEntry", "ServiceEntry", "File"]);
        let text = encode(&metrics.registry()).unwrap();
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="ServiceEntry"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="File"} 1"#),
            "{text}"
        );
        // Fixed: back to 0, the series kept.
        metrics.config.rejected([]);
        let text = encode(&metrics.registry()).unwrap();
        assert!(
            text.contains(r#"redirect_config_objects_rejected{kind="ServiceEntry"} 0"#),
            "{text}"
        );
    }
}
