//! eBPF programs that steer a pod's outbound TCP and DNS to the node agent.
//!
//! All are attached to one cgroup v2 directory (the pods' parent); each file holds one hook, in an
//! IPv4 and an IPv6 flavour that share one decision (`steer.rs`):
//! - `connect4`/`connect6`: TCP connect() -> gateway:proxy port; TCP/UDP connect() to port 53 ->
//!   gateway:DNS port. A v4-mapped destination in connect6 is an IPv4 one (IPv4 gateway, v4-mapped).
//! - `sendmsg4`/`sendmsg6`: unconnected UDP sendmsg() to port 53 -> gateway:DNS port.
//! - `sock_ops`: files the original destination under the client ip:port once the agent answered
//!   the handshake, before the client's last ACK leaves; reports a kernel-decided connection's
//!   close (`records`).
//! - `getpeername4`/`getpeername6`, `recvmsg4`/`recvmsg6`: the application still sees the peer it
//!   asked for.
//! - `netns_probe`: run once at start on kernels before 5.14, to learn the node's netns cookie.
//! - `hbone_replies`: tc ingress on the node's links (not the cgroup), with HBONE between nodes:
//!   marks the answers to the agent's sockets bound to a Pod's address.
//! - `inbound`: sk_lookup in each guarded Pod's network namespace (not the cgroup): inbound
//!   authorization, a refused connection reset at its SYN.
//! - `node_origin`: tc egress on the node's veths: files the node's own connections to Pods,
//!   which `inbound` admits.
#![no_std]
#![no_main]
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go to aya-ebpf by reference, as the helpers take them: how a key reaches \
              the lookup shapes the code the verifier sees, so a change waits for a run on every \
              supported kernel"
)]

mod connect4;
mod connect6;
mod fastpath;
mod getpeername4;
mod getpeername6;
mod hbone_replies;
mod inbound;
mod inet6;
mod maps;
mod netns_probe;
mod node_origin;
mod origin;
mod records;
mod recvmsg4;
mod recvmsg6;
mod sendmsg4;
mod sendmsg6;
mod sock_ops;
mod steer;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier proves there is no panic path; this is never reached.
    loop {}
}

/// GPL-compatible so the kernel grants every helper we call.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
