//! The Pods of other nodes, as an agent given its node holds them: the bulk of a big cluster, so
//! held compactly and shared. They are grouped by namespace, each namespace's Pods one packed
//! [`PodGroup`] behind an `Arc`: the watch's store, every model built from it and every snapshot
//! share the groups, and a change copies only its own namespace's group (copy on write). A group
//! holds its Pods' names in one string and their addresses in one vector, so a Pod costs no
//! allocation of its own: at 100,000 Pods that is 200,000 small blocks fewer for the allocator to
//! keep, and no heap page pinned by one of them among the garbage of the first list.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    sync::Arc,
};

use super::{ObjectMeta, PodElsewhere, Workload, WorkloadKind, labels::Labels};

/// The Pods of other nodes, by namespace then name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodsElsewhere {
    namespaces: BTreeMap<Arc<str>, Arc<PodGroup>>,
    len: usize,
}

/// One Pod of a [`PodGroup`], borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodRef<'a> {
    pub namespace: &'a Arc<str>,
    pub name: &'a str,
    pub ips: &'a [IpAddr],
    pub labels: &'a Arc<Labels>,
    pub ports: &'a Arc<BTreeMap<String, u16>>,
    pub workload_name: Option<&'a Arc<str>>,
    pub never_enrolled: bool,
}

impl<'a> PodRef<'a> {
    /// What Istio's telemetry names its workload.
    pub fn workload_name(self) -> &'a str {
        self.workload_name.map_or(self.name, |w| w)
    }
}

impl PodRef<'_> {
    pub fn to_owned(self) -> PodElsewhere {
        PodElsewhere {
            namespace: self.namespace.clone(),
            name: self.name.into(),
            ips: self.ips.into(),
            labels: self.labels.clone(),
            ports: self.ports.clone(),
            workload_name: self.workload_name.cloned(),
            never_enrolled: self.never_enrolled,
        }
    }

    /// The Pod as a workload, for a selector to pick; `file` as its errors name the source.
    pub fn workload(self, file: &str) -> Workload {
        Workload {
            kind: WorkloadKind::Pod,
            meta: ObjectMeta {
                name: self.name.to_string(),
                namespace: self.namespace.to_string(),
                labels: (**self.labels).clone(),
                creation_timestamp: None,
                uid: None,
                file: file.to_string(),
            },
            ips: self.ips.to_vec(),
            node_name: None,
            service_account: None,
            ports: (**self.ports).clone(),
            other_address: None,
            workload_name: self.workload_name.cloned(),
            never_enrolled: self.never_enrolled,
        }
    }

    /// Whether this is `pod`, field for field.
    fn is(&self, pod: &PodElsewhere) -> bool {
        *self.name == *pod.name
            && *self.ips == *pod.ips
            && self.labels == &pod.labels
            && self.ports == &pod.ports
            && self.workload_name == pod.workload_name.as_ref()
            && self.never_enrolled == pod.never_enrolled
    }
}

impl PodElsewhere {
    pub fn borrowed(&self) -> PodRef<'_> {
        PodRef {
            namespace: &self.namespace,
            name: &self.name,
            ips: &self.ips,
            labels: &self.labels,
            ports: &self.ports,
            workload_name: self.workload_name.as_ref(),
            never_enrolled: self.never_enrolled,
        }
    }

    /// See [`PodRef::workload`].
    pub fn workload(&self, file: &str) -> Workload {
        self.borrowed().workload(file)
    }
}

/// One namespace's Pods, sorted by name: the names one after the other in one string, the
/// addresses in one vector, each Pod where its own end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGroup {
    namespace: Arc<str>,
    names: String,
    ips: Vec<IpAddr>,
    pods: Vec<Packed>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Packed {
    /// Where its name ends in `names` (it starts where the one before ends).
    name_end: u32,
    /// Where its addresses end in `ips`.
    ips_end: u32,
    labels: Arc<Labels>,
    ports: Arc<BTreeMap<String, u16>>,
    workload_name: Option<Arc<str>>,
    never_enrolled: bool,
}

impl PodGroup {
    fn new(namespace: Arc<str>) -> Self {
        PodGroup {
            namespace,
            names: String::new(),
            ips: Vec::new(),
            pods: Vec::new(),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Where the `i`th Pod's name and addresses start.
    fn starts(&self, i: usize) -> (usize, usize) {
        match i.checked_sub(1).map(|before| &self.pods[before]) {
            Some(p) => (p.name_end as usize, p.ips_end as usize),
            None => (0, 0),
        }
    }

    /// The `i`th Pod, by name.
    pub fn get(&self, i: usize) -> Option<PodRef<'_>> {
        let packed = self.pods.get(i)?;
        let (name, ips) = self.starts(i);
        Some(PodRef {
            namespace: &self.namespace,
            name: &self.names[name..packed.name_end as usize],
            ips: &self.ips[ips..packed.ips_end as usize],
            labels: &packed.labels,
            ports: &packed.ports,
            workload_name: packed.workload_name.as_ref(),
            never_enrolled: packed.never_enrolled,
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = PodRef<'_>> {
        (0..self.pods.len()).filter_map(|i| self.get(i))
    }

    /// Where the Pod of that name is, or would go.
    fn position(&self, name: &str) -> Result<usize, usize> {
        let (mut low, mut high) = (0, self.pods.len());
        while low < high {
            let mid = low + (high - low) / 2;
            let (start, _) = self.starts(mid);
            let held = &self.names[start..self.pods[mid].name_end as usize];
            match held.cmp(name) {
                std::cmp::Ordering::Less => low = mid + 1,
                std::cmp::Ordering::Greater => high = mid,
                std::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(low)
    }

    /// Puts `pod` in at `i`, the ends of the Pods after it moved along.
    fn insert(&mut self, i: usize, pod: PodRef<'_>) {
        let (name, ips) = self.starts(i);
        self.names.insert_str(name, pod.name);
        self.ips.splice(ips..ips, pod.ips.iter().copied());
        let (name_len, ips_len) = (pod.name.len() as u32, pod.ips.len() as u32);
        for after in &mut self.pods[i..] {
            after.name_end += name_len;
            after.ips_end += ips_len;
        }
        self.pods.insert(
            i,
            Packed {
                name_end: name as u32 + name_len,
                ips_end: ips as u32 + ips_len,
                labels: pod.labels.clone(),
                ports: pod.ports.clone(),
                workload_name: pod.workload_name.cloned(),
                never_enrolled: pod.never_enrolled,
            },
        );
    }

    /// Takes out the `i`th Pod, the ends of the Pods after it moved back.
    fn cut(&mut self, i: usize) {
        let (name, ips) = self.starts(i);
        let packed = self.pods.remove(i);
        let (name_end, ips_end) = (packed.name_end as usize, packed.ips_end as usize);
        self.names.replace_range(name..name_end, "");
        self.ips.drain(ips..ips_end);
        let (name_len, ips_len) = ((name_end - name) as u32, (ips_end - ips) as u32);
        for after in &mut self.pods[i..] {
            after.name_end -= name_len;
            after.ips_end -= ips_len;
        }
    }

    /// Gives back what growing left spare.
    fn shrink_to_fit(&mut self) {
        self.names.shrink_to_fit();
        self.ips.shrink_to_fit();
        self.pods.shrink_to_fit();
    }

    /// This group without the Pods `drop` names.
    fn without(&self, drop: &HashSet<&str>) -> PodGroup {
        let mut kept = PodGroup::new(self.namespace.clone());
        for pod in self.iter().filter(|p| !drop.contains(p.name)) {
            kept.insert(kept.len(), pod);
        }
        kept
    }
}

impl PodsElsewhere {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<PodRef<'_>> {
        let group = self.namespaces.get(namespace)?;
        group.get(group.position(name).ok()?)
    }

    /// Adds or replaces the Pod of that namespace and name. Returns whether anything changed.
    pub fn upsert(&mut self, pod: PodElsewhere) -> bool {
        let group = self
            .namespaces
            .entry(pod.namespace.clone())
            .or_insert_with(|| Arc::new(PodGroup::new(pod.namespace.clone())));
        match group.position(&pod.name) {
            Ok(i) if group.get(i).is_some_and(|held| held.is(&pod)) => false,
            Ok(i) => {
                let group = Arc::make_mut(group);
                group.cut(i);
                group.insert(i, pod.borrowed());
                true
            }
            Err(i) => {
                Arc::make_mut(group).insert(i, pod.borrowed());
                self.len += 1;
                true
            }
        }
    }

    /// Gives back what growing left spare, in the groups no one else shares: once a whole list is
    /// in (it grew them one Pod at a time). Growing exactly instead would copy a group at every
    /// Pod of a list.
    pub fn shrink_to_fit(&mut self) {
        for group in self.namespaces.values_mut() {
            if let Some(group) = Arc::get_mut(group) {
                group.shrink_to_fit();
            }
        }
    }

    /// [`PodsElsewhere::shrink_to_fit`] for one namespace: after a change (its group was copied,
    /// then grown).
    pub fn shrink_namespace(&mut self, namespace: &str) {
        if let Some(group) = self.namespaces.get_mut(namespace).and_then(Arc::get_mut) {
            group.shrink_to_fit();
        }
    }

    /// Removes the Pod of that namespace and name, if held.
    pub fn remove(&mut self, namespace: &str, name: &str) -> Option<PodElsewhere> {
        let group = self.namespaces.get_mut(namespace)?;
        let i = group.position(name).ok()?;
        let pod = group.get(i)?.to_owned();
        Arc::make_mut(group).cut(i);
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
    pub fn groups(&self) -> impl Iterator<Item = &Arc<PodGroup>> {
        self.namespaces.values()
    }

    /// The Pods of one namespace, by name.
    pub fn in_namespace(&self, namespace: &str) -> impl Iterator<Item = PodRef<'_>> {
        self.namespaces
            .get(namespace)
            .into_iter()
            .flat_map(|g| g.iter())
    }

    /// Every Pod, by namespace then name.
    pub fn iter(&self) -> impl Iterator<Item = PodRef<'_>> {
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
                Some(names) if group.iter().any(|p| names.contains(p.name)) => {
                    Arc::new(group.without(names))
                }
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
            workload_name: None,
            never_enrolled: false,
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

    /// Upserts and removes in any order leave the Pods a plain map of them holds, each read back
    /// whole (names and addresses of every length, none to several), and a group's layout depends
    /// only on what it holds.
    mod props {
        use std::collections::BTreeMap;

        use proptest::prelude::*;

        use super::*;

        #[derive(Debug, Clone)]
        enum Op {
            Upsert {
                ns: u8,
                name: String,
                ips: Vec<u8>,
                app: u8,
            },
            Remove {
                ns: u8,
                name: String,
            },
        }

        fn op() -> impl Strategy<Value = Op> {
            let name = "[a-d]{0,3}";
            prop_oneof![
                3 => (0u8..3, name, proptest::collection::vec(any::<u8>(), 0..3), 0u8..2)
                    .prop_map(|(ns, name, ips, app)| Op::Upsert { ns, name, ips, app }),
                1 => (0u8..3, name).prop_map(|(ns, name)| Op::Remove { ns, name }),
            ]
        }

        fn built(ns: u8, name: &str, ips: &[u8], app: u8) -> PodElsewhere {
            PodElsewhere {
                namespace: format!("ns-{ns}").into(),
                name: name.into(),
                ips: ips
                    .iter()
                    .map(|last| IpAddr::from([10, 0, ns, *last]))
                    .collect(),
                labels: Arc::new(Labels::from([("app".to_string(), app.to_string())])),
                ports: Arc::default(),
                workload_name: (app == 1).then(|| Arc::from("web")),
                never_enrolled: app == 2,
            }
        }

        proptest! {
            #[test]
            fn packed_groups_hold_what_a_map_holds(ops in proptest::collection::vec(op(), 0..40)) {
                let mut held = PodsElsewhere::default();
                let mut plain: BTreeMap<(String, String), PodElsewhere> = BTreeMap::new();
                for op in ops {
                    match op {
                        Op::Upsert { ns, name, ips, app } => {
                            let pod = built(ns, &name, &ips, app);
                            let key = (pod.namespace.to_string(), name);
                            let changed = plain.get(&key) != Some(&pod);
                            plain.insert(key, pod.clone());
                            prop_assert_eq!(held.upsert(pod), changed);
                        }
                        Op::Remove { ns, name } => {
                            let key = (format!("ns-{ns}"), name);
                            let removed = held.remove(&key.0, &key.1);
                            prop_assert_eq!(removed, plain.remove(&key));
                        }
                    }
                    let got: Vec<PodElsewhere> = held.iter().map(PodRef::to_owned).collect();
                    let want: Vec<PodElsewhere> = plain.values().cloned().collect();
                    prop_assert_eq!(&got, &want);
                    prop_assert_eq!(held.len(), plain.len());
                    for ((ns, name), pod) in &plain {
                        let read = held.get(ns, name).map(PodRef::to_owned);
                        prop_assert_eq!(read.as_ref(), Some(pod));
                    }
                }
                // The same Pods put in another order: the same groups, byte for byte.
                let again: PodsElsewhere = plain.values().rev().cloned().collect();
                prop_assert_eq!(&again, &held);
            }
        }
    }
}
