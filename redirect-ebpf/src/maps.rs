//! Maps and load-time globals shared by the programs. Names and layouts come from `redirect-common`.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use redirect_common::{
    FLOW_MAP_ENTRIES, OPTED_OUT_MAP_ENTRIES, OrigDst, SOCKET_MAP_ENTRIES, SockAddr, Stat,
};

/// socket cookie -> where the application meant to go.
#[map]
pub static SOCKET_ORIG_DST: LruHashMap<u64, OrigDst> =
    LruHashMap::with_max_entries(SOCKET_MAP_ENTRIES, 0);

/// client ip:port -> where the application meant to go; read by the agent after accept().
#[map]
pub static FLOW_ORIG_DST: LruHashMap<SockAddr, OrigDst> =
    LruHashMap::with_max_entries(FLOW_MAP_ENTRIES, 0);

#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);

/// Pod cgroups whose processes are left alone (their pods opted out of capture); kept by the agent.
#[map]
pub static OPTED_OUT_CGROUPS: HashMap<u64, u8> =
    HashMap::with_max_entries(OPTED_OUT_MAP_ENTRIES, 0);

/// The node's netns cookie as `netns_probe` saw it (kernels without SO_NETNS_COOKIE).
#[map]
pub static NETNS_PROBE: Array<u64> = Array::with_max_entries(1, 0);

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
pub fn gateway_v4() -> u32 {
    // Volatile: the value is patched into .rodata at load time, the compiler must not fold the zero.
    unsafe { core::ptr::read_volatile(&GATEWAY_V4) }
}

/// Gateway IPv6 in the kernel's `user_ip6` form (network-order words); all zero when not configured.
#[inline(always)]
pub fn gateway_v6() -> [u32; 4] {
    unsafe { core::ptr::read_volatile(&GATEWAY_V6) }
}

#[inline(always)]
pub fn proxy_port() -> u16 {
    unsafe { core::ptr::read_volatile(&PROXY_PORT) }
}

#[inline(always)]
pub fn dns_proxy_port() -> u16 {
    unsafe { core::ptr::read_volatile(&DNS_PROXY_PORT) }
}

#[inline(always)]
pub fn node_netns_cookie() -> u64 {
    unsafe { core::ptr::read_volatile(&NODE_NETNS_COOKIE) }
}

#[inline(always)]
pub fn count(stat: Stat) {
    if let Some(slot) = STATS.get_ptr_mut(stat as u32) {
        // Per-CPU slot: no other writer while this program runs on this CPU.
        unsafe { *slot += 1 }
    }
}
