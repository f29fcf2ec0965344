//! Connection records of the connections the kernel decides (left alone or rewritten to an
//! endpoint: the proxy never sees them). At connect() the decision is reported on `CONN_RECORDS`
//! and the socket's cookie put in `RECORDS_ARMED`; `sock_ops`, as the SYN is about to leave, finds
//! it there and asks for the socket's state changes, and when it closes reports the close (bytes,
//! client address, the state it left). Nothing is kept in the socket: the agent joins the two by
//! the cookie. Nothing is waited for: a record the ring has no room for is counted as lost.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_SOCK_OPS_STATE_CB_FLAG,
        bpf_sock,
    },
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns,
    },
    maps::ring_buf::RingBufEntry,
    programs::{SockAddrContext, SockOpsContext},
};
use redirect_common::{
    FastStat, ORIG_REWRITTEN, SockAddr,
    records::{
        CloseRecord, OUTCOME_LEFT_ALONE, OpenRecord, RECORD_CLOSE, RECORD_OPEN,
        RECORDS_ARMED_SLOTS, RECORDS_WAKE_AT, tcp_state,
    },
};

use crate::{
    fastpath::ip_key,
    maps::{CONN_RECORDS, RECORDS_ARMED, RECORDS_SAMPLE, count_record_lost},
    origin,
    steer::Dest,
};

/// Whether this connection is to be recorded (`RECORDS_SAMPLE`: 0 none, 1 all, N one in N).
#[inline(always)]
fn sampled() -> bool {
    let every = RECORDS_SAMPLE.get(0).copied().unwrap_or(0);
    if every <= 1 {
        return every == 1;
    }
    // SAFETY: the helper takes no argument and has no precondition.
    let random = unsafe { bpf_get_prandom_u32() };
    random % every == 0
}

/// The `RECORDS_ARMED` slot of a cookie.
#[inline(always)]
fn armed_slot(cookie: u64) -> u32 {
    (cookie as u32) & (RECORDS_ARMED_SLOTS - 1)
}

/// The kernel decided the socket of `ctx` (to `dst`, sent to `to`, `outcome` its `FastStat`):
/// reports its open and arms its close.
#[inline(always)]
pub(crate) fn opened(ctx: &SockAddrContext, dst: &Dest, to: &Dest, outcome: u8) {
    if !sampled() {
        return;
    }
    // SAFETY: `sk` is the one member of the union the kernel fills in a sock_addr context.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    // A connect() on a socket already connecting or connected is decided again but opens nothing
    // (its first connect() reported the open).
    // SAFETY: the verifier types ctx->sk as a valid socket; it is checked non-null first.
    if sk.is_null() || unsafe { (*sk).state } != u32::from(tcp_state::CLOSE) {
        return;
    }
    let Some(mut entry) = CONN_RECORDS.reserve::<OpenRecord>(0) else {
        count_record_lost();
        return;
    };
    // SAFETY: helpers on the context the kernel passed the program, and ones without arguments.
    let (cookie, cgroup, now) = unsafe {
        (
            bpf_get_socket_cookie(ctx.as_ptr()),
            bpf_get_current_cgroup_id(),
            bpf_ktime_get_ns(),
        )
    };
    let out = entry.as_mut_ptr();
    // SAFETY: `out` is a reserved entry sized and aligned for one OpenRecord, ours until submitted.
    // Each field is written in place (a whole-struct store would bring a memset).
    unsafe {
        use core::ptr::{addr_of_mut, write_volatile};
        write_volatile(addr_of_mut!((*out).kind), RECORD_OPEN);
        write_volatile(addr_of_mut!((*out).outcome), outcome);
        write_volatile(addr_of_mut!((*out)._pad), [0; 2]);
        write_volatile(addr_of_mut!((*out).dst_port), dst.port);
        write_volatile(addr_of_mut!((*out).endpoint_port), to.port);
        write_volatile(addr_of_mut!((*out).cookie), cookie);
        write_volatile(addr_of_mut!((*out).cgroup), cgroup);
        write_volatile(addr_of_mut!((*out).opened_ns), now);
        write_volatile(addr_of_mut!((*out).dst), ip_key(&dst.ip));
        write_volatile(addr_of_mut!((*out).endpoint), ip_key(&to.ip));
    }
    submit(entry);
    // Armed only once the open is on the ring: a close is never reported without its open.
    if let Some(slot) = RECORDS_ARMED.get_ptr_mut(armed_slot(cookie)) {
        // SAFETY: an array slot, valid while the program runs; a racing writer of the same slot
        // (another socket with the same low bits, microseconds apart) only hides one close.
        unsafe { core::ptr::write_volatile(slot, cookie) };
    }
}

/// At the socket's connect (sock_ops `TCP_CONNECT_CB`): a socket connect() just recorded asks for
/// its state changes, so that its close is seen.
#[inline(always)]
pub(crate) fn watch_close(ctx: &SockOpsContext) {
    // SAFETY: the helper reads the socket of the context the kernel passed the program.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let armed = RECORDS_ARMED.get(armed_slot(cookie)).copied();
    if armed != Some(cookie) {
        return;
    }
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
}

/// The facts sock_ops learned by the close, for the close record.
pub(crate) struct Closing {
    pub client: SockAddr,
    pub endpoint: SockAddr,
    pub last_state: u32,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

/// A watched socket closed (sock_ops `STATE_CB` to `TCP_CLOSE`): reports the close, with what the
/// socket still knows of its decision (its original destination, when it was rewritten).
#[inline(always)]
pub(crate) fn closed(ctx: &SockOpsContext, sk: *mut bpf_sock, closing: &Closing) {
    // Closed already (a CLOSE to CLOSE change): reported then.
    if closing.last_state == u32::from(tcp_state::CLOSE) {
        return;
    }
    let Some(mut entry) = CONN_RECORDS.reserve::<CloseRecord>(0) else {
        count_record_lost();
        return;
    };
    // SAFETY: helpers on the context the kernel passed the program, and one without arguments.
    let (cookie, now) = unsafe { (bpf_get_socket_cookie(ctx.as_ptr()), bpf_ktime_get_ns()) };
    let (client, endpoint) = (&closing.client, &closing.endpoint);
    let out = entry.as_mut_ptr();
    // SAFETY: `out` is a reserved entry sized and aligned for one CloseRecord, ours until
    // submitted; each field is written in place, as in `opened`.
    unsafe {
        use core::ptr::{addr_of_mut, write_volatile};
        write_volatile(addr_of_mut!((*out).kind), RECORD_CLOSE);
        write_volatile(addr_of_mut!((*out).last_state), closing.last_state as u8);
        write_volatile(addr_of_mut!((*out)._pad), 0);
        write_volatile(addr_of_mut!((*out).endpoint_port), endpoint.port);
        write_volatile(addr_of_mut!((*out).cookie), cookie);
        write_volatile(addr_of_mut!((*out).closed_ns), now);
        write_volatile(addr_of_mut!((*out).bytes_sent), closing.bytes_sent);
        write_volatile(addr_of_mut!((*out).bytes_received), closing.bytes_received);
        write_volatile(addr_of_mut!((*out).client), ip_key(&client.ip6_words()));
        write_volatile(addr_of_mut!((*out).endpoint), ip_key(&endpoint.ip6_words()));
        write_volatile(addr_of_mut!((*out).client_port), client.port);
        write_volatile(addr_of_mut!((*out)._pad2), 0);
    }
    // The decision, written on each branch from where it is: the filed original read in place
    // (`origin::recall_sock_in_place`), or the socket's own peer. Picked without a branch, the
    // compiler masks the storage pointer, which the verifier refuses.
    match origin::recall_sock_in_place(sk) {
        Some(orig) if orig.protocol & ORIG_REWRITTEN != 0 => {
            // SAFETY: as above.
            unsafe { write_decision(out, FastStat::Rewritten as u8, orig.cgroup_id, &orig.dst) }
        }
        // SAFETY: as above.
        _ => unsafe { write_decision(out, OUTCOME_LEFT_ALONE, 0, endpoint) },
    }
    submit(entry);
}

/// Writes what a close record says of the kernel's decision.
///
/// # Safety
/// `out` points at a reserved `CloseRecord` entry not yet submitted.
#[inline(always)]
unsafe fn write_decision(out: *mut CloseRecord, outcome: u8, cgroup: u64, dst: &SockAddr) {
    use core::ptr::{addr_of_mut, write_volatile};
    // SAFETY: the caller's promise.
    unsafe {
        write_volatile(addr_of_mut!((*out).outcome), outcome);
        write_volatile(addr_of_mut!((*out).cgroup), cgroup);
        write_volatile(addr_of_mut!((*out).dst_port), dst.port);
        write_volatile(addr_of_mut!((*out).dst), ip_key(&dst.ip6_words()));
    }
}

/// Puts a written entry on the ring. The agent collects on its own tick and is woken from here
/// only when half the ring waits: a wakeup from here runs it on the CPU making connections, where
/// its tick finds it wherever it last ran (under load, mostly a CPU with time to spare).
#[inline(always)]
fn submit<T>(entry: RingBufEntry<T>) {
    let waiting = CONN_RECORDS.query(u64::from(BPF_RB_AVAIL_DATA));
    let wake = if waiting >= u64::from(RECORDS_WAKE_AT) {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    entry.submit(u64::from(wake));
}
