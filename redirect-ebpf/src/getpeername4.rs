use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::{maps::gateway_v4, steer::orig_dst_of};

/// getpeername() on a steered socket returns the peer the application connected to, not the gateway.
#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    if sa.user_ip4 != gateway_v4() {
        return 1;
    }
    if let Some(orig) = orig_dst_of(&ctx)
        && let Some(ip) = orig.dst.v4_be()
    {
        sa.user_ip4 = ip;
        sa.user_port = u32::from(orig.dst.port.to_be());
    }
    1
}
