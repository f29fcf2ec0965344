use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::{
    inet6,
    steer::{Hook, steer},
};

/// sendmsg4 for IPv6 sockets: unconnected UDP to port 53 (v4-mapped or IPv6) goes to the DNS proxy.
#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    if let Some(to) = steer(&ctx, Hook::SendMsg, inet6::read(&ctx)) {
        inet6::write(&ctx, to);
    }
    1
}
