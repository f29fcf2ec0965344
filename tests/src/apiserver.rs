//! A small Kubernetes API server for the tests: it serves the objects a test puts in, over plain
//! HTTP, with the protocol the real one speaks to a watching client.
//!
//! - `GET` of a collection: a JSON list with `metadata.resourceVersion`; `fieldSelector` on
//!   `metadata.name`, `metadata.namespace` and `spec.nodeName` (`=`, `==`, `!=`, terms joined by
//!   `,`); pages of `limit` items linked by `continue`.
//! - A watch with a `fieldSelector` sees an object that comes to match it as `ADDED` and one that
//!   stops matching as `DELETED`, as the API server's watch cache tells them.
//! - `?watch=true|1`: a stream of `ADDED`/`MODIFIED`/`DELETED` events after the `resourceVersion`
//!   asked, a `BOOKMARK` when the client allows them, and an `ERROR` with code 410 for a version
//!   older than the server keeps ([`ApiServer::expire_watches`] forgets them all).
//! - Discovery of the Istio group (`/apis/networking.istio.io/<version>`), 404 for a version not
//!   served, 403 for a resource the test forbids; and of everything else as kubectl asks it (`/api`,
//!   `/apis`, `/api/v1`, `/apis/<group>/v1`), Istio's security policies (`security.istio.io`)
//!   among them, at `v1` only.
//! - One object: `GET`; `POST` (create, 409 when it exists); `PUT` (replace, 409 when the
//!   `resourceVersion` sent is not the current one); `PATCH .../status` with a JSON merge patch (409
//!   on a stale `metadata.resourceVersion`), recorded in `managedFields` under the `fieldManager`
//!   asked. An update of a ServiceEntry through the object keeps its status, as the API does for a
//!   kind with a status subresource, and moves `metadata.generation` when the spec changes.
//!
//! - Every request counted by the API's verb and kind ([`ApiServer::requests_of`]), and every
//!   version of an object kept ([`ApiServer::versions_of`]), for a test to read what the clients
//!   asked and wrote.
//!
//! It listens on the loopback of the node netns (where the agent runs) and can stop and start again
//! on the same port, keeping its objects and their history, as a restarted API server does.
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, channel::Channel, combinators::BoxBody};
use hyper::{Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::netns;

/// `(namespace, name)`.
type Key = (String, String);

/// The kinds served: (apiVersion group, kind, plural, namespaced).
const KINDS: &[(&str, &str, &str, bool)] = &[
    ("", "Namespace", "namespaces", false),
    ("", "Pod", "pods", true),
    ("", "Service", "services", true),
    ("", "ConfigMap", "configmaps", true),
    (
        "networking.istio.io",
        "ServiceEntry",
        "serviceentries",
        true,
    ),
    (
        "networking.istio.io",
        "WorkloadEntry",
        "workloadentries",
        true,
    ),
    ("discovery.k8s.io", "EndpointSlice", "endpointslices", true),
    (
        "security.istio.io",
        "AuthorizationPolicy",
        "authorizationpolicies",
        true,
    ),
    (
        "security.istio.io",
        "PeerAuthentication",
        "peerauthentications",
        true,
    ),
    ("coordination.k8s.io", "Lease", "leases", true),
];

const ISTIO: &str = "networking.istio.io";

#[derive(Default)]
struct State {
    /// The last resourceVersion given out.
    rv: u64,
    /// Objects by kind (`group`, `plural`: stored once whatever version is asked), then key.
    objects: BTreeMap<(String, String), BTreeMap<Key, Arc<Stored>>>,
    /// Every change, for watches that resume: (rv, group, plural, type, object).
    history: Vec<Event>,
    /// Watches asking for a version older than this get 410 Gone.
    oldest: u64,
    watches: Vec<Watch>,
    /// Versions of the Istio group served.
    istio_versions: Vec<String>,
    /// Plurals whose list and watch answer 403.
    forbidden: BTreeSet<String>,
    /// Requests seen, `METHOD path?query`, for the tests to check what the client asked.
    requests: Vec<String>,
    /// Requests by the API's verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`) and kind (its plural), counted once the kind is known to be served.
    verbs: BTreeMap<(String, String), usize>,
    /// What was asked as RBAC names it: API group, resource (`plural` or `plural/subresource`) and
    /// verb, for a test to hold against the manifests' roles.
    asked: BTreeSet<(String, String, String)>,
}

/// One change as the watches are told it: the object before (for an update), and after.
struct Event {
    rv: u64,
    group: String,
    plural: String,
    kind: &'static str,
    before: Option<Arc<Stored>>,
    object: Arc<Stored>,
}

/// An object as stored: its JSON, its text as served (written once, as the API server's watch
/// cache keeps it: a list or a watch event copies bytes instead of writing the object again) and
/// the fields a selection reads.
struct Stored {
    value: Value,
    /// The object's JSON text without `apiVersion`, which is the version asked ([`Stored::at`]).
    text: Bytes,
    fields: Fields,
}

/// What a field selector or a namespace reads of an object: a field it does not have (or that
/// is not a string) is `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Fields {
    name: Option<String>,
    namespace: Option<String>,
    node_name: Option<String>,
}

impl Fields {
    fn of(object: &Value) -> Fields {
        let text = |value: &Value| value.as_str().map(str::to_string);
        Fields {
            name: text(&object["metadata"]["name"]),
            namespace: text(&object["metadata"]["namespace"]),
            node_name: text(&object["spec"]["nodeName"]),
        }
    }

    fn get(&self, field: Field) -> Option<&str> {
        match field {
            Field::Name => self.name.as_deref(),
            Field::Namespace => self.namespace.as_deref(),
            Field::NodeName => self.node_name.as_deref(),
        }
    }
}

impl Stored {
    fn new(value: Value) -> Stored {
        let text = match &value {
            Value::Object(fields) => serde_json::to_vec(&WithoutApiVersion(fields)),
            other => serde_json::to_vec(other),
        };
        Stored {
            // Writing a JSON value to memory does not fail (its keys are strings).
            text: Bytes::from(text.unwrap_or_default()),
            fields: Fields::of(&value),
            value,
        }
    }

    /// The object's text as served at `api_version`: `apiVersion` first, then the stored text.
    fn at(&self, api_version: &str, out: &mut Vec<u8>) {
        let Some(rest) = self.text.strip_prefix(b"{") else {
            out.extend_from_slice(&self.text);
            return;
        };
        out.extend_from_slice(b"{\"apiVersion\":");
        out.extend_from_slice(Value::from(api_version).to_string().as_bytes());
        if rest != b"}" {
            out.push(b',');
        }
        out.extend_from_slice(rest);
    }

    fn served(&self, api_version: &str) -> Bytes {
        let mut out = Vec::with_capacity(self.text.len() + 64);
        self.at(api_version, &mut out);
        Bytes::from(out)
    }
}

/// An object's fields but `apiVersion`, written as the object itself would be.
struct WithoutApiVersion<'a>(&'a serde_json::Map<String, Value>);

impl serde::Serialize for WithoutApiVersion<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in self.0.iter().filter(|(k, _)| *k != "apiVersion") {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A `fieldSelector`: every term must hold.
#[derive(Debug, Clone, Default)]
struct FieldSelector {
    /// (field, must equal (else must differ), value).
    terms: Vec<(Field, bool, String)>,
}

/// A field a selector may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Namespace,
    NodeName,
}

impl FieldSelector {
    /// `None`: a field the server does not filter on (the API answers 400).
    fn parse(text: &str) -> Option<FieldSelector> {
        let mut terms = Vec::new();
        for term in text.split(',').filter(|t| !t.is_empty()) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else {
                let (f, v) = term.split_once('=')?;
                (f, true, v)
            };
            let field = match field {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
                "spec.nodeName" => Field::NodeName,
                _ => return None,
            };
            terms.push((field, equal, value.to_string()));
        }
        Some(FieldSelector { terms })
    }

    /// A field the object does not have reads as empty, as the API's field sets do.
    fn matches(&self, object: &Fields) -> bool {
        self.terms.iter().all(|(field, equal, value)| {
            let got = object.get(*field).unwrap_or("");
            (got == value) == *equal
        })
    }
}

struct Watch {
    group: String,
    plural: String,
    namespace: Option<String>,
    fields: FieldSelector,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Line>,
}

/// What a watch sends, written out at the version the watch asked for.
enum Line {
    /// An event of this type about this object.
    Event(&'static str, Arc<Stored>),
    /// A `BOOKMARK` at this version.
    Bookmark(u64),
    /// Sent as it is (an `ERROR`).
    Raw(Bytes),
}

impl Watch {
    fn wants(&self, group: &str, plural: &str, object: &Fields) -> bool {
        self.group == group
            && self.plural == plural
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| object.namespace.as_deref() == Some(ns))
            && self.fields.matches(object)
    }

    /// What this watch is told of `event`, if anything: an update that brings the object into
    /// its selection is an addition, one that takes it out a deletion.
    fn sees(&self, event: &Event) -> Option<&'static str> {
        let now = self.wants(&event.group, &event.plural, &event.object.fields);
        let was = event
            .before
            .as_ref()
            .is_some_and(|b| self.wants(&event.group, &event.plural, &b.fields));
        match (event.kind, was, now) {
            ("MODIFIED", true, true) => Some("MODIFIED"),
            ("MODIFIED", false, true) => Some("ADDED"),
            ("MODIFIED", true, false) => Some("DELETED"),
            ("MODIFIED", false, false) => None,
            (kind, _, true) => Some(kind),
            _ => None,
        }
    }
}

/// The running (or stopped) server. Dropping it stops it.
pub struct ApiServer {
    state: Arc<Mutex<State>>,
    netns: String,
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl ApiServer {
    /// Starts on a free port of the loopback of netns `netns`, serving `networking.istio.io/v1`.
    pub fn start(netns: &str) -> Result<ApiServer> {
        let state = State {
            rv: 1,
            istio_versions: vec!["v1".into()],
            ..State::default()
        };
        let mut server = ApiServer {
            state: Arc::new(Mutex::new(state)),
            netns: netns.to_string(),
            addr: "127.0.0.1:0".parse()?,
            runtime: None,
        };
        server.resume()?;
        Ok(server)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig pointing at this server, written to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<PathBuf> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"http://{}\"}}\nusers:\n- name: agent\n  user: {{token: test-token}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: agent}}\ncurrent-context: test\n",
            self.addr
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_path_buf())
    }

    /// Stops serving: the listener closes and every open watch is cut. Objects are kept.
    pub fn stop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            self.state().watches.clear();
            rt.shutdown_background();
        }
    }

    /// Serves again on the same port.
    pub fn resume(&mut self) -> Result<()> {
        if self.runtime.is_some() {
            return Ok(());
        }
        let addr = self.addr;
        let listener = netns::in_netns(&self.netns, move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(l)
        })?
        .context("binding the test API server")?;
        self.addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .thread_name("test-apiserver")
            .build()?;
        let state = self.state.clone();
        rt.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((stream, _)) = listener.accept().await {
                let state = state.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(&state, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        self.runtime = Some(rt);
        Ok(())
    }

    /// Adds or replaces an object (`apiVersion`, `kind`, `metadata` set), as `kubectl apply` would.
    pub fn put(&self, object: Value) -> Result<()> {
        let (group, plural, namespaced) = kind_of(&object)?;
        let mut object = object;
        let namespace = match namespaced {
            true => object["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string(),
            false => String::new(),
        };
        if namespaced {
            object["metadata"]["namespace"] = Value::from(namespace.clone());
        }
        let name = object["metadata"]["name"]
            .as_str()
            .context("an object without metadata.name")?
            .to_string();
        self.state()
            .store(&group, &plural, (namespace, name), object, Write::Object);
        Ok(())
    }

    /// Writes an object's status as controller `manager` does (through the status subresource).
    pub fn put_status(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        status: Value,
        manager: &str,
    ) -> Result<()> {
        let (group, _, plural, _) = KINDS
            .iter()
            .find(|k| k.1 == kind)
            .with_context(|| format!("the test server serves no kind {kind}"))?;
        let mut state = self.state();
        let key = (namespace.to_string(), name.to_string());
        let mut object = state
            .objects
            .get(&(group.to_string(), plural.to_string()))
            .and_then(|o| o.get(&key))
            .map(|stored| stored.value.clone())
            .with_context(|| format!("no {kind} {namespace}/{name}"))?;
        object["status"] = status;
        state.store(
            group,
            plural,
            key,
            object,
            Write::Status(manager.to_string()),
        );
        Ok(())
    }

    /// Deletes an object; false when there was none.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Result<bool> {
        let (group, _, plural, namespaced) = KINDS
            .iter()
            .find(|k| k.1 == kind)
            .with_context(|| format!("the test server serves no kind {kind}"))?;
        let ns = if *namespaced { namespace } else { "" };
        let mut state = self.state();
        let removed = state
            .objects
            .get_mut(&(group.to_string(), plural.to_string()))
            .and_then(|o| o.remove(&(ns.to_string(), name.to_string())));
        let Some(removed) = removed else {
            return Ok(false);
        };
        state.rv += 1;
        let rv = state.rv;
        let mut object = removed.value.clone();
        object["metadata"]["resourceVersion"] = Value::from(rv.to_string());
        state.publish(
            rv,
            group,
            plural,
            "DELETED",
            None,
            Arc::new(Stored::new(object)),
        );
        Ok(true)
    }

    /// The object stored, if any.
    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let (group, _, plural, namespaced) = KINDS.iter().find(|k| k.1 == kind)?;
        let ns = if *namespaced { namespace } else { "" };
        self.state()
            .objects
            .get(&(group.to_string(), plural.to_string()))?
            .get(&(ns.to_string(), name.to_string()))
            .map(|stored| stored.value.clone())
    }

    /// Every version of one object written since the start (or the last
    /// [`ApiServer::expire_watches`]), oldest first; a deletion is not one.
    pub fn versions_of(&self, kind: &str, namespace: &str, name: &str) -> Vec<Value> {
        let Some((group, _, plural, namespaced)) = KINDS.iter().find(|k| k.1 == kind) else {
            return Vec::new();
        };
        let ns = if *namespaced { namespace } else { "" };
        self.state()
            .history
            .iter()
            .filter(|e| e.group == *group && e.plural == *plural && e.kind != "DELETED")
            .filter(|e| {
                let m = &e.object.value["metadata"];
                m["name"] == name && (ns.is_empty() || m["namespace"] == ns)
            })
            .map(|e| e.object.value.clone())
            .collect()
    }

    /// Makes the server forget its history, as etcd compaction does: every open watch gets an
    /// `ERROR` event with code 410 and ends, and a watch resuming from before now gets the same.
    pub fn expire_watches(&self) {
        let mut state = self.state();
        // A watch from the current version misses nothing; one from before it is too old.
        state.oldest = state.rv;
        state.history.clear();
        for w in state.watches.drain(..) {
            let _ = w.tx.send(Line::Raw(gone()));
        }
    }

    /// Sends a `BOOKMARK` at the current version to every watch that allows them.
    pub fn bookmark(&self) {
        let state = self.state();
        let rv = state.rv;
        for w in &state.watches {
            if w.bookmarks {
                let _ = w.tx.send(Line::Bookmark(rv));
            }
        }
    }

    /// The versions of `networking.istio.io` served (none: the CRDs are not installed).
    pub fn serve_istio_versions(&self, versions: &[&str]) {
        self.state().istio_versions = versions.iter().map(|v| v.to_string()).collect();
    }

    /// Makes list and watch of `plural` answer 403, as RBAC does without a rule for it.
    pub fn forbid(&self, plural: &str) {
        self.state().forbidden.insert(plural.to_string());
    }

    /// Requests seen so far, `GET path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.state().requests.clone()
    }

    /// Requests seen so far of `verb` (`get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`) on the kind `plural`.
    pub fn requests_of(&self, verb: &str, plural: &str) -> usize {
        let state = self.state();
        let key = (verb.to_string(), plural.to_string());
        state.verbs.get(&key).copied().unwrap_or(0)
    }

    /// Every (API group, resource, verb) asked so far, as RBAC rules name them.
    pub fn asked(&self) -> BTreeSet<(String, String, String)> {
        self.state().asked.clone()
    }

    /// Every request of the kind `plural` seen so far, by verb.
    pub fn verbs_of(&self, plural: &str) -> BTreeMap<String, usize> {
        self.state()
            .verbs
            .iter()
            .filter(|((_, p), _)| p == plural)
            .map(|((verb, _), n)| (verb.clone(), *n))
            .collect()
    }

    /// Makes the objects served those of the manifests in `dir` (every `.yaml`): adds, changes and
    /// deletes what differs, one event each. An IstioOperator's `spec.meshConfig` is served as the
    /// ConfigMap `istio-system/istio`, key `mesh`, as an Istio install writes it.
    pub fn sync_dir(&self, dir: &Path) -> Result<usize> {
        let wanted = read_manifests(dir)?;
        let mut changes = 0;
        let current: Vec<(String, String, String)> = {
            let state = self.state();
            state
                .objects
                .iter()
                .flat_map(|((group, plural), objects)| {
                    objects.keys().map(move |(ns, name)| {
                        let kind = KINDS
                            .iter()
                            .find(|k| k.0 == group && k.2 == plural)
                            .map_or("", |k| k.1);
                        (kind.to_string(), ns.clone(), name.clone())
                    })
                })
                .collect()
        };
        for (kind, ns, name) in current {
            let present = wanted.iter().any(|o| {
                o["kind"] == kind.as_str()
                    && o["metadata"]["name"] == name.as_str()
                    && (ns.is_empty() || o["metadata"]["namespace"] == ns.as_str())
            });
            if !present && self.delete(&kind, &ns, &name)? {
                changes += 1;
            }
        }
        for object in wanted {
            let kind = object["kind"].as_str().unwrap_or_default().to_string();
            let ns = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let same = self.get(&kind, &ns, &name).is_some_and(|mut old| {
                old["metadata"]
                    .as_object_mut()
                    .map(|m| m.remove("resourceVersion"));
                old == object
            });
            if !same {
                self.put(object)?;
                changes += 1;
            }
        }
        Ok(changes)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How an object is written: through the object (its status kept) or through its status.
enum Write {
    Object,
    /// By this field manager.
    Status(String),
}

impl State {
    /// Stores `object` under `key` at a new version and tells the watches; returns what is stored.
    fn store(
        &mut self,
        group: &str,
        plural: &str,
        key: Key,
        object: Value,
        write: Write,
    ) -> Arc<Stored> {
        let mut object = object;
        self.rv += 1;
        let rv = self.rv;
        let objects = self
            .objects
            .entry((group.to_string(), plural.to_string()))
            .or_default();
        let before = objects.get(&key).map(|b| &b.value);
        let generation = before.and_then(|b| b["metadata"]["generation"].as_i64());
        match &write {
            Write::Object => {
                if let Some(before) = before
                    && plural == "serviceentries"
                {
                    object["status"] = before["status"].clone();
                    object["metadata"]["managedFields"] =
                        before["metadata"]["managedFields"].clone();
                }
                let spec_changed = before.is_none_or(|b| b["spec"] != object["spec"]);
                let generation = generation.unwrap_or(0) + i64::from(spec_changed);
                object["metadata"]["generation"] = Value::from(generation.max(1));
            }
            Write::Status(manager) => set_status_manager(&mut object, manager),
        }
        object["metadata"]["resourceVersion"] = Value::from(rv.to_string());
        let stored = Arc::new(Stored::new(object));
        let before = objects.insert(key, stored.clone());
        let event = match before {
            Some(_) => "MODIFIED",
            None => "ADDED",
        };
        self.publish(rv, group, plural, event, before, stored.clone());
        stored
    }

    fn publish(
        &mut self,
        rv: u64,
        group: &str,
        plural: &str,
        kind: &'static str,
        before: Option<Arc<Stored>>,
        object: Arc<Stored>,
    ) {
        let event = Event {
            rv,
            group: group.to_string(),
            plural: plural.to_string(),
            kind,
            before,
            object,
        };
        self.watches.retain(|w| match w.sees(&event) {
            Some(kind) => w.tx.send(Line::Event(kind, event.object.clone())).is_ok(),
            None => true,
        });
        self.history.push(event);
    }
}

/// Records `manager` as the writer of the object's status conditions, as the API server's
/// managed fields do: whoever writes an atomic list owns it alone.
fn set_status_manager(object: &mut Value, manager: &str) {
    let mut fields: Vec<Value> = object["metadata"]["managedFields"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for entry in fields.iter_mut() {
        if let Some(status) = entry["fieldsV1"]["f:status"].as_object_mut() {
            status.remove("f:conditions");
        }
    }
    fields.retain(|e| !(e["manager"] == manager && e["subresource"] == "status"));
    fields.push(
        json!({"manager": manager, "operation": "Update", "subresource": "status",
                       "fieldsV1": {"f:status": {"f:conditions": {}}}}),
    );
    object["metadata"]["managedFields"] = Value::Array(fields);
}

/// RFC 7386: `patch` merged into `target` (objects merged key by key, `null` removes, anything
/// else replaces).
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// `(group, plural, namespaced)` of an object, from its `apiVersion` and `kind`.
fn kind_of(object: &Value) -> Result<(String, String, bool)> {
    let api_version = object["apiVersion"].as_str().unwrap_or("v1");
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let kind = object["kind"].as_str().unwrap_or_default();
    match KINDS.iter().find(|k| k.0 == group && k.1 == kind) {
        Some((group, _, plural, namespaced)) => {
            Ok((group.to_string(), plural.to_string(), *namespaced))
        }
        None => bail!("the test server serves no {api_version} {kind}"),
    }
}

/// One line of a watch: `type` first, as the API server writes it (a client reads the object
/// knowing its type).
fn event_line(event: &str, object: &[u8]) -> Bytes {
    let mut line = Vec::with_capacity(object.len() + 32);
    line.extend_from_slice(b"{\"type\":");
    line.extend_from_slice(Value::from(event).to_string().as_bytes());
    line.extend_from_slice(b",\"object\":");
    line.extend_from_slice(object);
    line.extend_from_slice(b"}\n");
    Bytes::from(line)
}

fn gone() -> Bytes {
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version", "reason": "Expired", "code": 410
    });
    event_line("ERROR", status.to_string().as_bytes())
}

/// A `BOOKMARK` of `kind` at version `rv`, served at `api_version`.
fn bookmark(api_version: &str, kind: &str, rv: u64) -> Bytes {
    let object = json!({"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv.to_string()}});
    event_line("BOOKMARK", object.to_string().as_bytes())
}

/// A watch's line as served at `api_version`.
fn written(line: Line, api_version: &str, kind: &str) -> Bytes {
    match line {
        Line::Event(event, object) => {
            let mut text = Vec::with_capacity(object.text.len() + 64);
            object.at(api_version, &mut text);
            event_line(event, &text)
        }
        Line::Bookmark(rv) => bookmark(api_version, kind, rv),
        Line::Raw(line) => line,
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, body: Value) -> Response<Body> {
    full_text(status, Bytes::from(body.to_string()))
}

fn full_text(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut r = Response::new(Full::new(body).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn status(code: StatusCode, reason: &str, message: String) -> Response<Body> {
    full(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

async fn handle(state: &Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .map(|q| form_pairs(q).into_iter().collect())
        .unwrap_or_default();
    lock(state).requests.push(format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map_or("", |p| p.as_str())
    ));
    let method = req.method().clone();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/..., /apis/GROUP/VERSION/...
    let (group, version, rest) = match parts.as_slice() {
        ["api"] => {
            return full(
                StatusCode::OK,
                json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
            );
        }
        ["apis"] => return group_list(state),
        ["api", "v1"] => return discovery(state, "", "v1"),
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version] => return discovery(state, group, version),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("no route {path}"),
            );
        }
    };
    // A collection (cluster-wide or in a namespace), or one object, or one object's status.
    let (namespace, plural, one, sub) = match rest {
        [plural] => (None, *plural, None, None),
        ["namespaces", ns, plural] => (Some(ns.to_string()), *plural, None, None),
        [plural, name] => (None, *plural, Some(*name), None),
        ["namespaces", ns, plural, name] => (Some(ns.to_string()), *plural, Some(*name), None),
        ["namespaces", ns, plural, name, sub] => {
            (Some(ns.to_string()), *plural, Some(*name), Some(*sub))
        }
        _ => {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("no route {path}"),
            );
        }
    };
    if group == ISTIO && !lock(state).istio_versions.iter().any(|v| v == version) {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource".into(),
        );
    }
    if !KINDS.iter().any(|k| k.0 == group && k.2 == plural) {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no resource {plural}"),
        );
    }
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = verb_of(&method, one.is_some(), watching);
    {
        let mut state = lock(state);
        *state
            .verbs
            .entry((verb.to_string(), plural.to_string()))
            .or_default() += 1;
        let resource = match sub {
            Some(sub) => format!("{plural}/{sub}"),
            None => plural.to_string(),
        };
        state
            .asked
            .insert((group.to_string(), resource, verb.to_string()));
    }
    let api_version = match group {
        "" => "v1".to_string(),
        g => format!("{g}/{version}"),
    };
    let body = match method {
        hyper::Method::GET => Bytes::new(),
        _ => match req.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    format!("reading the body: {e}"),
                );
            }
        },
    };
    let target = Target {
        group,
        plural,
        api_version: &api_version,
        namespace: namespace.as_deref().unwrap_or(""),
    };
    if let Some(name) = one {
        return one_object(state, &method, &target, name, sub, &query, &body);
    }
    if method == hyper::Method::POST {
        return create(state, &target, &body);
    }
    if lock(state).forbidden.contains(plural) {
        let group_shown = if group.is_empty() { "\"\"" } else { group };
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "{plural} is forbidden: User \"system:serviceaccount:kube-system:redirect\" cannot {verb} resource \"{plural}\" in API group {group_shown} at the cluster scope"
            ),
        );
    }
    let fields = match query.get("fieldSelector").map(|f| FieldSelector::parse(f)) {
        None => FieldSelector::default(),
        Some(Some(fields)) => fields,
        Some(None) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!(
                    "field label not supported: {}",
                    query.get("fieldSelector").map_or("", String::as_str)
                ),
            );
        }
    };
    let selects = |object: &Fields| {
        namespace
            .as_deref()
            .is_none_or(|ns| object.namespace.as_deref() == Some(ns))
            && fields.matches(object)
    };
    let kind = KINDS
        .iter()
        .find(|k| k.0 == group && k.2 == plural)
        .map_or("", |k| k.1);
    if !watching {
        let st = lock(state);
        // Pages of `limit` items; `continue` is `<list version>/<namespace>/<name>` of the last
        // item given, and every page carries the version of the first, as one consistent list
        // does. A page starts where the last ended: a list costs its items, not items x pages.
        let (rv, after) = match query
            .get("continue")
            .map(|c| c.splitn(3, '/').collect::<Vec<_>>())
        {
            Some(parts) => match parts.as_slice() {
                [rv, ns, name] => match rv.parse() {
                    Ok(rv) => (rv, Some((ns.to_string(), name.to_string()))),
                    Err(_) => (st.rv, None),
                },
                _ => (st.rv, None),
            },
            None => (st.rv, None),
        };
        let limit = query
            .get("limit")
            .and_then(|l| l.parse().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let empty = BTreeMap::new();
        let all = st
            .objects
            .get(&(group.to_string(), plural.to_string()))
            .unwrap_or(&empty);
        let start = match &after {
            Some(key) => std::ops::Bound::Excluded(key),
            None => std::ops::Bound::Unbounded,
        };
        let mut page = all
            .range::<Key, _>((start, std::ops::Bound::Unbounded))
            .filter(|(_, o)| selects(&o.fields));
        let chosen: Vec<(&Key, &Arc<Stored>)> = page.by_ref().take(limit).collect();
        let more = page.next().is_some();
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if more && let Some(((ns, name), _)) = chosen.last() {
            metadata["continue"] = Value::from(format!("{rv}/{ns}/{name}"));
        }
        let items: Vec<&Stored> = chosen.into_iter().map(|(_, o)| &**o).collect();
        return full_text(
            StatusCode::OK,
            list_text(&api_version, kind, &metadata, &items),
        );
    }

    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let (tx, mut rx) = mpsc::unbounded_channel();
    {
        let mut st = lock(state);
        if from != 0 && from < st.oldest {
            let _ = tx.send(Line::Raw(gone()));
        } else {
            let watch = Watch {
                group: group.to_string(),
                plural: plural.to_string(),
                namespace: namespace.clone(),
                fields: fields.clone(),
                bookmarks,
                tx,
            };
            for event in st.history.iter().filter(|e| e.rv > from) {
                if let Some(kind) = watch.sees(event) {
                    let _ = watch.tx.send(Line::Event(kind, event.object.clone()));
                }
            }
            if bookmarks {
                let _ = watch.tx.send(Line::Bookmark(st.rv));
            }
            st.watches.push(watch);
        }
    }
    let (mut sender, body) = Channel::<Bytes, Infallible>::new(16);
    tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            // Objects are stored at one version; each line is written at the one asked.
            if sender
                .send_data(written(line, &api_version, kind))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let mut r = Response::new(body.boxed());
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The API's verb for a request: what RBAC would check it as.
fn verb_of(method: &hyper::Method, one: bool, watching: bool) -> &'static str {
    match (method, one) {
        (&hyper::Method::GET, true) => "get",
        (&hyper::Method::GET, false) if watching => "watch",
        (&hyper::Method::GET, false) => "list",
        (&hyper::Method::POST, _) => "create",
        (&hyper::Method::PUT, _) => "update",
        (&hyper::Method::PATCH, _) => "patch",
        (&hyper::Method::DELETE, _) => "delete",
        _ => "other",
    }
}

/// A list of `kind` at `api_version`: the items' stored text, each at that version, one after the
/// other; no object is written again.
fn list_text(api_version: &str, kind: &str, metadata: &Value, items: &[&Stored]) -> Bytes {
    let head =
        json!({"apiVersion": api_version, "kind": format!("{kind}List"), "metadata": metadata})
            .to_string();
    let size: usize = items.iter().map(|o| o.text.len() + 64).sum();
    let mut body = Vec::with_capacity(head.len() + size + 16);
    body.extend_from_slice(head.strip_suffix('}').unwrap_or(&head).as_bytes());
    body.extend_from_slice(b",\"items\":[");
    for (i, object) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        object.at(api_version, &mut body);
    }
    body.extend_from_slice(b"]}");
    Bytes::from(body)
}

/// Where a request goes: the kind's group and plural, the version asked, the namespace (empty for
/// a cluster-wide request or a cluster-scoped kind).
struct Target<'a> {
    group: &'a str,
    plural: &'a str,
    api_version: &'a str,
    namespace: &'a str,
}

fn not_found(target: &Target<'_>, name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", target.plural),
    )
}

fn conflict(target: &Target<'_>, name: &str) -> Response<Body> {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
            target.plural
        ),
    )
}

fn bad_body(e: serde_json::Error) -> Response<Body> {
    status(
        StatusCode::BAD_REQUEST,
        "BadRequest",
        format!("the body is not JSON: {e}"),
    )
}

/// `GET`, `PUT` or `PATCH .../status` of one object.
fn one_object(
    state: &Mutex<State>,
    method: &hyper::Method,
    target: &Target<'_>,
    name: &str,
    sub: Option<&str>,
    query: &BTreeMap<String, String>,
    body: &Bytes,
) -> Response<Body> {
    let kind = (target.group.to_string(), target.plural.to_string());
    let key = (target.namespace.to_string(), name.to_string());
    let mut st = lock(state);
    let Some(current) = st.objects.get(&kind).and_then(|o| o.get(&key)).cloned() else {
        return not_found(target, name);
    };
    let at_version = |object: &Stored| full_text(StatusCode::OK, object.served(target.api_version));
    let stale = |sent: &Value| {
        sent["metadata"]["resourceVersion"]
            .as_str()
            .is_some_and(|rv| current.value["metadata"]["resourceVersion"] != rv)
    };
    match (method, sub) {
        (&hyper::Method::GET, None | Some("status")) => at_version(&current),
        (&hyper::Method::PUT, None) => {
            let sent: Value = match serde_json::from_slice(body) {
                Ok(sent) => sent,
                Err(e) => return bad_body(e),
            };
            if stale(&sent) {
                return conflict(target, name);
            }
            let stored = st.store(target.group, target.plural, key, sent, Write::Object);
            at_version(&stored)
        }
        (&hyper::Method::PATCH, Some("status")) => {
            let patch: Value = match serde_json::from_slice(body) {
                Ok(patch) => patch,
                Err(e) => return bad_body(e),
            };
            if stale(&patch) {
                return conflict(target, name);
            }
            let mut object = current.value.clone();
            merge_patch(&mut object["status"], &patch["status"]);
            let manager = query
                .get("fieldManager")
                .cloned()
                .unwrap_or_else(|| "unknown".into());
            let stored = st.store(
                target.group,
                target.plural,
                key,
                object,
                Write::Status(manager),
            );
            at_version(&stored)
        }
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} is not served here"),
        ),
    }
}

/// `POST` to a collection: a new object, 409 when one of that name exists.
fn create(state: &Mutex<State>, target: &Target<'_>, body: &Bytes) -> Response<Body> {
    let mut object: Value = match serde_json::from_slice(body) {
        Ok(object) => object,
        Err(e) => return bad_body(e),
    };
    let Some(name) = object["metadata"]["name"].as_str().map(str::to_string) else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value".into(),
        );
    };
    if !target.namespace.is_empty() {
        object["metadata"]["namespace"] = Value::from(target.namespace);
    }
    let kind = (target.group.to_string(), target.plural.to_string());
    let key = (target.namespace.to_string(), name.clone());
    let mut st = lock(state);
    if st.objects.get(&kind).is_some_and(|o| o.contains_key(&key)) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", target.plural),
        );
    }
    let stored = st.store(target.group, target.plural, key, object, Write::Object);
    full_text(StatusCode::CREATED, stored.served(target.api_version))
}

/// The versions of a group served: the Istio group's as the test says, every other group's `v1`.
fn versions_of(state: &Mutex<State>, group: &str) -> Vec<String> {
    match group {
        ISTIO => lock(state).istio_versions.clone(),
        _ => vec!["v1".into()],
    }
}

/// `/apis`: every group with a kind served.
fn group_list(state: &Mutex<State>) -> Response<Body> {
    let groups: BTreeSet<&str> = KINDS
        .iter()
        .map(|k| k.0)
        .filter(|g| !g.is_empty())
        .collect();
    let groups: Vec<Value> = groups
        .into_iter()
        .filter_map(|group| {
            let versions: Vec<Value> = versions_of(state, group)
                .into_iter()
                .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
                .collect();
            let preferred = versions.first()?.clone();
            Some(json!({"name": group, "versions": versions, "preferredVersion": preferred}))
        })
        .collect();
    full(
        StatusCode::OK,
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
    )
}

/// `/api/v1`, `/apis/GROUP/VERSION`: the resources of that group, when that version is served.
fn discovery(state: &Mutex<State>, group: &str, version: &str) -> Response<Body> {
    let served = KINDS.iter().any(|k| k.0 == group)
        && versions_of(state, group).iter().any(|v| v == version);
    if !served {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource".into(),
        );
    }
    let resources: Vec<Value> = KINDS
        .iter()
        .filter(|k| k.0 == group)
        .flat_map(|(_, kind, plural, namespaced)| {
            let verbs = [
                "get", "list", "watch", "create", "update", "patch", "delete",
            ];
            let mut resources = vec![json!({"name": plural, "singularName": kind.to_lowercase(),
                   "namespaced": namespaced, "kind": kind, "verbs": verbs})];
            if *plural == "serviceentries" {
                resources.push(
                    json!({"name": format!("{plural}/status"), "singularName": "",
                   "namespaced": namespaced, "kind": kind, "verbs": ["get", "patch", "update"]}),
                );
            }
            resources
        })
        .collect();
    let group_version = match group {
        "" => version.to_string(),
        g => format!("{g}/{version}"),
    };
    full(
        StatusCode::OK,
        json!({"kind": "APIResourceList", "apiVersion": "v1",
               "groupVersion": group_version, "resources": resources}),
    )
}

fn form_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Some((decode(k)?, decode(v)?))
        })
        .collect()
}

fn decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The objects of every `.yaml` in `dir`, as JSON, with the mesh config as its ConfigMap.
pub fn read_manifests(dir: &Path) -> Result<Vec<Value>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut objects = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc)
                .with_context(|| format!("reading {}", file.display()))?;
            if value.is_null() {
                continue;
            }
            objects.push(as_served(value)?);
        }
    }
    Ok(objects)
}

/// An IstioOperator becomes the ConfigMap Istio's installer writes; other objects are served as is.
fn as_served(object: Value) -> Result<Value> {
    if object["kind"] == "IstioOperator" {
        let mesh = serde_yaml_ng::to_string(&object["spec"]["meshConfig"])?;
        return Ok(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "istio", "namespace": "istio-system"},
            "data": {"mesh": mesh}
        }));
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(node: &str) -> Value {
        json!({"metadata": {"name": "p", "namespace": "a"}, "spec": {"nodeName": node}})
    }

    fn stored(object: Value) -> Arc<Stored> {
        Arc::new(Stored::new(object))
    }

    fn watch(selector: &str) -> Watch {
        Watch {
            group: String::new(),
            plural: "pods".into(),
            namespace: None,
            fields: FieldSelector::parse(selector).unwrap(),
            bookmarks: false,
            tx: mpsc::unbounded_channel().0,
        }
    }

    fn moved(before: Option<Value>, after: Value) -> Event {
        let (before, after) = (before.map(stored), stored(after));
        Event {
            rv: 1,
            group: String::new(),
            plural: "pods".into(),
            kind: if before.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            },
            before,
            object: after,
        }
    }

    #[test]
    fn a_list_is_its_items_stored_text_at_the_version_asked() {
        let entry = json!({"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
                           "metadata": {"name": "e", "namespace": "a", "resourceVersion": "7"},
                           "spec": {"hosts": ["e.example.com"], "ports": [{"number": 443}]}});
        let bare = json!({"apiVersion": "networking.istio.io/v1"});
        let (one, two) = (Stored::new(entry.clone()), Stored::new(bare));
        let metadata = json!({"resourceVersion": "9", "continue": "9/a/e"});
        let text = list_text(
            "networking.istio.io/v1beta1",
            "ServiceEntry",
            &metadata,
            &[&one, &two],
        );
        let list: Value = serde_json::from_slice(&text).unwrap();
        let mut served = entry;
        served["apiVersion"] = json!("networking.istio.io/v1beta1");
        assert_eq!(
            list,
            json!({"apiVersion": "networking.istio.io/v1beta1", "kind": "ServiceEntryList",
                   "metadata": metadata,
                   "items": [served, {"apiVersion": "networking.istio.io/v1beta1"}]})
        );
        let empty = list_text("v1", "Pod", &metadata, &[]);
        let empty: Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(empty["items"], json!([]));
        assert_eq!(empty["kind"], "PodList");
    }

    #[test]
    fn a_watch_line_gives_its_type_first_and_the_object_at_the_version_asked() {
        let object = stored(json!({"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": "p", "namespace": "a"}}));
        let line = written(Line::Event("ADDED", object), "v2", "Pod");
        let text = std::str::from_utf8(&line).unwrap();
        assert!(
            text.starts_with("{\"type\":\"ADDED\",\"object\":"),
            "{text}"
        );
        assert!(text.ends_with('\n'));
        let event: Value = serde_json::from_str(text).unwrap();
        assert_eq!(
            event["object"],
            json!({"apiVersion": "v2", "kind": "Pod", "metadata": {"name": "p", "namespace": "a"}})
        );
        let event: Value =
            serde_json::from_slice(&written(Line::Bookmark(5), "v2", "Pod")).unwrap();
        assert_eq!(
            event,
            json!({"type": "BOOKMARK", "object": {"apiVersion": "v2", "kind": "Pod",
                                                  "metadata": {"resourceVersion": "5"}}})
        );
    }

    #[test]
    fn field_selectors_match_as_the_api_server_does() {
        let f = FieldSelector::parse("spec.nodeName!=n1,metadata.namespace=a").unwrap();
        assert!(f.matches(&Fields::of(&pod("n2"))));
        assert!(!f.matches(&Fields::of(&pod("n1"))));
        // A Pod not yet scheduled has no node: it matches `!=` and not `=`.
        let unscheduled = json!({"metadata": {"name": "p", "namespace": "a"}});
        let unscheduled = Fields::of(&unscheduled);
        assert!(f.matches(&unscheduled));
        assert!(
            !FieldSelector::parse("spec.nodeName==n1")
                .unwrap()
                .matches(&unscheduled)
        );
        assert!(FieldSelector::parse("status.phase=Running").is_none());
    }

    #[test]
    fn an_object_entering_or_leaving_a_watchs_selection_is_added_or_deleted_there() {
        let here = watch("spec.nodeName=n1");
        let elsewhere = watch("spec.nodeName!=n1");
        // Bound to n1 after waiting unscheduled.
        let bound = moved(Some(pod("")), pod("n1"));
        assert_eq!(here.sees(&bound), Some("ADDED"));
        assert_eq!(elsewhere.sees(&bound), Some("DELETED"));
        let relabelled = moved(Some(pod("n1")), pod("n1"));
        assert_eq!(here.sees(&relabelled), Some("MODIFIED"));
        assert_eq!(elsewhere.sees(&relabelled), None);
        assert_eq!(here.sees(&moved(None, pod("n2"))), None);
        assert_eq!(elsewhere.sees(&moved(None, pod("n2"))), Some("ADDED"));
    }
}
