//! The workload store: pods and WorkloadEntries by IP, to name a connection's client namespace
//! and to reach a workload addressed directly. A pod of a namespace the control plane does not
//! discover is still a client (its namespace is known on the node), but no destination. Pods of
//! other nodes that no selector needs are destinations only.
use std::{collections::HashMap, net::IpAddr, sync::Arc};

use crate::{
    config::{PodGroup, PodsElsewhere, Workload},
    visibility::Discovery,
};

/// The workload a connection reaches directly, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadName<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
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
    elsewhere_by_ip: HashMap<IpAddr, (u32, u32)>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    first: u32,
    shared: bool,
    /// The first workload with this IP whose namespace is discovered: a destination.
    reachable: Option<u32>,
}

impl WorkloadStore {
    pub fn new(
        workloads: Vec<Arc<Workload>>,
        elsewhere: PodsElsewhere,
        discovery: &Discovery,
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
        let mut elsewhere_by_ip = HashMap::with_capacity(elsewhere.len());
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
                        elsewhere_by_ip.entry(ip).or_insert((g, i as u32));
                    }
                }
            }
            groups.push(group.clone());
        }
        WorkloadStore {
            workloads,
            by_ip,
            elsewhere: groups,
            elsewhere_by_ip,
        }
    }

    /// A discovered workload with this IP (any, when several share it): the connection goes to the
    /// same place.
    pub fn by_ip(&self, ip: IpAddr) -> Option<WorkloadName<'_>> {
        if let Some(i) = self.by_ip.get(&ip).and_then(|slot| slot.reachable) {
            let w = &self.workloads[i as usize];
            return Some(WorkloadName {
                namespace: &w.meta.namespace,
                name: &w.meta.name,
            });
        }
        let (group, i) = *self.elsewhere_by_ip.get(&ip)?;
        let pod = self.elsewhere[group as usize].get(i as usize)?;
        Some(WorkloadName {
            namespace: pod.namespace,
            name: pod.name,
        })
    }

    /// Every address a connection reaches a workload at.
    pub fn destinations(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.by_ip
            .iter()
            .filter(|(_, slot)| slot.reachable.is_some())
            .map(|(ip, _)| *ip)
            .chain(self.elsewhere_by_ip.keys().copied())
    }

    /// The client behind a peer IP. An IP several workloads share names no single namespace, so the
    /// client counts as unknown (PUBLIC services only) rather than borrowing another's namespace.
    pub fn client(&self, ip: IpAddr) -> Option<&Workload> {
        let slot = self.by_ip.get(&ip.to_canonical())?;
        (!slot.shared).then(|| &*self.workloads[slot.first as usize])
    }
}
