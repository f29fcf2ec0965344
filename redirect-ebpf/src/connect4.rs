//! `connect()` on an IPv4 socket: the hook that steers a pod's TCP connections to the outbound
//! proxy (or, with the fast path, leaves them alone or rewrites them to an endpoint in the kernel)
//! and its connected DNS sockets to the DNS proxy. It runs before the kernel picks a route, so the
//! pod's connection is to the agent from its first packet, with nothing to undo later.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::v4_mapped_words;

use crate::steer::{Dest, Hook, steer};

/// TCP connect() to anything but loopback goes to the outbound proxy; TCP and UDP connect() to
/// port 53 go to the DNS proxy (glibc and dig connect their UDP socket before sending).
#[cgroup_sock_addr(connect4)]
pub(crate) fn connect4(ctx: SockAddrContext) -> i32 {
    // SAFETY: `sock_addr` is the context the kernel passed this program: valid for the whole call,
    // and the only reference to it; the verifier allows writing `user_ip4` and `user_port`.
    let sa = unsafe { &mut *ctx.sock_addr };
    let dst = Dest {
        ip: v4_mapped_words(sa.user_ip4),
        port: u16::from_be(sa.user_port as u16),
    };
    if let Some(to) = steer(&ctx, Hook::Connect, dst) {
        // An IPv4 destination always gets the (v4-mapped) IPv4 gateway: its last word.
        sa.user_ip4 = to.ip[3];
        sa.user_port = u32::from(to.port.to_be());
    }
    1 // allow the call, rewritten or not
}
