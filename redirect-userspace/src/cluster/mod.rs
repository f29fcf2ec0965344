//! The Kubernetes API as the source of the configuration (`redirect run --kube`).
//!
//! One watch per kind ([`watch`]) reads objects through the same loader as the files do
//! ([`kinds`]); the [`store`] holds them as the model holds them, each at its last good version.
//! A burst of changes becomes one new snapshot (once the changes pause for [`QUIET`], after at most
//! [`COALESCE`]), built off the async workers and swapped whole, exactly as a reload of a directory
//! is. With a node name, Pods are watched as this node's (clients) and the other nodes' (endpoints
//! and workload addresses only): see `docs/inputs.md#watched-per-node`. The security policies
//! (AuthorizationPolicy, PeerAuthentication) are watched cluster-wide; with a node name the model
//! holds only the root namespace's and those of the namespaces with a Pod of this node (`store`'s
//! `policies`). A burst that changed only Pods that no selector picks (those of other nodes are the
//! bulk of a big cluster's churn), or only policies, changes no service: the snapshot keeps its
//! services and builds only its workloads again. A burst that touched none of what the workloads
//! read (no Pod, WorkloadEntry, Namespace or mesh config, and the same namespaces where a selector
//! picks Pods) keeps the workloads and builds the services again; when it changed only a few
//! ServiceEntries, each resolving on its own, only their services are built and resolved again
//! ([`Reuse`]). Every snapshot finds anew which policies apply to each Pod of the node. While the
//! API server is away nothing changes: the state in force stays, and each watch retries on its own.
pub(crate) mod kinds;
mod reuse;
pub(crate) mod store;
mod watch;

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use tokio::{
    sync::{mpsc, watch as latest},
    task::JoinHandle,
    time::Instant,
};
use tracing::{debug, error, info, warn};

pub use kinds::Kind;
use reuse::{InForce, Next, Reuse};
pub(crate) use store::Changes;
pub use store::{Change, Store};
pub(crate) use watch::read as read_watched;

use crate::{
    clock::now_rfc3339,
    config::{ConfigError, Model},
    live::LiveState,
    metrics::{Metrics, ReloadResult},
    pipeline,
    state::Snapshot,
    status,
};

/// The longest a change waits for the ones after it before the snapshot is rebuilt.
pub(crate) const COALESCE: Duration = Duration::from_millis(100);
/// A pause this long between changes ends a burst: one change alone is in force within
/// milliseconds, a stream of them still makes one snapshot per [`COALESCE`].
pub(crate) const QUIET: Duration = Duration::from_millis(5);
/// How often an agent that is not ready says what it is waiting for.
const NOT_READY_LOG: Duration = Duration::from_secs(10);

/// The ConfigMap that holds the mesh config under the key `mesh`, as istiod reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MeshConfigMap {
    pub namespace: String,
    pub name: String,
}

impl Default for MeshConfigMap {
    fn default() -> Self {
        MeshConfigMap {
            namespace: "istio-system".into(),
            name: "istio".into(),
        }
    }
}

/// What `run --kube` was told.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Source {
    /// A kubeconfig given on the command line, used instead of the search below.
    pub kubeconfig: Option<std::path::PathBuf>,
    pub mesh: MeshConfigMap,
    /// With `--write-status`: the lease that elects the cluster's one status writer.
    pub status_lease: Option<status::LeaseConfig>,
    /// The node this agent serves (`--node-name`): only its Pods are clients, held whole.
    pub node_name: Option<String>,
    /// Whether the Pods of other nodes are reached over HBONE (`--hbone-between-nodes`).
    pub hbone_between_nodes: bool,
}

/// The client configuration as kubectl finds it: the kubeconfig given, else the pod's service
/// account when running in a cluster, else `$KUBECONFIG`, else `~/.kube/config`.
pub(crate) async fn client_config(source: &Source) -> anyhow::Result<kube::Config> {
    let options = kube::config::KubeConfigOptions::default();
    if let Some(path) = &source.kubeconfig {
        let file = kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
        return kube::Config::from_custom_kubeconfig(file, &options)
            .await
            .with_context(|| format!("using the kubeconfig {}", path.display()));
    }
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        return kube::Config::incluster()
            .context("reading the pod's service account (KUBERNETES_SERVICE_HOST is set)");
    }
    kube::Config::from_kubeconfig(&options)
        .await
        .context("reading the kubeconfig ($KUBECONFIG, else ~/.kube/config)")
}

/// Where the configuration comes from, as `/config_dump` names it.
pub(crate) fn source_name(config: &kube::Config) -> String {
    format!("kubernetes API at {}", config.cluster_url)
}

/// The cluster followed: the task that turns the watches' changes into snapshots, and the status
/// writer's lease when this agent takes part in the election.
pub(crate) struct Following {
    pub task: JoinHandle<()>,
    pub status_lease: Option<status::Holder>,
}

/// Starts a watch per kind and the task that turns their changes into snapshots. Fails only when
/// no client can be made (no configuration); an API server that does not answer is retried.
pub(crate) fn start(
    config: kube::Config,
    source: Source,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Following> {
    let mesh = source.mesh;
    let server = config.cluster_url.to_string();
    let client = kube::Client::try_from(config).context("making a Kubernetes API client")?;
    match &source.node_name {
        Some(node) => {
            info!(%server, %node, "learning the cluster from the Kubernetes API; clients: the Pods of this node")
        }
        None => {
            info!(%server, "learning the cluster from the Kubernetes API; no node name (--node-name, NODE_NAME): every Pod of the cluster is held as a client")
        }
    }
    // Bounded: a flood of events waits for the store instead of piling up in memory.
    let (tx, rx) = mpsc::channel(4096);
    let kinds = Kind::watched(source.node_name.is_some());
    // The status the API holds is read only for the status writer.
    let observe_status = source.status_lease.is_some();
    let mut watches = Vec::new();
    for &kind in &kinds {
        watches.push(tokio::spawn(watch::run(
            client.clone(),
            kind,
            mesh.clone(),
            source.node_name.clone(),
            observe_status,
            tx.clone(),
            metrics.clone(),
        )));
    }
    drop(tx);
    let mut status_lease = None;
    let status = source.status_lease.map(|lease| {
        let (inputs_tx, inputs_rx) = latest::channel(status::Inputs::default());
        let writer = status::start(client.clone(), lease, inputs_rx, metrics.clone());
        live.set_status_writer(writer.report);
        status_lease = Some(writer.lease);
        inputs_tx
    });
    let (hbone_node, hbone_between_nodes) = (source.node_name.clone(), source.hbone_between_nodes);
    let task = tokio::spawn(async move {
        let hbone_node = hbone_node.filter(|_| hbone_between_nodes);
        let store = Store::new(&kinds).with_hbone_node(hbone_node);
        follow(rx, store, live, metrics, status).await;
        for w in watches {
            w.abort();
        }
    });
    Ok(Following { task, status_lease })
}

/// Applies the changes as they come, one snapshot per burst. Nothing is put in force before every
/// watch has listed once: until then the agent is not ready. With a status writer, each burst also
/// tells it the latest resolution and the status the API holds.
async fn follow(
    mut rx: mpsc::Receiver<Change>,
    store: Store,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
    status: Option<latest::Sender<status::Inputs>>,
) {
    let mut follower = Follower {
        store,
        live,
        metrics,
        status,
        desired: Arc::new(Vec::new()),
        in_force: None,
        told: None,
    };
    let mut next_not_ready_log = Instant::now() + NOT_READY_LOG;
    loop {
        // Wait for a change (or, while not ready, for the time to say so).
        let first = if follower.store.ready() {
            rx.recv().await
        } else {
            match tokio::time::timeout_at(next_not_ready_log, rx.recv()).await {
                Ok(change) => change,
                Err(_) => {
                    log_not_ready(&follower.store);
                    next_not_ready_log = Instant::now() + NOT_READY_LOG;
                    continue;
                }
            }
        };
        let Some(first) = first else { return };
        follower.store.apply(first, &now_rfc3339());
        // The rest of the burst: until the changes pause, for at most COALESCE.
        let deadline = Instant::now() + COALESCE;
        loop {
            let pause = (Instant::now() + QUIET).min(deadline);
            match tokio::time::timeout_at(pause, rx.recv()).await {
                Ok(Some(change)) => {
                    follower.store.apply(change, &now_rfc3339());
                }
                Ok(None) | Err(_) => break,
            }
        }
        follower.burst_applied().await;
    }
}

/// The store, and what the snapshot in force and the status writer were last given from it.
struct Follower {
    store: Store,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
    status: Option<latest::Sender<status::Inputs>>,
    /// Each entry's conditions, kept only for a status writer.
    desired: Arc<Vec<status::Desired>>,
    /// What the snapshot in force was built from; `None` until one is in force (the first is always
    /// built whole) and after a build that failed.
    in_force: Option<InForce>,
    /// The status changes the writer was last told of.
    told: Option<u64>,
}

impl Follower {
    /// A burst is in the store: a snapshot built from its changes and put in force, and the status
    /// writer told.
    async fn burst_applied(&mut self) {
        self.live.set_watches(self.store.statuses());
        let changes = match self.store.ready() {
            true => self.store.take_changes(),
            false => Changes::default(),
        };
        let rebuilt = match changes.any() {
            true => self.rebuild(changes).await,
            false => false,
        };
        if let Some(status) = &self.status
            && self.store.ready()
        {
            let (observed, changes) = self.store.observed();
            if rebuilt || self.told != Some(changes) {
                self.told = Some(changes);
                status.send_replace(status::Inputs {
                    api_version: self
                        .store
                        .api_version(Kind::ServiceEntry)
                        .map(str::to_string),
                    desired: self.desired.clone(),
                    observed: Arc::new(observed.clone()),
                });
            }
        }
    }

    /// Builds the next snapshot from the store (reusing what the changes leave as it was) and puts
    /// it in force; true when the entries' statuses changed with it.
    async fn rebuild(&mut self, changes: Changes) -> bool {
        let started = std::time::Instant::now();
        let selecting = self.store.selecting_namespaces();
        let reuse = Reuse::of(changes, &selecting, self.in_force.as_ref());
        let selecting = selecting.into_iter().map(str::to_string).collect();
        let (model, errors, rejected) = self.store.model();
        let modelled = started.elapsed();
        let previous = self.live.snapshot_arc();
        let before = self.in_force.take();
        let built = tokio::task::spawn_blocking(move || {
            let next = Next::build(reuse, &previous, before, &model, errors);
            (next, model)
        })
        .await;
        let (next, model) = match built {
            Ok(built) => built,
            Err(join) => {
                error!(error = %join, "building the snapshot panicked; the configuration in force stays");
                self.metrics.config.reload(ReloadResult::Failed);
                return false;
            }
        };
        debug!(
            kept = next.kept,
            model_ms = modelled.as_secs_f64() * 1e3,
            build_ms = (started.elapsed() - modelled).as_secs_f64() * 1e3,
            "snapshot built"
        );
        let Next {
            snapshot,
            errors,
            allocation,
            resolved,
            ..
        } = next;
        pipeline::put_in_force(
            &self.live,
            &self.metrics,
            "kubernetes API",
            snapshot,
            errors,
            rejected,
        )
        .await;
        let status_changed = resolved.changes_status();
        if self.status.is_some() {
            self.desired = resolved.desired(&self.desired);
        }
        self.in_force = Some(InForce {
            entries: model.service_entries.clone(),
            selecting,
            allocation,
        });
        if self.live.audit().is_some() {
            pipeline::audit(&self.live, model).await;
        } else {
            // A model holds a pointer per Pod: freed off the async workers, after the change is in
            // force.
            drop(tokio::task::spawn_blocking(move || drop(model)));
        }
        status_changed
    }
}

fn log_not_ready(store: &Store) {
    let waiting: Vec<String> = store
        .statuses()
        .into_iter()
        .filter(|w| !w.synced)
        .map(|w| match w.last_error {
            Some(e) => format!("{} ({e})", w.kind),
            None => w.kind.to_string(),
        })
        .collect();
    warn!(
        "not ready: nothing is in force until every watch has listed once; waiting for {}",
        waiting.join(", ")
    );
}

/// The same path a reload of files takes: resolve visibility, allocate, build the snapshot.
pub fn build(model: &Model, errors: Vec<ConfigError>) -> (Snapshot, Vec<ConfigError>) {
    let built = pipeline::build(model, errors);
    (built.snapshot, built.errors)
}

#[cfg(test)]
mod policy_tests;
#[cfg(test)]
mod tests;
