use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::steer::{Hook, steer};

/// Unconnected UDP sendmsg()/sendto() to port 53 goes to the DNS proxy.
#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    steer(&ctx, Hook::SendMsg);
    1
}
