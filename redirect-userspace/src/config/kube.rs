//! Kubernetes core kinds (`v1`): Namespace, Service, Pod.
use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use serde::Deserialize;

use super::{
    convert::{self, RawMeta},
    error::Ctx,
    labels::Labels,
    model::{
        KubeService, NAMESPACE_NAME_LABEL, Namespace, ServicePort, TargetPort, Workload,
        WorkloadKind,
    },
    workload_names::{Controller, pod_workload},
};

/// The service account Kubernetes gives a Pod that names none.
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

#[derive(Debug, Deserialize)]
pub(crate) struct RawNamespace {
    metadata: Option<RawMeta>,
}

impl RawNamespace {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<Namespace> {
        let before = ctx.error_count();
        let meta = convert::meta(ctx, self.metadata, false);
        let mut labels = meta.labels;
        // Kubernetes sets this label on every namespace and overwrites any other value.
        labels.insert(NAMESPACE_NAME_LABEL.to_string(), meta.name.clone());
        (ctx.error_count() == before).then_some(Namespace {
            name: meta.name,
            labels,
            declared: true,
        })
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawService {
    metadata: Option<RawMeta>,
    spec: Option<RawServiceSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawServiceSpec {
    #[serde(rename = "clusterIP")]
    cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs")]
    cluster_ips: Option<Vec<String>>,
    ports: Option<Vec<RawServicePort>>,
    selector: Option<Labels>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawServicePort {
    port: Option<i64>,
    name: Option<String>,
    protocol: Option<String>,
    target_port: Option<IntOrString>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IntOrString {
    Int(i64),
    String(String),
}

impl RawService {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<KubeService> {
        let before = ctx.error_count();
        let meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();
        // clusterIPs wins when both are set (it is the newer, dual-stack field).
        let (field, texts) = match (spec.cluster_ips, spec.cluster_ip) {
            (Some(ips), _) => ("spec.clusterIPs", ips),
            (None, Some(ip)) => ("spec.clusterIP", vec![ip]),
            (None, None) => ("spec.clusterIP", Vec::new()),
        };
        let mut cluster_ips: Vec<IpAddr> = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            if text.is_empty() || text == "None" {
                continue;
            }
            let at = if field == "spec.clusterIPs" {
                format!("{field}[{i}]")
            } else {
                field.to_string()
            };
            cluster_ips.extend(convert::ip(ctx, &at, text));
        }
        let mut ports: Vec<ServicePort> = Vec::new();
        for (i, raw) in spec.ports.unwrap_or_default().into_iter().enumerate() {
            let at = format!("spec.ports[{i}]");
            let Some(port) = convert::port(ctx, &format!("{at}.port"), raw.port) else {
                continue;
            };
            let target_port = match raw.target_port {
                None => TargetPort::Number(port),
                Some(IntOrString::Int(n)) => {
                    match convert::port(ctx, &format!("{at}.targetPort"), Some(n)) {
                        Some(p) => TargetPort::Number(p),
                        None => continue,
                    }
                }
                Some(IntOrString::String(name)) => match name.parse::<i64>() {
                    Ok(n) => match convert::port(ctx, &format!("{at}.targetPort"), Some(n)) {
                        Some(p) => TargetPort::Number(p),
                        None => continue,
                    },
                    Err(_) => TargetPort::Name(name),
                },
            };
            if ports
                .iter()
                .any(|p| p.port == port && p.protocol == raw.protocol)
            {
                ctx.error(
                    format!("{at}.port"),
                    format!("port {port} is declared twice"),
                );
            }
            ports.push(ServicePort {
                port,
                name: raw.name,
                protocol: raw.protocol,
                target_port,
            });
        }
        (ctx.error_count() == before).then_some(KubeService {
            meta,
            cluster_ips,
            ports,
            selector: spec.selector,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawPod {
    pub(super) metadata: Option<RawMeta>,
    pub(super) spec: Option<RawPodSpec>,
    pub(super) status: Option<RawPodStatus>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RawPodSpec {
    pub(super) node_name: Option<String>,
    pub(super) service_account_name: Option<String>,
    pub(super) containers: Option<Vec<RawContainer>>,
    pub(super) host_network: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawContainer {
    pub(super) ports: Option<Vec<RawContainerPort>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RawContainerPort {
    pub(super) name: Option<String>,
    pub(super) container_port: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RawPodStatus {
    #[serde(rename = "podIP")]
    pub(super) pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pub(super) pod_ips: Option<Vec<RawPodIp>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawPodIp {
    pub(super) ip: Option<String>,
}

impl RawPod {
    /// What a Pod of another node keeps: not its uid (which ties a client to its cgroup), node
    /// or age, as the watch of other nodes' Pods cuts them.
    pub(super) fn forget_this_nodes_fields(&mut self) {
        if let Some(meta) = &mut self.metadata {
            meta.uid = None;
            meta.creation_timestamp = None;
        }
        if let Some(spec) = &mut self.spec {
            spec.node_name = None;
            spec.service_account_name = None;
        }
    }

    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<Workload> {
        let before = ctx.error_count();
        let workload_name = self.metadata.as_ref().and_then(workload_name);
        let sidecar = (self.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .is_some_and(|a| a.sidecar_status.is_some());
        let meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();
        let status = self.status.unwrap_or_default();
        // A Pod has an address or two: a list, searched, is the cheapest set. Field names are
        // written out only for an error.
        let mut ips: Vec<IpAddr> = Vec::with_capacity(1);
        if let Some(text) = status.pod_ip.as_deref().filter(|t| !t.is_empty()) {
            ips.extend(convert::ip(ctx, "status.podIP", text));
        }
        for (i, raw) in status.pod_ips.unwrap_or_default().into_iter().enumerate() {
            if let Some(text) = raw.ip.as_deref() {
                let ip = match text.parse::<IpAddr>() {
                    Ok(ip) => Some(ip),
                    Err(_) => convert::ip(ctx, &format!("status.podIPs[{i}].ip"), text),
                };
                if let Some(ip) = ip
                    && !ips.contains(&ip)
                {
                    ips.push(ip);
                }
            }
        }
        let mut ports = BTreeMap::new();
        for (c, container) in spec.containers.unwrap_or_default().into_iter().enumerate() {
            for (i, raw) in container.ports.unwrap_or_default().into_iter().enumerate() {
                let number = match raw.container_port.map(u16::try_from) {
                    Some(Ok(p)) if p != 0 => Some(p),
                    _ => {
                        let at = format!("spec.containers[{c}].ports[{i}].containerPort");
                        convert::port(ctx, &at, raw.container_port)
                    }
                };
                if let (Some(name), Some(number)) = (raw.name, number) {
                    ports.insert(name, number);
                }
            }
        }
        (ctx.error_count() == before).then_some(Workload {
            kind: WorkloadKind::Pod,
            meta,
            ips,
            // Kubernetes fills in `default`; a Pod written by hand may leave it out.
            service_account: Some(
                spec.service_account_name
                    .filter(|sa| !sa.is_empty())
                    .unwrap_or_else(|| DEFAULT_SERVICE_ACCOUNT.to_string()),
            ),
            node_name: spec.node_name,
            ports,
            other_address: None,
            workload_name,
            never_enrolled: sidecar || spec.host_network == Some(true),
        })
    }
}

/// A Pod's workload name for Istio's telemetry, when not its own name.
fn workload_name(meta: &RawMeta) -> Option<Arc<str>> {
    let name = meta.name.as_deref()?;
    let none = Labels::new();
    let labels = meta.labels.as_ref().unwrap_or(&none);
    let generated = meta.generate_name.as_deref().is_some_and(|g| !g.is_empty());
    let controller = meta
        .controller()
        .map(|(kind, name)| Controller { kind, name });
    let workload = pod_workload(name, generated, labels, controller);
    (workload != name).then(|| Arc::from(workload))
}
