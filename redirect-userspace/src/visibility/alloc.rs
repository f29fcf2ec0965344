//! Stable virtual IPs for ServiceEntries that declare no addresses.
//!
//! Each `namespace/name/host` hashes to a slot in `240.240.0.0/16` and `2001:2::/48`; a taken slot
//! probes to the next free one. Requests are served oldest first, so a new entry never moves an
//! older entry's address, and the same configuration always gives the same addresses.
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

use crate::config::{Address, Host, Model, Resolution, ServiceEntry};

pub const V4_RANGE: Ipv4Net = match Ipv4Net::new(Ipv4Addr::new(240, 240, 0, 0), 16) {
    Ok(net) => net,
    Err(_) => panic!("valid prefix"),
};
pub const V6_RANGE: Ipv6Net = match Ipv6Net::new(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0), 48) {
    Ok(net) => net,
    Err(_) => panic!("valid prefix"),
};

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

/// Whether an entry gets allocated addresses: it has none, and connections do not simply go to the
/// original destination (resolution NONE). Wildcard hosts never get one.
pub fn needs_allocation(entry: &ServiceEntry) -> bool {
    entry.addresses.is_empty() && entry.resolution != Resolution::None
}

/// Allocations for every entry of `model`, indexed like `model.service_entries`.
pub fn allocate(model: &Model) -> Vec<Vec<Allocation>> {
    let mut taken = Taken::from_model(model);
    let mut requests: Vec<(usize, &str)> = Vec::new();
    for (i, entry) in model.service_entries.iter().enumerate() {
        if !needs_allocation(entry) {
            continue;
        }
        for host in &entry.hosts {
            if let Host::Exact(name) = host {
                requests.push((i, name));
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
        (age(a), &a.namespace, &a.name, ha).cmp(&(age(b), &b.namespace, &b.name, hb))
    });
    let mut out = vec![Vec::new(); model.service_entries.len()];
    for (i, host) in requests {
        let meta = &model.service_entries[i].meta;
        let digest = Sha256::digest(format!("{}/{}/{host}", meta.namespace, meta.name).as_bytes());
        let v4 = taken.next_v4(u16::from_be_bytes([digest[0], digest[1]]));
        if v4.is_none() {
            tracing::warn!(namespace = %meta.namespace, name = %meta.name, host, "no free IPv4 address left in {V4_RANGE}");
        }
        let mut host_bits = [0u8; 16];
        host_bits[6..].copy_from_slice(&digest[2..12]);
        let v6 = taken.next_v6(u128::from_be_bytes(host_bits));
        out[i].push(Allocation {
            host: host.to_string(),
            v4,
            v6,
        });
    }
    out
}

/// Addresses already claimed by a declared address (an entry's or a Service's) or an allocation.
struct Taken {
    ips: HashSet<IpAddr>,
    /// Declared CIDRs that overlap the allocation ranges (almost always none).
    nets: Vec<IpNet>,
}

impl Taken {
    fn from_model(model: &Model) -> Self {
        let mut ips = HashSet::new();
        let mut nets = Vec::new();
        for entry in &model.service_entries {
            for address in &entry.addresses {
                match *address {
                    Address::Ip(ip) => {
                        ips.insert(ip);
                    }
                    Address::Cidr(net) => {
                        let overlaps = match net {
                            IpNet::V4(n) => n.contains(&V4_RANGE) || V4_RANGE.contains(&n),
                            IpNet::V6(n) => n.contains(&V6_RANGE) || V6_RANGE.contains(&n),
                        };
                        if overlaps {
                            nets.push(net);
                        }
                    }
                }
            }
        }
        for service in &model.services {
            ips.extend(service.cluster_ips.iter().copied());
        }
        Taken { ips, nets }
    }

    fn claim(&mut self, ip: IpAddr) -> bool {
        if self.nets.iter().any(|n| n.contains(&ip)) {
            return false;
        }
        self.ips.insert(ip)
    }

    fn next_v4(&mut self, start: u16) -> Option<Ipv4Addr> {
        let base = u32::from(V4_RANGE.network());
        (0..=u16::MAX)
            .map(|k| start.wrapping_add(k))
            // Skip the network and broadcast addresses of the range.
            .filter(|&offset| offset != 0 && offset != u16::MAX)
            .map(|offset| Ipv4Addr::from(base + u32::from(offset)))
            .find(|&ip| self.claim(IpAddr::V4(ip)))
    }

    fn next_v6(&mut self, start: u128) -> Option<Ipv6Addr> {
        let base = u128::from(V6_RANGE.network());
        let mask = (1u128 << 80) - 1;
        (0..1024u128)
            .map(|k| (start.wrapping_add(k)) & mask)
            .filter(|&offset| offset != 0)
            .map(|offset| Ipv6Addr::from(base | offset))
            .find(|&ip| self.claim(IpAddr::V6(ip)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(ips: &[&str], nets: &[&str]) -> Taken {
        Taken {
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            nets: nets.iter().map(|s| s.parse().unwrap()).collect(),
        }
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
                taken: taken(&[], &[]),
                start: 0x0102,
                want: Some("240.240.1.2"),
            },
            Case {
                name: "taken slot probes to the next",
                taken: taken(&["240.240.1.2"], &[]),
                start: 0x0102,
                want: Some("240.240.1.3"),
            },
            Case {
                name: "network address is skipped",
                taken: taken(&[], &[]),
                start: 0,
                want: Some("240.240.0.1"),
            },
            Case {
                name: "broadcast address is skipped and wraps",
                taken: taken(&[], &[]),
                start: u16::MAX,
                want: Some("240.240.0.1"),
            },
            Case {
                name: "a declared CIDR blocks its addresses",
                taken: taken(&[], &["240.240.1.0/24"]),
                start: 0x0102,
                want: Some("240.240.2.0"),
            },
            Case {
                name: "full range gives none",
                taken: taken(&[], &["240.240.0.0/16"]),
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
        let mut t = taken(&[], &[]);
        let older = t.next_v4(0x0505);
        let newer = t.next_v4(0x0505);
        assert_eq!(older, Some("240.240.5.5".parse().unwrap()));
        assert_eq!(newer, Some("240.240.5.6".parse().unwrap()));
    }
}
