//! The configuration the agent runs with, its flags and their defaults as they came to be: logged
//! once at start and shown in `/config_dump` (`inForce`), so what a node runs can be read rather
//! than worked out from a manifest. The agent fills it in.
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct InForce {
    /// Where the configuration comes from: `kubernetes API`, `directory <path>`, or `none`.
    pub(crate) source: String,
    pub(crate) node_name: Option<String>,
    pub(crate) cgroup: String,
    pub(crate) gateways: Vec<String>,
    pub(crate) proxy_port: u16,
    pub(crate) dns_proxy_port: Option<u16>,
    pub(crate) dns_upstream: String,
    pub(crate) dns_cache_entries: Option<usize>,
    pub(crate) admin: String,
    pub(crate) stats: Option<String>,
    pub(crate) fast_path: bool,
    pub(crate) fast_path_memory_bytes: usize,
    pub(crate) relay: String,
    pub(crate) kernel_records: String,
    pub(crate) access_log: bool,
    pub(crate) deny_destinations: Vec<String>,
    /// Where the Pods' certificates come from: `directory <path>`, `istio CA <address>`, or none.
    pub(crate) certificates: Option<String>,
    pub(crate) trust_domain: Option<String>,
    pub(crate) cluster_id: String,
    /// Traffic between two Pods of the mesh on different nodes goes over HBONE.
    pub(crate) hbone_between_nodes: bool,
    pub(crate) audit_mesh_config: Option<String>,
    pub(crate) bpffs: Option<String>,
    pub(crate) handover_socket: Option<String>,
    pub(crate) drain_timeout_secs: f64,
}

impl InForce {
    /// One line of JSON, for the log.
    pub(crate) fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("(not encoded: {e})"))
    }
}
