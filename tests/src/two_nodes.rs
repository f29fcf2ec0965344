//! The two-node cluster the HBONE suites share: a1 on node a, b1 on node b, each with its node and
//! service account, as both nodes' agents are given them.
use std::time::Duration;

/// `(namespace/name, IPv4)` of the Pod on node a.
pub const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
/// `(namespace/name, IPv4)` of the Pod on node b.
pub const B1: (&str, &str) = ("team-b/b1", "10.244.2.20");
pub const TRUST_DOMAIN: &str = "cluster.local";
/// The lifetime of the certificates the suites issue when expiry is not what they test.
pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// a1 and b1 as Pod manifests, one document each.
pub fn pods() -> String {
    let pod = |(key, ip): (&str, &str), node: &str, uid: &str| {
        let (namespace, name) = key.split_once('/').unwrap_or_default();
        let ip6 = ip
            .parse()
            .map(crate::pod_ip6)
            .unwrap_or(std::net::Ipv6Addr::UNSPECIFIED);
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}}}\nspec: {{nodeName: {node}, serviceAccountName: default}}\nstatus: {{podIP: {ip}, podIPs: [{{ip: {ip}}}, {{ip: '{ip6}'}}]}}\n"
        )
    };
    format!(
        "{}---\n{}---\n{}",
        ambient_namespaces(&["team-a", "team-b"]),
        pod(A1, "node-a", "0a1a1a1a-0000-4000-8000-0000000000a1"),
        pod(B1, "node-b", "0b1b1b1b-0000-4000-8000-0000000000b1"),
    )
}

/// Namespaces labelled `istio.io/dataplane-mode: ambient`, one document each: their Pods are in
/// the mesh, and traffic between two of them on different nodes goes over HBONE.
pub fn ambient_namespaces(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| {
            format!(
                "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{istio.io/dataplane-mode: ambient}}}}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}
