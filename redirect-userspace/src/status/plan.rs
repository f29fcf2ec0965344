//! What to write on one ServiceEntry: the conditions `resolve` computes, merged into those the
//! API holds. Pure; the writer does the I/O.
use serde_json::{Map, Value, json};

use super::observed::Observed;
use crate::visibility::{
    ADDRESS_ALLOCATED, Condition, VISIBILITY_APPLIED, WAYPOINT_BOUND, WAYPOINT_MISSING,
};

/// The condition types the status writer owns. Any other type is never touched.
pub(crate) const MANAGED_TYPES: [&str; 4] = [
    VISIBILITY_APPLIED,
    WAYPOINT_BOUND,
    WAYPOINT_MISSING,
    ADDRESS_ALLOCATED,
];

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// The API already says what `resolve` says.
    Unchanged,
    /// Another field manager writes these condition types: left to it.
    OtherWriter(String),
    /// The whole new `status.conditions` (other types as they were, ours as resolved).
    Write(Vec<Value>),
}

fn managed(condition: &Value) -> bool {
    condition["type"]
        .as_str()
        .is_some_and(|t| MANAGED_TYPES.contains(&t))
}

/// The plan for one entry whose wanted conditions are `wanted` (empty: none of ours should be
/// there), given what the API holds, at time `now` (RFC 3339). `lastTransitionTime` moves only when
/// a condition's status changes; `observedGeneration` is the entry's generation.
pub(crate) fn plan(wanted: &[Condition], observed: &Observed, now: &str) -> Plan {
    let ours_present = observed.conditions.iter().any(managed);
    if ours_present && let Some(other) = &observed.other_writer {
        return Plan::OtherWriter(other.clone());
    }
    let mut conditions: Vec<Value> = observed
        .conditions
        .iter()
        .filter(|c| !managed(c))
        .cloned()
        .collect();
    for want in wanted {
        let status = want.status.to_string();
        let before = observed.conditions.iter().find(|c| c["type"] == want.type_);
        let since = match before {
            Some(c) if c["status"] == status.as_str() && c["lastTransitionTime"].is_string() => {
                c["lastTransitionTime"].clone()
            }
            _ => Value::from(now),
        };
        let mut condition = Map::new();
        condition.insert("type".into(), json!(want.type_));
        condition.insert("status".into(), json!(status));
        condition.insert("reason".into(), json!(want.reason));
        condition.insert("message".into(), json!(want.message));
        condition.insert("lastTransitionTime".into(), since);
        if let Some(generation) = observed.generation {
            condition.insert("observedGeneration".into(), json!(generation));
        }
        conditions.push(Value::Object(condition));
    }
    if conditions == observed.conditions {
        Plan::Unchanged
    } else {
        Plan::Write(conditions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::visibility::ConditionStatus;

    const THEN: &str = "2026-01-01T00:00:00Z";
    const NOW: &str = "2026-06-01T00:00:00Z";

    fn namespace_applied() -> Condition {
        Condition {
            type_: VISIBILITY_APPLIED,
            status: ConditionStatus::True,
            reason: "Namespace",
            message: "ServiceEntry is visible only within its own namespace (NAMESPACE), per mesh serviceEntryVisibility.".into(),
        }
    }

    fn observed(conditions: Vec<Value>) -> Observed {
        Observed {
            resource_version: "5".into(),
            generation: Some(2),
            conditions,
            other_writer: None,
        }
    }

    #[test]
    fn a_new_condition_is_written_then_nothing_while_it_holds() {
        let Plan::Write(first) = plan(&[namespace_applied()], &observed(vec![]), NOW) else {
            panic!("nothing to write")
        };
        assert_eq!(first[0]["type"], VISIBILITY_APPLIED);
        assert_eq!(first[0]["reason"], "Namespace");
        assert_eq!(first[0]["observedGeneration"], 2);
        assert_eq!(first[0]["lastTransitionTime"], NOW);
        // Read back later: nothing to do, and the time of the transition stays.
        assert_eq!(
            plan(
                &[namespace_applied()],
                &observed(first.clone()),
                "2027-01-01T00:00:00Z"
            ),
            Plan::Unchanged
        );
    }

    #[test]
    fn the_transition_time_moves_only_with_the_status() {
        let held = json!({"type": VISIBILITY_APPLIED, "status": "True", "reason": "Public",
            "message": "old", "lastTransitionTime": THEN, "observedGeneration": 1});
        // Same status, new reason and generation: rewritten, the transition time kept.
        let Plan::Write(got) = plan(&[namespace_applied()], &observed(vec![held]), NOW) else {
            panic!("expected a write")
        };
        assert_eq!(got[0]["lastTransitionTime"], THEN);
        assert_eq!(got[0]["reason"], "Namespace");
        assert_eq!(got[0]["observedGeneration"], 2);
        let held = json!({"type": WAYPOINT_BOUND, "status": "True", "reason": "WaypointAccepted",
            "message": "m", "lastTransitionTime": THEN});
        let refused = Condition {
            type_: WAYPOINT_BOUND,
            status: ConditionStatus::False,
            reason: "CrossNamespaceWaypointForbidden",
            message: "m".into(),
        };
        let Plan::Write(got) = plan(&[refused], &observed(vec![held]), NOW) else {
            panic!("expected a write")
        };
        assert_eq!(got[0]["lastTransitionTime"], NOW);
    }

    #[test]
    fn other_types_are_kept_and_ours_no_longer_wanted_are_removed() {
        let foreign = json!({"type": "example.com/Healthy", "status": "True", "reason": "Probed"});
        let stale = json!({"type": VISIBILITY_APPLIED, "status": "True", "reason": "Public"});
        let got = plan(&[], &observed(vec![foreign.clone(), stale]), NOW);
        assert_eq!(got, Plan::Write(vec![foreign.clone()]));
        assert_eq!(plan(&[], &observed(vec![foreign]), NOW), Plan::Unchanged);
    }

    #[test]
    fn conditions_another_writer_holds_are_left_alone() {
        let mut held = observed(vec![
            json!({"type": VISIBILITY_APPLIED, "status": "True", "reason": "Public"}),
        ]);
        held.other_writer = Some("pilot-discovery".into());
        assert_eq!(
            plan(&[namespace_applied()], &held, NOW),
            Plan::OtherWriter("pilot-discovery".into())
        );
        // Another writer of other types only: ours are added beside theirs.
        let mut held = observed(vec![
            json!({"type": "example.com/Healthy", "status": "True"}),
        ]);
        held.other_writer = Some("health-checker".into());
        let Plan::Write(got) = plan(&[namespace_applied()], &held, NOW) else {
            panic!("expected a write")
        };
        assert_eq!(got.len(), 2);
        assert_eq!(got[0]["type"], "example.com/Healthy");
    }
}
