//! The control plane's part: for each ServiceEntry, its visibility (ordered policies over namespace
//! labels), its status conditions, its effective sidecar `exportTo`, and its addresses (declared, or
//! allocated when none are). Pure functions over the [`Model`]; no I/O.
mod alloc;
mod conditions;
mod export_to;
mod policy;

pub use alloc::{
    ADDRESS_ALLOCATED, ADDRESS_POOL_EXHAUSTED, Allocation, V4_RANGE, V6_RANGE, allocate,
    needs_allocation,
};
pub use conditions::{
    CROSS_NAMESPACE_WAYPOINT_FORBIDDEN, Condition, ConditionStatus, VISIBILITY_APPLIED,
    WAYPOINT_ACCEPTED, WAYPOINT_BOUND, conditions, requested_waypoint,
};
pub use export_to::sidecar_export_to;
pub use policy::{policy_matches, visibility_for};

pub use crate::config::Visibility;
use crate::config::{Address, ConfigError, Model, WaypointRef};

/// What [`resolve`] gives: the visibility of every ServiceEntry of a model (not to be confused with
/// a ServiceEntry's `resolution`, [`crate::config::Resolution`]), indexed like `model.service_entries`.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub entries: Vec<ResolvedEntry>,
    /// Whether `serviceEntryVisibility` is set (false: the feature is inert).
    pub configured: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEntry {
    pub namespace: String,
    pub name: String,
    pub visibility: Visibility,
    /// 0-based index of the policy that matched; `None` when the default applied or the feature is unset.
    pub matched_policy: Option<usize>,
    pub conditions: Vec<Condition>,
    pub sidecar_export_to: Vec<String>,
    /// Per host, the addresses allocated because none were declared (empty when declared).
    pub allocated: Vec<Allocation>,
    /// The waypoint the data plane uses: `None` without one or when the binding was refused.
    pub waypoint: Option<WaypointRef>,
}

impl ResolvedEntry {
    /// The declared addresses, or the allocated ones when none are declared.
    pub fn addresses(&self, declared: &[Address]) -> Vec<Address> {
        if !declared.is_empty() {
            return declared.to_vec();
        }
        self.allocated
            .iter()
            .flat_map(Allocation::addresses)
            .map(Address::Ip)
            .collect()
    }
}

/// What the policies give one namespace's entries.
struct NamespacePolicy<'m> {
    name: &'m str,
    labels: std::borrow::Cow<'m, crate::config::Labels>,
    visibility: Visibility,
    matched_policy: Option<usize>,
}

/// Resolves every ServiceEntry of `model`, NONE ones included.
pub fn resolve(model: &Model) -> Resolved {
    let config = model.mesh.service_entry_visibility.as_ref();
    let cap = config.is_some_and(|c| c.apply_to_sidecars);
    let mut allocations = allocate(model).into_iter();
    // Entries are sorted by namespace: the policies are matched once per namespace.
    let mut current: Option<NamespacePolicy<'_>> = None;
    let entries = model
        .service_entries
        .iter()
        .map(|entry| {
            let ns = &entry.meta.namespace;
            if current.as_ref().is_some_and(|p| p.name != ns.as_str()) {
                current = None;
            }
            let policy = current.get_or_insert_with(|| {
                let labels = model.namespace_labels(ns);
                let (visibility, matched_policy) = visibility_for(config, &labels);
                NamespacePolicy {
                    name: ns,
                    labels,
                    visibility,
                    matched_policy,
                }
            });
            let (ns_labels, visibility, matched_policy) =
                (&policy.labels, policy.visibility, policy.matched_policy);
            let (mut conditions, waypoint) =
                conditions(entry, ns_labels, visibility, config.is_some());
            let allocated = allocations.next().unwrap_or_default();
            if let Some(missing) = allocated.iter().find(|a| a.v4.is_none())
                && visibility != Visibility::None
            {
                conditions.push(Condition {
                    type_: ADDRESS_ALLOCATED,
                    status: ConditionStatus::False,
                    reason: ADDRESS_POOL_EXHAUSTED,
                    message: format!(
                        "no IPv4 address left in {V4_RANGE} for {}; declare spec.addresses",
                        missing.host
                    ),
                });
            }
            ResolvedEntry {
                namespace: ns.clone(),
                name: entry.meta.name.clone(),
                visibility,
                matched_policy,
                conditions,
                sidecar_export_to: sidecar_export_to(
                    entry.export_to.as_deref(),
                    model.mesh.default_service_export_to.as_deref(),
                    ns,
                    visibility,
                    cap,
                ),
                allocated,
                waypoint,
            }
        })
        .collect();
    Resolved {
        entries,
        configured: config.is_some(),
    }
}

/// One error per entry the address pool could not serve (see [`alloc::exhausted`]).
pub fn allocation_errors(model: &Model, resolution: &Resolved) -> Vec<ConfigError> {
    alloc::exhausted(
        model,
        resolution.entries.iter().map(|e| e.allocated.as_slice()),
    )
}

#[cfg(test)]
mod tests;
