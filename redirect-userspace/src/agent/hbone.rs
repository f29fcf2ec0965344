//! The agent's HBONE parts: the client with the Pods' certificates from the source configured,
//! and, with `--hbone-between-nodes`, the receiving side for this node's Pods: the transparent
//! listener on 15008, and the routes that bring it what peers send to the Pods, kept in step with
//! the Pods of each snapshot.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
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
    redirect::pod_routes::PodRoutes,
};

/// The listener and the routing, in place before the agent calls itself ready.
pub(super) struct Receiving {
    listener: TcpListener,
    routes: PodRoutes,
}

/// Listens on 15008 (beside a predecessor's listener during a hand-over) and puts the routing in
/// place. Fails when either cannot be had: `CAP_NET_ADMIN` in the node's netns is needed.
pub(super) async fn prepare() -> anyhow::Result<Receiving> {
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, crate::hbone::PORT));
    let listener = listen_transparent(addr)
        .with_context(|| format!("listening for HBONE on {addr} (IP_TRANSPARENT)"))?;
    let routes = PodRoutes::install(crate::hbone::PORT)
        .await
        .context("routing HBONE for this node's Pods to the agent (rule and table 15008)")?;
    Ok(Receiving { listener, routes })
}

impl Receiving {
    /// Serves the listener, and keeps a route for each Pod of the node of every snapshot applied.
    pub(super) fn spawn(
        self,
        proxy: &Arc<ProxyContext>,
        lifecycle: &Lifecycle,
    ) -> [JoinHandle<()>; 2] {
        let live = proxy.live.clone();
        info!(
            port = crate::hbone::PORT,
            "receiving HBONE for this node's Pods"
        );
        [
            tokio::spawn(serve_inbound(
                self.listener,
                proxy.clone(),
                lifecycle.serving(),
            )),
            tokio::spawn(keep_routes(self.routes, live, lifecycle.serving())),
        ]
    }
}

/// Syncs the routes with each snapshot until the agent stops: then takes them away, unless a
/// successor took over (it put them in place again as it started, and serves them now).
async fn keep_routes(mut routes: PodRoutes, live: Arc<LiveState>, mut stop: Watcher) {
    let mut applied = live.applied();
    loop {
        let pods: BTreeSet<Ipv4Addr> = live
            .snapshot()
            .local_pod_addresses()
            .filter_map(|ip| match ip {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            })
            .collect();
        let failed = match routes.sync(pods).await {
            Ok(()) => false,
            Err(e) => {
                warn!(error = %e, "routing HBONE to this node's Pods failed; tried again in 5 s or with the next change");
                true
            }
        };
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
