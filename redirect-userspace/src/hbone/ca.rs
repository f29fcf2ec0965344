//! Istio's CA protocol, as ztunnel speaks it: a fresh key pair and a CSR naming the workload's
//! SPIFFE identity, sent over gRPC (`istio.v1.auth.IstioCertificateService/CreateCertificate`)
//! to istiod's TLS port. The node agent authenticates with its own projected service-account
//! token (audience `istio-ca`) and asks for the pod's identity in the request's
//! `ImpersonatedIdentity` metadata; istiod grants it when the agent's account is a trusted node
//! agent and a pod of that identity runs on the agent's node.
use std::{
    path::PathBuf,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use hyper::http::uri::PathAndQuery;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject};
use tonic::{
    metadata::MetadataValue,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint},
};

use super::Identity;

/// The request, field numbers as in Istio's `security/v1alpha1/ca.proto`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct IstioCertificateRequest {
    /// PEM-encoded certificate request.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Requested lifetime, in seconds.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<prost_types::Struct>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct IstioCertificateResponse {
    /// PEM-encoded: the leaf first, then intermediates, the root last.
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

const CREATE_CERTIFICATE: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// The metadata key istiod reads the identity asked for from (a node agent asking for a pod).
const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// How long a call to the CA may take, connecting included.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the CA is and how to speak to it (`redirect run --ca-address ...`).
#[derive(Debug, Clone)]
pub(crate) struct CaSettings {
    /// `https://istiod.istio-system.svc:15012`.
    pub address: String,
    /// The mesh's root certificates: istiod's serving certificate chains to them, and so do the
    /// peers HBONE accepts.
    pub root: PathBuf,
    /// The agent's projected service-account token, read again for every call (the kubelet
    /// rotates it).
    pub token: PathBuf,
    /// Sent as the `ClusterID` header: which cluster's registry istiod checks the pod in.
    pub cluster_id: String,
    /// The lifetime asked for.
    pub validity: Duration,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum CaError {
    #[error("--ca-address {address}: {why}")]
    Address { address: String, why: String },
    #[error("{path}: {why}")]
    File { path: String, why: String },
    #[error("making the certificate request: {0}")]
    Request(#[from] rcgen::Error),
    #[error("the CA at {address} answered {code:?}: {message}")]
    Refused {
        address: String,
        code: tonic::Code,
        message: String,
    },
    #[error("the CA at {address} issued an unusable chain: {why}")]
    Chain { address: String, why: String },
    /// The identity's certificate expired and the CA has not renewed it: nothing is presented.
    #[error(
        "the certificate of {identity} expired {ago_secs} s ago and the CA has not renewed it (last answer: {why})"
    )]
    Expired {
        identity: String,
        ago_secs: u64,
        why: String,
    },
    /// No certificate was ever issued and the CA failed less than a second ago: not asked again.
    #[error("no certificate for {identity} yet: the CA failed {ago_ms} ms ago ({why})")]
    Unavailable {
        identity: String,
        ago_ms: u128,
        why: String,
    },
}

/// A certificate the CA issued, with the key it was issued for.
#[derive(Debug)]
pub(crate) struct Issued {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

#[derive(Debug)]
pub(crate) struct IstioCa {
    settings: CaSettings,
    channel: Channel,
}

impl IstioCa {
    /// Checks the address and reads the roots now (a bad flag stops the agent at start); connects
    /// on the first call.
    pub(crate) fn new(settings: CaSettings) -> Result<IstioCa, CaError> {
        let bad_address = |why: String| CaError::Address {
            address: settings.address.clone(),
            why,
        };
        if !settings.address.starts_with("https://") {
            return Err(bad_address(
                "the CA is reached over TLS: https://HOST:PORT".into(),
            ));
        }
        let root = std::fs::read(&settings.root).map_err(|e| CaError::File {
            path: settings.root.display().to_string(),
            why: e.to_string(),
        })?;
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(root));
        let channel = Endpoint::from_shared(settings.address.clone())
            .and_then(|e| e.tls_config(tls))
            .map_err(|e| bad_address(e.to_string()))?
            .connect_timeout(CALL_TIMEOUT)
            .timeout(CALL_TIMEOUT)
            .connect_lazy();
        Ok(IstioCa { settings, channel })
    }

    pub(crate) fn settings(&self) -> &CaSettings {
        &self.settings
    }

    /// A new key pair and a certificate for `identity`, signed by the CA.
    pub(crate) async fn issue(&self, identity: &Identity) -> Result<Issued, CaError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let request = IstioCertificateRequest {
            csr: csr(identity, &key)?,
            validity_duration: i64::try_from(self.settings.validity.as_secs()).unwrap_or(i64::MAX),
            metadata: Some(impersonating(identity)),
        };
        let mut call = tonic::Request::new(request);
        let token = self.token()?;
        let headers = call.metadata_mut();
        headers.insert("authorization", token);
        if let Ok(cluster) = MetadataValue::try_from(self.settings.cluster_id.as_str()) {
            headers.insert("clusterid", cluster);
        }
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        let refused = |status: tonic::Status| CaError::Refused {
            address: self.settings.address.clone(),
            code: status.code(),
            message: status.message().to_string(),
        };
        grpc.ready()
            .await
            .map_err(|e| refused(tonic::Status::unavailable(e.to_string())))?;
        let response: tonic::Response<IstioCertificateResponse> = grpc
            .unary(
                call,
                PathAndQuery::from_static(CREATE_CERTIFICATE),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .map_err(refused)?;
        let chain = read_issued(&response.into_inner().cert_chain, identity).map_err(|why| {
            CaError::Chain {
                address: self.settings.address.clone(),
                why,
            }
        })?;
        let (not_before, not_after) = validity(&chain[0]).ok_or_else(|| CaError::Chain {
            address: self.settings.address.clone(),
            why: "the leaf's validity cannot be read".into(),
        })?;
        Ok(Issued {
            chain,
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_before,
            not_after,
        })
    }

    /// `Bearer <token>`, from the token file as it is now.
    fn token(&self) -> Result<MetadataValue<tonic::metadata::Ascii>, CaError> {
        let path = &self.settings.token;
        let bad = |why: String| CaError::File {
            path: path.display().to_string(),
            why,
        };
        let token = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(bad("the token file is empty".into()));
        }
        MetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| bad("the token is not printable ASCII".into()))
    }
}

/// A PEM CSR whose only name is the identity's URI SAN (the subject is left empty, as Istio's
/// own agents send it).
fn csr(identity: &Identity, key: &KeyPair) -> Result<String, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(identity.to_string().try_into()?)];
    params.serialize_request(key)?.pem()
}

/// `{"ImpersonatedIdentity": "<spiffe id>"}`.
fn impersonating(identity: &Identity) -> prost_types::Struct {
    let value = prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue(identity.to_string())),
    };
    prost_types::Struct {
        fields: [(IMPERSONATED_IDENTITY.to_string(), value)].into(),
    }
}

/// The chain as the CA sent it, each entry PEM (an entry may hold more than one certificate); the
/// leaf must name exactly the identity asked for.
fn read_issued(
    pems: &[String],
    identity: &Identity,
) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut chain = Vec::new();
    for (i, pem) in pems.iter().enumerate() {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            chain.push(cert.map_err(|e| format!("cert_chain[{i}]: {e}"))?);
        }
    }
    if chain.is_empty() {
        return Err("cert_chain holds no certificate".into());
    }
    super::tls::check_names(&chain, identity)?;
    Ok(chain)
}

/// The leaf's `notBefore` and `notAfter`.
fn validity(leaf: &CertificateDer<'_>) -> Option<(SystemTime, SystemTime)> {
    use x509_parser::prelude::FromDer;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(leaf).ok()?;
    let at = |t: x509_parser::time::ASN1Time| {
        let secs = u64::try_from(t.timestamp()).ok()?;
        Some(UNIX_EPOCH + Duration::from_secs(secs))
    };
    Some((
        at(cert.validity().not_before)?,
        at(cert.validity().not_after)?,
    ))
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use x509_parser::prelude::FromDer;

    use super::*;

    fn team_a() -> Identity {
        Identity::parse("spiffe://cluster.local/ns/team-a/sa/sleep").unwrap()
    }

    #[test]
    fn the_request_is_encoded_with_istios_field_numbers() {
        let request = IstioCertificateRequest {
            csr: "C".into(),
            validity_duration: 86400,
            metadata: Some(impersonating(&team_a())),
        };
        let bytes = request.encode_to_vec();
        // Field 1 (csr), length-delimited: tag byte 0x0a; field 3 (varint): 0x18; field 4
        // (message): 0x22. Field 2 (the deprecated subject) is never sent.
        assert_eq!(&bytes[..3], &[0x0a, 0x01, b'C']);
        assert_eq!(bytes[3], 0x18);
        assert!(bytes.contains(&0x22));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("ImpersonatedIdentity"));
        assert!(text.contains("spiffe://cluster.local/ns/team-a/sa/sleep"));
    }

    #[test]
    fn the_csr_names_the_identity_and_nothing_else() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let pem = csr(&team_a(), &key).unwrap();
        let der = rustls::pki_types::CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
            .unwrap();
        let (_, request) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&der).unwrap();
        assert_eq!(request.certification_request_info.subject.iter().count(), 0);
        let uris: Vec<String> = request
            .requested_extensions()
            .into_iter()
            .flatten()
            .filter_map(|ext| match ext {
                x509_parser::extensions::ParsedExtension::SubjectAlternativeName(san) => Some(
                    san.general_names
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(uris, ["URI(spiffe://cluster.local/ns/team-a/sa/sleep)"]);
    }

    #[test]
    fn a_chain_for_someone_else_or_empty_is_refused() {
        assert!(
            read_issued(&[], &team_a())
                .unwrap_err()
                .contains("no certificate")
        );
        let other = rcgen::CertificateParams::new(Vec::<String>::new())
            .map(|mut p| {
                p.subject_alt_names = vec![SanType::URI(
                    "spiffe://cluster.local/ns/team-b/sa/sleep"
                        .try_into()
                        .unwrap(),
                )];
                p
            })
            .unwrap()
            .self_signed(&KeyPair::generate().unwrap())
            .unwrap();
        let why = read_issued(&[other.pem()], &team_a()).unwrap_err();
        assert!(why.contains("ns/team-b"), "{why}");
    }

    #[tokio::test]
    async fn an_unreachable_ca_is_an_error_naming_it_not_a_hang() {
        let dir = std::env::temp_dir().join(format!("rdt-ca-unreachable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = rcgen::CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .self_signed(&KeyPair::generate().unwrap())
            .unwrap();
        std::fs::write(dir.join("root-cert.pem"), root.pem()).unwrap();
        std::fs::write(dir.join("token"), "t\n").unwrap();
        // Nothing listens on port 1 of loopback: refused at once.
        let ca = IstioCa::new(CaSettings {
            address: "https://127.0.0.1:1".into(),
            root: dir.join("root-cert.pem"),
            token: dir.join("token"),
            cluster_id: "Kubernetes".into(),
            validity: Duration::from_secs(3600),
        })
        .unwrap();
        let started = std::time::Instant::now();
        let failed = ca.issue(&team_a()).await.unwrap_err().to_string();
        assert!(failed.contains("https://127.0.0.1:1"), "{failed}");
        assert!(started.elapsed() < CALL_TIMEOUT + Duration::from_secs(1));
        // An empty token is said before anything is sent.
        std::fs::write(dir.join("token"), "").unwrap();
        let empty = ca.issue(&team_a()).await.unwrap_err().to_string();
        assert!(
            empty.contains("token") && empty.contains("empty"),
            "{empty}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_address_or_missing_root_is_said_at_start() {
        let settings = CaSettings {
            address: "http://istiod:15012".into(),
            root: "/nonexistent/root-cert.pem".into(),
            token: "/nonexistent/token".into(),
            cluster_id: "Kubernetes".into(),
            validity: Duration::from_secs(3600),
        };
        let plain = IstioCa::new(settings.clone()).unwrap_err().to_string();
        assert!(plain.contains("https://"), "{plain}");
        let missing = IstioCa::new(CaSettings {
            address: "https://istiod:15012".into(),
            ..settings
        })
        .unwrap_err()
        .to_string();
        assert!(missing.contains("/nonexistent/root-cert.pem"), "{missing}");
    }
}
