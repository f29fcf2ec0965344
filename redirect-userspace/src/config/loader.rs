//! Reading a directory of Kubernetes YAML into a [`Model`]: every document of every file, each
//! object checked on its own. An invalid object is left out and reported; every valid one loads.
use std::{collections::HashMap, path::Path, sync::Arc};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::{
    authorization::{RawAuthorizationPolicy, RawPeerAuthentication},
    endpoint_slice::RawEndpointSlice,
    error::{ConfigError, ConfigErrors, Ctx, MAX_QUOTED, bounded, plain_message},
    kube::{RawNamespace, RawPod, RawService},
    mesh::{MeshConfig, RawConfigMap, RawIstioOperator, RawMeshConfig},
    model::{DEFAULT_CLUSTER_DOMAIN, DEFAULT_NAMESPACE, Model, Namespace},
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
    limits: Limits,
    /// The size of every file listed so far, against `limits.max_dir_bytes`.
    bytes_listed: u64,
}

/// Who a document says it is, for reports and for keeping its last good version.
pub(super) struct Identity {
    kind: &'static str,
    namespace: String,
    name: String,
}

/// What a document is, from `apiVersion` and `kind`. `None`: not ours, skipped.
pub(super) fn classify(api_version: Option<&str>, kind: &str) -> Option<&'static str> {
    let group = api_version.map(|v| v.rsplit_once('/').map_or("", |(g, _)| g));
    let version = api_version.map(|v| v.rsplit_once('/').map_or(v, |(_, v)| v));
    let core = matches!(api_version, None | Some("v1"));
    let istio_networking = group.is_none_or(|g| g == "networking.istio.io")
        && version.is_none_or(|v| matches!(v, "v1" | "v1beta1" | "v1alpha3"));
    let istio_security = group.is_none_or(|g| g == "security.istio.io")
        && version.is_none_or(|v| matches!(v, "v1" | "v1beta1"));
    Some(match kind {
        "AuthorizationPolicy" if istio_security => "AuthorizationPolicy",
        "PeerAuthentication" if istio_security => "PeerAuthentication",
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
pub(super) fn describe(id: &Identity) -> String {
    match (id.kind, id.name.as_str()) {
        (kind, "") => kind.to_string(),
        ("Namespace", name) => format!("Namespace {name}"),
        (kind, name) => format!("{kind} {}/{name}", id.namespace),
    }
}

/// Who an object says it is; `text` reads the string at a path of it.
pub(super) fn identity<'v>(
    kind: &'static str,
    text: impl Fn(&[&str]) -> Option<&'v str>,
) -> Identity {
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

    /// Reads one document of a file: an object of a kind the agent uses, or a `List` of them.
    pub(super) fn add_document(&mut self, file: &str, value: Value, prefix: String) {
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
        if kind == "EndpointSlice" {
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
        self.add_kind(file, kind, value, prefix);
    }

    /// Reads one object of a known `kind` (as [`classify`] names it): added if valid, else left
    /// out and reported.
    pub(super) fn add_kind(
        &mut self,
        file: &str,
        kind: &'static str,
        value: Value,
        prefix: String,
    ) {
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
            "AuthorizationPolicy" | "PeerAuthentication" => {
                let prefix = ctx.prefix.clone();
                self.add_security(file, id, value, prefix);
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

    /// An AuthorizationPolicy or a PeerAuthentication: converted and added if valid.
    fn add_security(&mut self, file: &str, id: &Identity, value: Value, prefix: String) {
        let mut ctx = Ctx {
            file,
            object: describe(id),
            prefix,
            errors: &mut self.errors,
        };
        let kind = id.kind;
        if kind == "AuthorizationPolicy" {
            let policy =
                typed::<RawAuthorizationPolicy>(&mut ctx, value).and_then(|r| r.convert(&mut ctx));
            if let Some(policy) = policy
                && self.first(kind, &policy.meta.namespace, &policy.meta.name, file)
            {
                self.model.authorization_policies.push(Arc::new(policy));
            }
        } else {
            let policy =
                typed::<RawPeerAuthentication>(&mut ctx, value).and_then(|r| r.convert(&mut ctx));
            if let Some(policy) = policy
                && self.first(kind, &policy.meta.namespace, &policy.meta.name, file)
            {
                self.model.peer_authentications.push(Arc::new(policy));
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
        .chain(
            model
                .authorization_policies
                .iter()
                .map(|p| &p.meta.namespace),
        )
        .chain(model.peer_authentications.iter().map(|p| &p.meta.namespace))
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
        .authorization_policies
        .sort_by(|a, b| key(&a.meta).cmp(&key(&b.meta)));
    model
        .peer_authentications
        .sort_by(|a, b| key(&a.meta).cmp(&key(&b.meta)));
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
