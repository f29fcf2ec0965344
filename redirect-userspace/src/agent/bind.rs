//! The agent's listening sockets: a predecessor's when one hands them over, otherwise bound anew,
//! one set per gateway address. Bound before the programs attach: from the moment they are, a
//! steered connection or query must find someone listening.
use std::{
    net::SocketAddr,
    os::fd::{AsFd, OwnedFd},
    sync::Arc,
};

use anyhow::Context;
use tracing::{info, warn};

use super::{
    AgentConfig,
    handover::{self, Kind, Predecessor},
};
use crate::{
    budget::Budgets,
    dns::{AnswerCache, DnsMetrics, DnsProxy, Upstream, VisibleNames},
    proxy,
};

/// What the DNS proxies share.
pub(super) struct DnsParts {
    pub upstream: Arc<Upstream>,
    pub decide: Arc<VisibleNames>,
    pub cache: Option<Arc<AnswerCache>>,
    pub budgets: Arc<Budgets>,
    pub metrics: Arc<DnsMetrics>,
}

/// Every listening socket of the agent, and copies of them to offer a successor.
pub(super) struct Bound {
    pub proxy: Vec<tokio::net::TcpListener>,
    pub dns: Vec<DnsProxy>,
    pub admin: crate::admin::Listeners,
    pub offer: Vec<handover::Socket>,
}

/// Asks the agent in service, if one listens on the hand-over socket, for its listening sockets.
pub(super) fn inherit(
    config: &AgentConfig,
    me: handover::Identity,
) -> (Option<Predecessor>, Vec<handover::Socket>) {
    let Some(path) = &config.handover_socket else {
        return (None, Vec::new());
    };
    match handover::take_over(path, me) {
        Ok(Some((predecessor, sockets))) => {
            info!(path = %path.display(), sockets = sockets.len(), "took the listening sockets of the agent in service");
            (Some(predecessor), sockets)
        }
        Ok(None) => (None, Vec::new()),
        Err(e) => {
            warn!(path = %path.display(), error = %e, "asking for a predecessor's sockets failed; binding anew");
            (None, Vec::new())
        }
    }
}

/// The proxy, DNS, admin and stats listeners: the inherited ones where they match, new ones otherwise.
/// Inherited sockets this configuration does not use are closed.
pub(super) async fn bind(
    config: &AgentConfig,
    mut inherited: Vec<handover::Socket>,
    dns: &DnsParts,
) -> anyhow::Result<Bound> {
    let mut bound = Bound {
        proxy: Vec::new(),
        dns: Vec::new(),
        admin: crate::admin::Listeners {
            admin: match take(&mut inherited, Kind::Admin, config.admin).pop() {
                Some(fd) => std::net::TcpListener::from(fd),
                None => crate::admin::bind(config.admin, config.admin_allow_non_loopback)?,
            },
            stats: match config.stats {
                Some(addr) => Some(match take(&mut inherited, Kind::Stats, addr).pop() {
                    Some(fd) => std::net::TcpListener::from(fd),
                    None => crate::admin::bind_stats(addr)?,
                }),
                None => None,
            },
        },
        offer: Vec::new(),
    };
    bound
        .offer
        .push(offered(Kind::Admin, config.admin, &bound.admin.admin)?);
    if let (Some(addr), Some(stats)) = (config.stats, &bound.admin.stats) {
        bound.offer.push(offered(Kind::Stats, addr, stats)?);
    }
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
        bound.offer.push(offered(Kind::Proxy, addr, &listener)?);
        bound.proxy.push(listener);
        if let Some(port) = config.dns_proxy_port {
            let addr = SocketAddr::new(gateway, port);
            let proxy = bind_dns(addr, &mut inherited, dns, &mut bound.offer).await?;
            bound.dns.push(proxy);
        }
    }
    for unused in &inherited {
        info!(kind = ?unused.kind, addr = %unused.addr, "a predecessor's socket this configuration does not use; closing our copy");
    }
    Ok(bound)
}

/// One DNS proxy on `addr` (its UDP group and TCP listener), offered to a successor.
async fn bind_dns(
    addr: SocketAddr,
    inherited: &mut Vec<handover::Socket>,
    parts: &DnsParts,
    offer: &mut Vec<handover::Socket>,
) -> anyhow::Result<DnsProxy> {
    let decide = parts.decide.clone();
    let udp = take(inherited, Kind::DnsUdp, addr);
    let mut tcp = take(inherited, Kind::DnsTcp, addr);
    let dns = match tcp.pop() {
        Some(tcp) if !udp.is_empty() => DnsProxy::from_sockets(
            udp.into_iter().map(std::net::UdpSocket::from).collect(),
            std::net::TcpListener::from(tcp),
            parts.upstream.clone(),
            decide,
            parts.metrics.clone(),
        )?,
        _ => DnsProxy::bind(addr, parts.upstream.clone(), decide, parts.metrics.clone()).await?,
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
    let dns = match &parts.cache {
        Some(cache) => dns.with_cache(cache.clone()),
        None => dns,
    };
    Ok(dns.with_budgets(parts.budgets.clone()))
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
