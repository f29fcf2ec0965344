//! The fast path's tables as the kernel reads them: what `connect4`/`connect6` look up to decide a
//! connection without the proxy. The agent compiles each snapshot into these (`fastpath` in the
//! agent has the rules and a model of the lookup). Enumerations cross the wall as plain `u32`
//! constants: a value read from a map is never trusted to be a valid Rust enum.

/// Client namespace id of a pod whose namespace claims no address: it sees the shared entries.
pub const NS_UNKNOWN: u32 = 0;
/// Client namespace id of a namespace whose own entries did not fit: the proxy decides.
pub const NS_PROXY: u32 = u32::MAX;
/// Set in a client's value in `FAST_CLIENTS` (beside its namespace id, never with [`NS_PROXY`]):
/// the client is a Pod in the ambient mesh, whose connections to the mesh's Pods of other nodes
/// go over HBONE ([`WORKLOAD_HBONE`]).
pub const NS_ENROLLED: u32 = 1 << 31;

/// [`IpKey::family`] and [`Backends::family`].
pub const FAMILY_V4: u32 = 4;
pub const FAMILY_V6: u32 = 6;

/// [`Claim::action`]: the proxy decides.
pub const ACTION_PROXY: u32 = 0;
/// [`Claim::action`]: resolution NONE, the original destination on any port.
pub const ACTION_PASSTHROUGH: u32 = 1;
/// [`Claim::action`]: look the port up in the ports table under [`Claim::service`].
pub const ACTION_PORTS: u32 = 2;
/// [`Claim::action`]: no claimant visible here, as if the address were not claimed (the lookup
/// goes on), but [`Claim::hidden`] was skipped.
pub const ACTION_NONE: u32 = 3;

/// A workload address's value in `FAST_WORKLOADS`: the connection goes straight to it.
pub const WORKLOAD_DIRECT: u8 = 1;
/// A workload address's value in `FAST_WORKLOADS`: only the proxy may carry a connection there, also
/// when a service's endpoint is picked there or a resolution-NONE entry passes it through: a Pod
/// of this node whose authorization policies did not fit the kernel's inbound table (the proxy
/// decides it).
pub const WORKLOAD_PROXY: u8 = 2;
/// A workload address's value in `FAST_WORKLOADS`: a Pod of another node in the mesh. A client in
/// the mesh ([`NS_ENROLLED`]) reaches it over HBONE, which only the proxy speaks (as for
/// [`WORKLOAD_PROXY`]); any other client reaches it directly (as for [`WORKLOAD_DIRECT`]).
pub const WORKLOAD_HBONE: u8 = 4;
/// A workload address's value in `FAST_WORKLOADS`: a Pod of this node some authorization policy
/// applies to, decided by the kernel at the Pod's socket lookup. Left alone once the `inbound`
/// program runs in the Pod's namespace (its address in `INBOUND_ATTACHED`); until then only the
/// proxy may carry a connection there, as for [`WORKLOAD_PROXY`].
pub const WORKLOAD_GUARDED: u8 = 3;

/// Entries of `INBOUND_ATTACHED`: the addresses of the node's guarded Pods.
pub const INBOUND_ATTACHED_ENTRIES: u32 = 16 * 1024;

/// [`Claim::hidden`] when no service was skipped.
pub const NOT_HIDDEN: u32 = u32::MAX;

/// Bytes of the ring buffer of hidden-service events (a power of two, a multiple of the page).
pub const HIDDEN_EVENTS_BYTES: u32 = 64 * 1024;

/// The most addresses (and networks) `FAST_AUDITED` holds; past it, the connections to those left
/// out are audited only when the proxy decides them.
pub const AUDITED_ENTRIES: u32 = 16 * 1024;

/// `FAST_GENERATION` values: no tables in force (every connection goes to the proxy), or the set
/// of maps in force.
pub const GEN_OFF: u32 = 0;
pub const GEN_A: u32 = 1;
pub const GEN_B: u32 = 2;

/// The most endpoints one port entry holds.
pub const MAX_ENDPOINTS: usize = 16;

/// The slot of each table's array of maps (and of the config array) that holds generation
/// `generation` (`GEN_A` or `GEN_B`).
#[inline(always)]
pub const fn generation_slot(generation: u32) -> u32 {
    generation.wrapping_sub(GEN_A)
}

/// An address: IPv4 in the first 4 bytes (the rest zero), IPv6 in all 16. 20 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpKey {
    pub family: u32,
    pub addr: [u8; 16],
}

/// Key of the exact table: whose view, which address. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    pub ns: u32,
    pub ip: IpKey,
}

/// The bytes the CIDR trie compares: `ns` and `family` big-endian, then the address, so that a
/// prefix of `64 + len` bits is "this view, this family, this network".
pub type LpmBytes = [u8; 24];

impl AddrKey {
    #[inline(always)]
    pub const fn lpm_bytes(&self) -> LpmBytes {
        let ns = self.ns.to_be_bytes();
        let f = self.ip.family.to_be_bytes();
        let a = &self.ip.addr;
        [
            ns[0], ns[1], ns[2], ns[3], f[0], f[1], f[2], f[3], a[0], a[1], a[2], a[3], a[4], a[5],
            a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
        ]
    }
}

/// Value of the exact and CIDR tables. 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Claim {
    /// One of the `ACTION_*` constants.
    pub action: u32,
    pub service: u32,
    /// The service skipped because it is hidden from the view's clients, counted and reported when
    /// the kernel decides; [`NOT_HIDDEN`] for none.
    pub hidden: u32,
}

/// One decision the kernel reports to the agent: a hide, or a connection to an address the agent
/// audits. Who connected where, which service it skipped ([`NOT_HIDDEN`] for none), and what the
/// kernel did (a `FastStat`). 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HiddenEvent {
    pub cgroup: u64,
    /// The client namespace's id in the generation in force.
    pub ns: u32,
    pub hidden: u32,
    /// The original destination, as in [`IpKey`].
    pub dst: IpKey,
    pub port: u16,
    /// The `FastStat` of the decision.
    pub outcome: u8,
    /// The generation in force (`GEN_A`, `GEN_B`): which tables `ns` and `hidden` are ids of.
    pub generation: u8,
}

/// Key of the ports table. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    pub service: u32,
    /// Host byte order.
    pub port: u16,
    pub _pad: u16,
}

/// One endpoint: address as in [`IpKey`], port in host byte order. 20 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Backend {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
}

/// Value of the ports table: a port's endpoints, all of `family`. 328 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backends {
    pub family: u32,
    /// `1..=MAX_ENDPOINTS`; the program picks `endpoints[random % count]`.
    pub count: u32,
    pub endpoints: [Backend; MAX_ENDPOINTS],
}

/// The one entry of the config array: flags of the whole snapshot, each 0 or 1. 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Config {
    /// The shared entries did not fit: every connection goes to the proxy.
    pub proxy_everything: u8,
    /// Not every workload address fit (informational: an address nothing claims is left alone
    /// either way, and counted as a passthrough when it is not in the table).
    pub workloads_incomplete: u8,
    /// Not every pod cgroup fit (informational: a missing cgroup goes to the proxy anyway).
    pub clients_incomplete: u8,
    pub _pad: u8,
}

/// What the agent needs to build the tables and to read them back (`explain`, its model of the
/// lookup); the programs read the fields.
#[cfg(feature = "user")]
mod user {
    use core::net::{IpAddr, SocketAddr};

    use super::*;

    impl IpKey {
        /// The key of `ip`: a v4-mapped IPv6 address is its IPv4 address, as in every lookup of
        /// the data plane.
        pub fn new(ip: IpAddr) -> IpKey {
            let mut addr = [0; 16];
            match ip.to_canonical() {
                IpAddr::V4(ip) => {
                    addr[..4].copy_from_slice(&ip.octets());
                    IpKey {
                        family: FAMILY_V4,
                        addr,
                    }
                }
                IpAddr::V6(ip) => IpKey {
                    family: FAMILY_V6,
                    addr: ip.octets(),
                },
            }
        }

        pub fn ip(&self) -> IpAddr {
            if self.family == FAMILY_V6 {
                IpAddr::from(self.addr)
            } else {
                IpAddr::from([self.addr[0], self.addr[1], self.addr[2], self.addr[3]])
            }
        }

        /// Address bits in the key: what a CIDR prefix length counts.
        pub fn bits(&self) -> u32 {
            if self.family == FAMILY_V6 { 128 } else { 32 }
        }
    }

    impl Claim {
        /// A claim with one of the `ACTION_*` constants, hiding nothing.
        pub fn new(action: u32, service: u32) -> Claim {
            Claim {
                action,
                service,
                hidden: NOT_HIDDEN,
            }
        }

        /// This claim, reporting `hidden` as the service skipped.
        pub fn hiding(self, hidden: Option<u32>) -> Claim {
            Claim {
                hidden: hidden.unwrap_or(NOT_HIDDEN),
                ..self
            }
        }

        /// The service skipped as hidden, if any.
        pub fn hidden(&self) -> Option<u32> {
            (self.hidden != NOT_HIDDEN).then_some(self.hidden)
        }
    }

    impl PortKey {
        pub fn new(service: u32, port: u16) -> PortKey {
            PortKey {
                service,
                port,
                _pad: 0,
            }
        }
    }

    impl Backends {
        /// The endpoints in order, as socket addresses.
        pub fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
            let count = (self.count as usize).min(MAX_ENDPOINTS);
            self.endpoints[..count].iter().map(|b| {
                let ip = IpKey {
                    family: self.family,
                    addr: b.addr,
                }
                .ip();
                SocketAddr::new(ip, b.port)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_the_documented_sizes() {
        assert_eq!(core::mem::size_of::<IpKey>(), 20);
        assert_eq!(core::mem::size_of::<AddrKey>(), 24);
        assert_eq!(core::mem::size_of::<Claim>(), 12);
        assert_eq!(core::mem::size_of::<HiddenEvent>(), 40);
        assert_eq!(core::mem::size_of::<PortKey>(), 8);
        assert_eq!(core::mem::size_of::<Backend>(), 20);
        assert_eq!(core::mem::size_of::<Backends>(), 328);
        assert_eq!(core::mem::size_of::<Config>(), 4);
    }

    #[test]
    fn lpm_bytes_put_view_and_family_first_most_significant_first() {
        let key = AddrKey {
            ns: 0x0102_0304,
            ip: IpKey {
                family: FAMILY_V4,
                addr: [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            },
        };
        let b = key.lpm_bytes();
        assert_eq!(&b[..8], &[1, 2, 3, 4, 0, 0, 0, 4]);
        assert_eq!(&b[8..12], &[10, 0, 0, 1]);
    }

    #[cfg(feature = "user")]
    #[test]
    fn a_claim_hides_nothing_until_told_and_crosses_as_the_sentinel() {
        let claim = Claim::new(ACTION_PORTS, 7);
        assert_eq!(claim.hidden, NOT_HIDDEN);
        assert_eq!(claim.hidden(), None);
        assert_eq!(claim.hiding(Some(3)).hidden(), Some(3));
        assert_eq!(claim.hiding(Some(3)).hidden, 3);
        assert_eq!(claim.hiding(None).hidden, NOT_HIDDEN);
    }

    #[cfg(feature = "user")]
    #[test]
    fn a_v4_mapped_address_is_its_ipv4_key_and_reads_back_as_ipv4() {
        use core::net::IpAddr;
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let key = IpKey::new(mapped);
        assert_eq!(key, IpKey::new(v4));
        assert_eq!(key.family, FAMILY_V4);
        assert_eq!(key.ip(), v4);
        assert_eq!(key.bits(), 32);
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(IpKey::new(v6).ip(), v6);
        assert_eq!(IpKey::new(v6).bits(), 128);
    }

    #[cfg(feature = "user")]
    #[test]
    fn backends_list_only_their_count_of_endpoints() {
        let mut backends = Backends {
            family: FAMILY_V4,
            count: 2,
            endpoints: [Backend::default(); MAX_ENDPOINTS],
        };
        backends.endpoints[0].addr[..4].copy_from_slice(&[10, 0, 0, 1]);
        backends.endpoints[0].port = 80;
        backends.endpoints[1].addr[..4].copy_from_slice(&[10, 0, 0, 2]);
        backends.endpoints[1].port = 8080;
        let addrs: [core::net::SocketAddr; 2] = [
            "10.0.0.1:80".parse().unwrap(),
            "10.0.0.2:8080".parse().unwrap(),
        ];
        assert!(backends.addrs().eq(addrs));
        assert_eq!(
            PortKey::new(7, 80),
            PortKey {
                service: 7,
                port: 80,
                _pad: 0
            }
        );
    }
}
