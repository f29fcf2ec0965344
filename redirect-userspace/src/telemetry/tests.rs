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

fn metrics() -> Arc<IstioMetrics> {
    let model = match load_sources([("node.yaml", NODE)]) {
        Ok(model) => model,
        Err(e) => panic!("refused:\n{e}"),
    };
    let live = LiveState::new(None);
    live.apply(Snapshot::from_model(&model), Vec::new(), Vec::new());
    Arc::new(IstioMetrics::new(live, "Kubernetes"))
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
fn a_bare_pod_to_a_service_of_this_node_is_reported_by_both_ends() {
    let m = metrics();
    let s = seen(
        Client::At(ip("10.244.1.11")),
        Some("team-b/web"),
        "10.96.0.20",
        "10.244.1.12",
    );
    m.count([(s, OPENED)]);
    let opened = series(&m, "istio_tcp_connections_opened_total");
    let reporters: Vec<&str> = opened.iter().map(|(l, _)| label(l, "reporter")).collect();
    assert_eq!(reporters, ["source", "destination"]);
    for (labels, n) in &opened {
        assert_eq!(*n, 1);
        assert_eq!(label(labels, "source_workload"), "bare");
        assert_eq!(label(labels, "source_canonical_service"), "bare");
        assert_eq!(label(labels, "source_canonical_revision"), "latest");
        assert_eq!(
            label(labels, "destination_service"),
            "web.team-b.svc.cluster.local"
        );
        assert_eq!(label(labels, "destination_workload"), "web");
        assert_eq!(label(labels, "destination_canonical_service"), "web");
        assert_eq!(label(labels, "destination_version"), "v2");
        assert_eq!(
            label(labels, "destination_principal"),
            "spiffe://cluster.local/ns/team-b/sa/default"
        );
    }
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
