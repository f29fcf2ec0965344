//! `sendmsg()` on an unconnected IPv6 UDP socket: `sendmsg4`'s steering of DNS queries for IPv6
//! sockets, so a pod's resolver reaches the DNS proxy whichever family it queries over.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::{
    inet6,
    steer::{Hook, steer},
};

/// sendmsg4 for IPv6 sockets: unconnected UDP to an IPv6 port 53 goes to the DNS proxy. (An IPv6
/// socket sending to a v4-mapped address never gets here: the kernel hands that datagram to the IPv4
/// path, which runs sendmsg4; its reply still comes back through recvmsg6, v4-mapped.)
#[cgroup_sock_addr(sendmsg6)]
pub(crate) fn sendmsg6(ctx: SockAddrContext) -> i32 {
    if let Some(to) = steer(&ctx, Hook::SendMsg, inet6::read(&ctx)) {
        inet6::write(&ctx, to);
    }
    1
}
