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
//!   `/apis`, `/api/v1`, `/apis/<group>/v1`).
//! - One object: `GET`; `POST` (create, 409 when it exists); `PUT` (replace, 409 when the
//!   `resourceVersion` sent is not the current one); `PATCH .../status` with a JSON merge patch (409
//!   on a stale `metadata.resourceVersion`), recorded in `managedFields` under the `fieldManager`
//!   asked. An update of a ServiceEntry through the object keeps its status, as the API does for a
//!   kind with a status subresource, and moves `metadata.generation` when the spec changes.
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
    ("coordination.k8s.io", "Lease", "leases", true),
];

const ISTIO: &str = "networking.istio.io";

#[derive(Default)]
struct State {
    /// The last resourceVersion given out.
    rv: u64,
    /// Objects by kind (`group`, `plural`: stored once whatever version is asked), then key.
    objects: BTreeMap<(String, String), BTreeMap<Key, Value>>,
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
}

/// One change as the watches are told it: the object before (for an update), and after.
struct Event {
    rv: u64,
    group: String,
    plural: String,
    kind: &'static str,
    before: Option<Value>,
    object: Value,
}

/// A `fieldSelector`: every term must hold.
#[derive(Debug, Clone, Default)]
struct FieldSelector {
    /// (JSON pointer, must equal (else must differ), value).
    terms: Vec<(&'static str, bool, String)>,
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
            let pointer = match field {
                "metadata.name" => "/metadata/name",
                "metadata.namespace" => "/metadata/namespace",
                "spec.nodeName" => "/spec/nodeName",
                _ => return None,
            };
            terms.push((pointer, equal, value.to_string()));
        }
        Some(FieldSelector { terms })
    }

    /// A field the object does not have reads as empty, as the API's field sets do.
    fn matches(&self, object: &Value) -> bool {
        self.terms.iter().all(|(pointer, equal, value)| {
            let got = object
                .pointer(pointer)
                .and_then(Value::as_str)
                .unwrap_or("");
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
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Watch {
    fn wants(&self, group: &str, plural: &str, object: &Value) -> bool {
        self.group == group
            && self.plural == plural
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| object["metadata"]["namespace"] == ns)
            && self.fields.matches(object)
    }

    /// What this watch is told of `event`, if anything: an update that brings the object into
    /// its selection is an addition, one that takes it out a deletion.
    fn sees(&self, event: &Event) -> Option<&'static str> {
        let now = self.wants(&event.group, &event.plural, &event.object);
        let was = event
            .before
            .as_ref()
            .is_some_and(|b| self.wants(&event.group, &event.plural, b));
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
            .cloned()
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
        let Some(mut object) = removed else {
            return Ok(false);
        };
        state.rv += 1;
        let rv = state.rv;
        object["metadata"]["resourceVersion"] = Value::from(rv.to_string());
        state.publish(rv, group, plural, "DELETED", None, object);
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
            .cloned()
    }

    /// Makes the server forget its history, as etcd compaction does: every open watch gets an
    /// `ERROR` event with code 410 and ends, and a watch resuming from before now gets the same.
    pub fn expire_watches(&self) {
        let mut state = self.state();
        // A watch from the current version misses nothing; one from before it is too old.
        state.oldest = state.rv;
        state.history.clear();
        for w in state.watches.drain(..) {
            let _ = w.tx.send(gone());
        }
    }

    /// Sends a `BOOKMARK` at the current version to every watch that allows them.
    pub fn bookmark(&self) {
        let state = self.state();
        let rv = state.rv;
        for w in &state.watches {
            if w.bookmarks {
                let _ = w.tx.send(bookmark(&w.group, &w.plural, rv));
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
    fn store(&mut self, group: &str, plural: &str, key: Key, object: Value, write: Write) -> Value {
        let mut object = object;
        self.rv += 1;
        let rv = self.rv;
        let objects = self
            .objects
            .entry((group.to_string(), plural.to_string()))
            .or_default();
        let before = objects.get(&key);
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
        let before = objects.insert(key, object.clone());
        let event = match before {
            Some(_) => "MODIFIED",
            None => "ADDED",
        };
        self.publish(rv, group, plural, event, before, object.clone());
        object
    }

    fn publish(
        &mut self,
        rv: u64,
        group: &str,
        plural: &str,
        kind: &'static str,
        before: Option<Value>,
        object: Value,
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
            Some(kind) => w.tx.send(event_line(kind, &event.object)).is_ok(),
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

fn event_line(event: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": event, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn gone() -> Bytes {
    event_line(
        "ERROR",
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410
        }),
    )
}

fn bookmark(group: &str, plural: &str, rv: u64) -> Bytes {
    let (api_version, kind) = KINDS
        .iter()
        .find(|k| k.0 == group && k.2 == plural)
        .map(|k| (api_version_of(k.0), k.1))
        .unwrap_or_default();
    event_line(
        "BOOKMARK",
        &json!({"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv.to_string()}}),
    )
}

fn api_version_of(group: &str) -> String {
    match group {
        "" => "v1".into(),
        g => format!("{g}/v1"),
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, body: Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
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
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = if watching { "watch" } else { "list" };
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
    let selects = |object: &Value| {
        namespace
            .as_deref()
            .is_none_or(|ns| object["metadata"]["namespace"] == ns)
            && fields.matches(object)
    };
    // Objects are stored once; each is served at the version asked.
    let at_version = |mut object: Value| {
        object["apiVersion"] = Value::from(api_version.clone());
        object
    };
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
            .filter(|(_, o)| selects(o));
        let chosen: Vec<(&Key, &Value)> = page.by_ref().take(limit).collect();
        let more = page.next().is_some();
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if more && let Some(((ns, name), _)) = chosen.last() {
            metadata["continue"] = Value::from(format!("{rv}/{ns}/{name}"));
        }
        let items: Vec<Value> = chosen
            .into_iter()
            .map(|(_, o)| at_version(o.clone()))
            .collect();
        let kind = KINDS
            .iter()
            .find(|k| k.0 == group && k.2 == plural)
            .map_or("", |k| k.1);
        return full(
            StatusCode::OK,
            json!({"apiVersion": api_version, "kind": format!("{kind}List"),
                   "metadata": metadata, "items": items}),
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
            let _ = tx.send(gone());
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
                    let _ = watch
                        .tx
                        .send(event_line(kind, &at_version(event.object.clone())));
                }
            }
            if bookmarks {
                let _ = watch.tx.send(bookmark(group, plural, st.rv));
            }
            st.watches.push(watch);
        }
    }
    let (mut sender, body) = Channel::<Bytes, Infallible>::new(16);
    let version_of = api_version.clone();
    tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            // Events are stored at one version; rewrite apiVersion for the one asked.
            let line = match serde_json::from_slice::<Value>(&line) {
                Ok(mut e) if e["object"]["kind"] != "Status" => {
                    e["object"]["apiVersion"] = Value::from(version_of.clone());
                    let mut text = e.to_string();
                    text.push('\n');
                    Bytes::from(text)
                }
                _ => line,
            };
            if sender.send_data(line).await.is_err() {
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
    let at_version = |mut object: Value| {
        object["apiVersion"] = Value::from(target.api_version);
        object
    };
    let stale = |sent: &Value| {
        sent["metadata"]["resourceVersion"]
            .as_str()
            .is_some_and(|rv| current["metadata"]["resourceVersion"] != rv)
    };
    match (method, sub) {
        (&hyper::Method::GET, None | Some("status")) => full(StatusCode::OK, at_version(current)),
        (&hyper::Method::PUT, None) => {
            let sent: Value = match serde_json::from_slice(body) {
                Ok(sent) => sent,
                Err(e) => return bad_body(e),
            };
            if stale(&sent) {
                return conflict(target, name);
            }
            let stored = st.store(target.group, target.plural, key, sent, Write::Object);
            full(StatusCode::OK, at_version(stored))
        }
        (&hyper::Method::PATCH, Some("status")) => {
            let patch: Value = match serde_json::from_slice(body) {
                Ok(patch) => patch,
                Err(e) => return bad_body(e),
            };
            if stale(&patch) {
                return conflict(target, name);
            }
            let mut object = current;
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
            full(StatusCode::OK, at_version(stored))
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
    let mut stored = st.store(target.group, target.plural, key, object, Write::Object);
    stored["apiVersion"] = Value::from(target.api_version);
    full(StatusCode::CREATED, stored)
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
    fn field_selectors_match_as_the_api_server_does() {
        let f = FieldSelector::parse("spec.nodeName!=n1,metadata.namespace=a").unwrap();
        assert!(f.matches(&pod("n2")));
        assert!(!f.matches(&pod("n1")));
        // A Pod not yet scheduled has no node: it matches `!=` and not `=`.
        let unscheduled = json!({"metadata": {"name": "p", "namespace": "a"}});
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
