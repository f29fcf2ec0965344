//! The workload store: pods and WorkloadEntries by IP, to name a connection's client namespace
//! and to reach a workload addressed directly. A pod of a namespace the control plane does not
//! discover is still a client (its namespace is known on the node), but no destination. Pods of
//! other nodes that no selector needs are destinations only.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use crate::{
    config::{
        DATAPLANE_AMBIENT, DATAPLANE_MODE_LABEL, Labels, Namespace, PodGroup, PodsElsewhere,
        Workload, WorkloadKind, enrolled,
    },
    visibility::Discovery,
};

/// The workload a connection reaches directly, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadName<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
}

/// A workload as Istio's telemetry names it: its namespace, workload name (a Deployment's Pods by
/// the Deployment's), labels and service account (unknown for another node's Pod).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TelemetryName<'a> {
    pub namespace: &'a str,
    pub workload: &'a str,
    pub labels: &'a Labels,
    pub service_account: Option<&'a str>,
}

impl<'a> TelemetryName<'a> {
    pub(crate) fn of(w: &'a Workload) -> Self {
        TelemetryName {
            namespace: &w.meta.namespace,
            workload: w.workload_name(),
            labels: &w.meta.labels,
            // A WorkloadEntry without an account has the namespace's `default`, as upstream says.
            service_account: match w.kind {
                WorkloadKind::Pod => w.service_account.as_deref(),
                WorkloadKind::WorkloadEntry => {
                    Some(w.service_account.as_deref().unwrap_or("default"))
                }
            },
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct WorkloadStore {
    /// Shared with the model they were built from.
    pub workloads: Vec<Arc<Workload>>,
    /// Every workload IP -> the first workload (kind, namespace/name order) with it, and whether
    /// another workload shares it (host-network pods do).
    by_ip: HashMap<IpAddr, Slot>,
    /// The Pods elsewhere of each discovered namespace, the groups shared with the model.
    elsewhere: Vec<Arc<PodGroup>>,
    /// The address of each Pod elsewhere in a discovered namespace that no workload has: its
    /// group in `elsewhere`, and its place there.
    elsewhere_by_ip: ByAddress,
    /// With HBONE between nodes, the node this agent serves.
    hbone_node: Option<Arc<str>>,
    /// The namespaces labelled `istio.io/dataplane-mode: ambient`: their Pods are in the mesh.
    ambient_namespaces: HashSet<Arc<str>>,
}

/// Where a Pod elsewhere is: its group in [`WorkloadStore::elsewhere`], its place there.
type Place = (u32, u32);

/// Addresses to places, sorted and searched by halves: at 100,000 Pods a hash map would hold a
/// whole `IpAddr` per entry and a third more for its spare buckets (3.6 MiB against 1.2).
#[derive(Debug, Default)]
struct ByAddress {
    v4: Vec<(u32, Place)>,
    v6: Vec<(u128, Place)>,
    /// The addresses given more than once (a node's, which its hostNetwork Pods all have),
    /// sorted.
    shared_v4: Vec<u32>,
    shared_v6: Vec<u128>,
}

/// Sorts `held` by address and keeps the first place given for each (the sort is stable); returns
/// the addresses given more than once, sorted.
fn sort_keeping_first<K: Ord + Copy>(held: &mut Vec<(K, Place)>) -> Vec<K> {
    held.sort_by_key(|(ip, _)| *ip);
    let mut shared: Vec<K> = held
        .windows(2)
        .filter(|pair| pair[0].0 == pair[1].0)
        .map(|pair| pair[0].0)
        .collect();
    shared.dedup();
    held.dedup_by_key(|(ip, _)| *ip);
    shared
}

impl ByAddress {
    /// The first place given for each address, of `places` in their order.
    fn new(places: impl Iterator<Item = (IpAddr, Place)>) -> Self {
        let mut by = ByAddress::default();
        for (ip, place) in places {
            match ip {
                IpAddr::V4(v4) => by.v4.push((v4.to_bits(), place)),
                IpAddr::V6(v6) => by.v6.push((v6.to_bits(), place)),
            }
        }
        by.shared_v4 = sort_keeping_first(&mut by.v4);
        by.shared_v6 = sort_keeping_first(&mut by.v6);
        by.v4.shrink_to_fit();
        by.v6.shrink_to_fit();
        by
    }

    fn get(&self, ip: IpAddr) -> Option<Place> {
        fn find<K: Ord + Copy>(held: &[(K, Place)], key: K) -> Option<Place> {
            let i = held.binary_search_by_key(&key, |(k, _)| *k).ok()?;
            Some(held[i].1)
        }
        match ip {
            IpAddr::V4(v4) => find(&self.v4, v4.to_bits()),
            IpAddr::V6(v6) => find(&self.v6, v6.to_bits()),
        }
    }

    /// Whether `ip` was given more than once.
    fn is_shared(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => self.shared_v4.binary_search(&v4.to_bits()).is_ok(),
            IpAddr::V6(v6) => self.shared_v6.binary_search(&v6.to_bits()).is_ok(),
        }
    }

    fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let v4 = self
            .v4
            .iter()
            .map(|(ip, _)| IpAddr::from(Ipv4Addr::from_bits(*ip)));
        let v6 = self
            .v6
            .iter()
            .map(|(ip, _)| IpAddr::from(Ipv6Addr::from_bits(*ip)));
        v4.chain(v6)
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    first: u32,
    shared: bool,
    /// The first workload with this IP whose namespace is discovered: a destination.
    reachable: Option<u32>,
}

impl WorkloadStore {
    pub(super) fn new(
        workloads: Vec<Arc<Workload>>,
        elsewhere: PodsElsewhere,
        discovery: &Discovery,
        namespaces: &BTreeMap<String, Namespace>,
        hbone_node: Option<&str>,
    ) -> Self {
        // Sized once: a model of 10,000 pods is not rehashed on the way.
        let mut by_ip: HashMap<IpAddr, Slot> = HashMap::with_capacity(workloads.len());
        for (i, w) in workloads.iter().enumerate() {
            let reachable = discovery.sees(&w.meta.namespace).then_some(i as u32);
            for ip in &w.ips {
                by_ip
                    .entry(ip.to_canonical())
                    .and_modify(|slot| {
                        slot.shared = true;
                        slot.reachable = slot.reachable.or(reachable);
                    })
                    .or_insert(Slot {
                        first: i as u32,
                        shared: false,
                        reachable,
                    });
            }
        }
        let mut places = Vec::with_capacity(elsewhere.len());
        let mut groups = Vec::new();
        for group in elsewhere.groups() {
            if !discovery.sees(group.namespace()) {
                continue;
            }
            let g = groups.len() as u32;
            for (i, pod) in group.iter().enumerate() {
                for ip in pod.ips {
                    let ip = ip.to_canonical();
                    if by_ip.get(&ip).is_none_or(|s| s.reachable.is_none()) {
                        places.push((ip, (g, i as u32)));
                    }
                }
            }
            groups.push(group.clone());
        }
        WorkloadStore {
            workloads,
            by_ip,
            elsewhere: groups,
            elsewhere_by_ip: ByAddress::new(places.into_iter()),
            hbone_node: hbone_node.map(Arc::from),
            ambient_namespaces: (namespaces.values())
                .filter(|ns| {
                    ns.labels.get(DATAPLANE_MODE_LABEL).map(String::as_str)
                        == Some(DATAPLANE_AMBIENT)
                })
                .map(|ns| Arc::from(ns.name.as_str()))
                .collect(),
        }
    }

    pub(super) fn hbone_between_nodes(&self) -> bool {
        self.hbone_node.is_some()
    }

    /// Whether `w` is a Pod in the ambient mesh (`config::enrolled`).
    pub(super) fn enrolled(&self, w: &Workload) -> bool {
        let ambient = self.ambient_namespaces.contains(w.meta.namespace.as_str());
        w.kind == WorkloadKind::Pod && enrolled(&w.meta.labels, w.never_enrolled, ambient)
    }

    /// With HBONE between nodes, the namespace of the Pod of another node a connection to `ip`
    /// reaches, which that node's data plane receives over HBONE: a Pod in the mesh. Any other
    /// (not enrolled, opted out, with a sidecar) is reached directly, as is everything else.
    pub(super) fn hbone_peer(&self, ip: IpAddr) -> Option<&str> {
        let (namespace, enrolled) = self.other_nodes_pod(ip)?;
        enrolled.then_some(namespace)
    }

    /// With HBONE between nodes, the namespace of the Pod of another node at address `ip` (not a
    /// node's own address), and whether it is in the mesh.
    pub(super) fn other_nodes_pod(&self, ip: IpAddr) -> Option<(&str, bool)> {
        let node = self.hbone_node.as_deref()?;
        // An address several Pods have is a node's (its hostNetwork Pods'): no Pod's data plane
        // stands there. (A node's single hostNetwork Pod is told apart by `hostNetwork` itself: it
        // is never in the mesh.)
        let slot = self.by_ip.get(&ip);
        if slot.is_some_and(|slot| slot.shared) || self.elsewhere_by_ip.is_shared(ip) {
            return None;
        }
        if let Some(i) = slot.and_then(|slot| slot.reachable) {
            let w = &self.workloads[i as usize];
            // Another node's, by name; or held without an identity, as an API source holds the
            // other nodes' Pods a selector picks.
            let elsewhere = match w.node_name.as_deref() {
                Some(at) => at != node,
                None => w.service_account.is_none(),
            };
            let namespace = w.meta.namespace.as_str();
            return (elsewhere && w.kind == WorkloadKind::Pod)
                .then(|| (namespace, self.enrolled(w)));
        }
        let (group, i) = self.elsewhere_by_ip.get(ip)?;
        let pod = self.elsewhere[group as usize].get(i as usize)?;
        let ambient = self.ambient_namespaces.contains(&**pod.namespace);
        let enrolled = enrolled(pod.labels, pod.never_enrolled, ambient);
        Some((&**pod.namespace, enrolled))
    }

    /// The Pod of this node at `ip` whose identity the agent presents to HBONE peers: one with a
    /// service account, on the HBONE node (or on no node named, as a directory may give it), that
    /// does not opt out of capture. An opted-out Pod keeps its own port 15008: an Istio waypoint
    /// (Envoy, opted out) receives HBONE there itself.
    pub(super) fn local_pod(&self, ip: IpAddr) -> Option<&Workload> {
        let w = self.client(ip)?;
        self.is_local_pod(w).then_some(w)
    }

    /// The [`WorkloadStore::local_pod`]s in discovered namespaces: the mesh's destinations on this
    /// node (a Pod of a namespace the control plane does not see has no policy either).
    pub(super) fn local_pods(&self) -> impl Iterator<Item = &Workload> + Clone + '_ {
        let discovered = |w: &Workload| {
            (w.ips.iter()).any(|ip| {
                (self.by_ip.get(&ip.to_canonical())).is_some_and(|slot| slot.reachable.is_some())
            })
        };
        (self.workloads.iter())
            .filter(move |w| self.is_local_pod(w) && discovered(w))
            .map(|w| &**w)
    }

    /// The addresses of [`WorkloadStore::local_pod`]s.
    pub(super) fn local_pod_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.workloads
            .iter()
            .filter(|w| self.is_local_pod(w))
            .flat_map(|w| w.ips.iter().map(|ip| ip.to_canonical()))
    }

    fn is_local_pod(&self, w: &Workload) -> bool {
        let here = match (w.node_name.as_deref(), self.hbone_node.as_deref()) {
            (Some(at), Some(node)) => at == node,
            _ => true,
        };
        w.kind == WorkloadKind::Pod
            && w.service_account.is_some()
            && here
            && !w.opts_out_of_capture()
    }

    /// A discovered workload with this IP (any, when several share it): the connection goes to the
    /// same place.
    pub(super) fn by_ip(&self, ip: IpAddr) -> Option<WorkloadName<'_>> {
        if let Some(i) = self.by_ip.get(&ip).and_then(|slot| slot.reachable) {
            let w = &self.workloads[i as usize];
            return Some(WorkloadName {
                namespace: &w.meta.namespace,
                name: &w.meta.name,
            });
        }
        let (group, i) = self.elsewhere_by_ip.get(ip)?;
        let pod = self.elsewhere[group as usize].get(i as usize)?;
        Some(WorkloadName {
            namespace: pod.namespace,
            name: pod.name,
        })
    }

    /// Every address a connection reaches a workload at.
    pub(super) fn destinations(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.by_ip
            .iter()
            .filter(|(_, slot)| slot.reachable.is_some())
            .map(|(ip, _)| *ip)
            .chain(self.elsewhere_by_ip.addresses())
    }

    /// The one workload at `ip`, of this node or another, in any namespace, as telemetry names
    /// it; `None` for an address several workloads share (a node's) or none has.
    pub(super) fn telemetry_at(&self, ip: IpAddr) -> Option<TelemetryName<'_>> {
        if let Some(slot) = self.by_ip.get(&ip) {
            return (!slot.shared).then(|| TelemetryName::of(&self.workloads[slot.first as usize]));
        }
        if self.elsewhere_by_ip.is_shared(ip) {
            return None;
        }
        let (group, i) = self.elsewhere_by_ip.get(ip)?;
        let pod = self.elsewhere[group as usize].get(i as usize)?;
        Some(TelemetryName {
            namespace: pod.namespace,
            workload: pod.workload_name(),
            labels: pod.labels,
            service_account: None,
        })
    }

    /// The client behind a peer IP. An IP several workloads share names no single namespace, so the
    /// client counts as unknown (PUBLIC services only) rather than borrowing another's namespace.
    pub(super) fn client(&self, ip: IpAddr) -> Option<&Workload> {
        let slot = self.by_ip.get(&ip.to_canonical())?;
        (!slot.shared).then(|| &*self.workloads[slot.first as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_address_finds_the_first_place_given_for_it_in_either_family() {
        let by = ByAddress::new(
            [
                (ip("10.0.0.2"), (0, 0)),
                (ip("fd00::1"), (0, 1)),
                (ip("10.0.0.1"), (1, 0)),
                (ip("10.0.0.2"), (2, 0)),
                (ip("fd00::1"), (2, 1)),
            ]
            .into_iter(),
        );
        assert_eq!(by.get(ip("10.0.0.2")), Some((0, 0)), "the first given");
        assert_eq!(by.get(ip("10.0.0.1")), Some((1, 0)));
        assert_eq!(by.get(ip("fd00::1")), Some((0, 1)));
        assert_eq!(by.get(ip("10.0.0.3")), None);
        assert_eq!(by.get(ip("fd00::2")), None);
        let mut all: Vec<IpAddr> = by.addresses().collect();
        all.sort();
        assert_eq!(all, [ip("10.0.0.1"), ip("10.0.0.2"), ip("fd00::1")]);
    }
}
