//! The resources the agent lets its clients make it hold, each capped for the node and shared out per
//! client (a workload, by any of its addresses: `Snapshot::budget_key`): proxied connections and
//! their file descriptors, DNS queries in flight upstream, DNS-over-TCP connections, the node's
//! ephemeral ports toward each upstream address. A pod at its share is refused; the others go on,
//! and each pod can reach its floor however much the others hold ([`tally`]).
//!
//! Sizes come from the open-files limit (see [`Limits::size`]), so the agent refuses early, with a
//! reset or SERVFAIL the client sees at once, instead of running out of descriptors and hanging
//! everyone's accepts.
mod fds;
mod limits;
mod metrics;
pub(crate) mod ports;
mod share;
mod tally;

use std::sync::Arc;

pub(crate) use fds::{Ceiling, FdCharge, FdLedger, raise_fd_limit};
pub(crate) use limits::{BudgetArgs, Cap, FDS_PER_CONNECTION, Limits};
pub(crate) use metrics::{BudgetKind, BudgetMetrics, Refusal};
pub(crate) use ports::UpstreamPorts;
pub(crate) use share::{Permit, Share};

/// Every budget of one agent.
#[derive(Debug)]
pub(crate) struct Budgets {
    pub fds: Arc<FdLedger>,
    pub connections: Arc<Share>,
    pub dns_forwards: Arc<Share>,
    pub dns_tcp_clients: Arc<Share>,
    pub upstream_ports: Arc<UpstreamPorts>,
    /// What they count (registered by the agent).
    pub metrics: Arc<BudgetMetrics>,
}

impl Budgets {
    pub(crate) fn new(limits: Limits, metrics: &Arc<BudgetMetrics>) -> Budgets {
        let share = |kind, cap: Cap| Share::new(kind, cap.node, cap.client, metrics.clone());
        Budgets {
            fds: FdLedger::new(limits.proxy_fds, limits.splice_below, metrics.clone()),
            connections: share(BudgetKind::Connections, limits.connections),
            dns_forwards: share(BudgetKind::DnsForwards, limits.dns_forwards),
            dns_tcp_clients: share(BudgetKind::DnsTcpClients, limits.dns_tcp_clients),
            upstream_ports: UpstreamPorts::new(
                limits.upstream_ports.node,
                limits.upstream_ports.client,
                metrics.clone(),
            ),
            metrics: metrics.clone(),
        }
    }

    /// Why a new proxied connection would be refused now whoever asked, if it would: readiness says so.
    pub(crate) fn saturated(&self) -> Option<&'static str> {
        if self.fds.used() + FDS_PER_CONNECTION > self.fds.limit() {
            Some("the outbound proxy is at its file-descriptor budget")
        } else if self.connections.used() >= self.connections.node_limit() {
            Some("the outbound proxy is at its connection limit")
        } else {
            None
        }
    }
}
