//! The kinds the agent watches, and each object's way from the API's JSON to the model: first cut
//! down to the fields the model reads, then read by the same loader that reads files. Pods, by
//! far the most numerous, are cut down as they are parsed ([`ApiPod`]).
/// `kube::Resource` for a type a watch reads, of a kind only known when the watch starts (its
/// `ApiResource`), whose `meta` field holds what kube's watcher reads of it.
macro_rules! api_resource {
    ($type:ty) => {
        impl kube::Resource for $type {
            type DynamicType = kube::api::ApiResource;
            type Scope = kube::core::DynamicResourceScope;

            fn group(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
                dt.group.as_str().into()
            }

            fn version(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
                dt.version.as_str().into()
            }

            fn kind(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
                dt.kind.as_str().into()
            }

            fn api_version(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
                dt.api_version.as_str().into()
            }

            fn plural(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
                dt.plural.as_str().into()
            }

            fn meta(&self) -> &kube::api::ObjectMeta {
                &self.meta
            }

            fn meta_mut(&mut self) -> &mut kube::api::ObjectMeta {
                &mut self.meta
            }
        }
    };
}
use api_resource;

mod entry;
mod pod;

use std::sync::Arc;

use serde_json::{Map, Value};

pub(crate) use entry::ApiEntry;
pub(crate) use pod::ApiPod;

use crate::config::{
    self, AuthorizationPolicy, ConfigError, EndpointSlice, KubeService, MeshConfig, Namespace,
    PeerAuthentication, PodElsewhere, ServiceEntry, Workload,
};

/// What the agent watches. The mesh config is one ConfigMap, watched by name. With a node name,
/// Pods are two watches: this node's (its clients, whole) and the other nodes' ([`Kind::PodElsewhere`],
/// only what an endpoint or a workload address needs); see `docs/inputs.md#watched-per-node`. The
/// security policies are watched cluster-wide; with a node name the model holds only those this
/// node enforces (see `store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Namespace,
    /// Every Pod, or with a node name the Pods of this node.
    Pod,
    Service,
    ServiceEntry,
    WorkloadEntry,
    MeshConfig,
    EndpointSlice,
    AuthorizationPolicy,
    PeerAuthentication,
    /// With a node name: the Pods of every other node.
    PodElsewhere,
}

/// The group of Istio's networking kinds.
pub(crate) const ISTIO_GROUP: &str = "networking.istio.io";
/// The group of Istio's security policies.
pub(crate) const SECURITY_GROUP: &str = "security.istio.io";
/// The group of EndpointSlices.
pub(crate) const DISCOVERY_GROUP: &str = "discovery.k8s.io";

impl Kind {
    /// What an agent without a node name watches: every Pod of the cluster as a client.
    pub const ALL: [Kind; 9] = [
        Kind::Namespace,
        Kind::Pod,
        Kind::Service,
        Kind::ServiceEntry,
        Kind::WorkloadEntry,
        Kind::MeshConfig,
        Kind::EndpointSlice,
        Kind::AuthorizationPolicy,
        Kind::PeerAuthentication,
    ];

    /// What an agent watches: [`Kind::ALL`], and with a node name the other nodes' Pods apart.
    pub fn watched(node_scoped: bool) -> Vec<Kind> {
        let mut kinds = Kind::ALL.to_vec();
        if node_scoped {
            kinds.push(Kind::PodElsewhere);
        }
        kinds
    }

    /// The watch's name in `/config_dump` and the metrics: the kind, but for the other nodes' Pods.
    pub fn label(self) -> &'static str {
        match self {
            Kind::PodElsewhere => "Pod (other nodes)",
            other => other.name(),
        }
    }

    /// The API's `kind`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod | Kind::PodElsewhere => "Pod",
            Kind::Service => "Service",
            Kind::ServiceEntry => "ServiceEntry",
            Kind::WorkloadEntry => "WorkloadEntry",
            Kind::MeshConfig => "ConfigMap",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::AuthorizationPolicy => "AuthorizationPolicy",
            Kind::PeerAuthentication => "PeerAuthentication",
        }
    }

    /// The resource in URLs and in RBAC rules.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Namespace => "namespaces",
            Kind::Pod | Kind::PodElsewhere => "pods",
            Kind::Service => "services",
            Kind::ServiceEntry => "serviceentries",
            Kind::WorkloadEntry => "workloadentries",
            Kind::MeshConfig => "configmaps",
            Kind::EndpointSlice => "endpointslices",
            Kind::AuthorizationPolicy => "authorizationpolicies",
            Kind::PeerAuthentication => "peerauthentications",
        }
    }

    /// `""` for the core group.
    pub fn group(self) -> &'static str {
        match self {
            Kind::ServiceEntry | Kind::WorkloadEntry => ISTIO_GROUP,
            Kind::AuthorizationPolicy | Kind::PeerAuthentication => SECURITY_GROUP,
            Kind::EndpointSlice => DISCOVERY_GROUP,
            _ => "",
        }
    }

    /// A custom resource of Istio's: its versions are discovered, and it may not be installed.
    pub fn is_istio(self) -> bool {
        matches!(self.group(), ISTIO_GROUP | SECURITY_GROUP)
    }

    /// An Istio security policy: with a node name, held for the model only where it can apply
    /// to a Pod of the node.
    pub fn is_security_policy(self) -> bool {
        self.group() == SECURITY_GROUP
    }

    /// The versions to use, best first: the Istio kinds fall back to `v1beta1` where `v1` is not
    /// served.
    pub fn versions(self) -> &'static [&'static str] {
        if self.is_istio() {
            &["v1", "v1beta1"]
        } else {
            &["v1"]
        }
    }

    /// The `apiVersion` of a kind whose version is not discovered (every kind but Istio's).
    pub fn fixed_api_version(self) -> String {
        match self.group() {
            "" => self.versions()[0].to_string(),
            group => format!("{group}/{}", self.versions()[0]),
        }
    }

    /// `group/resource`, as an RBAC rule or an error names it.
    pub fn resource(self) -> String {
        match self.group() {
            "" => self.plural().to_string(),
            group => format!("{}.{group}", self.plural()),
        }
    }
}

/// A watched object as the model holds it: shared with every model built while it is in force.
/// Crate-private, as the security policies are: the scale bench reads only a conversion's errors.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Object {
    Namespace(Namespace),
    ServiceEntry(Arc<ServiceEntry>),
    Service(Arc<KubeService>),
    /// A Pod or a WorkloadEntry.
    Workload(Arc<Workload>),
    Mesh(Box<MeshConfig>),
    EndpointSlice(Arc<EndpointSlice>),
    /// A Pod of another node.
    PodElsewhere(Arc<PodElsewhere>),
    AuthorizationPolicy(Arc<AuthorizationPolicy>),
    PeerAuthentication(Arc<PeerAuthentication>),
}

/// One object read: the object when valid, and every problem found in it.
#[derive(Debug, Clone)]
pub struct Converted {
    pub(crate) object: Option<Object>,
    pub errors: Vec<ConfigError>,
    /// A ServiceEntry's status as the API holds it, for the status writer.
    pub observed: Option<Arc<crate::status::Observed>>,
}

/// What stands for the file name in the errors of objects read from the API.
pub(crate) const SOURCE: &str = "kubernetes API";

/// Reads one object served by the API (`api_version` as watched) through the file loader's checks.
/// The mesh ConfigMap is read whatever its name: only the configured one is watched.
pub fn convert(kind: Kind, api_version: &str, object: Value) -> Converted {
    let observed = (kind == Kind::ServiceEntry).then(|| Arc::new(crate::status::observe(&object)));
    Converted {
        observed,
        ..convert_unobserved(kind, api_version, object)
    }
}

/// [`convert`] without a ServiceEntry's status for the status writer.
fn convert_unobserved(kind: Kind, api_version: &str, object: Value) -> Converted {
    let observed = None;
    let mut slim = strip(kind, object);
    slim.insert("apiVersion".into(), Value::from(api_version));
    slim.insert("kind".into(), Value::from(kind.name()));
    if kind == Kind::MeshConfig
        && let Some(Value::Object(meta)) = slim.get_mut("metadata")
    {
        // The loader reads the mesh config from a ConfigMap named `istio` only.
        meta.insert("name".into(), Value::from("istio"));
    }
    let slim = Value::Object(slim);
    if kind == Kind::ServiceEntry
        && let Some(checked) = config::check_api_entry(SOURCE, &slim)
    {
        let (object, errors) = match checked {
            Ok(entry) => (Some(Object::ServiceEntry(Arc::new(entry))), Vec::new()),
            Err(errors) => (None, errors),
        };
        return Converted {
            object,
            errors,
            observed,
        };
    }
    let loaded = config::read_api_object(SOURCE, &slim);
    if !loaded.errors.is_empty() {
        return Converted {
            object: None,
            errors: loaded.errors,
            observed,
        };
    }
    let mut model = loaded.model;
    let object = match kind {
        Kind::Namespace => model
            .namespaces
            .into_values()
            .find(|n| n.declared)
            .map(Object::Namespace),
        Kind::ServiceEntry => model.service_entries.pop().map(Object::ServiceEntry),
        Kind::Service => model.services.pop().map(Object::Service),
        Kind::Pod | Kind::WorkloadEntry => model.workloads.pop().map(Object::Workload),
        Kind::PodElsewhere => model
            .workloads
            .pop()
            .map(|pod| Object::PodElsewhere(Arc::new(PodElsewhere::new(&pod)))),
        Kind::MeshConfig => Some(Object::Mesh(Box::new(model.mesh))),
        Kind::EndpointSlice => model.endpoint_slices.pop().map(Object::EndpointSlice),
        Kind::AuthorizationPolicy => model
            .authorization_policies
            .pop()
            .map(Object::AuthorizationPolicy),
        Kind::PeerAuthentication => model
            .peer_authentications
            .pop()
            .map(Object::PeerAuthentication),
    };
    Converted {
        object,
        errors: Vec::new(),
        observed,
    }
}

/// The object cut down to the fields the model reads: no managed fields, annotations (but an
/// AuthorizationPolicy's dry run and a Pod's sidecar mark), container specs or status beyond the
/// pod's addresses. What the
/// API adds later is ignored the same way.
/// A Pod's fields kept here are the ones [`pod::POD`] reads.
pub(crate) fn strip(kind: Kind, object: Value) -> Map<String, Value> {
    let Value::Object(mut object) = object else {
        return Map::new();
    };
    let mut slim = Map::new();
    if let Some(Value::Object(meta)) = object.remove("metadata") {
        slim.insert("metadata".into(), Value::Object(strip_meta(kind, meta)));
    }
    let spec = object.remove("spec");
    match kind {
        Kind::Namespace => {}
        Kind::Pod | Kind::PodElsewhere => strip_pod(kind, spec, object.remove("status"), &mut slim),
        Kind::Service => {
            if let Some(Value::Object(spec)) = spec {
                let kept = keep(spec, &["clusterIP", "clusterIPs", "ports", "selector"]);
                slim.insert("spec".into(), Value::Object(kept));
            }
        }
        // The model reads nearly all of these specs; any other value is the loader's to refuse.
        Kind::ServiceEntry | Kind::WorkloadEntry => {
            if let Some(spec) = spec {
                slim.insert("spec".into(), spec);
            }
            // Istio's allocations; the conditions are the status writer's (see `status`).
            if kind == Kind::ServiceEntry
                && let Some(Value::Object(status)) = object.remove("status")
            {
                slim.insert("status".into(), Value::Object(keep(status, &["addresses"])));
            }
        }
        // The spec whole, as for the entries; the status is istiod's validation messages.
        Kind::AuthorizationPolicy | Kind::PeerAuthentication => {
            if let Some(spec) = spec {
                slim.insert("spec".into(), spec);
            }
        }
        Kind::MeshConfig => {
            if let Some(Value::Object(data)) = object.remove("data") {
                slim.insert("data".into(), Value::Object(keep(data, &["mesh"])));
            }
        }
        // Each endpoint's addresses, readiness and Pod; each port's name and number.
        Kind::EndpointSlice => {
            if let Some(Value::Object(meta)) = slim.get_mut("metadata")
                && let Some(Value::Object(labels)) = meta.get_mut("labels")
            {
                *labels = keep(std::mem::take(labels), &[config::SERVICE_NAME_LABEL]);
            }
            for field in ["addressType", "endpoints", "ports"] {
                if let Some(value) = object.remove(field) {
                    slim.insert(field.into(), value);
                }
            }
        }
    }
    slim
}

/// An object's metadata cut down to what the model reads of its kind.
fn strip_meta(kind: Kind, mut meta: Map<String, Value>) -> Map<String, Value> {
    let pod = matches!(kind, Kind::Pod | Kind::PodElsewhere);
    let read = |field: &str| match field {
        "name" | "namespace" | "labels" => true,
        // A Pod of another node is an endpoint or a workload address, never a client here: its
        // uid (which ties a client to its cgroup), node and age are not kept.
        "creationTimestamp" | "uid" => kind != Kind::PodElsewhere,
        // Of the annotations, a policy's dry run and a Pod's sidecar (cut below).
        "annotations" => pod || kind == Kind::AuthorizationPolicy,
        // The owner that made a Pod names its workload.
        "generateName" | "ownerReferences" => pod,
        _ => false,
    };
    meta.retain(|field, _| read(field));
    if let Some(Value::Object(annotations)) = meta.get_mut("annotations") {
        let read = match kind {
            Kind::AuthorizationPolicy => config::DRY_RUN_ANNOTATION,
            _ => config::SIDECAR_STATUS_ANNOTATION,
        };
        *annotations = keep(std::mem::take(annotations), &[read]);
        if annotations.is_empty() {
            meta.remove("annotations");
        }
    }
    if let Some(Value::Array(owners)) = meta.get_mut("ownerReferences") {
        for owner in owners.iter_mut() {
            if let Value::Object(o) = owner {
                *o = keep(std::mem::take(o), &["kind", "name", "controller"]);
            }
        }
    }
    meta
}

/// A Pod's spec and status cut to what [`pod::POD`] reads, into `slim`.
fn strip_pod(
    kind: Kind,
    spec: Option<Value>,
    status: Option<Value>,
    slim: &mut Map<String, Value>,
) {
    if let Some(Value::Object(mut spec)) = spec {
        let containers = spec.remove("containers");
        let node_fields: &[&str] = match kind {
            // A client's service account names its workload identity (HBONE).
            Kind::Pod => &["nodeName", "serviceAccountName", "hostNetwork"],
            _ => &["hostNetwork"],
        };
        let mut kept = keep(spec, node_fields);
        if let Some(Value::Array(containers)) = containers {
            let containers = containers
                .into_iter()
                .map(|c| match c {
                    Value::Object(c) => Value::Object(keep(c, &["ports"])),
                    other => other,
                })
                .map(|mut c| {
                    if let Some(Value::Array(ports)) = c.get_mut("ports") {
                        for port in ports.iter_mut() {
                            if let Value::Object(p) = port {
                                *p = keep(std::mem::take(p), &["name", "containerPort"]);
                            }
                        }
                    }
                    c
                })
                .collect();
            kept.insert("containers".into(), Value::Array(containers));
        }
        slim.insert("spec".into(), Value::Object(kept));
    }
    if let Some(Value::Object(status)) = status {
        slim.insert(
            "status".into(),
            Value::Object(keep(status, &["podIP", "podIPs"])),
        );
    }
}

/// `map` with only `fields`, cut in place.
fn keep(mut map: Map<String, Value>, fields: &[&str]) -> Map<String, Value> {
    map.retain(|field, _| fields.contains(&field.as_str()));
    map
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::WorkloadKind;

    fn pod() -> Value {
        json!({
            "metadata": {
                "name": "web-1", "namespace": "team-a",
                "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                "labels": {"app": "web"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
                "resourceVersion": "42",
                "creationTimestamp": "2024-05-01T12:00:00Z"
            },
            "spec": {
                "nodeName": "node-1",
                "containers": [{
                    "name": "web", "image": "nginx", "env": [{"name": "A", "value": "B"}],
                    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
                }],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {
                "phase": "Running", "podIP": "10.244.1.20",
                "podIPs": [{"ip": "10.244.1.20"}],
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        })
    }

    #[test]
    fn strip_keeps_only_what_the_model_reads() {
        let slim = Value::Object(strip(Kind::Pod, pod()));
        assert_eq!(
            slim,
            json!({
                "metadata": {
                    "name": "web-1", "namespace": "team-a",
                    "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                    "labels": {"app": "web"},
                    "creationTimestamp": "2024-05-01T12:00:00Z"
                },
                "spec": {
                    "nodeName": "node-1",
                    "containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]
                },
                "status": {"podIP": "10.244.1.20", "podIPs": [{"ip": "10.244.1.20"}]}
            })
        );
        let cm = json!({
            "metadata": {"name": "istio", "namespace": "istio-system"},
            "data": {"mesh": "x: 1", "meshNetworks": "big"}
        });
        assert_eq!(
            Value::Object(strip(Kind::MeshConfig, cm)),
            json!({"metadata": {"name": "istio", "namespace": "istio-system"}, "data": {"mesh": "x: 1"}})
        );
    }

    #[test]
    fn a_pod_from_the_api_becomes_the_same_workload_a_file_gives() {
        let got = convert(Kind::Pod, "v1", pod());
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        let Some(Object::Workload(w)) = got.object else {
            panic!("{:?}", got.object)
        };
        let file = config::load_sources([(
            SOURCE,
            "apiVersion: v1\nkind: Pod\nmetadata: {name: web-1, namespace: team-a, uid: 3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1, labels: {app: web}, creationTimestamp: '2024-05-01T12:00:00Z'}\nspec: {nodeName: node-1, containers: [{ports: [{name: http, containerPort: 8080}]}]}\nstatus: {podIP: 10.244.1.20}\n",
        )])
        .unwrap();
        assert_eq!(w, file.workloads[0]);
        assert_eq!(w.kind, WorkloadKind::Pod);
    }

    #[test]
    fn a_pod_of_another_node_keeps_what_an_endpoint_needs_and_no_identity() {
        let slim = Value::Object(strip(Kind::PodElsewhere, pod()));
        assert_eq!(
            slim,
            json!({
                "metadata": {"name": "web-1", "namespace": "team-a", "labels": {"app": "web"}},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
                "status": {"podIP": "10.244.1.20", "podIPs": [{"ip": "10.244.1.20"}]}
            })
        );
        let Some(Object::PodElsewhere(p)) = convert(Kind::PodElsewhere, "v1", pod()).object else {
            panic!()
        };
        let w = p.workload(SOURCE);
        assert_eq!(w.kind, WorkloadKind::Pod);
        assert_eq!((w.meta.uid, w.node_name.as_deref()), (None, None));
        assert_eq!(w.ports.get("http"), Some(&8080));
        assert_eq!(w.meta.labels["app"], "web");
        assert_eq!(w.ips, ["10.244.1.20".parse::<std::net::IpAddr>().unwrap()]);
        // Refused as this node's Pods are, with the field named.
        let mut bad = pod();
        bad["status"]["podIP"] = json!("10.999.0.1");
        let got = convert(Kind::PodElsewhere, "v1", bad);
        assert!(got.object.is_none());
        assert_eq!(got.errors[0].object.as_deref(), Some("Pod team-a/web-1"));
        assert_eq!(got.errors[0].field.as_deref(), Some("status.podIP"));
    }

    #[test]
    fn an_invalid_object_is_refused_with_its_field_named() {
        let se = json!({
            "metadata": {"name": "bad", "namespace": "team-a"},
            "spec": {"hosts": ["bad.example.com"], "addresses": ["203.0.113.0/33"]}
        });
        let got = convert(Kind::ServiceEntry, "networking.istio.io/v1", se);
        assert!(got.object.is_none());
        assert_eq!(got.errors.len(), 1, "{:?}", got.errors);
        let e = &got.errors[0];
        assert_eq!(e.file, SOURCE);
        assert_eq!(e.object.as_deref(), Some("ServiceEntry team-a/bad"));
        assert_eq!(e.field.as_deref(), Some("spec.addresses[0]"));
    }

    #[test]
    fn the_mesh_config_map_is_read_whatever_its_name() {
        let cm = json!({
            "metadata": {"name": "istio-1-24", "namespace": "istio-system"},
            "data": {"mesh": "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n"}
        });
        let got = convert(Kind::MeshConfig, "v1", cm);
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        let Some(Object::Mesh(mesh)) = got.object else {
            panic!("{:?}", got.object)
        };
        assert_ne!(*mesh, MeshConfig::default());
    }

    #[test]
    fn discovery_selectors_come_from_the_mesh_config_map_and_a_bad_one_names_its_field() {
        let cm = |mesh: &str| json!({"metadata": {"name": "istio", "namespace": "istio-system"}, "data": {"mesh": mesh}});
        let got = convert(
            Kind::MeshConfig,
            "v1",
            cm("discoverySelectors:\n- matchLabels: {istio-discovery: enabled}\n"),
        );
        let Some(Object::Mesh(mesh)) = got.object else {
            panic!("{:?}", got.errors)
        };
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(mesh.discovery_selectors.len(), 1);
        assert!(mesh.discovery_selectors[0].matches(&labels(&[("istio-discovery", "enabled")])));
        assert!(!mesh.discovery_selectors[0].matches(&labels(&[])));

        let got = convert(
            Kind::MeshConfig,
            "v1",
            cm("discoverySelectors:\n- matchExpressions: [{key: a, operator: Near}]\n"),
        );
        assert!(got.object.is_none());
        let field = got.errors[0].field.as_deref().unwrap_or_default();
        assert!(
            field.starts_with("data.mesh.discoverySelectors[0]"),
            "{:?}",
            got.errors
        );
    }

    fn endpoint_slice(address: &str) -> Value {
        json!({
            "metadata": {"name": "web-abc", "namespace": "team-a", "resourceVersion": "7",
                         "labels": {"kubernetes.io/service-name": "web",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
                         "managedFields": [{"manager": "kube-controller-manager"}]},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": [address], "conditions": {"ready": true, "serving": true},
                 "nodeName": "node-1", "zone": "a", "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "team-a"}},
                {"addresses": ["10.244.1.21"], "conditions": {"ready": false}}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
        })
    }

    #[test]
    fn an_endpoint_slice_keeps_its_service_its_ready_addresses_and_its_ports() {
        let got = convert(
            Kind::EndpointSlice,
            "discovery.k8s.io/v1",
            endpoint_slice("10.244.1.20"),
        );
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        let Some(Object::EndpointSlice(slice)) = got.object else {
            panic!("{:?}", got.object)
        };
        assert_eq!(
            *slice,
            EndpointSlice {
                namespace: "team-a".into(),
                name: "web-abc".into(),
                service: "web".into(),
                endpoints: vec![config::SliceEndpoint {
                    ip: "10.244.1.20".parse().unwrap(),
                    pod: Some("web-1".into()),
                }],
                ports: vec![("http".into(), 8080)],
            }
        );
        // Only the service label is kept of the labels.
        let slim = Value::Object(strip(Kind::EndpointSlice, endpoint_slice("10.244.1.20")));
        assert_eq!(
            slim["metadata"]["labels"],
            json!({"kubernetes.io/service-name": "web"})
        );
        assert!(slim["metadata"].get("managedFields").is_none());
    }

    #[test]
    fn an_endpoint_slice_with_a_bad_address_is_refused_with_its_field_named() {
        let got = convert(
            Kind::EndpointSlice,
            "discovery.k8s.io/v1",
            endpoint_slice("10.244.1.999"),
        );
        assert!(got.object.is_none());
        let e = &got.errors[0];
        assert_eq!(e.object.as_deref(), Some("EndpointSlice team-a/web-abc"));
        assert_eq!(e.field.as_deref(), Some("endpoints[0].addresses[0]"));
        let got = convert(
            Kind::EndpointSlice,
            "discovery.k8s.io/v1",
            endpoint_slice("2001:db8::1"),
        );
        assert_eq!(
            got.errors[0].field.as_deref(),
            Some("endpoints[0].addresses[0]")
        );
        assert!(
            got.errors[0].message.contains("addressType"),
            "{:?}",
            got.errors
        );
    }

    #[test]
    fn a_directory_skips_endpoint_slices() {
        let file = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-abc, namespace: team-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.1.20]}]\nports: [{name: http, port: 8080}]\n";
        let model = config::load_sources([("slices.yaml", file)]).unwrap();
        assert!(model.endpoint_slices.is_empty());
    }

    #[test]
    fn a_policy_keeps_its_spec_and_of_its_annotations_the_dry_run() {
        let policy = json!({
            "metadata": {"name": "deny", "namespace": "team-a", "resourceVersion": "3",
                         "annotations": {"istio.io/dry-run": "true", "big": "x"},
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"action": "DENY", "rules": [{}]},
            "status": {"validationMessages": []}
        });
        assert_eq!(
            Value::Object(strip(Kind::AuthorizationPolicy, policy.clone())),
            json!({"metadata": {"name": "deny", "namespace": "team-a",
                                "annotations": {"istio.io/dry-run": "true"}},
                   "spec": {"action": "DENY", "rules": [{}]}})
        );
        let Some(Object::AuthorizationPolicy(p)) = convert(
            Kind::AuthorizationPolicy,
            "security.istio.io/v1",
            policy.clone(),
        )
        .object
        else {
            panic!()
        };
        assert!(p.dry_run);
        // A PeerAuthentication reads no annotation.
        let slim = strip(Kind::PeerAuthentication, policy);
        assert!(slim["metadata"].get("annotations").is_none());
    }

    #[test]
    fn the_security_policies_are_istios_discovered_in_their_own_group() {
        for kind in [Kind::AuthorizationPolicy, Kind::PeerAuthentication] {
            assert!(kind.is_istio() && kind.is_security_policy());
            assert_eq!(kind.group(), SECURITY_GROUP);
            assert_eq!(kind.versions(), ["v1", "v1beta1"]);
        }
        assert_eq!(
            Kind::AuthorizationPolicy.resource(),
            "authorizationpolicies.security.istio.io"
        );
        assert_eq!(
            Kind::PeerAuthentication.resource(),
            "peerauthentications.security.istio.io"
        );
        assert_eq!(Kind::ServiceEntry.group(), ISTIO_GROUP);
        assert!(!Kind::ServiceEntry.is_security_policy());
    }

    #[test]
    fn the_root_namespace_comes_from_the_mesh_config_map() {
        let cm = |mesh: &str| json!({"metadata": {"name": "istio", "namespace": "istio-system"}, "data": {"mesh": mesh}});
        let root = |mesh: &str| match convert(Kind::MeshConfig, "v1", cm(mesh)).object {
            Some(Object::Mesh(mesh)) => mesh.root_namespace().to_string(),
            other => panic!("{other:?}"),
        };
        assert_eq!(root("rootNamespace: mesh-root\n"), "mesh-root");
        assert_eq!(root("trustDomain: example.org\n"), "istio-system");
    }

    #[test]
    fn a_namespace_keeps_its_labels_and_gains_its_name_label() {
        let ns = json!({"metadata": {"name": "team-a", "labels": {"tier": "gold"}}});
        let Some(Object::Namespace(ns)) = convert(Kind::Namespace, "v1", ns).object else {
            panic!()
        };
        assert!(ns.declared);
        assert_eq!(ns.labels["tier"], "gold");
        assert_eq!(ns.labels[config::NAMESPACE_NAME_LABEL], "team-a");
    }
}
