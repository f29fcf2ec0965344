//! A stand-in for istiod's CA service: `istio.v1.auth.IstioCertificateService/CreateCertificate`
//! over gRPC on TLS, as Istio's `security/v1alpha1/ca.proto` defines it. It checks what istiod
//! checks of a node agent: the bearer token, that the identity asked for (the request's
//! `ImpersonatedIdentity`) is one it may have (`--allow`), and that the CSR names exactly it; then
//! signs with the suite's test CA for the lifetime asked, at most `--ttl` seconds. Events go to
//! stdout, one line each.
//!
//! The messages are written out here on their own, from the proto, not taken from the agent: a
//! field number the agent got wrong would then fail the suite instead of agreeing with itself.
use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result};
use integration::pki::TestCa;
use tonic::codegen::{Service, http};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::transport::{Identity as TlsIdentity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct CertificateRequest {
    #[prost(string, tag = "1")]
    csr: String,
    #[prost(int64, tag = "3")]
    validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    metadata: Option<prost_types::Struct>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CertificateResponse {
    #[prost(string, repeated, tag = "1")]
    cert_chain: Vec<String>,
}

const METHOD: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// What `rdt-peer ca` is given.
#[derive(Debug)]
pub(crate) struct CaArgs {
    pub(crate) listen: SocketAddr,
    /// `root-cert.pem` and `root-key.pem` of the suite's CA.
    pub(crate) ca_dir: PathBuf,
    pub(crate) trust_domain: String,
    /// The names of the serving certificate (istiod's host name, the listen IP).
    pub(crate) names: Vec<String>,
    /// The file holding the only token accepted.
    pub(crate) token: PathBuf,
    /// `NAMESPACE/ACCOUNT` identities a caller may ask for.
    pub(crate) allow: Vec<String>,
    /// The longest lifetime granted (`--ttl`); unset, the one asked for.
    pub(crate) max_ttl: Option<Duration>,
}

struct State {
    ca: TestCa,
    token: String,
    allowed: BTreeSet<String>,
    max_ttl: Option<Duration>,
}

pub(crate) fn serve(args: CaArgs) -> Result<()> {
    let ca = TestCa::load(&args.trust_domain, &args.ca_dir)?;
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    let serving = ca.issue_server(&names, Duration::from_secs(3600))?;
    let token = std::fs::read_to_string(&args.token)
        .with_context(|| format!("reading {}", args.token.display()))?;
    let allowed = args
        .allow
        .iter()
        .map(|a| {
            let (ns, sa) = a
                .split_once('/')
                .context("--allow takes NAMESPACE/ACCOUNT")?;
            Ok(integration::pki::spiffe_id(&args.trust_domain, ns, sa))
        })
        .collect::<Result<_>>()?;
    let state = Arc::new(State {
        ca,
        token: token.trim().to_string(),
        allowed,
        max_ttl: args.max_ttl,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let tls = ServerTlsConfig::new().identity(TlsIdentity::from_pem(
            serving.cert_chain_pem,
            serving.key_pem,
        ));
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        super::hbone::say(&format!("listening {}", args.listen));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        Server::builder()
            .tls_config(tls)?
            .serve_with_incoming(CaService(state), incoming)
            .await
            .context("serving")
    })
}

#[derive(Clone)]
struct CaService(Arc<State>);

impl NamedService for CaService {
    const NAME: &'static str = "istio.v1.auth.IstioCertificateService";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<http::Request<tonic::body::Body>> for CaService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != METHOD {
                return Ok(Status::unimplemented(request.uri().path().to_string()).into_http());
            }
            let codec =
                tonic_prost::ProstCodec::<CertificateResponse, CertificateRequest>::default();
            Ok(Grpc::new(codec).unary(Create(state), request).await)
        })
    }
}

struct Create(Arc<State>);

impl UnaryService<CertificateRequest> for Create {
    type Response = CertificateResponse;
    type Future = BoxFuture<Result<Response<CertificateResponse>, Status>>;

    fn call(&mut self, request: Request<CertificateRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let result = create(&state, &request);
            if let Err(status) = &result {
                super::hbone::say(&format!(
                    "refused code={:?} why={}",
                    status.code(),
                    status.message()
                ));
            }
            result.map(Response::new)
        })
    }
}

fn create(
    state: &State,
    request: &Request<CertificateRequest>,
) -> Result<CertificateResponse, Status> {
    let header = |name: &str| {
        request
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    if header("authorization") != format!("Bearer {}", state.token) {
        return Err(Status::unauthenticated(
            "the bearer token is not the one expected",
        ));
    }
    let body = request.get_ref();
    let asked = body
        .metadata
        .as_ref()
        .and_then(|m| m.fields.get("ImpersonatedIdentity"))
        .and_then(|v| match &v.kind {
            Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })
        .ok_or_else(|| Status::invalid_argument("no ImpersonatedIdentity"))?;
    if !state.allowed.contains(&asked) {
        return Err(Status::permission_denied(format!(
            "{asked} runs on no node of this caller"
        )));
    }
    let asked_for = u64::try_from(body.validity_duration)
        .ok()
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .ok_or_else(|| Status::invalid_argument("validity_duration must be positive"))?;
    let valid_for = state.max_ttl.map_or(asked_for, |max| asked_for.min(max));
    let (chain, uris) = state
        .ca
        .sign_csr(&body.csr, valid_for)
        .map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
    if uris != [asked.clone()] {
        return Err(Status::invalid_argument(format!(
            "the CSR names {uris:?}, not {asked}"
        )));
    }
    super::hbone::say(&format!(
        "issued identity={asked} ttl={}s cluster={} asked={}s",
        valid_for.as_secs(),
        header("clusterid"),
        asked_for.as_secs()
    ));
    // As istiod: one PEM per certificate, the leaf first and the root last.
    Ok(CertificateResponse { cert_chain: chain })
}
