//! Types and names shared by the eBPF programs (`redirect-ebpf`) and the node agent (`redirect`).
//!
//! Everything that crosses the kernel/user wall lives here, `#[repr(C)]` with explicit padding so that
//! map keys never carry uninitialised bytes. The user side gets `aya::Pod` impls with the `user` feature.
#![no_std]

/// Port the outbound proxy listens on at the gateway address.
pub const PROXY_PORT: u16 = 15001;
/// Port the DNS proxy listens on (UDP and TCP) at the gateway address.
pub const DNS_PROXY_PORT: u16 = 15053;
/// The DNS port whose traffic the programs steer to the DNS proxy.
pub const DNS_PORT: u16 = 53;
/// `SO_MARK` the agent puts on its own upstream sockets; the programs never redirect a socket carrying it.
/// One bit clear of the marks others on a node use: kube-proxy's 0x4000 (masquerade) and 0x8000,
/// Calico's and Cilium's upper 16 bits, Cilium's 0x0f00, the AWS VPC CNI's 0x80. (Bit 0x4000, in
/// an earlier value, had kube-proxy masquerade the agent's connections.)
pub const AGENT_SOCKET_MARK: u32 = 0x2000;
/// The HBONE port: peers dial a Pod's address on it.
pub const HBONE_PORT: u16 = 15008;
/// The bit `hbone_replies` sets in `skb->mark` of a packet that answers one of the agent's sockets
/// bound to an address not its own (a Pod's); a policy rule delivers such packets in the node's
/// netns. Clear of the marks others use, as [`AGENT_SOCKET_MARK`] is, and of it.
pub const HBONE_REPLY_MARK: u32 = 0x1000;
/// Addresses in `HBONE_SOURCES`, at most: other nodes' Pods sending to this node's at one time.
pub const HBONE_SOURCES_ENTRIES: u32 = 65_536;

/// Names of the maps in the eBPF object.
pub mod maps {
    /// Socket local storage holding a [`super::OrigDst`] in each steered socket: written by
    /// connect4/sendmsg4, read by sock_ops, getpeername4 and recvmsg4 on the same socket, gone
    /// with the socket.
    pub const SOCKET_ORIG_DST: &str = "SOCKET_ORIG_DST";
    /// client address ([`super::SockAddr`]) -> [`super::OrigDst`]: filed by sock_ops when the client
    /// gets the agent's SYN-ACK (before its last ACK), taken by the agent after `accept()` using the
    /// peer address.
    pub const FLOW_ORIG_DST: &str = "FLOW_ORIG_DST";
    /// A steered or rewritten TCP connection's two ends ([`super::FlowEnds`]) ->
    /// [`super::OrigDst`]: filed by sock_ops as its SYN leaves, read by getpeername on an MPTCP
    /// socket, whose first subflow is the socket the hooks steered (its storage is the subflow's).
    pub const SUBFLOW_ORIG_DST: &str = "SUBFLOW_ORIG_DST";
    /// Per-CPU counters indexed by [`super::Stat`].
    pub const STATS: &str = "STATS";
    /// cgroup id (u64) of a pod that opted out of capture -> 1: kept by the agent, read by the hooks.
    pub const OPTED_OUT_CGROUPS: &str = "OPTED_OUT_CGROUPS";
    /// One u64: the netns cookie `netns_probe` read (kernels without `SO_NETNS_COOKIE`).
    pub const NETNS_PROBE: &str = "NETNS_PROBE";
    /// One u32: which generation of the fast path's tables is in force ([`super::fastpath::GEN_OFF`]
    /// while the agent runs without `--fast-path` or has not filled one yet).
    pub const FAST_GENERATION: &str = "FAST_GENERATION";
    /// Per-CPU counters of the fast path, indexed by [`super::FastStat`].
    pub const FAST_STATS: &str = "FAST_STATS";
    /// Ring buffer of [`super::fastpath::HiddenEvent`]s: each connection the kernel decided after
    /// skipping a hidden service, for the agent's debug log.
    pub const FAST_HIDDEN_EVENTS: &str = "FAST_HIDDEN_EVENTS";
    /// LPM trie of the addresses whose decisions the agent audits (`run --audit-mesh-config`),
    /// keyed as the CIDR tables are in the shared view ([`super::fastpath::AddrKey::lpm_bytes`]):
    /// each connection the kernel decides to one is reported on [`FAST_HIDDEN_EVENTS`].
    pub const FAST_AUDITED: &str = "FAST_AUDITED";
    /// Socket local storage holding a [`super::records::ConnRecord`] in each socket the kernel
    /// decided while records are on: written at connect(), closed by sock_ops.
    pub const SOCKET_RECORD: &str = "SOCKET_RECORD";
    /// Ring buffer of [`super::records::ConnRecord`]s: each kernel-decided connection when it is
    /// made and when it closes.
    pub const CONN_RECORDS: &str = "CONN_RECORDS";
    /// One u32, written by the agent: 0, no records; 1, every kernel-decided connection; N, one
    /// in N (chosen at random per connection).
    pub const RECORDS_SAMPLE: &str = "RECORDS_SAMPLE";
    /// One per-CPU u64: the records the kernel could not report (the ring was full, or the
    /// socket's storage could not be made). The agent's own, like the ring: not pinned.
    pub const RECORDS_LOST: &str = "RECORDS_LOST";
    /// The fast path's tables: each an array of two maps, one per generation (slot
    /// [`super::fastpath::generation_slot`]), that the agent creates at the size the tables need and
    /// swaps in while the generation is idle; then it flips [`FAST_GENERATION`].
    pub const FAST_CLIENTS: &str = "FAST_CLIENTS";
    pub const FAST_EXACT: &str = "FAST_EXACT";
    pub const FAST_CIDRS: &str = "FAST_CIDRS";
    pub const FAST_PORTS: &str = "FAST_PORTS";
    pub const FAST_WORKLOADS: &str = "FAST_WORKLOADS";
    /// An array of two [`super::fastpath::Config`]s, one per generation.
    pub const FAST_CONFIG: &str = "FAST_CONFIG";
    /// IPv4 address (network order, as in the packet) -> 1: another node's Pod the agent sends
    /// from to this node's Pods (HBONE received, carried on with the sender's address). Kept by
    /// the agent; the agent's own, not pinned.
    pub const HBONE_SOURCES: &str = "HBONE_SOURCES";
    pub const HBONE_SOURCES6: &str = "HBONE_SOURCES6";
    /// The inbound authorization table in force: an array of one map, replaced whole.
    pub const INBOUND_TABLE: &str = "INBOUND_TABLE";
    /// Per-CPU counters of the inbound decisions (`inbound::INBOUND_COUNT_SLOTS`).
    pub const INBOUND_COUNTS: &str = "INBOUND_COUNTS";
    /// Refusals reported to the agent.
    pub const INBOUND_EVENTS: &str = "INBOUND_EVENTS";
    /// The node's own connections to Pods (`node_origin` files them), let through by `inbound`
    /// just after (pinned: a successor's and a predecessor's programs share it).
    pub const NODE_DIALS: &str = "NODE_DIALS";
    /// The guarded Pods' addresses whose namespace runs `inbound` (the fast path leaves a
    /// connection to one alone; to any other guarded Pod it goes through the proxy).
    pub const INBOUND_ATTACHED: &str = "INBOUND_ATTACHED";
}

/// Names of the programs in the eBPF object (the function names).
pub mod programs {
    pub const CONNECT4: &str = "connect4";
    pub const SENDMSG4: &str = "sendmsg4";
    pub const RECVMSG4: &str = "recvmsg4";
    pub const GETPEERNAME4: &str = "getpeername4";
    pub const CONNECT6: &str = "connect6";
    pub const SENDMSG6: &str = "sendmsg6";
    pub const RECVMSG6: &str = "recvmsg6";
    pub const GETPEERNAME6: &str = "getpeername6";
    pub const SOCK_OPS: &str = "sock_ops";
    /// cgroup/sock_create, run once at start on kernels before 5.14 (see `NETNS_PROBE`).
    pub const NETNS_PROBE: &str = "netns_probe";
    /// tc ingress on the node's links, with `--hbone-between-nodes`: marks the packets that
    /// answer the agent's sockets bound to a Pod's address ([`super::HBONE_REPLY_MARK`]).
    pub const HBONE_REPLIES: &str = "hbone_replies";
    /// sk_lookup, one link in each guarded Pod's network namespace.
    pub const INBOUND: &str = "inbound";
    /// tc egress on the node's veths: files the node's own connections to Pods.
    pub const NODE_ORIGIN: &str = "node_origin";
}

/// Names of the read-only globals the agent sets at load time.
pub mod globals {
    /// The gateway IPv4 address, in network byte order (as `bpf_sock_addr.user_ip4`); 0: none, IPv4
    /// destinations (and their v4-mapped form) are left alone.
    pub const GATEWAY_V4: &str = "GATEWAY_V4";
    /// The gateway IPv6 address as four network-order words (as `bpf_sock_addr.user_ip6`); all zero:
    /// none, IPv6 destinations are left alone.
    pub const GATEWAY_V6: &str = "GATEWAY_V6";
    /// Port of the outbound proxy, host byte order.
    pub const PROXY_PORT: &str = "PROXY_PORT";
    /// Port of the DNS proxy, host byte order; 0 leaves DNS alone.
    pub const DNS_PROXY_PORT: &str = "DNS_PROXY_PORT";
    /// Cookie of the node's own network namespace (the agent's); sockets there are never steered.
    /// 0 when the kernel cannot tell (SO_NETNS_COOKIE needs 5.14).
    pub const NODE_NETNS_COOKIE: &str = "NODE_NETNS_COOKIE";
}

/// Size of the flow map (LRU: the oldest go first). An entry lives from the end of the client's
/// handshake to the agent's accept(), which takes it out.
pub const FLOW_MAP_ENTRIES: u32 = 65_536;
/// Pods on one node that opted out of capture, at most.
pub const OPTED_OUT_MAP_ENTRIES: u32 = 4096;
/// cgroup levels the programs climb looking for an opted-out pod's cgroup (kubelet's is at 2 to 4).
pub const MAX_CGROUP_DEPTH: i32 = 12;

/// Counters the programs keep, one slot each in the per-CPU `STATS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// TCP connect() rewritten to the outbound proxy.
    TcpRedirected = 0,
    /// DNS (UDP connect/sendmsg or TCP connect to port 53) rewritten to the DNS proxy.
    DnsRedirected = 1,
    /// DNS reply source rewritten back to the resolver the client addressed.
    DnsReplyRewritten = 2,
    /// Socket skipped because it carries the agent's mark.
    SkippedAgentMark = 3,
    /// Flow filed by sock_ops for the agent to read after accept().
    FlowFiled = 4,
    /// A map update failed (map full or similar); the socket was left alone.
    MapUpdateFailed = 5,
    /// Socket skipped because it lives in the node's own network namespace (a hostNetwork pod).
    SkippedNodeNetns = 6,
    /// Socket skipped because its pod opted out of capture (`istio.io/dataplane-mode: none`).
    SkippedOptedOut = 7,
}

impl Stat {
    pub const COUNT: u32 = 8;
    pub const ALL: [Stat; Self::COUNT as usize] = [
        Stat::TcpRedirected,
        Stat::DnsRedirected,
        Stat::DnsReplyRewritten,
        Stat::SkippedAgentMark,
        Stat::FlowFiled,
        Stat::MapUpdateFailed,
        Stat::SkippedNodeNetns,
        Stat::SkippedOptedOut,
    ];

    /// Name used for the metric label.
    pub const fn name(self) -> &'static str {
        match self {
            Stat::TcpRedirected => "tcp_redirected",
            Stat::DnsRedirected => "dns_redirected",
            Stat::DnsReplyRewritten => "dns_reply_rewritten",
            Stat::SkippedAgentMark => "skipped_agent_mark",
            Stat::FlowFiled => "flow_filed",
            Stat::MapUpdateFailed => "map_update_failed",
            Stat::SkippedNodeNetns => "skipped_node_netns",
            Stat::SkippedOptedOut => "skipped_opted_out",
        }
    }
}

/// Counters of the fast path's decisions in `connect4`/`connect6`, one slot each in the per-CPU
/// `FAST_STATS` array. Only TCP connections the proxy would otherwise get are counted.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastStat {
    /// Left alone: no visible service claims the address, or a resolution NONE one does.
    Passthrough = 0,
    /// Left alone: a workload's address.
    Workload = 1,
    /// Destination rewritten to an endpoint.
    Rewritten = 2,
    /// Steered to the proxy: a service the kernel cannot serve (host names, no endpoint, ...).
    ProxyService = 3,
    /// Steered to the proxy: the connecting cgroup is not in the client table.
    ProxyUnknownClient = 4,
    /// Steered to the proxy: a table overflowed (shared entries, a namespace's, the workloads).
    ProxyOverflow = 5,
}

/// The `FAST_STATS` slot counting the connections the kernel decided after skipping a service
/// hidden from the client (the proxy's `services_hidden` count of the same connections). Not a
/// decision: outside [`FastStat::ALL`].
pub const FAST_STAT_HIDDEN: u32 = 6;
/// The `FAST_STATS` slot counting hides not reported on `FAST_HIDDEN_EVENTS` (the ring was full).
pub const FAST_STAT_HIDDEN_DROPPED: u32 = 7;
/// Slots of `FAST_STATS`.
pub const FAST_STAT_SLOTS: u32 = 8;

impl FastStat {
    pub const COUNT: u32 = 6;
    pub const ALL: [FastStat; Self::COUNT as usize] = [
        FastStat::Passthrough,
        FastStat::Workload,
        FastStat::Rewritten,
        FastStat::ProxyService,
        FastStat::ProxyUnknownClient,
        FastStat::ProxyOverflow,
    ];

    /// The decision, for the metric label.
    pub const fn outcome(self) -> &'static str {
        match self {
            FastStat::Passthrough => "passthrough",
            FastStat::Workload => "workload",
            FastStat::Rewritten => "rewritten",
            FastStat::ProxyService | FastStat::ProxyUnknownClient | FastStat::ProxyOverflow => {
                "proxy"
            }
        }
    }

    /// Why the proxy decides, for the metric label; empty for the kernel's own decisions.
    pub const fn reason(self) -> &'static str {
        match self {
            FastStat::Passthrough | FastStat::Workload | FastStat::Rewritten => "",
            FastStat::ProxyService => "service",
            FastStat::ProxyUnknownClient => "unknown_client",
            FastStat::ProxyOverflow => "table_full",
        }
    }
}

pub mod fastpath;
pub mod inbound;
pub mod records;

/// An IPv6 address as the kernel hands it (`user_ip6`, `local_ip6`: four words in network order)
/// as its sixteen bytes.
#[inline(always)]
pub const fn ip6_bytes(words: [u32; 4]) -> [u8; 16] {
    let [a, b, c, d] = [
        words[0].to_ne_bytes(),
        words[1].to_ne_bytes(),
        words[2].to_ne_bytes(),
        words[3].to_ne_bytes(),
    ];
    [
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ]
}

/// Sixteen address bytes as the kernel's four network-order words: the inverse of [`ip6_bytes`].
#[inline(always)]
pub const fn ip6_words(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// A TCP connection's two ends as its socket shows them: its own address and port, and its peer's.
/// 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FlowEnds {
    pub local: SockAddr,
    pub remote: SockAddr,
}

impl FlowEnds {
    /// From each end's address as four network-order words (`user_ip6` form; an IPv4 address
    /// v4-mapped) and port in host byte order. Written word by word: a struct built field by field
    /// with zero bytes in it becomes a memset call, which the kernel cannot take with the object's
    /// BTF.
    #[inline(always)]
    pub fn from_words(
        local: [u32; 4],
        local_port: u16,
        remote: [u32; 4],
        remote_port: u16,
    ) -> Self {
        let port_word = |port: u16| {
            let p = port.to_ne_bytes();
            u32::from_ne_bytes([p[0], p[1], 0, 0])
        };
        let words: [u32; 10] = [
            local[0],
            local[1],
            local[2],
            local[3],
            port_word(local_port),
            remote[0],
            remote[1],
            remote[2],
            remote[3],
            port_word(remote_port),
        ];
        // SAFETY: FlowEnds is two SockAddrs of 16 address bytes, a u16 port and a u16 pad each:
        // ten u32s' worth of plain integers, no padding, any bit pattern valid.
        unsafe { core::mem::transmute::<[u32; 10], FlowEnds>(words) }
    }
}

/// `IPPROTO_MPTCP`: `bpf_sock.protocol` of an MPTCP socket (its subflows are plain TCP).
pub const IPPROTO_MPTCP: u32 = 262;

/// An IP address and port. IPv4 is stored IPv4-mapped (`::ffff:a.b.c.d`) so one layout serves both
/// families: an IPv4 socket and an IPv6 socket talking to the v4-mapped form of the same address
/// file the same key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockAddr {
    /// Address bytes in network order.
    pub addr: [u8; 16],
    /// Port in host byte order.
    pub port: u16,
    pub _pad: u16,
}

impl SockAddr {
    /// From an IPv4 address in network byte order as the kernel hands it (`user_ip4`, `local_ip4`)
    /// and a port in host byte order.
    #[inline(always)]
    pub const fn from_v4_be(ip_be: u32, port: u16) -> Self {
        let b = ip_be.to_ne_bytes();
        SockAddr {
            addr: [
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, b[0], b[1], b[2], b[3],
            ],
            port,
            _pad: 0,
        }
    }

    /// From an IPv6 address as four words in network order as the kernel hands it (`user_ip6`,
    /// `local_ip6`) and a port in host byte order.
    #[inline(always)]
    pub const fn from_ip6_words(words: [u32; 4], port: u16) -> Self {
        SockAddr {
            addr: ip6_bytes(words),
            port,
            _pad: 0,
        }
    }

    /// The address as four words in network order, the kernel's `user_ip6` form.
    #[inline(always)]
    pub const fn ip6_words(&self) -> [u32; 4] {
        ip6_words(&self.addr)
    }

    /// From a socket address: IPv4 is stored IPv4-mapped.
    pub fn from_socket_addr(addr: core::net::SocketAddr) -> Self {
        let ip = match addr.ip() {
            core::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            core::net::IpAddr::V6(v6) => v6,
        };
        SockAddr {
            addr: ip.octets(),
            port: addr.port(),
            _pad: 0,
        }
    }

    /// As a socket address: IPv4-mapped addresses come back as IPv4.
    pub fn to_socket_addr(&self) -> core::net::SocketAddr {
        let v6 = core::net::Ipv6Addr::from(self.addr);
        let ip = match v6.to_ipv4_mapped() {
            Some(v4) => core::net::IpAddr::V4(v4),
            None => core::net::IpAddr::V6(v6),
        };
        core::net::SocketAddr::new(ip, self.port)
    }

    /// The IPv4 address in network byte order, when this is an IPv4-mapped address.
    #[inline(always)]
    pub const fn v4_be(&self) -> Option<u32> {
        let a = &self.addr;
        if a[0] == 0
            && a[1] == 0
            && a[2] == 0
            && a[3] == 0
            && a[4] == 0
            && a[5] == 0
            && a[6] == 0
            && a[7] == 0
            && a[8] == 0
            && a[9] == 0
            && a[10] == 0xff
            && a[11] == 0xff
        {
            Some(u32::from_ne_bytes([a[12], a[13], a[14], a[15]]))
        } else {
            None
        }
    }
}

/// What the programs remember about a redirected socket: where the application meant to go, and who it is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct OrigDst {
    /// The destination the application passed to connect()/sendmsg().
    pub dst: SockAddr,
    /// IP protocol (6 TCP, 17 UDP), with [`ORIG_REWRITTEN`] set when the fast path rewrote the
    /// destination to an endpoint (the socket never reaches the agent).
    pub protocol: u32,
    /// cgroup v2 id of the process that connected (its pod's cgroup).
    pub cgroup_id: u64,
    /// Network namespace cookie of the socket (its pod's netns).
    pub netns_cookie: u64,
}

/// Flag in [`OrigDst::protocol`]: the socket was rewritten to an endpoint by the fast path, not
/// steered to the agent. getpeername shows the original in place of the endpoint; sock_ops files no flow.
pub const ORIG_REWRITTEN: u32 = 0x100;

/// The third word of a v4-mapped address (`::ffff:0:0/96`) in network order.
pub const V4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Whether an address in `user_ip6` form is v4-mapped (`::ffff:a.b.c.d`).
#[inline(always)]
pub const fn is_v4_mapped(words: &[u32; 4]) -> bool {
    words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD
}

/// `::ffff:a.b.c.d` in `user_ip6` form, from an IPv4 address in network order.
#[inline(always)]
pub const fn v4_mapped_words(ip_be: u32) -> [u32; 4] {
    [0, 0, V4_MAPPED_WORD, ip_be]
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain-old-data, `#[repr(C)]`, all padding explicit and zeroed by constructors.
    unsafe impl aya::Pod for super::SockAddr {}
    // SAFETY: as above; `protocol` fills the hole before the u64s.
    unsafe impl aya::Pod for super::OrigDst {}
    // The fast path's keys and values: `#[repr(C)]` integers and byte arrays, any bit pattern valid;
    // `fastpath`'s layout test holds each to the size of its fields (no hidden padding byte).
    // SAFETY: a u32 and 16 bytes: 20 bytes, no padding.
    unsafe impl aya::Pod for super::fastpath::IpKey {}
    // SAFETY: a u32 and an `IpKey`, both 4-aligned: 24 bytes, no padding.
    unsafe impl aya::Pod for super::fastpath::AddrKey {}
    // SAFETY: three u32s: 12 bytes, no padding.
    unsafe impl aya::Pod for super::fastpath::Claim {}
    // SAFETY: a u32, a u16 and the explicit `_pad` u16: 8 bytes, no padding.
    unsafe impl aya::Pod for super::fastpath::PortKey {}
    // SAFETY: two u32s and `Backend`s of 16 bytes, a u16 and the explicit `_pad` u16: 328 bytes,
    // no padding.
    unsafe impl aya::Pod for super::fastpath::Backends {}
    // SAFETY: four u8s, the last the explicit `_pad`: 4 bytes, no padding.
    unsafe impl aya::Pod for super::fastpath::Config {}
    // SAFETY: six u64s, three `IpKey`s, three u16s, four u8s and the explicit two-byte `_pad`:
    // 120 bytes, no padding (`records`' layout test).
    unsafe impl aya::Pod for super::records::ConnRecord {}
    // SAFETY: two u8s and a u16: 4 bytes, no padding (`inbound`'s layout test).
    unsafe impl aya::Pod for super::inbound::InboundVerdict {}
    // SAFETY: 32 address bytes and four u16s: 40 bytes, no padding.
    unsafe impl aya::Pod for super::inbound::InboundEvent {}
    // SAFETY: two `SockAddr`s: 40 bytes, no padding.
    unsafe impl aya::Pod for super::FlowEnds {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(core::mem::size_of::<SockAddr>(), 20);
        assert_eq!(core::mem::size_of::<OrigDst>(), 40);
        assert_eq!(core::mem::align_of::<OrigDst>(), 8);
    }

    #[test]
    fn v4_round_trips_through_mapped_form() {
        // 203.0.113.10 as the kernel hands it: network byte order in a u32.
        let be = u32::from_ne_bytes([203, 0, 113, 10]);
        let sa = SockAddr::from_v4_be(be, 80);
        assert_eq!(&sa.addr[10..], &[0xff, 0xff, 203, 0, 113, 10]);
        assert_eq!(sa.v4_be(), Some(be));
        let mut v6 = sa;
        v6.addr[0] = 0x20;
        assert_eq!(v6.v4_be(), None);
    }

    #[test]
    fn socket_addr_conversions_agree_with_kernel_layout() {
        let addr: core::net::SocketAddr = "203.0.113.10:8080".parse().unwrap();
        let sa = SockAddr::from_socket_addr(addr);
        assert_eq!(
            sa,
            SockAddr::from_v4_be(u32::from_ne_bytes([203, 0, 113, 10]), 8080)
        );
        assert_eq!(sa.to_socket_addr(), addr);
        let v6: core::net::SocketAddr = "[2001:db8::1]:53".parse().unwrap();
        assert_eq!(SockAddr::from_socket_addr(v6).to_socket_addr(), v6);
    }

    #[test]
    fn ip6_words_are_the_kernels_network_order_form() {
        // 2001:db8::1 as the kernel's user_ip6: each word holds four address bytes in memory order.
        let ip: core::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
        let o = ip.octets();
        let words = [
            u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
            u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
            u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
            u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
        ];
        let sa = SockAddr::from_ip6_words(words, 53);
        assert_eq!(sa.addr, o);
        assert_eq!(sa.ip6_words(), words);
        assert!(!is_v4_mapped(&words));
    }

    #[test]
    fn a_v4_mapped_address_files_the_same_key_as_its_ipv4_form() {
        let be = u32::from_ne_bytes([10, 244, 1, 10]);
        let mapped = SockAddr::from_ip6_words(v4_mapped_words(be), 40000);
        assert!(is_v4_mapped(&mapped.ip6_words()));
        assert_eq!(mapped, SockAddr::from_v4_be(be, 40000));
        let addr: core::net::SocketAddr = "10.244.1.10:40000".parse().unwrap();
        assert_eq!(mapped.to_socket_addr(), addr);
    }

    #[test]
    fn flow_ends_built_from_words_are_the_two_addresses_field_by_field() {
        let local = SockAddr::from_v4_be(u32::from_ne_bytes([10, 244, 1, 10]), 40000);
        let remote = SockAddr::from_ip6_words([0x20010db8u32.to_be(), 0, 0, 1u32.to_be()], 443);
        let ends = FlowEnds::from_words(local.ip6_words(), 40000, remote.ip6_words(), 443);
        assert_eq!(ends, FlowEnds { local, remote });
        assert_eq!(core::mem::size_of::<FlowEnds>(), 40);
    }
}
