//! The service store: services in rank order, and the indexes lookups use.
use std::{collections::HashMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;

use super::{
    bucket::{Bucket, Choice},
    service::Service,
};

#[derive(Debug, Default)]
pub(crate) struct ServiceStore {
    /// Sorted by [`Service::rank_key`]; each shared with the snapshots that kept it (see
    /// `Snapshot::with_entries`).
    pub services: Vec<Arc<Service>>,
    /// Exact addresses (VIPs, declared or allocated): the first step of an outbound lookup.
    by_vip: HashMap<IpAddr, Bucket>,
    /// CIDR addresses: the second step, longest prefix first.
    by_cidr: CidrIndex,
    /// Exact host names (lower case): DNS.
    by_host: HashMap<Box<str>, Bucket>,
    /// Wildcard hosts by the suffix after `*.`: DNS, after exact names.
    by_wildcard: HashMap<Box<str>, Bucket>,
    /// The longest wildcard suffix: longer parts of a query name need no probe.
    longest_wildcard: usize,
    /// The last label of every indexed name (a handful: `com`, `local`, ...): most names the
    /// resolver tries (`x.example.com.team-a.svc`) end in none of them and need no hash lookup.
    last_labels: Vec<Box<str>>,
}

fn last_label(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(_, last)| last)
}

/// One hash table per prefix length, longest first: a lookup masks the address once per length in
/// use (a handful), instead of scanning every CIDR.
#[derive(Debug, Default)]
struct CidrIndex {
    v4: Vec<(u8, HashMap<u32, Bucket>)>,
    v6: Vec<(u8, HashMap<u128, Bucket>)>,
}

fn mask_v4(ip: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        ip & (u32::MAX << (32 - u32::from(len)))
    }
}

fn mask_v6(ip: u128, len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        ip & (u128::MAX << (128 - u32::from(len)))
    }
}

impl ServiceStore {
    pub(super) fn new(services: Vec<Arc<Service>>) -> Self {
        // Sized once (about one address and one name per service): no rehash on the way.
        let mut store = ServiceStore {
            by_vip: HashMap::with_capacity(services.len()),
            by_host: HashMap::with_capacity(services.len()),
            ..ServiceStore::default()
        };
        for (i, svc) in services.iter().enumerate() {
            let i = i as u32;
            for ip in svc.vips() {
                store.by_vip.entry(ip).or_default().push(i);
            }
            for net in &svc.cidrs {
                store.by_cidr.insert(*net, i);
            }
            // Only a service with an address can answer DNS; one without is not in the name indexes,
            // nor is a partial wildcard (`*x`), which names no domain.
            let partial_wildcard = svc.hostname.starts_with('*') && !svc.hostname.starts_with("*.");
            if !svc.has_addresses() || partial_wildcard {
                continue;
            }
            let last = last_label(&svc.hostname);
            if !store.last_labels.iter().any(|l| **l == *last) {
                store.last_labels.push(last.into());
            }
            match svc.hostname.strip_prefix("*.") {
                Some(suffix) => {
                    store.longest_wildcard = store.longest_wildcard.max(suffix.len());
                    store.by_wildcard.entry(suffix.into()).or_default().push(i)
                }
                None => store
                    .by_host
                    .entry(svc.hostname.as_str().into())
                    .or_default()
                    .push(i),
            }
        }
        store
            .by_cidr
            .v4
            .sort_by_key(|(len, _)| std::cmp::Reverse(*len));
        store
            .by_cidr
            .v6
            .sort_by_key(|(len, _)| std::cmp::Reverse(*len));
        let buckets = store
            .by_vip
            .values_mut()
            .chain(store.by_host.values_mut())
            .chain(store.by_wildcard.values_mut())
            .chain(
                store
                    .by_cidr
                    .v4
                    .iter_mut()
                    .flat_map(|(_, m)| m.values_mut()),
            )
            .chain(
                store
                    .by_cidr
                    .v6
                    .iter_mut()
                    .flat_map(|(_, m)| m.values_mut()),
            );
        for bucket in buckets {
            bucket.seal(&services);
        }
        store.services = services;
        store
    }

    pub(super) fn by_vip(&self, ip: IpAddr, client_ns: Option<&str>) -> Choice<'_> {
        match self.by_vip.get(&ip) {
            Some(bucket) => bucket.choose(&self.services, client_ns),
            None => Choice::default(),
        }
    }

    /// A claimant in the client's own namespace wins over a more specific prefix elsewhere (as
    /// ztunnel prefers the namespace over CIDR specificity); among the rest the longest prefix with a
    /// visible claimant wins, and equal prefixes are ranked.
    pub(super) fn by_cidr(&self, ip: IpAddr, client_ns: Option<&str>) -> Choice<'_> {
        let mut best: Option<&Service> = None;
        let mut hidden = None;
        let mut own = None;
        let mut consider = |bucket: &Bucket| {
            let choice = bucket.choose(&self.services, client_ns);
            hidden = hidden.or(choice.hidden);
            match choice.service {
                Some(svc) if client_ns == Some(svc.namespace.as_str()) => {
                    own = Some(svc);
                    true
                }
                Some(svc) => {
                    best = best.or(Some(svc));
                    // An unknown client has no namespace to prefer: the longest prefix settles it.
                    client_ns.is_none()
                }
                None => false,
            }
        };
        match ip {
            IpAddr::V4(ip) => {
                let ip = u32::from(ip);
                for (len, map) in &self.by_cidr.v4 {
                    if map.get(&mask_v4(ip, *len)).is_some_and(&mut consider) {
                        break;
                    }
                }
            }
            IpAddr::V6(ip) => {
                let ip = u128::from(ip);
                for (len, map) in &self.by_cidr.v6 {
                    if map.get(&mask_v6(ip, *len)).is_some_and(&mut consider) {
                        break;
                    }
                }
            }
        }
        match own {
            Some(svc) => Choice {
                service: Some(svc),
                hidden: None,
            },
            None => Choice {
                service: best,
                hidden,
            },
        }
    }

    /// An exact host name (lower case, no trailing dot); wildcards are not tried.
    pub(super) fn by_exact_host(&self, name: &str, client_ns: Option<&str>) -> Choice<'_> {
        match self.by_host.get(name) {
            Some(bucket) => bucket.choose(&self.services, client_ns),
            None => Choice::default(),
        }
    }

    /// A host name (lower case, no trailing dot): the exact name first, then wildcards from the
    /// most specific (`*.b.example.com` before `*.example.com`).
    pub(super) fn by_host(&self, name: &str, client_ns: Option<&str>) -> Choice<'_> {
        let last = last_label(name);
        if !self.last_labels.iter().any(|l| **l == *last) {
            return Choice::default();
        }
        let mut hidden = None;
        if let Some(bucket) = self.by_host.get(name) {
            let choice = bucket.choose(&self.services, client_ns);
            if choice.service.is_some() {
                return choice;
            }
            hidden = choice.hidden;
        }
        if self.by_wildcard.is_empty() {
            return Choice {
                service: None,
                hidden,
            };
        }
        let mut rest = name;
        while let Some((_, suffix)) = rest.split_once('.') {
            rest = suffix;
            if suffix.len() > self.longest_wildcard {
                continue;
            }
            if let Some(bucket) = self.by_wildcard.get(suffix) {
                let choice = bucket.choose(&self.services, client_ns);
                hidden = hidden.or(choice.hidden);
                if choice.service.is_some() {
                    return Choice {
                        service: choice.service,
                        hidden,
                    };
                }
            }
        }
        Choice {
            service: None,
            hidden,
        }
    }
}

impl CidrIndex {
    fn insert(&mut self, net: IpNet, service: u32) {
        match net {
            IpNet::V4(net) => {
                let len = net.prefix_len();
                let key = mask_v4(u32::from(net.network()), len);
                let slot = match self.v4.iter().position(|(l, _)| *l == len) {
                    Some(p) => p,
                    None => {
                        self.v4.push((len, HashMap::new()));
                        self.v4.len() - 1
                    }
                };
                self.v4[slot].1.entry(key).or_default().push(service);
            }
            IpNet::V6(net) => {
                let len = net.prefix_len();
                let key = mask_v6(u128::from(net.network()), len);
                let slot = match self.v6.iter().position(|(l, _)| *l == len) {
                    Some(p) => p,
                    None => {
                        self.v6.push((len, HashMap::new()));
                        self.v6.len() - 1
                    }
                };
                self.v6[slot].1.entry(key).or_default().push(service);
            }
        }
    }
}
