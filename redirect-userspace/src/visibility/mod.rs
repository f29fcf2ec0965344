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
pub(crate) use alloc::V6_RANGE;
pub use alloc::allocate;
pub(crate) use alloc::{ADDRESS_ALLOCATED, ADDRESS_POOL_EXHAUSTED, Allocation, V4_RANGE};
#[cfg(test)]
pub(crate) use conditions::{CROSS_NAMESPACE_WAYPOINT_FORBIDDEN, WAYPOINT_ACCEPTED};
pub(crate) use conditions::{
    Condition, ConditionStatus, VISIBILITY_APPLIED, WAYPOINT_BOUND, WAYPOINT_MISSING, conditions,
};
pub use discovery::Discovery;
pub(crate) use export_to::sidecar_export_to;
pub(crate) use policy::visibility_for;
pub(crate) use publish::Shadowed;

pub(crate) use crate::config::Visibility;
use crate::config::{Address, ConfigError, Model, ServiceEntry, VisibilityConfig, WaypointRef};

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

/// One entry as resolved. Serialized as `redirect resolve` reports it (a public interface): the
/// allocations and the waypoint are reported in other words there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedEntry {
    pub namespace: String,
    pub name: String,
    pub visibility: Visibility,
    /// 0-based index of the policy that matched; `None` when the default applied or the feature is unset.
    pub matched_policy: Option<usize>,
    pub conditions: Vec<Condition>,
    pub sidecar_export_to: Vec<String>,
    /// Per host, the addresses allocated because none were declared (empty when declared).
    #[serde(skip)]
    pub allocated: Vec<Allocation>,
    /// The waypoint the data plane uses: `None` without one or when the binding was refused.
    #[serde(skip)]
    pub waypoint: Option<WaypointRef>,
    /// False when no `discoverySelectors` matches the entry's namespace: it reaches no data plane.
    pub discovered: bool,
    /// Hosts held by an older entry or a Service of the same namespace: not published.
    #[serde(skip_serializing_if = "Vec::is_empty")]
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
    resolve_under(model, model.mesh.service_entry_visibility.as_ref())
}

/// Each entry's visibility under the model's own mesh config, in the model's order: what
/// [`resolve`] gives each entry's `visibility`, without the rest of the resolution.
pub(crate) fn visibilities(model: &Model) -> Vec<Visibility> {
    let settings = Settings::of_mesh(model);
    settings
        .policies(model)
        .into_iter()
        .map(|(v, _)| v)
        .collect()
}

/// [`resolve`] under another visibility configuration than the model's own (an audit policy: the
/// same rules, never enforced). Discovery, shadowing and allocation are the model's either way.
pub(crate) fn resolve_under(model: &Model, config: Option<&VisibilityConfig>) -> Resolved {
    let settings = Settings {
        config,
        cap: config.is_some_and(|c| c.apply_to_sidecars),
        ..Settings::of(model)
    };
    let policies = settings.policies(model);
    let visibilities: Vec<Visibility> = policies.iter().map(|(v, _)| *v).collect();
    let mut shadowed = publish::shadowed(model, &visibilities, &settings.discovery).into_iter();
    let mut allocations = allocate(model, &settings.discovery).into_iter();
    let entries = model
        .service_entries
        .iter()
        .zip(policies)
        .map(|(entry, policy)| {
            let shadowed = shadowed.next().unwrap_or_default();
            let allocated = allocations.next().unwrap_or_default();
            settings.entry(model, entry, policy, shadowed, allocated)
        })
        .collect();
    Resolved {
        entries,
        configured: settings.config.is_some(),
        discovery: settings.discovery,
    }
}

/// Whether `entry` resolves on its own: nothing of its resolution comes from another entry of
/// `model`, and nothing of another's from it. Two things tie entries together, and such an entry
/// has neither: the address pools (it needs no allocated address and takes no slot from them) and
/// "one namespace, one host" (no host of its is declared twice in its namespace). Asked of both
/// versions of a changed entry (the one `model` holds under its name is skipped), a yes says the
/// change leaves every other entry's resolution as it was.
pub(crate) fn stands_alone(model: &Model, entry: &ServiceEntry) -> bool {
    alloc::outside_pools(entry) && publish::alone_in_namespace(model, entry)
}

/// What [`resolve`] gives `entries` of `model`, each of which [`stands_alone`] (so none is
/// shadowed, none has an allocation); `discovery` is the model's.
pub(crate) fn resolve_alone(
    model: &Model,
    discovery: &Discovery,
    entries: &[&ServiceEntry],
) -> Vec<ResolvedEntry> {
    let settings = Settings {
        discovery: discovery.clone(),
        ..Settings::of_mesh(model)
    };
    entries
        .iter()
        .map(|entry| {
            let policy = settings.policy(model, &entry.meta.namespace);
            settings.entry(model, entry, policy, Vec::new(), Vec::new())
        })
        .collect()
}

/// What every entry's resolution reads of the mesh.
struct Settings<'m> {
    config: Option<&'m crate::config::VisibilityConfig>,
    /// Whether the visibility caps the sidecars' `exportTo`.
    cap: bool,
    discovery: Discovery,
}

impl<'m> Settings<'m> {
    fn of(model: &'m Model) -> Self {
        Settings {
            discovery: Discovery::of(model),
            ..Settings::of_mesh(model)
        }
    }

    fn of_mesh(model: &'m Model) -> Self {
        let config = model.mesh.service_entry_visibility.as_ref();
        Settings {
            config,
            cap: config.is_some_and(|c| c.apply_to_sidecars),
            discovery: Discovery::default(),
        }
    }

    /// Each entry's visibility and the policy that gave it, in the model's order. Entries are
    /// sorted by namespace: the policies are matched once per namespace.
    fn policies(&self, model: &Model) -> Vec<(Visibility, Option<usize>)> {
        let mut current: Option<(&str, Visibility, Option<usize>)> = None;
        model
            .service_entries
            .iter()
            .map(|entry| {
                let ns = entry.meta.namespace.as_str();
                match current {
                    Some((name, visibility, matched)) if name == ns => (visibility, matched),
                    _ => {
                        let (visibility, matched) = self.policy(model, ns);
                        current = Some((ns, visibility, matched));
                        (visibility, matched)
                    }
                }
            })
            .collect()
    }

    /// The visibility of a namespace's entries, and the policy that gave it.
    fn policy(&self, model: &Model, ns: &str) -> (Visibility, Option<usize>) {
        visibility_for(self.config, &model.namespace_labels(ns))
    }

    /// One entry's resolution, given its namespace's policy, its hosts another definition holds and
    /// its allocations.
    fn entry(
        &self,
        model: &Model,
        entry: &ServiceEntry,
        (visibility, matched_policy): (Visibility, Option<usize>),
        shadowed: Vec<Shadowed>,
        allocated: Vec<Allocation>,
    ) -> ResolvedEntry {
        let ns = &entry.meta.namespace;
        let discovered = self.discovery.sees(ns);
        // Delivered to no proxy: NONE, not discovered, or every host held by another definition.
        let published =
            discovered && visibility != Visibility::None && shadowed.len() < entry.hosts.len();
        let (mut conditions, waypoint) = if published {
            let labels = model.namespace_labels(ns);
            conditions(entry, &labels, visibility, self.config.is_some())
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
                self.cap,
            ),
            allocated,
            waypoint,
            discovered,
            shadowed,
        }
    }
}

/// The errors of entries in force without some address: one per `status.addresses` value refused
/// (see [`alloc::refused_status`]), then one per entry the address pool could not serve (see
/// [`alloc::exhausted`]).
pub(crate) fn allocation_errors(model: &Model, resolution: &Resolved) -> Vec<ConfigError> {
    let mut errors: Vec<ConfigError> = alloc::refused_status(model).collect();
    errors.extend(alloc::exhausted(
        model,
        resolution.entries.iter().map(|e| e.allocated.as_slice()),
    ));
    errors
}

#[cfg(test)]
mod tests;
