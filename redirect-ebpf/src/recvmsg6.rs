//! `recvmsg()` on an IPv6 UDP socket: `recvmsg4`'s restoring of the reply's source for IPv6
//! sockets, v4-mapped when the resolver was addressed that way.
use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use redirect_common::Stat;

use crate::{
    inet6,
    maps::{count, dns_proxy_port},
    steer::unsteered_peer,
};

/// recvmsg4 for IPv6 sockets: a reply from the DNS proxy (at either gateway) comes from the resolver
/// the client addressed, v4-mapped when that is what it asked.
#[cgroup_sock_addr(recvmsg6)]
pub(crate) fn recvmsg6(ctx: SockAddrContext) -> i32 {
    let dns_port = dns_proxy_port();
    let seen = inet6::read(&ctx);
    if dns_port == 0 || seen.port != dns_port {
        return 1;
    }
    if let Some(orig) = unsteered_peer(&ctx, &seen.ip) {
        inet6::write(&ctx, orig);
        count(Stat::DnsReplyRewritten);
    }
    1
}
