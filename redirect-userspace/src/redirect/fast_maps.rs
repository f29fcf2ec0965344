//! The fast path's maps: two generations of tables and the selector saying which one is in force.
//!
//! An update never touches the generation in force: the idle one is brought to the new tables
//! (only the entries that differ are written), then the selector flips in one map write. A
//! connection reads the selector once and then one generation, so it sees the old tables or the
//! new ones, never half of each. The tables are not pinned: a successor fills its own before its
//! programs are swapped in (`RedirectConfig::fast_tables`). The counters are: they go on across
//! hand-overs.
use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    hash::Hash,
    sync::Arc,
    time::{Duration, Instant},
};

use aya::{
    Ebpf, Pod,
    maps::{Array, HashMap, LpmTrie, MapData, MapError, PerCpuArray, RingBuf, lpm_trie::Key},
};
use redirect_common::{
    FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED, FastStat,
    fastpath::{
        AddrKey, Backends, Claim, Config, GEN_A, GEN_B, HiddenEvent, IpKey, LpmBytes, PortKey,
    },
    maps,
};

use super::{RedirectError, per_cpu_totals, take_map};
use crate::fastpath::{PortEndpoints, Tables};

/// A generation just left is not rewritten before this: a program that read the selector just
/// before the flip finishes its few lookups long before.
const QUIET_AFTER_FLIP: Duration = Duration::from_millis(20);

/// One generation's maps and what they hold.
struct Generation {
    clients: HashMap<MapData, u64, u32>,
    exact: HashMap<MapData, AddrKey, Claim>,
    cidrs: LpmTrie<MapData, LpmBytes, Claim>,
    ports: HashMap<MapData, PortKey, Backends>,
    workloads: HashMap<MapData, IpKey, u8>,
    config: Array<MapData, Config>,
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
}

/// The fast path's maps, owned by the agent that loaded them.
pub struct FastMaps {
    selector: Array<MapData, u32>,
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
        let mut generation = |i: usize| -> Result<Generation, RedirectError> {
            Ok(Generation {
                clients: take_map(ebpf, maps::FAST_CLIENTS[i], HashMap::try_from)?,
                exact: take_map(ebpf, maps::FAST_EXACT[i], HashMap::try_from)?,
                cidrs: take_map(ebpf, maps::FAST_CIDRS[i], LpmTrie::try_from)?,
                ports: take_map(ebpf, maps::FAST_PORTS[i], HashMap::try_from)?,
                workloads: take_map(ebpf, maps::FAST_WORKLOADS[i], HashMap::try_from)?,
                config: take_map(ebpf, maps::FAST_CONFIG[i], Array::try_from)?,
                held: Arc::default(),
            })
        };
        let generations = [generation(0)?, generation(1)?];
        Ok(FastMaps {
            selector: take_map(ebpf, maps::FAST_GENERATION, Array::try_from)?,
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
        self.generations[idle].write(tables)?;
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
        idle.sync(live.held.wanted())?;
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
    /// Brings this (idle) generation to `want`, writing only what differs. `held` follows every
    /// successful write, so after an error the next call finishes the job.
    fn write(&mut self, want: &Tables) -> Result<(), MapError> {
        let cidrs = want
            .cidrs()
            .map(|(len, bytes, claim)| ((len, *bytes), *claim))
            .collect();
        let workloads = want.workloads().iter().map(|ip| (*ip, 1)).collect();
        self.sync(Want {
            clients: want.clients(),
            exact: want.exact(),
            cidrs: &cidrs,
            ports: want.ports(),
            workloads: &workloads,
            config: want.config(),
        })
    }

    fn sync(&mut self, want: Want<'_>) -> Result<(), MapError> {
        let held = Arc::make_mut(&mut self.held);
        sync_hash(&mut self.clients, &mut held.clients, want.clients, |v| *v)?;
        sync_hash(&mut self.exact, &mut held.exact, want.exact, |v| *v)?;
        sync(
            &mut self.cidrs,
            &mut held.cidrs,
            want.cidrs,
            |m, (len, bytes)| m.remove(&Key::new(*len, *bytes)),
            |m, (len, bytes), v| m.insert(&Key::new(*len, *bytes), *v, 0),
        )?;
        sync_hash(
            &mut self.ports,
            &mut held.ports,
            want.ports,
            PortEndpoints::kernel,
        )?;
        sync_hash(
            &mut self.workloads,
            &mut held.workloads,
            want.workloads,
            |v| *v,
        )?;
        self.config.set(0, want.config, 0)?;
        held.config = want.config;
        Ok(())
    }
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
