//! The node's inbound policies compiled into the kernel's table (`redirect_common::inbound`): for
//! each guarded Pod, address and port class, the source space cut into ranges over which
//! [`PodPolicies::decide`] cannot change its mind, each range a few LPM entries. The kernel then
//! decides a connection with one or two lookups; [`InboundTable::lookup`] is the same lookup in
//! Rust, for the tests that hold the two to the same decisions and for `redirect explain`.
//!
//! Why ranges suffice: for a plaintext client a decision depends on the source address only
//! through its membership in the `ipBlocks`/`notIpBlocks` (and `source.ip`) networks of the Pod's
//! policies, on the port only through its membership in their `ports`/`notPorts`. So the elementary
//! intervals between those networks' edges, and the ports named plus "any other", decide alike.
//! The node's own Pods are not plaintext when the agent knows who they are: each gets an exact
//! entry decided with its identity (when that differs from the plaintext decision).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use ipnet::IpNet;
use redirect_common::inbound::{
    INBOUND_ALLOW, INBOUND_DENY, INBOUND_FIXED_BITS, INBOUND_RULES, InboundBytes, InboundVerdict,
    OTHER_PORTS, inbound_bytes, inbound_prefix,
};

use super::{
    decide::{Conn, Decision},
    node::{NodePolicies, PodPolicies},
    policy::Match,
};
use crate::hbone::Identity;

/// Where Istio's CNI sends kubelet's health probes from. Upstream never redirects it to ztunnel,
/// so no policy ever decides it: the table admits it on every port of every guarded Pod.
pub(crate) const KUBELET_PROBE: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);

/// The entries of each address of a Pod left out: the refusal and the probe's admission.
const LEFT_OUT_ENTRIES: usize = 2;

/// A Pod of this node as a client: its address and, when the agent can confirm it, its identity
/// (`None`: treated as plaintext, no identity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalClient {
    pub ip: IpAddr,
    pub identity: Option<Identity>,
}

/// What an entry's `rule` index stands for: the counters' and the access log's label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Rule {
    /// The Pod's policies decided so (and these dry-run policies matched).
    Decided(Decision),
    /// [`KUBELET_PROBE`], admitted undecided.
    KubeletProbe,
    /// A Pod left out of the table for its size: refused in the kernel, reached only by the proxy.
    LeftOut,
    /// Every verdict past the first `INBOUND_RULES - 1` distinct ones, counted together.
    Other,
}

impl Rule {
    /// The rule of `verdict` with no dry-run policy matching.
    #[cfg(test)]
    pub(crate) fn decided(verdict: super::Verdict) -> Rule {
        Rule::Decided(Decision {
            verdict,
            dry_run_matches: Vec::new(),
        })
    }

    /// Whether the kernel admits what this rule decides.
    pub(crate) fn allowed(&self) -> bool {
        match self {
            Rule::Decided(d) => d.verdict.allowed(),
            Rule::KubeletProbe => true,
            Rule::LeftOut => false,
            // Never an entry's own label, only the shared slot's.
            Rule::Other => false,
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::Decided(d) => d.verdict.fmt(f),
            Rule::KubeletProbe => {
                f.write_str("kubelet health probe (169.254.7.127), never decided, as upstream")
            }
            Rule::LeftOut => {
                f.write_str("not in the kernel's table: only the proxy's connections reach it")
            }
            Rule::Other => f.write_str("other"),
        }
    }
}

/// The kernel's inbound table for the node, and the labels of its rules. The default is empty:
/// no Pod guarded.
#[derive(Debug, Clone, Default)]
pub(crate) struct InboundTable {
    /// (key masked to its prefix, prefix length, value), sorted by key then length.
    entries: Vec<(InboundBytes, u32, InboundVerdict)>,
    /// The index of each entry, by prefix length, longest first: the lookup tries each length.
    by_len: Vec<(u32, HashMap<InboundBytes, usize>)>,
    /// The label of each `InboundVerdict::rule`.
    rules: Vec<Rule>,
    /// The guarded Pods compiled in full, by (namespace, name).
    pods: Vec<Arc<PodPolicies>>,
    /// The guarded Pods that did not fit, by (namespace, name): a refusal and the probe's
    /// admission per address.
    left_out: Vec<Arc<PodPolicies>>,
    /// Every address with entries (of the Pods in the table and of those left out), sorted.
    addresses: Vec<IpAddr>,
}

/// One Pod's entries before the budget: (key, prefix length, index into `rules`).
struct PodEntries {
    pod: Arc<PodPolicies>,
    /// The addresses the Pod is guarded at (those `NodePolicies::pod` answers with this Pod).
    addresses: Vec<IpAddr>,
    entries: BTreeMap<(InboundBytes, u32), usize>,
    rules: Vec<Rule>,
}

impl InboundTable {
    /// Compiles the table for every guarded Pod of `policies`, `clients` being every Pod of the
    /// node (their sources get exact entries decided with their identity), within `max_entries`.
    ///
    /// When the Pods do not all fit, those left out are the largest: keeping the smallest first
    /// keeps the most Pods decided in the kernel (of two alike, the first by (namespace, name)). A Pod left out still gets two entries per
    /// address, without port classes: one refusing every source on every port (fail closed: the
    /// caller routes same-node clients of those Pods through the proxy, whose own dials the kernel
    /// lets through), and the kubelet probe's admission (its health checks never reach the proxy,
    /// and refusing them would take the Pod out of service). Those entries are always there, so
    /// the table exceeds `max_entries` only when it is smaller than twice the guarded addresses.
    pub(crate) fn compile(
        policies: &NodePolicies,
        clients: &[LocalClient],
        max_entries: usize,
    ) -> InboundTable {
        let clients = distinct_clients(clients);
        let mut pods: Vec<&Arc<PodPolicies>> = policies.guarded_pods().collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name, &a.ips).cmp(&(&b.namespace, &b.name, &b.ips)));
        let compiled: Vec<PodEntries> = pods
            .into_iter()
            .map(|pod| {
                let mut addresses: Vec<IpAddr> = (pod.ips.iter())
                    .map(|ip| ip.to_canonical())
                    .filter(|ip| policies.pod(*ip).is_some_and(|p| Arc::ptr_eq(p, pod)))
                    .collect();
                addresses.sort();
                addresses.dedup();
                compile_pod(pod, addresses, &clients)
            })
            .collect();

        // Keep the smallest Pods first while they fit; the fallback of the others is reserved.
        let mut by_size: Vec<usize> = (0..compiled.len()).collect();
        by_size.sort_by_key(|i| compiled[*i].entries.len());
        let mut kept = vec![false; compiled.len()];
        let mut total: usize = compiled
            .iter()
            .map(|p| LEFT_OUT_ENTRIES * p.addresses.len())
            .sum();
        for i in by_size {
            let pod = &compiled[i];
            let with = total - LEFT_OUT_ENTRIES * pod.addresses.len() + pod.entries.len();
            if with <= max_entries {
                kept[i] = true;
                total = with;
            }
        }

        let mut rules = Rules::default();
        let mut entries = Vec::with_capacity(total);
        let (mut in_table, mut left_out) = (Vec::new(), Vec::new());
        let mut addresses = Vec::new();
        for (pod, kept) in compiled.into_iter().zip(kept) {
            addresses.extend(&pod.addresses);
            if kept {
                // The verdict's own, not its label's: the shared last label has none.
                let labels: Vec<(bool, u16)> = (pod.rules.into_iter())
                    .map(|r| (r.allowed(), rules.index(r)))
                    .collect();
                for ((key, len), rule) in pod.entries {
                    let (allowed, index) = labels[rule];
                    entries.push((key, len, verdict(allowed, index)));
                }
                in_table.push(pod.pod);
            } else {
                let refused = rules.index(Rule::LeftOut);
                let probe = rules.index(Rule::KubeletProbe);
                let probe_src = addr16(IpAddr::V4(KUBELET_PROBE));
                for dst in &pod.addresses {
                    let dst = addr16(*dst);
                    let all = inbound_bytes(&dst, OTHER_PORTS, &[0; 16]);
                    entries.push((all, INBOUND_FIXED_BITS, verdict(false, refused)));
                    let key = inbound_bytes(&dst, OTHER_PORTS, &probe_src);
                    entries.push((key, inbound_prefix(128), verdict(true, probe)));
                }
                left_out.push(pod.pod);
            }
        }
        entries.sort_by_key(|e| (e.0, e.1));

        let mut lens: BTreeMap<u32, HashMap<InboundBytes, usize>> = BTreeMap::new();
        for (i, (key, len, _)) in entries.iter().enumerate() {
            lens.entry(*len).or_default().insert(*key, i);
        }
        addresses.sort();
        InboundTable {
            entries,
            by_len: lens.into_iter().rev().collect(),
            rules: rules.list,
            pods: in_table,
            left_out,
            addresses,
        }
    }

    /// Every entry: (key, its first `prefix length` bits significant, value), sorted.
    pub(crate) fn entries(
        &self,
    ) -> impl ExactSizeIterator<Item = (&InboundBytes, u32, &InboundVerdict)> {
        self.entries.iter().map(|(key, len, v)| (key, *len, v))
    }

    /// [`Self::entries`], for the writer that sizes the kernel's trie by their count first.
    pub(crate) fn entries_exact(
        &self,
    ) -> impl ExactSizeIterator<Item = (&InboundBytes, u32, &InboundVerdict)> {
        self.entries()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every address the table has entries for (the guarded Pods', those left out included),
    /// sorted: the kernel decides every connection to them.
    pub(crate) fn addresses(&self) -> impl ExactSizeIterator<Item = IpAddr> + '_ {
        self.addresses.iter().copied()
    }

    /// The label of each rule index ([`InboundVerdict::rule`]).
    pub(crate) fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The guarded Pods decided in the kernel, by (namespace, name).
    pub(crate) fn pods(&self) -> &[Arc<PodPolicies>] {
        &self.pods
    }

    /// The guarded Pods that did not fit, by (namespace, name): the kernel refuses every
    /// connection to them but the proxy's (and kubelet's probes), so their same-node clients must
    /// go through the proxy.
    pub(crate) fn left_out(&self) -> &[Arc<PodPolicies>] {
        &self.left_out
    }

    /// The kernel's lookup: the longest prefix matching (`dst`, `port`, `src`) and, on a miss,
    /// (`dst`, [`OTHER_PORTS`], `src`). `None` on two misses: `dst` is not guarded, and the kernel
    /// lets the connection through.
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "`redirect explain` asks it next; the tests now")
    )]
    pub(crate) fn lookup(&self, src: IpAddr, dst: IpAddr, port: u16) -> Option<InboundVerdict> {
        let (src, dst) = (addr16(src), addr16(dst));
        self.longest(&inbound_bytes(&dst, port, &src))
            .or_else(|| self.longest(&inbound_bytes(&dst, OTHER_PORTS, &src)))
    }

    /// As the kernel's LPM trie: among the entries whose first `len` bits are the key's, the
    /// longest.
    fn longest(&self, key: &InboundBytes) -> Option<InboundVerdict> {
        self.by_len.iter().find_map(|(len, bucket)| {
            let i = bucket.get(&mask(key, *len))?;
            Some(self.entries[*i].2)
        })
    }
}

/// The first `len` bits of `key`, the rest zero.
fn mask(key: &InboundBytes, len: u32) -> InboundBytes {
    let mut out = [0; 36];
    let whole = ((len / 8) as usize).min(out.len());
    out[..whole].copy_from_slice(&key[..whole]);
    let bits = len % 8;
    if bits > 0 && whole < out.len() {
        out[whole] = key[whole] & (0xffu8 << (8 - bits));
    }
    out
}

fn verdict(allowed: bool, rule: u16) -> InboundVerdict {
    InboundVerdict {
        allow: if allowed { INBOUND_ALLOW } else { INBOUND_DENY },
        _pad: 0,
        rule,
    }
}

/// An address in its 16-byte form: IPv4 v4-mapped.
fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip.to_canonical() {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The clients by canonical address; of two at one address, the first (the agent does not hand
/// the same address to two Pods; were it to, one exact entry can hold one identity).
fn distinct_clients(clients: &[LocalClient]) -> Vec<(IpAddr, Option<&Identity>)> {
    let mut seen = BTreeSet::new();
    let mut out: Vec<(IpAddr, Option<&Identity>)> = clients
        .iter()
        .filter(|c| seen.insert(c.ip.to_canonical()))
        .map(|c| (c.ip.to_canonical(), c.identity.as_ref()))
        .collect();
    out.sort_by_key(|c| c.0);
    out
}

/// The rule labels of the table, each distinct one once, the last slot shared.
#[derive(Default)]
struct Rules {
    list: Vec<Rule>,
    /// By the label's text (`Verdict` has no `Hash`; distinct labels read differently).
    index: HashMap<String, u16>,
}

impl Rules {
    fn index(&mut self, rule: Rule) -> u16 {
        // The whole rule, its dry-run matches with it: two rules of one verdict count apart.
        let text = format!("{rule:?}");
        if let Some(i) = self.index.get(&text) {
            return *i;
        }
        let last = (INBOUND_RULES - 1) as usize;
        if self.list.len() < last {
            let i = self.list.len() as u16;
            self.list.push(rule);
            self.index.insert(text, i);
            i
        } else {
            if self.list.len() == last {
                self.list.push(Rule::Other);
            }
            last as u16
        }
    }
}

/// Every match of the Pod's policies, dry-run ones included: they change no verdict, but what
/// they match is counted by the rule too.
fn matches(pod: &PodPolicies) -> impl Iterator<Item = &Match> {
    (pod.policies.iter())
        .flat_map(|p| &p.groups)
        .flat_map(|g| &g.clauses)
        .flat_map(|c| &c.matches)
}

/// One family's address space, as integers.
struct Family {
    /// Address bits: 32 or 128.
    width: u32,
    /// The source bits of the family's root in the 16-byte form: 96 (`::ffff:0:0/96`) or 0.
    root_bits: u32,
    /// A range no entry of the family may cover (IPv6: the v4-mapped space, IPv4's).
    excluded: Option<(u128, u128)>,
}

const V4: Family = Family {
    width: 32,
    root_bits: 96,
    excluded: None,
};
const V6: Family = Family {
    width: 128,
    root_bits: 0,
    excluded: Some((0xffff_0000_0000, 0xffff_ffff_ffff)),
};

impl Family {
    fn max(&self) -> u128 {
        u128::MAX >> (128 - self.width)
    }

    fn addr(&self, value: u128) -> IpAddr {
        if self.width == 32 {
            IpAddr::V4(Ipv4Addr::from(value as u32))
        } else {
            IpAddr::V6(Ipv6Addr::from(value))
        }
    }

    /// The 16-byte form of `value` and the source bits of a /`prefix` at it.
    fn source(&self, value: u128, prefix: u32) -> ([u8; 16], u32) {
        (addr16(self.addr(value)), self.root_bits + prefix)
    }

    /// The elementary intervals (inclusive) between the edges of `nets`, the excluded range left
    /// out: every address of one decides alike.
    fn intervals(&self, nets: &[(u128, u128)]) -> Vec<(u128, u128)> {
        let mut starts = BTreeSet::from([0u128]);
        let edges = nets.iter().copied().chain(self.excluded);
        for (lo, hi) in edges {
            starts.insert(lo);
            if hi < self.max() {
                starts.insert(hi + 1);
            }
        }
        let starts: Vec<u128> = starts.into_iter().collect();
        (starts.iter().enumerate())
            .map(|(i, lo)| (*lo, starts.get(i + 1).map_or(self.max(), |next| next - 1)))
            .filter(|(lo, hi)| self.excluded.is_none_or(|(x, y)| !(x <= *lo && *hi <= y)))
            .collect()
    }
}

/// The fewest prefixes (value, length) covering exactly `lo..=hi` in a `width`-bit space.
fn cover(mut lo: u128, hi: u128, width: u32) -> Vec<(u128, u32)> {
    let mut out = Vec::new();
    loop {
        // The largest block aligned at `lo` that stays within `hi`.
        let mut bits = lo.trailing_zeros().min(width);
        while bits > 0 && block_end(lo, bits) > hi {
            bits -= 1;
        }
        let end = block_end(lo, bits);
        out.push((lo, width - bits));
        if end >= hi {
            return out;
        }
        lo = end + 1;
    }
}

/// The last value of the `bits`-bit block at `lo` (aligned).
fn block_end(lo: u128, bits: u32) -> u128 {
    if bits >= 128 {
        u128::MAX
    } else {
        lo | ((1u128 << bits) - 1)
    }
}

/// The source entries of one port class: (source address, source bits, index of the rule).
type Sources = Vec<([u8; 16], u32, usize)>;

/// One Pod's entries: every port class of every address, every source range of each.
fn compile_pod(
    pod: &Arc<PodPolicies>,
    addresses: Vec<IpAddr>,
    clients: &[(IpAddr, Option<&Identity>)],
) -> PodEntries {
    let named: BTreeSet<u16> = matches(pod)
        .flat_map(|m| m.destination_ports.iter().chain(&m.not_destination_ports))
        .copied()
        .filter(|p| *p != OTHER_PORTS)
        .collect();
    // Every port no policy names decides as the smallest of them.
    let other = (1..=u16::MAX).find(|p| !named.contains(p));
    let mut nets: [Vec<(u128, u128)>; 2] = [Vec::new(), Vec::new()];
    for net in matches(pod).flat_map(|m| m.source_ips.iter().chain(&m.not_source_ips)) {
        match net {
            IpNet::V4(n) => (nets[0]).push((
                u32::from(n.network()).into(),
                u32::from(n.broadcast()).into(),
            )),
            IpNet::V6(n) => (nets[1]).push((n.network().into(), n.broadcast().into())),
        }
    }
    let mut out = PodEntries {
        pod: pod.clone(),
        addresses: Vec::new(),
        entries: BTreeMap::new(),
        rules: Vec::new(),
    };
    let label = |rules: &mut Vec<Rule>, rule: Rule| match rules.iter().position(|r| *r == rule) {
        Some(i) => i,
        None => {
            rules.push(rule);
            rules.len() - 1
        }
    };
    let probe = label(&mut out.rules, Rule::KubeletProbe);
    for dst in &addresses {
        let dst16 = addr16(*dst);
        let classes = named.iter().map(|p| (*p, *p));
        let mut by_class: Vec<(u16, Sources)> = Vec::new();
        for (class, port) in classes.chain(other.map(|p| (OTHER_PORTS, p))) {
            let decide = |src: IpAddr, id: Option<&Identity>| {
                let conn = Conn {
                    src_identity: id,
                    src_ip: src,
                    dst_ip: *dst,
                    dst_port: port,
                };
                Rule::Decided(pod.decide(&conn))
            };
            let mut sources = Vec::new();
            for (family, nets) in [(&V4, &nets[0]), (&V6, &nets[1])] {
                for (value, prefix, rule) in ranges(family, nets, |a| decide(a, None)) {
                    let (src, bits) = family.source(value, prefix);
                    sources.push((src, bits, label(&mut out.rules, rule)));
                }
            }
            for (ip, id) in clients {
                let rule = decide(*ip, *id);
                // A client decided as plaintext from its address is, by the ranges, already.
                if id.is_some() && rule != decide(*ip, None) {
                    sources.push((addr16(*ip), 128, label(&mut out.rules, rule)));
                }
            }
            sources.push((addr16(IpAddr::V4(KUBELET_PROBE)), 128, probe));
            by_class.push((class, sources));
        }
        // A named port that decides every source as the other ports do needs no class: its
        // lookup misses and falls to the other ports'.
        let others = by_class
            .last()
            .filter(|(c, _)| *c == OTHER_PORTS)
            .map(|c| c.1.clone());
        for (class, sources) in by_class {
            if class != OTHER_PORTS && others.as_ref() == Some(&sources) {
                continue;
            }
            for (src, bits, rule) in sources {
                let key = inbound_bytes(&dst16, class, &src);
                out.entries.insert((key, inbound_prefix(bits)), rule);
            }
        }
    }
    out.addresses = addresses;
    out
}

/// One family's plaintext source ranges: (value, prefix length in the family, rule). The most
/// frequent decision (by the prefixes it would take) sits at the family's root, and only the
/// ranges deciding otherwise get prefixes of their own.
fn ranges(
    family: &Family,
    nets: &[(u128, u128)],
    decide: impl Fn(IpAddr) -> Rule,
) -> Vec<(u128, u32, Rule)> {
    // Runs of adjacent intervals deciding alike.
    let mut runs: Vec<(u128, u128, Rule)> = Vec::new();
    for (lo, hi) in family.intervals(nets) {
        let rule = decide(family.addr(lo));
        match runs.last_mut() {
            Some((_, end, last)) if *last == rule && *end + 1 == lo => *end = hi,
            _ => runs.push((lo, hi, rule)),
        }
    }
    let covers: Vec<Vec<(u128, u32)>> = (runs.iter())
        .map(|(lo, hi, _)| cover(*lo, *hi, family.width))
        .collect();
    let mut weight: Vec<(&Rule, usize)> = Vec::new();
    for ((_, _, rule), c) in runs.iter().zip(&covers) {
        match weight.iter_mut().find(|(r, _)| *r == rule) {
            Some((_, w)) => *w += c.len(),
            None => weight.push((rule, c.len())),
        }
    }
    // The first of the heaviest: `max_by_key` would take the last.
    let root = (weight.iter())
        .fold(None::<(&Rule, usize)>, |best, (r, w)| match best {
            Some((_, bw)) if bw >= *w => best,
            _ => Some((r, *w)),
        })
        .map(|(r, _)| r.clone());
    let mut out = Vec::new();
    if let Some(root) = &root {
        out.push((0, 0, root.clone()));
    }
    for ((_, _, rule), c) in runs.iter().zip(covers) {
        if Some(rule) != root.as_ref() {
            out.extend(c.into_iter().map(|(v, p)| (v, p, rule.clone())));
        }
    }
    out
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
