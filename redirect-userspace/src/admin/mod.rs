//! The admin HTTP server: `/config_dump`, `/metrics`, `/healthz/ready`, `/logging`; and the stats
//! address, which serves the metrics alone where a cluster's Prometheus scrapes ztunnel's
//! (`/metrics` and `/stats/prometheus` on port 15020 of every address).
//!
//! It runs on its own thread with its own single-threaded runtime, apart from the data path: a busy
//! proxy never delays a scrape, and a slow scraper never takes a proxy worker.
pub(crate) mod client;
mod connections;
mod in_force;

pub(crate) use in_force::InForce;

use std::{convert::Infallible, io, net::SocketAddr, sync::Arc, thread};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use self::connections::Body;
use crate::{
    budget::Budgets,
    fastpath,
    live::{ConfigStatus, LiveState},
    logging::LogLevel,
    metrics,
    state::ConfigDump,
};

/// This build: version and, when built from a git checkout, the commit.
pub(crate) const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "+", env!("REDIRECT_GIT_REV"));

/// What the admin endpoints show.
pub(crate) struct AdminState {
    pub registry: Registry,
    /// The agent's phase: serving while the programs are attached and the proxies listen.
    pub phase: crate::drain::Watcher,
    pub live: Arc<LiveState>,
    pub log_level: Option<LogLevel>,
    /// When the proxy is at its limits it says so: a new connection would be refused.
    pub budgets: Option<Arc<Budgets>>,
    /// With the fast path: what the kernel's tables hold and who decides what.
    pub fast_path: Option<Arc<fastpath::FastPath>>,
    /// The agent's: whether a successor can take over.
    pub handover: Option<crate::redirect::bpffs::Handover>,
    /// The pods' cgroups the agent has found: `/config_dump` says which pod it knows by its cgroup.
    pub cgroups: Option<Arc<crate::identity::CgroupPods>>,
    /// The connection records, kernel's and proxy's (`/connections`).
    pub connections: Option<Arc<crate::records::Connections>>,
    /// The agent's flags and defaults in force (`inForce` in `/config_dump`).
    pub in_force: Option<InForce>,
}

impl AdminState {
    /// Ready: programs attached, a configuration in force (traffic is decided right), and room
    /// for new connections. `Err` says why not.
    fn ready(&self) -> Result<(), &'static str> {
        if self.phase.phase() != crate::drain::Phase::Serving {
            return Err("the eBPF programs are not attached");
        }
        if !self.live.has_config() {
            return Err("no configuration in force");
        }
        match self.budgets.as_ref().and_then(|b| b.saturated()) {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }
}

/// `/config_dump`: the running state, what the configuration said, and what this build is.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Dump {
    version: &'static str,
    config: ConfigStatus,
    #[serde(flatten)]
    state: ConfigDump,
    fast_path: FastPathDump,
    #[serde(skip_serializing_if = "Option::is_none")]
    handover: Option<crate::redirect::bpffs::Handover>,
    #[serde(skip_serializing_if = "Option::is_none")]
    in_force: Option<InForce>,
}

/// `fastPath` in `/config_dump`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FastPathDump {
    /// `run --fast-path`: the kernel decides what needs no proxy. Off: the proxy decides everything.
    enabled: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    in_force: Option<fastpath::Dump>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum AdminError {
    #[error(
        "admin address {0} is not a loopback address; it exposes the node's configuration, pass --admin-allow-non-loopback to bind it anyway"
    )]
    NotLoopback(SocketAddr),
    #[error("binding the admin server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("binding the stats address {addr} (--stats; --no-stats turns it off): {source}")]
    BindStats {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// Binds the admin address (loopback only unless allowed).
pub(crate) fn bind(
    addr: SocketAddr,
    allow_non_loopback: bool,
) -> Result<std::net::TcpListener, AdminError> {
    if !addr.ip().is_loopback() && !allow_non_loopback {
        return Err(AdminError::NotLoopback(addr));
    }
    let bind_err = |source| AdminError::Bind { addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
    listener.set_nonblocking(true).map_err(bind_err)?;
    Ok(listener)
}

/// Binds the stats address: any address, for it serves the metrics alone.
pub(crate) fn bind_stats(addr: SocketAddr) -> Result<std::net::TcpListener, AdminError> {
    let bind_err = |source| AdminError::BindStats { addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
    listener.set_nonblocking(true).map_err(bind_err)?;
    Ok(listener)
}

/// The admin server's sockets (bound here or handed over by a predecessor).
pub(crate) struct Listeners {
    /// Every endpoint.
    pub admin: std::net::TcpListener,
    /// The metrics alone; `None` with `--no-stats`.
    pub stats: Option<std::net::TcpListener>,
}

/// What a listener answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoints {
    All,
    MetricsOnly,
}

/// Serves on `listeners` on a thread of its own, until `stop` changes; then they are closed (a
/// successor holding the same sockets serves on).
pub(crate) fn spawn_on(
    listeners: Listeners,
    state: AdminState,
    stop: crate::drain::Watcher,
) -> io::Result<SocketAddr> {
    let Listeners { admin, stats } = listeners;
    admin.set_nonblocking(true)?;
    let local = admin.local_addr()?;
    let stats_local = match &stats {
        Some(stats) => {
            stats.set_nonblocking(true)?;
            Some(stats.local_addr()?)
        }
        None => None,
    };
    let state = Arc::new(state);
    thread::Builder::new().name("admin".into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                warn!(error = %e, "admin runtime failed to start; admin server disabled");
                return;
            }
        };
        let admin = serve(admin, state.clone(), stop.clone(), Endpoints::All);
        match stats {
            Some(stats) => {
                let stats = serve(stats, state, stop, Endpoints::MetricsOnly);
                runtime.block_on(async { tokio::join!(admin, stats) });
            }
            None => runtime.block_on(admin),
        }
    })?;
    info!(addr = %local, "admin server listening");
    if let Some(addr) = stats_local {
        info!(%addr, "metrics served for Prometheus at /metrics and /stats/prometheus");
    }
    Ok(local)
}

async fn serve(
    listener: std::net::TcpListener,
    state: Arc<AdminState>,
    mut stop: crate::drain::Watcher,
    endpoints: Endpoints,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            warn!(error = %e, "admin listener unusable; admin server disabled");
            return;
        }
    };
    loop {
        let accepted = tokio::select! {
            () = stop.stopped() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Usually EMFILE: back off instead of spinning on a CPU the proxy needs.
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = state.clone();
                async move {
                    Ok::<_, Infallible>(match endpoints {
                        Endpoints::All => route(&req, &state),
                        Endpoints::MetricsOnly => stats_route(&req, &state),
                    })
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(peer = %peer, error = %e, "admin connection ended with an error");
            }
        });
    }
}

/// The stats address: the metrics at either of ztunnel's paths, nothing else.
fn stats_route(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics" | "/stats/prometheus") => metrics_page(state),
        _ => text(
            StatusCode::NOT_FOUND,
            "endpoints: /metrics /stats/prometheus\n".into(),
        ),
    }
}

fn metrics_page(state: &AdminState) -> Response<Body> {
    match metrics::encode(&state.registry) {
        Ok(body) => with_type(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            body,
        ),
        Err(_) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n".into(),
        ),
    }
}

fn route(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    if req.uri().path() == "/logging" {
        return logging(req, state);
    }
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match req.uri().path() {
        "/connections" => connections(req, state),
        "/explain" => explain(req, state),
        "/audit" => audit(req, state),
        "/config_dump" => {
            let mut held = state.live.snapshot().config_dump();
            if let Some(cgroups) = &state.cgroups {
                for w in &mut held.workloads {
                    let uid = w.uid.as_deref().and_then(|u| u.parse().ok());
                    w.cgroup = uid.and_then(|uid| cgroups.known_pod_cgroup(&uid));
                }
            }
            let dump = Dump {
                version: VERSION,
                config: state.live.status_report(),
                state: held,
                fast_path: FastPathDump {
                    enabled: state.fast_path.is_some(),
                    in_force: state.fast_path.as_ref().and_then(|fast| fast.dump()),
                },
                handover: state.handover.clone(),
                in_force: state.in_force.clone(),
            };
            match serde_json::to_string_pretty(&dump) {
                Ok(body) => with_type(StatusCode::OK, "application/json", body + "\n"),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding the dump failed: {e}\n"),
                ),
            }
        }
        "/healthz/ready" => match state.ready() {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        "/metrics" => metrics_page(state),
        _ => text(
            StatusCode::NOT_FOUND,
            "endpoints: /config_dump /metrics /healthz/ready /logging[?level=FILTER] /audit[?namespace=NS] /connections[?namespace=NS][&service=NS/NAME][&follow=1] /explain?from=NAMESPACE|NS/POD|POD-IP&(host=NAME|ip=IP[:PORT][&over=auto|same-node|hbone|plaintext])\n".into(),
        ),
    }
}

/// `/audit[?namespace=NS]`: the changes the audit mesh config would make, by pair (those of client
/// namespace `NS` only when given); 404 when the agent runs without one.
fn audit(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let Some(audit) = state.live.audit() else {
        return text(
            StatusCode::NOT_FOUND,
            "no audit: the agent runs without --audit-mesh-config\n".into(),
        );
    };
    let namespace = query_param(req, "namespace");
    match serde_json::to_string_pretty(&audit.report(namespace.as_deref())) {
        Ok(body) => with_type(StatusCode::OK, "application/json", body + "\n"),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the audit failed: {e}\n"),
        ),
    }
}

/// `/connections`: the recent connection records (`connections.rs`); 404 without records (an
/// agent always keeps them; the offline admin state has none).
fn connections(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let Some(records) = &state.connections else {
        return text(StatusCode::NOT_FOUND, "no connection records here\n".into());
    };
    let filter = connections::filter_of(|key| query_param(req, key));
    if query_param(req, "follow").is_some_and(|v| v != "0" && v != "false") {
        return connections::follow(records, filter, state.phase.clone());
    }
    match connections::recent(records, &filter) {
        Ok(body) => with_type(StatusCode::OK, "application/json", body),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the records failed: {e}\n"),
        ),
    }
}

/// The (percent-decoded) value of the query parameter `key`, if given.
fn query_param(req: &Request<Incoming>, key: &str) -> Option<String> {
    let query = req.uri().query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// `/explain?from=CLIENT&host=NAME` or `&ip=IP[:PORT]`: `redirect explain`'s report, computed on
/// the snapshot in force by the same lookups the proxy and the DNS proxy make. The client is a
/// namespace, a pod (`namespace/name`) or a pod's address, as the agent knows it.
fn explain(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let query: Vec<(String, String)> = req
        .uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default();
    let param = |key: &str| {
        query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    let Some(from) = param("from") else {
        return text(StatusCode::BAD_REQUEST, "from= is required\n".into());
    };
    let snapshot = state.live.snapshot();
    let client = match crate::explain::client_of(&snapshot, from) {
        Ok(client) => client,
        Err(why) => return text(StatusCode::NOT_FOUND, format!("{why}\n")),
    };
    let body = match (param("host"), param("ip")) {
        (Some(host), None) => {
            let mut e = crate::explain::explain_host(&snapshot, &client.namespace, host);
            e.client = client;
            serde_json::to_string_pretty(&e)
        }
        (None, Some(ip)) => {
            let dst = match crate::explain::parse_destination(ip) {
                Ok(dst) => dst,
                Err(why) => return text(StatusCode::BAD_REQUEST, format!("ip={ip}: {why}\n")),
            };
            let over = match param("over")
                .map(|o| <crate::explain::Over as clap::ValueEnum>::from_str(o, true))
            {
                None => crate::explain::Over::Auto,
                Some(Ok(over)) => over,
                Some(Err(_)) => {
                    return text(
                        StatusCode::BAD_REQUEST,
                        "over= is one of auto, same-node, hbone, plaintext\n".into(),
                    );
                }
            };
            let mut e = crate::explain::explain_ip(&snapshot, &client.namespace, dst);
            e.client = client;
            // Who decides is what the tables in force say (the host names resolved ahead
            // included), not a compilation of the snapshot; without the fast path, the proxy.
            let port = e.outbound.port.unwrap_or(0);
            e.outbound.decided_by = state
                .fast_path
                .as_ref()
                .and_then(|fast| fast.decided_by(&e.client.namespace, dst.ip, port))
                .unwrap_or(fastpath::DecidedBy::Proxy);
            crate::explain::authorize(&snapshot, &mut e, dst, over);
            serde_json::to_string_pretty(&e)
        }
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                "give one of host= and ip=\n".into(),
            );
        }
    };
    match body {
        Ok(body) => with_type(StatusCode::OK, "application/json", body + "\n"),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the report failed: {e}\n"),
        ),
    }
}

/// `/logging` shows the log filter; `/logging?level=FILTER` (RUST_LOG syntax) replaces it.
fn logging(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let Some(log_level) = &state.log_level else {
        return text(
            StatusCode::NOT_FOUND,
            "log level control is not available\n".into(),
        );
    };
    // Filters like `info,redirect=debug` arrive percent-encoded from most clients.
    let level = query_param(req, "level");
    match level {
        None => text(StatusCode::OK, format!("{}\n", log_level.current())),
        Some(level) => match log_level.set(&level) {
            Ok(()) => {
                info!(filter = %level, "log filter changed");
                text(StatusCode::OK, format!("{}\n", log_level.current()))
            }
            Err(e) => text(StatusCode::BAD_REQUEST, format!("invalid log filter {e}\n")),
        },
    }
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    with_type(status, "text/plain; charset=utf-8", body)
}

fn with_type(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(connections::whole(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}
