use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

use crate::steer::{Hook, steer};

/// TCP connect() to anything but loopback goes to the outbound proxy; TCP and UDP connect() to
/// port 53 go to the DNS proxy (glibc and dig connect their UDP socket before sending).
#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    steer(&ctx, Hook::Connect);
    1 // allow the call, rewritten or not
}
