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
    FAMILY_V4, FAMILY_V6, IpKey, MAX_ENDPOINTS, NS_ENROLLED, NS_PROXY, NS_UNKNOWN, PortKey,
    WORKLOAD_DIRECT, WORKLOAD_GUARDED, WORKLOAD_HBONE, WORKLOAD_PROXY,
};

use super::{
    limits::{Fallback, Limits, Stats},
    memory::entry_bytes,
    tables::{NsId, PortEndpoints, Tables},
};
use crate::{
    config::{EndpointAddress, Resolution},
    state::{Port, Service, ServiceVisibility, Snapshot},
};

/// The addresses the agent resolved ahead for endpoint host names, while fresh: for each name its
/// addresses, IPv4 first (`dns::ahead`). A name missing here is the proxy's to resolve.
pub(crate) type HostAddresses = HashMap<String, Vec<IpAddr>>;

/// One claimed key, exact address or network, and its claimants in rank order.
type Claimants = BTreeMap<(IpKey, u32), Vec<u32>>;

/// Compiles `snapshot` into tables of at most `limits` entries, every endpoint host name left to the
/// proxy.
pub(crate) fn compile(snapshot: &Snapshot, limits: Limits) -> (Tables, Stats) {
    compile_with(snapshot, limits, &HostAddresses::new())
}

/// Compiles `snapshot` into tables of at most `limits` entries; an endpoint host name with
/// addresses in `hosts` is rewritten to them like an endpoint given by address.
pub(crate) fn compile_with(
    snapshot: &Snapshot,
    limits: Limits,
    hosts: &HostAddresses,
) -> (Tables, Stats) {
    compile_reusing(snapshot, limits, hosts, None)
}

/// What [`compile_with`] gives `snapshot`, from what it gave the snapshot before (`compiled`, with
/// the same limits, and the same host addresses when `same_hosts`): a snapshot that shares its
/// services with that one ([`Snapshot::same_services`], a change to Pods alone) takes only its
/// workload addresses again; one that shares its workloads ([`Snapshot::same_workloads`], a
/// change to services alone) compiles only the services' entries, and of those only the entries
/// of the addresses the changed services claim when it can (`patch`).
pub(crate) fn compile_after(
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
        Some((before, tables, stats))
            if before.same_workloads(snapshot) && before.same_guards(snapshot) =>
        {
            let patched = same_hosts
                .then(|| {
                    super::patch::services_changed(before, tables, stats, snapshot, limits, hosts)
                })
                .flatten();
            patched.unwrap_or_else(|| {
                let workloads = Workloads::in_tables(tables, stats);
                compile_reusing(snapshot, limits, hosts, workloads)
            })
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
///
/// The entries every client shares come first, in two kinds: those that change a decision (a key
/// with a PUBLIC claimant) and those that only report a hide (a key whose claimants are all
/// hidden from the unknown client: without the entry the kernel decides the same, but cannot
/// count the hide). The first kind must fit the whole budget, or the proxy decides everything.
/// Then each namespace owning a claimant gets its own entries, the hide reports of its services
/// and its services' rewrites, admitted whole, the namespace needing least first, within its
/// share: one tenant's thousands of addresses send its own clients to the proxy before anyone
/// else's.
fn compile_services(snapshot: &Snapshot, limits: Limits, hosts: &HostAddresses) -> (Tables, Stats) {
    let services: Vec<&Service> = snapshot.services().collect();
    let (exact, cidrs) = claimants(&services);
    let mut compiler = Compiler {
        services: &services,
        hosts,
        limits,
        tables: Tables {
            max_clients: limits.clients,
            ..Tables::default()
        },
        claims: HashMap::new(),
        ports_written: HashSet::new(),
        bytes: 0,
        stats: Stats::default(),
    };
    let (shared, reports) = compiler.shared(&exact, &cidrs);
    if !compiler.fits(&shared, usize::MAX) {
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
    compiler.namespaces(&exact, &cidrs, reports);

    let Compiler {
        tables, mut stats, ..
    } = compiler;
    stats.exact = tables.exact.len();
    stats.cidrs = tables.cidrs.len();
    stats.ports = tables.ports.len();
    (tables, stats)
}

/// Who claims each exact address and each network, by service id (the service's rank).
fn claimants(services: &[&Service]) -> (Claimants, Claimants) {
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
    (exact, cidrs)
}

/// The tables [`compile_with`] gives `snapshot`, from `tables` and `stats`: what it gave a snapshot with the
/// same services (shared, [`Snapshot::same_services`]), host addresses and limits. Only the
/// workload addresses are taken again: a change to Pods alone compiles no service.
pub(crate) fn with_workloads(
    tables: &Tables,
    stats: &Stats,
    snapshot: &Snapshot,
    limits: Limits,
) -> (Tables, Stats) {
    let (mut tables, mut stats) = (tables.clone(), stats.clone());
    if stats.fallbacks.contains_key(&Fallback::SharedFull) {
        // The shared entries did not fit: no table holds anything, workloads included.
        return (tables, stats);
    }
    // Otherwise the proxy decides everything only when the workloads it alone may carry did not
    // fit: worked out again below, like the rest of the workloads.
    tables.workloads.clear();
    tables.config.workloads_incomplete = 0;
    tables.config.proxy_everything = 0;
    stats.workloads = 0;
    stats.fallbacks.remove(&Fallback::WorkloadsUncounted);
    Workloads::of(snapshot, limits).add_to(&mut tables, &mut stats);
    (tables, stats)
}

/// The workload addresses' entries of the tables. They read the snapshot's workloads alone (and
/// the limit), nothing of its services.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Workloads {
    /// Every address a workload is reached at, with how (`WORKLOAD_DIRECT`, `WORKLOAD_PROXY`);
    /// none when they do not all fit.
    addresses: HashMap<IpKey, u8>,
    /// How many were left out for want of room.
    left_out: usize,
    /// Even the addresses only the proxy may carry did not fit: it decides every connection.
    proxy_all: bool,
}

impl Workloads {
    /// Every address a workload of `snapshot` is reached at, or only those the proxy must carry
    /// when they do not all fit.
    fn of(snapshot: &Snapshot, limits: Limits) -> Self {
        let ips: HashMap<IpKey, u8> = snapshot
            .workload_destinations()
            .map(|ip| {
                let authz = snapshot.authz();
                let class = if authz.proxy_only(ip) {
                    WORKLOAD_PROXY
                } else if snapshot.hbone_peer(ip).is_some() {
                    WORKLOAD_HBONE
                } else if authz.pod(ip).is_some() {
                    WORKLOAD_GUARDED
                } else {
                    WORKLOAD_DIRECT
                };
                (IpKey::new(ip), class)
            })
            .collect();
        if ips.len() <= limits.workloads {
            return Workloads {
                addresses: ips,
                left_out: 0,
                proxy_all: false,
            };
        }
        // Left out, an address only the proxy may carry (or that only the kernel's inbound check
        // may let a connection reach) would be left alone in the kernel: those are kept first, and when even they do not fit the proxy decides every connection.
        let total = ips.len();
        let addresses: HashMap<IpKey, u8> = (ips.into_iter())
            .filter(|(_, class)| *class != WORKLOAD_DIRECT)
            .collect();
        match addresses.len() > limits.workloads {
            true => Workloads {
                addresses: HashMap::new(),
                left_out: total,
                proxy_all: true,
            },
            false => Workloads {
                left_out: total - addresses.len(),
                addresses,
                proxy_all: false,
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
                .get(&Fallback::WorkloadsUncounted)
                .copied()
                .unwrap_or(0),
            proxy_all: false,
        })
    }

    /// Into tables that hold no workload address yet.
    fn add_to(self, tables: &mut Tables, stats: &mut Stats) {
        if self.left_out > 0 {
            tables.config.workloads_incomplete = 1;
            stats.fell_back(Fallback::WorkloadsUncounted, self.left_out);
        }
        if self.proxy_all {
            tables.config.proxy_everything = 1;
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
#[derive(Default)]
struct View {
    exact: Vec<(IpKey, Claim)>,
    cidrs: Vec<(IpKey, u32, Claim)>,
}

impl View {
    fn len(&self) -> usize {
        self.exact.len() + self.cidrs.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The services whose rewrites this view's entries use.
    fn services(&self) -> impl Iterator<Item = u32> + '_ {
        let claims = self.exact.iter().map(|(_, c)| c);
        let claims = claims.chain(self.cidrs.iter().map(|(_, _, c)| c));
        claims
            .filter(|c| c.action == ACTION_PORTS)
            .map(|c| c.service)
    }
}

/// What reaching one service means in the kernel: its claim and the rewrites of its ports, worked
/// out once, written when a view that uses them is.
pub(super) struct ServiceClaim {
    pub claim: Claim,
    pub ports: Vec<(PortKey, PortEndpoints)>,
}

struct Compiler<'s> {
    services: &'s [&'s Service],
    hosts: &'s HostAddresses,
    limits: Limits,
    tables: Tables,
    /// The claim each service compiled to.
    claims: HashMap<u32, ServiceClaim>,
    /// The services whose rewrites are in the tables.
    ports_written: HashSet<u32>,
    /// Kernel memory of the entries in the tables ([`entry_bytes`]).
    bytes: usize,
    stats: Stats,
}

impl<'s> Compiler<'s> {
    /// The entries every client shares, and the hide reports by the namespace of the service
    /// hidden.
    fn shared(&mut self, exact: &Claimants, cidrs: &Claimants) -> (View, HashMap<&'s str, View>) {
        let services = self.services;
        // Entries every client shares: what a pod of a namespace owning no claimant there sees, its
        // PUBLIC winner, and the NAMESPACE claimant it skipped (the proxy's `hidden`). For a network,
        // the proxy walks every claimed network holding the address, longest first: the winner is the
        // first with a PUBLIC claimant, the hidden one the first NAMESPACE claimant met on the whole
        // walk (a known client goes on looking for its own namespace's). So each claimed network gets
        // an entry carrying what its walk finds, and the trie's longest match is the walk's start. A
        // network without a PUBLIC claimant of its own carries the winner of a shorter one, which
        // that one's entry carries too: it only reports the hide.
        let first = |members: &[u32], visibility: ServiceVisibility| {
            members
                .iter()
                .copied()
                .find(|&m| services[m as usize].visibility == visibility)
        };
        let public = |members: &[u32]| first(members, ServiceVisibility::Public);
        let scoped = |members: &[u32]| first(members, ServiceVisibility::Namespace);
        let mut shared = View::default();
        // The hide reports, by the namespace of the service hidden.
        let mut reports: HashMap<&str, View> = HashMap::new();
        let owner = |hidden: u32| services[hidden as usize].namespace.as_str();
        for ((key, _), members) in exact {
            let hidden = scoped(members);
            match public(members) {
                Some(w) => {
                    let claim = self.claim(w).hiding(hidden);
                    shared.exact.push((*key, claim));
                }
                None => {
                    if let Some(h) = hidden {
                        let claim = Claim::new(ACTION_NONE, 0).hiding(hidden);
                        reports
                            .entry(owner(h))
                            .or_default()
                            .exact
                            .push((*key, claim));
                    }
                }
            }
        }
        for ((key, len), members) in cidrs {
            let walk = std::iter::once(members.as_slice())
                .chain(ancestors(cidrs, *key, *len).map(Vec::as_slice))
                .collect::<Vec<_>>();
            let winner = walk.iter().find_map(|m| public(m));
            let hidden = walk.iter().find_map(|m| scoped(m));
            let claim = match winner {
                Some(w) => self.claim(w),
                None => Claim::new(ACTION_NONE, 0),
            }
            .hiding(hidden);
            match hidden {
                _ if public(members).is_some() => shared.cidrs.push((*key, *len, claim)),
                Some(h) => reports
                    .entry(owner(h))
                    .or_default()
                    .cidrs
                    .push((*key, *len, claim)),
                // Hides nothing and changes nothing: a shorter network's entry says the same.
                None => {}
            }
        }
        (shared, reports)
    }

    /// Each namespace owning a claimant gets its own entries and its hide reports, admitted whole
    /// within its share, the namespace needing least first.
    fn namespaces(
        &mut self,
        exact: &Claimants,
        cidrs: &Claimants,
        mut reports: HashMap<&'s str, View>,
    ) {
        // A namespace owning a claimant of a key sees its own best claimant there, whatever the
        // visibility; everywhere else it sees what an unknown client sees, so it needs no entry. Each
        // namespace's keys are gathered in one pass over the claims, not by a pass per namespace.
        let own_exact = own_claims(exact, self.services);
        let own_cidrs = own_claims(cidrs, self.services);
        let owners: BTreeSet<&str> = own_exact
            .keys()
            .chain(own_cidrs.keys())
            .chain(reports.keys())
            .copied()
            .collect();
        let mut candidates = Vec::new();
        for ns in owners {
            let mut own = self.own_view(
                own_exact.get(ns).map_or(&[], Vec::as_slice),
                own_cidrs.get(ns).map_or(&[], Vec::as_slice),
            );
            // An exact entry equal to the shared one is redundant: the lookup falls back to it. (A
            // network's is not: without it, a shorter prefix of the namespace's own would win.)
            own.exact.retain(|(ip, claim)| {
                self.tables.exact.get(&AddrKey {
                    ns: NS_UNKNOWN,
                    ip: *ip,
                }) != Some(claim)
            });
            let reported = reports.remove(ns).unwrap_or_default();
            if own.is_empty() && reported.is_empty() {
                continue;
            }
            let cost = self.cost(&own) + self.cost(&reported);
            candidates.push((cost, ns, own, reported));
        }
        // The namespaces needing least first (then by name): a big one cannot crowd out small ones.
        candidates.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        // Ids stop short of `NS_ENROLLED` (a bit of a client's entry, beside its id).
        let room = self.limits.namespaces.min(NS_ENROLLED as usize - 1);
        for (_, ns, own, reported) in candidates {
            let share = self.limits.namespace_bytes;
            let fits = own.is_empty() || self.stats.namespaces < room;
            if !fits || !self.fits_both(&own, &reported, share) {
                self.stats
                    .fell_back(Fallback::HidesUncounted, reported.len());
                if !own.is_empty() {
                    self.stats.fell_back(Fallback::NamespaceFull, 1);
                    self.tables.namespaces.insert(ns.to_string(), NS_PROXY);
                }
                continue;
            }
            self.insert(NS_UNKNOWN, reported);
            if own.is_empty() {
                continue;
            }
            let id = self.stats.namespaces as NsId + 1;
            self.insert(id, own);
            self.tables.namespaces.insert(ns.to_string(), id);
            self.stats.namespaces += 1;
        }
    }
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

    /// Kernel memory `view` would add: its entries and the rewrites it uses not written yet.
    fn cost(&self, view: &View) -> usize {
        let ports: usize = self
            .new_services(view)
            .map(|id| self.claims.get(&id).map_or(0, |c| c.ports.len()))
            .sum();
        view.exact.len() * entry_bytes("exact")
            + view.cidrs.len() * entry_bytes("cidrs")
            + ports * entry_bytes("ports")
    }

    /// The services `view` uses whose rewrites are not written yet, each once.
    fn new_services<'v>(&'v self, view: &'v View) -> impl Iterator<Item = u32> + 'v {
        let mut seen = HashSet::new();
        view.services()
            .filter(move |id| !self.ports_written.contains(id) && seen.insert(*id))
    }

    /// Whether `view` fits the tables' room, and costs at most `share` bytes.
    fn fits(&self, view: &View, share: usize) -> bool {
        self.fits_both(view, &View::default(), share)
    }

    /// Whether two views fit together (entry counts and memory), and cost at most `share` bytes.
    fn fits_both(&self, a: &View, b: &View, share: usize) -> bool {
        let cost = self.cost(a) + self.cost(b);
        self.tables.exact.len() + a.exact.len() + b.exact.len() <= self.limits.exact
            && self.tables.cidrs.len() + a.cidrs.len() + b.cidrs.len() <= self.limits.cidrs
            && cost <= share
            && self.bytes.saturating_add(cost) <= self.limits.bytes
    }

    fn insert(&mut self, ns: NsId, view: View) {
        let new: Vec<u32> = self.new_services(&view).collect();
        for id in new {
            self.write_ports(id);
        }
        self.bytes += view.exact.len() * entry_bytes("exact");
        self.bytes += view.cidrs.len() * entry_bytes("cidrs");
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

    /// Writes service `id`'s rewrites, as far as the ports table has room (a port left out is
    /// the proxy's: the kernel finds no rewrite for it).
    fn write_ports(&mut self, id: u32) {
        if !self.ports_written.insert(id) {
            return;
        }
        let Some(service) = self.claims.get(&id) else {
            return;
        };
        for (key, endpoints) in &service.ports {
            if self.tables.ports.len() >= self.limits.ports
                || self.bytes + entry_bytes("ports") > self.limits.bytes
            {
                self.stats.fell_back(Fallback::PortsFull, 1);
                continue;
            }
            if let Entry::Vacant(slot) = self.tables.ports.entry(*key) {
                slot.insert(endpoints.clone());
                self.bytes += entry_bytes("ports");
            }
        }
    }

    /// What reaching service `id` means in the kernel, worked out the first time it is asked for
    /// (its fallbacks counted then).
    fn claim(&mut self, id: u32) -> Claim {
        if let Some(service) = self.claims.get(&id) {
            return service.claim;
        }
        let (service, fallbacks) = service_claim(id, self.services[id as usize], self.hosts);
        for why in fallbacks {
            self.stats.fell_back(why, 1);
        }
        let claim = service.claim;
        self.claims.insert(id, service);
        claim
    }
}

/// What reaching service `id` (`svc`) means in the kernel: its claim, the rewrites of its ports,
/// and why each port left out goes to the proxy.
pub(super) fn service_claim(
    id: u32,
    svc: &Service,
    hosts: &HostAddresses,
) -> (ServiceClaim, Vec<Fallback>) {
    let mut action = if svc.waypoint_route().is_some() {
        // Its connections go over HBONE to the waypoint: only the proxy speaks it.
        return (
            ServiceClaim {
                claim: Claim::new(ACTION_PROXY, id),
                ports: Vec::new(),
            },
            Vec::new(),
        );
    } else if svc.resolution == Resolution::None {
        ACTION_PASSTHROUGH
    } else {
        ACTION_PROXY
    };
    let mut ports = Vec::new();
    let mut fallbacks = Vec::new();
    if action == ACTION_PROXY {
        let mut seen = BTreeSet::new();
        // The first port of a number is the one the proxy serves.
        for port in svc.ports.iter().filter(|p| seen.insert(p.port)) {
            match backends(port, hosts) {
                Ok(b) => ports.push((PortKey::new(id, port.port), b)),
                Err(why) => fallbacks.push(why),
            }
        }
        if !ports.is_empty() {
            action = ACTION_PORTS;
        }
    }
    let claim = Claim::new(action, id);
    (ServiceClaim { claim, ports }, fallbacks)
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

/// What [`compile_with`] gives `snapshot` with the host addresses `hosts`, from the tables it gave
/// the same snapshot with `before`: when every service naming a host whose addresses changed keeps
/// the same ports rewritable (the usual refresh: a name's addresses moved), only those ports'
/// endpoints are written again; `None` when a claim or a fallback would change (compile whole).
pub(crate) fn with_hosts(
    tables: &Tables,
    stats: &Stats,
    snapshot: &Snapshot,
    before: &HostAddresses,
    hosts: &HostAddresses,
) -> Option<(Tables, Stats)> {
    if tables.config.proxy_everything != 0 {
        return None;
    }
    let changed = |name: &String| before.get(name) != hosts.get(name);
    let mut tables = tables.clone();
    for (id, svc) in snapshot.services().enumerate() {
        if svc.resolution == Resolution::None {
            continue;
        }
        let mut seen = BTreeSet::new();
        for port in svc.ports.iter().filter(|p| seen.insert(p.port)) {
            let names_changed = port.endpoints.iter().any(|ep| match &ep.address {
                EndpointAddress::Host(name) => changed(name),
                EndpointAddress::Ip(_) => false,
            });
            if !names_changed {
                continue;
            }
            let (old, new) = (backends(port, before), backends(port, hosts));
            match (old, new) {
                (Ok(_), Ok(new)) => {
                    let key = PortKey::new(id as u32, port.port);
                    if let Some(slot) = tables.ports.get_mut(&key) {
                        *slot = new;
                    }
                }
                (Err(a), Err(b)) if a == b => {}
                _ => return None,
            }
        }
    }
    Some((tables, stats.clone()))
}
