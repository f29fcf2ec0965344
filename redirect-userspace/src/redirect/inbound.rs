//! Inbound authorization in the kernel (`docs/authorization.md#in-the-kernel`): the `inbound` program
//! (sk_lookup) attached in each guarded Pod's network namespace, the table it reads, and
//! `node_origin` (tc egress on the node's veths), which files the node's own connections to Pods
//! for `inbound` to admit.
//!
//! [`InboundGate`] keeps the links (one per Pod, made through `/proc/PID/ns/net` of a process of
//! the Pod's cgroup) and puts each new table in force: a new map, filled, then put in the one
//! slot of `INBOUND_TABLE` in a single write, so a connection sees one table or the next, never
//! half of each. The links die with the agent (a successor attaches its own before its
//! predecessor leaves; for that moment both decide, alike). `NODE_DIALS` is pinned with the other
//! shared maps, so a predecessor's `inbound` admits what a successor's `node_origin` filed.
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    fs::File,
    net::IpAddr,
    path::Path,
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf,
    maps::{ArrayOfMaps, HashMap, LpmTrie, MapData, MapError, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{SchedClassifier, SkLookup, TcAttachType, sk_lookup::SkLookupLinkId},
};
use redirect_common::{
    fastpath::IpKey,
    inbound::{
        INBOUND_COUNT_SLOTS, INBOUND_EVENTS_LOST, INBOUND_NODE_PASSED, InboundBytes, InboundEvent,
        InboundVerdict,
    },
    maps, programs,
};
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use uuid::Uuid;

use super::{RedirectError, attach::program, per_cpu_totals, take_map, tc_links::TcOnLinks};
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
    pub origin: OriginMarker,
}

/// Loads `inbound` and takes its maps. Nothing is attached yet: [`InboundGate::attach`] does, Pod
/// by Pod.
pub(super) fn load(ebpf: &Arc<Mutex<Ebpf>>) -> Result<Loaded, RedirectError> {
    let mut object = ebpf.locked();
    let name = programs::INBOUND;
    (program::<SkLookup>(&mut object, name)?.load())
        .map_err(|source| RedirectError::Program { name, source })?;
    let name = programs::NODE_ORIGIN;
    (program::<SchedClassifier>(&mut object, name)?.load())
        .map_err(|source| RedirectError::Program { name, source })?;
    let slot = take_map(&mut object, maps::INBOUND_TABLE, ArrayOfMaps::try_from)?;
    let counts = take_map(&mut object, maps::INBOUND_COUNTS, PerCpuArray::try_from)?;
    let events = take_map(&mut object, maps::INBOUND_EVENTS, RingBuf::try_from)?;
    let attached = take_map(&mut object, maps::INBOUND_ATTACHED, HashMap::try_from)?;
    drop(object);
    let gate = InboundGate {
        ebpf: ebpf.clone(),
        slot,
        in_force: None,
        links: StdHashMap::new(),
        attached,
    };
    let origin = TcOnLinks::new(ebpf, programs::NODE_ORIGIN, TcAttachType::Egress, is_veth)?;
    Ok(Loaded {
        gate,
        counts: InboundCounts(counts),
        events: InboundEvents(events),
        origin,
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
        let program = inbound(&mut object)?;
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
        let Ok(program) = inbound(&mut object) else {
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

/// The loaded `inbound` program.
fn inbound(object: &mut Ebpf) -> Result<&mut SkLookup, String> {
    program(object, programs::INBOUND).map_err(|e| e.to_string())
}

impl InboundCounts {
    /// Refused and admitted by each rule (index), then the node's own connections let through and
    /// the refusals not reported.
    pub(crate) fn read(&self) -> InboundTotals {
        let slots: Vec<u32> = (0..INBOUND_COUNT_SLOTS).collect();
        let totals = per_cpu_totals(&self.0, &slots, |slot| slot);
        let value = |slot: u32| totals.get(slot as usize).map_or(0, |(_, n)| *n);
        let rules = (0..INBOUND_NODE_PASSED / 2)
            .map(|rule| (value(2 * rule), value(2 * rule + 1)))
            .collect();
        InboundTotals {
            rules,
            node_passed: value(INBOUND_NODE_PASSED),
            events_lost: value(INBOUND_EVENTS_LOST),
        }
    }
}

/// What [`InboundCounts::read`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct InboundTotals {
    /// (refused, admitted) by rule index.
    pub rules: Vec<(u64, u64)>,
    pub node_passed: u64,
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

/// `node_origin`, kept on every veth of the node (each Pod's link has its node end here).
pub(crate) type OriginMarker = TcOnLinks;

/// A veth.
fn is_veth(link: &LinkMessage) -> bool {
    link.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => {
            (infos.iter()).any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)))
        }
        _ => false,
    })
}
