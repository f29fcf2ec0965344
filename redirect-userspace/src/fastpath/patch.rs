//! A change to a few services compiled as a change to the tables before it. Only the entries of
//! the addresses those services claim, before or after, are worked out again, by the rules of the
//! whole compile (`compile`), and so are the rewrites and fallbacks of every service claiming one
//! of them. The result is what the whole compile gives, but for the numbers the namespaces go by
//! (a namespace keeps its number; a new one takes the next).
//!
//! It applies only where the budget played no part: the tables before hold everything (no budget
//! fallback), and after the change every namespace touched still fits its share and the tables
//! their room. Then the whole compile admits every namespace whatever their order, and what a
//! namespace holds depends on its own services alone. Networks (CIDRs) are left to the whole
//! compile: a network's entry depends on every network holding it.
use std::collections::{BTreeSet, HashMap, HashSet};

use redirect_common::fastpath::{
    ACTION_NONE, ACTION_PORTS, AddrKey, Claim, IpKey, NS_ENROLLED, NS_UNKNOWN,
};

use super::{
    compile::{HostAddresses, ServiceClaim, service_claim},
    limits::{Fallback, Limits, Stats},
    memory::entry_bytes,
    tables::{NsId, Tables},
};
use crate::state::{Service, ServiceVisibility, Snapshot};

/// Above this many services changed at once, the whole compile is as quick.
const MOST_CHANGED: usize = 64;

/// With any of these the tables before depend on the order the namespaces were admitted in.
const BUDGET_FALLBACKS: [Fallback; 4] = [
    Fallback::SharedFull,
    Fallback::NamespaceFull,
    Fallback::HidesUncounted,
    Fallback::PortsFull,
];

/// The tables the whole compile gives `after` with `hosts`, from those it gave `before` (`tables`
/// and `stats`, with the same hosts and limits): `None` when the patch does not apply (see the
/// module docs) and the whole compile must run.
pub(super) fn services_changed(
    before: &Snapshot,
    tables: &Tables,
    stats: &Stats,
    after: &Snapshot,
    limits: Limits,
    hosts: &HostAddresses,
) -> Option<(Tables, Stats)> {
    if tables.config.proxy_everything != 0
        || BUDGET_FALLBACKS
            .iter()
            .any(|f| stats.fallbacks.contains_key(f))
    {
        return None;
    }
    let changed = after.services_changed_in_place(before, MOST_CHANGED)?;
    let mut old = Side::of(before);
    let mut new = Side::of(after);
    let scope = Scope::of(&changed, &mut old, &mut new, hosts)?;

    let mut patch = Patch {
        before: tables,
        out: tables.clone(),
        stats: stats.clone(),
        old: &old,
        new: &new,
        scope: &scope,
    };
    patch.entries()?;
    patch.rewrites()?;
    patch.fallbacks()?;
    patch.within(limits)?;
    let Patch { out, mut stats, .. } = patch;
    stats.namespaces = out.namespaces.len();
    stats.exact = out.exact.len();
    stats.cidrs = out.cidrs.len();
    stats.ports = out.ports.len();
    Some((out, stats))
}

/// What a patch compiles again: the keys the changed services claim, their claimants, and the
/// namespaces of those, each counted whole.
struct Scope<'s> {
    keys: HashSet<IpKey>,
    /// Every claimant of those keys: its entries, rewrites and fallbacks may change.
    touched: BTreeSet<u32>,
    namespaces: BTreeSet<&'s str>,
    /// The services of those namespaces: what each holds is counted against its share.
    counted: Vec<u32>,
}

impl<'s> Scope<'s> {
    /// The scope of the change to `changed`, with both sides gathered and claimed over it;
    /// `None` when a network is among them (the patch does not apply).
    fn of(
        changed: &[u32],
        old: &mut Side<'s>,
        new: &mut Side<'s>,
        hosts: &HostAddresses,
    ) -> Option<Self> {
        // The keys the changed services claim, in either version.
        let mut keys = HashSet::new();
        for &id in changed {
            for svc in old.service(id).into_iter().chain(new.service(id)) {
                if !svc.cidrs.is_empty() {
                    return None;
                }
                keys.extend(svc.vips().map(IpKey::new));
            }
        }
        old.gather(&keys);
        new.gather(&keys);
        let touched: BTreeSet<u32> = keys
            .iter()
            .flat_map(|k| old.members(k).iter().chain(new.members(k)))
            .copied()
            .collect();
        let mut namespaces = BTreeSet::new();
        for &id in &touched {
            for svc in old.service(id).into_iter().chain(new.service(id)) {
                namespaces.insert(svc.namespace.as_str());
            }
        }
        let counted: Vec<u32> = (0..new.services.len() as u32)
            .filter(|&id| namespaces.contains(new.services[id as usize].namespace.as_str()))
            .collect();
        if touched
            .iter()
            .filter_map(|&id| old.service(id))
            .chain(counted.iter().filter_map(|&id| new.service(id)))
            .any(|svc| !svc.cidrs.is_empty())
        {
            return None;
        }
        old.gather(&touched.iter().flat_map(|&id| old.keys(id)).collect());
        let wanted = touched.iter().chain(&counted).flat_map(|&id| new.keys(id));
        new.gather(&wanted.collect());
        old.claim_all(touched.iter().copied(), hosts);
        new.claim_all(touched.iter().chain(&counted).copied(), hosts);
        Some(Scope {
            keys,
            touched,
            namespaces,
            counted,
        })
    }
}

/// The tables being patched, from the ones compiled `before`, between the two sides.
struct Patch<'p, 's> {
    before: &'p Tables,
    out: Tables,
    stats: Stats,
    old: &'p Side<'s>,
    new: &'p Side<'s>,
    scope: &'p Scope<'s>,
}

impl Patch<'_, '_> {
    /// The entries of the keys, again.
    fn entries(&mut self) -> Option<()> {
        let (old, new, out) = (self.old, self.new, &mut self.out);
        for key in &self.scope.keys {
            out.exact.remove(&AddrKey {
                ns: NS_UNKNOWN,
                ip: *key,
            });
            for (ns, _) in old.own_best(key) {
                if let Some(&id) = self.before.namespaces.get(ns) {
                    out.exact.remove(&AddrKey { ns: id, ip: *key });
                }
            }
        }
        for key in &self.scope.keys {
            let shared = new.shared_entry(key)?;
            if let Some(claim) = shared {
                let shared_key = AddrKey {
                    ns: NS_UNKNOWN,
                    ip: *key,
                };
                out.exact.insert(shared_key, claim);
            }
            for (ns, best) in new.own_best(key) {
                let claim = new.claim(best)?;
                // Equal to the shared entry: the lookup falls back to it.
                if Some(claim) == shared {
                    continue;
                }
                let id = match out.namespaces.get(ns) {
                    Some(&id) => id,
                    None => {
                        let id = next_id(out)?;
                        out.namespaces.insert(ns.to_string(), id);
                        id
                    }
                };
                out.exact.insert(AddrKey { ns: id, ip: *key }, claim);
            }
        }
        Some(())
    }

    /// Rewrites: a service's are written while an entry leads to them.
    fn rewrites(&mut self) -> Option<()> {
        let touched = &self.scope.touched;
        let rewritten_before: Vec<u32> = (touched.iter().copied())
            .filter(|&id| (self.old.service(id)).is_some_and(|svc| rewrites(self.before, svc, id)))
            .collect();
        for &id in &rewritten_before {
            for (port, _) in self.old.ports(id)? {
                self.out.ports.remove(port);
            }
        }
        for &id in touched {
            if (self.new.service(id)).is_some_and(|svc| rewrites(&self.out, svc, id)) {
                for (port, endpoints) in self.new.ports(id)? {
                    self.out.ports.insert(*port, endpoints.clone());
                }
            }
        }
        Some(())
    }

    /// Fallbacks: a service's are counted once it is a key's winner or its namespace's best
    /// there.
    fn fallbacks(&mut self) -> Option<()> {
        let fallbacks = &mut self.stats.fallbacks;
        for &id in &self.scope.touched {
            if self.old.is_claimed(id) {
                for why in self.old.fallbacks(id)? {
                    let count = fallbacks.entry(*why).or_default();
                    *count = count.saturating_sub(1);
                }
            }
            if self.new.is_claimed(id) {
                for why in self.new.fallbacks(id)? {
                    *fallbacks.entry(*why).or_default() += 1;
                }
            }
        }
        fallbacks.retain(|_, n| *n > 0);
        Some(())
    }

    /// Each namespace touched within its share (one left without an entry of its own gives its
    /// number back), and the tables within theirs.
    fn within(&mut self, limits: Limits) -> Option<()> {
        let out = &mut self.out;
        for ns in &self.scope.namespaces {
            let held = self.new.held_by(out, ns, &self.scope.counted)?;
            if held.bytes() > limits.namespace_bytes {
                return None;
            }
            if held.own == 0 {
                out.namespaces.remove(*ns);
            }
        }
        let bytes = out.exact.len() * entry_bytes("exact")
            + out.cidrs.len() * entry_bytes("cidrs")
            + out.ports.len() * entry_bytes("ports");
        let room = limits.namespaces.min(NS_ENROLLED as usize - 1);
        let fits = out.exact.len() <= limits.exact
            && out.ports.len() <= limits.ports
            && bytes <= limits.bytes
            && out.namespaces.len() <= room;
        fits.then_some(())
    }
}

/// The number a namespace new to the tables takes.
fn next_id(tables: &Tables) -> Option<NsId> {
    let next = tables.namespaces.values().max().map_or(1, |id| id + 1);
    (next < NS_ENROLLED).then_some(next)
}

/// Whether an entry of `tables` leads to the rewrites of service `id`: the shared one or its
/// namespace's at one of its keys (no other entry names it).
fn rewrites(tables: &Tables, svc: &Service, id: u32) -> bool {
    let namespaces = [NS_UNKNOWN, tables.namespace_id(&svc.namespace)];
    svc.vips().map(IpKey::new).any(|ip| {
        namespaces.iter().any(|&ns| {
            tables
                .exact
                .get(&AddrKey { ns, ip })
                .is_some_and(|c| c.service == id && c.action == ACTION_PORTS)
        })
    })
}

/// What one namespace's own entries take: [`Compiler::cost`](super::compile) of its own view
/// and of its hide reports.
struct Held {
    own: usize,
    reports: usize,
    ports: usize,
}

impl Held {
    fn bytes(&self) -> usize {
        (self.own + self.reports) * entry_bytes("exact") + self.ports * entry_bytes("ports")
    }
}

/// One snapshot's services by id (their position), and what the patch worked out of them.
struct Side<'s> {
    services: Vec<&'s Service>,
    /// The claimants of each key gathered so far, in rank order.
    claimants: HashMap<IpKey, Vec<u32>>,
    claims: HashMap<u32, (ServiceClaim, Vec<Fallback>)>,
}

impl<'s> Side<'s> {
    fn of(snapshot: &'s Snapshot) -> Self {
        Side {
            services: snapshot.services().collect(),
            claimants: HashMap::new(),
            claims: HashMap::new(),
        }
    }

    fn service(&self, id: u32) -> Option<&'s Service> {
        self.services.get(id as usize).copied()
    }

    /// The exact keys service `id` claims.
    fn keys(&self, id: u32) -> impl Iterator<Item = IpKey> + 's {
        self.service(id)
            .into_iter()
            .flat_map(|svc| svc.vips().map(IpKey::new))
    }

    /// Gathers the claimants of `keys` not gathered yet, in one pass over the services, as the
    /// whole compile does.
    fn gather(&mut self, keys: &HashSet<IpKey>) {
        let wanted: HashSet<IpKey> = keys
            .iter()
            .filter(|k| !self.claimants.contains_key(k))
            .copied()
            .collect();
        if wanted.is_empty() {
            return;
        }
        for key in &wanted {
            self.claimants.insert(*key, Vec::new());
        }
        for (id, svc) in self.services.iter().enumerate() {
            for ip in svc.vips() {
                let key = IpKey::new(ip);
                if wanted.contains(&key)
                    && let Some(members) = self.claimants.get_mut(&key)
                {
                    members.push(id as u32);
                }
            }
        }
    }

    fn members(&self, key: &IpKey) -> &[u32] {
        self.claimants.get(key).map_or(&[], Vec::as_slice)
    }

    fn claim_all(&mut self, ids: impl Iterator<Item = u32>, hosts: &HostAddresses) {
        for id in ids {
            if let Some(svc) = self.service(id) {
                self.claims
                    .entry(id)
                    .or_insert_with(|| service_claim(id, svc, hosts));
            }
        }
    }

    fn claim(&self, id: u32) -> Option<Claim> {
        self.claims.get(&id).map(|(c, _)| c.claim)
    }

    fn ports(
        &self,
        id: u32,
    ) -> Option<&[(redirect_common::fastpath::PortKey, super::PortEndpoints)]> {
        self.claims.get(&id).map(|(c, _)| c.ports.as_slice())
    }

    fn fallbacks(&self, id: u32) -> Option<&[Fallback]> {
        self.claims.get(&id).map(|(_, f)| f.as_slice())
    }

    fn first(&self, key: &IpKey, visibility: ServiceVisibility) -> Option<u32> {
        self.members(key)
            .iter()
            .copied()
            .find(|&m| self.services[m as usize].visibility == visibility)
    }

    /// The entry every client shares at `key`: the PUBLIC winner, hiding the first NAMESPACE
    /// claimant; without a winner, the report of that hide. `None` when a claim was not worked
    /// out (the patch gives up).
    fn shared_entry(&self, key: &IpKey) -> Option<Option<Claim>> {
        let hidden = self.first(key, ServiceVisibility::Namespace);
        Some(match self.first(key, ServiceVisibility::Public) {
            Some(winner) => Some(self.claim(winner)?.hiding(hidden)),
            None => hidden.map(|h| Claim::new(ACTION_NONE, 0).hiding(Some(h))),
        })
    }

    /// Each namespace claiming `key`, with its best ranked claimant there.
    fn own_best(&self, key: &IpKey) -> Vec<(&'s str, u32)> {
        let mut best: Vec<(&'s str, u32)> = Vec::new();
        for &id in self.members(key) {
            let ns = self.services[id as usize].namespace.as_str();
            if !best.iter().any(|(n, _)| *n == ns) {
                best.push((ns, id));
            }
        }
        best
    }

    /// Whether the whole compile works out service `id`'s claim (and counts its fallbacks): it
    /// wins one of its keys, or is its namespace's best there.
    fn is_claimed(&self, id: u32) -> bool {
        let Some(svc) = self.service(id) else {
            return false;
        };
        self.keys(id).any(|key| {
            self.first(&key, ServiceVisibility::Public) == Some(id)
                || self
                    .own_best(&key)
                    .iter()
                    .any(|&(ns, best)| ns == svc.namespace && best == id)
        })
    }

    /// What namespace `ns` holds in `tables`, from its services among `counted`.
    fn held_by(&self, tables: &Tables, ns: &str, counted: &[u32]) -> Option<Held> {
        let mut held = Held {
            own: 0,
            reports: 0,
            ports: 0,
        };
        let mut seen = HashSet::new();
        let mut rewritten = BTreeSet::new();
        let of_namespace = counted
            .iter()
            .copied()
            .filter(|&id| self.services[id as usize].namespace == ns);
        for id in of_namespace {
            for key in self.keys(id) {
                if !seen.insert(key) {
                    continue;
                }
                let shared = tables.exact.get(&AddrKey {
                    ns: NS_UNKNOWN,
                    ip: key,
                });
                let best = self.own_best(&key).into_iter().find(|(n, _)| *n == ns);
                if let Some((_, best)) = best {
                    let claim = self.claim(best)?;
                    if shared != Some(&claim) {
                        held.own += 1;
                        if claim.action == ACTION_PORTS {
                            rewritten.insert(best);
                        }
                    }
                }
                let reports_here = shared.is_some_and(|c| {
                    c.action == ACTION_NONE
                        && c.hidden()
                            .and_then(|h| self.service(h))
                            .is_some_and(|h| h.namespace == ns)
                });
                held.reports += usize::from(reports_here);
            }
        }
        // Rewrites a shared entry leads to were written with the shared entries, not counted here.
        for id in rewritten {
            let shared_leads = self.keys(id).any(|ip| {
                tables
                    .exact
                    .get(&AddrKey { ns: NS_UNKNOWN, ip })
                    .is_some_and(|c| c.service == id && c.action == ACTION_PORTS)
            });
            if !shared_leads {
                held.ports += self.ports(id)?.len();
            }
        }
        Some(held)
    }
}
