//! What a client in a namespace gets for a host name or an IP, and why: the report `redirect
//! explain` prints offline and the admin server's `/explain` gives for the snapshot in force. Calls
//! the very `state` lookups the proxy and the DNS proxy call, so the three cannot drift.
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

mod authz;

pub use authz::{AuthorizationReport, Over, authorize};

use crate::fastpath::{self, DecidedBy};
use crate::state::{
    DnsDecision, NoUpstreamReason, Outbound, OutboundDecision, OutboundOutcome, PassthroughReason,
    Pick, Service, Snapshot,
};

#[derive(Debug, Clone, Copy)]
pub struct Destination {
    pub ip: IpAddr,
    pub port: Option<u16>,
}

pub(crate) fn parse_destination(text: &str) -> Result<Destination, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(Destination {
            ip: addr.ip(),
            port: Some(addr.port()),
        });
    }
    text.parse::<IpAddr>()
        .map(|ip| Destination { ip, port: None })
        .map_err(|_| format!("{text:?} is not IP, IP:PORT or [IPv6]:PORT"))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Client {
    pub namespace: String,
    /// `namespace/name` of the pod the running agent knows the client as (`/explain?from=POD`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct HostExplanation {
    pub client: Client,
    pub dns: DnsReport,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsReport {
    pub action: DnsAction,
    pub service: Option<String>,
    pub addresses: Vec<IpAddr>,
    /// The query (as the resolver sends it) that decided.
    pub query: String,
    pub cname: Option<String>,
    pub hidden: Option<String>,
    /// Every query the resolver would send, in order, until one is answered.
    pub queries: Vec<QueryReport>,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueryReport {
    pub name: String,
    pub action: DnsAction,
}

/// What the DNS proxy does with a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DnsAction {
    /// The agent answers, authoritatively.
    Answer,
    /// The query goes to the upstream resolver unchanged.
    Forward,
}

impl DnsAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Answer => "answer",
            Self::Forward => "forward",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct IpExplanation {
    pub client: Client,
    pub outbound: OutboundReport,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OutboundReport {
    /// Never `error`: that is the proxy's, when carrying the decision out fails.
    pub action: OutboundOutcome,
    pub service: Option<String>,
    /// Where the next connection would go (`ip:port` or `host:port`); null for a reset.
    pub endpoint: Option<String>,
    pub workload: Option<String>,
    /// All endpoints of the service port, round robin order.
    pub candidates: Vec<String>,
    pub hidden: Option<String>,
    pub port: Option<u16>,
    /// Who decides it under `run` as shipped (with `--no-fast-path`, always the proxy): `kernel` or `proxy`.
    pub decided_by: DecidedBy,
    pub reason: String,
    /// When the connection reaches a Pod of this node: how its authorization policies decide it
    /// ([`authorize`] fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<AuthorizationReport>,
}

fn vis(s: &Service) -> &'static str {
    match s.visibility {
        crate::state::ServiceVisibility::Public => "Public",
        crate::state::ServiceVisibility::Namespace => "Namespace",
    }
}

/// Sends the queries a pod's resolver would send, in order, through `Snapshot::decide_dns`; the first
/// one the agent answers decides. Forwarded ones are up to the upstream resolver.
pub fn explain_host(snapshot: &Snapshot, namespace: &str, host: &str) -> HostExplanation {
    let queries = snapshot.search_domains(Some(namespace)).expand(host);
    let mut reports = Vec::new();
    let mut hidden: Option<String> = None;
    let mut decided = None;
    for query in &queries {
        let decision = snapshot.decide_dns(Some(namespace), query);
        hidden = hidden.or(decision.hidden().map(|s| s.to_string()));
        match decision {
            DnsDecision::Answer(a) => {
                reports.push(QueryReport {
                    name: query.clone(),
                    action: DnsAction::Answer,
                });
                let mut addresses: Vec<IpAddr> = a.v4().iter().map(|&ip| ip.into()).collect();
                addresses.extend(a.v6().iter().map(|&ip| IpAddr::from(ip)));
                let mut reason = format!(
                    "{} ({}) owns {} and is visible to {namespace}: the agent answers (TTL 30s)",
                    a.service,
                    vis(a.service),
                    a.service.hostname
                );
                if let Some(target) = a.cname {
                    reason.push_str(&format!(
                        "; a search domain was stripped, so the answer is a CNAME to {target}"
                    ));
                }
                if addresses.is_empty() {
                    reason.push_str("; it has no address, so the answer is empty (NOERROR)");
                }
                decided = Some(DnsReport {
                    action: DnsAction::Answer,
                    service: Some(a.service.to_string()),
                    addresses,
                    query: query.clone(),
                    cname: a.cname.map(String::from),
                    hidden: None,
                    queries: Vec::new(),
                    reason,
                });
                break;
            }
            DnsDecision::Forward { .. } => reports.push(QueryReport {
                name: query.clone(),
                action: DnsAction::Forward,
            }),
        }
    }
    let mut dns = decided.unwrap_or_else(|| DnsReport {
        action: DnsAction::Forward,
        service: None,
        addresses: Vec::new(),
        query: queries.last().cloned().unwrap_or_default(),
        cname: None,
        hidden: None,
        queries: Vec::new(),
        reason: match &hidden {
            Some(h) => format!(
                "{h} owns the name but is hidden from {namespace}: every query goes to the upstream resolver, as if it did not exist"
            ),
            None => "no service visible to this namespace owns the name: every query goes to the upstream resolver".to_string(),
        },
    });
    dns.hidden = hidden;
    dns.queries = reports;
    HostExplanation {
        client: Client {
            namespace: namespace.to_string(),
            pod: None,
        },
        dns,
    }
}

/// Runs `Snapshot::decide_outbound_with(.., Pick::Peek)`: the decision the proxy's next connection would get.
/// Without a port, a service's first declared port is used.
pub fn explain_ip(snapshot: &Snapshot, namespace: &str, dst: Destination) -> IpExplanation {
    let client = Some(namespace);
    let port = dst.port.or_else(|| {
        snapshot
            .decide_outbound_with(client, dst.ip, 0, Pick::Peek)
            .service()
            .and_then(|s| s.ports.first())
            .map(|p| p.port)
    });
    let d = snapshot.decide_outbound_with(client, dst.ip, port.unwrap_or(0), Pick::Peek);
    let waypoint = match d.action {
        Outbound::Service { service, .. } => service.waypoint_route(),
        _ => None,
    };
    let endpoint = match waypoint {
        // The waypoint picks the endpoint; the connection goes to it.
        Some((_, ip)) => Some(std::net::SocketAddr::new(ip, crate::hbone::PORT).to_string()),
        None => d.target().map(|t| match port {
            Some(_) => t.to_string(),
            None => dst.ip.to_string(),
        }),
    };
    let hidden = d.hidden.map(|s| s.to_string());
    let mut reason = match d.hidden {
        Some(h) => format!(
            "{h} claims {} but is hidden from {namespace} ({}); ",
            dst.ip,
            vis(h)
        ),
        None => String::new(),
    };
    reason.push_str(&why(&d, namespace, dst.ip, port));
    if let Some((name, ip)) = waypoint {
        reason.push_str(&format!(
            "; bound to waypoint {name}: the connection goes over HBONE to {}, CONNECT {}:{}, as the client pod's workload identity",
            std::net::SocketAddr::new(ip, crate::hbone::PORT),
            dst.ip,
            port.unwrap_or(0)
        ));
    }
    let (workload, candidates) = match d.action {
        Outbound::Service { port, .. } => (
            None,
            port.endpoints
                .iter()
                .map(|e| e.target().to_string())
                .collect(),
        ),
        Outbound::Workload { workload, .. } => (
            Some(format!("{}/{}", workload.namespace, workload.name)),
            Vec::new(),
        ),
        Outbound::Passthrough { .. } | Outbound::NoHealthyUpstream { .. } => (None, Vec::new()),
    };
    IpExplanation {
        client: Client {
            namespace: namespace.to_string(),
            pod: None,
        },
        outbound: OutboundReport {
            action: d.outcome(),
            service: d.service().map(|s| s.to_string()),
            endpoint,
            workload,
            candidates,
            hidden,
            port,
            decided_by: decided_by(snapshot, namespace, dst.ip, port.unwrap_or(0)),
            reason,
            authorization: None,
        },
    }
}

/// Who decides with the fast path: the snapshot compiled as the agent compiles it, the client a
/// pod of `namespace` whose cgroup the agent knows.
fn decided_by(snapshot: &Snapshot, namespace: &str, ip: IpAddr, port: u16) -> DecidedBy {
    let (tables, _) =
        fastpath::compile(snapshot, fastpath::Limits::within(fastpath::DEFAULT_MEMORY));
    fastpath::decided_by(&tables, Some(namespace), ip, port)
}

fn why(d: &OutboundDecision<'_>, namespace: &str, ip: IpAddr, port: Option<u16>) -> String {
    let port_text = port.map_or("its first port".to_string(), |p| format!("port {p}"));
    match d.action {
        Outbound::Service {
            service,
            port,
            index,
            endpoint,
        } => format!(
            "{service} ({}) claims {ip} and is visible to {namespace}; {} of {} endpoint(s) for port {}, next pick {} (round robin)",
            vis(service),
            index + 1,
            port.endpoints.len(),
            port.port,
            endpoint.target()
        ),
        Outbound::Workload { workload, .. } => format!(
            "no visible service claims {ip}; workload {}/{} has it: connect to it directly",
            workload.namespace, workload.name
        ),
        Outbound::Passthrough {
            reason: PassthroughReason::Unknown,
            ..
        } => {
            format!(
                "no visible service or workload has {ip}: passthrough to the original destination (unknown traffic)"
            )
        }
        Outbound::Passthrough {
            reason: PassthroughReason::ResolutionNone(s),
            ..
        } => format!(
            "{s} ({}) claims {ip} with resolution NONE: the connection goes to the original destination",
            vis(s)
        ),
        Outbound::NoHealthyUpstream {
            service,
            reason: NoUpstreamReason::PortNotDeclared,
        } => format!(
            "{service} ({}) claims {ip} but does not declare {port_text}: the connection is reset (no_healthy_upstream)",
            vis(service)
        ),
        Outbound::NoHealthyUpstream {
            service,
            reason: NoUpstreamReason::NoEndpoints,
        } => format!(
            "{service} ({}) claims {ip} but has no endpoint for {port_text}: the connection is reset (no_healthy_upstream)",
            vis(service)
        ),
    }
}

/// The client a running agent would see for `from`: a pod as `namespace/name` or by one of its
/// addresses, else a namespace. `Err` names a pod the agent does not know.
pub(crate) fn client_of(snapshot: &Snapshot, from: &str) -> Result<Client, String> {
    let pod = |w: &crate::config::Workload| Client {
        namespace: w.meta.namespace.clone(),
        pod: Some(format!("{}/{}", w.meta.namespace, w.meta.name)),
    };
    if let Ok(ip) = from.parse::<IpAddr>() {
        return snapshot.workload_by_ip(ip).map(pod).ok_or_else(|| {
            format!("no single workload the agent knows has the address {ip}: such a client sees PUBLIC services only")
        });
    }
    if let Some((namespace, name)) = from.split_once('/') {
        return snapshot
            .workloads()
            .iter()
            .find(|w| w.meta.namespace == namespace && w.meta.name == name)
            .map(|w| pod(w))
            .ok_or_else(|| format!("the agent knows no pod {from}"));
    }
    Ok(Client {
        namespace: from.to_string(),
        pod: None,
    })
}
