//! Inbound authorization in the kernel, kept in step with the snapshot in force
//! (`docs/authorization.md#in-the-kernel`): each snapshot's table put in force as the snapshot is
//! applied (before the fast path acts on it), the check attached in the namespace of every Pod of
//! the node (as soon as a process of the Pod shows it, so a policy that comes later needs only its
//! table), the kernel's counts joined to the authorization counters and each refusal it reports
//! logged.
use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::{info, warn};
use uuid::Uuid;

use crate::{
    authz::{InboundTable, Rule},
    identity::CgroupPods,
    live::LiveState,
    lock::Locked,
    proxy::{Authorizer, AuthzPath},
    records::{Connections, Event, Received, ends},
    redirect::inbound::{InboundCounts, InboundEvents, InboundGate, Loaded, OriginMarker},
    state::Snapshot,
};

/// How often the kernel's counts and refusals are read, and Pods not attached yet tried again.
const EVERY: Duration = Duration::from_millis(200);

/// (refused, admitted) by rule index, as the kernel's counters last said.
type RuleCounts = Vec<(u64, u64)>;

/// The kernel's side of inbound authorization and what the agent keeps of it.
pub(super) struct KernelInbound {
    /// Shared with the hook that installs each snapshot's table as it is applied.
    kernel: Arc<Mutex<Kernel>>,
    events: InboundEvents,
    origin: OriginMarker,
    live: Arc<LiveState>,
    cgroups: Arc<CgroupPods>,
    connections: Arc<Connections>,
    /// Pods whose namespace could not be entered, said once each.
    unattached: HashSet<Uuid>,
}

/// The table and links in force, and the counters read from them.
struct Kernel {
    gate: InboundGate,
    counts: InboundCounts,
    authorizer: Arc<Authorizer>,
    /// The table in force and the rules' counts already counted under its labels.
    installed: Option<(Arc<InboundTable>, RuleCounts)>,
}

impl KernelInbound {
    /// Takes the loaded program and maps; from now on every snapshot applied puts its table in
    /// force before the fast path acts on it.
    pub(super) fn new(
        loaded: Loaded,
        live: Arc<LiveState>,
        cgroups: Arc<CgroupPods>,
        connections: Arc<Connections>,
        authorizer: Arc<Authorizer>,
    ) -> Self {
        let kernel = Arc::new(Mutex::new(Kernel {
            gate: loaded.gate,
            counts: loaded.counts,
            authorizer,
            installed: None,
        }));
        let hook = Arc::downgrade(&kernel);
        live.on_apply_first(move |snapshot| {
            if let Some(kernel) = hook.upgrade() {
                kernel.locked().install(snapshot);
            }
        });
        KernelInbound {
            kernel,
            events: loaded.events,
            origin: loaded.origin,
            live,
            cgroups,
            connections,
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
        self.kernel.locked().install(&snapshot);
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
            self.kernel.locked().count();
            self.log_refusals();
        }
    }

    /// Attaches the program in the namespace of every Pod of the node it is not in yet (each
    /// Pod's, guarded or not: a policy that comes later then needs only its table); detaches it
    /// from Pods gone.
    fn attach(&mut self, snapshot: &Snapshot) {
        let mut kernel = self.kernel.locked();
        let mut keep = HashSet::new();
        for pod in snapshot.local_pods() {
            let Some(uid) = pod.meta.uid else {
                continue;
            };
            keep.insert(uid);
            if kernel.gate.attached(&uid) {
                continue;
            }
            let name = format!("{}/{}", pod.meta.namespace, pod.meta.name);
            let attached = match self.cgroups.pod_netns(&uid) {
                // A hostNetwork Pod's namespace is the node's: checked there, every connection
                // to the node would be (and upstream never enrolls such a Pod).
                Some(netns) if is_own_netns(&netns) => {
                    if self.unattached.insert(uid) {
                        info!(pod = %name, "no inbound authorization in the kernel for a Pod in the node's network namespace (hostNetwork)");
                    }
                    continue;
                }
                Some(netns) => kernel.gate.attach(uid, &netns, &pod.ips),
                None => Err("no process of the Pod is visible in its cgroup yet".to_string()),
            };
            match attached {
                Ok(()) => {
                    self.unattached.remove(&uid);
                    info!(pod = %name, "inbound authorization attached in the Pod's network namespace");
                }
                Err(e) => {
                    if self.unattached.insert(uid) {
                        warn!(pod = %name, error = %e, "cannot attach inbound authorization in the Pod's network namespace yet (the agent needs the host's PID namespace, and CAP_SYS_PTRACE for a Pod not running as root); until then only connections through the proxy are decided for it");
                    }
                }
            }
        }
        self.unattached.retain(|uid| keep.contains(uid));
        kernel.gate.detach_others(&keep);
    }

    /// An access-log line for each refusal the kernel reported.
    fn log_refusals(&mut self) {
        let rules: Vec<Rule> = match &self.kernel.locked().installed {
            Some((table, _)) => table.rules().to_vec(),
            None => return,
        };
        let snapshot = self.live.snapshot_arc();
        for event in self.events.drain() {
            let address = |bytes: [u8; 16], port| {
                SocketAddr::new(std::net::Ipv6Addr::from(bytes).to_canonical(), port)
            };
            let (src, dst) = (
                address(event.src, event.src_port),
                address(event.dst, event.dst_port),
            );
            let rule = (rules.get(usize::from(event.rule)))
                .map_or_else(|| "other".to_string(), Rule::to_string);
            let identity = (snapshot.authz().client_identity(src.ip()))
                .map_or_else(|| "-".to_string(), |id| id.to_string());
            self.connections.received(&Received {
                event: Event::Close,
                src_identity: &identity,
                src,
                dst,
                bytes_in: 0,
                bytes_out: 0,
                duration: Duration::ZERO,
                end: ends::REFUSED,
                authorization: &rule,
                decided_by: "kernel",
            });
        }
    }
}

impl Kernel {
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
            (table.rules().iter()).zip(now.iter().zip(counted.iter()))
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
            // Each connection a rule decided matched its dry-run policies too.
            if let Rule::Decided(decision) = rule {
                let n = new_denied + new_allowed;
                for dry in decision.dry_run_matches.iter().filter(|_| n > 0) {
                    metrics.count_n(AuthzPath::Kernel, "dry_run", Some(dry), n);
                }
            }
        }
        *counted = now;
    }
}

/// Whether `netns` (a `/proc/PID/ns/net`) is the agent's own network namespace, the node's.
fn is_own_netns(netns: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let inode = |path: &std::path::Path| std::fs::metadata(path).map(|m| (m.dev(), m.ino()));
    match (
        inode(netns),
        inode(std::path::Path::new("/proc/self/ns/net")),
    ) {
        (Ok(pod), Ok(own)) => pod == own,
        // Unreadable: the attach that follows says why.
        _ => false,
    }
}

/// The `policy` label of a rule's counts.
fn policy_label(rule: &Rule) -> Option<String> {
    match rule {
        Rule::Decided(decision) => decision.verdict.policy().map(str::to_string),
        Rule::KubeletProbe => Some("kubelet-probe".to_string()),
        Rule::LeftOut => Some("not-in-kernel-table".to_string()),
        Rule::Other => Some("other".to_string()),
    }
}
