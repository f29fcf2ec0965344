//! The state in force on this node: the snapshot the proxy and the DNS proxy read, swapped whole on
//! every good reload, and what the last reload said.
use std::{
    path::PathBuf,
    sync::{Arc, Mutex, OnceLock},
};

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::lock::Locked;
use crate::{
    audit::Audit,
    clock::now_rfc3339,
    config::{ConfigError, Rejected},
    state::Snapshot,
};

/// Readers take one cheap guard per decision and never block a reload, nor a reload them.
pub(crate) struct LiveState {
    snapshot: ArcSwap<Snapshot>,
    status: Mutex<ConfigStatus>,
    /// Called with each new snapshot before the status counts it as applied (the fast path's
    /// tables): whoever sees the new generation sees it in force everywhere.
    /// Run with every snapshot applied, in order.
    on_apply: std::sync::RwLock<Vec<OnApply>>,
    /// With `--write-status`: what the status writer reports.
    status_writer: OnceLock<Arc<Mutex<crate::status::Report>>>,
    /// Whether a configuration is in force: set once the source gave its first (at once without
    /// a source), for whoever waits on it ([`LiveState::in_force`]).
    in_force: tokio::sync::watch::Sender<bool>,
    /// Counts the snapshots applied, for whoever follows each ([`LiveState::applied`]).
    applied: tokio::sync::watch::Sender<u64>,
    /// With `--audit-mesh-config`: the policy audited beside the one in force.
    audit: OnceLock<Arc<Audit>>,
}

type OnApply = Box<dyn Fn(&Arc<Snapshot>) + Send + Sync>;

/// What `/config_dump` reports about the configuration itself.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ConfigStatus {
    /// The directory the agent loads (None: running without configuration, everything passes through).
    pub source: Option<PathBuf>,
    /// Good configurations applied since start.
    pub generation: u64,
    /// When the configuration in force was applied (RFC 3339).
    pub applied_at: Option<String>,
    /// The errors of the last load: objects left out (their last good version kept where there was
    /// one), entries the address pool could not serve, or a directory that could not be read at all.
    /// Null once a load is clean.
    pub last_error: Option<ConfigErrorReport>,
    /// The objects in error now, one per object (`File` for a file not read to its end).
    pub rejected: Vec<Rejected>,
    /// With the Kubernetes API as the source: the state of each watch.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub watches: Vec<WatchStatus>,
    /// With `--write-status`: the lease, whether this agent writes, its writes, and the entries
    /// another controller writes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_writer: Option<crate::status::Report>,
}

/// One watch on the Kubernetes API, as `/config_dump` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchStatus {
    pub kind: &'static str,
    /// The `apiVersion` watched; `None` until discovered.
    pub api_version: Option<String>,
    /// Listed in full at least once; what it holds is in force.
    pub synced: bool,
    /// False while the API does not serve this kind (its CRD is not installed).
    pub installed: bool,
    /// Objects held now.
    pub objects: usize,
    /// When an object last changed (RFC 3339).
    pub last_event_at: Option<String>,
    /// The last failure, cleared by the next successful list.
    pub last_error: Option<String>,
    pub last_error_at: Option<String>,
    /// Failures since start.
    pub errors: u64,
}

impl WatchStatus {
    /// A full list came in: what it holds is in force, and the last failure is over.
    pub fn listed(&mut self) {
        self.synced = true;
        self.installed = true;
        self.last_error = None;
        self.last_error_at = None;
    }

    /// The API does not serve this kind: nothing to wait for, nothing held.
    pub fn not_installed(&mut self) {
        self.installed = false;
        self.synced = true;
        self.api_version = None;
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ConfigErrorReport {
    pub at: String,
    pub errors: Vec<ConfigError>,
}

impl LiveState {
    /// An empty state: nothing claimed, every connection passes through, every query is forwarded.
    pub(crate) fn new(source: Option<PathBuf>) -> Arc<Self> {
        Arc::new(LiveState {
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            in_force: tokio::sync::watch::Sender::new(source.is_none()),
            applied: tokio::sync::watch::Sender::new(0),
            status: Mutex::new(ConfigStatus {
                source,
                ..ConfigStatus::default()
            }),
            on_apply: std::sync::RwLock::new(Vec::new()),
            status_writer: OnceLock::new(),
            audit: OnceLock::new(),
        })
    }

    /// Audits every decision against `audit`'s policy from now on (once; a second call is ignored).
    pub(crate) fn set_audit(&self, audit: Arc<Audit>) {
        let _ = self.audit.set(audit);
    }

    /// The audit, with `--audit-mesh-config`.
    pub(crate) fn audit(&self) -> Option<&Arc<Audit>> {
        self.audit.get()
    }

    pub(crate) fn snapshot(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.snapshot.load()
    }

    /// The snapshot in force, owned: for a task that holds it across an await.
    pub(crate) fn snapshot_arc(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Puts a configuration in force: everything valid, and the last good version of what was
    /// not; `errors` and `rejected` say what was left out.
    pub(crate) fn apply(
        &self,
        snapshot: Snapshot,
        errors: Vec<ConfigError>,
        rejected: Vec<Rejected>,
    ) {
        let snapshot = Arc::new(snapshot);
        self.snapshot.store(snapshot.clone());
        let hooks = match self.on_apply.read() {
            Ok(hooks) => hooks,
            Err(poisoned) => poisoned.into_inner(),
        };
        for hook in hooks.iter() {
            hook(&snapshot);
        }
        drop(hooks);
        let now = now_rfc3339();
        let mut status = self.status();
        status.generation += 1;
        status.last_error = (!errors.is_empty()).then(|| ConfigErrorReport {
            at: now.clone(),
            errors,
        });
        status.applied_at = Some(now);
        status.rejected = rejected;
        drop(status);
        self.in_force.send_replace(true);
        self.applied.send_modify(|n| *n += 1);
    }

    /// Told of every snapshot applied from now on (a reader that falls behind sees the last).
    pub(crate) fn applied(&self) -> tokio::sync::watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// Returns once a configuration is in force (at once if one is).
    pub(crate) async fn in_force(&self) {
        let mut in_force = self.in_force.subscribe();
        // The sender lives as long as `self`: this cannot fail while it is borrowed.
        let _ = in_force.wait_for(|yes| *yes).await;
    }

    /// Adds what runs with every snapshot applied from now on, after what was added before.
    pub(crate) fn on_apply(&self, f: impl Fn(&Arc<Snapshot>) + Send + Sync + 'static) {
        self.hooks().push(Box::new(f));
    }

    /// As [`LiveState::on_apply`], but before everything added before: what must be in force
    /// before the others act on a snapshot (inbound authorization's table, before the fast path
    /// lets connections to a newly guarded Pod go straight to it).
    pub(crate) fn on_apply_first(&self, f: impl Fn(&Arc<Snapshot>) + Send + Sync + 'static) {
        self.hooks().insert(0, Box::new(f));
    }

    fn hooks(&self) -> std::sync::RwLockWriteGuard<'_, Vec<OnApply>> {
        match self.on_apply.write() {
            Ok(hooks) => hooks,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Records a load that applied nothing (the directory could not be read); what is in force stays.
    pub(crate) fn refuse(&self, errors: Vec<ConfigError>) {
        let report = ConfigErrorReport {
            at: now_rfc3339(),
            errors,
        };
        self.status().last_error = Some(report);
    }

    /// Records the state of the Kubernetes API watches.
    pub(crate) fn set_watches(&self, watches: Vec<WatchStatus>) {
        self.status().watches = watches;
    }

    /// Shows the status writer's report in [`LiveState::status_report`] (once).
    pub(crate) fn set_status_writer(&self, report: Arc<Mutex<crate::status::Report>>) {
        let _ = self.status_writer.set(report);
    }

    pub(crate) fn status_report(&self) -> ConfigStatus {
        let mut status = self.status().clone();
        status.status_writer = self.status_writer.get().map(|r| r.locked().clone());
        status
    }

    /// True once a configuration is in force (or none is expected).
    pub(crate) fn has_config(&self) -> bool {
        *self.in_force.borrow()
    }

    fn status(&self) -> std::sync::MutexGuard<'_, ConfigStatus> {
        // A panic while holding this lock leaves plain data behind: keep serving it.
        self.status.locked()
    }
}

impl std::fmt::Debug for LiveState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveState")
            .field("snapshot", &self.snapshot)
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

/// Hands the allocator's free pages back to the kernel; called once a new state is in force. A
/// build allocates the new model and state beside the old ones and frees the old ones between
/// objects that stay, so glibc's arenas would keep the high-water mark of two states (about twice
/// what the agent needs) without it. Takes a few milliseconds for 10,000 entries: run it on the
/// blocking pool.
pub(crate) fn release_free_memory() {
    // SAFETY: malloc_trim only returns free pages to the kernel; it takes no pointer.
    unsafe {
        libc::malloc_trim(0);
    }
}
