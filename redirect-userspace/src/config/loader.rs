//! Reading a directory of Kubernetes YAML into a [`Model`]: every document of every file, each
//! object checked on its own. An invalid object is left out and reported; every valid one loads.
use std::{collections::HashMap, path::Path, sync::Arc};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::{
    api_pod::ApiPodParts,
    endpoint_slice::RawEndpointSlice,
    error::{ConfigError, ConfigErrors, Ctx, MAX_QUOTED, bounded, plain_message},
    kube::{RawNamespace, RawPod, RawService},
    mesh::{MeshConfig, RawConfigMap, RawIstioOperator, RawMeshConfig},
    model::{DEFAULT_CLUSTER_DOMAIN, DEFAULT_NAMESPACE, Model, Namespace, ServiceEntry, Workload},
    service_entry::{RawServiceEntry, RawWorkloadEntry},
    source::{self, Limits},
    yaml,
};

/// What one read of the configuration gave: every valid object, and every problem.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    /// The valid objects, complete (implicit namespaces added) and sorted.
    pub model: Model,
    /// Every problem, in file order.
    pub errors: Vec<ConfigError>,
    /// What was left out, one entry per object (or per file that could not be read to its end).
    pub rejected: Vec<Rejected>,
    /// The source itself could not be listed: nothing was read at all.
    pub unreadable: bool,
}

/// An object left out of a load, or a file whose objects could not all be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejected {
    /// The object's kind; `File` for a file not read or not parsed to its end, `Document` for a
    /// document that is not a Kubernetes object.
    pub kind: &'static str,
    /// Empty for cluster-scoped kinds and for files.
    pub namespace: String,
    /// Empty when the object has none, and for files.
    pub name: String,
    pub file: String,
    /// A running agent kept this object's last good version in force.
    pub last_good_in_force: bool,
}

/// Kinds that hold the mesh config.
pub(crate) const MESH_KINDS: [&str; 3] = ["IstioOperator", "ConfigMap", "MeshConfig"];

impl Loaded {
    /// Everything valid, or every error: for callers that accept nothing less than a clean load.
    pub fn into_result(self) -> Result<Model, ConfigErrors> {
        if self.errors.is_empty() {
            Ok(self.model)
        } else {
            Err(ConfigErrors(self.errors))
        }
    }
}

/// Reads every `.yaml`, `.yml` and `.json` regular file directly in `path` (or the one file `path`
/// names) within `limits`. Hidden entries are skipped, so a mounted ConfigMap (`..data` links)
/// loads each file once.
pub(crate) fn read_dir(path: &Path, limits: &Limits) -> Loaded {
    let files = match source::list(path) {
        Ok(files) => files,
        Err(message) => {
            let file = path.display().to_string();
            return Loaded {
                errors: vec![ConfigError::new(file.clone(), None, None, message)],
                rejected: vec![Rejected::file(&file)],
                unreadable: true,
                ..Loaded::default()
            };
        }
    };
    let mut loader = Loader::new(limits);
    loader.add_files(files);
    loader.finish()
}

/// Reads in-memory sources `(file name, text)`, in order, exactly as [`read_dir`] would.
pub fn read_sources<'a>(sources: impl IntoIterator<Item = (&'a str, &'a str)>) -> Loaded {
    let limits = Limits::default();
    let mut loader = Loader::new(&limits);
    for (file, text) in sources {
        if text.len() as u64 > limits.max_file_bytes {
            loader.file_error(file, format!("{} bytes is more than the {}-byte limit for one file (--config-max-file-bytes): not read", text.len(), limits.max_file_bytes));
        } else {
            loader.add_file(file, text);
        }
    }
    loader.finish()
}

/// Reads one object as the Kubernetes API serves it (JSON, with `apiVersion` and `kind`) exactly as
/// one document of a file is read: the same checks and the same errors, `source` standing in for
/// the file name. The model holds that object alone (plus its implicit namespace).
pub(crate) fn read_api_object(source: &str, object: &serde_json::Value) -> Loaded {
    read_api_pod(source, object).unwrap_or_else(|| read_api_document(source, object))
}

/// A ServiceEntry the API served (`api_version` as watched), checked as [`read_api_object`]
/// checks it, read from its JSON without YAML in between nor a whole load around it: the same
/// entry or the same errors. `None` when the JSON might read otherwise than its YAML does (a list
/// where a part goes, a field of another type: the YAML read names it in its words); read it
/// with [`read_api_object`] then.
pub(crate) fn check_api_entry(
    source: &str,
    object: &serde_json::Value,
) -> Option<Result<ServiceEntry, Vec<ConfigError>>> {
    let api_version = object.get("apiVersion").and_then(serde_json::Value::as_str);
    let kind = object.get("kind").and_then(serde_json::Value::as_str)?;
    if classify(api_version, kind) != Some("ServiceEntry") || !entry_reads_as_its_yaml(object) {
        return None;
    }
    let raw = RawServiceEntry::deserialize(object).ok()?;
    let text = |path: &[&str]| path.iter().try_fold(object, |v, key| v.get(*key))?.as_str();
    let id = identity("ServiceEntry", text);
    Some(checked(source, &id, |ctx| raw.convert(ctx)))
}

/// What `convert` makes of one object `id` read from `source`, or every error it gave (one error
/// and the object is refused, as a load refuses it).
fn checked<T>(
    source: &str,
    id: &Identity,
    convert: impl FnOnce(&mut Ctx<'_>) -> Option<T>,
) -> Result<T, Vec<ConfigError>> {
    let mut errors = Vec::new();
    let mut ctx = Ctx {
        file: source,
        object: describe(id),
        prefix: String::new(),
        errors: &mut errors,
    };
    match convert(&mut ctx) {
        Some(object) if errors.is_empty() => Ok(object),
        _ => Err(errors),
    }
}

/// Whether a ServiceEntry's JSON reads as its YAML does wherever it reads at all: no list stands
/// where a part of it goes (`metadata`, `spec`, `status`, a port, an endpoint, the workload
/// selector, a status address), which JSON would read field by field and YAML refuses.
fn entry_reads_as_its_yaml(entry: &serde_json::Value) -> bool {
    use serde_json::Value as Json;
    let part = |v: Option<&Json>| !matches!(v, Some(Json::Array(_)));
    let items = |v: Option<&Json>| match v {
        Some(Json::Array(items)) => items.iter().all(|i| !i.is_array()),
        _ => true,
    };
    let spec = entry.get("spec");
    fn at<'v>(v: Option<&'v Json>, field: &str) -> Option<&'v Json> {
        v.and_then(|v| v.get(field))
    }
    ["metadata", "spec", "status"]
        .iter()
        .all(|field| part(entry.get(*field)))
        && part(at(spec, "workloadSelector"))
        && items(at(spec, "ports"))
        && items(at(spec, "endpoints"))
        && items(at(entry.get("status"), "addresses"))
}

/// A `v1` Pod the API served, read in one pass ([`ApiPodParts`]; of another node's Pod, only
/// what that watch keeps), checked as [`read_api_object`] checks it: the same workload or the same
/// errors, without a whole load around one Pod. `Err`: it holds something the YAML way reads in
/// its own words; the JSON a whole read would have kept of it, for [`read_api_object`].
pub(crate) fn check_api_pod(
    source: &str,
    pod: ApiPodParts,
    elsewhere: bool,
) -> Result<Result<Workload, Vec<ConfigError>>, serde_json::Value> {
    let raw = pod.into_raw(elsewhere)?;
    let meta = raw.metadata.as_ref();
    let id = identity("Pod", |path| match path {
        ["metadata", "name"] => meta?.name.as_deref(),
        ["metadata", "namespace"] => meta?.namespace.as_deref(),
        _ => None,
    });
    Ok(checked(source, &id, |ctx| raw.convert(ctx)))
}

/// [`read_api_object`] for any object: as YAML, the form the loader reads.
fn read_api_document(source: &str, object: &serde_json::Value) -> Loaded {
    let limits = Limits::default();
    let mut loader = Loader::new(&limits);
    loader.from_api = true;
    match serde_yaml_ng::to_value(object) {
        Ok(value) => loader.add_document(source, value, String::new()),
        Err(e) => loader.file_error(source, format!("not a Kubernetes object: {e}")),
    }
    loader.finish()
}

/// [`read_api_object`] for a `v1` Pod, read from its JSON without YAML in between: most of the
/// cost of a Pod, of which the API lists a cluster's worth. The same checks on the same values;
/// `None` (read as YAML then) when the JSON might read otherwise than its YAML does: a field of a
/// type the Pod does not take (the YAML read names it in its words) or a list where one of its
/// parts goes (which JSON would read field by field, and YAML refuses).
fn read_api_pod(source: &str, object: &serde_json::Value) -> Option<Loaded> {
    let api_version = object.get("apiVersion").and_then(serde_json::Value::as_str);
    let kind = object.get("kind").and_then(serde_json::Value::as_str)?;
    if classify(api_version, kind) != Some("Pod") || !reads_as_its_yaml(object) {
        return None;
    }
    let raw = RawPod::deserialize(object).ok()?;
    let text = |path: &[&str]| path.iter().try_fold(object, |v, key| v.get(*key))?.as_str();
    let id = identity("Pod", text);
    let limits = Limits::default();
    let mut loader = Loader::new(&limits);
    loader.from_api = true;
    loader.add_pod(source, &id, raw, String::new());
    loader.rejected_if_refused(source, id, 0);
    Some(loader.finish())
}

/// Whether a Pod's JSON reads as its YAML does wherever it reads at all: no list stands where a
/// part of the Pod goes (`metadata`, `spec`, `status`, a container, a port, an address).
fn reads_as_its_yaml(pod: &serde_json::Value) -> bool {
    use serde_json::Value as Json;
    let part = |v: Option<&Json>| !matches!(v, Some(Json::Array(_)));
    let items = |v: Option<&Json>| match v {
        Some(Json::Array(items)) => items.iter().all(Json::is_object),
        _ => true,
    };
    let spec = pod.get("spec");
    let containers = spec.and_then(|s| s.get("containers"));
    ["metadata", "spec", "status"]
        .iter()
        .all(|field| part(pod.get(*field)))
        && items(containers)
        && items(pod.get("status").and_then(|s| s.get("podIPs")))
        && containers
            .and_then(Json::as_array)
            .is_none_or(|cs| cs.iter().all(|c| items(c.get("ports"))))
}

/// [`read_dir`] with the default limits, accepting only a load without any error.
#[cfg(test)]
pub(crate) fn load_dir(path: &Path) -> Result<Model, ConfigErrors> {
    read_dir(path, &Limits::default()).into_result()
}

/// [`read_sources`], accepting only a load without any error.
pub fn load_sources<'a>(
    sources: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Model, ConfigErrors> {
    read_sources(sources).into_result()
}

impl Rejected {
    fn file(file: &str) -> Self {
        Rejected {
            kind: "File",
            namespace: String::new(),
            name: String::new(),
            file: file.to_string(),
            last_good_in_force: false,
        }
    }
}

pub(super) struct Loader {
    /// What one file's YAML may expand to (see [`Limits::expansion_budget`]).
    budget: usize,
    errors: Vec<ConfigError>,
    rejected: Vec<Rejected>,
    model: Model,
    /// (kind, namespace, name) -> file, to refuse duplicates.
    seen: HashMap<(&'static str, String, String), String>,
    /// The mesh config found so far and what it was (`IstioOperator in FILE`).
    mesh: Option<(MeshConfig, String)>,
    /// Reading an object the Kubernetes API served: EndpointSlices are read only then.
    from_api: bool,
    limits: Limits,
    /// The size of every file listed so far, against `limits.max_dir_bytes`.
    bytes_listed: u64,
}

/// Who a document says it is, for reports and for keeping its last good version.
struct Identity {
    kind: &'static str,
    namespace: String,
    name: String,
}

/// What a document is, from `apiVersion` and `kind`. `None`: not ours, skipped.
fn classify(api_version: Option<&str>, kind: &str) -> Option<&'static str> {
    let group = api_version.map(|v| v.rsplit_once('/').map_or("", |(g, _)| g));
    let version = api_version.map(|v| v.rsplit_once('/').map_or(v, |(_, v)| v));
    let core = matches!(api_version, None | Some("v1"));
    let istio_networking = group.is_none_or(|g| g == "networking.istio.io")
        && version.is_none_or(|v| matches!(v, "v1" | "v1beta1" | "v1alpha3"));
    Some(match kind {
        "Namespace" if core => "Namespace",
        "Service" if core => "Service",
        "Pod" if core => "Pod",
        "ConfigMap" if core => "ConfigMap",
        "List" if core => "List",
        "ServiceEntry" if istio_networking => "ServiceEntry",
        "WorkloadEntry" if istio_networking => "WorkloadEntry",
        "IstioOperator" if group.is_none_or(|g| g == "install.istio.io") => "IstioOperator",
        "MeshConfig" => "MeshConfig",
        "EndpointSlice" if api_version == Some("discovery.k8s.io/v1") => "EndpointSlice",
        _ => return None,
    })
}

fn str_at<'v>(value: &'v Value, path: &[&str]) -> Option<&'v str> {
    path.iter().try_fold(value, |v, key| v.get(*key))?.as_str()
}

/// `Kind namespace/name`, or `Kind name` for a cluster-scoped kind, or `Kind` when unnamed.
fn describe(id: &Identity) -> String {
    match (id.kind, id.name.as_str()) {
        (kind, "") => kind.to_string(),
        ("Namespace", name) => format!("Namespace {name}"),
        (kind, name) => format!("{kind} {}/{name}", id.namespace),
    }
}

/// Who an object says it is; `text` reads the string at a path of it.
fn identity<'v>(kind: &'static str, text: impl Fn(&[&str]) -> Option<&'v str>) -> Identity {
    let text = |path: &[&str]| text(path).map(|s| bounded(s, MAX_QUOTED).into_owned());
    let name = text(&["metadata", "name"]).unwrap_or_default();
    let namespace = match kind {
        "Namespace" => String::new(),
        _ => text(&["metadata", "namespace"]).unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()),
    };
    Identity {
        kind,
        namespace,
        name,
    }
}

impl Loader {
    pub(super) fn new(limits: &Limits) -> Self {
        Loader {
            budget: limits.expansion_budget(),
            errors: Vec::new(),
            rejected: Vec::new(),
            model: Model::default(),
            seen: HashMap::new(),
            mesh: None,
            from_api: false,
            limits: *limits,
            bytes_listed: 0,
        }
    }

    /// Reads listed files in order, each within the file limit, all of them within the directory
    /// limit (counted over every call): a file past it is reported and not read.
    pub(super) fn add_files(&mut self, files: Vec<source::Candidate>) {
        for candidate in files {
            let file = candidate.path.display().to_string();
            self.bytes_listed = self.bytes_listed.saturating_add(candidate.len);
            let text = if self.bytes_listed > self.limits.max_dir_bytes {
                Err(format!(
                    "the files read pass the {}-byte limit (--config-max-dir-bytes): not read",
                    self.limits.max_dir_bytes
                ))
            } else {
                source::read(&candidate.path, self.limits.max_file_bytes)
            };
            match text {
                Ok(text) => self.add_file(&file, &text),
                Err(message) => self.file_error(&file, message),
            }
        }
    }

    /// A file that could not be read: its objects are the ones left out.
    pub(super) fn file_error(&mut self, file: &str, message: String) {
        self.errors
            .push(ConfigError::new(file, None, None, message));
        self.rejected.push(Rejected::file(file));
    }

    pub(super) fn add_file(&mut self, file: &str, text: &str) {
        let mut number = 0;
        let mut held = false;
        yaml::for_each_document(text, self.budget, |document| {
            number += 1;
            match document {
                Ok(value) => {
                    held |= !value.is_null();
                    self.add_document(file, value, String::new())
                }
                Err(e) => {
                    held = true;
                    // The parser cannot resynchronise after a syntax error: the rest of the file is lost.
                    self.file_error(file, format!("document {number} is not valid YAML: {e}"));
                }
            }
        });
        // A file with no document at all is one being written in place (read between the
        // truncation and the write) or cut short (a full disk), far more often than a file meant
        // to say nothing: what it held stays at its last good version. Removing the file removes
        // its objects.
        if !held {
            self.file_error(
                file,
                "holds no document (read while it was rewritten in place, or cut short?): its objects stay at their last good versions; remove the file to remove them".to_string(),
            );
        }
    }

    fn add_document(&mut self, file: &str, value: Value, prefix: String) {
        if value.is_null() {
            return;
        }
        let Some(kind_text) = value.get("kind").and_then(Value::as_str) else {
            let field = if prefix.is_empty() {
                "kind".to_string()
            } else {
                format!("{prefix}kind")
            };
            let message = if value.is_mapping() {
                "not a Kubernetes object: no kind"
            } else {
                "not a Kubernetes object: expected a mapping with apiVersion and kind"
            };
            self.errors
                .push(ConfigError::new(file, None, Some(field), message));
            self.rejected.push(Rejected {
                kind: "Document",
                ..Rejected::file(file)
            });
            return;
        };
        let api_version = value.get("apiVersion").and_then(Value::as_str);
        let Some(kind) = classify(api_version, kind_text) else {
            tracing::debug!(
                file,
                kind = %bounded(kind_text, MAX_QUOTED),
                api_version = api_version.map(|v| bounded(v, MAX_QUOTED).into_owned()),
                "skipping a kind the agent does not use"
            );
            return;
        };
        if kind == "EndpointSlice" && !self.from_api {
            tracing::debug!(
                file,
                "skipping an EndpointSlice: a directory's Services take their endpoints from their selector"
            );
            return;
        }
        if kind == "List" {
            let items = match value {
                Value::Mapping(mut map) => match map.remove("items") {
                    Some(Value::Sequence(items)) => items,
                    _ => Vec::new(),
                },
                _ => Vec::new(),
            };
            for (i, item) in items.into_iter().enumerate() {
                self.add_document(file, item, format!("{prefix}items[{i}]."));
            }
            return;
        }
        let id = identity(kind, |path| str_at(&value, path));
        let before = self.errors.len();
        self.add_object(file, &id, value, prefix);
        self.rejected_if_refused(file, id, before);
    }

    /// Records the object `id` as left out when errors came after the first `before`.
    fn rejected_if_refused(&mut self, file: &str, id: Identity, before: usize) {
        if self.errors.len() > before {
            self.rejected.push(Rejected {
                kind: id.kind,
                namespace: id.namespace,
                name: id.name,
                file: file.to_string(),
                last_good_in_force: false,
            });
        }
    }

    /// Checks a Pod read into its raw shape and adds it if valid.
    fn add_pod(&mut self, file: &str, id: &Identity, raw: RawPod, prefix: String) {
        let mut ctx = Ctx {
            file,
            object: describe(id),
            prefix,
            errors: &mut self.errors,
        };
        if let Some(pod) = raw.convert(&mut ctx)
            && self.first("Pod", &pod.meta.namespace, &pod.meta.name, file)
        {
            self.model.workloads.push(Arc::new(pod));
        }
    }

    /// Converts one object and adds it if valid; every problem goes to `self.errors`.
    fn add_object(&mut self, file: &str, id: &Identity, value: Value, prefix: String) {
        let mut ctx = Ctx {
            file,
            object: describe(id),
            prefix,
            errors: &mut self.errors,
        };
        match id.kind {
            "Namespace" => {
                if let Some(ns) =
                    typed::<RawNamespace>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("Namespace", "", &ns.name, file)
                {
                    self.model.namespaces.insert(ns.name.clone(), ns);
                }
            }
            "ServiceEntry" => {
                if let Some(se) =
                    typed::<RawServiceEntry>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("ServiceEntry", &se.meta.namespace, &se.meta.name, file)
                {
                    self.model.service_entries.push(Arc::new(se));
                }
            }
            "Service" => {
                if let Some(svc) =
                    typed::<RawService>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("Service", &svc.meta.namespace, &svc.meta.name, file)
                {
                    self.model.services.push(Arc::new(svc));
                }
            }
            "Pod" => {
                let prefix = ctx.prefix.clone();
                if let Some(raw) = typed::<RawPod>(&mut ctx, value) {
                    self.add_pod(file, id, raw, prefix);
                }
            }
            "WorkloadEntry" => {
                if let Some(we) =
                    typed::<RawWorkloadEntry>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("WorkloadEntry", &we.meta.namespace, &we.meta.name, file)
                {
                    self.model.workloads.push(Arc::new(we));
                }
            }
            "EndpointSlice" => {
                if let Some(slice) =
                    typed::<RawEndpointSlice>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("EndpointSlice", &slice.namespace, &slice.name, file)
                {
                    self.model.endpoint_slices.push(Arc::new(slice));
                }
            }
            "IstioOperator" => {
                let mesh = typed::<RawIstioOperator>(&mut ctx, value)
                    .and_then(|r| r.into_mesh().convert(&mut ctx, "spec.meshConfig."));
                let object = ctx.object;
                self.set_mesh(file, object, "spec.meshConfig", mesh);
            }
            "MeshConfig" => {
                let mesh =
                    typed::<RawMeshConfig>(&mut ctx, value).and_then(|r| r.convert(&mut ctx, ""));
                let object = ctx.object;
                self.set_mesh(file, object, "kind", mesh);
            }
            "ConfigMap" => {
                if id.name != "istio" {
                    tracing::debug!(file, object = %ctx.object, "skipping a ConfigMap other than istio");
                    return;
                }
                let Some(text) = typed::<RawConfigMap>(&mut ctx, value)
                    .and_then(|cm| cm.data)
                    .and_then(|mut data| data.remove("mesh"))
                else {
                    tracing::debug!(file, object = %ctx.object, "ConfigMap istio has no mesh key");
                    return;
                };
                let raw = match yaml::single(&text, self.budget) {
                    Ok(value) => typed_at::<Option<RawMeshConfig>>(&mut ctx, value, "data.mesh")
                        .map(Option::unwrap_or_default),
                    Err(e) => {
                        ctx.error("data.mesh", format!("not valid YAML: {e}"));
                        None
                    }
                };
                let mesh = raw.and_then(|r| r.convert(&mut ctx, "data.mesh."));
                let object = ctx.object;
                self.set_mesh(file, object, "data.mesh", mesh);
            }
            _ => {
                // classify returns only the kinds above; a new kind without a branch is a bug, not input.
                tracing::error!(kind = id.kind, "no loader for this kind");
            }
        }
    }

    /// Records an object's identity; false (and an error) when it was already defined.
    fn first(&mut self, kind: &'static str, namespace: &str, name: &str, file: &str) -> bool {
        let key = (kind, namespace.to_string(), name.to_string());
        if let Some(earlier) = self.seen.get(&key) {
            let object = if namespace.is_empty() {
                format!("{kind} {name}")
            } else {
                format!("{kind} {namespace}/{name}")
            };
            let where_ = if earlier == file {
                "earlier in this file".to_string()
            } else {
                format!("in {earlier}")
            };
            self.errors.push(ConfigError::new(
                file,
                Some(object),
                Some("metadata.name".into()),
                format!("duplicate object: already defined {where_}"),
            ));
            return false;
        }
        self.seen.insert(key, file.to_string());
        true
    }

    /// `field`: where this object holds its mesh config, named in the error if it is a second one.
    fn set_mesh(&mut self, file: &str, object: String, field: &str, mesh: Option<MeshConfig>) {
        let Some(mesh) = mesh else { return };
        if let Some((_, first)) = &self.mesh {
            self.errors.push(ConfigError::new(
                file,
                Some(object),
                Some(field.to_string()),
                format!("a second mesh config: {first} is one already; keep exactly one"),
            ));
            return;
        }
        self.mesh = Some((mesh, format!("{object} in {file}")));
    }

    pub(super) fn finish(self) -> Loaded {
        let mut model = self.model;
        model.mesh = self.mesh.map(|(m, _)| m).unwrap_or_default();
        complete(&mut model);
        Loaded {
            model,
            errors: self.errors,
            rejected: self.rejected,
            unreadable: false,
        }
    }
}

/// Adds the implicit namespace of every object whose namespace nothing declares, and sorts.
pub(crate) fn complete(model: &mut Model) {
    model.cluster_domain = DEFAULT_CLUSTER_DOMAIN.to_string();
    let mut missing = std::collections::BTreeSet::new();
    // Objects come mostly grouped by namespace: one lookup per run of the same namespace.
    let mut previous: Option<&str> = None;
    for ns in model
        .service_entries
        .iter()
        .map(|s| &s.meta.namespace)
        .chain(model.services.iter().map(|s| &s.meta.namespace))
        .chain(model.workloads.iter().map(|w| &w.meta.namespace))
        .map(String::as_str)
        .chain(model.pods_elsewhere.namespaces())
    {
        if previous != Some(ns) && !model.namespaces.contains_key(ns) {
            missing.insert(ns.to_string());
        }
        previous = Some(ns);
    }
    for ns in missing {
        let implicit = Namespace::implicit(&ns);
        model.namespaces.insert(ns, implicit);
    }
    // Compared in place: a model of 20,000 objects is sorted without copying a name.
    fn key(m: &super::model::ObjectMeta) -> (&str, &str) {
        (&m.namespace, &m.name)
    }
    model
        .service_entries
        .sort_by(|a, b| key(&a.meta).cmp(&key(&b.meta)));
    model
        .services
        .sort_by(|a, b| key(&a.meta).cmp(&key(&b.meta)));
    model
        .workloads
        .sort_by(|a, b| (a.kind, key(&a.meta)).cmp(&(b.kind, key(&b.meta))));
    model
        .endpoint_slices
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
}

/// Deserializes a document into its raw shape; a type error names the field path.
fn typed<T: for<'de> Deserialize<'de>>(ctx: &mut Ctx<'_>, value: Value) -> Option<T> {
    typed_at(ctx, value, "")
}

/// As [`typed`], for a value held at `at` inside the object (`data.mesh`), named in the field path.
fn typed_at<T: for<'de> Deserialize<'de>>(ctx: &mut Ctx<'_>, value: Value, at: &str) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(raw) => Some(raw),
        Err(e) => {
            let path = e.path().to_string();
            let field = match (at, path.as_str()) {
                (at, ".") => at.to_string(),
                ("", path) => path.to_string(),
                (at, path) => format!("{at}.{path}"),
            };
            ctx.error(field, plain_message(&e.into_inner().to_string()));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fs,
        time::{Duration, Instant},
    };

    use super::*;

    const NS: &str = "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n";

    fn entry(name: &str, spec: &str) -> String {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: team-a}}\nspec: {spec}\n"
        )
    }

    fn names(loaded: &Loaded) -> Vec<&str> {
        loaded
            .model
            .service_entries
            .iter()
            .map(|s| s.meta.name.as_str())
            .collect()
    }

    #[test]
    fn one_bad_object_is_left_out_and_every_valid_one_loads() {
        let good = entry(
            "good",
            "{hosts: [good.example.com], addresses: [203.0.113.1]}",
        );
        let bad = entry(
            "bad",
            "{hosts: [bad.example.com], addresses: [203.0.113.0/33]}",
        );
        let text = format!("{NS}---\n{good}---\n{bad}");
        let loaded = read_sources([("a.yaml", text.as_str()), ("b.yaml", "kind: [unclosed")]);
        assert_eq!(names(&loaded), ["good"]);
        assert!(loaded.model.namespaces["team-a"].declared);
        let got: Vec<(&str, &str, &str)> = loaded
            .rejected
            .iter()
            .map(|r| (r.kind, r.name.as_str(), r.file.as_str()))
            .collect();
        assert_eq!(
            got,
            [("ServiceEntry", "bad", "a.yaml"), ("File", "", "b.yaml")]
        );
        assert_eq!(loaded.errors.len(), 2, "{:?}", loaded.errors);
        assert_eq!(loaded.errors[0].field.as_deref(), Some("spec.addresses[0]"));
        assert!(loaded.into_result().is_err(), "a strict load still refuses");
    }

    /// What a Pod's JSON can hold where the model reads it: anything, small.
    fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::{Value as Json, json};
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
    fn any_pod() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::{Value as Json, json};
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

    fn same_load(a: &Loaded, b: &Loaded) -> Result<(), proptest::test_runner::TestCaseError> {
        proptest::prop_assert_eq!(&a.errors, &b.errors);
        proptest::prop_assert_eq!(&a.rejected, &b.rejected);
        proptest::prop_assert_eq!(&a.model.workloads, &b.model.workloads);
        proptest::prop_assert_eq!(&a.model.namespaces, &b.model.namespaces);
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
        /// A Pod read from its JSON is what its YAML gives: the same workload or the same errors.
        #[test]
        fn a_pod_read_from_json_is_what_its_yaml_gives(pod in any_pod()) {
            same_load(&read_api_object("kubernetes API", &pod), &read_api_document("kubernetes API", &pod))?;
        }

        /// Whatever a part of a Pod holds.
        #[test]
        fn any_part_of_a_pod_reads_as_its_yaml_does(
            part in 0..3usize, field in "[a-z]{0,3}|ip|ports|containers|podIPs", value in any_json()
        ) {
            let mut pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "web-1", "namespace": "team-a"},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 80}]}]},
                "status": {"podIP": "10.0.0.1"}});
            let part = ["metadata", "spec", "status"][part];
            if field.is_empty() {
                pod[part] = value;
            } else {
                pod[part][field.as_str()] = value;
            }
            same_load(&read_api_object("kubernetes API", &pod), &read_api_document("kubernetes API", &pod))?;
        }
    }

    fn api_entry() -> serde_json::Value {
        serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
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
    fn entry_as_its_yaml(
        entry: &serde_json::Value,
    ) -> Result<bool, proptest::test_runner::TestCaseError> {
        let yaml = read_api_document("kubernetes API", entry);
        let Some(checked) = check_api_entry("kubernetes API", entry) else {
            return Ok(false);
        };
        match checked {
            Ok(se) => {
                proptest::prop_assert!(yaml.errors.is_empty(), "{:?}", yaml.errors);
                proptest::prop_assert_eq!(yaml.model.service_entries, vec![Arc::new(se)]);
            }
            Err(errors) => {
                proptest::prop_assert!(!errors.is_empty());
                proptest::prop_assert_eq!(&errors, &yaml.errors);
                proptest::prop_assert!(yaml.model.service_entries.is_empty());
            }
        }
        Ok(true)
    }

    /// `entry` with the value at `pointer` set, its field added if missing.
    fn set(entry: &mut serde_json::Value, pointer: &str, value: serde_json::Value) {
        let (parent, field) = pointer.rsplit_once('/').unwrap_or_default();
        match entry.pointer_mut(parent) {
            Some(serde_json::Value::Object(map)) => {
                map.insert(field.to_string(), value);
            }
            Some(serde_json::Value::Array(items)) => {
                items[field.parse::<usize>().unwrap()] = value;
            }
            _ => panic!("no {parent}"),
        }
    }

    #[test]
    fn an_entry_read_from_json_is_what_its_yaml_gives() {
        use serde_json::json;
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
        let loaded = check_api_entry("kubernetes API", &api_entry())
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
        entry["status"]["addresses"] = serde_json::json!([
            {"value": "169.254.7.1", "host": "api.example.com"},
            {"value": "240.240.0.1", "host": "api.example.com"}
        ]);
        let se = check_api_entry("kubernetes API", &entry).unwrap().unwrap();
        let kept: Vec<String> = se
            .status_addresses
            .iter()
            .map(|a| a.ip.to_string())
            .collect();
        assert_eq!(kept, ["240.240.0.1"]);
        let [e] = se.refused_status.as_slice() else {
            panic!("{:?}", se.refused_status)
        };
        assert_eq!(e.file, "kubernetes API");
        assert_eq!(e.object.as_deref(), Some("ServiceEntry team-a/api"));
        assert_eq!(e.field.as_deref(), Some("status.addresses[0].value"));
        let yaml = read_api_object("kubernetes API", &entry);
        assert!(
            yaml.errors.is_empty() && yaml.rejected.is_empty(),
            "{:?}",
            yaml.errors
        );
        assert_eq!(yaml.model.service_entries, vec![Arc::new(se)]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
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
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "team-a"},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 80}]}]},
            "status": {"podIP": "10.0.0.1"}});
        assert!(read_api_pod("kubernetes API", &pod).is_some());
        let mut odd = pod.clone();
        odd["spec"]["containers"][0]["ports"][0] = serde_json::json!(["http", 80]);
        assert!(read_api_pod("kubernetes API", &odd).is_none());
        let mut odd = pod.clone();
        odd["status"]["podIP"] = serde_json::json!(10);
        assert!(read_api_pod("kubernetes API", &odd).is_none());
        let loaded = read_api_object("kubernetes API", &odd);
        assert_eq!(loaded.errors[0].field.as_deref(), Some("status.podIP"));
        let entry = serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
            "metadata": {"name": "e", "namespace": "team-a"}, "spec": {"hosts": ["e.example.com"]}});
        assert!(read_api_pod("kubernetes API", &entry).is_none());
        assert_eq!(
            read_api_object("kubernetes API", &entry)
                .model
                .service_entries
                .len(),
            1
        );
    }

    #[test]
    fn documents_before_a_syntax_error_still_load() {
        let good = entry("good", "{hosts: [good.example.com]}");
        let text = format!("{good}---\nkind: [unclosed\n");
        let loaded = read_sources([("a.yaml", text.as_str())]);
        assert_eq!(names(&loaded), ["good"]);
        assert_eq!(loaded.rejected[0].kind, "File");
    }

    /// Messages name the form a field expects, never the Rust type behind it.
    #[test]
    fn messages_are_in_the_users_terms() {
        struct Case {
            name: &'static str,
            yaml: String,
            message: &'static str,
        }
        let cases = [
            Case {
                name: "port number as text",
                yaml: entry("x", "{hosts: [a.example.com], ports: [{number: eighty}]}"),
                message: "expected an integer, got string \"eighty\"",
            },
            Case {
                name: "ports as a mapping",
                yaml: entry("x", "{hosts: [a.example.com], ports: {number: 80}}"),
                message: "expected a list, got a mapping",
            },
            Case {
                name: "spec as a list",
                yaml: entry("x", "[a, b]"),
                message: "expected a mapping, got a list",
            },
            Case {
                name: "visibility config as a list",
                yaml: "kind: MeshConfig\nserviceEntryVisibility: [1]\n".into(),
                message: "expected a mapping, got a list",
            },
            Case {
                name: "applyToSidecars as a number",
                yaml: "kind: MeshConfig\nserviceEntryVisibility: {applyToSidecars: 3}\n".into(),
                message: "expected true or false, got integer 3",
            },
            Case {
                name: "Service targetPort as a list",
                yaml: "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: a}\nspec: {ports: [{port: 80, targetPort: [1]}]}\n".into(),
                message: "expected a port number or a port name",
            },
        ];
        for case in cases {
            let loaded = read_sources([("a.yaml", case.yaml.as_str())]);
            let [e] = loaded.errors.as_slice() else {
                panic!("{}: {:?}", case.name, loaded.errors)
            };
            assert!(e.message.contains(case.message), "{}: {e}", case.name);
            for rust in ["i64", "u16", "struct", "Raw", "enum", "sequence", "map,"] {
                assert!(!e.message.contains(rust), "{}: {rust} in {e}", case.name);
            }
        }
    }

    #[test]
    fn a_huge_bad_value_is_quoted_only_in_part() {
        let huge = "x".repeat(1 << 20);
        let text = entry(
            &huge,
            &format!("{{hosts: [a.example.com], addresses: [{huge}]}}"),
        );
        let loaded = read_sources([("a.yaml", text.as_str())]);
        assert!(!loaded.errors.is_empty());
        for e in &loaded.errors {
            let shown = e.to_string();
            assert!(
                shown.len() < 2 * (MAX_QUOTED + crate::config::MAX_MESSAGE),
                "{} bytes",
                shown.len()
            );
        }
        assert!(loaded.rejected.iter().all(|r| r.name.len() <= MAX_QUOTED));
    }

    #[test]
    fn a_directory_with_hostile_files_loads_what_it_may_quickly() {
        let dir =
            std::env::temp_dir().join(format!("redirect-loader-hostile-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("a.yaml"),
            entry("good", "{hosts: [good.example.com]}"),
        )
        .unwrap();
        super::super::source::tests::mkfifo(&dir.join("fifo.yaml"));
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).unwrap();
        // An ignored 100 MB file (sparse) and an over-cap manifest.
        let ignored = fs::File::create(dir.join("big.bin")).unwrap();
        ignored.set_len(100 << 20).unwrap();
        let over = fs::File::create(dir.join("over.yaml")).unwrap();
        over.set_len(5 << 20).unwrap();
        fs::write(
            dir.join("bomb.yaml"),
            crate::config::yaml::tests::alias_bomb(),
        )
        .unwrap();
        let started = Instant::now();
        let loaded = read_dir(&dir, &Limits::default());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(names(&loaded), ["good"]);
        let files: Vec<&str> = loaded
            .errors
            .iter()
            .map(|e| e.file.rsplit('/').next().unwrap_or_default())
            .collect();
        assert_eq!(files, ["bomb.yaml", "over.yaml"], "{:?}", loaded.errors);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_directory_cap_leaves_out_the_files_past_it() {
        let dir =
            std::env::temp_dir().join(format!("redirect-loader-dircap-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let a = entry("a", "{hosts: [a.example.com]}");
        fs::write(dir.join("a.yaml"), &a).unwrap();
        fs::write(dir.join("b.yaml"), entry("b", "{hosts: [b.example.com]}")).unwrap();
        let limits = Limits {
            max_file_bytes: 1 << 20,
            max_dir_bytes: a.len() as u64 + 10,
        };
        let loaded = read_dir(&dir, &limits);
        assert_eq!(names(&loaded), ["a"]);
        assert!(
            loaded.errors[0].message.contains("--config-max-dir-bytes"),
            "{:?}",
            loaded.errors
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
