//! Workload certificates from a directory, as a cluster with its own issuer (cert-manager's CSI
//! driver, SPIRE) or the suite's test CA writes them:
//!
//! ```text
//! DIR/root-cert.pem                          the trust anchors peers must chain to
//! DIR/<namespace>/<service account>/cert-chain.pem   leaf first
//! DIR/<namespace>/<service account>/key.pem
//! ```
//!
//! A TLS client configuration is built per identity on first use and kept while its files stay
//! as they are: they are looked at again at most once a second, and a changed file (a rotation,
//! written whole and renamed into place) gives the next connection the new certificate.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
    server::ParsedCertificate,
};

use super::Identity;
use crate::lock::Locked;

/// How often a kept configuration's files are looked at again.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
#[error("{path}: {why}")]
pub(crate) struct CertError {
    pub path: String,
    pub why: String,
}

impl CertError {
    fn at(path: &Path, why: impl std::fmt::Display) -> CertError {
        CertError {
            path: path.display().to_string(),
            why: why.to_string(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct IdentityDir {
    dir: PathBuf,
    trust_domain: String,
    provider: Arc<CryptoProvider>,
    kept: Mutex<HashMap<(String, String), Kept>>,
}

/// A configuration built from files as they were when last looked at.
#[derive(Debug, Clone)]
struct Kept {
    config: Arc<ClientConfig>,
    files: [Option<SystemTime>; 3],
    checked: Instant,
}

impl IdentityDir {
    pub(crate) fn new(dir: PathBuf, trust_domain: String) -> IdentityDir {
        IdentityDir {
            dir,
            trust_domain,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
            kept: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The TLS client configuration presenting `namespace/account`'s certificate, and trusting
    /// servers whose chain ends at the roots and whose identity is in this trust domain. The same
    /// `Arc` while the files are unchanged (a connection pool keys on it).
    pub(crate) fn client_config(
        &self,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<ClientConfig>, CertError> {
        let key = (namespace.to_string(), account.to_string());
        let now = Instant::now();
        if let Some(kept) = self.kept.locked().get(&key)
            && now.duration_since(kept.checked) < RECHECK
        {
            return Ok(kept.config.clone());
        }
        let paths = self.paths(namespace, account);
        let files = paths.each_ref().map(|p| modified(p));
        if let Some(kept) = self.kept.locked().get_mut(&key)
            && kept.files == files
        {
            kept.checked = now;
            return Ok(kept.config.clone());
        }
        let config = Arc::new(self.load(namespace, account, &paths)?);
        let kept = Kept {
            config: config.clone(),
            files,
            checked: now,
        };
        self.kept.locked().insert(key, kept);
        Ok(config)
    }

    /// `cert-chain.pem`, `key.pem`, `root-cert.pem` of one identity.
    fn paths(&self, namespace: &str, account: &str) -> [PathBuf; 3] {
        let own = self.dir.join(namespace).join(account);
        [
            own.join("cert-chain.pem"),
            own.join("key.pem"),
            self.dir.join("root-cert.pem"),
        ]
    }

    fn load(
        &self,
        namespace: &str,
        account: &str,
        [chain_path, key_path, roots_path]: &[PathBuf; 3],
    ) -> Result<ClientConfig, CertError> {
        let chain = read_chain(chain_path)?;
        let key = PrivateKeyDer::from_pem_file(key_path)
            .map_err(|e| CertError::at(key_path, format!("no private key read: {e}")))?;
        let expected = Identity {
            trust_domain: self.trust_domain.clone(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        };
        match Identity::of_certificate(&chain[0]) {
            Some(named) if named == expected => {}
            Some(named) => {
                return Err(CertError::at(
                    chain_path,
                    format!("the certificate names {named}, not {expected}"),
                ));
            }
            None => {
                return Err(CertError::at(
                    chain_path,
                    "the certificate names no single SPIFFE identity in its URI SAN",
                ));
            }
        }
        let roots = read_roots(roots_path)?;
        let verifier = Arc::new(PeerVerifier {
            roots: Arc::new(roots),
            trust_domain: self.trust_domain.clone(),
            provider: self.provider.clone(),
        });
        let mut config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| CertError::at(chain_path, e))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| CertError::at(key_path, format!("does not fit the certificate: {e}")))?;
        // As ztunnel: HTTP/2 only, no server name sent.
        config.alpn_protocols = vec![b"h2".to_vec()];
        config.enable_sni = false;
        Ok(config)
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| CertError::at(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::at(path, e))?;
    if chain.is_empty() {
        return Err(CertError::at(path, "holds no certificate"));
    }
    Ok(chain)
}

fn read_roots(path: &Path) -> Result<RootCertStore, CertError> {
    let mut roots = RootCertStore::empty();
    for cert in read_chain(path)? {
        roots
            .add(cert)
            .map_err(|e| CertError::at(path, format!("not a usable trust anchor: {e}")))?;
    }
    Ok(roots)
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
