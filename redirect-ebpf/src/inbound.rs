//! sk_lookup in each guarded Pod's network namespace: inbound authorization at the moment a new
//! TCP connection to the Pod looks for its listening socket. A refused connection finds none: the
//! kernel answers its SYN with a reset, so the client's `connect()` fails at once, wherever it
//! comes from (a Pod of this node, another node in plaintext, the node itself).
//!
//! The node's own connections to the Pod pass: `node_origin` filed each in `NODE_DIALS` as its
//! SYN left the node, and it passes within a second of that (upstream never decides them: kubelet's probes among them; the agent's
//! own dials, HBONE received and the proxy's, were decided before they were made). Everything else is looked up in the table in force (`redirect_common::inbound`): the
//! Pod's port class, then every other port. No entry at all: the Pod is not guarded, passed.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns, macros::sk_lookup, maps::lpm_trie::Key, programs::SkLookupContext,
};
use redirect_common::{
    FlowEnds,
    inbound::{
        INBOUND_ALLOW, INBOUND_EVENTS_LOST, INBOUND_NODE_PASSED, INBOUND_RULES, InboundBytes,
        InboundEvent, InboundVerdict, OTHER_PORTS,
    },
    ip6_bytes, v4_mapped_words,
};

use crate::{
    fastpath::from_words,
    maps::{INBOUND_COUNTS, INBOUND_EVENTS, INBOUND_TABLE, NODE_DIALS},
};

/// How long a SYN the node sent is its own to pass: from `node_origin` to this lookup is
/// microseconds; a retransmitted SYN is filed again.
const NODE_DIAL_FRESH_NS: u64 = 1_000_000_000;

const SK_PASS: u32 = 1;
const SK_DROP: u32 = 0;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const IPPROTO_TCP: u32 = 6;

#[sk_lookup]
pub(crate) fn inbound(ctx: SkLookupContext) -> u32 {
    let Some(c) = read(&ctx) else {
        return SK_PASS;
    };
    let (local, local_port, remote, remote_port) = (c.local, c.local_port, c.remote, c.remote_port);
    let ends = FlowEnds::from_words(local, local_port, remote, remote_port);
    // SAFETY: the value is copied at once.
    let filed = unsafe { NODE_DIALS.get(&ends) }.copied();
    // SAFETY: the helper takes no argument.
    let now = unsafe { bpf_ktime_get_ns() };
    // Only a SYN filed just now: a later connection from the same address and port is decided as
    // any other. Never removed here: during a hand-over a predecessor's program and a successor's
    // both look it up, and both must let it through.
    if filed.is_some_and(|at| now.wrapping_sub(at) < NODE_DIAL_FRESH_NS) {
        count(INBOUND_NODE_PASSED);
        return SK_PASS;
    }
    let Some(table) = INBOUND_TABLE.get(0) else {
        return SK_PASS;
    };
    let mut found = table.get(&key(&local, local_port, &remote)).copied();
    if found.is_none() {
        found = table.get(&key(&local, OTHER_PORTS, &remote)).copied();
    }
    let Some(verdict) = found else {
        return SK_PASS;
    };
    let rule = if (verdict.rule as u32) < INBOUND_RULES {
        verdict.rule as u32
    } else {
        INBOUND_RULES - 1
    };
    if verdict.allow == INBOUND_ALLOW {
        count(2 * rule + 1);
        return SK_PASS;
    }
    count(2 * rule);
    report(&local, local_port, &remote, remote_port, &verdict);
    SK_DROP
}

/// A TCP connection's two ends, IPv4 v4-mapped, ports in host order.
struct Ends {
    local: [u32; 4],
    local_port: u16,
    remote: [u32; 4],
    remote_port: u16,
}

/// The connection the lookup is for; `None` for anything but TCP over IPv4 or IPv6. Every field
/// is read up front, each its own load at a fixed offset of the context (the verifier refuses a
/// context pointer moved by a computed offset, which choosing between fields can compile to).
#[inline(always)]
fn read(ctx: &SkLookupContext) -> Option<Ends> {
    let l = ctx.lookup;
    // SAFETY: `lookup` is the context the kernel passed this program, valid and aligned for the
    // whole call; every field read is one sk_lookup programs may read, at its own size (reading
    // the other family's addresses gives zeros). Volatile, so each stays its own load.
    let (protocol, family, local4, remote4, local6, remote6, local_port, remote_port) = unsafe {
        (
            core::ptr::read_volatile(&(*l).protocol),
            core::ptr::read_volatile(&(*l).family),
            core::ptr::read_volatile(&(*l).local_ip4),
            core::ptr::read_volatile(&(*l).remote_ip4),
            [
                core::ptr::read_volatile(&(*l).local_ip6[0]),
                core::ptr::read_volatile(&(*l).local_ip6[1]),
                core::ptr::read_volatile(&(*l).local_ip6[2]),
                core::ptr::read_volatile(&(*l).local_ip6[3]),
            ],
            [
                core::ptr::read_volatile(&(*l).remote_ip6[0]),
                core::ptr::read_volatile(&(*l).remote_ip6[1]),
                core::ptr::read_volatile(&(*l).remote_ip6[2]),
                core::ptr::read_volatile(&(*l).remote_ip6[3]),
            ],
            core::ptr::read_volatile(&(*l).local_port),
            core::ptr::read_volatile(&(*l).remote_port),
        )
    };
    if protocol != IPPROTO_TCP {
        return None;
    }
    let (local, remote) = match family {
        AF_INET => (v4_mapped_words(local4), v4_mapped_words(remote4)),
        AF_INET6 => (local6, remote6),
        _ => return None,
    };
    Some(Ends {
        local,
        local_port: local_port as u16,
        remote,
        remote_port: u16::from_be(remote_port),
    })
}

/// Tells the agent of a refusal, for its access log; counted when the ring is full.
#[inline(always)]
fn report(
    local: &[u32; 4],
    local_port: u16,
    remote: &[u32; 4],
    remote_port: u16,
    v: &InboundVerdict,
) {
    let event = InboundEvent {
        src: ip6_bytes(*remote),
        dst: ip6_bytes(*local),
        src_port: remote_port,
        dst_port: local_port,
        rule: v.rule,
        _pad: 0,
    };
    if INBOUND_EVENTS.output::<InboundEvent>(&event, 0).is_err() {
        count(INBOUND_EVENTS_LOST);
    }
}

#[inline(always)]
fn count(slot: u32) {
    if let Some(counter) = INBOUND_COUNTS.get_ptr_mut(slot) {
        // SAFETY: `get_ptr_mut` gave this CPU's slot, aligned and valid while the program runs; a
        // per-CPU slot has no other writer while this program runs on this CPU.
        unsafe { *counter += 1 }
    }
}

/// The whole trie key of (`dst`, `port_class`, `src`): every bit of it, so the trie finds the
/// longest stored prefix. Written word by word (see `from_words`).
#[inline(always)]
fn key(dst: &[u32; 4], port_class: u16, src: &[u32; 4]) -> Key<InboundBytes> {
    let bits = (core::mem::size_of::<InboundBytes>() * 8) as u32;
    // Big-endian port in the first two bytes of its word, the zero pad after.
    let p = port_class.to_be_bytes();
    let port = u32::from_ne_bytes([p[0], p[1], 0, 0]);
    from_words::<KeyWords, 10>([
        bits, dst[0], dst[1], dst[2], dst[3], port, src[0], src[1], src[2], src[3],
    ])
    .0
}

/// An LPM key aligned for word writes (the trie's key type is packed).
#[repr(C, align(4))]
struct KeyWords(Key<InboundBytes>);
