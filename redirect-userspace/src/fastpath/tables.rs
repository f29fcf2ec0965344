//! The tables the kernel reads, as plain Rust data. Keys and values are `redirect_common::fastpath`'s,
//! the very entries the BPF maps hold; the userspace maps stand in for the BPF maps named in each
//! field of [`Tables`]:
//!
//! | map | kind | key | value |
//! | --- | --- | --- | --- |
//! | clients | hash | cgroup id, `u64` | [`NsId`], `u32` |
//! | exact | hash | [`AddrKey`], 24 B | [`Claim`], 12 B |
//! | cidrs | LPM trie | `u32` prefix length + [`AddrKey::lpm_bytes`], 4 + 24 B | [`Claim`], 12 B |
//! | ports | hash | [`PortKey`], 8 B | [`Backends`], 328 B (held as [`PortEndpoints`]) |
//! | workloads | hash | [`IpKey`], 20 B | `u8` (direct, or the proxy's: over HBONE or under authorization) |
//! | config | array, 1 entry | `u32` 0 | [`Config`], three `u8` flags |
//!
//! A snapshot's tables are swapped whole (the eBPF half: one set of maps per generation, the
//! generation in force read first), never edited in place.
#[cfg(test)]
use std::{collections::BTreeSet, net::SocketAddr};
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use redirect_common::fastpath::{
    AddrKey, Backend, Backends, Claim, Config, IpKey, LpmBytes, MAX_ENDPOINTS, NS_ENROLLED,
    NS_PROXY, NS_UNKNOWN, PortKey,
};

use super::lpm::LpmTrie;

/// A client namespace as the kernel knows it: a small number instead of a name ([`NS_UNKNOWN`]: a
/// pod whose namespace claims no address; `NS_PROXY`: a namespace whose own entries did not fit).
pub(super) type NsId = u32;

/// The client table is full: from now on a cgroup missing from it goes to the proxy (see
/// [`Clients::set`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the fast path's client table is full ({0} entries)")]
pub(crate) struct ClientsFull(pub usize);

/// A port's endpoints as the agent holds them: only the slots in use (most ports have one or two of
/// the kernel value's 16), shared between the tables and what each map generation last wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortEndpoints {
    /// Every endpoint's (one of the `FAMILY_*` constants).
    pub family: u32,
    /// `1..=MAX_ENDPOINTS` of them.
    pub endpoints: Arc<[Backend]>,
}

impl PortEndpoints {
    /// The value the BPF map holds.
    pub(crate) fn kernel(&self) -> Backends {
        let mut value = Backends {
            family: self.family,
            count: 0,
            endpoints: [Backend::default(); MAX_ENDPOINTS],
        };
        for (slot, endpoint) in value.endpoints.iter_mut().zip(self.endpoints.iter()) {
            *slot = *endpoint;
            value.count += 1;
        }
        value
    }

    /// The endpoints in order, as socket addresses.
    #[cfg(test)]
    pub(crate) fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.endpoints.iter().map(|b| {
            let ip = IpKey {
                family: self.family,
                addr: b.addr,
            };
            SocketAddr::new(ip.ip(), b.port)
        })
    }
}

/// What one generation of the kernel's maps is given: the compiled tables, shared with the
/// compiler's copy and with the other generation (never copied to add the clients), and the client
/// table of the pods on the node.
#[derive(Debug, Clone, Default)]
pub(crate) struct Install {
    pub tables: Arc<Tables>,
    pub clients: Arc<Clients>,
}

impl Install {
    /// The one entry of the BPF array: the tables' flags, and whether the client table is whole.
    pub(crate) fn config(&self) -> Config {
        let mut config = self.tables.config;
        config.clients_incomplete = u8::from(self.clients.incomplete);
        config
    }
}

/// BPF hash `cgroup id (u64) -> NsId`: filled by the agent from its identity walk, with the ids
/// the tables gave the namespaces; a missing cgroup could be any pod's, so its connections go to
/// the proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Clients {
    entries: HashMap<u64, NsId>,
    max: usize,
    /// A cgroup did not fit.
    incomplete: bool,
}

impl Clients {
    /// An empty client table for `tables` (as many entries as their limits allow).
    pub(crate) fn new(tables: &Tables) -> Clients {
        Clients {
            entries: HashMap::new(),
            max: tables.max_clients,
            incomplete: false,
        }
    }

    /// Records the namespace of a pod cgroup (a namespace that claims no address gets
    /// [`NS_UNKNOWN`]: its clients see what every client sees), and whether the pod is in the
    /// ambient mesh ([`NS_ENROLLED`]). A cgroup that does not fit is missing, and a missing cgroup
    /// goes to the proxy.
    pub(crate) fn set(
        &mut self,
        tables: &Tables,
        cgroup: u64,
        namespace: &str,
        enrolled: bool,
    ) -> Result<(), ClientsFull> {
        if self.entries.len() >= self.max && !self.entries.contains_key(&cgroup) {
            self.incomplete = true;
            return Err(ClientsFull(self.max));
        }
        let id = tables.namespace_id(namespace);
        let entry = match enrolled && id != NS_PROXY {
            true => id | NS_ENROLLED,
            false => id,
        };
        self.entries.insert(cgroup, entry);
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn get(&self, cgroup: u64) -> Option<NsId> {
        self.entries.get(&cgroup).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every entry, as the BPF map holds them.
    pub(crate) fn entries(&self) -> &HashMap<u64, NsId> {
        &self.entries
    }
}

/// One snapshot's tables. Swapped whole, like the snapshot they come from.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Tables {
    /// The most entries of the client table ([`Clients`]).
    pub(super) max_clients: usize,
    /// Userspace only: the namespace ids this snapshot gave out, for the agent and `explain`.
    pub(super) namespaces: BTreeMap<String, NsId>,
    /// BPF hash `AddrKey -> Claim`: exact addresses (VIPs).
    pub(super) exact: HashMap<AddrKey, Claim>,
    /// BPF LPM trie `AddrKey/(64 + len) -> Claim`: CIDR addresses.
    pub(super) cidrs: LpmTrie<Claim>,
    /// BPF hash `PortKey -> Backends`: the ports whose endpoints are plain IPs.
    pub(super) ports: HashMap<PortKey, PortEndpoints>,
    /// BPF hash `IpKey -> u8`: workload addresses, to count their connections apart, and how each
    /// is reached (`WORKLOAD_DIRECT`, or `WORKLOAD_PROXY`: the proxy's).
    pub(super) workloads: HashMap<IpKey, u8>,
    /// BPF array of one entry.
    pub(super) config: Config,
}

impl Tables {
    /// The id the client table should give a cgroup of `namespace`: [`NS_UNKNOWN`] for a namespace
    /// that claims no address (its clients see what an unknown client sees).
    pub(crate) fn namespace_id(&self, namespace: &str) -> NsId {
        self.namespaces
            .get(namespace)
            .copied()
            .unwrap_or(NS_UNKNOWN)
    }

    /// BPF hash `AddrKey -> Claim`.
    pub(crate) fn exact(&self) -> &HashMap<AddrKey, Claim> {
        &self.exact
    }

    /// BPF LPM trie entries: (prefix length, key bytes, claim).
    pub(crate) fn cidrs(&self) -> impl Iterator<Item = (u32, &LpmBytes, &Claim)> {
        self.cidrs.iter()
    }

    /// The LPM trie's entry for exactly this prefix, if any.
    pub(crate) fn cidr(&self, prefix_len: u32, bytes: &LpmBytes) -> Option<&Claim> {
        self.cidrs.get(prefix_len, bytes)
    }

    /// Entries of the LPM trie.
    pub(crate) fn cidr_count(&self) -> usize {
        self.cidrs.len()
    }

    /// BPF hash `PortKey -> Backends` (each made by [`PortEndpoints::kernel`]).
    pub(crate) fn ports(&self) -> &HashMap<PortKey, PortEndpoints> {
        &self.ports
    }

    /// BPF hash `IpKey -> WORKLOAD_DIRECT | WORKLOAD_PROXY`.
    pub(crate) fn workloads(&self) -> &HashMap<IpKey, u8> {
        &self.workloads
    }
}

#[cfg(test)]
/// [`Tables`] with each namespace number replaced by the namespace's name (`""`: every client).
#[derive(Debug, PartialEq)]
pub(crate) struct ByName {
    exact: HashMap<(String, IpKey), Claim>,
    cidrs: HashMap<(String, u32, LpmBytes), Claim>,
    namespaces: BTreeSet<String>,
    rest: Tables,
}

#[cfg(test)]
impl Tables {
    /// These tables with each namespace number replaced by the namespace's name: two
    /// compilations that number the namespaces apart compare equal when they hold the same.
    pub(crate) fn by_name(&self) -> ByName {
        let name = |ns: u32| match ns {
            NS_UNKNOWN => String::new(),
            id => self
                .namespaces
                .iter()
                .find(|(_, n)| **n == id)
                .map_or_else(|| format!("unnamed {id}"), |(name, _)| name.clone()),
        };
        let exact = self
            .exact
            .iter()
            .map(|(AddrKey { ns, ip }, claim)| ((name(*ns), *ip), *claim))
            .collect();
        let cidrs = self
            .cidrs()
            .map(|(len, bytes, claim)| {
                let ns = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                let mut rest = *bytes;
                rest[..4].fill(0);
                ((name(ns), len, rest), *claim)
            })
            .collect();
        let rest = Tables {
            namespaces: Default::default(),
            exact: Default::default(),
            cidrs: Default::default(),
            ..self.clone()
        };
        ByName {
            exact,
            cidrs,
            namespaces: self.namespaces.keys().cloned().collect(),
            rest,
        }
    }
}

#[cfg(test)]
mod tests {
    use redirect_common::fastpath::FAMILY_V4;

    use super::*;

    #[test]
    fn a_ports_endpoints_become_the_kernels_value_with_the_slots_past_them_empty() {
        let endpoint = |port| Backend {
            addr: [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            port,
            _pad: 0,
        };
        let held = PortEndpoints {
            family: FAMILY_V4,
            endpoints: [endpoint(80), endpoint(81)].into(),
        };
        let value = held.kernel();
        assert_eq!((value.family, value.count), (FAMILY_V4, 2));
        assert_eq!(value.endpoints[..2], [endpoint(80), endpoint(81)]);
        assert!(
            value.endpoints[2..]
                .iter()
                .all(|b| *b == Backend::default())
        );
        let addrs: Vec<String> = held.addrs().map(|a| a.to_string()).collect();
        assert_eq!(
            addrs,
            value.addrs().map(|a| a.to_string()).collect::<Vec<_>>()
        );
    }
}
