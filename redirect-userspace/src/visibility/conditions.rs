//! The status conditions the control plane writes on a ServiceEntry.
use std::fmt;

use serde::Serialize;

use crate::config::{Labels, ServiceEntry, UseWaypoint, Visibility, WaypointRef, use_waypoint};

pub const VISIBILITY_APPLIED: &str = "istio.io/VisibilityApplied";
pub const WAYPOINT_BOUND: &str = "istio.io/WaypointBound";
pub const CROSS_NAMESPACE_WAYPOINT_FORBIDDEN: &str = "CrossNamespaceWaypointForbidden";
pub const WAYPOINT_ACCEPTED: &str = "WaypointAccepted";

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
pub fn requested_waypoint(
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

/// The conditions of one entry and the waypoint the data plane honours (`None` when refused or
/// absent). A NONE entry is delivered to no proxy: it gets neither condition, as upstream does.
/// `namespace_labels` are the labels of the entry's namespace (for an inherited waypoint).
pub fn conditions(
    entry: &ServiceEntry,
    namespace_labels: &Labels,
    visibility: Visibility,
    configured: bool,
) -> (Vec<Condition>, Option<WaypointRef>) {
    let mut out = Vec::new();
    if visibility == Visibility::None {
        return (out, None);
    }
    if configured {
        let (reason, message) = match visibility {
            Visibility::Public => (
                "Public",
                "visible to workloads in every namespace".to_string(),
            ),
            _ => (
                "Namespace",
                format!(
                    "visible only to workloads in namespace {}",
                    entry.meta.namespace
                ),
            ),
        };
        out.push(Condition {
            type_: VISIBILITY_APPLIED,
            status: ConditionStatus::True,
            reason,
            message,
        });
    }
    let Some((waypoint, inherited)) = requested_waypoint(entry, namespace_labels) else {
        return (out, None);
    };
    let origin = if inherited {
        format!(" (from the labels of namespace {})", entry.meta.namespace)
    } else {
        String::new()
    };
    if visibility == Visibility::Namespace && waypoint.namespace != entry.meta.namespace {
        out.push(Condition {
            type_: WAYPOINT_BOUND,
            status: ConditionStatus::False,
            reason: CROSS_NAMESPACE_WAYPOINT_FORBIDDEN,
            message: format!(
                "waypoint {waypoint}{origin} is in another namespace; a NAMESPACE-visibility ServiceEntry may bind only a waypoint in {}",
                entry.meta.namespace
            ),
        });
        return (out, None);
    }
    out.push(Condition {
        type_: WAYPOINT_BOUND,
        status: ConditionStatus::True,
        reason: WAYPOINT_ACCEPTED,
        message: format!("bound to waypoint {waypoint}{origin}"),
    });
    (out, Some(waypoint))
}
