//! The one way a model becomes the state in force, whatever it came from (a directory, the
//! Kubernetes API, the offline commands): resolve visibility, add what the address pool could not
//! serve to the errors, build the snapshot; then put it in force, log it, count it and give the
//! memory the old one held back to the system.
use tracing::{error, info, warn};

use crate::{
    config::{ConfigError, Model, Rejected},
    live::LiveState,
    metrics::{Metrics, ReloadResult},
    state::Snapshot,
    visibility::{self, Resolved},
};

/// A model resolved: each entry's visibility and addresses, and every error (the loader's, then
/// the allocation's).
pub fn resolve(model: &Model, mut errors: Vec<ConfigError>) -> (Resolved, Vec<ConfigError>) {
    let resolution = visibility::resolve(model);
    errors.extend(visibility::allocation_errors(model, &resolution));
    (resolution, errors)
}

/// What one configuration gives.
pub struct Built {
    pub snapshot: Snapshot,
    pub resolution: Resolved,
    pub errors: Vec<ConfigError>,
}

/// [`resolve`], then the snapshot.
pub fn build(model: &Model, errors: Vec<ConfigError>) -> Built {
    let (resolution, errors) = resolve(model, errors);
    Built {
        snapshot: Snapshot::build(model, &resolution),
        resolution,
        errors,
    }
}

/// Puts `snapshot` in force (swapped whole), with one log line per error and one for the load,
/// counted under its result. `source` names where the configuration came from in the log.
pub async fn put_in_force(
    live: &LiveState,
    metrics: &Metrics,
    source: &str,
    snapshot: Snapshot,
    errors: Vec<ConfigError>,
    rejected: Vec<Rejected>,
) {
    let services = snapshot.services().count();
    let workloads = snapshot.workloads().len();
    log_errors(&errors);
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
    live.apply(snapshot, errors, rejected);
    metrics.config.reload(result);
    let _ = tokio::task::spawn_blocking(crate::live::release_free_memory).await;
}

/// One line per error, naming file, object and field (each already bounded in length).
pub fn log_errors(errors: &[ConfigError]) {
    for e in errors {
        error!(
            file = %e.file,
            object = e.object.as_deref().unwrap_or("-"),
            field = e.field.as_deref().unwrap_or("-"),
            "{}",
            e.message
        );
    }
}
