//! The outbound proxy: accepts the connections the kernel steered to it, finds where each client
//! meant to go (the flow the kernel filed), decides as the snapshot says, then connects and relays
//! within the client's budgets, counting and logging each connection once.
use std::{
    io,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::{debug, warn};

use super::{
    Authorizer, DialGuard, Direction, Pipes, RelayError, RelayMode, Timeout, Timeouts,
    authorize::{Authorized, Inbound, Path, pod_identity},
    record::ConnectionResult,
    relay,
    relay::Carried,
    splice_relay,
    tunnel_relay::relay_tunnel,
};
use crate::{
    budget::{BudgetKind, Budgets, Ceiling, FDS_PER_CONNECTION, FdCharge, Permit, Refusal},
    config::Workload,
    dns::HostCache,
    hbone::{HboneClient, Identity},
    identity::{CgroupPods, Check, Client},
    live::LiveState,
    metrics::{Lookup, Metrics},
    net::{CONNECT_TIMEOUT, SocketFactory},
    proxy::ProxyMetrics,
    records::{Connections, Name, ends},
    redirect::Flows,
    state::{Outbound, OutboundOutcome, Snapshot, Target},
};

/// Pending connections the kernel queues for us: bursts of new connections from many pods.
const BACKLOG: u32 = 4096;

/// What every connection task needs.
#[derive(Debug)]
pub(crate) struct ProxyContext {
    /// Where each client meant to go, as the kernel filed it.
    pub flows: Arc<dyn Flows>,
    /// Where the upstream sockets come from (the agent's carry its mark).
    pub sockets: Arc<dyn SocketFactory>,
    pub live: Arc<LiveState>,
    /// The families that cut across (the hides).
    pub metrics: Arc<Metrics>,
    pub proxy_metrics: Arc<ProxyMetrics>,
    /// Endpoints given by host name (resolution DNS), resolved through the upstream and kept for their TTL.
    pub endpoint_hosts: Arc<HostCache>,
    pub relay: RelayMode,
    /// The pods' cgroups, to check the registry's word for who a client is.
    pub cgroups: Arc<CgroupPods>,
    /// Connections and descriptors each client, and the node, may hold.
    pub budgets: Arc<Budgets>,
    pub timeouts: Timeouts,
    /// What the proxy never dials for a pod.
    pub guard: Arc<DialGuard>,
    /// Send and receive buffer of each proxied socket, bytes; `None`: the kernel's autotuning.
    pub buffer: Option<usize>,
    /// Where each connection's records go (the access log among them).
    pub records: Arc<Connections>,
    /// Tunnels to waypoints, for the services bound to one.
    pub hbone: Arc<HboneClient>,
    /// Inbound authorization of the connections carried to this node's Pods.
    pub authorizer: Arc<Authorizer>,
}

pub(crate) struct OutboundProxy {
    listener: TcpListener,
    context: Arc<ProxyContext>,
    /// A descriptor held back for the day the process runs out anyway: closed, it lets one waiting
    /// client be accepted and reset instead of left hanging in the queue.
    spare: Option<std::fs::File>,
}

/// Binds the proxy's listener.
pub(crate) fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    // Accepted sockets inherit these: no per-connection system calls for them.
    socket.set_nodelay(true)?;
    socket2::SockRef::from(&socket).set_tcp_keepalive(&crate::net::keepalive())?;
    // Linger 0: a connection that ends any way but the graceful one (a refusal, a failed relay,
    // the agent killed) is reset, so neither peer takes a cut stream for a complete one.
    socket2::SockRef::from(&socket).set_linger(Some(Duration::ZERO))?;
    socket.bind(addr).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "binding the outbound proxy to {addr} (is the gateway an address of this network namespace?): {e}"
            ),
        )
    })?;
    socket.listen(BACKLOG)
}

impl OutboundProxy {
    pub(crate) fn new(listener: TcpListener, context: Arc<ProxyContext>) -> Self {
        Self {
            listener,
            context,
            spare: spare_fd(),
        }
    }

    #[cfg(test)]
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts until `shutdown` changes. Connection tasks are detached: they end with their
    /// connection, or with the runtime.
    pub(crate) async fn serve(mut self, mut shutdown: crate::drain::Watcher) {
        loop {
            tokio::select! {
                // Any change (or the sender gone) means stop.
                () = shutdown.stopped() => return,
                accepted = self.listener.accept() => match accepted {
                    // Over budget: dropped at once, reset (the listener's linger 0), no task.
                    Ok((stream, peer)) => match admit(&self.context, peer) {
                        Some(admitted) => {
                            tokio::spawn(handle(stream, peer, admitted, self.context.clone()));
                        }
                        None => {
                            // Its flow entry is never read: it must not wait for the next
                            // connection from this address and port.
                            self.context.flows.forget(peer);
                            debug!(client = %peer, "over budget; connection reset");
                        }
                    },
                    Err(e) if out_of_fds(&e) => self.reset_one_waiting().await,
                    Err(e) => {
                        warn!(error = %e, "outbound accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }

    /// The process is out of descriptors (something outside the budget took them): frees the spare
    /// to take one waiting client off the queue and reset it, then holds a spare again.
    async fn reset_one_waiting(&mut self) {
        warn!("outbound accept: out of file descriptors; resetting a waiting client");
        self.context
            .budgets
            .metrics
            .refused(BudgetKind::Fds, Refusal::Fds);
        self.spare = None;
        let _ = tokio::time::timeout(Duration::from_millis(1), self.listener.accept()).await;
        self.spare = spare_fd();
        if self.spare.is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn spare_fd() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// What an admitted connection holds until it ends: its place in the client's share and the
/// descriptors of its two sockets.
struct Admitted {
    /// Whose share the connection took: the ports toward its upstream come from the same one.
    share: IpAddr,
    _permit: Permit,
    _fds: FdCharge,
}

/// Whether `peer` may have one more connection: within its workload's share, the node's limit, and
/// the descriptor budget (each refusal counted by reason).
fn admit(context: &ProxyContext, peer: SocketAddr) -> Option<Admitted> {
    let share = context.live.snapshot().budget_key(peer.ip());
    let permit = context.budgets.connections.take(share).ok()?;
    let fds = context
        .budgets
        .fds
        .charge(FDS_PER_CONNECTION, Ceiling::Limit)?;
    Some(Admitted {
        share,
        _permit: permit,
        _fds: fds,
    })
}

async fn handle(
    mut client: TcpStream,
    peer: SocketAddr,
    admitted: Admitted,
    context: Arc<ProxyContext>,
) {
    // A v4-mapped peer is the IPv4 client it stands for, in every lookup and log line.
    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    let _active = context.proxy_metrics.track_active();
    let mut result = ConnectionResult::start(&context.proxy_metrics, &context.records, peer);
    // Every refusal returns here and drops the client, which resets it: accepted sockets have the
    // listener's linger 0, kept until a relay ends cleanly.
    if let Err(refused) = proxy(&context, &mut client, peer, admitted.share, &mut result).await {
        result.refused(refused.outcome, refused.why);
    }
}

/// Why a connection was refused before any byte moved.
struct Refused {
    outcome: OutboundOutcome,
    why: &'static str,
}

impl Refused {
    fn error(why: &'static str) -> Refused {
        Refused {
            outcome: OutboundOutcome::Error,
            why,
        }
    }
}

/// Finds where `client` meant to go and decides (`route`), then connects and relays (`carry`),
/// filling in `result` on the way.
async fn proxy(
    context: &ProxyContext,
    client: &mut TcpStream,
    peer: SocketAddr,
    share: IpAddr,
    result: &mut ConnectionResult<'_>,
) -> Result<(), Refused> {
    let mut route = route(context, peer, result).await?;
    match route.via.take() {
        Some(via) => carry_through_waypoint(context, client, peer, route, via, result).await,
        None => carry(context, client, peer, share, route, result).await,
    }
}

/// Where a decided connection goes: the decision's outcome and the addresses it may dial.
struct Route {
    outcome: OutboundOutcome,
    orig: SocketAddr,
    first: SocketAddr,
    fallback: Option<SocketAddr>,
    /// The HBONE peer it goes through, a waypoint or another node (`first` is then the peer's
    /// HBONE address).
    via: Option<Via>,
    /// To a Pod of this node: admitted by its authorization policies, until revoked.
    authorized: Option<Authorized>,
}

/// A connection's way over HBONE: as whom, from which address (the client Pod's, to another node,
/// as ztunnel dials; the node's to a waypoint), to a peer of which namespace, and the `CONNECT`
/// authority (the original destination through a waypoint; the Pod and port to another node).
struct Via {
    client: Identity,
    source: Option<IpAddr>,
    peer_namespace: String,
    authority: SocketAddr,
}

/// The decision for the connection from `peer`, with no byte moved: its original destination,
/// who the client is, what it may see there, the endpoint's addresses and whether they may be
/// dialled for this client.
async fn route(
    context: &ProxyContext,
    peer: SocketAddr,
    result: &mut ConnectionResult<'_>,
) -> Result<Route, Refused> {
    let (orig, cgroup_id) = match context.flows.take(peer) {
        Ok(Some(orig)) => (orig.dst.to_socket_addr(), orig.cgroup_id),
        Ok(None) => {
            debug!(client = %peer, "no original destination recorded for this connection (not a steered connect); resetting it");
            context.proxy_metrics.flow_unclaimed();
            return Err(Refused::error("no original destination"));
        }
        Err(e) => {
            warn!(client = %peer, error = %e, "reading the original destination failed; closing the connection");
            return Err(Refused::error("original destination unreadable"));
        }
    };
    result.orig_dst = Some(orig);

    let snapshot = context.live.snapshot_arc();
    let who = Client::of_connection(&snapshot, &context.cgroups, peer.ip(), cgroup_id).await;
    who.report_mismatch(&context.cgroups, &context.metrics, "outbound connection");
    result.workload = who.workload_name().map(Name::from);
    result.namespace = who.namespace().map(Name::from);
    let Some(plan) = decide(context, &snapshot, peer, &who, orig) else {
        return Err(Refused {
            outcome: OutboundOutcome::NoHealthyUpstream,
            why: "no healthy upstream",
        });
    };
    result.service = plan.service.map(Name::from);
    if let Some(waypoint) = plan.waypoint {
        let mut route =
            through_waypoint(context, peer, orig, &who, waypoint, plan.outcome, result)?;
        // With HBONE between nodes the answers to a Pod's address come back to the agent (marked
        // on the node's links): the waypoint sees the client Pod's address, as ztunnel dials it.
        // Otherwise, or to a waypoint of the other family, the node's.
        if let Some(via) = &mut route.via {
            let client = peer.ip().to_canonical();
            via.source = Some(client).filter(|ip| {
                snapshot.hbone_between_nodes() && ip.is_ipv4() == route.first.is_ipv4()
            });
        }
        return Ok(route);
    }
    let (first, fallback) = match plan.target {
        Dst::Addr(addr) => (addr, None),
        Dst::Host { name, port } => match context.endpoint_hosts.pick(&name).await {
            Ok(pick) => (
                SocketAddr::new(pick.first, port),
                pick.fallback.map(|ip| SocketAddr::new(ip, port)),
            ),
            Err(e) => {
                debug!(client = %peer, orig_dst = %orig, endpoint = %name, error = %e, "endpoint host name did not resolve");
                return Err(Refused::error("endpoint host name did not resolve"));
            }
        },
    };
    // Never dial, for a pod, what the pod could not reach itself: the node's loopback, its link,
    // its own addresses, or what the operator denies.
    let (first, fallback) = allowed(context, peer, orig, first, fallback)
        .ok_or(Refused::error("destination refused"))?;
    // Over HBONE only from a Pod in the mesh to a Pod in the mesh; plaintext otherwise, as ztunnel.
    let via = snapshot
        .hbone_peer(first.ip())
        .filter(|_| who.trusted_workload().is_some_and(|w| snapshot.enrolled(w)))
        .and_then(|namespace| to_other_node(context, &who, peer.ip(), namespace, first));
    let first = match via {
        Some(_) => SocketAddr::new(first.ip(), crate::hbone::PORT),
        None => first,
    };
    let authorized = match via {
        None => authorize(context, &snapshot, &who, peer, first, result)?,
        Some(_) => None,
    };
    Ok(Route {
        outcome: plan.outcome,
        orig,
        first,
        fallback: fallback.filter(|_| via.is_none()),
        via,
        authorized,
    })
}

/// A connection to a Pod of this node, decided by its authorization policies as coming from
/// `who` (its identity only when the kernel confirmed the Pod: anything else is plaintext);
/// `None` for any other destination.
fn authorize(
    context: &ProxyContext,
    snapshot: &Arc<Snapshot>,
    who: &Client<'_>,
    peer: SocketAddr,
    dst: SocketAddr,
    result: &mut ConnectionResult<'_>,
) -> Result<Option<Authorized>, Refused> {
    if snapshot.local_pod(dst.ip()).is_none() {
        return Ok(None);
    }
    let src_identity = who
        .workload
        .filter(|_| who.check == Check::Confirmed)
        .and_then(|w| pod_identity(&context.hbone, snapshot, w));
    let inbound = Inbound {
        path: Path::SameNode,
        src_identity,
        src_ip: peer.ip(),
        dst_ip: dst.ip(),
        dst_port: dst.port(),
    };
    match context
        .authorizer
        .admit(inbound, || context.live.snapshot_arc())
    {
        Ok(authorized) => {
            result.authorization = Some(Name::from(authorized.verdict.to_string()));
            Ok(Some(authorized))
        }
        Err(verdict) => {
            result.endpoint = Some(dst);
            result.authorization = Some(Name::from(verdict.to_string()));
            Err(Refused {
                outcome: OutboundOutcome::Denied,
                why: ends::DENIED,
            })
        }
    }
}

/// The workload identity of a Pod of this node (one with a service account), in the mesh's trust
/// domain; `None` without certificates configured.
pub(super) fn workload_identity(hbone: &HboneClient, w: &Workload) -> Option<Identity> {
    hbone.identity(&w.meta.namespace, w.service_account.as_deref()?)
}

/// The way over HBONE to `endpoint`, a Pod of another node of `namespace`, as the client's
/// workload identity and from its address `from` (the receiving side carries the stream on from
/// it: the Pod there sees this Pod's address). A client without an identity (no Pod of this node)
/// goes directly, as ztunnel carries only the Pods it captures.
fn to_other_node(
    context: &ProxyContext,
    who: &Client<'_>,
    from: IpAddr,
    namespace: &str,
    endpoint: SocketAddr,
) -> Option<Via> {
    let client = workload_identity(&context.hbone, who.trusted_workload()?)?;
    Some(Via {
        client,
        // A client of another family than the Pod's goes from the node's address.
        source: Some(from.to_canonical()).filter(|ip| ip.is_ipv4() == endpoint.is_ipv4()),
        peer_namespace: namespace.to_string(),
        authority: endpoint,
    })
}

/// The route of a connection to a service bound to `waypoint`: over HBONE to its address, as the
/// client pod's workload identity. A client with no identity (not a pod of this node with a
/// service account) cannot be carried, and is refused rather than sent around the waypoint.
fn through_waypoint(
    context: &ProxyContext,
    peer: SocketAddr,
    orig: SocketAddr,
    who: &Client<'_>,
    waypoint: WaypointPlan,
    outcome: OutboundOutcome,
    result: &mut ConnectionResult<'_>,
) -> Result<Route, Refused> {
    result.waypoint = Some(Name::from(waypoint.name));
    let Some(client) = who
        .trusted_workload()
        .and_then(|w| workload_identity(&context.hbone, w))
    else {
        context.hbone.metrics.tunnel("no_identity");
        debug!(client = %peer, orig_dst = %orig, "no workload identity for the client of a waypoint-bound service; resetting it");
        return Err(Refused::error("no workload identity for the waypoint"));
    };
    let (first, _) = allowed(context, peer, orig, waypoint.addr, None)
        .ok_or(Refused::error("destination refused"))?;
    Ok(Route {
        outcome,
        orig,
        first,
        fallback: None,
        authorized: None,
        via: Some(Via {
            client,
            source: None,
            peer_namespace: waypoint.namespace,
            authority: orig,
        }),
    })
}

/// Carries a connection through its waypoint: a tunnel (an HTTP/2 stream of a pooled mutual-TLS
/// connection) to the original destination, the bytes relayed both ways until either side ends.
async fn carry_through_waypoint(
    context: &ProxyContext,
    client: &mut TcpStream,
    peer: SocketAddr,
    route: Route,
    via: Via,
    result: &mut ConnectionResult<'_>,
) -> Result<(), Refused> {
    // Through a waypoint, the waypoint; to another node, the Pod the stream reaches.
    result.endpoint = Some(match result.waypoint {
        Some(_) => route.first,
        None => via.authority,
    });
    result.hbone_identity = Some(Name::from(via.client.to_string()));
    let tunnel = context
        .hbone
        .tunnel(
            &via.client,
            via.source,
            route.first,
            &via.peer_namespace,
            via.authority,
        )
        .await;
    let mut tunnel = match tunnel {
        Ok(tunnel) => tunnel,
        Err(e) => {
            warn!(client = %peer, orig_dst = %route.orig, peer = %route.first, identity = %via.client, error = %e, "no HBONE tunnel; resetting the connection");
            return Err(Refused::error(ends::TUNNEL_FAILED));
        }
    };
    result.decided(route.outcome);
    result.opened();
    match relay_tunnel(client.split(), &mut tunnel.stream, context.timeouts).await {
        Ok(carried) => {
            count_carried(context, result, carried);
            let _ = socket2::SockRef::from(&*client).set_linger(None);
        }
        Err(e) => {
            result.end = relay_end(context, &e);
            debug!(client = %peer, waypoint = %route.first, error = %e, "tunnelled connection ended with an error; resetting the client");
        }
    }
    Ok(())
}

/// Carries a routed connection: a port toward the upstream within the client's share, the
/// upstream connected, the bytes relayed both ways until either side ends.
async fn carry(
    context: &ProxyContext,
    client: &TcpStream,
    peer: SocketAddr,
    share: IpAddr,
    route: Route,
    result: &mut ConnectionResult<'_>,
) -> Result<(), Refused> {
    // A port toward the upstream, open and then in TIME_WAIT: one pod's short connections must
    // not take the node's whole range toward an endpoint (`budget::ports`).
    let mut port = context
        .budgets
        .upstream_ports
        .take(share, route.first)
        .map_err(|_| Refused::error("over budget: ports toward the upstream"))?;
    // Bounded kernel buffers on both legs: a peer that never reads holds at most this much.
    if let Some(bytes) = context.buffer {
        let socket = socket2::SockRef::from(client);
        let _ = socket.set_send_buffer_size(bytes);
        let _ = socket.set_recv_buffer_size(bytes);
    }
    let connected = connect_upstream(
        &*context.sockets,
        route.first,
        route.fallback,
        context.buffer,
    )
    .await;
    let (upstream, dst) = match connected {
        Ok(connected) => connected,
        Err((dst, e)) => {
            debug!(client = %peer, orig_dst = %route.orig, upstream = %dst, error = %e, "upstream connect failed");
            result.endpoint = Some(dst);
            return Err(Refused::error(ends::UPSTREAM_CONNECT_FAILED));
        }
    };
    result.decided(route.outcome);
    result.endpoint = Some(dst);
    result.opened();
    // The client socket has linger 0 from the listener; the upstream gets it too.
    let _ = socket2::SockRef::from(&upstream).set_linger(Some(Duration::ZERO));
    let pipes = match context.relay {
        RelayMode::Splice => Pipes::lease(&context.budgets.fds).or_else(|| {
            context.proxy_metrics.splice_fallback();
            None
        }),
        RelayMode::Copy => None,
    };
    let relayed = async {
        match pipes {
            Some(pipes) => splice_relay(client, &upstream, pipes, context.timeouts).await,
            None => relay(client, &upstream, context.timeouts).await,
        }
    };
    let carried = match &route.authorized {
        None => relayed.await,
        Some(authorized) => tokio::select! {
            carried = relayed => carried,
            () = authorized.revoked() => {
                // Both sockets still linger 0: dropping them resets both peers.
                result.end = "closed: no longer allowed after a policy update";
                return Ok(());
            }
        },
    };
    match carried {
        Ok(carried) => {
            port.closed_first(carried.upstream_closed_first);
            count_carried(context, result, carried);
            // Both sides ended cleanly: close gracefully, so data still in flight is delivered.
            for socket in [client, &upstream] {
                let _ = socket2::SockRef::from(socket).set_linger(None);
            }
        }
        Err(e) => {
            result.end = relay_end(context, &e);
            // Both sockets still linger 0: dropping them resets both peers.
            debug!(client = %peer, upstream = %dst, error = %e, "connection ended with an error; resetting both sides");
        }
    }
    Ok(())
}

/// A relay that ended cleanly: its bytes counted and recorded.
fn count_carried(context: &ProxyContext, result: &mut ConnectionResult<'_>, carried: Carried) {
    context.proxy_metrics.bytes(Direction::Sent, carried.sent);
    context
        .proxy_metrics
        .bytes(Direction::Received, carried.received);
    (result.sent, result.received, result.end) = (carried.sent, carried.received, "closed");
}

/// How a relay that failed ended, for the record; a timeout is counted.
fn relay_end(context: &ProxyContext, e: &RelayError) -> &'static str {
    match e {
        RelayError::Idle(_) => {
            context.proxy_metrics.timed_out(Timeout::Idle);
            "idle timeout"
        }
        RelayError::Write(_) => {
            context.proxy_metrics.timed_out(Timeout::Write);
            "write timeout"
        }
        RelayError::Io(_) => "reset",
    }
}

/// The addresses of `first` and `fallback` the proxy may dial for this client, first first; `None`
/// when neither (each refusal counted by reason, and logged once per destination).
fn allowed(
    context: &ProxyContext,
    peer: SocketAddr,
    orig: SocketAddr,
    first: SocketAddr,
    fallback: Option<SocketAddr>,
) -> Option<(SocketAddr, Option<SocketAddr>)> {
    let mut ok = [Some(first), fallback].into_iter().flatten().filter(|dst| {
        let Some(reason) = context.guard.check(dst.ip()) else {
            return true;
        };
        context.proxy_metrics.refused_destination(reason);
        if context.guard.first_refusal(dst.ip()) {
            warn!(client = %peer, orig_dst = %orig, upstream = %dst, reason = reason.as_str(), "refusing to dial {} for a pod; resetting the connection", reason.describe());
        } else {
            debug!(client = %peer, orig_dst = %orig, upstream = %dst, reason = reason.as_str(), "refused destination");
        }
        false
    });
    let first = ok.next()?;
    Some((first, ok.next()))
}

/// Connects to `first`; with a `fallback` (a host name's IPv6 address beside its IPv4 one), that is
/// tried too once `first` fails or is still connecting after [`FALLBACK_DELAY`], and the first to
/// connect wins (`docs/data-plane.md#connect-failures`). Each has the connect deadline. The address
/// connected to, or the last one tried and its error.
async fn connect_upstream(
    sockets: &dyn SocketFactory,
    first: SocketAddr,
    fallback: Option<SocketAddr>,
    buffer: Option<usize>,
) -> Result<(TcpStream, SocketAddr), (SocketAddr, io::Error)> {
    let attempt = |addr: SocketAddr| async move {
        crate::net::connect(sockets, addr, CONNECT_TIMEOUT, buffer)
            .await
            .map(|stream| (stream, addr))
            .map_err(|e| (addr, e))
    };
    let Some(other) = fallback else {
        return attempt(first).await;
    };
    let primary = attempt(first);
    tokio::pin!(primary);
    let early = match tokio::time::timeout(FALLBACK_DELAY, &mut primary).await {
        Ok(Ok(connected)) => return Ok(connected),
        Ok(Err(failed)) => Some(failed),
        Err(_) => None,
    };
    debug!(upstream = %first, fallback = %other, failed = early.is_some(), "trying the host's other address family too");
    let secondary = attempt(other);
    if early.is_some() {
        return secondary.await;
    }
    tokio::pin!(secondary);
    // Both are connecting: the first to succeed wins (the other is dropped, its socket closed); if
    // one fails, the other's outcome is the answer.
    tokio::select! {
        result = &mut primary => match result {
            Ok(connected) => Ok(connected),
            Err(_) => secondary.await,
        },
        result = &mut secondary => match result {
            Ok(connected) => Ok(connected),
            Err(_) => primary.await,
        },
    }
}

/// How long a host name's IPv4 address has to connect before its IPv6 one is tried alongside
/// (RFC 8305's recommended connection attempt delay).
const FALLBACK_DELAY: Duration = Duration::from_millis(250);

/// Where to connect, owned: the snapshot it came from may be replaced while the connection lives.
enum Dst {
    Addr(SocketAddr),
    Host { name: String, port: u16 },
}

struct Plan {
    outcome: OutboundOutcome,
    target: Dst,
    /// `namespace/name` of the service decided on, for the access log.
    service: Option<String>,
    /// The waypoint the service is bound to, when its address is known.
    waypoint: Option<WaypointPlan>,
}

struct WaypointPlan {
    /// `namespace/name`.
    name: String,
    namespace: String,
    /// Its HBONE address.
    addr: SocketAddr,
}

/// The decision for this connection (`docs/data-plane.md#destination-ip-lookup`),
/// made with `state::Snapshot::decide_outbound` under one snapshot.
/// `None`: no healthy upstream, reset the client.
/// An unknown client (no namespace) sees PUBLIC services only.
fn decide(
    context: &ProxyContext,
    snapshot: &Snapshot,
    peer: SocketAddr,
    who: &Client<'_>,
    orig: SocketAddr,
) -> Option<Plan> {
    let client_ns = who.namespace();
    let decision = snapshot.decide_outbound(client_ns, orig.ip(), orig.port());
    let outcome = decision.outcome();
    if let Some(audit) = context.live.audit() {
        let dst = (orig.ip(), orig.port());
        audit.connect(client_ns, || who.workload_name(), dst, decision.service());
    }
    if let Some(hidden) = decision.hidden {
        context.metrics.clients.hidden(Lookup::Outbound);
        debug!(
            client = %peer,
            client_namespace = client_ns.unwrap_or("<unknown>"),
            service = %format_args!("{}/{}", hidden.namespace, hidden.name),
            orig_dst = %orig,
            instead = outcome.metric_label(),
            "service hidden from client"
        );
    }
    let target = decision.target();
    let service = decision
        .service()
        .map(|s| format!("{}/{}", s.namespace, s.name));
    debug!(
        client = %peer,
        client_namespace = client_ns.unwrap_or("<unknown>"),
        orig_dst = %orig,
        action = outcome.metric_label(),
        service = service.as_deref().unwrap_or("-"),
        endpoint = %target.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
        "outbound connection"
    );
    let target = match target? {
        Target::Addr(addr) => Dst::Addr(addr),
        Target::Host { name, port } => Dst::Host {
            name: name.to_string(),
            port,
        },
    };
    let waypoint = match decision.action {
        Outbound::Service { service, .. } => {
            service.waypoint_route().map(|(waypoint, ip)| WaypointPlan {
                name: waypoint.to_string(),
                namespace: waypoint.namespace.clone(),
                addr: SocketAddr::new(ip, crate::hbone::PORT),
            })
        }
        _ => None,
    };
    Some(Plan {
        outcome,
        target,
        service,
        waypoint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::PlainSockets;

    /// The listener's TCP_NODELAY, keepalive and linger 0 are what every accepted client socket
    /// gets, with no system call per connection: Linux clones them from the listener.
    #[tokio::test]
    async fn accepted_sockets_inherit_nodelay_keepalive_and_linger() {
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (_client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (accepted, _) = accepted.unwrap();
        assert!(accepted.nodelay().unwrap());
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            crate::net::KEEPALIVE_IDLE
        );
        assert_eq!(socket.linger().unwrap(), Some(Duration::ZERO));
    }

    /// A loopback address whose listener never accepts and whose queue is full: the kernel drops
    /// every further SYN, as a black-holed path does. Keep the returned sockets alive.
    fn black_hole() -> (SocketAddr, Vec<std::net::TcpStream>, std::net::TcpListener) {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        socket.listen(0).unwrap();
        let listener: std::net::TcpListener = socket.into();
        let addr = listener.local_addr().unwrap();
        // The queue holds one; the next SYNs are dropped (their connects would hang).
        let queued = (0..2)
            .filter_map(|_| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
            })
            .collect();
        (addr, queued, listener)
    }

    async fn listener6() -> (SocketAddr, TcpListener) {
        let listener = TcpListener::bind("[::1]:0").await.unwrap();
        (listener.local_addr().unwrap(), listener)
    }

    #[tokio::test]
    async fn a_silent_first_family_hands_over_to_the_other_after_the_fallback_delay() {
        let (silent, _queued, _listener) = black_hole();
        let (v6, _v6_listener) = listener6().await;
        let started = std::time::Instant::now();
        let (_, connected) = connect_upstream(&PlainSockets, silent, Some(v6), None)
            .await
            .unwrap();
        assert_eq!(connected, v6);
        let took = started.elapsed();
        assert!(
            took >= FALLBACK_DELAY && took < CONNECT_TIMEOUT / 4,
            "took {took:?}: the other family starts after the delay, not after the deadline"
        );
    }

    #[tokio::test]
    async fn a_refused_first_family_hands_over_at_once_and_a_working_one_wins() {
        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (v6, _v6_listener) = listener6().await;
        let started = std::time::Instant::now();
        let (_, connected) = connect_upstream(&PlainSockets, refused, Some(v6), None)
            .await
            .unwrap();
        assert_eq!(connected, v6);
        assert!(
            started.elapsed() < FALLBACK_DELAY,
            "no wait after a refusal"
        );

        let v4 = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let v4_addr = v4.local_addr().unwrap();
        let (_, connected) = connect_upstream(&PlainSockets, v4_addr, Some(v6), None)
            .await
            .unwrap();
        assert_eq!(connected, v4_addr, "IPv4 first when it works");
        let (failed, _) = connect_upstream(&PlainSockets, refused, None, None)
            .await
            .unwrap_err();
        assert_eq!(failed, refused);
    }
}
