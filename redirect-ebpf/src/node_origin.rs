//! tc egress on the node's veths (the node's end of each Pod's link): files each new TCP connection
//! that a socket of the node itself opens to a Pod, for `inbound` to admit once. Upstream never
//! sends the node's own connections to a Pod (kubelet's health probes among them) to ztunnel, so no
//! policy decides them; the agent's own dials (HBONE received, the proxy's, already decided) are
//! the node's sockets too.
//!
//! A packet a socket of the node sent leaves with that socket attached (`skb->sk`); one the node
//! forwards (from another node, from outside, from another Pod) has none. Only a SYN without ACK is
//! filed, with the time it left: `inbound` lets it through only just after. The program never drops
//! or changes a packet.
use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::classifier, programs::TcContext};
use redirect_common::{FlowEnds, v4_mapped_words};

use crate::maps::NODE_DIALS;

/// `TC_ACT_UNSPEC` (and `TCX_NEXT`): the programs and filters after this one still run.
const NEXT: i32 = -1;
const ETH_HEADER: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPV6_HEADER: usize = 40;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

#[classifier]
pub(crate) fn node_origin(ctx: TcContext) -> i32 {
    // SAFETY: `skb` is the context the kernel passed this program, valid for the whole call;
    // reading `sk` is allowed to tc programs (the socket is only tested for presence).
    let from_node_socket = unsafe { !(*ctx.skb.skb).__bindgen_anon_2.sk.is_null() };
    if from_node_socket && let Some(ends) = syn_ends(&ctx) {
        // SAFETY: the helper takes no argument.
        let now = unsafe { bpf_ktime_get_ns() };
        let _ = NODE_DIALS.insert(&ends, &now, 0);
    }
    NEXT
}

/// The ends of a TCP SYN (without ACK), the Pod's as `local`; `None` for any other packet.
#[inline(always)]
fn syn_ends(ctx: &TcContext) -> Option<FlowEnds> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    let (src, dst, tcp) = if ethertype == ETH_P_IP {
        let version_ihl: u8 = ctx.load(ETH_HEADER).ok()?;
        let protocol: u8 = ctx.load(ETH_HEADER + 9).ok()?;
        let fragment = u16::from_be(ctx.load::<u16>(ETH_HEADER + 6).ok()?) & 0x1fff;
        if version_ihl >> 4 != 4 || protocol != IPPROTO_TCP || fragment != 0 {
            return None;
        }
        let saddr: u32 = ctx.load(ETH_HEADER + 12).ok()?;
        let daddr: u32 = ctx.load(ETH_HEADER + 16).ok()?;
        let tcp = ETH_HEADER + usize::from(version_ihl & 0x0f) * 4;
        (v4_mapped_words(saddr), v4_mapped_words(daddr), tcp)
    } else if ethertype == ETH_P_IPV6 {
        // A TCP header right after the fixed header: the SYNs the node's sockets send carry no
        // extension header.
        let next: u8 = ctx.load(ETH_HEADER + 6).ok()?;
        if next != IPPROTO_TCP {
            return None;
        }
        let word = |at: usize| ctx.load::<u32>(at).ok();
        let src = [word(22)?, word(26)?, word(30)?, word(34)?];
        let dst = [word(38)?, word(42)?, word(46)?, word(50)?];
        (src, dst, ETH_HEADER + IPV6_HEADER)
    } else {
        return None;
    };
    let flags: u8 = ctx.load(tcp + 13).ok()?;
    if flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        return None;
    }
    let sport = u16::from_be(ctx.load::<u16>(tcp).ok()?);
    let dport = u16::from_be(ctx.load::<u16>(tcp + 2).ok()?);
    Some(FlowEnds::from_words(dst, dport, src, sport))
}
