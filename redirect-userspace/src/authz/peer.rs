//! PeerAuthentication as the node enforces it (`docs/authorization.md#peerauthentication`): each
//! workload's effective mode, and STRICT as a DENY of plaintext, the policy Istio converts it to.
use std::{collections::BTreeMap, sync::Arc};

use serde::Serialize;

use super::policy::{Action, Authorization, Clause, Group, Match, Scope, StringMatch};
use crate::config::{Labels, MtlsMode, PeerAuthentication, Timestamp, selects};

/// The name of the mesh-wide policy a STRICT mode becomes.
pub(crate) const STATIC_STRICT: &str = "istio_converted_static_strict";

/// The PeerAuthentications of a model, by level.
#[derive(Debug)]
pub(crate) struct PeerPolicies {
    /// The root namespace's policy without a selector, the oldest.
    mesh: Option<Arc<PeerAuthentication>>,
    /// Each namespace's policy without a selector, the oldest.
    namespaces: BTreeMap<String, Arc<PeerAuthentication>>,
    /// Policies with a selector, outside the root namespace, oldest first.
    workloads: BTreeMap<String, Vec<Arc<PeerAuthentication>>>,
    /// The one STRICT policy, shared by every workload under STRICT without port-level modes.
    strict: Arc<Authorization>,
}

/// What PeerAuthentication says of one workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Mtls {
    /// The mode after inheritance; `UNSET` all the way is PERMISSIVE.
    pub mode: MtlsMode,
    /// The policy that set it (`namespace/name`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Port-level modes of the workload's own policy, after inheritance.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<u16, MtlsMode>,
}

impl PeerPolicies {
    pub(crate) fn new(policies: &[Arc<PeerAuthentication>], root_namespace: &str) -> Self {
        let mut by_age: Vec<&Arc<PeerAuthentication>> = policies.iter().collect();
        by_age.sort_by_key(|p| age_key(p));
        let mut out = PeerPolicies {
            mesh: None,
            namespaces: BTreeMap::new(),
            workloads: BTreeMap::new(),
            strict: Arc::new(strict_policy(root_namespace)),
        };
        for p in by_age {
            let ns = &p.meta.namespace;
            match &p.selector {
                None if ns == root_namespace => {
                    out.mesh.get_or_insert_with(|| p.clone());
                    out.namespaces
                        .entry(ns.clone())
                        .or_insert_with(|| p.clone());
                }
                None => {
                    out.namespaces
                        .entry(ns.clone())
                        .or_insert_with(|| p.clone());
                }
                // A root-namespace policy with a selector is ignored, as Istio ignores it.
                Some(_) if ns == root_namespace => {}
                Some(_) => out.workloads.entry(ns.clone()).or_default().push(p.clone()),
            }
        }
        out
    }

    /// The effective mTLS of a workload of `namespace` with `labels`.
    pub(crate) fn mtls(&self, namespace: &str, labels: &Labels) -> Mtls {
        let own = self.workloads.get(namespace).and_then(|ps| {
            ps.iter()
                .find(|p| p.selector.as_ref().is_some_and(|s| selects(s, labels)))
        });
        let chain = [own, self.namespaces.get(namespace), self.mesh.as_ref()];
        let (mode, from) = chain
            .iter()
            .flatten()
            .find(|p| p.mode != MtlsMode::Unset)
            .map_or((MtlsMode::Permissive, None), |p| {
                (effective(p.mode), Some(key(p)))
            });
        let ports = own
            .map(|p| {
                p.port_level
                    .iter()
                    .map(|(port, m)| {
                        let m = match m {
                            MtlsMode::Unset => mode,
                            m => effective(*m),
                        };
                        (*port, m)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Mtls {
            mode,
            from: from.or_else(|| own.map(|p| key(p))),
            ports,
        }
    }

    /// The DENY policy the workload's mTLS becomes, if it refuses any plaintext.
    pub(crate) fn policy(&self, mtls: &Mtls, own: Option<&str>) -> Option<Arc<Authorization>> {
        if mtls.ports.is_empty() {
            return (mtls.mode == MtlsMode::Strict).then(|| self.strict.clone());
        }
        let (namespace, name) = own?.split_once('/')?;
        let plaintext = Match {
            not_principals: vec![StringMatch::Presence],
            ..Match::default()
        };
        let ports = |strict: bool| -> Vec<u16> {
            (mtls.ports.iter())
                .filter(|(_, m)| (**m == MtlsMode::Strict) == strict)
                .map(|(p, _)| *p)
                .collect()
        };
        let m = if mtls.mode == MtlsMode::Strict {
            Match {
                not_destination_ports: ports(false),
                ..plaintext
            }
        } else {
            let strict = ports(true);
            if strict.is_empty() {
                return None;
            }
            Match {
                destination_ports: strict,
                ..plaintext
            }
        };
        Some(Arc::new(Authorization {
            namespace: namespace.to_string(),
            name: format!("converted_peer_authentication_{name}"),
            scope: Scope::Namespace,
            action: Action::Deny,
            dry_run: false,
            groups: vec![Group {
                clauses: vec![Clause { matches: vec![m] }],
            }],
            notes: Vec::new(),
        }))
    }

    /// The workload-level policy of a workload, `namespace/name`, when one selects it.
    pub(crate) fn own(&self, namespace: &str, labels: &Labels) -> Option<String> {
        self.workloads.get(namespace).and_then(|ps| {
            ps.iter()
                .find(|p| p.selector.as_ref().is_some_and(|s| selects(s, labels)))
                .map(|p| key(p))
        })
    }
}

/// DISABLE acts as PERMISSIVE: the node still speaks mTLS over HBONE.
fn effective(mode: MtlsMode) -> MtlsMode {
    match mode {
        MtlsMode::Disable => MtlsMode::Permissive,
        m => m,
    }
}

fn key(p: &PeerAuthentication) -> String {
    format!("{}/{}", p.meta.namespace, p.meta.name)
}

/// Oldest first; without a timestamp last; then by name.
fn age_key(p: &PeerAuthentication) -> (bool, Option<Timestamp>, &str, &str) {
    (
        p.meta.creation_timestamp.is_none(),
        p.meta.creation_timestamp,
        &p.meta.namespace,
        &p.meta.name,
    )
}

/// DENY when the peer has no identity.
fn strict_policy(root_namespace: &str) -> Authorization {
    Authorization {
        namespace: root_namespace.to_string(),
        name: STATIC_STRICT.to_string(),
        scope: Scope::Global,
        action: Action::Deny,
        dry_run: false,
        groups: vec![Group {
            clauses: vec![Clause {
                matches: vec![Match {
                    not_principals: vec![StringMatch::Presence],
                    ..Match::default()
                }],
            }],
        }],
        notes: Vec::new(),
    }
}
