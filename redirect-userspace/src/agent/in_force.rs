//! The configuration the agent runs with, its flags and their defaults as they came to be: logged
//! once at start and shown in `/config_dump` (`inForce`), so what a node runs can be read rather
//! than worked out from a manifest.
use std::path::Path;

use serde::Serialize;

use super::AgentConfig;
use crate::hbone::CertSource;

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct InForce {
    /// Where the configuration comes from: `kubernetes API`, `directory <path>`, or `none`.
    source: String,
    node_name: Option<String>,
    cgroup: String,
    gateways: Vec<String>,
    proxy_port: u16,
    dns_proxy_port: Option<u16>,
    dns_upstream: String,
    dns_cache_entries: Option<usize>,
    admin: String,
    stats: Option<String>,
    fast_path: bool,
    fast_path_memory_bytes: usize,
    relay: String,
    kernel_records: String,
    access_log: bool,
    deny_destinations: Vec<String>,
    /// Where the Pods' certificates come from: `directory <path>`, `istio CA <address>`, or none.
    certificates: Option<String>,
    trust_domain: Option<String>,
    cluster_id: String,
    /// Traffic between two Pods of the mesh on different nodes goes over HBONE.
    hbone_between_nodes: bool,
    audit_mesh_config: Option<String>,
    bpffs: Option<String>,
    handover_socket: Option<String>,
    drain_timeout_secs: f64,
}

impl InForce {
    pub(crate) fn of(config: &AgentConfig) -> InForce {
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

    /// One line of JSON, for the log.
    pub(crate) fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("(not encoded: {e})"))
    }
}
