//! Reading and writing the destination of an IPv6 socket address (`user_ip6`, `user_port`).
//!
//! Only the inet6 hooks may touch `user_ip6` (the verifier refuses it in the inet4 ones), so this
//! stays out of the shared decision. Each word is its own 4-byte access, which every kernel accepts.
use aya_ebpf::programs::SockAddrContext;

use crate::steer::Dest;

#[inline(always)]
pub(crate) fn read(ctx: &SockAddrContext) -> Dest {
    // SAFETY: `sock_addr` is the context the kernel passed the program: valid for the whole call.
    let sa = unsafe { &*ctx.sock_addr };
    // SAFETY: each pointer is to a word of that context, aligned and initialised; volatile so that
    // each stays its own 4-byte load.
    let ip = [
        unsafe { core::ptr::read_volatile(&sa.user_ip6[0]) },
        unsafe { core::ptr::read_volatile(&sa.user_ip6[1]) },
        unsafe { core::ptr::read_volatile(&sa.user_ip6[2]) },
        unsafe { core::ptr::read_volatile(&sa.user_ip6[3]) },
    ];
    Dest {
        ip,
        port: u16::from_be(sa.user_port as u16),
    }
}

#[inline(always)]
pub(crate) fn write(ctx: &SockAddrContext, to: Dest) {
    // SAFETY: `sock_addr` is the context the kernel passed the program: valid for the whole call and
    // the only reference to it; the verifier allows writing `user_ip6` and `user_port` in the inet6
    // hooks, the only callers.
    let sa = unsafe { &mut *ctx.sock_addr };
    for (i, word) in to.ip.iter().enumerate() {
        // SAFETY: a word of that context, aligned; volatile so that each stays its own 4-byte store.
        unsafe { core::ptr::write_volatile(&mut sa.user_ip6[i], *word) };
    }
    sa.user_port = u32::from(to.port.to_be());
}
