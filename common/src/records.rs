//! Connection records of the connections the kernel decided (the fast path left them alone or
//! rewrote them to an endpoint, so the proxy never sees them). `connect4`/`connect6` report what
//! they decided as an [`OpenRecord`]; `sock_ops` reports the socket's close as a [`CloseRecord`]
//! (bytes, how it ended, the client's address and port). Nothing is kept in the socket: the agent
//! joins the two by the socket's cookie.

use crate::fastpath::IpKey;

/// Bytes of the ring buffer the records cross on (a power of two, a multiple of the page): at
/// 80 and 120 bytes a connection's two, about 10,000 connections, a third of a second of a busy
/// node.
pub const RECORDS_BYTES: u32 = 2 * 1024 * 1024;

/// Bytes of records waiting before the kernel wakes the agent: half the ring, a safety valve for
/// bursts. Below it the agent collects them on its own tick (`fastpath::records` in the agent), a
/// busy node's 100 ms of records (~0.6 MB at 30,000 connections a second).
pub const RECORDS_WAKE_AT: u32 = RECORDS_BYTES / 2;

/// Slots of `RECORDS_ARMED`, by which `sock_ops` knows a socket `connect4`/`connect6` recorded
/// (a power of two: the slot is the cookie's low bits). The two run microseconds apart in one
/// connect(); another recorded socket would have to take the same slot in between to hide one.
pub const RECORDS_ARMED_SLOTS: u32 = 1024;

/// [`OpenRecord::kind`]: the connection was decided at connect().
pub const RECORD_OPEN: u8 = 1;
/// [`CloseRecord::kind`]: the socket closed.
pub const RECORD_CLOSE: u8 = 2;

/// [`CloseRecord::outcome`] when the socket kept no original destination: the kernel left it
/// alone (`FastStat::Passthrough` or `FastStat::Workload`, which the agent tells apart), so the
/// endpoint is the destination and the cgroup is not known at the close.
pub const OUTCOME_LEFT_ALONE: u8 = u8::MAX;

/// The TCP states a socket may leave when it closes (`include/net/tcp_states.h`), for
/// [`CloseRecord::last_state`].
pub mod tcp_state {
    pub const ESTABLISHED: u8 = 1;
    pub const SYN_SENT: u8 = 2;
    pub const SYN_RECV: u8 = 3;
    pub const FIN_WAIT1: u8 = 4;
    pub const FIN_WAIT2: u8 = 5;
    pub const TIME_WAIT: u8 = 6;
    pub const CLOSE: u8 = 7;
    pub const CLOSE_WAIT: u8 = 8;
    pub const LAST_ACK: u8 = 9;
    pub const CLOSING: u8 = 11;
}

/// What connect() decided. 72 bytes, no implicit padding; `kind` first in every record.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenRecord {
    /// [`RECORD_OPEN`].
    pub kind: u8,
    /// The `FastStat` of the decision.
    pub outcome: u8,
    pub _pad: [u8; 2],
    /// Ports in host byte order.
    pub dst_port: u16,
    pub endpoint_port: u16,
    /// The socket's cookie: its close carries the same.
    pub cookie: u64,
    /// The connecting process's cgroup v2 id (its pod's).
    pub cgroup: u64,
    /// `CLOCK_MONOTONIC` nanoseconds at connect().
    pub opened_ns: u64,
    /// Where the application meant to go.
    pub dst: IpKey,
    /// Where the socket went: the endpoint the kernel chose, or `dst` when it left it alone.
    pub endpoint: IpKey,
}

/// The name `redirect-common`'s `aya::Pod` impl knows the open record by.
pub type ConnRecord = OpenRecord;

/// The socket closed. 112 bytes, no implicit padding. Besides the close's facts it carries what
/// the socket still knows of its decision, for a close whose open the agent no longer holds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloseRecord {
    /// [`RECORD_CLOSE`].
    pub kind: u8,
    /// `FastStat::Rewritten` when the socket kept its original destination (then `dst` and
    /// `cgroup` hold it), else [`OUTCOME_LEFT_ALONE`].
    pub outcome: u8,
    /// The TCP state the socket left for CLOSE ([`tcp_state`]).
    pub last_state: u8,
    pub _pad: u8,
    /// Ports in host byte order.
    pub dst_port: u16,
    pub endpoint_port: u16,
    /// The socket's cookie, as its open carried it.
    pub cookie: u64,
    /// `CLOCK_MONOTONIC` nanoseconds at the close.
    pub closed_ns: u64,
    /// Sequence space the peer acknowledged (`bytes_acked`: what the client sent, with its SYN and,
    /// once acknowledged, its FIN).
    pub bytes_sent: u64,
    /// Sequence space received (`bytes_received`: with the peer's FIN once it came).
    pub bytes_received: u64,
    /// The connecting process's cgroup, when the socket kept it (0 otherwise).
    pub cgroup: u64,
    /// The socket's own address.
    pub client: IpKey,
    /// Where the application meant to go, when the socket kept it (else the endpoint).
    pub dst: IpKey,
    /// The peer: where the socket went.
    pub endpoint: IpKey,
    pub client_port: u16,
    pub _pad2: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_whole_words_without_implicit_padding_and_begin_with_their_kind() {
        assert_eq!(core::mem::size_of::<OpenRecord>(), 72);
        assert_eq!(core::mem::size_of::<CloseRecord>(), 112);
        assert_eq!(core::mem::align_of::<OpenRecord>(), 8);
        assert_eq!(core::mem::align_of::<CloseRecord>(), 8);
        assert_eq!(core::mem::offset_of!(OpenRecord, kind), 0);
        assert_eq!(core::mem::offset_of!(CloseRecord, kind), 0);
        assert_eq!(core::mem::offset_of!(OpenRecord, endpoint), 52);
        assert_eq!(core::mem::offset_of!(CloseRecord, client_port), 108);
        assert!(RECORDS_ARMED_SLOTS.is_power_of_two());
    }
}
