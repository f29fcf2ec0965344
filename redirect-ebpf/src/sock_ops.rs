//! TCP socket events (`sock_ops`): the hook that files a steered connection's original destination
//! under the client's address and port at the moment the SYN is about to leave. The agent's proxy
//! only learns the peer address on `accept()`, and this is the key it looks the destination up by;
//! filed before the handshake, the entry is always there when the proxy asks.
use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_TCP_CLOSE,
    },
    macros::sock_ops,
    programs::SockOpsContext,
};
use redirect_common::{FlowEnds, ORIG_REWRITTEN, SockAddr, Stat};

use crate::{
    maps::{FLOW_ORIG_DST, SUBFLOW_ORIG_DST, count, proxy_port},
    origin,
    records::{self, Closing},
    steer::{gateway_for, same_ip},
};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// At ACTIVE_ESTABLISHED_CB the client has the agent's SYN-ACK and has not yet sent the ACK that
/// puts the connection in the agent's accept queue: file the original destination under the client
/// ip:port, which is what the agent sees as the peer after accept(). The agent can never read the
/// map too early, and only handshakes the agent answered file anything: a connect() abandoned
/// before its handshake (any number of them, from any pod) leaves no entry to crowd out another
/// pod's. The agent takes each entry out on accept, so the map holds only connections waiting in
/// its accept queue.
///
/// At TCP_CONNECT_CB (the SYN has not left) a socket connecting to the proxy's port by itself
/// drops what an earlier connection with its address and port filed, and a socket the kernel
/// decided and recorded asks for its state changes; at STATE_CB to TCP_CLOSE its close is
/// reported with what the connection carried (`records`).
#[sock_ops]
pub(crate) fn sock_ops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_STATE_CB {
        // A recorded socket's every state change runs this: all but its close leave at once.
        if ctx.arg(1) != BPF_TCP_CLOSE {
            return 1;
        }
    } else if op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_TCP_CONNECT_CB {
        return 1;
    }
    let family = ctx.family();
    if family != AF_INET && family != AF_INET6 {
        return 1;
    }
    // local_port is in host byte order in bpf_sock_ops (remote_port is not). An IPv6 socket talking
    // to a v4-mapped address has its IPv4 source in v4-mapped form here: the same key as from IPv4.
    let port = ctx.local_port() as u16;
    // Both fields are read whatever the family, and only the values are chosen: with a load in each
    // branch LLVM merges them into one load through a ctx pointer plus a chosen offset, which the
    // verifier refuses (no access through a modified ctx pointer).
    let v4 = ctx.local_ip4();
    let v6 = ctx.local_ip6();
    let client = if family == AF_INET {
        SockAddr::from_v4_be(v4, port)
    } else {
        SockAddr::from_ip6_words(v6, port)
    };
    // SAFETY: `ops` is the program's context; `sk` is read in place (null-checked where used).
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if op == BPF_SOCK_OPS_STATE_CB {
        // args: the state left, the state entered (CLOSE).
        let (bytes_sent, bytes_received) = byte_counts(&ctx);
        let closing = Closing {
            client,
            endpoint: remote(&ctx, family),
            last_state: ctx.arg(0),
            bytes_sent,
            bytes_received,
        };
        records::closed(&ctx, sk, &closing);
        return 1;
    }
    let orig = origin::recall_sock(sk);
    if op == BPF_SOCK_OPS_TCP_CONNECT_CB {
        // Only the kernel's own decisions are recorded (`records`): rewritten, or left alone
        // (nothing filed). Each arm asks on its own: the field of an absent `orig`, read in one
        // merged test, is whatever a register held, which the verifier refuses.
        match orig {
            // Filed under both ends too, for getpeername() on an MPTCP socket whose subflow this is.
            Some(orig) => {
                if orig.protocol & ORIG_REWRITTEN != 0 {
                    records::watch_close(&ctx);
                }
                let peer = remote(&ctx, family);
                let ends = FlowEnds::from_words(
                    client.ip6_words(),
                    client.port,
                    peer.ip6_words(),
                    peer.port,
                );
                if SUBFLOW_ORIG_DST.insert(&ends, &orig, 0).is_err() {
                    count(Stat::MapUpdateFailed);
                }
            }
            // A pod connecting to the proxy's port itself: an entry filed under its address and
            // port by an earlier connection (of a pod that had this address before) is not its
            // own. The two share the 4-tuple, so the earlier one is over: drop its entry before
            // the SYN leaves.
            None => {
                records::watch_close(&ctx);
                if connects_to_proxy(&ctx, family) {
                    let _ = FLOW_ORIG_DST.remove(&client);
                }
            }
        }
        return 1;
    }
    // Rewritten: the agent never sees it.
    let Some(orig) = orig.filter(|orig| orig.protocol & ORIG_REWRITTEN == 0) else {
        return 1;
    };
    if FLOW_ORIG_DST.insert(&client, &orig, 0).is_ok() {
        count(Stat::FlowFiled);
    } else {
        count(Stat::MapUpdateFailed);
    }
    1
}

/// The peer's address and port (`remote_port` holds the port in network byte order in its upper
/// 16 bits on little-endian hosts).
#[inline(always)]
fn remote(ctx: &SockOpsContext, family: u32) -> SockAddr {
    let (port, v4, v6) = remote_fields(ctx);
    let port = u16::from_be((port >> 16) as u16);
    if family == AF_INET {
        SockAddr::from_v4_be(v4, port)
    } else {
        SockAddr::from_ip6_words(v6, port)
    }
}

/// `remote_port`, `remote_ip4` and `remote_ip6` as the context holds them. Volatile loads, each at
/// its fixed offset: plain ones LLVM sinks into the branch that uses them and merges into one load
/// through a computed ctx pointer, which the verifier refuses.
#[inline(always)]
fn remote_fields(ctx: &SockOpsContext) -> (u32, u32, [u32; 4]) {
    let ops = ctx.ops;
    // SAFETY: `ops` is the program's context, valid for the whole call; fields read in place.
    unsafe {
        (
            core::ptr::read_volatile(&(*ops).remote_port),
            core::ptr::read_volatile(&(*ops).remote_ip4),
            [
                core::ptr::read_volatile(&(*ops).remote_ip6[0]),
                core::ptr::read_volatile(&(*ops).remote_ip6[1]),
                core::ptr::read_volatile(&(*ops).remote_ip6[2]),
                core::ptr::read_volatile(&(*ops).remote_ip6[3]),
            ],
        )
    }
}

/// The bytes the peer acknowledged and the bytes received (`bytes_acked`, `bytes_received`; the
/// kernel reads them from a full socket, 0 otherwise). Volatile loads at their fixed offsets, as
/// in `remote_fields`.
#[inline(always)]
fn byte_counts(ctx: &SockOpsContext) -> (u64, u64) {
    let ops = ctx.ops;
    // SAFETY: `ops` is the program's context, valid for the whole call; fields read in place.
    unsafe {
        (
            core::ptr::read_volatile(&(*ops).bytes_acked),
            core::ptr::read_volatile(&(*ops).bytes_received),
        )
    }
}

/// Whether the socket connects to the outbound proxy at the gateway of its family.
#[inline(always)]
fn connects_to_proxy(ctx: &SockOpsContext, family: u32) -> bool {
    let peer = remote(ctx, family);
    if peer.port != proxy_port() {
        return false;
    }
    let ip = peer.ip6_words();
    matches!(gateway_for(&ip), Some(gw) if same_ip(&gw, &ip))
}
