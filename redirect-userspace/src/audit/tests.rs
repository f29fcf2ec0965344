//! The audit policy built beside the enforced one from one model, and the changes it finds in real
//! decisions of the state (DNS and outbound), both ways.
use std::net::IpAddr;

use super::*;
use crate::config::{Visibility, load_sources};

const ENTRY: &str = "\
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api-example, namespace: team-a}
spec:
  hosts: [api.example.com]
  addresses: [203.0.113.10]
  ports: [{number: 80, name: http, protocol: HTTP}]
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints: [{address: 198.51.100.20}]
";

fn model(mesh: &str) -> Model {
    load_sources([("entry.yaml", ENTRY), ("mesh.yaml", mesh)]).unwrap()
}

fn visibility(default: &str) -> VisibilityConfig {
    let text = format!("serviceEntryVisibility: {{defaultVisibility: {default}}}\n");
    config::mesh_of("audit.yaml", &text)
        .unwrap()
        .service_entry_visibility
        .unwrap()
}

const OFF: &str = "kind: MeshConfig\n";
const NAMESPACE: &str =
    "kind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: NAMESPACE}\n";

fn built(mesh: &str, audit: &str) -> (Snapshot, Policy) {
    let model = model(mesh);
    let enforced = Snapshot::build(&model, &visibility::resolve(&model));
    let policy = Policy::build(Some(&visibility(audit)), &model, &enforced);
    (enforced, policy)
}

#[test]
fn the_entries_seen_otherwise_and_their_addresses_are_what_the_kernel_is_told() {
    let (_, policy) = built(OFF, "NAMESPACE");
    assert_eq!(policy.differs.len(), 1);
    assert_eq!(
        policy.addresses(),
        ["203.0.113.10/32".parse::<IpNet>().unwrap()]
    );
    // The same policy twice: nothing differs, nothing for the kernel.
    let (_, same) = built(NAMESPACE, "NAMESPACE");
    assert!(same.differs.is_empty() && same.addresses().is_empty());
}

#[test]
fn with_the_feature_off_a_namespace_audit_would_hide_team_as_entry_from_team_b_only() {
    let (enforced, policy) = built(OFF, "NAMESPACE");
    let ip: IpAddr = "203.0.113.10".parse().unwrap();
    let change = |client: &str| {
        let now = enforced.decide_outbound_with(Some(client), ip, 80, Pick::Peek);
        let audit = policy
            .snapshot
            .decide_outbound_with(Some(client), ip, 80, Pick::Peek);
        compare(
            now.service(),
            audit.service(),
            Some(client),
            &policy.differs,
        )
        .map(|c| {
            (
                c.service_namespace.to_string(),
                c.service.to_string(),
                c.direction,
            )
        })
    };
    assert_eq!(
        change("team-b"),
        Some((
            "team-a".into(),
            "api-example".into(),
            change::Direction::WouldHide
        ))
    );
    assert_eq!(change("team-a"), None);
    let dns = |client: &str| {
        let now = enforced.decide_dns(Some(client), "api.example.com.");
        let audit = policy.snapshot.decide_dns(Some(client), "api.example.com.");
        compare(
            now.service(),
            audit.service(),
            Some(client),
            &policy.differs,
        )
        .map(|c| c.direction)
    };
    assert_eq!(dns("team-b"), Some(change::Direction::WouldHide));
    assert_eq!(dns("team-a"), None);
}

#[test]
fn with_namespace_enforced_a_public_audit_would_show_it_and_the_enforced_answer_is_kept() {
    let (enforced, policy) = built(NAMESPACE, "PUBLIC");
    let now = enforced.decide_dns(Some("team-b"), "api.example.com.");
    let audit = policy
        .snapshot
        .decide_dns(Some("team-b"), "api.example.com.");
    assert!(
        matches!(now, DnsDecision::Forward { .. }),
        "enforced: forwarded"
    );
    let change = compare(
        now.service(),
        audit.service(),
        Some("team-b"),
        &policy.differs,
    );
    assert_eq!(
        change.map(|c| c.direction),
        Some(change::Direction::WouldShow)
    );
    // The enforced snapshot is untouched by the audit's: its entry is still NAMESPACE.
    let entry = enforced
        .services()
        .find(|s| s.name == "api-example")
        .unwrap();
    assert!(!entry.visible_to(Some("team-b")));
    assert_eq!(
        visibility::resolve(&model(NAMESPACE)).entries[0].visibility,
        Visibility::Namespace
    );
}

#[test]
fn the_enforced_visibilities_are_what_the_whole_resolution_gives() {
    for mesh in [OFF, NAMESPACE] {
        let model = model(mesh);
        let whole: Vec<Visibility> = visibility::resolve(&model)
            .entries
            .iter()
            .map(|e| e.visibility)
            .collect();
        assert_eq!(visibility::visibilities(&model), whole);
    }
}
