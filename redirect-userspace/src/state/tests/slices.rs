//! A Kubernetes Service's endpoints from its EndpointSlices (what the Kubernetes API gives), and
//! from its selector when no slice names it.
use std::sync::Arc;

use serde_json::{Value, json};

use super::*;
use crate::config::{EndpointSlice, read_api_object};

/// A Service `web` (port `http` 80 -> the pods' port `http`, and an unnamed 9000) with two pods.
const SERVICE: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: team-a, labels: {app: web}}
spec: {containers: [{ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.244.1.20}
---
apiVersion: v1
kind: Pod
metadata: {name: web-2, namespace: team-a, labels: {app: web}}
spec: {containers: [{ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.244.1.21}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-a}
spec: {clusterIP: 10.244.100.10, selector: {app: web}, ports: [{name: http, port: 80, targetPort: http}]}
---
apiVersion: v1
kind: Service
metadata: {name: manual, namespace: team-a}
spec: {clusterIP: 10.244.100.11, ports: [{port: 9000}]}
"#;

fn slice(name: &str, service: &str, endpoints: Value, ports: Value) -> Arc<EndpointSlice> {
    let object = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "team-a",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "endpoints": endpoints, "ports": ports
    });
    let loaded = read_api_object("kubernetes API", &object);
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    loaded.model.endpoint_slices[0].clone()
}

/// Every endpoint of `service`'s first port, `ip:port`.
fn endpoints(slices: Vec<Arc<EndpointSlice>>, service: &str) -> Vec<String> {
    let mut model = load_sources([("web.yaml", SERVICE)]).unwrap();
    model.endpoint_slices = slices;
    let snap = Snapshot::from_model(&model);
    let svc = snap.services().find(|s| s.name == service).unwrap();
    svc.ports[0]
        .endpoints
        .iter()
        .map(|e| e.target().to_string())
        .collect()
}

#[test]
fn a_services_endpoints_come_from_its_slices_when_any_names_it() {
    struct Case {
        name: &'static str,
        service: &'static str,
        slices: Vec<Arc<EndpointSlice>>,
        expect: &'static [&'static str],
    }
    let http = json!([{"name": "http", "port": 8081, "protocol": "TCP"}]);
    let cases = [
        Case {
            name: "no slice: the selector's pods, at their named port",
            service: "web",
            slices: vec![],
            expect: &["10.244.1.20:8080", "10.244.1.21:8080"],
        },
        Case {
            name: "a slice: its ready addresses at its port of the same name",
            service: "web",
            slices: vec![slice(
                "web-x",
                "web",
                json!([{"addresses": ["10.244.9.1"], "conditions": {"ready": true}},
                       {"addresses": ["10.244.9.2"], "conditions": {"ready": false}},
                       {"addresses": ["10.244.9.3"]}]),
                http.clone(),
            )],
            expect: &["10.244.9.1:8081", "10.244.9.3:8081"],
        },
        Case {
            name: "two slices add up, an address in both counts once",
            service: "web",
            slices: vec![
                slice(
                    "web-x",
                    "web",
                    json!([{"addresses": ["10.244.9.1"]}]),
                    http.clone(),
                ),
                slice(
                    "web-y",
                    "web",
                    json!([{"addresses": ["10.244.9.1"]}, {"addresses": ["10.244.9.4"]}]),
                    http.clone(),
                ),
            ],
            expect: &["10.244.9.1:8081", "10.244.9.4:8081"],
        },
        Case {
            name: "a slice without the port's name gives that port nothing",
            service: "web",
            slices: vec![slice(
                "web-x",
                "web",
                json!([{"addresses": ["10.244.9.1"]}]),
                json!([{"name": "metrics", "port": 9090}]),
            )],
            expect: &[],
        },
        Case {
            name: "only ready endpoints: a slice of none leaves none, not the selector's pods",
            service: "web",
            slices: vec![slice(
                "web-x",
                "web",
                json!([{"addresses": ["10.244.9.1"], "conditions": {"ready": false}}]),
                http.clone(),
            )],
            expect: &[],
        },
        Case {
            name: "another Service's slice changes nothing",
            service: "web",
            slices: vec![slice(
                "other-x",
                "other",
                json!([{"addresses": ["10.244.9.1"]}]),
                http.clone(),
            )],
            expect: &["10.244.1.20:8080", "10.244.1.21:8080"],
        },
        Case {
            name: "a Service without a selector: its unnamed port from the slice's unnamed port",
            service: "manual",
            slices: vec![slice(
                "manual-x",
                "manual",
                json!([{"addresses": ["192.0.2.7"]}]),
                json!([{"port": 9443}]),
            )],
            expect: &["192.0.2.7:9443"],
        },
    ];
    for case in cases {
        assert_eq!(
            endpoints(case.slices, case.service),
            case.expect,
            "{}",
            case.name
        );
    }
}

#[test]
fn a_slice_endpoint_names_its_pod() {
    let s = slice(
        "web-x",
        "web",
        json!([{"addresses": ["10.244.9.1"], "targetRef": {"kind": "Pod", "name": "web-9", "namespace": "team-a"}}]),
        json!([{"name": "http", "port": 8080}]),
    );
    let mut model = load_sources([("web.yaml", SERVICE)]).unwrap();
    model.endpoint_slices = vec![s];
    let snap = Snapshot::from_model(&model);
    let svc = snap.services().find(|s| s.name == "web").unwrap();
    assert_eq!(
        svc.ports[0].endpoints[0].workload.as_deref(),
        Some("team-a/web-9")
    );
}
