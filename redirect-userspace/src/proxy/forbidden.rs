//! Destinations the proxy never dials for a pod: what would reach the node itself rather than
//! something the pod could reach on its own (`docs/data-plane.md#destinations-the-proxy-refuses`).
//!
//! Every proxied connection starts in the node's network namespace, so `127.0.0.1` there is the
//! node's loopback (the agent's admin server among what listens on it), a link-local address is the
//! node's link (the cloud's metadata service answers at `169.254.169.254`), and the node's own
//! addresses are the node. A pod asking for any of these, as an endpoint, a workload or a
//! passthrough destination, is refused: its connection is reset and the refusal counted.
use crate::lock::Locked;
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ipnet::IpNet;

/// How long the node's own addresses are taken as read before they are listed again.
const NODE_ADDRESSES_FRESH: Duration = Duration::from_secs(1);

/// Why a destination is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Forbidden {
    /// `127.0.0.0/8`, `::1`: the node's own loopback.
    Loopback,
    /// `0.0.0.0/8`, `::`: a connect there reaches the local host.
    Unspecified,
    /// `169.254.0.0/16`, `fe80::/10`: the node's link (metadata services, the gateway itself).
    LinkLocal,
    /// An address of one of the node's interfaces.
    Node,
    /// A prefix the operator denies to every proxied connection (`--deny-destination`).
    Denied,
}

impl Forbidden {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Loopback => "loopback",
            Self::Unspecified => "unspecified",
            Self::LinkLocal => "link_local",
            Self::Node => "node",
            Self::Denied => "denied",
        }
    }

    pub(crate) const fn describe(self) -> &'static str {
        match self {
            Self::Loopback => "a loopback address (the node's own)",
            Self::Unspecified => "an unspecified address (the local host)",
            Self::LinkLocal => "a link-local address (the node's link)",
            Self::Node => "an address of the node itself",
            Self::Denied => "in a prefix denied by --deny-destination",
        }
    }
}

/// What an address is by itself, whatever the node: loopback, unspecified or link-local (IPv4, or
/// IPv4 in v4-mapped form, and IPv6).
pub(super) fn by_address(ip: IpAddr) -> Option<Forbidden> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => by_v4(v4),
        IpAddr::V6(v6) => by_v6(v6),
    }
}

fn by_v4(ip: Ipv4Addr) -> Option<Forbidden> {
    if ip.is_loopback() {
        Some(Forbidden::Loopback)
    } else if ip.octets()[0] == 0 {
        Some(Forbidden::Unspecified)
    } else if ip.is_link_local() {
        Some(Forbidden::LinkLocal)
    } else {
        None
    }
}

fn by_v6(ip: Ipv6Addr) -> Option<Forbidden> {
    if ip.is_loopback() {
        Some(Forbidden::Loopback)
    } else if ip.is_unspecified() {
        Some(Forbidden::Unspecified)
    } else if ip.is_unicast_link_local() {
        Some(Forbidden::LinkLocal)
    } else {
        None
    }
}

/// The node's addresses, listed again once they are a second old, and the operator's denied
/// prefixes. Shared by every connection task.
#[derive(Debug)]
pub(crate) struct DialGuard {
    denied: Vec<IpNet>,
    node: Mutex<NodeAddresses>,
    /// Destinations already warned about (a bounded set: a scan must not grow it, nor the log).
    warned: Mutex<HashSet<IpAddr>>,
    /// The in-process tests' upstreams listen on loopback, the one network they have without root.
    #[cfg(test)]
    loopback_allowed: bool,
}

/// Destinations warned about at most; past it refusals are logged at debug level only.
const WARNED_MAX: usize = 1024;

#[derive(Debug)]
struct NodeAddresses {
    listed: Option<Instant>,
    addresses: Arc<HashSet<IpAddr>>,
}

impl DialGuard {
    pub(crate) fn new(denied: Vec<IpNet>) -> Self {
        DialGuard {
            denied,
            node: Mutex::new(NodeAddresses {
                listed: None,
                addresses: Arc::default(),
            }),
            warned: Mutex::new(HashSet::new()),
            #[cfg(test)]
            loopback_allowed: false,
        }
    }

    /// A guard that lets loopback through, for tests that run the proxy in-process.
    #[cfg(test)]
    pub(crate) fn allowing_loopback(denied: Vec<IpNet>) -> Self {
        DialGuard {
            loopback_allowed: true,
            ..DialGuard::new(denied)
        }
    }

    /// True the first time a refusal of `ip` is reported (then it is worth a warning).
    pub(crate) fn first_refusal(&self, ip: IpAddr) -> bool {
        let mut warned = self.warned.locked();
        warned.len() < WARNED_MAX && warned.insert(ip)
    }

    /// Why the proxy must not dial `ip` for a pod, if it must not.
    pub(crate) fn check(&self, ip: IpAddr) -> Option<Forbidden> {
        let ip = ip.to_canonical();
        if let Some(reason) = by_address(ip).filter(|_| !self.test_loopback(ip)) {
            return Some(reason);
        }
        if self.denied.iter().any(|net| net.contains(&ip)) {
            return Some(Forbidden::Denied);
        }
        (self.node_addresses().contains(&ip) && !self.test_loopback(ip)).then_some(Forbidden::Node)
    }

    /// Whether `ip` is loopback let through for an in-process test (never in the agent).
    fn test_loopback(&self, ip: IpAddr) -> bool {
        #[cfg(test)]
        return self.loopback_allowed && ip.is_loopback();
        #[cfg(not(test))]
        {
            let _ = ip;
            false
        }
    }

    fn node_addresses(&self) -> Arc<HashSet<IpAddr>> {
        let mut node = self.node.locked();
        let fresh = node
            .listed
            .is_some_and(|at| at.elapsed() < NODE_ADDRESSES_FRESH);
        if !fresh {
            // A failed listing keeps the last one (the refusal of loopback and link-local does not
            // depend on it).
            if let Ok(addresses) = interface_addresses() {
                node.addresses = Arc::new(addresses);
            }
            node.listed = Some(Instant::now());
        }
        node.addresses.clone()
    }
}

/// Every address of every interface of this network namespace that is up (`getifaddrs(3)`). An
/// interface kept down only to hold addresses is not the node: kube-proxy's IPVS mode puts every
/// Service's cluster IP on such a dummy interface, and a pod may reach those itself.
fn interface_addresses() -> std::io::Result<HashSet<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut addresses = HashSet::new();
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, not yet freed.
        let entry = unsafe { &*cursor };
        let up = entry.ifa_flags & libc::IFF_UP as libc::c_uint != 0;
        // SAFETY: getifaddrs sets `ifa_addr` null or to a sockaddr of the family it names, alive
        // until freeifaddrs below.
        if up && let Some(ip) = unsafe { sockaddr_ip(entry.ifa_addr) } {
            addresses.insert(ip.to_canonical());
        }
        cursor = entry.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(addresses)
}

/// # Safety
/// `addr` is null or points to a sockaddr of the family it names.
unsafe fn sockaddr_ip(addr: *const libc::sockaddr) -> Option<IpAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: per the contract, the family tells which struct `addr` points to.
    unsafe {
        match i32::from((*addr).sa_family) {
            libc::AF_INET => {
                let v4 = &*(addr as *const libc::sockaddr_in);
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))))
            }
            libc::AF_INET6 => {
                let v6 = &*(addr as *const libc::sockaddr_in6);
                Some(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_unspecified_and_link_local_are_refused_in_every_form() {
        for (addr, want) in [
            ("127.0.0.1", Some(Forbidden::Loopback)),
            ("127.8.9.10", Some(Forbidden::Loopback)),
            ("::1", Some(Forbidden::Loopback)),
            ("::ffff:127.0.0.1", Some(Forbidden::Loopback)),
            ("0.0.0.0", Some(Forbidden::Unspecified)),
            ("0.1.2.3", Some(Forbidden::Unspecified)),
            ("::", Some(Forbidden::Unspecified)),
            ("169.254.169.254", Some(Forbidden::LinkLocal)),
            ("169.254.7.1", Some(Forbidden::LinkLocal)),
            ("::ffff:169.254.169.254", Some(Forbidden::LinkLocal)),
            ("fe80::1", Some(Forbidden::LinkLocal)),
            ("203.0.113.10", None),
            ("10.244.1.10", None),
            ("2001:db8::10", None),
            ("fd00:7::1", None),
        ] {
            assert_eq!(by_address(ip(addr)), want, "{addr}");
        }
    }

    #[test]
    fn the_nodes_own_addresses_and_denied_prefixes_are_refused() {
        let guard = DialGuard::new(vec!["198.51.100.0/24".parse().unwrap()]);
        let own = interface_addresses().unwrap();
        // Loopback is on every namespace; a non-loopback address only on some test machines.
        for addr in own.iter().filter(|a| by_address(**a).is_none()) {
            assert_eq!(guard.check(*addr), Some(Forbidden::Node), "{addr}");
        }
        assert_eq!(guard.check(ip("198.51.100.7")), Some(Forbidden::Denied));
        assert_eq!(
            guard.check(ip("::ffff:198.51.100.7")),
            Some(Forbidden::Denied)
        );
        assert_eq!(guard.check(ip("203.0.113.10")), None);
        assert_eq!(guard.check(ip("127.0.0.1")), Some(Forbidden::Loopback));
    }
}
