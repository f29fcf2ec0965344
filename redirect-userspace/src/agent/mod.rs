//! The node agent: wires the eBPF redirect, the outbound proxy, the DNS proxy, the configuration
//! reload and the admin server together, and takes them down in the right order.
mod reload;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::Context;
use tokio::sync::watch;
use tracing::info;

pub use reload::{Loaded, Reloader};

use crate::{
    admin::{self, AdminState},
    budget::{BudgetArgs, Budgets, Limits, raise_fd_limit},
    dns::{DnsProxy, HostCache, Upstream, VisibleNames},
    identity::{CgroupPods, OptOutSync},
    live::LiveState,
    logging::LogLevel,
    metrics::Metrics,
    proxy::{self, OutboundProxy, ProxyContext, RelayMode, Timeouts},
    redirect::{Gateways, RedirectConfig, Redirector},
};

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
    pub admin: SocketAddr,
    pub admin_allow_non_loopback: bool,
    pub relay: RelayMode,
    /// Caps and timeouts; the caps not given are sized from the open-files limit.
    pub budget: BudgetArgs,
    /// Input bounds of each configuration load.
    pub limits: crate::config::Limits,
    /// Learn the configuration from the Kubernetes API instead of `config_dir`.
    pub kube: Option<crate::cluster::Source>,
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
    // One upstream (and one pool of its sockets) for the DNS proxy and endpoint resolution.
    let upstream = Arc::new(Upstream::new(config.dns_upstream));

    // The configuration first: when the programs attach, the first answers are already right.
    // A refused first configuration leaves the agent running but not ready, waiting for a fix.
    let reload_task = match config.config_dir.clone() {
        Some(dir) => Some(reload::start(dir, config.limits, live.clone(), metrics.clone()).await),
        None => None,
    };
    let kube_task = match (kube, config.kube.clone()) {
        (Some(client), Some(source)) => Some(crate::cluster::start(
            client,
            source.mesh,
            live.clone(),
            metrics.clone(),
        )?),
        _ => None,
    };

    // Bind before attaching: from the moment the programs are attached, a steered connection or
    // query must find someone listening. One listener per gateway address (per family).
    let visible_names = Arc::new(VisibleNames {
        live: live.clone(),
        metrics: metrics.clone(),
    });
    let mut listeners = Vec::new();
    let mut dns_proxies = Vec::new();
    for gateway in config.gateway.addrs() {
        listeners.push(proxy::listen(SocketAddr::new(gateway, config.proxy_port))?);
        if let Some(port) = config.dns_proxy_port {
            let addr = SocketAddr::new(gateway, port);
            let decide = visible_names.clone();
            dns_proxies.push(
                DnsProxy::bind(addr, upstream.clone(), decide, metrics.clone())
                    .await?
                    .with_budgets(budgets.clone()),
            );
        }
    }
    // Which pod each cgroup is, read before attaching: the first connections find it ready.
    let cgroup_root = config.cgroup.clone();
    let cgroups = tokio::task::spawn_blocking(move || CgroupPods::new(cgroup_root))
        .await
        .context("reading the pods' cgroups")?;
    let redirector = Redirector::attach(&RedirectConfig {
        cgroup: config.cgroup.clone(),
        gateway: config.gateway,
        proxy_port: config.proxy_port,
        dns_proxy_port: config.dns_proxy_port,
    })
    .context("attaching the eBPF programs")?;
    let cgroups = Arc::new(cgroups);
    // Pods that opted out are left alone before the agent calls itself ready.
    let mut opt_out = OptOutSync::new(live.clone(), cgroups.clone(), redirector.maps());
    opt_out.sync().await;
    let proxy_context = Arc::new(ProxyContext {
        redirect_maps: redirector.maps(),
        live: live.clone(),
        metrics: metrics.clone(),
        endpoint_hosts: Arc::new(HostCache::new(upstream)),
        relay: config.relay,
        cgroups,
        budgets: budgets.clone(),
        timeouts: Timeouts {
            idle: config.budget.idle_timeout,
            write: config.budget.write_timeout,
        },
    });
    let proxies: Vec<OutboundProxy> = listeners
        .into_iter()
        .map(|listener| OutboundProxy::new(listener, proxy_context.clone()))
        .collect();

    admin::spawn(
        config.admin,
        config.admin_allow_non_loopback,
        AdminState {
            registry: metrics.registry(Some(redirector.maps())),
            attached: attached.clone(),
            live: live.clone(),
            log_level: Some(log_level),
            budgets: Some(budgets),
        },
    )?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let proxy_tasks: Vec<_> = proxies
        .into_iter()
        .map(|proxy| tokio::spawn(proxy.serve(stop_rx.clone())))
        .collect();
    tokio::spawn(opt_out.run(stop_rx.clone()));
    let dns_tasks: Vec<_> = dns_proxies
        .into_iter()
        .map(|dns| tokio::spawn(dns.serve(stop_rx.clone())))
        .collect();
    attached.store(true, Ordering::Release);
    info!(gateway = %config.gateway, proxy_port = config.proxy_port, dns_upstream = %config.dns_upstream, "agent running");

    let signal = shutdown_signal().await?;
    info!(signal, "shutting down");
    attached.store(false, Ordering::Release);
    // Detach first so no new connection is steered to a proxy that is going away.
    drop(redirector);
    let _ = stop_tx.send(true);
    for task in proxy_tasks.into_iter().chain(dns_tasks) {
        let _ = task.await;
    }
    for task in reload_task.into_iter().chain(kube_task) {
        task.abort();
    }
    info!("eBPF programs detached; agent stopped");
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}
