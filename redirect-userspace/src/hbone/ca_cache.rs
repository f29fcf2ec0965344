//! The node's pods' certificates from Istio's CA: asked for on an identity's first tunnel (one
//! call however many tunnels wait for it), kept, and renewed in the background once half their
//! lifetime has passed, as Istio's agents do; a failed renewal keeps the certificate in use while
//! it is valid and is tried again shortly.
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rustls::{RootCertStore, crypto::CryptoProvider};
use tracing::{info, warn};

use super::{
    CertError, HboneMetrics, Identity, TrustDomain,
    ca::{CaError, Issued, IstioCa},
    tls::{self, WorkloadTls},
};
use crate::lock::Locked;

/// How soon a failed renewal is tried again.
const RETRY: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(crate) struct CaIdentities {
    ca: IstioCa,
    trust_domain: Arc<TrustDomain>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    metrics: Arc<HboneMetrics>,
    slots: Mutex<HashMap<(String, String), Arc<Slot>>>,
}

/// One identity's certificate, behind an async lock so that waiting tunnels share one call.
#[derive(Debug, Default)]
struct Slot {
    current: tokio::sync::Mutex<Option<Current>>,
}

#[derive(Debug, Clone)]
struct Current {
    config: Arc<WorkloadTls>,
    renew_at: SystemTime,
    not_after: SystemTime,
    renewing: bool,
}

impl CaIdentities {
    pub(crate) fn new(
        ca: IstioCa,
        trust_domain: Arc<TrustDomain>,
        metrics: Arc<HboneMetrics>,
    ) -> Result<CaIdentities, CertError> {
        let roots = tls::read_roots(&ca.settings().root)?;
        Ok(CaIdentities {
            ca,
            trust_domain,
            roots: Arc::new(roots),
            provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
            metrics,
            slots: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn trust_domain(&self) -> &str {
        self.trust_domain.get()
    }

    /// The TLS configurations presenting `namespace/account`'s certificate: the one kept
    /// while it is not due, a new one otherwise. The same `Arc` until renewed.
    pub(crate) async fn tls(
        self: &Arc<Self>,
        namespace: &str,
        account: &str,
    ) -> Result<Arc<WorkloadTls>, CaError> {
        let key = (namespace.to_string(), account.to_string());
        let slot = self.slots.locked().entry(key).or_default().clone();
        let mut current = slot.current.lock().await;
        let now = SystemTime::now();
        if let Some(kept) = current.as_mut().filter(|c| now < c.not_after) {
            if now >= kept.renew_at && !kept.renewing {
                kept.renewing = true;
                self.clone()
                    .renew_later(slot.clone(), namespace.to_string(), account.to_string());
            }
            return Ok(kept.config.clone());
        }
        let fresh = self.ask(namespace, account).await;
        self.metrics.certificate(match fresh {
            Ok(_) => "issued",
            Err(_) => "failed",
        });
        let fresh = fresh?;
        let config = fresh.config.clone();
        *current = Some(fresh);
        Ok(config)
    }

    /// Renews a due certificate without holding up the tunnels that use it.
    fn renew_later(self: Arc<Self>, slot: Arc<Slot>, namespace: String, account: String) {
        tokio::spawn(async move {
            let renewed = self.ask(&namespace, &account).await;
            self.metrics.certificate(match renewed {
                Ok(_) => "renewed",
                Err(_) => "failed",
            });
            let mut current = slot.current.lock().await;
            match (renewed, current.as_mut()) {
                (Ok(fresh), _) => *current = Some(fresh),
                (Err(e), Some(kept)) => {
                    warn!(namespace, account, error = %e, "renewing a workload certificate failed; the one in use is kept");
                    kept.renewing = false;
                    kept.renew_at = SystemTime::now() + RETRY;
                }
                (Err(_), None) => {}
            }
        });
    }

    async fn ask(&self, namespace: &str, account: &str) -> Result<Current, CaError> {
        let identity = Identity {
            trust_domain: self.trust_domain.get().to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        };
        let issued = self.ca.issue(&identity).await?;
        let received = SystemTime::now();
        let Issued {
            chain,
            key,
            not_before,
            not_after,
        } = issued;
        let tls = tls::workload_tls(
            &self.provider,
            self.trust_domain.get(),
            chain,
            key,
            self.roots.clone(),
        )
        .map_err(|e| CaError::Chain {
            address: self.ca.settings().address.clone(),
            why: format!("the certificate does not fit its key: {e}"),
        })?;
        // Half the lifetime left from now: a CA backdates notBefore for clocks apart, which is
        // no lifetime this agent ever had.
        let start = not_before.max(received);
        let left = not_after.duration_since(start).unwrap_or_default();
        info!(%identity, valid_for = ?left, "workload certificate issued");
        Ok(Current {
            config: Arc::new(tls),
            renew_at: start + left / 2,
            not_after,
            renewing: false,
        })
    }
}
