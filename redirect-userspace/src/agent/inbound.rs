//! Inbound authorization in the kernel, kept in step with the snapshot in force
//! (`docs/authorization.md#in-the-kernel`): each snapshot's table put in force once, the program attached
//! in the namespace of every guarded Pod of the node (as soon as a process of the Pod shows it),
//! the kernel's counts joined to the authorization counters and each refusal it reports logged.
use std::{collections::HashSet, net::SocketAddr, sync::Arc, time::Duration};

use tracing::{info, warn};
use uuid::Uuid;

use crate::{
    authz::{InboundTable, Rule},
    identity::CgroupPods,
    live::LiveState,
    proxy::{Authorizer, AuthzPath},
    records::{Connections, Received},
    redirect::inbound::{InboundCounts, InboundEvents, InboundGate, Loaded, OriginMarker},
    state::Snapshot,
};

/// How often the kernel's counts and refusals are read, and Pods not attached yet tried again.
const EVERY: Duration = Duration::from_millis(200);

/// (refused, admitted) by rule index, as the kernel's counters last said.
type RuleCounts = Vec<(u64, u64)>;

/// The kernel's side of inbound authorization and what the agent keeps of it.
pub(super) struct KernelInbound {
    gate: InboundGate,
    counts: InboundCounts,
    events: InboundEvents,
    origin: OriginMarker,
    live: Arc<LiveState>,
    cgroups: Arc<CgroupPods>,
    connections: Arc<Connections>,
    authorizer: Arc<Authorizer>,
    /// The table in force and the rules' counts already counted under its labels.
    installed: Option<(Arc<InboundTable>, RuleCounts)>,
    /// Pods whose namespace could not be entered, said once each.
    unattached: HashSet<Uuid>,
}

impl KernelInbound {
    pub(super) fn new(
        loaded: Loaded,
        live: Arc<LiveState>,
        cgroups: Arc<CgroupPods>,
        connections: Arc<Connections>,
        authorizer: Arc<Authorizer>,
    ) -> Self {
        KernelInbound {
            gate: loaded.gate,
            counts: loaded.counts,
            events: loaded.events,
            origin: loaded.origin,
            live,
            cgroups,
            connections,
            authorizer,
            installed: None,
            unattached: HashSet::new(),
        }
    }

    /// Puts the snapshot in force's table in force and attaches where it can: called once before
    /// the agent serves, so the kernel decides from its first connection.
    pub(super) async fn sync(&mut self) {
        // The node's own connections are admitted before any Pod's check runs.
        if let Err(e) = self.origin.sync().await {
            warn!(error = %e, "listing the node's veths for node_origin failed");
        }
        let snapshot = self.live.snapshot_arc();
        self.install(&snapshot);
        self.attach(&snapshot);
    }

    /// Follows the snapshots in force until `shutdown`.
    pub(super) async fn run(mut self, mut shutdown: crate::drain::Watcher) {
        let mut applied = self.live.applied();
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = applied.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tick.tick() => {}
                () = shutdown.stopped() => return,
            }
            self.sync().await;
            self.count();
            self.log_refusals();
        }
    }

    /// Writes the snapshot's table to the kernel if it is not the one in force.
    fn install(&mut self, snapshot: &Snapshot) {
        let table = snapshot.authz().inbound();
        if let Some((held, _)) = &self.installed
            && Arc::ptr_eq(held, table)
        {
            return;
        }
        // The counts so far belong to the labels of the table they were made under.
        self.count();
        match self.gate.install(table.entries_exact()) {
            Ok(()) => {
                let counted = self.counts.read().rules;
                info!(
                    entries = table.len(),
                    pods = table.pods().len(),
                    left_out = table.left_out().len(),
                    "inbound authorization table in force in the kernel"
                );
                for pod in table.left_out() {
                    warn!(pod = %format!("{}/{}", pod.namespace, pod.name), "authorization policies of this Pod do not fit the kernel's table: only the proxy reaches it (same-node clients go through it; plaintext from elsewhere is refused)");
                }
                self.installed = Some((table.clone(), counted));
            }
            Err(e) => {
                // The table before stays in force; the next snapshot or tick tries again.
                warn!(error = %e, "writing the inbound authorization table to the kernel failed");
            }
        }
    }

    /// Attaches the program in every guarded Pod's namespace it is not in yet; detaches it from
    /// Pods gone or no longer guarded.
    fn attach(&mut self, snapshot: &Snapshot) {
        let authz = snapshot.authz();
        let mut keep = HashSet::new();
        for pod in authz.guarded_pods() {
            let Some(uid) = pod.uid else {
                continue;
            };
            keep.insert(uid);
            if self.gate.attached(&uid) {
                continue;
            }
            let name = format!("{}/{}", pod.namespace, pod.name);
            let attached = match self.cgroups.pod_netns(&uid) {
                Some(netns) => self.gate.attach(uid, &netns, &pod.ips),
                None => Err("no process of the Pod is visible in its cgroup yet".to_string()),
            };
            match attached {
                Ok(()) => {
                    self.unattached.remove(&uid);
                    info!(pod = %name, "inbound authorization attached in the Pod's network namespace");
                }
                Err(e) => {
                    if self.unattached.insert(uid) {
                        warn!(pod = %name, error = %e, "cannot attach inbound authorization in the Pod's network namespace yet (the agent needs the host's PID namespace); until then only connections through the proxy are decided for it");
                    }
                }
            }
        }
        self.unattached.retain(|uid| keep.contains(uid));
        self.gate.detach_others(&keep);
    }

    /// Adds what the kernel counted since the last read to the authorization counters.
    fn count(&mut self) {
        let totals = self.counts.read();
        let metrics = &self.authorizer.metrics;
        let (node, lost) = (
            metrics.node_admitted.get(),
            metrics.refusals_unreported.get(),
        );
        metrics
            .node_admitted
            .inc_by(totals.node_passed.saturating_sub(node));
        metrics
            .refusals_unreported
            .inc_by(totals.events_lost.saturating_sub(lost));
        let Some((table, counted)) = &mut self.installed else {
            return;
        };
        let now = totals.rules;
        for (rule, (&(denied, allowed), before)) in
            table.rules().iter().zip(now.iter().zip(counted.iter()))
        {
            let policy = policy_label(rule);
            let new_denied = denied.saturating_sub(before.0);
            let new_allowed = allowed.saturating_sub(before.1);
            if new_denied > 0 {
                metrics.count_n(AuthzPath::Kernel, "denied", policy.as_deref(), new_denied);
            }
            if new_allowed > 0 {
                metrics.count_n(AuthzPath::Kernel, "allowed", policy.as_deref(), new_allowed);
            }
        }
        *counted = now;
    }

    /// An access-log line for each refusal the kernel reported.
    fn log_refusals(&mut self) {
        let Some((table, _)) = &self.installed else {
            return;
        };
        let snapshot = self.live.snapshot_arc();
        for event in self.events.drain() {
            let src = SocketAddr::new(
                std::net::Ipv6Addr::from(event.src).to_canonical(),
                event.src_port,
            );
            let dst = SocketAddr::new(
                std::net::Ipv6Addr::from(event.dst).to_canonical(),
                event.dst_port,
            );
            let rule = (table.rules().get(usize::from(event.rule)))
                .map_or_else(|| "other".to_string(), Rule::to_string);
            let identity = snapshot
                .authz()
                .client_identity(src.ip())
                .map_or_else(|| "-".to_string(), |id| id.to_string());
            self.connections.received(&Received {
                src_identity: &identity,
                src,
                dst,
                bytes_in: 0,
                bytes_out: 0,
                duration: Duration::ZERO,
                end: "refused by authorization policy",
                authorization: &rule,
                decided_by: "kernel",
            });
        }
    }
}

/// The `policy` label of a rule's counts.
fn policy_label(rule: &Rule) -> Option<String> {
    match rule {
        Rule::Decided(verdict) => verdict.policy().map(str::to_string),
        Rule::KubeletProbe => Some("kubelet-probe".to_string()),
        Rule::LeftOut => Some("not-in-kernel-table".to_string()),
        Rule::Other => Some("other".to_string()),
    }
}
