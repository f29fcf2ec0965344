//! Inbound authorization in the kernel: the table the `inbound` program (sk_lookup, one link in
//! each Pod's network namespace) reads when a connection to the Pod is about to find its listening
//! socket, and what it reports.
//!
//! The table is a longest-prefix trie over [`InboundBytes`]: the Pod's address, the port class,
//! then the client's address. Every entry's prefix covers the first two whole
//! ([`INBOUND_FIXED_BITS`]) and some leading bits of the client's address, so that one lookup
//! finds the most specific source range the agent compiled for this Pod and port. A port some
//! policy of the Pod names is a class of its own; every other port is class 0. IPv4 addresses
//! are stored v4-mapped (`::ffff:a.b.c.d`), so one layout serves both families.

/// Bytes of one key: destination address (16), port class (2, big-endian), zero (2), source
/// address (16).
pub type InboundBytes = [u8; 36];

/// Bits of a key every entry fixes: destination, port class and the zero pad.
pub const INBOUND_FIXED_BITS: u32 = 160;

/// The port class of every port no policy of the Pod names.
pub const OTHER_PORTS: u16 = 0;

/// [`InboundVerdict::allow`] of a refused connection.
pub const INBOUND_DENY: u8 = 0;
/// [`InboundVerdict::allow`] of an admitted connection.
pub const INBOUND_ALLOW: u8 = 1;

/// Rules (distinct verdicts) the kernel counts apart; a later rule is counted in the last slot.
pub const INBOUND_RULES: u32 = 1024;
/// Slots of the per-CPU counters: two per rule (refused at `2 * rule`, admitted at
/// `2 * rule + 1`), then the node's own connections let through and the refusals the kernel
/// could not report.
pub const INBOUND_COUNT_SLOTS: u32 = 2 * INBOUND_RULES + 2;
/// The counter of the node's own connections (the agent's dials among them) let through.
pub const INBOUND_NODE_PASSED: u32 = 2 * INBOUND_RULES;
/// The counter of refusals that found the ring full.
pub const INBOUND_EVENTS_LOST: u32 = 2 * INBOUND_RULES + 1;

/// Bytes of the ring the kernel reports refusals on (a power of two, a multiple of the page).
pub const INBOUND_EVENTS_BYTES: u32 = 256 * 1024;

/// The node's own connections to Pods, each filed as its SYN left (the entry is good for a second;
/// the LRU pushes out the old ones).
pub const NODE_DIALS_ENTRIES: u32 = 16 * 1024;

/// The value of an entry: admit or refuse, and the rule that said so (an index into the agent's
/// list of verdicts, for counters and the access log). 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct InboundVerdict {
    pub allow: u8,
    pub _pad: u8,
    pub rule: u16,
}

/// A refusal the kernel reports: who was refused where, by which rule. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct InboundEvent {
    /// The client's address, IPv4 v4-mapped.
    pub src: [u8; 16],
    /// The Pod's address, IPv4 v4-mapped.
    pub dst: [u8; 16],
    pub src_port: u16,
    pub dst_port: u16,
    pub rule: u16,
    pub _pad: u16,
}

/// The key bytes of (`dst`, `port_class`, `src`), addresses in their 16-byte form.
#[inline(always)]
pub const fn inbound_bytes(dst: &[u8; 16], port_class: u16, src: &[u8; 16]) -> InboundBytes {
    let p = port_class.to_be_bytes();
    let mut out = [0u8; 36];
    let mut i = 0;
    while i < 16 {
        out[i] = dst[i];
        out[20 + i] = src[i];
        i += 1;
    }
    out[16] = p[0];
    out[17] = p[1];
    out
}

/// The prefix length of an entry whose source range is `src_bits` long in its 16-byte form (an
/// IPv4 /24 is 96 + 24 bits).
#[inline(always)]
pub const fn inbound_prefix(src_bits: u32) -> u32 {
    INBOUND_FIXED_BITS + src_bits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_put_destination_port_then_source() {
        let dst = [1u8; 16];
        let src = [2u8; 16];
        let key = inbound_bytes(&dst, 8080, &src);
        assert_eq!(&key[..16], &dst);
        assert_eq!(&key[16..18], &8080u16.to_be_bytes());
        assert_eq!(&key[18..20], &[0, 0]);
        assert_eq!(&key[20..], &src);
        assert_eq!(inbound_prefix(128), 288);
        assert_eq!(core::mem::size_of::<InboundVerdict>(), 4);
        assert_eq!(core::mem::size_of::<InboundEvent>(), 40);
    }
}
