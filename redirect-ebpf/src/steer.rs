//! The decision shared by connect4 and sendmsg4: should this socket address be steered to the agent,
//! and to which port. Kept in one place so both hooks agree.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_netns_cookie,
        bpf_get_socket_cookie,
    },
    programs::SockAddrContext,
};
use redirect_common::{AGENT_SOCKET_MARK, DNS_PORT, MAX_CGROUP_DEPTH, OrigDst, SockAddr, Stat};

use crate::maps::{
    OPTED_OUT_CGROUPS, SOCKET_ORIG_DST, count, dns_proxy_port, gateway_v4, node_netns_cookie,
    proxy_port,
};

pub const IPPROTO_TCP: u32 = 6;
pub const IPPROTO_UDP: u32 = 17;

/// Which traffic a hook handles.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// connect(): TCP to any port, UDP to port 53.
    Connect,
    /// sendmsg() on an unconnected UDP socket: port 53 only.
    SendMsg,
}

/// Rewrites the destination to the agent when the socket should be steered, remembering the original.
/// Never refuses the call: a socket we do not steer goes where it was going.
#[inline(always)]
pub fn steer(ctx: &SockAddrContext, hook: Hook) {
    let sa = unsafe { &mut *ctx.sock_addr };
    let gateway = gateway_v4();
    if gateway == 0 {
        return;
    }
    let dst_ip = sa.user_ip4;
    // Loopback stays in the pod; traffic already addressed to the gateway is the agent's own business.
    if dst_ip.to_ne_bytes()[0] == 127 || dst_ip == gateway {
        return;
    }
    let protocol = sa.protocol;
    let dst_port = u16::from_be(sa.user_port as u16);
    let dns_port = dns_proxy_port();
    let target_port = match (hook, protocol) {
        (_, IPPROTO_UDP) | (Hook::Connect, IPPROTO_TCP)
            if dst_port == DNS_PORT && dns_port != 0 =>
        {
            dns_port
        }
        (Hook::Connect, IPPROTO_TCP) => proxy_port(),
        _ => return,
    };
    if target_port == 0 {
        return;
    }
    // The verifier types ctx->sk as a valid socket pointer in sock_addr programs.
    let sk = unsafe { sa.__bindgen_anon_1.sk };
    if !sk.is_null() && unsafe { (*sk).mark } == AGENT_SOCKET_MARK {
        count(Stat::SkippedAgentMark);
        return;
    }

    // A hostNetwork pod sits in the pods' cgroup tree but shares the node's netns: it is the node
    // talking, not a mesh workload, so it goes where it was going.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let node_netns = node_netns_cookie();
    if node_netns != 0 && netns_cookie == node_netns {
        count(Stat::SkippedNodeNetns);
        return;
    }

    if pod_opted_out() {
        count(Stat::SkippedOptedOut);
        return;
    }

    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let orig = OrigDst {
        dst: SockAddr::from_v4_be(dst_ip, dst_port),
        protocol,
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        netns_cookie,
    };
    if SOCKET_ORIG_DST.insert(&cookie, &orig, 0).is_err() {
        // Without the origin the agent could not forward it: leave the socket alone.
        count(Stat::MapUpdateFailed);
        return;
    }
    sa.user_ip4 = gateway;
    sa.user_port = u32::from(target_port.to_be());
    count(if target_port == dns_port {
        Stat::DnsRedirected
    } else {
        Stat::TcpRedirected
    });
}

/// Whether the calling process sits in (or below) the cgroup of a pod that opted out of capture. A
/// container's cgroup is below its pod's, so the hook climbs from the root down to the process's own.
#[inline(always)]
fn pod_opted_out() -> bool {
    for level in 1..=MAX_CGROUP_DEPTH {
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level) };
        if id == 0 {
            return false; // above the process's own cgroup: nothing deeper to look at
        }
        if unsafe { OPTED_OUT_CGROUPS.get(&id) }.is_some() {
            return true;
        }
    }
    false
}

/// The original destination remembered for this socket, if we steered it.
#[inline(always)]
pub fn orig_dst_of(ctx: &SockAddrContext) -> Option<OrigDst> {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    unsafe { SOCKET_ORIG_DST.get(&cookie) }.copied()
}
