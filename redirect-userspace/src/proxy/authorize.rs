//! Inbound authorization where the proxy carries a connection to a Pod of this node: HBONE
//! received for it, or a connection from a Pod of the same node that the kernel handed over
//! because some policy applies to its destination. Each connection is registered before it is
//! decided, so that a policy change between the two is not lost; every snapshot put in force
//! decides the open ones again, and closes those now denied (`docs/authorization.md#live`).
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::{
    authz::{Conn, Verdict},
    config::{DEFAULT_CLUSTER_DOMAIN, Workload},
    hbone::{HboneClient, Identity},
    identity::CgroupPods,
    lock::Locked,
    state::Snapshot,
};

/// Which way a connection reached the Pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Path {
    /// HBONE received on 15008, the peer's identity its certificate's.
    Hbone,
    /// From a Pod of this node, its identity the client Pod's.
    SameNode,
    /// Decided by the kernel at the Pod's socket lookup (any client; counted by the agent from
    /// the kernel's counters).
    Kernel,
}

impl Path {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Path::Hbone => "hbone",
            Path::SameNode => "same_node",
            Path::Kernel => "kernel",
        }
    }
}

/// Label sets past this many are counted under `policy="other"`: policies are configuration, but
/// a cluster may hold many.
const MAX_POLICY_SERIES: usize = 1024;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    path: &'static str,
    /// `allowed`, `denied`, `closed` (denied after a policy change), `dry_run` (a dry-run policy
    /// matched).
    result: &'static str,
    /// `namespace/name` of the deciding policy; empty when none decided.
    policy: String,
}

#[derive(Debug, Default)]
pub(crate) struct AuthzMetrics {
    decisions: Family<DecisionLabels, Counter>,
    series: Mutex<usize>,
    /// The node's own connections the kernel let through undecided.
    pub node_admitted: Counter,
    /// Refusals the kernel made but could not report to the agent (its ring was full).
    pub refusals_unreported: Counter,
}

impl AuthzMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "authorization_decisions",
            "Inbound connections to this node's Pods decided by authorization policy, by path (hbone and same_node: the proxy carries them; kernel: decided at the Pod's socket lookup, from any client), result (allowed, denied, closed: an open connection denied after a policy change, dry_run: a dry-run policy matched) and the deciding policy (namespace/name; empty when none decided; other past 1024 label sets)",
            self.decisions.clone(),
        );
        registry.register(
            "authorization_node_admitted",
            "Connections from the node's own sockets (kubelet's probes, the agent's dials) to this node's guarded Pods, let through by the kernel undecided, as upstream never decides them",
            self.node_admitted.clone(),
        );
        registry.register(
            "authorization_refusals_unreported",
            "Refusals the kernel made but could not report for the access log (the agent fell behind); each is still counted in redirect_authorization_decisions_total",
            self.refusals_unreported.clone(),
        );
    }

    pub(super) fn count(&self, path: Path, result: &'static str, policy: Option<&str>) {
        self.count_n(path, result, policy, 1);
    }

    /// Counts `n` decisions at once (the kernel's, read in batches).
    pub(crate) fn count_n(&self, path: Path, result: &'static str, policy: Option<&str>, n: u64) {
        let mut labels = DecisionLabels {
            path: path.as_str(),
            result,
            policy: policy.unwrap_or_default().to_string(),
        };
        if self.decisions.get(&labels).is_none() {
            let mut series = self.series.locked();
            if *series >= MAX_POLICY_SERIES {
                labels.policy = "other".to_string();
            } else {
                *series += 1;
            }
        }
        self.decisions.get_or_create(&labels).inc_by(n);
    }

    #[cfg(test)]
    pub(crate) fn get(&self, path: Path, result: &'static str, policy: &str) -> u64 {
        let labels = DecisionLabels {
            path: path.as_str(),
            result,
            policy: policy.to_string(),
        };
        self.decisions.get(&labels).map_or(0, |c| c.get())
    }
}

/// What a connection is decided on, owned so it can be decided again later.
#[derive(Debug, Clone)]
pub(crate) struct Inbound {
    pub path: Path,
    pub src_identity: Option<Identity>,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub dst_port: u16,
}

impl Inbound {
    fn conn(&self) -> Conn<'_> {
        Conn {
            src_identity: self.src_identity.as_ref(),
            src_ip: self.src_ip,
            dst_ip: self.dst_ip,
            dst_port: self.dst_port,
        }
    }

    /// How the node's policies decide it under `snapshot`; `None`: no policy applies to its Pod.
    fn decide(&self, snapshot: &Snapshot) -> Option<crate::authz::Decision> {
        let pod = snapshot.authz().pod(self.dst_ip)?;
        Some(pod.decide(&self.conn()))
    }

    fn source(&self) -> String {
        self.src_identity
            .as_ref()
            .map_or_else(|| "none (plaintext)".to_string(), ToString::to_string)
    }
}

struct Tracked {
    inbound: Inbound,
    revoked: Arc<Notify>,
    /// Already told to close: not counted again while it does.
    closing: bool,
}

/// Decides, and keeps the open connections it admitted to decide them again.
#[derive(Default)]
pub(crate) struct Authorizer {
    pub metrics: AuthzMetrics,
    open: Mutex<HashMap<u64, Tracked>>,
    next: AtomicU64,
    /// Closing connections in a Pod's namespace failed once already (said once).
    sweep_failed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authorizer")
            .field("open", &self.open.locked().len())
            .finish()
    }
}

/// An admitted connection, tracked until dropped; [`Authorized::revoked`] ends when a later policy
/// denies it.
pub(crate) struct Authorized {
    authorizer: Arc<Authorizer>,
    id: u64,
    revoked: Arc<Notify>,
    /// What decided it (`allowed by: ns/name`, ...), for the access log.
    pub verdict: Verdict,
}

impl Authorized {
    /// Ends when a policy put in force after the connection opened denies it.
    pub(crate) async fn revoked(&self) {
        self.revoked.notified().await;
    }
}

impl Drop for Authorized {
    fn drop(&mut self) {
        self.authorizer.open.locked().remove(&self.id);
    }
}

impl Authorizer {
    /// Registers `inbound`, then decides it under the snapshot in force (`snapshot` reads it
    /// after the registration). `Err`: denied, and why.
    pub(crate) fn admit(
        self: &Arc<Self>,
        inbound: Inbound,
        snapshot: impl FnOnce() -> Arc<Snapshot>,
    ) -> Result<Authorized, Verdict> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let revoked = Arc::new(Notify::new());
        let path = inbound.path;
        self.open.locked().insert(
            id,
            Tracked {
                inbound: inbound.clone(),
                revoked: revoked.clone(),
                closing: false,
            },
        );
        let mut authorized = Authorized {
            authorizer: self.clone(),
            id,
            revoked,
            verdict: Verdict::Allowed,
        };
        let Some(decision) = inbound.decide(&snapshot()) else {
            return Ok(authorized);
        };
        for policy in &decision.dry_run_matches {
            self.metrics.count(path, "dry_run", Some(policy));
            // Counted always; logged at debug (a busy client must not flood the log: the access
            // log line, within its budget, names the decision).
            debug!(path = path.as_str(), src_identity = %inbound.source(), src = %inbound.src_ip, dst = %inbound.dst_ip, port = inbound.dst_port, policy = %policy, "dry-run policy matched; not enforced");
        }
        let verdict = decision.verdict;
        self.metrics.count(path, verdict.result(), verdict.policy());
        if verdict.allowed() {
            authorized.verdict = verdict;
            return Ok(authorized);
        }
        debug!(path = path.as_str(), src_identity = %inbound.source(), src = %inbound.src_ip, dst = %inbound.dst_ip, port = inbound.dst_port, "connection denied: {verdict}");
        Err(verdict)
    }

    /// True the first time a sweep of a Pod's namespace fails.
    pub(super) fn first_sweep_failure(&self) -> bool {
        !self.sweep_failed.swap(true, Ordering::Relaxed)
    }

    /// Decides every open connection again under `snapshot` and revokes those now denied.
    pub(crate) fn recheck(&self, snapshot: &Snapshot) {
        let mut open = self.open.locked();
        let mut closed = 0;
        for tracked in open.values_mut().filter(|t| !t.closing) {
            let Some(decision) = tracked.inbound.decide(snapshot) else {
                continue;
            };
            if decision.verdict.allowed() {
                continue;
            }
            let i = &tracked.inbound;
            self.metrics
                .count(i.path, "closed", decision.verdict.policy());
            warn!(path = i.path.as_str(), src_identity = %i.source(), src = %i.src_ip, dst = %i.dst_ip, port = i.dst_port, "connection closed because it's no longer allowed after a policy update: {}", decision.verdict);
            tracked.revoked.notify_one();
            tracked.closing = true;
            closed += 1;
        }
        if closed > 0 {
            debug!(
                closed,
                open = open.len(),
                "policy update: open connections decided again"
            );
        }
    }
}

/// The workload identity of a Pod of this node, as its certificate names it (the mesh's trust
/// domain), whether certificates are configured or not.
pub(super) fn pod_identity(
    hbone: &HboneClient,
    snapshot: &Snapshot,
    pod: &Workload,
) -> Option<Identity> {
    let account = pod.service_account.as_deref()?;
    hbone.identity(&pod.meta.namespace, account).or_else(|| {
        Some(Identity {
            trust_domain: (snapshot.trust_domain())
                .unwrap_or(DEFAULT_CLUSTER_DOMAIN)
                .to_string(),
            namespace: pod.meta.namespace.clone(),
            service_account: account.to_string(),
        })
    })
}

/// Decides the open connections again each time a snapshot is put in force, until `shutdown`:
/// those the proxy carries, and those the kernel passed directly (`revoke`), when the agent
/// knows the Pods' cgroups.
pub(crate) async fn recheck_on_change(
    context: Arc<super::ProxyContext>,
    cgroups: Option<Arc<CgroupPods>>,
    mut shutdown: crate::drain::Watcher,
) {
    let live = &context.live;
    let mut applied = live.applied();
    let mut before = live.snapshot_arc();
    before
        .authz()
        .log_changes(&crate::authz::NodePolicies::default());
    loop {
        tokio::select! {
            changed = applied.changed() => {
                if changed.is_err() {
                    return;
                }
                let after = live.snapshot_arc();
                after.authz().log_changes(before.authz());
                context.authorizer.recheck(&after);
                if let Some(cgroups) = &cgroups {
                    super::revoke::close_kernel_passed(&context.authorizer, cgroups, &context.hbone, &before, &after).await;
                }
                before = after;
            }
            () = shutdown.stopped() => return,
        }
    }
}
