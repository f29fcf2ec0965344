//! The proxy in-process, without root or a kernel: flows filed by the test instead of the eBPF
//! programs, plain sockets instead of marked ones, and every peer on loopback (the one network a
//! test has without root). Each outcome is seen as a client sees it (bytes or a reset) and as an
//! operator does (the metric).
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use redirect_common::{OrigDst, SockAddr};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
};

use super::{
    Authorizer, DialGuard, OutboundProxy, ProxyContext, ProxyMetrics, RelayMode, Timeouts, listen,
};
use crate::{
    budget::{BudgetArgs, BudgetMetrics, Budgets, Limits},
    config::{WorkloadAddress, load_sources},
    dns::{HostCache, Upstream},
    identity::CgroupPods,
    live::LiveState,
    metrics::{Metrics, encode},
    net::PlainSockets,
    records::{Connections, DecidedBy, Event, Filter, RecordMetrics},
    redirect::FiledFlows,
    state::Snapshot,
};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// The address the test entries claim, and the endpoint address the loader accepts before the test
/// moves it to loopback (the loader refuses loopback endpoints: the agent dials from the node).
const VIP: &str = "203.0.113.10";
const ENDPOINT: &str = "198.51.100.20";

struct Proxy {
    addr: SocketAddr,
    live: Arc<LiveState>,
    authorizer: Arc<Authorizer>,
    flows: Arc<FiledFlows>,
    metrics: Arc<Metrics>,
    proxy_metrics: Arc<ProxyMetrics>,
    budget_metrics: Arc<BudgetMetrics>,
    records: Arc<Connections>,
    _stop: crate::drain::Lifecycle,
}

#[derive(Default)]
struct Setup {
    /// Service entries (YAML), endpoints at [`ENDPOINT`] moved to loopback.
    config: String,
    timeouts: Timeouts,
    per_client: Option<usize>,
    denied: Vec<ipnet::IpNet>,
}

/// A PUBLIC entry for `api.example.com` at [`VIP`] port 80, its one endpoint on loopback port `port`.
fn public_entry(port: u16) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: api, namespace: team-a}}\n\
         spec: {{hosts: [api.example.com], addresses: [{VIP}], exportTo: ['*'], resolution: STATIC,\n\
         ports: [{{number: 80, name: http, protocol: TCP}}], endpoints: [{{address: {ENDPOINT}, ports: {{http: {port}}}}}]}}\n"
    )
}

fn snapshot(config: &str) -> Snapshot {
    let mut model = if config.is_empty() {
        load_sources(std::iter::empty()).unwrap()
    } else {
        match load_sources([("proxy-test.yaml", config)]) {
            Ok(model) => model,
            Err(e) => panic!("fixture does not load:\n{e}"),
        }
    };
    let endpoint: IpAddr = ENDPOINT.parse().unwrap();
    for entry in &mut model.service_entries {
        let entry = Arc::make_mut(entry);
        for e in &mut entry.endpoints {
            if e.address == WorkloadAddress::Ip(endpoint) {
                e.address = WorkloadAddress::Ip(LOOPBACK);
            }
        }
    }
    Snapshot::from_model(&model)
}

async fn start(setup: Setup) -> Proxy {
    let metrics = Arc::new(Metrics::default());
    let proxy_metrics = Arc::new(ProxyMetrics::default());
    let budget_metrics = Arc::new(BudgetMetrics::default());
    let live = LiveState::new(None);
    live.apply(snapshot(&setup.config), Vec::new(), Vec::new());
    let args = BudgetArgs {
        max_connections_per_client: setup.per_client,
        ..BudgetArgs::default()
    };
    let flows = Arc::new(FiledFlows::default());
    let records = Arc::new(Connections::new(false, Arc::new(RecordMetrics::default())));
    let authorizer = Arc::new(Authorizer::default());
    let context = Arc::new(ProxyContext {
        flows: flows.clone(),
        sockets: Arc::new(PlainSockets),
        live: live.clone(),
        metrics: metrics.clone(),
        proxy_metrics: proxy_metrics.clone(),
        endpoint_hosts: Arc::new(HostCache::new(Arc::new(Upstream::new(
            "127.0.0.1:9".parse().unwrap(),
        )))),
        relay: RelayMode::Splice,
        // No cgroup tree: no client is a pod with a uid, so none is held against the kernel.
        cgroups: Arc::new(CgroupPods::new("/nonexistent/cgroup".into())),
        budgets: Arc::new(Budgets::new(
            Limits::size(4096, crate::budget::ports::DEFAULT_EPHEMERAL_PORTS, &args),
            &budget_metrics,
        )),
        timeouts: setup.timeouts,
        guard: Arc::new(DialGuard::allowing_loopback(setup.denied)),
        buffer: Some(64 * 1024),
        records: records.clone(),
        hbone: Arc::new(crate::hbone::HboneClient::new(
            None,
            Arc::new(PlainSockets),
            Arc::default(),
        )),
        authorizer: authorizer.clone(),
    });
    let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let proxy = OutboundProxy::new(listener, context.clone());
    let addr = proxy.local_addr().unwrap();
    let stop = crate::drain::Lifecycle::default();
    tokio::spawn(proxy.serve(stop.serving()));
    tokio::spawn(super::recheck_on_change(
        context.clone(),
        None,
        stop.serving(),
    ));
    Proxy {
        addr,
        live,
        authorizer,
        flows,
        metrics,
        proxy_metrics,
        budget_metrics,
        records,
        _stop: stop,
    }
}

impl Proxy {
    /// Every family the proxy counts in, as `/metrics` shows them.
    fn text(&self) -> String {
        let registry = crate::metrics::registry_of(|r| {
            self.metrics.register(r);
            self.proxy_metrics.register(r);
            self.budget_metrics.register(r);
        });
        encode(&registry).unwrap()
    }

    /// A client connection that meant to go to `orig`, steered to the proxy as the kernel would:
    /// its original destination filed under its address and port before it connects.
    async fn connect(&self, orig: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let local = socket.local_addr().unwrap();
        let filed = OrigDst {
            dst: SockAddr::from_socket_addr(orig),
            protocol: 6,
            cgroup_id: 0,
            netns_cookie: 0,
        };
        self.flows.file(local, filed);
        socket.connect(self.addr).await.unwrap()
    }

    /// `redirect_<family>_total{...="<label>"}`, 0 when the series does not exist yet.
    fn count(&self, family: &str, label: &str) -> u64 {
        let text = self.text();
        let prefix = format!("redirect_{family}_total{{");
        text.lines()
            .find(|l| l.starts_with(&prefix) && l.contains(&format!("\"{label}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Waits for the connection to be counted under `outcome` (the proxy counts it when decided).
    async fn counted(&self, outcome: &str, want: u64) {
        for _ in 0..200 {
            if self.count("outbound_connections", outcome) >= want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{outcome} never counted {want}: {}", self.text());
    }
}

/// An upstream that greets every connection with `name` and then echoes.
async fn upstream(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                conn.write_all(format!("{name}\n").as_bytes()).await?;
                let (mut r, mut w) = conn.split();
                tokio::io::copy(&mut r, &mut w).await
            });
        }
    });
    addr
}

/// Reads the greeting line.
async fn greeting(conn: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while conn.read(&mut byte).await.unwrap() == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

/// Whether the proxy resets the connection (rather than serving or closing it).
async fn is_reset(conn: &mut TcpStream) -> bool {
    let mut buf = [0u8; 16];
    match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await {
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        _ => false,
    }
}

#[tokio::test]
async fn a_visible_service_is_dialled_at_its_endpoint_and_carried_both_ways() {
    let endpoint = upstream("endpoint").await;
    let proxy = start(Setup {
        config: public_entry(endpoint.port()),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(format!("{VIP}:80").parse().unwrap()).await;
    assert_eq!(greeting(&mut conn).await, "endpoint");
    conn.write_all(b"ping\n").await.unwrap();
    assert_eq!(greeting(&mut conn).await, "ping");
    proxy.counted("service", 1).await;
}

#[tokio::test]
async fn an_address_no_service_claims_passes_through_to_where_it_was_going() {
    let real = upstream("the real destination").await;
    let proxy = start(Setup::default()).await;
    let mut conn = proxy.connect(real).await;
    assert_eq!(greeting(&mut conn).await, "the real destination");
    proxy.counted("passthrough", 1).await;
}

#[tokio::test]
async fn an_undeclared_port_of_a_service_is_reset_as_no_healthy_upstream() {
    let endpoint = upstream("endpoint").await;
    let proxy = start(Setup {
        config: public_entry(endpoint.port()),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(format!("{VIP}:81").parse().unwrap()).await;
    assert!(is_reset(&mut conn).await);
    proxy.counted("no_healthy_upstream", 1).await;
}

#[tokio::test]
async fn an_endpoint_that_refuses_is_a_reset_and_an_error() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = start(Setup {
        config: public_entry(closed.port()),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(format!("{VIP}:80").parse().unwrap()).await;
    assert!(is_reset(&mut conn).await);
    proxy.counted("error", 1).await;
    assert_eq!(proxy.count("outbound_connections", "service"), 0);
}

#[tokio::test]
async fn a_connection_nobody_filed_is_reset_and_counted_unclaimed() {
    let proxy = start(Setup::default()).await;
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    assert!(is_reset(&mut conn).await);
    proxy.counted("error", 1).await;
    let text = proxy.text();
    assert!(
        text.contains("redirect_outbound_unclaimed_total 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_denied_destination_is_never_dialled() {
    let real = upstream("must not be reached").await;
    let proxy = start(Setup {
        denied: vec!["127.0.0.1/32".parse().unwrap()],
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(real).await;
    assert!(is_reset(&mut conn).await);
    proxy.counted("error", 1).await;
    assert_eq!(proxy.count("outbound_refused_destinations", "denied"), 1);
}

#[tokio::test]
async fn a_client_past_its_share_is_reset_and_its_held_connection_kept() {
    let real = upstream("real").await;
    let proxy = start(Setup {
        per_client: Some(1),
        ..Setup::default()
    })
    .await;
    let mut held = proxy.connect(real).await;
    assert_eq!(greeting(&mut held).await, "real");
    let mut refused = proxy.connect(real).await;
    assert!(is_reset(&mut refused).await);
    assert_eq!(proxy.count("budget_refusals", "connections"), 1);
    held.write_all(b"still here\n").await.unwrap();
    assert_eq!(greeting(&mut held).await, "still here");
}

#[tokio::test]
async fn a_connection_with_no_byte_either_way_ends_at_the_idle_timeout() {
    let real = upstream("real").await;
    let proxy = start(Setup {
        timeouts: Timeouts {
            idle: Duration::from_millis(300),
            write: Duration::from_secs(30),
        },
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(real).await;
    assert_eq!(greeting(&mut conn).await, "real");
    assert!(is_reset(&mut conn).await);
    assert_eq!(proxy.count("outbound_timeouts", "idle"), 1);
}

#[tokio::test]
async fn a_client_that_stops_reading_after_closing_ends_at_the_write_timeout() {
    // An upstream that, once the client's request is in (and its side closed), sends more than
    // every buffer on the way holds.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let real = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        conn.read_to_end(&mut request).await.unwrap();
        let chunk = vec![0u8; 1 << 20];
        while conn.write_all(&chunk).await.is_ok() {}
    });
    let proxy = start(Setup {
        timeouts: Timeouts {
            idle: Duration::from_secs(30),
            write: Duration::from_millis(300),
        },
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(real).await;
    conn.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    conn.shutdown().await.unwrap();
    for _ in 0..500 {
        if proxy.count("outbound_timeouts", "write") == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no write timeout counted");
}

#[tokio::test]
async fn a_proxied_connection_is_recorded_when_its_upstream_answers_and_again_with_its_bytes_when_it_ends()
 {
    let endpoint = upstream("endpoint").await;
    let proxy = start(Setup {
        config: public_entry(endpoint.port()),
        ..Setup::default()
    })
    .await;
    let orig: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let mut conn = proxy.connect(orig).await;
    let client = conn.local_addr().unwrap();
    assert_eq!(greeting(&mut conn).await, "endpoint");
    conn.write_all(b"ping\n").await.unwrap();
    assert_eq!(greeting(&mut conn).await, "ping");
    drop(conn);
    let mut records = Vec::new();
    for _ in 0..200 {
        records = proxy.records.recent(&Filter::default());
        if records.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let events: Vec<Event> = records.iter().map(|r| r.event).collect();
    assert_eq!(events, [Event::Open, Event::Close], "{records:?}");
    let close = &records[1];
    assert_eq!(close.decided_by, DecidedBy::Proxy);
    assert_eq!(close.client, Some(client));
    assert_eq!(close.orig_dst, Some(orig));
    assert_eq!(close.endpoint, Some(endpoint));
    assert_eq!(close.service.as_deref(), Some("team-a/api"));
    // "ping\n" each way, and the greeting "endpoint\n" back.
    assert_eq!((close.bytes_sent, close.bytes_received), (5, 14));
    assert_eq!(close.end, Some("closed"));
    let other_namespace = Filter {
        namespace: Some("team-b".into()),
        ..Filter::default()
    };
    assert!(proxy.records.recent(&other_namespace).is_empty());
}

/// A Pod of this node on a loopback address, serving; and its authorization policies.
fn pod_under(policies: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: web-1, namespace: team-a, labels: {{app: web}}}}\nstatus: {{podIP: 127.0.0.2}}\n---\n{policies}"
    )
}

fn authz_policy(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: team-a}}\nspec: {spec}\n---\n"
    )
}

/// An upstream as in [`upstream`], on the Pod's loopback address.
async fn pod_upstream(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                conn.write_all(format!("{name}\n").as_bytes()).await?;
                let (mut r, mut w) = conn.split();
                tokio::io::copy(&mut r, &mut w).await
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_connection_to_a_pod_its_policies_deny_is_reset_and_counted_denied() {
    let web = pod_upstream("web-1").await;
    // The client (on 127.0.0.1, no Pod the kernel confirmed) has no identity: plaintext.
    let proxy = start(Setup {
        config: pod_under(&authz_policy(
            "only-a",
            "{rules: [{from: [{source: {principals: [cluster.local/ns/team-a/sa/default]}}]}]}",
        )),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(web).await;
    assert!(is_reset(&mut conn).await);
    proxy.counted("denied", 1).await;
    assert_eq!(
        proxy
            .authorizer
            .metrics
            .get(super::authorize::Path::SameNode, "denied", ""),
        1
    );
}

#[tokio::test]
async fn an_allowed_connection_is_carried_and_closed_once_a_new_policy_denies_it() {
    let web = pod_upstream("web-1").await;
    let allow_all = authz_policy("allow-all", "{rules: [{}]}");
    let proxy = start(Setup {
        config: pod_under(&allow_all),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(web).await;
    assert_eq!(greeting(&mut conn).await, "web-1");
    let deny = authz_policy(
        "deny-loopback",
        "{action: DENY, rules: [{from: [{source: {ipBlocks: [127.0.0.1/32]}}]}]}",
    );
    let denied = snapshot(&pod_under(&format!("{allow_all}{deny}")));
    proxy.live.apply(denied, Vec::new(), Vec::new());
    assert!(is_reset(&mut conn).await, "the open connection is closed");
    let path = super::authorize::Path::SameNode;
    assert_eq!(
        proxy
            .authorizer
            .metrics
            .get(path, "allowed", "team-a/allow-all"),
        1
    );
    assert_eq!(
        proxy
            .authorizer
            .metrics
            .get(path, "closed", "team-a/deny-loopback"),
        1
    );
    // And the next one is refused.
    let mut next = proxy.connect(web).await;
    assert!(is_reset(&mut next).await);
    assert_eq!(
        proxy
            .authorizer
            .metrics
            .get(path, "denied", "team-a/deny-loopback"),
        1
    );
}

#[tokio::test]
async fn a_pod_without_policy_is_reached_and_nothing_is_counted() {
    let web = pod_upstream("web-1").await;
    let proxy = start(Setup {
        config: pod_under(""),
        ..Setup::default()
    })
    .await;
    let mut conn = proxy.connect(web).await;
    assert_eq!(greeting(&mut conn).await, "web-1");
    proxy.counted("workload", 1).await;
    let path = super::authorize::Path::SameNode;
    assert_eq!(proxy.authorizer.metrics.get(path, "allowed", ""), 0);
}
