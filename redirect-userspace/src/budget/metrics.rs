//! What the budgets hold and refuse (`docs/observability.md#metrics`).
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::metrics::label_value_as_str;

/// A resource the agent caps.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum BudgetKind {
    /// Descriptors of the outbound proxy (sockets and pipes).
    Fds,
    Connections,
    DnsForwards,
    DnsTcpClients,
    /// Ephemeral ports of the node toward one upstream address (open, or in TIME_WAIT).
    UpstreamPorts,
}

impl BudgetKind {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Fds => "fds",
            Self::Connections => "connections",
            Self::DnsForwards => "dns_forwards",
            Self::DnsTcpClients => "dns_tcp_clients",
            Self::UpstreamPorts => "upstream_ports",
        }
    }
}

/// Why a budget said no.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The client holds its whole share.
    ClientShare,
    /// The node-wide limit is reached.
    NodeLimit,
    /// What is left is kept for clients that hold less than their floor: a newcomer always gets
    /// its floor.
    Reserve,
    /// The descriptors a connection needs are not in the budget.
    Fds,
}

impl Refusal {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::ClientShare => "client_share",
            Self::NodeLimit => "node_limit",
            Self::Reserve => "reserve",
            Self::Fds => "fds",
        }
    }
}

/// Which limit a budget gauge is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) enum Scope {
    Node,
    Client,
    /// What a client can always reach, however much the others hold.
    Floor,
}

impl Scope {
    pub(super) const fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Client => "client",
            Self::Floor => "floor",
        }
    }
}

label_value_as_str!(BudgetKind, Refusal, Scope);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetLabels {
    budget: BudgetKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    budget: BudgetKind,
    scope: Scope,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    budget: BudgetKind,
    reason: Refusal,
}

#[derive(Debug, Default)]
pub(crate) struct BudgetMetrics {
    used: Family<BudgetLabels, Gauge>,
    limit: Family<LimitLabels, Gauge>,
    refusals: Family<RefusalLabels, Counter>,
}

impl BudgetMetrics {
    /// A budget's limits, set once when the budget is made.
    pub(crate) fn limits(&self, budget: BudgetKind, node: usize, client: Option<usize>) {
        let set = |scope, n: usize| {
            self.limit
                .get_or_create(&LimitLabels { budget, scope })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        set(Scope::Node, node);
        if let Some(client) = client {
            set(Scope::Client, client);
        }
    }

    /// A budget's floor, set once when the budget is made.
    pub(crate) fn floor(&self, budget: BudgetKind, floor: usize) {
        self.limit
            .get_or_create(&LimitLabels {
                budget,
                scope: Scope::Floor,
            })
            .set(i64::try_from(floor).unwrap_or(i64::MAX));
    }

    /// How much of a budget is held now, node-wide.
    pub(crate) fn used(&self, budget: BudgetKind, used: usize) {
        self.used
            .get_or_create(&BudgetLabels { budget })
            .set(i64::try_from(used).unwrap_or(i64::MAX));
    }

    pub(crate) fn refused(&self, budget: BudgetKind, reason: Refusal) {
        self.refusals
            .get_or_create(&RefusalLabels { budget, reason })
            .inc();
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "budget_used",
            "What the agent holds now, node-wide, of each budget",
            self.used.clone(),
        );
        registry.register(
            "budget_limit",
            "Each budget's node-wide limit, one client's share of it and the floor every client can reach",
            self.limit.clone(),
        );
        registry.register(
            "budget_refusals",
            "Requests refused because a budget was reached, by budget and reason",
            self.refusals.clone(),
        );
    }
}
