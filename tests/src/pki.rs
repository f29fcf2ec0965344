//! A test certificate authority issuing Istio-style workload certificates: ECDSA P-256, an empty
//! subject and one URI SAN `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`, usable
//! for both ends of mutual TLS (serverAuth + clientAuth).
//!
//! ```no_run
//! use std::time::Duration;
//! use integration::pki::TestCa;
//! # fn main() -> anyhow::Result<()> {
//! let ca = TestCa::new("cluster.local")?;
//! let dir = std::path::Path::new("/tmp/identities");
//! // root-cert.pem, team-a/default/{cert-chain,key}.pem: the layout the agent reads.
//! ca.write_identity_dir(dir, &[("team-a", "default")], Duration::from_secs(3600))?;
//! # Ok(()) }
//! ```
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
use x509_parser::extensions::GeneralName;

/// How far back a certificate's validity starts, for clocks a little apart.
const BACKDATE: Duration = Duration::from_secs(60);
/// The root's lifetime.
const ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// A self-signed root (ECDSA P-256) for one trust domain, and the key that signs its leaves.
pub struct TestCa {
    trust_domain: String,
    root_pem: String,
    root_key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A workload certificate and its key.
#[derive(Clone, Debug)]
pub struct Issued {
    /// PEM: the leaf, then the root.
    pub cert_chain_pem: String,
    /// PEM, PKCS#8 (`PRIVATE KEY`).
    pub key_pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

/// `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`.
pub fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// The first URI SAN of a DER certificate (a workload's SPIFFE identity); `None` when it has none
/// or does not parse.
pub fn uri_san(cert_der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|name| match name {
        GeneralName::URI(uri) => Some((*uri).to_string()),
        _ => None,
    })
}

impl TestCa {
    /// A new root for `trust_domain`, CN `rdt test root <trust domain>`, valid for ten years.
    pub fn new(trust_domain: &str) -> Result<TestCa> {
        if trust_domain.is_empty() || trust_domain.contains('/') {
            bail!("bad trust domain {trust_domain:?}");
        }
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generating the root key")?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "rdt");
        dn.push(DnType::CommonName, format!("rdt test root {trust_domain}"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = now()?;
        params.not_before = rcgen::date_time_ymd(1970, 1, 1) + (now - BACKDATE);
        params.not_after = rcgen::date_time_ymd(1970, 1, 1) + (now + ROOT_LIFETIME);
        let root = params.self_signed(&key).context("signing the root")?;
        Ok(TestCa {
            trust_domain: trust_domain.to_string(),
            root_pem: root.pem(),
            root_key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Writes `root-cert.pem` and `root-key.pem` into `dir`, for another process to
    /// [`TestCa::load`] (the CA stand-in, `rdt-peer ca`).
    pub fn save(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_atomic(&dir.join("root-cert.pem"), &self.root_pem, 0o644)?;
        write_atomic(&dir.join("root-key.pem"), &self.root_key_pem, 0o600)
    }

    /// The CA [`TestCa::save`] wrote into `dir`.
    pub fn load(trust_domain: &str, dir: &Path) -> Result<TestCa> {
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
        };
        let (root_pem, root_key_pem) = (read("root-cert.pem")?, read("root-key.pem")?);
        let key = KeyPair::from_pem(&root_key_pem).context("root-key.pem")?;
        let issuer = Issuer::from_ca_cert_pem(&root_pem, key).context("root-cert.pem")?;
        Ok(TestCa {
            trust_domain: trust_domain.to_string(),
            root_pem,
            root_key_pem,
            issuer,
        })
    }

    /// Signs a PEM certificate request as a workload certificate (the CSR's key and SANs, this
    /// CA's usages), valid for `valid_for`; the chain, one PEM each (leaf, then root), and the URI
    /// SANs it names.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        valid_for: Duration,
    ) -> Result<(Vec<String>, Vec<String>)> {
        let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
            .context("the CSR does not parse or its signature does not verify")?;
        let uris = csr
            .params
            .subject_alt_names
            .iter()
            .filter_map(|san| match san {
                SanType::URI(uri) => Some(uri.as_str().to_string()),
                _ => None,
            })
            .collect();
        workload_usages(&mut csr.params, valid_for)?;
        let leaf = csr.signed_by(&self.issuer).context("signing the CSR")?;
        Ok((vec![leaf.pem(), self.root_pem.clone()], uris))
    }

    /// A serving certificate for a control plane (istiod's): DNS and IP SANs, serverAuth.
    pub fn issue_server(&self, names: &[&str], valid_for: Duration) -> Result<Issued> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generating a key")?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .context("the server's names")?;
        workload_usages(&mut params, valid_for)?;
        let leaf = params.signed_by(&key, &self.issuer).context("signing")?;
        Ok(Issued {
            cert_chain_pem: format!("{}{}", leaf.pem(), self.root_pem),
            key_pem: key.serialize_pem(),
        })
    }

    /// The trust domain this root issues for.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The root certificate, PEM.
    pub fn root_pem(&self) -> String {
        self.root_pem.clone()
    }

    /// A workload certificate for `namespace`/`service_account`: URI SAN only, not a CA,
    /// digitalSignature + keyEncipherment, serverAuth + clientAuth, valid from a minute ago for
    /// `valid_for` from now.
    pub fn issue(
        &self,
        namespace: &str,
        service_account: &str,
        valid_for: Duration,
    ) -> Result<Issued> {
        for (what, part) in [
            ("namespace", namespace),
            ("service account", service_account),
        ] {
            if part.is_empty() || part.contains('/') {
                bail!("bad {what} {part:?}");
            }
        }
        let uri = spiffe_id(&self.trust_domain, namespace, service_account);
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).context("generating a key")?;
        let mut params = CertificateParams::default();
        // Empty, as Istio's: the SAN is the identity (and rcgen marks it critical then).
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(
            uri.clone()
                .try_into()
                .with_context(|| format!("{uri} as a URI SAN"))?,
        )];
        workload_usages(&mut params, valid_for)?;
        let leaf = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing {uri}"))?;
        Ok(Issued {
            cert_chain_pem: format!("{}{}", leaf.pem(), self.root_pem),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes the layout the agent reads: `dir/root-cert.pem`, and for every (namespace, service
    /// account) `dir/<namespace>/<service account>/cert-chain.pem` and `.../key.pem`. Each file is
    /// written under a temporary name in its directory, then renamed into place.
    pub fn write_identity_dir(
        &self,
        dir: &Path,
        identities: &[(&str, &str)],
        valid_for: Duration,
    ) -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (namespace, service_account) in identities {
            let issued = self.issue(namespace, service_account, valid_for)?;
            let sa_dir = dir.join(namespace).join(service_account);
            fs::create_dir_all(&sa_dir)
                .with_context(|| format!("creating {}", sa_dir.display()))?;
            write_atomic(
                &sa_dir.join("cert-chain.pem"),
                &issued.cert_chain_pem,
                0o644,
            )?;
            write_atomic(&sa_dir.join("key.pem"), &issued.key_pem, 0o600)?;
        }
        write_atomic(&dir.join("root-cert.pem"), &self.root_pem, 0o644)
    }

    /// Writes `cert-chain.pem`, `key.pem` and `root-cert.pem` flat into `dir`, each atomically,
    /// and returns the arguments that give them to `rdt-peer hbone` or `hbone-client`
    /// (`--cert`, `--key`, `--root`).
    pub fn write_server_files(
        &self,
        dir: &Path,
        namespace: &str,
        service_account: &str,
        valid_for: Duration,
    ) -> Result<Vec<String>> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let issued = self.issue(namespace, service_account, valid_for)?;
        let mut args = Vec::new();
        for (flag, file, text, mode) in [
            ("--cert", "cert-chain.pem", &issued.cert_chain_pem, 0o644),
            ("--key", "key.pem", &issued.key_pem, 0o600),
            ("--root", "root-cert.pem", &self.root_pem, 0o644),
        ] {
            let path = dir.join(file);
            write_atomic(&path, text, mode)?;
            args.extend([flag.to_string(), path.to_string_lossy().into_owned()]);
        }
        Ok(args)
    }
}

/// A leaf's constraints, as Istio's CA sets them: not a CA, digitalSignature + keyEncipherment,
/// serverAuth + clientAuth, valid from a minute ago for `valid_for` from now.
fn workload_usages(params: &mut CertificateParams, valid_for: Duration) -> Result<()> {
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    let now = now()?;
    params.not_before = rcgen::date_time_ymd(1970, 1, 1) + (now - BACKDATE);
    params.not_after = rcgen::date_time_ymd(1970, 1, 1) + (now + valid_for);
    Ok(())
}

/// Time since the Unix epoch.
fn now() -> Result<Duration> {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the clock is before 1970")
}

/// Writes `contents` to a temporary file next to `path` (mode `mode`), then renames it over `path`.
fn write_atomic(path: &Path, contents: &str, mode: u32) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        file.write_all(contents.as_bytes())
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.sync_all()
            .with_context(|| format!("syncing {}", tmp.display()))?;
        fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::client::verify_server_cert_signed_by_trust_anchor;
    use rustls::crypto::ring;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
    use rustls::server::danger::ClientCertVerifier;
    use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
    use rustls::{CertificateError, RootCertStore};

    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn chain(issued: &Issued) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(issued.cert_chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap()
    }

    fn roots(ca: &TestCa) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.root_pem().as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        Arc::new(roots)
    }

    fn client_verifier(ca: &TestCa) -> Arc<dyn ClientCertVerifier> {
        WebPkiClientVerifier::builder_with_provider(roots(ca), Arc::new(ring::default_provider()))
            .build()
            .unwrap()
    }

    fn unix(secs: u64) -> UnixTime {
        UnixTime::since_unix_epoch(Duration::from_secs(secs))
    }

    #[test]
    fn leaf_carries_the_spiffe_uri_and_validity() {
        let ca = TestCa::new("cluster.local").unwrap();
        let before = now().unwrap().as_secs();
        let issued = ca.issue("team-a", "default", HOUR).unwrap();
        let after = now().unwrap().as_secs();
        let chain = chain(&issued);
        assert_eq!(chain.len(), 2, "leaf then root");
        let (rest, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        assert!(rest.is_empty());
        let sans: Vec<String> = leaf
            .subject_alternative_name()
            .unwrap()
            .expect("a SAN extension")
            .value
            .general_names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect();
        assert_eq!(
            sans,
            vec![r#"URI("spiffe://cluster.local/ns/team-a/sa/default")"#]
        );
        assert_eq!(
            uri_san(&chain[0]).as_deref(),
            Some("spiffe://cluster.local/ns/team-a/sa/default")
        );
        assert!(!leaf.is_ca());
        let ku = leaf.key_usage().unwrap().expect("key usage").value;
        assert!(ku.digital_signature() && ku.key_encipherment() && !ku.key_cert_sign());
        let eku = leaf
            .extended_key_usage()
            .unwrap()
            .expect("extended key usage")
            .value;
        assert!(eku.server_auth && eku.client_auth);
        let not_before = leaf.validity().not_before.timestamp() as u64;
        let not_after = leaf.validity().not_after.timestamp() as u64;
        assert!(
            (before - 60..=after - 60).contains(&not_before),
            "{not_before}"
        );
        assert!(
            (before + 3600..=after + 3600).contains(&not_after),
            "{not_after}"
        );
        // The second certificate is the root, and the root is a CA named after the trust domain.
        let (_, root) = x509_parser::parse_x509_certificate(&chain[1]).unwrap();
        assert!(root.is_ca());
        assert_eq!(
            root.subject().to_string(),
            "O=rdt, CN=rdt test root cluster.local"
        );
        assert_eq!(leaf.issuer(), root.subject());
        // The key is PKCS#8.
        assert!(issued.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert!(matches!(
            PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).unwrap(),
            PrivateKeyDer::Pkcs8(_)
        ));
    }

    #[test]
    fn chain_verifies_against_its_root_only() {
        let ca = TestCa::new("cluster.local").unwrap();
        let other = TestCa::new("cluster.local").unwrap();
        let issued = chain(&ca.issue("team-a", "default", HOUR).unwrap());
        let foreign = chain(&other.issue("team-a", "default", HOUR).unwrap());
        let now = UnixTime::now();

        let verifier = client_verifier(&ca);
        verifier
            .verify_client_cert(&issued[0], &issued[1..], now)
            .expect("a leaf of this root verifies as a client");
        // Same trust domain, so the same issuer name: the other root's signature does not check.
        let err = verifier
            .verify_client_cert(&foreign[0], &foreign[1..], now)
            .expect_err("a leaf of another root must not verify");
        assert!(
            matches!(
                err,
                rustls::Error::InvalidCertificate(CertificateError::BadSignature)
            ),
            "{err:?}"
        );
        // Another trust domain: no root of that name at all.
        let elsewhere = chain(
            &TestCa::new("elsewhere.example")
                .unwrap()
                .issue("team-a", "default", HOUR)
                .unwrap(),
        );
        let err = verifier
            .verify_client_cert(&elsewhere[0], &elsewhere[1..], now)
            .expect_err("a leaf of another trust domain's root must not verify");
        assert!(
            matches!(
                err,
                rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)
            ),
            "{err:?}"
        );

        let algs = ring::default_provider()
            .signature_verification_algorithms
            .all;
        let leaf = ParsedCertificate::try_from(&issued[0]).unwrap();
        verify_server_cert_signed_by_trust_anchor(&leaf, &roots(&ca), &issued[1..], now, algs)
            .expect("a leaf of this root verifies as a server");
        let leaf = ParsedCertificate::try_from(&foreign[0]).unwrap();
        verify_server_cert_signed_by_trust_anchor(&leaf, &roots(&ca), &foreign[1..], now, algs)
            .expect_err("a leaf of another root must not verify as a server");
    }

    #[test]
    fn leaf_is_refused_outside_its_validity() {
        let ca = TestCa::new("cluster.local").unwrap();
        let issued = chain(&ca.issue("team-a", "default", HOUR).unwrap());
        let verifier = client_verifier(&ca);
        let now = now().unwrap().as_secs();
        verifier
            .verify_client_cert(&issued[0], &issued[1..], unix(now + 3500))
            .expect("valid within the hour");
        let err = verifier
            .verify_client_cert(&issued[0], &issued[1..], unix(now + 3700))
            .expect_err("expired after the hour");
        assert!(format!("{err:?}").contains("Expired"), "{err:?}");
        let err = verifier
            .verify_client_cert(&issued[0], &issued[1..], unix(now - 120))
            .expect_err("not valid before a minute ago");
        assert!(format!("{err:?}").contains("NotValidYet"), "{err:?}");
    }

    #[test]
    fn writes_the_identity_layout() {
        let dir = std::env::temp_dir().join(format!("rdt-pki-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let ca = TestCa::new("td.example").unwrap();
        ca.write_identity_dir(&dir, &[("team-a", "default"), ("team-b", "api")], HOUR)
            .unwrap();
        assert_eq!(
            fs::read_to_string(dir.join("root-cert.pem")).unwrap(),
            ca.root_pem()
        );
        for (ns, sa) in [("team-a", "default"), ("team-b", "api")] {
            let sa_dir = dir.join(ns).join(sa);
            let pem = fs::read_to_string(sa_dir.join("cert-chain.pem")).unwrap();
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            assert_eq!(
                uri_san(&certs[0]),
                Some(spiffe_id("td.example", ns, sa)),
                "{ns}/{sa}"
            );
            client_verifier(&ca)
                .verify_client_cert(&certs[0], &certs[1..], UnixTime::now())
                .unwrap();
            let key = fs::read_to_string(sa_dir.join("key.pem")).unwrap();
            PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        }
        let flat = dir.join("flat");
        ca.write_server_files(&flat, "istio-system", "waypoint", HOUR)
            .unwrap();
        let mut names: Vec<String> = fs::read_dir(&flat)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["cert-chain.pem", "key.pem", "root-cert.pem"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// With `RDT_PKI_OUT=DIR`, writes files for a manual `rdt-peer hbone` check: `DIR/server`
    /// (istio-system/waypoint) and `DIR/client` (team-a/default) from one root, `DIR/other`
    /// (team-a/default) from another. Does nothing without it.
    #[test]
    fn write_manual_check_files() {
        let Some(out) = std::env::var_os("RDT_PKI_OUT") else {
            return;
        };
        let out = Path::new(&out);
        let ca = TestCa::new("cluster.local").unwrap();
        let other = TestCa::new("cluster.local").unwrap();
        ca.write_server_files(&out.join("server"), "istio-system", "waypoint", HOUR)
            .unwrap();
        ca.write_server_files(&out.join("client"), "team-a", "default", HOUR)
            .unwrap();
        other
            .write_server_files(&out.join("other"), "team-a", "default", HOUR)
            .unwrap();
    }
}
