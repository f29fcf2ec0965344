//! Where the node's pods' workload certificates come from: a directory kept by someone else
//! (`--identity-dir`), or Istio's CA asked by this agent (`--ca-address`).
use std::{path::PathBuf, sync::Arc};

use super::{
    CaError, CaSettings, CertError, HboneMetrics, IdentityDir, IstioCa, TrustDomain,
    ca_cache::CaIdentities, tls::WorkloadTls,
};

/// A source as configured, not yet opened.
#[derive(Debug, Clone)]
pub(crate) enum CertSource {
    Dir(PathBuf),
    IstioCa(CaSettings),
}

#[derive(Debug)]
pub(crate) enum WorkloadCerts {
    Files(IdentityDir),
    IstioCa(Arc<CaIdentities>),
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum IdentityError {
    #[error(transparent)]
    Files(#[from] CertError),
    #[error(transparent)]
    Ca(#[from] CaError),
}

impl WorkloadCerts {
    /// Reads what can be read now (the CA's roots): a bad setting stops the agent at start.
    /// Inside the runtime (the CA's channel starts a task).
    pub(crate) fn open(
        source: CertSource,
        trust_domain: Arc<TrustDomain>,
        metrics: Arc<HboneMetrics>,
    ) -> Result<WorkloadCerts, IdentityError> {
        Ok(match source {
            CertSource::Dir(dir) => WorkloadCerts::Files(IdentityDir::new(dir, trust_domain)),
            CertSource::IstioCa(settings) => {
                let ca = IstioCa::new(settings)?;
                WorkloadCerts::IstioCa(Arc::new(CaIdentities::new(ca, trust_domain, metrics)?))
            }
        })
    }

    pub(crate) fn trust_domain(&self) -> &str {
        match self {
            WorkloadCerts::Files(dir) => dir.trust_domain(),
            WorkloadCerts::IstioCa(ca) => ca.trust_domain(),
        }
    }

    /// The TLS configurations presenting `namespace/account`'s certificate. The same `Arc`
    /// while the certificate is the same (a connection pool keys on it).
    pub(crate) async fn tls(
        &self,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<WorkloadTls>, IdentityError> {
        Ok(match self {
            WorkloadCerts::Files(dir) => dir.tls(namespace, account)?,
            WorkloadCerts::IstioCa(ca) => ca.tls(namespace, account).await?,
        })
    }
}
