//! How the authorization policies of a Pod of this node decide a client's connection to it, and
//! which policy decides: the very decision the proxy makes (`authz`), for `explain` and `/explain`.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::{Destination, IpExplanation};
use crate::{
    authz::Conn,
    config::{DEFAULT_CLUSTER_DOMAIN, Workload},
    hbone::Identity,
    state::{Outbound, Pick, Snapshot, Target},
};

/// The way a connection reaches the destination Pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Over {
    /// As the agent would carry it: a Pod of this node on the same node, another node's Pod over
    /// HBONE when it is reached that way, anything else in plaintext.
    #[default]
    Auto,
    /// From a Pod of this node, as its workload identity.
    SameNode,
    /// Over HBONE, as the client's workload identity.
    Hbone,
    /// In plaintext: no identity.
    Plaintext,
}

impl Over {
    pub fn as_str(self) -> &'static str {
        match self {
            Over::Auto => "auto",
            Over::SameNode => "same-node",
            Over::Hbone => "hbone",
            Over::Plaintext => "plaintext",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationReport {
    /// The destination Pod, `namespace/name`.
    pub pod: String,
    /// The way decided on (never `auto`).
    pub over: Over,
    /// The peer identity matched (`spiffe://...`); none in plaintext.
    pub identity: Option<String>,
    pub allowed: bool,
    /// `allowed by: ns/name`, `explicitly denied by: ns/name`, ...
    pub verdict: String,
    /// Every policy that applies to the Pod, `namespace/name`.
    pub policies: Vec<String>,
    /// The Pod's effective PeerAuthentication mode.
    pub mtls: String,
    /// Dry-run policies that match (never enforced).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
    /// Where the decision is made: `kernel` (at the Pod's socket lookup: a refused connection is
    /// reset at its SYN) or `proxy` (HBONE received, or a Pod whose policies did not fit the
    /// kernel's table).
    pub decided_in: String,
    pub reason: String,
}

/// Fills in `e.outbound.authorization` when the connection `e` explains (the client's to `dst`)
/// ends at a Pod of this node, directly (a waypoint decides for itself).
pub fn authorize(snapshot: &Snapshot, e: &mut IpExplanation, dst: Destination, over: Over) {
    let port = e.outbound.port.unwrap_or(0);
    let decision =
        snapshot.decide_outbound_with(Some(&e.client.namespace), dst.ip, port, Pick::Peek);
    let bound_to_waypoint = match decision.action {
        Outbound::Service { service, .. } => service.waypoint_route().is_some(),
        _ => false,
    };
    let Some(Target::Addr(target)) = decision.target() else {
        return;
    };
    if bound_to_waypoint {
        return;
    }
    let Some(pod) = snapshot.local_pod(target.ip()) else {
        return;
    };
    let client = e
        .client
        .pod
        .as_deref()
        .and_then(|key| key.split_once('/'))
        .and_then(|(ns, name)| {
            (snapshot.workloads().iter()).find(|w| w.meta.namespace == ns && w.meta.name == name)
        });
    e.outbound.authorization = Some(report(
        snapshot,
        &e.client.namespace,
        client.map(|w| &**w),
        pod,
        target,
        over,
    ));
    // The kernel hands a connection whose destination (or pick) is a Pod only the proxy may reach
    // to the proxy; the others it leaves alone, and decides at the Pod's socket lookup.
    if snapshot.authz().proxy_only(target.ip()) {
        e.outbound.decided_by = crate::fastpath::DecidedBy::Proxy;
    }
}

fn report(
    snapshot: &Snapshot,
    namespace: &str,
    client: Option<&Workload>,
    pod: &Workload,
    target: SocketAddr,
    over: Over,
) -> AuthorizationReport {
    let src_ip = client
        .and_then(|w| w.ips.first().copied())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let client_is_local = client.is_some_and(|w| {
        w.ips
            .first()
            .is_some_and(|ip| snapshot.local_pod(*ip).is_some())
    });
    let over = match over {
        Over::Auto => match client {
            None => Over::SameNode,
            Some(_) if client_is_local => Over::SameNode,
            // Over HBONE between two Pods of the mesh; anything else comes in plaintext.
            Some(w)
                if snapshot.enrolled(pod)
                    && w.ips.iter().any(|ip| snapshot.hbone_peer(*ip).is_some()) =>
            {
                Over::Hbone
            }
            Some(_) => Over::Plaintext,
        },
        other => other,
    };
    let account = client.map_or(Some("default"), |w| w.service_account.as_deref());
    // On the same node a Pod has its identity only when the kernel can confirm it is the Pod: by
    // its uid, which ties it to its cgroup.
    let unconfirmed = over == Over::SameNode && client.is_some_and(|w| w.meta.uid.is_none());
    let identity = match over {
        Over::Plaintext => None,
        _ if unconfirmed => None,
        _ => account.map(|sa| Identity {
            trust_domain: snapshot
                .trust_domain()
                .unwrap_or(DEFAULT_CLUSTER_DOMAIN)
                .to_string(),
            namespace: client.map_or(namespace, |w| &w.meta.namespace).to_string(),
            service_account: sa.to_string(),
        }),
    };
    let name = format!("{}/{}", pod.meta.namespace, pod.meta.name);
    // Every way in is decided: HBONE by the proxy, the rest at the Pod's socket lookup.
    let decided_in = match over {
        Over::Hbone => "proxy",
        _ if snapshot.authz().proxy_only(target.ip()) => "proxy",
        _ if snapshot.authz().pod(target.ip()).is_some() => "kernel",
        // No policy: nothing to decide, the connection goes as it would.
        _ => "none",
    };
    let conn = Conn {
        src_identity: identity.as_ref(),
        src_ip,
        dst_ip: target.ip(),
        dst_port: target.port(),
    };
    let (policies, decision, mtls) = match snapshot.authz().pod(target.ip()) {
        Some(p) => (
            p.policies.iter().map(|a| a.key()).collect(),
            Some(p.decide(&conn)),
            p.mtls.mode.as_str(),
        ),
        None => (Vec::new(), None, "PERMISSIVE"),
    };
    let verdict = decision
        .as_ref()
        .map_or(crate::authz::Verdict::Allowed, |d| d.verdict.clone());
    let who = match &identity {
        Some(id) => format!("as {id}"),
        None => "in plaintext (no identity)".to_string(),
    };
    let reason = match &decision {
        None => format!("no authorization policy applies to {name}: allowed"),
        Some(_) => format!(
            "{name} on port {}, {who} over {}: {verdict}",
            target.port(),
            over.as_str()
        ),
    };
    AuthorizationReport {
        pod: name,
        over,
        identity: identity.map(|i| i.to_string()),
        allowed: verdict.allowed(),
        verdict: verdict.to_string(),
        policies,
        mtls: mtls.to_string(),
        dry_run: decision.map(|d| d.dry_run_matches).unwrap_or_default(),
        decided_in: decided_in.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::load_sources, explain::explain_ip, explain::parse_destination};

    const WORLD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: team-a, labels: {app: web}, uid: 00000000-0000-0000-0000-0000000000a1}
status: {podIP: 10.244.1.20}
---
apiVersion: v1
kind: Pod
metadata: {name: b1, namespace: team-b, uid: 00000000-0000-0000-0000-0000000000b1}
status: {podIP: 10.244.2.10}
---
apiVersion: v1
kind: Pod
metadata: {name: nouid, namespace: team-b}
status: {podIP: 10.244.2.11}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-b, namespace: team-a}
spec: {action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}], to: [{operation: {ports: ["8080"]}}]}]}
"#;

    fn report(from: &str, ip: &str, over: Over) -> Option<AuthorizationReport> {
        let snapshot = Snapshot::from_model(&load_sources([("w.yaml", WORLD)]).unwrap());
        let client = crate::explain::client_of(&snapshot, from).unwrap();
        let dst = parse_destination(ip).unwrap();
        let mut e = explain_ip(&snapshot, &client.namespace, dst);
        e.client = client;
        authorize(&snapshot, &mut e, dst, over);
        if let Some(r) = e
            .outbound
            .authorization
            .as_ref()
            .filter(|r| r.over != Over::Hbone)
        {
            assert_eq!(
                r.decided_in == "proxy",
                e.outbound.decided_by == crate::fastpath::DecidedBy::Proxy,
                "a Pod only the proxy may reach is the proxy's; the kernel decides the others"
            );
        }
        e.outbound.authorization
    }

    #[test]
    fn a_pod_of_the_node_gets_its_policies_verdict_and_the_deciding_policy() {
        let r = report("team-b/b1", "10.244.1.20:8080", Over::Auto).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.verdict, "explicitly denied by: team-a/deny-b");
        assert_eq!(r.over, Over::SameNode);
        assert_eq!(
            r.identity.as_deref(),
            Some("spiffe://cluster.local/ns/team-b/sa/default")
        );
        assert_eq!(r.decided_in, "kernel");
        assert_eq!(r.policies, ["team-a/deny-b"]);
        let other_port = report("team-b/b1", "10.244.1.20:9090", Over::Auto).unwrap();
        assert!(other_port.allowed);
    }

    #[test]
    fn plaintext_has_no_identity_and_is_decided_in_the_kernel_from_anywhere() {
        // A Pod without a uid cannot be tied to its cgroup: plaintext, no identity.
        let nouid = report("team-b/nouid", "10.244.1.20:8080", Over::Auto).unwrap();
        assert_eq!(nouid.identity, None);
        assert!(nouid.allowed, "a namespaces rule never matches plaintext");
        assert_eq!(nouid.decided_in, "kernel");
        let off_node = report("team-b", "10.244.1.20:8080", Over::Plaintext).unwrap();
        assert_eq!(
            (off_node.identity.as_deref(), off_node.decided_in.as_str()),
            (None, "kernel")
        );
        let hbone = report("team-b/b1", "10.244.1.20:8080", Over::Hbone).unwrap();
        assert_eq!(hbone.decided_in, "proxy");
    }

    #[test]
    fn no_report_for_a_destination_that_is_no_pod_of_the_node() {
        assert!(report("team-b/b1", "192.0.2.1:80", Over::Auto).is_none());
    }
}
