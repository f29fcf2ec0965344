//! Serializable views of a snapshot, for `/config_dump`, `redirect config service` and the CLI.
use std::{collections::BTreeMap, net::IpAddr};

use serde::Serialize;

use super::{
    Snapshot,
    service::{Service, ServiceKind, ServiceVisibility},
};
use crate::config::{LabelSelector, Resolution, VisibilityConfig, WaypointRef, WorkloadKind};

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceDump {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    /// Exact addresses, then CIDRs.
    pub vips: Vec<String>,
    /// Service port -> target port.
    pub ports: BTreeMap<u16, u16>,
    pub endpoints: Vec<EndpointDump>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<WaypointRef>,
    /// Where the waypoint is reached over HBONE (`ip:15008`); absent while its Service is unknown
    /// (connections then go without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waypoint_address: Option<String>,
    pub visibility: ServiceVisibility,
    pub kind: ServiceKind,
    pub resolution: Resolution,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointDump {
    /// An IP, or a host name resolved upstream.
    pub address: String,
    /// Service port -> endpoint port.
    pub ports: BTreeMap<u16, u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadDump {
    pub kind: WorkloadKind,
    pub name: String,
    pub namespace: String,
    pub ips: Vec<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `metadata.uid`: checked against the connecting process's pod cgroup.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Labelled `istio.io/dataplane-mode: none`: the programs leave this pod alone.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub opted_out: bool,
    /// A Pod in the ambient mesh (`docs/data-plane.md#who-is-in-the-mesh`): its traffic to the
    /// mesh's Pods of other nodes goes over HBONE.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub in_mesh: bool,
    /// The id of the pod's own cgroup, once the agent has found it on this node (it then knows the
    /// pod by its cgroup, not only by its address); filled in by the running agent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VisibilityDump {
    /// False: `serviceEntryVisibility` is unset and the feature is inert.
    pub configured: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub config: Option<VisibilityConfig>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigDump {
    pub services: Vec<ServiceDump>,
    pub workloads: Vec<WorkloadDump>,
    pub service_entry_visibility: VisibilityDump,
    /// The mesh config's namespace selectors; absent when every namespace is discovered.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub discovery_selectors: Vec<LabelSelector>,
    pub(crate) authorization: crate::authz::AuthorizationDump,
}

impl ServiceDump {
    pub fn new(svc: &Service) -> Self {
        let mut endpoints: Vec<EndpointDump> = Vec::new();
        for port in &svc.ports {
            for ep in &port.endpoints {
                let address = ep.address.to_string();
                match endpoints.iter_mut().find(|e| e.address == address) {
                    Some(e) => {
                        e.ports.insert(port.port, ep.port);
                    }
                    None => endpoints.push(EndpointDump {
                        address,
                        ports: BTreeMap::from([(port.port, ep.port)]),
                        workload: ep.workload.clone(),
                    }),
                }
            }
        }
        ServiceDump {
            name: svc.name.clone(),
            namespace: svc.namespace.clone(),
            hostname: svc.hostname.clone(),
            vips: svc
                .vips()
                .map(|ip| ip.to_string())
                .chain(svc.cidrs.iter().map(|n| n.to_string()))
                .collect(),
            ports: svc.ports.iter().map(|p| (p.port, p.target_port)).collect(),
            endpoints,
            waypoint: svc.waypoint.clone(),
            waypoint_address: svc
                .waypoint_route()
                .map(|(_, ip)| std::net::SocketAddr::new(ip, crate::hbone::PORT).to_string()),
            visibility: svc.visibility,
            kind: svc.kind,
            resolution: svc.resolution,
        }
    }
}

impl Snapshot {
    /// Every service the data plane holds (NONE entries are not among them), optionally only
    /// those of one namespace, sorted by namespace, name and host name.
    pub fn service_dump(&self, namespace: Option<&str>) -> Vec<ServiceDump> {
        let mut out: Vec<ServiceDump> = self
            .services()
            .filter(|s| namespace.is_none_or(|ns| s.namespace == ns))
            .map(ServiceDump::new)
            .collect();
        out.sort_by(|a, b| {
            (&a.namespace, &a.name, &a.hostname).cmp(&(&b.namespace, &b.name, &b.hostname))
        });
        out
    }

    pub fn config_dump(&self) -> ConfigDump {
        ConfigDump {
            services: self.service_dump(None),
            workloads: self
                .workloads()
                .iter()
                .map(|w| WorkloadDump {
                    kind: w.kind,
                    name: w.meta.name.clone(),
                    namespace: w.meta.namespace.clone(),
                    ips: w.ips.clone(),
                    node: w.node_name.clone(),
                    uid: w.meta.uid.map(|uid| uid.to_string()),
                    opted_out: w.opts_out_of_capture(),
                    in_mesh: self.enrolled(w),
                    cgroup: None,
                })
                .collect(),
            service_entry_visibility: VisibilityDump {
                configured: self.visibility.is_some(),
                config: self.visibility.clone(),
            },
            discovery_selectors: self.discovery_selectors.clone(),
            authorization: self.authz.dump(),
        }
    }
}
