//! What `/config_dump` shows of the fast path: the tables in force and, for each service address
//! and port, who decides a connection from the service's own namespace.
use std::collections::BTreeMap;

use serde::Serialize;

use super::{DecidedBy, Fallback, Stats, TableMemory, Tables, decided_by};
use crate::state::Snapshot;

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Dump {
    /// Entries of each table in force.
    pub tables: BTreeMap<&'static str, usize>,
    /// What the snapshot leaves to the proxy that the kernel could otherwise decide, by reason.
    pub fallbacks: BTreeMap<String, usize>,
    /// What each table's maps take in the kernel, both generations together.
    pub memory: BTreeMap<&'static str, TableMemory>,
    /// The kernel memory the tables may take (`run --fast-path-memory`).
    pub memory_budget_bytes: usize,
    pub services: Vec<ServiceDecision>,
}

/// Who decides a connection to one address and port of a service.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ServiceDecision {
    /// `namespace/name`.
    pub service: String,
    pub address: String,
    pub port: u16,
    /// For a client in the service's own namespace.
    pub decided_by: DecidedBy,
}

impl Dump {
    /// `in_force`: the entries of each table in the kernel's maps, if any are in force.
    pub(crate) fn new(
        snapshot: &Snapshot,
        tables: &Tables,
        stats: &Stats,
        in_force: Option<BTreeMap<&'static str, usize>>,
    ) -> Dump {
        let mut services = Vec::new();
        for svc in snapshot.services() {
            let addresses = svc.vips().chain(svc.cidrs.iter().map(|net| net.network()));
            for ip in addresses {
                for port in &svc.ports {
                    services.push(ServiceDecision {
                        service: format!("{}/{}", svc.namespace, svc.name),
                        address: ip.to_string(),
                        port: port.port,
                        decided_by: decided_by(tables, Some(&svc.namespace), ip, port.port),
                    });
                }
            }
        }
        Dump {
            tables: in_force.unwrap_or_default(),
            fallbacks: stats
                .fallbacks
                .iter()
                .map(|(why, n)| (fallback_name(*why), *n))
                .collect(),
            memory: BTreeMap::new(),
            memory_budget_bytes: 0,
            services,
        }
    }

    /// This dump, with what the maps take and may take.
    pub(crate) fn with_memory(
        self,
        memory: BTreeMap<&'static str, TableMemory>,
        budget: usize,
    ) -> Dump {
        Dump {
            memory,
            memory_budget_bytes: budget,
            ..self
        }
    }
}

/// `HostNameEndpoint` -> `host_name_endpoint`: the metric label and the dump's key.
pub(crate) fn fallback_name(why: Fallback) -> String {
    let mut out = String::new();
    for (i, c) in format!("{why:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_names_are_snake_case() {
        assert_eq!(
            fallback_name(Fallback::HostNameEndpoint),
            "host_name_endpoint"
        );
        assert_eq!(fallback_name(Fallback::PortsFull), "ports_full");
    }
}
