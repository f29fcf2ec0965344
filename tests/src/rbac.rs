//! The RBAC rules the DaemonSet's service account is given (`deploy/manifests/10-rbac.yaml`), to
//! hold what an agent asked of the test API server against them: the test server authorizes
//! nothing, so a verb the agent needs and the manifests forget would pass every other test and
//! fail in a real cluster with 403.
use std::path::Path;

use anyhow::{Context, Result};
use serde::Deserialize;

/// One rule of a Role or ClusterRole. `resourceNames` is not held: a rule that names objects
/// counts as allowing the verb on the resource (the agent asks for the one object it names).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    #[serde(default)]
    pub api_groups: Vec<String>,
    #[serde(default)]
    pub resources: Vec<String>,
    #[serde(default)]
    pub verbs: Vec<String>,
}

impl Rule {
    pub fn allows(&self, group: &str, resource: &str, verb: &str) -> bool {
        let has = |list: &[String], item: &str| list.iter().any(|v| v == item || v == "*");
        has(&self.api_groups, group) && has(&self.resources, resource) && has(&self.verbs, verb)
    }
}

#[derive(Deserialize)]
struct Document {
    kind: Option<String>,
    #[serde(default)]
    rules: Vec<Rule>,
}

/// Every rule of every Role and ClusterRole in the repository's RBAC manifest.
pub fn manifest_rules() -> Result<Vec<Rule>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests/10-rbac.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    rules_of(&text).with_context(|| format!("{}", path.display()))
}

fn rules_of(text: &str) -> Result<Vec<Rule>> {
    let mut rules = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let document = Document::deserialize(document)?;
        if matches!(document.kind.as_deref(), Some("Role" | "ClusterRole")) {
            rules.extend(document.rules);
        }
    }
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_allows_its_groups_resources_and_verbs_only() -> Result<()> {
        let rules = rules_of(
            "kind: ClusterRole\nrules:\n  - apiGroups: [\"\"]\n    resources: [pods]\n    verbs: [get, list]\n---\nkind: RoleBinding\nrules: []\n---\nkind: Role\nrules:\n  - apiGroups: [coordination.k8s.io]\n    resources: [leases]\n    resourceNames: [x]\n    verbs: [update]\n",
        )?;
        let allowed = |g: &str, r: &str, v: &str| rules.iter().any(|rule| rule.allows(g, r, v));
        assert!(allowed("", "pods", "list"));
        assert!(!allowed("", "pods", "watch"));
        assert!(!allowed("apps", "pods", "get"));
        assert!(allowed("coordination.k8s.io", "leases", "update"));
        assert!(!allowed("coordination.k8s.io", "leases/status", "update"));
        // The manifest itself reads.
        assert!(!manifest_rules()?.is_empty());
        Ok(())
    }
}
