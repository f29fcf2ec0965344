//! The kernel's connection records, user side: read off `CONN_RECORDS` as they come (the ring
//! wakes the reader; nothing polls), joined to the pod by its cgroup and to the service by the
//! decision the tables in force were compiled from, and handed to the agent's [`Connections`] as
//! `decided_by=kernel` records. A close is joined to its open by the socket's cookie, so it names
//! the service the connection was decided for even when the configuration changed since.
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    num::NonZeroUsize,
    os::fd::AsRawFd,
    sync::Arc,
    time::{Duration, SystemTime},
};

use aya::maps::{MapData, RingBuf};
use lru::LruCache;
use redirect_common::{
    FastStat,
    records::{ConnRecord, RECORD_CLOSE, RECORD_OPEN, tcp_state},
};
use tokio::io::unix::AsyncFd;
use tracing::warn;

use crate::{
    config::Workload,
    records::{Connections, DecidedBy, Event, Record},
    state::{OutboundOutcome, Pick, Snapshot},
};

/// Open connections remembered for their close, at most (the longest unclosed go first: a
/// connect() that failed before its handshake never closes); a close not found is joined by
/// deciding again on the tables in force.
const OPEN_JOINED: NonZeroUsize = NonZeroUsize::new(65_536).unwrap();

/// How many of the kernel's decisions it records (`run --kernel-records`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KernelRecords {
    Off,
    All,
    /// One connection in N, chosen at random.
    OneIn(u32),
}

impl KernelRecords {
    /// The value of `RECORDS_SAMPLE`.
    pub(crate) fn sample(self) -> u32 {
        match self {
            KernelRecords::Off => 0,
            KernelRecords::All => 1,
            KernelRecords::OneIn(n) => n.max(1),
        }
    }
}

impl std::str::FromStr for KernelRecords {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(KernelRecords::Off),
            "all" => Ok(KernelRecords::All),
            _ => match s.strip_prefix("1/").map(str::parse::<u32>) {
                Some(Ok(1)) => Ok(KernelRecords::All),
                Some(Ok(n)) if n > 1 => Ok(KernelRecords::OneIn(n)),
                _ => Err(format!(
                    "{s:?}: expected all, off, or 1/N (one connection in N, N at least 1)"
                )),
            },
        }
    }
}

/// The pods the client table in force names, by cgroup.
pub(super) type PodsByCgroup = HashMap<u64, Arc<Workload>>;

/// The snapshot the tables in force came from, and the pods they name.
pub(super) type NamesInForce = (Arc<Snapshot>, Arc<PodsByCgroup>);

/// What the joins need: the names of the tables in force (none before the first).
pub(super) trait Names: Send + Sync {
    fn names(&self) -> Option<NamesInForce>;
}

/// What an open record learned, kept for its close.
struct Opened {
    workload: Option<String>,
    namespace: Option<String>,
    outcome: OutboundOutcome,
    service: Option<String>,
}

/// Reads the ring until `shutdown` changes.
pub(super) async fn follow(
    ring: RingBuf<MapData>,
    names: Arc<dyn Names>,
    connections: Arc<Connections>,
    mut shutdown: crate::drain::Watcher,
) {
    // SAFETY: the ring owns its map's descriptor, open and the same for as long as it lives;
    // it is never swapped out of the AsyncFd.
    let registered =
        unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) };
    let mut ring = match registered {
        Ok(ring) => ring,
        Err(e) => {
            warn!(error = %e, "fast path: the kernel's connection records cannot be read; they are lost");
            return;
        }
    };
    let mut joiner = Joiner::new();
    loop {
        let mut guard = tokio::select! {
            () = shutdown.stopped() => return,
            ready = ring.readable_mut() => match ready {
                Ok(guard) => guard,
                Err(e) => {
                    warn!(error = %e, fd = ring.get_ref().as_raw_fd(), "fast path: waiting on the connection records failed; they are lost from now on");
                    return;
                }
            },
        };
        let ring = guard.get_inner_mut();
        let names = names.names();
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<ConnRecord>() {
                continue;
            }
            // SAFETY: the programs write whole `ConnRecord`s (plain integers, any bit pattern
            // valid); the item may be unaligned.
            let raw = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<ConnRecord>()) };
            drop(item);
            if let Some(record) = joiner.join(&raw, names.as_ref()) {
                connections.record(record);
            }
        }
        guard.clear_ready();
    }
}

/// Joins records to names, and closes to their opens.
struct Joiner {
    open: LruCache<u64, Opened>,
}

impl Joiner {
    fn new() -> Joiner {
        Joiner {
            open: LruCache::new(OPEN_JOINED),
        }
    }

    fn join(&mut self, raw: &ConnRecord, names: Option<&NamesInForce>) -> Option<Record> {
        let event = match raw.kind {
            RECORD_OPEN => Event::Open,
            RECORD_CLOSE => Event::Close,
            _ => return None,
        };
        let opened = match event {
            Event::Close => self.open.pop(&raw.cookie),
            Event::Open => None,
        };
        let opened = opened.unwrap_or_else(|| decided(raw, names));
        let mut record = Record::new(event, DecidedBy::Kernel);
        record.time = monotonic_to_wall(match event {
            Event::Open => raw.opened_ns,
            Event::Close => raw.closed_ns,
        });
        record.orig_dst = Some(SocketAddr::new(raw.dst.ip(), raw.dst_port));
        record.endpoint = Some(SocketAddr::new(raw.endpoint.ip(), raw.endpoint_port));
        if event == Event::Close {
            record.client =
                (raw.client.family != 0).then(|| SocketAddr::new(raw.client.ip(), raw.client_port));
            (record.bytes_sent, record.bytes_received) = payload(raw);
            record.duration = Some(Duration::from_nanos(
                raw.closed_ns.saturating_sub(raw.opened_ns),
            ));
            record.end = Some(end_of(raw.last_state));
        }
        record.workload = opened.workload.clone();
        record.namespace = opened.namespace.clone();
        record.outcome = opened.outcome;
        record.service = opened.service.clone();
        if event == Event::Open {
            self.open.put(raw.cookie, opened);
        }
        Some(record)
    }
}

/// The pod of the record's cgroup and the service of its decision, as the tables in force know
/// them. The outcome is the kernel's (what it did); the service, the decision's it made it from.
fn decided(raw: &ConnRecord, names: Option<&NamesInForce>) -> Opened {
    let outcome = match FastStat::ALL.get(usize::from(raw.outcome)) {
        Some(FastStat::Rewritten) => OutboundOutcome::Service,
        Some(FastStat::Workload) => OutboundOutcome::Workload,
        _ => OutboundOutcome::Passthrough,
    };
    let Some((snapshot, pods)) = names else {
        return Opened {
            workload: None,
            namespace: None,
            outcome,
            service: None,
        };
    };
    let pod = pods.get(&raw.cgroup);
    let namespace = pod.map(|w| w.meta.namespace.as_str());
    let dst: IpAddr = raw.dst.ip();
    let decision = snapshot.decide_outbound_with(namespace, dst, raw.dst_port, Pick::Peek);
    Opened {
        workload: pod.map(|w| format!("{}/{}", w.meta.namespace, w.meta.name)),
        namespace: namespace.map(str::to_string),
        outcome,
        service: decision
            .service()
            .map(|s| format!("{}/{}", s.namespace, s.name)),
    }
}

/// The bytes the application sent and received, from the kernel's counts of sequence space: the
/// peer's acknowledgements count our SYN, and our FIN once it is acknowledged; what we received
/// counts the peer's FIN. Which of those happened follows from the state the socket left.
pub(super) fn payload(raw: &ConnRecord) -> (u64, u64) {
    use tcp_state::*;
    let established = !matches!(raw.last_state, SYN_SENT | SYN_RECV);
    let our_fin_acked = matches!(raw.last_state, FIN_WAIT2 | CLOSING | LAST_ACK);
    let their_fin = matches!(raw.last_state, FIN_WAIT2 | CLOSING | LAST_ACK | CLOSE_WAIT);
    let sent = match established {
        true => raw.bytes_sent.saturating_sub(1 + u64::from(our_fin_acked)),
        false => 0,
    };
    (
        sent,
        raw.bytes_received.saturating_sub(u64::from(their_fin)),
    )
}

/// How a connection ended, from the TCP state its socket left for CLOSE.
pub(super) fn end_of(last_state: u8) -> &'static str {
    match last_state {
        // Never established: refused, unreachable, or the handshake timed out.
        tcp_state::SYN_SENT | tcp_state::SYN_RECV => "connect failed",
        // Both sides' FINs went through (TIME_WAIT or the last ACK).
        tcp_state::FIN_WAIT2 | tcp_state::TIME_WAIT | tcp_state::CLOSING | tcp_state::LAST_ACK => {
            "closed"
        }
        // Torn down while data could still flow: a reset, sent or received.
        _ => "reset",
    }
}

/// The wall-clock time of a `CLOCK_MONOTONIC` reading in nanoseconds (`bpf_ktime_get_ns`).
fn monotonic_to_wall(ns: u64) -> SystemTime {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write; CLOCK_MONOTONIC is always available.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } == 0;
    let wall = SystemTime::now();
    if !ok || ns == 0 {
        return wall;
    }
    let mono_now = u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000
        + u64::try_from(now.tv_nsec).unwrap_or(0);
    wall - Duration::from_nanos(mono_now.saturating_sub(ns))
}

#[cfg(test)]
mod tests;
