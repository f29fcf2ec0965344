//! `connect()` on an IPv6 socket: `connect4`'s steering for IPv6 sockets, including those a
//! dual-stack application opens to a v4-mapped address, which must be decided exactly as the IPv4
//! destination they stand for so both families see the same services.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::{
    inet6,
    steer::{Hook, steer},
};

/// connect4 for IPv6 sockets. A v4-mapped destination (`::ffff:a.b.c.d`, what a JVM connects to
/// for an IPv4 address) is decided as the IPv4 one and goes to the IPv4 gateway in its v4-mapped
/// form; a native IPv6 destination goes to the IPv6 gateway.
#[cgroup_sock_addr(connect6)]
pub(crate) fn connect6(ctx: SockAddrContext) -> i32 {
    if let Some(to) = steer(&ctx, Hook::Connect, inet6::read(&ctx)) {
        inet6::write(&ctx, to);
    }
    1
}
