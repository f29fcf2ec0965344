//! tc ingress on the node's links, with HBONE between nodes: marks the packets that answer one of
//! the agent's sockets bound to an address that is not the node's (a Pod's), so that a policy rule
//! delivers them in the node's netns instead of forwarding them to that address. IPv4 and IPv6
//! (a TCP header right after the fixed IPv6 header: the agent's own connections carry no
//! extension headers).
//!
//! Two kinds of socket do that, and a cheap test finds each kind's packets before any lookup:
//! - the agent sends a Pod's connection to another node from the Pod's address: the answers come
//!   from the peer's port 15008 (`sport == HBONE_PORT`);
//! - the agent carries a stream received to a Pod of this node from the sender's address, a Pod of
//!   another node: the answers go to an address in `HBONE_SOURCES`.
//!
//! Only a socket the packet exactly answers is taken (a listener the lookup falls back to is not),
//! so a packet of the Pods' own that passes either test is forwarded as before. The program never
//! drops or redirects; it passes every packet on to whatever runs after it.
use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_CURRENT_NETNS, bpf_sock_tuple},
    helpers::{bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use redirect_common::{HBONE_PORT, HBONE_REPLY_MARK};

use crate::maps::{HBONE_SOURCES, HBONE_SOURCES6};

/// `TC_ACT_UNSPEC` (and `TCX_NEXT`): the programs and filters after this one still run.
const NEXT: i32 = -1;
const ETH_HEADER: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// The fixed IPv6 header.
const IPV6_HEADER: usize = 40;
const IPPROTO_TCP: u8 = 6;
/// `TCP_LISTEN` in the kernel's socket states.
const TCP_LISTEN: u32 = 10;

#[classifier]
pub(crate) fn hbone_replies(ctx: TcContext) -> i32 {
    if answers_agent_socket(&ctx).unwrap_or(false) {
        // SAFETY: `skb` is the context the kernel passed this program, valid for the whole call;
        // reading `mark` is allowed to tc programs.
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark(mark | HBONE_REPLY_MARK);
    }
    NEXT
}

/// Whether the packet is TCP that answers a socket of the node's netns bound to its destination,
/// and passes one of the two tests. `None` when the packet is too short to tell.
#[inline(always)]
fn answers_agent_socket(ctx: &TcContext) -> Option<bool> {
    match u16::from_be(ctx.load::<u16>(12).ok()?) {
        ETH_P_IP => answers_v4(ctx),
        ETH_P_IPV6 => answers_v6(ctx),
        _ => Some(false),
    }
}

#[inline(always)]
fn answers_v4(ctx: &TcContext) -> Option<bool> {
    let version_ihl: u8 = ctx.load(ETH_HEADER).ok()?;
    let protocol: u8 = ctx.load(ETH_HEADER + 9).ok()?;
    // A fragment after the first carries no ports.
    let fragment = u16::from_be(ctx.load::<u16>(ETH_HEADER + 6).ok()?) & 0x1fff;
    if version_ihl >> 4 != 4 || protocol != IPPROTO_TCP || fragment != 0 {
        return Some(false);
    }
    // Addresses and ports as the packet has them, in network order.
    let saddr: u32 = ctx.load(ETH_HEADER + 12).ok()?;
    let daddr: u32 = ctx.load(ETH_HEADER + 16).ok()?;
    let tcp = ETH_HEADER + usize::from(version_ihl & 0x0f) * 4;
    let sport: u16 = ctx.load(tcp).ok()?;
    let dport: u16 = ctx.load(tcp + 2).ok()?;
    let from_peer_port = u16::from_be(sport) == HBONE_PORT;
    // SAFETY: a lookup by a key on the stack; the value is only tested for presence.
    if !from_peer_port && unsafe { HBONE_SOURCES.get(&daddr) }.is_none() {
        return Some(false);
    }
    let mut tuple = bpf_sock_tuple {
        __bindgen_anon_1: aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1 {
            ipv4: aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
                saddr,
                daddr,
                sport,
                dport,
            },
        },
    };
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>();
    Some(answers_established(ctx, &mut tuple, size))
}

#[inline(always)]
fn answers_v6(ctx: &TcContext) -> Option<bool> {
    let next_header: u8 = ctx.load(ETH_HEADER + 6).ok()?;
    if next_header != IPPROTO_TCP {
        return Some(false);
    }
    let saddr: [u32; 4] = ctx.load(ETH_HEADER + 8).ok()?;
    let daddr: [u32; 4] = ctx.load(ETH_HEADER + 24).ok()?;
    let tcp = ETH_HEADER + IPV6_HEADER;
    let sport: u16 = ctx.load(tcp).ok()?;
    let dport: u16 = ctx.load(tcp + 2).ok()?;
    let from_peer_port = u16::from_be(sport) == HBONE_PORT;
    // SAFETY: as in `answers_v4`.
    if !from_peer_port && unsafe { HBONE_SOURCES6.get(&daddr) }.is_none() {
        return Some(false);
    }
    let mut tuple = bpf_sock_tuple {
        __bindgen_anon_1: aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1 {
            ipv6: aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr,
                daddr,
                sport,
                dport,
            },
        },
    };
    let size =
        core::mem::size_of::<aya_ebpf::bindings::bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>();
    Some(answers_established(ctx, &mut tuple, size))
}

/// Whether a socket of the node's netns that is not a listener has exactly `tuple` (`size` bytes
/// of it: the family's part).
#[inline(always)]
fn answers_established(ctx: &TcContext, tuple: &mut bpf_sock_tuple, size: usize) -> bool {
    // SAFETY: the helper reads `size` bytes of the tuple on our stack, for the skb the kernel
    // passed; a socket it returns is released below, on every path.
    let sk = unsafe {
        bpf_skc_lookup_tcp(
            ctx.as_ptr(),
            tuple,
            size as u32,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    if sk.is_null() {
        return false;
    }
    // SAFETY: a non-null socket from the lookup, not yet released; `state` is a field of its
    // common part, which every kind of socket the lookup returns has.
    let state = unsafe { (*sk).state };
    // SAFETY: released once, as the lookup requires.
    unsafe { bpf_sk_release(sk.cast()) };
    state != TCP_LISTEN
}
