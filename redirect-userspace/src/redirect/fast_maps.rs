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
    held: Held,
}

/// What one generation's maps hold, entry for entry, as last written.
#[derive(Default)]
struct Held {
    clients: StdHashMap<u64, u32>,
    exact: StdHashMap<AddrKey, Claim>,
    cidrs: StdHashMap<(u32, LpmBytes), Claim>,
    /// Shared with the tables written (the endpoints in use, not the kernel's 16 slots).
    ports: StdHashMap<PortKey, PortEndpoints>,
    workloads: StdHashMap<IpKey, u8>,
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
    stats: PerCpuArray<MapData, u64>,
    /// Until the agent's reader takes it.
    events: Option<RingBuf<MapData>>,
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
                held: Held::default(),
            })
        };
        let generations = [generation(0)?, generation(1)?];
        Ok(FastMaps {
            selector: take_map(ebpf, maps::FAST_GENERATION, Array::try_from)?,
            generations,
            in_force: None,
            flipped_at: None,
            stats: take_map(ebpf, maps::FAST_STATS, PerCpuArray::try_from)?,
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
        Ok(())
    }

    /// Entries of each table in force, if any are.
    pub fn sizes_in_force(&self) -> Option<BTreeMap<&'static str, usize>> {
        self.in_force.map(|i| self.generations[i].held.sizes())
    }

    /// Totals of the programs' per-CPU fast-path counters.
    pub fn counts(&self) -> Vec<(FastStat, u64)> {
        per_cpu_totals(&self.stats, &FastStat::ALL, |stat| stat as u32)
    }

    /// Connections the kernel decided past a hidden service, and the hides it could not report.
    pub fn hidden_counts(&self) -> (u64, u64) {
        let totals = per_cpu_totals(
            &self.stats,
            &[FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED],
            |slot| slot,
        );
        (totals[0].1, totals[1].1)
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
        let held = &mut self.held;
        sync_hash(&mut self.clients, &mut held.clients, want.clients(), |v| *v)?;
        sync_hash(&mut self.exact, &mut held.exact, want.exact(), |v| *v)?;
        let cidrs = want
            .cidrs()
            .map(|(len, bytes, claim)| ((len, *bytes), *claim))
            .collect();
        sync(
            &mut self.cidrs,
            &mut held.cidrs,
            &cidrs,
            |m, (len, bytes)| m.remove(&Key::new(*len, *bytes)),
            |m, (len, bytes), v| m.insert(&Key::new(*len, *bytes), *v, 0),
        )?;
        sync_hash(
            &mut self.ports,
            &mut held.ports,
            want.ports(),
            PortEndpoints::kernel,
        )?;
        let workloads = want.workloads().iter().map(|ip| (*ip, 1)).collect();
        sync_hash(&mut self.workloads, &mut held.workloads, &workloads, |v| *v)?;
        self.config.set(0, want.config(), 0)?;
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
