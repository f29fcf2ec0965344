//! `recvmsg()` on an IPv4 UDP socket: the hook that makes a reply from the DNS proxy look as if it
//! came from the resolver the pod addressed. Resolvers drop answers from any other source, so
//! without it a steered query would never get its answer.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::{Stat, v4_mapped_words};

use crate::{
    maps::{count, dns_proxy_port},
    steer::unsteered_peer,
};

/// A DNS reply from the DNS proxy must look as if it came from the resolver the client addressed,
/// or the client drops it.
#[cgroup_sock_addr(recvmsg4)]
pub(crate) fn recvmsg4(ctx: SockAddrContext) -> i32 {
    // SAFETY: `sock_addr` is the context the kernel passed this program: valid for the whole call,
    // and the only reference to it; the verifier allows writing `user_ip4` and `user_port`.
    let sa = unsafe { &mut *ctx.sock_addr };
    let dns_port = dns_proxy_port();
    if dns_port == 0 || u16::from_be(sa.user_port as u16) != dns_port {
        return 1;
    }
    if let Some(orig) = unsteered_peer(&ctx, &v4_mapped_words(sa.user_ip4)) {
        // An IPv4 socket was steered by connect4/sendmsg4: its original is v4-mapped.
        sa.user_ip4 = orig.ip[3];
        sa.user_port = u32::from(orig.port.to_be());
        count(Stat::DnsReplyRewritten);
    }
    1
}
