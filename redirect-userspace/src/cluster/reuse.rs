//! What a burst's snapshot keeps of the one in force, from what changed, and building it.
//!
//! What each half of a snapshot reads is in `state`'s module docs; here, what a change may touch:
//! - Pods alone, none in a namespace where a selector picks Pods: no service reads them, the
//!   services are kept ([`Reuse::Services`]); so too for security policies alone, which neither
//!   half reads (every snapshot finds anew which apply to each Pod of the node);
//! - no Pod, WorkloadEntry, Namespace or mesh config, and the namespaces where a selector picks
//!   Pods as they were: the workloads read nothing that changed and are kept; the services are
//!   built again ([`Reuse::Workloads`]), every entry resolved again;
//! - of those, ServiceEntries alone, a few, each standing alone in its version before and after
//!   (`visibility::stands_alone`: no allocated or pool address, no host shared in its namespace):
//!   no other entry's resolution changes, so every other service is kept and only these entries
//!   are resolved and their services built ([`Reuse::Entries`]). The address pool's errors of the
//!   last whole resolution stay true, and every other entry's status conditions too.
//!
//! Anything else builds the snapshot whole.
use std::{
    collections::{BTreeSet, HashSet},
    sync::Arc,
};

use super::{Changes, store::Key};
use crate::{
    config::{ConfigError, Model, ServiceEntry},
    pipeline,
    state::Snapshot,
    status,
    visibility::ResolvedEntry,
};

/// What the snapshot in force was built from, for the next burst to build on.
#[derive(Debug)]
pub(super) struct InForce {
    /// Its model's ServiceEntries: the versions a change replaces.
    pub(super) entries: Vec<Arc<ServiceEntry>>,
    /// The namespaces where a selector picked Pods: which Pods of other nodes are workloads.
    pub(super) selecting: HashSet<String>,
    /// The allocation's errors of the last whole resolution, which the snapshots built on it keep.
    pub(super) allocation: Vec<ConfigError>,
}

/// What a burst's snapshot keeps of the one in force, from what changed (see `state`'s module
/// docs for what each half of a snapshot reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Reuse {
    /// Nothing: resolved and built whole.
    Nothing,
    /// The services: only Pods changed, none in a namespace where a selector picks Pods (or only
    /// security policies).
    Services,
    /// The workloads: nothing they read changed (no Pod, WorkloadEntry, Namespace or mesh config,
    /// and the same namespaces where a selector picks Pods). The services are built whole.
    Workloads,
    /// The workloads, and the services of every ServiceEntry but these, the only objects changed
    /// (when each stands alone, else as [`Reuse::Workloads`]).
    Entries(BTreeSet<Key>),
}

impl Reuse {
    pub(super) fn of(
        changes: Changes,
        selecting: &HashSet<&str>,
        in_force: Option<&InForce>,
    ) -> Reuse {
        let Some(in_force) = in_force else {
            return Reuse::Nothing;
        };
        if changes.only_pods(selecting) {
            return Reuse::Services;
        }
        let same_selecting = in_force.selecting.len() == selecting.len()
            && selecting.iter().all(|ns| in_force.selecting.contains(*ns));
        if !changes.keeps_workloads() || !same_selecting {
            return Reuse::Nothing;
        }
        match changes.only_entries() {
            Some(_) => Reuse::Entries(changes.entries),
            None => Reuse::Workloads,
        }
    }
}

/// A burst's snapshot, and what the next one and the status writer need of it.
pub(super) struct Next {
    pub(super) snapshot: Snapshot,
    /// What [`Reuse`] it was built with, in the end (for the log).
    pub(super) kept: &'static str,
    /// Every error to report: the loader's, then the allocation's.
    pub(super) errors: Vec<ConfigError>,
    /// The allocation's errors.
    pub(super) allocation: Vec<ConfigError>,
    pub(super) resolved: Resolution,
}

/// The resolution a snapshot was built with, as far as it was worked out again.
pub(super) enum Resolution {
    /// Every entry of the model, in its order.
    Whole(Vec<ResolvedEntry>),
    /// These entries alone (the changed ones the model holds, in key order); every other is as
    /// before.
    Entries(BTreeSet<Key>, Vec<ResolvedEntry>),
    /// None: no entry's resolution changed.
    Unchanged,
}

impl Next {
    /// The snapshot for `model` built on `previous`, the one in force, keeping what `reuse` says
    /// (`before`: what `previous` was built from). `errors` are the loader's.
    pub(super) fn build(
        reuse: Reuse,
        previous: &Snapshot,
        before: Option<InForce>,
        model: &Model,
        errors: Vec<ConfigError>,
    ) -> Next {
        let loaded = errors.len();
        // Built without resolving every entry again: the address pool's errors of the last whole
        // resolution still hold.
        let kept_allocation = |snapshot, kept, resolved, before: &InForce| {
            let mut errors = errors.clone();
            errors.extend(before.allocation.iter().cloned());
            Next {
                snapshot,
                kept,
                errors,
                allocation: before.allocation.clone(),
                resolved,
            }
        };
        let (built, kept) = match (reuse, &before) {
            (Reuse::Services, Some(before)) => {
                let snapshot = previous.with_pods(model);
                return kept_allocation(snapshot, "services", Resolution::Unchanged, before);
            }
            (Reuse::Entries(changed), Some(before)) => {
                match pipeline::with_entries(previous, &before.entries, model, &changed) {
                    Some((snapshot, resolved)) => {
                        let kept = "workloads and other entries' services";
                        let resolved = Resolution::Entries(changed, resolved);
                        return kept_allocation(snapshot, kept, resolved, before);
                    }
                    None => (
                        pipeline::with_services(previous, model, errors),
                        "workloads",
                    ),
                }
            }
            (Reuse::Workloads, Some(_)) => (
                pipeline::with_services(previous, model, errors),
                "workloads",
            ),
            _ => (pipeline::build(model, errors), "nothing"),
        };
        // Resolved whole: the loader's errors, then the allocation's.
        Next {
            snapshot: built.snapshot,
            kept,
            allocation: built.errors.get(loaded..).unwrap_or_default().to_vec(),
            errors: built.errors,
            resolved: Resolution::Whole(built.resolution.entries),
        }
    }
}

impl Resolution {
    /// Whether an entry's status conditions may have changed.
    pub(super) fn changes_status(&self) -> bool {
        !matches!(self, Resolution::Unchanged)
    }

    /// Each entry's conditions, from those told before (`desired`, in the model's order).
    pub(super) fn desired(self, desired: &Arc<Vec<status::Desired>>) -> Arc<Vec<status::Desired>> {
        let one = |e: ResolvedEntry| status::Desired {
            namespace: e.namespace,
            name: e.name,
            conditions: e.conditions,
        };
        match self {
            Resolution::Whole(entries) => Arc::new(entries.into_iter().map(one).collect()),
            Resolution::Unchanged => desired.clone(),
            Resolution::Entries(changed, resolved) => {
                let changed: HashSet<(&str, &str)> = changed
                    .iter()
                    .map(|(ns, name)| (ns.as_str(), name.as_str()))
                    .collect();
                // Both in `namespace/name` order: the changed ones merged in.
                let mut fresh = resolved.into_iter().map(one).peekable();
                let mut out = Vec::with_capacity(desired.len() + changed.len());
                let unchanged = desired
                    .iter()
                    .filter(|d| !changed.contains(&(d.namespace.as_str(), d.name.as_str())));
                for d in unchanged {
                    while let Some(f) =
                        fresh.next_if(|f| (&f.namespace, &f.name) < (&d.namespace, &d.name))
                    {
                        out.push(f);
                    }
                    out.push(d.clone());
                }
                out.extend(fresh);
                Arc::new(out)
            }
        }
    }
}
