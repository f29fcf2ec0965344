//! `ServiceEntry` and `WorkloadEntry` (networking.istio.io): raw shape and validation.
use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde::Deserialize;

use super::{
    convert::{self, RawMeta},
    error::Ctx,
    labels::Labels,
    mesh::validate_export_to,
    model::{
        EndpointAddress, Location, Resolution, ServiceEntry, ServiceEntryEndpoint,
        ServiceEntryPort, WaypointRef, Workload, WorkloadKind,
    },
};

pub const USE_WAYPOINT_LABEL: &str = "istio.io/use-waypoint";
pub const USE_WAYPOINT_NAMESPACE_LABEL: &str = "istio.io/use-waypoint-namespace";

#[derive(Debug, Deserialize)]
pub(crate) struct RawServiceEntry {
    metadata: Option<RawMeta>,
    spec: Option<RawServiceEntrySpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawServiceEntrySpec {
    hosts: Option<Vec<String>>,
    addresses: Option<Vec<String>>,
    ports: Option<Vec<RawPort>>,
    location: Option<String>,
    resolution: Option<String>,
    endpoints: Option<Vec<RawWorkloadEntrySpec>>,
    workload_selector: Option<RawWorkloadSelector>,
    export_to: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPort {
    number: Option<i64>,
    name: Option<String>,
    protocol: Option<String>,
    target_port: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
struct RawWorkloadSelector {
    labels: Option<Labels>,
}

/// The spec of a WorkloadEntry, also the shape of a ServiceEntry endpoint.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawWorkloadEntrySpec {
    address: Option<String>,
    ports: Option<BTreeMap<String, i64>>,
    labels: Option<Labels>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawWorkloadEntry {
    metadata: Option<RawMeta>,
    spec: Option<RawWorkloadEntrySpec>,
}

fn named_ports(
    ctx: &mut Ctx<'_>,
    field: &str,
    raw: Option<BTreeMap<String, i64>>,
) -> BTreeMap<String, u16> {
    let mut ports = BTreeMap::new();
    for (name, number) in raw.unwrap_or_default() {
        if let Some(p) = convert::port(ctx, &format!("{field}.{name}"), Some(number)) {
            ports.insert(name, p);
        }
    }
    ports
}

impl RawServiceEntry {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<ServiceEntry> {
        let before = ctx.error_count();
        let meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();

        let raw_hosts = spec.hosts.unwrap_or_default();
        if raw_hosts.is_empty() {
            ctx.error("spec.hosts", "at least one host is required");
        }
        let mut hosts = Vec::new();
        // Duplicate checks through sets: a generated list of 100,000 hosts stays linear.
        let mut seen_hosts = HashSet::new();
        for (i, text) in raw_hosts.iter().enumerate() {
            if let Some(host) = convert::host(ctx, &format!("spec.hosts[{i}]"), text) {
                if !seen_hosts.insert(host.clone()) {
                    ctx.error(
                        format!("spec.hosts[{i}]"),
                        format!("host {host} is listed twice"),
                    );
                } else {
                    hosts.push(host);
                }
            }
        }

        let mut addresses = Vec::new();
        for (i, text) in spec.addresses.unwrap_or_default().iter().enumerate() {
            addresses.extend(convert::address(ctx, &format!("spec.addresses[{i}]"), text));
        }

        let mut ports: Vec<ServiceEntryPort> = Vec::new();
        let (mut seen_numbers, mut seen_names) = (HashSet::new(), HashSet::new());
        for (i, raw) in spec.ports.unwrap_or_default().into_iter().enumerate() {
            let at = format!("spec.ports[{i}]");
            let number = convert::port(ctx, &format!("{at}.number"), raw.number);
            let target_port = raw
                .target_port
                .and_then(|t| convert::port(ctx, &format!("{at}.targetPort"), Some(t)));
            let Some(number) = number else { continue };
            if !seen_numbers.insert(number) {
                ctx.error(
                    format!("{at}.number"),
                    format!("port {number} is declared twice"),
                );
            }
            if let Some(name) = &raw.name
                && !seen_names.insert(name.clone())
            {
                ctx.error(
                    format!("{at}.name"),
                    format!("port name {name:?} is used twice"),
                );
            }
            ports.push(ServiceEntryPort {
                number,
                name: raw.name,
                protocol: raw.protocol,
                target_port,
            });
        }

        let location = match spec.location.as_deref() {
            None | Some("MESH_EXTERNAL") => Location::MeshExternal,
            Some("MESH_INTERNAL") => Location::MeshInternal,
            Some(other) => {
                ctx.error(
                    "spec.location",
                    format!("unknown location {other:?}: expected MESH_EXTERNAL or MESH_INTERNAL"),
                );
                Location::MeshExternal
            }
        };
        let resolution = match spec.resolution.as_deref() {
            None | Some("NONE") => Resolution::None,
            Some("STATIC") => Resolution::Static,
            Some("DNS") => Resolution::Dns,
            Some("DNS_ROUND_ROBIN") => Resolution::DnsRoundRobin,
            Some(other) => {
                ctx.error(
                    "spec.resolution",
                    format!("unknown resolution {other:?}: expected NONE, STATIC, DNS or DNS_ROUND_ROBIN"),
                );
                Resolution::None
            }
        };

        let raw_endpoints = spec.endpoints.unwrap_or_default();
        let workload_selector = spec.workload_selector.map(|s| s.labels.unwrap_or_default());
        if !raw_endpoints.is_empty() && workload_selector.is_some() {
            ctx.error(
                "spec.workloadSelector",
                "only one of endpoints and workloadSelector may be set",
            );
        }
        if !raw_endpoints.is_empty() && resolution == Resolution::None {
            ctx.error(
                "spec.endpoints",
                "resolution NONE takes no endpoints (connections go to the original destination)",
            );
        }
        let port_names: BTreeSet<&str> = ports.iter().filter_map(|p| p.name.as_deref()).collect();
        let mut endpoints = Vec::new();
        for (i, raw) in raw_endpoints.into_iter().enumerate() {
            let at = format!("spec.endpoints[{i}]");
            let address = match raw.address.as_deref() {
                None | Some("") => {
                    ctx.error(format!("{at}.address"), "an address is required");
                    continue;
                }
                Some(text) => match text.parse() {
                    Ok(ip) => EndpointAddress::Ip(ip),
                    Err(_) if text.starts_with("unix://") => {
                        ctx.error(
                            format!("{at}.address"),
                            "unix socket endpoints are not supported by this data plane",
                        );
                        continue;
                    }
                    Err(_) if resolution == Resolution::Static => {
                        ctx.error(
                            format!("{at}.address"),
                            format!("{text:?} is not an IP address (resolution STATIC needs IP endpoints; use DNS for host names)"),
                        );
                        continue;
                    }
                    Err(_) if convert::is_dns_name(text) => {
                        EndpointAddress::Host(text.to_ascii_lowercase())
                    }
                    Err(_) => {
                        ctx.error(
                            format!("{at}.address"),
                            format!("{text:?} is neither an IP address nor a host name"),
                        );
                        continue;
                    }
                },
            };
            let eps = named_ports(ctx, &format!("{at}.ports"), raw.ports);
            for name in eps.keys() {
                if !port_names.contains(name.as_str()) {
                    ctx.error(
                        format!("{at}.ports.{name}"),
                        format!("no port named {name:?} in spec.ports"),
                    );
                }
            }
            endpoints.push(ServiceEntryEndpoint {
                address,
                ports: eps,
                labels: raw.labels.unwrap_or_default(),
            });
        }

        if let Some(export_to) = &spec.export_to {
            validate_export_to(ctx, "spec.exportTo", export_to);
        }

        let waypoint = meta.labels.get(USE_WAYPOINT_LABEL).and_then(|name| {
            // `none` opts an object out of a namespace-wide waypoint, as in Istio.
            (name != "none" && !name.is_empty()).then(|| WaypointRef {
                name: name.clone(),
                namespace: meta
                    .labels
                    .get(USE_WAYPOINT_NAMESPACE_LABEL)
                    .filter(|ns| !ns.is_empty())
                    .unwrap_or(&meta.namespace)
                    .clone(),
            })
        });

        (ctx.error_count() == before).then_some(ServiceEntry {
            meta,
            hosts,
            addresses,
            ports,
            location,
            resolution,
            endpoints,
            workload_selector,
            export_to: spec.export_to,
            waypoint,
        })
    }
}

impl RawWorkloadEntry {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<Workload> {
        let before = ctx.error_count();
        let mut meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();
        let ip = match spec.address.as_deref() {
            None | Some("") => {
                ctx.error("spec.address", "an address is required");
                None
            }
            Some(text) => convert::ip(ctx, "spec.address", text),
        };
        let ports = named_ports(ctx, "spec.ports", spec.ports);
        // A WorkloadEntry's own labels are in spec.labels; those are what selectors match.
        if let Some(labels) = spec.labels {
            meta.labels = labels;
        }
        (ctx.error_count() == before).then(|| Workload {
            kind: WorkloadKind::WorkloadEntry,
            meta,
            ips: ip.into_iter().collect(),
            node_name: None,
            ports,
        })
    }
}
