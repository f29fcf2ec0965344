//! Snapshot -> tables. For every claimed address the compiler works out, independently of the
//! service store, the winner for an unknown client and for each namespace owning a claimant, and
//! writes an entry only where the kernel's answer would be exactly the proxy's.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, hash_map::Entry},
    net::IpAddr,
};

use ipnet::IpNet;

use redirect_common::fastpath::{
    ACTION_NONE, ACTION_PASSTHROUGH, ACTION_PORTS, ACTION_PROXY, AddrKey, Backend, Claim, Config,
    FAMILY_V4, FAMILY_V6, IpKey, MAX_CIDRS, MAX_CLIENTS, MAX_ENDPOINTS, MAX_EXACT, MAX_NAMESPACES,
    MAX_PORTS, MAX_WORKLOADS, NS_PROXY, NS_UNKNOWN, PortKey,
};

use super::tables::{NsId, PortEndpoints, Tables};
use crate::{
    config::{EndpointAddress, Resolution},
    state::{Port, Service, ServiceVisibility, Snapshot},
};

/// Entries each table may hold (the BPF maps' `max_entries`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Namespaces with entries of their own.
    pub namespaces: usize,
    pub clients: usize,
    pub exact: usize,
    pub cidrs: usize,
    pub ports: usize,
    pub workloads: usize,
}

impl Limits {
    /// The room the eBPF maps have.
    pub fn kernel() -> Limits {
        Limits {
            namespaces: MAX_NAMESPACES as usize,
            clients: MAX_CLIENTS as usize,
            exact: MAX_EXACT as usize,
            cidrs: MAX_CIDRS as usize,
            ports: MAX_PORTS as usize,
            workloads: MAX_WORKLOADS as usize,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            namespaces: 4096,
            clients: 65_536,
            exact: 65_536,
            cidrs: 16_384,
            ports: 65_536,
            workloads: 65_536,
        }
    }
}

/// The addresses the agent resolved ahead for endpoint host names, while fresh: for each name its
/// addresses, IPv4 first (`dns::ahead`). A name missing here is the proxy's to resolve.
pub type HostAddresses = HashMap<String, Vec<IpAddr>>;

/// Why the proxy decides what the kernel could otherwise have decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fallback {
    /// A service port with an endpoint by host name the agent holds no fresh addresses for (not
    /// resolved yet, did not resolve, its answer expired, or past the names resolved ahead); counted
    /// per service port.
    HostNameEndpoint,
    /// A declared service port without endpoints: the proxy resets (per service port).
    NoEndpoints,
    /// A service port whose endpoints mix IPv4 and IPv6: no single rewrite fits every socket.
    MixedFamilies,
    /// More than [`MAX_ENDPOINTS`] endpoints on a service port.
    TooManyEndpoints,
    /// The rewrite table is full (per service port left out).
    PortsFull,
    /// A namespace's own entries did not fit: its clients go to the proxy (per namespace).
    NamespaceFull,
    /// The entries every client shares did not fit: the proxy decides everything.
    SharedFull,
    /// Not every workload address fit: unclaimed addresses go to the proxy (per address).
    WorkloadsFull,
}

/// What a compilation produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub namespaces: usize,
    pub exact: usize,
    pub cidrs: usize,
    pub ports: usize,
    pub workloads: usize,
    pub fallbacks: BTreeMap<Fallback, usize>,
}

impl Stats {
    fn fell_back(&mut self, why: Fallback, n: usize) {
        if n > 0 {
            *self.fallbacks.entry(why).or_default() += n;
        }
    }
}

/// One claimed key, exact address or network, and its claimants in rank order.
type Claimants = BTreeMap<(IpKey, u32), Vec<u32>>;

/// Compiles `snapshot` into tables of at most `limits` entries, every endpoint host name left to the
/// proxy.
pub fn compile(snapshot: &Snapshot, limits: Limits) -> (Tables, Stats) {
    compile_with(snapshot, limits, &HostAddresses::new())
}

/// Compiles `snapshot` into tables of at most `limits` entries; an endpoint host name with
/// addresses in `hosts` is rewritten to them like an endpoint given by address.
pub fn compile_with(snapshot: &Snapshot, limits: Limits, hosts: &HostAddresses) -> (Tables, Stats) {
    compile_reusing(snapshot, limits, hosts, None)
}

/// What [`compile_with`] gives `snapshot`, from what it gave the snapshot before (`compiled`, with
/// the same limits, and the same host addresses when `same_hosts`): a snapshot that shares its
/// services with that one ([`Snapshot::same_services`], a change to Pods alone) takes only its
/// workload addresses again; one that shares its workloads ([`Snapshot::same_workloads`], a
/// change to services alone) compiles only the services' entries.
pub fn compile_after(
    compiled: Option<(&Snapshot, &Tables, &Stats)>,
    same_hosts: bool,
    snapshot: &Snapshot,
    limits: Limits,
    hosts: &HostAddresses,
) -> (Tables, Stats) {
    match compiled {
        Some((before, tables, stats)) if same_hosts && before.same_services(snapshot) => {
            with_workloads(tables, stats, snapshot, limits)
        }
        Some((before, tables, stats)) if before.same_workloads(snapshot) => {
            let workloads = Workloads::in_tables(tables, stats);
            compile_reusing(snapshot, limits, hosts, workloads)
        }
        _ => compile_with(snapshot, limits, hosts),
    }
}

/// [`compile_with`], the workload addresses taken from `workloads` when given: what the tables of a
/// snapshot with the same workloads ([`Snapshot::same_workloads`]) and limits hold
/// ([`Workloads::in_tables`]).
fn compile_reusing(
    snapshot: &Snapshot,
    limits: Limits,
    hosts: &HostAddresses,
    workloads: Option<Workloads>,
) -> (Tables, Stats) {
    let (mut tables, mut stats) = compile_services(snapshot, limits, hosts);
    if tables.config.proxy_everything == 0 {
        workloads
            .unwrap_or_else(|| Workloads::of(snapshot, limits))
            .add_to(&mut tables, &mut stats);
    }
    (tables, stats)
}

/// The tables but for the workload addresses: the services' entries, from the snapshot's services
/// alone (and the host addresses).
fn compile_services(snapshot: &Snapshot, limits: Limits, hosts: &HostAddresses) -> (Tables, Stats) {
    let services: Vec<&Service> = snapshot.services().collect();
    let mut exact = Claimants::new();
    let mut cidrs = Claimants::new();
    for (id, svc) in services.iter().enumerate() {
        for ip in svc.vips() {
            let key = IpKey::new(ip);
            exact.entry((key, key.bits())).or_default().push(id as u32);
        }
        for net in &svc.cidrs {
            cidrs.entry(network_key(net)).or_default().push(id as u32);
        }
    }
    let mut compiler = Compiler {
        services: &services,
        hosts,
        limits,
        tables: Tables {
            max_clients: limits.clients,
            ..Tables::default()
        },
        claims: HashMap::new(),
        stats: Stats::default(),
    };

    // Entries every client shares: what a pod of a namespace owning no claimant there sees, its
    // PUBLIC winner, and the NAMESPACE claimant it skipped (the proxy's `hidden`). For a network,
    // the proxy walks every claimed network holding the address, longest first: the winner is the
    // first with a PUBLIC claimant, the hidden one the first NAMESPACE claimant met on the whole
    // walk (a known client goes on looking for its own namespace's). So each claimed network gets
    // an entry carrying what its walk finds, and the trie's longest match is the walk's start.
    let first = |members: &[u32], visibility: ServiceVisibility| {
        members
            .iter()
            .copied()
            .find(|&m| services[m as usize].visibility == visibility)
    };
    let public = |members: &[u32]| first(members, ServiceVisibility::Public);
    let scoped = |members: &[u32]| first(members, ServiceVisibility::Namespace);
    let mut shared = View {
        exact: Vec::new(),
        cidrs: Vec::new(),
    };
    for ((key, _), members) in &exact {
        let hidden = scoped(members);
        let claim = match public(members) {
            Some(w) => compiler.claim(w),
            None if hidden.is_some() => Claim::new(ACTION_NONE, 0),
            None => continue,
        };
        shared.exact.push((*key, claim.hiding(hidden)));
    }
    for ((key, len), members) in &cidrs {
        let walk = std::iter::once(members.as_slice())
            .chain(ancestors(&cidrs, *key, *len).map(Vec::as_slice))
            .collect::<Vec<_>>();
        let winner = walk.iter().find_map(|m| public(m));
        let hidden = walk.iter().find_map(|m| scoped(m));
        let claim = match winner {
            Some(w) => compiler.claim(w),
            None => Claim::new(ACTION_NONE, 0),
        };
        shared.cidrs.push((*key, *len, claim.hiding(hidden)));
    }
    if !compiler.fits(&shared) {
        compiler.stats.fell_back(Fallback::SharedFull, 1);
        let stats = compiler.stats;
        let tables = Tables {
            max_clients: limits.clients,
            config: Config {
                proxy_everything: 1,
                ..Config::default()
            },
            ..Tables::default()
        };
        return (tables, stats);
    }
    compiler.insert(NS_UNKNOWN, shared);

    // A namespace owning a claimant of a key sees its own best claimant there, whatever the
    // visibility; everywhere else it sees what an unknown client sees, so it needs no entry. Each
    // namespace's keys are gathered in one pass over the claims, not by a pass per namespace.
    let own_exact = own_claims(&exact, &services);
    let own_cidrs = own_claims(&cidrs, &services);
    let owners: BTreeSet<&str> = own_exact.keys().chain(own_cidrs.keys()).copied().collect();
    for ns in owners {
        let next_id = compiler.stats.namespaces as NsId + 1;
        let mut entries = compiler.own_view(
            own_exact.get(ns).map_or(&[], Vec::as_slice),
            own_cidrs.get(ns).map_or(&[], Vec::as_slice),
        );
        // An exact entry equal to the shared one is redundant: the lookup falls back to it. (A
        // network's is not: without it, a shorter prefix of the namespace's own would win.)
        entries.exact.retain(|(ip, claim)| {
            compiler.tables.exact.get(&AddrKey {
                ns: NS_UNKNOWN,
                ip: *ip,
            }) != Some(claim)
        });
        if entries.exact.is_empty() && entries.cidrs.is_empty() {
            continue;
        }
        // Ids stop short of `NS_PROXY`.
        let room = limits.namespaces.min(NS_PROXY as usize - 1);
        if compiler.stats.namespaces >= room || !compiler.fits(&entries) {
            compiler.stats.fell_back(Fallback::NamespaceFull, 1);
            compiler.tables.namespaces.insert(ns.to_string(), NS_PROXY);
            continue;
        }
        compiler.insert(next_id, entries);
        compiler.tables.namespaces.insert(ns.to_string(), next_id);
        compiler.stats.namespaces += 1;
    }

    let Compiler {
        tables, mut stats, ..
    } = compiler;
    stats.exact = tables.exact.len();
    stats.cidrs = tables.cidrs.len();
    stats.ports = tables.ports.len();
    (tables, stats)
}

/// The tables [`compile_with`] gives `snapshot`, from `tables` and `stats`: what it gave a snapshot with the
/// same services (shared, [`Snapshot::same_services`]), host addresses and limits. Only the
/// workload addresses are taken again: a change to Pods alone compiles no service.
pub fn with_workloads(
    tables: &Tables,
    stats: &Stats,
    snapshot: &Snapshot,
    limits: Limits,
) -> (Tables, Stats) {
    let (mut tables, mut stats) = (tables.clone(), stats.clone());
    if tables.config.proxy_everything != 0 {
        // The shared entries did not fit: no table holds anything, workloads included.
        return (tables, stats);
    }
    tables.workloads.clear();
    tables.config.workloads_incomplete = 0;
    stats.workloads = 0;
    stats.fallbacks.remove(&Fallback::WorkloadsFull);
    Workloads::of(snapshot, limits).add_to(&mut tables, &mut stats);
    (tables, stats)
}

/// The workload addresses' entries of the tables. They read the snapshot's workloads alone (and
/// the limit), nothing of its services.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Workloads {
    /// Every address a workload is reached at; none when they do not all fit.
    addresses: HashSet<IpKey>,
    /// How many were left out (all of them) for want of room.
    left_out: usize,
}

impl Workloads {
    /// Every address a workload of `snapshot` is reached at, or none when they do not all fit.
    fn of(snapshot: &Snapshot, limits: Limits) -> Self {
        let ips: HashSet<IpKey> = snapshot.workload_destinations().map(IpKey::new).collect();
        match ips.len() > limits.workloads {
            true => Workloads {
                addresses: HashSet::new(),
                left_out: ips.len(),
            },
            false => Workloads {
                addresses: ips,
                left_out: 0,
            },
        }
    }

    /// What compiled tables hold of the workloads; `None` when they hold no entry at all (the
    /// shared entries did not fit), so none was worked out.
    fn in_tables(tables: &Tables, stats: &Stats) -> Option<Self> {
        (tables.config.proxy_everything == 0).then(|| Workloads {
            addresses: tables.workloads.clone(),
            left_out: stats
                .fallbacks
                .get(&Fallback::WorkloadsFull)
                .copied()
                .unwrap_or(0),
        })
    }

    /// Into tables that hold no workload address yet.
    fn add_to(self, tables: &mut Tables, stats: &mut Stats) {
        if self.left_out > 0 {
            tables.config.workloads_incomplete = 1;
            stats.fell_back(Fallback::WorkloadsFull, self.left_out);
        }
        stats.workloads = self.addresses.len();
        tables.workloads = self.addresses;
    }
}

/// One key a namespace claims, and its best ranked claimant of that namespace.
type OwnClaim = ((IpKey, u32), u32);

/// For each namespace owning a claimant: the keys it claims, in key order, each with the first
/// (best ranked) of its own claimants there.
fn own_claims<'s>(
    claimants: &Claimants,
    services: &[&'s Service],
) -> HashMap<&'s str, Vec<OwnClaim>> {
    let mut by_namespace: HashMap<&str, Vec<OwnClaim>> = HashMap::new();
    for (key, members) in claimants {
        for &id in members {
            let own = by_namespace
                .entry(services[id as usize].namespace.as_str())
                .or_default();
            if own.last().is_none_or(|(k, _)| k != key) {
                own.push((*key, id));
            }
        }
    }
    by_namespace
}

/// The claimed networks holding the network `key/len`, longest first.
fn ancestors<'c>(
    cidrs: &'c Claimants,
    key: IpKey,
    len: u32,
) -> impl Iterator<Item = &'c Vec<u32>> + 'c {
    (0..len).rev().filter_map(move |shorter| {
        let mut addr = key.addr;
        for (i, byte) in addr.iter_mut().enumerate() {
            let bit = i as u32 * 8;
            if bit >= shorter {
                *byte = 0;
            } else if bit + 8 > shorter {
                *byte &= 0xffu8 << (8 - (shorter - bit));
            }
        }
        cidrs.get(&(IpKey { addr, ..key }, shorter))
    })
}

/// A CIDR as declared: its family's own bits, no v4-mapping (the lookups never match an IPv6
/// network against an IPv4 destination).
fn network_key(net: &IpNet) -> (IpKey, u32) {
    let mut addr = [0; 16];
    let family = match net.trunc() {
        IpNet::V4(n) => {
            addr[..4].copy_from_slice(&n.network().octets());
            FAMILY_V4
        }
        IpNet::V6(n) => {
            addr = n.network().octets();
            FAMILY_V6
        }
    };
    (IpKey { family, addr }, u32::from(net.prefix_len()))
}

/// One view's entries: exact keys and (key, prefix length) networks.
struct View {
    exact: Vec<(IpKey, Claim)>,
    cidrs: Vec<(IpKey, u32, Claim)>,
}

struct Compiler<'s> {
    services: &'s [&'s Service],
    hosts: &'s HostAddresses,
    limits: Limits,
    tables: Tables,
    /// The claim each service compiled to, its ports written once.
    claims: HashMap<u32, Claim>,
    stats: Stats,
}

impl Compiler<'_> {
    /// A namespace's view: its own claimant of each key it claims (key order, as [`own_claims`]
    /// gives them).
    fn own_view(&mut self, exact: &[OwnClaim], cidrs: &[OwnClaim]) -> View {
        View {
            exact: exact
                .iter()
                .map(|&((key, _), id)| (key, self.claim(id)))
                .collect(),
            cidrs: cidrs
                .iter()
                .map(|&((key, len), id)| (key, len, self.claim(id)))
                .collect(),
        }
    }

    fn fits(&self, view: &View) -> bool {
        self.tables.exact.len() + view.exact.len() <= self.limits.exact
            && self.tables.cidrs.len() + view.cidrs.len() <= self.limits.cidrs
    }

    fn insert(&mut self, ns: NsId, view: View) {
        for (ip, claim) in view.exact {
            self.tables.exact.insert(AddrKey { ns, ip }, claim);
        }
        for (ip, len, claim) in view.cidrs {
            // Namespace and family take the key's first 64 bits.
            self.tables
                .cidrs
                .insert(AddrKey { ns, ip }, 64 + len, claim);
        }
    }

    /// What reaching service `id` means in the kernel; its rewrite entries are written the first
    /// time it is asked for.
    fn claim(&mut self, id: u32) -> Claim {
        if let Some(claim) = self.claims.get(&id) {
            return *claim;
        }
        let svc = self.services[id as usize];
        let mut action = if svc.resolution == Resolution::None {
            ACTION_PASSTHROUGH
        } else {
            ACTION_PROXY
        };
        if action == ACTION_PROXY {
            let mut seen = BTreeSet::new();
            // The first port of a number is the one the proxy serves.
            for port in svc.ports.iter().filter(|p| seen.insert(p.port)) {
                let backends = match backends(port, self.hosts) {
                    Ok(b) => b,
                    Err(why) => {
                        self.stats.fell_back(why, 1);
                        continue;
                    }
                };
                if self.tables.ports.len() >= self.limits.ports {
                    self.stats.fell_back(Fallback::PortsFull, 1);
                    continue;
                }
                match self.tables.ports.entry(PortKey::new(id, port.port)) {
                    Entry::Vacant(slot) => {
                        slot.insert(backends);
                        action = ACTION_PORTS;
                    }
                    Entry::Occupied(_) => {}
                }
            }
        }
        let claim = Claim::new(action, id);
        self.claims.insert(id, claim);
        claim
    }
}

/// A port's endpoints as one rewrite, when they are all plain IPs, or host names resolved ahead,
/// of one family. A host name stands for its IPv4 addresses, or its IPv6 ones when it has no IPv4
/// address: the address family the proxy connects to first.
fn backends(port: &Port, hosts: &HostAddresses) -> Result<PortEndpoints, Fallback> {
    if port.endpoints.is_empty() {
        return Err(Fallback::NoEndpoints);
    }
    let mut addresses = Vec::with_capacity(port.endpoints.len());
    for ep in &port.endpoints {
        match &ep.address {
            EndpointAddress::Ip(ip) => addresses.push((IpKey::new(*ip), ep.port)),
            EndpointAddress::Host(name) => {
                let resolved = hosts.get(name).ok_or(Fallback::HostNameEndpoint)?;
                let has_v4 = resolved.iter().any(|ip| ip.is_ipv4());
                addresses.extend(
                    resolved
                        .iter()
                        .filter(|ip| ip.is_ipv4() == has_v4)
                        .map(|ip| (IpKey::new(*ip), ep.port)),
                );
            }
        }
        if addresses.len() > MAX_ENDPOINTS {
            return Err(Fallback::TooManyEndpoints);
        }
    }
    if addresses.is_empty() {
        return Err(Fallback::HostNameEndpoint);
    }
    let family = addresses[0].0.family;
    if addresses.iter().any(|(ip, _)| ip.family != family) {
        return Err(Fallback::MixedFamilies);
    }
    Ok(PortEndpoints {
        family,
        endpoints: addresses
            .into_iter()
            .map(|(ip, port)| Backend {
                addr: ip.addr,
                port,
                _pad: 0,
            })
            .collect(),
    })
}
