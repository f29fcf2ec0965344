//! The service store: services in rank order, and the indexes lookups use. Every bucket lists
//! service positions in ascending order, which is rank order, so choosing is one short scan.
use std::{collections::HashMap, net::IpAddr};

use ipnet::IpNet;

use super::service::{Service, ServiceVisibility};

#[derive(Debug, Default)]
pub(crate) struct ServiceStore {
    /// Sorted by [`Service::rank_key`].
    pub services: Vec<Service>,
    /// Exact addresses (VIPs, declared or allocated): the first step of an outbound lookup.
    by_vip: HashMap<IpAddr, Vec<u32>>,
    /// CIDR addresses: the second step, longest prefix first.
    by_cidr: CidrIndex,
    /// Exact host names (lower case): DNS.
    by_host: HashMap<Box<str>, Vec<u32>>,
    /// Wildcard hosts by the suffix after `*.`: DNS, after exact names.
    by_wildcard: HashMap<Box<str>, Vec<u32>>,
}

/// One hash table per prefix length, longest first: a lookup masks the address once per length in
/// use (a handful), instead of scanning every CIDR.
#[derive(Debug, Default)]
struct CidrIndex {
    v4: Vec<(u8, HashMap<u32, Vec<u32>>)>,
    v6: Vec<(u8, HashMap<u128, Vec<u32>>)>,
}

/// The outcome of ranking the services that claim one key, for one client.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Choice<'a> {
    pub service: Option<&'a Service>,
    /// The best-ranked claimant the client may not see, for the "hidden from client" log.
    pub hidden: Option<&'a Service>,
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
    pub fn new(services: Vec<Service>) -> Self {
        let mut store = ServiceStore::default();
        for (i, svc) in services.iter().enumerate() {
            let i = i as u32;
            for ip in svc.vips() {
                store.by_vip.entry(ip).or_default().push(i);
            }
            for net in &svc.cidrs {
                store.by_cidr.insert(*net, i);
            }
            let key: Box<str> = svc.hostname.as_str().into();
            match key.strip_prefix("*.") {
                Some(suffix) => store.by_wildcard.entry(suffix.into()).or_default().push(i),
                None => store.by_host.entry(key).or_default().push(i),
            }
        }
        store.by_cidr.v4.sort_by(|a, b| b.0.cmp(&a.0));
        store.by_cidr.v6.sort_by(|a, b| b.0.cmp(&a.0));
        store.services = services;
        store
    }

    /// Ranks the claimants of one key for a client: a service in the client's own namespace first,
    /// then the global rank order; services the client may not see are skipped (and remembered).
    fn choose<'a>(
        &'a self,
        bucket: &[u32],
        client_ns: Option<&str>,
        usable: fn(&Service) -> bool,
    ) -> Choice<'a> {
        let mut choice = Choice::default();
        for &i in bucket {
            let svc = &self.services[i as usize];
            if !usable(svc) {
                continue;
            }
            if client_ns == Some(svc.namespace.as_str()) {
                choice.service = Some(svc);
                return choice;
            }
            match svc.visibility {
                ServiceVisibility::Public => {
                    choice.service.get_or_insert(svc);
                }
                ServiceVisibility::Namespace => {
                    choice.hidden.get_or_insert(svc);
                }
            }
        }
        choice
    }

    pub fn by_vip(&self, ip: IpAddr, client_ns: Option<&str>) -> Choice<'_> {
        match self.by_vip.get(&ip) {
            Some(bucket) => self.choose(bucket, client_ns, |_| true),
            None => Choice::default(),
        }
    }

    /// The longest prefix with a visible claimant wins; equal prefixes are ranked.
    pub fn by_cidr(&self, ip: IpAddr, client_ns: Option<&str>) -> Choice<'_> {
        let mut hidden = None;
        let mut found = |bucket: &[u32]| {
            let choice = self.choose(bucket, client_ns, |_| true);
            hidden = hidden.or(choice.hidden);
            choice.service
        };
        let service = match ip {
            IpAddr::V4(ip) => {
                let ip = u32::from(ip);
                self.by_cidr
                    .v4
                    .iter()
                    .find_map(|(len, map)| map.get(&mask_v4(ip, *len)).and_then(|b| found(b)))
            }
            IpAddr::V6(ip) => {
                let ip = u128::from(ip);
                self.by_cidr
                    .v6
                    .iter()
                    .find_map(|(len, map)| map.get(&mask_v6(ip, *len)).and_then(|b| found(b)))
            }
        };
        Choice { service, hidden }
    }

    /// A host name (lower case, no trailing dot): the exact name first, then wildcards from the
    /// most specific. Only services with an address can answer DNS; the others are skipped.
    pub fn by_host(&self, name: &str, client_ns: Option<&str>) -> Choice<'_> {
        let mut hidden = None;
        if let Some(bucket) = self.by_host.get(name) {
            let choice = self.choose(bucket, client_ns, Service::has_addresses);
            if choice.service.is_some() {
                return choice;
            }
            hidden = choice.hidden;
        }
        let mut rest = name;
        while let Some((_, suffix)) = rest.split_once('.') {
            if let Some(bucket) = self.by_wildcard.get(suffix) {
                let choice = self.choose(bucket, client_ns, Service::has_addresses);
                hidden = hidden.or(choice.hidden);
                if choice.service.is_some() {
                    return Choice {
                        service: choice.service,
                        hidden,
                    };
                }
            }
            rest = suffix;
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
