//! What the API says a ServiceEntry's status is now, read from each object the watch sends.
use serde_json::Value;

/// The field manager the agent writes status as; any other manager's conditions are not ours.
pub(crate) const FIELD_MANAGER: &str = "redirect-agent";

/// One ServiceEntry's status as last seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// Written back with each update: a write over a newer version is refused (409), not lost.
    pub resource_version: String,
    /// `metadata.generation`: conditions say which version of the spec they describe.
    pub generation: Option<i64>,
    /// `status.conditions` as they stand, every type (only the status writer's are ever changed).
    pub conditions: Vec<Value>,
    /// Another field manager that last wrote the conditions (`istiod` does when it writes these
    /// conditions itself), if any.
    pub other_writer: Option<String>,
}

/// Reads the status of a ServiceEntry object as the API serves it.
pub(crate) fn observe(object: &Value) -> Observed {
    let meta = &object["metadata"];
    let other_writer = meta["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| !m["fieldsV1"]["f:status"]["f:conditions"].is_null())
        .filter_map(|m| m["manager"].as_str())
        .find(|manager| *manager != FIELD_MANAGER)
        .map(str::to_string);
    Observed {
        resource_version: meta["resourceVersion"].as_str().unwrap_or("").to_string(),
        generation: meta["generation"].as_i64(),
        conditions: object["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
        other_writer,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_version_generation_conditions_and_who_wrote_them() {
        let object = json!({
            "metadata": {"name": "api", "namespace": "team-a", "resourceVersion": "42", "generation": 3,
                "managedFields": [
                    {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {}}},
                    {"manager": "pilot-discovery", "operation": "Apply", "subresource": "status",
                     "fieldsV1": {"f:status": {"f:conditions": {}}}}]},
            "status": {"conditions": [{"type": "istio.io/VisibilityApplied", "status": "True"}]}
        });
        let got = observe(&object);
        assert_eq!(got.resource_version, "42");
        assert_eq!(got.generation, Some(3));
        assert_eq!(got.conditions.len(), 1);
        assert_eq!(got.other_writer.as_deref(), Some("pilot-discovery"));

        // Our own writes are not another writer's; no status at all is no conditions.
        let object = json!({"metadata": {"resourceVersion": "7", "managedFields": [
            {"manager": FIELD_MANAGER, "fieldsV1": {"f:status": {"f:conditions": {}}}}]}});
        let got = observe(&object);
        assert_eq!(got.other_writer, None);
        assert!(got.conditions.is_empty());
        assert_eq!(got.generation, None);
    }
}
