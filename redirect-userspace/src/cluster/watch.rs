//! One watch per kind through kube-rs: discovery of the Istio kinds' version, the watcher's
//! list-then-watch (which lists again by itself when its history expires), and every failure put
//! in words an operator can act on.
use std::{fmt::Debug, time::Duration};

use futures::StreamExt;
use kube::{
    Api, Client, Resource,
    api::{ApiResource, DynamicObject, GroupVersionKind},
    runtime::{
        WatchStreamExt,
        utils::Backoff,
        watcher::{self, Event},
    },
};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::{
    MeshConfigMap,
    kinds::{self, ApiEntry, ApiPod, Kind},
    store::{Change, Key},
};
use crate::metrics::Metrics;

/// How often to look again for an Istio kind the API does not serve.
const NOT_INSTALLED_RECHECK: Duration = Duration::from_secs(10);

/// Retries after a failure: 250 ms doubling to 5 s, reset by the next success. A restarted API
/// server is back in use within seconds, and a down one costs a request every 5 s per watch.
#[derive(Debug, Clone)]
pub(super) struct RetryBackoff {
    next: Duration,
}

const FIRST_RETRY: Duration = Duration::from_millis(250);
const MAX_RETRY: Duration = Duration::from_secs(5);

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff { next: FIRST_RETRY }
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (now * 2).min(MAX_RETRY);
        Some(now)
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = FIRST_RETRY;
    }
}

/// Watches `kind` for as long as the agent runs, reporting to `changes`. `node`: the node whose
/// Pods are [`Kind::Pod`] (the others being [`Kind::PodElsewhere`]); `None`, every Pod is.
/// `observe_status`: a ServiceEntry's status and managed fields are read (for the status writer);
/// without it they are dropped as they arrive.
pub(super) async fn run(
    client: Client,
    kind: Kind,
    mesh: MeshConfigMap,
    node: Option<String>,
    observe_status: bool,
    changes: mpsc::Sender<Change>,
    metrics: std::sync::Arc<Metrics>,
) {
    let report = Reporter {
        kind,
        node,
        observe_status,
        mesh: mesh.clone(),
        changes: changes.clone(),
        metrics,
    };
    // An Istio kind whose CRD goes away is looked for again, at whichever version is served then.
    loop {
        let api_version = if kind.is_istio() {
            match discover(&client, &report).await {
                Some(v) => v,
                None => return,
            }
        } else {
            kind.fixed_api_version()
        };
        if !report
            .send(Change::Watching(kind, api_version.clone()))
            .await
        {
            return;
        }
        let ended = match kind {
            Kind::Pod | Kind::PodElsewhere => {
                follow::<ApiPod>(client.clone(), &api_version, &report).await
            }
            Kind::ServiceEntry if !observe_status => {
                follow::<ApiEntry>(client.clone(), &api_version, &report).await
            }
            _ => follow::<DynamicObject>(client.clone(), &api_version, &report).await,
        };
        match ended {
            Ended::NotServed => continue,
            Ended::Stopping => return,
        }
    }
}

enum Ended {
    /// The API stopped serving this kind.
    NotServed,
    /// Nobody listens any more: the agent is stopping.
    Stopping,
}

/// An object as a watch reads it from the API.
trait Watched:
    Resource<DynamicType = ApiResource, Scope = kube::core::DynamicResourceScope>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + 'static
{
    /// The object converted; a ServiceEntry's status kept only when `observe_status`.
    fn read(
        self,
        kind: Kind,
        api_version: &str,
        observe_status: bool,
    ) -> serde_json::Result<kinds::Converted>;
}

/// Any kind, read whole and then cut down.
impl Watched for DynamicObject {
    fn read(
        self,
        kind: Kind,
        api_version: &str,
        observe_status: bool,
    ) -> serde_json::Result<kinds::Converted> {
        read(kind, api_version, self, observe_status)
    }
}

/// A Pod, cut down as it was parsed.
impl Watched for ApiPod {
    fn read(self, kind: Kind, api_version: &str, _: bool) -> serde_json::Result<kinds::Converted> {
        Ok(self.convert(kind, api_version))
    }
}

/// A ServiceEntry without its status (no status writer), cut down as it was parsed.
impl Watched for ApiEntry {
    fn read(self, _: Kind, api_version: &str, _: bool) -> serde_json::Result<kinds::Converted> {
        Ok(self.convert(api_version))
    }
}

/// Lists, then watches, `report.kind` at `api_version`, reporting every change.
async fn follow<K: Watched>(client: Client, api_version: &str, report: &Reporter) -> Ended {
    let kind = report.kind;
    let (group, version) = match api_version.rsplit_once('/') {
        Some((group, version)) => (group, version),
        None => ("", api_version),
    };
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, version, kind.name()),
        kind.plural(),
    );
    // The first list comes in pages, each taken in as it arrives (kube's default page is 500).
    let mut config = watcher::Config::default().page_size(LIST_PAGE);
    if let Some(fields) = field_selector(kind, report.node.as_deref()) {
        config = config.fields(&fields);
    }
    let api: Api<K> = if kind == Kind::MeshConfig {
        config = config.fields(&format!("metadata.name={}", report.mesh.name));
        Api::namespaced_with(client, &report.mesh.namespace, &resource)
    } else {
        Api::all_with(client, &resource)
    };
    let mut stream = std::pin::pin!(watcher::watcher(api, config).backoff(RetryBackoff::default()));
    let mut failing = false;
    while let Some(item) = stream.next().await {
        let change = match item {
            Ok(Event::Init) => Change::Relist(kind),
            Ok(Event::InitApply(object) | Event::Apply(object)) => {
                let key = key(&object);
                let converted = match object.read(kind, api_version, report.observe_status) {
                    Ok(converted) => converted,
                    Err(e) => {
                        warn!(kind = kind.label(), error = %e, "an object the API sent could not be read; skipped");
                        continue;
                    }
                };
                Change::Upsert(kind, key, Box::new(converted))
            }
            Ok(Event::Delete(object)) => Change::Deleted(kind, key(&object)),
            Ok(Event::InitDone) => {
                if failing {
                    info!(
                        kind = kind.label(),
                        "listed again: watching the Kubernetes API"
                    );
                    failing = false;
                }
                Change::Listed(kind)
            }
            Err(e) => {
                failing = true;
                let failure = describe(kind, &report.mesh, &e);
                report.failed(&failure).await;
                if failure.not_found && kind.is_istio() {
                    warn!(
                        kind = kind.name(),
                        %api_version,
                        "the API no longer serves this kind (its CRD was removed?): none are in force; looking for it again"
                    );
                    return match report.send(Change::NotInstalled(kind)).await {
                        true => Ended::NotServed,
                        false => Ended::Stopping,
                    };
                }
                continue;
            }
        };
        if !report.send(change).await {
            return Ended::Stopping;
        }
    }
    Ended::Stopping
}

/// Objects per page of a first list: big enough that a page costs little more than its objects,
/// small enough that the page being read is a small part of what the agent holds.
const LIST_PAGE: u32 = 500;

/// The server-side filter of a Pod watch scoped to a node: this node's Pods, or every other's.
fn field_selector(kind: Kind, node: Option<&str>) -> Option<String> {
    let node = node?;
    match kind {
        Kind::Pod => Some(format!("spec.nodeName={node}")),
        Kind::PodElsewhere => Some(format!("spec.nodeName!={node}")),
        _ => None,
    }
}

/// One object the API sent, converted; a ServiceEntry's status kept only when `observe_status`.
pub(crate) fn read(
    kind: Kind,
    api_version: &str,
    object: DynamicObject,
    observe_status: bool,
) -> serde_json::Result<kinds::Converted> {
    let mut converted = kinds::convert(kind, api_version, as_json(kind, object, observe_status)?);
    if !observe_status {
        converted.observed = None;
    }
    Ok(converted)
}

/// The object as JSON for [`kinds::convert`], moved rather than copied, and without the metadata
/// nothing reads (a Pod's managed fields and annotations are often most of it); a ServiceEntry's
/// managed fields say who writes its status, so they stay when the status is `observed`. An
/// AuthorizationPolicy keeps its annotations: one says whether it is a dry run (`strip` cuts the
/// rest).
pub(super) fn as_json(
    kind: Kind,
    object: DynamicObject,
    observed: bool,
) -> serde_json::Result<serde_json::Value> {
    let DynamicObject {
        mut metadata, data, ..
    } = object;
    if kind != Kind::ServiceEntry || !observed {
        metadata.managed_fields = None;
        // Of the annotations, a policy's dry run is read, and whether a Pod has a sidecar.
        match kind {
            Kind::AuthorizationPolicy => {}
            Kind::Pod | Kind::PodElsewhere => {
                metadata.annotations = (metadata.annotations.take())
                    .map(|mut a| {
                        a.retain(|key, _| key == crate::config::SIDECAR_STATUS_ANNOTATION);
                        a
                    })
                    .filter(|a| !a.is_empty());
            }
            _ => metadata.annotations = None,
        }
    }
    let mut json = match data {
        serde_json::Value::Object(fields) => fields,
        _ => serde_json::Map::new(),
    };
    json.insert("metadata".into(), serde_json::to_value(metadata)?);
    Ok(serde_json::Value::Object(json))
}

fn key(object: &impl Resource) -> Key {
    let meta = object.meta();
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The `apiVersion` at which the API serves an Istio kind, waiting (with a warning) while it
/// serves none. `None`: the agent is stopping.
async fn discover(client: &Client, report: &Reporter) -> Option<String> {
    let kind = report.kind;
    let mut backoff = RetryBackoff::default();
    let mut warned = false;
    loop {
        let wait = match served_version(client, kind).await {
            Ok(Some(api_version)) => {
                if warned {
                    info!(kind = kind.name(), %api_version, "the API serves this kind now: watching it");
                }
                return Some(api_version);
            }
            Ok(None) => {
                if !warned {
                    warn!(
                        kind = kind.name(),
                        group = kind.group(),
                        "the API serves no {} (is Istio's CRD installed?): none are in force; checking again every {}s",
                        kind.plural(),
                        NOT_INSTALLED_RECHECK.as_secs()
                    );
                    warned = true;
                }
                if !report.send(Change::NotInstalled(kind)).await {
                    return None;
                }
                NOT_INSTALLED_RECHECK
            }
            Err(e) => {
                let failure = Failure::from_client_error(kind, &report.mesh, "get", &e);
                report.failed(&failure).await;
                backoff.next().unwrap_or(MAX_RETRY)
            }
        };
        if report.changes.is_closed() {
            return None;
        }
        tokio::time::sleep(wait).await;
    }
}

/// The first of the kind's versions the API serves, `group/version`.
async fn served_version(client: &Client, kind: Kind) -> Result<Option<String>, kube::Error> {
    for version in kind.versions() {
        let group_version = format!("{}/{version}", kind.group());
        match client.list_api_group_resources(&group_version).await {
            Ok(list) if list.resources.iter().any(|r| r.name == kind.plural()) => {
                return Ok(Some(group_version));
            }
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

struct Reporter {
    kind: Kind,
    node: Option<String>,
    /// Whether a ServiceEntry's status is kept (only the status writer reads it).
    observe_status: bool,
    mesh: MeshConfigMap,
    changes: mpsc::Sender<Change>,
    metrics: std::sync::Arc<Metrics>,
}

impl Reporter {
    /// False once nobody listens (the agent is stopping).
    async fn send(&self, change: Change) -> bool {
        self.changes.send(change).await.is_ok()
    }

    async fn failed(&self, failure: &Failure) {
        let kind = self.kind.label();
        self.metrics.kube.watch_error(kind);
        if failure.forbidden {
            error!(kind, "{}", failure.message);
        } else if failure.expired {
            info!(kind, "{}", failure.message);
        } else {
            warn!(kind, "{}", failure.message);
        }
        self.send(Change::Failed(self.kind, failure.message.clone()))
            .await;
    }
}

/// A watch failure in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    pub message: String,
    pub forbidden: bool,
    pub not_found: bool,
    /// 410 Gone: the watch's history expired; the watcher lists again by itself.
    pub expired: bool,
}

fn describe(kind: Kind, mesh: &MeshConfigMap, e: &watcher::Error) -> Failure {
    match e {
        watcher::Error::InitialListFailed(e) => Failure::from_client_error(kind, mesh, "list", e),
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
            Failure::from_client_error(kind, mesh, "watch", e)
        }
        watcher::Error::WatchError(status) => {
            Failure::from_status(kind, mesh, "watch", status.code, &status.message)
        }
        watcher::Error::NoResourceVersion => Failure::other(format!(
            "the API sent {} without a resourceVersion: cannot watch them",
            kind.plural()
        )),
    }
}

impl Failure {
    fn from_client_error(kind: Kind, mesh: &MeshConfigMap, verb: &str, e: &kube::Error) -> Self {
        match e {
            kube::Error::Api(status) => {
                Failure::from_status(kind, mesh, verb, status.code, &status.message)
            }
            other => Failure::other(format!(
                "cannot {verb} {} on the Kubernetes API server: {}; retrying",
                kind.plural(),
                with_causes(other)
            )),
        }
    }

    /// `code` and `message` of the API's `Status`.
    pub(super) fn from_status(
        kind: Kind,
        mesh: &MeshConfigMap,
        verb: &str,
        code: u16,
        message: &str,
    ) -> Self {
        let resource = kind.resource();
        let scope = if kind == Kind::MeshConfig {
            format!(" in namespace {}", mesh.namespace)
        } else {
            String::new()
        };
        let mut failure = Failure::other(format!(
            "{verb} {} answered {code}: {message}; retrying",
            kind.plural()
        ));
        match code {
            403 => {
                failure.message = format!(
                    "forbidden to {verb} {resource}{scope}: grant the agent's service account get, list and watch on {resource}{scope} (the API said: {message})"
                );
                failure.forbidden = true;
            }
            404 => failure.not_found = true,
            410 => {
                failure.message = format!(
                    "the watch on {} expired (410 Gone): listing them again; what is in force stays until the new list is complete",
                    kind.plural()
                );
                failure.expired = true;
            }
            _ => {}
        }
        failure
    }

    fn other(message: String) -> Self {
        Failure {
            message,
            forbidden: false,
            not_found: false,
            expired: false,
        }
    }
}

/// An error and what caused it (`client error (Connect): Connection refused`), each said once.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh() -> MeshConfigMap {
        MeshConfigMap::default()
    }

    #[test]
    fn forbidden_names_the_verb_and_the_resource() {
        let f = Failure::from_status(
            Kind::ServiceEntry,
            &mesh(),
            "list",
            403,
            "serviceentries.networking.istio.io is forbidden",
        );
        assert!(f.forbidden);
        assert!(
            f.message
                .starts_with("forbidden to list serviceentries.networking.istio.io:"),
            "{}",
            f.message
        );
        let f = Failure::from_status(Kind::AuthorizationPolicy, &mesh(), "list", 403, "no");
        assert!(
            f.message.starts_with(
                "forbidden to list authorizationpolicies.security.istio.io: grant the agent's service account get, list and watch on authorizationpolicies.security.istio.io"
            ),
            "{}",
            f.message
        );
        let f = Failure::from_status(Kind::MeshConfig, &mesh(), "watch", 403, "no");
        assert!(
            f.message
                .starts_with("forbidden to watch configmaps in namespace istio-system:"),
            "{}",
            f.message
        );
    }

    #[test]
    fn gone_is_an_expiry_and_not_found_is_told_apart() {
        let f = Failure::from_status(Kind::Pod, &mesh(), "watch", 410, "too old");
        assert!(f.expired && !f.forbidden && !f.not_found);
        let f = Failure::from_status(Kind::WorkloadEntry, &mesh(), "list", 404, "not found");
        assert!(f.not_found);
    }

    #[test]
    fn an_object_reaches_the_loader_whole_but_for_metadata_nothing_reads() {
        let object = |kind: &str| -> DynamicObject {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": kind,
                "metadata": {"name": "a", "namespace": "team-a", "labels": {"app": "x"},
                             "annotations": {"big": "x"}, "managedFields": [{"manager": "m"}]},
                "spec": {"nodeName": "n"}, "status": {"podIP": "10.0.0.1"}
            }))
            .unwrap()
        };
        let pod = as_json(Kind::Pod, object("Pod"), true).unwrap();
        assert_eq!(
            pod,
            serde_json::json!({
                "metadata": {"name": "a", "namespace": "team-a", "labels": {"app": "x"}},
                "spec": {"nodeName": "n"}, "status": {"podIP": "10.0.0.1"}
            })
        );
        // Of a Pod's annotations, only whether it has a sidecar.
        let mut sidecar = object("Pod");
        (sidecar.metadata.annotations.get_or_insert_default())
            .insert("sidecar.istio.io/status".into(), "{}".into());
        let pod = as_json(Kind::Pod, sidecar, false).unwrap();
        assert_eq!(
            pod["metadata"]["annotations"],
            serde_json::json!({"sidecar.istio.io/status": "{}"})
        );
        let se = as_json(Kind::ServiceEntry, object("ServiceEntry"), true).unwrap();
        assert_eq!(se["metadata"]["managedFields"][0]["manager"], "m");
        let se = as_json(Kind::ServiceEntry, object("ServiceEntry"), false).unwrap();
        assert!(se["metadata"].get("managedFields").is_none());
        // A policy's annotations say whether it is a dry run.
        let policy = as_json(
            Kind::AuthorizationPolicy,
            object("AuthorizationPolicy"),
            false,
        )
        .unwrap();
        assert_eq!(policy["metadata"]["annotations"]["big"], "x");
        assert!(policy["metadata"].get("managedFields").is_none());
    }

    #[test]
    fn an_entry_status_is_kept_only_for_the_status_writer() {
        let entry = || -> DynamicObject {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
                "metadata": {"name": "api", "namespace": "team-a", "resourceVersion": "7"},
                "spec": {"hosts": ["api.example.com"], "ports": [{"number": 443, "name": "https"}],
                         "resolution": "DNS", "location": "MESH_EXTERNAL"}
            }))
            .unwrap()
        };
        let api_version = "networking.istio.io/v1";
        let kept = read(Kind::ServiceEntry, api_version, entry(), true).unwrap();
        assert_eq!(kept.observed.unwrap().resource_version, "7");
        let dropped = read(Kind::ServiceEntry, api_version, entry(), false).unwrap();
        assert!(dropped.observed.is_none());
        assert!(dropped.object.is_some(), "{:?}", dropped.errors);
    }

    #[test]
    fn pods_are_split_by_node_only_when_a_node_is_named() {
        assert_eq!(
            field_selector(Kind::Pod, Some("node-1")).as_deref(),
            Some("spec.nodeName=node-1")
        );
        assert_eq!(
            field_selector(Kind::PodElsewhere, Some("node-1")).as_deref(),
            Some("spec.nodeName!=node-1")
        );
        assert_eq!(field_selector(Kind::Pod, None), None);
        assert_eq!(field_selector(Kind::Service, Some("node-1")), None);
        assert_eq!(Kind::watched(false), Kind::ALL.to_vec());
        assert_eq!(Kind::watched(true).last(), Some(&Kind::PodElsewhere));
    }

    #[test]
    fn retries_double_up_to_five_seconds_and_reset() {
        let mut b = RetryBackoff::default();
        let waits: Vec<u64> = (0..7)
            .map(|_| b.next().unwrap().as_millis() as u64)
            .collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next(), Some(FIRST_RETRY));
    }
}
