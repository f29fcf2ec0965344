//! Reading a directory of Kubernetes YAML into a [`Model`]: every document of every file, all errors
//! collected, nothing returned unless everything is valid.
use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use serde::Deserialize;
use serde_yaml_ng::Value;

use super::{
    error::{ConfigError, ConfigErrors, Ctx},
    kube::{RawNamespace, RawPod, RawService},
    mesh::{MeshConfig, RawConfigMap, RawIstioOperator, RawMeshConfig},
    model::{DEFAULT_CLUSTER_DOMAIN, DEFAULT_NAMESPACE, Model, Namespace},
    service_entry::{RawServiceEntry, RawWorkloadEntry},
};

/// Loads every `.yaml`, `.yml` and `.json` file directly in `path` (or the one file `path` names).
/// Hidden entries are skipped, so a mounted ConfigMap (`..data` links) loads each file once.
pub fn load_dir(path: &Path) -> Result<Model, ConfigErrors> {
    let files = list_files(path).map_err(|message| {
        ConfigErrors(vec![ConfigError::new(
            path.display().to_string(),
            None,
            None,
            message,
        )])
    })?;
    let mut sources = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        match fs::read_to_string(&file) {
            Ok(text) => sources.push((file.display().to_string(), text)),
            Err(e) => errors.push(ConfigError::new(
                file.display().to_string(),
                None,
                None,
                format!("cannot read: {e}"),
            )),
        }
    }
    let mut loader = Loader::default();
    for (file, text) in &sources {
        loader.add_file(file, text);
    }
    loader.errors.extend(errors);
    loader.finish()
}

/// Loads from in-memory sources `(file name, text)`, in order, exactly as [`load_dir`] would.
pub fn load_sources<'a>(
    sources: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Model, ConfigErrors> {
    let mut loader = Loader::default();
    for (file, text) in sources {
        loader.add_file(file, text);
    }
    loader.finish()
}

fn list_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    let meta = fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(|e| format!("cannot list directory: {e}"))? {
        let entry = entry.map_err(|e| format!("cannot list directory: {e}"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let manifest = [".yaml", ".yml", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext));
        // fs::metadata follows links: ConfigMap mounts link each file into `..data/`.
        if !name.starts_with('.')
            && manifest
            && fs::metadata(entry.path()).is_ok_and(|m| m.is_file())
        {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

#[derive(Default)]
struct Loader {
    errors: Vec<ConfigError>,
    model: Model,
    /// (kind, namespace, name) -> file, to refuse duplicates.
    seen: HashMap<(&'static str, String, String), String>,
    /// The mesh config found so far and what it was (`IstioOperator in FILE`).
    mesh: Option<(MeshConfig, String)>,
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
        _ => return None,
    })
}

fn str_at<'v>(value: &'v Value, path: &[&str]) -> Option<&'v str> {
    path.iter().try_fold(value, |v, key| v.get(*key))?.as_str()
}

/// `Kind namespace/name`, or `Kind name` for a cluster-scoped kind, or `Kind` when unnamed.
fn describe(kind: &str, value: &Value) -> String {
    let name = str_at(value, &["metadata", "name"]);
    let namespace = str_at(value, &["metadata", "namespace"]);
    match (kind, name) {
        (_, None) => kind.to_string(),
        ("Namespace", Some(name)) => format!("Namespace {name}"),
        (_, Some(name)) => format!("{kind} {}/{name}", namespace.unwrap_or(DEFAULT_NAMESPACE)),
    }
}

impl Loader {
    fn add_file(&mut self, file: &str, text: &str) {
        for (index, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
            match Value::deserialize(document) {
                Ok(value) => self.add_document(file, value, String::new()),
                Err(e) => {
                    self.errors.push(ConfigError::new(
                        file,
                        None,
                        None,
                        format!("document {} is not valid YAML: {e}", index + 1),
                    ));
                    // The parser cannot resynchronise after a syntax error: the rest of the file is lost.
                    break;
                }
            }
        }
    }

    fn add_document(&mut self, file: &str, value: Value, prefix: String) {
        if value.is_null() {
            return;
        }
        let Some(kind_text) = value
            .get("kind")
            .and_then(Value::as_str)
            .map(str::to_string)
        else {
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
            return;
        };
        let api_version = value.get("apiVersion").and_then(Value::as_str);
        let Some(kind) = classify(api_version, &kind_text) else {
            tracing::debug!(file, kind = %kind_text, api_version, "skipping a kind the agent does not use");
            return;
        };
        let object = describe(kind, &value);
        let mut ctx = Ctx {
            file,
            object,
            prefix,
            errors: &mut self.errors,
        };
        match kind {
            "List" => {
                let prefix = ctx.prefix.clone();
                let items = match value.get("items") {
                    Some(Value::Sequence(items)) => items.clone(),
                    _ => Vec::new(),
                };
                for (i, item) in items.into_iter().enumerate() {
                    self.add_document(file, item, format!("{prefix}items[{i}]."));
                }
            }
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
                    self.model.service_entries.push(se);
                }
            }
            "Service" => {
                if let Some(svc) =
                    typed::<RawService>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("Service", &svc.meta.namespace, &svc.meta.name, file)
                {
                    self.model.services.push(svc);
                }
            }
            "Pod" => {
                if let Some(pod) =
                    typed::<RawPod>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("Pod", &pod.meta.namespace, &pod.meta.name, file)
                {
                    self.model.workloads.push(pod);
                }
            }
            "WorkloadEntry" => {
                if let Some(we) =
                    typed::<RawWorkloadEntry>(&mut ctx, value).and_then(|r| r.convert(&mut ctx))
                    && self.first("WorkloadEntry", &we.meta.namespace, &we.meta.name, file)
                {
                    self.model.workloads.push(we);
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
                if str_at(&value, &["metadata", "name"]) != Some("istio") {
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
                let raw = match serde_path_to_error::deserialize::<_, Option<RawMeshConfig>>(
                    serde_yaml_ng::Deserializer::from_str(&text),
                ) {
                    Ok(raw) => Some(raw.unwrap_or_default()),
                    Err(e) => {
                        let path = e.path().to_string();
                        let field = if path == "." {
                            "data.mesh".to_string()
                        } else {
                            format!("data.mesh.{path}")
                        };
                        ctx.error(field, e.into_inner().to_string());
                        None
                    }
                };
                let mesh = raw.and_then(|r| r.convert(&mut ctx, "data.mesh."));
                let object = ctx.object;
                self.set_mesh(file, object, "data.mesh", mesh);
            }
            _ => unreachable!("classify returns only the kinds above"),
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

    fn finish(self) -> Result<Model, ConfigErrors> {
        if !self.errors.is_empty() {
            return Err(ConfigErrors(self.errors));
        }
        let mut model = self.model;
        model.mesh = self.mesh.map(|(m, _)| m).unwrap_or_default();
        model.cluster_domain = DEFAULT_CLUSTER_DOMAIN.to_string();
        let referenced: Vec<String> = model
            .service_entries
            .iter()
            .map(|s| &s.meta.namespace)
            .chain(model.services.iter().map(|s| &s.meta.namespace))
            .chain(model.workloads.iter().map(|w| &w.meta.namespace))
            .cloned()
            .collect();
        for ns in referenced {
            model
                .namespaces
                .entry(ns.clone())
                .or_insert_with(|| Namespace::implicit(&ns));
        }
        let key = |m: &super::model::ObjectMeta| (m.namespace.clone(), m.name.clone());
        model.service_entries.sort_by_key(|s| key(&s.meta));
        model.services.sort_by_key(|s| key(&s.meta));
        model.workloads.sort_by_key(|w| (w.kind, key(&w.meta)));
        Ok(model)
    }
}

/// Deserializes a document into its raw shape; a type error names the field path.
fn typed<T: for<'de> Deserialize<'de>>(ctx: &mut Ctx<'_>, value: Value) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(raw) => Some(raw),
        Err(e) => {
            let path = e.path().to_string();
            ctx.error(
                if path == "." { "" } else { &path },
                e.into_inner().to_string(),
            );
            None
        }
    }
}
