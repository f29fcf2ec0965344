//! One namespace, one host: the ambient index publishes one service per namespace and host name.
//! When two ServiceEntries of a namespace declare the same host, the oldest (creation time, then
//! name) is published for it and the newer one's service for that host does not exist. A
//! ServiceEntry that declares the host of a Kubernetes Service of its own namespace is never
//! published for that host: the Service is its only definition. Across namespaces nothing is
//! dropped; the data plane's ranking decides per client.
use std::collections::{HashMap, hash_map::Entry};

use serde::Serialize;

use super::Discovery;
use crate::config::{Model, Visibility};

/// A host of an entry that is not published, and the definition that holds it instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Shadowed {
    /// As declared (`*.example.com` for a wildcard).
    pub host: String,
    /// `ServiceEntry ns/name` or `Service ns/name`.
    pub by: String,
}

/// Per entry (indexed like `model.service_entries`), its hosts that are not published. Entries
/// that reach no data plane (NONE, not discovered) take part in nothing.
pub(crate) fn shadowed(
    model: &Model,
    visibilities: &[Visibility],
    discovery: &Discovery,
) -> Vec<Vec<Shadowed>> {
    let mut out = vec![Vec::new(); model.service_entries.len()];
    // The host names Kubernetes Services define, each in its own namespace.
    let services: HashMap<String, &crate::config::ObjectMeta> = model
        .services
        .iter()
        .filter(|s| discovery.sees(&s.meta.namespace))
        .map(|s| (s.hostname(&model.cluster_domain), &s.meta))
        .collect();
    let mut order: Vec<usize> = (0..model.service_entries.len())
        .filter(|&i| {
            visibilities[i] != Visibility::None
                && discovery.sees(&model.service_entries[i].meta.namespace)
        })
        .collect();
    // Oldest first (no timestamp counts as newest), then by name.
    order.sort_by_key(|&i| {
        let meta = &model.service_entries[i].meta;
        (
            &meta.namespace,
            meta.creation_timestamp.is_none(),
            meta.creation_timestamp,
            &meta.name,
        )
    });
    let mut owners: HashMap<(&str, String), usize> = HashMap::new();
    for i in order {
        let entry = &model.service_entries[i];
        let ns = entry.meta.namespace.as_str();
        for host in &entry.hosts {
            let host = host.to_string();
            if let Some(service) = services.get(&host).filter(|s| s.namespace == ns) {
                out[i].push(Shadowed {
                    by: format!("Service {ns}/{}", service.name),
                    host,
                });
                continue;
            }
            match owners.entry((ns, host)) {
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
                Entry::Occupied(slot) => {
                    let owner = &model.service_entries[*slot.get()].meta;
                    out[i].push(Shadowed {
                        host: slot.key().1.clone(),
                        by: format!("ServiceEntry {}/{}", owner.namespace, owner.name),
                    });
                }
            }
        }
    }
    out
}
