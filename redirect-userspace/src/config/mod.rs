//! The resource model: a directory of Kubernetes YAML, or the objects the Kubernetes API serves
//! (`api`), -> typed, validated resources ([`Model`]).
//!
//! Every error names the file, the object (`Kind namespace/name`) and the field. The unit of refusal
//! is one object: an invalid object is left out and reported, every valid one loads ([`Loaded`]);
//! a running agent puts back the last good version of what was left out ([`keep_last_good`]).
mod api;
mod authorization;
mod convert;
mod elsewhere;
mod endpoint_slice;
mod error;
mod inputs;
mod kube;
mod labels;
mod last_good;
mod loader;
mod mesh;
mod mesh_file;
mod model;
mod service_entry;
mod source;
mod workload_names;
mod yaml;

pub(crate) use api::{ENTRY, POD, Reader, check_api_entry, check_api_pod, read_api_object};
pub(crate) use authorization::{
    AuthorizationPolicy, AuthzAction, AuthzCondition, AuthzOperation, AuthzSource,
    DRY_RUN_ANNOTATION, MtlsMode, PeerAuthentication,
};
pub(crate) use elsewhere::{PodGroup, PodRef, PodsElsewhere};
pub(crate) use endpoint_slice::SERVICE_NAME_LABEL;
pub use error::ConfigErrors;
#[cfg(test)]
pub(crate) use error::MAX_MESSAGE;
pub(crate) use error::{ConfigError, log_errors};
pub(crate) use inputs::read_inputs;
/// `metadata.creationTimestamp`: only its order matters (the ranking rule).
pub(crate) use jiff::Timestamp;
pub(crate) use labels::{LabelSelector, Labels, selects};
pub(crate) use last_good::keep_last_good;
pub(crate) use loader::complete;
#[cfg(test)]
pub(crate) use loader::load_dir;
pub(crate) use loader::{Rejected, read_dir};
pub use loader::{load_sources, read_sources};
pub(crate) use mesh::{
    DEFAULT_ROOT_NAMESPACE, MatchingRule, MeshConfig, Policy, Visibility, VisibilityConfig,
};
pub(crate) use mesh_file::{mesh_of, read_mesh_file};
pub use model::*;
pub(crate) use service_entry::use_waypoint;
#[cfg(test)]
pub(crate) use source::tests as source_tests;
pub(crate) use source::{FileStat, Limits, list as list_files, read as read_file};
pub(crate) use workload_names::{canonical_revision, canonical_service};

#[cfg(test)]
mod istio_tests;
#[cfg(test)]
mod tests;
