//! The resource model: a directory of Kubernetes YAML -> typed, validated resources ([`Model`]).
//!
//! Every error names the file, the object (`Kind namespace/name`) and the field; all errors of a load
//! are reported together and a load with any error returns none of its objects.
mod convert;
mod error;
mod kube;
mod labels;
mod loader;
mod mesh;
mod model;
mod service_entry;

pub use error::{ConfigError, ConfigErrors};
/// `metadata.creationTimestamp`: only its order matters (the ranking rule).
pub use jiff::Timestamp;
pub use labels::{LabelSelector, Labels, Operator, Requirement, selects};
pub use loader::{load_dir, load_sources};
pub use mesh::{MatchingRule, MeshConfig, Policy, Visibility, VisibilityConfig};
pub use model::*;
pub use service_entry::{USE_WAYPOINT_LABEL, USE_WAYPOINT_NAMESPACE_LABEL, use_waypoint};

#[cfg(test)]
mod istio_tests;
#[cfg(test)]
mod tests;
