//! The decision shared by the connect and sendmsg hooks of both families: should this socket address
//! be steered to the agent, and where to. Kept in one place so every hook agrees.
//!
//! Addresses are handled in the kernel's `user_ip6` form (four network-order words) whatever the
//! socket's family: an IPv4 destination is its v4-mapped form, so `connect4` to `a.b.c.d` and
//! `connect6` to `::ffff:a.b.c.d` reach the same decision and file the same map keys.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_netns_cookie,
    },
    programs::SockAddrContext,
};
use redirect_common::{
    AGENT_SOCKET_MARK, DNS_PORT, FlowEnds, IPPROTO_MPTCP, MAX_CGROUP_DEPTH, ORIG_REWRITTEN,
    OrigDst, SockAddr, Stat, is_v4_mapped, v4_mapped_words,
};

use crate::{
    fastpath::{self, Fast},
    maps::{
        OPTED_OUT_CGROUPS, SUBFLOW_ORIG_DST, count, dns_proxy_port, gateway_v4, gateway_v6,
        node_netns_cookie, proxy_port,
    },
    origin, records,
};

pub(crate) const IPPROTO_TCP: u32 = 6;
const AF_INET: u32 = 2;
pub(crate) const IPPROTO_UDP: u32 = 17;

/// Which traffic a hook handles.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hook {
    /// connect(): TCP to any port, UDP to port 53.
    Connect,
    /// sendmsg() on an unconnected UDP socket: port 53 only.
    SendMsg,
}

/// An address in `user_ip6` form and a port in host byte order.
#[derive(Clone, Copy)]
pub(crate) struct Dest {
    pub ip: [u32; 4],
    pub port: u16,
}

/// Word by word, without short-circuit: no memcmp call in BPF, and one straight-line check.
#[inline(always)]
pub(crate) fn same_ip(a: &[u32; 4], b: &[u32; 4]) -> bool {
    ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) == 0
}

/// The gateway of `ip`'s family in `user_ip6` form: the v4-mapped IPv4 gateway for an IPv4 (or
/// v4-mapped) destination, the IPv6 gateway otherwise; `None` when that family has no gateway.
#[inline(always)]
pub(crate) fn gateway_for(ip: &[u32; 4]) -> Option<[u32; 4]> {
    if is_v4_mapped(ip) {
        let gw = gateway_v4();
        return (gw != 0).then_some(v4_mapped_words(gw));
    }
    let gw = gateway_v6();
    (!same_ip(&gw, &[0; 4])).then_some(gw)
}

/// Addresses that stay on the host that sent them: 127/8, ::1, and the unspecified address
/// (connect() to 0.0.0.0 or :: reaches the local host).
#[inline(always)]
fn is_local(ip: &[u32; 4]) -> bool {
    if is_v4_mapped(ip) {
        let first = ip[3].to_ne_bytes()[0];
        return first == 127 || ip[3] == 0;
    }
    let loopback = [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])];
    same_ip(ip, &loopback) || same_ip(ip, &[0; 4])
}

/// Decides whether the socket should go to the agent; if so remembers the original destination and
/// returns where to send it instead. `None`: leave the call as it is (never refuse it).
#[inline(always)]
pub(crate) fn steer(ctx: &SockAddrContext, hook: Hook, dst: Dest) -> Option<Dest> {
    let gateway = gateway_for(&dst.ip)?;
    // Loopback stays in the pod; traffic already addressed to the gateway is the agent's own business.
    if is_local(&dst.ip) || same_ip(&dst.ip, &gateway) {
        return None;
    }
    // SAFETY: `sock_addr` is the context the kernel passed the program: valid for the whole call.
    let sa = unsafe { &*ctx.sock_addr };
    let protocol = sa.protocol;
    let dns_port = dns_proxy_port();
    let (target_port, is_dns) = match (hook, protocol) {
        (_, IPPROTO_UDP) | (Hook::Connect, IPPROTO_TCP)
            if dst.port == DNS_PORT && dns_port != 0 =>
        {
            (dns_port, true)
        }
        (Hook::Connect, IPPROTO_TCP) => (proxy_port(), false),
        _ => return None,
    };
    if target_port == 0 {
        return None;
    }
    // SAFETY: `sk` is the one member of the union the kernel fills in a sock_addr context.
    let sk = unsafe { sa.__bindgen_anon_1.sk };
    // SAFETY: the verifier types ctx->sk as a valid socket pointer in sock_addr programs; it is
    // checked non-null before `mark` is read.
    if !sk.is_null() && unsafe { (*sk).mark } == AGENT_SOCKET_MARK {
        count(Stat::SkippedAgentMark);
        return None;
    }

    // A hostNetwork pod sits in the pods' cgroup tree but shares the node's netns: it is the node
    // talking, not a mesh workload, so it goes where it was going.
    // SAFETY: the helper reads the socket of the context the kernel passed the program, what it
    // takes in a sock_addr program.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let node_netns = node_netns_cookie();
    if node_netns != 0 && netns_cookie == node_netns {
        count(Stat::SkippedNodeNetns);
        return None;
    }

    if pod_opted_out() {
        count(Stat::SkippedOptedOut);
        return None;
    }

    // With `--fast-path`, the kernel decides what needs no proxy (off: always `Proxy`).
    let mut to = Dest {
        ip: gateway,
        port: target_port,
    };
    let mut rewritten = 0;
    if !is_dns {
        let mut outcome = 0;
        match fastpath::decide(&dst, &mut to, &mut outcome) {
            Fast::Leave => {
                records::opened(ctx, &dst, &dst, outcome);
                return None;
            }
            Fast::Rewrite => {
                records::opened(ctx, &dst, &to, outcome);
                rewritten = ORIG_REWRITTEN;
            }
            Fast::Proxy => {}
        }
    }

    let orig = OrigDst {
        dst: SockAddr::from_ip6_words(dst.ip, dst.port),
        protocol: protocol | rewritten,
        // SAFETY: the helper takes no argument and only reads the current task's cgroup.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        netns_cookie,
    };
    if !origin::remember(ctx, &orig) {
        count(Stat::MapUpdateFailed);
        // Without the origin the agent could not forward it: leave the socket alone. A rewrite
        // still reaches its endpoint; only getpeername() shows the endpoint.
        return (rewritten != 0).then_some(to);
    }
    if is_dns {
        count(Stat::DnsRedirected);
    } else if rewritten == 0 {
        count(Stat::TcpRedirected);
    }
    Some(to)
}

/// Whether the calling process sits in (or below) the cgroup of a pod that opted out of capture. A
/// container's cgroup is below its pod's, so the hook climbs from the root down to the process's own.
#[inline(always)]
fn pod_opted_out() -> bool {
    for level in 1..=MAX_CGROUP_DEPTH {
        // SAFETY: the helper takes a level and answers 0 past the task's own cgroup.
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level) };
        if id == 0 {
            return false; // above the process's own cgroup: nothing deeper to look at
        }
        // SAFETY: only the presence of the entry is read, never the value behind the reference.
        if unsafe { OPTED_OUT_CGROUPS.get(&id) }.is_some() {
            return true;
        }
    }
    false
}

/// The peer getpeername() should show in place of `seen`: the original destination of a socket
/// steered to the gateway, or of one the fast path rewrote to an endpoint.
#[inline(always)]
pub(crate) fn original_peer(ctx: &SockAddrContext, seen: &[u32; 4]) -> Option<Dest> {
    if let Some(gateway) = gateway_for(seen)
        && same_ip(seen, &gateway)
    {
        return unsteered_peer(ctx, seen);
    }
    let orig = orig_dst_of(ctx)?;
    (orig.protocol & ORIG_REWRITTEN != 0).then(|| Dest {
        ip: orig.dst.ip6_words(),
        port: orig.dst.port,
    })
}

/// getpeername()'s answer on an MPTCP socket, which the hooks never see connect: they steer its
/// first subflow (a TCP socket of its own, holding the storage). The original destination is filed
/// under the ends the two share, the subflow's peer being `seen`.
#[inline(always)]
pub(crate) fn mptcp_peer(ctx: &SockAddrContext, seen: &Dest) -> Option<Dest> {
    // SAFETY: `sock_addr` is the context the kernel passed the program: valid for the whole call.
    let sa = unsafe { &*ctx.sock_addr };
    if sa.protocol != IPPROTO_MPTCP {
        return None;
    }
    // SAFETY: the union's pointer member is the socket the verifier typed for this context.
    let sk = unsafe { sa.__bindgen_anon_1.sk };
    if sk.is_null() {
        return None;
    }
    // SAFETY: a non-null socket of this call; each field read in place, at its own offset.
    let (family, v4, v6, port) = unsafe {
        (
            core::ptr::read_volatile(&(*sk).family),
            core::ptr::read_volatile(&(*sk).src_ip4),
            [
                core::ptr::read_volatile(&(*sk).src_ip6[0]),
                core::ptr::read_volatile(&(*sk).src_ip6[1]),
                core::ptr::read_volatile(&(*sk).src_ip6[2]),
                core::ptr::read_volatile(&(*sk).src_ip6[3]),
            ],
            core::ptr::read_volatile(&(*sk).src_port),
        )
    };
    let local = if family == AF_INET {
        v4_mapped_words(v4)
    } else {
        v6
    };
    // `src_port` is in host byte order.
    let ends = FlowEnds::from_words(local, port as u16, seen.ip, seen.port);
    // SAFETY: the value is copied out at once.
    let orig = unsafe { SUBFLOW_ORIG_DST.get(&ends) }.copied()?;
    Some(Dest {
        ip: orig.dst.ip6_words(),
        port: orig.dst.port,
    })
}

/// The original destination remembered for this socket, if we steered it.
#[inline(always)]
pub(crate) fn orig_dst_of(ctx: &SockAddrContext) -> Option<OrigDst> {
    origin::recall(ctx)
}

/// The original destination to show in place of `seen` (a reply's source, or getpeername's peer):
/// `Some` only when `seen` is the gateway of its family and this socket was steered.
#[inline(always)]
pub(crate) fn unsteered_peer(ctx: &SockAddrContext, seen: &[u32; 4]) -> Option<Dest> {
    let gateway = gateway_for(seen)?;
    if !same_ip(seen, &gateway) {
        return None;
    }
    let orig = orig_dst_of(ctx)?;
    Some(Dest {
        ip: orig.dst.ip6_words(),
        port: orig.dst.port,
    })
}
