//! Connection records of the connections the kernel decides (left alone or rewritten to an
//! endpoint: the proxy never sees them). At connect() the decision is filed in the socket's own
//! storage (`SOCKET_RECORD`) and reported on `CONN_RECORDS`; `sock_ops` asks for the socket's state
//! changes, and when it closes reports the record again with its bytes, its client address and the
//! state it left. Nothing is waited for: a record the ring has no room for is counted as lost.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_SOCK_OPS_STATE_CB_FLAG,
        bpf_sock,
    },
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns,
        generated::bpf_sk_storage_get,
    },
    programs::{SockAddrContext, SockOpsContext},
};
use redirect_common::{
    SockAddr,
    records::{ConnRecord, RECORD_CLOSE, RECORD_OPEN, RECORDS_WAKE_AT},
};

use crate::{
    fastpath::ip_key,
    maps::{CONN_RECORDS, RECORDS_SAMPLE, SOCKET_RECORD, count_record_lost},
    steer::Dest,
};

/// Words of a record: it is copied and written a word at a time (a plain struct copy with zero
/// bytes in it becomes a memset call, which the kernel cannot take with the object's BTF).
const WORDS: usize = core::mem::size_of::<ConnRecord>() / 8;

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

/// The kernel decided the socket of `ctx` (to `dst`, sent to `to`, `outcome` its `FastStat`):
/// files its open record in the socket and reports it.
#[inline(always)]
pub(crate) fn opened(ctx: &SockAddrContext, dst: &Dest, to: &Dest, outcome: u8) {
    if !sampled() {
        return;
    }
    // SAFETY: `ctx.sock_addr.sk` is the verifier-checked socket of this call; with no initial
    // value the kernel zero-fills a new slot.
    let slot = unsafe { SOCKET_RECORD.get_or_insert_ptr_mut(ctx, None) };
    if slot.is_null() {
        count_record_lost();
        return;
    }
    // SAFETY: helpers on the context the kernel passed the program, and ones without arguments.
    let (cookie, cgroup, now) = unsafe {
        (
            bpf_get_socket_cookie(ctx.as_ptr()),
            bpf_get_current_cgroup_id(),
            bpf_ktime_get_ns(),
        )
    };
    let (dst_key, to_key) = (ip_key(&dst.ip), ip_key(&to.ip));
    // SAFETY: a non-null slot is this socket's storage, sized and aligned for one ConnRecord; the
    // socket is locked by the connect() running this program, so no other writer. Each field is
    // written in place (a whole-struct store would bring a memset).
    unsafe {
        use core::ptr::{addr_of_mut, write_volatile};
        write_volatile(addr_of_mut!((*slot).cookie), cookie);
        write_volatile(addr_of_mut!((*slot).cgroup), cgroup);
        write_volatile(addr_of_mut!((*slot).opened_ns), now);
        write_volatile(addr_of_mut!((*slot).dst), dst_key);
        write_volatile(addr_of_mut!((*slot).endpoint), to_key);
        write_volatile(addr_of_mut!((*slot).dst_port), dst.port);
        write_volatile(addr_of_mut!((*slot).endpoint_port), to.port);
        write_volatile(addr_of_mut!((*slot).kind), RECORD_OPEN);
        write_volatile(addr_of_mut!((*slot).outcome), outcome);
    }
    report(slot, None);
}

/// At the socket's connect (sock_ops `TCP_CONNECT_CB`): a socket with a record asks for its state
/// changes, so that its close is seen.
#[inline(always)]
pub(crate) fn watch_close(ctx: &SockOpsContext, sk: *mut bpf_sock) {
    if record_of(sk).is_null() {
        return;
    }
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
}

/// The facts sock_ops learned by the close, for the close record.
pub(crate) struct Closing {
    pub client: SockAddr,
    pub last_state: u32,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

/// The socket closed (sock_ops `STATE_CB` to `TCP_CLOSE`): reports its record once more, with what
/// the close brings.
#[inline(always)]
pub(crate) fn closed(sk: *mut bpf_sock, closing: &Closing) {
    let slot = record_of(sk);
    if slot.is_null() {
        return;
    }
    // SAFETY: a non-null slot is this socket's storage holding one ConnRecord; the state
    // callback runs with the socket locked, so nothing else writes it meanwhile.
    unsafe {
        if core::ptr::read_volatile(&(*slot).kind) != RECORD_OPEN {
            return; // reported already
        }
        core::ptr::write_volatile(&mut (*slot).kind, RECORD_CLOSE);
    }
    report(slot, Some(closing));
}

/// The record filed in `sk`, or null.
#[inline(always)]
fn record_of(sk: *mut bpf_sock) -> *mut ConnRecord {
    if sk.is_null() {
        return core::ptr::null_mut();
    }
    let map = core::ptr::from_ref(&SOCKET_RECORD).cast_mut().cast();
    // SAFETY: `sk` is the non-null socket the kernel handed this sock_ops call; flags 0 never
    // creates, so a null result means nothing was filed.
    unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }.cast()
}

/// Puts a copy of the record at `slot` on the ring, with the close's facts when given.
#[inline(always)]
fn report(slot: *mut ConnRecord, closing: Option<&Closing>) {
    let Some(mut entry) = CONN_RECORDS.reserve::<ConnRecord>(0) else {
        count_record_lost();
        return;
    };
    let out = entry.as_mut_ptr();
    // SAFETY: `slot` is a socket's storage holding one ConnRecord (see the callers) and `out` a
    // reserved entry of the same size and alignment; both are copied a word at a time.
    unsafe {
        let (from, to) = (slot.cast::<u64>(), out.cast::<u64>());
        for i in 0..WORDS {
            core::ptr::write_volatile(to.add(i), core::ptr::read_volatile(from.add(i)));
        }
        if let Some(c) = closing {
            use core::ptr::{addr_of_mut, write_volatile};
            write_volatile(addr_of_mut!((*out).kind), RECORD_CLOSE);
            write_volatile(addr_of_mut!((*out).closed_ns), bpf_ktime_get_ns());
            write_volatile(addr_of_mut!((*out).bytes_sent), c.bytes_sent);
            write_volatile(addr_of_mut!((*out).bytes_received), c.bytes_received);
            write_volatile(addr_of_mut!((*out).client), ip_key(&c.client.ip6_words()));
            write_volatile(addr_of_mut!((*out).client_port), c.client.port);
            write_volatile(addr_of_mut!((*out).last_state), c.last_state as u8);
        }
    }
    // The agent is woken once a batch waits, not for each record (it collects the rest on a
    // short tick): a busy node's records cost it a wakeup per batch.
    let waiting = CONN_RECORDS.query(u64::from(BPF_RB_AVAIL_DATA));
    let wake = if waiting >= u64::from(RECORDS_WAKE_AT) {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    entry.submit(u64::from(wake));
}
