//! Stable virtual IPs for ServiceEntries that declare no addresses.
//!
//! Each `namespace/name/host` hashes to a slot in `240.240.0.0/16` and `2001:2::/48`; a taken slot
//! probes to the next free one. Requests are served oldest first, so a new entry never moves an
//! older entry's address, and the same configuration always gives the same addresses.
//!
//! Only exact addresses are avoided: a declared IP, a Service clusterIP, an earlier allocation. A
//! declared CIDR takes nothing from the pool, so one tenant declaring `0.0.0.0/0` never costs the
//! others their addresses (lookups try exact addresses before CIDRs, so an allocated address inside
//! a declared CIDR still reaches its own entry). The IPv4 pool finds the next free slot through a
//! "next free" forest, so a full pool costs nothing per further request.
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

use super::Discovery;
use crate::config::{Address, ConfigError, Host, Model, Resolution, ServiceEntry};

/// Istio's ranges: the agent allocates from the same ones its allocator does.
pub(crate) const V4_RANGE: Ipv4Net = crate::config::ALLOCATION_V4;
pub(crate) const V6_RANGE: Ipv6Net = crate::config::ALLOCATION_V6;

/// The status condition on an entry left without an IPv4 address (only written then).
pub(crate) const ADDRESS_ALLOCATED: &str = "istio.io/AddressAllocated";
pub(crate) const ADDRESS_POOL_EXHAUSTED: &str = "AddressPoolExhausted";

/// Slots in the IPv4 range (offsets 0 and 65,535, the network and broadcast addresses, never given).
const V4_SLOTS: usize = 1 << 16;

/// The addresses allocated to one host of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub host: String,
    /// `None` only when all 65,534 IPv4 slots are taken.
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl Allocation {
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.v4
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.v6.map(IpAddr::V6))
    }
}

/// The label by which an entry opts out of allocation (`"false"`, any case), as in Istio.
pub(super) const AUTOALLOCATE_LABEL: &str = "networking.istio.io/enable-autoallocate-ip";

/// Whether an entry gets allocated addresses: it has none, connections do not simply go to the
/// original destination (resolution NONE), and it has not opted out by label.
pub(super) fn needs_allocation(entry: &ServiceEntry) -> bool {
    let opted_out = entry
        .meta
        .labels
        .get(AUTOALLOCATE_LABEL)
        .is_some_and(|v| v.eq_ignore_ascii_case("false"));
    entry.addresses.is_empty() && entry.resolution != Resolution::None && !opted_out
}

/// Whether a host of an entry that needs allocation gets an address: an exact host always; a
/// wildcard only with resolution DYNAMIC_DNS, whose clients ask for names under it (Istio's
/// allocator keeps those hosts too).
fn allocates_host(entry: &ServiceEntry, host: &Host) -> bool {
    matches!(host, Host::Exact(_)) || entry.resolution == Resolution::DynamicDns
}

/// Allocations for every entry of `model`, indexed like `model.service_entries`. An entry of a
/// namespace the control plane does not discover gets none.
pub fn allocate(model: &Model, discovery: &Discovery) -> Vec<Vec<Allocation>> {
    let mut taken = Taken::from_model(model);
    // Per host, what `status.addresses` gave it (both families, or one, or none): the pools fill
    // in what is missing.
    let mut requests: Vec<(usize, Allocation)> = Vec::new();
    let mut out = vec![Vec::new(); model.service_entries.len()];
    for (i, entry) in model.service_entries.iter().enumerate() {
        if !needs_allocation(entry) || !discovery.sees(&entry.meta.namespace) {
            continue;
        }
        for host in &entry.hosts {
            if !allocates_host(entry, host) {
                continue;
            }
            let host = host.to_string();
            match from_status(entry, &host) {
                Some(given) if given.v4.is_some() && given.v6.is_some() => out[i].push(given),
                Some(given) => requests.push((i, given)),
                None => requests.push((
                    i,
                    Allocation {
                        host,
                        v4: None,
                        v6: None,
                    },
                )),
            }
        }
    }
    // Oldest first (no timestamp counts as newest), then by name: a stable, total order.
    requests.sort_by(|(a, ha), (b, hb)| {
        let (a, b) = (
            &model.service_entries[*a].meta,
            &model.service_entries[*b].meta,
        );
        let age =
            |m: &crate::config::ObjectMeta| (m.creation_timestamp.is_none(), m.creation_timestamp);
        (age(a), &a.namespace, &a.name, &ha.host).cmp(&(age(b), &b.namespace, &b.name, &hb.host))
    });
    for (i, mut given) in requests {
        let meta = &model.service_entries[i].meta;
        let digest =
            Sha256::digest(format!("{}/{}/{}", meta.namespace, meta.name, given.host).as_bytes());
        if given.v4.is_none() {
            given.v4 = taken.next_v4(u16::from_be_bytes([digest[0], digest[1]]));
        }
        if given.v6.is_none() {
            let mut host_bits = [0u8; 16];
            host_bits[6..].copy_from_slice(&digest[2..12]);
            given.v6 = taken.next_v6(u128::from_be_bytes(host_bits));
        }
        out[i].push(given);
    }
    out
}

/// The addresses Istio's allocator wrote in the entry's `status.addresses` for `host`, if any: every
/// proxy of the mesh answers those, so the agent does too. Only values inside Istio's ranges are
/// in the model (the loader refuses the others), so none of these is anything but an allocation.
/// A host given one family only (the other absent, or refused) gets the other from the pools.
fn from_status(entry: &ServiceEntry, host: &str) -> Option<Allocation> {
    let mut given = entry.status_addresses.iter().filter(|a| a.host == host);
    let v4 = given.clone().find_map(|a| match a.ip.to_canonical() {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(_) => None,
    });
    let v6 = given.find_map(|a| match a.ip.to_canonical() {
        IpAddr::V6(ip) => Some(ip),
        IpAddr::V4(_) => None,
    });
    (v4.is_some() || v6.is_some()).then(|| Allocation {
        host: host.to_string(),
        v4,
        v6,
    })
}

/// Addresses already claimed by a declared address (an entry's or a Service's) or an allocation.
struct Taken {
    v4: FreeSlots,
    /// IPv6 addresses claimed inside [`V6_RANGE`] (the range is too large for a slot table).
    v6: HashSet<Ipv6Addr>,
}

impl Taken {
    fn from_model(model: &Model) -> Self {
        let declared = model
            .service_entries
            .iter()
            .flat_map(|e| &e.addresses)
            .filter_map(|a| match *a {
                Address::Ip(ip) => Some(ip),
                // A declared CIDR takes nothing from the pool (see the module comment).
                Address::Cidr(_) => None,
            })
            .chain(
                model
                    .services
                    .iter()
                    .flat_map(|s| s.cluster_ips.iter().copied()),
            )
            // Istio's allocations are taken too: none of the agent's may collide with them.
            .chain(
                model
                    .service_entries
                    .iter()
                    .flat_map(|e| e.status_addresses.iter().map(|a| a.ip)),
            );
        Taken::from_ips(declared)
    }

    fn from_ips(ips: impl IntoIterator<Item = IpAddr>) -> Self {
        let mut taken = Taken {
            v4: FreeSlots::new(),
            v6: HashSet::new(),
        };
        for ip in ips.into_iter().filter(|ip| in_pool(*ip)) {
            match ip {
                IpAddr::V4(ip) => taken.v4.take(v4_offset(ip)),
                IpAddr::V6(ip) => {
                    taken.v6.insert(ip);
                }
            }
        }
        taken
    }

    fn next_v4(&mut self, start: u16) -> Option<Ipv4Addr> {
        let slot = self.v4.next_free(usize::from(start))?;
        self.v4.take(slot);
        Some(Ipv4Addr::from(u32::from(V4_RANGE.network()) + slot as u32))
    }

    fn next_v6(&mut self, start: u128) -> Option<Ipv6Addr> {
        let base = u128::from(V6_RANGE.network());
        let mask = (1u128 << 80) - 1;
        (0..1024u128)
            .map(|k| (start.wrapping_add(k)) & mask)
            .filter(|&offset| offset != 0)
            .map(|offset| Ipv6Addr::from(base | offset))
            .find(|&ip| self.v6.insert(ip))
    }
}

/// Whether a declared (or Istio-allocated) address takes a slot of the pools.
fn in_pool(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => V4_RANGE.contains(&ip),
        IpAddr::V6(ip) => V6_RANGE.contains(&ip),
    }
}

/// Whether the pools' allocations, every entry's, owe nothing to `entry`: it needs no address of
/// its own and takes no slot from the pools (no declared address nor `status.addresses` in them).
/// A change to such an entry alone moves no other entry's allocated address. An entry with a
/// refused `status.addresses` value is not: its errors are the pools' ([`refused_status`]), told
/// again by a whole resolution only.
pub(super) fn outside_pools(entry: &ServiceEntry) -> bool {
    let declared = entry.addresses.iter().filter_map(|a| match a {
        Address::Ip(ip) => Some(*ip),
        // A declared CIDR takes nothing from the pool (see the module comment).
        Address::Cidr(_) => None,
    });
    let given = entry.status_addresses.iter().map(|a| a.ip);
    !needs_allocation(entry)
        && entry.refused_status.is_empty()
        && !declared.chain(given).any(in_pool)
}

/// The error of every `status.addresses` value the loader refused, entry by entry: those entries
/// are in force without them (see `config::ServiceEntry::refused_status`).
pub(super) fn refused_status(model: &Model) -> impl Iterator<Item = ConfigError> + '_ {
    model
        .service_entries
        .iter()
        .flat_map(|e| e.refused_status.iter().cloned())
}

fn v4_offset(ip: Ipv4Addr) -> usize {
    (u32::from(ip) - u32::from(V4_RANGE.network())) as usize
}

/// The IPv4 slots, each pointing at a slot that may be free: a free slot points at itself, a taken
/// one onward (wrapping). Following the pointers with path halving finds the next free slot in
/// amortised near-constant time; a count of free slots answers "full" at once.
struct FreeSlots {
    next: Vec<u16>,
    free: usize,
}

impl FreeSlots {
    fn new() -> Self {
        let mut slots = FreeSlots {
            next: (0..V4_SLOTS).map(|i| i as u16).collect(),
            free: V4_SLOTS,
        };
        // The range's network and broadcast addresses are never given out.
        slots.take(0);
        slots.take(V4_SLOTS - 1);
        slots
    }

    /// The first free slot at or after `start`, wrapping; `None` when every slot is taken.
    fn next_free(&mut self, start: usize) -> Option<usize> {
        if self.free == 0 {
            return None;
        }
        let mut slot = start;
        loop {
            let next = usize::from(self.next[slot]);
            if next == slot {
                return Some(slot);
            }
            // Path halving: point this slot past its successor, so later searches skip both.
            self.next[slot] = self.next[next];
            slot = next;
        }
    }

    fn take(&mut self, slot: usize) {
        if usize::from(self.next[slot]) == slot {
            self.next[slot] = ((slot + 1) % V4_SLOTS) as u16;
            self.free -= 1;
        }
    }
}

/// One error per entry that needed an IPv4 address and got none because the pool is full: the
/// entry loads without it (clients that see it are answered with its IPv6 address only, or
/// forwarded), and the error names it until the pool has room.
pub(super) fn exhausted<'a>(
    model: &Model,
    allocations: impl IntoIterator<Item = &'a [Allocation]>,
) -> Vec<ConfigError> {
    model
        .service_entries
        .iter()
        .zip(allocations)
        .filter_map(|(entry, allocated)| {
            let missing: Vec<&str> = allocated
                .iter()
                .filter(|a| a.v4.is_none())
                .map(|a| a.host.as_str())
                .collect();
            let first = missing.first()?;
            let more = match missing.len() {
                1 => String::new(),
                n => format!(" and {} more host(s)", n - 1),
            };
            Some(ConfigError::new(
                entry.meta.file.clone(),
                Some(format!(
                    "ServiceEntry {}/{}",
                    entry.meta.namespace, entry.meta.name
                )),
                Some("spec.addresses".into()),
                format!(
                    "no IPv4 address left to allocate for {first}{more}: all {} addresses of {V4_RANGE} are taken; declare spec.addresses",
                    V4_SLOTS - 2
                ),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_sources;

    fn taken(ips: &[&str]) -> Taken {
        Taken::from_ips(ips.iter().map(|s| s.parse::<IpAddr>().unwrap()))
    }

    /// Every IPv4 slot of the range taken.
    fn full() -> Taken {
        let base = u32::from(V4_RANGE.network());
        Taken::from_ips((1..65535u32).map(|k| IpAddr::V4(Ipv4Addr::from(base + k))))
    }

    #[test]
    fn probing_rules() {
        struct Case {
            name: &'static str,
            taken: Taken,
            start: u16,
            want: Option<&'static str>,
        }
        let cases = [
            Case {
                name: "free slot is used as hashed",
                taken: taken(&[]),
                start: 0x0102,
                want: Some("240.240.1.2"),
            },
            Case {
                name: "taken slot probes to the next",
                taken: taken(&["240.240.1.2"]),
                start: 0x0102,
                want: Some("240.240.1.3"),
            },
            Case {
                name: "a run of taken slots probes past its end",
                taken: taken(&["240.240.1.2", "240.240.1.3", "240.240.1.4"]),
                start: 0x0102,
                want: Some("240.240.1.5"),
            },
            Case {
                name: "network address is skipped",
                taken: taken(&[]),
                start: 0,
                want: Some("240.240.0.1"),
            },
            Case {
                name: "broadcast address is skipped and wraps",
                taken: taken(&[]),
                start: u16::MAX,
                want: Some("240.240.0.1"),
            },
            Case {
                name: "addresses outside the range take nothing",
                taken: taken(&["10.0.1.2", "2001:db8::1"]),
                start: 0x0102,
                want: Some("240.240.1.2"),
            },
            Case {
                name: "full range gives none",
                taken: full(),
                start: 7,
                want: None,
            },
        ];
        for mut case in cases {
            let got = case.taken.next_v4(case.start);
            assert_eq!(got, case.want.map(|s| s.parse().unwrap()), "{}", case.name);
        }
    }

    #[test]
    fn an_older_entry_keeps_its_address_when_a_newer_one_collides() {
        // Two requests for the same slot: the oldest (first served) keeps it.
        let mut t = taken(&[]);
        let older = t.next_v4(0x0505);
        let newer = t.next_v4(0x0505);
        assert_eq!(older, Some("240.240.5.5".parse().unwrap()));
        assert_eq!(newer, Some("240.240.5.6".parse().unwrap()));
    }

    fn entries(namespaces: usize, per_namespace: usize) -> String {
        let mut yaml = String::new();
        for n in 0..namespaces {
            for e in 0..per_namespace {
                yaml.push_str(&format!(
                    "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: e{e}, namespace: ns-{n}}}\nspec: {{hosts: [e{e}.ns-{n}.example.com], resolution: DNS, ports: [{{number: 80, name: http}}]}}\n"
                ));
            }
        }
        yaml
    }

    /// A tenant declaring every address there is costs no other tenant its allocated address.
    #[test]
    fn a_declared_cidr_takes_nothing_from_other_tenants() {
        let others = entries(5, 20);
        let greedy = "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: everything, namespace: team-a}\nspec: {hosts: [all.example.com], addresses: [0.0.0.0/0, \"::/0\", 240.240.0.0/16], resolution: STATIC, ports: [{number: 80, name: http}]}\n";
        let before = load_sources([("o.yaml", others.as_str())]).unwrap();
        let with = format!("{others}{greedy}");
        let after = load_sources([("o.yaml", with.as_str())]).unwrap();
        let by_name = |m: &Model| -> Vec<(String, Vec<Allocation>)> {
            let allocated = allocate(m, &Discovery::of(m));
            m.service_entries
                .iter()
                .zip(allocated)
                .filter(|(e, _)| e.meta.namespace != "team-a")
                .map(|(e, a)| (format!("{}/{}", e.meta.namespace, e.meta.name), a))
                .collect()
        };
        let (b, a) = (by_name(&before), by_name(&after));
        assert_eq!(b.len(), 100);
        assert!(
            b.iter()
                .all(|(_, a)| a.len() == 1 && a[0].v4.is_some() && a[0].v6.is_some())
        );
        assert_eq!(a, b, "allocations unchanged by the CIDR");
        assert!(
            exhausted(
                &after,
                allocate(&after, &Discovery::of(&after))
                    .iter()
                    .map(Vec::as_slice)
            )
            .is_empty()
        );
    }

    #[test]
    fn an_exact_declared_address_is_avoided() {
        let mut t = taken(&["240.240.9.9"]);
        assert_eq!(t.next_v4(0x0909), Some("240.240.9.10".parse().unwrap()));
    }

    /// Past the pool's 65,534 addresses every further entry is an error, with no scan per entry.
    #[test]
    fn exhaustion_is_an_error_on_each_entry_left_without_an_address() {
        // 66,000 copies of one entry, each its own name and host.
        let one = entries(1, 1);
        let mut model = load_sources([("o.yaml", one.as_str())]).unwrap();
        let template = model.service_entries[0].clone();
        model.service_entries = (0..66_000)
            .map(|i| {
                let mut e = (*template).clone();
                e.meta.namespace = format!("ns-{}", i % 66);
                e.meta.name = format!("e{i}");
                e.hosts = vec![Host::Exact(format!("e{i}.example.com"))];
                std::sync::Arc::new(e)
            })
            .collect();
        let allocated = allocate(&model, &Discovery::of(&model));
        let given = allocated.iter().filter(|a| a[0].v4.is_some()).count();
        assert_eq!(given, 65_534);
        let errors = exhausted(&model, allocated.iter().map(Vec::as_slice));
        assert_eq!(errors.len(), 66_000 - 65_534);
        let e = &errors[0];
        assert_eq!(e.field.as_deref(), Some("spec.addresses"));
        assert!(
            e.object
                .as_deref()
                .unwrap_or_default()
                .starts_with("ServiceEntry ns-"),
            "{e}"
        );
        assert!(e.message.contains("no IPv4 address left"), "{e}");
        // And a status condition on each such entry.
        let resolution = super::super::resolve(&model);
        let flagged = resolution
            .entries
            .iter()
            .filter(|e| {
                e.conditions
                    .iter()
                    .any(|c| c.type_ == ADDRESS_ALLOCATED && c.reason == ADDRESS_POOL_EXHAUSTED)
            })
            .count();
        assert_eq!(flagged, errors.len());
        // Every allocated address is distinct.
        let distinct: HashSet<Ipv4Addr> = allocated.iter().filter_map(|a| a[0].v4).collect();
        assert_eq!(distinct.len(), given);
    }
}
