//! Reading from the API as from a file: the fast reads of Pods and ServiceEntries against the
//! reference way, on fixed cases and on any JSON.
use std::sync::Arc;

use proptest::prelude::*;
use serde::{Deserialize, de::DeserializeSeed};
use serde_json::{Value as Json, json};

use super::*;

const SOURCE: &str = "kubernetes API";

/// What a Pod's JSON can hold where the model reads it: anything, small.
fn any_json() -> impl proptest::strategy::Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        any::<i64>().prop_map(Json::from),
        any::<u64>().prop_map(Json::from),
        (0u32..70_000).prop_map(Json::from),
        (-1e5f64..1e5).prop_map(Json::from),
        "[a-z0-9.:-]{0,10}".prop_map(Json::from),
        Just(json!("10.1.2.3")),
        Just(json!("2024-05-01T12:00:00Z")),
        Just(json!("3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1")),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Json::from),
            prop::collection::btree_map(
                "ip|name|ports|containerPort|containers|podIP|podIPs|nodeName|app",
                inner,
                0..3
            )
            .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

/// A Pod whose parts are each valid, missing or anything else.
fn any_pod() -> impl proptest::strategy::Strategy<Value = Json> {
    let or_any = |valid: Json| prop_oneof![3 => Just(Some(valid)), 1 => Just(None), 1 => any_json().prop_map(Some)];
    let port = (or_any(json!("http")), or_any(json!(8080))).prop_map(|(name, number)| {
        let mut port = serde_json::Map::new();
        port.extend(name.map(|n| ("name".to_string(), n)));
        port.extend(number.map(|n| ("containerPort".to_string(), n)));
        Json::Object(port)
    });
    let container = prop::collection::vec(prop_oneof![4 => port, 1 => any_json()], 0..3)
        .prop_map(|ports| json!({"name": "c", "ports": ports}));
    let containers = prop::collection::vec(prop_oneof![4 => container, 1 => any_json()], 0..3);
    (
        or_any(json!("web-1")),
        or_any(json!("team-a")),
        or_any(json!({"app": "web"})),
        or_any(json!("3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1")),
        or_any(json!("node-1")),
        prop_oneof![4 => containers.prop_map(|c| Some(Json::from(c))), 1 => any_json().prop_map(Some), 1 => Just(None)],
        or_any(json!("10.244.1.20")),
        or_any(json!([{"ip": "10.244.1.20"}, {"ip": "fd00::1"}])),
        or_any(json!("2024-05-01T12:00:00Z")),
    )
        .prop_map(|(name, ns, labels, uid, node, containers, ip, ips, created)| {
            let fields = |pairs: Vec<(&str, Option<Json>)>| {
                Json::Object(
                    pairs
                        .into_iter()
                        .filter_map(|(k, v)| Some((k.to_string(), v?)))
                        .collect(),
                )
            };
            let mut pod = fields(vec![
                (
                    "metadata",
                    Some(fields(vec![
                        ("name", name),
                        ("namespace", ns),
                        ("labels", labels),
                        ("uid", uid),
                        ("creationTimestamp", created),
                    ])),
                ),
                ("spec", Some(fields(vec![("nodeName", node), ("containers", containers)]))),
                ("status", Some(fields(vec![("podIP", ip), ("podIPs", ips)]))),
            ]);
            pod["apiVersion"] = json!("v1");
            pod["kind"] = json!("Pod");
            pod
        })
}

/// A Pod read the fast way is what its YAML gives: the same workload or the same errors.
fn pod_as_its_yaml(pod: &Json) -> Result<(), TestCaseError> {
    let yaml = read_api_object(SOURCE, pod);
    let Ok(checked) = check_api_pod(SOURCE, cut(pod, &POD), false) else {
        return Ok(());
    };
    match checked {
        Ok(workload) => {
            prop_assert!(yaml.errors.is_empty(), "{:?}", yaml.errors);
            prop_assert_eq!(&yaml.model.workloads, &vec![Arc::new(workload)]);
        }
        Err(errors) => {
            prop_assert!(!errors.is_empty());
            prop_assert_eq!(&errors, &yaml.errors);
            prop_assert!(yaml.model.workloads.is_empty());
        }
    }
    Ok(())
}

/// `object` as the watch reads it: cut down to `keep` as it is parsed, its `apiVersion` and
/// `kind` those the watch asked for.
fn cut(object: &Json, keep: &'static partial::Keep) -> Json {
    let mut cut = Reader(keep).deserialize(object).unwrap();
    if let Json::Object(map) = &mut cut {
        for field in ["apiVersion", "kind"] {
            map.extend(object.get(field).map(|v| (field.to_string(), v.clone())));
        }
    }
    cut
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]
    /// A Pod read from its JSON is what its YAML gives: the same workload or the same errors.
    #[test]
    fn a_pod_read_from_json_is_what_its_yaml_gives(pod in any_pod()) {
        pod_as_its_yaml(&pod)?;
    }

    /// Whatever a part of a Pod holds.
    #[test]
    fn any_part_of_a_pod_reads_as_its_yaml_does(
        part in 0..3usize, field in "[a-z]{0,3}|ip|ports|containers|podIPs", value in any_json()
    ) {
        let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "team-a"},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 80}]}]},
            "status": {"podIP": "10.0.0.1"}});
        let part = ["metadata", "spec", "status"][part];
        if field.is_empty() {
            pod[part] = value;
        } else {
            pod[part][field.as_str()] = value;
        }
        pod_as_its_yaml(&pod)?;
    }
}

fn api_entry() -> Json {
    json!({"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
        "metadata": {"name": "api", "namespace": "team-a", "labels": {"app": "api"},
                     "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                     "creationTimestamp": "2024-05-01T12:00:00Z"},
        "spec": {"hosts": ["api.example.com"], "addresses": ["203.0.113.10"],
                 "ports": [{"number": 443, "name": "https", "protocol": "TLS", "targetPort": 8443}],
                 "location": "MESH_EXTERNAL", "resolution": "STATIC", "exportTo": ["."],
                 "endpoints": [{"address": "198.51.100.1", "ports": {"https": 8443},
                                "labels": {"v": "1"}, "network": "n1"}]},
        "status": {"addresses": [{"value": "240.240.0.1", "host": "api.example.com"}]}})
}

/// An entry read from its JSON, when it is, is what its YAML gives: the same entry or the
/// same errors. `typed`: whether it was read from its JSON.
fn entry_as_its_yaml(entry: &Json) -> Result<bool, TestCaseError> {
    let yaml = read_api_object(SOURCE, entry);
    let Some(checked) = check_api_entry(SOURCE, &cut(entry, &ENTRY)) else {
        return Ok(false);
    };
    match checked {
        Ok(se) => {
            prop_assert!(yaml.errors.is_empty(), "{:?}", yaml.errors);
            prop_assert_eq!(yaml.model.service_entries, vec![Arc::new(se)]);
        }
        Err(errors) => {
            prop_assert!(!errors.is_empty());
            prop_assert_eq!(&errors, &yaml.errors);
            prop_assert!(yaml.model.service_entries.is_empty());
        }
    }
    Ok(true)
}

/// `entry` with the value at `pointer` set, its field added if missing.
fn set(entry: &mut Json, pointer: &str, value: Json) {
    let (parent, field) = pointer.rsplit_once('/').unwrap_or_default();
    match entry.pointer_mut(parent) {
        Some(Json::Object(map)) => {
            map.insert(field.to_string(), value);
        }
        Some(Json::Array(items)) => {
            items[field.parse::<usize>().unwrap()] = value;
        }
        _ => panic!("no {parent}"),
    }
}

#[test]
fn an_entry_read_from_json_is_what_its_yaml_gives() {
    let typed = [
        ("/spec/addresses/0", json!("203.0.113.0/33")),
        ("/spec/ports/0/number", json!(70000)),
        ("/spec/ports/0/number", json!(0)),
        ("/spec/hosts/0", json!("*")),
        ("/spec/hosts", json!([])),
        ("/spec/resolution", json!("SOMETIMES")),
        ("/spec/resolution", json!(2)),
        ("/spec/endpoints/0/address", json!("127.0.0.1")),
        ("/spec/endpoints/0/ports/https", json!(0)),
        ("/metadata/uid", json!("not-a-uid")),
        ("/metadata/name", json!("Api_1")),
        ("/status/addresses/0/value", json!("240.240.0.999")),
        ("/status/addresses/0/value", json!("8.8.8.8")),
        ("/status/addresses/0/host", json!(null)),
        ("/spec/location", json!(null)),
        ("/metadata/labels", json!(null)),
        ("/spec/workloadSelector", json!({"labels": {"app": "api"}})),
    ];
    let odd = [
        ("/metadata", json!(["api"])),
        ("/spec", json!([{"hosts": ["a.example.com"]}])),
        ("/status", json!([])),
        ("/spec/ports/0", json!([443, "https"])),
        ("/spec/endpoints/0", json!(["198.51.100.1"])),
        ("/spec/workloadSelector", json!([{"app": "api"}])),
        ("/status/addresses/0", json!(["240.240.0.1"])),
        ("/spec/ports/0/number", json!("443")),
        ("/spec/ports/0/number", json!(443.5)),
        ("/spec/hosts", json!("api.example.com")),
        ("/spec/hosts/0", json!(7)),
        ("/spec/hosts/0", json!(null)),
        ("/spec/ports/0", json!(null)),
        ("/metadata/name", json!(7)),
        ("/metadata/labels/app", json!(7)),
        ("/spec/resolution", json!(true)),
        ("/spec/endpoints/0/ports", json!([8443])),
    ];
    for (cases, want) in [(&typed[..], true), (&odd[..], false)] {
        for (pointer, value) in cases {
            let mut entry = api_entry();
            set(&mut entry, pointer, value.clone());
            let got = entry_as_its_yaml(&entry).unwrap();
            assert_eq!(got, want, "{pointer}: {value}");
        }
    }
    assert!(entry_as_its_yaml(&api_entry()).unwrap());
    let loaded = check_api_entry(SOURCE, &cut(&api_entry(), &ENTRY))
        .unwrap()
        .unwrap();
    assert_eq!(loaded.meta.name, "api");
    for part in ["metadata", "spec", "status"] {
        let mut entry = api_entry();
        entry.as_object_mut().unwrap().remove(part);
        assert!(entry_as_its_yaml(&entry).unwrap(), "without {part}");
    }
}

/// From the API as from a file: a `status.addresses` value outside Istio's ranges is refused
/// with its field named, and the entry is read (its status is the control plane's).
#[test]
fn a_refused_status_address_from_the_api_keeps_the_entry() {
    let mut entry = api_entry();
    entry["status"]["addresses"] = json!([
        {"value": "169.254.7.1", "host": "api.example.com"},
        {"value": "240.240.0.1", "host": "api.example.com"}
    ]);
    let se = check_api_entry(SOURCE, &cut(&entry, &ENTRY))
        .unwrap()
        .unwrap();
    let kept: Vec<String> = se
        .status_addresses
        .iter()
        .map(|a| a.ip.to_string())
        .collect();
    assert_eq!(kept, ["240.240.0.1"]);
    let [e] = se.refused_status.as_slice() else {
        panic!("{:?}", se.refused_status)
    };
    assert_eq!(e.file, SOURCE);
    assert_eq!(e.object.as_deref(), Some("ServiceEntry team-a/api"));
    assert_eq!(e.field.as_deref(), Some("status.addresses[0].value"));
    let yaml = read_api_object(SOURCE, &entry);
    assert!(
        yaml.errors.is_empty() && yaml.rejected.is_empty(),
        "{:?}",
        yaml.errors
    );
    assert_eq!(yaml.model.service_entries, vec![Arc::new(se)]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Whatever a part of an entry holds.
    #[test]
    fn any_part_of_an_entry_reads_as_its_yaml_does(
        place in 0..14usize, value in any_json()
    ) {
        const PLACES: [&str; 14] = ["/metadata", "/metadata/name", "/metadata/labels", "/spec",
            "/spec/hosts", "/spec/hosts/0", "/spec/ports", "/spec/ports/0", "/spec/ports/0/number",
            "/spec/endpoints/0", "/spec/endpoints/0/ports", "/spec/resolution", "/status/addresses",
            "/spec/workloadSelector"];
        let mut entry = api_entry();
        set(&mut entry, PLACES[place], value);
        entry_as_its_yaml(&entry)?;
    }
}

#[test]
fn a_plain_pod_is_read_without_yaml_and_an_odd_one_with_it() {
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-1", "namespace": "team-a"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 80}]}]},
        "status": {"podIP": "10.0.0.1"}});
    assert!(matches!(
        check_api_pod(SOURCE, cut(&pod, &POD), false),
        Ok(Ok(_))
    ));
    let mut odd = pod.clone();
    odd["spec"]["containers"][0]["ports"][0] = json!(["http", 80]);
    assert!(check_api_pod(SOURCE, cut(&odd, &POD), false).is_err());
    let mut odd = pod.clone();
    odd["status"]["podIP"] = json!(10);
    assert!(check_api_pod(SOURCE, cut(&odd, &POD), false).is_err());
    let loaded = read_api_object(SOURCE, &odd);
    assert_eq!(loaded.errors[0].field.as_deref(), Some("status.podIP"));
}

/// A Deployment's Pod, read either way and of this node or another, is named after the
/// Deployment for Istio's telemetry; a Pod with a name of its own keeps it whatever owns it.
#[test]
fn a_deployments_pod_is_named_after_its_deployment_either_way() {
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-7d9f8b6c5-x2k4p", "generateName": "web-7d9f8b6c5-",
            "namespace": "team-a", "labels": {"pod-template-hash": "7d9f8b6c5"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "u0"},
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8b6c5",
                 "uid": "u1", "controller": true, "blockOwnerDeletion": true}]},
        "status": {"podIP": "10.0.0.1"}});
    for elsewhere in [false, true] {
        let Ok(Ok(w)) = check_api_pod(SOURCE, cut(&pod, &POD), elsewhere) else {
            panic!("not read without YAML")
        };
        assert_eq!(w.workload_name(), "web");
        assert_eq!(
            crate::config::PodElsewhere::new(&w)
                .workload_name
                .as_deref(),
            Some("web")
        );
    }
    let yaml = read_api_object(SOURCE, &pod);
    assert_eq!(yaml.model.workloads[0].workload_name(), "web");
    let mut own = pod.clone();
    own["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("generateName");
    let Ok(Ok(w)) = check_api_pod(SOURCE, cut(&own, &POD), false) else {
        panic!("not read without YAML")
    };
    assert_eq!(w.workload_name(), "web-7d9f8b6c5-x2k4p");
}

/// Only what a kind's tree names is kept; a `*` keeps every other field, a list each item.
#[test]
fn only_what_the_tree_names_is_kept() {
    let entry = json!({"kind": "ServiceEntry",
        "metadata": {"name": "e", "managedFields": [{"manager": "x"}], "annotations": {"a": "b"}},
        "spec": {"hosts": ["e.example.com"], "ports": [{"number": 80, "x": 1}, [1]]},
        "status": {"addresses": [{"value": "240.240.0.1"}], "conditions": [{"type": "Ready"}]}});
    assert_eq!(
        cut(&entry, &ENTRY),
        json!({"kind": "ServiceEntry", "metadata": {"name": "e"},
            "spec": {"hosts": ["e.example.com"], "ports": [{"number": 80, "x": 1}, [1]]},
            "status": {"addresses": [{"value": "240.240.0.1"}]}})
    );
    assert!(
        !reads_as_its_yaml(&cut(&entry, &ENTRY), &ENTRY),
        "a list where a port goes"
    );
    assert_eq!(
        cut(&json!([{"a": 1}]), &POD),
        json!([{"a": 1}]),
        "read whole where not a part"
    );
    assert_eq!(cut(&json!("x"), &POD), json!("x"));
}

/// A field given twice is its last value, as JSON read whole has it.
#[test]
fn a_field_given_twice_is_its_last_value() {
    let text = r#"{"metadata": {"name": "a", "name": "b", "uid": 1}, "status": {"podIP": "x"}}"#;
    let cut: Json = serde_json::from_str::<CutPod>(text).unwrap().0;
    assert_eq!(
        cut,
        json!({"metadata": {"name": "b", "uid": 1}, "status": {"podIP": "x"}})
    );
}

struct CutPod(Json);

impl<'de> Deserialize<'de> for CutPod {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Reader(&POD).deserialize(d).map(CutPod)
    }
}
