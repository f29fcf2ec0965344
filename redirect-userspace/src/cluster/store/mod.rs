//! What the watches have told so far, kind by kind, and the model it makes.
//!
//! Each object is held as the model holds it, at its last good version: an update the loader
//! refuses leaves the previous version in force and is reported until fixed. A watch that starts
//! over (its first list, or a list after its history expired) gathers the new list beside what is
//! served and swaps it in whole once complete, so nothing is ever served half-listed.
mod changes;
mod elsewhere;
mod interner;
mod policies;
mod relist;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
};

pub(crate) use changes::Changes;
use elsewhere::HeldElsewhere;
use interner::Interner;
use policies::PolicyScope;
use relist::{Relisting, Slots};

use super::kinds::{Converted, Kind, Object, SOURCE};
use crate::{
    config::{self, ConfigError, Model, Rejected},
    live::WatchStatus,
    status::Observed,
};

/// `(namespace, name)`; the namespace is empty for a Namespace.
pub(crate) type Key = (String, String);

/// One thing a watch reports.
#[derive(Debug, Clone)]
pub enum Change {
    /// Watching `kind` at this `apiVersion` (found by discovery for the Istio kinds).
    Watching(Kind, String),
    /// A full list starts; it replaces what is held once [`Change::Listed`] comes.
    Relist(Kind),
    /// An object listed, added or changed.
    Upsert(Kind, Key, Box<Converted>),
    Deleted(Kind, Key),
    /// The list that began with [`Change::Relist`] is complete.
    Listed(Kind),
    /// The API does not serve this kind: it holds nothing (and counts as listed).
    NotInstalled(Kind),
    /// The watch failed; it retries by itself.
    Failed(Kind, String),
}

impl Change {
    pub fn kind(&self) -> Kind {
        match self {
            Change::Watching(k, _)
            | Change::Relist(k)
            | Change::Upsert(k, ..)
            | Change::Deleted(k, _)
            | Change::Listed(k)
            | Change::NotInstalled(k)
            | Change::Failed(k, _) => *k,
        }
    }
}

#[derive(Debug)]
pub struct Store {
    kinds: BTreeMap<Kind, Relisting<Slots>>,
    /// Each ServiceEntry's status as the API holds it (the status writer's view; not the model's).
    observed: BTreeMap<Key, Arc<Observed>>,
    /// Counts changes to `observed`, so a reader knows when to look again.
    observed_changes: u64,
    interner: Interner,
    /// The Pods of other nodes, when watched: held apart and compactly.
    elsewhere: Option<Relisting<HeldElsewhere>>,
    changes: Changes,
    /// With HBONE between nodes, the node served (every model says so).
    hbone_node: Option<String>,
}

impl Default for Store {
    /// The store of an agent without a node name.
    fn default() -> Self {
        Store::new(&Kind::ALL)
    }
}

impl Store {
    /// With HBONE between nodes: the node this agent serves, for every model to carry.
    pub fn with_hbone_node(mut self, node: Option<String>) -> Self {
        self.hbone_node = node;
        self
    }

    /// A store for these watches; it is ready once each has listed.
    pub fn new(watched: &[Kind]) -> Self {
        let kinds = watched
            .iter()
            .filter(|&&kind| kind != Kind::PodElsewhere)
            .map(|&kind| (kind, Relisting::new(kind)))
            .collect();
        let elsewhere = watched
            .contains(&Kind::PodElsewhere)
            .then(|| Relisting::new(Kind::PodElsewhere));
        Store {
            kinds,
            observed: BTreeMap::new(),
            observed_changes: 0,
            interner: Interner::default(),
            elsewhere,
            changes: Changes::default(),
            hbone_node: None,
        }
    }

    /// Takes in one change at time `now` (RFC 3339). Returns whether what is served changed.
    pub fn apply(&mut self, change: Change, now: &str) -> bool {
        // What a change told one by one names: a Pod's namespace, a ServiceEntry's key.
        enum Named {
            Pod(String),
            Entry(Key),
            Other(Kind),
        }
        let named = match &change {
            Change::Upsert(Kind::Pod | Kind::PodElsewhere, (namespace, _), _)
            | Change::Deleted(Kind::Pod | Kind::PodElsewhere, (namespace, _)) => {
                Named::Pod(namespace.clone())
            }
            Change::Upsert(Kind::ServiceEntry, key, _)
            | Change::Deleted(Kind::ServiceEntry, key) => Named::Entry(key.clone()),
            other => Named::Other(other.kind()),
        };
        let changed = self.take_in(change, now);
        if changed {
            let changes = &mut self.changes;
            match named {
                Named::Pod(namespace) => {
                    changes.pods.insert(namespace);
                }
                Named::Entry(key) => {
                    changes.entries.insert(key);
                }
                Named::Other(Kind::ServiceEntry | Kind::Service | Kind::EndpointSlice) => {
                    changes.services = true
                }
                Named::Other(Kind::AuthorizationPolicy | Kind::PeerAuthentication) => {
                    changes.policies = true
                }
                Named::Other(_) => changes.others = true,
            }
        }
        changed
    }

    /// What changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    fn take_in(&mut self, mut change: Change, now: &str) -> bool {
        let kind = change.kind();
        let entries_listed = matches!(change, Change::Listed(Kind::ServiceEntry));
        self.observe(&mut change);
        let Store {
            kinds,
            elsewhere,
            interner,
            ..
        } = self;
        let changed = match (kind, elsewhere) {
            (Kind::PodElsewhere, Some(w)) => w.take_in(change, now, |object| match object {
                Object::PodElsewhere(pod) => Some(interner.pod(Arc::unwrap_or_clone(pod))),
                _ => None,
            }),
            (Kind::PodElsewhere, None) => false,
            (_, _) => match kinds.get_mut(&kind) {
                Some(w) => w.take_in(change, now, Some),
                None => false,
            },
        };
        if entries_listed && let Some(w) = self.kinds.get(&Kind::ServiceEntry) {
            let before = self.observed.len();
            self.observed.retain(|key, _| w.served.contains_key(key));
            self.observed_changes += (before - self.observed.len()) as u64;
        }
        changed
    }

    /// Keeps each ServiceEntry's status as the API holds it (the status writer's view), which
    /// the model does not read.
    fn observe(&mut self, change: &mut Change) {
        match change {
            Change::Upsert(_, key, converted) => {
                if let Some(observed) = converted.observed.take()
                    && self.observed.get(key) != Some(&observed)
                {
                    self.observed.insert(key.clone(), observed);
                    self.observed_changes += 1;
                }
            }
            Change::Deleted(Kind::ServiceEntry, key) if self.observed.remove(key).is_some() => {
                self.observed_changes += 1;
            }
            _ => {}
        }
    }

    /// The namespaces where a selector picks Pods as endpoints: a ServiceEntry's
    /// `workloadSelector`, or a Service's selector while no EndpointSlice names the Service.
    pub fn selecting_namespaces(&self) -> HashSet<&str> {
        let objects = |kind: Kind| {
            self.kinds
                .get(&kind)
                .into_iter()
                .flat_map(|w| w.served.values())
                .filter_map(|slot| slot.good.as_ref())
        };
        let sliced: HashSet<(&str, &str)> = objects(Kind::EndpointSlice)
            .filter_map(|o| match o {
                Object::EndpointSlice(s) => Some((s.namespace.as_str(), s.service.as_str())),
                _ => None,
            })
            .collect();
        let mut selecting = HashSet::new();
        for object in objects(Kind::ServiceEntry).chain(objects(Kind::Service)) {
            match object {
                Object::ServiceEntry(se)
                    if se.workload_selector.as_ref().is_some_and(|s| !s.is_empty()) =>
                {
                    selecting.insert(se.meta.namespace.as_str());
                }
                Object::Service(svc)
                    if svc.selector.as_ref().is_some_and(|s| !s.is_empty())
                        && !sliced
                            .contains(&(svc.meta.namespace.as_str(), svc.meta.name.as_str())) =>
                {
                    selecting.insert(svc.meta.namespace.as_str());
                }
                _ => {}
            }
        }
        selecting
    }

    /// Each ServiceEntry's status as the API holds it, and how many changes it has seen.
    pub fn observed(&self) -> (&BTreeMap<Key, Arc<Observed>>, u64) {
        (&self.observed, self.observed_changes)
    }

    /// The `apiVersion` a kind is watched at, once discovered.
    pub fn api_version(&self, kind: Kind) -> Option<&str> {
        self.status(kind)?.api_version.as_deref()
    }

    fn status(&self, kind: Kind) -> Option<&WatchStatus> {
        match kind {
            Kind::PodElsewhere => self.elsewhere.as_ref().map(|w| &w.status),
            _ => self.kinds.get(&kind).map(|w| &w.status),
        }
    }

    /// Every watch has listed once (or found its kind not served): the model is whole.
    pub fn ready(&self) -> bool {
        self.kinds.values().all(|w| w.status.synced)
            && self.elsewhere.as_ref().is_none_or(|w| w.status.synced)
    }

    /// Each watch's status, in the order of [`Kind`].
    pub fn statuses(&self) -> Vec<WatchStatus> {
        let counted = |w: &WatchStatus, objects| WatchStatus {
            objects,
            ..w.clone()
        };
        let mut statuses: Vec<(Kind, WatchStatus)> = self
            .kinds
            .iter()
            .map(|(kind, w)| (*kind, counted(&w.status, w.served.len())))
            .chain(self.elsewhere.iter().map(|w| {
                let status = counted(&w.status, relist::Held::len(&w.served));
                (Kind::PodElsewhere, status)
            }))
            .collect();
        statuses.sort_by_key(|(kind, _)| *kind);
        statuses.into_iter().map(|(_, status)| status).collect()
    }

    /// The model of everything in force, the errors of the objects refused, and one rejection per
    /// such object (its last good version in force where it had one). With a node name, of the
    /// security policies only those that can apply here ([`PolicyScope`]).
    pub fn model(&self) -> (Model, Vec<ConfigError>, Vec<Rejected>) {
        let mut model = Model::default();
        let mut errors = Vec::new();
        let mut rejected = Vec::new();
        // A Pod seen by both Pod watches for a moment (bound to this node as the other watch
        // lets it go) is this node's.
        let here: HashSet<(&str, &str)> = self
            .kinds
            .get(&Kind::Pod)
            .filter(|_| self.elsewhere.is_some())
            .into_iter()
            .flat_map(|w| w.served.keys())
            .map(|(ns, name)| (ns.as_str(), name.as_str()))
            .collect();
        let selecting = self.selecting_namespaces();
        let policies = PolicyScope::of(&self.kinds, self.elsewhere.is_some());
        for (kind, w) in &self.kinds {
            for ((namespace, name), slot) in &w.served {
                if !policies.holds(*kind, namespace) {
                    continue;
                }
                if !slot.errors.is_empty() {
                    errors.extend(slot.errors.iter().cloned());
                    rejected.push(Rejected {
                        kind: kind.name(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                        file: SOURCE.to_string(),
                        last_good_in_force: slot.good.is_some(),
                    });
                }
                // The objects are shared, not copied: a rebuild costs a pointer per object.
                match &slot.good {
                    Some(Object::Namespace(ns)) => {
                        model.namespaces.insert(ns.name.clone(), ns.clone());
                    }
                    Some(Object::ServiceEntry(se)) => model.service_entries.push(se.clone()),
                    Some(Object::Service(svc)) => model.services.push(svc.clone()),
                    Some(Object::Workload(w)) => model.workloads.push(w.clone()),
                    Some(Object::Mesh(mesh)) => model.mesh = (**mesh).clone(),
                    Some(Object::EndpointSlice(slice)) => model.endpoint_slices.push(slice.clone()),
                    Some(Object::PodElsewhere(pod)) => {
                        model.pods_elsewhere.upsert((**pod).clone());
                    }
                    Some(Object::AuthorizationPolicy(p)) => {
                        model.authorization_policies.push(p.clone())
                    }
                    Some(Object::PeerAuthentication(p)) => {
                        model.peer_authentications.push(p.clone())
                    }
                    None => {}
                }
            }
        }
        if let Some(w) = &self.elsewhere {
            w.served
                .add_to_model(&mut model, &mut errors, &mut rejected, &here, &selecting);
        }
        model.hbone_node = self.hbone_node.clone();
        config::complete(&mut model);
        (model, errors, rejected)
    }
}
