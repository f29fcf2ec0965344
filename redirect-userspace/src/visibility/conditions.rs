//! The status conditions the control plane writes on a ServiceEntry.
use std::fmt;

use serde::Serialize;

use crate::config::{
    Host, Labels, ServiceEntry, UseWaypoint, Visibility, WaypointRef, use_waypoint,
};

pub(crate) const VISIBILITY_APPLIED: &str = "istio.io/VisibilityApplied";
pub(crate) const WAYPOINT_BOUND: &str = "istio.io/WaypointBound";
pub(crate) const WAYPOINT_MISSING: &str = "istio.io/WaypointMissing";
pub(crate) const CROSS_NAMESPACE_WAYPOINT_FORBIDDEN: &str = "CrossNamespaceWaypointForbidden";
pub(crate) const WAYPOINT_ACCEPTED: &str = "WaypointAccepted";
pub(super) const NO_WAYPOINT_FOR_WILDCARD_SERVICE: &str = "NoWaypointForWildcardService";

/// Istio's own messages, so tools that match on them see the same text.
const PUBLIC_MESSAGE: &str = "ServiceEntry is visible to the entire mesh (PUBLIC).";
const NAMESPACE_MESSAGE: &str = "ServiceEntry is visible only within its own namespace (NAMESPACE), per mesh serviceEntryVisibility.";
const WAYPOINT_MISSING_MESSAGE: &str =
    "ServiceEntry will not apply until it is bound to a valid waypoint.";

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: &'static str,
    pub status: ConditionStatus,
    pub reason: &'static str,
    pub message: String,
}

/// Serialized as the strings `"True"` / `"False"`, as in Kubernetes status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ConditionStatus {
    True,
    False,
}

impl fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
        })
    }
}

/// The waypoint an entry asks for and whether it came from its namespace: its own labels, else
/// its namespace's, as upstream inherits them. `none` on the entry opts out of the namespace's.
pub(super) fn requested_waypoint(
    entry: &ServiceEntry,
    namespace_labels: &Labels,
) -> Option<(WaypointRef, bool)> {
    match &entry.use_waypoint {
        UseWaypoint::Use(waypoint) => Some((waypoint.clone(), false)),
        UseWaypoint::Opted => None,
        UseWaypoint::Unset => match use_waypoint(namespace_labels, &entry.meta.namespace) {
            UseWaypoint::Use(waypoint) => Some((waypoint, true)),
            UseWaypoint::Unset | UseWaypoint::Opted => None,
        },
    }
}

/// The conditions of one published entry and the waypoint the data plane honours (`None` when
/// refused or absent). An entry that is delivered to no proxy (NONE, not discovered, or every host
/// shadowed) gets none of these: the caller does not ask. `namespace_labels` are the labels of the
/// entry's namespace (for an inherited waypoint).
pub(crate) fn conditions(
    entry: &ServiceEntry,
    namespace_labels: &Labels,
    visibility: Visibility,
    configured: bool,
) -> (Vec<Condition>, Option<WaypointRef>) {
    let mut out = Vec::new();
    if configured {
        let (reason, message) = match visibility {
            Visibility::Namespace => ("Namespace", NAMESPACE_MESSAGE),
            _ => ("Public", PUBLIC_MESSAGE),
        };
        out.push(Condition {
            type_: VISIBILITY_APPLIED,
            status: ConditionStatus::True,
            reason,
            message: message.to_string(),
        });
    }
    let waypoint = bind_waypoint(entry, namespace_labels, visibility, &mut out);
    let wildcard = entry.hosts.iter().any(|h| !matches!(h, Host::Exact(_)));
    if wildcard && waypoint.is_none() {
        out.push(Condition {
            type_: WAYPOINT_MISSING,
            status: ConditionStatus::True,
            reason: NO_WAYPOINT_FOR_WILDCARD_SERVICE,
            message: WAYPOINT_MISSING_MESSAGE.to_string(),
        });
    }
    (out, waypoint)
}

/// The WaypointBound condition, when the entry asks for a waypoint, and the waypoint it binds: a
/// NAMESPACE entry may bind only one in its own namespace.
fn bind_waypoint(
    entry: &ServiceEntry,
    namespace_labels: &Labels,
    visibility: Visibility,
    out: &mut Vec<Condition>,
) -> Option<WaypointRef> {
    let (waypoint, inherited) = requested_waypoint(entry, namespace_labels)?;
    if visibility == Visibility::Namespace && waypoint.namespace != entry.meta.namespace {
        let origin = if inherited {
            format!(" (from the labels of namespace {})", entry.meta.namespace)
        } else {
            String::new()
        };
        out.push(Condition {
            type_: WAYPOINT_BOUND,
            status: ConditionStatus::False,
            reason: CROSS_NAMESPACE_WAYPOINT_FORBIDDEN,
            message: format!(
                "waypoint {waypoint}{origin} is in another namespace; a NAMESPACE-visibility ServiceEntry may bind only a waypoint in {}",
                entry.meta.namespace
            ),
        });
        return None;
    }
    out.push(Condition {
        type_: WAYPOINT_BOUND,
        status: ConditionStatus::True,
        reason: WAYPOINT_ACCEPTED,
        message: format!("Successfully attached to waypoint {waypoint}"),
    });
    Some(waypoint)
}
