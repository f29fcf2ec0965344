//! The policies in force on this node, by destination Pod: which apply to each Pod of the node
//! (`docs/authorization.md#which-policies`), converted once per snapshot so that deciding a
//! connection is a lookup and a walk over a few matches.
use std::{collections::HashMap, net::IpAddr, sync::Arc};

use serde::Serialize;

use super::{
    decide::{Conn, Decision, decide},
    peer::{Mtls, PeerPolicies},
    policy::{Authorization, NotEnforced, Scope, convert},
    table::{InboundTable, LocalClient},
};
use crate::{
    config::{DEFAULT_CLUSTER_DOMAIN, Model, Workload, selects},
    hbone::Identity,
};

/// What applies to one Pod of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodPolicies {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    /// What ties the Pod to its cgroup on the node.
    #[serde(skip)]
    pub uid: Option<uuid::Uuid>,
    /// Every policy that applies, PeerAuthentication's DENY of plaintext among them (dumped by
    /// name: the policies themselves are dumped once).
    #[serde(serialize_with = "keys")]
    pub policies: Vec<Arc<Authorization>>,
    pub mtls: Mtls,
}

impl PodPolicies {
    pub(crate) fn decide(&self, conn: &Conn<'_>) -> Decision {
        decide(self.policies.iter().map(|p| &**p), conn)
    }
}

fn keys<S: serde::Serializer>(policies: &[Arc<Authorization>], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(policies.iter().map(|p| p.key()))
}

/// A policy the node enforces nothing of, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Skipped {
    pub policy: String,
    pub why: String,
}

/// Entries of the kernel's inbound table at most (an LPM trie entry takes about 100 bytes of
/// kernel memory: some 6 MiB). Pods past it are decided by the proxy alone.
pub(crate) const INBOUND_MAX_ENTRIES: usize = 64 * 1024;

/// The policies of a snapshot, by Pod of the node.
#[derive(Debug, Default)]
pub(crate) struct NodePolicies {
    /// By each address of a Pod some policy applies to. A Pod of the node that is missing here
    /// has none: every connection to it is allowed.
    pods: HashMap<IpAddr, Arc<PodPolicies>>,
    /// Every policy converted, in `namespace/name` order.
    converted: Vec<Arc<Authorization>>,
    skipped: Vec<Skipped>,
    /// The identity of each Pod of the node as a client (by address), when the agent can tie
    /// the Pod to its cgroup: what a same-node connection is decided with.
    clients: HashMap<IpAddr, Identity>,
    /// The same decisions compiled for the kernel.
    inbound: Arc<InboundTable>,
}

/// The converted policies, indexed by where they apply.
#[derive(Default)]
struct Index {
    global: Vec<Arc<Authorization>>,
    namespace: HashMap<String, Vec<Arc<Authorization>>>,
    /// Selector policies by namespace; the root namespace's select in every namespace.
    selector: HashMap<String, Vec<Arc<Authorization>>>,
}

impl NodePolicies {
    /// Converts `model`'s policies and finds those that apply to each of `pods` (the node's).
    pub(crate) fn build<'w>(
        model: &Model,
        pods: impl Iterator<Item = &'w Workload> + Clone,
    ) -> Self {
        let root = model.mesh.root_namespace();
        let mut index = Index::default();
        let mut converted = Vec::new();
        let mut skipped = Vec::new();
        for policy in &model.authorization_policies {
            let key = format!("{}/{}", policy.meta.namespace, policy.meta.name);
            match convert(policy, root) {
                Ok(authz) => {
                    let authz = Arc::new(authz);
                    converted.push(authz.clone());
                    let ns = authz.namespace.clone();
                    match authz.scope {
                        Scope::Global => index.global.push(authz),
                        Scope::Namespace => index.namespace.entry(ns).or_default().push(authz),
                        Scope::Selector(_) => index.selector.entry(ns).or_default().push(authz),
                    }
                }
                Err(why @ (NotEnforced::Waypoint | NotEnforced::Unsupported(_))) => {
                    skipped.push(Skipped {
                        policy: key,
                        why: why.to_string(),
                    });
                }
            }
        }
        let peers = PeerPolicies::new(&model.peer_authentications, root);
        let mut out = NodePolicies {
            pods: HashMap::new(),
            converted,
            skipped,
            clients: clients(model, pods.clone()),
            inbound: Arc::default(),
        };
        for pod in pods {
            let ns = &pod.meta.namespace;
            let labels = &pod.meta.labels;
            let selected = |list: Option<&Vec<Arc<Authorization>>>| -> Vec<Arc<Authorization>> {
                (list.into_iter().flatten())
                    .filter(|p| match &p.scope {
                        Scope::Selector(s) => selects(s, labels),
                        _ => true,
                    })
                    .cloned()
                    .collect()
            };
            let mut policies: Vec<Arc<Authorization>> = index.global.clone();
            policies.extend(index.namespace.get(ns).into_iter().flatten().cloned());
            policies.extend(selected(index.selector.get(ns)));
            if ns != root {
                policies.extend(selected(index.selector.get(root)));
            }
            // (A root-namespace Pod's own namespace policies are the global ones: indexed once.)
            let mtls = peers.mtls(ns, labels);
            let own = peers.own(ns, labels);
            policies.extend(peers.policy(&mtls, own.as_deref()));
            if policies.is_empty() {
                continue;
            }
            let entry = Arc::new(PodPolicies {
                namespace: ns.clone(),
                name: pod.meta.name.clone(),
                ips: pod.ips.iter().map(|ip| ip.to_canonical()).collect(),
                uid: pod.meta.uid,
                policies,
                mtls,
            });
            for ip in &pod.ips {
                out.pods.insert(ip.to_canonical(), entry.clone());
            }
        }
        let clients: Vec<LocalClient> = (out.clients.iter())
            .map(|(ip, id)| LocalClient {
                ip: *ip,
                identity: Some(id.clone()),
            })
            .collect();
        out.inbound = Arc::new(InboundTable::compile(&out, &clients, INBOUND_MAX_ENTRIES));
        out
    }

    /// The kernel's inbound table of these policies.
    pub(crate) fn inbound(&self) -> &Arc<InboundTable> {
        &self.inbound
    }

    /// Whether a connection to the Pod of this node at `ip` may reach it only through the proxy:
    /// some policy applies to it and its policies did not fit the kernel's table.
    pub(crate) fn proxy_only(&self, ip: IpAddr) -> bool {
        let Some(pod) = self.pod(ip) else {
            return false;
        };
        self.inbound.left_out().iter().any(|p| Arc::ptr_eq(p, pod))
    }

    /// The identity a connection from the Pod of this node at `ip` is decided with; `None` for
    /// any other address (plaintext, no identity).
    pub(crate) fn client_identity(&self, ip: IpAddr) -> Option<&Identity> {
        self.clients.get(&ip.to_canonical())
    }

    /// The policies of the Pod of this node at `ip`; `None` when none applies (or no such Pod).
    pub(crate) fn pod(&self, ip: IpAddr) -> Option<&Arc<PodPolicies>> {
        self.pods.get(&ip.to_canonical())
    }

    /// Whether `other` decides every connection as these do: the same policies on the same Pods.
    pub(crate) fn same_decisions(&self, other: &NodePolicies) -> bool {
        self.pods == other.pods
    }

    /// The node's Pods some policy applies to, each once.
    pub(crate) fn guarded_pods(&self) -> impl Iterator<Item = &Arc<PodPolicies>> + '_ {
        let mut seen = std::collections::HashSet::new();
        self.pods
            .values()
            .filter(move |p| seen.insert(Arc::as_ptr(p)))
    }

    /// Logs what `self` enforces differently from `before` of each policy: the notes of a policy
    /// converted anew (what was dropped of it) and why a policy newly left out enforces nothing.
    pub(crate) fn log_changes(&self, before: &NodePolicies) {
        for policy in &self.converted {
            if before.converted.contains(policy) || policy.notes.is_empty() {
                continue;
            }
            for note in &policy.notes {
                tracing::warn!(policy = %policy.key(), action = policy.action.as_str(), "authorization policy converted with a change: {note}");
            }
        }
        for skipped in &self.skipped {
            if !before.skipped.contains(skipped) {
                tracing::warn!(policy = %skipped.policy, "authorization policy not enforced on the node: {}", skipped.why);
            }
        }
    }

    /// Whether `other` guards the very same addresses, the same of them through the proxy alone.
    pub(crate) fn same_guards(&self, other: &NodePolicies) -> bool {
        self.pods.len() == other.pods.len()
            && self.pods.keys().all(|ip| other.pods.contains_key(ip))
            && self
                .pods
                .keys()
                .all(|ip| self.proxy_only(*ip) == other.proxy_only(*ip))
    }

    #[cfg(test)]
    pub(crate) fn converted(&self) -> &[Arc<Authorization>] {
        &self.converted
    }

    #[cfg(test)]
    pub(crate) fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// What `/config_dump` shows: every policy as converted, those the node enforces nothing of,
    /// and the policies of each Pod of the node that has any.
    pub(crate) fn dump(&self) -> AuthorizationDump {
        let mut pods: Vec<&Arc<PodPolicies>> = self.pods.values().collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        pods.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let key = |p: &Arc<PodPolicies>| format!("{}/{}", p.namespace, p.name);
        AuthorizationDump {
            policies: self.converted.iter().map(|p| (**p).clone()).collect(),
            not_enforced: self.skipped.clone(),
            pods: pods.into_iter().map(|p| (**p).clone()).collect(),
            kernel: KernelDump {
                entries: self.inbound.len(),
                addresses: self.inbound.addresses().collect(),
                left_out: self.inbound.left_out().iter().map(key).collect(),
            },
        }
    }
}

/// Each Pod of the node the agent can tie to its cgroup (it has a uid) and that names a service
/// account, by address: its workload identity, in the mesh's trust domain. The proxy decides a
/// connection from such a Pod with the same identity.
fn clients<'w>(
    model: &Model,
    pods: impl Iterator<Item = &'w Workload>,
) -> HashMap<IpAddr, Identity> {
    let trust_domain = (model.mesh.trust_domain.as_deref()).unwrap_or(DEFAULT_CLUSTER_DOMAIN);
    let mut out = HashMap::new();
    for pod in pods {
        let (Some(_), Some(account)) = (pod.meta.uid, pod.service_account.as_deref()) else {
            continue;
        };
        let id = Identity {
            trust_domain: trust_domain.to_string(),
            namespace: pod.meta.namespace.clone(),
            service_account: account.to_string(),
        };
        for ip in &pod.ips {
            out.insert(ip.to_canonical(), id.clone());
        }
    }
    out
}

/// The authorization section of `/config_dump`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AuthorizationDump {
    pub policies: Vec<Authorization>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_enforced: Vec<Skipped>,
    /// The node's Pods some policy applies to (PeerAuthentication's included).
    pub pods: Vec<PodPolicies>,
    /// The kernel's inbound table compiled from them.
    pub kernel: KernelDump,
}

/// What the kernel's inbound table holds.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct KernelDump {
    pub entries: usize,
    /// The addresses it decides connections to.
    pub addresses: Vec<IpAddr>,
    /// Guarded Pods that did not fit (`namespace/name`): only the proxy reaches them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<String>,
}
