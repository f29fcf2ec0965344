//! The Pods of other nodes, held apart and compactly: they are most of a big cluster. The same
//! rules as every other kind ([`super::relist`]), on groups shared by namespace.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use super::{Key, relist::Held};
use crate::{
    cluster::kinds::{Kind, SOURCE},
    config::{ConfigError, Model, PodElsewhere, PodRef, PodsElsewhere, Rejected},
};

#[derive(Debug, Default, PartialEq)]
pub(super) struct HeldElsewhere {
    pods: PodsElsewhere,
    /// The Pods whose latest version was refused, with why; the last good version of each, if it
    /// had one, stays in `pods`.
    refused: BTreeMap<Key, Vec<ConfigError>>,
}

impl Held for HeldElsewhere {
    type Good = PodElsewhere;

    fn good(&self, (namespace, name): &Key) -> Option<PodElsewhere> {
        self.pods.get(namespace, name).map(PodRef::to_owned)
    }

    fn put(&mut self, key: Key, good: Option<PodElsewhere>, errors: Vec<ConfigError>) -> bool {
        let upserted = good.is_some_and(|pod| self.pods.upsert(pod));
        if errors.is_empty() {
            self.refused.remove(&key).is_some() | upserted
        } else {
            (self.refused.insert(key, errors.clone()) != Some(errors)) | upserted
        }
    }

    fn remove(&mut self, key @ (namespace, name): &Key) -> bool {
        let was_refused = self.refused.remove(key).is_some();
        self.pods.remove(namespace, name).is_some() | was_refused
    }

    fn len(&self) -> usize {
        let never_good = self
            .refused
            .keys()
            .filter(|(ns, name)| self.pods.get(ns, name).is_none())
            .count();
        self.pods.len() + never_good
    }

    fn settle(&mut self, (namespace, _): &Key) {
        self.pods.shrink_namespace(namespace);
    }

    fn settle_all(&mut self) {
        self.pods.shrink_to_fit();
    }
}

impl HeldElsewhere {
    /// The Pods of other nodes into `model` (but those `here` holds): those a selector of their
    /// namespace can pick as workloads like any other, the rest shared whole, one pointer per
    /// namespace (a rebuild does not walk them).
    pub(super) fn add_to_model(
        &self,
        model: &mut Model,
        errors: &mut Vec<ConfigError>,
        rejected: &mut Vec<Rejected>,
        here: &HashSet<(&str, &str)>,
        selecting: &HashSet<&str>,
    ) {
        let is_here = |namespace: &str, name: &str| here.contains(&(namespace, name));
        let mut here_by_namespace: HashMap<&str, HashSet<&str>> = HashMap::new();
        for (namespace, name) in here {
            here_by_namespace.entry(namespace).or_default().insert(name);
        }
        for ((namespace, name), refused) in &self.refused {
            if is_here(namespace, name) {
                continue;
            }
            errors.extend(refused.iter().cloned());
            rejected.push(Rejected {
                kind: Kind::PodElsewhere.name(),
                namespace: namespace.clone(),
                name: name.clone(),
                file: SOURCE.to_string(),
                last_good_in_force: self.pods.get(namespace, name).is_some(),
            });
        }
        for namespace in selecting {
            for pod in self.pods.in_namespace(namespace) {
                if !is_here(namespace, pod.name) {
                    model.workloads.push(Arc::new(pod.workload(SOURCE)));
                }
            }
        }
        model.pods_elsewhere = self.pods.without(
            |namespace| selecting.contains(namespace),
            &here_by_namespace,
        );
    }
}
