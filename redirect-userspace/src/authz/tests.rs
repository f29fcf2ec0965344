//! The conversion and the decision against the cases Istio's own tests pin (`authorization_test.go`,
//! ztunnel's `rbac.rs`), written as policies a user writes and connections a node sees.
use std::net::IpAddr;

use super::*;
use crate::{
    config::{Model, load_sources},
    hbone::Identity,
};

/// The Pods of the node in every case (the kernel table's tests add an IPv6 one).
pub(super) const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: team-a, labels: {app: web}, uid: 00000000-0000-0000-0000-0000000000a1}
spec: {serviceAccountName: web}
status: {podIP: 10.244.1.20}
---
apiVersion: v1
kind: Pod
metadata: {name: db-1, namespace: team-a, labels: {app: db}, uid: 00000000-0000-0000-0000-0000000000a2}
status: {podIP: 10.244.1.21}
---
apiVersion: v1
kind: Pod
metadata: {name: b1, namespace: team-b, labels: {app: client}, uid: 00000000-0000-0000-0000-0000000000b1}
status: {podIP: 10.244.2.10}
"#;

pub(super) const WEB: &str = "10.244.1.20";
pub(super) const DB: &str = "10.244.1.21";

pub(super) fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn model(policies: &str) -> Model {
    let text = format!("{PODS}---\n{policies}");
    match load_sources([("dir/a.yaml", text.as_str())]) {
        Ok(model) => model,
        Err(e) => panic!("refused:\n{e}"),
    }
}

fn node(policies: &str) -> NodePolicies {
    let model = model(policies);
    NodePolicies::build(&model, model.workloads.iter().map(|w| &**w))
}

pub(super) fn id(ns: &str, sa: &str) -> Identity {
    Identity {
        trust_domain: "cluster.local".into(),
        namespace: ns.into(),
        service_account: sa.into(),
    }
}

/// The verdict on a connection to `dst:port` from `src` as `identity` (`None`: plaintext).
fn verdict(
    node: &NodePolicies,
    identity: Option<&Identity>,
    src: &str,
    dst: &str,
    port: u16,
) -> Verdict {
    match node.pod(ip(dst)) {
        None => Verdict::Allowed,
        Some(pod) => {
            pod.decide(&Conn {
                src_identity: identity,
                src_ip: ip(src),
                dst_ip: ip(dst),
                dst_port: port,
            })
            .verdict
        }
    }
}

pub(super) fn policy(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n---\n"
    )
}

pub(super) fn peer(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1beta1\nkind: PeerAuthentication\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n---\n"
    )
}

const B1: &str = "10.244.2.10";

#[test]
fn no_policy_allows_everything_and_guards_no_pod() {
    let n = node("");
    assert!(n.pod(ip(WEB)).is_none());
    let b = id("team-b", "default");
    assert_eq!(verdict(&n, Some(&b), B1, WEB, 8080), Verdict::Allowed);
}

#[test]
fn deny_from_a_namespace_refuses_it_and_no_other() {
    let n = node(&policy(
        "team-a",
        "deny-b",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}]}]}",
    ));
    let (a, b) = (id("team-a", "default"), id("team-b", "default"));
    assert_eq!(
        verdict(&n, Some(&b), B1, WEB, 8080),
        Verdict::ExplicitlyDenied("team-a/deny-b".into())
    );
    assert_eq!(
        verdict(&n, Some(&a), "10.244.1.99", WEB, 8080),
        Verdict::Allowed
    );
    // Plaintext has no namespace: a positive `namespaces` never matches it.
    assert_eq!(verdict(&n, None, B1, WEB, 8080), Verdict::Allowed);
}

#[test]
fn allow_by_principal_refuses_everyone_else() {
    let n = node(&policy(
        "team-a",
        "only-a",
        "{selector: {matchLabels: {app: web}}, rules: [{from: [{source: {principals: [cluster.local/ns/team-a/sa/default]}}]}]}",
    ));
    let (a, b) = (id("team-a", "default"), id("team-b", "default"));
    assert_eq!(
        verdict(&n, Some(&a), "10.244.1.99", WEB, 8080),
        Verdict::AllowedBy("team-a/only-a".into())
    );
    assert_eq!(verdict(&n, Some(&b), B1, WEB, 8080), Verdict::NotAllowed);
    assert_eq!(verdict(&n, None, B1, WEB, 8080), Verdict::NotAllowed);
    // The selector picks web alone: db has no policy.
    assert!(n.pod(ip(DB)).is_none());
}

#[test]
fn principals_take_prefix_suffix_and_presence() {
    let n = node(&policy(
        "team-a",
        "p",
        "{rules: [{from: [{source: {principals: [\"*/sa/web\", \"cluster.local/ns/team-b/*\"]}}]}]}",
    ));
    assert!(verdict(&n, Some(&id("team-c", "web")), B1, WEB, 1).allowed());
    assert!(verdict(&n, Some(&id("team-b", "x")), B1, WEB, 1).allowed());
    assert!(!verdict(&n, Some(&id("team-c", "x")), B1, WEB, 1).allowed());
    let any = node(&policy(
        "team-a",
        "any",
        "{rules: [{from: [{source: {principals: [\"*\"]}}]}]}",
    ));
    assert!(verdict(&any, Some(&id("team-c", "x")), B1, WEB, 1).allowed());
    assert!(
        !verdict(&any, None, B1, WEB, 1).allowed(),
        "plaintext has no principal"
    );
}

#[test]
fn not_forms_always_hold_for_plaintext() {
    let n = node(&policy(
        "team-a",
        "deny-not-a",
        "{action: DENY, rules: [{from: [{source: {notNamespaces: [team-a]}}]}]}",
    ));
    assert!(!verdict(&n, None, B1, WEB, 80).allowed());
    assert!(!verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80).allowed());
    assert!(verdict(&n, Some(&id("team-a", "default")), B1, WEB, 80).allowed());
}

#[test]
fn service_accounts_default_to_the_policys_namespace() {
    let n = node(&policy(
        "team-a",
        "sa",
        "{rules: [{from: [{source: {serviceAccounts: [web, team-b/default]}}]}]}",
    ));
    assert!(verdict(&n, Some(&id("team-a", "web")), B1, WEB, 1).allowed());
    assert!(verdict(&n, Some(&id("team-b", "default")), B1, WEB, 1).allowed());
    assert!(!verdict(&n, Some(&id("team-b", "web")), B1, WEB, 1).allowed());
}

#[test]
fn ip_blocks_ports_and_not_ports() {
    let n = node(&policy(
        "team-a",
        "deny",
        "{action: DENY, rules: [{from: [{source: {ipBlocks: [10.244.2.0/24]}}], to: [{operation: {notPorts: [\"9090\"]}}]}]}",
    ));
    assert!(!verdict(&n, None, B1, WEB, 8080).allowed());
    assert!(verdict(&n, None, B1, WEB, 9090).allowed(), "notPorts");
    assert!(
        verdict(&n, None, "10.244.1.99", WEB, 8080).allowed(),
        "outside the block"
    );
    let one = node(&policy(
        "team-a",
        "allow",
        "{rules: [{from: [{source: {ipBlocks: [10.244.2.10]}}], to: [{operation: {ports: [\"8080\"]}}]}]}",
    ));
    assert!(
        verdict(&one, None, B1, WEB, 8080).allowed(),
        "an address is a /32"
    );
    assert!(!verdict(&one, None, B1, WEB, 9090).allowed());
    assert!(!verdict(&one, None, "10.244.2.11", WEB, 8080).allowed());
}

#[test]
fn a_port_name_empties_its_match_and_the_rule_never_fires() {
    let n = node(&policy(
        "team-a",
        "deny",
        "{action: DENY, rules: [{to: [{operation: {ports: [http]}}]}]}",
    ));
    assert!(verdict(&n, None, B1, WEB, 80).allowed());
    let converted = &n.converted()[0];
    assert!(
        converted
            .notes
            .iter()
            .any(|m| m.contains("\"http\" is not a port number")),
        "{:?}",
        converted.notes
    );
}

#[test]
fn l7_only_allow_rule_is_dropped_and_denies_everyone() {
    let n = node(&policy(
        "team-a",
        "get",
        "{rules: [{to: [{operation: {methods: [GET]}}]}]}",
    ));
    let a = id("team-a", "default");
    assert_eq!(verdict(&n, Some(&a), B1, WEB, 80), Verdict::NotAllowed);
    assert!(n.converted()[0].groups.is_empty());
    assert!(
        n.converted()[0].notes[0].contains("omitted"),
        "{:?}",
        n.converted()[0].notes
    );
}

#[test]
fn deny_with_l4_from_and_l7_to_is_a_no_op() {
    let n = node(&policy(
        "team-a",
        "d",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}], to: [{operation: {methods: [GET]}}]}]}",
    ));
    assert!(verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80).allowed());
    assert!(
        n.converted()[0].notes[0].contains("no effect"),
        "{:?}",
        n.converted()[0].notes
    );
}

#[test]
fn deny_mixing_l4_and_l7_in_one_source_keeps_the_l4_part() {
    let n = node(&policy(
        "team-a",
        "d",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b], requestPrincipals: [\"*\"]}}]}]}",
    ));
    assert!(!verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80).allowed());
    assert!(verdict(&n, Some(&id("team-a", "default")), B1, WEB, 80).allowed());
    assert!(
        n.converted()[0].notes[0].contains("denies more"),
        "{:?}",
        n.converted()[0].notes
    );
}

#[test]
fn deny_catch_all_beside_an_l7_rule_still_denies_everything() {
    let n = node(&policy(
        "team-a",
        "d",
        "{action: DENY, rules: [{to: [{operation: {paths: [/admin]}}]}, {}]}",
    ));
    assert!(!verdict(&n, Some(&id("team-a", "default")), B1, WEB, 80).allowed());
}

#[test]
fn deny_with_an_l7_when_never_fires() {
    let n = node(&policy(
        "team-a",
        "d",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}], when: [{key: \"request.headers[x]\", values: [a]}]}]}",
    ));
    assert!(verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80).allowed());
}

#[test]
fn l4_when_conditions_match() {
    let n = node(&policy(
        "team-a",
        "d",
        "{action: DENY, rules: [{when: [{key: destination.port, values: [\"9090\"]}, {key: source.ip, notValues: [10.244.1.0/24]}]}]}",
    ));
    assert!(!verdict(&n, None, B1, WEB, 9090).allowed());
    assert!(verdict(&n, None, B1, WEB, 8080).allowed());
    assert!(verdict(&n, None, "10.244.1.5", WEB, 9090).allowed());
}

#[test]
fn empty_spec_allow_is_allow_nothing_and_deny_does_nothing() {
    let allow = node(&policy("team-a", "nothing", "{}"));
    assert_eq!(
        verdict(&allow, Some(&id("team-a", "default")), B1, WEB, 80),
        Verdict::NotAllowed
    );
    let deny = node(&policy("team-a", "nothing", "{action: DENY}"));
    assert!(verdict(&deny, Some(&id("team-a", "default")), B1, WEB, 80).allowed());
}

#[test]
fn empty_rule_matches_every_connection_and_empty_source_none() {
    let all = node(&policy("team-a", "all", "{rules: [{}]}"));
    assert!(verdict(&all, None, B1, WEB, 80).allowed());
    // `from: [{}]` (no source) is skipped: the rule has no from clause.
    let skipped = node(&policy("team-a", "all", "{rules: [{from: [{}]}]}"));
    assert!(verdict(&skipped, None, B1, WEB, 80).allowed());
    // `source: {}` is a match with nothing set: never holds.
    let empty = node(&policy(
        "team-a",
        "none",
        "{rules: [{from: [{source: {}}]}]}",
    ));
    assert!(!verdict(&empty, None, B1, WEB, 80).allowed());
}

#[test]
fn root_namespace_policies_apply_everywhere_and_its_selectors_select_in_every_namespace() {
    let n = node(&policy(
        "istio-system",
        "deny-b",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}]}]}",
    ));
    let b = id("team-b", "default");
    assert!(!verdict(&n, Some(&b), B1, WEB, 80).allowed());
    assert!(!verdict(&n, Some(&b), B1, DB, 80).allowed());
    assert!(
        !verdict(&n, Some(&b), "10.244.1.20", B1, 80).allowed(),
        "team-b's own pod too"
    );
    let sel = node(&policy(
        "istio-system",
        "db-only",
        "{selector: {matchLabels: {app: db}}, action: DENY, rules: [{}]}",
    ));
    assert!(verdict(&sel, Some(&b), B1, WEB, 80).allowed());
    assert!(!verdict(&sel, Some(&b), B1, DB, 80).allowed());
}

#[test]
fn another_namespaces_policy_does_not_apply() {
    let n = node(&policy("team-b", "deny-all", "{action: DENY, rules: [{}]}"));
    assert!(n.pod(ip(WEB)).is_none());
    assert!(n.pod(ip(B1)).is_some());
}

#[test]
fn empty_selector_selects_no_workload() {
    let n = node(&policy(
        "team-a",
        "d",
        "{selector: {}, action: DENY, rules: [{}]}",
    ));
    assert!(n.pod(ip(WEB)).is_none());
}

#[test]
fn waypoint_audit_and_custom_policies_are_not_enforced_and_say_why() {
    let n = node(&format!(
        "{}{}{}",
        policy(
            "team-a",
            "wp",
            "{targetRefs: [{kind: Service, group: \"\", name: web}], action: DENY, rules: [{}]}"
        ),
        policy("team-a", "audit", "{action: AUDIT, rules: [{}]}"),
        policy(
            "team-a",
            "ext",
            "{action: CUSTOM, provider: {name: opa}, rules: [{}]}"
        ),
    ));
    assert!(n.pod(ip(WEB)).is_none());
    let why: Vec<_> = n
        .skipped()
        .iter()
        .map(|s| (s.policy.as_str(), s.why.as_str()))
        .collect();
    assert_eq!(why.len(), 3, "{why:?}");
    assert!(
        why.iter()
            .any(|(p, w)| *p == "team-a/audit" && w.contains("AUDIT"))
    );
    assert!(
        why.iter()
            .any(|(p, w)| *p == "team-a/wp" && w.contains("waypoint"))
    );
}

#[test]
fn dry_run_policies_are_never_enforced_but_their_matches_reported() {
    let text = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: d, namespace: team-a, annotations: {istio.io/dry-run: \"true\"}}\nspec: {action: DENY, rules: [{}]}\n";
    let n = node(text);
    let pod = n.pod(ip(WEB)).unwrap();
    let d = pod.decide(&Conn {
        src_identity: None,
        src_ip: ip(B1),
        dst_ip: ip(WEB),
        dst_port: 80,
    });
    assert_eq!(d.verdict, Verdict::Allowed);
    assert_eq!(d.dry_run_matches, ["team-a/d (DENY)"]);
}

#[test]
fn strict_refuses_plaintext_and_any_identity_passes() {
    let n = node(&peer("istio-system", "default", "{mtls: {mode: STRICT}}"));
    assert_eq!(
        verdict(&n, None, B1, WEB, 80),
        Verdict::ExplicitlyDenied("istio-system/istio_converted_static_strict".into())
    );
    assert!(verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80).allowed());
}

#[test]
fn peer_authentication_levels_inherit_and_the_nearest_wins() {
    let n = node(&format!(
        "{}{}",
        peer("istio-system", "default", "{mtls: {mode: STRICT}}"),
        peer("team-a", "relaxed", "{mtls: {mode: PERMISSIVE}}"),
    ));
    assert!(
        verdict(&n, None, B1, WEB, 80).allowed(),
        "namespace level wins over mesh"
    );
    assert!(
        !verdict(&n, None, "10.244.1.20", B1, 80).allowed(),
        "team-b inherits STRICT"
    );
    let unset = node(&format!(
        "{}{}",
        peer("istio-system", "default", "{mtls: {mode: STRICT}}"),
        peer("team-a", "unset", "{mtls: {mode: UNSET}}"),
    ));
    assert!(
        !verdict(&unset, None, B1, WEB, 80).allowed(),
        "UNSET inherits"
    );
    let disable = node(&peer("team-a", "off", "{mtls: {mode: DISABLE}}"));
    assert!(
        verdict(&disable, None, B1, WEB, 80).allowed(),
        "DISABLE acts as PERMISSIVE"
    );
}

#[test]
fn root_namespace_peer_authentication_with_a_selector_is_ignored() {
    let n = node(&peer(
        "istio-system",
        "sel",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}}",
    ));
    assert!(verdict(&n, None, B1, WEB, 80).allowed());
}

#[test]
fn port_level_mtls_opens_one_port_under_strict_and_closes_one_under_permissive() {
    let open = node(&peer(
        "team-a",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}, portLevelMtls: {\"9090\": {mode: DISABLE}}}",
    ));
    assert_eq!(
        verdict(&open, None, B1, WEB, 8080),
        Verdict::ExplicitlyDenied("team-a/converted_peer_authentication_web".into())
    );
    assert!(verdict(&open, None, B1, WEB, 9090).allowed());
    let close = node(&peer(
        "team-a",
        "web",
        "{selector: {matchLabels: {app: web}}, portLevelMtls: {\"9090\": {mode: STRICT}}}",
    ));
    assert!(verdict(&close, None, B1, WEB, 8080).allowed());
    assert!(!verdict(&close, None, B1, WEB, 9090).allowed());
    assert!(verdict(&close, Some(&id("team-b", "x")), B1, WEB, 9090).allowed());
}

#[test]
fn the_oldest_namespace_peer_authentication_wins() {
    let text = "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: new, namespace: team-a, creationTimestamp: \"2025-02-01T00:00:00Z\"}\nspec: {mtls: {mode: PERMISSIVE}}\n---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: old, namespace: team-a, creationTimestamp: \"2025-01-01T00:00:00Z\"}\nspec: {mtls: {mode: STRICT}}\n";
    let n = node(text);
    assert!(!verdict(&n, None, B1, WEB, 80).allowed());
}

#[test]
fn deny_wins_over_allow() {
    let n = node(&format!(
        "{}{}",
        policy("team-a", "allow-all", "{rules: [{}]}"),
        policy(
            "team-a",
            "deny-b",
            "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}]}]}"
        ),
    ));
    assert_eq!(
        verdict(&n, Some(&id("team-b", "default")), B1, WEB, 80),
        Verdict::ExplicitlyDenied("team-a/deny-b".into())
    );
    assert_eq!(
        verdict(&n, Some(&id("team-a", "default")), B1, WEB, 80),
        Verdict::AllowedBy("team-a/allow-all".into())
    );
}

#[test]
fn malformed_policies_are_refused_naming_the_field() {
    for (text, field) in [
        (policy("team-a", "x", "{action: BLOCK}"), "spec.action"),
        (
            policy("team-a", "x", "{rules: [{when: [{key: source.ip}]}]}"),
            "spec.rules[0].when[0]",
        ),
        (
            policy(
                "team-a",
                "x",
                "{selector: {matchLabels: {a: b}}, targetRef: {kind: Gateway, name: w}}",
            ),
            "spec.selector",
        ),
        (
            peer("team-a", "x", "{mtls: {mode: MAYBE}}"),
            "spec.mtls.mode",
        ),
        (
            peer("team-a", "x", "{portLevelMtls: {\"80\": {mode: STRICT}}}"),
            "spec.portLevelMtls",
        ),
        (
            peer(
                "team-a",
                "x",
                "{selector: {matchLabels: {a: b}}, portLevelMtls: {http: {mode: STRICT}}}",
            ),
            "spec.portLevelMtls.http",
        ),
    ] {
        let text = format!("{PODS}---\n{text}");
        let err = load_sources([("dir/a.yaml", text.as_str())]).expect_err(&text);
        let shown = err.to_string();
        assert!(shown.contains("dir/a.yaml"), "{shown}");
        assert!(shown.contains("team-a/x"), "{shown}");
        assert!(shown.contains(field), "{field}: {shown}");
    }
}
