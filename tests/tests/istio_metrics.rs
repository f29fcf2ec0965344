//! Istio's standard TCP metrics (`docs/observability.md#istio-metrics`), as Kiali and Istio's
//! dashboards read them: real curls move the series of their kind of connection by exactly what
//! they did, whoever decided them (the kernel by default, the proxy with `--no-fast-path`), with
//! the labels ztunnel would give them; and a real Prometheus scraping the stats address answers
//! Kiali's graph queries and the workload dashboard's with the edges the test made.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use integration::fixtures::{Moved, curls_moved};
use integration::metrics::Metrics;
use integration::prometheus::{Prometheus, Sample};
use integration::world::{World, edit_file};
use integration::{Launch, pace};

const OPENED: &str = "istio_tcp_connections_opened_total";
const CLOSED: &str = "istio_tcp_connections_closed_total";
const FAILED: &str = "istio_tcp_connections_failed_total";
/// Client to server: Istio's names are backwards on purpose.
const FROM_CLIENT: &str = "istio_tcp_received_bytes_total";
const TO_CLIENT: &str = "istio_tcp_sent_bytes_total";

/// Connections of each kind.
const EACH: usize = 50;

/// a1 as the Pod of a Deployment `curl-client` (its ReplicaSet's name, `pod-template-hash`,
/// a generated name) with Istio's canonical labels, as SPEC's example has it.
fn deployment_a1(dir: &std::path::Path) -> Result<()> {
    edit_file(
        dir,
        "10-workloads.yaml",
        "metadata: {name: a1, namespace: team-a, uid: 3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1, labels: {app: client}}",
        "metadata:\n  name: a1\n  generateName: curl-client-7d9f8b6c5-\n  namespace: team-a\n  \
         uid: 3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1\n  \
         labels: {app: client, pod-template-hash: 7d9f8b6c5, service.istio.io/canonical-name: curl, service.istio.io/canonical-revision: v1}\n  \
         ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: curl-client-7d9f8b6c5, uid: 0f0e0d0c-0000-4000-8000-00000000a1a1, controller: true}]",
    )?;
    // An entry whose endpoint refuses: every connection to it fails to connect.
    std::fs::write(
        dir.join("35-closed.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\n\
         metadata: {name: closed-port, namespace: team-a}\n\
         spec:\n  hosts: [closed.example.com]\n  addresses: [203.0.113.99]\n  \
         ports: [{number: 80, name: http, protocol: HTTP}]\n  resolution: STATIC\n  \
         endpoints: [{address: 198.51.100.20, ports: {http: 81}}]\n",
    )?;
    Ok(())
}

/// The labels a1's connections to team-a's entry carry, whoever decides them (SPEC's example).
const A1_TO_ENTRY: &[(&str, &str)] = &[
    ("reporter", "source"),
    ("source_workload", "curl-client"),
    ("source_workload_namespace", "team-a"),
    ("source_canonical_service", "curl"),
    ("source_canonical_revision", "v1"),
    ("source_app", "curl"),
    ("source_version", "v1"),
    ("source_cluster", "Kubernetes"),
    ("source_principal", "unknown"),
    ("destination_service", "api.example.com"),
    ("destination_service_name", "api-example"),
    ("destination_service_namespace", "team-a"),
    ("destination_workload", "api-example"),
    ("destination_workload_namespace", "team-a"),
    ("destination_cluster", "Kubernetes"),
    ("request_protocol", "tcp"),
    ("response_flags", "-"),
    ("connection_security_policy", "unknown"),
];

/// b1 (a bare Pod, `app: client`) to the real api.example.com: nothing visible claims it.
const B1_PASSTHROUGH: &[(&str, &str)] = &[
    ("reporter", "source"),
    ("source_workload", "b1"),
    ("source_workload_namespace", "team-b"),
    ("source_canonical_service", "client"),
    ("source_canonical_revision", "latest"),
    ("destination_service", "unknown"),
    ("destination_service_name", "unknown"),
    ("destination_workload", "unknown"),
    ("destination_principal", "unknown"),
    ("response_flags", "-"),
];

/// b1 to team-a's Service `web`, whose Pod web-1 is on this node.
const B1_TO_WEB: &[(&str, &str)] = &[
    ("source_workload", "b1"),
    ("destination_service", "web.team-a.svc.cluster.local"),
    ("destination_service_name", "web"),
    ("destination_service_namespace", "team-a"),
    ("destination_workload", "web-1"),
    ("destination_workload_namespace", "team-a"),
    ("destination_canonical_service", "web"),
    ("connection_security_policy", "unknown"),
    ("response_flags", "-"),
];

/// Where Prometheus listens and scrapes, in the node's netns (see `telemetry.rs`).
const PROMETHEUS: &str = "127.0.0.1:19091";
const STATS: &str = "192.0.2.1:15020";

fn with(
    labels: &[(&'static str, &'static str)],
    more: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    labels.iter().chain(more).copied().collect()
}

/// How much each family moved for the series `labels` picks, between two readings.
fn moved_by(before: &Metrics, after: &Metrics, family: &str, labels: &[(&str, &str)]) -> f64 {
    after.sum_matching(family, labels) - before.sum_matching(family, labels)
}

/// Waits until the closes of `want` connections of `labels` are counted (the kernel's reach the
/// agent within a collection tick), and returns the metrics then.
fn closed(w: &World, before: &Metrics, labels: &[(&str, &str)], want: f64) -> Result<Metrics> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    loop {
        let now = w.agent.metrics()?;
        let got = moved_by(before, &now, CLOSED, labels);
        if got >= want || Instant::now() > deadline {
            return Ok(now);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `EACH` connections of one kind moved their series by exactly `EACH` opened and closed, and by
/// the bytes curl moved each way.
fn check_counted(
    before: &Metrics,
    after: &Metrics,
    labels: &[(&str, &str)],
    moved: &[Moved],
) -> Result<()> {
    let n = EACH as f64;
    let opened = moved_by(before, after, OPENED, labels);
    let closed = moved_by(before, after, CLOSED, labels);
    ensure!(
        opened == n && closed == n,
        "opened {opened}, closed {closed} for {labels:?}"
    );
    let sent: u64 = moved.iter().map(|m| m.sent).sum();
    let received: u64 = moved.iter().map(|m| m.received).sum();
    let from_client = moved_by(before, after, FROM_CLIENT, labels);
    let to_client = moved_by(before, after, TO_CLIENT, labels);
    ensure!(
        from_client == sent as f64 && to_client == received as f64,
        "counted {from_client} from the client and {to_client} to it; curl sent {sent} and received {received}: {labels:?}"
    );
    Ok(())
}

/// Every series of `family` that `labels` picks carries exactly these labels' values.
fn one_series(
    metrics: &Metrics,
    family: &str,
    labels: &[(&str, &str)],
) -> Result<BTreeMap<String, String>> {
    let series: Vec<_> = metrics.matching(family, labels).collect();
    ensure!(
        series.len() == 1,
        "{} series of {family} for {labels:?}: {series:?}",
        series.len()
    );
    let (held, _) = series.into_iter().next().unwrap_or_default();
    ensure!(held.len() == 27, "{} labels: {held:?}", held.len());
    ensure!(
        held.values().all(|v| !v.is_empty()),
        "an empty label: {held:?}"
    );
    Ok(held)
}

/// `EACH` curls from `namespace`'s client to `url`, spread over a few seconds so that a scrape a
/// second sees their series grow (a rate needs two samples of it).
fn spread(w: &World, namespace: &str, url: &str) -> Result<Vec<Moved>> {
    let mut moved = Vec::with_capacity(EACH);
    for _ in 0..5 {
        moved.extend(curls_moved(w.client(namespace), url, EACH / 5)?);
        std::thread::sleep(Duration::from_millis(600));
    }
    Ok(moved)
}

/// a1 to its entry, b1 out past it, b1 to web, and a1 to a port that refuses: what each moved.
fn traffic(w: &World) -> Result<(Metrics, [Vec<Moved>; 3])> {
    let before = w.agent.metrics()?;
    let entry = spread(w, "team-a", "http://api.example.com/")?;
    let out = spread(w, "team-b", "http://api.example.com/")?;
    let web = spread(w, "team-b", "http://web.team-a.svc.cluster.local/")?;
    for _ in 0..EACH {
        let refused = w
            .client("team-a")
            .cmd("curl")
            .args(["-sS", "--max-time", "5", "http://closed.example.com/"])
            .output()?;
        ensure!(!refused.success(), "closed.example.com answered");
    }
    Ok((before, [entry, out, web]))
}

/// The four kinds' series, checked against what curl did.
fn check_kinds(
    w: &World,
    before: &Metrics,
    [entry, out, web]: &[Vec<Moved>; 3],
) -> Result<Metrics> {
    let n = EACH as f64;
    closed(w, before, B1_TO_WEB, 2.0 * n)?;
    let after = closed(w, before, A1_TO_ENTRY, n)?;
    check_counted(before, &after, A1_TO_ENTRY, entry)?;
    check_counted(before, &after, B1_PASSTHROUGH, out)?;
    // Delivered to a Pod of this node: reported by both ends, with the same labels.
    for reporter in ["source", "destination"] {
        check_counted(
            before,
            &after,
            &with(B1_TO_WEB, &[("reporter", reporter)]),
            web,
        )?;
    }
    let held = one_series(
        &after,
        OPENED,
        &with(B1_TO_WEB, &[("reporter", "destination")]),
    )?;
    ensure!(
        held["destination_principal"].ends_with("/ns/team-a/sa/default")
            && held["destination_principal"].starts_with("spiffe://"),
        "{held:?}"
    );
    one_series(&after, OPENED, A1_TO_ENTRY)?;
    // A refused port: opened, then closed failed with CONNECT (no bytes).
    let refused: &[(&str, &str)] = &[
        ("source_workload", "curl-client"),
        ("destination_service", "closed.example.com"),
        ("response_flags", "CONNECT"),
    ];
    let after = closed(w, before, refused, n)?;
    let failed = moved_by(before, &after, FAILED, refused);
    let closed_failed = moved_by(before, &after, CLOSED, refused);
    ensure!(
        failed == n && closed_failed == n,
        "failed {failed}, closed {closed_failed}"
    );
    Ok(after)
}

#[test]
fn connections_the_kernel_decides_move_istios_series_by_exactly_what_curl_did() -> Result<()> {
    let w = World::start_with(deployment_a1)?;
    let prometheus = Prometheus::start(
        w.topo.node(),
        PROMETHEUS.parse()?,
        &w.topo.scratch_path("prometheus"),
        &[STATS.parse()?],
        "/stats/prometheus",
    )?;
    // Scraping before the traffic starts: every series is seen as it grows.
    prometheus.query_until("up", Duration::from_secs(20), |s| {
        s.first().is_some_and(|s| s.value == 1.0)
    })?;
    let (before, moved) = traffic(&w)?;
    check_kinds(&w, &before, &moved)?;
    let after = w.agent.metrics()?;
    // The kernel decided them: the agent's own counters say so.
    ensure!(
        after.sum("redirect_fast_path_connections_total")
            >= before.sum("redirect_fast_path_connections_total") + 3.0 * EACH as f64,
        "the kernel did not decide these connections"
    );
    kiali_sees_the_edges(&prometheus)?;
    the_workload_dashboard_sees_a1(&w, &prometheus)
}

#[test]
fn connections_the_proxy_carries_count_with_the_same_labels() -> Result<()> {
    let w = World::start_with_launched(deployment_a1, &Launch::no_fast_path())?;
    let (before, moved) = traffic(&w)?;
    let after = check_kinds(&w, &before, &moved)?;
    ensure!(
        after.sum("redirect_fast_path_connections_total") == 0.0,
        "without the fast path the kernel decides nothing"
    );
    Ok(())
}

/// The series of Kiali's graph (SPEC: namespace graph, TCP, `sent` rate) of `namespace`, outgoing
/// or incoming, once Prometheus has them.
fn kiali(prometheus: &Prometheus, namespace: &str, incoming: bool) -> Result<Vec<Sample>> {
    let by = "app,source_cluster,source_workload_namespace,source_workload,source_canonical_service,\
              source_canonical_revision,destination_cluster,destination_service_namespace,\
              destination_service,destination_service_name,destination_workload_namespace,\
              destination_workload,destination_canonical_service,destination_canonical_revision,\
              response_flags";
    let selector = match incoming {
        false => format!(r#"reporter=~"waypoint|source",source_workload_namespace="{namespace}""#),
        true => {
            format!(
                r#"reporter=~"waypoint|destination",destination_workload_namespace="{namespace}""#
            )
        }
    };
    let query = format!(
        "round(sum(rate(istio_tcp_received_bytes_total{{{selector}}} [600s])) by ({by}) > 0,0.001)"
    );
    let answer = prometheus.query_until(&query, Duration::from_secs(20), |s| !s.is_empty());
    answer.map_err(|e| {
        let up = prometheus.query("up");
        let held = prometheus.query("count(istio_tcp_received_bytes_total)");
        e.context(format!("up: {up:?}; series held: {held:?}"))
    })
}

fn edge<'a>(samples: &'a [Sample], source: &str, destination: (&str, &str)) -> Option<&'a Sample> {
    samples.iter().find(|s| {
        let l = |k: &str| s.labels.get(k).map(String::as_str);
        l("source_workload") == Some(source)
            && l("destination_service") == Some(destination.0)
            && l("destination_workload") == Some(destination.1)
    })
}

/// Kiali's team-a graph: the edge a1's Deployment → api.example.com going out, b1 → web coming
/// in; team-b's: b1 → the unknown outside and → web.
fn kiali_sees_the_edges(prometheus: &Prometheus) -> Result<()> {
    let out = kiali(prometheus, "team-a", false)?;
    let a1 = edge(&out, "curl-client", ("api.example.com", "api-example"));
    ensure!(
        a1.is_some_and(|s| s.value > 0.0),
        "no edge curl-client → api.example.com: {out:?}"
    );
    let inbound = kiali(prometheus, "team-a", true)?;
    let web = edge(&inbound, "b1", ("web.team-a.svc.cluster.local", "web-1"));
    ensure!(
        web.is_some_and(|s| s.value > 0.0),
        "no edge b1 → web: {inbound:?}"
    );
    let b = kiali(prometheus, "team-b", false)?;
    ensure!(
        edge(&b, "b1", ("unknown", "unknown")).is_some(),
        "no edge b1 → unknown: {b:?}"
    );
    ensure!(
        edge(&b, "b1", ("web.team-a.svc.cluster.local", "web-1")).is_some(),
        "no edge b1 → web: {b:?}"
    );
    Ok(())
}

/// Istio's workload dashboard for team-a/curl-client while it sends: its TCP panels' queries
/// (irate needs traffic in its last two scrapes) answer non-zero, the plain-TCP panel by service.
fn the_workload_dashboard_sees_a1(w: &World, prometheus: &Prometheus) -> Result<()> {
    let sending = w
        .client("team-a")
        .cmd("sh")
        .args(["-c", "while true; do curl -s -o /dev/null --max-time 2 http://api.example.com/; sleep 0.05; done"])
        .spawn()?;
    let who = r#"source_workload_namespace=~"team-a", source_workload=~"curl-client""#;
    let client_traffic = format!(
        r#"sum(irate(istio_tcp_sent_bytes_total{{reporter=~"source|destination", {who}}}[1m])) + sum(irate(istio_tcp_received_bytes_total{{reporter=~"source|destination", {who}}}[1m]))"#
    );
    let answer = prometheus.query_until(&client_traffic, Duration::from_secs(20), |s| {
        s.first().is_some_and(|s| s.value > 0.0)
    });
    let outgoing = format!(
        r#"round(sum(irate(istio_tcp_received_bytes_total{{connection_security_policy!="mutual_tls", reporter="source", {who}, destination_service=~".*"}}[1m])) by (destination_service), 0.001)"#
    );
    let by_service = prometheus.query_until(&outgoing, Duration::from_secs(20), |s| {
        s.iter().any(|s| {
            s.labels.get("destination_service").map(String::as_str) == Some("api.example.com")
                && s.value > 0.0
        })
    });
    drop(sending);
    ensure!(answer.is_ok(), "TCP Client Traffic: {answer:?}");
    ensure!(
        by_service.is_ok(),
        "Bytes Sent on Outgoing TCP Connection: {by_service:?}"
    );
    Ok(())
}
