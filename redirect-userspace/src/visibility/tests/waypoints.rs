//! Waypoint inheritance from the namespace, translated from Istio's ambient `services_test.go`
//! (waypoint labels on the object, else on its namespace; `none` opts out) and pilot
//! `serviceentry_visibility_test.go` (a NAMESPACE entry may not bind a waypoint elsewhere).
use super::*;

#[test]
fn waypoints_are_inherited_from_the_namespace() {
    struct Case {
        /// The source case: ambient `services_test.go` or pilot `serviceentry_visibility_test.go`.
        name: &'static str,
        namespace_labels: &'static str,
        entry_labels: &'static str,
        visibility: &'static str,
        /// (status, reason) of WaypointBound; `None`: no WaypointBound at all.
        bound_condition: Option<(&'static str, &'static str)>,
        waypoint: Option<&'static str>,
    }
    // A case names what it checks: labels are empty unless named.
    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                namespace_labels: "{}",
                entry_labels: "{}",
                visibility: "PUBLIC",
                bound_condition: None,
                waypoint: None,
            }
        }
    }
    let cases = [
        Case {
            name: "services_test.go: namespace use-waypoint applies to an unlabelled entry",
            namespace_labels: "{istio.io/use-waypoint: ns-wp}",
            visibility: "PUBLIC",
            bound_condition: Some(("True", WAYPOINT_ACCEPTED)),
            waypoint: Some("team-a/ns-wp"),
            ..Default::default()
        },
        Case {
            name: "services_test.go: namespace use-waypoint with use-waypoint-namespace",
            namespace_labels: "{istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}",
            visibility: "PUBLIC",
            bound_condition: Some(("True", WAYPOINT_ACCEPTED)),
            waypoint: Some("istio-system/egress"),
            ..Default::default()
        },
        Case {
            name: "serviceentry_visibility_test.go: NAMESPACE entry inheriting a cross-namespace waypoint is refused",
            namespace_labels: "{istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}",
            visibility: "NAMESPACE",
            bound_condition: Some(("False", CROSS_NAMESPACE_WAYPOINT_FORBIDDEN)),
            waypoint: None,
            ..Default::default()
        },
        Case {
            name: "serviceentry_visibility_test.go: NAMESPACE entry inheriting a same-namespace waypoint binds",
            namespace_labels: "{istio.io/use-waypoint: ns-wp}",
            visibility: "NAMESPACE",
            bound_condition: Some(("True", WAYPOINT_ACCEPTED)),
            waypoint: Some("team-a/ns-wp"),
            ..Default::default()
        },
        Case {
            name: "services_test.go: the entry's own label wins over the namespace's",
            namespace_labels: "{istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}",
            entry_labels: "{istio.io/use-waypoint: own-wp}",
            visibility: "NAMESPACE",
            bound_condition: Some(("True", WAYPOINT_ACCEPTED)),
            waypoint: Some("team-a/own-wp"),
        },
        Case {
            name: "services_test.go: use-waypoint none on the entry opts out of the namespace's",
            namespace_labels: "{istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}",
            entry_labels: "{istio.io/use-waypoint: none}",
            visibility: "NAMESPACE",
            bound_condition: None,
            waypoint: None,
        },
        Case {
            name: "services_test.go: use-waypoint none on the namespace binds nothing",
            namespace_labels: "{istio.io/use-waypoint: none}",
            visibility: "PUBLIC",
            bound_condition: None,
            waypoint: None,
            ..Default::default()
        },
        Case {
            name: "services_test.go: use-waypoint-namespace alone binds nothing",
            namespace_labels: "{istio.io/use-waypoint-namespace: istio-system}",
            visibility: "NAMESPACE",
            bound_condition: None,
            waypoint: None,
            ..Default::default()
        },
        Case {
            name: "services_test.go: the entry's use-waypoint-namespace alone does not redirect the namespace's waypoint",
            namespace_labels: "{istio.io/use-waypoint: ns-wp}",
            entry_labels: "{istio.io/use-waypoint-namespace: istio-system}",
            visibility: "NAMESPACE",
            bound_condition: Some(("True", WAYPOINT_ACCEPTED)),
            waypoint: Some("team-a/ns-wp"),
        },
    ];
    for case in cases {
        let yaml = format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team-a\n  labels: {}\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: api\n  namespace: team-a\n  labels: {}\nspec:\n  hosts: [api.example.com]\n---\nkind: MeshConfig\nserviceEntryVisibility: {{defaultVisibility: {}}}\n",
            case.namespace_labels, case.entry_labels, case.visibility
        );
        let got = resolve(&model(&yaml)).entries.remove(0);
        let bound = got
            .conditions
            .iter()
            .find(|c| c.type_ == WAYPOINT_BOUND)
            .map(|c| (c.status.to_string(), c.reason));
        assert_eq!(
            bound,
            case.bound_condition.map(|(s, r)| (s.to_string(), r)),
            "{}",
            case.name
        );
        assert_eq!(
            got.waypoint.map(|w| w.to_string()).as_deref(),
            case.waypoint,
            "{}",
            case.name
        );
    }
}

#[test]
fn an_inherited_refusal_names_the_waypoint_and_where_it_came_from() {
    let yaml = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team-a\n  labels: {istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: istio-system}\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: team-a}\nspec:\n  hosts: [api.example.com]\n---\nkind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: NAMESPACE}\n";
    let got = resolve(&model(yaml)).entries.remove(0);
    let refused = got
        .conditions
        .iter()
        .find(|c| c.type_ == WAYPOINT_BOUND)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(refused.contains("istio-system/egress"), "{refused}");
    assert!(refused.contains("namespace team-a"), "{refused}");
}
