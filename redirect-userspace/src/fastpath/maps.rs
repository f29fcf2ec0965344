//! The fast path's maps: two generations of tables and the selector saying which one is in force.
//!
//! Each table is an array of two maps in the kernel, one slot per generation. The agent creates
//! the maps itself, at the size the tables need: a generation whose tables outgrew its maps (or
//! hold far less than they could) gets new maps of the right size, filled before they are put in
//! its slot. An update never touches the generation in force: the idle one is brought to the new
//! tables (only the entries that differ are written, or every entry into new maps), then the
//! selector flips in one map write. A connection reads the selector once and then one generation,
//! so it sees the old tables or the new ones, never half of each. The tables are not pinned: a
//! successor fills its own before its programs are swapped in (`Redirector::attach`'s hook).
//! The counters are: they go on across hand-overs.
use std::{
    collections::{BTreeMap, HashMap as StdHashMap, HashSet},
    hash::Hash,
    os::fd::{AsFd, AsRawFd},
    sync::Arc,
    time::{Duration, Instant},
};

use aya::{
    Ebpf, Pod,
    maps::{
        Array, ArrayOfMaps, HashMap, IterableMap, LpmTrie, MapData, MapError, PerCpuArray, RingBuf,
        lpm_trie::Key,
    },
};
use redirect_common::{
    FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED, FastStat,
    fastpath::{
        AddrKey, Backends, Claim, Config, GEN_A, GEN_B, HiddenEvent, IpKey, LpmBytes, PortKey,
        generation_slot,
    },
    maps,
};

use super::{Install, PortEndpoints, TableMemory, Tables, kernel_bytes};
use crate::redirect::{RedirectError, per_cpu_totals, take_map};

/// A generation just left is not rewritten before this: a program that read the selector just
/// before the flip finishes its few lookups long before.
const QUIET_AFTER_FLIP: Duration = Duration::from_millis(20);

/// The smallest map the agent creates (a few KiB of buckets): most nodes' tables stay below it.
const MIN_CAPACITY: u32 = 1024;

/// The capacity a map holding `entries` is created with: a quarter more for what the next
/// configurations add, a power of two (the hash maps' buckets are, whatever is asked).
fn capacity_for(entries: usize) -> u32 {
    let wanted = entries
        .saturating_add(entries / 4)
        .max(MIN_CAPACITY as usize);
    u32::try_from(wanted.next_power_of_two()).unwrap_or(1 << 31)
}

/// Whether a map of `capacity` should be made anew to hold `entries`: it is too small, or four
/// times larger than needed (its buckets are memory held for nothing).
fn needs_new_map(capacity: u32, entries: usize) -> bool {
    entries > capacity as usize || capacity > capacity_for(entries).saturating_mul(4)
}

/// The five tables' arrays of maps, one slot per generation.
struct Outers {
    clients: ArrayOfMaps<MapData, HashMap<MapData, u64, u32>>,
    exact: ArrayOfMaps<MapData, HashMap<MapData, AddrKey, Claim>>,
    cidrs: ArrayOfMaps<MapData, LpmTrie<MapData, LpmBytes, Claim>>,
    ports: ArrayOfMaps<MapData, HashMap<MapData, PortKey, Backends>>,
    workloads: ArrayOfMaps<MapData, HashMap<MapData, IpKey, u8>>,
    /// Each generation's flags, by slot.
    config: Array<MapData, Config>,
}

/// One map of a generation and the entries it was created for.
struct Sized<M> {
    map: M,
    capacity: u32,
}

/// One generation's maps and what they hold.
struct Generation {
    slot: u32,
    clients: Sized<HashMap<MapData, u64, u32>>,
    exact: Sized<HashMap<MapData, AddrKey, Claim>>,
    cidrs: Sized<LpmTrie<MapData, LpmBytes, Claim>>,
    ports: Sized<HashMap<MapData, PortKey, Backends>>,
    workloads: Sized<HashMap<MapData, IpKey, u8>>,
    /// What the maps hold, as last written: the very tables the agent compiled (shared with it
    /// and, after [`FastMaps::catch_up`], with the other generation: no copy is made to write
    /// them). `None` while a write is under way or after one failed: then what the maps hold is
    /// unknown, and the next write makes every map anew.
    held: Option<Install>,
}

/// Entries of each table `install` holds.
fn sizes(install: &Install) -> BTreeMap<&'static str, usize> {
    let tables = &install.tables;
    BTreeMap::from([
        ("clients", install.clients.len()),
        ("exact", tables.exact().len()),
        ("cidrs", tables.cidr_count()),
        ("ports", tables.ports().len()),
        ("workloads", tables.workloads().len()),
    ])
}

/// The fast path's maps, owned by the agent that loaded them.
pub(crate) struct FastMaps {
    selector: Array<MapData, u32>,
    outers: Outers,
    generations: [Generation; 2],
    /// Index into `generations` of the one in force, if any.
    in_force: Option<usize>,
    flipped_at: Option<Instant>,
    /// Whether the idle generation holds what the one in force does (see [`FastMaps::catch_up`]).
    idle_caught_up: bool,
    stats: Arc<FastStats>,
    /// Until the agent's reader takes it.
    events: Option<RingBuf<MapData>>,
    /// Until the audit's writer takes it.
    audited: Option<LpmTrie<MapData, LpmBytes, u8>>,
    /// The kernel's connection records, until their reader takes them.
    records: Option<RingBuf<MapData>>,
    /// How many of its decisions the kernel records; held, so the programs keep reading it.
    _records_sample: Array<MapData, u32>,
    records_lost: Arc<RecordsLost>,
}

/// The programs' fast-path counters: read without the maps' lock, which an update holds for as
/// long as it writes (a scrape or the hides' reader never waits for one).
pub(crate) struct FastStats(PerCpuArray<MapData, u64>);

impl FastStats {
    /// Totals of the programs' per-CPU fast-path counters.
    pub(crate) fn counts(&self) -> Vec<(FastStat, u64)> {
        per_cpu_totals(&self.0, &FastStat::ALL, |stat| stat as u32)
    }

    /// Connections the kernel decided past a hidden service, and the hides it could not report.
    pub(crate) fn hidden_counts(&self) -> (u64, u64) {
        let totals = per_cpu_totals(
            &self.0,
            &[FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED],
            |slot| slot,
        );
        (totals[0].1, totals[1].1)
    }
}

/// The kernel's count of the connection records it could not report (`RECORDS_LOST`).
pub(crate) struct RecordsLost(PerCpuArray<MapData, u64>);

impl RecordsLost {
    pub(crate) fn count(&self) -> u64 {
        per_cpu_totals(&self.0, &[0u32], |slot| slot)[0].1
    }
}

/// The kernel's reports of the hides it decided past (`FAST_HIDDEN_EVENTS`).
pub(crate) struct HiddenEvents(RingBuf<MapData>);

impl HiddenEvents {
    /// Every event waiting, oldest first.
    pub(crate) fn drain(&mut self) -> Vec<HiddenEvent> {
        let mut out = Vec::new();
        while let Some(item) = self.0.next() {
            if item.len() >= std::mem::size_of::<HiddenEvent>() {
                // SAFETY: the program writes whole `HiddenEvent`s (plain integers, any bit
                // pattern valid); the item may be unaligned.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<HiddenEvent>()) });
            }
        }
        out
    }
}

impl FastMaps {
    /// The fast path's maps out of the loaded object; the kernel records one connection in
    /// `records_sample` of those it decides (0: none).
    pub(crate) fn take(ebpf: &mut Ebpf, records_sample: u32) -> Result<FastMaps, RedirectError> {
        let mut sample: Array<MapData, u32> =
            take_map(ebpf, maps::RECORDS_SAMPLE, Array::try_from)?;
        sample
            .set(0, records_sample, 0)
            .map_err(|source| RedirectError::Map {
                name: maps::RECORDS_SAMPLE,
                source,
            })?;
        let mut outers = Outers {
            clients: take_map(ebpf, maps::FAST_CLIENTS, ArrayOfMaps::try_from)?,
            exact: take_map(ebpf, maps::FAST_EXACT, ArrayOfMaps::try_from)?,
            cidrs: take_map(ebpf, maps::FAST_CIDRS, ArrayOfMaps::try_from)?,
            ports: take_map(ebpf, maps::FAST_PORTS, ArrayOfMaps::try_from)?,
            workloads: take_map(ebpf, maps::FAST_WORKLOADS, ArrayOfMaps::try_from)?,
            config: take_map(ebpf, maps::FAST_CONFIG, Array::try_from)?,
        };
        let created = |source| RedirectError::Map {
            name: "fast path table",
            source,
        };
        let generations = [
            Generation::new(&mut outers, generation_slot(GEN_A)).map_err(created)?,
            Generation::new(&mut outers, generation_slot(GEN_B)).map_err(created)?,
        ];
        Ok(FastMaps {
            selector: take_map(ebpf, maps::FAST_GENERATION, Array::try_from)?,
            outers,
            generations,
            in_force: None,
            flipped_at: None,
            idle_caught_up: false,
            stats: Arc::new(FastStats(take_map(
                ebpf,
                maps::FAST_STATS,
                PerCpuArray::try_from,
            )?)),
            events: Some(take_map(ebpf, maps::FAST_HIDDEN_EVENTS, RingBuf::try_from)?),
            audited: Some(take_map(ebpf, maps::FAST_AUDITED, LpmTrie::try_from)?),
            records: Some(take_map(ebpf, maps::CONN_RECORDS, RingBuf::try_from)?),
            _records_sample: sample,
            records_lost: Arc::new(RecordsLost(take_map(
                ebpf,
                maps::RECORDS_LOST,
                PerCpuArray::try_from,
            )?)),
        })
    }

    /// [`FastMaps::take`], then `first` put in force when given (a failure to write them is logged:
    /// the proxy decides until the next tables).
    pub(crate) fn take_with(
        ebpf: &mut Ebpf,
        first: Option<&Install>,
        records_sample: u32,
    ) -> Result<FastMaps, RedirectError> {
        let mut maps = FastMaps::take(ebpf, records_sample)?;
        if let Some(first) = first {
            match maps.install(first) {
                Ok(()) => tracing::info!(
                    exact = first.tables.exact().len(),
                    ports = first.tables.ports().len(),
                    clients = first.clients.len(),
                    "fast path: new tables in force (before the programs attach)"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "fast path: writing the first tables failed; the proxy decides until the next ones")
                }
            }
        }
        Ok(maps)
    }

    /// Puts `tables` in force, whole. On an error the generation in force stays as it was.
    pub(crate) fn install(&mut self, tables: &Install) -> Result<(), MapError> {
        let idle = self.in_force.map_or(0, |i| 1 - i);
        if let Some(at) = self.flipped_at {
            // Blocking, but short and only on back-to-back updates.
            std::thread::sleep(QUIET_AFTER_FLIP.saturating_sub(at.elapsed()));
        }
        self.generations[idle].write(&mut self.outers, tables)?;
        let selector = if idle == 0 { GEN_A } else { GEN_B };
        self.selector.set(0, selector, 0)?;
        self.in_force = Some(idle);
        self.flipped_at = Some(Instant::now());
        self.idle_caught_up = false;
        Ok(())
    }

    /// Entries of each table in force, if any are.
    pub(crate) fn sizes_in_force(&self) -> Option<BTreeMap<&'static str, usize>> {
        let held = self.generations[self.in_force?].held.as_ref()?;
        Some(sizes(held))
    }

    /// What each table's maps take in the kernel, both generations together.
    pub(crate) fn memory(&self) -> BTreeMap<&'static str, TableMemory> {
        let mut out: BTreeMap<&'static str, TableMemory> = BTreeMap::new();
        for generation in &self.generations {
            for (name, memory) in generation.memory() {
                out.entry(name).or_default().add(&memory);
            }
        }
        out
    }

    /// The programs' counters, to read without this lock.
    pub(crate) fn stats(&self) -> Arc<FastStats> {
        self.stats.clone()
    }

    /// Brings the idle generation to what the one in force holds, once [`QUIET_AFTER_FLIP`] has
    /// passed since the flip (`false`: too soon, call again later). Otherwise the next update
    /// writes both its own change and the one before it: after the first tables (the idle
    /// generation empty) that is every entry, at 10,000 entries some 100 ms on the way to one
    /// pod's change. Done off the update's path, it takes that time when nothing waits for it.
    pub(crate) fn catch_up(&mut self) -> Result<bool, MapError> {
        let Some(in_force) = self.in_force else {
            return Ok(true);
        };
        if self.idle_caught_up {
            return Ok(true);
        }
        if self
            .flipped_at
            .is_some_and(|at| at.elapsed() < QUIET_AFTER_FLIP)
        {
            return Ok(false);
        }
        let (first, second) = self.generations.split_at_mut(1);
        let (live, idle) = match in_force {
            0 => (&first[0], &mut second[0]),
            _ => (&second[0], &mut first[0]),
        };
        if let Some(held) = live.held.clone() {
            idle.write(&mut self.outers, &held)?;
        }
        self.idle_caught_up = true;
        Ok(true)
    }

    /// The hide reports, once (their reader owns them).
    pub(crate) fn take_events(&mut self) -> Option<HiddenEvents> {
        self.events.take().map(HiddenEvents)
    }

    /// The kernel's count of the records it could not report.
    pub(crate) fn records_lost(&self) -> Arc<RecordsLost> {
        self.records_lost.clone()
    }

    /// The kernel's connection records, once (their reader owns them).
    pub(crate) fn take_records(&mut self) -> Option<RingBuf<MapData>> {
        self.records.take()
    }

    /// The audited addresses' trie, for the one task that writes it.
    pub(crate) fn take_audited(&mut self) -> Option<super::audited::AuditedMap> {
        self.audited.take().map(super::audited::AuditedMap::new)
    }
}

impl Generation {
    /// The generation in `slot`, with maps of the smallest size in place (a program finds every
    /// map of a generation, empty until the agent writes it).
    fn new(outers: &mut Outers, slot: u32) -> Result<Generation, MapError> {
        let generation = Generation {
            slot,
            clients: Sized::create(MIN_CAPACITY, hash_map)?,
            exact: Sized::create(MIN_CAPACITY, hash_map)?,
            cidrs: Sized::create(MIN_CAPACITY, lpm_trie)?,
            ports: Sized::create(MIN_CAPACITY, hash_map)?,
            workloads: Sized::create(MIN_CAPACITY, hash_map)?,
            // Empty maps, known to be.
            held: Some(Install::default()),
        };
        outers.clients.set(slot, &generation.clients.map, 0)?;
        outers.exact.set(slot, &generation.exact.map, 0)?;
        outers.cidrs.set(slot, &generation.cidrs.map, 0)?;
        outers.ports.set(slot, &generation.ports.map, 0)?;
        outers.workloads.set(slot, &generation.workloads.map, 0)?;
        outers.config.set(slot, Config::default(), 0)?;
        Ok(generation)
    }

    /// Brings this (idle) generation to `want`, writing only what differs from what it holds (a
    /// map made anew, because it is too small or far too large or its content is unknown, gets
    /// every entry).
    fn write(&mut self, outers: &mut Outers, want: &Install) -> Result<(), MapError> {
        let slot = self.slot;
        // Unknown until this write has succeeded.
        let had = self.held.take();
        let unknown = had.is_none();
        let tables = &*want.tables;
        let anew = [
            self.clients
                .resize(unknown, want.clients.len(), hash_map, |m| {
                    outers.clients.set(slot, m, 0)
                })?,
            self.exact
                .resize(unknown, tables.exact().len(), hash_map, |m| {
                    outers.exact.set(slot, m, 0)
                })?,
            self.cidrs
                .resize(unknown, tables.cidr_count(), lpm_trie, |m| {
                    outers.cidrs.set(slot, m, 0)
                })?,
            self.ports
                .resize(unknown, tables.ports().len(), hash_map, |m| {
                    outers.ports.set(slot, m, 0)
                })?,
            self.workloads
                .resize(unknown, tables.workloads().len(), hash_map, |m| {
                    outers.workloads.set(slot, m, 0)
                })?,
        ];
        // What each map held before, unless it was made anew (empty).
        let had = |table: usize| had.as_ref().filter(|_| !anew[table]);
        let same_tables =
            (1..anew.len()).all(|t| had(t).is_some_and(|h| Arc::ptr_eq(&h.tables, &want.tables)));
        sync_hash(
            &mut self.clients.map,
            had(0).map(|h| h.clients.entries()),
            want.clients.entries(),
            |v| *v,
        )?;
        if !same_tables {
            sync_hash(
                &mut self.exact.map,
                had(1).map(|h| h.tables.exact()),
                tables.exact(),
                |v| *v,
            )?;
            let had_cidrs = had(2).map(|h| Cidrs(&h.tables));
            sync(
                &mut self.cidrs.map,
                had_cidrs.as_ref(),
                &Cidrs(tables),
                |m, (len, bytes)| m.remove(&Key::new(*len, *bytes)),
                |m, (len, bytes), v| m.insert(&Key::new(*len, *bytes), *v, 0),
            )?;
            sync_hash(
                &mut self.ports.map,
                had(3).map(|h| h.tables.ports()),
                tables.ports(),
                PortEndpoints::kernel,
            )?;
            sync_hash(
                &mut self.workloads.map,
                had(4).map(|h| h.tables.workloads()),
                tables.workloads(),
                |class| *class,
            )?;
        }
        outers.config.set(slot, want.config(), 0)?;
        self.held = Some(want.clone());
        Ok(())
    }

    /// What each of this generation's maps takes in the kernel.
    fn memory(&self) -> [(&'static str, TableMemory); 5] {
        let held = self.held.as_ref().map(sizes).unwrap_or_default();
        let entries = |table| held.get(table).copied().unwrap_or(0);
        [
            (
                "clients",
                self.clients.memory("clients", entries("clients")),
            ),
            ("exact", self.exact.memory("exact", entries("exact"))),
            ("cidrs", self.cidrs.memory("cidrs", entries("cidrs"))),
            ("ports", self.ports.memory("ports", entries("ports"))),
            (
                "workloads",
                self.workloads.memory("workloads", entries("workloads")),
            ),
        ]
    }
}

/// `BPF_F_NO_PREALLOC`: entries allocated as they are written (the programs' templates say the
/// same, and a map put in a slot must match its template's flags).
const NO_PREALLOC: u32 = 1;

fn hash_map<K: Pod, V: Pod>(capacity: u32) -> Result<HashMap<MapData, K, V>, MapError> {
    HashMap::create(capacity, NO_PREALLOC)
}

fn lpm_trie<K: Pod, V: Pod>(capacity: u32) -> Result<LpmTrie<MapData, K, V>, MapError> {
    LpmTrie::create(capacity, NO_PREALLOC)
}

impl<M> Sized<M> {
    fn create(
        capacity: u32,
        create: impl Fn(u32) -> Result<M, MapError>,
    ) -> Result<Self, MapError> {
        Ok(Sized {
            map: create(capacity)?,
            capacity,
        })
    }

    /// Makes a new map when `entries` do not fit this one (or need far less), or when what it
    /// holds is `unknown`, put in the generation's slot by `place`. Whether it did: a new map
    /// starts empty, so the sync that follows writes every entry.
    fn resize(
        &mut self,
        unknown: bool,
        entries: usize,
        create: impl Fn(u32) -> Result<M, MapError>,
        place: impl FnOnce(&M) -> Result<(), MapError>,
    ) -> Result<bool, MapError> {
        if !unknown && !needs_new_map(self.capacity, entries) {
            return Ok(false);
        }
        let capacity = capacity_for(entries);
        let map = create(capacity)?;
        // The generation is idle: no program reads its slot, so the new (empty) map may take it
        // before it is filled.
        place(&map)?;
        self.map = map;
        self.capacity = capacity;
        Ok(true)
    }
}

impl<M: IterableMapData> Sized<M> {
    fn memory(&self, table: &'static str, entries: usize) -> TableMemory {
        TableMemory {
            entries,
            capacity: self.capacity as usize,
            estimated_bytes: kernel_bytes(table, entries, self.capacity as usize),
            kernel_bytes: memlock(self.map.data()),
        }
    }
}

/// A map whose [`MapData`] can be read (for its file descriptor).
trait IterableMapData {
    fn data(&self) -> &MapData;
}

impl<K: Pod, V: Pod> IterableMapData for HashMap<MapData, K, V> {
    fn data(&self) -> &MapData {
        IterableMap::<K, V>::map(self)
    }
}

impl<K: Pod, V: Pod> IterableMapData for LpmTrie<MapData, K, V> {
    fn data(&self) -> &MapData {
        IterableMap::<Key<K>, V>::map(self)
    }
}

/// What the kernel says a map takes (`memlock` in its fdinfo: the memory in use on recent kernels,
/// the most it can take on older ones), if it says.
fn memlock(map: &MapData) -> Option<u64> {
    let fd = map.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    info.lines()
        .find_map(|line| line.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
}

/// One table's entries, as [`sync`] compares them.
trait Entries {
    type Key: Copy;
    type Value: PartialEq;
    fn value(&self, key: &Self::Key) -> Option<&Self::Value>;
    fn each(&self) -> impl Iterator<Item = (Self::Key, &Self::Value)>;
}

impl<K: Eq + Hash + Copy, V: PartialEq> Entries for StdHashMap<K, V> {
    type Key = K;
    type Value = V;
    fn value(&self, key: &K) -> Option<&V> {
        self.get(key)
    }
    fn each(&self) -> impl Iterator<Item = (K, &V)> {
        self.iter().map(|(k, v)| (*k, v))
    }
}

impl<K: Eq + Hash + Copy> Entries for HashSet<K> {
    type Key = K;
    type Value = ();
    fn value(&self, key: &K) -> Option<&()> {
        self.contains(key).then_some(&())
    }
    fn each(&self) -> impl Iterator<Item = (K, &())> {
        self.iter().map(|k| (*k, &()))
    }
}

/// The tables' LPM trie, keyed by (prefix length, masked key bytes).
struct Cidrs<'t>(&'t Tables);

impl Entries for Cidrs<'_> {
    type Key = (u32, LpmBytes);
    type Value = Claim;
    fn value(&self, (len, bytes): &(u32, LpmBytes)) -> Option<&Claim> {
        self.0.cidr(*len, bytes)
    }
    fn each(&self) -> impl Iterator<Item = ((u32, LpmBytes), &Claim)> {
        self.0
            .cidrs()
            .map(|(len, bytes, claim)| ((len, *bytes), claim))
    }
}

/// Makes a map that holds `had` (`None`: nothing) equal to `want`: removes what is gone, then
/// writes what is new or changed (removals first, so a full map makes room).
fn sync<M, T: Entries>(
    map: &mut M,
    had: Option<&T>,
    want: &T,
    remove: impl Fn(&mut M, &T::Key) -> Result<(), MapError>,
    insert: impl Fn(&mut M, &T::Key, &T::Value) -> Result<(), MapError>,
) -> Result<(), MapError> {
    if let Some(had) = had {
        for (k, _) in had.each() {
            if want.value(&k).is_none() {
                match remove(map, &k) {
                    Ok(()) | Err(MapError::KeyNotFound) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    for (k, v) in want.each() {
        if had.and_then(|h| h.value(&k)) != Some(v) {
            insert(map, &k, v)?;
        }
    }
    Ok(())
}

/// [`sync`] for an aya hash map, whose keys are the table's own; `kernel` makes the value it holds.
fn sync_hash<K: Pod + Eq + Hash, V: PartialEq, W: Pod>(
    map: &mut HashMap<MapData, K, W>,
    had: Option<&StdHashMap<K, V>>,
    want: &StdHashMap<K, V>,
    kernel: impl Fn(&V) -> W,
) -> Result<(), MapError> {
    sync(
        map,
        had,
        want,
        |m, k| m.remove(k),
        |m, k, v| m.insert(k, kernel(v), 0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map standing in for a BPF map: what `sync` wrote, and every write it made.
    #[derive(Default)]
    struct Recorded {
        map: StdHashMap<u32, u32>,
        writes: Vec<String>,
    }

    fn apply(rec: &mut Recorded, had: Option<&StdHashMap<u32, u32>>, want: &StdHashMap<u32, u32>) {
        sync(
            rec,
            had,
            want,
            |r, k| {
                r.writes.push(format!("-{k}"));
                r.map.remove(k).map(drop).ok_or(MapError::KeyNotFound)
            },
            |r, k, v| {
                r.writes.push(format!("+{k}={v}"));
                r.map.insert(*k, *v);
                Ok(())
            },
        )
        .unwrap();
    }

    #[test]
    fn a_generation_gets_only_what_differs_and_ends_equal_to_the_tables() {
        let mut rec = Recorded::default();
        let first = StdHashMap::from([(1, 10), (2, 20), (3, 30)]);
        apply(&mut rec, None, &first);
        assert_eq!(rec.map, first);
        assert_eq!(rec.writes.len(), 3);

        rec.writes.clear();
        let second = StdHashMap::from([(1, 10), (2, 21), (4, 40)]);
        apply(&mut rec, Some(&first), &second);
        assert_eq!(rec.map, second);
        rec.writes.sort();
        // Key 1 is unchanged: not written. Removals come first (room in a full map).
        assert_eq!(rec.writes, ["+2=21", "+4=40", "-3"]);
    }
}
