//! Inbound authorization in the kernel (`docs/authorization.md#kernel`): the `inbound` program
//! (sk_lookup) attached in each guarded Pod's network namespace, the table it reads, and the
//! agent's own dials it lets through.
//!
//! [`InboundGate`] keeps the links (one per Pod, made through `/proc/PID/ns/net` of a process of
//! the Pod's cgroup) and puts each new table in force: a new map, filled, then put in the one
//! slot of `INBOUND_TABLE` in a single write, so a connection sees one table or the next, never
//! half of each. The links die with the agent (a successor attaches its own before its
//! predecessor leaves; for that moment both decide, alike). [`AgentDials`] is pinned with the
//! other shared maps, so a predecessor's programs let a successor's dials through too.
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    fs::File,
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::{Arc, Mutex, RwLock},
};

use aya::{
    Ebpf,
    maps::{ArrayOfMaps, HashMap, LpmTrie, MapData, MapError, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{SkLookup, sk_lookup::SkLookupLinkId},
};
use redirect_common::{
    FlowEnds, SockAddr,
    fastpath::IpKey,
    inbound::{
        INBOUND_AGENT_PASSED, INBOUND_COUNT_SLOTS, INBOUND_EVENTS_LOST, InboundBytes, InboundEvent,
        InboundVerdict,
    },
    maps, programs,
};
use uuid::Uuid;

use super::{RedirectError, per_cpu_totals, take_map};
use crate::lock::Locked;

/// `BPF_F_NO_PREALLOC`, as the program's template of the table says (an LPM trie requires it).
const NO_PREALLOC: u32 = 1;

type Table = LpmTrie<MapData, InboundBytes, InboundVerdict>;

/// The program, its table's slot, and the Pods it is attached for.
pub(crate) struct InboundGate {
    ebpf: Arc<Mutex<Ebpf>>,
    slot: ArrayOfMaps<MapData, Table>,
    /// The map in force (the slot holds it too).
    in_force: Option<Table>,
    /// Each Pod's link and the addresses it was attached for.
    links: StdHashMap<Uuid, (SkLookupLinkId, Vec<IpAddr>)>,
    /// Those addresses, for the fast path (`INBOUND_ATTACHED`).
    attached: HashMap<MapData, IpKey, u8>,
}

/// The kernel's counters of its inbound decisions.
pub(crate) struct InboundCounts(PerCpuArray<MapData, u64>);

/// The kernel's reports of its refusals.
pub(crate) struct InboundEvents(RingBuf<MapData>);

/// What [`load`] gives.
pub(crate) struct Loaded {
    pub gate: InboundGate,
    pub counts: InboundCounts,
    pub events: InboundEvents,
    pub dials: Arc<AgentDials>,
}

/// Loads `inbound` and takes its maps. Nothing is attached yet: [`InboundGate::attach`] does, Pod
/// by Pod.
pub(super) fn load(ebpf: &Arc<Mutex<Ebpf>>) -> Result<Loaded, RedirectError> {
    let name = programs::INBOUND;
    let mut object = ebpf.locked();
    let program: &mut SkLookup = object
        .program_mut(name)
        .ok_or(RedirectError::MissingProgram { name })?
        .try_into()
        .map_err(|source| RedirectError::Program { name, source })?;
    program
        .load()
        .map_err(|source| RedirectError::Program { name, source })?;
    let slot = take_map(&mut object, maps::INBOUND_TABLE, ArrayOfMaps::try_from)?;
    let counts = take_map(&mut object, maps::INBOUND_COUNTS, PerCpuArray::try_from)?;
    let events = take_map(&mut object, maps::INBOUND_EVENTS, RingBuf::try_from)?;
    let dials = take_map(&mut object, maps::AGENT_DIALS, HashMap::try_from)?;
    let attached = take_map(&mut object, maps::INBOUND_ATTACHED, HashMap::try_from)?;
    drop(object);
    let gate = InboundGate {
        ebpf: ebpf.clone(),
        slot,
        in_force: None,
        links: StdHashMap::new(),
        attached,
    };
    let dials = Arc::new(AgentDials {
        map: Mutex::new(dials),
        guarded: RwLock::new(Arc::new(HashSet::new())),
    });
    Ok(Loaded {
        gate,
        counts: InboundCounts(counts),
        events: InboundEvents(events),
        dials,
    })
}

impl InboundGate {
    /// Puts `entries` (trie key, prefix length, verdict) in force as one table.
    pub(crate) fn install<'a>(
        &mut self,
        entries: impl ExactSizeIterator<Item = (&'a InboundBytes, u32, &'a InboundVerdict)>,
    ) -> Result<(), MapError> {
        let len = entries.len();
        let capacity = u32::try_from(len.max(1)).unwrap_or(u32::MAX);
        let mut table: Table = LpmTrie::create(capacity, NO_PREALLOC)?;
        for (bytes, prefix, verdict) in entries {
            table.insert(&Key::new(prefix, *bytes), *verdict, 0)?;
        }
        self.slot.set(0, &table, 0)?;
        self.in_force = Some(table);
        Ok(())
    }

    /// Whether the program runs in the namespace of the Pod `uid`.
    pub(crate) fn attached(&self, uid: &Uuid) -> bool {
        self.links.contains_key(uid)
    }

    /// Attaches the program in the network namespace at `netns` (`/proc/PID/ns/net` of a process
    /// of the Pod `uid`), then tells the fast path it may leave connections to `ips` alone.
    pub(crate) fn attach(&mut self, uid: Uuid, netns: &Path, ips: &[IpAddr]) -> Result<(), String> {
        let file = File::open(netns).map_err(|e| format!("{}: {e}", netns.display()))?;
        let mut object = self.ebpf.locked();
        let program = program(&mut object)?;
        let link = program
            .attach(&file)
            .map_err(|e| format!("attaching in {}: {e}", netns.display()))?;
        drop(object);
        for ip in ips {
            if let Err(e) = self.attached.insert(IpKey::new(*ip), 1, 0) {
                // The fast path keeps sending this address's connections to the proxy.
                tracing::warn!(%ip, error = %e, "marking a guarded Pod's address as decided in the kernel failed");
            }
        }
        self.links.insert(uid, (link, ips.to_vec()));
        Ok(())
    }

    /// Detaches the program from the namespaces of the Pods not in `keep`: gone from the node, or
    /// no longer guarded.
    pub(crate) fn detach_others(&mut self, keep: &HashSet<Uuid>) -> usize {
        let gone: Vec<Uuid> = (self.links.keys())
            .filter(|uid| !keep.contains(uid))
            .copied()
            .collect();
        if gone.is_empty() {
            return 0;
        }
        let mut object = self.ebpf.locked();
        let Ok(program) = program(&mut object) else {
            return 0;
        };
        for uid in &gone {
            let Some((link, ips)) = self.links.remove(uid) else {
                continue;
            };
            // The fast path first: a connection to a Pod no longer decided here goes to the proxy.
            for ip in ips {
                let _ = self.attached.remove(&IpKey::new(ip));
            }
            if let Err(e) = program.detach(link) {
                // Mostly gone with its namespace already.
                tracing::debug!(pod = %uid, error = %e, "detaching inbound from a Pod's namespace");
            }
        }
        gone.len()
    }
}

fn program(object: &mut Ebpf) -> Result<&mut SkLookup, String> {
    let name = programs::INBOUND;
    object
        .program_mut(name)
        .ok_or_else(|| format!("program {name} missing"))?
        .try_into()
        .map_err(|e| format!("program {name}: {e}"))
}

impl InboundCounts {
    /// Refused and admitted by each rule (index), then the agent's own dials let through and the
    /// refusals not reported.
    pub(crate) fn read(&self) -> InboundTotals {
        let slots: Vec<u32> = (0..INBOUND_COUNT_SLOTS).collect();
        let totals = per_cpu_totals(&self.0, &slots, |slot| slot);
        let value = |slot: u32| totals.get(slot as usize).map_or(0, |(_, n)| *n);
        let rules = (0..INBOUND_AGENT_PASSED / 2)
            .map(|rule| (value(2 * rule), value(2 * rule + 1)))
            .collect();
        InboundTotals {
            rules,
            agent_passed: value(INBOUND_AGENT_PASSED),
            events_lost: value(INBOUND_EVENTS_LOST),
        }
    }
}

/// What [`InboundCounts::read`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct InboundTotals {
    /// (refused, admitted) by rule index.
    pub rules: Vec<(u64, u64)>,
    pub agent_passed: u64,
    pub events_lost: u64,
}

impl InboundEvents {
    /// Every refusal waiting, oldest first.
    pub(crate) fn drain(&mut self) -> Vec<InboundEvent> {
        let mut out = Vec::new();
        while let Some(item) = self.0.next() {
            if item.len() >= std::mem::size_of::<InboundEvent>() {
                // SAFETY: the program writes whole `InboundEvent`s (plain integers and bytes, any
                // bit pattern valid); the item may be unaligned.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<InboundEvent>()) });
            }
        }
        out
    }
}

/// The agent's own connections to guarded Pods, filed just before each SYN leaves so that the
/// kernel lets through what the agent decided already (HBONE received, the proxy's).
#[derive(Debug)]
pub(crate) struct AgentDials {
    map: Mutex<HashMap<MapData, FlowEnds, u8>>,
    /// The addresses the kernel guards: dials elsewhere need no filing.
    guarded: RwLock<Arc<HashSet<IpAddr>>>,
}

impl AgentDials {
    /// Whether a dial to `dst` must be filed.
    pub(crate) fn covers(&self, dst: IpAddr) -> bool {
        let guarded = match self.guarded.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        guarded.contains(&dst.to_canonical())
    }

    /// The addresses the table in force guards.
    pub(crate) fn set_guarded(&self, ips: HashSet<IpAddr>) {
        let ips = Arc::new(ips);
        match self.guarded.write() {
            Ok(mut g) => *g = ips,
            Err(poisoned) => *poisoned.into_inner() = ips,
        }
    }

    /// Files the connection from the agent's `agent` to the Pod's `pod`.
    pub(crate) fn file(&self, pod: SocketAddr, agent: SocketAddr) -> Result<(), MapError> {
        let mut map = self.map.locked();
        map.insert(ends(pod, agent), 1, 0)
    }

    /// Removes the filing once the connection is made or failed (the kernel removes it when it
    /// lets the SYN through; a filing it never saw must not wait for the LRU).
    pub(crate) fn forget(&self, pod: SocketAddr, agent: SocketAddr) {
        let mut map = self.map.locked();
        let _ = map.remove(&ends(pod, agent));
    }
}

fn ends(pod: SocketAddr, agent: SocketAddr) -> FlowEnds {
    FlowEnds {
        local: SockAddr::from_socket_addr(pod),
        remote: SockAddr::from_socket_addr(agent),
    }
}
