//! The kernel's connection records, user side: read off `CONN_RECORDS` in batches (the kernel
//! wakes the reader once a batch waits, and the reader collects what waits below one every 100 ms),
//! joined to the pod by its cgroup and to the service by the decision the tables in force were
//! compiled from, and handed to the agent's [`Connections`] as `decided_by=kernel` records. A close is joined to its open by the socket's cookie, so it names
//! the service the connection was decided for even when the configuration changed since.
use std::{
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    sync::Arc,
    time::{Duration, SystemTime},
};

use aya::maps::{MapData, RingBuf};
use foldhash::{HashMap, HashMapExt};
use redirect_common::{
    FastStat,
    records::{ConnRecord, RECORD_CLOSE, RECORD_OPEN, tcp_state},
};
use tokio::io::unix::AsyncFd;
use tracing::warn;

use crate::{
    config::Workload,
    records::{Connections, DecidedBy, Event, Name, Record, ends},
    state::{OutboundOutcome, Pick, Snapshot},
};

/// Open connections remembered for their close, at most about this many: past it the older half is
/// let go (a connect() that failed before its handshake never closes). A close not found is joined
/// by deciding again on the tables in force.
const OPEN_JOINED: usize = 65_536;

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

/// A pod the client table in force names, with the names its records carry (made once per
/// install, shared by every record).
#[derive(Debug, Clone)]
pub(crate) struct ClientPod {
    pub pod: Arc<Workload>,
    /// `namespace/name`.
    pub workload: Name,
    pub namespace: Name,
}

impl ClientPod {
    pub(crate) fn new(pod: &Arc<Workload>) -> ClientPod {
        ClientPod {
            pod: pod.clone(),
            workload: Name::from(format!("{}/{}", pod.meta.namespace, pod.meta.name)),
            namespace: Name::from(pod.meta.namespace.as_str()),
        }
    }
}

/// The pods the client table in force names, by cgroup.
pub(super) type PodsByCgroup = HashMap<u64, ClientPod>;

/// The snapshot the tables in force came from, and the pods they name.
pub(super) type NamesInForce = (Arc<Snapshot>, Arc<PodsByCgroup>);

/// What the joins need: the names of the tables in force (none before the first).
pub(super) trait Names: Send + Sync {
    fn names(&self) -> Option<NamesInForce>;
}

/// How often the agent collects the records waiting below
/// [`redirect_common::records::RECORDS_WAKE_AT`] (the kernel wakes it
/// at once past that): a record reaches the log and the followers within this.
const COLLECT_EVERY: Duration = Duration::from_millis(100);

/// What an open record learned, kept for its close.
#[derive(Clone)]
struct Opened {
    workload: Option<Name>,
    namespace: Option<Name>,
    outcome: OutboundOutcome,
    service: Option<Name>,
}

/// Reads the ring until `shutdown` changes: when the kernel wakes it for a batch, and every
/// [`COLLECT_EVERY`] for what waits below one.
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
    let mut tick = tokio::time::interval(COLLECT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.stopped() => return,
            ready = ring.readable_mut() => match ready {
                Ok(mut guard) => {
                    collect(guard.get_inner_mut(), &mut joiner, names.as_ref(), &connections);
                    guard.clear_ready();
                }
                Err(e) => {
                    warn!(error = %e, fd = ring.get_ref().as_raw_fd(), "fast path: waiting on the connection records failed; they are lost from now on");
                    return;
                }
            },
            _ = tick.tick() => collect(ring.get_mut(), &mut joiner, names.as_ref(), &connections),
        }
    }
}

/// Every record waiting, joined and handed over together.
fn collect(
    ring: &mut RingBuf<MapData>,
    joiner: &mut Joiner,
    names: &dyn Names,
    connections: &Connections,
) {
    let names = names.names();
    let clock = Clock::now();
    let mut records = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<ConnRecord>() {
            continue;
        }
        // SAFETY: the programs write whole `ConnRecord`s (plain integers, any bit pattern
        // valid); the item may be unaligned.
        let raw = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<ConnRecord>()) };
        drop(item);
        records.extend(joiner.join(&raw, names.as_ref(), &clock));
    }
    if !records.is_empty() {
        connections.record_all(records);
    }
}

/// Joins records to names, and closes to their opens.
struct Joiner {
    open: Opens,
    /// The service names made for the snapshot at this address (its services, by address).
    services: (usize, HashMap<usize, Name>),
}

/// The open connections by cookie, in two halves: the newer takes the opens, a close looks in
/// both; when the newer is full the older is let go and the newer takes its place. Bounded, and
/// no bookkeeping per record beyond a hash insert and remove.
struct Opens {
    newer: HashMap<u64, Opened>,
    older: HashMap<u64, Opened>,
}

impl Opens {
    fn put(&mut self, cookie: u64, opened: Opened) {
        if self.newer.len() >= OPEN_JOINED / 2 {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(cookie, opened);
    }

    fn take(&mut self, cookie: u64) -> Option<Opened> {
        self.newer
            .remove(&cookie)
            .or_else(|| self.older.remove(&cookie))
    }
}

impl Joiner {
    fn new() -> Joiner {
        Joiner {
            open: Opens {
                newer: HashMap::new(),
                older: HashMap::new(),
            },
            services: (0, HashMap::new()),
        }
    }

    fn join(
        &mut self,
        raw: &ConnRecord,
        names: Option<&NamesInForce>,
        clock: &Clock,
    ) -> Option<Record> {
        let event = match raw.kind {
            RECORD_OPEN => Event::Open,
            RECORD_CLOSE => Event::Close,
            _ => return None,
        };
        let opened = match event {
            Event::Close => self.open.take(raw.cookie),
            Event::Open => None,
        };
        let opened = opened.unwrap_or_else(|| self.decided(raw, names));
        let mut record = Record::new(event, DecidedBy::Kernel);
        record.time = clock.wall(match event {
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
        } else {
            self.open.put(raw.cookie, opened.clone());
        }
        record.workload = opened.workload;
        record.namespace = opened.namespace;
        record.outcome = opened.outcome;
        record.service = opened.service;
        Some(record)
    }

    /// The pod of the record's cgroup and the service of its decision, as the tables in force
    /// know them. The outcome is the kernel's (what it did); the service, the decision's it made
    /// it from.
    fn decided(&mut self, raw: &ConnRecord, names: Option<&NamesInForce>) -> Opened {
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
        let namespace = pod.map(|p| p.pod.meta.namespace.as_str());
        let dst: IpAddr = raw.dst.ip();
        let decision = snapshot.decide_outbound_with(namespace, dst, raw.dst_port, Pick::Peek);
        let snapshot_at = Arc::as_ptr(snapshot) as usize;
        if self.services.0 != snapshot_at {
            self.services = (snapshot_at, HashMap::new());
        }
        let service = decision.service().map(|s| {
            let at = std::ptr::from_ref(s) as usize;
            self.services
                .1
                .entry(at)
                .or_insert_with(|| Name::from(format!("{}/{}", s.namespace, s.name)))
                .clone()
        });
        Opened {
            workload: pod.map(|p| p.workload.clone()),
            namespace: pod.map(|p| p.namespace.clone()),
            outcome,
            service,
        }
    }
}

/// The wall clock against the kernel's `CLOCK_MONOTONIC` (`bpf_ktime_get_ns`), read once per batch.
struct Clock {
    wall: SystemTime,
    monotonic_ns: u64,
}

impl Clock {
    fn now() -> Clock {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid timespec to write; CLOCK_MONOTONIC is always available.
        let read = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } == 0;
        let monotonic_ns = match read {
            true => {
                u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000
                    + u64::try_from(now.tv_nsec).unwrap_or(0)
            }
            false => 0,
        };
        Clock {
            wall: SystemTime::now(),
            monotonic_ns,
        }
    }

    /// The wall-clock time of the monotonic reading `ns`.
    fn wall(&self, ns: u64) -> SystemTime {
        if self.monotonic_ns == 0 || ns == 0 {
            return self.wall;
        }
        self.wall - Duration::from_nanos(self.monotonic_ns.saturating_sub(ns))
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
        tcp_state::SYN_SENT | tcp_state::SYN_RECV => ends::CONNECT_FAILED,
        // Both sides' FINs went through (TIME_WAIT or the last ACK).
        tcp_state::FIN_WAIT2 | tcp_state::TIME_WAIT | tcp_state::CLOSING | tcp_state::LAST_ACK => {
            "closed"
        }
        // Torn down while data could still flow: a reset, sent or received.
        _ => "reset",
    }
}

#[cfg(test)]
mod tests;
