//! The 10,000-entry / 1,000-namespace config the agent's RSS is measured with.
//!
//! The same shape as the criterion bench's model (redirect-userspace/benches/state.rs), written out as a
//! manifest file so the real agent loads it through `--config`: every tenth namespace is trusted
//! (PUBLIC by policy), the rest keep their entries (NAMESPACE); one entry in ten shares a host name,
//! one in five declares no address (allocated).
pub const NAMESPACES: usize = 1_000;
pub const ENTRIES: usize = 10_000;

pub fn yaml() -> String {
    let mut yaml = String::from(
        "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchLabels: {trusted: \"true\"}}}]\n",
    );
    for n in 0..NAMESPACES {
        let labels = if n % 10 == 0 {
            "{trusted: \"true\"}"
        } else {
            "{}"
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: ns-{n}, labels: {labels}}}\n"
        ));
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: ns-{n}}}\nstatus: {{podIP: 10.{}.{}.10}}\n",
            n / 256,
            n % 256
        ));
    }
    for i in 0..ENTRIES {
        let n = i % NAMESPACES;
        let host = if i % 10 == 0 {
            format!("shared-{}.example.com", i % 100)
        } else {
            format!("svc-{i}.ns-{n}.example.com")
        };
        let addresses = if i % 5 == 4 {
            String::new()
        } else {
            format!(
                "addresses: [100.{}.{}.{}], ",
                64 + i / 65536,
                (i / 256) % 256,
                i % 256
            )
        };
        yaml.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: se-{i}, namespace: ns-{n}}}\nspec: {{hosts: [{host}], {addresses}ports: [{{number: 80, name: http, targetPort: 8080}}], resolution: STATIC, endpoints: [{{address: 198.18.{}.{}}}, {{address: 198.19.{}.{}}}]}}\n",
            i / 256 % 256,
            i % 256,
            i / 256 % 256,
            i % 256
        ));
    }
    yaml
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_every_entry_and_namespace() {
        let y = yaml();
        assert_eq!(y.matches("kind: ServiceEntry").count(), ENTRIES);
        assert_eq!(y.matches("kind: Namespace").count(), NAMESPACES);
        assert_eq!(y.matches("kind: Pod").count(), NAMESPACES);
    }
}
