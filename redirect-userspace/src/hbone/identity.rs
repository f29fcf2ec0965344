//! A workload identity, as SPIFFE writes it and Istio issues it, and the mesh's trust domain.
use std::{fmt, sync::OnceLock};

use x509_parser::{extensions::GeneralName, prelude::FromDer};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    /// `spiffe://<td>/ns/<namespace>/sa/<account>`, or `None` for any other URI.
    pub(crate) fn parse(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix("spiffe://")?;
        let mut parts = rest.split('/');
        let (td, ns_tag, namespace, sa_tag, account) = (
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
        );
        let valid = parts.next().is_none()
            && ns_tag == "ns"
            && sa_tag == "sa"
            && [td, namespace, account].iter().all(|p| !p.is_empty());
        valid.then(|| Identity {
            trust_domain: td.to_string(),
            namespace: namespace.to_string(),
            service_account: account.to_string(),
        })
    }

    /// The identity the leaf (the first certificate) of `chain` names, as
    /// [`Identity::of_certificate`].
    pub(crate) fn of_leaf(chain: &[rustls::pki_types::CertificateDer<'_>]) -> Option<Identity> {
        Identity::of_certificate(chain.first()?)
    }

    /// The identity a certificate (DER) names in its URI SAN; `None` when it names none, or more
    /// than one (no single identity then).
    pub(crate) fn of_certificate(der: &[u8]) -> Option<Identity> {
        let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut identities = san
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::URI(uri) => Identity::parse(uri),
                _ => None,
            });
        let first = identities.next()?;
        identities.next().is_none().then_some(first)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// The mesh's trust domain, chosen on first use and kept: the flag's, or what `choose` says then
/// (the mesh config's, in force by the first tunnel even when it was not as the agent started).
/// Kept, because certificates and pooled connections are made for one.
pub(crate) struct TrustDomain {
    chosen: OnceLock<String>,
    choose: Box<dyn Fn() -> String + Send + Sync>,
}

impl TrustDomain {
    pub(crate) fn fixed(domain: String) -> TrustDomain {
        TrustDomain {
            chosen: OnceLock::from(domain),
            choose: Box::new(String::new),
        }
    }

    pub(crate) fn chosen_by(choose: impl Fn() -> String + Send + Sync + 'static) -> TrustDomain {
        TrustDomain {
            chosen: OnceLock::new(),
            choose: Box::new(choose),
        }
    }

    pub(crate) fn get(&self) -> &str {
        self.chosen.get_or_init(|| {
            let domain = (self.choose)();
            tracing::info!(trust_domain = %domain, "the workload identities' trust domain");
            domain
        })
    }
}

impl fmt::Debug for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TrustDomain")
            .field(&self.chosen.get())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spiffe_uri_reads_back_as_it_is_written() {
        let id = Identity::parse("spiffe://cluster.local/ns/team-a/sa/default").unwrap();
        assert_eq!(id.trust_domain, "cluster.local");
        assert_eq!(id.namespace, "team-a");
        assert_eq!(id.service_account, "default");
        assert_eq!(
            id.to_string(),
            "spiffe://cluster.local/ns/team-a/sa/default"
        );
    }

    #[test]
    fn a_chosen_trust_domain_is_asked_once_and_kept() {
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        let domain = TrustDomain::chosen_by(move || {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            "mesh.example".to_string()
        });
        assert_eq!(domain.get(), "mesh.example");
        assert_eq!(domain.get(), "mesh.example");
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(TrustDomain::fixed("a.b".into()).get(), "a.b");
    }

    #[test]
    fn anything_else_is_no_identity() {
        for uri in [
            "https://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a",
            "spiffe://cluster.local/ns/a/sa/b/extra",
            "spiffe://cluster.local/namespace/a/sa/b",
            "spiffe:///ns/a/sa/b",
            "spiffe://td/ns//sa/b",
        ] {
            assert_eq!(Identity::parse(uri), None, "{uri}");
        }
    }
}
