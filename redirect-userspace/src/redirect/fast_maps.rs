//! The fast path's maps: two generations of tables and the selector saying which one is in force.
//!
//! Each table is an array of two maps in the kernel, one slot per generation. The agent creates
//! the maps itself, at the size the tables need: a generation whose tables outgrew its maps (or
//! hold far less than they could) gets new maps of the right size, filled before they are put in
//! its slot. An update never touches the generation in force: the idle one is brought to the new
//! tables (only the entries that differ are written, or every entry into new maps), then the
//! selector flips in one map write. A connection reads the selector once and then one generation,
//! so it sees the old tables or the new ones, never half of each. The tables are not pinned: a
//! successor fills its own before its programs are swapped in (`RedirectConfig::fast_tables`).
//! The counters are: they go on across hand-overs.
use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
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

use super::{RedirectError, per_cpu_totals, take_map};
use crate::fastpath::{PortEndpoints, TableMemory, Tables, kernel_bytes};

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
    /// Shared with the other generation while both hold the same (after [`FastMaps::catch_up`]):
    /// one copy, not two, of what the maps hold at rest.
    held: Arc<Held>,
}

/// What one generation's maps hold, entry for entry, as last written.
#[derive(Clone, Default)]
struct Held {
    clients: StdHashMap<u64, u32>,
    exact: StdHashMap<AddrKey, Claim>,
    cidrs: StdHashMap<(u32, LpmBytes), Claim>,
    /// Shared with the tables written (the endpoints in use, not the kernel's 16 slots).
    ports: StdHashMap<PortKey, PortEndpoints>,
    workloads: StdHashMap<IpKey, u8>,
    config: Config,
}

/// What a generation is to hold: the tables to install, or the other generation's content.
struct Want<'a> {
    clients: &'a StdHashMap<u64, u32>,
    exact: &'a StdHashMap<AddrKey, Claim>,
    cidrs: &'a StdHashMap<(u32, LpmBytes), Claim>,
    ports: &'a StdHashMap<PortKey, PortEndpoints>,
    workloads: &'a StdHashMap<IpKey, u8>,
    config: Config,
}

impl Held {
    fn sizes(&self) -> BTreeMap<&'static str, usize> {
        BTreeMap::from([
            ("clients", self.clients.len()),
            ("exact", self.exact.len()),
            ("cidrs", self.cidrs.len()),
            ("ports", self.ports.len()),
            ("workloads", self.workloads.len()),
        ])
    }

    fn wanted(&self) -> Want<'_> {
        Want {
            clients: &self.clients,
            exact: &self.exact,
            cidrs: &self.cidrs,
            ports: &self.ports,
            workloads: &self.workloads,
            config: self.config,
        }
    }
}

/// The fast path's maps, owned by the agent that loaded them.
pub struct FastMaps {
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
}

/// The programs' fast-path counters: read without the maps' lock, which an update holds for as
/// long as it writes (a scrape or the hides' reader never waits for one).
pub struct FastStats(PerCpuArray<MapData, u64>);

impl FastStats {
    /// Totals of the programs' per-CPU fast-path counters.
    pub fn counts(&self) -> Vec<(FastStat, u64)> {
        per_cpu_totals(&self.0, &FastStat::ALL, |stat| stat as u32)
    }

    /// Connections the kernel decided past a hidden service, and the hides it could not report.
    pub fn hidden_counts(&self) -> (u64, u64) {
        let totals = per_cpu_totals(
            &self.0,
            &[FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED],
            |slot| slot,
        );
        (totals[0].1, totals[1].1)
    }
}

/// The kernel's reports of the hides it decided past (`FAST_HIDDEN_EVENTS`).
pub struct HiddenEvents(RingBuf<MapData>);

impl HiddenEvents {
    /// Every event waiting, oldest first.
    pub fn drain(&mut self) -> Vec<HiddenEvent> {
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
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<FastMaps, RedirectError> {
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
        })
    }

    /// Puts `tables` in force, whole. On an error the generation in force stays as it was.
    pub fn install(&mut self, tables: &Tables) -> Result<(), MapError> {
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
    pub fn sizes_in_force(&self) -> Option<BTreeMap<&'static str, usize>> {
        self.in_force.map(|i| self.generations[i].held.sizes())
    }

    /// What each table's maps take in the kernel, both generations together.
    pub fn memory(&self) -> BTreeMap<&'static str, TableMemory> {
        let mut out: BTreeMap<&'static str, TableMemory> = BTreeMap::new();
        for generation in &self.generations {
            for (name, memory) in generation.memory() {
                out.entry(name).or_default().add(&memory);
            }
        }
        out
    }

    /// The programs' counters, to read without this lock.
    pub fn stats(&self) -> Arc<FastStats> {
        self.stats.clone()
    }

    /// Brings the idle generation to what the one in force holds, once [`QUIET_AFTER_FLIP`] has
    /// passed since the flip (`false`: too soon, call again later). Otherwise the next update
    /// writes both its own change and the one before it: after the first tables (the idle
    /// generation empty) that is every entry, at 10,000 entries some 100 ms on the way to one
    /// pod's change. Done off the update's path, it takes that time when nothing waits for it.
    pub fn catch_up(&mut self) -> Result<bool, MapError> {
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
        idle.sync(&mut self.outers, live.held.wanted())?;
        idle.held = live.held.clone();
        self.idle_caught_up = true;
        Ok(true)
    }

    /// The hide reports, once (their reader owns them).
    pub fn take_events(&mut self) -> Option<HiddenEvents> {
        self.events.take().map(HiddenEvents)
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
            held: Arc::default(),
        };
        outers.clients.set(slot, &generation.clients.map, 0)?;
        outers.exact.set(slot, &generation.exact.map, 0)?;
        outers.cidrs.set(slot, &generation.cidrs.map, 0)?;
        outers.ports.set(slot, &generation.ports.map, 0)?;
        outers.workloads.set(slot, &generation.workloads.map, 0)?;
        outers.config.set(slot, Config::default(), 0)?;
        Ok(generation)
    }

    /// Brings this (idle) generation to `want`, writing only what differs. `held` follows every
    /// successful write, so after an error the next call finishes the job.
    fn write(&mut self, outers: &mut Outers, want: &Tables) -> Result<(), MapError> {
        let cidrs = want
            .cidrs()
            .map(|(len, bytes, claim)| ((len, *bytes), *claim))
            .collect();
        let workloads = want.workloads().iter().map(|ip| (*ip, 1)).collect();
        self.sync(
            outers,
            Want {
                clients: want.clients(),
                exact: want.exact(),
                cidrs: &cidrs,
                ports: want.ports(),
                workloads: &workloads,
                config: want.config(),
            },
        )
    }

    fn sync(&mut self, outers: &mut Outers, want: Want<'_>) -> Result<(), MapError> {
        let slot = self.slot;
        let held = Arc::make_mut(&mut self.held);
        self.clients
            .resize(&mut held.clients, want.clients.len(), hash_map, |m| {
                outers.clients.set(slot, m, 0)
            })?;
        self.exact
            .resize(&mut held.exact, want.exact.len(), hash_map, |m| {
                outers.exact.set(slot, m, 0)
            })?;
        self.cidrs
            .resize(&mut held.cidrs, want.cidrs.len(), lpm_trie, |m| {
                outers.cidrs.set(slot, m, 0)
            })?;
        self.ports
            .resize(&mut held.ports, want.ports.len(), hash_map, |m| {
                outers.ports.set(slot, m, 0)
            })?;
        self.workloads
            .resize(&mut held.workloads, want.workloads.len(), hash_map, |m| {
                outers.workloads.set(slot, m, 0)
            })?;
        sync_hash(
            &mut self.clients.map,
            &mut held.clients,
            want.clients,
            |v| *v,
        )?;
        sync_hash(&mut self.exact.map, &mut held.exact, want.exact, |v| *v)?;
        sync(
            &mut self.cidrs.map,
            &mut held.cidrs,
            want.cidrs,
            |m, (len, bytes)| m.remove(&Key::new(*len, *bytes)),
            |m, (len, bytes), v| m.insert(&Key::new(*len, *bytes), *v, 0),
        )?;
        sync_hash(
            &mut self.ports.map,
            &mut held.ports,
            want.ports,
            PortEndpoints::kernel,
        )?;
        sync_hash(
            &mut self.workloads.map,
            &mut held.workloads,
            want.workloads,
            |v| *v,
        )?;
        outers.config.set(slot, want.config, 0)?;
        held.config = want.config;
        Ok(())
    }

    /// What each of this generation's maps takes in the kernel.
    fn memory(&self) -> [(&'static str, TableMemory); 5] {
        let held = &self.held;
        [
            (
                "clients",
                self.clients.memory("clients", held.clients.len()),
            ),
            ("exact", self.exact.memory("exact", held.exact.len())),
            ("cidrs", self.cidrs.memory("cidrs", held.cidrs.len())),
            ("ports", self.ports.memory("ports", held.ports.len())),
            (
                "workloads",
                self.workloads.memory("workloads", held.workloads.len()),
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

    /// Makes a new map when `entries` do not fit this one (or need far less), put in the
    /// generation's slot by `place`. It starts empty: `held` is cleared, so the sync that follows
    /// writes every entry.
    fn resize<K, V>(
        &mut self,
        held: &mut StdHashMap<K, V>,
        entries: usize,
        create: impl Fn(u32) -> Result<M, MapError>,
        place: impl FnOnce(&M) -> Result<(), MapError>,
    ) -> Result<(), MapError> {
        if !needs_new_map(self.capacity, entries) {
            return Ok(());
        }
        let capacity = capacity_for(entries);
        let map = create(capacity)?;
        // The generation is idle: no program reads its slot, so the new (empty) map may take it
        // before it is filled.
        place(&map)?;
        self.map = map;
        self.capacity = capacity;
        held.clear();
        Ok(())
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

/// Makes a map equal to `want`, knowing it holds `held`: removes what is gone, then writes what is
/// new or changed (removals first, so a full map makes room).
fn sync<M, K: Eq + Hash + Copy, V: Clone + PartialEq>(
    map: &mut M,
    held: &mut StdHashMap<K, V>,
    want: &StdHashMap<K, V>,
    remove: impl Fn(&mut M, &K) -> Result<(), MapError>,
    insert: impl Fn(&mut M, &K, &V) -> Result<(), MapError>,
) -> Result<(), MapError> {
    let gone: Vec<K> = held
        .keys()
        .filter(|k| !want.contains_key(k))
        .copied()
        .collect();
    for k in gone {
        match remove(map, &k) {
            Ok(()) | Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(e),
        }
        held.remove(&k);
    }
    for (k, v) in want {
        if held.get(k) != Some(v) {
            insert(map, k, v)?;
            held.insert(*k, v.clone());
        }
    }
    Ok(())
}

/// [`sync`] for an aya hash map, whose keys are the table's own; `kernel` makes the value it holds.
fn sync_hash<K: Pod + Eq + Hash, V: Clone + PartialEq, W: Pod>(
    map: &mut HashMap<MapData, K, W>,
    held: &mut StdHashMap<K, V>,
    want: &StdHashMap<K, V>,
    kernel: impl Fn(&V) -> W,
) -> Result<(), MapError> {
    sync(
        map,
        held,
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

    fn apply(rec: &mut Recorded, held: &mut StdHashMap<u32, u32>, want: &StdHashMap<u32, u32>) {
        sync(
            rec,
            held,
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
        let mut held = StdHashMap::new();
        let first = StdHashMap::from([(1, 10), (2, 20), (3, 30)]);
        apply(&mut rec, &mut held, &first);
        assert_eq!(rec.map, first);
        assert_eq!(rec.writes.len(), 3);

        rec.writes.clear();
        let second = StdHashMap::from([(1, 10), (2, 21), (4, 40)]);
        apply(&mut rec, &mut held, &second);
        assert_eq!(rec.map, second);
        assert_eq!(held, second);
        rec.writes.sort();
        // Key 1 is unchanged: not written. Removals come first (room in a full map).
        assert_eq!(rec.writes, ["+2=21", "+4=40", "-3"]);
    }
}
