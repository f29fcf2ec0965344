//! `getpeername()` on an IPv4 socket: the hook that shows the application the peer it connected
//! to rather than the agent's gateway (or the endpoint the fast path picked). Applications log,
//! check and reconnect by that address; steering must not change what they see.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::v4_mapped_words;

use crate::steer::{Dest, mptcp_peer, original_peer};

/// getpeername() on a steered socket returns the peer the application connected to, not the
/// gateway; on one the fast path rewrote, not the endpoint.
#[cgroup_sock_addr(getpeername4)]
pub(crate) fn getpeername4(ctx: SockAddrContext) -> i32 {
    // SAFETY: `sock_addr` is the context the kernel passed this program: valid for the whole call,
    // and the only reference to it; the verifier allows writing `user_ip4` and `user_port`.
    let sa = unsafe { &mut *ctx.sock_addr };
    let seen = Dest {
        ip: v4_mapped_words(sa.user_ip4),
        port: u16::from_be(sa.user_port as u16),
    };
    if let Some(orig) = original_peer(&ctx, &seen.ip).or_else(|| mptcp_peer(&ctx, &seen)) {
        sa.user_ip4 = orig.ip[3];
        sa.user_port = u32::from(orig.port.to_be());
    }
    1
}
