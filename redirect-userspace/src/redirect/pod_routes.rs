//! The routing that hands the agent the HBONE sent to this node's Pods. A peer dials
//! `<pod IP>:15008`; the node would forward that to the Pod, which has nothing listening there.
//! One policy rule sends TCP to port 15008 to a table of the agent's own, which holds a `local`
//! route for each Pod of the node: such a packet is delivered in the node's netns, to the agent's
//! transparent listener, and any other port to a Pod is forwarded as before. A destination the
//! table does not hold (another node's Pod, dialled by the agent itself) falls through to the
//! next rules, so the agent's own HBONE out of the node is untouched.
use std::{collections::BTreeSet, io, net::Ipv4Addr};

use futures::TryStreamExt;
use rtnetlink::{
    Handle, IpVersion, RouteMessageBuilder,
    packet_route::{
        IpProtocol,
        route::{RouteScope, RouteType},
        rule::{RuleAction, RuleAttribute, RulePortRange},
    },
};

/// The agent's routing table, and its rule's priority (before the `main` table's 32766).
const TABLE: u32 = 15008;
const RULE_PRIORITY: u32 = 15008;

/// The rule and routes in place; [`PodRoutes::remove`] takes them away.
#[derive(Debug)]
pub(crate) struct PodRoutes {
    handle: Handle,
    port: u16,
    loopback: u32,
    held: BTreeSet<Ipv4Addr>,
}

#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub(crate) struct RoutesError {
    what: String,
    source: rtnetlink::Error,
}

fn failed(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> RoutesError {
    move |source| RoutesError {
        what: what.into(),
        source,
    }
}

impl PodRoutes {
    /// Puts the rule in place for TCP to `port`, after taking away what an agent before left (a
    /// crash leaves its rule and routes behind). Needs `CAP_NET_ADMIN` in the node's netns.
    pub(crate) async fn install(port: u16) -> Result<PodRoutes, io::Error> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        let loopback = loopback_index(&handle).await.map_err(io::Error::other)?;
        let mut routes = PodRoutes {
            handle,
            port,
            loopback,
            held: BTreeSet::new(),
        };
        routes.clear().await.map_err(io::Error::other)?;
        routes.add_rule().await.map_err(io::Error::other)?;
        Ok(routes)
    }

    /// Holds a `local` route for exactly the addresses of `pods`.
    pub(crate) async fn sync(&mut self, pods: BTreeSet<Ipv4Addr>) -> Result<(), RoutesError> {
        let gone: Vec<Ipv4Addr> = self.held.difference(&pods).copied().collect();
        for ip in gone {
            match self.handle.route().del(self.route(ip)).execute().await {
                Ok(()) => {}
                // Gone already (its Pod's link went with it).
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ESRCH => {}
                Err(e) => return Err(failed(format!("removing the route of {ip}"))(e)),
            }
            self.held.remove(&ip);
        }
        let new: Vec<Ipv4Addr> = pods.difference(&self.held).copied().collect();
        for ip in new {
            match self
                .handle
                .route()
                .add(self.route(ip))
                .replace()
                .execute()
                .await
            {
                Ok(()) => {}
                Err(e) => return Err(failed(format!("adding the route of {ip}"))(e)),
            }
            self.held.insert(ip);
        }
        Ok(())
    }

    /// Takes the rule and every route away.
    pub(crate) async fn remove(mut self) -> Result<(), RoutesError> {
        self.clear().await
    }

    /// The `local` route of one Pod's address in the agent's table.
    fn route(&self, ip: Ipv4Addr) -> rtnetlink::packet_route::route::RouteMessage {
        RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(ip, 32)
            .table_id(TABLE)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .output_interface(self.loopback)
            .build()
    }

    async fn add_rule(&self) -> Result<(), RoutesError> {
        let mut add = self
            .handle
            .rule()
            .add()
            .v4()
            .priority(RULE_PRIORITY)
            .table_id(TABLE)
            .action(RuleAction::ToTable);
        let attributes = &mut add.message_mut().attributes;
        attributes.push(RuleAttribute::IpProtocol(IpProtocol::Tcp));
        attributes.push(RuleAttribute::DestinationPortRange(RulePortRange {
            start: self.port,
            end: self.port,
        }));
        add.execute()
            .await
            .map_err(failed("adding the rule for HBONE to the node's Pods"))
    }

    /// Deletes the agent's rules (by priority) and every route of its table.
    async fn clear(&mut self) -> Result<(), RoutesError> {
        let rules: Vec<_> = self
            .handle
            .rule()
            .get(IpVersion::V4)
            .execute()
            .try_collect()
            .await
            .map_err(failed("listing the routing rules"))?;
        for rule in rules {
            let ours = rule
                .attributes
                .contains(&RuleAttribute::Priority(RULE_PRIORITY));
            if ours {
                self.handle
                    .rule()
                    .del(rule)
                    .execute()
                    .await
                    .map_err(failed("removing the rule for HBONE"))?;
            }
        }
        let mut table = RouteMessageBuilder::<Ipv4Addr>::new()
            .table_id(TABLE)
            .build();
        // The kernel filters a dump by table only when asked strictly; every table comes back.
        table.header.table = 0;
        let routes: Vec<_> = self
            .handle
            .route()
            .get(table)
            .execute()
            .try_collect()
            .await
            .map_err(failed("listing the routes"))?;
        for route in routes {
            let in_table =
                route
                    .attributes
                    .contains(&rtnetlink::packet_route::route::RouteAttribute::Table(
                        TABLE,
                    ));
            if in_table {
                self.handle
                    .route()
                    .del(route)
                    .execute()
                    .await
                    .map_err(failed("removing a route for HBONE"))?;
            }
        }
        self.held.clear();
        Ok(())
    }
}

/// The index of `lo`.
async fn loopback_index(handle: &Handle) -> Result<u32, RoutesError> {
    let mut links = handle.link().get().match_name("lo".to_string()).execute();
    match links.try_next().await.map_err(failed("finding lo"))? {
        Some(link) => Ok(link.header.index),
        None => Err(RoutesError {
            what: "finding lo".to_string(),
            source: rtnetlink::Error::RequestFailed,
        }),
    }
}
