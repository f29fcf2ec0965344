//! Each steered socket's original destination, kept in the socket's own storage
//! (`SOCKET_ORIG_DST`): written at connect()/sendmsg(), read by getpeername(), recvmsg() and
//! sock_ops on the same socket, freed by the kernel when the socket goes.
use aya_ebpf::{helpers::generated::bpf_sk_storage_get, programs::SockAddrContext};
use redirect_common::OrigDst;

use crate::maps::SOCKET_ORIG_DST;

/// Files `orig` for the socket of `ctx` (replacing what an earlier connect() filed); false when
/// the kernel could not allocate the storage.
#[inline(always)]
pub(crate) fn remember(ctx: &SockAddrContext, orig: &OrigDst) -> bool {
    // SAFETY: `ctx.sock_addr.sk` is the verifier-checked socket of this call; with no initial
    // value the kernel zero-fills a new slot, which is then written whole.
    let slot = unsafe { SOCKET_ORIG_DST.get_or_insert_ptr_mut(ctx, None) };
    if slot.is_null() {
        return false;
    }
    // Word by word: a plain struct copy with zero bytes in it becomes a memset call, which the
    // kernel cannot take with the object's BTF (memset has none).
    // SAFETY: OrigDst is 40 bytes of plain data, 8-aligned, no padding.
    let words: [u64; 5] = unsafe { core::mem::transmute(*orig) };
    let slot = slot.cast::<u64>();
    for (i, word) in words.iter().enumerate() {
        // SAFETY: a non-null slot is this socket's storage, sized and aligned for one OrigDst; the
        // socket is locked by the connect()/sendmsg() running this program, so no other writer.
        unsafe { core::ptr::write_volatile(slot.add(i), *word) };
    }
    true
}

/// The original destination filed for the socket of `ctx`, if it was steered.
#[inline(always)]
pub(crate) fn recall(ctx: &SockAddrContext) -> Option<OrigDst> {
    // SAFETY: as in `remember`; a null result means nothing was filed.
    let slot = unsafe { SOCKET_ORIG_DST.get_ptr_mut(ctx) };
    // SAFETY: a non-null slot is this socket's storage holding one OrigDst (plain integers, any
    // bit pattern valid), copied out at once.
    unsafe { slot.as_ref() }.copied()
}

/// The same, for a sock_ops program's socket (`bpf_sock_ops.sk`, which may be null).
#[inline(always)]
pub(crate) fn recall_sock(sk: *mut aya_ebpf::bindings::bpf_sock) -> Option<OrigDst> {
    recall_sock_in_place(sk).copied()
}

/// The original destination filed for a sock_ops program's socket, read where it is filed. For a
/// caller that picks between it and a value of its own: a copy out, when nothing was filed, is
/// stack the compiler may still read and select away, which the verifier refuses to a loader
/// without CAP_PERFMON (as the DaemonSet runs) as a read of uninitialised stack.
#[inline(always)]
pub(crate) fn recall_sock_in_place(
    sk: *mut aya_ebpf::bindings::bpf_sock,
) -> Option<&'static OrigDst> {
    if sk.is_null() {
        return None;
    }
    let map = core::ptr::from_ref(&SOCKET_ORIG_DST).cast_mut().cast();
    // SAFETY: `sk` is the non-null socket the kernel handed this sock_ops call; flags 0 never
    // creates, so a null result means nothing was filed.
    let slot = unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) };
    // SAFETY: as in `recall`: a non-null slot holds one OrigDst (plain integers, any bit pattern
    // valid), and the socket, so its storage, outlives this program's run.
    unsafe { slot.cast::<OrigDst>().as_ref() }
}
