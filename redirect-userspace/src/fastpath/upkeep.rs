//! The fast path (the agent's default; off with `run --no-fast-path`): keeps the kernel's tables
//! equal to the snapshot in force, the endpoint host names resolved ahead and the pods' cgroups on
//! the node. A snapshot is compiled again when it or the fresh host addresses change: one that
//! changed only Pods (its services shared) keeps the services' entries and takes only its workload
//! addresses again; one that changed only services (its workloads shared) keeps the workload
//! addresses, and one that changed a few services in place is a patch of the tables before
//! (`patch`). The client table (cgroup -> namespace) is redone whenever the cgroups change, beside
//! the compiled tables, never in a copy of them. Every change goes in as a new generation, written
//! as what differs from what that generation holds.
use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, OnceLock, atomic::Ordering},
    time::{Duration, Instant},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use redirect_common::{
    FastStat,
    fastpath::{HiddenEvent, NOT_HIDDEN},
};
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::maps::{FastMaps, FastStats, RecordsLost};
use crate::lock::Locked;
use crate::{
    config::{Workload, WorkloadKind},
    fastpath::{
        self, Clients, DecidedBy, Dump, Fallback, HostAddresses, Install, Limits, Stats,
        TableMemory, Tables, ahead::Ahead, fallback_name,
    },
    identity::CgroupPods,
    live::LiveState,
    metrics::{Lookup, Metrics},
    records::Connections,
    state::Snapshot,
};

/// How soon a new pod's connections are decided in the kernel (until then its cgroup is unknown
/// and the proxy decides them).
pub(super) const RESCAN_EVERY: Duration = Duration::from_secs(1);

/// How long the agent waits for its first answers about endpoint host names before its first
/// tables (names still unanswered go to the proxy until they resolve).
pub(super) const FIRST_RESOLUTION: Duration = Duration::from_secs(1);
/// How long after a flip the idle generation is brought up to date (past the quiet time the
/// programs need to finish with it).
const CATCH_UP_AFTER: Duration = Duration::from_millis(25);
/// How often the kernel's count of hides joins the proxy's, and its reports are logged.
const HIDES_EVERY: Duration = Duration::from_millis(100);
/// Hides logged a second at most (the rest are summed up in one line).
const HIDES_LOGGED_PER_SECOND: u32 = 50;

/// A snapshot and the tables compiled from it (without the client table).
type Compiled = (Arc<Snapshot>, Arc<Tables>, Arc<Stats>);

/// What the metrics and `/config_dump` read of the last compilation and install: kept apart from
/// the compiler's state and the maps, so that neither a scrape nor the admin server waits for a
/// compilation or a write to the kernel.
#[derive(Default)]
struct Published {
    fallbacks: BTreeMap<Fallback, usize>,
    fresh_hosts: usize,
    compiled: Option<Compiled>,
    /// Entries of each table in force, once some are.
    in_force: Option<BTreeMap<&'static str, usize>>,
    /// What the maps take in the kernel, both generations.
    memory: BTreeMap<&'static str, TableMemory>,
    /// The pods the client table in force names, by cgroup.
    clients: Arc<super::records::PodsByCgroup>,
}

/// The compiled snapshot in force and the cgroups its client table was filled from.
#[derive(Default)]
struct State {
    compiled: Option<Compiled>,
    /// The host addresses the compiled tables hold.
    hosts: HostAddresses,
    pods: Vec<(u64, Uuid)>,
    /// Pod cgroups the client table had no room for, at the last install.
    clients_left_out: usize,
}

pub(crate) struct FastPath {
    live: Arc<LiveState>,
    cgroups: Arc<CgroupPods>,
    /// Set once the programs are loaded ([`FastPath::start`]).
    maps: OnceLock<Arc<Mutex<FastMaps>>>,
    /// The programs' counters, read without the maps' lock.
    stats: OnceLock<Arc<FastStats>>,
    /// The kernel's count of the connection records it could not report.
    records_lost: OnceLock<Arc<RecordsLost>>,
    /// What the metrics say of the tables in force, kept apart from `state`, which a compilation
    /// holds for as long as it runs.
    published: Arc<Mutex<Published>>,
    /// Endpoint host names resolved ahead.
    ahead: Arc<Ahead>,
    metrics: Arc<Metrics>,
    /// What the tables may hold (from the kernel memory they may take).
    limits: Limits,
    /// Where the kernel's connection records go, joined to names.
    connections: Arc<Connections>,
    state: Mutex<State>,
}

impl FastPath {
    /// Before the programs are loaded: the first tables, from the snapshot in force, the pods'
    /// cgroups and the endpoint host names resolved within [`FIRST_RESOLUTION`]. They go in force
    /// before the programs are attached (the hook of `Redirector::attach`).
    pub(crate) async fn prepare(
        live: Arc<LiveState>,
        cgroups: Arc<CgroupPods>,
        ahead: Arc<Ahead>,
        metrics: Arc<Metrics>,
        limits: Limits,
        connections: Arc<Connections>,
    ) -> (Arc<FastPath>, Install) {
        let pods = cgroups.rescan().await;
        ahead.follow(&live.snapshot_arc());
        ahead.resolve_due(FIRST_RESOLUTION).await;
        let fast = Arc::new(FastPath {
            live,
            cgroups,
            maps: OnceLock::new(),
            stats: OnceLock::new(),
            records_lost: OnceLock::new(),
            published: Arc::default(),
            ahead,
            metrics,
            limits,
            connections,
            state: Mutex::new(State {
                pods,
                ..State::default()
            }),
        });
        let first = fast.refresh(None).unwrap_or_default();
        (fast, first)
    }

    /// With the programs loaded (and the first tables in force): installs every later snapshot as
    /// it is applied.
    pub(crate) fn start(self: &Arc<Self>, maps: Arc<Mutex<FastMaps>>) {
        self.publish_maps(&maps);
        // The first tables went in before the programs: the other generation catches up now.
        self.catch_up_later(maps.clone());
        let (stats, records_lost) = {
            let maps = maps.locked();
            (maps.stats(), maps.records_lost())
        };
        let _ = self.stats.set(stats);
        let _ = self.records_lost.set(records_lost);
        let _ = self.maps.set(maps);
        let fast = self;
        let live = &self.live;
        let on_apply = Arc::downgrade(fast);
        live.on_apply(move |snapshot| {
            if let Some(fast) = on_apply.upgrade() {
                // The names first: the tables then drop those no longer named.
                fast.ahead.follow(snapshot);
                fast.refresh(None);
            }
        });
        fast.refresh(None);
    }

    /// Compiles the snapshot in force if it or the fresh host addresses are new, and installs the
    /// tables when they or the pods' cgroups (`pods`, when rescanned) changed. Before the maps
    /// exist, returns the tables instead.
    fn refresh(&self, pods: Option<Vec<(u64, Uuid)>>) -> Option<Install> {
        let mut state = self.state.locked();
        // Read under the lock: of two racing callers, the last to lock installs the latest.
        let snapshot = self.live.snapshot_arc();
        let hosts = self.ahead.fresh();
        let new_snapshot = !matches!(&state.compiled, Some((s, ..)) if Arc::ptr_eq(s, &snapshot));
        let new_hosts = hosts != state.hosts;
        let new_pods = pods.as_ref().is_some_and(|p| *p != state.pods);
        if !new_snapshot && !new_hosts && !new_pods {
            return None;
        }
        if let Some(pods) = pods {
            state.pods = pods;
        }
        let started = std::time::Instant::now();
        if new_snapshot || new_hosts {
            // Only the host addresses moved: their ports' endpoints are written again, nothing else.
            let patched = match &state.compiled {
                Some((s, t, st)) if !new_snapshot => {
                    fastpath::with_hosts(t, st, s, &state.hosts, &hosts)
                }
                _ => None,
            };
            let (tables, stats) = patched.unwrap_or_else(|| {
                let compiled = state
                    .compiled
                    .as_ref()
                    .map(|(s, t, st)| (&**s, &**t, &**st));
                fastpath::compile_after(compiled, !new_hosts, &snapshot, self.limits, &hosts)
            });
            let compiled = (snapshot.clone(), Arc::new(tables), Arc::new(stats));
            {
                let mut published = self.published.locked();
                published.fallbacks = compiled.2.fallbacks.clone();
                published.fresh_hosts = hosts.len();
                published.compiled = Some(compiled.clone());
            }
            state.compiled = Some(compiled);
            state.hosts = hosts;
        }
        let Some((snapshot, tables, stats)) = &state.compiled else {
            return None;
        };
        let (install, clients, left_out) = with_clients(snapshot, tables, &state.pods);
        self.published.locked().clients = Arc::new(clients);
        let compiled_in = started.elapsed();
        let Some(maps) = self.maps.get() else {
            state.clients_left_out = left_out;
            return Some(install);
        };
        let installed = maps.locked().install(&install);
        self.publish_maps(maps);
        match installed {
            Ok(()) => {
                info!(
                    exact = tables.exact().len(),
                    cidrs = tables.cidrs().count(),
                    ports = tables.ports().len(),
                    workloads = tables.workloads().len(),
                    clients = install.clients.len(),
                    fallbacks = ?stats.fallbacks,
                    compiled_in = ?compiled_in,
                    written_in = ?(started.elapsed() - compiled_in),
                    "fast path: new tables in force"
                );
                self.catch_up_later(maps.clone());
            }
            Err(e) => {
                warn!(error = %e, "fast path: writing the tables failed; the previous ones stay in force")
            }
        }
        if left_out > 0 && left_out != state.clients_left_out {
            warn!(
                cgroups = left_out,
                "fast path: the client table is full; these pods' connections go to the proxy"
            );
        }
        state.clients_left_out = left_out;
        None
    }

    /// Publishes what the maps in force hold and take (for `/config_dump` and the metrics).
    fn publish_maps(&self, maps: &Mutex<FastMaps>) {
        publish_maps(maps, &self.published);
    }

    /// See [`catch_up_later`].
    fn catch_up_later(&self, maps: Arc<Mutex<FastMaps>>) {
        catch_up_later(maps, self.published.clone());
    }

    /// Rescans the pods' cgroups every [`RESCAN_EVERY`] until `shutdown` changes.
    pub(crate) async fn run(self: Arc<Self>, mut shutdown: crate::drain::Watcher) {
        // New tables whenever the fresh host addresses change.
        let fast = self.clone();
        let changed = move || {
            let fast = fast.clone();
            tokio::task::spawn_blocking(move || fast.refresh(None));
        };
        tokio::spawn(self.ahead.clone().run(changed, shutdown.clone()));
        tokio::spawn(self.clone().hides(shutdown.clone()));
        if let Some(ring) = self.maps.get().and_then(|m| m.locked().take_records()) {
            tokio::spawn(super::records::follow(
                ring,
                self.clone(),
                self.connections.clone(),
                shutdown.clone(),
            ));
        }
        let audited = self.maps.get().and_then(|m| m.locked().take_audited());
        if let (Some(audit), Some(audited)) = (self.live.audit(), audited) {
            tokio::spawn(super::audited::follow(
                audited,
                audit.clone(),
                shutdown.clone(),
            ));
        }
        let mut tick = tokio::time::interval(RESCAN_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.stopped() => return,
                _ = tick.tick() => {
                    let pods = self.cgroups.rescan().await;
                    let fast = self.clone();
                    let _ = tokio::task::spawn_blocking(move || fast.refresh(Some(pods))).await;
                }
            }
        }
    }

    /// Adds the kernel's count of hides to the proxy's (`services_hidden{lookup="outbound"}`) and
    /// logs its reports at debug level as the proxy logs its own, at most
    /// [`HIDES_LOGGED_PER_SECOND`] a second, until `shutdown` changes.
    async fn hides(self: Arc<Self>, mut shutdown: crate::drain::Watcher) {
        let Some(maps) = self.maps.get() else {
            return;
        };
        let Some(stats) = self.stats.get() else {
            return;
        };
        let mut events = maps.locked().take_events();
        // The kernel's count lives in a pinned map and goes on across agents: what it held when this
        // one started is the predecessor's (a successor that took it for its own added every hide
        // since the pin was made at its first tick, all at once).
        let mut counted = stats.hidden_counts().0;
        let (mut window, mut logged, mut suppressed) = (Instant::now(), 0u32, 0u64);
        let mut tick = tokio::time::interval(HIDES_EVERY);
        loop {
            tokio::select! {
                () = shutdown.stopped() => return,
                _ = tick.tick() => {}
            }
            let (hidden, _) = stats.hidden_counts();
            if hidden > counted {
                self.metrics
                    .clients
                    .hidden_by(Lookup::Outbound, hidden - counted);
                counted = hidden;
            }
            let Some(events) = &mut events else { continue };
            let drained = events.drain();
            if let Some(audit) = self.live.audit() {
                for event in &drained {
                    self.audit_decision(audit, event);
                }
            }
            if !tracing::enabled!(tracing::Level::DEBUG) {
                continue;
            }
            if window.elapsed() >= Duration::from_secs(1) {
                if suppressed > 0 {
                    debug!(
                        hides = suppressed,
                        "more services hidden from clients in the kernel than logged"
                    );
                }
                (window, logged, suppressed) = (Instant::now(), 0, 0);
            }
            for event in drained.iter().filter(|e| e.hidden != NOT_HIDDEN) {
                if logged >= HIDES_LOGGED_PER_SECOND {
                    suppressed += 1;
                    continue;
                }
                logged += 1;
                self.log_hide(event);
            }
        }
    }

    /// The snapshot the tables in force were compiled from, and the pod whose cgroup is `cgroup`
    /// in it (`None` for a cgroup the client table did not name).
    pub(super) fn compiled_client(
        &self,
        cgroup: u64,
    ) -> Option<(Arc<Snapshot>, Option<Arc<Workload>>)> {
        let (snapshot, clients) = super::records::Names::names(self)?;
        Some((snapshot, clients.get(&cgroup).map(|c| c.pod.clone())))
    }

    /// One hide the kernel reported, as the proxy logs it (the client by its pod's address).
    fn log_hide(&self, event: &HiddenEvent) {
        let Some((snapshot, pod)) = self.compiled_client(event.cgroup) else {
            return;
        };
        let client = pod
            .as_ref()
            .and_then(|w| w.ips.first())
            .map_or("<unknown>".to_string(), |ip| ip.to_string());
        let client_ns = pod
            .as_ref()
            .map_or("<unknown>", |w| w.meta.namespace.as_str());
        let Some(hidden) = snapshot.services().nth(event.hidden as usize) else {
            return;
        };
        let instead = match FastStat::ALL.get(usize::from(event.outcome)) {
            Some(FastStat::Rewritten) => "service",
            Some(stat) => stat.outcome(),
            None => "?",
        };
        debug!(
            client = %client,
            client_namespace = client_ns,
            service = %format_args!("{}/{}", hidden.namespace, hidden.name),
            orig_dst = %SocketAddr::new(event.dst.ip(), event.port),
            instead,
            decided_by = "kernel",
            "service hidden from client"
        );
    }

    /// A Prometheus collector of the kernel's fast-path counters and the compiler's fallbacks.
    pub(crate) fn collector(self: &Arc<Self>) -> Box<dyn Collector> {
        Box::new(FastPathMetrics(self.clone()))
    }

    /// What `/config_dump` shows: the tables in force, what they take in the kernel, and who
    /// decides each service's ports. Read from what was last published: it never waits for a
    /// compilation or a write to the maps.
    pub(crate) fn dump(&self) -> Option<Dump> {
        let published = self.published.locked();
        let (snapshot, tables, stats) = published.compiled.clone()?;
        self.maps.get()?;
        let (in_force, memory) = (published.in_force.clone(), published.memory.clone());
        drop(published);
        let dump = Dump::new(&snapshot, &tables, &stats, in_force);
        Some(dump.with_memory(memory, self.limits.bytes.saturating_mul(2)))
    }

    /// Who decides a connection of a pod of `namespace` to `ip:port` under the tables last put in
    /// force (`None` before any).
    pub(crate) fn decided_by(&self, namespace: &str, ip: IpAddr, port: u16) -> Option<DecidedBy> {
        let (_, tables, _) = self.published.locked().compiled.clone()?;
        Some(fastpath::decided_by(&tables, Some(namespace), ip, port))
    }

    /// What the maps take in the kernel, by table (both generations).
    fn memory(&self) -> BTreeMap<&'static str, TableMemory> {
        let published = self.published.locked();
        published.memory.clone()
    }

    fn fallbacks(&self) -> BTreeMap<Fallback, usize> {
        let published = self.published.locked();
        published.fallbacks.clone()
    }
}

/// The compiled tables with a client entry for every pod cgroup whose pod the snapshot knows,
/// those pods by cgroup (for the records' and hides' names), and how many did not fit.
fn with_clients(
    snapshot: &Snapshot,
    tables: &Arc<Tables>,
    pods: &[(u64, Uuid)],
) -> (Install, super::records::PodsByCgroup, usize) {
    let by_uid: HashMap<Uuid, &Arc<Workload>> = snapshot
        .workloads()
        .iter()
        .filter(|w| w.kind == WorkloadKind::Pod)
        .filter_map(|w| Some((w.meta.uid?, w)))
        .collect();
    let mut clients = Clients::new(tables);
    let mut named =
        <super::records::PodsByCgroup as foldhash::HashMapExt>::with_capacity(pods.len());
    let mut left_out = 0;
    for (cgroup, uid) in pods {
        // A pod the snapshot does not know stays out: the proxy knows it by address, if at all.
        let Some(pod) = by_uid.get(uid) else {
            continue;
        };
        let enrolled = snapshot.enrolled(pod);
        if clients
            .set(tables, *cgroup, &pod.meta.namespace, enrolled)
            .is_err()
        {
            left_out += 1;
            continue;
        }
        named.insert(*cgroup, super::records::ClientPod::new(pod));
    }
    let install = Install {
        tables: tables.clone(),
        clients: Arc::new(clients),
    };
    (install, named, left_out)
}

impl super::records::Names for FastPath {
    fn names(&self) -> Option<super::records::NamesInForce> {
        let published = self.published.locked();
        let (snapshot, ..) = published.compiled.as_ref()?;
        Some((snapshot.clone(), published.clients.clone()))
    }
}

struct FastPathMetrics(Arc<FastPath>);

impl fmt::Debug for FastPathMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FastPathMetrics")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabels {
    table: &'static str,
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FallbackLabels {
    reason: String,
}

/// What the maps in force hold and take, into `published`.
fn publish_maps(maps: &Mutex<FastMaps>, published: &Mutex<Published>) {
    let maps = maps.locked();
    let (in_force, memory) = (maps.sizes_in_force(), maps.memory());
    drop(maps);
    let mut published = published.locked();
    published.in_force = in_force;
    published.memory = memory;
}

/// Brings the generation just left to the tables in force once programs are done with it, off any
/// update's path (see [`FastMaps::catch_up`]), then publishes what the maps take; a later update
/// does it itself if it comes first.
fn catch_up_later(maps: Arc<Mutex<FastMaps>>, published: Arc<Mutex<Published>>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        loop {
            tokio::time::sleep(CATCH_UP_AFTER).await;
            let (maps, published) = (maps.clone(), published.clone());
            let done = tokio::task::spawn_blocking(move || {
                let done = maps.locked().catch_up();
                if matches!(done, Ok(true)) {
                    publish_maps(&maps, &published);
                    // The idle generation's own record of its maps was just let go of.
                    crate::live::release_free_memory();
                }
                done
            })
            .await;
            match done {
                Ok(Ok(false)) => continue,
                Ok(Ok(true)) => return,
                Ok(Err(e)) => {
                    debug!(error = %e, "fast path: bringing the idle tables up to date failed; the next update writes what is left");
                    return;
                }
                Err(_) => return,
            }
        }
    });
}

impl Collector for FastPathMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let counts = match self.0.stats.get() {
            Some(stats) => stats.counts(),
            None => Vec::new(),
        };
        let mut family = encoder.encode_descriptor(
            "fast_path_connections",
            "TCP connections decided at connect() by the fast path: left alone (passthrough, workload), rewritten to an endpoint, or handed to the proxy (with why)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (stat, total) in counts {
            let labels = OutcomeLabels {
                outcome: stat.outcome(),
                reason: stat.reason(),
            };
            ConstCounter::new(total).encode(family.encode_family(&labels)?)?;
        }
        let lost = self.0.records_lost.get().map_or(0, |lost| lost.count());
        let family = encoder.encode_descriptor(
            "connection_records_lost",
            "Connection records of kernel-decided connections the kernel could not report (its ring buffer was full: the agent fell behind)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        ConstCounter::new(lost).encode(family)?;
        let mut family = encoder.encode_descriptor(
            "fast_path_fallbacks",
            "What the snapshot in force leaves to the proxy that the kernel could otherwise decide, by reason",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (why, n) in self.0.fallbacks() {
            let labels = FallbackLabels {
                reason: fallback_name(why),
            };
            ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "fast_path_table_bytes",
            "Kernel memory of the fast path's maps, both generations, by table: estimated from the entries and capacity, or as the kernel reports it (`memlock`, recent kernels)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (table, memory) in self.0.memory() {
            let estimated = TableLabels {
                table,
                source: "estimated",
            };
            ConstGauge::new(memory.estimated_bytes as i64)
                .encode(family.encode_family(&estimated)?)?;
            if let Some(bytes) = memory.kernel_bytes {
                let labels = TableLabels {
                    table,
                    source: "kernel",
                };
                ConstGauge::new(bytes as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        let family = encoder.encode_descriptor(
            "fast_path_table_budget_bytes",
            "Kernel memory the fast path's maps may take, both generations (`run --fast-path-memory`)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        ConstGauge::new(self.0.limits.bytes.saturating_mul(2) as i64).encode(family)?;
        let ahead = &self.0.ahead;
        let mut family = encoder.encode_descriptor(
            "fast_path_host_names",
            "Endpoint host names resolved ahead for the kernel: named by the configuration (`wanted`, at most 4096), with fresh addresses now (`fresh`), past the bound (`left_out`, the proxy resolves them)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        let fresh = self.0.published.locked().fresh_hosts;
        for (state, n) in [
            ("wanted", ahead.names()),
            ("fresh", fresh),
            ("left_out", ahead.left_out()),
        ] {
            let labels = StateLabels { state };
            ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "fast_path_host_resolutions",
            "Resolutions of endpoint host names ahead, by result: `resolved`, `failed` (the proxy resolves the name until it does), `expired` (an answer that ran out without a refresh)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (result, n) in [
            ("resolved", &ahead.stats.resolved),
            ("failed", &ahead.stats.failed),
            ("expired", &ahead.stats.expired),
        ] {
            let labels = ResultLabels { result };
            ConstCounter::new(n.load(Ordering::Relaxed)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
