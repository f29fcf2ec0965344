//! What changed in what is served, sorted by what a snapshot must build again for it.
use std::collections::HashSet;

use super::Key;

/// What changed in what is served, since [`super::Store::take_changes`] last said, sorted by what a
/// snapshot must build again for it (see `cluster::follow`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// What the workloads, or every service, may depend on: Namespaces, WorkloadEntries, the mesh
    /// config, or Pods listed again (not told one by one).
    pub others: bool,
    /// The namespaces of the Pods (of this node or another) added, changed or deleted.
    pub pods: std::collections::BTreeSet<String>,
    /// Services or EndpointSlices added, changed, deleted or listed again, or ServiceEntries listed
    /// again: services change, not told entry by entry.
    pub services: bool,
    /// The ServiceEntries added, changed or deleted one by one.
    pub entries: std::collections::BTreeSet<Key>,
    /// AuthorizationPolicies or PeerAuthentications added, changed, deleted or listed again: read
    /// by neither half of a snapshot, only by its policies, which every snapshot builds anew.
    pub policies: bool,
}

impl Changes {
    pub fn any(&self) -> bool {
        self.others
            || !self.pods.is_empty()
            || self.services
            || !self.entries.is_empty()
            || self.policies
    }

    /// Whether these changes leave every service as it was: only Pods changed, none in a
    /// namespace where a selector picks Pods (`selecting`), or only policies. Then the snapshot's
    /// services can be kept and only its clients and workload addresses built again.
    pub fn only_pods(&self, selecting: &HashSet<&str>) -> bool {
        !self.others
            && !self.services
            && self.entries.is_empty()
            && !self.pods.iter().any(|ns| selecting.contains(ns.as_str()))
    }

    /// Whether no Pod, WorkloadEntry, Namespace or mesh config changed: the workloads stay as they
    /// were unless the namespaces where a selector picks Pods changed (the caller's to compare).
    pub fn keeps_workloads(&self) -> bool {
        !self.others && self.pods.is_empty()
    }

    /// The ServiceEntries changed, when nothing else did.
    pub fn only_entries(&self) -> Option<&std::collections::BTreeSet<Key>> {
        (self.keeps_workloads() && !self.services && !self.entries.is_empty())
            .then_some(&self.entries)
    }
}
