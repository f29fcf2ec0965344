//! The node agent: wires the eBPF redirect, the outbound proxy, the DNS proxy, the configuration
//! reload and the admin server together, and takes them down in the right order; hands its sockets and
//! programs over to a successor (`handover`) and drains.
mod bind;
mod dir_watch;
mod families;
mod file_watch;
mod hbone;
mod in_force;
mod inbound;

pub(crate) mod handover;
mod opt_out;
mod reload;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use tracing::{info, warn};

use self::{
    families::{Families, registry},
    inbound::KernelInbound,
    opt_out::OptOutSync,
};
use crate::{
    admin::{self, AdminState},
    audit::Audit,
    budget::{BudgetArgs, Budgets, Limits, raise_fd_limit},
    dns::{AnswerCache, HostCache, Upstream, VisibleNames},
    drain::{Lifecycle, Phase, Watcher},
    fastpath::{FastMaps, FastPath, KernelRecords, ahead::Ahead},
    hbone::HboneClient,
    identity::CgroupPods,
    live::LiveState,
    logging::LogLevel,
    proxy::{DialGuard, OutboundProxy, ProxyContext, RelayMode, Timeouts},
    records::Connections,
    redirect::{Gateways, RedirectConfig, Redirector, Release},
};

#[derive(Debug, Clone)]
pub(crate) struct AgentConfig {
    /// Directory of manifests to load and watch; `None` runs with nothing claimed (all passthrough).
    pub config_dir: Option<PathBuf>,
    pub cgroup: PathBuf,
    /// One address per family at most; the proxy and the DNS proxy listen on each.
    pub gateway: Gateways,
    pub proxy_port: u16,
    /// Port of the DNS proxy at the gateway; `None` leaves pods' DNS alone.
    pub dns_proxy_port: Option<u16>,
    pub dns_upstream: SocketAddr,
    /// Entries of the cache of upstream answers; `None`: no cache.
    pub dns_cache: Option<std::num::NonZeroUsize>,
    pub admin: SocketAddr,
    pub admin_allow_non_loopback: bool,
    /// Where the metrics alone are served for a cluster's Prometheus; `None`: nowhere.
    pub stats: Option<SocketAddr>,
    /// Prefixes the proxy never dials for a pod, beyond the ones it always refuses.
    pub deny_destinations: Vec<ipnet::IpNet>,
    pub relay: RelayMode,
    /// Caps and timeouts; the caps not given are sized from the open-files limit.
    pub budget: BudgetArgs,
    /// Input bounds of each configuration load.
    pub limits: crate::config::Limits,
    /// bpffs directory the links and maps are pinned in; `None`: tied to this process.
    pub pin_dir: Option<PathBuf>,
    /// Unix socket a successor asks for the listening sockets on; `None`: no hand-over.
    pub handover_socket: Option<PathBuf>,
    /// Whether a successor can take over, for `/config_dump` and `redirect_handover_available`.
    pub handover: crate::redirect::bpffs::Handover,
    /// After a hand-over, how long proxied connections may run before they are reset.
    pub drain_timeout: Duration,
    /// Learn the configuration from the Kubernetes API instead of `config_dir`.
    pub kube: Option<crate::cluster::Source>,
    /// Decide in the kernel what needs no proxy (the default; off with `run --no-fast-path`).
    pub fast_path: bool,
    /// Kernel memory the fast path's tables may take, both generations together.
    pub fast_path_memory: usize,
    /// One access-log line per connection when it ends (the proxy's and the kernel's).
    pub access_log: bool,
    /// How many of the connections the kernel decides it records.
    pub kernel_records: KernelRecords,
    /// A second mesh config audited beside the one in force, never enforced.
    pub audit_mesh_config: Option<PathBuf>,
    /// Where the node's pods' certificates for HBONE to waypoints come from; `None`: nowhere.
    pub cert_source: Option<crate::hbone::CertSource>,
    /// `--trust-domain`; unset, the mesh config's as it is at the first tunnel.
    pub trust_domain: Option<String>,
    /// `--cluster-id`: the cluster Istio's metrics name for this node's workloads.
    pub cluster_id: String,
    /// With HBONE between nodes (`--hbone-between-nodes`), the node served.
    pub hbone_node: Option<String>,
}

/// Runs until SIGINT or SIGTERM.
pub(crate) fn run(config: AgentConfig, log_level: LogLevel) -> anyhow::Result<()> {
    let fd_limit = raise_fd_limit();
    let ephemeral_ports = crate::budget::ports::ephemeral_ports().unwrap_or_else(|e| {
        tracing::warn!(error = %e, assumed = crate::budget::ports::DEFAULT_EPHEMERAL_PORTS, "reading the node's ephemeral port range");
        crate::budget::ports::DEFAULT_EPHEMERAL_PORTS
    });
    let limits = Limits::size(fd_limit, ephemeral_ports, &config.budget);
    info!(?limits, "resource budgets");
    let in_force = in_force::of(&config);
    info!(config = %in_force.to_json_line(), "configuration in force");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("proxy")
        .build()
        .context("starting the proxy runtime")?;
    runtime.block_on(run_async(config, limits, log_level))?;
    // Connection tasks still running are dropped with the runtime: their sockets close.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(())
}

async fn run_async(config: AgentConfig, limits: Limits, log_level: LogLevel) -> anyhow::Result<()> {
    // Before anything is attached: a SIGTERM during start-up waits for the start to complete, then
    // takes the ordinary way out (programs detached), instead of killing the process half-way.
    let mut signals = Signals::install()?;
    let running = start(&config, limits, log_level).await?;
    let signal = tokio::select! {
        signal = signals.recv() => Some(signal),
        () = running.lifecycle.handed_over() => None,
    };
    match signal {
        Some(signal) => running.shut_down(signal).await,
        None => running.drain(config.drain_timeout, &mut signals).await,
    }
    Ok(())
}

/// What the configuration comes from, started: the snapshot in force and the tasks that keep it so.
struct Inputs {
    live: Arc<LiveState>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Held while this agent may write ServiceEntry status (`--write-status`).
    status_lease: Option<crate::status::Holder>,
}

impl Inputs {
    /// Stops following the configuration; hands the status writer's lease back first, so another
    /// agent writes from its next try instead of a whole lease later.
    async fn stop(self) {
        if let Some(lease) = self.status_lease {
            lease.release().await;
        }
        for task in self.tasks {
            task.abort();
        }
    }
}

/// The configuration first: when the programs attach, the first answers are already right. A
/// refused first configuration leaves the agent running but not ready, waiting for a fix.
async fn start_inputs(config: &AgentConfig, families: &Families) -> anyhow::Result<Inputs> {
    let metrics = &families.shared;
    let kube = match &config.kube {
        Some(source) => Some(crate::cluster::client_config(source).await?),
        None => None,
    };
    let source = kube
        .as_ref()
        .map(|k| PathBuf::from(crate::cluster::source_name(k)))
        .or_else(|| config.config_dir.clone());
    let live = LiveState::new(source);
    let mut tasks = Vec::new();
    // Before the first configuration: its policy is audited from the first decision on.
    if let Some(file) = &config.audit_mesh_config {
        let audit = Audit::new(file.clone(), families.audit.clone());
        live.set_audit(audit.clone());
        tasks.push(tokio::spawn(follow_audit_file(audit)));
    }
    if let Some(dir) = config.config_dir.clone() {
        let settings = (config.limits, config.hbone_node.clone());
        tasks.push(reload::start(dir, settings, live.clone(), metrics.clone()).await);
    }
    let mut status_lease = None;
    if let (Some(client), Some(source)) = (kube, config.kube.clone()) {
        let following = crate::cluster::start(client, source, live.clone(), metrics.clone())?;
        tasks.push(following.task);
        status_lease = following.status_lease;
    }
    Ok(Inputs {
        live,
        tasks,
        status_lease,
    })
}

/// Reads the audit file again each time it changes.
async fn follow_audit_file(audit: Arc<Audit>) {
    let mut watch = file_watch::FileWatch::new(audit.file());
    loop {
        watch.changed().await;
        let reading = audit.clone();
        let _ = tokio::task::spawn_blocking(move || reading.reload_file()).await;
    }
}

/// The agent serving: the owner of its running parts, until it shuts down or drains.
struct Running {
    redirector: Redirector,
    /// The proxies' and the DNS proxies' accept loops.
    serving: Vec<tokio::task::JoinHandle<()>>,
    inputs: Inputs,
    /// Moved on by a signal or a successor's hand-over; dropped, it stops the admin server.
    lifecycle: Arc<Lifecycle>,
    handover_server: Option<handover::Server>,
    budgets: Arc<Budgets>,
}

/// Starts everything in order: inputs, listeners, the programs, the servers; returns once the
/// agent serves (and, after a hand-over, serves alone).
async fn start(
    config: &AgentConfig,
    limits: Limits,
    log_level: LogLevel,
) -> anyhow::Result<Running> {
    let families = Families::default();
    let metrics = families.shared.clone();
    let budgets = Arc::new(Budgets::new(limits, &families.budgets));
    let inputs = start_inputs(config, &families).await?;
    let live = inputs.live.clone();
    let hbone = hbone::client(config, &live, &families)?;
    let prepared = hbone::prepare(config).await?;
    let lifecycle = Arc::new(Lifecycle::default());
    // One upstream (and its shared UDP sockets) for the DNS proxy and endpoint resolution.
    let upstream = Arc::new(Upstream::new(config.dns_upstream));
    let visible_names = Arc::new(VisibleNames::new(live.clone(), metrics.clone()));

    // A predecessor still serving hands over its very sockets: nothing waiting in a queue is lost.
    let identity = handover::Identity::current(&config.cgroup)
        .with_context(|| format!("reading the identity of {}", config.cgroup.display()))?;
    let (predecessor, inherited) = bind::inherit(config, identity);
    let dns_parts = dns_parts(config, &families, &upstream, &visible_names, &budgets);
    let bound = bind::bind(config, inherited, &dns_parts).await?;

    let Attached {
        starting,
        cgroups,
        endpoint_hosts,
        fast_path,
        connections,
        mut opt_out,
        inbound,
    } = attach(config, &live, &upstream, &families, predecessor.is_some()).await?;
    let redirector = starting.redirector()?;
    let receiving = hbone::marking_replies(prepared, redirector, &live).await?;
    // Pods that opted out are left alone before the agent calls itself ready.
    opt_out.sync().await;
    visible_names.use_kernel(redirector.maps(), cgroups.clone());
    let proxy_context = Arc::new(proxy_context(
        config,
        redirector,
        &live,
        &families,
        endpoint_hosts,
        cgroups.clone(),
        (&budgets, &connections, hbone),
    ));
    let admin_state = AdminState {
        cgroups: Some(cgroups),
        handover: Some(config.handover.clone()),
        fast_path: fast_path.clone(),
        registry: registry(config, &families, redirector, fast_path.as_ref()),
        phase: lifecycle.admin(),
        live: live.clone(),
        log_level: Some(log_level),
        budgets: Some(budgets.clone()),
        connections: Some(connections),
        in_force: Some(in_force::of(config)),
    };

    if predecessor.is_some() {
        until_in_force(&live).await;
    }
    let held = redirector.held_links();
    let parts = (opt_out, fast_path, held, receiving, inbound);
    let serving = spawn_serving(bound.proxy, bound.dns, &proxy_context, parts, &lifecycle);

    // Offer our sockets to the next agent; when it is ready, stop serving (it serves on them).
    let handover_server = match &config.handover_socket {
        Some(path) => Some(offer_to_successor(
            path,
            identity,
            bound.offer,
            redirector.held_links(),
            lifecycle.clone(),
        )?),
        None => None,
    };
    if let Some(predecessor) = predecessor {
        until_predecessor_stops(predecessor).await?;
    }
    admin::spawn_on(bound.admin, admin_state, lifecycle.admin())
        .context("starting the admin server")?;
    let redirector = starting.done()?;
    lifecycle.enter(Phase::Serving);
    info!(gateway = %config.gateway, proxy_port = config.proxy_port, dns_upstream = %config.dns_upstream, start = ?redirector.start(), "agent running");
    Ok(Running {
        redirector,
        serving,
        inputs,
        lifecycle,
        handover_server,
        budgets,
    })
}

/// The running agent's background parts: the opt-out sync, the fast path, the pins watched,
/// HBONE's receiving side and inbound authorization in the kernel.
type Background = (
    OptOutSync,
    Option<Arc<FastPath>>,
    Option<Arc<crate::redirect::HeldLinks>>,
    Option<hbone::Receiving>,
    KernelInbound,
);

/// The accept loops of the proxies and the DNS proxies (returned, to be awaited when they stop),
/// and the background tasks of the running agent (the opt-out sync, the fast path's upkeep, the
/// watch on the pins); each stops when the agent stops serving.
fn spawn_serving(
    proxies: Vec<tokio::net::TcpListener>,
    dns: Vec<crate::dns::DnsProxy>,
    proxy_context: &Arc<ProxyContext>,
    (opt_out, fast_path, held, receiving, inbound): Background,
    lifecycle: &Lifecycle,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut serving: Vec<_> = proxies
        .into_iter()
        .map(|listener| {
            let proxy = OutboundProxy::new(listener, proxy_context.clone());
            tokio::spawn(proxy.serve(lifecycle.serving()))
        })
        .collect();
    serving.extend(
        dns.into_iter()
            .map(|dns| tokio::spawn(dns.serve(lifecycle.serving()))),
    );
    tokio::spawn(opt_out.run(lifecycle.serving()));
    tokio::spawn(inbound.run(lifecycle.serving()));
    if let Some(fast) = fast_path {
        tokio::spawn(fast.run(lifecycle.serving()));
    }
    if let Some(held) = held {
        tokio::spawn(watch_pins(held, lifecycle.serving()));
    }
    if let Some(receiving) = receiving {
        serving.extend(receiving.spawn(proxy_context, lifecycle));
    }
    tokio::spawn(crate::proxy::recheck_on_change(
        proxy_context.clone(),
        Some(proxy_context.cgroups.clone()),
        lifecycle.serving(),
    ));
    serving
}

/// What every DNS listener shares: the upstream, the names visible to each client, the cache, the
/// budgets and the counters.
fn dns_parts(
    config: &AgentConfig,
    families: &Families,
    upstream: &Arc<Upstream>,
    visible_names: &Arc<VisibleNames>,
    budgets: &Arc<Budgets>,
) -> bind::DnsParts {
    bind::DnsParts {
        upstream: upstream.clone(),
        decide: visible_names.clone(),
        cache: answer_cache(config, families),
        budgets: budgets.clone(),
        metrics: families.dns.clone(),
    }
}

/// One cache of upstream answers for every DNS listener: a family's answers serve the other's
/// askers too.
fn answer_cache(config: &AgentConfig, families: &Families) -> Option<Arc<AnswerCache>> {
    let entries = config.dns_cache?;
    Some(Arc::new(AnswerCache::new(
        entries,
        families.dns.cache_entries(),
    )))
}

/// A successor serves nothing before its configuration is in force: the agent in service,
/// accepting on the same sockets, answers alone until then. With the API as the source the first
/// lists take a moment, and a connection served meanwhile would pass through as if no entry
/// existed.
async fn until_in_force(live: &LiveState) {
    let waited = Instant::now();
    live.in_force().await;
    info!(
        waited_ms = waited.elapsed().as_millis() as u64,
        "configuration in force; serving beside the agent in service"
    );
}

/// Tells the agent in service that this one is ready, and waits until it stopped accepting.
async fn until_predecessor_stops(predecessor: handover::Predecessor) -> anyhow::Result<()> {
    let took = Instant::now();
    tokio::task::spawn_blocking(move || predecessor.ready())
        .await
        .context("hand-over task")?
        .context("the agent in service did not confirm the hand-over")?;
    info!(
        waited_ms = took.elapsed().as_millis() as u64,
        "the agent in service stopped accepting; serving alone"
    );
    Ok(())
}

/// The programs attached, and what had to be ready before they were.
struct Attached {
    /// Detaches them again if start-up fails from here on.
    starting: Starting,
    cgroups: Arc<CgroupPods>,
    /// Endpoint host names: what the agent resolves ahead for the kernel, the proxy uses too.
    endpoint_hosts: Arc<HostCache>,
    fast_path: Option<Arc<FastPath>>,
    /// Where every connection record goes, the kernel's and the proxy's.
    connections: Arc<Connections>,
    opt_out: OptOutSync,
    /// Inbound authorization in the kernel, its first table in force.
    inbound: KernelInbound,
}

/// Reads the pods' cgroups and compiles the kernel's first tables, then attaches the programs (or
/// puts them in a predecessor's links): the first connections find both ready.
async fn attach(
    config: &AgentConfig,
    live: &Arc<LiveState>,
    upstream: &Arc<Upstream>,
    families: &Families,
    has_predecessor: bool,
) -> anyhow::Result<Attached> {
    let metrics = &families.shared;
    let connections = Arc::new(
        Connections::new(config.access_log, families.records.clone())
            .with_istio(families.istio(config, live)),
    );
    let cgroup_root = config.cgroup.clone();
    let cgroups = tokio::task::spawn_blocking(move || CgroupPods::new(cgroup_root))
        .await
        .context("reading the pods' cgroups")?;
    let cgroups = Arc::new(cgroups);
    let endpoint_hosts = Arc::new(HostCache::new(upstream.clone()));
    let (fast_path, fast_tables) = match config.fast_path {
        true => {
            let ahead = Arc::new(Ahead::new(upstream.clone(), endpoint_hosts.clone()));
            let (fast, tables) = FastPath::prepare(
                live.clone(),
                cgroups.clone(),
                ahead,
                metrics.clone(),
                crate::fastpath::Limits::within(config.fast_path_memory),
                connections.clone(),
            )
            .await;
            (Some(fast), Some(tables))
        }
        false => (None, None),
    };
    let redirect = RedirectConfig {
        cgroup: config.cgroup.clone(),
        gateway: config.gateway,
        proxy_port: config.proxy_port,
        dns_proxy_port: config.dns_proxy_port,
        pin_dir: config.pin_dir.clone(),
    };
    let mut fast_maps = None;
    // The first tables go in force before the programs are attached (or swapped in for a
    // predecessor's): the kernel decides from the first connection.
    let redirector = Redirector::attach(&redirect, |ebpf| {
        fast_maps = Some(FastMaps::take_with(
            ebpf,
            fast_tables.as_ref(),
            config.kernel_records.sample(),
        )?);
        Ok(())
    })
    .context("attaching the eBPF programs")?;
    // A start-up error from here on must not leave the programs attached with nobody serving:
    // every steered connection would be refused until a good agent starts. They are detached on
    // the way out, unless a predecessor that still serves owns them (it takes its links back).
    let starting = Starting {
        redirector: Some(redirector),
        detach: !has_predecessor,
    };
    let redirector = starting.redirector()?;
    if let (Some(fast), Some(maps)) = (&fast_path, fast_maps) {
        fast.start(Arc::new(std::sync::Mutex::new(maps)));
    }
    let opt_out = OptOutSync::new(live.clone(), cgroups.clone(), redirector.maps());
    let loaded = redirector
        .inbound()
        .context("loading inbound authorization")?;
    let mut inbound = KernelInbound::new(
        loaded,
        live.clone(),
        cgroups.clone(),
        connections.clone(),
        families.authorizer.clone(),
    );
    inbound.sync().await;
    Ok(Attached {
        starting,
        cgroups,
        endpoint_hosts,
        fast_path,
        connections,
        opt_out,
        inbound,
    })
}

/// What every proxied connection needs, from the agent's configuration and its running parts.
fn proxy_context(
    config: &AgentConfig,
    redirector: &Redirector,
    live: &Arc<LiveState>,
    families: &Families,
    endpoint_hosts: Arc<HostCache>,
    cgroups: Arc<CgroupPods>,
    (budgets, connections, hbone): (&Arc<Budgets>, &Arc<Connections>, Arc<HboneClient>),
) -> ProxyContext {
    ProxyContext {
        flows: redirector.maps(),
        sockets: Arc::new(crate::net::MarkedSockets),
        live: live.clone(),
        metrics: families.shared.clone(),
        proxy_metrics: families.proxy.clone(),
        endpoint_hosts,
        relay: config.relay,
        cgroups,
        budgets: budgets.clone(),
        timeouts: Timeouts {
            idle: config.budget.idle_timeout,
            write: config.budget.write_timeout,
        },
        guard: Arc::new(DialGuard::new(config.deny_destinations.clone())),
        // SO_SNDBUF and SO_RCVBUF are doubled by the kernel (its bookkeeping): ask for half.
        buffer: (config.budget.connection_buffer > 0)
            .then_some(config.budget.connection_buffer / 2),
        records: connections.clone(),
        hbone,
        authorizer: families.authorizer.clone(),
    }
}

/// Listens for a successor at `path`; once one has taken over, the agent is handed over. If a
/// successor dies after putting its programs in our links, ours go back in.
fn offer_to_successor(
    path: &std::path::Path,
    identity: handover::Identity,
    offer: Vec<handover::Socket>,
    held: Option<Arc<crate::redirect::HeldLinks>>,
    lifecycle: Arc<Lifecycle>,
) -> anyhow::Result<handover::Server> {
    let on_ready = move || lifecycle.enter(Phase::HandedOver);
    let on_failed = move || {
        let Some(held) = &held else { return };
        let retaken = held.retake();
        if retaken > 0 {
            warn!(
                links = retaken,
                "the successor died after it took over the links; put our programs back in them"
            );
        }
    };
    handover::Server::start(path, identity, offer, on_ready, on_failed)
        .with_context(|| format!("listening for a successor at {}", path.display()))
}

impl Running {
    /// A signal: detach first, so no new connection is steered to a proxy that is going away; then
    /// stop accepting and wait for the accept loops.
    async fn shut_down(self, signal: &'static str) {
        info!(signal, "shutting down");
        if let Some(server) = self.handover_server {
            server.close();
        }
        match self.redirector.release() {
            Ok(Release::Detached) => info!("eBPF programs detached"),
            Ok(Release::Superseded) => info!("a successor's programs are attached; left them"),
            Err(e) => warn!(error = %e, "detaching the eBPF programs failed"),
        }
        self.lifecycle.enter(Phase::ShuttingDown);
        // While the accept loops end, no longer the status writer.
        let (_, ()) = tokio::join!(futures::future::join_all(self.serving), self.inputs.stop());
        info!("agent stopped");
    }

    /// Handed over: the successor serves and its programs are attached. Ours drain until their end
    /// or the deadline; the process leaves when told to (a DaemonSet would restart a container that
    /// exits on its own, and the restarted one would take over again).
    async fn drain(self, timeout: Duration, signals: &mut Signals) {
        let handed_at = Instant::now();
        info!(
            drain_timeout_s = timeout.as_secs(),
            "handed over to a successor; draining"
        );
        // The successor writes ServiceEntry status from now on, if either of us does.
        let Inputs {
            tasks: inputs,
            status_lease,
            ..
        } = self.inputs;
        if let Some(lease) = status_lease {
            lease.release().await;
        }
        for task in self.serving {
            let _ = task.await;
        }
        let (signal, left) =
            tokio::join!(signals.recv(), drain(&self.budgets, handed_at + timeout));
        info!(signal, "shutting down after the hand-over");
        if left > 0 {
            warn!(
                connections = left,
                "drain deadline passed; resetting what is left"
            );
        } else {
            info!(
                drained_ms = handed_at.elapsed().as_millis() as u64,
                "every connection ended"
            );
        }
        match self.redirector.release() {
            Ok(Release::Superseded) => {}
            Ok(Release::Detached) => warn!("no successor's programs were attached; detached ours"),
            Err(e) => warn!(error = %e, "checking the pinned programs failed"),
        }
        for task in inputs {
            task.abort();
        }
        // Connections still open are dropped with the runtime: reset (linger 0), never a silent FIN.
    }
}

/// The programs attached and the agent not yet running: dropped before [`Starting::done`] (a
/// start-up error), it detaches them unless a live predecessor owns them.
struct Starting {
    redirector: Option<Redirector>,
    detach: bool,
}

impl Starting {
    fn redirector(&self) -> anyhow::Result<&Redirector> {
        self.redirector
            .as_ref()
            .context("the eBPF programs were released during start-up")
    }

    /// Start-up completed: the programs are the running agent's.
    fn done(mut self) -> anyhow::Result<Redirector> {
        self.redirector
            .take()
            .context("the eBPF programs were released during start-up")
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        let Some(redirector) = self.redirector.take() else {
            return;
        };
        if !self.detach {
            warn!("start-up failed; the agent in service keeps the programs");
            return;
        }
        match redirector.release() {
            Ok(Release::Detached) => warn!("start-up failed; eBPF programs detached"),
            Ok(Release::Superseded) => {}
            Err(e) => {
                warn!(error = %e, "start-up failed, and detaching the eBPF programs failed too")
            }
        }
    }
}

/// Says once when the pins of the links this agent holds are gone (the bpf filesystem unmounted
/// under it): the links stay attached while the agent runs, but a successor cannot take over.
async fn watch_pins(held: Arc<crate::redirect::HeldLinks>, mut stop: Watcher) {
    loop {
        tokio::select! {
            () = stop.stopped() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if held.pins_lost_now() {
            warn!(dir = %held.dir().display(), "the pinned links are gone (was the bpf filesystem unmounted?); this agent holds the links itself, so pods stay steered while it runs, but a successor cannot take over and the links go when this agent does: restart it with the bpf filesystem mounted");
        }
    }
}

/// Waits until no proxied connection, DNS forward or DNS client is left, or `deadline`; returns
/// how many proxied connections were left. Each budget wakes it when its last unit goes back.
async fn drain(budgets: &Budgets, deadline: Instant) -> usize {
    let shares = [
        &budgets.connections,
        &budgets.dns_forwards,
        &budgets.dns_tcp_clients,
    ];
    let all_ended = async {
        // Nothing new is accepted while draining: once each has been empty, all are.
        while shares.iter().any(|s| s.used() > 0) {
            for share in shares {
                share.until_empty().await;
            }
        }
    };
    let _ = tokio::time::timeout_at(deadline.into(), all_ended).await;
    budgets.connections.used()
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
