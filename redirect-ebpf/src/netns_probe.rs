//! Learns the node's network namespace cookie on kernels without `SO_NETNS_COOKIE` (before 5.14).
//!
//! The agent attaches this to a throwaway cgroup of its own, creates one socket from a child process
//! placed there (in the agent's, that is the node's, namespace), reads the cookie from the map and
//! removes everything. It never runs for a pod.
use aya_ebpf::{
    EbpfContext, helpers::bpf_get_netns_cookie, macros::cgroup_sock, programs::SockContext,
};

use crate::maps::NETNS_PROBE;

#[cgroup_sock(sock_create)]
pub(crate) fn netns_probe(ctx: SockContext) -> i32 {
    // SAFETY: the helper reads the socket of the context the kernel passed this program, which
    // is what it takes in a cgroup/sock_create program.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if let Some(slot) = NETNS_PROBE.get_ptr_mut(0) {
        // SAFETY: `get_ptr_mut` gave a pointer to the array's one slot, aligned and valid while
        // the program runs; one writer: the probe's single socket.
        unsafe { *slot = cookie }
    }
    1 // allow the socket
}
