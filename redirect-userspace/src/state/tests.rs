//! Table-driven tests of `docs/data-plane.md` and `docs/dns.md`, each case named after the rule it checks.
use std::net::IpAddr;

use super::*;
use crate::config::load_sources;

mod props;
mod slices;
mod upstream;

/// A small multi-tenant world: every rule of `docs/data-plane.md` and `docs/dns.md` has an object here to exercise it.
pub(super) const WORLD: &str = concat!(
    r#"
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-b}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-c, labels: {trusted: "true"}}
---
apiVersion: v1
kind: Namespace
metadata: {name: quarantine, labels: {quarantine: "true"}}
---
kind: MeshConfig
serviceEntryVisibility:
  defaultVisibility: NAMESPACE
  policies:
    - visibility: PUBLIC
      matchingRules: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: istio-system}}}]
    - visibility: PUBLIC
      matchingRules: [{namespaceSelector: {matchLabels: {trusted: "true"}}}]
    - visibility: NONE
      matchingRules: [{namespaceSelector: {matchLabels: {quarantine: "true"}}}]
---
apiVersion: v1
kind: Pod
metadata: {name: a1, namespace: team-a}
status: {podIP: 10.244.1.10}
---
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: team-a, labels: {app: web}}
spec: {containers: [{ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.244.1.20}
---
apiVersion: v1
kind: Pod
metadata: {name: b1, namespace: team-b}
status: {podIP: 10.244.2.10}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-a}
spec: {clusterIP: 10.244.100.10, selector: {app: web}, ports: [{port: 80, targetPort: http}]}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: team-a}
spec: {clusterIP: 10.244.100.11, ports: [{port: 80}]}
---
"#,
    include_str!("../../tests/fixtures/team-a-api.yaml"),
    r#"---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: rr, namespace: team-a}
spec:
  hosts: [rr.example.com]
  addresses: [203.0.113.80]
  ports: [{number: 80, name: http, targetPort: 8080}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.81}, {address: 198.51.100.82}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: v6, namespace: team-a}
spec:
  hosts: [v6.example.com]
  addresses: ["2001:db8::10"]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: "2001:db8::11"}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: shadow-b1, namespace: team-a}
spec:
  hosts: [shadow.example.com]
  addresses: [10.244.2.10]
  ports: [{number: 8080, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.21}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: inside, namespace: team-a}
spec:
  hosts: [inside.example.com]
  addresses: [198.51.100.140]
  ports: [{number: 443, name: tls}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.141}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: shared-b, namespace: team-b, creationTimestamp: "2024-06-01T00:00:00Z"}
spec:
  hosts: [shared.example.com]
  addresses: [203.0.113.41]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.41}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: cdn, namespace: team-b}
spec:
  hosts: [cdn.example.com]
  addresses: [203.0.113.60]
  ports: [{number: 80, name: http}]
  resolution: DNS
  endpoints: [{address: origin.example.org, ports: {http: 8080}}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: shared-c, namespace: team-c, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  hosts: [shared.example.com]
  addresses: [203.0.113.40]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.40}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: partner, namespace: team-c, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  hosts: [partner.example.com]
  addresses: [198.51.100.128/25]
  ports: [{number: 443, name: tls}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: partner-copy, namespace: istio-system, creationTimestamp: "2024-06-01T00:00:00Z"}
spec:
  hosts: [partner-copy.example.com]
  addresses: [198.51.100.128/25]
  ports: [{number: 443, name: tls}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: partner-wide, namespace: istio-system}
spec:
  hosts: [partner-wide.example.com]
  addresses: [198.51.100.0/24]
  ports: [{number: 443, name: tls}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: metrics, namespace: istio-system}
spec:
  hosts: [metrics.example.com]
  addresses: [203.0.113.30]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.30}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: httpbin, namespace: istio-system}
spec:
  hosts: [httpbin.example.com]
  ports: [{number: 80, name: http}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: istio-system}
spec:
  hosts: ["*.wild.example.com"]
  addresses: [203.0.113.90]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.90}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild-noaddr, namespace: istio-system}
spec:
  hosts: ["*.noaddr.example.com"]
  ports: [{number: 80, name: http}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: hijack, namespace: quarantine}
spec:
  hosts: [metrics.example.com, login.example.com]
  addresses: [203.0.113.30, 203.0.113.50]
  ports: [{number: 80, name: http}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.99}]
"#
);

pub(super) fn world() -> Snapshot {
    match load_sources([("world.yaml", WORLD)]) {
        Ok(model) => Snapshot::from_model(&model),
        Err(e) => panic!("world does not load:\n{e}"),
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// (action, service, endpoint, hidden) as the CLI prints them.
pub(super) fn outbound_summary(
    d: &OutboundDecision<'_>,
) -> (
    OutboundOutcome,
    Option<String>,
    Option<String>,
    Option<String>,
) {
    let action = d.outcome();
    let service = match d.action {
        Outbound::Workload { workload, .. } => {
            Some(format!("{}/{}", workload.namespace, workload.name))
        }
        _ => d.service().map(|s| s.to_string()),
    };
    (
        action,
        service,
        d.target().map(|t| t.to_string()),
        d.hidden.map(|s| s.to_string()),
    )
}

#[test]
fn outbound_rules() {
    struct Case {
        name: &'static str,
        client: Option<&'static str>,
        dst: &'static str,
        port: u16,
        action: OutboundOutcome,
        service: Option<&'static str>,
        endpoint: Option<&'static str>,
        hidden: Option<&'static str>,
    }
    // A case names what it checks: its action always, the rest only when present (port: 80 unless named).
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                client: None,
                dst: "",
                port: 80,
                action: OutboundOutcome::Passthrough,
                service: None,
                endpoint: None,
                hidden: None,
            }
        }
    }
    let cases = [
        Case {
            name: "NAMESPACE entry serves its own namespace",
            client: Some("team-a"),
            dst: "203.0.113.10",
            action: OutboundOutcome::Service,
            service: Some("team-a/api"),
            endpoint: Some("198.51.100.20:80"),
            ..Default::default()
        },
        Case {
            name: "NAMESPACE entry is absent for another namespace: passthrough",
            client: Some("team-b"),
            dst: "203.0.113.10",
            action: OutboundOutcome::Passthrough,
            endpoint: Some("203.0.113.10:80"),
            hidden: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            name: "unknown client sees only PUBLIC: NAMESPACE entry passes through",
            client: None,
            dst: "203.0.113.10",
            action: OutboundOutcome::Passthrough,
            endpoint: Some("203.0.113.10:80"),
            hidden: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            name: "unknown client sees PUBLIC entries",
            client: None,
            dst: "203.0.113.30",
            action: OutboundOutcome::Service,
            service: Some("istio-system/metrics"),
            endpoint: Some("198.51.100.30:80"),
            ..Default::default()
        },
        Case {
            name: "NONE entry absent from lookups, even in its own namespace",
            client: Some("quarantine"),
            dst: "203.0.113.50",
            action: OutboundOutcome::Passthrough,
            endpoint: Some("203.0.113.50:80"),
            ..Default::default()
        },
        Case {
            name: "NONE entry never shadows a PUBLIC one on the same address",
            client: Some("quarantine"),
            dst: "203.0.113.30",
            action: OutboundOutcome::Service,
            service: Some("istio-system/metrics"),
            endpoint: Some("198.51.100.30:80"),
            ..Default::default()
        },
        Case {
            name: "shared address space: own NAMESPACE entry inside",
            client: Some("team-b"),
            dst: "203.0.113.41",
            action: OutboundOutcome::Service,
            service: Some("team-b/shared-b"),
            endpoint: Some("198.51.100.41:80"),
            ..Default::default()
        },
        Case {
            name: "trusted namespace entry is PUBLIC",
            client: Some("team-a"),
            dst: "203.0.113.40",
            action: OutboundOutcome::Service,
            service: Some("team-c/shared-c"),
            endpoint: Some("198.51.100.40:80"),
            ..Default::default()
        },
        Case {
            name: "own namespace exact VIP beats a CIDR",
            client: Some("team-a"),
            dst: "198.51.100.140",
            port: 443,
            action: OutboundOutcome::Service,
            service: Some("team-a/inside"),
            endpoint: Some("198.51.100.141:443"),
            ..Default::default()
        },
        Case {
            name: "hidden exact VIP falls through to a visible CIDR",
            client: Some("team-b"),
            dst: "198.51.100.140",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("team-c/partner"),
            endpoint: Some("198.51.100.140:443"),
            hidden: Some("team-a/inside"),
        },
        Case {
            name: "hidden exact VIP falls through to a workload",
            client: Some("team-b"),
            dst: "10.244.2.10",
            port: 8080,
            action: OutboundOutcome::Workload,
            service: Some("team-b/b1"),
            endpoint: Some("10.244.2.10:8080"),
            hidden: Some("team-a/shadow-b1"),
        },
        Case {
            name: "exact VIP serves its own namespace over the workload",
            client: Some("team-a"),
            dst: "10.244.2.10",
            port: 8080,
            action: OutboundOutcome::Service,
            service: Some("team-a/shadow-b1"),
            endpoint: Some("198.51.100.21:8080"),
            ..Default::default()
        },
        Case {
            name: "hidden exact VIP falls through to passthrough",
            client: Some("team-c"),
            dst: "203.0.113.41",
            action: OutboundOutcome::Passthrough,
            endpoint: Some("203.0.113.41:80"),
            hidden: Some("team-b/shared-b"),
            ..Default::default()
        },
        Case {
            name: "CIDR longest prefix wins",
            client: Some("team-b"),
            dst: "198.51.100.200",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("team-c/partner"),
            endpoint: Some("198.51.100.200:443"),
            ..Default::default()
        },
        Case {
            name: "CIDR shorter prefix when the longer does not contain the address",
            client: Some("team-b"),
            dst: "198.51.100.5",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("istio-system/partner-wide"),
            endpoint: Some("198.51.100.5:443"),
            ..Default::default()
        },
        Case {
            name: "equal CIDRs: oldest creationTimestamp wins",
            client: Some("team-b"),
            dst: "198.51.100.200",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("team-c/partner"),
            endpoint: Some("198.51.100.200:443"),
            ..Default::default()
        },
        Case {
            name: "equal CIDRs: own namespace wins over age",
            client: Some("istio-system"),
            dst: "198.51.100.200",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("istio-system/partner-copy"),
            endpoint: Some("198.51.100.200:443"),
            ..Default::default()
        },
        Case {
            name: "resolution NONE passes through with the service",
            client: Some("team-a"),
            dst: "198.51.100.129",
            port: 443,
            action: OutboundOutcome::Passthrough,
            service: Some("team-c/partner"),
            endpoint: Some("198.51.100.129:443"),
            ..Default::default()
        },
        Case {
            name: "undeclared port: no healthy upstream",
            client: Some("team-a"),
            dst: "203.0.113.10",
            port: 81,
            action: OutboundOutcome::NoHealthyUpstream,
            service: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            // ztunnel find_upstream: a PASSTHROUGH service returns the original destination first.
            name: "undeclared port on a resolution NONE service: passthrough (ztunnel find_upstream)",
            client: Some("team-a"),
            dst: "198.51.100.129",
            port: 22,
            action: OutboundOutcome::Passthrough,
            service: Some("team-c/partner"),
            endpoint: Some("198.51.100.129:22"),
            ..Default::default()
        },
        Case {
            name: "service without endpoints: no healthy upstream",
            client: Some("team-b"),
            dst: "10.244.100.11",
            action: OutboundOutcome::NoHealthyUpstream,
            service: Some("team-a/empty"),
            ..Default::default()
        },
        Case {
            name: "Kubernetes Service is PUBLIC and maps a named targetPort",
            client: Some("team-b"),
            dst: "10.244.100.10",
            action: OutboundOutcome::Service,
            service: Some("team-a/web"),
            endpoint: Some("10.244.1.20:8080"),
            ..Default::default()
        },
        Case {
            name: "resolution DNS endpoint by host name, endpoint port by port name",
            client: Some("team-b"),
            dst: "203.0.113.60",
            action: OutboundOutcome::Service,
            service: Some("team-b/cdn"),
            endpoint: Some("origin.example.org:8080"),
            ..Default::default()
        },
        Case {
            name: "targetPort maps the service port",
            client: Some("team-a"),
            dst: "203.0.113.80",
            action: OutboundOutcome::Service,
            service: Some("team-a/rr"),
            endpoint: Some("198.51.100.81:8080"),
            ..Default::default()
        },
        Case {
            name: "workload reached directly",
            client: Some("team-b"),
            dst: "10.244.1.10",
            port: 9000,
            action: OutboundOutcome::Workload,
            service: Some("team-a/a1"),
            endpoint: Some("10.244.1.10:9000"),
            ..Default::default()
        },
        Case {
            name: "unknown address passes through",
            client: Some("team-a"),
            dst: "192.0.2.1",
            action: OutboundOutcome::Passthrough,
            endpoint: Some("192.0.2.1:80"),
            ..Default::default()
        },
        Case {
            name: "IPv4-mapped IPv6 destination is the IPv4 address",
            client: Some("team-a"),
            dst: "::ffff:203.0.113.10",
            action: OutboundOutcome::Service,
            service: Some("team-a/api"),
            endpoint: Some("198.51.100.20:80"),
            ..Default::default()
        },
        Case {
            name: "IPv6 VIP",
            client: Some("team-a"),
            dst: "2001:db8::10",
            action: OutboundOutcome::Service,
            service: Some("team-a/v6"),
            endpoint: Some("[2001:db8::11]:80"),
            ..Default::default()
        },
    ];
    let snap = world();
    for case in cases {
        let got = snap.decide_outbound_with(case.client, ip(case.dst), case.port, Pick::Peek);
        let want = (
            case.action,
            case.service.map(String::from),
            case.endpoint.map(String::from),
            case.hidden.map(String::from),
        );
        assert_eq!(outbound_summary(&got), want, "{}", case.name);
    }
}

#[test]
fn round_robin_spreads_and_peek_does_not_advance() {
    let snap = world();
    let next = |pick| {
        snap.decide_outbound_with(Some("team-a"), ip("203.0.113.80"), 80, pick)
            .target()
            .unwrap()
            .to_string()
    };
    assert_eq!(next(Pick::Peek), "198.51.100.81:8080");
    assert_eq!(
        next(Pick::Peek),
        "198.51.100.81:8080",
        "peek never advances"
    );
    let picks: Vec<String> = (0..4).map(|_| next(Pick::Next)).collect();
    assert_eq!(
        picks,
        [
            "198.51.100.81:8080",
            "198.51.100.82:8080",
            "198.51.100.81:8080",
            "198.51.100.82:8080"
        ]
    );
    assert_eq!(
        next(Pick::Peek),
        "198.51.100.81:8080",
        "peek shows the next pick"
    );
}

#[test]
fn resolution_dns_without_endpoints_connects_to_the_host() {
    let snap = world();
    let DnsDecision::Answer(answer) = snap.decide_dns(Some("team-a"), "httpbin.example.com") else {
        panic!("httpbin.example.com is PUBLIC and allocated");
    };
    let vip = answer.v4()[0];
    assert!(crate::visibility::V4_RANGE.contains(&vip));
    let d = snap.decide_outbound_with(Some("team-b"), IpAddr::V4(vip), 80, Pick::Peek);
    assert_eq!(d.target().unwrap().to_string(), "httpbin.example.com:80");
}

#[test]
fn workload_by_ip_names_the_client() {
    let snap = world();
    let w = snap.workload_by_ip(ip("10.244.2.10")).unwrap();
    assert_eq!(
        (w.meta.namespace.as_str(), w.meta.name.as_str()),
        ("team-b", "b1")
    );
    assert!(
        snap.workload_by_ip(ip("10.244.9.9")).is_none(),
        "unknown IP: unknown client"
    );
    let shared = "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: a}\nstatus: {podIP: 10.0.0.1}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: y, namespace: b}\nstatus: {podIP: 10.0.0.1}\n";
    let snap = Snapshot::from_model(&load_sources([("p.yaml", shared)]).unwrap());
    assert!(
        snap.workload_by_ip(ip("10.0.0.1")).is_none(),
        "an IP two workloads share names no client namespace"
    );
    assert!(
        matches!(
            snap.decide_outbound(None, ip("10.0.0.1"), 80).action,
            Outbound::Workload { .. }
        ),
        "but it is still a workload to reach"
    );
}

#[test]
fn a_pod_of_another_node_is_reached_as_the_workload_it_was_but_is_no_client() {
    let pods = "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: a, labels: {app: x}}\nstatus: {podIP: 10.0.0.1}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: y, namespace: b}\nstatus: {podIPs: [{ip: 10.0.0.2}, {ip: 'fd00::2'}]}\n";
    let whole = load_sources([("p.yaml", pods)]).unwrap();
    let mut scoped = whole.clone();
    scoped.pods_elsewhere = scoped
        .workloads
        .drain(..)
        .map(|w| std::sync::Arc::new(crate::config::PodElsewhere::new(&w)))
        .collect();
    let (whole, scoped) = (Snapshot::from_model(&whole), Snapshot::from_model(&scoped));
    for to in ["10.0.0.1", "10.0.0.2", "fd00::2", "10.0.0.3"] {
        assert_eq!(
            outbound_summary(&whole.decide_outbound(None, ip(to), 80)),
            outbound_summary(&scoped.decide_outbound(None, ip(to), 80)),
            "{to}"
        );
    }
    let destinations = |s: &Snapshot| {
        let mut d: Vec<IpAddr> = s.workload_destinations().collect();
        d.sort();
        d
    };
    assert_eq!(destinations(&whole), destinations(&scoped));
    assert!(whole.workload_by_ip(ip("10.0.0.1")).is_some());
    assert!(scoped.workload_by_ip(ip("10.0.0.1")).is_none());
}

/// With HBONE between nodes: another node's Pod (by `nodeName`, or held elsewhere) in the ambient
/// mesh is an HBONE peer of its namespace; one opted out, outside the mesh, with a sidecar or on the
/// node's network is not; this node's Pods (and those naming no node) receive HBONE; without an
/// HBONE node, nothing is either.
#[test]
fn hbone_peers_are_the_enrolled_pods_of_other_nodes_and_this_nodes_pods_receive() {
    let pod = |name: &str, ns: &str, node: &str, ip: &str, labels: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}, labels: {{{labels}}}}}\nspec: {{nodeName: {node}}}\nstatus: {{podIP: {ip}}}\n---\n"
        )
    };
    // The Pod's manifest with both its addresses in `podIPs`.
    let dual_stack = |manifest: String, v4: &str, v6: &str| {
        manifest.replace(
            &format!("podIP: {v4}"),
            &format!("podIP: {v4}, podIPs: [{{ip: {v4}}}, {{ip: '{v6}'}}]"),
        )
    };
    let pods = [
        pod("here", "a", "node-a", "10.0.1.1", ""),
        dual_stack(pod("there", "b", "node-b", "10.0.2.1", ""), "10.0.2.1", "fd00::2:1"),
        pod("out", "b", "node-b", "10.0.2.2", "istio.io/dataplane-mode: none"),
        "apiVersion: v1\nkind: Pod\nmetadata: {name: nowhere, namespace: a}\nstatus: {podIP: 10.0.1.2}\n---\n".to_string(),
        pod("waypoint", "a", "node-a", "10.0.1.3", "istio.io/dataplane-mode: none"),
        dual_stack(pod("proxy", "kube-system", "node-b", "192.0.2.2", ""), "192.0.2.2", "fd00:2::2"),
        dual_stack(pod("cni", "kube-system", "node-b", "192.0.2.2", ""), "192.0.2.2", "fd00:2::2"),
        pod("plain", "c", "node-b", "10.0.3.1", ""),
        pod("enrolled", "c", "node-b", "10.0.3.2", "istio.io/dataplane-mode: ambient"),
        pod("sidecar", "b", "node-b", "10.0.2.3", "").replace(
            "labels: {}",
            "labels: {}, annotations: {sidecar.istio.io/status: '{}'}",
        ),
        pod("host", "b", "node-b", "10.0.2.4", "").replace(
            "spec: {nodeName: node-b}",
            "spec: {nodeName: node-b, hostNetwork: true}",
        ),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: b, labels: {istio.io/dataplane-mode: ambient}}\n---\n".to_string(),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: kube-system, labels: {istio.io/dataplane-mode: ambient}}\n---\n".to_string(),
    ]
    .concat();
    let mut model = load_sources([("p.yaml", pods.as_str())]).unwrap();
    let plain = Snapshot::from_model(&model);
    assert_eq!(
        plain.hbone_peer(ip("10.0.2.1")),
        None,
        "no HBONE node, no peer"
    );
    model.hbone_node = Some("node-a".to_string());
    let snap = Snapshot::from_model(&model);
    assert_eq!(snap.hbone_peer(ip("10.0.2.1")), Some("b"));
    assert_eq!(
        snap.hbone_peer(ip("10.0.2.2")),
        None,
        "opted out: reached directly"
    );
    assert_eq!(snap.hbone_peer(ip("10.0.3.1")), None, "outside the mesh");
    assert_eq!(
        snap.hbone_peer(ip("10.0.3.2")),
        Some("c"),
        "enrolled by its own label"
    );
    assert_eq!(snap.hbone_peer(ip("10.0.2.3")), None, "a sidecar's Pod");
    assert_eq!(
        snap.hbone_peer(ip("10.0.2.4")),
        None,
        "on the node's network"
    );
    assert_eq!(snap.hbone_peer(ip("fd00::2:1")), Some("b"), "either family");
    assert_eq!(snap.hbone_peer(ip("10.0.1.1")), None, "this node's");
    assert_eq!(snap.hbone_peer(ip("10.9.9.9")), None, "no Pod");
    for own in ["192.0.2.2", "fd00:2::2"] {
        assert_eq!(snap.hbone_peer(ip(own)), None, "node b's own address {own}");
    }
    let mut local: Vec<IpAddr> = snap.local_pod_addresses().collect();
    local.sort();
    assert_eq!(local, vec![ip("10.0.1.1"), ip("10.0.1.2")]);
    assert!(
        snap.local_pod(ip("10.0.1.3")).is_none(),
        "a waypoint keeps its own 15008"
    );
    assert!(snap.local_pod(ip("10.0.1.1")).is_some());
    assert!(snap.local_pod(ip("10.0.2.1")).is_none());

    // An API source holds the other nodes' Pods apart, without an identity: peers all the same.
    let mut scoped = model.clone();
    scoped
        .workloads
        .retain(|w| !["there", "proxy", "cni"].contains(&w.meta.name.as_str()));
    for w in model
        .workloads
        .iter()
        .filter(|w| w.meta.namespace == "kube-system")
    {
        scoped
            .pods_elsewhere
            .upsert(crate::config::PodElsewhere::new(w));
    }
    let there = load_sources([(
        "p.yaml",
        pod("there", "b", "node-b", "10.0.2.1", "").as_str(),
    )])
    .unwrap()
    .workloads
    .remove(0);
    scoped
        .pods_elsewhere
        .upsert(crate::config::PodElsewhere::new(&there));
    let scoped = Snapshot::from_model(&scoped);
    assert_eq!(scoped.hbone_peer(ip("10.0.2.1")), Some("b"));
    assert_eq!(
        scoped.hbone_peer(ip("192.0.2.2")),
        None,
        "node b's, held elsewhere"
    );
}

#[test]
fn a_dual_stack_pod_takes_one_budget_share_by_either_address() {
    let pods = r#"
apiVersion: v1
kind: Pod
metadata: {name: d, namespace: a}
status:
  podIP: 10.0.0.7
  podIPs: [{ip: 10.0.0.7}, {ip: "fd00::7"}]
---
apiVersion: v1
kind: Pod
metadata: {name: x, namespace: a}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: y, namespace: b}
status: {podIP: 10.0.0.1}
"#;
    let snap = Snapshot::from_model(&load_sources([("p.yaml", pods)]).unwrap());
    for from in ["10.0.0.7", "fd00::7", "::ffff:10.0.0.7"] {
        assert_eq!(snap.budget_key(ip(from)), ip("10.0.0.7"), "from {from}");
    }
    assert_eq!(
        snap.budget_key(ip("10.0.0.9")),
        ip("10.0.0.9"),
        "an address no workload holds is a client of its own"
    );
    assert_eq!(
        snap.budget_key(ip("10.0.0.1")),
        ip("10.0.0.1"),
        "an address two workloads share stays its own client"
    );
}

/// (action, service, cname, v4, v6, hidden)
type DnsSummary = (
    &'static str,
    Option<String>,
    Option<String>,
    Vec<String>,
    Vec<String>,
    Option<String>,
);

pub(super) fn dns_summary(d: &DnsDecision<'_, '_>) -> DnsSummary {
    match d {
        DnsDecision::Answer(a) => (
            "answer",
            Some(a.service.to_string()),
            a.cname.map(String::from),
            a.v4().iter().map(|i| i.to_string()).collect(),
            a.v6().iter().map(|i| i.to_string()).collect(),
            a.hidden.map(|s| s.to_string()),
        ),
        DnsDecision::Forward { hidden } => (
            "forward",
            None,
            None,
            vec![],
            vec![],
            hidden.map(|s| s.to_string()),
        ),
    }
}

#[test]
fn dns_rules() {
    struct Case {
        name: &'static str,
        client: Option<&'static str>,
        qname: &'static str,
        action: &'static str,
        service: Option<&'static str>,
        cname: Option<&'static str>,
        v4: &'static [&'static str],
        v6: &'static [&'static str],
        hidden: Option<&'static str>,
    }
    // A case names what it checks: its action always, the rest only when present.
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                client: None,
                qname: "",
                action: "forward",
                service: None,
                cname: None,
                v4: &[],
                v6: &[],
                hidden: None,
            }
        }
    }
    let cases = [
        Case {
            name: "own namespace resolves its NAMESPACE entry",
            client: Some("team-a"),
            qname: "api.example.com.",
            action: "answer",
            service: Some("team-a/api"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "hidden name is forwarded for another namespace",
            client: Some("team-b"),
            qname: "api.example.com.",
            action: "forward",
            hidden: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            name: "hidden name is forwarded for an unknown client",
            client: None,
            qname: "api.example.com",
            action: "forward",
            hidden: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            name: "search-domain expansion is answered with a CNAME",
            client: Some("team-a"),
            qname: "api.example.com.team-a.svc.cluster.local.",
            action: "answer",
            service: Some("team-a/api"),
            cname: Some("api.example.com"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "svc search domain is stripped too",
            client: Some("team-a"),
            qname: "api.example.com.svc.cluster.local",
            action: "answer",
            service: Some("team-a/api"),
            cname: Some("api.example.com"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "cluster domain is stripped too",
            client: Some("team-a"),
            qname: "api.example.com.cluster.local",
            action: "answer",
            service: Some("team-a/api"),
            cname: Some("api.example.com"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "search-domain expansion of a hidden name is forwarded",
            client: Some("team-b"),
            qname: "api.example.com.team-b.svc.cluster.local.",
            action: "forward",
            hidden: Some("team-a/api"),
            ..Default::default()
        },
        Case {
            name: "another namespace's search domain is not stripped",
            client: Some("team-a"),
            qname: "api.example.com.team-b.svc.cluster.local.",
            action: "forward",
            ..Default::default()
        },
        Case {
            name: "names are case-insensitive",
            client: Some("team-a"),
            qname: "API.Example.COM.",
            action: "answer",
            service: Some("team-a/api"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "CNAME target keeps the asked case",
            client: Some("team-a"),
            qname: "Api.Example.com.Team-A.svc.cluster.local",
            action: "answer",
            service: Some("team-a/api"),
            cname: Some("Api.Example.com"),
            v4: &["203.0.113.10"],
            ..Default::default()
        },
        Case {
            name: "shared host name: own namespace wins inside",
            client: Some("team-b"),
            qname: "shared.example.com",
            action: "answer",
            service: Some("team-b/shared-b"),
            v4: &["203.0.113.41"],
            ..Default::default()
        },
        Case {
            name: "shared host name: PUBLIC wins outside",
            client: Some("team-a"),
            qname: "shared.example.com",
            action: "answer",
            service: Some("team-c/shared-c"),
            v4: &["203.0.113.40"],
            hidden: Some("team-b/shared-b"),
            ..Default::default()
        },
        Case {
            name: "NONE entry is never answered, even in its namespace",
            client: Some("quarantine"),
            qname: "login.example.com",
            action: "forward",
            ..Default::default()
        },
        Case {
            name: "NONE entry never shadows a PUBLIC host",
            client: Some("quarantine"),
            qname: "metrics.example.com",
            action: "answer",
            service: Some("istio-system/metrics"),
            v4: &["203.0.113.30"],
            ..Default::default()
        },
        Case {
            name: "Kubernetes Service FQDN from another namespace",
            client: Some("team-b"),
            qname: "web.team-a.svc.cluster.local.",
            action: "answer",
            service: Some("team-a/web"),
            v4: &["10.244.100.10"],
            ..Default::default()
        },
        Case {
            name: "wildcard host answers a subdomain",
            client: Some("team-b"),
            qname: "api.wild.example.com",
            action: "answer",
            service: Some("istio-system/wild"),
            v4: &["203.0.113.90"],
            ..Default::default()
        },
        Case {
            name: "wildcard host answers a deeper subdomain",
            client: Some("team-b"),
            qname: "a.b.wild.example.com",
            action: "answer",
            service: Some("istio-system/wild"),
            v4: &["203.0.113.90"],
            ..Default::default()
        },
        Case {
            name: "wildcard host does not answer its apex",
            client: Some("team-b"),
            qname: "wild.example.com",
            action: "forward",
            ..Default::default()
        },
        Case {
            name: "wildcard without addresses is forwarded",
            client: Some("team-b"),
            qname: "x.noaddr.example.com",
            action: "forward",
            ..Default::default()
        },
        Case {
            name: "service without an IPv4 address answers A with nothing (NOERROR)",
            client: Some("team-a"),
            qname: "v6.example.com",
            action: "answer",
            service: Some("team-a/v6"),
            v6: &["2001:db8::10"],
            ..Default::default()
        },
        Case {
            name: "unknown client gets PUBLIC entries",
            client: None,
            qname: "metrics.example.com.",
            action: "answer",
            service: Some("istio-system/metrics"),
            v4: &["203.0.113.30"],
            ..Default::default()
        },
        Case {
            name: "unknown client: svc search domain stripped",
            client: None,
            qname: "metrics.example.com.svc.cluster.local.",
            action: "answer",
            service: Some("istio-system/metrics"),
            cname: Some("metrics.example.com"),
            v4: &["203.0.113.30"],
            ..Default::default()
        },
        Case {
            name: "a name no service owns is forwarded",
            client: Some("team-a"),
            qname: "www.example.org.",
            action: "forward",
            ..Default::default()
        },
        Case {
            name: "an over-long name is forwarded",
            client: Some("team-a"),
            qname: "a.example.com",
            action: "forward",
            ..Default::default()
        },
    ];
    let snap = world();
    for case in cases {
        let qname = if case.name.starts_with("an over-long") {
            format!("{}.{}", "x".repeat(250), case.qname)
        } else {
            case.qname.to_string()
        };
        let got = dns_summary(&snap.decide_dns(case.client, &qname));
        let strs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let want = (
            case.action,
            case.service.map(String::from),
            case.cname.map(String::from),
            strs(case.v4),
            strs(case.v6),
            case.hidden.map(String::from),
        );
        assert_eq!(got, want, "{}", case.name);
    }
}

#[test]
fn search_domain_expansion_is_what_the_resolver_sends() {
    struct Case {
        name: &'static str,
        client: Option<&'static str>,
        short: &'static str,
        want: &'static [&'static str],
    }
    let cases = [
        Case {
            name: "short name: search list first, then as is",
            client: Some("team-a"),
            short: "web",
            want: &[
                "web.team-a.svc.cluster.local.",
                "web.svc.cluster.local.",
                "web.cluster.local.",
                "web.",
            ],
        },
        Case {
            name: "external name with few dots: search list first",
            client: Some("team-a"),
            short: "api.example.com",
            want: &[
                "api.example.com.team-a.svc.cluster.local.",
                "api.example.com.svc.cluster.local.",
                "api.example.com.cluster.local.",
                "api.example.com.",
            ],
        },
        Case {
            name: "absolute name: as is only",
            client: Some("team-a"),
            short: "api.example.com.",
            want: &["api.example.com."],
        },
        Case {
            name: "five dots or more: as is first",
            client: Some("team-a"),
            short: "a.b.c.d.e.f",
            want: &[
                "a.b.c.d.e.f.",
                "a.b.c.d.e.f.team-a.svc.cluster.local.",
                "a.b.c.d.e.f.svc.cluster.local.",
                "a.b.c.d.e.f.cluster.local.",
            ],
        },
        Case {
            name: "unknown client: no namespace domain",
            client: None,
            short: "web",
            want: &["web.svc.cluster.local.", "web.cluster.local.", "web."],
        },
    ];
    for case in cases {
        let got = SearchDomains::new(case.client, "cluster.local").expand(case.short);
        assert_eq!(got, case.want, "{}", case.name);
    }
}

#[test]
fn short_kubernetes_name_resolves_through_the_first_search_domain() {
    let snap = world();
    let queries = snap.search_domains(Some("team-a")).expand("web");
    let got = dns_summary(&snap.decide_dns(Some("team-a"), &queries[0]));
    assert_eq!(
        got.1.as_deref(),
        Some("team-a/web"),
        "web.team-a.svc.cluster.local is the Service's own name"
    );
    assert_eq!(got.2, None, "an exact name needs no CNAME");
}

#[test]
fn dumps_hold_every_delivered_service_and_no_none_entry() {
    let snap = world();
    let dump = snap.config_dump();
    assert!(
        dump.services.iter().all(|s| s.namespace != "quarantine"),
        "NONE entries are absent from the dump"
    );
    let web = dump.services.iter().find(|s| s.name == "web").unwrap();
    let json = serde_json::to_value(web).unwrap();
    assert_eq!(
        json["visibility"], "Public",
        "Kubernetes Services report Public"
    );
    assert_eq!(json["hostname"], "web.team-a.svc.cluster.local");
    assert_eq!(
        json["ports"]["80"], 80,
        "a named targetPort differs per pod: the endpoint says"
    );
    assert_eq!(json["endpoints"][0]["address"], "10.244.1.20");
    assert_eq!(json["endpoints"][0]["ports"]["80"], 8080);
    assert_eq!(json["endpoints"][0]["workload"], "team-a/web-1");
    let api =
        serde_json::to_value(dump.services.iter().find(|s| s.name == "api").unwrap()).unwrap();
    assert_eq!(api["visibility"], "Namespace");
    assert_eq!(api["vips"], serde_json::json!(["203.0.113.10"]));
    assert!(api.get("waypoint").is_none(), "waypoint only when bound");
    assert_eq!(snap.service_dump(Some("team-b")).len(), 2);
    assert!(dump.service_entry_visibility.configured);
    assert_eq!(dump.workloads.len(), 3);
}

#[test]
fn the_dump_shows_discovery_selectors_only_when_set() {
    let dump = serde_json::to_value(world().config_dump()).unwrap();
    assert!(dump.get("discoverySelectors").is_none(), "{dump}");
    let yaml = "kind: MeshConfig\ndiscoverySelectors: [{matchLabels: {mesh: \"on\"}}]\n";
    let model = crate::config::load_sources([("m.yaml", yaml)]).unwrap();
    let dump = serde_json::to_value(Snapshot::from_model(&model).config_dump()).unwrap();
    assert_eq!(
        dump["discoverySelectors"],
        serde_json::json!([{"matchLabels": {"mesh": "on"}}])
    );
}

#[test]
fn snapshot_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Snapshot>();
    assert_send_sync::<std::sync::Arc<Snapshot>>();
}

#[test]
fn feature_unset_makes_every_entry_visible_everywhere() {
    let without_mesh: String = WORLD
        .split("\n---\n")
        .filter(|doc| !doc.contains("kind: MeshConfig"))
        .collect::<Vec<_>>()
        .join("\n---\n");
    let snap = Snapshot::from_model(&load_sources([("w.yaml", without_mesh.as_str())]).unwrap());
    let d = snap.decide_outbound_with(Some("team-b"), ip("203.0.113.10"), 80, Pick::Peek);
    assert_eq!(outbound_summary(&d).1.as_deref(), Some("team-a/api"));
    let got = dns_summary(&snap.decide_dns(Some("team-b"), "login.example.com"));
    assert_eq!(
        got.1.as_deref(),
        Some("quarantine/hijack"),
        "no NONE without the feature"
    );
}
