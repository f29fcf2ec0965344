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
    crypto::CryptoProvider,
    pki_types::{PrivateKeyDer, pem::PemObject},
};

use super::{
    Identity, TrustDomain,
    tls::{self, WorkloadTls, check_names, read_chain, read_roots},
};
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
    pub(super) fn at(path: &Path, why: impl std::fmt::Display) -> CertError {
        CertError {
            path: path.display().to_string(),
            why: why.to_string(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct IdentityDir {
    dir: PathBuf,
    trust_domain: Arc<TrustDomain>,
    provider: Arc<CryptoProvider>,
    kept: Mutex<HashMap<(String, String), Kept>>,
}

/// A configuration built from files as they were when last looked at.
#[derive(Debug, Clone)]
struct Kept {
    config: Arc<WorkloadTls>,
    files: [Option<SystemTime>; 3],
    checked: Instant,
}

impl IdentityDir {
    pub(crate) fn new(dir: PathBuf, trust_domain: Arc<TrustDomain>) -> IdentityDir {
        IdentityDir {
            dir,
            trust_domain,
            provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
            kept: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn trust_domain(&self) -> &str {
        self.trust_domain.get()
    }

    /// The TLS configurations presenting `namespace/account`'s certificate, and trusting
    /// peers whose chain ends at the roots and whose identity is in this trust domain. The same
    /// `Arc` while the files are unchanged (a connection pool keys on it).
    pub(crate) fn tls(
        &self,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<WorkloadTls>, CertError> {
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
    ) -> Result<WorkloadTls, CertError> {
        let chain = read_chain(chain_path)?;
        let key = PrivateKeyDer::from_pem_file(key_path)
            .map_err(|e| CertError::at(key_path, format!("no private key read: {e}")))?;
        let expected = Identity {
            trust_domain: self.trust_domain.get().to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        };
        check_names(&chain, &expected).map_err(|why| CertError::at(chain_path, why))?;
        let roots = Arc::new(read_roots(roots_path)?);
        tls::workload_tls(&self.provider, self.trust_domain.get(), chain, key, roots)
            .map_err(|e| CertError::at(key_path, format!("does not fit the certificate: {e}")))
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
