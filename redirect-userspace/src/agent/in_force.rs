//! The flags in force (`admin::InForce`), filled in from the agent's configuration.
use std::path::Path;

use super::AgentConfig;
use crate::{admin::InForce, hbone::CertSource};

/// What `config` runs with, for the log and `/config_dump`.
pub(super) fn of(config: &AgentConfig) -> InForce {
    let shown = |p: &Path| p.display().to_string();
    let source = match (&config.kube, &config.config_dir) {
        (Some(_), _) => "kubernetes API".to_string(),
        (None, Some(dir)) => format!("directory {}", dir.display()),
        (None, None) => "none".to_string(),
    };
    let node_name = (config.kube.as_ref())
        .and_then(|kube| kube.node_name.clone())
        .or_else(|| config.hbone_node.clone());
    let gateways = [config.gateway.v4.map(|ip| ip.to_string())]
        .into_iter()
        .chain([config.gateway.v6.map(|ip| ip.to_string())])
        .flatten()
        .collect();
    let certificates = config.cert_source.as_ref().map(|source| match source {
        CertSource::Dir(dir) => format!("directory {}", dir.display()),
        CertSource::IstioCa(ca) => format!("istio CA {}", ca.address),
    });
    InForce {
        source,
        node_name,
        cgroup: shown(&config.cgroup),
        gateways,
        proxy_port: config.proxy_port,
        dns_proxy_port: config.dns_proxy_port,
        dns_upstream: config.dns_upstream.to_string(),
        dns_cache_entries: config.dns_cache.map(|n| n.get()),
        admin: config.admin.to_string(),
        stats: config.stats.map(|addr| addr.to_string()),
        fast_path: config.fast_path,
        fast_path_memory_bytes: config.fast_path_memory,
        relay: format!("{:?}", config.relay).to_lowercase(),
        kernel_records: config.kernel_records.to_string(),
        access_log: config.access_log,
        deny_destinations: config
            .deny_destinations
            .iter()
            .map(|n| n.to_string())
            .collect(),
        certificates,
        trust_domain: config.trust_domain.clone(),
        cluster_id: config.cluster_id.clone(),
        hbone_between_nodes: config.hbone_node.is_some(),
        audit_mesh_config: config.audit_mesh_config.as_deref().map(shown),
        bpffs: config.pin_dir.as_deref().map(shown),
        handover_socket: config.handover_socket.as_deref().map(shown),
        drain_timeout_secs: config.drain_timeout.as_secs_f64(),
    }
}
