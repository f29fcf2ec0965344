//! HBONE against an in-process waypoint: mutual TLS both ways, the `CONNECT` authority, pooling,
//! rotation, and each refusal counted.
use std::{
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
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
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

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
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
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
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
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
            });
        }
    });
    (addr, seen)
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
