//! HBONE, as ztunnel speaks it: HTTP/2 CONNECT over mutual TLS 1.3 (ALPN `h2`), each end
//! identified by the SPIFFE URI SAN of its certificate.
//!
//! `serve` is a terminator standing in for a waypoint: a CONNECT to a `--route` authority is carried
//! to its backend over plain TCP; it can also play a faulty peer ([`Fault`]). `client` opens one
//! tunnel. Events go to stdout, one line each.
use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::Empty;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo};
use integration::pki::uri_san;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, ring};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

mod faults;
pub(crate) use faults::Fault;

/// Limit for a TLS handshake, and for a TCP connect to a backend or terminator.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const ALPN_H2: &[u8] = b"h2";

/// What `rdt-peer hbone` is given.
#[derive(Debug)]
pub(crate) struct ServeArgs {
    pub(crate) name: String,
    pub(crate) listen: Vec<SocketAddr>,
    pub(crate) cert: std::path::PathBuf,
    pub(crate) key: std::path::PathBuf,
    pub(crate) root: std::path::PathBuf,
    /// `AUTHORITY=BACKEND`.
    pub(crate) routes: Vec<String>,
    pub(crate) fault: Fault,
}

/// What `rdt-peer hbone-client` is given.
#[derive(Debug)]
pub(crate) struct ClientArgs {
    pub(crate) connect: SocketAddr,
    pub(crate) cert: std::path::PathBuf,
    pub(crate) key: std::path::PathBuf,
    pub(crate) root: std::path::PathBuf,
    pub(crate) authority: String,
    pub(crate) send: Option<String>,
}

/// One line to stdout, flushed at once (the harness reads it as it comes).
pub(crate) fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// An error on one line.
fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().replace(['\n', '\r'], " ")
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let chain = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", path.display()))?;
    if chain.is_empty() {
        bail!("no certificate in {}", path.display());
    }
    Ok(chain)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .with_context(|| format!("reading a key from {}", path.display()))
}

fn load_roots(path: &Path) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in load_chain(path)? {
        roots
            .add(cert)
            .with_context(|| format!("a root in {}", path.display()))?;
    }
    Ok(Arc::new(roots))
}

/// The SPIFFE identity (first URI SAN) of the first certificate the peer presented, or `-`.
fn peer_identity(certs: Option<&[CertificateDer<'static>]>) -> String {
    certs
        .and_then(|certs| certs.first())
        .and_then(|cert| uri_san(cert))
        .unwrap_or_else(|| "-".to_string())
}

/// `203.0.113.10:80` and `[2001:db8::1]:80` as `SocketAddr` prints them; anything else as given.
fn normalize_authority(authority: &str) -> String {
    authority
        .parse::<SocketAddr>()
        .map_or_else(|_| authority.to_string(), |a| a.to_string())
}

struct Terminator {
    routes: HashMap<String, SocketAddr>,
    fault: Fault,
    /// TCP connections accepted so far.
    accepted: AtomicUsize,
}

pub(crate) fn serve(args: ServeArgs) -> Result<()> {
    if args.listen.is_empty() {
        bail!("nothing to serve: give --listen");
    }
    let mut routes = HashMap::new();
    for route in &args.routes {
        let (authority, backend) = route
            .split_once('=')
            .with_context(|| format!("--route {route}: want AUTHORITY=BACKEND"))?;
        let backend: SocketAddr = backend
            .parse()
            .with_context(|| format!("--route {route}: backend {backend} is not IP:PORT"))?;
        routes.insert(normalize_authority(authority), backend);
    }
    let chain = load_chain(&args.cert)?;
    let key = load_key(&args.key)?;
    let roots = load_roots(&args.root)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
        .build()
        .context("building the client certificate verifier")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("the server certificate and key")?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let terminator = Arc::new(Terminator {
        routes,
        fault: args.fault,
        accepted: AtomicUsize::new(0),
    });
    let name = args.name;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        // Bind everything first: a bad address fails the start.
        let mut listeners = Vec::new();
        for addr in &args.listen {
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            listeners.push(listener);
        }
        eprintln!("rdt-peer {name}: hbone terminator");
        let mut tasks = Vec::new();
        for listener in listeners {
            let local = listener.local_addr().context("local address")?;
            say(&format!("listening {local}"));
            tasks.push(tokio::spawn(accept_loop(
                listener,
                acceptor.clone(),
                terminator.clone(),
            )));
        }
        for task in tasks {
            let _ = task.await;
        }
        Ok(())
    })
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, terminator: Arc<Terminator>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("rdt-peer: accept: {e}");
                // EMFILE and friends: do not spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let n = terminator.accepted.fetch_add(1, Ordering::Relaxed) + 1;
        say(&format!("accepted n={n} from={peer}"));
        if terminator.fault == Fault::StallTls {
            tokio::spawn(faults::stall(stream, n));
            continue;
        }
        tokio::spawn(serve_connection(
            stream,
            peer,
            n,
            acceptor.clone(),
            terminator.clone(),
        ));
    }
}

/// TLS connection `n`: the handshake, then HTTP/2 with one CONNECT tunnel per stream (the first
/// turned away when the fault says so).
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    n: usize,
    acceptor: TlsAcceptor,
    terminator: Arc<Terminator>,
) {
    let _ = stream.set_nodelay(true);
    let tls = match timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            say(&format!("refused tls error={}", one_line(&e)));
            return;
        }
        Err(_) => {
            say("refused tls error=handshake timed out");
            return;
        }
    };
    let identity: Arc<str> = Arc::from(peer_identity(tls.get_ref().1.peer_certificates()));
    let fault = terminator.fault;
    let served = if fault.turns_away(n) {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let shim = tokio::spawn(faults::turn_away_first_stream(tls, far, fault));
        let served = serve_http2(near, terminator, identity, true).await;
        if let Ok(Err(e)) = shim.await {
            eprintln!("rdt-peer: hbone connection from {peer}: frames: {e}");
        }
        served
    } else {
        serve_http2(tls, terminator, identity, false).await
    };
    if let Err(e) = served {
        eprintln!(
            "rdt-peer: hbone connection from {peer}: {:#}",
            anyhow::Error::new(e)
        );
    }
    say(&format!("ended n={n}"));
}

/// HTTP/2 on `io`, each CONNECT carried by [`handle`]. `unindexed`: the client may not index
/// headers (HPACK's dynamic table size 0), so a header block kept from hyper leaves its decoder
/// in step.
async fn serve_http2<I>(
    io: I,
    terminator: Arc<Terminator>,
    identity: Arc<str>,
    unindexed: bool,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let service = service_fn(move |req| {
        let terminator = terminator.clone();
        let identity = identity.clone();
        async move { Ok::<_, Infallible>(handle(req, &terminator, identity).await) }
    });
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    if unindexed {
        builder.header_table_size(0);
    }
    builder.serve_connection(TokioIo::new(io), service).await
}

fn empty(status: StatusCode) -> Response<Empty<Bytes>> {
    let mut response = Response::new(Empty::new());
    *response.status_mut() = status;
    response
}

async fn handle(
    mut req: Request<Incoming>,
    terminator: &Terminator,
    identity: Arc<str>,
) -> Response<Empty<Bytes>> {
    if req.method() != Method::CONNECT {
        say(&format!("refused method={}", req.method()));
        return empty(StatusCode::BAD_REQUEST);
    }
    let authority = req
        .uri()
        .authority()
        .map_or_else(|| "-".to_string(), |a| a.to_string());
    let Some(&backend) = terminator.routes.get(&normalize_authority(&authority)) else {
        say(&format!(
            "connect authority={authority} identity={identity} backend=- status=503"
        ));
        return empty(StatusCode::SERVICE_UNAVAILABLE);
    };
    let upstream = match timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(backend)).await {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(e)) => {
            eprintln!("rdt-peer: hbone {authority}: connecting {backend}: {e}");
            say(&format!(
                "connect authority={authority} identity={identity} backend={backend} status=503"
            ));
            return empty(StatusCode::SERVICE_UNAVAILABLE);
        }
        Err(_) => {
            eprintln!("rdt-peer: hbone {authority}: connecting {backend}: timed out");
            say(&format!(
                "connect authority={authority} identity={identity} backend={backend} status=503"
            ));
            return empty(StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    let _ = upstream.set_nodelay(true);
    say(&format!(
        "connect authority={authority} identity={identity} backend={backend} status=200"
    ));
    // hyper hands over the stream once the 200 below has been sent.
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => upgraded,
            Err(e) => {
                eprintln!("rdt-peer: hbone {authority}: upgrade: {e}");
                say(&format!("closed authority={authority} sent=0 received=0"));
                return;
            }
        };
        let mut client = Counted::new(TokioIo::new(upgraded));
        let mut upstream = Counted::new(upstream);
        if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            eprintln!("rdt-peer: hbone {authority}: relay: {e}");
        }
        say(&format!(
            "closed authority={authority} sent={} received={}",
            upstream.read, client.read
        ));
    });
    empty(StatusCode::OK)
}

/// A stream that counts the bytes read from it.
struct Counted<T> {
    inner: T,
    read: u64,
}

impl<T> Counted<T> {
    fn new(inner: T) -> Self {
        Counted { inner, read: 0 }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.read += (buf.filled().len() - before) as u64;
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Accepts a server certificate that chains to the roots (webpki, serverAuth), whatever names it
/// carries: HBONE identifies a server by its SPIFFE URI, not a DNS name.
#[derive(Debug)]
struct ChainOnly {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Prints `peer identity=URI` after the TLS handshake, `status N` for the CONNECT, and on 200
/// sends `--send`, half-closes and prints `got TEXT` (all read back until EOF).
pub(crate) fn client(args: ClientArgs) -> Result<()> {
    let provider = provider();
    let verifier = ChainOnly {
        roots: load_roots(&args.root)?,
        algorithms: provider.signature_verification_algorithms,
    };
    let chain = load_chain(&args.cert)?;
    let key = load_key(&args.key)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(chain, key)
        .context("the client certificate and key")?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    let connector = TlsConnector::from(Arc::new(config));

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let addr = args.connect;
        let tcp = timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
            .await
            .with_context(|| format!("connecting {addr}: timed out"))?
            .with_context(|| format!("connecting {addr}"))?;
        let _ = tcp.set_nodelay(true);
        // No server name check: an IP name sends no SNI, and the verifier ignores it.
        let tls = timeout(
            HANDSHAKE_TIMEOUT,
            connector.connect(ServerName::IpAddress(addr.ip().into()), tcp),
        )
        .await
        .context("TLS handshake: timed out")?
        .context("TLS handshake")?;
        say(&format!(
            "peer identity={}",
            peer_identity(tls.get_ref().1.peer_certificates())
        ));
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .context("HTTP/2 handshake")?;
        // The connection's own error says why a request failed (a TLS alert from a server that
        // refused our certificate arrives only here, after the handshake).
        let mut connection = tokio::spawn(async move {
            connection
                .await
                .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
        });
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(args.authority.as_str())
            .body(Empty::<Bytes>::new())
            .with_context(|| format!("a CONNECT to {}", args.authority))?;
        let response = match sender.send_request(request).await {
            Ok(response) => response,
            Err(e) => {
                let e = anyhow::Error::new(e).context(format!("CONNECT {}", args.authority));
                return Err(
                    match timeout(Duration::from_secs(1), &mut connection).await {
                        Ok(Ok(Err(why))) => e.context(format!("the connection failed: {why}")),
                        _ => e,
                    },
                );
            }
        };
        let status = response.status();
        say(&format!("status {}", status.as_u16()));
        if status != StatusCode::OK {
            bail!("CONNECT {}: status {status}", args.authority);
        }
        let upgraded = hyper::upgrade::on(response)
            .await
            .context("taking the tunnel")?;
        let mut tunnel = TokioIo::new(upgraded);
        if let Some(text) = &args.send {
            tunnel.write_all(text.as_bytes()).await.context("sending")?;
        }
        tunnel.shutdown().await.context("half-closing")?;
        let mut back = Vec::new();
        tunnel
            .read_to_end(&mut back)
            .await
            .context("reading the tunnel")?;
        say(&format!("got {}", String::from_utf8_lossy(&back)));
        Ok(())
    })
}
