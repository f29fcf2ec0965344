//! The per-node data-plane state: services indexed by exact VIP, CIDR and host name, workloads by
//! IP, and the lookups the proxy, the DNS proxy and `redirect explain` all call.
//!
//! A [`Snapshot`] is built once per configuration and never changes (but for round-robin counters);
//! hold it in an `Arc` and swap the whole `Arc` on reload. NONE entries never enter it.
mod bucket;
mod build;
mod dns;
mod dump;
mod outbound;
mod service;
mod store;
mod workload;

use std::{net::IpAddr, sync::Arc};

pub use dns::DnsDecision;
#[cfg(test)]
pub use dns::SearchDomains;
pub use dump::ConfigDump;
pub use outbound::{
    NoUpstreamReason, Outbound, OutboundDecision, OutboundOutcome, PassthroughReason, Pick,
};
#[cfg(test)]
pub use service::ServiceKind;
pub use service::{Port, Service, ServiceVisibility, Target};
pub use workload::WorkloadName;

use crate::{
    config::{DEFAULT_CLUSTER_DOMAIN, LabelSelector, Model, VisibilityConfig, Workload},
    visibility::{self, Resolved},
};
use store::ServiceStore;
use workload::WorkloadStore;

#[derive(Debug)]
pub struct Snapshot {
    /// Shared with the snapshot a change to Pods alone was built from (see [`Snapshot::with_pods`]).
    services: Arc<ServiceStore>,
    workloads: WorkloadStore,
    cluster_domain: String,
    /// The visibility configuration in force, for dumps.
    visibility: Option<VisibilityConfig>,
    /// The mesh config's `discoverySelectors`, for dumps.
    discovery_selectors: Vec<LabelSelector>,
}

impl Default for Snapshot {
    /// An empty state: every connection passes through, every query is forwarded.
    fn default() -> Self {
        Snapshot {
            services: Arc::default(),
            workloads: WorkloadStore::default(),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.to_string(),
            visibility: None,
            discovery_selectors: Vec::new(),
        }
    }
}

impl Snapshot {
    /// Resolves visibility and builds the state for `model`.
    pub fn from_model(model: &Model) -> Self {
        Self::build(model, &visibility::resolve(model))
    }

    /// Builds the state from a model and its resolution (`visibility::resolve(model)`).
    pub fn build(model: &Model, resolution: &Resolved) -> Self {
        Snapshot {
            services: Arc::new(ServiceStore::new(build::services(model, resolution))),
            workloads: WorkloadStore::new(
                model.workloads.clone(),
                model.pods_elsewhere.clone(),
                &resolution.discovery,
            ),
            cluster_domain: model.cluster_domain.clone(),
            visibility: model.mesh.service_entry_visibility.clone(),
            discovery_selectors: model.mesh.discovery_selectors.clone(),
        }
    }

    /// This snapshot's services with the workloads `model` holds: for a change to Pods alone, none
    /// in a namespace a selector picks Pods in (no service changes then). Everything else is
    /// `model`'s, as [`Snapshot::build`] would make it.
    pub fn with_pods(&self, model: &Model) -> Self {
        let discovery = visibility::Discovery::of(model);
        Snapshot {
            services: self.services.clone(),
            workloads: WorkloadStore::new(
                model.workloads.clone(),
                model.pods_elsewhere.clone(),
                &discovery,
            ),
            cluster_domain: model.cluster_domain.clone(),
            visibility: model.mesh.service_entry_visibility.clone(),
            discovery_selectors: model.mesh.discovery_selectors.clone(),
        }
    }

    /// Whether `other` holds these very services (shared, as [`Snapshot::with_pods`] leaves them).
    pub fn same_services(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.services, &other.services)
    }

    /// The client behind a connection's peer IP; `None` (unknown: PUBLIC services only) when no
    /// workload, or more than one, has that IP.
    pub fn workload_by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.workloads.client(ip)
    }

    /// The address a client's budget share is kept under: the first address of the workload that
    /// holds `ip`, whichever of its addresses it came from (a dual-stack pod is one client, not
    /// two), and `ip` itself when no single workload holds it.
    pub fn budget_key(&self, ip: IpAddr) -> IpAddr {
        let ip = ip.to_canonical();
        self.workload_by_ip(ip)
            .and_then(|w| w.ips.first().copied())
            .unwrap_or(ip)
    }

    /// Every service in rank order.
    pub fn services(&self) -> impl Iterator<Item = &Service> {
        self.services.services.iter()
    }

    /// Every workload, clients of undiscovered namespaces included.
    pub fn workloads(&self) -> &[std::sync::Arc<Workload>] {
        &self.workloads.workloads
    }

    /// The addresses at which a connection reaches a workload directly (the lookup's third step).
    pub fn workload_destinations(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.workloads.destinations()
    }

    pub fn cluster_domain(&self) -> &str {
        &self.cluster_domain
    }
}

#[cfg(test)]
mod tests;
