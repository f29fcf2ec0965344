//! The node agent: wires the eBPF redirect, the outbound proxy, the DNS proxy, the configuration
//! reload and the admin server together, and takes them down in the right order; hands its sockets and
//! programs over to a successor (`handover`) and drains.
mod fast_path;
pub mod handover;
mod reload;

use std::{
    net::SocketAddr,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use tokio::sync::{Notify, watch};
use tracing::{info, warn};

pub use reload::{Loaded, Reloader};

use crate::{
    admin::{self, AdminState},
    budget::{BudgetArgs, Budgets, Limits, raise_fd_limit},
    dns::{AnswerCache, DnsProxy, HostCache, Upstream, VisibleNames, ahead::Ahead},
    identity::{CgroupPods, OptOutSync},
    live::LiveState,
    logging::LogLevel,
    metrics::Metrics,
    proxy::{self, DialGuard, OutboundProxy, ProxyContext, RelayMode, Timeouts, access::AccessLog},
    redirect::{Gateways, RedirectConfig, Redirector, Release},
};
use handover::Kind;

#[derive(Debug, Clone)]
pub struct AgentConfig {
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
    /// One info line per proxied connection when it ends.
    pub access_log: bool,
}

/// Runs until SIGINT or SIGTERM.
pub fn run(config: AgentConfig, log_level: LogLevel) -> anyhow::Result<()> {
    let fd_limit = raise_fd_limit();
    let limits = Limits::size(fd_limit, &config.budget);
    info!(?limits, "resource budgets");
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
    let metrics = Arc::new(Metrics::default());
    let budgets = Arc::new(Budgets::new(limits, &metrics));
    let kube = match &config.kube {
        Some(source) => Some(crate::cluster::client_config(source).await?),
        None => None,
    };
    let source = kube
        .as_ref()
        .map(|k| PathBuf::from(crate::cluster::source_name(k)))
        .or_else(|| config.config_dir.clone());
    let live = LiveState::new(source);
    let attached = Arc::new(AtomicBool::new(false));
    // One upstream (and its shared UDP sockets) for the DNS proxy and endpoint resolution.
    let upstream = Arc::new(Upstream::new(config.dns_upstream));
    // One cache for every listener: a family's answers serve the other's askers too.
    let dns_cache = config
        .dns_cache
        .map(|entries| Arc::new(AnswerCache::new(entries, metrics.dns_cache_entries())));

    // The configuration first: when the programs attach, the first answers are already right.
    // A refused first configuration leaves the agent running but not ready, waiting for a fix.
    let reload_task = match config.config_dir.clone() {
        Some(dir) => Some(reload::start(dir, config.limits, live.clone(), metrics.clone()).await),
        None => None,
    };
    let kube_task = match (kube, config.kube.clone()) {
        (Some(client), Some(source)) => Some(crate::cluster::start(
            client,
            source,
            live.clone(),
            metrics.clone(),
        )?),
        _ => None,
    };

    // Bind before attaching: from the moment the programs are attached, a steered connection or
    // query must find someone listening. One listener per gateway address (per family).
    let visible_names = Arc::new(VisibleNames::new(live.clone(), metrics.clone()));
    // A predecessor still serving hands over its very sockets: nothing waiting in a queue is lost.
    let identity = handover::Identity::current(&config.cgroup)
        .with_context(|| format!("reading the identity of {}", config.cgroup.display()))?;
    let (predecessor, mut inherited) = match &config.handover_socket {
        Some(path) => match handover::take_over(path, identity) {
            Ok(Some((predecessor, sockets))) => {
                info!(path = %path.display(), sockets = sockets.len(), "took the listening sockets of the agent in service");
                (Some(predecessor), sockets)
            }
            Ok(None) => (None, Vec::new()),
            Err(e) => {
                warn!(path = %path.display(), error = %e, "asking for a predecessor's sockets failed; binding anew");
                (None, Vec::new())
            }
        },
        None => (None, Vec::new()),
    };
    let mut offer = Vec::new();
    let mut listeners = Vec::new();
    let mut dns_proxies = Vec::new();
    for gateway in config.gateway.addrs() {
        let addr = SocketAddr::new(gateway, config.proxy_port);
        let listener = match take(&mut inherited, Kind::Proxy, addr).pop() {
            Some(fd) => {
                let std = std::net::TcpListener::from(fd);
                std.set_nonblocking(true)?;
                tokio::net::TcpListener::from_std(std)?
            }
            None => proxy::listen(addr)?,
        };
        offer.push(offered(Kind::Proxy, addr, &listener)?);
        listeners.push(listener);
        if let Some(port) = config.dns_proxy_port {
            let addr = SocketAddr::new(gateway, port);
            let decide = visible_names.clone();
            let udp = take(&mut inherited, Kind::DnsUdp, addr);
            let mut tcp = take(&mut inherited, Kind::DnsTcp, addr);
            let dns = match tcp.pop() {
                Some(tcp) if !udp.is_empty() => DnsProxy::from_sockets(
                    udp.into_iter().map(std::net::UdpSocket::from).collect(),
                    std::net::TcpListener::from(tcp),
                    upstream.clone(),
                    decide,
                    metrics.clone(),
                )?,
                _ => DnsProxy::bind(addr, upstream.clone(), decide, metrics.clone()).await?,
            };
            let (udp, tcp) = dns.socket_fds()?;
            offer.extend(udp.into_iter().map(|fd| handover::Socket {
                kind: Kind::DnsUdp,
                addr,
                fd,
            }));
            offer.push(handover::Socket {
                kind: Kind::DnsTcp,
                addr,
                fd: tcp,
            });
            let dns = match &dns_cache {
                Some(cache) => dns.with_cache(cache.clone()),
                None => dns,
            };
            dns_proxies.push(dns.with_budgets(budgets.clone()));
        }
    }
    let admin_listener = match take(&mut inherited, Kind::Admin, config.admin).pop() {
        Some(fd) => std::net::TcpListener::from(fd),
        None => admin::bind(config.admin, config.admin_allow_non_loopback)?,
    };
    offer.push(offered(Kind::Admin, config.admin, &admin_listener)?);
    for unused in &inherited {
        info!(kind = ?unused.kind, addr = %unused.addr, "a predecessor's socket this configuration does not use; closing our copy");
    }
    drop(inherited);
    // Which pod each cgroup is, read before attaching: the first connections find it ready.
    let cgroup_root = config.cgroup.clone();
    let cgroups = tokio::task::spawn_blocking(move || CgroupPods::new(cgroup_root))
        .await
        .context("reading the pods' cgroups")?;
    let cgroups = Arc::new(cgroups);
    // One cache of endpoint host names: what the agent resolves ahead for the kernel, the proxy
    // uses too.
    let endpoint_hosts = Arc::new(HostCache::new(upstream.clone()));
    // The kernel's first tables before the programs attach (or replace a predecessor's): its
    // first answers are the fast ones.
    let (fast_path, fast_tables) = match config.fast_path {
        true => {
            let ahead = Arc::new(Ahead::new(upstream.clone(), endpoint_hosts.clone()));
            let (fast, tables) =
                fast_path::FastPath::prepare(live.clone(), cgroups.clone(), ahead, metrics.clone())
                    .await;
            (Some(fast), Some(tables))
        }
        false => (None, None),
    };
    let redirector = Redirector::attach(&RedirectConfig {
        cgroup: config.cgroup.clone(),
        gateway: config.gateway,
        proxy_port: config.proxy_port,
        dns_proxy_port: config.dns_proxy_port,
        pin_dir: config.pin_dir.clone(),
        fast_tables,
    })
    .context("attaching the eBPF programs")?;
    // A start-up error from here on must not leave the programs attached with nobody serving:
    // every steered connection would be refused until a good agent starts. They are detached on
    // the way out, unless a predecessor that still serves owns them (it takes its links back).
    let starting = Starting {
        redirector: Some(redirector),
        detach: predecessor.is_none(),
    };
    let redirector = starting.redirector()?;
    if let Some(fast) = &fast_path {
        fast.start(redirector.fast_maps());
    }
    // Pods that opted out are left alone before the agent calls itself ready.
    let mut opt_out = OptOutSync::new(live.clone(), cgroups.clone(), redirector.maps());
    opt_out.sync().await;
    visible_names.use_kernel(redirector.maps(), cgroups.clone());
    let proxy_context = Arc::new(ProxyContext {
        flows: redirector.maps(),
        sockets: Arc::new(crate::net::MarkedSockets),
        live: live.clone(),
        metrics: metrics.clone(),
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
        access_log: AccessLog::new(config.access_log),
    });
    let proxies: Vec<OutboundProxy> = listeners
        .into_iter()
        .map(|listener| OutboundProxy::new(listener, proxy_context.clone()))
        .collect();

    let mut registry = metrics.registry(Some(redirector.maps()));
    let handover_available = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    handover_available.set(i64::from(config.handover.available));
    registry.register(
        "handover_available",
        "1 when a successor can take over (pinned on a bpf filesystem); 0: a restart or rollout drops connections",
        handover_available,
    );
    if let Some(fast) = &fast_path {
        registry.register_collector(fast.collector());
    }
    let fast_path_dump = fast_path
        .clone()
        .map(|fast| Box::new(move || fast.dump()) as Box<dyn Fn() -> _ + Send + Sync>);
    let admin_state = AdminState {
        cgroups: Some(proxy_context.cgroups.clone()),
        handover: Some(config.handover.clone()),
        fast_path: fast_path_dump,
        registry,
        attached: attached.clone(),
        live: live.clone(),
        log_level: Some(log_level),
        budgets: Some(budgets.clone()),
    };

    // A successor serves nothing before its configuration is in force: the agent in service, accepting
    // on the same sockets, answers alone until then. With the API as the source the first lists take
    // a moment, and a connection served meanwhile would pass through as if no entry existed.
    if predecessor.is_some() {
        let waited = Instant::now();
        while !live.has_config() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        info!(
            waited_ms = waited.elapsed().as_millis() as u64,
            "configuration in force; serving beside the agent in service"
        );
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let proxy_tasks: Vec<_> = proxies
        .into_iter()
        .map(|proxy| tokio::spawn(proxy.serve(stop_rx.clone())))
        .collect();
    tokio::spawn(opt_out.run(stop_rx.clone()));
    if let Some(fast) = fast_path {
        tokio::spawn(fast.run(stop_rx.clone()));
    }
    let dns_tasks: Vec<_> = dns_proxies
        .into_iter()
        .map(|dns| tokio::spawn(dns.serve(stop_rx.clone())))
        .collect();

    // Offer our sockets to the next agent; when it is ready, stop serving (it serves on them).
    let stop_tx = Arc::new(stop_tx);
    let (admin_stop, admin_stopped) = watch::channel(false);
    let handed_over = Arc::new(Notify::new());
    let handover_server = match &config.handover_socket {
        Some(path) => {
            let (stop_tx, attached, handed_over) =
                (stop_tx.clone(), attached.clone(), handed_over.clone());
            let held = redirector.held_links();
            let on_failed = move || {
                // The successor may have put its programs in our links before it died.
                if let Some(held) = &held {
                    let retaken = held.retake();
                    if retaken > 0 {
                        warn!(
                            links = retaken,
                            "the successor died after it took over the links; put our programs back in them"
                        );
                    }
                }
            };
            let server = handover::Server::start(
                path,
                identity,
                offer,
                move || {
                    attached.store(false, Ordering::Release);
                    let _ = stop_tx.send(true);
                    let _ = admin_stop.send(true);
                    handed_over.notify_one();
                },
                on_failed,
            )
            .with_context(|| format!("listening for a successor at {}", path.display()))?;
            Some(server)
        }
        None => {
            drop(offer);
            None
        }
    };
    if let Some(predecessor) = predecessor {
        let took = Instant::now();
        tokio::task::spawn_blocking(move || predecessor.ready())
            .await
            .context("hand-over task")?
            .context("the agent in service did not confirm the hand-over")?;
        info!(
            waited_ms = took.elapsed().as_millis() as u64,
            "the agent in service stopped accepting; serving alone"
        );
    }
    admin::spawn_on(admin_listener, admin_state, admin_stopped)
        .context("starting the admin server")?;
    let redirector = starting.done()?;
    if let Some(held) = redirector.held_links() {
        tokio::spawn(watch_pins(held, stop_rx.clone()));
    }
    attached.store(true, Ordering::Release);
    info!(gateway = %config.gateway, proxy_port = config.proxy_port, dns_upstream = %config.dns_upstream, start = ?redirector.start(), "agent running");

    let signal = tokio::select! {
        signal = signals.recv() => Some(signal),
        () = handed_over.notified() => None,
    };
    if let Some(signal) = signal {
        info!(signal, "shutting down");
        attached.store(false, Ordering::Release);
        if let Some(server) = handover_server {
            server.close();
        }
        // Detach first so no new connection is steered to a proxy that is going away.
        match redirector.release() {
            Ok(Release::Detached) => info!("eBPF programs detached"),
            Ok(Release::Superseded) => info!("a successor's programs are attached; left them"),
            Err(e) => warn!(error = %e, "detaching the eBPF programs failed"),
        }
        let _ = stop_tx.send(true);
        for task in proxy_tasks.into_iter().chain(dns_tasks) {
            let _ = task.await;
        }
        for task in reload_task.into_iter().chain(kube_task) {
            task.abort();
        }
        info!("agent stopped");
        return Ok(());
    }

    // Handed over: the successor serves and its programs are attached. Ours drain until their end
    // or the deadline; the process leaves when told to (a DaemonSet would restart a container that
    // exits on its own, and the restarted one would take over again).
    let handed_at = Instant::now();
    info!(
        drain_timeout_s = config.drain_timeout.as_secs(),
        "handed over to a successor; draining"
    );
    for task in proxy_tasks.into_iter().chain(dns_tasks) {
        let _ = task.await;
    }
    let deadline = handed_at + config.drain_timeout;
    let (signal, left) = tokio::join!(signals.recv(), drain(&budgets, deadline));
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
    match redirector.release() {
        Ok(Release::Superseded) => {}
        Ok(Release::Detached) => warn!("no successor's programs were attached; detached ours"),
        Err(e) => warn!(error = %e, "checking the pinned programs failed"),
    }
    for task in reload_task.into_iter().chain(kube_task) {
        task.abort();
    }
    // Connections still open are dropped with the runtime: reset (linger 0), never a silent FIN.
    Ok(())
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
async fn watch_pins(held: Arc<crate::redirect::HeldLinks>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if held.pins_lost_now() {
            warn!(dir = %held.dir().display(), "the pinned links are gone (was the bpf filesystem unmounted?); this agent holds the links itself, so pods stay steered while it runs, but a successor cannot take over and the links go when this agent does: restart it with the bpf filesystem mounted");
        }
    }
}

/// Waits until no proxied connection, DNS forward or DNS client is left, or `deadline`; returns
/// how many proxied connections were left.
async fn drain(budgets: &Budgets, deadline: Instant) -> usize {
    loop {
        let connections = budgets.connections.used();
        let busy = connections + budgets.dns_forwards.used() + budgets.dns_tcp_clients.used();
        if busy == 0 || Instant::now() >= deadline {
            return connections;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Takes the handed-over sockets of `kind` bound to `addr`.
fn take(inherited: &mut Vec<handover::Socket>, kind: Kind, addr: SocketAddr) -> Vec<OwnedFd> {
    let (matching, rest): (Vec<_>, Vec<_>) = std::mem::take(inherited)
        .into_iter()
        .partition(|s| s.kind == kind && s.addr == addr);
    *inherited = rest;
    matching.into_iter().map(|s| s.fd).collect()
}

fn offered(kind: Kind, addr: SocketAddr, socket: &impl AsFd) -> anyhow::Result<handover::Socket> {
    Ok(handover::Socket {
        kind,
        addr,
        fd: socket
            .as_fd()
            .try_clone_to_owned()
            .context("duplicating a listening socket for the hand-over")?,
    })
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
