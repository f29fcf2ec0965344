//! Connections the kernel passed directly to a Pod of this node (a Pod of the node connecting to
//! one that had no policy then) have no proxy on their path to close them. When the policies
//! change, each one the new policies deny is reset in the destination Pod's network namespace,
//! where its accepted socket is (`redirect::sock_destroy`); the client sees the reset at once.
use std::sync::Arc;

use tracing::{debug, info, warn};

use super::authorize::{Authorizer, Path, pod_identity};
use crate::{
    authz::{Conn, PodPolicies, Verdict},
    hbone::HboneClient,
    identity::CgroupPods,
    redirect::sock_destroy::{TcpConnection, destroy_in},
    state::Snapshot,
};

/// Resets, in each guarded Pod's namespace, the connections from the node's Pods that `after`'s
/// policies deny, when they decide otherwise than `before`'s.
pub(crate) async fn close_kernel_passed(
    authorizer: &Authorizer,
    cgroups: &CgroupPods,
    hbone: &Arc<HboneClient>,
    before: &Snapshot,
    after: &Arc<Snapshot>,
) {
    if after.authz().same_decisions(before.authz()) {
        return;
    }
    let guarded: Vec<Arc<PodPolicies>> = after.authz().guarded_pods().cloned().collect();
    for pod in &guarded {
        // A Pod whose policies did not change decides its open connections as before.
        let unchanged = (pod.ips.first())
            .and_then(|ip| before.authz().pod(*ip))
            .is_some_and(|was| **was == **pod);
        if unchanged {
            continue;
        }
        let Some(netns) = pod.uid.and_then(|uid| cgroups.pod_netns(&uid)) else {
            continue;
        };
        let (snapshot, policies, hbone_for_sweep) = (after.clone(), pod.clone(), hbone.clone());
        let sweep = tokio::task::spawn_blocking(move || {
            destroy_in(netns, move |conn| {
                denied(&hbone_for_sweep, &snapshot, &policies, conn).is_some()
            })
        });
        let done = match sweep.await {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                // Entering a Pod's namespace needs CAP_SYS_ADMIN and the host's process ids: said
                // once, then at debug.
                if authorizer.first_sweep_failure() {
                    warn!(pod = %format_args!("{}/{}", pod.namespace, pod.name), error = %e, "cannot list or close the Pod's connections after a policy update: connections the kernel passed directly stay open (the agent needs CAP_SYS_ADMIN and the host's PID namespace for this)");
                } else {
                    debug!(pod = %format_args!("{}/{}", pod.namespace, pod.name), error = %e, "cannot list or close the Pod's connections after a policy update");
                }
                continue;
            }
            Err(e) => {
                warn!(error = %e, "closing connections after a policy update failed");
                continue;
            }
        };
        for conn in &done.closed {
            let verdict = denied(hbone, after, pod, *conn).unwrap_or(Verdict::NotAllowed);
            authorizer
                .metrics
                .count(Path::SameNode, "closed", verdict.policy());
            info!(src = %conn.remote, dst = %conn.local, "connection closed because it's no longer allowed after a policy update: {verdict}");
        }
        if done.failed > 0 {
            warn!(pod = %format_args!("{}/{}", pod.namespace, pod.name), failed = done.failed, "the kernel refused to close connections a policy now denies (is CONFIG_INET_DIAG_DESTROY set?)");
        }
        debug!(pod = %format_args!("{}/{}", pod.namespace, pod.name), closed = done.closed.len(), "connections passed in the kernel decided again");
    }
}

/// Why `policies` deny `conn`, a connection the Pod accepted from a Pod of this node (its
/// identity that Pod's); `None` when they allow it or it is no such connection.
fn denied(
    hbone: &HboneClient,
    snapshot: &Snapshot,
    policies: &PodPolicies,
    conn: TcpConnection,
) -> Option<Verdict> {
    let (local, remote) = (
        conn.local.ip().to_canonical(),
        conn.remote.ip().to_canonical(),
    );
    if !conn.accepted || !policies.ips.contains(&local) {
        return None;
    }
    let client = snapshot.local_pod(remote)?;
    let identity = pod_identity(hbone, snapshot, client);
    let decision = policies.decide(&Conn {
        src_identity: identity.as_ref(),
        src_ip: remote,
        dst_ip: local,
        dst_port: conn.local.port(),
    });
    (!decision.verdict.allowed()).then_some(decision.verdict)
}
