//! The node agent: wires the eBPF redirect, the outbound proxy and the admin server together, and
//! takes them down in the right order.
use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::Context;
use tokio::sync::watch;
use tracing::info;

use crate::{
    admin::{self, AdminState},
    metrics::Metrics,
    proxy::{self, OutboundProxy, ProxyContext},
    redirect::{RedirectConfig, Redirector},
};

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub cgroup: PathBuf,
    pub gateway: Ipv4Addr,
    pub proxy_port: u16,
    pub admin: SocketAddr,
    pub admin_allow_non_loopback: bool,
}

/// Runs until SIGINT or SIGTERM.
pub fn run(config: AgentConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("proxy")
        .build()
        .context("starting the proxy runtime")?;
    runtime.block_on(run_async(config))?;
    // Connection tasks still running are dropped with the runtime: their sockets close.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(())
}

async fn run_async(config: AgentConfig) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));

    let redirect_config = RedirectConfig {
        cgroup: config.cgroup.clone(),
        gateway: config.gateway,
        proxy_port: config.proxy_port,
        dns_proxy_port: None,
    };
    // Bind before attaching: from the moment the programs are attached, a steered connection must
    // find the proxy listening.
    let proxy_addr = SocketAddr::from((config.gateway, config.proxy_port));
    let listener = proxy::listen(proxy_addr)?;
    let redirector = Redirector::attach(&redirect_config).context("attaching the eBPF programs")?;
    let proxy = OutboundProxy::new(
        listener,
        Arc::new(ProxyContext {
            redirect_maps: redirector.maps(),
            metrics: metrics.clone(),
        }),
    );

    admin::spawn(
        config.admin,
        config.admin_allow_non_loopback,
        AdminState {
            registry: metrics.registry(Some(redirector.maps())),
            ready: ready.clone(),
        },
    )?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let proxy_task = tokio::spawn(proxy.serve(stop_rx));
    ready.store(true, Ordering::Release);
    info!(proxy = %proxy_addr, "agent ready");

    let signal = shutdown_signal().await?;
    info!(signal, "shutting down");
    ready.store(false, Ordering::Release);
    // Detach first so no new connection is steered to a proxy that is going away.
    drop(redirector);
    let _ = stop_tx.send(true);
    let _ = proxy_task.await;
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
