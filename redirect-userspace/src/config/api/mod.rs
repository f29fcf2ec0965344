//! Reading objects as the Kubernetes API serves them (JSON, one object at a time) into what a file
//! gives: the same checks, the same objects, the same errors.
//!
//! Two ways, one result. [`read_api_object`] is the reference: the object as YAML, read as one
//! document of a file is. For the two kinds a cluster holds by the thousand, the watch cuts each
//! object down as it is parsed ([`Reader`] with [`POD`] or [`ENTRY`]) and [`check_api_pod`] and
//! [`check_api_entry`] read that JSON straight into the loader's raw shapes, without YAML in
//! between, whenever it reads as its YAML does ([`reads_as_its_yaml`]). When it might not, the
//! caller takes the reference way, so that an odd object is refused in the reference's words.
mod partial;
#[cfg(test)]
mod tests;

use serde::Deserialize;
use serde_json::Value;

pub(crate) use partial::Reader;
use partial::{All, Each, Fields, Keep, PART};

use super::{
    error::{ConfigError, Ctx},
    kube::RawPod,
    loader::{Loaded, Loader, classify, describe, identity},
    model::{ServiceEntry, Workload},
    service_entry::RawServiceEntry,
    source::Limits,
};

/// What the model reads of an object's metadata, and the `resourceVersion` a watch resumes from.
const META: Keep = Fields(&[
    ("name", All),
    ("namespace", All),
    ("labels", All),
    ("creationTimestamp", All),
    ("uid", All),
    ("resourceVersion", All),
]);

/// What the model reads of a Pod's metadata: [`META`], and what names its workload for Istio's
/// telemetry (the owner that made it).
const POD_META: Keep = Fields(&[
    ("name", All),
    ("namespace", All),
    ("labels", All),
    ("creationTimestamp", All),
    ("uid", All),
    ("resourceVersion", All),
    ("generateName", All),
    (
        "annotations",
        Fields(&[(super::SIDECAR_STATUS_ANNOTATION, All)]),
    ),
    (
        "ownerReferences",
        Each(&Fields(&[
            ("kind", All),
            ("name", All),
            ("controller", All),
        ])),
    ),
]);

/// What the model reads of a Pod: nearly none of its bytes (managed fields, annotations,
/// container specs, most of the status are skipped).
pub(crate) const POD: Keep = Fields(&[
    ("metadata", POD_META),
    (
        "spec",
        Fields(&[
            ("nodeName", All),
            ("serviceAccountName", All),
            ("hostNetwork", All),
            (
                "containers",
                Each(&Fields(&[(
                    "ports",
                    Each(&Fields(&[("name", All), ("containerPort", All)])),
                )])),
            ),
        ]),
    ),
    (
        "status",
        Fields(&[("podIP", All), ("podIPs", Each(&Fields(&[("ip", All)])))]),
    ),
]);

/// What the model reads of a ServiceEntry: its spec whole, and of its status Istio's allocated
/// addresses (the conditions and the managed fields, often most of its bytes, are skipped).
pub(crate) const ENTRY: Keep = Fields(&[
    ("metadata", META),
    (
        "spec",
        Fields(&[
            ("ports", Each(&PART)),
            ("endpoints", Each(&PART)),
            ("workloadSelector", PART),
            ("*", All),
        ]),
    ),
    ("status", Fields(&[("addresses", Each(&PART))])),
]);

/// Reads one object as the API serves it (with `apiVersion` and `kind`) exactly as one document
/// of a file is read: the same checks and the same errors, `source` standing in for the file
/// name. The model holds that object alone (plus its implicit namespace).
pub(crate) fn read_api_object(source: &str, object: &Value) -> Loaded {
    let limits = Limits::default();
    let mut loader = Loader::new(&limits);
    let api_version = object.get("apiVersion").and_then(Value::as_str);
    let kind = object.get("kind").and_then(Value::as_str);
    match (
        kind.and_then(|k| classify(api_version, k)),
        serde_yaml_ng::to_value(object),
    ) {
        (Some(kind), Ok(value)) if kind != "List" => {
            loader.add_kind(source, kind, value, String::new())
        }
        (_, Ok(value)) => loader.add_document(source, value, String::new()),
        (_, Err(e)) => loader.file_error(source, format!("not a Kubernetes object: {e}")),
    }
    loader.finish()
}

/// A ServiceEntry the API served, cut down to [`ENTRY`], checked as [`read_api_object`] checks it
/// without YAML in between: the same entry or the same errors. `None` when its JSON might read
/// otherwise than its YAML does: read it with [`read_api_object`] then.
pub(crate) fn check_api_entry(
    source: &str,
    object: &Value,
) -> Option<Result<ServiceEntry, Vec<ConfigError>>> {
    let api_version = object.get("apiVersion").and_then(Value::as_str);
    let kind = object.get("kind").and_then(Value::as_str)?;
    if classify(api_version, kind) != Some("ServiceEntry") || !reads_as_its_yaml(object, &ENTRY) {
        return None;
    }
    let raw = RawServiceEntry::deserialize(object).ok()?;
    let text = |path: &[&str]| path.iter().try_fold(object, |v, key| v.get(*key))?.as_str();
    let id = identity("ServiceEntry", text);
    Some(checked(source, &id, |ctx| raw.convert(ctx)))
}

/// A `v1` Pod the API served, cut down to [`POD`], checked as [`read_api_object`] checks it
/// without YAML in between: the same workload or the same errors. Of another node's Pod
/// (`elsewhere`), only what that watch keeps: no uid, age or node. `Err`: its JSON might read
/// otherwise than its YAML does; the JSON, for [`read_api_object`].
pub(crate) fn check_api_pod(
    source: &str,
    pod: Value,
    elsewhere: bool,
) -> Result<Result<Workload, Vec<ConfigError>>, Value> {
    if !reads_as_its_yaml(&pod, &POD) {
        return Err(pod);
    }
    let Ok(mut raw) = RawPod::deserialize(&pod) else {
        return Err(pod);
    };
    if elsewhere {
        raw.forget_this_nodes_fields();
    }
    let text = |path: &[&str]| path.iter().try_fold(&pod, |v, key| v.get(*key))?.as_str();
    let id = identity("Pod", text);
    Ok(checked(source, &id, |ctx| raw.convert(ctx)))
}

/// Whether JSON read into a loader's raw shape gives what its YAML gives, wherever it reads at
/// all: no list stands where `keep` says a part goes. Read from JSON, a list fills a part field by
/// field in order; YAML refuses it, and names the field. A value of another type fails either
/// way, and the caller then reads it the YAML way for the YAML's words.
fn reads_as_its_yaml(value: &Value, keep: &Keep) -> bool {
    match (keep, value) {
        (Fields(_), Value::Array(_)) => false,
        (Fields(fields), Value::Object(map)) => fields
            .iter()
            .filter(|(name, _)| *name != "*")
            .all(|(name, keep)| map.get(*name).is_none_or(|v| reads_as_its_yaml(v, keep))),
        (Each(item), Value::Array(items)) => items.iter().all(|v| reads_as_its_yaml(v, item)),
        _ => true,
    }
}

/// What `convert` makes of one object `id` read from `source`, or every error it gave (one error
/// and the object is refused, as a load refuses it).
fn checked<T>(
    source: &str,
    id: &super::loader::Identity,
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
