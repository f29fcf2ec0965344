//! The DNS decision made against the state in force: what the asking pod's namespace may see.
use std::{net::IpAddr, sync::Arc};

use hickory_proto::rr::Name;
use tracing::debug;

use super::{Decide, Decision, DnsQuery, LocalAnswer};
use crate::{
    live::LiveState,
    metrics::{Lookup, Metrics},
    state::DnsDecision,
};

/// Answers from the live snapshot; counts and logs every service hidden from the client.
pub struct VisibleNames {
    pub live: Arc<LiveState>,
    pub metrics: Arc<Metrics>,
}

impl Decide for VisibleNames {
    fn decide(&self, query: &DnsQuery<'_>) -> Decision {
        let snapshot = self.live.snapshot();
        let client_ns = client_namespace(&snapshot, query.client);
        let qname = query.name.to_ascii();
        let decision = snapshot.decide_dns(client_ns, &qname);
        if let Some(hidden) = decision.hidden() {
            self.metrics.hidden(Lookup::Dns);
            debug!(
                client = %query.client,
                client_namespace = client_ns.unwrap_or("<unknown>"),
                service = %format_args!("{}/{}", hidden.namespace, hidden.name),
                name = %qname,
                instead = match decision {
                    DnsDecision::Answer(_) => "answered with a visible service",
                    DnsDecision::Forward { .. } => "forwarded upstream",
                },
                "service hidden from client"
            );
        }
        match decision {
            DnsDecision::Answer(answer) => {
                let cname_target = answer.cname.and_then(|target| {
                    let mut name = Name::from_ascii(target).ok()?;
                    name.set_fqdn(true);
                    Some(name)
                });
                debug!(
                    client = %query.client,
                    client_namespace = client_ns.unwrap_or("<unknown>"),
                    name = %qname,
                    service = %format_args!("{}/{}", answer.service.namespace, answer.service.name),
                    "DNS answered"
                );
                Decision::Answer(LocalAnswer {
                    cname_target,
                    v4: answer.v4().to_vec(),
                    v6: answer.v6().to_vec(),
                })
            }
            DnsDecision::Forward { .. } => {
                debug!(
                    client = %query.client,
                    client_namespace = client_ns.unwrap_or("<unknown>"),
                    name = %qname,
                    "DNS forwarded"
                );
                Decision::Forward
            }
        }
    }

    fn budget_key(&self, client: IpAddr) -> IpAddr {
        self.live.snapshot().budget_key(client)
    }

    fn known(&self, client: IpAddr) -> bool {
        self.live
            .snapshot()
            .workload_by_ip(client.to_canonical())
            .is_some()
    }
}

/// The namespace of the pod with this IP; `None` (PUBLIC only) for anything else.
pub fn client_namespace(snapshot: &crate::state::Snapshot, ip: IpAddr) -> Option<&str> {
    snapshot
        .workload_by_ip(ip)
        .map(|w| w.meta.namespace.as_str())
}
