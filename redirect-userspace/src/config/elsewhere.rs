//! The Pods of other nodes, as an agent given its node holds them: the bulk of a big cluster, so
//! held compactly and shared. They are grouped by namespace, each namespace's Pods one sorted
//! vector behind an `Arc`: the watch's store, every model built from it and every snapshot share
//! the groups, and a change copies only its own namespace's group (copy on write).
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use super::PodElsewhere;

/// The Pods of other nodes, by namespace then name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodsElsewhere {
    namespaces: BTreeMap<Arc<str>, Arc<Vec<PodElsewhere>>>,
    len: usize,
}

impl PodsElsewhere {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<&PodElsewhere> {
        let group = self.namespaces.get(namespace)?;
        let i = position(group, name).ok()?;
        Some(&group[i])
    }

    /// Adds or replaces the Pod of that namespace and name. Returns whether anything changed.
    pub fn upsert(&mut self, pod: PodElsewhere) -> bool {
        let group = self.namespaces.entry(pod.namespace.clone()).or_default();
        match position(group, &pod.name) {
            Ok(i) if group[i] == pod => false,
            Ok(i) => {
                Arc::make_mut(group)[i] = pod;
                true
            }
            Err(i) => {
                Arc::make_mut(group).insert(i, pod);
                self.len += 1;
                true
            }
        }
    }

    /// Removes the Pod of that namespace and name, if held.
    pub fn remove(&mut self, namespace: &str, name: &str) -> Option<PodElsewhere> {
        let group = self.namespaces.get_mut(namespace)?;
        let i = position(group, name).ok()?;
        let pod = Arc::make_mut(group).remove(i);
        if group.is_empty() {
            self.namespaces.remove(namespace);
        }
        self.len -= 1;
        Some(pod)
    }

    /// The namespaces holding at least one Pod, in order.
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.namespaces.keys().map(|ns| &**ns)
    }

    /// Each namespace's Pods, in namespace order (the groups themselves, to share).
    pub fn groups(&self) -> impl Iterator<Item = &Arc<Vec<PodElsewhere>>> {
        self.namespaces.values()
    }

    /// The Pods of one namespace, by name.
    pub fn in_namespace(&self, namespace: &str) -> &[PodElsewhere] {
        self.namespaces.get(namespace).map_or(&[], |g| g.as_slice())
    }

    /// Every Pod, by namespace then name.
    pub fn iter(&self) -> impl Iterator<Item = &PodElsewhere> {
        self.namespaces.values().flat_map(|g| g.iter())
    }

    /// These Pods without the namespaces `drop_namespace` names and without the Pods `drop_pods`
    /// names (namespace -> names); the groups left whole stay shared.
    pub fn without(
        &self,
        drop_namespace: impl Fn(&str) -> bool,
        drop_pods: &HashMap<&str, HashSet<&str>>,
    ) -> PodsElsewhere {
        let mut kept = PodsElsewhere::default();
        for (namespace, group) in &self.namespaces {
            if drop_namespace(namespace) {
                continue;
            }
            let group = match drop_pods.get(&**namespace) {
                Some(names) if group.iter().any(|p| names.contains(&*p.name)) => Arc::new(
                    group
                        .iter()
                        .filter(|p| !names.contains(&*p.name))
                        .cloned()
                        .collect(),
                ),
                _ => group.clone(),
            };
            if !group.is_empty() {
                kept.len += group.len();
                kept.namespaces.insert(namespace.clone(), group);
            }
        }
        kept
    }
}

fn position(group: &[PodElsewhere], name: &str) -> Result<usize, usize> {
    group.binary_search_by(|p| (*p.name).cmp(name))
}

impl FromIterator<PodElsewhere> for PodsElsewhere {
    fn from_iter<I: IntoIterator<Item = PodElsewhere>>(pods: I) -> Self {
        let mut held = PodsElsewhere::default();
        for pod in pods {
            held.upsert(pod);
        }
        held
    }
}

impl FromIterator<Arc<PodElsewhere>> for PodsElsewhere {
    fn from_iter<I: IntoIterator<Item = Arc<PodElsewhere>>>(pods: I) -> Self {
        pods.into_iter().map(Arc::unwrap_or_clone).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn pod(namespace: &str, name: &str, ip: &str) -> PodElsewhere {
        PodElsewhere {
            namespace: namespace.into(),
            name: name.into(),
            ips: [ip.parse::<IpAddr>().unwrap()].into(),
            labels: Arc::default(),
            ports: Arc::default(),
        }
    }

    fn names(held: &PodsElsewhere) -> Vec<String> {
        held.iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect()
    }

    #[test]
    fn pods_are_kept_by_namespace_then_name_and_counted() {
        let mut held = PodsElsewhere::default();
        assert!(held.upsert(pod("b", "y", "10.0.0.1")));
        assert!(held.upsert(pod("a", "z", "10.0.0.2")));
        assert!(held.upsert(pod("b", "x", "10.0.0.3")));
        assert!(!held.upsert(pod("b", "x", "10.0.0.3")), "the same again");
        assert!(held.upsert(pod("b", "x", "10.0.0.4")), "moved");
        assert_eq!(names(&held), ["a/z", "b/x", "b/y"]);
        assert_eq!(held.len(), 3);
        assert_eq!(held.get("b", "x").unwrap().ips[0].to_string(), "10.0.0.4");
        assert!(held.remove("a", "z").is_some());
        assert!(held.remove("a", "z").is_none());
        assert_eq!(held.namespaces().collect::<Vec<_>>(), ["b"]);
        assert_eq!(held.len(), 2);
    }

    #[test]
    fn a_change_copies_only_its_own_namespaces_group() {
        let mut held: PodsElsewhere = [pod("a", "p", "10.0.0.1"), pod("b", "q", "10.0.0.2")]
            .into_iter()
            .collect();
        let served = held.clone();
        held.upsert(pod("a", "p2", "10.0.0.3"));
        let groups = |h: &PodsElsewhere| h.groups().cloned().collect::<Vec<_>>();
        let (before, after) = (groups(&served), groups(&held));
        assert!(!Arc::ptr_eq(&before[0], &after[0]), "a changed");
        assert!(Arc::ptr_eq(&before[1], &after[1]), "b is shared");
        assert_eq!(
            names(&served),
            ["a/p", "b/q"],
            "what was served is unchanged"
        );
    }

    #[test]
    fn without_drops_namespaces_and_pods_and_shares_the_rest() {
        let held: PodsElsewhere = [
            pod("a", "p", "10.0.0.1"),
            pod("b", "q", "10.0.0.2"),
            pod("b", "r", "10.0.0.3"),
            pod("c", "s", "10.0.0.4"),
        ]
        .into_iter()
        .collect();
        let drop = HashMap::from([("b", HashSet::from(["q"]))]);
        let kept = held.without(|ns| ns == "a", &drop);
        assert_eq!(names(&kept), ["b/r", "c/s"]);
        assert_eq!(kept.len(), 2);
        let c = |h: &PodsElsewhere| h.groups().last().cloned().unwrap();
        assert!(Arc::ptr_eq(&c(&held), &c(&kept)));
    }
}
