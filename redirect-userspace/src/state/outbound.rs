//! The outbound decision (`docs/data-plane.md#destination-ip-lookup`): what a connection from a client
//! namespace to an original destination `ip:port` gets.
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::{
    Snapshot,
    service::{Endpoint, Port, Service, Target},
};
use crate::config::Resolution;

/// How to pick among a port's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Round robin: advances the service's counter (the proxy).
    Next,
    /// The endpoint the next `Next` would give, without advancing (`explain`).
    Peek,
}

/// How an outbound connection was handled, one type everywhere: `explain`'s `action` (its serde
/// name, camelCase, [`Self::json_name`]) and the `outcome` label of `redirect_outbound_connections_total`
/// ([`Self::metric_label`], snake_case). `Error` is the proxy's alone: a decision never fails, carrying it out may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum OutboundOutcome {
    /// A visible service's endpoint was picked.
    Service,
    /// No visible service claims the address; a workload has it.
    Workload,
    /// The original destination, unchanged.
    Passthrough,
    /// The client's connection is reset: the port is not declared, or has no endpoint.
    NoHealthyUpstream,
    /// The destination could not be reached (or the original destination was unknown): reset.
    Error,
    /// The destination Pod's authorization policies refused the client: reset.
    Denied,
}

impl OutboundOutcome {
    /// Its serde name: `explain`'s `action`, in JSON and in the table.
    pub const fn json_name(self) -> &'static str {
        match self {
            Self::Service => "service",
            Self::Workload => "workload",
            Self::Passthrough => "passthrough",
            Self::NoHealthyUpstream => "noHealthyUpstream",
            Self::Error => "error",
            Self::Denied => "denied",
        }
    }

    /// The metric label (`docs/observability.md#metrics`).
    pub const fn metric_label(self) -> &'static str {
        match self {
            Self::Service => "service",
            Self::Workload => "workload",
            Self::Passthrough => "passthrough",
            Self::NoHealthyUpstream => "no_healthy_upstream",
            Self::Error => "error",
            Self::Denied => "denied",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct OutboundDecision<'a> {
    pub action: Outbound<'a>,
    /// The best-ranked service claiming this address that the client may not see, if any was
    /// skipped on the way to `action` (for the "service hidden from client" debug log and counter).
    pub hidden: Option<&'a Service>,
}

#[derive(Debug, Clone, Copy)]
pub enum Outbound<'a> {
    /// Connect to `endpoint` of `service`; `port.endpoints` are the candidates, `index` the pick.
    Service {
        service: &'a Service,
        port: &'a Port,
        endpoint: &'a Endpoint,
        index: usize,
    },
    /// No service claims the address, but a workload has it: connect to it directly.
    Workload {
        workload: super::WorkloadName<'a>,
        addr: SocketAddr,
    },
    /// Connect to the original destination unchanged.
    Passthrough {
        addr: SocketAddr,
        reason: PassthroughReason<'a>,
    },
    /// Reset the client's connection at once.
    NoHealthyUpstream {
        service: &'a Service,
        reason: NoUpstreamReason,
    },
}

#[derive(Debug, Clone, Copy)]
pub enum PassthroughReason<'a> {
    /// Nothing the client can see claims the address.
    Unknown,
    /// A visible service with resolution NONE claims it.
    ResolutionNone(&'a Service),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoUpstreamReason {
    PortNotDeclared,
    NoEndpoints,
}

impl<'a> OutboundDecision<'a> {
    /// What carrying the decision out is counted as, unless the connect fails.
    pub fn outcome(&self) -> OutboundOutcome {
        match self.action {
            Outbound::Service { .. } => OutboundOutcome::Service,
            Outbound::Workload { .. } => OutboundOutcome::Workload,
            Outbound::Passthrough { .. } => OutboundOutcome::Passthrough,
            Outbound::NoHealthyUpstream { .. } => OutboundOutcome::NoHealthyUpstream,
        }
    }

    /// The service the decision is about, if any.
    pub fn service(&self) -> Option<&'a Service> {
        match self.action {
            Outbound::Service { service, .. } | Outbound::NoHealthyUpstream { service, .. } => {
                Some(service)
            }
            Outbound::Passthrough {
                reason: PassthroughReason::ResolutionNone(service),
                ..
            } => Some(service),
            _ => None,
        }
    }

    /// Where the proxy connects; `None` means reset the client.
    pub fn target(&self) -> Option<Target<'a>> {
        match self.action {
            Outbound::Service { endpoint, .. } => Some(endpoint.target()),
            Outbound::Workload { addr, .. } | Outbound::Passthrough { addr, .. } => {
                Some(Target::Addr(addr))
            }
            Outbound::NoHealthyUpstream { .. } => None,
        }
    }
}

impl Snapshot {
    /// The decision for a new connection: advances the round robin.
    pub fn decide_outbound(
        &self,
        client_ns: Option<&str>,
        ip: IpAddr,
        port: u16,
    ) -> OutboundDecision<'_> {
        self.decide_outbound_with(client_ns, ip, port, Pick::Next)
    }

    /// The same decision with an explicit endpoint pick. Allocation-free.
    pub fn decide_outbound_with(
        &self,
        client_ns: Option<&str>,
        ip: IpAddr,
        port: u16,
        pick: Pick,
    ) -> OutboundDecision<'_> {
        let ip = ip.to_canonical();
        let addr = SocketAddr::new(ip, port);
        let exact = self.services.by_vip(ip, client_ns);
        let (service, hidden) = match exact.service {
            Some(svc) => (Some(svc), exact.hidden),
            None => {
                let cidr = self.services.by_cidr(ip, client_ns);
                (cidr.service, exact.hidden.or(cidr.hidden))
            }
        };
        let action = match service {
            Some(service) => service_action(service, addr, pick),
            None => match self.workloads.by_ip(ip) {
                Some(workload) => Outbound::Workload { workload, addr },
                None => Outbound::Passthrough {
                    addr,
                    reason: PassthroughReason::Unknown,
                },
            },
        };
        OutboundDecision { action, hidden }
    }
}

fn service_action(service: &Service, addr: SocketAddr, pick: Pick) -> Outbound<'_> {
    // Resolution NONE forwards to the original destination on any port, declared or not, before the
    // port check: a NONE entry for a network (GitHub's ranges, port 22) must not break :443 to it.
    if service.resolution == Resolution::None {
        return Outbound::Passthrough {
            addr,
            reason: PassthroughReason::ResolutionNone(service),
        };
    }
    let Some(port) = service.port(addr.port()) else {
        return Outbound::NoHealthyUpstream {
            service,
            reason: NoUpstreamReason::PortNotDeclared,
        };
    };
    if port.endpoints.is_empty() {
        return Outbound::NoHealthyUpstream {
            service,
            reason: NoUpstreamReason::NoEndpoints,
        };
    }
    let n = match pick {
        Pick::Next => service
            .next_endpoint
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        Pick::Peek => service
            .next_endpoint
            .load(std::sync::atomic::Ordering::Relaxed),
    };
    let index = n % port.endpoints.len();
    Outbound::Service {
        service,
        port,
        endpoint: &port.endpoints[index],
        index,
    }
}

#[cfg(test)]
mod tests {
    use super::OutboundOutcome::{self, *};

    #[test]
    fn outcome_name_is_its_serde_name() {
        for outcome in [Service, Workload, Passthrough, NoHealthyUpstream, Error] {
            let json = serde_json::to_value(outcome).unwrap();
            assert_eq!(json, outcome.json_name());
            assert_eq!(
                serde_json::from_value::<OutboundOutcome>(json).unwrap(),
                outcome
            );
        }
        assert_eq!(NoHealthyUpstream.metric_label(), "no_healthy_upstream");
    }
}
