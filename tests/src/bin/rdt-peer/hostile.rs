//! A hostile HBONE peer: it holds a valid workload certificate of the trust domain, so it passes
//! the receiving agent's handshake, and then does what a well-behaved node never does.
//!
//! - `flood`: `--conns` connections, each granting the largest windows it may, each with
//!   `--streams` CONNECTs to a Pod that sends and never reads; once they are answered it stops
//!   reading the connection (so what the Pods send piles up in the agent) and sends into every
//!   stream as long as the windows it was given last. `--push-ms` after the last connection it
//!   prints `ready conns= refused= streams= ok= first_error=`, and holds until stdin.
//! - `reset`: one connection, `--rounds` rounds of `--streams` CONNECTs, each round reset
//!   `--reset-ms` after it was sent. Prints `done sent= answered= refused= cancelled= other= ms=`.
//! - `idle`: `--conns` connections (from each `--from` address in turn) that open no stream and
//!   answer pings. Prints `ready conns= refused= first_error=`, holds until stdin, then prints
//!   `done alive=` (those the agent had not closed).
use std::io::BufRead as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use h2::Reason;
use h2::client::{ResponseFuture, SendRequest};
use hyper::{Method, Request, StatusCode};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, ring};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::timeout;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::hbone::say;

/// Limit for a TCP connect, a TLS or an HTTP/2 handshake, and the answers to a round of CONNECTs.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest windows HTTP/2 allows (2^31 - 1) and its largest frame.
const MAX_WINDOW: u32 = (1 << 31) - 1;
const MAX_FRAME: u32 = (1 << 24) - 1;
/// What is sent into a stream at a time.
const CHUNK: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum Mode {
    Flood,
    Reset,
    Idle,
}

/// What `rdt-peer hostile` is given.
#[derive(Debug)]
pub(crate) struct HostileArgs {
    pub(crate) mode: Mode,
    pub(crate) connect: SocketAddr,
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    /// The CONNECT target, `IP:PORT`.
    pub(crate) authority: String,
    pub(crate) conns: usize,
    pub(crate) streams: usize,
    pub(crate) rounds: usize,
    pub(crate) reset_ms: u64,
    pub(crate) push_ms: u64,
    /// Source addresses, taken in turn (none: the kernel picks).
    pub(crate) from: Vec<IpAddr>,
}

pub(crate) fn run(args: HostileArgs) -> Result<()> {
    let connector = connector(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async move {
        match args.mode {
            Mode::Flood => flood(&args, &connector).await,
            Mode::Reset => reset(&args, &connector).await,
            Mode::Idle => idle(&args, &connector).await,
        }
    })
}

/// One connection's HTTP/2 side and what stops its reads.
struct Dialled {
    sender: SendRequest<Bytes>,
    reads: ReadSwitch,
    ended: Arc<AtomicBool>,
}

/// TCP (from `from`), TLS with our certificate, HTTP/2 (with the largest windows if `wide`); the
/// connection is driven by a task of its own, which answers pings.
async fn dial(
    connector: &TlsConnector,
    to: SocketAddr,
    from: Option<IpAddr>,
    wide: bool,
) -> Result<Dialled> {
    let socket = if to.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(from) = from {
        socket
            .bind(SocketAddr::new(from, 0))
            .with_context(|| format!("binding {from}"))?;
    }
    let tcp: TcpStream = timeout(STEP_TIMEOUT, socket.connect(to))
        .await
        .context("connect timed out")?
        .context("connect")?;
    let _ = tcp.set_nodelay(true);
    let tls = timeout(
        STEP_TIMEOUT,
        connector.connect(ServerName::IpAddress(to.ip().into()), tcp),
    )
    .await
    .context("TLS handshake timed out")?
    .context("TLS handshake")?;
    let reads = ReadSwitch::default();
    let io = Gate {
        inner: tls,
        reads: reads.clone(),
    };
    let mut builder = h2::client::Builder::new();
    if wide {
        builder
            .initial_window_size(MAX_WINDOW)
            .initial_connection_window_size(MAX_WINDOW)
            .max_frame_size(MAX_FRAME);
    }
    let (sender, connection) = timeout(STEP_TIMEOUT, builder.handshake::<_, Bytes>(io))
        .await
        .context("HTTP/2 handshake timed out")?
        .context("HTTP/2 handshake")?;
    let ended = Arc::new(AtomicBool::new(false));
    let flag = ended.clone();
    tokio::spawn(async move {
        let _ = connection.await;
        flag.store(true, Ordering::Release);
    });
    // The server's SETTINGS (its stream cap) arrive with the first exchange.
    let sender = timeout(STEP_TIMEOUT, sender.ready())
        .await
        .context("HTTP/2 not ready in time")?
        .context("HTTP/2 not ready")?;
    Ok(Dialled {
        sender,
        reads,
        ended,
    })
}

fn connect_request(authority: &str) -> Result<Request<()>> {
    Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .body(())
        .with_context(|| format!("a CONNECT to {authority}"))
}

/// `flood`: see the module's doc.
async fn flood(args: &HostileArgs, connector: &TlsConnector) -> Result<()> {
    let (mut held, mut refused, mut streams, mut ok) = (Vec::new(), 0, 0, 0);
    let (mut first_error, mut pushers) = (None, Vec::new());
    for i in 0..args.conns {
        let from = pick(&args.from, i);
        let dialled = match dial(connector, args.connect, from, true).await {
            Ok(dialled) => dialled,
            Err(e) => {
                refused += 1;
                first_error.get_or_insert_with(|| one_line(&e));
                continue;
            }
        };
        let mut answers = Vec::new();
        for _ in 0..args.streams {
            let sender = timeout(STEP_TIMEOUT, dialled.sender.clone().ready()).await;
            let Ok(Ok(mut sender)) = sender else { break };
            let Ok((response, send)) =
                sender.send_request(connect_request(&args.authority)?, false)
            else {
                break;
            };
            streams += 1;
            answers.push((response, send));
        }
        for (response, send) in answers {
            let Ok(Ok(response)) = timeout(STEP_TIMEOUT, response).await else {
                continue;
            };
            if response.status() != StatusCode::OK {
                continue;
            }
            ok += 1;
            pushers.push(send);
        }
        // Reading on would only move the Pods' bytes into this process; stopped, they stay in
        // the agent.
        dialled.reads.stop();
        pushers
            .drain(..)
            .for_each(|send| drop(tokio::spawn(push(send))));
        held.push(dialled);
    }
    tokio::time::sleep(Duration::from_millis(args.push_ms)).await;
    say(&format!(
        "ready conns={} refused={refused} streams={streams} ok={ok} first_error={}",
        held.len(),
        first_error.as_deref().unwrap_or("-")
    ));
    wait_stdin().await;
    say("done");
    Ok(())
}

/// Sends pattern bytes into the stream for as long as it is given window.
async fn push(mut send: h2::SendStream<Bytes>) {
    let chunk = Bytes::from(vec![0x5a; CHUNK]);
    loop {
        send.reserve_capacity(CHUNK);
        let granted = std::future::poll_fn(|cx| send.poll_capacity(cx)).await;
        let Some(Ok(n)) = granted else { return };
        if n == 0 {
            continue;
        }
        if send.send_data(chunk.slice(..n.min(CHUNK)), false).is_err() {
            return;
        }
    }
}

/// `reset`: see the module's doc.
async fn reset(args: &HostileArgs, connector: &TlsConnector) -> Result<()> {
    let started = Instant::now();
    let dialled = dial(connector, args.connect, pick(&args.from, 0), false).await?;
    let tally = Arc::new(Tally::default());
    let mut sent = 0;
    for _ in 0..args.rounds {
        let mut round = Vec::with_capacity(args.streams);
        for _ in 0..args.streams {
            let mut sender = timeout(STEP_TIMEOUT, dialled.sender.clone().ready())
                .await
                .context("no room for a stream in time")?
                .context("the connection failed")?;
            let (response, send) = sender
                .send_request(connect_request(&args.authority)?, false)
                .context("sending a CONNECT")?;
            sent += 1;
            round.push((tokio::spawn(answer(response, tally.clone())), send));
        }
        tokio::time::sleep(Duration::from_millis(args.reset_ms)).await;
        for (answer, mut send) in round {
            send.send_reset(Reason::CANCEL);
            let _ = answer.await;
        }
    }
    say(&format!(
        "done sent={sent} answered={} refused={} cancelled={} other={} ms={}",
        tally.answered.load(Ordering::Acquire),
        tally.refused.load(Ordering::Acquire),
        tally.cancelled.load(Ordering::Acquire),
        tally.other.load(Ordering::Acquire),
        started.elapsed().as_millis()
    ));
    Ok(())
}

/// How the CONNECTs of `reset` ended.
#[derive(Default)]
struct Tally {
    /// The agent answered (it should not have: the Pod's port drops SYNs).
    answered: AtomicUsize,
    /// Refused by the agent (`REFUSED_STREAM`): past its streams in flight.
    refused: AtomicUsize,
    /// Reset by us.
    cancelled: AtomicUsize,
    other: AtomicUsize,
}

async fn answer(response: ResponseFuture, tally: Arc<Tally>) {
    let counter = match response.await {
        Ok(_) => &tally.answered,
        Err(e) => match e.reason() {
            Some(Reason::REFUSED_STREAM) => &tally.refused,
            Some(Reason::CANCEL) => &tally.cancelled,
            _ => &tally.other,
        },
    };
    counter.fetch_add(1, Ordering::AcqRel);
}

/// `idle`: see the module's doc.
async fn idle(args: &HostileArgs, connector: &TlsConnector) -> Result<()> {
    let (mut held, mut refused, mut first_error) = (Vec::new(), 0, None);
    for i in 0..args.conns {
        match dial(connector, args.connect, pick(&args.from, i), false).await {
            Ok(dialled) => held.push(dialled),
            Err(e) => {
                refused += 1;
                first_error.get_or_insert_with(|| one_line(&e));
            }
        }
    }
    // A connection the agent closes after its handshake is not held.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let alive = |held: &[Dialled]| {
        held.iter()
            .filter(|d| !d.ended.load(Ordering::Acquire))
            .count()
    };
    say(&format!(
        "ready conns={} refused={refused} first_error={}",
        alive(&held),
        first_error.as_deref().unwrap_or("-")
    ));
    wait_stdin().await;
    say(&format!("done alive={}", alive(&held)));
    Ok(())
}

fn pick(from: &[IpAddr], i: usize) -> Option<IpAddr> {
    (!from.is_empty()).then(|| from[i % from.len()])
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace(['\n', '\r', ' '], "_")
}

/// Until a line (or the end) on stdin.
async fn wait_stdin() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
    })
    .await;
}

/// Turns a connection's reads off for good: from then on it neither reads what the agent sends nor
/// sees its window updates and pings.
#[derive(Clone, Default)]
struct ReadSwitch(Arc<AtomicBool>);

impl ReadSwitch {
    fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }
}

struct Gate {
    inner: TlsStream<TcpStream>,
    reads: ReadSwitch,
}

impl AsyncRead for Gate {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.reads.0.load(Ordering::Acquire) {
            // Never woken: the process ends without reading again.
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Gate {
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

/// TLS 1.3, ALPN h2, our certificate; any server certificate is taken (its handshake signature
/// is still checked): a hostile peer has no reason to doubt whom it attacks.
fn connector(args: &HostileArgs) -> Result<TlsConnector> {
    let provider = Arc::new(ring::default_provider());
    let chain = CertificateDer::pem_file_iter(&args.cert)
        .with_context(|| format!("reading {}", args.cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", args.cert.display()))?;
    if chain.is_empty() {
        bail!("no certificate in {}", args.cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(&args.key)
        .with_context(|| format!("reading a key from {}", args.key.display()))?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_client_auth_cert(chain, key)
        .context("the client certificate and key")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

#[derive(Debug)]
struct AnyServer(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
