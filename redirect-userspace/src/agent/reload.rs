//! Keeping the configuration in force current: load, resolve and build off the async workers, and
//! swap the snapshot whole. One object in error never holds back the rest: it is left out, or kept
//! at its last good version, and reported until fixed.
use std::{path::PathBuf, sync::Arc};

use tracing::{error, warn};

use crate::{
    config::{self, ConfigError, Limits, Model, Rejected},
    live::LiveState,
    metrics::{Metrics, ReloadResult},
    pipeline,
    state::Snapshot,
};

use super::dir_watch::DirWatch;

/// Loads a directory again and again, remembering the last version in force of every object.
pub(super) struct Reloader {
    dir: PathBuf,
    limits: Limits,
    /// The model in force: where the last good version of an object in error comes from.
    in_force: Option<Model>,
    /// With HBONE between nodes, the node served (every model says so).
    hbone_node: Option<String>,
}

/// What one load gave: the state to put in force and what was in error.
pub(super) struct Loaded {
    pub snapshot: Snapshot,
    pub errors: Vec<ConfigError>,
    pub rejected: Vec<Rejected>,
}

impl Reloader {
    pub(super) fn new(dir: PathBuf, limits: Limits, hbone_node: Option<String>) -> Self {
        Reloader {
            dir,
            limits,
            in_force: None,
            hbone_node,
        }
    }

    /// config -> visibility -> state, the same path `redirect explain` takes, with the last good
    /// version of each object in error put back. `Err`: nothing could be read at all.
    pub(super) fn load(&mut self) -> Result<Loaded, Vec<ConfigError>> {
        let mut loaded = config::read_dir(&self.dir, &self.limits);
        if loaded.unreadable {
            return Err(loaded.errors);
        }
        if let Some(previous) = &self.in_force {
            config::keep_last_good(&mut loaded, previous);
        }
        loaded.model.hbone_node = self.hbone_node.clone();
        let built = pipeline::build(&loaded.model, loaded.errors);
        self.in_force = Some(loaded.model);
        Ok(Loaded {
            snapshot: built.snapshot,
            errors: built.errors,
            rejected: loaded.rejected,
        })
    }
}

/// Applies the directory once more. Returns whether anything was applied.
pub(super) async fn apply(
    reloader: &mut Option<Reloader>,
    live: &Arc<LiveState>,
    metrics: &Metrics,
) -> bool {
    let Some(mut owned) = reloader.take() else {
        return false;
    };
    let shown = owned.dir.display().to_string();
    // Building 10,000 entries takes tens of milliseconds: not on a proxy worker.
    let joined = tokio::task::spawn_blocking(move || {
        let result = owned.load();
        (owned, result)
    })
    .await;
    let (owned, result) = match joined {
        Ok(done) => done,
        Err(join) => {
            // The reloader went down with the panic; the next change starts from what runs now
            // (objects in error then have no last good version to fall back on).
            error!(dir = %shown, error = %join, "loading the configuration panicked; the configuration in force stays");
            metrics.config.reload(ReloadResult::Failed);
            return false;
        }
    };
    // The model is copied only for an audit (a pointer per object).
    let audited = live.audit().and_then(|_| owned.in_force.clone());
    *reloader = Some(owned);
    match result {
        Ok(loaded) => {
            pipeline::put_in_force(
                live,
                metrics,
                &shown,
                loaded.snapshot,
                loaded.errors,
                loaded.rejected,
            )
            .await;
            if let Some(model) = audited {
                pipeline::audit(live, model).await;
            }
            true
        }
        Err(errors) => {
            config::log_errors(&errors, "");
            warn!(dir = %shown, "configuration not readable; the configuration in force stays");
            live.refuse(errors);
            metrics.config.reload(ReloadResult::Failed);
            false
        }
    }
}

/// Applies `dir` now, then again after every change in a task of its own.
pub(super) async fn start(
    dir: PathBuf,
    (limits, hbone_node): (Limits, Option<String>),
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    // Watch before the first load: a change made while it loads is not missed.
    let mut watch = DirWatch::new(&dir, limits);
    let mut reloader = Some(Reloader::new(dir, limits, hbone_node.clone()));
    apply(&mut reloader, &live, &metrics).await;
    tokio::spawn(async move {
        loop {
            watch.changed().await;
            if reloader.is_none() {
                // Lost to a panic: start again from nothing in force but what runs.
                let dir = watch.dir().to_path_buf();
                reloader = Some(Reloader::new(dir, limits, hbone_node.clone()));
            }
            apply(&mut reloader, &live, &metrics).await;
        }
    })
}
