//! Keeping the configuration in force current: load, resolve and build off the async workers, swap
//! the snapshot whole, and refuse a bad change without touching what runs.
use std::{path::PathBuf, sync::Arc};

use tracing::{error, info, warn};

use crate::{
    config::{self, ConfigErrors},
    live::LiveState,
    metrics::{Metrics, ReloadResult},
    state::Snapshot,
    watch::DirWatch,
};

/// Loads `dir` into a snapshot: config -> visibility -> state, the same path `redirect explain` takes.
pub fn load(dir: &std::path::Path) -> Result<Snapshot, ConfigErrors> {
    let model = config::load_dir(dir)?;
    Ok(Snapshot::from_model(&model))
}

/// Applies `dir` once. Returns whether it was good.
pub async fn apply(dir: PathBuf, live: &LiveState, metrics: &Metrics) -> bool {
    let shown = dir.display().to_string();
    // Building 10,000 entries takes tens of milliseconds: not on a proxy worker.
    match tokio::task::spawn_blocking(move || load(&dir)).await {
        Ok(Ok(snapshot)) => {
            let services = snapshot.services().count();
            let workloads = snapshot.workloads().len();
            live.apply(snapshot);
            metrics.reload(ReloadResult::Ok);
            info!(dir = %shown, services, workloads, "configuration applied");
            true
        }
        Ok(Err(errors)) => {
            for e in errors.iter() {
                error!(
                    file = %e.file,
                    object = e.object.as_deref().unwrap_or("-"),
                    field = e.field.as_deref().unwrap_or("-"),
                    "{}",
                    e.message
                );
            }
            warn!(dir = %shown, errors = errors.len(), "configuration refused; the last good configuration stays in force");
            live.refuse(&errors);
            metrics.reload(ReloadResult::Failed);
            false
        }
        Err(join) => {
            error!(dir = %shown, error = %join, "loading the configuration panicked; the last good configuration stays in force");
            metrics.reload(ReloadResult::Failed);
            false
        }
    }
}

/// Applies `dir` now, then again after every change in a task of its own.
pub async fn start(
    dir: PathBuf,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    // Watch before the first load: a change made while it loads is not missed.
    let mut watch = DirWatch::new(&dir);
    apply(dir.clone(), &live, &metrics).await;
    tokio::spawn(async move {
        loop {
            watch.changed().await;
            apply(dir.clone(), &live, &metrics).await;
        }
    })
}
