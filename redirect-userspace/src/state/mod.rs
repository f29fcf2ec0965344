//! The per-node data-plane state: services indexed by exact VIP, CIDR and host name, workloads by
//! IP, and the lookups the proxy, the DNS proxy and `redirect explain` all call.
//!
//! A [`Snapshot`] is built once per configuration and never changes (but for round-robin counters);
//! hold it in an `Arc` and swap the whole `Arc` on reload. NONE entries never enter it.
//!
//! A snapshot has two halves that read different parts of the model, so a change to one part
//! builds one half again and shares the other with the snapshot before (`Arc`):
//! - **the workloads** (clients by IP, workload addresses): the Pods of this node, the
//!   WorkloadEntries, the other nodes' Pods (those a selector of their namespace may pick held as
//!   workloads, the rest as addresses only), and which namespaces are discovered (the Namespaces'
//!   labels, the mesh config's `discoverySelectors`). Nothing of a ServiceEntry, Service or
//!   EndpointSlice, but through the namespaces where a selector picks Pods;
//! - **the services**: the ServiceEntries and their resolution (visibility, addresses, shadowing),
//!   the Services and EndpointSlices, and the workloads a selector picks as endpoints.
//!
//! [`Snapshot::with_pods`] keeps the services (a change to Pods no selector picks);
//! [`Snapshot::with_services`] keeps the workloads (a change that touches none of what they read);
//! [`Snapshot::with_entries`] keeps the workloads and every service but those of a few
//! ServiceEntries, each resolved on its own (`visibility::stands_alone`). Each gives what
//! [`Snapshot::build`] gives the same model; the property test of `cluster` holds them to it. A
//! service kept is the same object, its round-robin position included.
mod bucket;
mod build;
mod dns;
mod dump;
mod outbound;
mod service;
mod store;
mod workload;

use std::{collections::HashSet, net::IpAddr, sync::Arc};

pub(crate) use dns::DnsDecision;
#[cfg(test)]
pub(crate) use dns::SearchDomains;
pub(crate) use dump::ConfigDump;
pub(crate) use outbound::{NoUpstreamReason, Outbound, OutboundDecision, PassthroughReason};
pub use outbound::{OutboundOutcome, Pick};
pub(crate) use service::{Endpoint, Port, Service, ServiceKind, ServiceVisibility, Target};
pub(crate) use workload::{TelemetryName, WorkloadName};

use crate::{
    authz::NodePolicies,
    config::{
        DEFAULT_CLUSTER_DOMAIN, LabelSelector, Model, ServiceEntry, VisibilityConfig, Workload,
        WorkloadKind,
    },
    visibility::{self, Resolved, ResolvedEntry},
};
use store::ServiceStore;
use workload::WorkloadStore;

/// Every service of `model`, indexed.
fn services(model: &Model, resolution: &Resolved) -> Arc<ServiceStore> {
    Arc::new(ServiceStore::new(build::services(model, resolution)))
}

#[derive(Debug)]
pub struct Snapshot {
    /// Shared with the snapshot a change to Pods alone was built from (see [`Snapshot::with_pods`]).
    services: Arc<ServiceStore>,
    /// Shared with the snapshot a change to services alone was built from (see
    /// [`Snapshot::with_services`]).
    workloads: Arc<WorkloadStore>,
    cluster_domain: String,
    /// The visibility configuration in force, for dumps.
    visibility: Option<VisibilityConfig>,
    /// The mesh config's `discoverySelectors`, for dumps.
    discovery_selectors: Vec<LabelSelector>,
    /// The mesh config's `trustDomain`, when it names one.
    trust_domain: Option<String>,
    /// The authorization policies that apply to each Pod of the node.
    authz: Arc<NodePolicies>,
}

impl Default for Snapshot {
    /// An empty state: every connection passes through, every query is forwarded.
    fn default() -> Self {
        Snapshot {
            services: Arc::default(),
            workloads: Arc::default(),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.to_string(),
            visibility: None,
            discovery_selectors: Vec::new(),
            trust_domain: None,
            authz: Arc::default(),
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
        let workloads = WorkloadStore::new(
            model.workloads.clone(),
            model.pods_elsewhere.clone(),
            &resolution.discovery,
            &model.namespaces,
            model.hbone_node.as_deref(),
        );
        Self::of(model, services(model, resolution), Arc::new(workloads))
    }

    /// This snapshot's services with the workloads `model` holds: for a change to Pods alone, none
    /// in a namespace a selector picks Pods in (no service changes then). Everything else is
    /// `model`'s, as [`Snapshot::build`] would make it.
    pub fn with_pods(&self, model: &Model) -> Self {
        let discovery = visibility::Discovery::of(model);
        let workloads = WorkloadStore::new(
            model.workloads.clone(),
            model.pods_elsewhere.clone(),
            &discovery,
            &model.namespaces,
            model.hbone_node.as_deref(),
        );
        Self::of(model, self.services.clone(), Arc::new(workloads))
    }

    /// This snapshot's workloads with the services of `model` and its resolution: for a change that
    /// touches no Pod, WorkloadEntry, Namespace or mesh config and leaves the namespaces where a
    /// selector picks Pods as they were (the workloads read nothing else, see the module docs).
    pub fn with_services(&self, model: &Model, resolution: &Resolved) -> Self {
        Self::of(model, services(model, resolution), self.workloads.clone())
    }

    /// This snapshot's workloads, and its services but those of the ServiceEntries `changed`
    /// (`(namespace, name)`): theirs are built from `entries`, the versions of `model` (a deleted one
    /// is missing), each with its resolution in `resolved`. For a change to these entries alone,
    /// each of them standing alone in both versions (`visibility::stands_alone`): then no other
    /// entry's resolution, so no other service, changes. As [`Snapshot::with_services`], the
    /// workloads must read nothing that changed.
    pub fn with_entries(
        &self,
        model: &Model,
        changed: &HashSet<(&str, &str)>,
        entries: &[&ServiceEntry],
        resolved: &[ResolvedEntry],
    ) -> Self {
        let mut fresh = build::entry_services(model, entries.iter().copied().zip(resolved));
        build::sort(&mut fresh);
        let kept = self.services.services.iter().filter(|s| {
            s.kind != ServiceKind::ServiceEntry
                || !changed.contains(&(s.namespace.as_str(), s.name.as_str()))
        });
        // Both in rank order: merged, not sorted again.
        let mut merged = Vec::with_capacity(self.services.services.len() + fresh.len());
        let mut fresh = fresh.into_iter().peekable();
        for kept in kept {
            while let Some(next) = fresh.next_if(|f| f.rank_key() < kept.rank_key()) {
                merged.push(next);
            }
            merged.push(kept.clone());
        }
        merged.extend(fresh);
        Self::of(
            model,
            Arc::new(ServiceStore::new(merged)),
            self.workloads.clone(),
        )
    }

    fn of(model: &Model, services: Arc<ServiceStore>, workloads: Arc<WorkloadStore>) -> Self {
        let authz = Arc::new(NodePolicies::build(model, workloads.local_pods()));
        Snapshot {
            authz,
            services,
            workloads,
            cluster_domain: model.cluster_domain.clone(),
            visibility: model.mesh.service_entry_visibility.clone(),
            discovery_selectors: model.mesh.discovery_selectors.clone(),
            trust_domain: model.mesh.trust_domain.clone(),
        }
    }

    /// The authorization policies that apply to each Pod of the node.
    pub(crate) fn authz(&self) -> &NodePolicies {
        &self.authz
    }

    /// The mesh config's `trustDomain`, when it names one.
    pub fn trust_domain(&self) -> Option<&str> {
        self.trust_domain.as_deref()
    }

    /// Whether `other` holds these very services (shared, as [`Snapshot::with_pods`] leaves them).
    pub fn same_services(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.services, &other.services)
    }

    /// The positions (the fast path's service ids) whose service is not the very one `before`
    /// holds there, when every other service kept its place: an entry edited in place, or added
    /// or removed at the end of the rank order. `None` when more than `most` differ (services
    /// moved: one was added or removed before others).
    pub fn services_changed_in_place(&self, before: &Snapshot, most: usize) -> Option<Vec<u32>> {
        let (old, new) = (&before.services.services, &self.services.services);
        let common = old.len().min(new.len());
        let mut changed = Vec::new();
        for (i, (a, b)) in old.iter().zip(new.iter()).enumerate() {
            if !Arc::ptr_eq(a, b) {
                changed.push(i as u32);
                if changed.len() > most {
                    return None;
                }
            }
        }
        let longest = old.len().max(new.len());
        changed.extend((common..longest).map(|i| i as u32));
        (changed.len() <= most).then_some(changed)
    }

    /// Whether `other` holds these very workloads (shared, as [`Snapshot::with_services`] and
    /// [`Snapshot::with_entries`] leave them).
    pub fn same_workloads(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.workloads, &other.workloads)
    }

    /// Whether `other` has authorization policies on the very same addresses of this node's Pods
    /// (what the fast path's workload table reads of them).
    pub(crate) fn same_guards(&self, other: &Snapshot) -> bool {
        self.authz.same_guards(&other.authz)
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
        self.services.services.iter().map(|s| &**s)
    }

    /// Every workload, clients of undiscovered namespaces included.
    pub fn workloads(&self) -> &[std::sync::Arc<Workload>] {
        &self.workloads.workloads
    }

    /// The addresses at which a connection reaches a workload directly (the lookup's third step).
    pub fn workload_destinations(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.workloads.destinations()
    }

    /// With HBONE between nodes, the namespace of the Pod of another node at `ip`: a connection
    /// there goes over HBONE to `ip` on port 15008.
    pub fn hbone_peer(&self, ip: IpAddr) -> Option<&str> {
        self.workloads.hbone_peer(ip.to_canonical())
    }

    /// Whether HBONE between nodes is on: the agent receives HBONE for its Pods, and answers to
    /// its sockets bound to a Pod's address are brought back to it.
    pub fn hbone_between_nodes(&self) -> bool {
        self.workloads.hbone_between_nodes()
    }

    /// With HBONE between nodes, whether `ip` is the address of a Pod of another node, in the
    /// mesh or not: a stream received from it keeps it as its source.
    pub fn other_nodes_pod(&self, ip: IpAddr) -> bool {
        self.workloads.other_nodes_pod(ip.to_canonical()).is_some()
    }

    /// Whether `w` is a Pod in the ambient mesh: its connections to the mesh's Pods of other nodes
    /// go over HBONE.
    pub fn enrolled(&self, w: &Workload) -> bool {
        self.workloads.enrolled(w)
    }

    /// The Pod of this node at `ip` that receives HBONE, with its service account.
    pub fn local_pod(&self, ip: IpAddr) -> Option<&Workload> {
        self.workloads.local_pod(ip.to_canonical())
    }

    /// The Pods of this node the agent has found on it.
    pub(crate) fn local_pods(&self) -> impl Iterator<Item = &Workload> + '_ {
        self.workloads.local_pods()
    }

    /// The addresses of the Pods of this node that receive HBONE.
    pub fn local_pod_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.workloads.local_pod_addresses()
    }

    pub fn cluster_domain(&self) -> &str {
        &self.cluster_domain
    }

    /// The one workload at `ip` (of any node or namespace) as Istio's telemetry names it.
    pub(crate) fn telemetry_at(&self, ip: IpAddr) -> Option<TelemetryName<'_>> {
        self.workloads.telemetry_at(ip.to_canonical())
    }

    /// The workload of that namespace and name, a Pod before a WorkloadEntry.
    pub(crate) fn workload_named(&self, namespace: &str, name: &str) -> Option<&Workload> {
        let named = |w: &&Arc<Workload>| w.meta.namespace == namespace && w.meta.name == name;
        let mut found = self.workloads.workloads.iter().filter(named);
        let first = found.next()?;
        Some(match first.kind {
            WorkloadKind::Pod => first,
            WorkloadKind::WorkloadEntry => {
                found.find(|w| w.kind == WorkloadKind::Pod).unwrap_or(first)
            }
        })
    }
}

#[cfg(test)]
mod tests;
