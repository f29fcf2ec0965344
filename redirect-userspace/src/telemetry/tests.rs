//! Istio's labels as ztunnel fills them, for the workloads and services of a small node.
use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use prometheus_client::registry::Registry;

use super::*;
use crate::{config::load_sources, live::LiveState, state::Snapshot};

const NODE: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: curl-client-7d9f8b6c5-x2k4p
  generateName: curl-client-7d9f8b6c5-
  namespace: team-a
  labels:
    app: client
    pod-template-hash: 7d9f8b6c5
    service.istio.io/canonical-name: curl
    service.istio.io/canonical-revision: v1
  ownerReferences:
  - {apiVersion: apps/v1, kind: ReplicaSet, name: curl-client-7d9f8b6c5, uid: 8f0c1d2e-0000-4000-8000-000000000001, controller: true}
spec: {serviceAccountName: sleep}
status: {podIP: 10.244.1.10}
---
apiVersion: v1
kind: Pod
metadata: {name: bare, namespace: team-b}
status: {podIP: 10.244.1.11}
---
apiVersion: v1
kind: Pod
metadata:
  name: web-0
  generateName: web-
  namespace: team-b
  labels: {app: web, version: v2}
  ownerReferences:
  - {apiVersion: apps/v1, kind: StatefulSet, name: web, uid: 8f0c1d2e-0000-4000-8000-000000000002, controller: true}
status: {podIP: 10.244.1.12}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-b}
spec:
  clusterIP: 10.96.0.20
  selector: {app: web}
  ports: [{port: 80}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api-example, namespace: team-a}
spec:
  hosts: [api.example.com, api2.example.com]
  addresses: [240.240.0.1]
  ports: [{number: 80, name: http, protocol: HTTP}]
  resolution: STATIC
  endpoints: [{address: 10.0.0.50}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: anything, namespace: team-a}
spec:
  hosts: [any.example.com]
  addresses: [240.240.0.9]
  ports: [{number: 80, name: http, protocol: HTTP}]
  resolution: NONE
"#;

fn snapshot(yaml: &str) -> Snapshot {
    match load_sources([("node.yaml", yaml)]) {
        Ok(model) => Snapshot::from_model(&model),
        Err(e) => panic!("refused:\n{e}"),
    }
}

fn metrics_and_state() -> (Arc<IstioMetrics>, Arc<LiveState>) {
    let live = LiveState::new(None);
    live.apply(snapshot(NODE), Vec::new(), Vec::new());
    (
        Arc::new(IstioMetrics::new(live.clone(), "Kubernetes")),
        live,
    )
}

fn metrics() -> Arc<IstioMetrics> {
    metrics_and_state().0
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Each series of `family` as its labels, with its value.
fn series(metrics: &Arc<IstioMetrics>, family: &str) -> Vec<(BTreeMap<String, String>, u64)> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(metrics.clone()));
    let text = crate::metrics::encode(&registry).unwrap();
    let prefix = format!("{family}{{");
    text.lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str()))
        .map(|rest| {
            let (labels, value) = rest.rsplit_once("} ").unwrap();
            let labels = labels
                .split("\",")
                .map(|pair| {
                    let (k, v) = pair.split_once("=\"").unwrap();
                    (k.to_string(), v.trim_end_matches('"').to_string())
                })
                .collect();
            (labels, value.parse().unwrap())
        })
        .collect()
}

fn seen(client: Client, service: Option<&str>, addressed: &str, destination: &str) -> Seen {
    Seen {
        reporter: Reporter::Source,
        client,
        service: service.map(Arc::from),
        addressed: Some(ip(addressed)),
        destination: Some(ip(destination)),
        port: None,
        waypoint: None,
        mutual_tls: None,
        flags: Flags::None,
    }
}

const OPENED: Counts = Counts {
    opened: 1,
    closed: 0,
    from_client: 0,
    to_client: 0,
};

const CLOSED: Counts = Counts {
    opened: 0,
    closed: 1,
    from_client: 100,
    to_client: 2000,
};

/// The value of each series of `family` by its reporter.
fn by_reporter(m: &Arc<IstioMetrics>, family: &str) -> BTreeMap<String, u64> {
    series(m, family)
        .into_iter()
        .map(|(labels, n)| (label(&labels, "reporter").to_string(), n))
        .collect()
}

fn label<'a>(labels: &'a BTreeMap<String, String>, name: &str) -> &'a str {
    labels.get(name).map(String::as_str).unwrap_or("<absent>")
}

#[test]
fn a_deployments_pod_to_a_service_entry_is_labelled_as_upstream_labels_it() {
    let m = metrics();
    let client = Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p"));
    let s = seen(
        client,
        Some("team-a/api-example"),
        "240.240.0.1",
        "10.0.0.50",
    );
    m.count([(s.clone(), OPENED), (s, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    assert_eq!(opened.len(), 1, "{opened:?}");
    let (labels, n) = &opened[0];
    assert_eq!(*n, 2);
    assert_eq!(labels.len(), labels::NAMES.len());
    for (name, value) in [
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
        ("destination_canonical_revision", "latest"),
        (
            "destination_principal",
            "spiffe://cluster.local/ns/team-a/sa/default",
        ),
        ("request_protocol", "tcp"),
        ("response_flags", "-"),
        ("connection_security_policy", "unknown"),
        ("source_zone", "unknown"),
    ] {
        assert_eq!(label(labels, name), value, "{name}");
    }
}

#[test]
fn a_bare_pod_to_a_service_of_this_node_is_reported_by_both_ends_once_delivered() {
    let m = metrics();
    let s = seen(
        Client::At(ip("10.244.1.11")),
        Some("team-b/web"),
        "10.96.0.20",
        "10.244.1.12",
    );
    m.count([(s.clone(), OPENED)]);
    // The destination's side is known to have reached the Pod only once it ended.
    let opened = by_reporter(&m, "istio_tcp_connections_opened_total");
    assert_eq!(
        opened,
        BTreeMap::from([("source".into(), 1), ("destination".into(), 0)])
    );
    m.count([(s, CLOSED)]);
    for family in [
        "istio_tcp_connections_opened_total",
        "istio_tcp_connections_closed_total",
    ] {
        let counted = by_reporter(&m, family);
        assert_eq!(
            counted,
            BTreeMap::from([("source".into(), 1), ("destination".into(), 1)])
        );
    }
    let received = by_reporter(&m, "istio_tcp_received_bytes_total");
    assert_eq!(received["destination"], 100);
    for (labels, _) in series(&m, "istio_tcp_connections_opened_total") {
        assert_eq!(label(&labels, "source_workload"), "bare");
        assert_eq!(label(&labels, "source_canonical_service"), "bare");
        assert_eq!(label(&labels, "source_canonical_revision"), "latest");
        assert_eq!(
            label(&labels, "destination_service"),
            "web.team-b.svc.cluster.local"
        );
        assert_eq!(label(&labels, "destination_workload"), "web");
        assert_eq!(label(&labels, "destination_canonical_service"), "web");
        assert_eq!(label(&labels, "destination_version"), "v2");
        assert_eq!(
            label(&labels, "destination_principal"),
            "spiffe://cluster.local/ns/team-b/sa/default"
        );
    }
}

#[test]
fn a_refusal_by_policy_is_connect_to_the_client_and_deny_at_the_destination() {
    let m = metrics();
    let mut s = seen(
        Client::At(ip("10.244.1.11")),
        None,
        "10.244.1.12",
        "10.244.1.12",
    );
    s.flags = Flags::Deny;
    let refused = Counts {
        opened: 1,
        closed: 1,
        ..Counts::default()
    };
    m.count([(s.clone(), refused)]);
    let flags: BTreeMap<String, String> = series(&m, "istio_tcp_connections_failed_total")
        .into_iter()
        .map(|(l, _)| {
            (
                label(&l, "reporter").into(),
                label(&l, "response_flags").into(),
            )
        })
        .collect();
    assert_eq!(
        flags,
        BTreeMap::from([
            ("source".into(), "CONNECT".into()),
            ("destination".into(), "DENY".into())
        ])
    );
    // A port that refuses: the destination never had the connection.
    let m = metrics();
    s.flags = Flags::Connect;
    m.count([
        (s.clone(), OPENED),
        (
            s,
            Counts {
                opened: 0,
                ..refused
            },
        ),
    ]);
    let opened = by_reporter(&m, "istio_tcp_connections_opened_total");
    assert_eq!(
        opened,
        BTreeMap::from([("source".into(), 1), ("destination".into(), 0)])
    );
}

#[test]
fn a_close_counts_where_its_open_did_when_its_pods_left_since() {
    let (m, live) = metrics_and_state();
    let client = Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p"));
    let s = seen(
        client,
        Some("team-a/api-example"),
        "240.240.0.1",
        "10.0.0.50",
    );
    m.count([(s.clone(), OPENED)]);
    // The Pod is gone (a rollout), its connection still open.
    let without = NODE.replacen(
        "curl-client-7d9f8b6c5-x2k4p",
        "curl-client-7d9f8b6c5-zzzzz",
        1,
    );
    live.apply(snapshot(&without), Vec::new(), Vec::new());
    m.count([(s.clone(), CLOSED)]);
    let closed = series(&m, "istio_tcp_connections_closed_total");
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(label(&closed[0].0, "source_workload"), "curl-client");
    assert_eq!(closed[0].1, 1);
    // A new connection of that kind takes the labels in force: the Pod is known by name only.
    m.count([(s, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    let workloads: Vec<&str> = opened
        .iter()
        .map(|(l, _)| label(l, "source_workload"))
        .collect();
    assert_eq!(workloads, ["curl-client", "curl-client-7d9f8b6c5-x2k4p"]);
}

#[test]
fn a_stream_received_names_the_service_of_the_pod_and_port_it_reached() {
    let m = metrics();
    let mut s = seen(
        Client::At(ip("10.244.2.10")),
        None,
        "10.244.1.12",
        "10.244.1.12",
    );
    s.reporter = Reporter::Destination;
    s.addressed = None;
    s.port = Some(80);
    s.mutual_tls = Some(Arc::from("spiffe://cluster.local/ns/team-c/sa/default"));
    m.count([(s.clone(), OPENED)]);
    s.port = Some(81);
    m.count([(s, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    let services: Vec<&str> = opened
        .iter()
        .map(|(l, _)| label(l, "destination_service"))
        .collect();
    assert_eq!(services, ["web.team-b.svc.cluster.local", "unknown"]);
}

#[test]
fn passthrough_and_resolution_none_name_no_service_nor_workload() {
    let m = metrics();
    let client = || Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p"));
    let outside = seen(client(), None, "192.0.2.7", "192.0.2.7");
    let none = seen(
        client(),
        Some("team-a/anything"),
        "240.240.0.9",
        "192.0.2.9",
    );
    m.count([(outside, OPENED), (none, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    // Both are one series: nothing tells them apart.
    assert_eq!(opened.len(), 1, "{opened:?}");
    let (labels, n) = &opened[0];
    assert_eq!(*n, 2);
    for name in [
        "destination_service",
        "destination_service_name",
        "destination_service_namespace",
        "destination_workload",
        "destination_workload_namespace",
        "destination_principal",
        "destination_cluster",
    ] {
        assert_eq!(label(labels, name), "unknown", "{name}");
    }
    assert_eq!(label(labels, "source_workload"), "curl-client");
}

#[test]
fn the_host_addressed_names_the_service_of_an_entry_of_several() {
    let m = metrics();
    let client = Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p"));
    // Both hosts share the entry's address: the first is named, as for any address they share.
    let s = seen(
        client,
        Some("team-a/api-example"),
        "240.240.0.1",
        "10.0.0.50",
    );
    m.count([(s, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    assert_eq!(
        label(&opened[0].0, "destination_service"),
        "api.example.com"
    );
}

#[test]
fn failures_count_as_failed_with_their_flags_and_hbone_is_mutual_tls() {
    let m = metrics();
    let mut s = seen(
        Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p")),
        None,
        "10.244.9.9",
        "10.244.9.9",
    );
    s.flags = Flags::Connect;
    s.mutual_tls = Some(Arc::from("spiffe://cluster.local/ns/team-a/sa/sleep"));
    let failed = Counts {
        opened: 1,
        closed: 1,
        ..Counts::default()
    };
    m.count([(s, failed)]);
    let rows = series(&m, "istio_tcp_connections_failed_total");
    assert_eq!(rows.len(), 1);
    let (labels, n) = &rows[0];
    assert_eq!(*n, 1);
    assert_eq!(label(labels, "response_flags"), "CONNECT");
    assert_eq!(label(labels, "connection_security_policy"), "mutual_tls");
    assert_eq!(
        label(labels, "source_principal"),
        "spiffe://cluster.local/ns/team-a/sa/sleep"
    );
    let closed = series(&m, "istio_tcp_connections_closed_total");
    assert_eq!(closed[0].1, 1);
}

#[test]
fn label_sets_past_the_bound_are_counted_apart() {
    let m = metrics();
    let client = || Client::Named(Arc::from("team-a/curl-client-7d9f8b6c5-x2k4p"));
    // Each unknown client Pod name is a label set of its own.
    let many = (0..MAX_ISTIO_SERIES + 5).map(|i| {
        let name = format!("team-a/gone-{i}");
        (
            seen(Client::Named(name.into()), None, "192.0.2.1", "192.0.2.1"),
            OPENED,
        )
    });
    m.count(many);
    m.count([(seen(client(), None, "192.0.2.1", "192.0.2.1"), OPENED)]);
    assert_eq!(m.series(), (MAX_ISTIO_SERIES, 6));
}
