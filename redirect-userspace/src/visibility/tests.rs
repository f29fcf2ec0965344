//! Table-driven tests of `docs/visibility.md`, each case named after the rule it checks.
use proptest::prelude::*;

use super::*;
use crate::config::{Model, load_sources};

mod waypoints;

fn model(yaml: &str) -> Model {
    match load_sources([("test.yaml", yaml)]) {
        Ok(model) => model,
        Err(e) => panic!("test manifest does not load:\n{e}"),
    }
}

/// team-a's entry for api.example.com, shared with the state tests and the harness.
const TEAM_A_API: &str = include_str!("../../tests/fixtures/team-a-api.yaml");

/// One namespace `team-a` with `labels`, one ServiceEntry in it, and `mesh` as the mesh config.
fn resolve_one(mesh: &str, labels: &str) -> ResolvedEntry {
    let yaml = format!(
        r#"
apiVersion: v1
kind: Namespace
metadata:
  name: team-a
  labels: {labels}
---
{TEAM_A_API}---
{mesh}
"#
    );
    resolve(&model(&yaml)).entries.remove(0)
}

fn mesh(visibility: &str) -> String {
    format!(
        "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec:\n  meshConfig:\n    serviceEntryVisibility:\n{visibility}"
    )
}

#[test]
fn policy_resolution_rules() {
    struct Case {
        name: &'static str,
        mesh: String,
        labels: &'static str,
        visibility: Visibility,
        matched: Option<usize>,
    }
    // A case names what it checks: the rest is a namespace without labels, matched by no policy.
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                mesh: String::new(),
                labels: "{}",
                visibility: Visibility::Public,
                matched: None,
            }
        }
    }
    let trusted_public = "        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchLabels: {trusted: \"true\"}}\n";
    let cases = [
        Case {
            name: "inert when unset: every entry PUBLIC, no policy",
            mesh: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: unrelated, namespace: istio-system}\n".into(),
            labels: "{trusted: \"true\"}",
            visibility: Visibility::Public,
            ..Default::default()
        },
        Case {
            name: "default applies when no policy matches",
            mesh: mesh(&format!("      defaultVisibility: NAMESPACE\n      policies:\n{trusted_public}")),
            visibility: Visibility::Namespace,
            ..Default::default()
        },
        Case {
            name: "a matching policy wins over the default",
            mesh: mesh(&format!("      defaultVisibility: NAMESPACE\n      policies:\n{trusted_public}")),
            labels: "{trusted: \"true\"}",
            visibility: Visibility::Public,
            matched: Some(0),
        },
        Case {
            name: "first matching policy wins (order matters)",
            mesh: mesh(&format!(
                "      defaultVisibility: PUBLIC\n      policies:\n        - visibility: NONE\n          matchingRules:\n            - namespaceSelector: {{matchLabels: {{quarantine: \"true\"}}}}\n{trusted_public}"
            )),
            labels: "{trusted: \"true\", quarantine: \"true\"}",
            visibility: Visibility::None,
            matched: Some(0),
        },
        Case {
            name: "later policy matches when earlier does not",
            mesh: mesh(&format!(
                "      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: NONE\n          matchingRules:\n            - namespaceSelector: {{matchLabels: {{quarantine: \"true\"}}}}\n{trusted_public}"
            )),
            labels: "{trusted: \"true\"}",
            visibility: Visibility::Public,
            matched: Some(1),
        },
        Case {
            name: "AND within a policy: one failing rule fails the policy",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchLabels: {trusted: \"true\"}}\n            - namespaceSelector: {matchLabels: {tier: gold}}\n"),
            labels: "{trusted: \"true\"}",
            visibility: Visibility::Namespace,
            ..Default::default()
        },
        Case {
            name: "AND within a policy: all rules matching matches",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchLabels: {trusted: \"true\"}}\n            - namespaceSelector: {matchLabels: {tier: gold}}\n"),
            labels: "{trusted: \"true\", tier: gold}",
            visibility: Visibility::Public,
            matched: Some(0),
        },
        Case {
            name: "empty rule list is a catch-all",
            mesh: mesh("      defaultVisibility: PUBLIC\n      policies:\n        - visibility: NAMESPACE\n          matchingRules: []\n"),
            visibility: Visibility::Namespace,
            matched: Some(0),
            ..Default::default()
        },
        Case {
            name: "absent rule list is a catch-all",
            mesh: mesh("      defaultVisibility: PUBLIC\n      policies:\n        - visibility: NAMESPACE\n"),
            visibility: Visibility::Namespace,
            matched: Some(0),
            ..Default::default()
        },
        Case {
            name: "unknown matcher never matches (fails closed)",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - workloadSelector: {matchLabels: {app: x}}\n"),
            visibility: Visibility::Namespace,
            ..Default::default()
        },
        Case {
            name: "missing matcher never matches (fails closed)",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - {}\n"),
            visibility: Visibility::Namespace,
            ..Default::default()
        },
        Case {
            name: "empty namespaceSelector matches every namespace",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {}\n"),
            visibility: Visibility::Public,
            matched: Some(0),
            ..Default::default()
        },
        Case {
            name: "every namespace carries its name label",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: team-a}}\n"),
            visibility: Visibility::Public,
            matched: Some(0),
            ..Default::default()
        },
        Case {
            name: "operator In",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchExpressions: [{key: tier, operator: In, values: [gold, silver]}]}\n"),
            labels: "{tier: silver}",
            visibility: Visibility::Public,
            matched: Some(0),
        },
        Case {
            name: "operator NotIn",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchExpressions: [{key: tier, operator: NotIn, values: [gold]}]}\n"),
            labels: "{tier: gold}",
            visibility: Visibility::Namespace,
            ..Default::default()
        },
        Case {
            name: "operator Exists",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - visibility: PUBLIC\n          matchingRules:\n            - namespaceSelector: {matchExpressions: [{key: trusted, operator: Exists}]}\n"),
            labels: "{trusted: \"false\"}",
            visibility: Visibility::Public,
            matched: Some(0),
        },
        Case {
            name: "operator DoesNotExist",
            mesh: mesh("      defaultVisibility: PUBLIC\n      policies:\n        - visibility: NAMESPACE\n          matchingRules:\n            - namespaceSelector: {matchExpressions: [{key: trusted, operator: DoesNotExist}]}\n"),
            visibility: Visibility::Namespace,
            matched: Some(0),
            ..Default::default()
        },
        Case {
            name: "VISIBILITY_UNSPECIFIED means PUBLIC",
            mesh: mesh("      defaultVisibility: VISIBILITY_UNSPECIFIED\n"),
            visibility: Visibility::Public,
            ..Default::default()
        },
        Case {
            name: "absent defaultVisibility means PUBLIC",
            mesh: mesh("      applyToSidecars: false\n"),
            visibility: Visibility::Public,
            ..Default::default()
        },
        Case {
            name: "absent policy visibility means PUBLIC",
            mesh: mesh("      defaultVisibility: NAMESPACE\n      policies:\n        - matchingRules: []\n"),
            visibility: Visibility::Public,
            matched: Some(0),
            ..Default::default()
        },
    ];
    for case in cases {
        let got = resolve_one(&case.mesh, case.labels);
        assert_eq!(
            (got.visibility, got.matched_policy),
            (case.visibility, case.matched),
            "{}",
            case.name
        );
    }
}

#[test]
fn mesh_config_in_each_form_resolves_the_same() {
    let visibility = "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n";
    let indented = |n: usize| {
        visibility
            .lines()
            .map(|l| format!("{}{l}\n", " ".repeat(n)))
            .collect::<String>()
    };
    let forms = [
        (
            "IstioOperator",
            format!(
                "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec:\n  meshConfig:\n{}",
                indented(4)
            ),
        ),
        (
            "IstioOperator without metadata or apiVersion",
            format!("kind: IstioOperator\nspec:\n  meshConfig:\n{}", indented(4)),
        ),
        (
            "ConfigMap istio, key mesh",
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: istio, namespace: istio-system}}\ndata:\n  mesh: |\n{}",
                indented(4)
            ),
        ),
        ("kind MeshConfig", format!("kind: MeshConfig\n{visibility}")),
    ];
    for (name, form) in forms {
        let got = resolve_one(&form, "{}");
        assert_eq!(got.visibility, Visibility::Namespace, "{name}");
    }
}

#[test]
fn condition_rules() {
    struct Case {
        name: &'static str,
        configured: bool,
        visibility: &'static str,
        waypoint_labels: &'static str,
        expect: &'static [(&'static str, &'static str, &'static str)],
        bound: Option<&'static str>,
    }
    // A case names what it checks: the rest is a configured feature, no waypoint label, nothing bound.
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                configured: true,
                visibility: "PUBLIC",
                waypoint_labels: "{}",
                expect: &[],
                bound: None,
            }
        }
    }
    let cases = [
        Case {
            name: "unset feature writes no VisibilityApplied",
            configured: false,
            visibility: "PUBLIC",
            expect: &[],
            ..Default::default()
        },
        Case {
            name: "PUBLIC gets VisibilityApplied True Public",
            visibility: "PUBLIC",
            expect: &[(VISIBILITY_APPLIED, "True", "Public")],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE gets VisibilityApplied True Namespace",
            visibility: "NAMESPACE",
            expect: &[(VISIBILITY_APPLIED, "True", "Namespace")],
            ..Default::default()
        },
        Case {
            name: "NONE gets no condition at all",
            visibility: "NONE",
            waypoint_labels: "{istio.io/use-waypoint: wp}",
            expect: &[],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE with a cross-namespace waypoint is refused",
            visibility: "NAMESPACE",
            waypoint_labels: "{istio.io/use-waypoint: wp, istio.io/use-waypoint-namespace: istio-system}",
            expect: &[
                (VISIBILITY_APPLIED, "True", "Namespace"),
                (WAYPOINT_BOUND, "False", CROSS_NAMESPACE_WAYPOINT_FORBIDDEN),
            ],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE with a same-namespace waypoint binds",
            visibility: "NAMESPACE",
            waypoint_labels: "{istio.io/use-waypoint: wp}",
            expect: &[
                (VISIBILITY_APPLIED, "True", "Namespace"),
                (WAYPOINT_BOUND, "True", WAYPOINT_ACCEPTED),
            ],
            bound: Some("team-a/wp"),
            ..Default::default()
        },
        Case {
            name: "NAMESPACE naming its own namespace explicitly binds",
            visibility: "NAMESPACE",
            waypoint_labels: "{istio.io/use-waypoint: wp, istio.io/use-waypoint-namespace: team-a}",
            expect: &[
                (VISIBILITY_APPLIED, "True", "Namespace"),
                (WAYPOINT_BOUND, "True", WAYPOINT_ACCEPTED),
            ],
            bound: Some("team-a/wp"),
            ..Default::default()
        },
        Case {
            name: "PUBLIC with a cross-namespace waypoint binds",
            visibility: "PUBLIC",
            waypoint_labels: "{istio.io/use-waypoint: wp, istio.io/use-waypoint-namespace: istio-system}",
            expect: &[
                (VISIBILITY_APPLIED, "True", "Public"),
                (WAYPOINT_BOUND, "True", WAYPOINT_ACCEPTED),
            ],
            bound: Some("istio-system/wp"),
            ..Default::default()
        },
        Case {
            name: "WaypointBound is written when the feature is unset",
            configured: false,
            visibility: "PUBLIC",
            waypoint_labels: "{istio.io/use-waypoint: wp, istio.io/use-waypoint-namespace: istio-system}",
            expect: &[(WAYPOINT_BOUND, "True", WAYPOINT_ACCEPTED)],
            bound: Some("istio-system/wp"),
        },
        Case {
            name: "use-waypoint none opts out: no WaypointBound",
            visibility: "PUBLIC",
            waypoint_labels: "{istio.io/use-waypoint: none}",
            expect: &[(VISIBILITY_APPLIED, "True", "Public")],
            ..Default::default()
        },
    ];
    for case in cases {
        let mesh = if case.configured {
            format!(
                "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: {}\n",
                case.visibility
            )
        } else {
            String::new()
        };
        let yaml = format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: api\n  namespace: team-a\n  labels: {}\nspec:\n  hosts: [api.example.com]\n---\n{mesh}",
            case.waypoint_labels
        );
        let got = resolve(&model(&yaml)).entries.remove(0);
        let conditions: Vec<(&str, String, &str)> = got
            .conditions
            .iter()
            .map(|c| (c.type_, c.status.to_string(), c.reason))
            .collect();
        let expect: Vec<(&str, String, &str)> = case
            .expect
            .iter()
            .map(|(t, s, r)| (*t, s.to_string(), *r))
            .collect();
        assert_eq!(conditions, expect, "{}", case.name);
        assert_eq!(
            got.waypoint.map(|w| w.to_string()).as_deref(),
            case.bound,
            "{}",
            case.name
        );
        assert!(
            got.conditions.iter().all(|c| !c.message.is_empty()),
            "{}: messages are never empty",
            case.name
        );
    }
}

#[test]
fn refused_waypoint_message_names_the_waypoint() {
    let yaml = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: api\n  namespace: team-a\n  labels: {istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}\nspec:\n  hosts: [api.example.com]\n---\nkind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: NAMESPACE}\n";
    let got = resolve(&model(yaml)).entries.remove(0);
    assert!(
        got.conditions[1].message.contains("istio-system/egress"),
        "{}",
        got.conditions[1].message
    );
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn sidecar_export_to_rules() {
    struct Case {
        name: &'static str,
        declared: Option<&'static [&'static str]>,
        mesh_default: Option<&'static [&'static str]>,
        visibility: Visibility,
        cap: bool,
        want: &'static [&'static str],
    }
    // A case names what it checks: the rest is nothing declared, no mesh default, the cap on.
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                declared: None,
                mesh_default: None,
                visibility: Visibility::Public,
                cap: true,
                want: &[],
            }
        }
    }
    use Visibility as V;
    let cases = [
        Case {
            name: "undeclared defaults to *",
            visibility: V::Public,
            want: &["*"],
            ..Default::default()
        },
        Case {
            name: "empty list counts as undeclared",
            declared: Some(&[]),
            visibility: V::Public,
            want: &["*"],
            ..Default::default()
        },
        Case {
            name: "mesh defaultServiceExportTo used when undeclared",
            mesh_default: Some(&["."]),
            visibility: V::Public,
            want: &["."],
            ..Default::default()
        },
        Case {
            name: "declared ~ alone stays ~ under PUBLIC",
            declared: Some(&["~"]),
            visibility: V::Public,
            want: &["~"],
            ..Default::default()
        },
        Case {
            name: "declared ~ alone stays ~ under NAMESPACE",
            declared: Some(&["~"]),
            visibility: V::Namespace,
            want: &["~"],
            ..Default::default()
        },
        Case {
            name: "PUBLIC leaves the declared set unchanged",
            declared: Some(&["team-b", "."]),
            visibility: V::Public,
            want: &["team-b", "."],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE caps * to .",
            declared: Some(&["*"]),
            visibility: V::Namespace,
            want: &["."],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE keeps .",
            declared: Some(&["."]),
            visibility: V::Namespace,
            want: &["."],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE turns own namespace by name into .",
            declared: Some(&["team-a", "team-b"]),
            visibility: V::Namespace,
            want: &["."],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE with only other namespaces becomes ~",
            declared: Some(&["team-b"]),
            visibility: V::Namespace,
            want: &["~"],
            ..Default::default()
        },
        Case {
            name: "NAMESPACE caps the mesh default too",
            mesh_default: Some(&["*"]),
            visibility: V::Namespace,
            want: &["."],
            ..Default::default()
        },
        Case {
            name: "NONE becomes ~",
            declared: Some(&["*"]),
            visibility: V::None,
            want: &["~"],
            ..Default::default()
        },
        Case {
            name: "without applyToSidecars the declared set stands",
            declared: Some(&["*"]),
            visibility: V::Namespace,
            cap: false,
            want: &["*"],
            ..Default::default()
        },
        Case {
            name: "without applyToSidecars NONE keeps the declared set",
            declared: Some(&["team-b"]),
            visibility: V::None,
            cap: false,
            want: &["team-b"],
            ..Default::default()
        },
    ];
    for case in cases {
        let declared = case.declared.map(strings);
        let mesh_default = case.mesh_default.map(strings);
        let got = sidecar_export_to(
            declared.as_deref(),
            mesh_default.as_deref(),
            "team-a",
            case.visibility,
            case.cap,
        );
        assert_eq!(got, strings(case.want), "{}", case.name);
    }
}

#[test]
fn apply_to_sidecars_caps_export_to_in_resolve() {
    let capped = resolve_one(
        &mesh("      defaultVisibility: NAMESPACE\n      applyToSidecars: true\n"),
        "{}",
    );
    assert_eq!(capped.sidecar_export_to, strings(&["."]));
    let uncapped = resolve_one(&mesh("      defaultVisibility: NAMESPACE\n"), "{}");
    assert_eq!(uncapped.sidecar_export_to, strings(&["*"]));
}

/// The namespaces a scope reaches, among a small universe.
fn reach(scope: &[String], own: &str) -> Vec<String> {
    let universe = ["team-a", "team-b", "team-c"];
    universe
        .iter()
        .filter(|ns| {
            scope
                .iter()
                .any(|e| e == "*" || (e == "." && **ns == own) || e == *ns)
        })
        .map(|s| s.to_string())
        .collect()
}

proptest! {
    #[test]
    fn visibility_never_widens_export_to(
        declared in proptest::option::of(proptest::sample::subsequence(vec!["*", ".", "team-a", "team-b", "team-c"], 0..=5)),
        private in any::<bool>(),
        visibility in prop_oneof![Just(Visibility::Public), Just(Visibility::Namespace), Just(Visibility::None)],
        cap in any::<bool>(),
    ) {
        let declared: Option<Vec<String>> = if private { Some(strings(&["~"])) } else { declared.map(|d| strings(&d)) };
        let effective = sidecar_export_to(declared.as_deref(), None, "team-a", visibility, cap);
        let declared_reach = reach(&declared.clone().filter(|d| !d.is_empty()).unwrap_or_else(|| strings(&["*"])), "team-a");
        let effective_reach = reach(&effective, "team-a");
        prop_assert!(effective_reach.iter().all(|ns| declared_reach.contains(ns)), "widened {declared:?} to {effective:?}");
        if cap && visibility == Visibility::Namespace {
            prop_assert!(effective_reach.iter().all(|ns| ns == "team-a"));
        }
        if cap && visibility == Visibility::None {
            prop_assert!(effective_reach.is_empty());
        }
    }
}

#[test]
fn allocation_rules() {
    let yaml = r#"
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: httpbin, namespace: istio-system}
spec: {hosts: [httpbin.example.com, httpbin.example.org], resolution: DNS, ports: [{number: 80, name: http}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: istio-system}
spec: {hosts: ["*.example.net"], resolution: DNS, ports: [{number: 80, name: http}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: passthrough, namespace: team-a}
spec: {hosts: [raw.example.com], resolution: NONE, ports: [{number: 80, name: http}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: declared, namespace: team-a}
spec: {hosts: [api.example.com], addresses: [203.0.113.10], resolution: STATIC, ports: [{number: 80, name: http}]}
"#;
    let m = model(yaml);
    let r = resolve(&m);
    let by_name = |name: &str| r.entries.iter().find(|e| e.name == name).unwrap();
    let httpbin = by_name("httpbin");
    assert_eq!(httpbin.allocated.len(), 2, "one allocation per exact host");
    for a in &httpbin.allocated {
        assert!(V4_RANGE.contains(&a.v4.unwrap()), "v4 from 240.240.0.0/16");
        assert!(V6_RANGE.contains(&a.v6.unwrap()), "v6 from 2001:2::/48");
    }
    assert_ne!(
        httpbin.allocated[0].v4, httpbin.allocated[1].v4,
        "hosts never share an allocation"
    );
    assert!(
        by_name("wild").allocated.is_empty(),
        "wildcard hosts get no address"
    );
    assert!(
        by_name("passthrough").allocated.is_empty(),
        "resolution NONE gets no address"
    );
    assert!(
        by_name("declared").allocated.is_empty(),
        "declared addresses are kept"
    );
    let se = |name: &str| {
        m.service_entries
            .iter()
            .find(|s| s.meta.name == name)
            .unwrap()
    };
    assert_eq!(
        by_name("declared")
            .addresses(&se("declared").addresses)
            .len(),
        1
    );
    assert_eq!(
        httpbin.addresses(&se("httpbin").addresses).len(),
        4,
        "resolve shows allocated v4 and v6 per host"
    );

    // Stable: the same namespace/name/host gets the same address whatever else is in the directory.
    let alone = resolve(&model(&yaml[..yaml.find("---").unwrap()]));
    assert_eq!(
        alone.entries[0].allocated, httpbin.allocated,
        "same across restarts and unrelated changes"
    );
}

/// A `status.addresses` value outside Istio's ranges is never an entry's address: the host is
/// allocated as if it were not written (the family it leaves missing from the pools), and its
/// error is among the allocation's errors, naming the entry and the field.
#[test]
fn refused_status_addresses_are_never_an_entrys_address() {
    let yaml = r#"
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: half, namespace: team-a}
spec: {hosts: [half.example.com], resolution: DNS, ports: [{number: 80, name: http}]}
status: {addresses: [{value: 8.8.8.8, host: half.example.com}, {value: "2001:2::7", host: half.example.com}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: none-good, namespace: team-a}
spec: {hosts: [lo.example.com], resolution: DNS, ports: [{number: 80, name: http}]}
status: {addresses: [{value: 127.0.0.1, host: lo.example.com}, {value: "fd00:7::1", host: lo.example.com}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: good, namespace: team-a}
spec: {hosts: [good.example.com], resolution: DNS, ports: [{number: 80, name: http}]}
status: {addresses: [{value: 240.240.3.7, host: good.example.com}, {value: "2001:2::8", host: good.example.com}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: declared, namespace: team-b}
spec: {hosts: [gw.example.com], addresses: [203.0.113.10], resolution: STATIC, ports: [{number: 80, name: http}]}
status: {addresses: [{value: 169.254.7.1, host: gw.example.com}]}
"#;
    let m = model(yaml);
    let r = resolve(&m);
    let entry = |name: &str| {
        let i = m
            .service_entries
            .iter()
            .position(|s| s.meta.name == name)
            .unwrap();
        (&m.service_entries[i], &r.entries[i])
    };
    let addresses = |name: &str| -> Vec<String> {
        let (se, resolved) = entry(name);
        resolved
            .addresses(&se.addresses)
            .iter()
            .map(ToString::to_string)
            .collect()
    };

    let (_, half) = entry("half");
    let [a] = half.allocated.as_slice() else {
        panic!("{:?}", half.allocated)
    };
    assert!(V4_RANGE.contains(&a.v4.unwrap()), "v4 from the pool: {a:?}");
    assert_eq!(a.v6, Some("2001:2::7".parse().unwrap()), "Istio's v6 kept");
    assert!(!addresses("half").contains(&"8.8.8.8".to_string()));
    assert!(
        half.conditions
            .iter()
            .all(|c| c.reason != ADDRESS_POOL_EXHAUSTED),
        "a refused v4 is no exhausted pool: {:?}",
        half.conditions
    );

    let (_, none_good) = entry("none-good");
    let [a] = none_good.allocated.as_slice() else {
        panic!("{:?}", none_good.allocated)
    };
    assert!(
        V4_RANGE.contains(&a.v4.unwrap()) && V6_RANGE.contains(&a.v6.unwrap()),
        "{a:?}"
    );

    assert_eq!(
        addresses("good"),
        ["240.240.3.7", "2001:2::8"],
        "Istio's own, as written"
    );
    assert_eq!(addresses("declared"), ["203.0.113.10"], "never 169.254.7.1");

    let errors = allocation_errors(&m, &r);
    let named: Vec<(&str, &str)> = errors
        .iter()
        .map(|e| {
            (
                e.object.as_deref().unwrap_or_default(),
                e.field.as_deref().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        named,
        [
            ("ServiceEntry team-a/half", "status.addresses[0].value"),
            ("ServiceEntry team-a/none-good", "status.addresses[0].value"),
            ("ServiceEntry team-a/none-good", "status.addresses[1].value"),
            ("ServiceEntry team-b/declared", "status.addresses[0].value"),
        ],
        "{errors:?}"
    );
    assert!(errors.iter().all(|e| e.file == "test.yaml"));

    // An entry that carries refusals never stands alone: only a whole resolution tells its errors.
    let (declared, _) = entry("declared");
    assert!(!stands_alone(&m, declared));
    let mut fixed = (**declared).clone();
    fixed.refused_status.clear();
    assert!(stands_alone(&m, &fixed));
}

#[test]
fn allocation_never_collides_across_many_entries() {
    let mut yaml = String::new();
    for i in 0..2000 {
        yaml.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: e{i}, namespace: ns{}}}\nspec: {{hosts: [h{i}.example.com], resolution: DNS, ports: [{{number: 80, name: http}}]}}\n",
            i % 7
        ));
    }
    let r = resolve(&model(&yaml));
    let mut v4 = std::collections::HashSet::new();
    let mut v6 = std::collections::HashSet::new();
    for e in &r.entries {
        for a in &e.allocated {
            assert!(v4.insert(a.v4.unwrap()), "v4 {:?} allocated twice", a.v4);
            assert!(v6.insert(a.v6.unwrap()), "v6 {:?} allocated twice", a.v6);
        }
    }
    assert_eq!((v4.len(), v6.len()), (2000, 2000));
}
