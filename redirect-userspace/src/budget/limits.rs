//! How big each budget is: flags where the operator set them, the rest sized from the open-files limit.
use std::time::Duration;

/// Descriptors kept out of every budget: listeners, eBPF maps and programs, the admin server, the
/// config watcher, the runtime, logs, the upstream's socket pool.
pub(super) const RESERVED_FDS: usize = 256;
/// A DNS-over-TCP client holds its socket and, while forwarding, one to the upstream.
const FDS_PER_DNS_TCP_CLIENT: usize = 2;
/// A proxied connection holds two sockets; relayed by splice, two pipes more.
pub(crate) const FDS_PER_CONNECTION: usize = 2;

const DEFAULT_DNS_FORWARDS: usize = 1024;
const DEFAULT_DNS_TCP_CLIENTS: usize = 1024;
/// Unless set, one client may hold this fraction of a node budget.
const DEFAULT_CLIENT_DIVISOR: usize = 4;

/// The budget flags of `redirect run`.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct BudgetArgs {
    /// Proxied connections open at once, node-wide [default: what the open-files limit allows with the
    /// copy relay].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Proxied connections one client (pod) may hold [default: a quarter of the node's].
    #[arg(long, value_name = "N")]
    pub max_connections_per_client: Option<usize>,
    /// DNS queries forwarded upstream over UDP and not yet answered, node-wide [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_dns_forwards: Option<usize>,
    /// DNS forwards one client may have in flight [default: a quarter of the node's].
    #[arg(long, value_name = "N")]
    pub max_dns_forwards_per_client: Option<usize>,
    /// DNS-over-TCP connections open at once, node-wide [default: 1024, less when the open-files
    /// limit is low].
    #[arg(long, value_name = "N")]
    pub max_dns_tcp_clients: Option<usize>,
    /// DNS-over-TCP connections one client may hold [default: a quarter of the node's].
    #[arg(long, value_name = "N")]
    pub max_dns_tcp_clients_per_client: Option<usize>,
    /// Local ports the proxy may hold toward any one upstream address, open or in TIME_WAIT after
    /// a close it made first [default: three quarters of the node's ephemeral range].
    #[arg(long, value_name = "N")]
    pub max_upstream_ports: Option<usize>,
    /// Of those, what one client (pod) may hold [default: a quarter of the node's].
    #[arg(long, value_name = "N")]
    pub max_upstream_ports_per_client: Option<usize>,
    /// A proxied connection that moves no byte either way for this long is reset.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,
    /// After one side has closed, a write the other side does not take for this long resets the
    /// connection (a peer that never reads).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub write_timeout: Duration,
    /// Kernel memory each proxied socket may hold per direction (its send and its receive buffer):
    /// what a connection whose peer never reads can make the node hold, on each of its two legs.
    /// 0 leaves the sizes to the kernel's autotuning (up to tcp_wmem and tcp_rmem).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_CONNECTION_BUFFER)]
    pub connection_buffer: usize,
}

/// Envoy's per-connection buffer limit, and enough for a full-rate stream on the node's links.
pub(super) const DEFAULT_CONNECTION_BUFFER: usize = 1 << 20;

/// A node-wide limit and one client's share of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cap {
    pub node: usize,
    pub client: usize,
}

impl Cap {
    fn new(node: usize, client: Option<usize>) -> Cap {
        let client = client
            .unwrap_or(node / DEFAULT_CLIENT_DIVISOR)
            .clamp(1.min(node), node);
        Cap { node, client }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The open-files limit the budgets were sized from.
    pub fd_limit: usize,
    /// Descriptors the outbound proxy may hold (sockets and pipes).
    pub proxy_fds: usize,
    /// Below this many proxy descriptors, new connections splice; above, they copy.
    pub splice_below: usize,
    pub connections: Cap,
    pub dns_forwards: Cap,
    pub dns_tcp_clients: Cap,
    /// Ports toward one upstream address, open or in TIME_WAIT.
    pub upstream_ports: Cap,
}

impl Limits {
    /// DNS over TCP first (small and bounded), the outbound proxy gets the rest: so no sum of
    /// budgets can reach `fd_limit`. UDP forwards hold no descriptor (they share the upstream
    /// sockets, which are in the reserve): their cap does not depend on the limit. Ports toward an
    /// upstream are sized from the node's ephemeral range (`ephemeral_ports`): a quarter of it is
    /// always left to the node's own connections.
    pub(crate) fn size(fd_limit: usize, ephemeral_ports: usize, args: &BudgetArgs) -> Limits {
        let spare = fd_limit.saturating_sub(RESERVED_FDS);
        let dns_cap = spare / 8;
        let forwards = args.max_dns_forwards.unwrap_or(DEFAULT_DNS_FORWARDS);
        let tcp = args
            .max_dns_tcp_clients
            .unwrap_or(DEFAULT_DNS_TCP_CLIENTS)
            .min(dns_cap / FDS_PER_DNS_TCP_CLIENT);
        let proxy_fds = spare - tcp * FDS_PER_DNS_TCP_CLIENT;
        let connections = args
            .max_connections
            .unwrap_or(usize::MAX)
            .min(proxy_fds / FDS_PER_CONNECTION);
        Limits {
            fd_limit,
            proxy_fds,
            splice_below: proxy_fds / 2,
            connections: Cap::new(connections, args.max_connections_per_client),
            dns_forwards: Cap::new(forwards, args.max_dns_forwards_per_client),
            dns_tcp_clients: Cap::new(tcp, args.max_dns_tcp_clients_per_client),
            upstream_ports: Cap::new(
                args.max_upstream_ports
                    .unwrap_or(ephemeral_ports - ephemeral_ports / 4),
                args.max_upstream_ports_per_client,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux's default range (28,232 ports): three quarters for the proxy, a quarter of that each.
    const DEFAULT_PORTS: Cap = Cap {
        node: 21_174,
        client: 5_293,
    };

    #[test]
    fn budgets_are_sized_from_the_fd_limit_and_never_sum_past_it() {
        struct Case {
            name: &'static str,
            fd_limit: usize,
            args: BudgetArgs,
            expect: Limits,
        }
        let cases = [
            Case {
                name: "a node's usual limit: DNS at its defaults, the proxy gets the rest",
                fd_limit: 1 << 20,
                args: BudgetArgs::default(),
                expect: Limits {
                    fd_limit: 1 << 20,
                    proxy_fds: (1 << 20) - 256 - 2048,
                    splice_below: ((1 << 20) - 256 - 2048) / 2,
                    connections: Cap {
                        node: ((1 << 20) - 256 - 2048) / 2,
                        client: ((1 << 20) - 256 - 2048) / 8,
                    },
                    dns_forwards: Cap {
                        node: 1024,
                        client: 256,
                    },
                    dns_tcp_clients: Cap {
                        node: 1024,
                        client: 256,
                    },
                    upstream_ports: DEFAULT_PORTS,
                },
            },
            Case {
                name: "a low limit shrinks DNS over TCP to an eighth of what is left, not UDP forwards",
                fd_limit: 2304,
                args: BudgetArgs::default(),
                expect: Limits {
                    fd_limit: 2304,
                    proxy_fds: 2048 - 256,
                    splice_below: 896,
                    connections: Cap {
                        node: 896,
                        client: 224,
                    },
                    dns_forwards: Cap {
                        node: 1024,
                        client: 256,
                    },
                    dns_tcp_clients: Cap {
                        node: 128,
                        client: 32,
                    },
                    upstream_ports: DEFAULT_PORTS,
                },
            },
            Case {
                name: "flags set caps, but never past what the descriptors allow",
                fd_limit: 2304,
                args: BudgetArgs {
                    max_connections: Some(100_000),
                    max_connections_per_client: Some(1_000_000),
                    max_dns_forwards: Some(10),
                    max_dns_forwards_per_client: Some(3),
                    ..BudgetArgs::default()
                },
                expect: Limits {
                    fd_limit: 2304,
                    proxy_fds: 2048 - 256,
                    splice_below: (2048 - 256) / 2,
                    connections: Cap {
                        node: (2048 - 256) / 2,
                        client: (2048 - 256) / 2,
                    },
                    dns_forwards: Cap {
                        node: 10,
                        client: 3,
                    },
                    dns_tcp_clients: Cap {
                        node: 128,
                        client: 32,
                    },
                    upstream_ports: DEFAULT_PORTS,
                },
            },
            Case {
                name: "a limit below the reserve leaves nothing to give",
                fd_limit: 100,
                args: BudgetArgs::default(),
                expect: Limits {
                    fd_limit: 100,
                    proxy_fds: 0,
                    splice_below: 0,
                    connections: Cap { node: 0, client: 0 },
                    dns_forwards: Cap {
                        node: 1024,
                        client: 256,
                    },
                    dns_tcp_clients: Cap { node: 0, client: 0 },
                    upstream_ports: DEFAULT_PORTS,
                },
            },
        ];
        for case in cases {
            let got = Limits::size(case.fd_limit, 28_232, &case.args);
            assert_eq!(got, case.expect, "{}", case.name);
            let worst =
                RESERVED_FDS + got.dns_tcp_clients.node * FDS_PER_DNS_TCP_CLIENT + got.proxy_fds;
            assert!(worst <= case.fd_limit.max(RESERVED_FDS), "{}", case.name);
        }
    }
}
