//! `ServiceEntry` and `WorkloadEntry` (networking.istio.io): raw shape and validation.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    sync::Arc,
};

use serde::Deserialize;

use super::{
    convert::{self, RawEnum, RawMeta},
    error::{ConfigError, Ctx},
    labels::Labels,
    mesh::validate_export_to,
    model::{
        ALLOCATION_V4, ALLOCATION_V6, Address, Host, Location, Resolution, ServiceEntry,
        ServiceEntryEndpoint, ServiceEntryPort, StatusAddress, UseWaypoint, WaypointRef, Workload,
        WorkloadAddress, WorkloadKind, in_allocation_ranges,
    },
    workload_names::entry_workload,
};

pub(super) const USE_WAYPOINT_LABEL: &str = "istio.io/use-waypoint";
pub(super) const USE_WAYPOINT_NAMESPACE_LABEL: &str = "istio.io/use-waypoint-namespace";

#[derive(Debug, Deserialize)]
pub(crate) struct RawServiceEntry {
    metadata: Option<RawMeta>,
    spec: Option<RawServiceEntrySpec>,
    status: Option<RawServiceEntryStatus>,
}

/// What a controller wrote: only the addresses Istio's allocator gave each host are read.
#[derive(Debug, Default, Deserialize)]
struct RawServiceEntryStatus {
    addresses: Option<Vec<RawStatusAddress>>,
}

#[derive(Debug, Default, Deserialize)]
struct RawStatusAddress {
    value: Option<String>,
    host: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawServiceEntrySpec {
    hosts: Option<Vec<String>>,
    addresses: Option<Vec<String>>,
    ports: Option<Vec<RawPort>>,
    location: Option<RawEnum>,
    resolution: Option<RawEnum>,
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
    network: Option<String>,
    #[serde(rename = "serviceAccount")]
    service_account: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawWorkloadEntry {
    metadata: Option<RawMeta>,
    spec: Option<RawWorkloadEntrySpec>,
}

/// Istio's proto numbering of `ServiceEntry.Location`.
const LOCATIONS: &[(&str, i64, Location)] = &[
    ("MESH_EXTERNAL", 0, Location::MeshExternal),
    ("MESH_INTERNAL", 1, Location::MeshInternal),
];

/// Istio's proto numbering of `ServiceEntry.Resolution`.
const RESOLUTIONS: &[(&str, i64, Resolution)] = &[
    ("NONE", 0, Resolution::None),
    ("STATIC", 1, Resolution::Static),
    ("DNS", 2, Resolution::Dns),
    ("DNS_ROUND_ROBIN", 3, Resolution::DnsRoundRobin),
    ("DYNAMIC_DNS", 4, Resolution::DynamicDns),
];

/// An endpoint or WorkloadEntry address: an IP, a host name, or a unix socket (`unix:///path`,
/// `unix://@abstract`), with Istio's reasons for refusing a socket path.
fn workload_address(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<WorkloadAddress> {
    if let Ok(ip) = text.parse::<std::net::IpAddr>() {
        // The proxy dials endpoints from the node: these would reach the node itself, not a
        // workload (docs/data-plane.md#destinations-the-proxy-refuses).
        if let Some(what) = node_local(ip) {
            ctx.error(
                field,
                format!("{text:?} is {what}: the agent dials endpoints from the node, so it would reach the node itself"),
            );
            return None;
        }
        return Some(WorkloadAddress::Ip(ip));
    }
    if let Some(path) = text.strip_prefix("unix://") {
        let problem = if path.starts_with('@') {
            (path.len() == 1).then_some("UDS abstract socket needs a name")
        } else if !path.starts_with('/') {
            Some("UDS must be an absolute path or abstract socket")
        } else if path.ends_with('/') {
            Some("UDS may not be a dir")
        } else {
            None
        };
        return match problem {
            Some(message) => {
                ctx.error(field, format!("{text:?}: {message}"));
                None
            }
            None => Some(WorkloadAddress::Unix(text.to_string())),
        };
    }
    let name = text.trim_end_matches('.');
    if name.bytes().all(|c| c.is_ascii_digit() || c == b'.') {
        ctx.error(field, format!("{text:?} is not a valid IP address"));
        None
    } else if text.contains('*') {
        ctx.error(field, format!("{text:?} must not contain a wildcard"));
        None
    } else if convert::is_dns_name(name) {
        Some(WorkloadAddress::Host(name.to_ascii_lowercase()))
    } else {
        ctx.error(
            field,
            format!("{text:?} is neither an IP address, a host name nor a unix socket"),
        );
        None
    }
}

/// What a loopback, unspecified or link-local address is, in words; `None` for any other.
fn node_local(ip: std::net::IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) if v4.is_loopback() => Some("a loopback address"),
        std::net::IpAddr::V4(v4) if v4.octets()[0] == 0 => Some("an unspecified address"),
        std::net::IpAddr::V4(v4) if v4.is_link_local() => Some("a link-local address"),
        std::net::IpAddr::V6(v6) if v6.is_loopback() => Some("a loopback address"),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => Some("an unspecified address"),
        std::net::IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("a link-local address"),
        _ => None,
    }
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

/// Reads the waypoint labels of an object or a namespace. The waypoint's namespace is
/// `istio.io/use-waypoint-namespace`, else `default_namespace` (the object's own, or the labelled
/// namespace itself). `none` opts out; the namespace label alone binds nothing.
pub(crate) fn use_waypoint(labels: &Labels, default_namespace: &str) -> UseWaypoint {
    match labels.get(USE_WAYPOINT_LABEL).map(String::as_str) {
        None | Some("") => UseWaypoint::Unset,
        Some("none") => UseWaypoint::Opted,
        Some(name) => UseWaypoint::Use(WaypointRef {
            name: name.to_string(),
            namespace: labels
                .get(USE_WAYPOINT_NAMESPACE_LABEL)
                .filter(|ns| !ns.is_empty())
                .map_or(default_namespace, String::as_str)
                .to_string(),
        }),
    }
}

impl RawServiceEntry {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<ServiceEntry> {
        let before = ctx.error_count();
        let meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();

        let raw_hosts = spec.hosts.unwrap_or_default();
        let hosts = hosts(ctx, &raw_hosts);
        let mut addresses = Vec::new();
        for (i, text) in spec.addresses.unwrap_or_default().iter().enumerate() {
            addresses.extend(convert::address(ctx, &format!("spec.addresses[{i}]"), text));
        }
        let ports = ports(ctx, spec.ports.unwrap_or_default());
        let location = spec
            .location
            .and_then(|raw| convert::enum_value(ctx, "spec.location", &raw, "location", LOCATIONS))
            .unwrap_or_default();
        let resolution = spec
            .resolution
            .and_then(|raw| {
                convert::enum_value(ctx, "spec.resolution", &raw, "resolution", RESOLUTIONS)
            })
            .unwrap_or_default();
        let raw_endpoints = spec.endpoints.unwrap_or_default();
        let workload_selector = spec.workload_selector.map(|s| s.labels.unwrap_or_default());
        let shape = Shape {
            hosts: &raw_hosts,
            addresses: &addresses,
            ports: &ports,
            resolution,
            endpoints: raw_endpoints.len(),
            workload_selector: workload_selector.as_ref(),
        };
        shape.check(ctx);
        let endpoints = endpoints(ctx, raw_endpoints, resolution, &ports);
        if let Some(export_to) = &spec.export_to {
            validate_export_to(ctx, "spec.exportTo", export_to);
        }

        let use_waypoint = use_waypoint(&meta.labels, &meta.namespace);
        let (status_addresses, refused_status) =
            status_addresses(ctx, self.status.and_then(|s| s.addresses));

        // Held for as long as the entry is in force: each list at its length, not at the capacity
        // it grew to (four slots at the first push; an endpoint is 80 bytes).
        (ctx.error_count() == before).then_some(ServiceEntry {
            meta,
            hosts: exact(hosts),
            addresses: exact(addresses),
            ports: exact(ports),
            location,
            resolution,
            endpoints: exact(endpoints),
            workload_selector,
            export_to: spec.export_to.map(exact),
            use_waypoint,
            status_addresses: exact(status_addresses),
            refused_status: exact(refused_status),
        })
    }
}

/// `spec.hosts`: at least one, each valid and listed once.
fn hosts(ctx: &mut Ctx<'_>, raw_hosts: &[String]) -> Vec<Host> {
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
    hosts
}

/// `spec.ports`: each number valid and declared once, each name used once.
fn ports(ctx: &mut Ctx<'_>, raw_ports: Vec<RawPort>) -> Vec<ServiceEntryPort> {
    let mut ports: Vec<ServiceEntryPort> = Vec::new();
    let (mut seen_numbers, mut seen_names) = (HashSet::new(), HashSet::new());
    for (i, raw) in raw_ports.into_iter().enumerate() {
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
    ports
}

/// What an entry's fields must agree on between them, whatever each says alone.
struct Shape<'a> {
    hosts: &'a [String],
    addresses: &'a [Address],
    ports: &'a [ServiceEntryPort],
    resolution: Resolution,
    /// How many endpoints it lists.
    endpoints: usize,
    workload_selector: Option<&'a Labels>,
}

impl Shape<'_> {
    fn check(&self, ctx: &mut Ctx<'_>) {
        let resolution = self.resolution;
        if self.addresses.iter().any(|a| matches!(a, Address::Cidr(_)))
            && !matches!(resolution, Resolution::None | Resolution::Static)
        {
            ctx.error(
                "spec.addresses",
                "CIDR addresses are allowed only for NONE/STATIC resolution types",
            );
        }
        for (key, value) in self.workload_selector.into_iter().flatten() {
            if key.contains('*') || value.contains('*') {
                ctx.error(
                    format!("spec.workloadSelector.labels.{key}"),
                    "wildcard is not supported in selector",
                );
            }
        }
        if resolution == Resolution::DynamicDns {
            dynamic_dns_shape(
                ctx,
                self.hosts,
                self.addresses,
                self.ports,
                self.endpoints > 0,
            );
        }
        if resolution == Resolution::DnsRoundRobin && self.endpoints > 1 {
            ctx.error(
                "spec.endpoints",
                "DNS_ROUND_ROBIN mode cannot have multiple endpoints",
            );
        }
        if self.endpoints > 0 && self.workload_selector.is_some() {
            ctx.error(
                "spec.workloadSelector",
                "only one of endpoints and workloadSelector may be set",
            );
        }
        if self.endpoints > 0 && resolution == Resolution::None {
            ctx.error(
                "spec.endpoints",
                "resolution NONE takes no endpoints (connections go to the original destination)",
            );
        }
    }
}

/// `spec.endpoints`: each with an address the resolution can use, and only ports `spec.ports`
/// names.
fn endpoints(
    ctx: &mut Ctx<'_>,
    raw_endpoints: Vec<RawWorkloadEntrySpec>,
    resolution: Resolution,
    ports: &[ServiceEntryPort],
) -> Vec<ServiceEntryEndpoint> {
    let port_names: BTreeSet<&str> = ports.iter().filter_map(|p| p.name.as_deref()).collect();
    let mut endpoints = Vec::new();
    for (i, raw) in raw_endpoints.into_iter().enumerate() {
        let at = format!("spec.endpoints[{i}]");
        let field = format!("{at}.address");
        let address = match raw.address.as_deref() {
            None | Some("") => {
                ctx.error(&field, "an address is required");
                continue;
            }
            Some(text) => match workload_address(ctx, &field, text) {
                Some(WorkloadAddress::Host(_)) if resolution == Resolution::Static => {
                    ctx.error(
                        &field,
                        format!("{text:?} is not an IP address (resolution STATIC needs IP endpoints; use DNS for host names)"),
                    );
                    continue;
                }
                Some(WorkloadAddress::Unix(_)) if resolution != Resolution::Static => {
                    ctx.error(&field, "a unix socket endpoint needs resolution STATIC");
                    continue;
                }
                Some(address) => address,
                None => continue,
            },
        };
        if matches!(address, WorkloadAddress::Unix(_)) && raw.ports.is_some() {
            ctx.error(format!("{at}.ports"), "UDS may not include ports");
        }
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
    endpoints
}

/// The addresses of `status.addresses` the entry may use, and an error for each one refused
/// (docs/visibility.md#istios-allocations). Istio's allocator writes only addresses of its two
/// ranges, [`ALLOCATION_V4`] and [`ALLOCATION_V6`]: any other value (loopback, link-local, another
/// entry's or a Service's address, a public one, the agent's own gateway) would have the agent
/// answer and claim an address that no declaration gave, so it is refused. Written by the control
/// plane, not by the entry's author: a refused value is never a reason to refuse the entry; it is
/// left out (its host is allocated as if it had none) and its error kept with the entry.
fn status_addresses(
    ctx: &Ctx<'_>,
    raw: Option<Vec<RawStatusAddress>>,
) -> (Vec<StatusAddress>, Vec<ConfigError>) {
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    for (i, raw) in raw.unwrap_or_default().into_iter().enumerate() {
        let at = format!("status.addresses[{i}]");
        let ip = match raw.value.as_deref() {
            None => Err(("value", "a value is required".to_string())),
            Some(text) => match text.parse::<IpAddr>() {
                Err(_) => Err(("value", format!("{text:?} is not an IP address"))),
                Ok(ip) if !in_allocation_ranges(ip) => Err((
                    "value",
                    format!(
                        "{text:?} is outside {ALLOCATION_V4} and {ALLOCATION_V6}, the only addresses Istio's allocator writes"
                    ),
                )),
                Ok(ip) => Ok(ip),
            },
        };
        let host = raw.host.as_deref().filter(|h| !h.is_empty());
        let checked = ip.and_then(|ip| match host {
            Some(host) => Ok(StatusAddress {
                host: host.to_ascii_lowercase(),
                ip,
            }),
            None => Err(("host", "a host is required".to_string())),
        });
        match checked {
            Ok(address) => accepted.push(address),
            Err((field, message)) => refused.push(ctx.kept_error(
                format!("{at}.{field}"),
                format!("{message}: not used (neither answered nor claimed); the entry stays"),
            )),
        }
    }
    (accepted, refused)
}

fn exact<T>(mut list: Vec<T>) -> Vec<T> {
    list.shrink_to_fit();
    list
}

/// Port protocols a dynamic forward proxy takes the host name from (compared case-insensitively).
const DYNAMIC_DNS_PROTOCOLS: &[&str] = &["HTTP", "HTTP2", "GRPC", "TLS"];

/// Istio's rules for `DYNAMIC_DNS`, with its messages: the host name comes from each request, so
/// hosts must be wildcards, nothing may fix addresses or endpoints, and every port must carry a
/// protocol that names its host (a port without a protocol names none).
fn dynamic_dns_shape(
    ctx: &mut Ctx<'_>,
    hosts: &[String],
    addresses: &[Address],
    ports: &[ServiceEntryPort],
    has_endpoints: bool,
) {
    for (i, host) in hosts.iter().enumerate() {
        if !host.starts_with('*') {
            ctx.error(
                format!("spec.hosts[{i}]"),
                "host must be wildcarded for resolution mode DYNAMIC_DNS",
            );
        }
    }
    if !addresses.is_empty() {
        ctx.error(
            "spec.addresses",
            "addresses cannot be set for resolution type DYNAMIC_DNS",
        );
    }
    if has_endpoints {
        ctx.error(
            "spec.endpoints",
            "endpoints cannot be set for resolution type DYNAMIC_DNS",
        );
    }
    for (i, port) in ports.iter().enumerate() {
        let protocol = port.protocol.as_deref().unwrap_or("");
        if !DYNAMIC_DNS_PROTOCOLS
            .iter()
            .any(|p| p.eq_ignore_ascii_case(protocol))
        {
            ctx.error(
                format!("spec.ports[{i}].protocol"),
                "only HTTP, TLS, GRPC, and HTTP2 protocols are supported",
            );
        }
    }
}

impl RawWorkloadEntry {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<Workload> {
        let before = ctx.error_count();
        let mut meta = convert::meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();
        // Istio accepts a WorkloadEntry with only a network (reached through that network's gateway).
        let address = match spec.address.as_deref() {
            None | Some("") if spec.network.as_deref().is_some_and(|n| !n.is_empty()) => None,
            None | Some("") => {
                ctx.error(
                    "spec.address",
                    "Address is required (or a network, for a workload behind its gateway)",
                );
                None
            }
            Some(text) => workload_address(ctx, "spec.address", text),
        };
        if matches!(address, Some(WorkloadAddress::Unix(_))) && spec.ports.is_some() {
            ctx.error("spec.ports", "UDS may not include ports");
        }
        let ports = named_ports(ctx, "spec.ports", spec.ports);
        // A WorkloadEntry's own labels are in spec.labels; those are what selectors match.
        if let Some(labels) = spec.labels {
            meta.labels = labels;
        }
        let service_account = spec.service_account.filter(|sa| !sa.is_empty());
        // The annotation of a WorkloadGroup's registration is not read: entries written by hand
        // carry none.
        let workload = entry_workload(&meta.name, None, &meta.labels);
        let workload_name = (workload != meta.name).then(|| Arc::from(workload));
        (ctx.error_count() == before).then(|| Workload {
            kind: WorkloadKind::WorkloadEntry,
            meta,
            ips: match &address {
                Some(WorkloadAddress::Ip(ip)) => vec![*ip],
                _ => Vec::new(),
            },
            node_name: None,
            service_account,
            ports,
            other_address: address.filter(|a| !matches!(a, WorkloadAddress::Ip(_))),
            workload_name,
            never_enrolled: false,
        })
    }
}
