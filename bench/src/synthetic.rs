//! A synthetic mesh of any size, as one multi-document manifest (the benchmarks' fixture): what the
//! criterion benches load and
//! what `cargo xtask bench` gives the real agent to measure its memory, so both measure the same thing.
//!
//! Every tenth namespace is trusted (PUBLIC by policy), the rest keep their entries (NAMESPACE). One
//! entry in ten shares a host name with other namespaces (never within its own); one in five declares
//! no address (allocated).
//! Each namespace has one client pod.

/// The scale the performance targets are stated at (BENCHMARKS.md, "Targets").
pub const NAMESPACES: usize = 1_000;
pub const ENTRIES: usize = 10_000;

pub fn large_mesh_yaml(namespaces: usize, entries: usize) -> String {
    let mut yaml = String::from(
        "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchLabels: {trusted: \"true\"}}}]\n",
    );
    for n in 0..namespaces {
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
    for i in 0..entries {
        let n = i % namespaces.max(1);
        // The same shared name never twice in one namespace: a namespace publishes one service per
        // host (the oldest entry), so a repeat would be a service less, not a claimant more.
        let host = if i % 10 == 0 {
            format!("shared-{}.example.com", i / namespaces.max(1))
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
    use redirect_userspace::model::load_sources;

    #[test]
    fn a_small_one_loads_with_every_object() {
        let yaml = large_mesh_yaml(20, 100);
        assert_eq!(yaml.matches("kind: ServiceEntry").count(), 100);
        assert_eq!(yaml.matches("kind: Namespace").count(), 20);
        let model = load_sources([("synthetic.yaml", yaml.as_str())]).expect("loads");
        assert_eq!(model.service_entries.len(), 100);
        assert_eq!(model.workloads.len(), 20);
        // Every entry is published, also with many entries per namespace (the bench's ten): the
        // agent holds one service for each, which the bench checks.
        let yaml = large_mesh_yaml(20, 400);
        let model = load_sources([("synthetic.yaml", yaml.as_str())]).expect("loads");
        let snapshot = redirect_userspace::model::Snapshot::from_model(&model);
        assert_eq!(snapshot.services().count(), 400);
    }
}
