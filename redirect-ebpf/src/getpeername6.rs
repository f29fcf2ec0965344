//! `getpeername()` on an IPv6 socket: `getpeername4`'s restoring of the original peer for IPv6
//! sockets, v4-mapped when the application connected that way.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::{
    inet6,
    steer::{mptcp_peer, original_peer},
};

/// getpeername4 for IPv6 sockets: the original peer, v4-mapped when the application asked so.
#[cgroup_sock_addr(getpeername6)]
pub(crate) fn getpeername6(ctx: SockAddrContext) -> i32 {
    let seen = inet6::read(&ctx);
    if let Some(orig) = original_peer(&ctx, &seen.ip).or_else(|| mptcp_peer(&ctx, &seen)) {
        inet6::write(&ctx, orig);
    }
    1
}
