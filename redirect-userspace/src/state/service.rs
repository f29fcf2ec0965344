//! A service as the data plane sees it: one per ServiceEntry host (as ztunnel does) or per Kubernetes
//! Service, with its addresses, ports and, per port, the endpoints to connect to.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::atomic::AtomicUsize,
};

use ipnet::IpNet;
use serde::Serialize;

use crate::config::{EndpointAddress, Resolution, Timestamp, WaypointRef};

/// What the data plane was told about a service's reach. NONE entries never get here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ServiceVisibility {
    Public,
    Namespace,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ServiceKind {
    ServiceEntry,
    /// A Kubernetes Service: always PUBLIC.
    Service,
}

#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    /// Lower case; `*.example.com` for a wildcard host.
    pub hostname: String,
    pub kind: ServiceKind,
    pub visibility: ServiceVisibility,
    pub resolution: Resolution,
    pub vips_v4: Vec<Ipv4Addr>,
    pub vips_v6: Vec<Ipv6Addr>,
    pub cidrs: Vec<IpNet>,
    pub ports: Vec<Port>,
    /// The bound waypoint; `None` without one or when the binding was refused.
    pub waypoint: Option<WaypointRef>,
    /// Where the bound waypoint is reached: the cluster IP of its Service (the Service Istio
    /// deploys beside a waypoint Gateway, of the same name), IPv4 first. `None` while no such
    /// Service is known: as upstream, the service is then reached without a waypoint.
    pub waypoint_address: Option<IpAddr>,
    pub created: Option<Timestamp>,
    /// Round-robin position, shared by all ports; relaxed ordering is enough to spread load.
    pub(crate) next_endpoint: AtomicUsize,
}

impl Service {
    /// Visible to a client in `client_ns` (`None`: a client that is not a known workload).
    pub fn visible_to(&self, client_ns: Option<&str>) -> bool {
        self.visibility == ServiceVisibility::Public || client_ns == Some(self.namespace.as_str())
    }

    pub fn port(&self, number: u16) -> Option<&Port> {
        self.ports.iter().find(|p| p.port == number)
    }

    pub fn has_addresses(&self) -> bool {
        !self.vips_v4.is_empty() || !self.vips_v6.is_empty()
    }

    /// The waypoint a connection to this service goes through: bound, and its address known.
    pub fn waypoint_route(&self) -> Option<(&WaypointRef, IpAddr)> {
        Some((self.waypoint.as_ref()?, self.waypoint_address?))
    }

    pub fn vips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.vips_v4
            .iter()
            .map(|ip| IpAddr::V4(*ip))
            .chain(self.vips_v6.iter().map(|ip| IpAddr::V6(*ip)))
    }

    /// The rank key shared by every client: a Kubernetes Service before any ServiceEntry, whatever
    /// their ages (upstream: "a Kubernetes Service always wins, else the oldest"); then oldest first
    /// (no timestamp counts as newest), then `namespace/name`, then host name. The client's own
    /// namespace is ranked first at lookup time.
    pub(crate) fn rank_key(&self) -> (bool, bool, Option<Timestamp>, &str, &str, &str) {
        (
            self.kind != ServiceKind::Service,
            self.created.is_none(),
            self.created,
            &self.namespace,
            &self.name,
            &self.hostname,
        )
    }
}

/// `namespace/name`, the way the CLI and logs name a service.
impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub port: u16,
    pub name: Option<String>,
    pub protocol: Option<String>,
    /// The declared target port (or the port itself), for dumps; endpoints carry their own.
    pub target_port: u16,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub address: EndpointAddress,
    pub port: u16,
    /// `namespace/name` of the Pod or WorkloadEntry behind it, if any.
    pub workload: Option<String>,
}

impl Endpoint {
    pub fn target(&self) -> Target<'_> {
        match &self.address {
            EndpointAddress::Ip(ip) => Target::Addr(SocketAddr::new(*ip, self.port)),
            EndpointAddress::Host(name) => Target::Host {
                name,
                port: self.port,
            },
        }
    }
}

/// Where to connect: an address, or a host name the proxy resolves through the upstream resolver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    Addr(SocketAddr),
    Host { name: &'a str, port: u16 },
}

impl fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Addr(addr) => write!(f, "{addr}"),
            Target::Host { name, port } => write!(f, "{name}:{port}"),
        }
    }
}
