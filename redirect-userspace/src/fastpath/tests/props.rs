//! Random worlds: whenever the kernel model decides, the proxy decides the same.
use std::net::IpAddr;

use proptest::prelude::*;
use redirect_common::fastpath::{IpKey, MAX_ENDPOINTS, WORKLOAD_GUARDED, WORKLOAD_PROXY};

use super::{HEADER, agrees, ip};
use crate::{
    config::load_sources,
    fastpath::{
        Clients, DecidedBy, Fallback, FastDecision, Limits, compile, decide, decide_for,
        decide_hidden, decided_by,
    },
    state::{Outbound, Pick, Snapshot, Target},
};

pub(super) const NAMESPACES: [&str; 5] = ["pub-a", "pub-b", "ns-c", "ns-d", "none-e"];
/// Exact addresses (a v4-mapped one, a pod's) and overlapping networks of both families.
const ADDRESSES: [&str; 10] = [
    "203.0.113.1",
    "203.0.113.2",
    "\"::ffff:203.0.113.3\"",
    "10.244.0.5",
    "\"2001:db8::1\"",
    "203.0.113.0/30",
    "203.0.113.0/29",
    "203.0.0.0/16",
    "\"2001:db8::/64\"",
    "\"::/0\"",
];
const POD_IPS: [&str; 4] = ["10.244.0.5", "10.244.0.6", "203.0.113.2", "2001:db8::5"];
const DESTINATIONS: [&str; 15] = [
    "203.0.113.1",
    "203.0.113.2",
    "203.0.113.3",
    "::ffff:203.0.113.1",
    "203.0.113.7",
    "203.0.9.9",
    "10.244.0.5",
    "10.244.0.6",
    "2001:db8::1",
    "2001:db8::5",
    "2001:db8::9",
    "2001:db9::1",
    "192.0.2.1",
    "::ffff:192.0.2.1",
    "::ffff:10.244.0.6",
];
const PORTS: [u16; 3] = [80, 443, 22];
/// Endpoint lists: plain IPv4 (one, two, a duplicate), IPv6, a host name, mixed, none.
const ENDPOINTS: [&str; 7] = [
    "[{address: 198.51.100.1}]",
    "[{address: 198.51.100.1}, {address: 198.51.100.2, ports: {http: 8080}}]",
    "[{address: 198.51.100.3}, {address: 198.51.100.3}]",
    "[{address: \"2001:db8:1::1\"}]",
    "[{address: origin.example.org}]",
    "[{address: 198.51.100.1}, {address: \"2001:db8:1::1\"}]",
    "[]",
];

/// Host names, few, so that entries of one namespace share one (one namespace, one host) and one
/// is a Kubernetes Service's own name.
const HOSTS: [&str; 3] = [
    "h0.example.com",
    "h1.example.com",
    "s0.pub-a.svc.cluster.local",
];

#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) ns: usize,
    pub(super) host: usize,
    /// `None`: no addresses declared (allocated, or not with the opt-out label).
    pub(super) addresses: Option<Vec<usize>>,
    pub(super) opt_out: bool,
    pub(super) resolution: usize,
    pub(super) https: bool,
    pub(super) endpoints: usize,
    pub(super) selector: bool,
    pub(super) age: Option<u8>,
}

pub(super) fn entry() -> impl Strategy<Value = Entry> {
    (
        (0..NAMESPACES.len(), 0..HOSTS.len()),
        proptest::option::weighted(0.8, proptest::collection::vec(0..ADDRESSES.len(), 1..3)),
        any::<bool>(),
        0..3usize,
        any::<bool>(),
        0..ENDPOINTS.len(),
        any::<bool>(),
        proptest::option::of(0..5u8),
    )
        .prop_map(
            |((ns, host), addresses, opt_out, resolution, https, endpoints, selector, age)| Entry {
                ns,
                host,
                addresses,
                opt_out,
                resolution,
                https,
                endpoints,
                selector,
                age,
            },
        )
}

#[derive(Debug, Clone)]
pub(super) struct World {
    pub(super) entries: Vec<Entry>,
    /// Kubernetes Services: (namespace, exact address).
    pub(super) services: Vec<(usize, usize)>,
    /// Pods: (namespace, address, labelled `app: x`).
    pub(super) pods: Vec<(usize, usize, bool)>,
    /// `discoverySelectors` that leave `ns-d` out.
    pub(super) discovery: bool,
    /// Namespaces with an authorization policy on all their Pods.
    pub(super) guarded: Vec<usize>,
}

pub(super) fn world() -> impl Strategy<Value = World> {
    (
        proptest::collection::vec(entry(), 0..7),
        proptest::collection::vec((0..NAMESPACES.len(), 0..5usize), 0..3),
        proptest::collection::vec((0..NAMESPACES.len(), 0..POD_IPS.len(), any::<bool>()), 0..5),
        any::<bool>(),
        proptest::collection::vec(0..NAMESPACES.len(), 0..2),
    )
        .prop_map(|(entries, services, pods, discovery, guarded)| World {
            entries,
            services,
            pods,
            discovery,
            guarded,
        })
}

pub(super) fn yaml(world: &World) -> String {
    let mut out = String::from(HEADER);
    if world.discovery {
        out = out.replacen(
            "serviceEntryVisibility:",
            "discoverySelectors: [{matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [ns-d]}]}]\nserviceEntryVisibility:",
            1,
        );
    }
    let ts = |age: Option<u8>| {
        age.map_or(String::new(), |a| {
            format!(", creationTimestamp: \"2024-01-0{}T00:00:00Z\"", a + 1)
        })
    };
    for (i, e) in world.entries.iter().enumerate() {
        // Host-name endpoints need resolution DNS.
        let resolution = match (e.resolution, ENDPOINTS[e.endpoints].contains("origin")) {
            (0, true) => "DNS",
            (r, _) => ["STATIC", "DNS", "NONE"][r],
        };
        let mut addresses: Vec<&str> = e
            .addresses
            .iter()
            .flatten()
            .map(|a| ADDRESSES[*a])
            .collect();
        // Networks need resolution STATIC or NONE.
        if resolution == "DNS" {
            addresses.retain(|a| !a.contains('/'));
            if addresses.is_empty() && e.addresses.is_some() {
                addresses.push(ADDRESSES[0]);
            }
        }
        let labels = if e.opt_out {
            ", labels: {networking.istio.io/enable-autoallocate-ip: \"false\"}"
        } else {
            ""
        };
        let ports = if e.https {
            "[{number: 80, name: http}, {number: 443, name: https, targetPort: 8443}]"
        } else {
            "[{number: 80, name: http}]"
        };
        let endpoints = if resolution == "NONE" {
            String::new()
        } else if e.selector {
            ", workloadSelector: {labels: {app: x}}".to_string()
        } else {
            format!(", endpoints: {}", ENDPOINTS[e.endpoints])
        };
        out.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: e{i}, namespace: {}{}{labels}}}\nspec: {{hosts: [{}], addresses: [{}], ports: {ports}, resolution: {resolution}{endpoints}}}\n",
            NAMESPACES[e.ns],
            ts(e.age),
            HOSTS[e.host],
            addresses.join(", "),
        ));
    }
    for (i, (ns, address)) in world.services.iter().enumerate() {
        out.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: {}}}\nspec: {{clusterIP: {}, selector: {{app: x}}, ports: [{{port: 80, targetPort: 8080}}]}}\n",
            NAMESPACES[*ns],
            ADDRESSES[*address].trim_matches('"').trim_start_matches("::ffff:"),
        ));
    }
    for (i, (ns, address, labelled)) in world.pods.iter().enumerate() {
        let labels = if *labelled { ", labels: {app: x}" } else { "" };
        out.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}, namespace: {}{labels}}}\nstatus: {{podIP: \"{}\"}}\n",
            NAMESPACES[*ns], POD_IPS[*address],
        ));
    }
    for ns in &world.guarded {
        out.push_str(&format!(
            "---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: deny-all, namespace: {}}}\nspec: {{action: DENY, rules: [{{}}]}}\n",
            NAMESPACES[*ns],
        ));
    }
    out
}

fn snapshot(world: &World) -> Snapshot {
    let yaml = yaml(world);
    match load_sources([("w.yaml", yaml.as_str())]) {
        Ok(model) => Snapshot::from_model(&model),
        Err(e) => panic!("generated world does not load:\n{e}\n{yaml}"),
    }
}

fn clients() -> impl Iterator<Item = Option<&'static str>> {
    NAMESPACES
        .iter()
        .map(|ns| Some(*ns))
        .chain([None, Some("elsewhere")])
}

/// Every client, destination and port: the kernel agrees with the proxy whenever it decides, and
/// `decided_by` says who decides.
/// With `complete`, also the other way round: the kernel hands the proxy only what needs it.
fn check(snap: &Snapshot, limits: Limits, complete: bool) -> Result<usize, TestCaseError> {
    let (tables, stats) = compile(snap, limits);
    // Hide reports left out with their namespace: the kernel then reports fewer hides, never others.
    let uncounted = stats.fallbacks.contains_key(&Fallback::HidesUncounted);
    // The agent registers one cgroup per client namespace; the unknown client's is not registered.
    let mut installed = Clients::new(&tables);
    let registered: Vec<(u64, Option<&str>)> = clients()
        .enumerate()
        .map(|(i, ns)| {
            let cgroup = i as u64 + 1;
            if let Some(ns) = ns {
                // A full table is counted by the agent; the kernel then sends misses to the proxy.
                let _ = installed.set(&tables, cgroup, ns, false);
            }
            (cgroup, ns)
        })
        .collect();
    let mut in_kernel = 0;
    for (cgroup, client) in registered {
        for dst in DESTINATIONS {
            for port in PORTS {
                let dst = ip(dst);
                let fast = decide(&tables, &installed, cgroup, dst, port);
                agrees(snap, fast, client, dst, port).map_err(TestCaseError::fail)?;
                let ns = client.map_or(0, |c| tables.namespace_id(c));
                let by_name = decide_for(&tables, ns, dst, port);
                agrees(snap, by_name, client, dst, port).map_err(TestCaseError::fail)?;
                // What the kernel counts as hidden is what the proxy would have (the kernel decides
                // for pods of known namespaces only).
                let (decision, hidden) = decide_hidden(&tables, ns, dst, port);
                if client.is_some() && decision != FastDecision::Proxy {
                    let proxy = snap.decide_outbound_with(client, dst, port, Pick::Peek);
                    let name = |s: &crate::state::Service| format!("{}/{}", s.namespace, s.name);
                    let kernel = hidden
                        .and_then(|id| snap.services().nth(id as usize))
                        .map(name);
                    let want = proxy.hidden.map(name);
                    // Past an exact address whose report was left out, the kernel may report the
                    // hide of a network holding it: still a service hidden from this client.
                    let hidden_here = |id: u32| {
                        snap.services().nth(id as usize).is_some_and(|s| {
                            s.visibility == crate::state::ServiceVisibility::Namespace
                                && Some(s.namespace.as_str()) != client
                        })
                    };
                    let another_hide = hidden.is_none_or(hidden_here);
                    prop_assert!(
                        kernel == want || (uncounted && another_hide),
                        "hidden: {:?} -> {}:{}: kernel {:?}, proxy {:?}",
                        client,
                        dst,
                        port,
                        kernel,
                        want
                    );
                }
                let by = decided_by(&tables, client, dst, port);
                prop_assert_eq!(by == DecidedBy::Proxy, by_name == FastDecision::Proxy);
                // A cgroup the agent could not name is the proxy's: it knows the client by address.
                if client.is_none() {
                    prop_assert_eq!(fast, FastDecision::Proxy);
                }
                if complete && by_name == FastDecision::Proxy {
                    prop_assert!(
                        needs_proxy(snap, client, dst, port),
                        "{client:?} -> {dst}:{port} could have been decided in the kernel"
                    );
                }
                // A Pod under authorization is the proxy's to reach unless the kernel's inbound
                // table holds its policies; then it is marked guarded, left alone only while the
                // inbound check runs in its namespace.
                match by_name {
                    FastDecision::Proxy => {}
                    // The program sends a pick that lands on an endpoint of the proxy's to it.
                    FastDecision::Rewrite(backends) => {
                        for b in backends.endpoints.iter() {
                            let key = IpKey {
                                family: backends.family,
                                addr: b.addr,
                            };
                            let class = tables.workloads().get(&key).copied();
                            let authz = snap.authz();
                            prop_assert!(
                                authz.pod(key.ip()).is_none()
                                    || class == Some(WORKLOAD_PROXY)
                                    || (class == Some(WORKLOAD_GUARDED)
                                        && !authz.proxy_only(key.ip())),
                                "{client:?} -> {dst}:{port}: endpoint {:?} under policy may be picked in the kernel",
                                key.ip()
                            );
                        }
                    }
                    _ => prop_assert!(
                        !reaches_guarded(snap, client, dst, port),
                        "{client:?} -> {dst}:{port} may reach a Pod under policy, decided in the kernel"
                    ),
                }
                in_kernel += usize::from(by_name != FastDecision::Proxy);
            }
        }
    }
    Ok(in_kernel)
}

/// Whether the proxy's decision may take the connection to a Pod only the proxy may reach (its
/// authorization policies did not fit the kernel's inbound table): any of a service port's
/// endpoints, or the address itself. (A Pod whose policies the kernel holds is decided at its
/// own socket lookup, wherever the connection comes from: the fast path leaves it alone.)
fn reaches_guarded(snap: &Snapshot, client: Option<&str>, dst: IpAddr, port: u16) -> bool {
    let d = snap.decide_outbound_with(client, dst, port, Pick::Peek);
    let guarded = |ip: IpAddr| snap.authz().proxy_only(ip);
    match d.action {
        Outbound::Service { port, .. } => port.endpoints.iter().any(|ep| match ep.target() {
            Target::Addr(a) => guarded(a.ip()),
            Target::Host { .. } => false,
        }),
        Outbound::Workload { addr, .. } | Outbound::Passthrough { addr, .. } => guarded(addr.ip()),
        Outbound::NoHealthyUpstream { .. } => false,
    }
}

/// What only the proxy can do: reset (no healthy upstream), resolve a host name, decide a Pod's
/// authorization, or pick among endpoints that are not all of the destination's family, or more
/// than one rewrite holds.
fn needs_proxy(snap: &Snapshot, client: Option<&str>, dst: IpAddr, port: u16) -> bool {
    if reaches_guarded(snap, client, dst, port) {
        return true;
    }
    let d = snap.decide_outbound_with(client, dst, port, Pick::Peek);
    match d.action {
        Outbound::NoHealthyUpstream { .. } => true,
        Outbound::Service { port, .. } => {
            port.endpoints.len() > MAX_ENDPOINTS
                || port.endpoints.iter().any(|ep| match ep.target() {
                    Target::Addr(a) => {
                        a.ip().to_canonical().is_ipv4() != dst.to_canonical().is_ipv4()
                    }
                    Target::Host { .. } => true,
                })
        }
        Outbound::Workload { .. } | Outbound::Passthrough { .. } => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn kernel_decisions_are_the_proxys(world in world()) {
        let snap = snapshot(&world);
        let in_kernel = check(&snap, Limits::default(), true)?;
        // Most of these destinations are claimed by no one the client can see: the kernel decides
        // many of them, so the agreement above is not vacuous.
        prop_assert!(in_kernel > 0);
    }

    #[test]
    fn kernel_decisions_are_the_proxys_with_tables_that_overflow(
        world in world(),
        limits in (0..3usize, 0..4usize, 0..4usize, 0..4usize, 0..4usize, 0..4usize),
        bytes in (0..4096usize, 0..2048usize),
    ) {
        let snap = snapshot(&world);
        let (namespaces, clients, exact, cidrs, ports, workloads) = limits;
        let (bytes, namespace_bytes) = bytes;
        let limits = Limits { namespaces, clients, exact, cidrs, ports, workloads, bytes, namespace_bytes };
        check(&snap, limits, false)?;
    }

    /// Only the memory bounds the tables (the agent's limits), and it runs out: what does not fit
    /// is the proxy's, with the proxy's answers, and the rest stays in the kernel.
    #[test]
    fn kernel_decisions_are_the_proxys_within_a_memory_budget(
        world in world(),
        memory in 0..16_384usize,
    ) {
        let snap = snapshot(&world);
        check(&snap, Limits::within(memory), false)?;
    }
}
