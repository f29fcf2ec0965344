//! The TLS side of HBONE shared by every source of certificates: a client configuration that
//! presents a workload's chain and trusts peers of the mesh, and the PEM files it is read from.
use std::{path::Path, sync::Arc};

use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
    server::ParsedCertificate,
};

use super::{CertError, Identity};

/// The TLS client configuration presenting `chain` (leaf first) with `key`, trusting servers whose
/// chain ends at `roots` and whose certificate names an identity of `trust_domain`. TLS 1.3 with
/// ALPN h2 and no server name sent, as ztunnel.
pub(super) fn client_config(
    provider: &Arc<CryptoProvider>,
    trust_domain: &str,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
) -> Result<ClientConfig, rustls::Error> {
    let verifier = Arc::new(PeerVerifier {
        roots,
        trust_domain: trust_domain.to_string(),
        provider: provider.clone(),
    });
    let mut config = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.enable_sni = false;
    Ok(config)
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
    match chain
        .first()
        .and_then(|leaf| Identity::of_certificate(leaf))
    {
        Some(named) if &named == expected => Ok(()),
        Some(named) => Err(format!("the certificate names {named}, not {expected}")),
        None => Err("the certificate names no single SPIFFE identity in its URI SAN".to_string()),
    }
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
        match Identity::of_certificate(end_entity) {
            Some(id) if id.trust_domain == self.trust_domain => Ok(ServerCertVerified::assertion()),
            _ => Err(rustls::Error::InvalidCertificate(
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
