//! The routing that hands the agent the HBONE sent to this node's Pods. A peer dials
//! `<pod IP>:15008`; the node would forward that to the Pod, which has nothing listening there.
//! One policy rule sends TCP to port 15008 to a table of the agent's own, which holds a `local`
//! route for each Pod of the node: such a packet is delivered in the node's netns, to the agent's
//! transparent listener, and any other port to a Pod is forwarded as before. A destination the
//! table does not hold (another node's Pod, dialled by the agent itself) falls through to the
//! next rules, so the agent's own HBONE out of the node is untouched.
//!
//! The agent carries a stream on from the sender's address (a Pod of another node), and a Pod of
//! this node sends its stream to the agent from its own address. The answers to those sockets are
//! addressed to a Pod, here or there: the node would forward them. `hbone_replies` marks them
//! (`HBONE_REPLY_MARK`), and a second rule sends marked packets to a table holding only a `local`
//! default route, so they are delivered in the node's netns, to the agent's socket.
use std::{
    collections::BTreeSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use futures::TryStreamExt;
use redirect_common::HBONE_REPLY_MARK;
use rtnetlink::{
    Handle, IpVersion, RouteMessageBuilder, RuleAddRequest,
    packet_route::{
        AddressFamily, IpProtocol,
        route::{RouteAddress, RouteAttribute, RouteMessage, RouteScope, RouteType},
        rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange},
    },
};
use tracing::warn;

/// The agent's routing table, and its rule's priority (before the `main` table's 32766).
const TABLE: u32 = 15008;
const RULE_PRIORITY: u32 = 15008;
/// The table for the answers to the agent's sockets bound to Pods' addresses, and its rule's.
const REPLY_TABLE: u32 = 15009;
const REPLY_RULE_PRIORITY: u32 = 15009;

/// The rule and routes in place; [`PodRoutes::remove`] takes them away.
#[derive(Debug)]
pub(crate) struct PodRoutes {
    handle: Handle,
    port: u16,
    loopback: u32,
    held: BTreeSet<IpAddr>,
    /// The families whose rules are in place (IPv6 only where the node has it).
    families: Vec<Family>,
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
    /// Puts the rule in place for TCP to `port`, and takes over the routes already in the table:
    /// an agent before this one (a crash, or one handing over and still serving) left them, and
    /// the first [`PodRoutes::sync`] removes those no Pod wants. Nothing is taken away first, so a
    /// Pod reached through them stays reached while this agent starts. Needs `CAP_NET_ADMIN` in
    /// the node's netns.
    pub(crate) async fn install(port: u16) -> Result<PodRoutes, io::Error> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        let loopback = loopback_index(&handle).await.map_err(io::Error::other)?;
        let mut routes = PodRoutes {
            handle,
            port,
            loopback,
            held: BTreeSet::new(),
            families: Vec::new(),
        };
        for family in FAMILIES {
            match routes.install_family(family).await {
                Ok(()) => routes.families.push(family),
                // A node without IPv6 has no IPv6 Pods to route.
                Err(e) if family == Family::V6 && e.unsupported() => {
                    warn!(error = %e, "no IPv6 routing rules on this node: HBONE is routed to its Pods' IPv4 addresses only");
                }
                Err(e) => return Err(io::Error::other(e)),
            }
        }
        for route in routes.routes().await.map_err(io::Error::other)? {
            let to = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
                RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
                _ => None,
            });
            match to {
                Some(ip) if route.header.destination_prefix_length == host_prefix(ip) => {
                    routes.held.insert(ip);
                }
                // Not one this agent makes: gone at once.
                _ => routes.delete_route(route).await.map_err(io::Error::other)?,
            }
        }
        Ok(routes)
    }

    /// The rules of one family and its reply table's route.
    async fn install_family(&self, family: Family) -> Result<(), RoutesError> {
        if self.rules(family, RULE_PRIORITY, TABLE).await?.is_empty() {
            self.add_rule(family).await?;
        }
        if self
            .rules(family, REPLY_RULE_PRIORITY, REPLY_TABLE)
            .await?
            .is_empty()
        {
            self.add_reply_rule(family).await?;
        }
        // `replace`: one a predecessor left is kept as it is.
        self.handle
            .route()
            .add(self.reply_route(family))
            .replace()
            .execute()
            .await
            .map_err(failed(
                "adding the route for answers to the agent's HBONE sockets",
            ))
    }

    /// Holds a `local` route for exactly the addresses of `pods`.
    pub(crate) async fn sync(&mut self, mut pods: BTreeSet<IpAddr>) -> Result<(), RoutesError> {
        pods.retain(|ip| self.families.contains(&Family::of(*ip)));
        let gone: Vec<IpAddr> = self.held.difference(&pods).copied().collect();
        for ip in gone {
            self.delete_route(self.route(ip)).await?;
            self.held.remove(&ip);
        }
        let new: Vec<IpAddr> = pods.difference(&self.held).copied().collect();
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

    /// Takes the rules and every route of the tables away.
    pub(crate) async fn remove(self) -> Result<(), RoutesError> {
        for &family in &self.families {
            let mut rules = self.rules(family, RULE_PRIORITY, TABLE).await?;
            rules.extend(self.rules(family, REPLY_RULE_PRIORITY, REPLY_TABLE).await?);
            for rule in rules {
                self.handle
                    .rule()
                    .del(rule)
                    .execute()
                    .await
                    .map_err(failed("removing the rule for HBONE"))?;
            }
        }
        for route in self.routes().await? {
            self.delete_route(route).await?;
        }
        for &family in &self.families {
            self.delete_route(self.reply_route(family)).await?;
        }
        Ok(())
    }

    /// `local default dev lo` in the reply table: what is looked up there is the node's own.
    fn reply_route(&self, family: Family) -> RouteMessage {
        let any = match family {
            Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        self.local_route(any, 0, REPLY_TABLE)
    }

    /// The `local` route of one Pod's address in the agent's table.
    fn route(&self, ip: IpAddr) -> RouteMessage {
        self.local_route(ip, host_prefix(ip), TABLE)
    }

    fn local_route(&self, ip: IpAddr, prefix: u8, table: u32) -> RouteMessage {
        fn local<T>(builder: RouteMessageBuilder<T>, table: u32, lo: u32) -> RouteMessage {
            builder
                .table_id(table)
                .kind(RouteType::Local)
                .scope(RouteScope::Host)
                .output_interface(lo)
                .build()
        }
        match ip {
            IpAddr::V4(v4) => local(
                RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(v4, prefix),
                table,
                self.loopback,
            ),
            IpAddr::V6(v6) => local(
                RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(v6, prefix),
                table,
                self.loopback,
            ),
        }
    }

    /// Deletes `route`; one already gone (with its Pod's link, or by another agent) is no error.
    async fn delete_route(&self, route: RouteMessage) -> Result<(), RoutesError> {
        match self.handle.route().del(route).execute().await {
            Ok(()) => Ok(()),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ESRCH => Ok(()),
            Err(e) => Err(failed("removing a route for HBONE")(e)),
        }
    }

    async fn add_rule(&self, family: Family) -> Result<(), RoutesError> {
        let mut add = of_family(self.handle.rule().add(), family)
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

    /// Packets marked as answers to the agent's sockets look up the reply table.
    async fn add_reply_rule(&self, family: Family) -> Result<(), RoutesError> {
        let mut add = of_family(self.handle.rule().add(), family)
            .priority(REPLY_RULE_PRIORITY)
            .table_id(REPLY_TABLE)
            .action(RuleAction::ToTable)
            .fw_mark(HBONE_REPLY_MARK);
        add.message_mut()
            .attributes
            .push(RuleAttribute::FwMask(HBONE_REPLY_MARK));
        add.execute().await.map_err(failed(
            "adding the rule for answers to the agent's HBONE sockets",
        ))
    }

    /// The agent's rules of one family and priority: those at `priority` that look up `table`
    /// (another's rule at that priority is not ours to take over, or to remove).
    async fn rules(
        &self,
        family: Family,
        priority: u32,
        table: u32,
    ) -> Result<Vec<RuleMessage>, RoutesError> {
        let rules: Vec<RuleMessage> = self
            .handle
            .rule()
            .get(match family {
                Family::V4 => IpVersion::V4,
                Family::V6 => IpVersion::V6,
            })
            .execute()
            .try_collect()
            .await
            .map_err(failed("listing the routing rules"))?;
        Ok(rules
            .into_iter()
            .filter(|r| r.attributes.contains(&RuleAttribute::Priority(priority)))
            // Tables past 255 are named by the attribute only (the header's field is a byte).
            .filter(|r| r.attributes.contains(&RuleAttribute::Table(table)))
            .collect())
    }

    /// The routes of the agent's table, of the families in place.
    async fn routes(&self) -> Result<Vec<RouteMessage>, RoutesError> {
        let mut all = Vec::new();
        for family in &self.families {
            let mut table = match family {
                Family::V4 => RouteMessageBuilder::<Ipv4Addr>::new()
                    .table_id(TABLE)
                    .build(),
                Family::V6 => RouteMessageBuilder::<Ipv6Addr>::new()
                    .table_id(TABLE)
                    .build(),
            };
            // The kernel filters a dump by table only when asked strictly; every table comes back.
            table.header.table = 0;
            let routes: Vec<RouteMessage> = self
                .handle
                .route()
                .get(table)
                .execute()
                .try_collect()
                .await
                .map_err(failed("listing the routes"))?;
            all.extend(
                routes
                    .into_iter()
                    .filter(|r| r.attributes.contains(&RouteAttribute::Table(TABLE))),
            );
        }
        Ok(all)
    }
}

/// Both families: the Pods of a dual-stack node are dialled at either address.
const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

impl RoutesError {
    /// The kernel has no such family (IPv6 not built in, or turned off at boot).
    fn unsupported(&self) -> bool {
        matches!(&self.source, rtnetlink::Error::NetlinkError(e) if e.raw_code() == -libc::EAFNOSUPPORT)
    }
}

/// The prefix length of one address's route.
fn host_prefix(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// A rule request of `family`.
fn of_family(mut add: RuleAddRequest, family: Family) -> RuleAddRequest {
    add.message_mut().header.family = match family {
        Family::V4 => AddressFamily::Inet,
        Family::V6 => AddressFamily::Inet6,
    };
    add
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
