//! HBONE against an in-process waypoint: mutual TLS both ways, the `CONNECT` authority, pooling,
//! rotation, and each refusal counted.
use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::Empty;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

use super::*;
use crate::net::PlainSockets;

/// A test CA of one trust domain.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    trust_domain: String,
}

/// A leaf's chain (leaf, root) and key, in PEM.
struct Leaf {
    chain: String,
    key: String,
}

impl Ca {
    fn new(trust_domain: &str) -> Ca {
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params
            .distinguished_name
            .push(DnType::CommonName, format!("test root {trust_domain}"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Ca {
            issuer,
            trust_domain: trust_domain.to_string(),
        }
    }

    fn leaf(&self, namespace: &str, account: &str) -> Leaf {
        let uri = format!("spiffe://{}/ns/{namespace}/sa/{account}", self.trust_domain);
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(uri.as_str().try_into().unwrap())];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            chain: format!("{}{}", cert.pem(), self.issuer.pem()),
            key: key.serialize_pem(),
        }
    }

    /// `dir` as `--identity-dir` reads it, with one identity.
    fn write_identity(&self, dir: &Path, namespace: &str, account: &str) {
        let leaf = self.leaf(namespace, account);
        let own = dir.join(namespace).join(account);
        std::fs::create_dir_all(&own).unwrap();
        write_atomically(&own.join("cert-chain.pem"), &leaf.chain);
        write_atomically(&own.join("key.pem"), &leaf.key);
        write_atomically(&dir.join("root-cert.pem"), &self.issuer.pem());
    }
}

fn write_atomically(path: &Path, text: &str) {
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, text).unwrap();
    std::fs::rename(&temp, path).unwrap();
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("hbone-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the stand-in waypoint saw of each `CONNECT`: the authority and the client's identity.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// A waypoint stand-in at a loopback address: requires a client certificate of `trusted`, presents
/// `leaf`, answers each `CONNECT` with 200 and echoes the tunnel's bytes.
async fn waypoint(trusted: &Ca, leaf: Leaf) -> (SocketAddr, Seen) {
    let acceptor = acceptor(trusted, leaf);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, record) = (acceptor.clone(), record.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve(tls, record).await;
                }
            });
        }
    });
    (addr, seen)
}

/// A waypoint's TLS: a client certificate of `trusted` required, `leaf` presented, HTTP/2.
fn acceptor(trusted: &Ca, leaf: Leaf) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.issuer.der().clone()).unwrap();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(leaf.chain.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// Serves one accepted connection as a waypoint does: each `CONNECT` recorded in `record`,
/// answered with 200, and its bytes echoed.
async fn serve(tls: TlsStream<TcpStream>, record: Seen) {
    let client = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| Identity::of_certificate(&c[0]))
        .map_or_else(|| "-".to_string(), |id| id.to_string());
    let service = service_fn(move |req: Request<Incoming>| {
        let (record, client) = (record.clone(), client.clone());
        async move {
            if req.method() != Method::CONNECT {
                let mut bad = Response::new(Empty::<Bytes>::new());
                *bad.status_mut() = StatusCode::BAD_REQUEST;
                return Ok::<_, hyper::Error>(bad);
            }
            let authority = req.uri().authority().map(|a| a.to_string());
            record
                .lock()
                .unwrap()
                .push((authority.unwrap_or_default(), client));
            tokio::spawn(async move {
                if let Ok(upgraded) = hyper::upgrade::on(req).await {
                    let (mut r, mut w) = tokio::io::split(TokioIo::new(upgraded));
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                }
            });
            Ok(Response::new(Empty::<Bytes>::new()))
        }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(tls), service)
        .await;
}

/// A waypoint stand-in that is shutting down: it answers the first `CONNECT` of each of its first
/// `refusing` connections with GOAWAY(last stream 0), then serves as [`waypoint`] does. Counts the
/// connections it accepted.
async fn goaway_waypoint(
    trusted: &Ca,
    leaf: Leaf,
    refusing: usize,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let acceptor = acceptor(trusted, leaf);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let nth = count.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                match acceptor.accept(tcp).await {
                    Ok(tls) if nth < refusing => refuse_with_goaway(tls).await,
                    Ok(tls) => serve(tls, Seen::default()).await,
                    Err(_) => {}
                }
            });
        }
    });
    (addr, accepted)
}

/// Answers the first `CONNECT` with GOAWAY(last stream 0, NO_ERROR): the stream was never
/// processed (RFC 9113 §6.8). Raw frames: `h2`'s server would name the `CONNECT`'s stream as the
/// last it took. Then waits for the client to leave.
async fn refuse_with_goaway(mut tls: TlsStream<TcpStream>) {
    let mut preface = [0; 24];
    if tls.read_exact(&mut preface).await.is_err() {
        return;
    }
    // Frames until the CONNECT's HEADERS (type 1).
    loop {
        let mut header = [0; 9];
        if tls.read_exact(&mut header).await.is_err() {
            return;
        }
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0; length];
        if tls.read_exact(&mut payload).await.is_err() {
            return;
        }
        if header[3] == 1 {
            break;
        }
    }
    #[rustfmt::skip]
    let settings_then_goaway = [
        0, 0, 0, 4, 0, 0, 0, 0, 0,
        0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let _ = tls.write_all(&settings_then_goaway).await;
    let _ = tls.flush().await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
}

/// A peer that accepts TCP and never says a word (no TLS). Counts the connections it accepted,
/// and holds them open.
async fn silent_peer() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(tcp);
        }
    });
    (addr, accepted)
}

fn client(dir: &Path, trust_domain: &str) -> HboneClient {
    let identities = IdentityDir::new(
        dir.to_path_buf(),
        Arc::new(TrustDomain::fixed(trust_domain.to_string())),
    );
    HboneClient::new(
        Some(Arc::new(WorkloadCerts::Files(identities))),
        Arc::new(PlainSockets),
        Arc::default(),
    )
}

fn identity(namespace: &str, account: &str) -> Identity {
    Identity {
        trust_domain: "cluster.local".to_string(),
        namespace: namespace.to_string(),
        service_account: account.to_string(),
    }
}

/// Writes `text` into a tunnel, closes its sending half and reads everything back.
async fn echo(tunnel: &mut client::Tunnel, text: &str) -> String {
    let stream = &mut tunnel.stream;
    stream
        .send
        .send(Bytes::from(text.to_string()))
        .await
        .unwrap();
    stream.send.finish().await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(5), stream.recv.read_to_end())
        .await
        .unwrap()
        .unwrap();
    String::from_utf8(back).unwrap()
}

#[tokio::test]
async fn a_tunnel_carries_bytes_to_the_authority_as_the_client_identity() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("tunnel");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, seen) = waypoint(&ca, ca.leaf("team-a", "team-a-waypoint")).await;
    let hbone = client(&dir, "cluster.local");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    for text in ["first", "second"] {
        let mut tunnel = hbone
            .tunnel(
                &identity("team-a", "sleep"),
                None,
                addr,
                "team-a",
                authority,
            )
            .await
            .unwrap();
        assert_eq!(echo(&mut tunnel, text).await, text);
    }
    let seen = seen.lock().unwrap().clone();
    let expected = (
        "203.0.113.10:80".to_string(),
        "spiffe://cluster.local/ns/team-a/sa/sleep".to_string(),
    );
    assert_eq!(seen, vec![expected.clone(), expected]);
    assert_eq!(hbone.metrics.tunnels("ok"), 2);
    // Both tunnels were streams of one connection.
    assert_eq!(hbone.metrics.connections(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A connection carries at most 100 tunnels at once (a peer takes 200 at a time, as ztunnel's and
/// hyper's servers do: past that a tunnel would wait): the 101st open one rides a second
/// connection, and once tunnels end, the first has room again.
#[tokio::test]
async fn past_a_hundred_open_tunnels_another_connection_is_opened_beside_the_first() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("streams");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, _) = waypoint(&ca, ca.leaf("team-a", "team-a-waypoint")).await;
    let hbone = client(&dir, "cluster.local");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let who = identity("team-a", "sleep");
    let mut open = Vec::new();
    for _ in 0..101 {
        open.push(
            hbone
                .tunnel(&who, None, addr, "team-a", authority)
                .await
                .unwrap(),
        );
    }
    assert_eq!(hbone.metrics.connections(), 2);
    assert_eq!(
        echo(open.last_mut().unwrap(), "on the second").await,
        "on the second"
    );
    open.truncate(50);
    let mut next = hbone
        .tunnel(&who, None, addr, "team-a", authority)
        .await
        .unwrap();
    assert_eq!(
        echo(&mut next, "on the first again").await,
        "on the first again"
    );
    assert_eq!(hbone.metrics.connections(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_waypoint_of_another_trust_domain_or_namespace_is_refused_and_counted() {
    let ca = Ca::new("cluster.local");
    let other = Ca::new("other.example");
    let dir = temp_dir("refused");
    ca.write_identity(&dir, "team-a", "sleep");
    let hbone = client(&dir, "cluster.local");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let who = identity("team-a", "sleep");

    // Its certificate chains to another root.
    let (foreign, seen) = waypoint(&ca, other.leaf("team-a", "waypoint")).await;
    let refused = hbone.tunnel(&who, None, foreign, "team-a", authority).await;
    assert!(matches!(refused, Err(HboneError::Tls(_))), "{refused:?}");
    assert_eq!(hbone.metrics.tunnels("tls_refused"), 1);
    assert!(seen.lock().unwrap().is_empty());

    // Our root, but an identity of another namespace than the waypoint's.
    let (elsewhere, seen) = waypoint(&ca, ca.leaf("team-b", "waypoint")).await;
    let refused = hbone
        .tunnel(&who, None, elsewhere, "team-a", authority)
        .await;
    assert!(
        matches!(refused, Err(HboneError::Peer { .. })),
        "{refused:?}"
    );
    assert_eq!(hbone.metrics.tunnels("peer_refused"), 1);
    assert!(seen.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_waypoint_refuses_a_client_of_another_trust_domain() {
    let ca = Ca::new("cluster.local");
    let other = Ca::new("cluster.local");
    let dir = temp_dir("foreign-client");
    // The client's certificate and roots come from a CA the waypoint does not trust.
    other.write_identity(&dir, "team-a", "sleep");
    let (addr, seen) = waypoint(&ca, other.leaf("team-a", "waypoint")).await;
    let hbone = client(&dir, "cluster.local");
    let refused = hbone
        .tunnel(
            &identity("team-a", "sleep"),
            None,
            addr,
            "team-a",
            "203.0.113.10:80".parse().unwrap(),
        )
        .await;
    assert!(refused.is_err());
    assert!(seen.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_rotated_certificate_is_used_by_the_next_connection_and_none_fails() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("rotation");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, _) = waypoint(&ca, ca.leaf("team-a", "waypoint")).await;
    let hbone = client(&dir, "cluster.local");
    let who = identity("team-a", "sleep");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let mut open = hbone
        .tunnel(&who, None, addr, "team-a", authority)
        .await
        .unwrap();
    let identities = hbone.identities.clone().unwrap();
    let before = identities.tls("team-a", "sleep").await.unwrap();

    // A new certificate renamed into place, its modification time surely another.
    std::thread::sleep(Duration::from_millis(20));
    ca.write_identity(&dir, "team-a", "sleep");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let after = identities.tls("team-a", "sleep").await.unwrap();
    assert!(!Arc::ptr_eq(&before, &after), "the new files were not read");

    let mut next = hbone
        .tunnel(&who, None, addr, "team-a", authority)
        .await
        .unwrap();
    assert_eq!(echo(&mut next, "after").await, "after");
    // The tunnel opened before the rotation still works.
    assert_eq!(echo(&mut open, "before").await, "before");
    assert_eq!(hbone.metrics.tunnels("ok"), 2);
    assert_eq!(hbone.metrics.connections(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_or_misfiled_certificate_is_an_error_naming_the_file() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("misfiled");
    let identities = IdentityDir::new(
        dir.clone(),
        Arc::new(TrustDomain::fixed("cluster.local".to_string())),
    );
    let missing = identities.tls("team-a", "sleep").unwrap_err();
    assert!(
        missing.path.ends_with("team-a/sleep/cert-chain.pem"),
        "{missing}"
    );

    // team-b's certificate filed under team-a.
    let leaf = ca.leaf("team-b", "sleep");
    let own = dir.join("team-a").join("sleep");
    std::fs::create_dir_all(&own).unwrap();
    write_atomically(&own.join("cert-chain.pem"), &leaf.chain);
    write_atomically(&own.join("key.pem"), &leaf.key);
    write_atomically(&dir.join("root-cert.pem"), &ca.issuer.pem());
    let misfiled = identities.tls("team-a", "sleep").unwrap_err();
    assert!(
        misfiled
            .why
            .contains("names spiffe://cluster.local/ns/team-b/sa/sleep"),
        "{misfiled}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_pooled_connection_serves_only_the_namespace_it_was_checked_for_and_waypoints_do_not_evict_each_other()
 {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("pool-keys");
    ca.write_identity(&dir, "team-a", "sleep");
    let (team_a, _) = waypoint(&ca, ca.leaf("team-a", "waypoint")).await;
    let (egress, _) = waypoint(&ca, ca.leaf("istio-system", "waypoint")).await;
    let hbone = client(&dir, "cluster.local");
    let who = identity("team-a", "sleep");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    // Alternating between two waypoints: one connection to each, kept.
    for round in 0..3 {
        for (at, namespace) in [(team_a, "team-a"), (egress, "istio-system")] {
            let mut open = hbone
                .tunnel(&who, None, at, namespace, authority)
                .await
                .unwrap();
            assert_eq!(echo(&mut open, "x").await, "x", "round {round}");
        }
    }
    assert_eq!(hbone.metrics.connections(), 2);
    // The same address expected to be another namespace's waypoint: checked again, refused,
    // though a connection to it is pooled.
    let wrong = hbone.tunnel(&who, None, team_a, "team-b", authority).await;
    assert!(
        matches!(wrong, Err(HboneError::Peer { .. })),
        "{:?}",
        wrong.err()
    );
}

/// The handshake timeout of the tests of a peer that never answers, and how much later than it
/// its tunnels may fail.
const TIMEOUT: Duration = Duration::from_secs(1);
const SLACK: Duration = Duration::from_millis(500);

/// Tunnels waiting for one pooled connection share its dial, and its failure: four to a peer that
/// accepts TCP and never answers TLS all fail when the one handshake times out, and the peer saw
/// one connection (each used to dial in turn once the one before failed: after 1, 2, 3 and 4
/// timeouts, 4 connections).
#[tokio::test]
async fn tunnels_waiting_for_one_connection_share_its_dial_and_its_failure() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("one-dial");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, accepted) = silent_peer().await;
    let hbone = client(&dir, "cluster.local").with_handshake_timeout(TIMEOUT);
    let who = identity("team-a", "sleep");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let started = Instant::now();
    let tunnels = (0..4).map(|_| async {
        let result = hbone.tunnel(&who, None, addr, "team-a", authority).await;
        (result, started.elapsed())
    });
    for (result, took) in futures::future::join_all(tunnels).await {
        assert!(
            matches!(result, Err(HboneError::Timeout(_))),
            "{:?}",
            result.err()
        );
        assert!(
            took >= TIMEOUT && took < TIMEOUT + SLACK,
            "failed after {took:?}"
        );
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    assert_eq!(hbone.metrics.tunnels("connect_failed"), 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failed dial is remembered for a moment: tunnels asking meanwhile fail at once without a
/// connection; after it, the peer is dialled again.
#[tokio::test]
async fn a_failed_peer_fails_new_tunnels_at_once_for_the_backoff_then_is_dialled_again() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("backoff");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, accepted) = silent_peer().await;
    let hbone = client(&dir, "cluster.local").with_handshake_timeout(TIMEOUT);
    let who = identity("team-a", "sleep");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let first = hbone.tunnel(&who, None, addr, "team-a", authority).await;
    assert!(matches!(first, Err(HboneError::Timeout(_))), "{first:?}");

    let burst = Instant::now();
    for _ in 0..3 {
        let again = hbone.tunnel(&who, None, addr, "team-a", authority).await;
        assert!(matches!(again, Err(HboneError::Timeout(_))), "{again:?}");
    }
    assert!(
        burst.elapsed() < client::FAILED_BACKOFF / 2,
        "{:?}",
        burst.elapsed()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);

    tokio::time::sleep(client::FAILED_BACKOFF).await;
    let started = Instant::now();
    let after = hbone.tunnel(&who, None, addr, "team-a", authority).await;
    assert!(matches!(after, Err(HboneError::Timeout(_))), "{after:?}");
    assert!(started.elapsed() >= TIMEOUT, "{:?}", started.elapsed());
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(hbone.metrics.tunnels("connect_failed"), 5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer shutting down answers a `CONNECT` with GOAWAY(last stream 0): the tunnel is opened on
/// a new connection, and the next tunnel rides that one (the refusing connection left the pool).
#[tokio::test]
async fn a_connect_refused_by_goaway_is_sent_again_on_a_new_connection() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("goaway");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, accepted) = goaway_waypoint(&ca, ca.leaf("team-a", "waypoint"), 1).await;
    let hbone = client(&dir, "cluster.local");
    let who = identity("team-a", "sleep");
    let authority: SocketAddr = "203.0.113.10:80".parse().unwrap();
    let mut tunnel = hbone
        .tunnel(&who, None, addr, "team-a", authority)
        .await
        .unwrap();
    assert_eq!(echo(&mut tunnel, "again").await, "again");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    let mut next = hbone
        .tunnel(&who, None, addr, "team-a", authority)
        .await
        .unwrap();
    assert_eq!(echo(&mut next, "next").await, "next");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(hbone.metrics.connections(), 2);
    assert_eq!(hbone.metrics.tunnels("ok"), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `CONNECT` is sent again once only: refused by GOAWAY on the new connection too, the tunnel
/// fails.
#[tokio::test]
async fn a_connect_refused_by_goaway_twice_fails() {
    let ca = Ca::new("cluster.local");
    let dir = temp_dir("goaway-twice");
    ca.write_identity(&dir, "team-a", "sleep");
    let (addr, accepted) = goaway_waypoint(&ca, ca.leaf("team-a", "waypoint"), usize::MAX).await;
    let hbone = client(&dir, "cluster.local");
    let refused = hbone
        .tunnel(
            &identity("team-a", "sleep"),
            None,
            addr,
            "team-a",
            "203.0.113.10:80".parse().unwrap(),
        )
        .await;
    assert!(
        matches!(&refused, Err(HboneError::Http(e)) if e.is_go_away()),
        "{:?}",
        refused.err()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(hbone.metrics.tunnels("tls_refused"), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
