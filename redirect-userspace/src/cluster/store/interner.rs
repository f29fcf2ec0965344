//! One copy of each namespace name, label set, port set and workload name the Pods of other nodes have: a
//! Deployment's Pods all carry the same, and 100,000 Pods hold a few thousand of each.
use std::{
    collections::{BTreeMap, HashSet},
    hash::Hash,
    sync::Arc,
};

use crate::config::{Labels, PodElsewhere};

#[derive(Debug, Default)]
pub(super) struct Interner {
    namespaces: HashSet<Arc<str>>,
    labels: HashSet<Arc<Labels>>,
    ports: HashSet<Arc<BTreeMap<String, u16>>>,
    workload_names: HashSet<Arc<str>>,
    /// Pods taken in since the sets were last cleared of what nobody holds any more.
    since_pruned: usize,
}

/// Pods between two prunings: a pruning walks every set once.
const PRUNE_EVERY: usize = 16_384;

/// The copy of `value` in `set`, which holds it from now on if it did not.
fn intern<T: Eq + Hash + ?Sized>(set: &mut HashSet<Arc<T>>, value: &Arc<T>) -> Arc<T> {
    match set.get(&**value) {
        Some(held) => held.clone(),
        None => {
            set.insert(value.clone());
            value.clone()
        }
    }
}

impl Interner {
    /// `pod`, holding the copies of its namespace, labels and ports every other Pod holds.
    pub(super) fn pod(&mut self, pod: PodElsewhere) -> PodElsewhere {
        self.since_pruned += 1;
        if self.since_pruned >= PRUNE_EVERY {
            self.prune();
        }
        PodElsewhere {
            namespace: intern(&mut self.namespaces, &pod.namespace),
            name: pod.name,
            ips: pod.ips,
            labels: intern(&mut self.labels, &pod.labels),
            ports: intern(&mut self.ports, &pod.ports),
            workload_name: (pod.workload_name).map(|name| intern(&mut self.workload_names, &name)),
            never_enrolled: pod.never_enrolled,
        }
    }

    /// Forgets what only the sets still hold.
    fn prune(&mut self) {
        self.since_pruned = 0;
        self.namespaces.retain(|v| Arc::strong_count(v) > 1);
        self.labels.retain(|v| Arc::strong_count(v) > 1);
        self.ports.retain(|v| Arc::strong_count(v) > 1);
        self.workload_names.retain(|v| Arc::strong_count(v) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodElsewhere {
        PodElsewhere {
            namespace: Arc::from("team-a"),
            name: name.into(),
            ips: Box::new([]),
            labels: Arc::new(Labels::from([("app".to_string(), "web".to_string())])),
            ports: Arc::new(BTreeMap::new()),
            workload_name: Some(Arc::from("web")),
            never_enrolled: false,
        }
    }

    #[test]
    fn pods_alike_hold_one_copy_and_a_pruning_forgets_what_nobody_holds() {
        let mut interner = Interner::default();
        let a = interner.pod(pod("a"));
        let b = interner.pod(pod("b"));
        assert!(Arc::ptr_eq(&a.labels, &b.labels));
        assert!(Arc::ptr_eq(&a.namespace, &b.namespace));
        assert!(Arc::ptr_eq(
            a.workload_name.as_ref().unwrap(),
            b.workload_name.as_ref().unwrap()
        ));
        drop((a, b));
        interner.prune();
        assert!(interner.labels.is_empty() && interner.namespaces.is_empty());
    }
}
