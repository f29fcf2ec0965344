//! The store: last good versions, relists served whole, changes classified.
use serde_json::{Value, json};

use super::*;
use crate::cluster::kinds::convert;
use crate::config::PodRef;

const NOW: &str = "2026-01-01T00:00:00Z";

fn entry(name: &str, address: &str) -> (Key, Box<Converted>) {
    let object = json!({
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"hosts": [format!("{name}.example.com")], "addresses": [address]}
    });
    upsert(Kind::ServiceEntry, object)
}

fn upsert(kind: Kind, object: Value) -> (Key, Box<Converted>) {
    let key = (
        object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        object["metadata"]["name"].as_str().unwrap().to_string(),
    );
    (
        key,
        Box::new(convert(kind, "networking.istio.io/v1", object)),
    )
}

/// A store whose every watch has listed nothing.
fn listed() -> Store {
    let mut store = Store::default();
    for kind in Kind::ALL {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    store
}

fn hosts(store: &Store) -> Vec<String> {
    store
        .model()
        .0
        .service_entries
        .iter()
        .map(|s| s.hosts[0].to_string())
        .collect()
}

#[test]
fn ready_only_once_every_watch_has_listed_or_is_not_installed() {
    let mut store = Store::default();
    assert!(!store.ready());
    for kind in Kind::ALL {
        assert!(!store.ready(), "{kind:?}");
        if kind == Kind::ServiceEntry {
            assert!(store.apply(Change::NotInstalled(kind), NOW));
        } else {
            store.apply(Change::Relist(kind), NOW);
            store.apply(Change::Listed(kind), NOW);
        }
    }
    assert!(store.ready());
    let se = &store.statuses()[3];
    assert_eq!(
        (se.kind, se.installed, se.synced),
        ("ServiceEntry", false, true)
    );
}

#[test]
fn a_relist_is_served_only_once_complete_and_then_replaces_everything() {
    let mut store = listed();
    let (key, a) = entry("a", "203.0.113.1");
    assert!(store.apply(Change::Upsert(Kind::ServiceEntry, key, a), NOW));
    // The watch expired: a new list comes, without `a`, with `b`.
    store.apply(Change::Relist(Kind::ServiceEntry), NOW);
    let (key, b) = entry("b", "203.0.113.2");
    assert!(!store.apply(Change::Upsert(Kind::ServiceEntry, key, b), NOW));
    assert_eq!(hosts(&store), ["a.example.com"], "served until complete");
    assert!(store.apply(Change::Listed(Kind::ServiceEntry), NOW));
    assert_eq!(hosts(&store), ["b.example.com"]);
    // The same list again changes nothing.
    store.apply(Change::Relist(Kind::ServiceEntry), NOW);
    let (key, b) = entry("b", "203.0.113.2");
    store.apply(Change::Upsert(Kind::ServiceEntry, key, b), NOW);
    assert!(!store.apply(Change::Listed(Kind::ServiceEntry), NOW));
}

#[test]
fn a_refused_update_keeps_the_last_good_version_and_reports_it() {
    let mut store = listed();
    let (key, good) = entry("a", "203.0.113.1");
    store.apply(Change::Upsert(Kind::ServiceEntry, key, good), NOW);
    let (key, bad) = entry("a", "203.0.113.0/33");
    assert!(bad.object.is_none());
    assert!(store.apply(Change::Upsert(Kind::ServiceEntry, key.clone(), bad), NOW));
    let (model, errors, rejected) = store.model();
    assert_eq!(model.service_entries.len(), 1);
    assert_eq!(
        model.service_entries[0].addresses[0].to_string(),
        "203.0.113.1"
    );
    assert_eq!(errors[0].field.as_deref(), Some("spec.addresses[0]"));
    assert_eq!(
        (rejected[0].kind, rejected[0].last_good_in_force),
        ("ServiceEntry", true)
    );
    // A new object that is invalid stays out; deleting the bad one clears its error.
    let (key2, bad2) = entry("c", "nope");
    store.apply(Change::Upsert(Kind::ServiceEntry, key2, bad2), NOW);
    let (model, _, rejected) = store.model();
    assert_eq!(model.service_entries.len(), 1);
    assert!(!rejected[1].last_good_in_force);
    assert!(store.apply(Change::Deleted(Kind::ServiceEntry, key), NOW));
    assert_eq!(store.model().2.len(), 1);
}

#[test]
fn a_change_the_model_does_not_read_changes_nothing() {
    let mut store = listed();
    let pod = |phase: &str| {
        json!({
            "metadata": {"name": "p", "namespace": "team-a", "resourceVersion": phase},
            "spec": {"nodeName": "n"},
            "status": {"podIP": "10.0.0.1", "phase": phase}
        })
    };
    let (key, p) = upsert(Kind::Pod, pod("Pending"));
    assert!(store.apply(Change::Upsert(Kind::Pod, key, p), NOW));
    let (key, p) = upsert(Kind::Pod, pod("Running"));
    assert!(!store.apply(Change::Upsert(Kind::Pod, key, p), NOW));
}

#[test]
fn a_pod_both_pod_watches_hold_for_a_moment_is_this_nodes() {
    let mut store = Store::new(&Kind::watched(true));
    for kind in Kind::watched(true) {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    let labels: Vec<&str> = store.statuses().iter().map(|s| s.kind).collect();
    assert!(labels.contains(&"Pod (other nodes)"), "{labels:?}");
    let pod = |node: &str| {
        json!({
            "metadata": {"name": "p", "namespace": "team-a", "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1"},
            "spec": {"nodeName": node},
            "status": {"podIP": "10.0.0.1"}
        })
    };
    let key: Key = ("team-a".into(), "p".into());
    let there = Box::new(convert(Kind::PodElsewhere, "v1", pod("node-2")));
    store.apply(Change::Upsert(Kind::PodElsewhere, key.clone(), there), NOW);
    let model = store.model().0;
    assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 1));
    let here = Box::new(convert(Kind::Pod, "v1", pod("node-1")));
    store.apply(Change::Upsert(Kind::Pod, key, here), NOW);
    let model = store.model().0;
    assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (1, 0));
    assert_eq!(model.workloads[0].node_name.as_deref(), Some("node-1"));
}

#[test]
fn a_pod_elsewhere_is_a_workload_only_while_a_selector_of_its_namespace_can_pick_it() {
    let mut store = Store::new(&Kind::watched(true));
    for kind in Kind::watched(true) {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    for (i, ns) in ["team-a", "team-a", "team-b"].iter().enumerate() {
        let pod = json!({
            "metadata": {"name": format!("web-{i}"), "namespace": ns, "labels": {"app": "web"}},
            "spec": {"nodeName": "node-2"},
            "status": {"podIP": format!("10.0.0.{i}")}
        });
        let key: Key = (ns.to_string(), format!("web-{i}"));
        let converted = Box::new(convert(Kind::PodElsewhere, "v1", pod));
        store.apply(Change::Upsert(Kind::PodElsewhere, key, converted), NOW);
    }
    let model = store.model().0;
    assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 3));
    // One copy of the label set for the three pods.
    let pods: Vec<PodRef> = model.pods_elsewhere.iter().collect();
    assert!(Arc::ptr_eq(pods[0].labels, pods[2].labels));
    // A Service with a selector in team-a, without slices: team-a's pods are workloads.
    let service = json!({
        "metadata": {"name": "web", "namespace": "team-a"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}
    });
    let key: Key = ("team-a".into(), "web".into());
    let converted = Box::new(convert(Kind::Service, "v1", service));
    assert!(converted.errors.is_empty(), "{:?}", converted.errors);
    store.apply(Change::Upsert(Kind::Service, key, converted), NOW);
    let model = store.model().0;
    let names: Vec<&str> = model
        .workloads
        .iter()
        .map(|w| w.meta.name.as_str())
        .collect();
    assert_eq!(names, ["web-0", "web-1"]);
    assert_eq!(model.pods_elsewhere.len(), 1);
    // Its EndpointSlice says its endpoints: the selector picks nothing any more.
    let slice = json!({
        "metadata": {"name": "web-x", "namespace": "team-a", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.0"]}], "ports": [{"port": 80}]
    });
    let key: Key = ("team-a".into(), "web-x".into());
    let converted = Box::new(convert(Kind::EndpointSlice, "discovery.k8s.io/v1", slice));
    assert!(converted.errors.is_empty(), "{:?}", converted.errors);
    store.apply(Change::Upsert(Kind::EndpointSlice, key, converted), NOW);
    let model = store.model().0;
    assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 3));
}

#[test]
fn a_pod_elsewhere_keeps_its_last_good_version_and_a_relist_replaces_them_whole() {
    let mut store = Store::new(&Kind::watched(true));
    for kind in Kind::watched(true) {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    let pod = |name: &str, ip: &str| {
        let object = json!({
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"nodeName": "node-2"},
            "status": {"podIP": ip}
        });
        let key: Key = ("team-a".into(), name.into());
        Change::Upsert(
            Kind::PodElsewhere,
            key,
            Box::new(convert(Kind::PodElsewhere, "v1", object)),
        )
    };
    let ips = |store: &Store| -> Vec<String> {
        let model = store.model().0;
        model
            .pods_elsewhere
            .iter()
            .map(|p| format!("{}={}", p.name, p.ips[0]))
            .collect()
    };
    assert!(store.apply(pod("a", "10.0.0.1"), NOW));
    assert!(!store.apply(pod("a", "10.0.0.1"), NOW), "the same again");
    // A refused update: the last good version stays, the error is reported.
    assert!(store.apply(pod("a", "10.999.0.1"), NOW));
    assert!(store.apply(pod("b", "nope"), NOW));
    assert_eq!(ips(&store), ["a=10.0.0.1"]);
    let (_, errors, rejected) = store.model();
    assert_eq!(errors.len(), 2);
    let kept: Vec<(&str, bool)> = rejected
        .iter()
        .map(|r| (r.name.as_str(), r.last_good_in_force))
        .collect();
    assert_eq!(kept, [("a", true), ("b", false)]);
    let objects = |store: &Store| {
        let statuses = store.statuses();
        statuses
            .iter()
            .find(|s| s.kind == "Pod (other nodes)")
            .unwrap()
            .objects
    };
    assert_eq!(objects(&store), 2);
    // A relist: served only once complete; `a` still refused keeps its last good version.
    store.apply(Change::Relist(Kind::PodElsewhere), NOW);
    assert!(!store.apply(pod("a", "10.999.0.1"), NOW));
    assert!(!store.apply(pod("c", "10.0.0.3"), NOW));
    assert_eq!(ips(&store), ["a=10.0.0.1"], "served until complete");
    assert!(store.apply(Change::Listed(Kind::PodElsewhere), NOW));
    assert_eq!(ips(&store), ["a=10.0.0.1", "c=10.0.0.3"]);
    assert_eq!(store.model().2.len(), 1, "b is gone, a still refused");
    // Fixed, then deleted.
    assert!(store.apply(pod("a", "10.0.0.9"), NOW));
    assert!(store.model().2.is_empty());
    let key: Key = ("team-a".into(), "a".into());
    assert!(store.apply(Change::Deleted(Kind::PodElsewhere, key), NOW));
    assert_eq!(ips(&store), ["c=10.0.0.3"]);
    assert_eq!(objects(&store), 1);
}

#[test]
fn failures_are_counted_and_a_good_list_clears_the_last_one() {
    let mut store = listed();
    store.apply(Change::Failed(Kind::Pod, "connection refused".into()), NOW);
    store.apply(Change::Failed(Kind::Pod, "connection refused".into()), NOW);
    let pod = store.statuses()[1].clone();
    assert_eq!(pod.kind, "Pod");
    assert_eq!(pod.errors, 2);
    assert_eq!(pod.last_error.as_deref(), Some("connection refused"));
    store.apply(Change::Relist(Kind::Pod), NOW);
    store.apply(Change::Listed(Kind::Pod), NOW);
    let pod = store.statuses()[1].clone();
    assert_eq!((pod.errors, pod.last_error), (2, None));
}
