//! The fast path: what `connect()` can decide without the proxy, from the tables the agent
//! compiled out of its snapshot. A few lookups, no loop: the generation's maps, the client's
//! namespace by cgroup, the claim on the address (exact, then CIDR; the client's own view before
//! the shared one), then the outcome. `redirect-userspace/src/fastpath/kernel.rs` is the model of this code, held to the
//! proxy's decisions by property tests: keep the two in step.
use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_prandom_u32},
    maps::lpm_trie::Key,
};
use redirect_common::{
    FAST_STAT_HIDDEN, FAST_STAT_HIDDEN_DROPPED, FastStat,
    fastpath::{
        ACTION_NONE, ACTION_PASSTHROUGH, ACTION_PORTS, AddrKey, Claim, FAMILY_V4, FAMILY_V6, GEN_A,
        GEN_B, HiddenEvent, IpKey, LpmBytes, MAX_ENDPOINTS, NOT_HIDDEN, NS_ENROLLED, NS_PROXY,
        NS_UNKNOWN, PortKey, WORKLOAD_GUARDED, WORKLOAD_HBONE, WORKLOAD_PROXY, generation_slot,
    },
    ip6_words, is_v4_mapped, v4_mapped_words,
};

use crate::{
    maps::{
        CidrsMap, ExactMap, FAST_AUDITED, FAST_CIDRS, FAST_CLIENTS, FAST_CONFIG, FAST_EXACT,
        FAST_GENERATION, FAST_HIDDEN_EVENTS, FAST_PORTS, FAST_WORKLOADS, INBOUND_ATTACHED,
        PortsMap, WorkloadsMap, count_fast, count_fast_slot,
    },
    steer::Dest,
};

/// What the kernel does with a TCP `connect()` the proxy would otherwise get.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fast {
    /// Leave the socket alone (passthrough, a workload, a resolution NONE service).
    Leave,
    /// Connect to the endpoint written into `to` instead.
    Rewrite,
    /// Steer to the proxy, as without the fast path.
    Proxy,
}

/// The decision under the generation in force; with none (`--fast-path` off, or before the
/// agent's first tables) the proxy decides and nothing is counted. On `Rewrite`, `to` holds the
/// endpoint; `outcome` the decision's `FastStat` (for its record). (Out-parameters the caller
/// initialised, not payloads: Linux 5.10's verifier refuses reading a stack slot one path never
/// wrote, which an enum payload leads LLVM to do.)
#[inline(always)]
pub(crate) fn decide(dst: &Dest, to: &mut Dest, outcome: &mut u8) -> Fast {
    let generation = FAST_GENERATION.get(0).copied().unwrap_or(0);
    let mut seen = Seen {
        cgroup: 0,
        ns: 0,
        hidden: NOT_HIDDEN,
    };
    if generation != GEN_A && generation != GEN_B {
        return Fast::Proxy;
    }
    let (fast, stat) = lookup(generation_slot(generation), dst, to, &mut seen);
    count_fast(stat);
    *outcome = stat as u8;
    if fast == Fast::Proxy {
        return fast;
    }
    // A hide the kernel decided past is the proxy's to count and log no more: counted here and
    // reported to the agent (which logs it as the proxy would). A decision on an address the agent
    // audits is reported too (the agent makes the audit's decision itself).
    let hidden = seen.hidden != NOT_HIDDEN;
    if hidden {
        count_fast_slot(FAST_STAT_HIDDEN);
    }
    if hidden || audited(&dst.ip) {
        let event = HiddenEvent {
            cgroup: seen.cgroup,
            ns: seen.ns,
            hidden: seen.hidden,
            dst: ip_key(&dst.ip),
            port: dst.port,
            outcome: stat as u8,
            generation: generation as u8,
        };
        if FAST_HIDDEN_EVENTS.output::<HiddenEvent>(&event, 0).is_err() {
            count_fast_slot(FAST_STAT_HIDDEN_DROPPED);
        }
    }
    fast
}

/// Whether the agent audits connections to `ip` (`FAST_AUDITED` holds an address or network of it).
#[inline(always)]
fn audited(ip: &[u32; 4]) -> bool {
    let key = addr_key(NS_UNKNOWN, &ip_key(ip));
    FAST_AUDITED.get(&lpm_key(&key)).is_some()
}

/// What the lookup learned on the way, for the report of a hide. (An out-parameter the caller
/// initialised, for the same reason as `to`.)
struct Seen {
    cgroup: u64,
    ns: u32,
    hidden: u32,
}

#[inline(always)]
fn lookup(slot: u32, dst: &Dest, to: &mut Dest, seen: &mut Seen) -> (Fast, FastStat) {
    // A generation without all its maps in place is not in force yet: the proxy decides.
    let (Some(clients), Some(exact), Some(cidrs), Some(ports), Some(workloads)) = (
        FAST_CLIENTS.get(slot),
        FAST_EXACT.get(slot),
        FAST_CIDRS.get(slot),
        FAST_PORTS.get(slot),
        FAST_WORKLOADS.get(slot),
    ) else {
        return (Fast::Proxy, FastStat::ProxyOverflow);
    };
    // A cgroup the agent has not named could be any pod's: only the proxy knows its namespace.
    // SAFETY: the helper takes no argument and only reads the current task's cgroup.
    let cgroup = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: the value is copied at once; the agent writes only the generation not in force, so
    // nothing changes the entry while it is read.
    let Some(ns) = (unsafe { clients.get(&cgroup) }).copied() else {
        return (Fast::Proxy, FastStat::ProxyUnknownClient);
    };
    let Some(config) = FAST_CONFIG.get(slot).copied() else {
        return (Fast::Proxy, FastStat::ProxyOverflow);
    };
    if config.proxy_everything != 0 || ns == NS_PROXY {
        return (Fast::Proxy, FastStat::ProxyOverflow);
    }
    // A client in the ambient mesh carries a bit beside its namespace.
    let enrolled = ns & NS_ENROLLED != 0;
    let ns = ns & !NS_ENROLLED;
    seen.cgroup = cgroup;
    seen.ns = ns;
    let ip = ip_key(&dst.ip);
    let found = claim(exact, cidrs, ns, ip, seen);
    let claim = match found {
        Some(c) if c.action != ACTION_NONE => c,
        _ => {
            // A workload is left alone unless only the proxy may carry it (over HBONE, or under
            // authorization the kernel does not decide); the table counts the others apart (an
            // address it had no room for is counted as a passthrough).
            return match workload(workloads, &ip) {
                Some(_) if proxy_only(workloads, &ip, enrolled) => {
                    (Fast::Proxy, FastStat::ProxyService)
                }
                Some(_) => (Fast::Leave, FastStat::Workload),
                None => (Fast::Leave, FastStat::Passthrough),
            };
        }
    };
    if claim.action == ACTION_PASSTHROUGH {
        // A network passed through may hold a Pod only the proxy may carry a connection to.
        if proxy_only(workloads, &ip, enrolled) {
            return (Fast::Proxy, FastStat::ProxyService);
        }
        return (Fast::Leave, FastStat::Passthrough);
    }
    if claim.action != ACTION_PORTS {
        return (Fast::Proxy, FastStat::ProxyService);
    }
    let port = PortKey {
        service: claim.service,
        port: dst.port,
        _pad: 0,
    };
    if pick(ports, workloads, &port, ip.family, enrolled, to) {
        (Fast::Rewrite, FastStat::Rewritten)
    } else {
        (Fast::Proxy, FastStat::ProxyService)
    }
}

/// The claim on `ip` in view `ns`: exact addresses before networks, in each the client's own
/// view before the one every client shares. The winners were ranked when the tables were compiled.
/// An exact entry with no visible claimant (`ACTION_NONE`) only says what was hidden: the networks
/// are looked at next, and its hide is the one reported. Sets `seen.hidden`.
#[inline(always)]
fn claim(
    exact_map: &ExactMap,
    cidrs: &CidrsMap,
    ns: u32,
    ip: IpKey,
    seen: &mut Seen,
) -> Option<Claim> {
    let own = addr_key(ns, &ip);
    let shared = addr_key(NS_UNKNOWN, &ip);
    // SAFETY: the value is copied at once; the agent writes only the generation not in force, so
    // nothing changes the entry while it is read.
    let mut exact = unsafe { exact_map.get(&own) }.copied();
    if exact.is_none() {
        // SAFETY: as above.
        exact = unsafe { exact_map.get(&shared) }.copied();
    }
    if let Some(c) = exact {
        seen.hidden = c.hidden;
        if c.action != ACTION_NONE {
            return Some(c);
        }
    }
    // Whole keys: the trie finds the longest stored prefix of each.
    let mut network = cidrs.get(&lpm_key(&own)).copied();
    if network.is_none() {
        network = cidrs.get(&lpm_key(&shared)).copied();
    }
    if let Some(c) = network
        && seen.hidden == NOT_HIDDEN
    {
        seen.hidden = c.hidden;
    }
    network
}

/// The class of workload address `ip` (`WORKLOAD_DIRECT`, `WORKLOAD_PROXY`), if it is one.
#[inline(always)]
fn workload(workloads: &WorkloadsMap, ip: &IpKey) -> Option<u8> {
    // SAFETY: the value is copied at once; the agent writes only the generation not in force, so
    // nothing changes the entry while it is read.
    unsafe { workloads.get(ip) }.copied()
}

/// Whether only the proxy may carry a connection to workload address `ip`: one under
/// authorization the kernel does not decide, one reached over HBONE from an `enrolled` client, or
/// a guarded Pod whose namespace does not run `inbound` yet (nothing would decide it).
#[inline(always)]
fn proxy_only(workloads: &WorkloadsMap, ip: &IpKey, enrolled: bool) -> bool {
    match workload(workloads, ip) {
        Some(WORKLOAD_PROXY) => true,
        Some(WORKLOAD_HBONE) => enrolled,
        // SAFETY: the value is only tested for presence.
        Some(WORKLOAD_GUARDED) => unsafe { INBOUND_ATTACHED.get(ip) }.is_none(),
        _ => false,
    }
}

/// Writes one of the port's endpoints, chosen per connection, into `to`; false (and `to`
/// untouched) when the port has no rewrite for a socket of this family, or the endpoint chosen is
/// one only the proxy may carry the connection to (the proxy serves both).
#[inline(always)]
fn pick(
    ports: &PortsMap,
    workloads: &WorkloadsMap,
    port: &PortKey,
    family: u32,
    enrolled: bool,
    to: &mut Dest,
) -> bool {
    // SAFETY: the reference lives only within this call, and the agent writes only the generation
    // not in force, so nothing changes the entry while it is read.
    let Some(backends) = (unsafe { ports.get(port) }) else {
        return false;
    };
    let count = backends.count;
    if backends.family != family || count == 0 {
        return false;
    }
    // SAFETY: the helper takes no argument and has no precondition.
    let i = (unsafe { bpf_get_prandom_u32() } % count) as usize;
    // Bounds the index for the verifier as well as for Rust.
    if i >= MAX_ENDPOINTS {
        return false;
    }
    let Some(b) = backends.endpoints.get(i) else {
        return false;
    };
    let a = &b.addr;
    let key = IpKey { family, addr: *a };
    if proxy_only(workloads, &key, enrolled) {
        return false;
    }
    let ip = if family == FAMILY_V4 {
        v4_mapped_words(u32::from_ne_bytes([a[0], a[1], a[2], a[3]]))
    } else {
        ip6_words(a)
    };
    to.ip = ip;
    to.port = b.port;
    true
}

/// An LPM key aligned for word writes (the trie's key type is packed).
#[repr(C, align(4))]
struct LpmKey(Key<LpmBytes>);

/// The exact table's key of `ip` in view `ns`.
#[inline(always)]
fn addr_key(ns: u32, ip: &IpKey) -> AddrKey {
    let [a, b, c, d] = addr_words(ip);
    from_words([ns, ip.family, a, b, c, d])
}

/// The whole trie key of `key` ([`AddrKey::lpm_bytes`], all its bits).
#[inline(always)]
fn lpm_key(key: &AddrKey) -> Key<LpmBytes> {
    let [a, b, c, d] = addr_words(&key.ip);
    // Namespace and family big-endian, most significant bit first, as the trie compares them.
    let ns = u32::from_ne_bytes(key.ns.to_be_bytes());
    let family = u32::from_ne_bytes(key.ip.family.to_be_bytes());
    let bits = (core::mem::size_of::<LpmBytes>() * 8) as u32;
    from_words::<LpmKey, 7>([bits, ns, family, a, b, c, d]).0
}

/// The address bytes of `ip` as four words, in memory order.
#[inline(always)]
fn addr_words(ip: &IpKey) -> [u32; 4] {
    let a = &ip.addr;
    let word = |i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
    [word(0), word(4), word(8), word(12)]
}

/// A key made of `N` words, written one by one: LLVM turns zeroed bytes of a key built in place
/// into a memset call, which the kernel refuses in an object with BTF (memset has no BTF of its
/// own).
#[inline(always)]
pub(crate) fn from_words<T, const N: usize>(words: [u32; N]) -> T {
    const { assert!(core::mem::size_of::<T>() == 4 * N && core::mem::align_of::<T>() >= 4) };
    let mut key = core::mem::MaybeUninit::<T>::uninit();
    let at = key.as_mut_ptr().cast::<u32>();
    // SAFETY: `T` is `N` words at an address aligned for a word (checked above), all written here
    // before it is read; every key type here is plain integers, any bit pattern valid.
    unsafe {
        for (i, word) in words.iter().enumerate() {
            core::ptr::write_volatile(at.add(i), *word);
        }
        key.assume_init()
    }
}

/// The tables' form of an address in `user_ip6` form: IPv4 (v4-mapped included) in the first four
/// bytes, IPv6 in all sixteen.
#[inline(always)]
pub(crate) fn ip_key(ip: &[u32; 4]) -> IpKey {
    let (family, words) = if is_v4_mapped(ip) {
        (FAMILY_V4, [ip[3], 0, 0, 0])
    } else {
        (FAMILY_V6, *ip)
    };
    let [a, b, c, d] = words;
    from_words([family, a, b, c, d])
}
