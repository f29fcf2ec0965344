//! The TLS side of HBONE shared by every source of certificates: the client and server
//! configurations that present a workload's chain and trust peers of the mesh, and the PEM files
//! they are read from.
use std::{path::Path, sync::Arc};

use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
    server::{
        ParsedCertificate, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};

use super::{CertError, Identity};

/// One workload's side of mutual TLS, as a client (to waypoints and other nodes) and as a server
/// (to peers sending to it), both made from one chain and key.
#[derive(Debug)]
pub(crate) struct WorkloadTls {
    pub client: Arc<ClientConfig>,
    pub server: Arc<ServerConfig>,
}

/// The TLS configurations presenting `chain` (leaf first) with `key`, trusting peers whose chain
/// ends at `roots` and whose certificate names an identity of `trust_domain`. TLS 1.3 with ALPN h2
/// and no server name sent, as ztunnel; the server asks every client for its certificate.
pub(super) fn workload_tls(
    provider: &Arc<CryptoProvider>,
    trust_domain: &str,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
) -> Result<WorkloadTls, rustls::Error> {
    let verifier = Arc::new(PeerVerifier {
        roots: roots.clone(),
        trust_domain: trust_domain.to_string(),
        provider: provider.clone(),
    });
    let mut client = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain.clone(), key.clone_key())?;
    client.alpn_protocols = vec![b"h2".to_vec()];
    client.enable_sni = false;
    let clients = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| rustls::Error::General(format!("the trust anchors: {e}")))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(ClientInTrustDomain {
            inner: clients,
            trust_domain: trust_domain.to_string(),
        }))
        .with_single_cert(chain, key)?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    Ok(WorkloadTls {
        client: Arc::new(client),
        server: Arc::new(server),
    })
}

/// Every certificate of a PEM file, in order; an empty file is an error.
pub(super) fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| CertError::at(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::at(path, e))?;
    if chain.is_empty() {
        return Err(CertError::at(path, "holds no certificate"));
    }
    Ok(chain)
}

/// The trust anchors of a PEM file.
pub(super) fn read_roots(path: &Path) -> Result<RootCertStore, CertError> {
    let mut roots = RootCertStore::empty();
    for cert in read_chain(path)? {
        roots
            .add(cert)
            .map_err(|e| CertError::at(path, format!("not a usable trust anchor: {e}")))?;
    }
    Ok(roots)
}

/// The identity a chain's leaf must name, checked before it is ever presented: a certificate
/// issued for someone else is refused with what it names instead.
pub(super) fn check_names(chain: &[CertificateDer<'_>], expected: &Identity) -> Result<(), String> {
    match Identity::of_leaf(chain) {
        Some(named) if &named == expected => Ok(()),
        Some(named) => Err(format!("the certificate names {named}, not {expected}")),
        None => Err("the certificate names no single SPIFFE identity in its URI SAN".to_string()),
    }
}

/// Whether `cert` names an identity of `trust_domain`: what both sides ask of a peer once its
/// chain is checked.
fn in_trust_domain(cert: &CertificateDer<'_>, trust_domain: &str) -> bool {
    Identity::of_certificate(cert).is_some_and(|id| id.trust_domain == trust_domain)
}

/// A peer is trusted when its chain ends at the roots and its certificate names an identity of
/// this trust domain. Which identity is the caller's to check (the waypoint's namespace); a
/// server name plays no part (HBONE sends none).
#[derive(Debug)]
struct PeerVerifier {
    roots: Arc<RootCertStore>,
    trust_domain: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match in_trust_domain(end_entity, &self.trust_domain) {
            true => Ok(ServerCertVerified::assertion()),
            false => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client is trusted when its chain ends at the roots (checked by webpki, as for any client
/// certificate) and its certificate names an identity of this trust domain. Which identity sent
/// the stream is recorded by the receiver, not checked here.
#[derive(Debug)]
struct ClientInTrustDomain {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
}

impl ClientCertVerifier for ClientInTrustDomain {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        match in_trust_domain(end_entity, &self.trust_domain) {
            true => Ok(ClientCertVerified::assertion()),
            false => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose,
        SanType,
    };
    use rustls::pki_types::PrivatePkcs8KeyDer;

    use super::*;

    struct TestCa(CertifiedIssuer<'static, KeyPair>);

    impl TestCa {
        fn new() -> TestCa {
            let mut params = CertificateParams::default();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
            TestCa(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
        }

        fn roots(&self) -> Arc<RootCertStore> {
            let mut roots = RootCertStore::empty();
            roots.add(self.0.der().clone()).unwrap();
            Arc::new(roots)
        }

        /// `namespace`'s workload TLS, its certificate valid until `not_after` (year).
        fn workload(&self, namespace: &str, not_after: i32) -> WorkloadTls {
            let mut params = CertificateParams::default();
            let uri = format!("spiffe://cluster.local/ns/{namespace}/sa/default");
            params.subject_alt_names = vec![SanType::URI(uri.as_str().try_into().unwrap())];
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(not_after, 1, 1);
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &self.0).unwrap();
            workload_tls(
                &Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
                "cluster.local",
                vec![cert.der().clone(), self.0.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
                self.roots(),
            )
            .unwrap()
        }
    }

    /// A handshake of `client` to `server` over a pipe: each side's error, if any.
    async fn handshake(
        client: &WorkloadTls,
        server: &WorkloadTls,
    ) -> (Option<String>, Option<String>) {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let acceptor = tokio_rustls::TlsAcceptor::from(server.server.clone());
        let connector = tokio_rustls::TlsConnector::from(client.client.clone());
        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        // The server's handshake ends with the client's certificate and Finished checked.
        let (dialled, accepted) = tokio::join!(connector.connect(name, near), acceptor.accept(far));
        (
            dialled.err().map(|e| e.to_string()),
            accepted.err().map(|e| e.to_string()),
        )
    }

    /// What either side checks of the other at the handshake: a peer whose certificate expired
    /// is refused ("expired"), whichever side it is; valid ones on both sides shake hands.
    #[tokio::test]
    async fn a_peer_presenting_an_expired_certificate_is_refused_at_the_handshake() {
        let ca = TestCa::new();
        let valid = ca.workload("team-b", 2100);
        let expired = ca.workload("team-a", 2021);

        let (client, server) = handshake(&ca.workload("team-a", 2100), &valid).await;
        assert_eq!((client, server), (None, None));

        let (_, server) = handshake(&expired, &valid).await;
        let server = server.unwrap_or_default();
        assert!(server.contains("expired"), "the receiver refused: {server}");

        let (client, _) = handshake(&valid, &expired).await;
        let client = client.unwrap_or_default();
        assert!(client.contains("expired"), "the sender refused: {client}");
    }
}
