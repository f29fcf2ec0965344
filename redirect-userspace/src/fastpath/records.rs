//! The kernel's connection records, user side: read off `CONN_RECORDS` in batches (the kernel
//! wakes the reader once a batch waits, and the reader collects what waits below one every 100 ms),
//! joined to the pod by its cgroup and to the service by the decision the tables in force were
//! compiled from, and handed to the agent's [`Connections`] as `decided_by=kernel` records. The
//! kernel keeps nothing per socket: a close is joined to its open by the socket's cookie, takes
//! its decision and names from it (so it names the service the connection was decided for even
//! when the configuration changed since), and its open record's time is the open's.
use std::{
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    sync::{Arc, Weak},
    time::{Duration, SystemTime},
};

use aya::maps::{MapData, RingBuf};
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use redirect_common::{
    FastStat,
    fastpath::IpKey,
    records::{CloseRecord, OpenRecord, RECORD_CLOSE, RECORD_OPEN, tcp_state},
};
use tokio::io::unix::AsyncFd;
use tracing::warn;

use crate::{
    config::Workload,
    records::{Connections, DecidedBy, Event, Name, Record, ends},
    state::{OutboundOutcome, Pick, Snapshot},
};

/// Open connections remembered for their close, at most about this many: past it the older half is
/// let go (a connect() that failed before its handshake never closes). The close of one let go is
/// named by deciding again on the tables in force, from what its socket kept.
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

impl std::fmt::Display for KernelRecords {
    /// As `--kernel-records` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelRecords::Off => f.write_str("off"),
            KernelRecords::All => f.write_str("all"),
            KernelRecords::OneIn(n) => write!(f, "1/{n}"),
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

/// Decisions named, at most this many (one per client cgroup, destination, port and outcome seen):
/// past it the cache starts over.
const NAMES_CACHED: usize = 4096;

/// What a decision is named: shared by every connection of the same client, destination and
/// outcome.
#[derive(Debug)]
struct Opened {
    workload: Option<Name>,
    namespace: Option<Name>,
    outcome: OutboundOutcome,
    service: Option<Name>,
}

/// An open connection, kept for its close.
struct Open {
    raw: OpenRecord,
    names: Arc<Opened>,
}

/// A record as the ring carries it.
enum Raw {
    Open(OpenRecord),
    Close(CloseRecord),
}

impl Raw {
    /// The record in `item`, by the kind its first byte says; `None` for anything else.
    fn read(item: &[u8]) -> Option<Raw> {
        let fits = |size: usize| item.len() >= size;
        match *item.first()? {
            // SAFETY: the programs write whole records (plain integers, any bit pattern valid) of
            // the kind their first byte says, and the item is that long; it may be unaligned.
            RECORD_OPEN if fits(std::mem::size_of::<OpenRecord>()) => Some(Raw::Open(unsafe {
                std::ptr::read_unaligned(item.as_ptr().cast::<OpenRecord>())
            })),
            // SAFETY: as above.
            RECORD_CLOSE if fits(std::mem::size_of::<CloseRecord>()) => Some(Raw::Close(unsafe {
                std::ptr::read_unaligned(item.as_ptr().cast::<CloseRecord>())
            })),
            _ => None,
        }
    }
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
    let mut records = Vec::with_capacity(joiner.last_batch);
    let mut batch = None;
    while let Some(item) = ring.next() {
        let raw = Raw::read(&item);
        drop(item);
        let Some(raw) = raw else { continue };
        // The names in force and the clock, read once a batch and only for a batch.
        let (names, batch) = batch.get_or_insert_with(|| (names.names(), Batch::now()));
        joiner.join(raw, names.as_ref(), batch, &mut records);
    }
    joiner.last_batch = records.len();
    if !records.is_empty() {
        connections.record_all(records);
    }
}

/// Joins records to names, and closes to their opens.
struct Joiner {
    open: Opens,
    names: NamesCache,
    /// Records the last batch made: the next one's room.
    last_batch: usize,
}

/// The open connections by cookie, in two halves: the newer takes the opens, a close looks in
/// both; when the newer is full the older is let go and the newer takes its place. Bounded, and
/// no bookkeeping per record beyond a hash insert and remove. Only connections still open stay
/// (a close takes its open out), so letting go takes connections of a node with tens of thousands
/// open at once, or opens whose close never came (a connect() that failed before its SYN).
struct Opens {
    newer: HashMap<u64, Open>,
    older: HashMap<u64, Open>,
    /// The cookies of the opens last let go: their closes are still recorded, from what the
    /// socket kept of its decision. A close of any other cookie is not one of ours to record (a
    /// socket watched by an agent before this one, or by another program).
    let_go: HashSet<u64>,
}

/// What a close found of its open.
enum Found {
    Open(Open),
    LetGo,
    Never,
}

impl Opens {
    fn put(&mut self, cookie: u64, open: Open) {
        if self.newer.len() >= OPEN_JOINED / 2 {
            self.let_go = self.older.drain().map(|(cookie, _)| cookie).collect();
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(cookie, open);
    }

    fn take(&mut self, cookie: u64) -> Found {
        match self
            .newer
            .remove(&cookie)
            .or_else(|| self.older.remove(&cookie))
        {
            Some(open) => Found::Open(open),
            None if self.let_go.remove(&cookie) => Found::LetGo,
            None => Found::Never,
        }
    }
}

impl Joiner {
    fn new() -> Joiner {
        Joiner {
            open: Opens {
                newer: HashMap::new(),
                older: HashMap::new(),
                let_go: HashSet::new(),
            },
            names: NamesCache::new(),
            last_batch: 0,
        }
    }

    /// The record of `raw`, if it is one to record, onto `records`.
    fn join(
        &mut self,
        raw: Raw,
        names: Option<&NamesInForce>,
        batch: &Batch,
        records: &mut Vec<Record>,
    ) {
        match raw {
            Raw::Open(raw) => {
                let named = self.names.decided(Decided::of_open(&raw), names);
                opened(batch.push(records, Event::Open, &named), &raw, &batch.clock);
                self.open.put(raw.cookie, Open { raw, names: named });
            }
            Raw::Close(raw) => match self.open.take(raw.cookie) {
                Found::Open(open) => {
                    let record = batch.push(records, Event::Close, &open.names);
                    closed(record, &raw, &open.raw, &batch.clock);
                }
                Found::LetGo => {
                    let mut decided = Decided::of_close(&raw);
                    if decided.cgroup == 0 && raw.client.family != 0 {
                        let at = self.names.cgroup_at(raw.client.ip(), names);
                        decided.cgroup = at.unwrap_or(0);
                    }
                    let named = self.names.decided(decided, names);
                    let record = batch.push(records, Event::Close, &named);
                    closed_alone(record, &raw, &batch.clock);
                }
                Found::Never => {}
            },
        }
    }
}

/// `record` as the open `raw` made it.
fn opened(record: &mut Record, raw: &OpenRecord, clock: &Clock) {
    record.time = clock.wall(raw.opened_ns);
    record.orig_dst = Some(SocketAddr::new(raw.dst.ip(), raw.dst_port));
    record.endpoint = Some(SocketAddr::new(raw.endpoint.ip(), raw.endpoint_port));
}

/// `record` as the close `raw`, whose open was `open`, made it.
fn closed(record: &mut Record, raw: &CloseRecord, open: &OpenRecord, clock: &Clock) {
    opened(record, open, clock);
    close_facts(record, raw, clock);
    record.duration = Some(Duration::from_nanos(
        raw.closed_ns.saturating_sub(open.opened_ns),
    ));
}

/// `record` as the close `raw` made it when its open was let go: the decision as the socket kept
/// it, and no duration (the time of the open went with it).
fn closed_alone(record: &mut Record, raw: &CloseRecord, clock: &Clock) {
    record.orig_dst = Some(SocketAddr::new(raw.dst.ip(), raw.dst_port));
    record.endpoint = Some(SocketAddr::new(raw.endpoint.ip(), raw.endpoint_port));
    close_facts(record, raw, clock);
}

/// What the close brings: its time, the client, the bytes and how it ended.
fn close_facts(record: &mut Record, raw: &CloseRecord, clock: &Clock) {
    record.time = clock.wall(raw.closed_ns);
    record.client =
        (raw.client.family != 0).then(|| SocketAddr::new(raw.client.ip(), raw.client_port));
    (record.bytes_sent, record.bytes_received) = payload(raw);
    record.end = Some(end_of(raw.last_state));
}

/// What every record of a batch starts from: the clock, and a blank kernel record (copied, where
/// making each anew would read the clock again).
struct Batch {
    clock: Clock,
    blank: Record,
}

impl Batch {
    fn now() -> Batch {
        Batch {
            clock: Clock::now(),
            blank: Record::new(Event::Open, DecidedBy::Kernel),
        }
    }

    /// A kernel record of `event` carrying `names`, put at the end of `records` (made in place: a
    /// record is a few hundred bytes) to be filled in.
    fn push<'a>(
        &self,
        records: &'a mut Vec<Record>,
        event: Event,
        names: &Opened,
    ) -> &'a mut Record {
        let at = records.len();
        records.extend_from_slice(std::slice::from_ref(&self.blank));
        let record = &mut records[at];
        record.event = event;
        record.workload.clone_from(&names.workload);
        record.namespace.clone_from(&names.namespace);
        record.outcome = names.outcome;
        record.service.clone_from(&names.service);
        record
    }
}

/// A decision to name: the client's cgroup, where it meant to go, and the kernel's outcome.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Decided {
    cgroup: u64,
    dst: IpKey,
    dst_port: u16,
    outcome: u8,
}

impl Decided {
    fn of_open(raw: &OpenRecord) -> Decided {
        Decided {
            cgroup: raw.cgroup,
            dst: raw.dst,
            dst_port: raw.dst_port,
            outcome: raw.outcome,
        }
    }

    fn of_close(raw: &CloseRecord) -> Decided {
        Decided {
            cgroup: raw.cgroup,
            dst: raw.dst,
            dst_port: raw.dst_port,
            outcome: raw.outcome,
        }
    }
}

/// The names of decisions made on the tables in force, made once per client, destination and
/// outcome rather than per connection; started over when the tables change.
struct NamesCache {
    /// The snapshot and pods the entries were named from (weak: an address is never reused while
    /// held, and the tables are not kept alive).
    of: Option<(Weak<Snapshot>, Weak<PodsByCgroup>)>,
    decided: HashMap<Decided, Arc<Opened>>,
    /// The service names made for the snapshot (its services, by address).
    services: HashMap<usize, Name>,
    /// The pods' cgroups by address, made when a close that lost its open first needs them.
    by_ip: Option<HashMap<IpAddr, u64>>,
}

impl NamesCache {
    fn new() -> NamesCache {
        NamesCache {
            of: None,
            decided: HashMap::new(),
            services: HashMap::new(),
            by_ip: None,
        }
    }

    /// Starts over when the tables in force are not those the entries were named from.
    fn follow(&mut self, names: Option<&NamesInForce>) {
        let same = match (&self.of, names) {
            (Some((s, p)), Some((snapshot, pods))) => {
                std::ptr::eq(s.as_ptr(), Arc::as_ptr(snapshot))
                    && std::ptr::eq(p.as_ptr(), Arc::as_ptr(pods))
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            *self = NamesCache::new();
            self.of = names.map(|(s, p)| (Arc::downgrade(s), Arc::downgrade(p)));
        }
    }

    fn decided(&mut self, decided: Decided, names: Option<&NamesInForce>) -> Arc<Opened> {
        self.follow(names);
        if let Some(named) = self.decided.get(&decided) {
            return named.clone();
        }
        if self.decided.len() >= NAMES_CACHED {
            self.decided.clear();
        }
        let named = Arc::new(self.name(&decided, names));
        self.decided.insert(decided, named.clone());
        named
    }

    /// The pod of the decision's cgroup and the service it was decided for, as the tables in
    /// force know them. The outcome is the kernel's (what it did); the service, the decision's it
    /// made it from.
    fn name(&mut self, decided: &Decided, names: Option<&NamesInForce>) -> Opened {
        let kernel = match FastStat::ALL.get(usize::from(decided.outcome)) {
            Some(FastStat::Rewritten) => Some(OutboundOutcome::Service),
            Some(FastStat::Workload) => Some(OutboundOutcome::Workload),
            Some(_) => Some(OutboundOutcome::Passthrough),
            // Left alone, said at a close: passthrough or a workload, as the tables say.
            None => None,
        };
        let Some((snapshot, pods)) = names else {
            return Opened {
                workload: None,
                namespace: None,
                outcome: kernel.unwrap_or(OutboundOutcome::Passthrough),
                service: None,
            };
        };
        let pod = pods.get(&decided.cgroup);
        let namespace = pod.map(|p| p.pod.meta.namespace.as_str());
        let dst: IpAddr = decided.dst.ip();
        let decision = snapshot.decide_outbound_with(namespace, dst, decided.dst_port, Pick::Peek);
        let outcome = kernel.unwrap_or(match decision.outcome() {
            OutboundOutcome::Workload => OutboundOutcome::Workload,
            _ => OutboundOutcome::Passthrough,
        });
        let service = decision.service().map(|s| {
            let at = std::ptr::from_ref(s) as usize;
            self.services
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

    /// The cgroup of the pod at `client`, as the tables in force name the pods (for a close that
    /// lost its open: a socket the kernel left alone keeps no cgroup).
    fn cgroup_at(&mut self, client: IpAddr, names: Option<&NamesInForce>) -> Option<u64> {
        self.follow(names);
        let (_, pods) = names?;
        let by_ip = self.by_ip.get_or_insert_with(|| {
            pods.iter()
                .flat_map(|(cgroup, p)| p.pod.ips.iter().map(move |ip| (*ip, *cgroup)))
                .collect()
        });
        by_ip.get(&client).copied()
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
pub(super) fn payload(raw: &CloseRecord) -> (u64, u64) {
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
