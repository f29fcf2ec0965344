use aya_ebpf::{
    bindings::BPF_SOCK_OPS_TCP_CONNECT_CB, helpers::bpf_get_socket_cookie, macros::sock_ops,
    programs::SockOpsContext,
};
use redirect_common::{SockAddr, Stat};

use crate::maps::{FLOW_ORIG_DST, SOCKET_ORIG_DST, count};

const AF_INET: u32 = 2;

/// At TCP_CONNECT_CB the local port is bound and the SYN has not left yet: file the original
/// destination under the client ip:port, which is what the agent sees as the peer after accept().
/// Filing it here, before the handshake, means the agent can never read the map too early.
#[sock_ops]
pub fn sock_ops(ctx: SockOpsContext) -> u32 {
    if ctx.op() != BPF_SOCK_OPS_TCP_CONNECT_CB || ctx.family() != AF_INET {
        return 1;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = (unsafe { SOCKET_ORIG_DST.get(&cookie) }).copied() else {
        return 1; // not a socket we steered
    };
    // local_port is in host byte order in bpf_sock_ops (remote_port is not).
    let client = SockAddr::from_v4_be(ctx.local_ip4(), ctx.local_port() as u16);
    if FLOW_ORIG_DST.insert(&client, &orig, 0).is_ok() {
        count(Stat::FlowFiled);
    } else {
        count(Stat::MapUpdateFailed);
    }
    1
}
