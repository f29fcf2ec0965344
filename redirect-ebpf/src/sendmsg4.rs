//! `sendmsg()` on an unconnected IPv4 UDP socket: the hook that sends a pod's DNS queries to the
//! DNS proxy. A resolver that sends without `connect()` (musl's, for one) would otherwise escape
//! `connect4`.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::v4_mapped_words;

use crate::steer::{Dest, Hook, steer};

/// Unconnected UDP sendmsg()/sendto() to port 53 goes to the DNS proxy.
#[cgroup_sock_addr(sendmsg4)]
pub(crate) fn sendmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: `sock_addr` is the context the kernel passed this program: valid for the whole call,
    // and the only reference to it; the verifier allows writing `user_ip4` and `user_port`.
    let sa = unsafe { &mut *ctx.sock_addr };
    let dst = Dest {
        ip: v4_mapped_words(sa.user_ip4),
        port: u16::from_be(sa.user_port as u16),
    };
    if let Some(to) = steer(&ctx, Hook::SendMsg, dst) {
        sa.user_ip4 = to.ip[3];
        sa.user_port = u32::from(to.port.to_be());
    }
    1
}
