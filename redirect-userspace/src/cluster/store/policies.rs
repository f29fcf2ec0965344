//! Which security policies (AuthorizationPolicies, PeerAuthentications) a model holds. Both are
//! watched cluster-wide, as Services and ServiceEntries are, and held at their last good version
//! like any object. With a node name, the model holds only those that can apply to a Pod of the
//! node: the root namespace's (mesh-wide, and their selectors pick in every namespace) and those of
//! the namespaces with a Pod of the node. The others, and their errors, are no concern of this
//! node's until its first Pod of their namespace comes: the model built for that change holds them.
use std::collections::{BTreeMap, HashSet};

use super::relist::{Relisting, Slots};
use crate::{
    cluster::kinds::{Kind, Object},
    config::DEFAULT_ROOT_NAMESPACE,
};

/// The namespaces whose policies a model holds.
pub(super) struct PolicyScope<'a> {
    /// `None`: every namespace's (no node name: every Pod of the cluster is a client here).
    namespaces: Option<HashSet<&'a str>>,
}

impl<'a> PolicyScope<'a> {
    /// The scope of the objects `kinds` serve; `node_scoped`: the Pod watch holds this node's only.
    pub(super) fn of(kinds: &'a BTreeMap<Kind, Relisting<Slots>>, node_scoped: bool) -> Self {
        if !node_scoped {
            return PolicyScope { namespaces: None };
        }
        let good = |kind: Kind| {
            (kinds.get(&kind).into_iter())
                .flat_map(|w| w.served.iter())
                .filter(|(_, slot)| slot.good.is_some())
        };
        // The mesh config in force (its last good version), else Istio's default.
        let root = good(Kind::MeshConfig)
            .find_map(|(_, slot)| match &slot.good {
                Some(Object::Mesh(mesh)) => Some(mesh.root_namespace()),
                _ => None,
            })
            .unwrap_or(DEFAULT_ROOT_NAMESPACE);
        let mut namespaces: HashSet<&str> = good(Kind::Pod)
            .map(|((namespace, _), _)| namespace.as_str())
            .collect();
        namespaces.insert(root);
        PolicyScope {
            namespaces: Some(namespaces),
        }
    }

    /// Whether the model holds the object of `kind` in `namespace` (every kind but the policies
    /// is held whole).
    pub(super) fn holds(&self, kind: Kind, namespace: &str) -> bool {
        !kind.is_security_policy()
            || self
                .namespaces
                .as_ref()
                .is_none_or(|n| n.contains(namespace))
    }
}
