//! Which namespaces the control plane sees: the mesh config's `discoverySelectors`. The objects of
//! a namespace no selector matches do not exist for the data plane (istiod's informers never list
//! them); an empty list discovers every namespace.
use std::collections::BTreeSet;

use crate::config::Model;

/// The namespaces of a model that are not discovered; computed once per resolution.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovery {
    undiscovered: BTreeSet<String>,
}

impl Discovery {
    pub fn of(model: &Model) -> Self {
        let selectors = &model.mesh.discovery_selectors;
        if selectors.is_empty() {
            return Discovery::default();
        }
        let undiscovered = model
            .namespaces
            .values()
            .filter(|ns| !selectors.iter().any(|s| s.matches(&ns.labels)))
            .map(|ns| ns.name.clone())
            .collect();
        Discovery { undiscovered }
    }

    /// Whether the objects of `namespace` exist for the data plane. Every namespace an object lives
    /// in is in the model, so one missing here is one with nothing in it: seen.
    pub fn sees(&self, namespace: &str) -> bool {
        !self.undiscovered.contains(namespace)
    }

    /// The namespaces not discovered, by name.
    pub fn undiscovered(&self) -> impl Iterator<Item = &str> {
        self.undiscovered.iter().map(String::as_str)
    }
}
