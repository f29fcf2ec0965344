//! The wall clock as the Kubernetes API and the reports write it.
use std::time::SystemTime;

/// Now, in RFC 3339 to the second (`2026-01-01T00:00:00Z`): what status conditions, reports and
/// the store's event times carry.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}
