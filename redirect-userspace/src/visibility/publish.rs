//! One namespace, one host: the ambient index publishes one service per namespace and host name.
//! When two ServiceEntries of a namespace declare the same host, the oldest (creation time, then
//! name) is published for it and the newer one's service for that host does not exist. A
//! ServiceEntry that declares the host of a Kubernetes Service of its own namespace is never
//! published for that host: the Service is its only definition. Across namespaces nothing is
//! dropped; the data plane's ranking decides per client.
use std::collections::{HashMap, hash_map::Entry};

use serde::Serialize;

use super::Discovery;
use crate::config::{Host, Model, ServiceEntry, Visibility};

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
    // Only entries of one namespace compete: each namespace's entries apart, so that sorting and
    // the owners' table never compare namespace names (20,000 entries took 20 ms that way).
    let mut by_namespace: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, entry) in model.service_entries.iter().enumerate() {
        if visibilities[i] != Visibility::None && discovery.sees(&entry.meta.namespace) {
            by_namespace
                .entry(entry.meta.namespace.as_str())
                .or_default()
                .push(i);
        }
    }
    let mut owners: HashMap<&Host, usize> = HashMap::new();
    for (ns, mut order) in by_namespace {
        // Oldest first (no timestamp counts as newest), then by name.
        order.sort_by_key(|&i| {
            let meta = &model.service_entries[i].meta;
            (
                meta.creation_timestamp.is_none(),
                meta.creation_timestamp,
                &meta.name,
            )
        });
        owners.clear();
        for i in order {
            for host in &model.service_entries[i].hosts {
                // A Service's host name is always exact: a wildcard never names one.
                let service = match host {
                    Host::Exact(name) => services.get(name).filter(|s| s.namespace == ns),
                    Host::Wildcard(_) | Host::Partial(_) => None,
                };
                if let Some(service) = service {
                    out[i].push(Shadowed {
                        by: format!("Service {ns}/{}", service.name),
                        host: host.to_string(),
                    });
                    continue;
                }
                match owners.entry(host) {
                    Entry::Vacant(slot) => {
                        slot.insert(i);
                    }
                    Entry::Occupied(slot) => {
                        let owner = &model.service_entries[*slot.get()].meta;
                        out[i].push(Shadowed {
                            host: host.to_string(),
                            by: format!("ServiceEntry {}/{}", owner.namespace, owner.name),
                        });
                    }
                }
            }
        }
    }
    out
}

/// Whether no host of `entry` is declared twice in its namespace: again by `entry` itself, by
/// another entry of `model` (one of the same name is skipped: the version `entry` replaces or is
/// replaced by), or as a Kubernetes Service's name. Such an entry never shadows and is never
/// shadowed, whatever its visibility, and no other entry's shadowing depends on it.
pub(crate) fn alone_in_namespace(model: &Model, entry: &ServiceEntry) -> bool {
    let ns = entry.meta.namespace.as_str();
    let hosts = &entry.hosts;
    if hosts
        .iter()
        .enumerate()
        .any(|(i, h)| hosts[..i].contains(h))
    {
        return false;
    }
    // Both lists are sorted by `namespace/name`: the namespace's own are one run.
    let entries = namespace_run(&model.service_entries, ns, |e| &e.meta.namespace);
    let shared = entries
        .iter()
        .filter(|other| other.meta.name != entry.meta.name)
        .any(|other| other.hosts.iter().any(|h| hosts.contains(h)));
    let services = namespace_run(&model.services, ns, |s| &s.meta.namespace);
    let service = services.iter().any(|svc| {
        let name = svc.hostname(&model.cluster_domain);
        hosts
            .iter()
            .any(|h| matches!(h, Host::Exact(exact) if *exact == name))
    });
    !shared && !service
}

/// The objects of `namespace` in a list sorted by namespace first.
fn namespace_run<'a, T>(sorted: &'a [T], namespace: &str, of: impl Fn(&T) -> &str) -> &'a [T] {
    let start = sorted.partition_point(|o| of(o) < namespace);
    let end = start + sorted[start..].partition_point(|o| of(o) == namespace);
    &sorted[start..end]
}
