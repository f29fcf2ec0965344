//! The agent's metric families and the registry they are served from: its own under the
//! `redirect_` prefix, the kernel's counters and the fast path's collector beside them, and
//! Istio's standard families under their own names.
use std::sync::Arc;

use super::AgentConfig;
use crate::{
    audit::AuditMetrics,
    budget::BudgetMetrics,
    dns::DnsMetrics,
    fastpath::FastPath,
    live::LiveState,
    metrics::Metrics,
    proxy::{Authorizer, ProxyMetrics},
    records::RecordMetrics,
    redirect::Redirector,
    telemetry::IstioMetrics,
};

/// Every family of the agent: the ones that cut across, and each subsystem's own.
#[derive(Debug, Default)]
pub(super) struct Families {
    pub(super) shared: Arc<Metrics>,
    pub(super) proxy: Arc<ProxyMetrics>,
    pub(super) dns: Arc<DnsMetrics>,
    pub(super) budgets: Arc<BudgetMetrics>,
    pub(super) audit: Arc<AuditMetrics>,
    pub(super) records: Arc<RecordMetrics>,
    pub(super) hbone: Arc<crate::hbone::HboneMetrics>,
    /// Inbound authorization owns its decisions' counters.
    pub(super) authorizer: Arc<Authorizer>,
    /// Istio's TCP families, made once the state in force exists.
    istio: std::sync::OnceLock<Arc<IstioMetrics>>,
}

impl Families {
    /// Istio's TCP families, labelled from the state in force.
    pub(super) fn istio(&self, config: &AgentConfig, live: &Arc<LiveState>) -> Arc<IstioMetrics> {
        let made = || {
            let istio = IstioMetrics::new(live.clone(), &config.cluster_id);
            Arc::new(istio.with_trust_domain(config.trust_domain.as_deref()))
        };
        self.istio.get_or_init(made).clone()
    }

    fn registry(&self) -> prometheus_client::registry::Registry {
        let mut registry = crate::metrics::registry_of(|r| {
            self.shared.register(r);
            self.proxy.register(r);
            self.dns.register(r);
            self.budgets.register(r);
            self.audit.register(r);
            self.records.register(r);
            self.hbone.register(r);
            self.authorizer.metrics.register(r);
        });
        // Istio's names carry no prefix of ours.
        if let Some(istio) = self.istio.get() {
            registry.register_collector(Box::new(istio.clone()));
        }
        registry
    }
}

/// The metrics registry: the agent's families, the kernel's counters, the hand-over gauge and the
/// fast path's collector.
pub(super) fn registry(
    config: &AgentConfig,
    families: &Families,
    redirector: &Redirector,
    fast_path: Option<&Arc<FastPath>>,
) -> prometheus_client::registry::Registry {
    let mut root = families.registry();
    let registry = root.sub_registry_with_prefix(crate::metrics::PREFIX);
    registry.register_collector(crate::redirect::counters::collector(redirector.maps()));
    let handover_available = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    handover_available.set(i64::from(config.handover.available));
    registry.register(
        "handover_available",
        "1 when a successor can take over (pinned on a bpf filesystem); 0: a restart or rollout drops connections",
        handover_available,
    );
    if let Some(fast) = fast_path {
        registry.register_collector(fast.collector());
    }
    root
}
