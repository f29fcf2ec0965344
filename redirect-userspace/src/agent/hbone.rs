//! The agent's HBONE parts: the client with the Pods' certificates from the source configured,
//! and, with `--hbone-between-nodes`, the receiving side for this node's Pods: the transparent
//! listener on 15008, the routes that bring it what peers send to the Pods, kept in step with the
//! Pods of each snapshot, and the marking of the answers to sockets bound to Pods' addresses, kept
//! on every link of the node.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use anyhow::Context;
use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{info, warn};

use super::{AgentConfig, Families};
use crate::{
    drain::{Lifecycle, Phase, Watcher},
    hbone::HboneClient,
    live::LiveState,
    proxy::{ProxyContext, listen_transparent, serve_inbound},
    redirect::{
        Redirector,
        hbone_replies::{HboneSources, ReplyMarker},
        pod_routes::PodRoutes,
    },
};

/// The listener and the routing, in place before the programs are attached.
pub(super) struct Prepared {
    listeners: Listeners,
    routes: PodRoutes,
}

/// The transparent listeners on 15008: IPv4, and IPv6 where the node has it.
struct Listeners {
    v4: TcpListener,
    v6: Option<TcpListener>,
}

/// The listener, the routing and the marking, in place before the agent calls itself ready.
pub(super) struct Receiving {
    listeners: Listeners,
    routing: Routing,
    sources: Arc<HboneSources>,
}

/// What is kept in step with the node: routes for its Pods, the marking on its links.
struct Routing {
    routes: PodRoutes,
    marker: ReplyMarker,
}

/// With HBONE between nodes, listens on 15008 (beside a predecessor's listener during a
/// hand-over) and puts the routing in place. Fails when either cannot be had: `CAP_NET_ADMIN` in
/// the node's netns is needed.
pub(super) async fn prepare(config: &AgentConfig) -> anyhow::Result<Option<Prepared>> {
    if config.hbone_node.is_none() {
        return Ok(None);
    }
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, crate::hbone::PORT));
    let v4 = listen_transparent(addr)
        .with_context(|| format!("listening for HBONE on {addr} (IP_TRANSPARENT)"))?;
    let addr = SocketAddr::from((Ipv6Addr::UNSPECIFIED, crate::hbone::PORT));
    // A node without IPv6 has no IPv6 Pods to receive for.
    let v6 = match listen_transparent(addr) {
        Ok(listener) => Some(listener),
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            warn!(error = %e, "no IPv6 on this node: HBONE is received for its Pods' IPv4 addresses only");
            None
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("listening for HBONE on {addr} (IPV6_TRANSPARENT)"));
        }
    };
    let listeners = Listeners { v4, v6 };
    let routes = PodRoutes::install(crate::hbone::PORT)
        .await
        .context("routing HBONE for this node's Pods to the agent (rule and table 15008)")?;
    Ok(Some(Prepared { listeners, routes }))
}

/// What was prepared, with the marking of answers loaded from the agent's object and put on the
/// node's links.
pub(super) async fn marking_replies(
    prepared: Option<Prepared>,
    redirector: &Redirector,
    live: &LiveState,
) -> anyhow::Result<Option<Receiving>> {
    match prepared {
        Some(prepared) => Ok(Some(prepared.marking_replies(redirector, live).await?)),
        None => Ok(None),
    }
}

impl Prepared {
    async fn marking_replies(
        mut self,
        redirector: &Redirector,
        live: &LiveState,
    ) -> anyhow::Result<Receiving> {
        // Routed before the agent calls itself ready: a peer that dials a Pod of this node at
        // once reaches the agent, not the Pod's closed port 15008.
        if let Err(e) = self.routes.sync(local_pods(live)).await {
            warn!(error = %e, "routing HBONE to this node's Pods failed; tried again in 5 s");
        }
        let (mut marker, sources) = redirector
            .hbone_replies()
            .context("loading hbone_replies (HBONE between nodes keeps the Pods' addresses)")?;
        let links = marker
            .sync()
            .await
            .context("listing the node's links for hbone_replies")?;
        if links.on == 0 && links.missing > 0 {
            anyhow::bail!(
                "hbone_replies could not be attached to any of the node's {} links (tc ingress: TCX from Linux 6.6, else the clsact qdisc); the answers to Pods' addresses would be lost",
                links.missing
            );
        }
        info!(
            links = links.on,
            failed = links.missing,
            "answers to the agent's HBONE sockets are marked on the node's links"
        );
        Ok(Receiving {
            listeners: self.listeners,
            routing: Routing {
                routes: self.routes,
                marker,
            },
            sources,
        })
    }
}

impl Receiving {
    /// Serves the listeners, and keeps a route for each Pod of the node of every snapshot applied.
    pub(super) fn spawn(
        self,
        proxy: &Arc<ProxyContext>,
        lifecycle: &Lifecycle,
    ) -> Vec<JoinHandle<()>> {
        let live = proxy.live.clone();
        info!(
            port = crate::hbone::PORT,
            ipv6 = self.listeners.v6.is_some(),
            "receiving HBONE for this node's Pods"
        );
        let serve = |listener| {
            tokio::spawn(serve_inbound(
                listener,
                proxy.clone(),
                self.sources.clone(),
                lifecycle.serving(),
            ))
        };
        let mut tasks = vec![serve(self.listeners.v4)];
        tasks.extend(self.listeners.v6.map(serve));
        tasks.push(tokio::spawn(keep_routing(
            self.routing,
            live,
            lifecycle.serving(),
        )));
        tasks
    }
}

/// Syncs the routes and the marking with each snapshot (a new Pod comes with a new link) until
/// the agent stops: then takes the routing away, unless a successor took over (it put it in
/// place again as it started, and serves it now). The marking goes with the agent's object.
async fn keep_routing(routing: Routing, live: Arc<LiveState>, mut stop: Watcher) {
    let Routing {
        mut routes,
        mut marker,
    } = routing;
    let mut applied = live.applied();
    loop {
        let mut failed = match routes.sync(local_pods(&live)).await {
            Ok(()) => false,
            Err(e) => {
                warn!(error = %e, "routing HBONE to this node's Pods failed; tried again in 5 s or with the next change");
                true
            }
        };
        match marker.sync().await {
            Ok(links) => failed |= links.missing > 0,
            Err(e) => {
                warn!(error = %e, "listing the node's links for hbone_replies failed; tried again in 5 s or with the next change");
                failed = true;
            }
        }
        let retry = async {
            match failed {
                true => tokio::time::sleep(std::time::Duration::from_secs(5)).await,
                false => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = applied.changed() => if changed.is_err() { break },
            () = retry => {}
            () = stop.stopped() => break,
        }
    }
    if stop.phase() == Phase::HandedOver {
        return;
    }
    match routes.remove().await {
        Ok(()) => info!("took away the routing of HBONE for this node's Pods"),
        Err(e) => warn!(error = %e, "taking away the routing of HBONE failed"),
    }
}

/// The addresses of this node's Pods in the configuration in force.
fn local_pods(live: &LiveState) -> BTreeSet<IpAddr> {
    live.snapshot().local_pod_addresses().collect()
}

/// The HBONE client, with the node's pods' certificates from the source configured (a bad one
/// stops the agent here, before anything is attached).
pub(super) fn client(
    config: &AgentConfig,
    live: &Arc<LiveState>,
    families: &Families,
) -> anyhow::Result<Arc<HboneClient>> {
    let workload_certs = match &config.cert_source {
        Some(source) => Some(Arc::new(crate::hbone::WorkloadCerts::open(
            source.clone(),
            trust_domain(config, live),
            families.hbone.clone(),
        )?)),
        None => None,
    };
    Ok(Arc::new(HboneClient::new(
        workload_certs,
        Arc::new(crate::net::MarkedSockets),
        families.hbone.clone(),
    )))
}

/// The trust domain of the workload identities: the flag's, else the mesh config's as it is at
/// the first tunnel (for an API source the mesh config may not be in force yet as the agent
/// starts), else `cluster.local`. Kept once chosen.
fn trust_domain(config: &AgentConfig, live: &Arc<LiveState>) -> Arc<crate::hbone::TrustDomain> {
    use crate::hbone::{DEFAULT_TRUST_DOMAIN, TrustDomain};
    Arc::new(match &config.trust_domain {
        Some(domain) => TrustDomain::fixed(domain.clone()),
        None => {
            let live = live.clone();
            TrustDomain::chosen_by(move || {
                let snapshot = live.snapshot();
                snapshot
                    .trust_domain()
                    .unwrap_or(DEFAULT_TRUST_DOMAIN)
                    .to_string()
            })
        }
    })
}
