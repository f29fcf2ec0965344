//! The control plane's part: for each ServiceEntry, its visibility (ordered policies over namespace
//! labels), its status conditions, its effective sidecar `exportTo`, and its addresses (declared, or
//! allocated when none are). Pure functions over the [`Model`]; no I/O.
mod alloc;
mod conditions;
mod discovery;
mod export_to;
mod policy;
mod publish;

#[cfg(test)]
pub use alloc::V6_RANGE;
pub use alloc::{ADDRESS_ALLOCATED, ADDRESS_POOL_EXHAUSTED, Allocation, V4_RANGE, allocate};
#[cfg(test)]
pub use conditions::{CROSS_NAMESPACE_WAYPOINT_FORBIDDEN, WAYPOINT_ACCEPTED};
pub use conditions::{
    Condition, ConditionStatus, VISIBILITY_APPLIED, WAYPOINT_BOUND, WAYPOINT_MISSING, conditions,
};
pub use discovery::Discovery;
pub use export_to::sidecar_export_to;
pub use policy::visibility_for;
pub use publish::Shadowed;

pub use crate::config::Visibility;
use crate::config::{Address, ConfigError, Model, WaypointRef};

/// What [`resolve`] gives: the visibility of every ServiceEntry of a model (not to be confused with
/// a ServiceEntry's `resolution`, [`crate::config::Resolution`]), indexed like `model.service_entries`.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub entries: Vec<ResolvedEntry>,
    /// Whether `serviceEntryVisibility` is set (false: the feature is inert).
    pub configured: bool,
    /// The namespaces whose objects exist for the data plane (`discoverySelectors`).
    pub discovery: Discovery,
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
    /// Whether the control plane sees the entry's namespace (`discoverySelectors`).
    pub discovered: bool,
    /// The hosts another definition of the same namespace holds (one namespace, one host).
    pub shadowed: Vec<Shadowed>,
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

    /// Whether the data plane gets this entry for `host` (its `Display` form).
    pub fn publishes(&self, host: &str) -> bool {
        self.discovered
            && self.visibility != Visibility::None
            && !self.shadowed.iter().any(|s| s.host == host)
    }
}

/// Resolves every ServiceEntry of `model`, NONE ones included.
pub fn resolve(model: &Model) -> Resolved {
    let config = model.mesh.service_entry_visibility.as_ref();
    let cap = config.is_some_and(|c| c.apply_to_sidecars);
    let discovery = Discovery::of(model);
    // Entries are sorted by namespace: the policies are matched once per namespace.
    let mut current: Option<(&str, Visibility, Option<usize>)> = None;
    let policies: Vec<(Visibility, Option<usize>)> = model
        .service_entries
        .iter()
        .map(|entry| {
            let ns = entry.meta.namespace.as_str();
            match current {
                Some((name, visibility, matched)) if name == ns => (visibility, matched),
                _ => {
                    let (visibility, matched) = visibility_for(config, &model.namespace_labels(ns));
                    current = Some((ns, visibility, matched));
                    (visibility, matched)
                }
            }
        })
        .collect();
    let visibilities: Vec<Visibility> = policies.iter().map(|(v, _)| *v).collect();
    let mut shadowed = publish::shadowed(model, &visibilities, &discovery).into_iter();
    let mut allocations = allocate(model, &discovery).into_iter();
    let entries = model
        .service_entries
        .iter()
        .zip(policies)
        .map(|(entry, (visibility, matched_policy))| {
            let ns = &entry.meta.namespace;
            let discovered = discovery.sees(ns);
            let shadowed = shadowed.next().unwrap_or_default();
            let allocated = allocations.next().unwrap_or_default();
            // Delivered to no proxy: NONE, not discovered, or every host held by another definition.
            let published =
                discovered && visibility != Visibility::None && shadowed.len() < entry.hosts.len();
            let (mut conditions, waypoint) = if published {
                let labels = model.namespace_labels(ns);
                conditions(entry, &labels, visibility, config.is_some())
            } else {
                (Vec::new(), None)
            };
            if let Some(missing) = allocated.iter().find(|a| a.v4.is_none())
                && published
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
                discovered,
                shadowed,
            }
        })
        .collect();
    Resolved {
        entries,
        configured: config.is_some(),
        discovery,
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
