use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::Stat;

use crate::{
    maps::{count, dns_proxy_port, gateway_v4},
    steer::orig_dst_of,
};

/// A DNS reply from the DNS proxy must look as if it came from the resolver the client addressed,
/// or the client drops it.
#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let dns_port = dns_proxy_port();
    if dns_port == 0 || sa.user_ip4 != gateway_v4() || u16::from_be(sa.user_port as u16) != dns_port
    {
        return 1;
    }
    if let Some(orig) = orig_dst_of(&ctx)
        && let Some(ip) = orig.dst.v4_be()
    {
        sa.user_ip4 = ip;
        sa.user_port = u32::from(orig.dst.port.to_be());
        count(Stat::DnsReplyRewritten);
    }
    1
}
