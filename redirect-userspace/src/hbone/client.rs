//! The HBONE client: a tunnel to `authority` through a peer (a waypoint, or the data plane of the
//! node a Pod runs on), for one client identity. Tunnels of one identity to one peer share an
//! HTTP/2 connection (one stream each), as ztunnel pools them; a connection is opened again when
//! it closed, when its peer sent GOAWAY, or when the identity's certificate changed.
//!
//! A connection is dialled once however many tunnels wait for it: they all get the dial's result,
//! and a failed dial is remembered for [`FAILED_BACKOFF`]. A `CONNECT` the peer refused unprocessed
//! is sent once more: above a graceful GOAWAY's last stream, on a new connection; reset with
//! `REFUSED_STREAM`, on the same one (it still takes streams).
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::{Reason, client::SendRequest};
use http::{Method, Request, StatusCode};
use rustls::pki_types::ServerName;
use tokio::sync::watch;
use tracing::debug;

use super::{
    HboneMetrics, Identity, IdentityError, WorkloadCerts,
    stream::{self, H2Stream},
};
use crate::{lock::Locked, net::SocketFactory};

/// How long the TLS and HTTP/2 handshakes, and the waypoint's answer to a `CONNECT`, may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a failed dial is remembered: tunnels asking for that connection meanwhile get its error
/// at once. A burst of tunnels to a peer that is gone, or accepts TCP and never answers TLS, would
/// otherwise dial it again and again, each waiting out a handshake timeout; short, so that a peer
/// back up (a restarted waypoint) is dialled again within a second.
pub(super) const FAILED_BACKOFF: Duration = Duration::from_secs(1);

/// Streams one pooled connection carries at once before another is opened beside it, as ztunnel's
/// pool does (ztunnel's server, and hyper's, take 200 at a time: past that a tunnel would wait).
const MAX_STREAMS: usize = 100;

/// How long a pooled connection may carry no stream before it is closed (at the next tunnel
/// opened), as ztunnel releases unused pooled connections after five minutes.
const IDLE: Duration = Duration::from_secs(300);

/// The tunnel: a stream to `authority`. Its connection counts it as one of its streams while it
/// lives.
#[derive(Debug)]
pub(crate) struct Tunnel {
    pub stream: H2Stream,
    _counted: Counted,
}

/// One stream of a pooled connection, counted until dropped.
#[derive(Debug)]
struct Counted(Arc<Streams>);

impl Drop for Counted {
    fn drop(&mut self) {
        *self.0.last_ended.locked() = Instant::now();
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A pooled connection's streams: how many are open (or being opened), and when the last ended.
#[derive(Debug)]
struct Streams {
    open: AtomicUsize,
    last_ended: Mutex<Instant>,
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            open: AtomicUsize::new(0),
            last_ended: Mutex::new(Instant::now()),
        }
    }
}

/// Why there is no tunnel. Cloned: one failed dial is the error of every tunnel that waited for it.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum HboneError {
    #[error("no workload identities configured (--identity-dir or --ca-address)")]
    NoIdentities,
    #[error("the client's certificate: {0}")]
    Certificate(#[source] Arc<IdentityError>),
    #[error("connecting to the HBONE peer: {0}")]
    Connect(Arc<std::io::Error>),
    #[error("TLS with the HBONE peer: {0}")]
    Tls(Arc<std::io::Error>),
    #[error("the HBONE peer presented {presented}, not an identity of namespace {expected}")]
    Peer { presented: String, expected: String },
    #[error("HTTP/2 with the HBONE peer: {0}")]
    Http(#[source] Arc<h2::Error>),
    #[error("the HBONE peer answered CONNECT with {0}")]
    Status(StatusCode),
    #[error("the HBONE peer did not answer within {0:?}")]
    Timeout(Duration),
}

impl From<IdentityError> for HboneError {
    fn from(e: IdentityError) -> Self {
        HboneError::Certificate(Arc::new(e))
    }
}

impl From<h2::Error> for HboneError {
    fn from(e: h2::Error) -> Self {
        HboneError::Http(Arc::new(e))
    }
}

impl HboneError {
    /// Its `result` label.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            HboneError::NoIdentities => "no_identity",
            HboneError::Certificate(e) => match **e {
                IdentityError::Files(_) => "no_identity",
                IdentityError::Ca(_) => "ca_failed",
            },
            HboneError::Connect(_) | HboneError::Timeout(_) => "connect_failed",
            HboneError::Tls(_) | HboneError::Http(_) => "tls_refused",
            HboneError::Peer { .. } => "peer_refused",
            HboneError::Status(_) => "status",
        }
    }
}

/// What a dial gives every tunnel that waited for it.
type Dialled = Result<SendRequest<Bytes>, HboneError>;

/// Where a pooled connection stands.
#[derive(Debug, Default)]
enum Dial {
    /// Not dialled yet.
    #[default]
    None,
    /// Being dialled, by a task of its own: a tunnel that gives up waiting leaves the dial to the
    /// others. Its result is sent once, to all.
    Dialling(watch::Receiver<Option<Dialled>>),
    /// Dialled. Unusable once closed, or once its peer sent GOAWAY (`h2` then opens no new stream
    /// on it): the next tunnel dials again.
    Open(SendRequest<Bytes>),
    /// The last dial failed, at `at`.
    Failed { error: HboneError, at: Instant },
}

/// One pooled connection, dialled once however many tunnels ask for it at the same time (a
/// burst of first connections waits for one handshake rather than making one each, and a dial
/// that fails fails them all at once).
#[derive(Debug, Default)]
struct Pooled {
    dial: Mutex<Dial>,
    /// Its tunnels open, or being opened.
    streams: Arc<Streams>,
}

/// Whether no new stream can be opened on a connection: it failed, ended (`h2` marks a
/// connection dropped by its driver task as failed), or its peer sent GOAWAY. A connection at its
/// peer's stream limit is still usable: a new stream waits for room.
fn is_closed(requests: &mut SendRequest<Bytes>) -> bool {
    let mut polled = Context::from_waker(Waker::noop());
    matches!(requests.poll_ready(&mut polled), Poll::Ready(Err(_)))
}

/// Whether a dial's task ended without a result (it panicked, or the runtime is shutting down):
/// its task settles the pool's state before it drops the sender.
fn is_abandoned(dialled: &watch::Receiver<Option<Dialled>>) -> bool {
    dialled.has_changed().is_err()
}

/// Whether the peer refused a stream before processing it, so that it may be sent again
/// (RFC 9113 §8.7): above the last stream a graceful GOAWAY let through (`h2` fails those, and any
/// new stream of that connection, with the GOAWAY), or reset with `REFUSED_STREAM`. A GOAWAY with
/// an error code also ends streams the peer may have processed: those are not sent again.
fn is_unprocessed(e: &h2::Error) -> bool {
    e.is_remote()
        && match e.reason() {
            Some(Reason::NO_ERROR) => e.is_go_away(),
            Some(Reason::REFUSED_STREAM) => e.is_reset(),
            _ => false,
        }
}

impl Pooled {
    /// The open connection; or the one being dialled, once it is; or a new one from `dial`. Within
    /// [`FAILED_BACKOFF`] of a failed dial, its error.
    async fn sender<F>(self: &Arc<Self>, dial: impl FnOnce() -> F) -> Dialled
    where
        F: Future<Output = Dialled> + Send + 'static,
    {
        let mut dialled = match self.settled_or_dialling(dial) {
            Ok(settled) => return settled,
            Err(dialled) => dialled,
        };
        match dialled.wait_for(Option::is_some).await.as_deref() {
            Ok(Some(result)) => result.clone(),
            _ => Err(HboneError::Connect(Arc::new(std::io::Error::other(
                "the dial ended without a result",
            )))),
        }
    }

    /// What [`Pooled::sender`] gives at once, or else the dial to wait for (started from `dial`
    /// when none is under way).
    fn settled_or_dialling<F>(
        self: &Arc<Self>,
        dial: impl FnOnce() -> F,
    ) -> Result<Dialled, watch::Receiver<Option<Dialled>>>
    where
        F: Future<Output = Dialled> + Send + 'static,
    {
        let mut state = self.dial.locked();
        match &mut *state {
            Dial::Open(requests) => {
                if !is_closed(requests) {
                    return Ok(Ok(requests.clone()));
                }
            }
            Dial::Failed { error, at } => {
                if at.elapsed() < FAILED_BACKOFF {
                    return Ok(Err(error.clone()));
                }
            }
            Dial::Dialling(dialled) => {
                if !is_abandoned(dialled) {
                    return Err(dialled.clone());
                }
            }
            Dial::None => {}
        }
        let (done, dialled) = watch::channel(None);
        *state = Dial::Dialling(dialled.clone());
        tokio::spawn(self.clone().settle(dial(), done));
        Err(dialled)
    }

    /// Dials; keeps the result for the tunnels asking next, then hands it to those waiting.
    async fn settle(
        self: Arc<Self>,
        dial: impl Future<Output = Dialled>,
        done: watch::Sender<Option<Dialled>>,
    ) {
        let dialled = dial.await;
        *self.dial.locked() = match &dialled {
            Ok(requests) => Dial::Open(requests.clone()),
            Err(error) => Dial::Failed {
                error: error.clone(),
                at: Instant::now(),
            },
        };
        done.send_replace(Some(dialled));
    }

    /// Whether it holds no live connection and none is being dialled: one that ended or took
    /// GOAWAY, or a dial that failed more than [`FAILED_BACKOFF`] ago (kept, a peer that is gone
    /// would stay in the pool for good).
    fn is_spent(&self) -> bool {
        match &mut *self.dial.locked() {
            Dial::None => true,
            Dial::Dialling(dialled) => is_abandoned(dialled),
            Dial::Open(requests) => is_closed(requests),
            Dial::Failed { at, .. } => at.elapsed() >= FAILED_BACKOFF,
        }
    }

    /// Whether it carried no stream for [`IDLE`]: its peer may be gone (a deleted Pod's
    /// connection would otherwise live on its keep-alives), and the peer holds what it keeps for it.
    fn is_idle(&self) -> bool {
        self.streams.open.load(Ordering::Relaxed) == 0
            && self.streams.last_ended.locked().elapsed() > IDLE
    }
}

/// One pooled connection: by client identity, the address it is dialled from (a Pod's, or the
/// node's), waypoint, the namespace its certificate was checked against, the certificate
/// configuration in use, and which of the connections side by side (a new one each
/// [`MAX_STREAMS`] tunnels at once).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    client: Identity,
    source: Option<IpAddr>,
    waypoint: SocketAddr,
    waypoint_namespace: String,
    config: ConfigKey,
    shard: u32,
}

/// The certificate configuration a pooled connection was dialled with, compared by identity.
/// Held, not its address: a renewed certificate's configuration could otherwise land where a freed
/// one was and join a connection still open with the old certificate.
#[derive(Debug, Clone)]
struct ConfigKey(Arc<super::tls::WorkloadTls>);

impl PartialEq for ConfigKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ConfigKey {}

impl std::hash::Hash for ConfigKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.0).hash(state)
    }
}

#[derive(Debug)]
pub(crate) struct HboneClient {
    pub(super) identities: Option<Arc<WorkloadCerts>>,
    sockets: Arc<dyn SocketFactory>,
    pool: Mutex<HashMap<PoolKey, Arc<Pooled>>>,
    /// [`HANDSHAKE_TIMEOUT`]; shorter in tests.
    handshake: Duration,
    pub metrics: Arc<HboneMetrics>,
}

impl HboneClient {
    pub(crate) fn new(
        identities: Option<Arc<WorkloadCerts>>,
        sockets: Arc<dyn SocketFactory>,
        metrics: Arc<HboneMetrics>,
    ) -> Self {
        HboneClient {
            identities,
            sockets,
            pool: Mutex::new(HashMap::new()),
            handshake: HANDSHAKE_TIMEOUT,
            metrics,
        }
    }

    /// The client, its handshakes and `CONNECT`s given `timeout` rather than [`HANDSHAKE_TIMEOUT`].
    #[cfg(test)]
    pub(super) fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake = timeout;
        self
    }

    /// The identity of a pod of `namespace` running as `account`, in this mesh's trust domain.
    pub(crate) fn identity(&self, namespace: &str, account: &str) -> Option<Identity> {
        Some(Identity {
            trust_domain: self.identities.as_ref()?.trust_domain().to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        })
    }

    /// The TLS server configuration presenting `identity`'s certificate to peers that send to it.
    pub(crate) async fn server_tls(
        &self,
        identity: &Identity,
    ) -> Result<Arc<rustls::ServerConfig>, HboneError> {
        let identities = self.identities.as_ref().ok_or(HboneError::NoIdentities)?;
        let tls = identities
            .tls(&identity.namespace, &identity.service_account)
            .await?;
        Ok(tls.server.clone())
    }

    /// A tunnel to `authority` through the waypoint at `waypoint` (of namespace
    /// `waypoint_namespace`), as `client`, its connection dialled from `source` when given (the
    /// client Pod's address; the node's otherwise). Counted by result.
    pub(crate) async fn tunnel(
        &self,
        client: &Identity,
        source: Option<IpAddr>,
        waypoint: SocketAddr,
        waypoint_namespace: &str,
        authority: SocketAddr,
    ) -> Result<Tunnel, HboneError> {
        let result = self
            .open(client, source, waypoint, waypoint_namespace, authority)
            .await;
        self.metrics.tunnel(match &result {
            Ok(_) => "ok",
            Err(e) => e.label(),
        });
        result
    }

    async fn open(
        &self,
        client: &Identity,
        source: Option<IpAddr>,
        waypoint: SocketAddr,
        waypoint_namespace: &str,
        authority: SocketAddr,
    ) -> Result<Tunnel, HboneError> {
        let identities = self.identities.as_ref().ok_or(HboneError::NoIdentities)?;
        let config = identities
            .tls(&client.namespace, &client.service_account)
            .await?;
        let key = PoolKey {
            client: client.clone(),
            source,
            waypoint,
            waypoint_namespace: waypoint_namespace.to_string(),
            config: ConfigKey(config.clone()),
            shard: 0,
        };
        let dialer = Dialer {
            sockets: self.sockets.clone(),
            metrics: self.metrics.clone(),
            config: config.client.clone(),
            source,
            waypoint,
            waypoint_namespace: waypoint_namespace.to_string(),
            timeout: self.handshake,
        };
        let mut retried = false;
        loop {
            let (pooled, counted) = self.checkout(key.clone());
            let sender = pooled.sender(|| dialer.clone().dial()).await?;
            match self.request(sender, authority).await {
                // Refused unprocessed: a connection that took GOAWAY is left out of the pool
                // (`is_spent`) and the next checkout dials a new one; one that only refused the
                // stream is checked out again.
                Err(HboneError::Http(e)) if !retried && is_unprocessed(&e) => {
                    debug!(%waypoint, %authority, error = %e, "HBONE peer refused the CONNECT unprocessed; sending it again");
                    retried = true;
                }
                result => {
                    return result.map(|stream| Tunnel {
                        stream,
                        _counted: counted,
                    });
                }
            }
        }
    }

    /// The pooled connection of `key` with room for one more stream, that stream counted on it.
    fn checkout(&self, key: PoolKey) -> (Arc<Pooled>, Counted) {
        let mut pool = self.pool.locked();
        // Connections of a configuration replaced since are not reused: drop them (the
        // client's connections to other waypoints on this configuration stay).
        pool.retain(|k, p| {
            !p.is_spent() && !p.is_idle() && (k.client != key.client || k.config == key.config)
        });
        // The first connection with room for one more stream.
        let mut key = key;
        loop {
            let pooled = pool.entry(key.clone()).or_default().clone();
            let stream = Counted(pooled.streams.clone());
            if pooled.streams.open.fetch_add(1, Ordering::Relaxed) < MAX_STREAMS {
                return (pooled, stream);
            }
            key.shard += 1;
        }
    }

    /// A `CONNECT` to `authority` on `sender`'s connection, and the stream once the peer took it.
    async fn request(
        &self,
        sender: SendRequest<Bytes>,
        authority: SocketAddr,
    ) -> Result<H2Stream, HboneError> {
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(authority.to_string())
            .body(())
            .map_err(|_| HboneError::Status(StatusCode::BAD_REQUEST))?;
        let (response, send) = tokio::time::timeout(self.handshake, async {
            let mut requests = sender.ready().await?;
            let (response, send) = requests.send_request(request, false)?;
            Ok::<_, h2::Error>((response.await?, send))
        })
        .await
        .map_err(|_| HboneError::Timeout(self.handshake))??;
        if response.status() != StatusCode::OK {
            return Err(HboneError::Status(response.status()));
        }
        Ok(H2Stream::new(send, response.into_body()))
    }
}

/// What dialling a pooled connection takes, owned: the dial runs in a task of its own.
#[derive(Debug, Clone)]
struct Dialer {
    sockets: Arc<dyn SocketFactory>,
    metrics: Arc<HboneMetrics>,
    config: Arc<rustls::ClientConfig>,
    source: Option<IpAddr>,
    waypoint: SocketAddr,
    waypoint_namespace: String,
    timeout: Duration,
}

impl Dialer {
    /// A mutual-TLS HTTP/2 connection to the waypoint, its certificate checked to name an
    /// identity of `waypoint_namespace`.
    async fn dial(self) -> Dialled {
        let (waypoint, timeout) = (self.waypoint, self.timeout);
        let sockets = &*self.sockets;
        let tcp = match self.source {
            Some(ip) => crate::net::connect_from(sockets, ip, waypoint, timeout).await,
            None => crate::net::connect(sockets, waypoint, timeout, None).await,
        }
        .map_err(|e| HboneError::Connect(Arc::new(e)))?;
        let connector = tokio_rustls::TlsConnector::from(self.config);
        let handshake = connector.connect(ServerName::IpAddress(waypoint.ip().into()), tcp);
        let tls = tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| HboneError::Timeout(timeout))?
            .map_err(|e| HboneError::Tls(Arc::new(e)))?;
        let peer = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(Identity::of_leaf);
        match peer {
            Some(id) if id.namespace == self.waypoint_namespace => {}
            other => {
                return Err(HboneError::Peer {
                    presented: other.map_or_else(|| "no identity".to_string(), |id| id.to_string()),
                    expected: self.waypoint_namespace,
                });
            }
        }
        let (requests, mut connection) =
            tokio::time::timeout(timeout, stream::client_builder().handshake::<_, Bytes>(tls))
                .await
                .map_err(|_| HboneError::Timeout(timeout))??;
        self.metrics.connection();
        tokio::spawn(async move {
            let pings = connection.ping_pong();
            tokio::select! {
                driven = &mut connection => if let Err(e) = driven {
                    debug!(%waypoint, error = %e, "HBONE connection ended");
                },
                () = stream::keep_alive(pings) => {
                    debug!(%waypoint, "HBONE peer left a ping unanswered; closing the connection");
                }
            }
        });
        Ok(requests)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_is_closed_once_its_driver_ended() {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let server =
            tokio::spawn(async move { stream::server_builder().handshake::<_, Bytes>(far).await });
        let (mut requests, connection) = stream::client_builder()
            .handshake::<_, Bytes>(near)
            .await
            .unwrap();
        let driver = tokio::spawn(connection);
        let server = server.await.unwrap().unwrap();
        assert!(!is_closed(&mut requests), "a live connection");
        // The peer goes away: the driver task ends, and drops the connection.
        drop(server);
        let _ = driver.await;
        assert!(is_closed(&mut requests), "an ended connection");
    }

    /// A peer shutting down gracefully sends GOAWAY: its connection takes no new stream, so the
    /// pool dials another (the streams it already took go on).
    #[tokio::test]
    async fn a_connection_whose_peer_sent_goaway_is_closed_to_new_streams() {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let mut server = stream::server_builder()
                .handshake::<_, Bytes>(far)
                .await
                .unwrap();
            server.graceful_shutdown();
            while let Some(Ok(_)) = server.accept().await {}
        });
        let (mut requests, connection) = stream::client_builder()
            .handshake::<_, Bytes>(near)
            .await
            .unwrap();
        tokio::spawn(connection);
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            while !is_closed(&mut requests) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(closed.is_ok(), "still taking streams after GOAWAY");
        server.abort();
    }
}
