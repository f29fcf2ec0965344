//! Pods that opt out of capture with Istio's label `istio.io/dataplane-mode: none`: the programs leave
//! their processes alone, so they connect and resolve as if no agent ran. The cluster DNS needs this:
//! its own upstream queries must not come back to the agent, which forwards to the cluster DNS.
//!
//! The programs look the process's cgroup ancestry up in a map of opted-out pod cgroups; this keeps
//! that map equal to what the configuration says, every [`SYNC_EVERY`] and once before the agent is
//! ready.
use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use tracing::{info, warn};
use uuid::Uuid;

use crate::{
    config::DATAPLANE_MODE_LABEL, identity::CgroupPods, live::LiveState, redirect::RedirectMaps,
    state::Snapshot,
};

/// How soon a labelled pod (or a pod whose cgroup appeared) is left alone, and a relabelled one
/// captured again.
pub(super) const SYNC_EVERY: Duration = Duration::from_secs(1);

/// A pod that opted out, as the configuration names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OptedOut {
    pub uid: Uuid,
    /// `namespace/name`, for the log.
    pub pod: String,
}

/// The Pods of `snapshot` labelled `istio.io/dataplane-mode: none`. A Pod without `metadata.uid`
/// cannot be tied to its cgroup and is left out (the caller says so once).
pub(super) fn opted_out(snapshot: &Snapshot) -> (Vec<OptedOut>, Vec<String>) {
    let mut found = Vec::new();
    let mut without_uid = Vec::new();
    for w in snapshot.workloads() {
        if !w.opts_out_of_capture() {
            continue;
        }
        let pod = format!("{}/{}", w.meta.namespace, w.meta.name);
        match w.meta.uid {
            Some(uid) => found.push(OptedOut { uid, pod }),
            None => without_uid.push(pod),
        }
    }
    (found, without_uid)
}

/// Keeps the programs' map of opted-out pod cgroups in step with the configuration.
pub(super) struct OptOutSync {
    live: Arc<LiveState>,
    cgroups: Arc<CgroupPods>,
    maps: Arc<RedirectMaps>,
    /// Which pod each id in the map is, for the log when it leaves.
    named: HashMap<u64, String>,
    /// Pods already reported as impossible to find, so each is reported once.
    reported: BTreeSet<String>,
}

impl OptOutSync {
    pub(super) fn new(
        live: Arc<LiveState>,
        cgroups: Arc<CgroupPods>,
        maps: Arc<RedirectMaps>,
    ) -> Self {
        OptOutSync {
            live,
            cgroups,
            maps,
            named: HashMap::new(),
            reported: BTreeSet::new(),
        }
    }

    /// One pass: the map gets exactly the cgroups of the opted-out pods found on this node.
    pub(super) async fn sync(&mut self) {
        let snapshot = self.live.snapshot_arc();
        let (pods, without_uid) = opted_out(&snapshot);
        for pod in without_uid {
            if self.reported.insert(pod.clone()) {
                warn!(%pod, "pod is labelled {DATAPLANE_MODE_LABEL}=none but has no metadata.uid: its cgroup cannot be found, so it stays captured");
            }
        }
        let uids: Vec<Uuid> = pods.iter().map(|p| p.uid).collect();
        let found = if uids.is_empty() {
            HashMap::new()
        } else {
            self.cgroups.pod_cgroups(&uids).await
        };
        let want: BTreeSet<u64> = found.values().copied().collect();
        match self.maps.set_opted_out(&want) {
            Ok((added, removed)) => {
                for id in removed {
                    let pod = self.named.remove(&id).unwrap_or_default();
                    info!(%pod, cgroup_id = id, "pod captured again");
                }
                for id in added {
                    let pod = pods
                        .iter()
                        .find(|p| found.get(&p.uid) == Some(&id))
                        .map(|p| p.pod.clone())
                        .unwrap_or_default();
                    info!(%pod, cgroup_id = id, "pod opted out ({DATAPLANE_MODE_LABEL}=none): its connections and DNS are left alone");
                    self.named.insert(id, pod);
                }
            }
            Err(e) => warn!(error = %e, "updating the opted-out pods' map failed; retrying"),
        }
    }

    /// Syncs every [`SYNC_EVERY`] until `shutdown` changes.
    pub(super) async fn run(mut self, mut shutdown: crate::drain::Watcher) {
        let mut tick = tokio::time::interval(SYNC_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.stopped() => return,
                _ = tick.tick() => self.sync().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pods_labelled_none_with_a_uid_opt_out() {
        let yaml = r#"
apiVersion: v1
kind: Pod
metadata: {name: coredns-1, namespace: kube-system, uid: 6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b, labels: {istio.io/dataplane-mode: none}}
status: {podIP: 10.244.9.10}
---
apiVersion: v1
kind: Pod
metadata: {name: ambient, namespace: team-a, uid: 7b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b, labels: {istio.io/dataplane-mode: ambient}}
status: {podIP: 10.244.9.11}
---
apiVersion: v1
kind: Pod
metadata: {name: no-uid, namespace: team-a, labels: {istio.io/dataplane-mode: none}}
status: {podIP: 10.244.9.12}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm, namespace: team-a, uid: 8b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b, labels: {istio.io/dataplane-mode: none}}
spec: {address: 10.244.9.13}
"#;
        let model = crate::config::load_sources([("pods.yaml", yaml)]).expect("valid config");
        let snapshot = Snapshot::from_model(&model);
        let (found, without_uid) = opted_out(&snapshot);
        assert_eq!(
            found,
            [OptedOut {
                uid: Uuid::parse_str("6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b").unwrap(),
                pod: "kube-system/coredns-1".into()
            }]
        );
        assert_eq!(without_uid, ["team-a/no-uid"]);
    }
}
