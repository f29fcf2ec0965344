//! The receiving side of HBONE between nodes: a peer (another node's agent, or ztunnel) dials a
//! Pod of this node on port 15008; the routing the agent set up delivers that connection here,
//! to the address the peer dialled. The agent answers as that Pod's workload identity, takes only
//! peers of the mesh's trust domain, and carries each `CONNECT` stream to the Pod, on the port the
//! stream names, logging who sent it. A stream from another node's Pod reaches the Pod from the
//! sender's address, as ztunnel carries it (`redirect::hbone_replies` brings the answers back).
//!
//! A peer holding a valid certificate is still held to limits: connections per address and
//! descriptors in all ([`limits`]), streams in flight per connection, dials included, and idle
//! connections closed ([`server`]), and the Pods' bytes a connection may hold ([`buffered`]); what
//! a flood held is handed back to the system once it ends ([`trim`]).
mod buffered;
#[cfg(test)]
mod carry_tests;
mod limits;
mod server;
pub(crate) use server::RECEIVED_FRAME;
#[cfg(test)]
mod tests;
mod trim;

use std::{
    io,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::{RecvStream, server::SendResponse};
use http::{Method, Request, Response, StatusCode};
use limits::{ConnectionHeld, InboundLimits};
use server::{Settings, StreamPermit};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream},
};
use tracing::{debug, info, warn};

use super::{
    ProxyContext, RelayError,
    authorize::{Authorized, Inbound, Path},
    relay::Carried,
    tunnel_relay::relay_tunnel,
};
use crate::{
    authz::Verdict,
    drain::Watcher,
    hbone::{self, CONNECTION_WINDOW, H2Stream, Identity},
    net::{CONNECT_TIMEOUT, connect_from},
    records::{Event, Received, ends},
    redirect::hbone_replies::{HboneSources, SourceHeld},
};

/// The Pods' bytes one connection may hold on their way to the peer: its receive window, as
/// ztunnel's. `h2` caps each stream's queue (4 MiB), not the connection's.
const CONNECTION_BUFFER: usize = CONNECTION_WINDOW as usize;

/// How long a peer may take over the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Pending connections the kernel queues for us.
const BACKLOG: i32 = 1024;

/// A listener on `addr` that may accept connections addressed to any Pod of the node: transparent
/// (`IP_TRANSPARENT`, which needs `CAP_NET_ADMIN`), so that the accepted side answers from the
/// Pod's address. IPv4.
pub(crate) fn listen_transparent(addr: SocketAddr) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    // A successor binds beside it during a hand-over.
    socket.set_reuse_port(true)?;
    match addr {
        SocketAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
        SocketAddr::V6(_) => {
            // IPv4 has its own listener: this one takes IPv6 only.
            socket.set_only_v6(true)?;
            socket.set_ip_transparent_v6(true)?;
        }
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Serves HBONE on `listener` until `shutdown`; the senders' addresses the agent carries streams
/// on from are held in `sources` while they are used.
pub(crate) async fn serve(
    listener: TcpListener,
    context: Arc<ProxyContext>,
    sources: Arc<HboneSources>,
    mut shutdown: Watcher,
) {
    let limits = InboundLimits::new(
        context.budgets.fds.clone(),
        context.budgets.connections.clone(),
    );
    tokio::spawn(trim::run(limits.trim(), shutdown.clone()));
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => match limits.connection(peer.ip(), context.live.snapshot().budget_key(peer.ip())) {
                    Ok(held) => {
                        let (context, sources, limits) = (context.clone(), sources.clone(), limits.clone());
                        tokio::spawn(connection(context, sources, limits, held, tcp, peer, shutdown.clone()));
                    }
                    Err(refused) => {
                        // Closed at once: the peer sees its connection end before any handshake.
                        context.hbone.metrics.inbound(refused);
                        debug!(%peer, refused, "HBONE connection refused: past its limit");
                    }
                },
                Err(e) => {
                    debug!(error = %e, "accepting an HBONE connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = shutdown.stopped() => return,
        }
    }
}

/// One peer's connection: TLS as the Pod it dialled, then HTTP/2, each stream a tunnel.
async fn connection(
    context: Arc<ProxyContext>,
    sources: Arc<HboneSources>,
    limits: Arc<InboundLimits>,
    held: ConnectionHeld,
    tcp: TcpStream,
    peer: SocketAddr,
    stopping: Watcher,
) {
    let Ok(dialled) = tcp.local_addr() else {
        return;
    };
    let metrics = &context.hbone.metrics;
    let (pod, from_pod) = {
        let snapshot = context.live.snapshot();
        let pod = snapshot.local_pod(dialled.ip());
        let pod = pod.and_then(|w| super::outbound::workload_identity(&context.hbone, w));
        (pod, snapshot.other_nodes_pod(peer.ip()))
    };
    let Some(pod) = pod else {
        metrics.inbound("no_workload");
        debug!(%peer, dst = %dialled, "HBONE to an address with no Pod of this node; closing");
        return;
    };
    let config = match context.hbone.server_tls(&pod).await {
        Ok(config) => config,
        Err(e) => {
            metrics.inbound(e.label());
            info!(%peer, dst = %dialled, identity = %pod, error = %e, "no certificate to answer HBONE as the Pod; closing");
            return;
        }
    };
    let accept = tokio_rustls::TlsAcceptor::from(config).accept(tcp);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            metrics.inbound("tls_refused");
            info!(%peer, dst = %dialled, error = %e, "HBONE peer refused in the TLS handshake");
            return;
        }
        Err(_) => {
            metrics.inbound("tls_refused");
            debug!(%peer, dst = %dialled, "HBONE peer did not finish the TLS handshake in time");
            return;
        }
    };
    let source = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(Identity::of_leaf);
    let Some(source) = source else {
        // The verifier takes only certificates that name one.
        metrics.inbound("tls_refused");
        return;
    };
    let from = from_pod.then(|| hold_source(&sources, peer.ip())).flatten();
    let sender = Arc::new(Sender {
        source,
        peer,
        pod: dialled.ip(),
        from,
    });
    let budget = buffered::SendBudget::new(CONNECTION_BUFFER);
    carry(context, limits, held, sender, budget, tls, stopping).await;
}

/// A connection's streams over `io` (TLS done) until it ends, holding its place (`_held`, what a
/// drain waits for); its streams end with it. Once the agent stops serving, the peer is told to
/// open no more (`GOAWAY`) and those open go on: a hand-over drains them, and the connection
/// with its last, while the successor takes the new ones.
async fn carry<IO: AsyncRead + AsyncWrite + Unpin>(
    context: Arc<ProxyContext>,
    limits: Arc<InboundLimits>,
    _held: ConnectionHeld,
    sender: Arc<Sender>,
    budget: Arc<buffered::SendBudget>,
    io: IO,
    mut stopping: Watcher,
) {
    let io = buffered::Metered::new(io, budget.clone());
    // Dropped as the connection ends: its streams end with it.
    let (_open, open) = tokio::sync::watch::channel(());
    server::serve(
        io,
        Settings::default(),
        &context.hbone.metrics,
        sender.peer,
        stopping.stopped(),
        |request, respond, permit| {
            let held = Stream {
                sender: sender.clone(),
                permit,
                budget: budget.clone(),
                limits: limits.clone(),
                connection: open.clone(),
            };
            tokio::spawn(stream(context.clone(), held, request, respond));
        },
    )
    .await;
}

/// Who sent a connection's streams.
#[derive(Debug)]
struct Sender {
    /// The identity the peer's certificate names.
    source: Identity,
    peer: SocketAddr,
    /// The Pod dialled: the only one its streams may reach.
    pod: IpAddr,
    /// The address its streams reach the Pod from, held while they may: the sender's, when it is
    /// another node's Pod. `None`: the node's.
    from: Option<SourceHeld>,
}

/// Holds `ip` as a source to carry streams on from; `None` (the node's address is used) when the
/// kernel's map takes no more.
fn hold_source(sources: &Arc<HboneSources>, ip: IpAddr) -> Option<SourceHeld> {
    match sources.hold(ip) {
        Ok(held) => Some(held),
        Err(e) => {
            warn!(%ip, error = %e, "cannot keep the sender's address; its streams reach the Pod from the node's");
            None
        }
    }
}

/// What one stream's task holds until it ends.
struct Stream {
    sender: Arc<Sender>,
    /// Its place among its connection's streams, its dial included.
    permit: StreamPermit,
    /// What its connection may hold of the Pods' bytes.
    budget: Arc<buffered::SendBudget>,
    limits: Arc<InboundLimits>,
    /// Closed when its connection ends: a stream whose Pod neither reads nor has room to send
    /// would otherwise wait for the idle timeout, holding its socket and buffers, after the peer left.
    connection: tokio::sync::watch::Receiver<()>,
}

/// One stream: a `CONNECT` to the Pod dialled, on the port it names (not 15008), answered `200` once the Pod
/// took the connection; then the bytes carried both ways.
async fn stream(
    context: Arc<ProxyContext>,
    held: Stream,
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let Stream {
        sender,
        permit: _permit,
        budget,
        limits,
        mut connection,
    } = held;
    let metrics = &context.hbone.metrics;
    let target = connect_target(&request, sender.pod);
    let Some(target) = target else {
        metrics.inbound("bad_request");
        debug!(peer = %sender.peer, src_identity = %sender.source, method = %request.method(), uri = %request.uri(), "HBONE stream is not a CONNECT to the Pod dialled");
        return refuse(&mut respond, StatusCode::BAD_REQUEST);
    };
    // Registered and decided before the Pod is dialled: a refused stream never reaches it.
    let inbound = Inbound {
        path: Path::Hbone,
        src_identity: Some(sender.source.clone()),
        src_ip: sender.peer.ip().to_canonical(),
        dst_ip: target.ip().to_canonical(),
        dst_port: target.port(),
    };
    let authorized = match context
        .authorizer
        .admit(inbound, || context.live.snapshot_arc())
    {
        Ok(authorized) => authorized,
        Err(verdict) => {
            metrics.inbound("denied");
            log_denied(&context, &sender, target, &verdict);
            return refuse(&mut respond, StatusCode::UNAUTHORIZED);
        }
    };
    let Some(_socket) = limits.socket() else {
        metrics.inbound("fd_limit");
        debug!(peer = %sender.peer, dst = %target, "HBONE stream refused: received HBONE is at its descriptor share");
        return refuse(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
    };
    // A peer that resets the stream no longer waits for the Pod: the dial, and its socket, go.
    let Some(upstream) = server::unless_reset(&mut respond, dial(&context, &sender, target)).await
    else {
        metrics.inbound("reset");
        debug!(peer = %sender.peer, dst = %target, "HBONE stream reset by the peer while the Pod was dialled");
        return;
    };
    let mut upstream = match upstream {
        Ok(upstream) => upstream,
        Err(e) => {
            metrics.inbound("connect_failed");
            info!(peer = %sender.peer, src_identity = %sender.source, dst = %target, error = %e, "HBONE stream: the Pod refused the connection");
            count_received(&context, &sender, target, Event::Close, ends::POD_REFUSED);
            return refuse(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    metrics.inbound("ok");
    let started = Instant::now();
    let send = match respond.send_response(status(StatusCode::OK), false) {
        Ok(send) => send,
        Err(e) => {
            debug!(peer = %sender.peer, error = %e, "HBONE stream closed before it was answered");
            return;
        }
    };
    // Answered: its close is counted where it ends, below.
    count_received(&context, &sender, target, Event::Open, "-");
    let mut tunnel = H2Stream::new(send, request.into_body());
    let (from_pod, to_pod) = upstream.split();
    let from_pod = buffered::Gated::new(from_pod, budget);
    let carried = tokio::select! {
        carried = relay_tunnel((from_pod, to_pod), &mut tunnel, context.timeouts) => Ok(carried),
        why = ended(&authorized, &mut connection) => Err(why),
    };
    let carried = carried.unwrap_or_else(|why| {
        let _ = socket2::SockRef::from(&upstream).set_linger(Some(Duration::ZERO));
        Err(RelayError::Io(io::Error::other(why)))
    });
    log_carried(
        &context,
        &sender,
        target,
        started,
        &authorized.verdict,
        carried,
    );
}

/// The address a stream's `CONNECT` names, if it may be carried there: an address of the Pod
/// dialled (`pod`), on any port but 15008.
pub(crate) fn connect_target<B>(request: &Request<B>, pod: IpAddr) -> Option<SocketAddr> {
    (request.method() == Method::CONNECT)
        .then(|| {
            request
                .uri()
                .authority()?
                .as_str()
                .parse::<SocketAddr>()
                .ok()
        })
        .flatten()
        // As ztunnel: a stream reaches the Pod that was dialled, never another address; and never
        // the Pod's port 15008, which the routing would bring straight back here.
        .filter(|target| target.ip().to_canonical() == pod.to_canonical())
        .filter(|target| target.port() != hbone::PORT)
}

/// Why a stream carried must end before its relay does: its policy revoked, or its connection
/// gone (a Pod that neither reads nor has room to send would hold the stream until the idle timeout).
/// The Pod's side is then reset; the stream is reset as its tunnel is dropped unfinished.
async fn ended(
    authorized: &Authorized,
    connection: &mut tokio::sync::watch::Receiver<()>,
) -> &'static str {
    tokio::select! {
        () = authorized.revoked() => "closed: no longer allowed after a policy update",
        _ = connection.wait_for(|_| false) => "closed: the peer's connection ended",
    }
}

/// A socket to the Pod at `target`, from the sender's address when it is held.
async fn dial(
    context: &ProxyContext,
    sender: &Sender,
    target: SocketAddr,
) -> io::Result<TcpStream> {
    let sockets = &*context.sockets;
    match &sender.from {
        Some(from) => connect_from(sockets, from.ip(), target, CONNECT_TIMEOUT).await,
        None => crate::net::connect(sockets, target, CONNECT_TIMEOUT, None).await,
    }
}

/// The access log's line for a stream refused by the Pod's authorization policies.
fn log_denied(context: &ProxyContext, sender: &Sender, dst: SocketAddr, verdict: &Verdict) {
    let source = sender.source.to_string();
    let authorization = verdict.to_string();
    context.records.received(&Received {
        event: Event::Close,
        src_identity: &source,
        src: sender.peer,
        dst,
        bytes_in: 0,
        bytes_out: 0,
        duration: Duration::ZERO,
        end: ends::DENIED,
        authorization: &authorization,
        decided_by: "proxy",
    });
}

/// Tells Istio's families of a stream received that moved no byte: its open, or its refusal by
/// the Pod. (Access-log lines are written for streams that end.)
fn count_received(
    context: &ProxyContext,
    sender: &Sender,
    dst: SocketAddr,
    event: Event,
    end: &'static str,
) {
    let source = sender.source.to_string();
    context.records.received(&Received {
        event,
        src_identity: &source,
        src: sender.peer,
        dst,
        bytes_in: 0,
        bytes_out: 0,
        duration: Duration::ZERO,
        end,
        authorization: "-",
        decided_by: "proxy",
    });
}

/// Answers a stream with `code` and ends it.
fn refuse(respond: &mut SendResponse<Bytes>, code: StatusCode) {
    let _ = respond.send_response(status(code), true);
}

fn status(code: StatusCode) -> Response<()> {
    let mut response = Response::new(());
    *response.status_mut() = code;
    response
}

/// The access log's line for a stream received: who sent it (the identity its certificate names,
/// from which address), to which Pod, and what moved.
fn log_carried(
    context: &ProxyContext,
    sender: &Sender,
    dst: SocketAddr,
    started: Instant,
    verdict: &Verdict,
    carried: Result<Carried, RelayError>,
) {
    let source = sender.source.to_string();
    let authorization = verdict.to_string();
    let (bytes_in, bytes_out, end) = match &carried {
        // Sent is from the Pod into the tunnel: the sender's bytes in are those received.
        Ok(c) => (c.received, c.sent, "closed"),
        Err(RelayError::Idle(_)) => (0, 0, "idle timeout"),
        Err(RelayError::Write(_)) => (0, 0, "write timeout"),
        Err(RelayError::Io(_)) => (0, 0, "reset"),
    };
    context.records.received(&Received {
        event: Event::Close,
        src_identity: &source,
        src: sender.peer,
        dst,
        bytes_in,
        bytes_out,
        duration: started.elapsed(),
        end,
        authorization: &authorization,
        decided_by: "proxy",
    });
}
