//! Who a connection or a DNS query comes from: one value, decided by one rule, for the proxy and the
//! DNS proxy. The registry gives the source address to a workload; where the kernel can tell which
//! cgroup the process runs in (every steered TCP connection, DNS over TCP included), that is held
//! against it. UDP queries carry no such word: the address alone decides.
use std::net::IpAddr;

use tracing::{debug, warn};
use uuid::Uuid;

use super::{CgroupPods, Check};
use crate::{
    config::{Workload, WorkloadKind},
    metrics::Metrics,
    state::Snapshot,
};

/// What the kernel said about the process behind a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum KernelView {
    /// Nothing: a UDP datagram, or a connection whose address no pod with a uid holds (the cgroup
    /// tree is then not read at all).
    #[default]
    Unknown,
    /// The cgroup the connecting process ran in, and the pod uid its path names (`None`: not a
    /// kubelet pod cgroup).
    Cgroup { id: u64, pod: Option<Uuid> },
}

impl KernelView {
    /// What the kernel says of `cgroup_id`, read only when it matters: when the registry gives
    /// `addr` to a pod with a uid. Without uids (a directory source), nothing is walked.
    pub(crate) async fn read(
        snapshot: &Snapshot,
        cgroups: &CgroupPods,
        addr: IpAddr,
        cgroup_id: u64,
    ) -> KernelView {
        let workload = snapshot.workload_by_ip(addr.to_canonical());
        KernelView::read_for(workload, cgroups, cgroup_id).await
    }

    /// [`KernelView::read`] for the workload the registry gives the address to.
    async fn read_for(
        workload: Option<&Workload>,
        cgroups: &CgroupPods,
        cgroup_id: u64,
    ) -> KernelView {
        if registry_pod(workload).is_none() {
            return KernelView::Unknown;
        }
        KernelView::Cgroup {
            id: cgroup_id,
            pod: cgroups.pod_uid(cgroup_id).await,
        }
    }
}

/// A client as the agent established it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client<'s> {
    pub addr: IpAddr,
    /// The workload the registry gives the address to.
    pub workload: Option<&'s Workload>,
    /// How the registry's word held against the kernel's.
    pub check: Check,
    cgroup: Option<u64>,
}

impl<'s> Client<'s> {
    /// The rule: the registry's workload for `addr`, trusted unless the kernel names another pod.
    pub(crate) fn identify(snapshot: &'s Snapshot, addr: IpAddr, kernel: KernelView) -> Client<'s> {
        let addr = addr.to_canonical();
        Client::of(addr, snapshot.workload_by_ip(addr), kernel)
    }

    /// The client of a steered connection from `addr`, whose process ran in cgroup `cgroup_id`:
    /// [`KernelView::read`] and [`Client::identify`] with one look-up of the address.
    pub(crate) async fn of_connection(
        snapshot: &'s Snapshot,
        cgroups: &CgroupPods,
        addr: IpAddr,
        cgroup_id: u64,
    ) -> Client<'s> {
        let addr = addr.to_canonical();
        let workload = snapshot.workload_by_ip(addr);
        let kernel = KernelView::read_for(workload, cgroups, cgroup_id).await;
        Client::of(addr, workload, kernel)
    }

    fn of(addr: IpAddr, workload: Option<&'s Workload>, kernel: KernelView) -> Client<'s> {
        let (check, cgroup) = match kernel {
            KernelView::Unknown => (Check::Unchecked, None),
            KernelView::Cgroup { id, pod } => {
                (Check::compare(registry_pod(workload), pod), Some(id))
            }
        };
        Client {
            addr,
            workload,
            check,
            cgroup,
        }
    }

    /// The namespace whose view the client gets; `None`: an unknown client (PUBLIC services only).
    pub(crate) fn namespace(&self) -> Option<&'s str> {
        self.workload
            .filter(|_| self.check.trusted())
            .map(|w| w.meta.namespace.as_str())
    }

    /// The workload the registry gives the address to, unless the kernel names another pod: whose
    /// workload identity the client may present.
    pub(crate) fn trusted_workload(&self) -> Option<&'s Workload> {
        self.workload.filter(|_| self.check.trusted())
    }

    /// `namespace/name` of the workload the registry gives the address to, trusted or not.
    pub(crate) fn workload_name(&self) -> Option<String> {
        self.workload
            .map(|w| format!("{}/{}", w.meta.namespace, w.meta.name))
    }

    /// Counts a mismatch, and warns the first time one is seen for the process's cgroup.
    pub(crate) fn report_mismatch(&self, cgroups: &CgroupPods, metrics: &Metrics, what: &str) {
        let (Check::Mismatch { registry, kernel }, Some(cgroup_id)) = (self.check, self.cgroup)
        else {
            return;
        };
        metrics.clients.identity_mismatch();
        if !cgroups.first_mismatch(cgroup_id) {
            debug!(client = %self.addr, registry_pod = %registry, kernel_pod = %kernel, cgroup_id, what, "client identity mismatch (warned before for this cgroup)");
            return;
        }
        warn!(
            client = %self.addr,
            registry_pod = %registry,
            kernel_pod = %kernel,
            cgroup_id,
            what,
            "the process is not in the cgroup of the pod that holds its address; serving it as an unknown client (PUBLIC services only)"
        );
    }
}

/// The pod uid the registry holds for a workload: only a Pod has a cgroup on this node (a
/// WorkloadEntry's uid names none).
fn registry_pod(workload: Option<&Workload>) -> Option<Uuid> {
    workload
        .filter(|w| w.kind == WorkloadKind::Pod)
        .and_then(|w| w.meta.uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_sources;

    const UID_A: &str = "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1";
    const UID_B: &str = "3f1c2a9e-7b4d-4c1a-9e2f-b2b2b2b2b2b2";

    fn snapshot() -> Snapshot {
        let yaml = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: web-1, namespace: team-a, uid: {UID_A}}}\nstatus: {{podIP: 10.244.1.20}}\n---\n\
             apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {{name: vm, namespace: team-b, uid: {UID_B}}}\nspec: {{address: 10.0.0.9}}\n"
        );
        match load_sources([("pods.yaml", yaml.as_str())]) {
            Ok(model) => Snapshot::from_model(&model),
            Err(e) => panic!("fixture does not load:\n{e}"),
        }
    }

    fn cgroup(pod: &str) -> KernelView {
        KernelView::Cgroup {
            id: 7,
            pod: Some(pod.parse().unwrap()),
        }
    }

    #[test]
    fn the_registry_names_the_namespace_unless_the_kernel_names_another_pod() {
        let s = snapshot();
        let pod: IpAddr = "10.244.1.20".parse().unwrap();
        let cases = [
            (
                "address only (UDP)",
                pod,
                KernelView::Unknown,
                Some("team-a"),
            ),
            ("the kernel agrees", pod, cgroup(UID_A), Some("team-a")),
            (
                "not a pod cgroup",
                pod,
                KernelView::Cgroup { id: 7, pod: None },
                Some("team-a"),
            ),
            ("another pod's cgroup", pod, cgroup(UID_B), None),
            (
                "v4-mapped address",
                "::ffff:10.244.1.20".parse().unwrap(),
                KernelView::Unknown,
                Some("team-a"),
            ),
            (
                "nobody's address",
                "10.9.9.9".parse().unwrap(),
                KernelView::Unknown,
                None,
            ),
            // A WorkloadEntry has no cgroup here: its uid is never held against the kernel's.
            (
                "a WorkloadEntry",
                "10.0.0.9".parse().unwrap(),
                cgroup(UID_A),
                Some("team-b"),
            ),
        ];
        for (name, addr, kernel, want) in cases {
            assert_eq!(
                Client::identify(&s, addr, kernel).namespace(),
                want,
                "{name}"
            );
        }
        let mismatch = Client::identify(&s, pod, cgroup(UID_B));
        assert_eq!(mismatch.workload_name().as_deref(), Some("team-a/web-1"));
        assert!(matches!(mismatch.check, Check::Mismatch { .. }));
    }
}
