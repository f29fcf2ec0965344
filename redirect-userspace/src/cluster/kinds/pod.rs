//! A Pod read from the API's bytes straight to the fields the model reads ([`config::POD`]): the
//! rest (managed fields, annotations, container specs, most of the status: nearly all of a Pod's
//! bytes) is skipped as it is parsed, never held. At 100,000 Pods the first list is mostly this.
//!
//! What is kept is checked without YAML in between ([`config::check_api_pod`]) unless it might
//! read otherwise than its YAML does; then that Pod is read the loader's YAML way, which refuses
//! it with the field named exactly as it does a Pod read whole. One odd Pod never fails the page
//! it came in.
use std::sync::Arc;

use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, de::DeserializeSeed};
use serde_json::Value;

use super::{Converted, Kind, Object, SOURCE};
use crate::config::{self, POD, PodElsewhere, Reader};

/// A Pod as a watch reads it: the fields the model reads of a Pod of either watch (what
/// [`super::strip`] keeps for [`Kind::Pod`], which keeps more than for [`Kind::PodElsewhere`]),
/// and the `resourceVersion` the watch resumes from.
#[derive(Debug, Clone)]
pub(crate) struct ApiPod {
    /// Its name, namespace and `resourceVersion`: what kube's watcher reads of an object.
    meta: ObjectMeta,
    object: Value,
}

impl ApiPod {
    /// The Pod converted for `kind`, as [`super::convert`] converts the whole object.
    pub(crate) fn convert(self, kind: Kind, api_version: &str) -> Converted {
        let checked = match api_version {
            "v1" => config::check_api_pod(SOURCE, self.object, kind == Kind::PodElsewhere),
            _ => Err(self.object),
        };
        let (object, errors) = match checked {
            Ok(Ok(pod)) if kind == Kind::PodElsewhere => (
                Some(Object::PodElsewhere(Arc::new(PodElsewhere::new(&pod)))),
                Vec::new(),
            ),
            Ok(Ok(pod)) => (Some(Object::Workload(Arc::new(pod))), Vec::new()),
            Ok(Err(errors)) => (None, errors),
            Err(json) => return super::convert(kind, api_version, json),
        };
        Converted {
            object,
            errors,
            observed: None,
        }
    }
}

impl<'de> Deserialize<'de> for ApiPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut object = Reader(&POD).deserialize(deserializer)?;
        let meta = watch_meta(&mut object);
        Ok(ApiPod { meta, object })
    }
}

/// What kube's watcher reads of an object cut down as it was parsed (name, namespace,
/// `resourceVersion`), its creation time set to the second on the way.
pub(super) fn watch_meta(object: &mut Value) -> ObjectMeta {
    let Some(Value::Object(meta)) = object.get_mut("metadata") else {
        return ObjectMeta::default();
    };
    if let Some(Value::String(text)) = meta.get_mut("creationTimestamp") {
        whole_seconds(text);
    }
    let text = |field: &str| meta.get(field).and_then(Value::as_str).map(String::from);
    ObjectMeta {
        name: text("name"),
        namespace: text("namespace"),
        resource_version: text("resourceVersion"),
        ..ObjectMeta::default()
    }
}

/// The creation time to the second, as the model has always had it from the API (k8s-openapi's
/// `Time` writes whole seconds); the API server writes no fraction anyway. One it cannot read is
/// left as it is, for the loader to name.
fn whole_seconds(text: &mut String) {
    if text.contains('.')
        && let Ok(time) = text.parse::<crate::config::Timestamp>()
    {
        *text = time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    }
}

super::api_resource!(ApiPod);

#[cfg(test)]
mod tests {
    use kube::{Resource, api::DynamicObject, core::ObjectList};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;
    use crate::cluster::{kinds::strip, watch::as_json};

    /// A Pod as the API serves it, with the fields nothing reads.
    fn pod() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "web-1", "namespace": "team-a", "resourceVersion": "42",
                "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                "creationTimestamp": "2024-05-01T12:00:00Z",
                "labels": {"app": "web", "pod-template-hash": "7d9f8b6c5"},
                "annotations": {"prometheus.io/scrape": "true"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web",
                                     "uid": "00000003-0000-4000-8000-000000000001", "controller": true}],
                "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                                   "time": "2024-05-01T12:00:05Z", "fieldsType": "FieldsV1",
                                   "fieldsV1": {"f:status": {"f:podIP": {}}}}]
            },
            "spec": {
                "nodeName": "node-1", "serviceAccountName": "default",
                "containers": [
                    {"name": "web", "image": "nginx", "env": [{"name": "A", "value": "B"}],
                     "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                               {"name": "metrics", "containerPort": 9090}]},
                    {"name": "sidecar", "ports": [{"containerPort": 15090}]}
                ],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {
                "phase": "Running", "hostIP": "192.0.2.10", "podIP": "10.244.1.20",
                "podIPs": [{"ip": "10.244.1.20"}, {"ip": "fd00::20"}],
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        })
    }

    /// What the watch gave before Pods were read slim: the object whole, then cut down. `None`
    /// where that failed the whole page (metadata kube could not read).
    fn read_whole(kind: Kind, text: &str) -> Option<Converted> {
        let object: DynamicObject = serde_json::from_str(text).ok()?;
        let json = as_json(kind, object, false).ok()?;
        Some(super::super::convert(kind, "v1", json))
    }

    fn read_slim(kind: Kind, text: &str) -> Converted {
        let pod: ApiPod = serde_json::from_str(text).expect("any JSON reads as a Pod");
        pod.convert(kind, "v1")
    }

    /// Both ways give the same object and the same errors, for both Pod watches.
    fn same_either_way(text: &str) -> Result<(), TestCaseError> {
        for kind in [Kind::Pod, Kind::PodElsewhere] {
            let slim = read_slim(kind, text);
            let Some(whole) = read_whole(kind, text) else {
                continue;
            };
            prop_assert_eq!(&slim.object, &whole.object, "{:?} {}", kind, text);
            prop_assert_eq!(&slim.errors, &whole.errors, "{:?} {}", kind, text);
            prop_assert!(slim.observed.is_none());
        }
        Ok(())
    }

    /// The typed read gives what the same Pod's JSON gives through the loader's YAML way, for
    /// both watches; `typed`: whether it was read typed (else it went the YAML way itself).
    fn typed_as_its_json(text: &str, typed: bool) -> Result<(), TestCaseError> {
        for kind in [Kind::Pod, Kind::PodElsewhere] {
            let pod: ApiPod = serde_json::from_str(text).expect("any JSON reads as a Pod");
            let json = pod.object.clone();
            let checked = config::check_api_pod(SOURCE, pod.object.clone(), false);
            prop_assert_eq!(checked.is_ok(), typed, "{:?} {}", kind, text);
            let old = super::super::convert(kind, "v1", json);
            let new = pod.convert(kind, "v1");
            prop_assert_eq!(&new.object, &old.object, "{:?} {}", kind, text);
            prop_assert_eq!(&new.errors, &old.errors, "{:?} {}", kind, text);
            same_either_way(text)?;
        }
        Ok(())
    }

    /// A Pod changed at one place: read typed (or not), and the same as read the YAML way.
    #[test]
    fn a_pod_read_typed_is_the_pod_read_the_yaml_way() {
        let regular = [
            ("/status/podIP", json!("10.999.0.1")),
            ("/status/podIPs/1/ip", json!("fd00::zz")),
            ("/spec/containers/1/ports/0/containerPort", json!(70000)),
            ("/spec/containers/1/ports/0/containerPort", json!(-1)),
            ("/spec/containers/1/ports/0/containerPort", json!(0)),
            ("/metadata/uid", json!("not-a-uid")),
            ("/metadata/creationTimestamp", json!("yesterday")),
            ("/metadata/name", json!("Web_1")),
            ("/metadata/namespace", json!("Team_A")),
            ("/metadata/labels", json!({})),
            ("/spec/containers", json!([])),
            // A null reads as no value from JSON as from YAML.
            ("/metadata/name", json!(null)),
            ("/metadata", json!(null)),
            ("/spec/nodeName", json!(null)),
            ("/spec/containers", json!(null)),
            ("/status/podIP", json!(null)),
        ];
        let odd = [
            ("/metadata", json!(["web-1"])),
            ("/spec", json!([{"nodeName": "node-1"}])),
            ("/status", json!([])),
            ("/spec/containers/0", json!([{"ports": []}])),
            ("/spec/containers/0/ports/0", json!(["http", 8080])),
            ("/status/podIPs/0", json!(["10.244.1.20"])),
            ("/spec/containers/0/ports/1/containerPort", json!("9090")),
            ("/spec/containers/0/ports/1/containerPort", json!(9090.0)),
            ("/spec/containers/0/ports/1/containerPort", json!(u64::MAX)),
            ("/spec/containers/0/ports/1/name", json!(7)),
            ("/metadata/name", json!(7)),
            ("/metadata/labels/app", json!(7)),
            ("/metadata/labels/app", json!(null)),
            ("/spec/containers", json!("none")),
            ("/status/podIP", json!(10)),
            ("/status/podIPs", json!({"ip": "10.244.1.20"})),
            ("/metadata/uid", json!(true)),
        ];
        for (cases, typed) in [(&regular[..], true), (&odd[..], false)] {
            for (pointer, value) in cases {
                let mut object = pod();
                *object.pointer_mut(pointer).unwrap() = value.clone();
                typed_as_its_json(&object.to_string(), typed).unwrap();
            }
        }
        typed_as_its_json(&pod().to_string(), true).unwrap();
        // Without metadata, spec or status at all.
        for part in ["metadata", "spec", "status"] {
            let mut object = pod();
            object.as_object_mut().unwrap().remove(part);
            typed_as_its_json(&object.to_string(), true).unwrap();
        }
        // Not an object at all.
        typed_as_its_json("[1, 2]", false).unwrap();
        typed_as_its_json("null", false).unwrap();
    }

    /// A label given twice: its last value, typed or not, as read whole.
    #[test]
    fn a_label_given_twice_is_its_last_value() {
        let text = pod().to_string();
        for (labels, typed) in [
            (r#"{"app": 7, "app": "web"}"#, true),
            (r#"{"app": "web", "app": 7}"#, false),
            (r#"{"app": "x", "app": "web"}"#, true),
        ] {
            let changed = text.replacen(
                r#""labels":{"app":"web","pod-template-hash":"7d9f8b6c5"}"#,
                &format!(r#""labels":{labels}"#),
                1,
            );
            assert_ne!(changed, text);
            typed_as_its_json(&changed, typed).unwrap();
        }
    }

    #[test]
    fn a_pod_reads_slim_as_it_reads_whole() {
        same_either_way(&pod().to_string()).unwrap();
        let got = read_slim(Kind::Pod, &pod().to_string());
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        let Some(super::super::Object::Workload(w)) = got.object else {
            panic!("{:?}", got.object)
        };
        assert_eq!(w.node_name.as_deref(), Some("node-1"));
        assert_eq!(w.ports.len(), 2);
        assert_eq!(w.ips.len(), 2);
    }

    /// A Pod with a data plane of its own (a sidecar's annotation, or the node's network) is never
    /// in the ambient mesh, read either way, by both watches; the same Pod without is.
    #[test]
    fn a_sidecar_or_the_nodes_network_is_read_either_way() {
        let never_enrolled = |object: Value, kind: Kind| {
            let text = object.to_string();
            same_either_way(&text).unwrap();
            match read_slim(kind, &text).object {
                Some(super::super::Object::Workload(w)) => w.never_enrolled,
                Some(super::super::Object::PodElsewhere(p)) => p.never_enrolled,
                other => panic!("{other:?}"),
            }
        };
        let mut sidecar = pod();
        sidecar["metadata"]["annotations"]["sidecar.istio.io/status"] =
            json!("{\"containers\":[]}");
        let mut host = pod();
        host["spec"]["hostNetwork"] = json!(true);
        for kind in [Kind::Pod, Kind::PodElsewhere] {
            assert!(!never_enrolled(pod(), kind), "{kind:?}");
            assert!(never_enrolled(sidecar.clone(), kind), "{kind:?}");
            assert!(never_enrolled(host.clone(), kind), "{kind:?}");
        }
    }

    #[test]
    fn only_what_the_model_reads_is_read() {
        let got = Reader(&POD).deserialize(pod()).unwrap();
        assert_eq!(
            got,
            json!({
                "metadata": {
                    "annotations": {},
                    "name": "web-1", "namespace": "team-a", "resourceVersion": "42",
                    "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                    "creationTimestamp": "2024-05-01T12:00:00Z",
                    "labels": {"app": "web", "pod-template-hash": "7d9f8b6c5"},
                    // What names its workload for Istio's telemetry, and no more of it.
                    "ownerReferences": [{"kind": "ReplicaSet", "name": "web", "controller": true}]
                },
                "spec": {
                    "nodeName": "node-1",
                    "serviceAccountName": "default",
                    "containers": [
                        {"ports": [{"name": "http", "containerPort": 8080},
                                   {"name": "metrics", "containerPort": 9090}]},
                        {"ports": [{"containerPort": 15090}]}
                    ]
                },
                "status": {"podIP": "10.244.1.20", "podIPs": [{"ip": "10.244.1.20"}, {"ip": "fd00::20"}]}
            })
        );
        // Everything `strip` keeps of either Pod watch is read.
        for kind in [Kind::Pod, Kind::PodElsewhere] {
            assert_eq!(strip(kind, got.clone()), strip(kind, pod()), "{kind:?}");
        }
        let read: ApiPod = serde_json::from_value(pod()).unwrap();
        assert_eq!(
            (
                read.meta().name.as_deref(),
                read.meta().namespace.as_deref(),
                read.meta().resource_version.as_deref()
            ),
            (Some("web-1"), Some("team-a"), Some("42"))
        );
    }

    /// Pods the loader refuses, refused the same way with the same field named.
    #[test]
    fn an_invalid_pod_is_refused_as_when_read_whole() {
        struct Case {
            name: &'static str,
            pointer: &'static str,
            value: Value,
            field: &'static str,
        }
        let cases = [
            Case {
                name: "bad address",
                pointer: "/status/podIP",
                value: json!("10.999.0.1"),
                field: "status.podIP",
            },
            Case {
                name: "bad second address",
                pointer: "/status/podIPs/1/ip",
                value: json!("fd00::zz"),
                field: "status.podIPs[1].ip",
            },
            Case {
                name: "port out of range",
                pointer: "/spec/containers/1/ports/0/containerPort",
                value: json!(70000),
                field: "spec.containers[1].ports[0].containerPort",
            },
            Case {
                name: "port as text",
                pointer: "/spec/containers/0/ports/1/containerPort",
                value: json!("9090"),
                field: "spec.containers[0].ports[1].containerPort",
            },
            Case {
                name: "port as a fraction",
                pointer: "/spec/containers/0/ports/1/containerPort",
                value: json!(80.5),
                field: "spec.containers[0].ports[1].containerPort",
            },
            Case {
                name: "ports as a mapping",
                pointer: "/spec/containers/0/ports",
                value: json!({"http": 8080}),
                field: "spec.containers[0].ports",
            },
            Case {
                name: "address as a number",
                pointer: "/status/podIP",
                value: json!(10),
                field: "status.podIP",
            },
            Case {
                name: "bad uid",
                pointer: "/metadata/uid",
                value: json!("not-a-uid"),
                field: "metadata.uid",
            },
            Case {
                name: "bad name",
                pointer: "/metadata/name",
                value: json!("Web_1"),
                field: "metadata.name",
            },
        ];
        for case in cases {
            let mut object = pod();
            *object.pointer_mut(case.pointer).unwrap() = case.value;
            let text = object.to_string();
            let name = object["metadata"]["name"].as_str().unwrap_or_default();
            same_either_way(&text).unwrap();
            let got = read_slim(Kind::Pod, &text);
            assert!(got.object.is_none(), "{}", case.name);
            let e = &got.errors[0];
            assert_eq!(e.file, super::super::SOURCE, "{}", case.name);
            let described = format!("Pod team-a/{name}");
            assert_eq!(
                e.object.as_deref(),
                Some(described.as_str()),
                "{}",
                case.name
            );
            assert_eq!(e.field.as_deref(), Some(case.field), "{}: {e}", case.name);
        }
    }

    /// What used to fail the whole page (kube could not read the metadata) now refuses the one Pod.
    #[test]
    fn odd_metadata_refuses_the_pod_and_not_the_page() {
        for (pointer, value, field) in [
            ("/metadata/labels/app", json!(7), "metadata.labels.app"),
            (
                "/metadata/creationTimestamp",
                json!("yesterday"),
                "metadata.creationTimestamp",
            ),
            ("/metadata/name", json!(["web"]), "metadata.name"),
        ] {
            let mut odd = pod();
            *odd.pointer_mut(pointer).unwrap() = value;
            let list = json!({"apiVersion": "v1", "kind": "PodList",
                              "metadata": {"resourceVersion": "50"}, "items": [pod(), odd]});
            let text = list.to_string();
            assert!(serde_json::from_str::<ObjectList<DynamicObject>>(&text).is_err());
            let list: ObjectList<ApiPod> = serde_json::from_str(&text).unwrap();
            let [good, odd] = <[ApiPod; 2]>::try_from(list.items).unwrap();
            assert!(good.convert(Kind::Pod, "v1").object.is_some());
            let odd = odd.convert(Kind::Pod, "v1");
            assert!(odd.object.is_none());
            assert_eq!(
                odd.errors[0].field.as_deref(),
                Some(field),
                "{:?}",
                odd.errors
            );
        }
    }

    #[test]
    fn a_field_given_twice_is_its_last_value_as_read_whole() {
        let text = pod().to_string();
        let body = text.strip_suffix('}').unwrap();
        for extra in [
            r#""spec": "none""#,
            r#""spec": {"nodeName": "node-2", "containers": "none"}"#,
            r#""status": {"podIP": "10.0.0.9", "podIP": "10.0.0.10"}"#,
        ] {
            same_either_way(&format!("{body}, {extra}}}")).unwrap();
        }
        let twice = format!(r#"{body}, "status": {{"podIP": "10.0.0.9", "podIP": "10.0.0.10"}}}}"#);
        let Some(super::super::Object::Workload(w)) = read_slim(Kind::Pod, &twice).object else {
            panic!()
        };
        assert_eq!(w.ips, ["10.0.0.10".parse::<std::net::IpAddr>().unwrap()]);
    }

    #[test]
    fn a_creation_time_keeps_the_whole_seconds_it_had_read_whole() {
        for time in [
            "2024-05-01T12:00:00.75Z",
            "2024-05-01T14:00:00.5+02:00",
            "2024-05-01T12:00:00+00:00",
        ] {
            let mut object = pod();
            object["metadata"]["creationTimestamp"] = json!(time);
            same_either_way(&object.to_string()).unwrap();
        }
    }

    /// Any JSON value, small.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u32..70_000).prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-z0-9.:-]{0,12}".prop_map(Value::from),
            Just(json!("10.1.2.3")),
            Just(json!("fd00::1")),
        ];
        leaf.prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
                prop::collection::btree_map("[a-z]{1,4}|ip|name|ports|containerPort", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// The places of a Pod the model reads, and some it does not.
    const PLACES: &[&str] = &[
        "/metadata",
        "/metadata/name",
        "/metadata/namespace",
        "/metadata/labels",
        "/metadata/labels/app",
        "/metadata/uid",
        "/metadata/creationTimestamp",
        "/metadata/resourceVersion",
        "/metadata/annotations",
        "/spec",
        "/spec/nodeName",
        "/spec/containers",
        "/spec/containers/0",
        "/spec/containers/0/ports",
        "/spec/containers/0/ports/0",
        "/spec/containers/0/ports/0/name",
        "/spec/containers/0/ports/1/containerPort",
        "/spec/containers/1/ports/0/containerPort",
        "/spec/volumes",
        "/status",
        "/status/podIP",
        "/status/podIPs",
        "/status/podIPs/0",
        "/status/podIPs/1/ip",
        "/status/phase",
    ];

    /// A Pod with a few of its places given other values, or removed.
    fn odd_pod() -> impl Strategy<Value = Value> {
        let change = (0..PLACES.len(), prop::option::of(any_json()));
        prop::collection::vec(change, 0..4).prop_map(|changes| {
            let mut object = pod();
            for (place, value) in changes {
                let (parent, field) = PLACES[place].rsplit_once('/').unwrap_or_default();
                let parent = if parent.is_empty() {
                    Some(&mut object)
                } else {
                    object.pointer_mut(parent)
                };
                match (parent, value) {
                    (Some(Value::Object(p)), Some(v)) => {
                        p.insert(field.to_string(), v);
                    }
                    (Some(Value::Object(p)), None) => {
                        p.remove(field);
                    }
                    (Some(Value::Array(items)), value) => {
                        if let Ok(i) = field.parse::<usize>()
                            && i < items.len()
                        {
                            match value {
                                Some(v) => items[i] = v,
                                None => {
                                    items.remove(i);
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            object
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn any_pod_reads_slim_as_it_reads_whole(object in odd_pod()) {
            same_either_way(&object.to_string())?;
        }

        #[test]
        fn any_pod_read_typed_is_the_pod_read_the_yaml_way(object in odd_pod()) {
            let text = object.to_string();
            let pod: ApiPod = serde_json::from_str(&text).unwrap();
            let typed = config::check_api_pod(SOURCE, pod.object, false).is_ok();
            typed_as_its_json(&text, typed)?;
        }

        #[test]
        fn any_json_reads_as_a_pod(object in any_json()) {
            let text = object.to_string();
            let pod: ApiPod = serde_json::from_str(&text).unwrap();
            let converted = pod.convert(Kind::Pod, "v1");
            prop_assert!(converted.object.is_some() || !converted.errors.is_empty());
        }
    }
}
