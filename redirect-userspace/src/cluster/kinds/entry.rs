//! A ServiceEntry read from the API's bytes straight to the fields the model reads, when no
//! status writer looks at its status: the managed fields, annotations (often a whole copy of the
//! entry) and status conditions are skipped as they are parsed, never held.
//!
//! What is kept is JSON, read whatever its shape: a field of an unexpected type is left to the
//! loader, which refuses that entry with the field named. One odd entry never fails the page it
//! came in.
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, de::DeserializeSeed};
use serde_json::Value;

use super::{Converted, Kind, pod::watch_meta};
use crate::config::{ENTRY, Reader};

/// A ServiceEntry as a watch without a status writer reads it: what the model reads of it
/// ([`ENTRY`]), as JSON.
#[derive(Debug, Clone)]
pub(crate) struct ApiEntry {
    /// Its name, namespace and `resourceVersion`: what kube's watcher reads of an object.
    meta: ObjectMeta,
    object: Value,
}

impl ApiEntry {
    /// The entry converted as [`super::convert`] converts the whole object, but for its status
    /// (no status writer reads it).
    pub(crate) fn convert(self, api_version: &str) -> Converted {
        super::convert_unobserved(Kind::ServiceEntry, api_version, self.object)
    }
}

impl<'de> Deserialize<'de> for ApiEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut object = Reader(&ENTRY).deserialize(deserializer)?;
        let meta = watch_meta(&mut object);
        Ok(ApiEntry { meta, object })
    }
}

super::api_resource!(ApiEntry);

#[cfg(test)]
mod tests {
    use kube::{Resource, api::DynamicObject};
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::cluster::watch::as_json;

    const API_VERSION: &str = "networking.istio.io/v1";

    /// An entry as the API serves it, with what nothing reads.
    fn entry() -> Value {
        json!({
            "apiVersion": API_VERSION, "kind": "ServiceEntry",
            "metadata": {
                "name": "api", "namespace": "team-a", "resourceVersion": "42", "generation": 3,
                "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
                "creationTimestamp": "2024-05-01T12:00:00Z", "labels": {"app": "api"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"spec\":{}}"},
                "managedFields": [{"manager": "pilot", "operation": "Update",
                                   "fieldsV1": {"f:status": {"f:conditions": {}}}}]
            },
            "spec": {"hosts": ["api.example.com"], "addresses": ["203.0.113.10"],
                     "ports": [{"number": 443, "name": "https", "protocol": "TLS"}],
                     "location": "MESH_EXTERNAL", "resolution": "STATIC",
                     "endpoints": [{"address": "198.51.100.1"}]},
            "status": {"addresses": [{"value": "240.240.0.1", "host": "api.example.com"}],
                       "conditions": [{"type": "Reconciled", "status": "True"}]}
        })
    }

    /// What the watch gives reading the entry whole; `None` where that failed the whole page.
    fn read_whole(text: &str) -> Option<Converted> {
        let object: DynamicObject = serde_json::from_str(text).ok()?;
        let json = as_json(Kind::ServiceEntry, object, false).ok()?;
        let mut converted = super::super::convert(Kind::ServiceEntry, API_VERSION, json);
        converted.observed = None;
        Some(converted)
    }

    fn same_either_way(text: &str) -> Result<(), TestCaseError> {
        let entry: ApiEntry = serde_json::from_str(text).expect("any JSON reads as an entry");
        let slim = entry.convert(API_VERSION);
        prop_assert!(slim.observed.is_none());
        if let Some(whole) = read_whole(text) {
            prop_assert_eq!(&slim.object, &whole.object, "{}", text);
            prop_assert_eq!(&slim.errors, &whole.errors, "{}", text);
        }
        Ok(())
    }

    #[test]
    fn an_entry_reads_slim_as_it_reads_whole() {
        let text = entry().to_string();
        same_either_way(&text).unwrap();
        let read: ApiEntry = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (
                read.meta().name.as_deref(),
                read.meta().resource_version.as_deref()
            ),
            (Some("api"), Some("42"))
        );
        assert!(read.object["metadata"].get("managedFields").is_none());
        assert!(read.object["status"].get("conditions").is_none());
        let got = read.convert(API_VERSION);
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        assert!(matches!(
            got.object,
            Some(super::super::Object::ServiceEntry(_))
        ));
    }

    #[test]
    fn odd_entries_read_slim_as_they_read_whole() {
        for (pointer, value) in [
            ("/spec/addresses/0", json!("203.0.113.0/33")),
            ("/spec/ports/0/number", json!("443")),
            ("/spec/ports/0", json!([443])),
            ("/spec", json!([{"hosts": ["a.example.com"]}])),
            (
                "/metadata/creationTimestamp",
                json!("2024-05-01T12:00:00.5Z"),
            ),
            (
                "/metadata/creationTimestamp",
                json!("2024-05-01T14:00:00+02:00"),
            ),
            ("/metadata/labels", json!({})),
            ("/status", json!(null)),
            ("/spec/hosts/0", json!(null)),
        ] {
            let mut object = entry();
            *object.pointer_mut(pointer).unwrap() = value;
            same_either_way(&object.to_string()).unwrap();
        }
        // Metadata kube could not read refuses the one entry, not the page.
        let mut object = entry();
        object["metadata"]["labels"]["app"] = json!(7);
        let text = object.to_string();
        assert!(read_whole(&text).is_none());
        let got = serde_json::from_str::<ApiEntry>(&text)
            .unwrap()
            .convert(API_VERSION);
        assert!(got.object.is_none());
        assert_eq!(got.errors[0].field.as_deref(), Some("metadata.labels.app"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_entry_reads_slim_as_it_reads_whole(
            place in 0..8usize,
            value in prop_oneof![
                Just(json!(null)), Just(json!(7)), Just(json!("x")), Just(json!([1])),
                Just(json!({"a": "b"})), Just(json!("10.1.2.3")), Just(json!(443)),
            ]
        ) {
            const PLACES: [&str; 8] = ["/metadata/uid", "/metadata/namespace", "/spec/hosts",
                "/spec/ports/0/name", "/spec/resolution", "/spec/endpoints/0/address",
                "/status/addresses", "/status/addresses/0/value"];
            let mut object = entry();
            *object.pointer_mut(PLACES[place]).unwrap() = value;
            same_either_way(&object.to_string())?;
        }
    }
}
