use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::v4_mapped_words;

use crate::steer::original_peer;

/// getpeername() on a steered socket returns the peer the application connected to, not the
/// gateway; on one the fast path rewrote, not the endpoint.
#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    if let Some(orig) = original_peer(&ctx, &v4_mapped_words(sa.user_ip4)) {
        sa.user_ip4 = orig.ip[3];
        sa.user_port = u32::from(orig.port.to_be());
    }
    1
}
