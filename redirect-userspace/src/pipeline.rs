//! The one way a model becomes the state in force, whatever it came from (a directory, the
//! Kubernetes API, the offline commands): resolve visibility, add what the address pool could not
//! serve to the errors, build the snapshot; then put it in force, log it, count it and give the
//! memory the old one held back to the system.
//!
//! A source that knows what changed (the Kubernetes API) may instead build the new snapshot from
//! the one in force, keeping what the change cannot touch: [`with_services`] keeps the workloads,
//! [`with_entries`] the workloads and every other entry's services (see `state`'s module docs for
//! what each half reads).
use std::{
    collections::{BTreeSet, HashSet},
    sync::Arc,
};

use tracing::{error, info, warn};

use crate::{
    config::{self, ConfigError, Model, Rejected, ServiceEntry},
    live::LiveState,
    metrics::{Metrics, ReloadResult},
    state::Snapshot,
    visibility::{self, Resolved, ResolvedEntry},
};

/// Above this many ServiceEntries changed at once, [`with_entries`] does not try: checking each
/// one against its namespace would cost more than resolving every entry again.
pub(crate) const MAX_ENTRIES_ALONE: usize = 64;

/// A model resolved: each entry's visibility and addresses, and every error (the loader's, then
/// the allocation's).
pub(crate) fn resolve(model: &Model, mut errors: Vec<ConfigError>) -> (Resolved, Vec<ConfigError>) {
    let resolution = visibility::resolve(model);
    errors.extend(visibility::allocation_errors(model, &resolution));
    (resolution, errors)
}

/// What one configuration gives.
pub(crate) struct Built {
    pub snapshot: Snapshot,
    pub resolution: Resolved,
    pub errors: Vec<ConfigError>,
}

/// [`resolve`], then the snapshot.
pub(crate) fn build(model: &Model, errors: Vec<ConfigError>) -> Built {
    let (resolution, errors) = resolve(model, errors);
    Built {
        snapshot: Snapshot::build(model, &resolution),
        resolution,
        errors,
    }
}

/// [`build`], the workloads kept from `previous`: for a change that touches none of what they read
/// (see [`Snapshot::with_services`]).
pub(crate) fn with_services(previous: &Snapshot, model: &Model, errors: Vec<ConfigError>) -> Built {
    let (resolution, errors) = resolve(model, errors);
    Built {
        snapshot: previous.with_services(model, &resolution),
        resolution,
        errors,
    }
}

/// `previous` with the services of the ServiceEntries `changed` (`(namespace, name)`) built again
/// from `model`, and the resolution of those `model` holds (in `changed`'s order; a deleted entry
/// has none). `before` is the entries `previous` was built from (sorted, as a model's are). `None`
/// when an entry, in its version before or after, does not stand alone
/// ([`visibility::stands_alone`]): then other entries' resolutions may change too and only a whole
/// resolution tells. The workloads are kept: as for [`with_services`], the change must touch none
/// of what they read.
pub(crate) fn with_entries(
    previous: &Snapshot,
    before: &[Arc<ServiceEntry>],
    model: &Model,
    changed: &BTreeSet<(String, String)>,
) -> Option<(Snapshot, Vec<ResolvedEntry>)> {
    if changed.len() > MAX_ENTRIES_ALONE {
        return None;
    }
    let find = |entries: &[Arc<ServiceEntry>], (ns, name): &(String, String)| {
        let found =
            entries.binary_search_by(|e| (&e.meta.namespace, &e.meta.name).cmp(&(ns, name)));
        found.ok().map(|i| entries[i].clone())
    };
    let mut after = Vec::with_capacity(changed.len());
    for key in changed {
        let old = find(before, key);
        let new = find(&model.service_entries, key);
        let versions = old.iter().chain(new.iter());
        if !versions.clone().all(|e| visibility::stands_alone(model, e)) {
            return None;
        }
        after.extend(new);
    }
    let after: Vec<&ServiceEntry> = after.iter().map(|e| &**e).collect();
    let resolved = visibility::resolve_alone(model, &visibility::Discovery::of(model), &after);
    let keys: HashSet<(&str, &str)> = changed
        .iter()
        .map(|(ns, name)| (ns.as_str(), name.as_str()))
        .collect();
    let snapshot = previous.with_entries(model, &keys, &after, &resolved);
    Some((snapshot, resolved))
}

/// Puts `snapshot` in force (swapped whole), with one log line per error and one for the load,
/// counted under its result. `source` names where the configuration came from in the log.
pub(crate) async fn put_in_force(
    live: &Arc<LiveState>,
    metrics: &Metrics,
    source: &str,
    snapshot: Snapshot,
    errors: Vec<ConfigError>,
    rejected: Vec<Rejected>,
) {
    let services = snapshot.services().count();
    let workloads = snapshot.workloads().len();
    config::log_errors(&errors, "");
    metrics.config.rejected(rejected.iter().map(|r| r.kind));
    let result = if errors.is_empty() {
        info!(source, services, workloads, "configuration applied");
        ReloadResult::Ok
    } else {
        let kept = rejected.iter().filter(|r| r.last_good_in_force).count();
        warn!(
            source,
            services,
            workloads,
            errors = errors.len(),
            rejected = rejected.len(),
            kept_last_good = kept,
            "configuration applied without the objects in error; their last good versions stay in force"
        );
        ReloadResult::Partial
    };
    // Held until the new one counts as in force: the last holder lets go of it off the async
    // workers (what it does not share with the new one may take milliseconds to free).
    let replaced = live.snapshot_arc();
    // Off the async workers: what follows a snapshot in force (the fast path's tables, compiled
    // and written) takes up to a hundred milliseconds at 10,000 entries, which the proxies'
    // connections would wait out. Counted once it is all done, as before.
    let applying = live.clone();
    let applied =
        tokio::task::spawn_blocking(move || applying.apply(snapshot, errors, rejected)).await;
    if let Err(e) = applied {
        error!(error = %e, "putting the configuration in force panicked after the swap");
    }
    metrics.config.reload(result);
    let _ = tokio::task::spawn_blocking(move || {
        drop(replaced);
        crate::live::release_free_memory();
    })
    .await;
}

/// With an audit policy: builds it again for `model`, the configuration just put in force (off the
/// async workers, as the snapshot was).
pub(crate) async fn audit(live: &Arc<LiveState>, model: Model) {
    let Some(audit) = live.audit().cloned() else {
        return;
    };
    let enforced = live.snapshot_arc();
    if let Err(e) = tokio::task::spawn_blocking(move || audit.rebuild(model, enforced)).await {
        error!(error = %e, "building the audit policy panicked; the one before stays");
    }
}
