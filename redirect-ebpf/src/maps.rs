//! Maps and load-time globals shared by the programs. Names and layouts come from `redirect-common`.
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{ArrayOfMaps, HashMap as BtfHashMap, LpmTrie as BtfLpmTrie, SkStorage},
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
};
use redirect_common::{
    FAST_STAT_SLOTS, FLOW_MAP_ENTRIES, FastStat, FlowEnds, HBONE_SOURCES_ENTRIES,
    OPTED_OUT_MAP_ENTRIES, OrigDst, SockAddr, Stat,
    fastpath::{
        AUDITED_ENTRIES, AddrKey, Backends, Claim, Config, HIDDEN_EVENTS_BYTES,
        INBOUND_ATTACHED_ENTRIES, IpKey, LpmBytes, PortKey,
    },
    inbound::{
        INBOUND_COUNT_SLOTS, INBOUND_EVENTS_BYTES, InboundBytes, InboundVerdict, NODE_DIALS_ENTRIES,
    },
    records::{RECORDS_ARMED_SLOTS, RECORDS_BYTES},
};

/// Where the application meant to go, kept in the socket itself (socket local storage): it lives
/// and dies with its socket, and no other socket, of this pod or another, can push it out (an LRU
/// map keyed by cookie dropped a long-lived connection's entry once enough others were made).
#[btf_map]
pub(crate) static SOCKET_ORIG_DST: SkStorage<OrigDst> = SkStorage::new();

/// client ip:port -> where the application meant to go; read by the agent after accept().
#[map]
pub(crate) static FLOW_ORIG_DST: LruHashMap<SockAddr, OrigDst> =
    LruHashMap::with_max_entries(FLOW_MAP_ENTRIES, 0);

/// A steered or rewritten TCP connection's ends -> where the application meant to go, filed as its
/// SYN leaves. An MPTCP socket's hooks steer its first subflow (a TCP socket of its own, holding
/// the storage); getpeername() on the MPTCP socket finds the original here by the ends it shares
/// with that subflow.
#[map]
pub(crate) static SUBFLOW_ORIG_DST: LruHashMap<FlowEnds, OrigDst> =
    LruHashMap::with_max_entries(FLOW_MAP_ENTRIES, 0);

#[map]
pub(crate) static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);

/// Pod cgroups whose processes are left alone (their pods opted out of capture); kept by the agent.
#[map]
pub(crate) static OPTED_OUT_CGROUPS: HashMap<u64, u8> =
    HashMap::with_max_entries(OPTED_OUT_MAP_ENTRIES, 0);

/// The node's netns cookie as `netns_probe` saw it (kernels without SO_NETNS_COOKIE).
#[map]
pub(crate) static NETNS_PROBE: Array<u64> = Array::with_max_entries(1, 0);

/// Which set of fast-path tables is in force (`GEN_OFF`: none, everything goes to the proxy).
#[map]
pub(crate) static FAST_GENERATION: Array<u32> = Array::with_max_entries(1, 0);

/// The fast path's decisions (`FastStat`), then the hides it counted and those it could not report.
#[map]
pub(crate) static FAST_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(FAST_STAT_SLOTS, 0);

/// Each connection the kernel decided after skipping a hidden service, for the agent's debug log.
/// Bounded: when the agent falls behind, events are dropped (and counted), never waited for.
#[map]
pub(crate) static FAST_HIDDEN_EVENTS: RingBuf = RingBuf::with_byte_size(HIDDEN_EVENTS_BYTES, 0);

/// The addresses whose decisions the agent audits, keyed as the CIDR tables in the shared view:
/// each connection the kernel decides to one is reported on `FAST_HIDDEN_EVENTS` too. Empty
/// without an audit policy (a lookup in an empty trie finds nothing at once). One map for both
/// generations: a report is only a prompt, and the agent decides the audit itself.
#[map]
pub(crate) static FAST_AUDITED: LpmTrie<LpmBytes, u8> =
    LpmTrie::with_max_entries(AUDITED_ENTRIES, BPF_F_NO_PREALLOC);

/// The cookie of each socket connect() just recorded, in the slot of its low bits: sock_ops finds
/// it there as the SYN is about to leave and asks for the socket's state changes. A plain array:
/// no allocation, no lock, nothing to free (socket storage cost a connection ~0.5 µs).
#[map]
pub(crate) static RECORDS_ARMED: Array<u64> = Array::with_max_entries(RECORDS_ARMED_SLOTS, 0);

/// The kernel's connection records, to the agent: a connection when it is decided and when it
/// closes. Bounded: when the agent falls behind, records are lost (and counted), never waited for.
#[map]
pub(crate) static CONN_RECORDS: RingBuf = RingBuf::with_byte_size(RECORDS_BYTES, 0);

/// Other nodes' Pods the agent sends from to this node's Pods (network-order IPv4 -> 1), kept by
/// the agent for `hbone_replies`. Empty without HBONE between nodes.
#[map]
pub(crate) static HBONE_SOURCES: HashMap<u32, u8> =
    HashMap::with_max_entries(HBONE_SOURCES_ENTRIES, BPF_F_NO_PREALLOC);

/// The same for IPv6 senders (the address's four words as the packet carries them -> 1).
#[map]
pub(crate) static HBONE_SOURCES6: HashMap<[u32; 4], u8> =
    HashMap::with_max_entries(HBONE_SOURCES_ENTRIES, BPF_F_NO_PREALLOC);

/// How many of the kernel's decisions are recorded: 0 none, 1 all, N one in N (set by the agent).
#[map]
pub(crate) static RECORDS_SAMPLE: Array<u32> = Array::with_max_entries(1, 0);

/// Records the kernel could not report.
#[map]
pub(crate) static RECORDS_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn count_record_lost() {
    if let Some(slot) = RECORDS_LOST.get_ptr_mut(0) {
        // SAFETY: as in `count_fast_slot`: this CPU's slot, no other writer while this runs.
        unsafe { *slot += 1 }
    }
}

// The fast path's tables. Each is an array of two maps, one per generation: the agent creates the
// maps at the size the tables need (the templates below give the kernel only their type, key,
// value and flags), fills the idle generation's, puts them in its slot, then flips
// `FAST_GENERATION`. A connection reads the generation once and then only that slot's maps, so it
// sees the old tables or the new ones, never half of each. Hash maps are allocated as they fill.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

/// cgroup id -> client namespace id.
pub(crate) type ClientsMap = BtfHashMap<u64, u32, 1, NO_PREALLOC>;
pub(crate) type ExactMap = BtfHashMap<AddrKey, Claim, 1, NO_PREALLOC>;
pub(crate) type CidrsMap = BtfLpmTrie<LpmBytes, Claim, 1>;
pub(crate) type PortsMap = BtfHashMap<PortKey, Backends, 1, NO_PREALLOC>;
pub(crate) type WorkloadsMap = BtfHashMap<IpKey, u8, 1, NO_PREALLOC>;

#[btf_map]
pub(crate) static FAST_CLIENTS: ArrayOfMaps<ClientsMap, 2> = ArrayOfMaps::new();
#[btf_map]
pub(crate) static FAST_EXACT: ArrayOfMaps<ExactMap, 2> = ArrayOfMaps::new();
#[btf_map]
pub(crate) static FAST_CIDRS: ArrayOfMaps<CidrsMap, 2> = ArrayOfMaps::new();
#[btf_map]
pub(crate) static FAST_PORTS: ArrayOfMaps<PortsMap, 2> = ArrayOfMaps::new();
#[btf_map]
pub(crate) static FAST_WORKLOADS: ArrayOfMaps<WorkloadsMap, 2> = ArrayOfMaps::new();
/// The inbound authorization table (`redirect_common::inbound`): made by the agent at the size it
/// needs and replaced whole in the array's one slot, so a lookup sees one table or the next.
pub(crate) type InboundMap = BtfLpmTrie<InboundBytes, InboundVerdict, 1>;
#[btf_map]
pub(crate) static INBOUND_TABLE: ArrayOfMaps<InboundMap, 1> = ArrayOfMaps::new();

/// The inbound decisions by rule, and the agent's own connections let through.
#[map]
pub(crate) static INBOUND_COUNTS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(INBOUND_COUNT_SLOTS, 0);

/// Each refusal, for the agent's access log. Bounded: lost (and counted) when the agent lags.
#[map]
pub(crate) static INBOUND_EVENTS: RingBuf = RingBuf::with_byte_size(INBOUND_EVENTS_BYTES, 0);

/// The guarded Pods' addresses whose namespace runs `inbound`, kept by the agent.
#[map]
pub(crate) static INBOUND_ATTACHED: HashMap<IpKey, u8> =
    HashMap::with_max_entries(INBOUND_ATTACHED_ENTRIES, BPF_F_NO_PREALLOC);

/// The node's own connections to Pods, filed by `node_origin` as their SYN leaves (Pod end, node
/// end), with the time it left (`CLOCK_MONOTONIC` ns).
#[map]
pub(crate) static NODE_DIALS: LruHashMap<FlowEnds, u64> =
    LruHashMap::with_max_entries(NODE_DIALS_ENTRIES, 0);

/// Each generation's flags.
#[map]
pub(crate) static FAST_CONFIG: Array<Config> = Array::with_max_entries(2, 0);

#[inline(always)]
pub(crate) fn count_fast(stat: FastStat) {
    count_fast_slot(stat as u32);
}

#[inline(always)]
pub(crate) fn count_fast_slot(index: u32) {
    if let Some(slot) = FAST_STATS.get_ptr_mut(index) {
        // SAFETY: `get_ptr_mut` gave this CPU's slot, aligned and valid while the program runs; a
        // per-CPU slot has no other writer while this program runs on this CPU.
        unsafe { *slot += 1 }
    }
}

// Set by the agent at load time (`EbpfLoader::set_global`); zero means "not configured".
#[unsafe(no_mangle)]
static GATEWAY_V4: u32 = 0;
#[unsafe(no_mangle)]
static GATEWAY_V6: [u32; 4] = [0; 4];
#[unsafe(no_mangle)]
static PROXY_PORT: u16 = 0;
#[unsafe(no_mangle)]
static DNS_PROXY_PORT: u16 = 0;
#[unsafe(no_mangle)]
static NODE_NETNS_COOKIE: u64 = 0;

/// Gateway IPv4 in network byte order.
#[inline(always)]
pub(crate) fn gateway_v4() -> u32 {
    // Volatile: the value is patched into .rodata at load time, the compiler must not fold the zero.
    // SAFETY: a reference to a static: aligned and initialised; nothing writes it after load.
    unsafe { core::ptr::read_volatile(&GATEWAY_V4) }
}

/// Gateway IPv6 in the kernel's `user_ip6` form (network-order words); all zero when not configured.
#[inline(always)]
pub(crate) fn gateway_v6() -> [u32; 4] {
    // SAFETY: a reference to a static: aligned and initialised; read volatile as `gateway_v4`.
    unsafe { core::ptr::read_volatile(&GATEWAY_V6) }
}

#[inline(always)]
pub(crate) fn proxy_port() -> u16 {
    // SAFETY: a reference to a static: aligned and initialised; read volatile as `gateway_v4`.
    unsafe { core::ptr::read_volatile(&PROXY_PORT) }
}

#[inline(always)]
pub(crate) fn dns_proxy_port() -> u16 {
    // SAFETY: a reference to a static: aligned and initialised; read volatile as `gateway_v4`.
    unsafe { core::ptr::read_volatile(&DNS_PROXY_PORT) }
}

#[inline(always)]
pub(crate) fn node_netns_cookie() -> u64 {
    // SAFETY: a reference to a static: aligned and initialised; read volatile as `gateway_v4`.
    unsafe { core::ptr::read_volatile(&NODE_NETNS_COOKIE) }
}

#[inline(always)]
pub(crate) fn count(stat: Stat) {
    if let Some(slot) = STATS.get_ptr_mut(stat as u32) {
        // SAFETY: `get_ptr_mut` gave this CPU's slot, aligned and valid while the program runs; a
        // per-CPU slot has no other writer while this program runs on this CPU.
        unsafe { *slot += 1 }
    }
}
