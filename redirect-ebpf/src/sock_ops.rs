use aya_ebpf::{
    bindings::BPF_SOCK_OPS_TCP_CONNECT_CB, helpers::bpf_get_socket_cookie, macros::sock_ops,
    programs::SockOpsContext,
};
use redirect_common::{ORIG_REWRITTEN, SockAddr, Stat};

use crate::maps::{FLOW_ORIG_DST, SOCKET_ORIG_DST, count};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// At TCP_CONNECT_CB the local port is bound and the SYN has not left yet: file the original
/// destination under the client ip:port, which is what the agent sees as the peer after accept().
/// Filing it here, before the handshake, means the agent can never read the map too early.
#[sock_ops]
pub fn sock_ops(ctx: SockOpsContext) -> u32 {
    if ctx.op() != BPF_SOCK_OPS_TCP_CONNECT_CB {
        return 1;
    }
    let family = ctx.family();
    if family != AF_INET && family != AF_INET6 {
        return 1;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = (unsafe { SOCKET_ORIG_DST.get(&cookie) }).copied() else {
        return 1; // not a socket we steered
    };
    if orig.protocol & ORIG_REWRITTEN != 0 {
        return 1; // rewritten to an endpoint: the agent never sees it
    }
    // local_port is in host byte order in bpf_sock_ops (remote_port is not). An IPv6 socket talking
    // to a v4-mapped address has its IPv4 source in v4-mapped form here: the same key as from IPv4.
    let port = ctx.local_port() as u16;
    // Both fields are read whatever the family, and only the values are chosen: with a load in each
    // branch LLVM merges them into one load through a ctx pointer plus a chosen offset, which the
    // verifier refuses (no access through a modified ctx pointer).
    let v4 = ctx.local_ip4();
    let v6 = ctx.local_ip6();
    let client = if family == AF_INET {
        SockAddr::from_v4_be(v4, port)
    } else {
        SockAddr::from_ip6_words(v6, port)
    };
    if FLOW_ORIG_DST.insert(&client, &orig, 0).is_ok() {
        count(Stat::FlowFiled);
    } else {
        count(Stat::MapUpdateFailed);
    }
    1
}
