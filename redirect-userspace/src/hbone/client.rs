//! The HBONE client: a tunnel to `authority` through a peer (a waypoint, or the data plane of the
//! node a Pod runs on), for one client identity. Tunnels of one identity to one peer share an
//! HTTP/2 connection (one stream each), as ztunnel pools them; a connection is opened again when
//! it closed or when the identity's certificate changed.
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
use h2::client::SendRequest;
use http::{Method, Request, StatusCode};
use rustls::pki_types::ServerName;
use tracing::debug;

use super::{
    HboneMetrics, Identity, IdentityError, WorkloadCerts,
    stream::{self, H2Stream},
};
use crate::{lock::Locked, net::SocketFactory};

/// How long the TLS and HTTP/2 handshakes, and the waypoint's answer to a `CONNECT`, may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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

#[derive(Debug, thiserror::Error)]
pub(crate) enum HboneError {
    #[error("no workload identities configured (--identity-dir or --ca-address)")]
    NoIdentities,
    #[error("the client's certificate: {0}")]
    Certificate(#[from] IdentityError),
    #[error("connecting to the HBONE peer: {0}")]
    Connect(std::io::Error),
    #[error("TLS with the HBONE peer: {0}")]
    Tls(std::io::Error),
    #[error("the HBONE peer presented {presented}, not an identity of namespace {expected}")]
    Peer { presented: String, expected: String },
    #[error("HTTP/2 with the HBONE peer: {0}")]
    Http(#[from] h2::Error),
    #[error("the HBONE peer answered CONNECT with {0}")]
    Status(StatusCode),
    #[error("the HBONE peer did not answer within {HANDSHAKE_TIMEOUT:?}")]
    Timeout,
}

impl HboneError {
    /// Its `result` label.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            HboneError::NoIdentities | HboneError::Certificate(IdentityError::Files(_)) => {
                "no_identity"
            }
            HboneError::Certificate(IdentityError::Ca(_)) => "ca_failed",
            HboneError::Connect(_) | HboneError::Timeout => "connect_failed",
            HboneError::Tls(_) | HboneError::Http(_) => "tls_refused",
            HboneError::Peer { .. } => "peer_refused",
            HboneError::Status(_) => "status",
        }
    }
}

/// One pooled connection, dialled once however many tunnels ask for it at the same time (a
/// burst of first connections waits for one handshake rather than making one each).
#[derive(Debug, Default)]
struct Pooled {
    sender: tokio::sync::Mutex<Option<SendRequest<Bytes>>>,
    /// Its tunnels open, or being opened.
    streams: Arc<Streams>,
}

/// Whether no new stream can be opened on a connection: it failed, or ended (`h2` marks a
/// connection dropped by its driver task as failed). A connection at its peer's stream limit is
/// still usable: a new stream waits for room.
fn is_closed(requests: &mut SendRequest<Bytes>) -> bool {
    let mut polled = Context::from_waker(Waker::noop());
    matches!(requests.poll_ready(&mut polled), Poll::Ready(Err(_)))
}

impl Pooled {
    /// The open connection, or a new one from `dial` when there is none or it closed.
    async fn sender<F>(&self, dial: impl FnOnce() -> F) -> Result<SendRequest<Bytes>, HboneError>
    where
        F: Future<Output = Result<SendRequest<Bytes>, HboneError>>,
    {
        let mut held = self.sender.lock().await;
        if let Some(sender) = held.as_mut()
            && !is_closed(sender)
        {
            return Ok(sender.clone());
        }
        let sender = dial().await?;
        *held = Some(sender.clone());
        Ok(sender)
    }

    /// Whether it holds no live connection and none is being dialled: one that ended, or a dial
    /// that failed (kept, a peer that is gone would stay in the pool for good).
    fn is_spent(&self) -> bool {
        self.sender
            .try_lock()
            .is_ok_and(|mut s| s.as_mut().is_none_or(is_closed))
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
    config: usize,
    shard: u32,
}

#[derive(Debug)]
pub(crate) struct HboneClient {
    pub(super) identities: Option<Arc<WorkloadCerts>>,
    sockets: Arc<dyn SocketFactory>,
    pool: Mutex<HashMap<PoolKey, Arc<Pooled>>>,
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
            metrics,
        }
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
            config: Arc::as_ptr(&config) as usize,
            shard: 0,
        };
        let (pooled, stream) = {
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
                    break (pooled, stream);
                }
                key.shard += 1;
            }
        };
        let sender = pooled
            .sender(|| self.connect(config.client.clone(), source, waypoint, waypoint_namespace))
            .await?;
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(authority.to_string())
            .body(())
            .map_err(|_| HboneError::Status(StatusCode::BAD_REQUEST))?;
        let (response, send) = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
            let mut requests = sender.ready().await?;
            let (response, send) = requests.send_request(request, false)?;
            Ok::<_, h2::Error>((response.await?, send))
        })
        .await
        .map_err(|_| HboneError::Timeout)??;
        if response.status() != StatusCode::OK {
            return Err(HboneError::Status(response.status()));
        }
        Ok(Tunnel {
            stream: H2Stream::new(send, response.into_body()),
            _counted: stream,
        })
    }

    /// A mutual-TLS HTTP/2 connection to the waypoint, its certificate checked to name an
    /// identity of `waypoint_namespace`.
    async fn connect(
        &self,
        config: Arc<rustls::ClientConfig>,
        source: Option<IpAddr>,
        waypoint: SocketAddr,
        waypoint_namespace: &str,
    ) -> Result<SendRequest<Bytes>, HboneError> {
        let sockets = &*self.sockets;
        let tcp = match source {
            Some(ip) => crate::net::connect_from(sockets, ip, waypoint, HANDSHAKE_TIMEOUT).await,
            None => crate::net::connect(sockets, waypoint, HANDSHAKE_TIMEOUT, None).await,
        }
        .map_err(HboneError::Connect)?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let handshake = connector.connect(ServerName::IpAddress(waypoint.ip().into()), tcp);
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .map_err(|_| HboneError::Timeout)?
            .map_err(HboneError::Tls)?;
        let peer = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(Identity::of_leaf);
        match peer {
            Some(id) if id.namespace == waypoint_namespace => {}
            other => {
                return Err(HboneError::Peer {
                    presented: other.map_or_else(|| "no identity".to_string(), |id| id.to_string()),
                    expected: waypoint_namespace.to_string(),
                });
            }
        }
        let (requests, mut connection) = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            stream::client_builder().handshake::<_, Bytes>(tls),
        )
        .await
        .map_err(|_| HboneError::Timeout)??;
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
}
