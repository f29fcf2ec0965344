//! Istio's security policies from the API: read as its watch reads them, they are what a directory
//! gives; held at their last good version; with a node name, only the root namespace's and those
//! of namespaces with a Pod of this node are in the model, and a namespace's first Pod here brings
//! its policies into force.
use std::{net::IpAddr, sync::Arc};

use kube::api::DynamicObject;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{
    COALESCE, follow,
    kinds::{Kind, SOURCE},
    store::{Change, Store},
    watch,
};
use crate::{
    config::{self, AuthzAction, Model, MtlsMode},
    live::LiveState,
    metrics::Metrics,
};

const V1: &str = "security.istio.io/v1";
const V1BETA1: &str = "security.istio.io/v1beta1";
const NOW: &str = "2026-01-01T00:00:00Z";

/// An AuthorizationPolicy as the API serves it, with what nothing reads (managed fields, another
/// annotation, istiod's status).
fn authorization(namespace: &str, name: &str, action: &str) -> Value {
    json!({
        "apiVersion": V1, "kind": "AuthorizationPolicy",
        "metadata": {
            "name": name, "namespace": namespace, "resourceVersion": "7", "generation": 2,
            "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
            "creationTimestamp": "2026-01-01T00:00:00Z", "labels": {"team": "a"},
            "annotations": {"istio.io/dry-run": "true",
                            "kubectl.kubernetes.io/last-applied-configuration": "{\"spec\":{}}"},
            "managedFields": [{"manager": "kubectl", "operation": "Update"}]
        },
        "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "action": action,
            "rules": [{
                "from": [{"source": {"namespaces": ["team-c"], "principals": ["cluster.local/ns/team-c/sa/x"]}}],
                "to": [{"operation": {"ports": ["8080"], "methods": ["GET"]}}],
                "when": [{"key": "source.ip", "values": ["10.0.0.0/8"]}]
            }]
        },
        "status": {"validationMessages": [{"type": {"code": "IST0000"}}]}
    })
}

/// A PeerAuthentication as the API serves it (at `v1beta1`, as an older Istio serves it).
fn peer(namespace: &str, name: &str, mode: &str) -> Value {
    json!({
        "apiVersion": V1BETA1, "kind": "PeerAuthentication",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "8",
                     "managedFields": [{"manager": "kubectl"}]},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "mtls": {"mode": mode},
                 "portLevelMtls": {"8080": {"mode": "PERMISSIVE"}}}
    })
}

/// A Pod of node `n1` (this node) or another.
fn pod(namespace: &str, name: &str, ip: &str, node: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "web"},
                     "uid": "3f1c2a9e-7b4d-4c1a-9e2f-b2b2b2b2b2b2"},
        "spec": {"nodeName": node, "serviceAccountName": "web"},
        "status": {"podIP": ip}
    })
}

fn mesh(root: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "istio", "namespace": "istio-system"},
           "data": {"mesh": format!("rootNamespace: {root}\n")}})
}

/// The object as its watch reads it (kube's `DynamicObject`, then the loader), as a change.
fn served(kind: Kind, object: Value) -> Change {
    let api_version = object["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let object: DynamicObject = serde_json::from_value(object).unwrap();
    let key = (
        object.metadata.namespace.clone().unwrap_or_default(),
        object.metadata.name.clone().unwrap_or_default(),
    );
    let converted = watch::read(kind, &api_version, object, false).unwrap();
    Change::Upsert(kind, key, Box::new(converted))
}

/// A store of an agent given its node, every watch listed (nothing yet).
fn node_store() -> Store {
    let mut store = Store::new(&Kind::watched(true));
    for kind in Kind::watched(true) {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    store
}

/// `namespace/name` of each policy of the model, of both kinds.
fn held(model: &Model) -> (Vec<String>, Vec<String>) {
    let key = |m: &config::ObjectMeta| format!("{}/{}", m.namespace, m.name);
    (
        model
            .authorization_policies
            .iter()
            .map(|p| key(&p.meta))
            .collect(),
        model
            .peer_authentications
            .iter()
            .map(|p| key(&p.meta))
            .collect(),
    )
}

#[test]
fn policies_from_the_api_are_what_a_directory_loads() {
    let mut store = node_store();
    store.apply(
        served(Kind::Pod, pod("team-a", "web-1", "10.0.0.1", "n1")),
        NOW,
    );
    let policy = authorization("team-a", "deny-c", "DENY");
    let peer = peer("team-a", "strict", "STRICT");
    assert!(store.apply(served(Kind::AuthorizationPolicy, policy.clone()), NOW));
    assert!(store.apply(served(Kind::PeerAuthentication, peer.clone()), NOW));
    assert!(store.take_changes().policies);
    let (model, errors, rejected) = store.model();
    assert!(errors.is_empty() && rejected.is_empty(), "{errors:?}");
    // The same objects as a file of the same JSON gives, through the same conversion.
    let file = config::load_sources([
        (SOURCE, policy.to_string().as_str()),
        (SOURCE, peer.to_string().as_str()),
    ])
    .unwrap();
    assert_eq!(model.authorization_policies, file.authorization_policies);
    assert_eq!(model.peer_authentications, file.peer_authentications);
    let p = &model.authorization_policies[0];
    assert_eq!((p.action, p.dry_run), (AuthzAction::Deny, true));
    assert_eq!(p.rules[0].to[0].as_ref().unwrap().methods, ["GET"]);
    let pa = &model.peer_authentications[0];
    assert_eq!(pa.mode, MtlsMode::Strict);
    assert_eq!(pa.port_level.get(&8080), Some(&MtlsMode::Permissive));
}

#[test]
fn a_refused_update_keeps_the_last_good_policy_with_the_field_named_and_a_delete_removes_it() {
    let mut store = node_store();
    store.apply(
        served(Kind::Pod, pod("team-a", "web-1", "10.0.0.1", "n1")),
        NOW,
    );
    let good = authorization("team-a", "deny-c", "DENY");
    store.apply(served(Kind::AuthorizationPolicy, good), NOW);
    store.apply(
        served(Kind::PeerAuthentication, peer("team-a", "strict", "STRICT")),
        NOW,
    );
    store.take_changes();

    let bad = authorization("team-a", "deny-c", "PERMIT");
    assert!(store.apply(served(Kind::AuthorizationPolicy, bad), NOW));
    let bad = peer("team-a", "strict", "STRICTEST");
    assert!(store.apply(served(Kind::PeerAuthentication, bad), NOW));
    assert!(store.take_changes().policies);
    let (model, errors, rejected) = store.model();
    assert_eq!(model.authorization_policies[0].action, AuthzAction::Deny);
    assert_eq!(model.peer_authentications[0].mode, MtlsMode::Strict);
    let named: Vec<(&str, Option<&str>, Option<&str>)> = errors
        .iter()
        .map(|e| (e.file.as_str(), e.object.as_deref(), e.field.as_deref()))
        .collect();
    assert_eq!(
        named,
        [
            (
                SOURCE,
                Some("AuthorizationPolicy team-a/deny-c"),
                Some("spec.action")
            ),
            (
                SOURCE,
                Some("PeerAuthentication team-a/strict"),
                Some("spec.mtls.mode")
            ),
        ]
    );
    assert!(errors[0].message.contains("PERMIT"), "{errors:?}");
    let kept: Vec<(&str, bool)> = rejected
        .iter()
        .map(|r| (r.kind, r.last_good_in_force))
        .collect();
    assert_eq!(
        kept,
        [("AuthorizationPolicy", true), ("PeerAuthentication", true)]
    );

    // Deleted: out of the model, and its error with it.
    let key = ("team-a".to_string(), "deny-c".to_string());
    assert!(store.apply(Change::Deleted(Kind::AuthorizationPolicy, key), NOW));
    let key = ("team-a".to_string(), "strict".to_string());
    assert!(store.apply(Change::Deleted(Kind::PeerAuthentication, key), NOW));
    assert!(store.take_changes().policies);
    let (model, errors, rejected) = store.model();
    assert_eq!(held(&model), (vec![], vec![]));
    assert!(errors.is_empty() && rejected.is_empty(), "{errors:?}");
}

#[test]
fn with_a_node_name_the_model_holds_the_root_namespaces_policies_and_those_of_namespaces_with_a_pod_here()
 {
    let mut store = node_store();
    store.apply(
        served(Kind::Pod, pod("team-a", "web-1", "10.0.0.1", "n1")),
        NOW,
    );
    store.apply(
        served(Kind::PodElsewhere, pod("team-b", "web-2", "10.0.0.2", "n2")),
        NOW,
    );
    for ns in ["istio-system", "team-a", "team-b", "my-root"] {
        let policy = authorization(ns, "deny-c", "DENY");
        store.apply(served(Kind::AuthorizationPolicy, policy), NOW);
        store.apply(
            served(Kind::PeerAuthentication, peer(ns, "strict", "STRICT")),
            NOW,
        );
    }
    // A refused policy of a namespace with no Pod here is no concern of this node.
    let bad = authorization("team-b", "bad", "PERMIT");
    store.apply(served(Kind::AuthorizationPolicy, bad), NOW);
    let (model, errors, _) = store.model();
    let both = |namespaces: &[&str], name: &str| {
        namespaces
            .iter()
            .map(|ns| format!("{ns}/{name}"))
            .collect::<Vec<_>>()
    };
    let here = ["istio-system", "team-a"];
    assert_eq!(held(&model), (both(&here, "deny-c"), both(&here, "strict")));
    assert!(errors.is_empty(), "{errors:?}");

    // team-b's first Pod on this node: its policies, and the refused one's error, come in.
    store.take_changes();
    store.apply(
        served(Kind::Pod, pod("team-b", "web-3", "10.0.0.3", "n1")),
        NOW,
    );
    assert!(store.take_changes().any());
    let (model, errors, _) = store.model();
    let here = ["istio-system", "team-a", "team-b"];
    assert_eq!(
        held(&model),
        (
            vec![
                "istio-system/deny-c".to_string(),
                "team-a/deny-c".into(),
                "team-b/deny-c".into()
            ],
            both(&here, "strict")
        )
    );
    assert_eq!(
        errors[0].object.as_deref(),
        Some("AuthorizationPolicy team-b/bad")
    );
    // And out again with its last Pod here.
    let key = ("team-b".to_string(), "web-3".to_string());
    store.apply(Change::Deleted(Kind::Pod, key), NOW);
    let (model, _, _) = store.model();
    assert_eq!(held(&model).0, both(&["istio-system", "team-a"], "deny-c"));

    // The root namespace is the mesh config's `rootNamespace`, read from its ConfigMap.
    store.apply(served(Kind::MeshConfig, mesh("my-root")), NOW);
    let (model, errors, _) = store.model();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(model.mesh.root_namespace(), "my-root");
    let here = ["my-root", "team-a"];
    assert_eq!(held(&model), (both(&here, "deny-c"), both(&here, "strict")));
}

#[test]
fn without_a_node_name_every_policy_is_held() {
    let mut store = Store::default();
    for kind in Kind::ALL {
        store.apply(Change::Relist(kind), NOW);
        store.apply(Change::Listed(kind), NOW);
    }
    for ns in ["team-a", "team-b"] {
        let policy = authorization(ns, "deny-c", "DENY");
        store.apply(served(Kind::AuthorizationPolicy, policy), NOW);
    }
    let (model, _, _) = store.model();
    assert_eq!(held(&model).0, ["team-a/deny-c", "team-b/deny-c"]);
}

#[test]
fn a_policy_not_served_by_the_api_is_none_and_a_watch_listed_again_replaces_them() {
    let mut store = node_store();
    store.apply(
        served(Kind::Pod, pod("team-a", "web-1", "10.0.0.1", "n1")),
        NOW,
    );
    let policy = authorization("team-a", "deny-c", "DENY");
    store.apply(served(Kind::AuthorizationPolicy, policy), NOW);
    // A list that no longer has it.
    store.take_changes();
    store.apply(Change::Relist(Kind::AuthorizationPolicy), NOW);
    assert!(store.apply(Change::Listed(Kind::AuthorizationPolicy), NOW));
    assert!(store.take_changes().policies);
    assert!(store.model().0.authorization_policies.is_empty());
    // Its CRD gone: none, and the watch counts as listed.
    let policy = authorization("team-a", "deny-c", "DENY");
    store.apply(served(Kind::AuthorizationPolicy, policy), NOW);
    assert!(store.apply(Change::NotInstalled(Kind::AuthorizationPolicy), NOW));
    assert!(store.model().0.authorization_policies.is_empty());
    assert!(store.ready());
}

async fn settle() {
    tokio::time::sleep(COALESCE * 3).await;
}

/// The keys of the policies in force for the Pod of this node at `ip`.
fn in_force(live: &LiveState, ip: &str) -> Vec<String> {
    let ip: IpAddr = ip.parse().unwrap();
    let snapshot = live.snapshot();
    let Some(pod) = snapshot.authz().pod(ip) else {
        return Vec::new();
    };
    pod.policies.iter().map(|p| p.key()).collect()
}

#[tokio::test]
async fn a_namespaces_first_pod_on_this_node_brings_its_policies_into_force() {
    let live = LiveState::new(Some("kubernetes API".into()));
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = mpsc::channel(4096);
    let kinds = Kind::watched(true);
    let task = tokio::spawn(follow(rx, Store::new(&kinds), live.clone(), metrics, None));
    for &kind in &kinds {
        tx.send(Change::Relist(kind)).await.unwrap();
        tx.send(Change::Listed(kind)).await.unwrap();
    }
    let policy = authorization("team-b", "deny-c", "DENY");
    tx.send(served(Kind::AuthorizationPolicy, policy))
        .await
        .unwrap();
    tx.send(served(Kind::Pod, pod("team-a", "web-1", "10.0.0.1", "n1")))
        .await
        .unwrap();
    settle().await;
    assert!(live.has_config());
    assert!(in_force(&live, "10.0.0.1").is_empty());
    assert!(live.snapshot().authz().converted().is_empty());
    let generation = live.status_report().generation;

    // team-b's first Pod here: a Pod change alone, and its namespace's policy is in force for it.
    tx.send(served(Kind::Pod, pod("team-b", "web-2", "10.0.0.2", "n1")))
        .await
        .unwrap();
    settle().await;
    assert_eq!(live.status_report().generation, generation + 1);
    assert_eq!(in_force(&live, "10.0.0.2"), ["team-b/deny-c"]);

    // A policy changed alone is a snapshot too: now a namespace-wide ALLOW.
    let mut allow = authorization("team-b", "deny-c", "ALLOW");
    allow["spec"]["selector"] = Value::Null;
    tx.send(served(Kind::AuthorizationPolicy, allow))
        .await
        .unwrap();
    settle().await;
    assert_eq!(live.status_report().generation, generation + 2);
    let snapshot = live.snapshot();
    let pod = snapshot.authz().pod("10.0.0.2".parse().unwrap()).unwrap();
    assert_eq!(pod.policies[0].key(), "team-b/deny-c");
    let policy = serde_json::to_value(&*pod.policies[0]).unwrap();
    assert_eq!(policy["action"], "ALLOW", "{policy}");
    drop(snapshot);
    drop(tx);
    task.await.unwrap();
}
