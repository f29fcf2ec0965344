//! What the watches have told so far, kind by kind, and the model it makes.
//!
//! Each object is held as the model holds it, at its last good version: an update the loader
//! refuses leaves the previous version in force and is reported until fixed. A watch that starts
//! over (its first list, or a list after its history expired) gathers the new list beside what is
//! served and swaps it in whole once complete, so nothing is ever served half-listed.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    hash::Hash,
    sync::Arc,
};

use super::kinds::{Converted, Kind, Object, SOURCE};
use crate::{
    config::{self, ConfigError, Labels, Model, PodElsewhere, PodRef, PodsElsewhere, Rejected},
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

#[derive(Debug, Clone, PartialEq)]
struct Slot {
    /// The version in force; `None` for an object never valid.
    good: Option<Object>,
    /// Why the latest version was refused; empty when it is the one in force.
    errors: Vec<ConfigError>,
}

#[derive(Debug, Default)]
struct Watched {
    objects: BTreeMap<Key, Slot>,
    /// The list being gathered, between [`Change::Relist`] and [`Change::Listed`].
    relist: Option<BTreeMap<Key, Slot>>,
    status: WatchStatus,
}

#[derive(Debug)]
pub struct Store {
    kinds: BTreeMap<Kind, Watched>,
    /// Each ServiceEntry's status as the API holds it (the status writer's view; not the model's).
    observed: BTreeMap<Key, Arc<Observed>>,
    /// Counts changes to `observed`, so a reader knows when to look again.
    observed_changes: u64,
    shared: Shared,
    /// The Pods of other nodes, held apart and compactly: they are most of a big cluster.
    elsewhere: Elsewhere,
    changes: Changes,
}

/// What the watch of other nodes' Pods has told, as [`Watched`] holds the other kinds (each Pod at
/// its last good version; a relist gathered beside what is served), but in shared groups.
#[derive(Debug, Default)]
struct Elsewhere {
    served: PodsElsewhere,
    /// The Pods whose latest version was refused, with why; the last good version of each, if it
    /// had one, stays in `served`.
    refused: BTreeMap<Key, Vec<ConfigError>>,
    /// The list being gathered, between [`Change::Relist`] and [`Change::Listed`].
    relist: Option<(PodsElsewhere, BTreeMap<Key, Vec<ConfigError>>)>,
}

impl Elsewhere {
    /// Where a change goes: the list being gathered, else what is served.
    fn gathering(&mut self) -> (&mut PodsElsewhere, &mut BTreeMap<Key, Vec<ConfigError>>) {
        match &mut self.relist {
            Some((pods, refused)) => (pods, refused),
            None => (&mut self.served, &mut self.refused),
        }
    }

    /// Pods held, refused ones that never had a good version included (as a watch's objects).
    fn objects(&self) -> usize {
        let never_good = self
            .refused
            .keys()
            .filter(|(ns, name)| self.served.get(ns, name).is_none())
            .count();
        self.served.len() + never_good
    }
}

/// What changed in what is served, since [`Store::take_changes`] last said, sorted by what a
/// snapshot must build again for it (see `cluster::follow`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// What the workloads, or every service, may depend on: Namespaces, WorkloadEntries, the mesh
    /// config, or Pods listed again (not told one by one).
    pub others: bool,
    /// The namespaces of the Pods (of this node or another) added, changed or deleted.
    pub pods: std::collections::BTreeSet<String>,
    /// Services or EndpointSlices added, changed, deleted or listed again, or ServiceEntries listed
    /// again: services change, not told entry by entry.
    pub services: bool,
    /// The ServiceEntries added, changed or deleted one by one.
    pub entries: std::collections::BTreeSet<Key>,
}

impl Changes {
    pub fn any(&self) -> bool {
        self.others || !self.pods.is_empty() || self.services || !self.entries.is_empty()
    }

    /// Whether these changes leave every service as it was: only Pods changed, none in a
    /// namespace where a selector picks Pods (`selecting`). Then the snapshot's services can be
    /// kept and only its clients and workload addresses built again.
    pub fn only_pods(&self, selecting: &HashSet<&str>) -> bool {
        !self.others
            && !self.services
            && self.entries.is_empty()
            && !self.pods.iter().any(|ns| selecting.contains(ns.as_str()))
    }

    /// Whether no Pod, WorkloadEntry, Namespace or mesh config changed: the workloads stay as they
    /// were unless the namespaces where a selector picks Pods changed (the caller's to compare).
    pub fn keeps_workloads(&self) -> bool {
        !self.others && self.pods.is_empty()
    }

    /// The ServiceEntries changed, when nothing else did.
    pub fn only_entries(&self) -> Option<&std::collections::BTreeSet<Key>> {
        (self.keeps_workloads() && !self.services && !self.entries.is_empty())
            .then_some(&self.entries)
    }
}

/// One copy of each namespace name, label set and port set the Pods of other nodes have: a
/// Deployment's Pods all carry the same, and 100,000 Pods hold a few thousand of each.
#[derive(Debug, Default)]
struct Shared {
    namespaces: HashSet<Arc<str>>,
    labels: HashSet<Arc<Labels>>,
    ports: HashSet<Arc<BTreeMap<String, u16>>>,
    /// Pods taken in since the sets were last cleared of what nobody holds any more.
    since_pruned: usize,
}

/// Pods between two prunings of [`Shared`]: a pruning walks every set once.
const PRUNE_EVERY: usize = 16_384;

fn share<T: Eq + Hash + ?Sized>(set: &mut HashSet<Arc<T>>, value: &Arc<T>) -> Arc<T> {
    match set.get(&**value) {
        Some(held) => held.clone(),
        None => {
            set.insert(value.clone());
            value.clone()
        }
    }
}

impl Shared {
    fn pod(&mut self, pod: PodElsewhere) -> PodElsewhere {
        self.since_pruned += 1;
        if self.since_pruned >= PRUNE_EVERY {
            self.prune();
        }
        PodElsewhere {
            namespace: share(&mut self.namespaces, &pod.namespace),
            name: pod.name,
            ips: pod.ips,
            labels: share(&mut self.labels, &pod.labels),
            ports: share(&mut self.ports, &pod.ports),
        }
    }

    /// Forgets what only the sets still hold.
    fn prune(&mut self) {
        self.since_pruned = 0;
        self.namespaces.retain(|v| Arc::strong_count(v) > 1);
        self.labels.retain(|v| Arc::strong_count(v) > 1);
        self.ports.retain(|v| Arc::strong_count(v) > 1);
    }
}

impl Default for Store {
    /// The store of an agent without a node name.
    fn default() -> Self {
        Store::new(&Kind::ALL)
    }
}

impl Store {
    /// A store for these watches; it is ready once each has listed.
    pub fn new(watched: &[Kind]) -> Self {
        let kinds = watched
            .iter()
            .map(|&kind| {
                let status = WatchStatus {
                    kind: kind.label(),
                    installed: true,
                    ..WatchStatus::default()
                };
                (
                    kind,
                    Watched {
                        status,
                        ..Watched::default()
                    },
                )
            })
            .collect();
        Store {
            kinds,
            observed: BTreeMap::new(),
            observed_changes: 0,
            shared: Shared::default(),
            elsewhere: Elsewhere::default(),
            changes: Changes::default(),
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
                Named::Other(_) => changes.others = true,
            }
        }
        changed
    }

    /// What changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    fn take_in(&mut self, change: Change, now: &str) -> bool {
        let Some(w) = self.kinds.get_mut(&change.kind()) else {
            return false;
        };
        if change.kind() == Kind::PodElsewhere
            && !matches!(change, Change::Watching(..) | Change::Failed(..))
        {
            return take_in_elsewhere(&mut self.elsewhere, &mut self.shared, w, change, now);
        }
        match change {
            Change::Watching(_, api_version) => {
                w.status.api_version = Some(api_version);
                w.status.installed = true;
                false
            }
            Change::Relist(_) => {
                w.relist = Some(BTreeMap::new());
                false
            }
            Change::Upsert(_, key, converted) => {
                // The last good version: from the list being gathered, else from what is served.
                let previous = w
                    .relist
                    .as_ref()
                    .and_then(|r| r.get(&key))
                    .or_else(|| w.objects.get(&key))
                    .and_then(|s| s.good.clone());
                let Converted {
                    object,
                    errors,
                    observed,
                } = *converted;
                if let Some(observed) = observed
                    && self.observed.get(&key) != Some(&observed)
                {
                    self.observed.insert(key.clone(), observed);
                    self.observed_changes += 1;
                }
                let slot = match object {
                    Some(object) => Slot {
                        good: Some(object),
                        errors: Vec::new(),
                    },
                    None => Slot {
                        good: previous,
                        errors,
                    },
                };
                w.status.last_event_at = Some(now.to_string());
                match w.relist.as_mut() {
                    Some(relist) => {
                        relist.insert(key, slot);
                        false
                    }
                    None => w.objects.insert(key, slot.clone()) != Some(slot),
                }
            }
            Change::Deleted(kind, key) => {
                if kind == Kind::ServiceEntry && self.observed.remove(&key).is_some() {
                    self.observed_changes += 1;
                }
                w.status.last_event_at = Some(now.to_string());
                match w.relist.as_mut() {
                    Some(relist) => {
                        relist.remove(&key);
                        false
                    }
                    None => w.objects.remove(&key).is_some(),
                }
            }
            Change::Listed(kind) => {
                let listed = w.relist.take().unwrap_or_default();
                if kind == Kind::ServiceEntry {
                    let before = self.observed.len();
                    self.observed.retain(|key, _| listed.contains_key(key));
                    self.observed_changes += (before - self.observed.len()) as u64;
                }
                let changed = listed != w.objects || !w.status.synced;
                w.objects = listed;
                w.status.listed();
                changed
            }
            Change::NotInstalled(_) => {
                let changed = !w.objects.is_empty() || !w.status.synced;
                w.objects.clear();
                w.relist = None;
                w.status.not_installed();
                changed
            }
            Change::Failed(_, message) => {
                w.status.errors += 1;
                w.status.last_error = Some(message);
                w.status.last_error_at = Some(now.to_string());
                false
            }
        }
    }

    /// The namespaces where a selector picks Pods as endpoints: a ServiceEntry's
    /// `workloadSelector`, or a Service's selector while no EndpointSlice names the Service.
    pub fn selecting_namespaces(&self) -> HashSet<&str> {
        let objects = |kind: Kind| {
            self.kinds
                .get(&kind)
                .into_iter()
                .flat_map(|w| w.objects.values())
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
        self.kinds.get(&kind)?.status.api_version.as_deref()
    }

    /// Every watch has listed once (or found its kind not served): the model is whole.
    pub fn ready(&self) -> bool {
        self.kinds.values().all(|w| w.status.synced)
    }

    pub fn statuses(&self) -> Vec<WatchStatus> {
        self.kinds
            .iter()
            .map(|(kind, w)| WatchStatus {
                objects: match kind {
                    Kind::PodElsewhere => self.elsewhere.objects(),
                    _ => w.objects.len(),
                },
                ..w.status.clone()
            })
            .collect()
    }

    /// The model of everything in force, the errors of the objects refused, and one rejection per
    /// such object (its last good version in force where it had one).
    pub fn model(&self) -> (Model, Vec<ConfigError>, Vec<Rejected>) {
        let mut model = Model::default();
        let mut errors = Vec::new();
        let mut rejected = Vec::new();
        // A Pod seen by both Pod watches for a moment (bound to this node as the other watch
        // lets it go) is this node's.
        let here: HashSet<(&str, &str)> = self
            .kinds
            .get(&Kind::Pod)
            .filter(|_| self.kinds.contains_key(&Kind::PodElsewhere))
            .into_iter()
            .flat_map(|w| w.objects.keys())
            .map(|(ns, name)| (ns.as_str(), name.as_str()))
            .collect();
        let selecting = self.selecting_namespaces();
        for (kind, w) in &self.kinds {
            for ((namespace, name), slot) in &w.objects {
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
                    None => {}
                }
            }
        }
        self.model_elsewhere(&mut model, &mut errors, &mut rejected, &here, &selecting);
        config::complete(&mut model);
        (model, errors, rejected)
    }

    /// The Pods of other nodes into `model` (but those `here` holds): those a selector of their
    /// namespace can pick as workloads like any other, the rest shared whole, one pointer per
    /// namespace (a rebuild does not walk them).
    fn model_elsewhere(
        &self,
        model: &mut Model,
        errors: &mut Vec<ConfigError>,
        rejected: &mut Vec<Rejected>,
        here: &HashSet<(&str, &str)>,
        selecting: &HashSet<&str>,
    ) {
        let held = &self.elsewhere;
        let is_here = |namespace: &str, name: &str| here.contains(&(namespace, name));
        let mut here_by_namespace: HashMap<&str, HashSet<&str>> = HashMap::new();
        for (namespace, name) in here {
            here_by_namespace.entry(namespace).or_default().insert(name);
        }
        for ((namespace, name), refused) in &held.refused {
            if is_here(namespace, name) {
                continue;
            }
            errors.extend(refused.iter().cloned());
            rejected.push(Rejected {
                kind: Kind::PodElsewhere.name(),
                namespace: namespace.clone(),
                name: name.clone(),
                file: SOURCE.to_string(),
                last_good_in_force: held.served.get(namespace, name).is_some(),
            });
        }
        for namespace in selecting {
            for pod in held.served.in_namespace(namespace) {
                if !is_here(namespace, pod.name) {
                    model.workloads.push(Arc::new(pod.workload(SOURCE)));
                }
            }
        }
        model.pods_elsewhere = held.served.without(
            |namespace| selecting.contains(namespace),
            &here_by_namespace,
        );
    }
}

/// [`Store::take_in`] for the Pods of other nodes: the same rules, on [`Elsewhere`].
fn take_in_elsewhere(
    held: &mut Elsewhere,
    shared: &mut Shared,
    w: &mut Watched,
    change: Change,
    now: &str,
) -> bool {
    match change {
        Change::Relist(_) => {
            held.relist = Some(Default::default());
            false
        }
        Change::Upsert(_, key, converted) => {
            w.status.last_event_at = Some(now.to_string());
            let relisting = held.relist.is_some();
            let Converted { object, errors, .. } = *converted;
            let changed = match object {
                Some(Object::PodElsewhere(pod)) => {
                    let pod = shared.pod(Arc::unwrap_or_clone(pod));
                    let (pods, refused) = held.gathering();
                    let was_refused = refused.remove(&key).is_some();
                    let changed = pods.upsert(pod) | was_refused;
                    if !relisting {
                        pods.shrink_namespace(&key.0);
                    }
                    changed
                }
                _ => {
                    // Refused: the last good version stays (carried into a list being gathered).
                    let carried = match &held.relist {
                        Some((pods, _)) if pods.get(&key.0, &key.1).is_none() => {
                            held.served.get(&key.0, &key.1).map(PodRef::to_owned)
                        }
                        _ => None,
                    };
                    let (pods, refused) = held.gathering();
                    if let Some(good) = carried {
                        pods.upsert(good);
                    }
                    refused.insert(key, errors.clone()) != Some(errors)
                }
            };
            changed && !relisting
        }
        Change::Deleted(_, key) => {
            w.status.last_event_at = Some(now.to_string());
            let relisting = held.relist.is_some();
            let (pods, refused) = held.gathering();
            let was_refused = refused.remove(&key).is_some();
            let removed = pods.remove(&key.0, &key.1).is_some();
            (removed || was_refused) && !relisting
        }
        Change::Listed(_) => {
            let (mut pods, refused) = held.relist.take().unwrap_or_default();
            pods.shrink_to_fit();
            let changed = pods != held.served || refused != held.refused || !w.status.synced;
            held.served = pods;
            held.refused = refused;
            w.status.listed();
            changed
        }
        Change::NotInstalled(_) => {
            let changed = !held.served.is_empty() || !held.refused.is_empty() || !w.status.synced;
            *held = Elsewhere::default();
            w.status.not_installed();
            changed
        }
        Change::Watching(..) | Change::Failed(..) => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::cluster::kinds::convert;

    const NOW: &str = "2026-01-01T00:00:00Z";

    fn entry(name: &str, address: &str) -> (Key, Box<Converted>) {
        let object = json!({
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"hosts": [format!("{name}.example.com")], "addresses": [address]}
        });
        upsert(Kind::ServiceEntry, object)
    }

    fn upsert(kind: Kind, object: Value) -> (Key, Box<Converted>) {
        let key = (
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            object["metadata"]["name"].as_str().unwrap().to_string(),
        );
        (
            key,
            Box::new(convert(kind, "networking.istio.io/v1", object)),
        )
    }

    /// A store whose every watch has listed nothing.
    fn listed() -> Store {
        let mut store = Store::default();
        for kind in Kind::ALL {
            store.apply(Change::Relist(kind), NOW);
            store.apply(Change::Listed(kind), NOW);
        }
        store
    }

    fn hosts(store: &Store) -> Vec<String> {
        store
            .model()
            .0
            .service_entries
            .iter()
            .map(|s| s.hosts[0].to_string())
            .collect()
    }

    #[test]
    fn ready_only_once_every_watch_has_listed_or_is_not_installed() {
        let mut store = Store::default();
        assert!(!store.ready());
        for kind in Kind::ALL {
            assert!(!store.ready(), "{kind:?}");
            if kind == Kind::ServiceEntry {
                assert!(store.apply(Change::NotInstalled(kind), NOW));
            } else {
                store.apply(Change::Relist(kind), NOW);
                store.apply(Change::Listed(kind), NOW);
            }
        }
        assert!(store.ready());
        let se = &store.statuses()[3];
        assert_eq!(
            (se.kind, se.installed, se.synced),
            ("ServiceEntry", false, true)
        );
    }

    #[test]
    fn a_relist_is_served_only_once_complete_and_then_replaces_everything() {
        let mut store = listed();
        let (key, a) = entry("a", "203.0.113.1");
        assert!(store.apply(Change::Upsert(Kind::ServiceEntry, key, a), NOW));
        // The watch expired: a new list comes, without `a`, with `b`.
        store.apply(Change::Relist(Kind::ServiceEntry), NOW);
        let (key, b) = entry("b", "203.0.113.2");
        assert!(!store.apply(Change::Upsert(Kind::ServiceEntry, key, b), NOW));
        assert_eq!(hosts(&store), ["a.example.com"], "served until complete");
        assert!(store.apply(Change::Listed(Kind::ServiceEntry), NOW));
        assert_eq!(hosts(&store), ["b.example.com"]);
        // The same list again changes nothing.
        store.apply(Change::Relist(Kind::ServiceEntry), NOW);
        let (key, b) = entry("b", "203.0.113.2");
        store.apply(Change::Upsert(Kind::ServiceEntry, key, b), NOW);
        assert!(!store.apply(Change::Listed(Kind::ServiceEntry), NOW));
    }

    #[test]
    fn a_refused_update_keeps_the_last_good_version_and_reports_it() {
        let mut store = listed();
        let (key, good) = entry("a", "203.0.113.1");
        store.apply(Change::Upsert(Kind::ServiceEntry, key, good), NOW);
        let (key, bad) = entry("a", "203.0.113.0/33");
        assert!(bad.object.is_none());
        assert!(store.apply(Change::Upsert(Kind::ServiceEntry, key.clone(), bad), NOW));
        let (model, errors, rejected) = store.model();
        assert_eq!(model.service_entries.len(), 1);
        assert_eq!(
            model.service_entries[0].addresses[0].to_string(),
            "203.0.113.1"
        );
        assert_eq!(errors[0].field.as_deref(), Some("spec.addresses[0]"));
        assert_eq!(
            (rejected[0].kind, rejected[0].last_good_in_force),
            ("ServiceEntry", true)
        );
        // A new object that is invalid stays out; deleting the bad one clears its error.
        let (key2, bad2) = entry("c", "nope");
        store.apply(Change::Upsert(Kind::ServiceEntry, key2, bad2), NOW);
        let (model, _, rejected) = store.model();
        assert_eq!(model.service_entries.len(), 1);
        assert!(!rejected[1].last_good_in_force);
        assert!(store.apply(Change::Deleted(Kind::ServiceEntry, key), NOW));
        assert_eq!(store.model().2.len(), 1);
    }

    #[test]
    fn a_change_the_model_does_not_read_changes_nothing() {
        let mut store = listed();
        let pod = |phase: &str| {
            json!({
                "metadata": {"name": "p", "namespace": "team-a", "resourceVersion": phase},
                "spec": {"nodeName": "n"},
                "status": {"podIP": "10.0.0.1", "phase": phase}
            })
        };
        let (key, p) = upsert(Kind::Pod, pod("Pending"));
        assert!(store.apply(Change::Upsert(Kind::Pod, key, p), NOW));
        let (key, p) = upsert(Kind::Pod, pod("Running"));
        assert!(!store.apply(Change::Upsert(Kind::Pod, key, p), NOW));
    }

    #[test]
    fn a_pod_both_pod_watches_hold_for_a_moment_is_this_nodes() {
        let mut store = Store::new(&Kind::watched(true));
        for kind in Kind::watched(true) {
            store.apply(Change::Relist(kind), NOW);
            store.apply(Change::Listed(kind), NOW);
        }
        let labels: Vec<&str> = store.statuses().iter().map(|s| s.kind).collect();
        assert!(labels.contains(&"Pod (other nodes)"), "{labels:?}");
        let pod = |node: &str| {
            json!({
                "metadata": {"name": "p", "namespace": "team-a", "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1"},
                "spec": {"nodeName": node},
                "status": {"podIP": "10.0.0.1"}
            })
        };
        let key: Key = ("team-a".into(), "p".into());
        let there = Box::new(convert(Kind::PodElsewhere, "v1", pod("node-2")));
        store.apply(Change::Upsert(Kind::PodElsewhere, key.clone(), there), NOW);
        let model = store.model().0;
        assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 1));
        let here = Box::new(convert(Kind::Pod, "v1", pod("node-1")));
        store.apply(Change::Upsert(Kind::Pod, key, here), NOW);
        let model = store.model().0;
        assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (1, 0));
        assert_eq!(model.workloads[0].node_name.as_deref(), Some("node-1"));
    }

    #[test]
    fn a_pod_elsewhere_is_a_workload_only_while_a_selector_of_its_namespace_can_pick_it() {
        let mut store = Store::new(&Kind::watched(true));
        for kind in Kind::watched(true) {
            store.apply(Change::Relist(kind), NOW);
            store.apply(Change::Listed(kind), NOW);
        }
        for (i, ns) in ["team-a", "team-a", "team-b"].iter().enumerate() {
            let pod = json!({
                "metadata": {"name": format!("web-{i}"), "namespace": ns, "labels": {"app": "web"}},
                "spec": {"nodeName": "node-2"},
                "status": {"podIP": format!("10.0.0.{i}")}
            });
            let key: Key = (ns.to_string(), format!("web-{i}"));
            let converted = Box::new(convert(Kind::PodElsewhere, "v1", pod));
            store.apply(Change::Upsert(Kind::PodElsewhere, key, converted), NOW);
        }
        let model = store.model().0;
        assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 3));
        // One copy of the label set for the three pods.
        let pods: Vec<PodRef> = model.pods_elsewhere.iter().collect();
        assert!(Arc::ptr_eq(pods[0].labels, pods[2].labels));
        // A Service with a selector in team-a, without slices: team-a's pods are workloads.
        let service = json!({
            "metadata": {"name": "web", "namespace": "team-a"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}
        });
        let key: Key = ("team-a".into(), "web".into());
        let converted = Box::new(convert(Kind::Service, "v1", service));
        assert!(converted.errors.is_empty(), "{:?}", converted.errors);
        store.apply(Change::Upsert(Kind::Service, key, converted), NOW);
        let model = store.model().0;
        let names: Vec<&str> = model
            .workloads
            .iter()
            .map(|w| w.meta.name.as_str())
            .collect();
        assert_eq!(names, ["web-0", "web-1"]);
        assert_eq!(model.pods_elsewhere.len(), 1);
        // Its EndpointSlice says its endpoints: the selector picks nothing any more.
        let slice = json!({
            "metadata": {"name": "web-x", "namespace": "team-a", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.0"]}], "ports": [{"port": 80}]
        });
        let key: Key = ("team-a".into(), "web-x".into());
        let converted = Box::new(convert(Kind::EndpointSlice, "discovery.k8s.io/v1", slice));
        assert!(converted.errors.is_empty(), "{:?}", converted.errors);
        store.apply(Change::Upsert(Kind::EndpointSlice, key, converted), NOW);
        let model = store.model().0;
        assert_eq!((model.workloads.len(), model.pods_elsewhere.len()), (0, 3));
    }

    #[test]
    fn a_pod_elsewhere_keeps_its_last_good_version_and_a_relist_replaces_them_whole() {
        let mut store = Store::new(&Kind::watched(true));
        for kind in Kind::watched(true) {
            store.apply(Change::Relist(kind), NOW);
            store.apply(Change::Listed(kind), NOW);
        }
        let pod = |name: &str, ip: &str| {
            let object = json!({
                "metadata": {"name": name, "namespace": "team-a"},
                "spec": {"nodeName": "node-2"},
                "status": {"podIP": ip}
            });
            let key: Key = ("team-a".into(), name.into());
            Change::Upsert(
                Kind::PodElsewhere,
                key,
                Box::new(convert(Kind::PodElsewhere, "v1", object)),
            )
        };
        let ips = |store: &Store| -> Vec<String> {
            let model = store.model().0;
            model
                .pods_elsewhere
                .iter()
                .map(|p| format!("{}={}", p.name, p.ips[0]))
                .collect()
        };
        assert!(store.apply(pod("a", "10.0.0.1"), NOW));
        assert!(!store.apply(pod("a", "10.0.0.1"), NOW), "the same again");
        // A refused update: the last good version stays, the error is reported.
        assert!(store.apply(pod("a", "10.999.0.1"), NOW));
        assert!(store.apply(pod("b", "nope"), NOW));
        assert_eq!(ips(&store), ["a=10.0.0.1"]);
        let (_, errors, rejected) = store.model();
        assert_eq!(errors.len(), 2);
        let kept: Vec<(&str, bool)> = rejected
            .iter()
            .map(|r| (r.name.as_str(), r.last_good_in_force))
            .collect();
        assert_eq!(kept, [("a", true), ("b", false)]);
        let objects = |store: &Store| {
            let statuses = store.statuses();
            statuses
                .iter()
                .find(|s| s.kind == "Pod (other nodes)")
                .unwrap()
                .objects
        };
        assert_eq!(objects(&store), 2);
        // A relist: served only once complete; `a` still refused keeps its last good version.
        store.apply(Change::Relist(Kind::PodElsewhere), NOW);
        assert!(!store.apply(pod("a", "10.999.0.1"), NOW));
        assert!(!store.apply(pod("c", "10.0.0.3"), NOW));
        assert_eq!(ips(&store), ["a=10.0.0.1"], "served until complete");
        assert!(store.apply(Change::Listed(Kind::PodElsewhere), NOW));
        assert_eq!(ips(&store), ["a=10.0.0.1", "c=10.0.0.3"]);
        assert_eq!(store.model().2.len(), 1, "b is gone, a still refused");
        // Fixed, then deleted.
        assert!(store.apply(pod("a", "10.0.0.9"), NOW));
        assert!(store.model().2.is_empty());
        let key: Key = ("team-a".into(), "a".into());
        assert!(store.apply(Change::Deleted(Kind::PodElsewhere, key), NOW));
        assert_eq!(ips(&store), ["c=10.0.0.3"]);
        assert_eq!(objects(&store), 1);
    }

    #[test]
    fn failures_are_counted_and_a_good_list_clears_the_last_one() {
        let mut store = listed();
        store.apply(Change::Failed(Kind::Pod, "connection refused".into()), NOW);
        store.apply(Change::Failed(Kind::Pod, "connection refused".into()), NOW);
        let pod = store.statuses()[1].clone();
        assert_eq!(pod.kind, "Pod");
        assert_eq!(pod.errors, 2);
        assert_eq!(pod.last_error.as_deref(), Some("connection refused"));
        store.apply(Change::Relist(Kind::Pod), NOW);
        store.apply(Change::Listed(Kind::Pod), NOW);
        let pod = store.statuses()[1].clone();
        assert_eq!((pod.errors, pod.last_error), (2, None));
    }
}
