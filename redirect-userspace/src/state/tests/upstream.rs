//! Cases translated from upstream tests of the data plane's choices, each naming its source:
//! ztunnel `src/state/service.rs` and `find_upstream`, Istio's ambient `services.go`
//! (`selectWorkloadServices`, tested in `services_test.go`) and `push_context_test.go`.
use std::net::IpAddr;

use super::{dns_summary, outbound_summary};
use crate::{
    config::load_sources,
    state::{Pick, Snapshot},
};

fn snapshot(yaml: &str) -> Snapshot {
    match load_sources([("case.yaml", yaml)]) {
        Ok(model) => Snapshot::from_model(&model),
        Err(e) => panic!("case does not load:\n{e}"),
    }
}

/// (action, service, endpoint) for a connection from `client` to `dst:port`.
fn outbound(
    s: &Snapshot,
    client: &str,
    dst: &str,
    port: u16,
) -> (String, Option<String>, Option<String>) {
    let ip: IpAddr = dst.parse().unwrap();
    let (action, service, endpoint, _) =
        outbound_summary(&s.decide_outbound_with(Some(client), ip, port, Pick::Peek));
    (action.json_name().to_string(), service, endpoint)
}

fn dns_service(s: &Snapshot, client: &str, name: &str) -> Option<String> {
    dns_summary(&s.decide_dns(Some(client), name)).1
}

/// ztunnel `find_upstream`: a PASSTHROUGH (resolution NONE) service returns the original destination
/// before any port check. Istio's `samples/external/github.yaml` shape: GitHub's ranges, port 22 only;
/// HTTPS on :443 must reach GitHub untouched, with the feature on or off.
#[test]
fn resolution_none_passes_through_on_undeclared_ports() {
    let github = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: github-tcp, namespace: default}\nspec:\n  hosts: [dummy.github.com]\n  addresses: [192.30.252.0/22, 140.82.112.0/20]\n  ports: [{name: tcp, number: 22, protocol: tcp}]\n  location: MESH_EXTERNAL\n  resolution: NONE\n";
    for (name, yaml) in [
        ("feature off", github.to_string()),
        (
            "feature on, entry PUBLIC",
            format!(
                "{github}---\nkind: MeshConfig\nserviceEntryVisibility: {{defaultVisibility: PUBLIC}}\n"
            ),
        ),
    ] {
        let s = snapshot(&yaml);
        for port in [22, 443, 80] {
            assert_eq!(
                outbound(&s, "default", "140.82.114.4", port),
                (
                    "passthrough".into(),
                    Some("default/github-tcp".into()),
                    Some(format!("140.82.114.4:{port}"))
                ),
                "{name}: port {port}"
            );
        }
    }
}

/// ztunnel `src/state/service.rs` `cidr_namespace_preferred_over_cidr_specificity`: a CIDR service
/// in the client's own namespace wins over a more specific prefix in another namespace; clients of
/// other namespaces get the longest prefix.
#[test]
fn cidr_namespace_preferred_over_cidr_specificity() {
    let yaml = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: wide, namespace: team-a}\nspec:\n  hosts: [wide.example.com]\n  addresses: [198.51.100.0/24]\n  ports: [{number: 443, name: tls}]\n  resolution: NONE\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: narrow, namespace: team-b}\nspec:\n  hosts: [narrow.example.com]\n  addresses: [198.51.100.128/25]\n  ports: [{number: 443, name: tls}]\n  resolution: NONE\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: narrowest, namespace: team-c}\nspec:\n  hosts: [narrowest.example.com]\n  addresses: [198.51.100.192/26]\n  ports: [{number: 443, name: tls}]\n  resolution: NONE\n";
    let s = snapshot(yaml);
    struct Case {
        name: &'static str,
        client: &'static str,
        dst: &'static str,
        service: &'static str,
    }
    let cases = [
        Case {
            name: "own namespace /24 beats /26 and /25 elsewhere",
            client: "team-a",
            dst: "198.51.100.200",
            service: "team-a/wide",
        },
        Case {
            name: "own namespace /25 beats /26 elsewhere",
            client: "team-b",
            dst: "198.51.100.200",
            service: "team-b/narrow",
        },
        Case {
            name: "no own claimant: longest prefix",
            client: "team-d",
            dst: "198.51.100.200",
            service: "team-c/narrowest",
        },
        Case {
            name: "no own claimant, /26 does not contain it: next longest",
            client: "team-d",
            dst: "198.51.100.130",
            service: "team-b/narrow",
        },
        Case {
            name: "own namespace only where its prefix contains the address",
            client: "team-c",
            dst: "198.51.100.5",
            service: "team-a/wide",
        },
    ];
    for case in cases {
        assert_eq!(
            outbound(&s, case.client, case.dst, 443).1.as_deref(),
            Some(case.service),
            "{}",
            case.name
        );
    }
    // An unknown client has no namespace: the longest prefix.
    let ip: IpAddr = "198.51.100.200".parse().unwrap();
    let unknown = outbound_summary(&s.decide_outbound_with(None, ip, 443, Pick::Peek));
    assert_eq!(unknown.1.as_deref(), Some("team-c/narrowest"));
}

/// Equal prefixes in other namespaces are ranked by the ranking rule (oldest first), after the
/// namespace preference (ztunnel `src/state/service.rs`, CIDR ties).
#[test]
fn equal_cidrs_elsewhere_are_ranked_oldest_first() {
    let se = |name: &str, ns: &str, created: &str| {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: {ns}, creationTimestamp: \"{created}\"}}\nspec:\n  hosts: [{name}.example.com]\n  addresses: [198.51.100.128/25]\n  ports: [{{number: 443, name: tls}}]\n  resolution: NONE\n---\n"
        )
    };
    let yaml = [
        se("newer", "team-a", "2024-06-01T00:00:00Z"),
        se("older", "team-b", "2024-01-01T00:00:00Z"),
    ]
    .concat();
    let s = snapshot(&yaml);
    assert_eq!(
        outbound(&s, "team-c", "198.51.100.129", 443).1.as_deref(),
        Some("team-b/older")
    );
    assert_eq!(
        outbound(&s, "team-a", "198.51.100.129", 443).1.as_deref(),
        Some("team-a/newer")
    );
}

/// The camping entry: an older PUBLIC ServiceEntry in team-b (and an older one in team-a) claim
/// team-a's Service name and address.
const CAMPING: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: team-a, creationTimestamp: \"2024-06-01T00:00:00Z\"}\nspec: {clusterIP: 10.244.100.10, ports: [{port: 80}]}\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: camper, namespace: team-b, creationTimestamp: \"2020-01-01T00:00:00Z\"}\nspec:\n  hosts: [web.team-a.svc.cluster.local]\n  addresses: [10.244.100.10]\n  ports: [{number: 80, name: http}]\n  resolution: STATIC\n  endpoints: [{address: 198.51.100.66}]\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: decorator, namespace: team-a, creationTimestamp: \"2020-01-01T00:00:00Z\"}\nspec:\n  hosts: [web.team-a.svc.cluster.local]\n  addresses: [10.244.100.10]\n  ports: [{number: 80, name: http}]\n  resolution: STATIC\n  endpoints: [{address: 198.51.100.67}]\n---\nkind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: PUBLIC}\n";

/// Istio ambient `services.go` `selectWorkloadServices` ("a Kubernetes Service always wins, else
/// the oldest"), cases of `services_test.go`: an older PUBLIC ServiceEntry never takes a Service's
/// host name or address, neither from other namespaces nor inside the Service's own namespace.
#[test]
fn kubernetes_service_wins_over_older_service_entries() {
    let s = snapshot(CAMPING);
    for client in ["team-a", "team-c"] {
        assert_eq!(
            dns_service(&s, client, "web.team-a.svc.cluster.local."),
            Some("team-a/web".into()),
            "DNS from {client}"
        );
        assert_eq!(
            outbound(&s, client, "10.244.100.10", 80).1.as_deref(),
            Some("team-a/web"),
            "outbound from {client}"
        );
    }
    // The camper's own namespace still sees its own entry first (own namespace before kind).
    assert_eq!(
        dns_service(&s, "team-b", "web.team-a.svc.cluster.local."),
        Some("team-b/camper".into())
    );
}

/// `push_context_test.go` (service ranking by host): among ServiceEntries alone, the oldest wins
/// for other namespaces; a NAMESPACE entry serves its own namespace and others get the PUBLIC one.
#[test]
fn service_entries_alone_rank_oldest_first() {
    let se = |name: &str, ns: &str, created: &str, ip: &str| {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: {ns}, creationTimestamp: \"{created}\"}}\nspec:\n  hosts: [shared.example.com]\n  addresses: [{ip}]\n  ports: [{{number: 80, name: http}}]\n  resolution: STATIC\n  endpoints: [{{address: 198.51.100.1}}]\n---\n"
        )
    };
    let ns_label = "apiVersion: v1\nkind: Namespace\nmetadata: {name: private, labels: {private: \"true\"}}\n---\nkind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: PUBLIC\n  policies: [{visibility: NAMESPACE, matchingRules: [{namespaceSelector: {matchLabels: {private: \"true\"}}}]}]\n";
    let yaml = [
        se("newer", "team-a", "2024-06-01T00:00:00Z", "203.0.113.2"),
        se("older", "team-b", "2024-01-01T00:00:00Z", "203.0.113.1"),
        se("mine", "private", "2023-01-01T00:00:00Z", "203.0.113.3"),
        ns_label.to_string(),
    ]
    .concat();
    let s = snapshot(&yaml);
    assert_eq!(
        dns_service(&s, "team-c", "shared.example.com."),
        Some("team-b/older".into())
    );
    assert_eq!(
        dns_service(&s, "private", "shared.example.com."),
        Some("private/mine".into())
    );
    assert_eq!(
        dns_service(&s, "team-a", "shared.example.com."),
        Some("team-a/newer".into())
    );
}
