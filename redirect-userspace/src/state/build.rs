//! Model + resolution -> the data plane's services. NONE entries are dropped here, so no lookup,
//! DNS answer or dump can ever see them.
use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    sync::{Arc, atomic::AtomicUsize},
};

use super::service::{Endpoint, Port, Service, ServiceKind, ServiceVisibility};
use crate::{
    config::{
        Address, EndpointAddress, EndpointSlice, Host, Model, Resolution, ServiceEntry,
        ServiceEntryPort, ServicePort, TargetPort, Visibility, WaypointRef, Workload, selects,
    },
    visibility::{Discovery, ResolvedEntry},
};

/// Every service of `model`, in rank order.
pub(crate) fn services(
    model: &Model,
    resolution: &crate::visibility::Resolved,
) -> Vec<Arc<Service>> {
    let entries = model.service_entries.iter().map(|e| &**e);
    let mut out = entry_services(model, entries.zip(&resolution.entries));
    out.extend(kube_services(model, &resolution.discovery));
    sort(&mut out);
    out
}

/// Services in rank order.
pub(crate) fn sort(services: &mut [Arc<Service>]) {
    services.sort_by(|a, b| a.rank_key().cmp(&b.rank_key()));
}

/// The services of these ServiceEntries, each with its resolution: one per published host.
pub(crate) fn entry_services<'a>(
    model: &Model,
    entries: impl IntoIterator<Item = (&'a ServiceEntry, &'a ResolvedEntry)>,
) -> Vec<Arc<Service>> {
    let mut out = Vec::new();
    let waypoints = WaypointAddresses::new(model);
    for (entry, resolved) in entries {
        let visibility = match resolved.visibility {
            Visibility::None => continue,
            Visibility::Public => ServiceVisibility::Public,
            Visibility::Namespace => ServiceVisibility::Namespace,
        };
        for host in &entry.hosts {
            let hostname = host.to_string();
            if resolved.publishes(&hostname) {
                let mut service =
                    from_service_entry(model, entry, resolved, host, hostname, visibility);
                service.waypoint_address = service.waypoint.as_ref().and_then(|w| waypoints.get(w));
                out.push(Arc::new(service));
            }
        }
    }
    out
}

/// The address of each waypoint by `(namespace, name)`: the first cluster IP (IPv4 first) of the
/// Service of that name. Indexed on first use: most models bind no waypoint.
struct WaypointAddresses<'m> {
    model: &'m Model,
    index: std::cell::OnceCell<HashMap<(&'m str, &'m str), IpAddr>>,
}

impl<'m> WaypointAddresses<'m> {
    fn new(model: &'m Model) -> Self {
        WaypointAddresses {
            model,
            index: std::cell::OnceCell::new(),
        }
    }

    fn get(&self, waypoint: &WaypointRef) -> Option<IpAddr> {
        let index = self.index.get_or_init(|| {
            self.model
                .services
                .iter()
                .filter_map(|svc| {
                    let ips = &svc.cluster_ips;
                    let ip = ips.iter().find(|ip| ip.is_ipv4()).or(ips.first())?;
                    Some(((svc.meta.namespace.as_str(), svc.meta.name.as_str()), *ip))
                })
                .collect()
        });
        index
            .get(&(waypoint.namespace.as_str(), waypoint.name.as_str()))
            .copied()
    }
}

/// The services of the Kubernetes Services of the namespaces `discovery` sees.
pub(crate) fn kube_services(model: &Model, discovery: &Discovery) -> Vec<Arc<Service>> {
    let mut out = Vec::with_capacity(model.services.len());
    // The EndpointSlices of each Service: when it has any, they say its endpoints, not its selector.
    let mut slices: HashMap<(&str, &str), Vec<&EndpointSlice>> = HashMap::new();
    for slice in &model.endpoint_slices {
        if !slice.service.is_empty() {
            slices
                .entry((&slice.namespace, &slice.service))
                .or_default()
                .push(slice);
        }
    }
    for svc in model
        .services
        .iter()
        .filter(|s| discovery.sees(&s.meta.namespace))
    {
        let slices = slices.get(&(svc.meta.namespace.as_str(), svc.meta.name.as_str()));
        let selected: Vec<&Workload> = match &svc.selector {
            Some(_) if slices.is_some() => Vec::new(),
            Some(selector) => model
                .workloads
                .iter()
                .map(|w| &**w)
                .filter(|w| {
                    w.meta.namespace == svc.meta.namespace && selects(selector, &w.meta.labels)
                })
                .collect(),
            None => Vec::new(),
        };
        let ports = svc
            .ports
            .iter()
            .map(|p| Port {
                port: p.port,
                name: p.name.clone(),
                protocol: p.protocol.clone(),
                target_port: match p.target_port {
                    TargetPort::Number(n) => n,
                    TargetPort::Name(_) => p.port,
                },
                endpoints: match slices {
                    Some(slices) => slice_endpoints(slices, p, &svc.meta.namespace),
                    None => selected
                        .iter()
                        .filter_map(|w| {
                            let port = match &p.target_port {
                                TargetPort::Number(n) => *n,
                                // A pod without that named port is not an endpoint for this port.
                                TargetPort::Name(name) => *w.ports.get(name)?,
                            };
                            workload_endpoint(w, port)
                        })
                        .collect(),
                },
            })
            .collect();
        let (vips_v4, vips_v6) = split_ips(svc.cluster_ips.iter().copied());
        out.push(Arc::new(Service {
            name: svc.meta.name.clone(),
            namespace: svc.meta.namespace.clone(),
            hostname: svc.hostname(&model.cluster_domain),
            kind: ServiceKind::Service,
            visibility: ServiceVisibility::Public,
            resolution: Resolution::Static,
            vips_v4,
            vips_v6,
            cidrs: Vec::new(),
            ports,
            waypoint: None,
            waypoint_address: None,
            created: svc.meta.creation_timestamp,
            next_endpoint: AtomicUsize::new(0),
        }));
    }
    out
}

fn from_service_entry(
    model: &Model,
    entry: &ServiceEntry,
    resolved: &ResolvedEntry,
    host: &Host,
    hostname: String,
    visibility: ServiceVisibility,
) -> Service {
    // Declared addresses belong to every host; allocated ones to their own host.
    let ips: Vec<IpAddr> = if entry.addresses.is_empty() {
        resolved
            .allocated
            .iter()
            .filter(|a| a.host == hostname)
            .flat_map(|a| a.addresses())
            .collect()
    } else {
        entry
            .addresses
            .iter()
            .filter_map(|a| match a {
                Address::Ip(ip) => Some(*ip),
                Address::Cidr(_) => None,
            })
            .collect()
    };
    let cidrs = entry
        .addresses
        .iter()
        .filter_map(|a| match a {
            Address::Cidr(net) => Some(*net),
            Address::Ip(_) => None,
        })
        .collect();
    let selected: Vec<&Workload> = match &entry.workload_selector {
        Some(selector) => model
            .workloads
            .iter()
            .map(|w| &**w)
            .filter(|w| {
                w.meta.namespace == entry.meta.namespace && selects(selector, &w.meta.labels)
            })
            .collect(),
        None => Vec::new(),
    };
    let ports = entry
        .ports
        .iter()
        .map(|p| Port {
            port: p.number,
            name: p.name.clone(),
            protocol: p.protocol.clone(),
            target_port: p.target_port.unwrap_or(p.number),
            // Held for the snapshot's life: at its length, not the four slots the first push made.
            endpoints: {
                let mut endpoints = se_endpoints(entry, host, p, &selected);
                endpoints.shrink_to_fit();
                endpoints
            },
        })
        .collect();
    let (vips_v4, vips_v6) = split_ips(ips.into_iter());
    Service {
        name: entry.meta.name.clone(),
        namespace: entry.meta.namespace.clone(),
        hostname,
        kind: ServiceKind::ServiceEntry,
        visibility,
        resolution: entry.resolution,
        vips_v4,
        vips_v6,
        cidrs,
        ports,
        waypoint: resolved.waypoint.clone(),
        waypoint_address: None,
        created: entry.meta.creation_timestamp,
        next_endpoint: AtomicUsize::new(0),
    }
}

/// The endpoints of one ServiceEntry port. An endpoint's named port (a ServiceEntry endpoint's or
/// WorkloadEntry's `ports`, a Pod's container port of that name) wins over `targetPort`, which wins
/// over the port number, as in Istio.
fn se_endpoints(
    entry: &ServiceEntry,
    host: &Host,
    port: &ServiceEntryPort,
    selected: &[&Workload],
) -> Vec<Endpoint> {
    let default_port = port.target_port.unwrap_or(port.number);
    let named = |ports: &std::collections::BTreeMap<String, u16>| {
        port.name
            .as_ref()
            .and_then(|n| ports.get(n))
            .copied()
            .unwrap_or(default_port)
    };
    if entry.resolution == Resolution::None {
        return Vec::new();
    }
    if !entry.endpoints.is_empty() {
        // A unix socket endpoint stays in the model but is never a destination for this proxy.
        return entry
            .endpoints
            .iter()
            .filter_map(|ep| {
                Some(Endpoint {
                    address: ep.address.reachable()?,
                    port: named(&ep.ports),
                    workload: None,
                })
            })
            .collect();
    }
    if entry.workload_selector.is_some() {
        // A Pod's container port of the entry port's name, as a WorkloadEntry's named port.
        return selected
            .iter()
            .filter_map(|w| workload_endpoint(w, named(&w.ports)))
            .collect();
    }
    // Resolution DNS without endpoints: connect to the host itself, resolved upstream.
    match host {
        Host::Exact(name) if entry.resolution.resolves_names() => vec![Endpoint {
            address: EndpointAddress::Host(name.clone()),
            port: default_port,
            workload: None,
        }],
        _ => Vec::new(),
    }
}

/// A Service port's endpoints from its slices: each slice's port of the same name (empty for an
/// unnamed port) at each of the slice's ready addresses, once each.
fn slice_endpoints(
    slices: &[&EndpointSlice],
    port: &ServicePort,
    namespace: &str,
) -> Vec<Endpoint> {
    let name = port.name.as_deref().unwrap_or("");
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for slice in slices {
        let Some(&(_, number)) = slice.ports.iter().find(|(n, _)| n == name) else {
            continue;
        };
        for ep in &slice.endpoints {
            if seen.insert((ep.ip, number)) {
                out.push(Endpoint {
                    address: EndpointAddress::Ip(ep.ip),
                    port: number,
                    workload: ep.pod.as_ref().map(|pod| format!("{namespace}/{pod}")),
                });
            }
        }
    }
    out
}

/// A workload's endpoint: its first IPv4 address, else its first address (the agent reaches either
/// family, whatever the family the client connected with), else a WorkloadEntry's host name. A unix
/// socket or a network-only WorkloadEntry is none.
fn workload_endpoint(w: &Workload, port: u16) -> Option<Endpoint> {
    let address = match w.ips.iter().find(|ip| ip.is_ipv4()).or(w.ips.first()) {
        Some(ip) => EndpointAddress::Ip(*ip),
        None => w.other_address.as_ref()?.reachable()?,
    };
    Some(Endpoint {
        address,
        port,
        workload: Some(format!("{}/{}", w.meta.namespace, w.meta.name)),
    })
}

fn split_ips(
    ips: impl Iterator<Item = IpAddr>,
) -> (Vec<std::net::Ipv4Addr>, Vec<std::net::Ipv6Addr>) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ip in ips {
        match ip.to_canonical() {
            IpAddr::V4(ip) if !v4.contains(&ip) => v4.push(ip),
            IpAddr::V6(ip) if !v6.contains(&ip) => v6.push(ip),
            _ => {}
        }
    }
    (v4, v6)
}
