//! The tables the kernel reads, as plain Rust data. Every key and value is fixed-size and
//! `#[repr(C)]`, laid out as the BPF map entry it becomes; the userspace maps stand in for the
//! BPF maps named in each field of [`Tables`]:
//!
//! | map | kind | key | value |
//! | --- | --- | --- | --- |
//! | clients | hash | cgroup id, `u64` | [`NsId`], `u32` |
//! | exact | hash | [`AddrKey`], 24 B | [`Claim`], 12 B |
//! | cidrs | LPM trie | `u32` prefix length + [`AddrKey::lpm_bytes`], 4 + 24 B | [`Claim`], 12 B |
//! | ports | hash | [`PortKey`], 8 B | [`Backends`], 328 B |
//! | workloads | hash | [`IpKey`], 20 B | `u8` (present) |
//! | config | array, 1 entry | `u32` 0 | [`Config`] as three `u8` flags |
//!
//! A snapshot's tables are swapped whole (the eBPF half: one set of maps per generation, the
//! generation in force read first), never edited in place.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use super::lpm::LpmTrie;

use redirect_common::fastpath as wire;

/// A client namespace as the kernel knows it: a small number instead of a name.
pub type NsId = u32;
/// A pod whose namespace claims no address: it sees what every client sees (PUBLIC services).
pub const NS_UNKNOWN: NsId = wire::NS_UNKNOWN;
/// A namespace whose own entries did not fit: its clients always go to the proxy.
pub const NS_PROXY: NsId = wire::NS_PROXY;

/// The most endpoints one rewrite entry holds; a port with more goes to the proxy.
pub const MAX_ENDPOINTS: usize = wire::MAX_ENDPOINTS;

#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4 = wire::FAMILY_V4,
    V6 = wire::FAMILY_V6,
}

/// An address: IPv4 in the first 4 bytes (the rest zero), IPv6 in all 16. A v4-mapped IPv6
/// address is its IPv4 address, as in every lookup of the data plane. 20 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpKey {
    pub family: Family,
    pub addr: [u8; 16],
}

impl IpKey {
    pub fn new(ip: IpAddr) -> Self {
        let mut addr = [0; 16];
        match ip.to_canonical() {
            IpAddr::V4(ip) => {
                addr[..4].copy_from_slice(&ip.octets());
                IpKey {
                    family: Family::V4,
                    addr,
                }
            }
            IpAddr::V6(ip) => IpKey {
                family: Family::V6,
                addr: ip.octets(),
            },
        }
    }

    pub fn ip(&self) -> IpAddr {
        match self.family {
            Family::V4 => IpAddr::from([self.addr[0], self.addr[1], self.addr[2], self.addr[3]]),
            Family::V6 => IpAddr::from(self.addr),
        }
    }

    /// Address bits in the key: what a CIDR prefix length counts.
    pub fn bits(&self) -> u32 {
        match self.family {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

/// The key of the exact-address and CIDR tables: whose view (`ns`), which address. 24 bytes; in
/// the LPM trie `ns` and `family` are stored big-endian so that a prefix of
/// `64 + cidr length` bits means "this namespace, this family, this network".
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    pub ns: NsId,
    pub ip: IpKey,
}

impl AddrKey {
    /// The bytes the LPM trie compares, most significant first.
    pub fn lpm_bytes(&self) -> [u8; 24] {
        let mut out = [0; 24];
        out[..4].copy_from_slice(&self.ns.to_be_bytes());
        out[4..8].copy_from_slice(&(self.ip.family as u32).to_be_bytes());
        out[8..].copy_from_slice(&self.ip.addr);
        out
    }
}

/// What an address (or network) claimed for one view leads to.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimAction {
    /// The proxy decides (the service can reset, resolve a host name, ...).
    Proxy = wire::ACTION_PROXY,
    /// Resolution NONE: the original destination, on any port.
    Passthrough = wire::ACTION_PASSTHROUGH,
    /// Look the port up in the rewrite table under `Claim::service`; a miss is the proxy's.
    Ports = wire::ACTION_PORTS,
    /// No claimant visible in this view: as if the address were not claimed, but `Claim::hidden`
    /// was skipped.
    None = wire::ACTION_NONE,
}

/// The value of the exact-address and CIDR tables (12 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claim {
    pub action: ClaimAction,
    /// The winning service's id (its rank position in the snapshot), for `Ports`.
    pub service: u32,
    /// The service skipped because it is hidden from this view's clients (its id), which the
    /// kernel counts and reports when it decides the connection.
    pub hidden: Option<u32>,
}

/// The key of the rewrite table. 8 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    pub service: u32,
    pub port: u16,
    pub _pad: u16,
}

impl PortKey {
    pub fn new(service: u32, port: u16) -> Self {
        PortKey {
            service,
            port,
            _pad: 0,
        }
    }
}

/// One endpoint address of a rewrite. 20 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
}

/// The value of the rewrite table: a port's endpoints, all of one family (the family a
/// `connect()` can be rewritten within). 8 + 16 * 20 = 328 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backends {
    pub family: Family,
    /// `1..=MAX_ENDPOINTS`; the program picks `endpoints[random % count]`.
    pub count: u32,
    pub endpoints: [Backend; MAX_ENDPOINTS],
}

impl Backends {
    /// The endpoints in order, as socket addresses.
    pub fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.endpoints[..self.count as usize].iter().map(|b| {
            let ip = IpKey {
                family: self.family,
                addr: b.addr,
            }
            .ip();
            SocketAddr::new(ip, b.port)
        })
    }
}

/// Flags of the whole snapshot: one array map entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Config {
    /// The shared (unknown client) entries did not fit: the proxy decides everything.
    pub proxy_everything: bool,
    /// Not every workload address fit: an address no service claims goes to the proxy, which
    /// knows whether it is a workload's.
    pub workloads_incomplete: bool,
    /// Not every pod cgroup fit (a cgroup missing from the client table goes to the proxy anyway).
    pub clients_incomplete: bool,
}

/// The client table is full: from now on a cgroup missing from it goes to the proxy (see
/// [`Tables::set_client`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the fast path's client table is full ({0} entries)")]
pub struct ClientsFull(pub usize);

/// One snapshot's tables. Swapped whole, like the snapshot they come from.
#[derive(Debug, Clone, Default)]
pub struct Tables {
    /// BPF hash `cgroup id (u64) -> NsId`: filled by the agent from its identity walk; a missing
    /// cgroup could be any pod's, so its connections go to the proxy.
    pub(super) clients: HashMap<u64, NsId>,
    pub(super) max_clients: usize,
    /// Userspace only: the namespace ids this snapshot gave out, for the agent and `explain`.
    pub(super) namespaces: BTreeMap<String, NsId>,
    /// BPF hash `AddrKey -> Claim`: exact addresses (VIPs).
    pub(super) exact: HashMap<AddrKey, Claim>,
    /// BPF LPM trie `AddrKey/(64 + len) -> Claim`: CIDR addresses.
    pub(super) cidrs: LpmTrie<Claim>,
    /// BPF hash `PortKey -> Backends`: the ports whose endpoints are plain IPs.
    pub(super) ports: HashMap<PortKey, Backends>,
    /// BPF hash `IpKey -> u8`: workload addresses, only to count their connections apart.
    pub(super) workloads: HashSet<IpKey>,
    /// BPF array of one entry.
    pub(super) config: Config,
}

impl Tables {
    /// The id the client table should give a cgroup of `namespace`: [`NS_UNKNOWN`] for a namespace
    /// that claims no address (its clients see what an unknown client sees).
    pub fn namespace_id(&self, namespace: &str) -> NsId {
        self.namespaces
            .get(namespace)
            .copied()
            .unwrap_or(NS_UNKNOWN)
    }

    /// Records the namespace of a pod cgroup (a namespace that claims no address gets
    /// [`NS_UNKNOWN`]: its clients see what every client sees). A cgroup that does not fit is
    /// missing, and a missing cgroup goes to the proxy.
    pub fn set_client(&mut self, cgroup: u64, namespace: &str) -> Result<(), ClientsFull> {
        let ns = self.namespace_id(namespace);
        if self.clients.len() >= self.max_clients && !self.clients.contains_key(&cgroup) {
            self.config.clients_incomplete = true;
            return Err(ClientsFull(self.max_clients));
        }
        self.clients.insert(cgroup, ns);
        Ok(())
    }

    pub fn config(&self) -> Config {
        self.config
    }
}
