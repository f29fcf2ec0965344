//! The Kubernetes API as the source of the configuration (`redirect run --kube`).
//!
//! One watch per kind ([`watch`]) reads objects through the same loader as the files do
//! ([`kinds`]); the [`store`] holds them as the model holds them, each at its last good version.
//! A burst of changes becomes one new snapshot (once the changes pause for [`QUIET`], after at most
//! [`COALESCE`]), built off the async workers and swapped whole, exactly as a reload of a directory
//! is. With a node name, Pods are watched as this node's (clients) and the other nodes' (endpoints
//! and workload addresses only): see `docs/inputs.md#watched-per-node`. A burst that changed only
//! Pods that no selector picks (those of other nodes are the bulk of a big cluster's churn)
//! changes no service: the snapshot keeps its services and builds only its workloads again. A
//! burst that touched none of what the workloads read (no Pod, WorkloadEntry, Namespace or mesh
//! config, and the same namespaces where a selector picks Pods) keeps the workloads and builds the
//! services again; when it changed only a few ServiceEntries, each resolving on its own, only their
//! services are built and resolved again ([`Reuse`]). While the API server is away nothing changes:
//! the state in force stays, and each watch retries on its own.
pub mod kinds;
pub mod store;
mod watch;

use std::{
    collections::{BTreeSet, HashSet},
    sync::Arc,
    time::Duration,
};

use anyhow::Context;
use tokio::{
    sync::{mpsc, watch as latest},
    task::JoinHandle,
    time::Instant,
};
use tracing::{debug, error, info, warn};

pub use kinds::Kind;
pub use store::{Change, Changes, Store};

use crate::{
    config::{ConfigError, Model, ServiceEntry},
    live::{LiveState, now_rfc3339},
    metrics::{Metrics, ReloadResult},
    pipeline,
    state::Snapshot,
    status,
    visibility::ResolvedEntry,
};

/// The longest a change waits for the ones after it before the snapshot is rebuilt.
pub const COALESCE: Duration = Duration::from_millis(100);
/// A pause this long between changes ends a burst: one change alone is in force within
/// milliseconds, a stream of them still makes one snapshot per [`COALESCE`].
pub const QUIET: Duration = Duration::from_millis(5);
/// How often an agent that is not ready says what it is waiting for.
const NOT_READY_LOG: Duration = Duration::from_secs(10);

/// The ConfigMap that holds the mesh config under the key `mesh`, as istiod reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshConfigMap {
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
pub struct Source {
    /// A kubeconfig given on the command line, used instead of the search below.
    pub kubeconfig: Option<std::path::PathBuf>,
    pub mesh: MeshConfigMap,
    /// With `--write-status`: the lease that elects the cluster's one status writer.
    pub status_lease: Option<status::LeaseConfig>,
    /// The node this agent serves (`--node-name`): only its Pods are clients, held whole.
    pub node_name: Option<String>,
}

/// The client configuration as kubectl finds it: the kubeconfig given, else the pod's service
/// account when running in a cluster, else `$KUBECONFIG`, else `~/.kube/config`.
pub async fn client_config(source: &Source) -> anyhow::Result<kube::Config> {
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
pub fn source_name(config: &kube::Config) -> String {
    format!("kubernetes API at {}", config.cluster_url)
}

/// Starts a watch per kind and the task that turns their changes into snapshots. Fails only when
/// no client can be made (no configuration); an API server that does not answer is retried.
pub fn start(
    config: kube::Config,
    source: Source,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<JoinHandle<()>> {
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
    let status = source.status_lease.map(|lease| {
        let (inputs_tx, inputs_rx) = latest::channel(status::Inputs::default());
        let report = status::start(client.clone(), lease, inputs_rx, metrics.clone());
        live.set_status_writer(report);
        inputs_tx
    });
    Ok(tokio::spawn(async move {
        follow(rx, Store::new(&kinds), live, metrics, status).await;
        for w in watches {
            w.abort();
        }
    }))
}

/// Applies the changes as they come, one snapshot per burst. Nothing is put in force before every
/// watch has listed once: until then the agent is not ready. With a status writer, each burst also
/// tells it the latest resolution and the status the API holds.
async fn follow(
    mut rx: mpsc::Receiver<Change>,
    mut store: Store,
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
    status: Option<latest::Sender<status::Inputs>>,
) {
    // Each entry's conditions, kept only for a status writer.
    let mut desired = Arc::new(Vec::new());
    // What the snapshot in force was built from; `None` until one is in force (the first is always
    // built whole) and after a build that failed.
    let mut in_force: Option<InForce> = None;
    // The status changes the writer was last told of.
    let mut told: Option<u64> = None;
    let mut next_not_ready_log = Instant::now() + NOT_READY_LOG;
    loop {
        // Wait for a change (or, while not ready, for the time to say so).
        let first = if store.ready() {
            rx.recv().await
        } else {
            match tokio::time::timeout_at(next_not_ready_log, rx.recv()).await {
                Ok(change) => change,
                Err(_) => {
                    log_not_ready(&store);
                    next_not_ready_log = Instant::now() + NOT_READY_LOG;
                    continue;
                }
            }
        };
        let Some(first) = first else { return };
        store.apply(first, &now_rfc3339());
        // The rest of the burst: until the changes pause, for at most COALESCE.
        let deadline = Instant::now() + COALESCE;
        loop {
            let pause = (Instant::now() + QUIET).min(deadline);
            match tokio::time::timeout_at(pause, rx.recv()).await {
                Ok(Some(change)) => {
                    store.apply(change, &now_rfc3339());
                }
                Ok(None) | Err(_) => break,
            }
        }
        live.set_watches(store.statuses());
        let mut rebuilt = false;
        let changes = match store.ready() {
            true => store.take_changes(),
            false => Changes::default(),
        };
        if changes.any() {
            let started = std::time::Instant::now();
            let selecting = store.selecting_namespaces();
            let reuse = Reuse::of(changes, &selecting, in_force.as_ref());
            let selecting = selecting.into_iter().map(str::to_string).collect();
            let (model, errors, rejected) = store.model();
            let modelled = started.elapsed();
            let previous = live.snapshot_arc();
            let before = in_force.take();
            let built = tokio::task::spawn_blocking(move || {
                let next = Next::build(reuse, &previous, before, &model, errors);
                (next, model)
            })
            .await;
            let (next, model) = match built {
                Ok(built) => built,
                Err(join) => {
                    error!(error = %join, "building the snapshot panicked; the configuration in force stays");
                    metrics.config.reload(ReloadResult::Failed);
                    continue;
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
                &live,
                &metrics,
                "kubernetes API",
                snapshot,
                errors,
                rejected,
            )
            .await;
            rebuilt = resolved.changes_status();
            if status.is_some() {
                desired = resolved.desired(&desired);
            }
            in_force = Some(InForce {
                entries: model.service_entries.clone(),
                selecting,
                allocation,
            });
            // A model holds a pointer per Pod: freed off the async workers, after the change is in force.
            drop(tokio::task::spawn_blocking(move || drop(model)));
        }
        if let Some(status) = &status
            && store.ready()
        {
            let (observed, changes) = store.observed();
            if rebuilt || told != Some(changes) {
                told = Some(changes);
                status.send_replace(status::Inputs {
                    api_version: store.api_version(Kind::ServiceEntry).map(str::to_string),
                    desired: desired.clone(),
                    observed: Arc::new(observed.clone()),
                });
            }
        }
    }
}

/// What the snapshot in force was built from, for the next burst to build on.
#[derive(Debug)]
struct InForce {
    /// Its model's ServiceEntries: the versions a change replaces.
    entries: Vec<Arc<ServiceEntry>>,
    /// The namespaces where a selector picked Pods: which Pods of other nodes are workloads.
    selecting: HashSet<String>,
    /// The allocation's errors of the last whole resolution, which the snapshots built on it keep.
    allocation: Vec<ConfigError>,
}

/// What a burst's snapshot keeps of the one in force, from what changed (see `state`'s module
/// docs for what each half of a snapshot reads).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reuse {
    /// Nothing: resolved and built whole.
    Nothing,
    /// The services: only Pods changed, none in a namespace where a selector picks Pods.
    Services,
    /// The workloads: nothing they read changed (no Pod, WorkloadEntry, Namespace or mesh config,
    /// and the same namespaces where a selector picks Pods). The services are built whole.
    Workloads,
    /// The workloads, and the services of every ServiceEntry but these, the only objects changed
    /// (when each stands alone, else as [`Reuse::Workloads`]).
    Entries(BTreeSet<store::Key>),
}

impl Reuse {
    fn of(changes: Changes, selecting: &HashSet<&str>, in_force: Option<&InForce>) -> Reuse {
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
struct Next {
    snapshot: Snapshot,
    /// What [`Reuse`] it was built with, in the end (for the log).
    kept: &'static str,
    /// Every error to report: the loader's, then the allocation's.
    errors: Vec<ConfigError>,
    /// The allocation's errors.
    allocation: Vec<ConfigError>,
    resolved: Resolution,
}

/// The resolution a snapshot was built with, as far as it was worked out again.
enum Resolution {
    /// Every entry of the model, in its order.
    Whole(Vec<ResolvedEntry>),
    /// These entries alone (the changed ones the model holds, in key order); every other is as
    /// before.
    Entries(BTreeSet<store::Key>, Vec<ResolvedEntry>),
    /// None: no entry's resolution changed.
    Unchanged,
}

impl Next {
    /// The snapshot for `model` built on `previous`, the one in force, keeping what `reuse` says
    /// (`before`: what `previous` was built from). `errors` are the loader's.
    fn build(
        reuse: Reuse,
        previous: &Snapshot,
        before: Option<InForce>,
        model: &Model,
        errors: Vec<ConfigError>,
    ) -> Next {
        let loaded = errors.len();
        let kept = |errors: Vec<ConfigError>, before: &InForce| {
            let mut errors = errors;
            errors.extend(before.allocation.iter().cloned());
            errors
        };
        let built = match (&reuse, &before) {
            (Reuse::Services, Some(before)) => {
                return Next {
                    snapshot: previous.with_pods(model),
                    kept: "services",
                    errors: kept(errors, before),
                    allocation: before.allocation.clone(),
                    resolved: Resolution::Unchanged,
                };
            }
            (Reuse::Entries(changed), Some(before)) => {
                match pipeline::with_entries(previous, &before.entries, model, changed) {
                    Some((snapshot, resolved)) => {
                        return Next {
                            snapshot,
                            kept: "workloads and other entries' services",
                            errors: kept(errors, before),
                            allocation: before.allocation.clone(),
                            resolved: Resolution::Entries(changed.clone(), resolved),
                        };
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
        let (built, kept) = built;
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
    fn changes_status(&self) -> bool {
        !matches!(self, Resolution::Unchanged)
    }

    /// Each entry's conditions, from those told before (`desired`, in the model's order).
    fn desired(self, desired: &Arc<Vec<status::Desired>>) -> Arc<Vec<status::Desired>> {
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
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn entry(i: usize) -> Change {
        let object = json!({
            "metadata": {"name": format!("e{i}"), "namespace": "team-a"},
            "spec": {"hosts": [format!("e{i}.example.com")], "addresses": [format!("203.0.113.{i}")]}
        });
        let converted = kinds::convert(Kind::ServiceEntry, "networking.istio.io/v1", object);
        Change::Upsert(
            Kind::ServiceEntry,
            ("team-a".into(), format!("e{i}")),
            Box::new(converted),
        )
    }

    async fn settle() {
        tokio::time::sleep(COALESCE * 3).await;
    }

    /// One change the property test makes.
    #[derive(Debug, Clone)]
    enum Op {
        /// A Pod of another node added or changed: namespace, name, address, label.
        Elsewhere(usize, usize, u8, usize),
        GoneElsewhere(usize, usize),
        /// A Pod of this node: namespace, name, address, label.
        Here(usize, usize, u8, usize),
        /// The entry picking `app: l0` Pods of `a` added (or deleted).
        Selector(bool),
    }

    const NAMESPACES: [&str; 3] = ["a", "b", "c"];

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0..3usize, 0..5usize, 0..8u8, 0..3usize).prop_map(|(n, p, ip, l)| Op::Elsewhere(n, p, ip, l)),
            2 => (0..3usize, 0..5usize).prop_map(|(n, p)| Op::GoneElsewhere(n, p)),
            2 => (0..3usize, 0..3usize, 0..8u8, 0..3usize).prop_map(|(n, p, ip, l)| Op::Here(n, p, ip, l)),
            1 => any::<bool>().prop_map(Op::Selector),
        ]
    }

    fn change(op: &Op) -> Change {
        let pod = |ns: &str, name: String, ip: u8, node: &str, labels: Value| {
            json!({"metadata": {"name": name, "namespace": ns, "labels": labels,
                                "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1"},
                   "spec": {"nodeName": node, "containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
                   "status": {"podIP": format!("10.0.0.{ip}")}})
        };
        match op {
            Op::Elsewhere(n, p, ip, l) => {
                let ns = NAMESPACES[*n];
                let object = pod(
                    ns,
                    format!("p{p}"),
                    *ip,
                    "n2",
                    json!({"app": format!("l{l}")}),
                );
                let converted = kinds::convert(Kind::PodElsewhere, "v1", object);
                Change::Upsert(
                    Kind::PodElsewhere,
                    (ns.into(), format!("p{p}")),
                    Box::new(converted),
                )
            }
            Op::GoneElsewhere(n, p) => {
                Change::Deleted(Kind::PodElsewhere, (NAMESPACES[*n].into(), format!("p{p}")))
            }
            Op::Here(n, p, ip, l) => {
                let ns = NAMESPACES[*n];
                let object = pod(
                    ns,
                    format!("h{p}"),
                    *ip,
                    "n1",
                    json!({"app": format!("l{l}")}),
                );
                let converted = kinds::convert(Kind::Pod, "v1", object);
                Change::Upsert(Kind::Pod, (ns.into(), format!("h{p}")), Box::new(converted))
            }
            Op::Selector(false) => Change::Deleted(Kind::ServiceEntry, ("a".into(), "sel".into())),
            Op::Selector(true) => {
                let object = json!({"metadata": {"name": "sel", "namespace": "a"},
                    "spec": {"hosts": ["sel.example.com"], "addresses": ["203.0.113.9"],
                             "ports": [{"number": 80, "name": "http", "protocol": "HTTP", "targetPort": 8080}],
                             "resolution": "STATIC", "workloadSelector": {"labels": {"app": "l0"}}}});
                let converted =
                    kinds::convert(Kind::ServiceEntry, "networking.istio.io/v1", object);
                Change::Upsert(
                    Kind::ServiceEntry,
                    ("a".into(), "sel".into()),
                    Box::new(converted),
                )
            }
        }
    }

    /// What a snapshot says: its dump, the addresses reached directly, and the decision for every
    /// address the test uses, from every namespace and from none.
    fn said(s: &Snapshot) -> (Value, Vec<std::net::IpAddr>, Vec<String>) {
        let mut destinations: Vec<std::net::IpAddr> = s.workload_destinations().collect();
        destinations.sort();
        let mut decisions = Vec::new();
        for to in (0..8)
            .map(|i| format!("10.0.0.{i}"))
            .chain(["203.0.113.9".to_string()])
        {
            for from in [None, Some("a"), Some("b")] {
                let d =
                    s.decide_outbound_with(from, to.parse().unwrap(), 80, crate::state::Pick::Peek);
                let who = match d.action {
                    crate::state::Outbound::Workload { workload, .. } => {
                        format!("{}/{}", workload.namespace, workload.name)
                    }
                    _ => String::new(),
                };
                decisions.push(format!(
                    "{to} {from:?} {:?} {who} {:?}",
                    d.outcome(),
                    d.target()
                ));
            }
        }
        let dump = serde_json::to_value(s.config_dump()).unwrap();
        (dump, destinations, decisions)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn a_snapshot_patched_for_pods_says_what_one_built_whole_says(
            ops in proptest::collection::vec(op(), 1..40)
        ) {
            let kinds = Kind::watched(true);
            let mut store = Store::new(&kinds);
            for &kind in &kinds {
                store.apply(Change::Relist(kind), "t");
                store.apply(Change::Listed(kind), "t");
            }
            store.take_changes();
            let mut previous: Option<Snapshot> = None;
            for op in &ops {
                store.apply(change(op), "t");
                let changes = store.take_changes();
                if !changes.any() {
                    continue;
                }
                let (model, errors, _) = store.model();
                let whole = pipeline::build(&model, errors).snapshot;
                let next = match previous {
                    Some(p) if changes.only_pods(&store.selecting_namespaces()) => {
                        p.with_pods(&model)
                    }
                    _ => pipeline::build(&model, Vec::new()).snapshot,
                };
                proptest::prop_assert_eq!(said(&next), said(&whole), "after {:?}", op);
                previous = Some(next);
            }
        }
    }

    #[tokio::test]
    async fn nothing_is_applied_before_every_watch_has_listed_and_a_burst_is_one_snapshot() {
        let live = LiveState::new(Some("kubernetes API".into()));
        let metrics = Arc::new(Metrics::default());
        let (tx, rx) = mpsc::channel(4096);
        let task = tokio::spawn(follow(rx, Store::default(), live.clone(), metrics, None));
        for kind in Kind::ALL {
            tx.send(Change::Relist(kind)).await.unwrap();
        }
        for i in 1..=10 {
            tx.send(entry(i)).await.unwrap();
        }
        for kind in Kind::ALL.iter().filter(|k| **k != Kind::MeshConfig) {
            tx.send(Change::Listed(*kind)).await.unwrap();
        }
        settle().await;
        assert_eq!(
            live.status_report().generation,
            0,
            "one watch has not listed"
        );
        assert!(!live.has_config());
        tx.send(Change::Listed(Kind::MeshConfig)).await.unwrap();
        settle().await;
        assert_eq!(live.status_report().generation, 1);
        assert_eq!(live.snapshot().services().count(), 10);

        // Fifty changes at once: one more snapshot, holding all of them.
        for i in 11..=60 {
            tx.send(entry(i)).await.unwrap();
        }
        settle().await;
        let status = live.status_report();
        assert_eq!(status.generation, 2);
        assert_eq!(live.snapshot().services().count(), 60);
        assert_eq!(status.watches.len(), Kind::ALL.len());
        // A failure changes no snapshot; it shows in the watch's state.
        tx.send(Change::Failed(Kind::Pod, "connection refused".into()))
            .await
            .unwrap();
        settle().await;
        let status = live.status_report();
        assert_eq!(status.generation, 2);
        let pods = status.watches.iter().find(|w| w.kind == "Pod").unwrap();
        assert_eq!(pods.last_error.as_deref(), Some("connection refused"));
        drop(tx);
        task.await.unwrap();
    }
}
