//! The integration harness: a throwaway copy of a node's network, built from network namespaces and
//! cgroups, with real processes in it.
//!
//! ```text
//!  pod netns (one per pod)          node netns (the agent)                ext netns ("the world")
//!  eth0 10.244.x.y/32  <-veth->  vpN fd00:7::1/128 (gateway, for NDP)  to-node 192.0.2.2/30
//!       fd00:10:244:x::y/128     lo: 169.254.7.1/32, fd00:7::1/128        fd00:2::2/64
//!  169.254.7.1, fd00:7::1        10.244.x.y/32, fd00:10:244:x::y/128   lo: TEST-NET /32s and
//!    dev eth0                      dev vpN  <-veth->                     2001:db8:: /128s on demand
//!  default via 169.254.7.1       to-ext 192.0.2.1/30, fd00:2::1/64       10.244.0.0/16 via 192.0.2.1
//!  default via fd00:7::1         forwarding on (both families)           fd00:10:244::/48 via fd00:2::1
//!  cgroup <run>/pods/<ns>_<pod>  TEST-NETs via 192.0.2.2, 2001:db8::/32 via fd00:2::2
//! ```
//!
//! Every pod is dual-stack: its IPv6 address is [`pod_ip6`] of its IPv4 one. IPv6 duplicate address
//! detection is off in every namespace of the run, so addresses work the moment they are added.
//!
//! Every name a run creates (netns, cgroup, state directory) carries `rdt<id>`, and the run records its
//! owner in `/run/redirect-tests/<tag>/owner`, so a later run removes what a dead one left behind.
//! Cleanup lives in `Drop` (also while panicking); nothing is ever added to the machine's own netns or
//! attached to the root cgroup.
//!
//! ```no_run
//! use integration::{Agent, DnsRecords, Topology, RESOLVER_IP};
//! # fn main() -> anyhow::Result<()> {
//! let topo = Topology::with_pods(&[("team-a/a1", "10.244.1.10"), ("team-b/b1", "10.244.2.10")])?;
//! let _ext = topo.start_ext_peer("real-api", &["203.0.113.10:80".parse()?], &["203.0.113.10:7".parse()?])?;
//! let _dns = topo.start_dnsmasq(RESOLVER_IP, DnsRecords::new().host("api.example.com", "203.0.113.10".parse()?))?;
//! let agent = Agent::start(&topo, &[])?; // `redirect run --cgroup <pods cgroup> ...` in the node netns
//! let out = topo.pod("team-a/a1").cmd("curl").args(["-sS", "http://api.example.com/"]).ok()?;
//! assert_eq!(out.stdout_str(), "real-api\n");
//! let m = agent.metrics()?;
//! assert_eq!(m.get_or_zero(r#"redirect_outbound_connections_total{outcome="passthrough"}"#), 1.0);
//! agent.stop()?; // SIGTERM, exit status 0 required
//! # Ok(()) }
//! ```

pub mod agent;
pub mod apiserver;
pub mod bpf;
pub mod cgroup;
pub mod container;
pub mod dig;
pub mod dnsmasq;
pub mod exec;
pub mod explain;
pub mod fixtures;
pub mod metrics;
pub mod netns;
pub mod pace;
pub mod pattern;
pub mod peer;
pub mod pki;
pub mod proc;
pub mod procfs;
pub mod prometheus;
pub mod rbac;
pub mod run;
pub mod topology;
pub mod two_nodes;
pub mod world;

pub use agent::{Agent, Launch, NO_FAST_PATH};
pub use dnsmasq::{DnsRecords, Dnsmasq};
pub use exec::{Cmd, Output, Place};
pub use metrics::Metrics;
pub use peer::Peer;
pub use proc::Proc;
pub use topology::{Pod, Topology};

use std::net::{Ipv4Addr, Ipv6Addr};

/// The gateway every pod reaches on its own link; it lives on the node netns's loopback.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 1);
/// The IPv6 gateway: on the node's loopback and on the node side of every pod veth (a neighbour
/// solicitation is answered only for an address of the interface it arrives on).
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 7, 0, 0, 0, 0, 0, 1);
/// The node's end of the node<->ext link, IPv6.
pub const NODE_EXT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 1);
/// The ext end of the node<->ext link, IPv6.
pub const EXT_NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 2);
/// The upstream resolver's IPv6 address (the same dnsmasq as [`RESOLVER_IP`]).
pub const RESOLVER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x53);

/// A pod's IPv6 address, from its IPv4 one: `10.244.X.Y` -> `fd00:10:244:X::Y`, the decimal digits
/// read as hex so the two look alike (`10.244.1.10` -> `fd00:10:244:1::10`).
pub fn pod_ip6(v4: Ipv4Addr) -> Ipv6Addr {
    let [_, _, x, y] = v4.octets();
    let hex = |n: u8| u16::from_str_radix(&n.to_string(), 16).unwrap_or(u16::from(n));
    Ipv6Addr::new(0xfd00, 0x10, 0x244, hex(x), 0, 0, 0, hex(y))
}
/// The node's end of the node<->ext link (the source address of the node's own connections to ext).
pub const NODE_EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The ext end of the node<->ext link.
pub const EXT_NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
/// The upstream resolver (dnsmasq in ext) that pods' `/etc/resolv.conf` names.
pub const RESOLVER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
/// Where the agent's admin server listens, inside the node netns.
pub const ADMIN_ADDR: &str = "127.0.0.1:15000";
/// Port of the identity HTTP server of [`Peer`] by convention.
pub const HTTP_PORT: u16 = 80;
/// Port of the raw TCP echo of [`Peer`] by convention.
pub const ECHO_PORT: u16 = 7;

/// Integration tests create namespaces and cgroups: they need root. Fails with a message saying how to run them.
pub fn require_root() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!(
            "the integration tests need root (network namespaces, cgroups, eBPF): \
             run `cargo xtask test`, or `sudo -E cargo test -p tests`"
        );
    }
    Ok(())
}
