//! What the fast path's tables may hold (`Limits`, from the kernel memory they may take), and what
//! a compilation produced: its entries and, by reason, what it left to the proxy (`Stats`,
//! `Fallback`).
use std::collections::BTreeMap;

use redirect_common::fastpath::NS_PROXY;

/// What the tables may hold: entries of each table, and the kernel memory of one generation
/// ([`super::entry_bytes`] an entry) in all and for one namespace's own entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Namespaces with entries of their own.
    pub namespaces: usize,
    pub clients: usize,
    pub exact: usize,
    pub cidrs: usize,
    pub ports: usize,
    pub workloads: usize,
    /// Bytes of kernel memory one generation's entries may take.
    pub bytes: usize,
    /// Bytes one namespace's own entries may take: its own view, the shared entries that only
    /// report its hidden services, and its services' rewrites.
    pub namespace_bytes: usize,
}

/// The kernel memory the fast path's tables may take by default, both generations together.
pub(crate) const DEFAULT_MEMORY: usize = 64 << 20;

impl Limits {
    /// The limits for `memory` bytes of kernel memory, both generations together: half of it a
    /// generation, and a quarter of that for any one namespace's own entries.
    pub(crate) fn within(memory: usize) -> Limits {
        let bytes = memory / 2;
        Limits {
            namespaces: NS_PROXY as usize - 1,
            clients: usize::MAX,
            exact: usize::MAX,
            cidrs: usize::MAX,
            ports: usize::MAX,
            // Only counts: an address nothing claims is left alone either way.
            workloads: 65_536,
            bytes,
            namespace_bytes: bytes / 4,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            namespaces: 4096,
            clients: 65_536,
            exact: 65_536,
            cidrs: 16_384,
            ports: 65_536,
            workloads: 65_536,
            bytes: usize::MAX,
            namespace_bytes: usize::MAX,
        }
    }
}

/// Why the proxy decides what the kernel could otherwise have decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Fallback {
    /// A service port with an endpoint by host name the agent holds no fresh addresses for (not
    /// resolved yet, did not resolve, its answer expired, or past the names resolved ahead); counted
    /// per service port.
    HostNameEndpoint,
    /// A declared service port without endpoints: the proxy resets (per service port).
    NoEndpoints,
    /// A service port whose endpoints mix IPv4 and IPv6: no single rewrite fits every socket.
    MixedFamilies,
    /// More than [`redirect_common::fastpath::MAX_ENDPOINTS`] endpoints on a service port.
    TooManyEndpoints,
    /// The rewrite table is full (per service port left out).
    PortsFull,
    /// A namespace's own entries did not fit, or took more than its share: its clients go to the
    /// proxy (per namespace). The other namespaces' stay in the kernel.
    NamespaceFull,
    /// Shared entries that only report a hide, left out with their namespace's own entries: the
    /// kernel decides the same without them, but does not count those hides (per entry).
    HidesUncounted,
    /// The entries every client shares and that change a decision did not fit in the whole
    /// budget: the proxy decides everything.
    SharedFull,
    /// Not every workload address fit: connections to the ones left out are still left alone in
    /// the kernel, counted as passthroughs (per address). The addresses only the proxy may carry
    /// (over HBONE, under authorization) are kept first; when even they do not fit, the proxy
    /// decides every connection.
    WorkloadsUncounted,
}

/// What a compilation produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    pub namespaces: usize,
    pub exact: usize,
    pub cidrs: usize,
    pub ports: usize,
    pub workloads: usize,
    pub fallbacks: BTreeMap<Fallback, usize>,
}

impl Stats {
    pub(super) fn fell_back(&mut self, why: Fallback, n: usize) {
        if n > 0 {
            *self.fallbacks.entry(why).or_default() += n;
        }
    }
}
