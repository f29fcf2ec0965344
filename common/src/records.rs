//! Connection records of the connections the kernel decided (the fast path left them alone or
//! rewrote them to an endpoint, so the proxy never sees them): what `connect4`/`connect6` decided,
//! kept in the socket's own storage, reported when it is made and again when the socket closes
//! (with what `sock_ops` learned by then: bytes, how it ended, the client's address and port).

use crate::fastpath::IpKey;

/// Bytes of the ring buffer the records cross on (a power of two, a multiple of the page): at
/// 128 bytes a record, about 16,000 records, some hundreds of milliseconds of a busy node.
pub const RECORDS_BYTES: u32 = 2 * 1024 * 1024;

/// Bytes of records waiting before the kernel wakes the agent; below it the agent collects them on
/// its own short tick (`fastpath::records` in the agent).
pub const RECORDS_WAKE_AT: u32 = 256 * 1024;

/// [`ConnRecord::kind`]: the connection was decided at connect().
pub const RECORD_OPEN: u8 = 1;
/// [`ConnRecord::kind`]: the socket closed.
pub const RECORD_CLOSE: u8 = 2;

/// The TCP states a socket may leave when it closes (`include/net/tcp_states.h`), for
/// [`ConnRecord::last_state`].
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

/// One record. 120 bytes, no implicit padding; the same layout in the socket's storage (the open
/// record) and on the ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnRecord {
    /// The socket's cookie: the open and the close of one connection share it.
    pub cookie: u64,
    /// The connecting process's cgroup v2 id (its pod's).
    pub cgroup: u64,
    /// `CLOCK_MONOTONIC` nanoseconds at connect().
    pub opened_ns: u64,
    /// `CLOCK_MONOTONIC` nanoseconds at the close; 0 in an open record.
    pub closed_ns: u64,
    /// Sequence space the peer acknowledged (`bytes_acked`: what the client sent, with its SYN and,
    /// once acknowledged, its FIN); 0 in an open record.
    pub bytes_sent: u64,
    /// Sequence space received (`bytes_received`: with the peer's FIN once it came); 0 in an open
    /// record.
    pub bytes_received: u64,
    /// Where the application meant to go.
    pub dst: IpKey,
    /// Where the socket went: the endpoint the kernel chose, or `dst` when it left it alone.
    pub endpoint: IpKey,
    /// The socket's own address at the close (family 0 in an open record: not bound yet).
    pub client: IpKey,
    /// Ports in host byte order.
    pub dst_port: u16,
    pub endpoint_port: u16,
    pub client_port: u16,
    /// [`RECORD_OPEN`] or [`RECORD_CLOSE`].
    pub kind: u8,
    /// The `FastStat` of the decision.
    pub outcome: u8,
    /// The TCP state the socket left when it closed ([`tcp_state`]); 0 in an open record.
    pub last_state: u8,
    /// The fast path's generation in force at connect().
    pub generation: u8,
    pub _pad: [u8; 2],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_120_bytes_without_implicit_padding() {
        assert_eq!(core::mem::size_of::<ConnRecord>(), 120);
        assert_eq!(core::mem::align_of::<ConnRecord>(), 8);
        assert_eq!(core::mem::size_of::<ConnRecord>() % 8, 0);
    }
}
