//! The fast path against `Snapshot::decide_outbound`: a named case per rule, and property tests on
//! random worlds. Every check goes through [`agrees`]: a kernel answer must be the proxy's.
use std::net::{IpAddr, SocketAddr};

use redirect_common::fastpath::{AddrKey, IpKey, MAX_ENDPOINTS, NS_PROXY, NS_UNKNOWN};

use super::*;
use crate::{
    config::load_sources,
    state::{Outbound, OutboundOutcome, Pick, Snapshot, Target},
};

mod patched;
mod props;

const HEADER: &str = r#"
kind: MeshConfig
serviceEntryVisibility:
  defaultVisibility: NAMESPACE
  policies:
  - visibility: PUBLIC
    matchingRules: [{namespaceSelector: {matchLabels: {publish: "yes"}}}]
  - visibility: NONE
    matchingRules: [{namespaceSelector: {matchLabels: {quarantine: "yes"}}}]
---
apiVersion: v1
kind: Namespace
metadata: {name: pub-a, labels: {publish: "yes"}}
---
apiVersion: v1
kind: Namespace
metadata: {name: pub-b, labels: {publish: "yes"}}
---
apiVersion: v1
kind: Namespace
metadata: {name: ns-c}
---
apiVersion: v1
kind: Namespace
metadata: {name: ns-d}
---
apiVersion: v1
kind: Namespace
metadata: {name: none-e, labels: {quarantine: "yes"}}
"#;

/// `pub-*` publish their entries, `ns-*` keep them, `none-e`'s are NONE.
fn snapshot(objects: &str) -> Snapshot {
    let yaml = format!("{HEADER}---\n{objects}");
    match load_sources([("w.yaml", yaml.as_str())]) {
        Ok(model) => Snapshot::from_model(&model),
        Err(e) => panic!("world does not load:\n{e}\n{yaml}"),
    }
}

/// A ServiceEntry in one line of YAML.
fn entry(name: &str, ns: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
    )
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Checks a kernel answer against the proxy's decision for the same client, address and port.
pub(super) fn agrees(
    snap: &Snapshot,
    fast: FastDecision<'_>,
    client: Option<&str>,
    ip: IpAddr,
    port: u16,
) -> Result<(), String> {
    agrees_with(snap, &HostAddresses::new(), fast, client, ip, port)
}

/// [`agrees`], the endpoint host names with the addresses in `hosts`: the proxy connects to one of
/// a host's IPv4 addresses first (its IPv6 ones when it has none), so the kernel must rewrite to
/// exactly those.
pub(super) fn agrees_with(
    snap: &Snapshot,
    hosts: &HostAddresses,
    fast: FastDecision<'_>,
    client: Option<&str>,
    ip: IpAddr,
    port: u16,
) -> Result<(), String> {
    let proxy = snap.decide_outbound_with(client, ip, port, Pick::Peek);
    let original = SocketAddr::new(ip.to_canonical(), port);
    let ctx = || format!("{client:?} -> {ip}:{port}: kernel {fast:?}, proxy {proxy:?}");
    let ok = match fast {
        FastDecision::Proxy => true,
        // Both leave the socket alone. A workload the table had no room for is counted as a
        // passthrough; a passthrough is never counted as a workload.
        FastDecision::Passthrough | FastDecision::Workload => {
            let outcome = proxy.outcome();
            let counted = match fast {
                FastDecision::Workload => outcome == OutboundOutcome::Workload,
                _ => matches!(
                    outcome,
                    OutboundOutcome::Passthrough | OutboundOutcome::Workload
                ),
            };
            counted && proxy.target() == Some(Target::Addr(original))
        }
        FastDecision::Rewrite(backends) => {
            let Outbound::Service { port: svc_port, .. } = proxy.action else {
                return Err(ctx());
            };
            // Endpoints by host name never match an address unless resolved.
            let mut want: Vec<Option<SocketAddr>> = svc_port
                .endpoints
                .iter()
                .flat_map(|ep| match ep.target() {
                    Target::Addr(a) => vec![Some(SocketAddr::new(a.ip().to_canonical(), a.port()))],
                    Target::Host { name, port } => match hosts.get(name) {
                        Some(ips) => {
                            let v4 = ips.iter().any(|ip| ip.is_ipv4());
                            ips.iter()
                                .filter(|ip| ip.is_ipv4() == v4)
                                .map(|ip| Some(SocketAddr::new(*ip, port)))
                                .collect()
                        }
                        None => vec![None],
                    },
                })
                .collect();
            let mut got: Vec<Option<SocketAddr>> = backends.addrs().map(Some).collect();
            want.sort();
            got.sort();
            let same_family = got
                .iter()
                .flatten()
                .all(|a| a.is_ipv4() == original.is_ipv4());
            want == got && same_family
        }
    };
    if ok { Ok(()) } else { Err(ctx()) }
}

/// The kernel's answer for a client in `client` (registered under a cgroup the way the agent
/// will), checked against the proxy, as a short word: `passthrough`, `workload`, `proxy` or the
/// rewrite's endpoints.
fn kernel(snap: &Snapshot, tables: &Tables, client: Option<&str>, dst: &str, port: u16) -> String {
    kernel_with(snap, &HostAddresses::new(), tables, client, dst, port)
}

/// [`kernel`] with endpoint host names resolved to `hosts`.
fn kernel_with(
    snap: &Snapshot,
    hosts: &HostAddresses,
    tables: &Tables,
    client: Option<&str>,
    dst: &str,
    port: u16,
) -> String {
    const CGROUP: u64 = 7;
    let mut clients = Clients::new(tables);
    // No client namespace: a pod of a namespace that claims nothing, which sees what every client sees.
    clients
        .set(
            tables,
            CGROUP,
            client.unwrap_or("a-namespace-claiming-nothing"),
            false,
        )
        .unwrap();
    let fast = decide(tables, &clients, CGROUP, ip(dst), port);
    if let Err(e) = agrees_with(snap, hosts, fast, client, ip(dst), port) {
        panic!("kernel and proxy disagree: {e}");
    }
    match fast {
        FastDecision::Passthrough => "passthrough".into(),
        FastDecision::Workload => "workload".into(),
        FastDecision::Proxy => "proxy".into(),
        FastDecision::Rewrite(b) => b
            .addrs()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(","),
    }
}

fn compiled(objects: &str) -> (Snapshot, Tables, Stats) {
    let snap = snapshot(objects);
    let (tables, stats) = compile(&snap, Limits::default());
    (snap, tables, stats)
}

const HTTP: &str = "ports: [{number: 80, name: http}]";

fn static_entry(name: &str, ns: &str, addresses: &str, endpoints: &str) -> String {
    entry(
        name,
        ns,
        &format!(
            "{{hosts: [{name}.example.com], addresses: [{addresses}], {HTTP}, resolution: STATIC, endpoints: [{endpoints}]}}"
        ),
    )
}

#[test]
fn plain_ip_endpoints_are_a_rewrite_to_all_of_them() {
    let (snap, t, stats) = compiled(&static_entry(
        "api",
        "pub-a",
        "203.0.113.10",
        "{address: 198.51.100.1}, {address: 198.51.100.2}",
    ));
    assert_eq!(
        kernel(&snap, &t, None, "203.0.113.10", 80),
        "198.51.100.1:80,198.51.100.2:80"
    );
    assert_eq!((stats.exact, stats.ports), (1, 1));
}

#[test]
fn own_namespace_cidr_beats_more_specific_foreign_cidr_in_the_tables() {
    let objects = static_entry("own", "ns-c", "10.0.0.0/8", "{address: 198.51.100.1}")
        + &static_entry("narrow", "pub-a", "10.1.0.0/16", "{address: 198.51.100.2}");
    let (snap, t, _) = compiled(&objects);
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.1.2.3", 80),
        "198.51.100.1:80"
    );
    assert_eq!(kernel(&snap, &t, None, "10.1.2.3", 80), "198.51.100.2:80");
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "10.1.2.3", 80),
        "198.51.100.2:80"
    );
    // Outside the narrow prefix only ns-c claims the address, and hides it from the others.
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.9.9.9", 80),
        "198.51.100.1:80"
    );
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "10.9.9.9", 80),
        "passthrough"
    );
}

#[test]
fn longest_visible_prefix_wins_and_equal_prefixes_are_ranked() {
    let objects = static_entry("wide", "pub-a", "10.0.0.0/8", "{address: 198.51.100.1}")
        + &static_entry("narrow", "pub-b", "10.1.0.0/16", "{address: 198.51.100.2}")
        + &static_entry(
            "narrow-hidden",
            "ns-d",
            "10.1.2.0/24",
            "{address: 198.51.100.3}",
        )
        + &static_entry("a-twin", "pub-a", "10.1.0.0/16", "{address: 198.51.100.4}");
    let (snap, t, _) = compiled(&objects);
    // The /24 is hidden from ns-c: the /16s remain, `pub-a/a-twin` ranks before `pub-b/narrow`.
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.1.2.3", 80),
        "198.51.100.4:80"
    );
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "10.1.2.3", 80),
        "198.51.100.3:80"
    );
    assert_eq!(kernel(&snap, &t, None, "10.2.0.1", 80), "198.51.100.1:80");
}

#[test]
fn hidden_exact_address_falls_through_to_a_visible_cidr() {
    let objects = static_entry("vip", "ns-c", "10.1.2.3", "{address: 198.51.100.1}")
        + &static_entry("net", "pub-a", "10.1.0.0/16", "{address: 198.51.100.2}");
    let (snap, t, _) = compiled(&objects);
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.1.2.3", 80),
        "198.51.100.1:80"
    );
    assert_eq!(kernel(&snap, &t, None, "10.1.2.3", 80), "198.51.100.2:80");
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "10.1.2.3", 80),
        "198.51.100.2:80"
    );
}

#[test]
fn own_namespace_entry_wins_over_an_older_public_one() {
    let objects = entry(
        "old",
        "pub-a",
        &format!("{{hosts: [old.example.com], addresses: [203.0.113.10], {HTTP}, resolution: STATIC, endpoints: [{{address: 198.51.100.1}}]}}"),
    )
    .replace("namespace: pub-a}", "namespace: pub-a, creationTimestamp: \"2020-01-01T00:00:00Z\"}")
        + &static_entry("mine", "ns-c", "203.0.113.10", "{address: 198.51.100.2}");
    let (snap, t, _) = compiled(&objects);
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "203.0.113.10", 80),
        "198.51.100.2:80"
    );
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "203.0.113.10", 80),
        "198.51.100.1:80"
    );
    assert_eq!(
        kernel(&snap, &t, None, "203.0.113.10", 80),
        "198.51.100.1:80"
    );
}

#[test]
fn kubernetes_service_outranks_an_older_entry_on_its_cluster_ip() {
    let objects = entry(
        "old",
        "pub-a",
        &format!("{{hosts: [old.example.com], addresses: [10.96.0.10], {HTTP}, resolution: STATIC, endpoints: [{{address: 198.51.100.1}}]}}"),
    )
    .replace("namespace: pub-a}", "namespace: pub-a, creationTimestamp: \"2020-01-01T00:00:00Z\"}")
        + r#"---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: pub-b}
spec: {clusterIP: 10.96.0.10, selector: {app: web}, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: pub-b, labels: {app: web}}
status: {podIP: 10.244.0.5}
"#;
    let (snap, t, _) = compiled(&objects);
    assert_eq!(kernel(&snap, &t, None, "10.96.0.10", 80), "10.244.0.5:8080");
    // The pod's own address is a workload's: left alone.
    assert_eq!(kernel(&snap, &t, None, "10.244.0.5", 8080), "workload");
}

#[test]
fn resolution_none_passes_through_on_any_port() {
    let objects = entry(
        "github",
        "pub-a",
        "{hosts: [github.com], addresses: [140.82.112.0/20], ports: [{number: 22, name: ssh}], resolution: NONE}",
    );
    let (snap, t, _) = compiled(&objects);
    assert_eq!(kernel(&snap, &t, None, "140.82.112.4", 22), "passthrough");
    assert_eq!(kernel(&snap, &t, None, "140.82.112.4", 443), "passthrough");
}

#[test]
fn undeclared_port_and_port_without_endpoints_go_to_the_proxy() {
    let objects = static_entry("api", "pub-a", "203.0.113.10", "{address: 198.51.100.1}")
        + &entry(
            "empty",
            "pub-a",
            &format!(
                "{{hosts: [empty.example.com], addresses: [203.0.113.11], {HTTP}, resolution: STATIC}}"
            ),
        );
    let (snap, t, stats) = compiled(&objects);
    assert_eq!(kernel(&snap, &t, None, "203.0.113.10", 443), "proxy");
    assert_eq!(kernel(&snap, &t, None, "203.0.113.11", 80), "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::NoEndpoints), Some(&1));
}

#[test]
fn host_name_endpoints_go_to_the_proxy() {
    let objects = entry(
        "cdn",
        "pub-a",
        &format!(
            "{{hosts: [cdn.example.com], addresses: [203.0.113.60], {HTTP}, resolution: DNS, endpoints: [{{address: origin.example.org}}, {{address: 198.51.100.1}}]}}"
        ),
    );
    let (snap, t, stats) = compiled(&objects);
    assert_eq!(kernel(&snap, &t, None, "203.0.113.60", 80), "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::HostNameEndpoint), Some(&1));
}

fn hosts(list: &[(&str, &[&str])]) -> HostAddresses {
    list.iter()
        .map(|(name, ips)| (name.to_string(), ips.iter().map(|s| ip(s)).collect()))
        .collect()
}

/// A host name resolved ahead is rewritten to like addresses: its IPv4 ones (the proxy's first
/// choice) beside the port's plain endpoints, each at the endpoint's port.
#[test]
fn host_names_resolved_ahead_are_a_rewrite_to_their_ipv4_addresses() {
    let objects = entry(
        "cdn",
        "pub-a",
        &format!(
            "{{hosts: [cdn.example.com], addresses: [203.0.113.60], {HTTP}, resolution: DNS, endpoints: [{{address: origin.example.org, ports: {{http: 8080}}}}, {{address: 198.51.100.1}}]}}"
        ),
    );
    let snap = snapshot(&objects);
    let resolved = hosts(&[(
        "origin.example.org",
        &["198.51.100.7", "198.51.100.8", "2001:db8::7"],
    )]);
    let (t, stats) = compile_with(&snap, Limits::default(), &resolved);
    assert_eq!(
        kernel_with(&snap, &resolved, &t, None, "203.0.113.60", 80),
        "198.51.100.7:8080,198.51.100.8:8080,198.51.100.1:80"
    );
    assert_eq!(stats.fallbacks.get(&Fallback::HostNameEndpoint), None);
}

/// The entries people write most: DNS, no endpoints, an allocated address; the host itself is the
/// endpoint. Resolved: a rewrite; IPv6 only: the IPv4 VIP's socket cannot take it, the proxy
/// decides; not resolved (or expired): the proxy; too many addresses: the proxy.
#[test]
fn a_dns_entry_without_endpoints_is_rewritten_to_its_hosts_addresses_while_they_fit() {
    let objects = entry(
        "httpbin",
        "pub-a",
        &format!("{{hosts: [httpbin.example.com], {HTTP}, resolution: DNS}}"),
    );
    let snap = snapshot(&objects);
    let vip = snap
        .services()
        .find(|s| s.name == "httpbin")
        .and_then(|s| s.vips().find(|ip| ip.is_ipv4()))
        .expect("an allocated IPv4 address")
        .to_string();
    let check = |resolved: &HostAddresses| {
        let (t, stats) = compile_with(&snap, Limits::default(), resolved);
        (kernel_with(&snap, resolved, &t, None, &vip, 80), stats)
    };
    let (got, _) = check(&hosts(&[("httpbin.example.com", &["198.51.100.80"])]));
    assert_eq!(got, "198.51.100.80:80");
    let (got, _) = check(&hosts(&[("httpbin.example.com", &["2001:db8::80"])]));
    assert_eq!(got, "proxy", "an IPv4 socket is rewritten within IPv4");
    let (got, stats) = check(&HostAddresses::new());
    assert_eq!(got, "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::HostNameEndpoint), Some(&1));
    let many: Vec<String> = (1..=MAX_ENDPOINTS + 1)
        .map(|i| format!("198.51.100.{i}"))
        .collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let (got, stats) = check(&hosts(&[("httpbin.example.com", &many)]));
    assert_eq!(got, "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::TooManyEndpoints), Some(&1));
}

#[test]
fn unclaimed_address_passes_through_and_a_pod_address_is_a_workload() {
    let objects = static_entry("hidden", "ns-c", "10.244.0.5", "{address: 198.51.100.1}")
        + "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: ns-d}\nstatus: {podIP: 10.244.0.5}\n";
    let (snap, t, _) = compiled(&objects);
    assert_eq!(kernel(&snap, &t, None, "192.0.2.1", 443), "passthrough");
    // A service claiming a pod's address hides the pod from its own namespace only.
    assert_eq!(kernel(&snap, &t, None, "10.244.0.5", 80), "workload");
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.244.0.5", 80),
        "198.51.100.1:80"
    );
}

#[test]
fn shared_pod_address_is_a_workload_for_everyone() {
    let pod = |name: &str, ns: &str| {
        format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nstatus: {{podIP: 10.244.0.9}}\n"
        )
    };
    let (snap, t, stats) = compiled(&(pod("a", "ns-c") + &pod("b", "ns-d")));
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.244.0.9", 80),
        "workload"
    );
    assert_eq!(stats.workloads, 1);
}

#[test]
fn v4_mapped_destination_is_its_ipv4_address() {
    let (snap, t, _) = compiled(&static_entry(
        "api",
        "pub-a",
        "\"::ffff:203.0.113.10\"",
        "{address: 198.51.100.1}",
    ));
    assert_eq!(
        kernel(&snap, &t, None, "::ffff:203.0.113.10", 80),
        "198.51.100.1:80"
    );
    assert_eq!(
        kernel(&snap, &t, None, "203.0.113.10", 80),
        "198.51.100.1:80"
    );
}

#[test]
fn ipv6_network_never_claims_an_ipv4_destination() {
    let (snap, t, _) = compiled(&static_entry(
        "all6",
        "pub-a",
        "\"::/0\"",
        "{address: \"2001:db8::1\"}",
    ));
    assert_eq!(
        kernel(&snap, &t, None, "2001:db8:1::1", 80),
        "[2001:db8::1]:80"
    );
    assert_eq!(
        kernel(&snap, &t, None, "::ffff:192.0.2.1", 80),
        "passthrough"
    );
    assert_eq!(kernel(&snap, &t, None, "192.0.2.1", 80), "passthrough");
}

#[test]
fn a_rewrite_stays_within_the_sockets_family() {
    let objects = static_entry(
        "dual",
        "pub-a",
        "203.0.113.10, \"2001:db8::10\"",
        "{address: 198.51.100.1}",
    ) + &static_entry(
        "mixed",
        "pub-a",
        "203.0.113.11",
        "{address: 198.51.100.1}, {address: \"2001:db8::1\"}",
    );
    let (snap, t, stats) = compiled(&objects);
    assert_eq!(
        kernel(&snap, &t, None, "203.0.113.10", 80),
        "198.51.100.1:80"
    );
    assert_eq!(kernel(&snap, &t, None, "2001:db8::10", 80), "proxy");
    assert_eq!(kernel(&snap, &t, None, "203.0.113.11", 80), "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::MixedFamilies), Some(&1));
}

#[test]
fn a_none_visibility_entry_is_absent_from_the_tables() {
    let (snap, t, stats) = compiled(&static_entry(
        "q",
        "none-e",
        "203.0.113.10",
        "{address: 198.51.100.1}",
    ));
    assert_eq!(
        kernel(&snap, &t, Some("none-e"), "203.0.113.10", 80),
        "passthrough"
    );
    assert_eq!((stats.exact, stats.namespaces), (0, 0));
}

#[test]
fn a_namespace_claiming_nothing_shares_the_unknown_view_and_an_unnamed_cgroup_goes_to_the_proxy() {
    let (_, t, stats) = compiled(&static_entry(
        "mine",
        "ns-c",
        "203.0.113.10",
        "{address: 198.51.100.1}",
    ));
    assert_eq!(stats.namespaces, 1);
    assert_ne!(t.namespace_id("ns-c"), NS_UNKNOWN);
    assert_eq!(t.namespace_id("ns-d"), NS_UNKNOWN);
    let mut c = Clients::new(&t);
    c.set(&t, 1, "ns-d", false).unwrap();
    c.set(&t, 2, "ns-c", false).unwrap();
    assert_eq!(c.get(1), Some(NS_UNKNOWN));
    assert_eq!(c.len(), 2);
    let dst = ip("203.0.113.10");
    assert_eq!(decide(&t, &c, 1, dst, 80), FastDecision::Passthrough);
    assert!(matches!(
        decide(&t, &c, 2, dst, 80),
        FastDecision::Rewrite(_)
    ));
    // A cgroup the agent could not name: its namespace is only known to the proxy (by address).
    assert_eq!(decide(&t, &c, 3, dst, 80), FastDecision::Proxy);
}

#[test]
fn too_many_endpoints_go_to_the_proxy() {
    let endpoints: Vec<String> = (1..=MAX_ENDPOINTS + 1)
        .map(|i| format!("{{address: 198.51.100.{i}}}"))
        .collect();
    let (snap, t, stats) = compiled(&static_entry(
        "big",
        "pub-a",
        "203.0.113.10",
        &endpoints.join(", "),
    ));
    assert_eq!(kernel(&snap, &t, None, "203.0.113.10", 80), "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::TooManyEndpoints), Some(&1));
}

fn limited(objects: &str, limits: Limits) -> (Snapshot, Tables, Stats) {
    let snap = snapshot(objects);
    let (tables, stats) = compile(&snap, limits);
    (snap, tables, stats)
}

#[test]
fn full_shared_tables_send_everything_to_the_proxy() {
    let objects = static_entry("a", "pub-a", "203.0.113.10", "{address: 198.51.100.1}")
        + &static_entry("b", "pub-a", "203.0.113.11", "{address: 198.51.100.1}");
    let limits = Limits {
        exact: 1,
        ..Limits::default()
    };
    let (snap, t, stats) = limited(&objects, limits);
    assert_eq!(kernel(&snap, &t, None, "203.0.113.10", 80), "proxy");
    assert_eq!(kernel(&snap, &t, None, "192.0.2.1", 80), "proxy");
    assert_eq!(stats.fallbacks.get(&Fallback::SharedFull), Some(&1));
}

#[test]
fn full_namespace_tables_send_that_namespace_to_the_proxy() {
    let objects = static_entry("shared", "pub-a", "10.0.0.0/8", "{address: 198.51.100.1}")
        + &static_entry("c", "ns-c", "10.1.0.0/16", "{address: 198.51.100.2}")
        + &static_entry("d", "ns-d", "10.2.0.0/16", "{address: 198.51.100.3}");
    // Shared: each network (the two /16s hide ns-c's and ns-d's entries from everyone else), then
    // one of ns-c's own.
    let limits = Limits {
        cidrs: 4,
        ..Limits::default()
    };
    let (snap, t, stats) = limited(&objects, limits);
    // Shared: the /8 alone (the /16s only report hides). Then the namespaces needing least first:
    // pub-a (its own /8), ns-c (its /16 and the report of it); ns-d does not fit: its clients go
    // to the proxy, its hide report is left out, the others are decided in the kernel.
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "10.1.0.1", 80),
        "198.51.100.2:80"
    );
    assert_eq!(kernel(&snap, &t, Some("ns-d"), "10.2.0.1", 80), "proxy");
    assert_eq!(kernel(&snap, &t, None, "10.2.0.1", 80), "198.51.100.1:80");
    assert_eq!(t.namespace_id("ns-d"), NS_PROXY);
    assert_eq!(
        kernel(&snap, &t, Some("pub-a"), "10.1.0.1", 80),
        "198.51.100.1:80"
    );
    assert_eq!(stats.fallbacks.get(&Fallback::NamespaceFull), Some(&1));
    assert_eq!(stats.fallbacks.get(&Fallback::HidesUncounted), Some(&1));
    let limits = Limits {
        namespaces: 0,
        ..Limits::default()
    };
    let (snap, t, _) = limited(&objects, limits);
    assert_eq!(kernel(&snap, &t, Some("ns-c"), "10.1.0.1", 80), "proxy");
}

/// A tenant whose hidden entry claims more addresses than its share: only its own clients go to
/// the proxy. Its neighbours' connections stay in the kernel, its addresses passed through as if
/// the entry did not exist (as the proxy would), their hides left uncounted.
#[test]
fn a_tenant_past_its_share_sends_only_its_own_clients_to_the_proxy() {
    let many: Vec<String> = (0..64).map(|i| format!("240.240.1.{i}")).collect();
    let objects = static_entry("big", "ns-d", &many.join(", "), "{address: 198.51.100.9}")
        + &static_entry("mine", "ns-c", "203.0.113.10", "{address: 198.51.100.2}")
        + &static_entry("pub", "pub-a", "203.0.113.11", "{address: 198.51.100.3}");
    // A generation of 32 KiB, 8 KiB a namespace: ns-d's 128 entries (96 bytes each) do not fit.
    let (snap, t, stats) = limited(&objects, Limits::within(64 << 10));
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "203.0.113.10", 80),
        "198.51.100.2:80"
    );
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "203.0.113.11", 80),
        "198.51.100.3:80"
    );
    assert_eq!(
        kernel(&snap, &t, Some("ns-c"), "240.240.1.7", 80),
        "passthrough"
    );
    assert_eq!(kernel(&snap, &t, None, "192.0.2.1", 80), "passthrough");
    assert_eq!(kernel(&snap, &t, Some("ns-d"), "240.240.1.7", 80), "proxy");
    assert_eq!(t.namespace_id("ns-d"), NS_PROXY);
    assert_eq!(stats.fallbacks.get(&Fallback::NamespaceFull), Some(&1));
    assert_eq!(stats.fallbacks.get(&Fallback::HidesUncounted), Some(&64));
    assert_eq!(stats.fallbacks.get(&Fallback::SharedFull), None);
    // With room for it, the tenant is in the kernel too.
    let (snap, t, stats) = limited(&objects, Limits::within(1 << 20));
    assert_eq!(
        kernel(&snap, &t, Some("ns-d"), "240.240.1.7", 80),
        "198.51.100.9:80"
    );
    assert!(stats.fallbacks.is_empty(), "{:?}", stats.fallbacks);
}

#[test]
fn a_full_workload_table_leaves_unclaimed_addresses_in_the_kernel() {
    let objects = static_entry("a", "pub-a", "203.0.113.10", "{address: 198.51.100.1}")
        + "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: ns-d}\nstatus: {podIP: 10.244.0.5}\n";
    let limits = Limits {
        workloads: 0,
        ..Limits::default()
    };
    let (snap, t, stats) = limited(&objects, limits);
    // Left alone as a workload would be: only counted as a passthrough.
    assert_eq!(kernel(&snap, &t, None, "10.244.0.5", 80), "passthrough");
    assert_eq!(kernel(&snap, &t, None, "192.0.2.1", 80), "passthrough");
    assert_eq!(
        kernel(&snap, &t, None, "203.0.113.10", 80),
        "198.51.100.1:80"
    );
    assert_eq!(stats.fallbacks.get(&Fallback::WorkloadsUncounted), Some(&1));
}

/// A change to Pods alone (the services shared) takes only the workload addresses again, and
/// gives what compiling the new snapshot whole gives, with room for the workloads or without.
#[test]
fn a_change_to_pods_alone_gives_the_tables_compiled_whole() {
    let pod = |ip: &str| {
        format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: ns-d}}\nstatus: {{podIP: {ip}}}\n"
        )
    };
    let entries = static_entry("a", "pub-a", "203.0.113.10", "{address: 198.51.100.1}")
        + &static_entry("b", "ns-c", "203.0.113.10", "{address: 198.51.100.2}");
    let before = snapshot(&(entries.clone() + &pod("10.244.0.5")));
    let moved = load_sources([(
        "w.yaml",
        format!("{HEADER}---\n{entries}{}", pod("10.244.0.6")).as_str(),
    )])
    .unwrap();
    let after = before.with_pods(&moved);
    assert!(after.same_services(&before));
    for workloads in [0, 1, 65_536] {
        let limits = Limits {
            workloads,
            ..Limits::default()
        };
        let (tables, stats) = compile(&before, limits);
        let patched = with_workloads(&tables, &stats, &after, limits);
        assert_eq!(patched, compile(&after, limits), "workloads {workloads}");
        if workloads > 0 {
            assert_ne!(
                patched.0, tables,
                "workloads {workloads}: the new address is in"
            );
        }
    }
}

/// A change to services alone (the workloads shared) compiles the services' entries and keeps the
/// workload addresses, and gives what compiling the new snapshot whole gives: with room for the
/// workloads or without, with room for the shared entries or without (then the tables before
/// worked out no workload address and the new ones must).
#[test]
fn a_change_to_services_alone_gives_the_tables_compiled_whole() {
    let pods = "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: ns-d}\nstatus: {podIP: 10.244.0.5}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: q, namespace: ns-d}\nstatus: {podIP: 10.244.0.6}\n";
    let a = static_entry("a", "pub-a", "203.0.113.10", "{address: 198.51.100.1}");
    let b = static_entry("b", "ns-c", "203.0.113.11", "{address: 198.51.100.2}");
    let c = static_entry("c", "pub-b", "203.0.113.12", "{address: 198.51.100.3}");
    let load =
        |yaml: String| load_sources([("w.yaml", format!("{HEADER}---\n{yaml}").as_str())]).unwrap();
    let before = Snapshot::from_model(&load(a.clone() + pods));
    let changed = load(a + &b + &c + pods);
    let after = before.with_services(&changed, &crate::visibility::resolve(&changed));
    assert!(after.same_workloads(&before) && !after.same_services(&before));
    // The same workloads, no entry at all.
    let back = after.with_services(
        &load(String::new() + pods),
        &crate::visibility::resolve(&load(String::new() + pods)),
    );
    for (exact, workloads) in [(65_536, 65_536), (65_536, 1), (1, 65_536), (2, 65_536)] {
        let limits = Limits {
            exact,
            workloads,
            ..Limits::default()
        };
        let none = HostAddresses::new();
        // More entries, then none: the shared entries stop fitting, then fit again.
        for (from, to) in [(&before, &after), (&after, &back)] {
            let (tables, stats) = compile(from, limits);
            let patched = compile_after(Some((from, &tables, &stats)), true, to, limits, &none);
            let whole = compile(to, limits);
            assert_eq!(patched, whole, "exact {exact}, workloads {workloads}");
            // Only the PUBLIC entries must fit for the workloads to be held.
            let public = to
                .services()
                .filter(|s| s.visibility == crate::state::ServiceVisibility::Public)
                .count();
            let fits = public <= exact && workloads >= 2;
            assert_eq!(whole.0.workloads().len(), if fits { 2 } else { 0 });
        }
    }
}

/// New addresses for a host name: only its ports' endpoints are written again, and the tables are
/// those compiled whole; a name that lost its answer changes a claim, and is compiled whole.
#[test]
fn new_addresses_for_a_host_name_patch_its_ports_alone() {
    let objects = entry(
        "cdn",
        "pub-a",
        &format!(
            "{{hosts: [cdn.example.com], addresses: [203.0.113.60], {HTTP}, resolution: DNS, endpoints: [{{address: origin.example.org}}]}}"
        ),
    ) + &static_entry("a", "ns-c", "203.0.113.10", "{address: 198.51.100.1}");
    let snap = snapshot(&objects);
    let before = hosts(&[("origin.example.org", &["198.51.100.7"])]);
    let after = hosts(&[("origin.example.org", &["198.51.100.8", "198.51.100.9"])]);
    let (t, stats) = compile_with(&snap, Limits::default(), &before);
    let patched = with_hosts(&t, &stats, &snap, &before, &after).expect("a patch");
    assert_eq!(patched, compile_with(&snap, Limits::default(), &after));
    assert_eq!(
        kernel_with(&snap, &after, &patched.0, None, "203.0.113.60", 80),
        "198.51.100.8:80,198.51.100.9:80"
    );
    assert_eq!(
        with_hosts(&t, &stats, &snap, &before, &HostAddresses::new()),
        None
    );
}

#[test]
fn full_port_table_sends_the_ports_left_out_to_the_proxy() {
    let objects = static_entry("a", "pub-a", "203.0.113.10", "{address: 198.51.100.1}")
        + &static_entry("b", "pub-a", "203.0.113.11", "{address: 198.51.100.2}");
    let limits = Limits {
        ports: 1,
        ..Limits::default()
    };
    let (snap, t, stats) = limited(&objects, limits);
    let answers = [
        kernel(&snap, &t, None, "203.0.113.10", 80),
        kernel(&snap, &t, None, "203.0.113.11", 80),
    ];
    assert_eq!(
        answers.iter().filter(|a| *a == "proxy").count(),
        1,
        "{answers:?}"
    );
    assert_eq!(stats.fallbacks.get(&Fallback::PortsFull), Some(&1));
}

#[test]
fn full_client_table_sends_unregistered_cgroups_to_the_proxy() {
    let objects = static_entry("c", "ns-c", "203.0.113.10", "{address: 198.51.100.1}")
        + &static_entry("p", "pub-a", "203.0.113.11", "{address: 198.51.100.2}");
    let limits = Limits {
        clients: 1,
        ..Limits::default()
    };
    let (_, t, _) = limited(&objects, limits);
    let mut c = Clients::new(&t);
    c.set(&t, 1, "ns-c", false).unwrap();
    assert_eq!(c.set(&t, 2, "ns-c", false), Err(ClientsFull(1)));
    let installed = Install {
        tables: std::sync::Arc::new(t.clone()),
        clients: std::sync::Arc::new(c.clone()),
    };
    assert_eq!(installed.config().clients_incomplete, 1);
    let dst = ip("203.0.113.11");
    assert!(matches!(
        decide(&t, &c, 1, dst, 80),
        FastDecision::Rewrite(_)
    ));
    assert_eq!(decide(&t, &c, 2, dst, 80), FastDecision::Proxy);
    assert_eq!(decide(&t, &c, 3, dst, 80), FastDecision::Proxy);
}

#[test]
fn decided_by_names_the_kernel_or_the_proxy() {
    let objects = static_entry("c", "ns-c", "203.0.113.10", "{address: 198.51.100.1}")
        + &entry(
            "cdn",
            "pub-a",
            &format!(
                "{{hosts: [cdn.example.com], addresses: [203.0.113.60], {HTTP}, resolution: DNS}}"
            ),
        );
    let (_, t, _) = compiled(&objects);
    let by = |client, dst, port| decided_by(&t, client, ip(dst), port);
    assert_eq!(by(Some("ns-c"), "203.0.113.10", 80), DecidedBy::Kernel);
    assert_eq!(by(Some("ns-c"), "203.0.113.10", 443), DecidedBy::Proxy);
    assert_eq!(by(None, "203.0.113.10", 80), DecidedBy::Kernel);
    assert_eq!(by(Some("ns-c"), "203.0.113.60", 80), DecidedBy::Proxy);
    assert_eq!(by(Some("elsewhere"), "192.0.2.1", 80), DecidedBy::Kernel);
}

#[test]
fn lpm_trie_returns_the_longest_prefix() {
    let mut trie = lpm::LpmTrie::default();
    let key = |ip: &str| AddrKey {
        ns: 3,
        ip: IpKey::new(super::tests::ip(ip)),
    };
    trie.insert(key("10.0.0.0"), 64 + 8, 8);
    trie.insert(key("10.1.0.0"), 64 + 16, 16);
    assert_eq!(trie.lookup(key("10.1.2.3")), Some(&16));
    assert_eq!(trie.lookup(key("10.2.2.3")), Some(&8));
    assert_eq!(trie.lookup(key("11.0.0.1")), None);
    assert_eq!(
        trie.lookup(AddrKey {
            ns: 4,
            ..key("10.1.2.3")
        }),
        None
    );
    assert_eq!(trie.len(), 2);
}

/// A service hidden from the client is counted where the kernel decides, as the proxy counts it:
/// a NAMESPACE address skipped for passthrough, a NAMESPACE network met on the way to a PUBLIC
/// one inside it, and nothing for the namespace that owns them.
#[test]
fn the_kernel_reports_the_hidden_service_the_proxy_would() {
    let objects = static_entry("vip", "ns-c", "203.0.113.10", "{address: 198.51.100.1}")
        + &static_entry("wide", "ns-c", "10.0.0.0/8", "{address: 198.51.100.1}")
        + &static_entry("narrow", "pub-a", "10.1.0.0/16", "{address: 198.51.100.2}");
    let (snap, t, _) = compiled(&objects);
    let hidden = |client: &str, dst: &str| {
        let ns = t.namespace_id(client);
        let (decision, hidden) = decide_hidden(&t, ns, ip(dst), 80);
        let proxy = snap.decide_outbound_with(Some(client), ip(dst), 80, Pick::Peek);
        let name = hidden.and_then(|id| snap.services().nth(id as usize).map(|s| s.name.clone()));
        assert_eq!(
            name,
            proxy.hidden.map(|s| s.name.clone()),
            "{client} -> {dst}"
        );
        assert_ne!(decision, FastDecision::Proxy, "{client} -> {dst}");
        name
    };
    assert_eq!(hidden("ns-d", "203.0.113.10").as_deref(), Some("vip"));
    assert_eq!(hidden("ns-d", "10.1.2.3").as_deref(), Some("wide"));
    assert_eq!(hidden("ns-d", "10.9.9.9").as_deref(), Some("wide"));
    assert_eq!(hidden("ns-c", "10.1.2.3"), None);
    assert_eq!(hidden("ns-c", "203.0.113.10"), None);
    assert_eq!(hidden("pub-a", "192.0.2.1"), None);
}

/// A NAMESPACE entry of `ns-a` bound to waypoint `wp` of its namespace, and, with `service`, the
/// waypoint's Service.
fn waypoint_bound(service: bool) -> String {
    let mut objects = String::from(
        "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: ns-a, labels: {istio.io/use-waypoint: wp}}\nspec: {hosts: [api.example.com], addresses: [203.0.113.10], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.1}]}\n",
    );
    if service {
        objects.push_str("---\napiVersion: v1\nkind: Service\nmetadata: {name: wp, namespace: ns-a}\nspec: {clusterIP: 10.96.0.50, ports: [{port: 15008}]}\n");
    }
    objects
}

#[test]
fn a_service_bound_to_a_known_waypoint_goes_to_the_proxy_and_otherwise_stays_a_rewrite() {
    let (snap, t, stats) = compiled(&waypoint_bound(true));
    assert_eq!(kernel(&snap, &t, Some("ns-a"), "203.0.113.10", 80), "proxy");
    let api = snap.services().find(|s| s.name == "api").unwrap();
    let (waypoint, address) = api.waypoint_route().unwrap();
    assert_eq!(
        (waypoint.to_string(), address),
        ("ns-a/wp".to_string(), ip("10.96.0.50"))
    );
    // By design, not for want of room: no fallback is counted for it (the one counted is the
    // waypoint Service's own port, which has no endpoints here).
    assert_eq!(stats.fallbacks.len(), 1, "{:?}", stats.fallbacks);
    assert_eq!(stats.fallbacks.get(&Fallback::NoEndpoints), Some(&1));

    // Bound, but no waypoint Service is known: reached without it, as upstream does.
    let (snap, t, _) = compiled(&waypoint_bound(false));
    assert_eq!(
        kernel(&snap, &t, Some("ns-a"), "203.0.113.10", 80),
        "198.51.100.1:80"
    );
    let api = snap.services().find(|s| s.name == "api").unwrap();
    assert!(api.waypoint.is_some() && api.waypoint_route().is_none());
}

/// With HBONE between nodes, the workload table marks the other nodes' Pods in the mesh: a
/// connection to one from a client in the mesh goes to the proxy (which tunnels it), from any other
/// client it is left alone, as are this node's Pods and Pods outside the mesh.
#[test]
fn the_other_nodes_pods_in_the_mesh_are_marked_for_the_proxy_and_enrolled_clients() {
    use redirect_common::fastpath::{NS_ENROLLED, WORKLOAD_DIRECT, WORKLOAD_HBONE};
    let pods = "apiVersion: v1\nkind: Namespace\nmetadata: {name: ns-b, labels: {istio.io/dataplane-mode: ambient}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: here, namespace: ns-a}\nspec: {nodeName: node-a}\nstatus: {podIP: 10.0.1.1}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: there, namespace: ns-b}\nspec: {nodeName: node-b}\nstatus: {podIP: 10.0.2.1, podIPs: [{ip: 10.0.2.1}, {ip: 'fd00::2:1'}]}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: plain, namespace: ns-a}\nspec: {nodeName: node-b}\nstatus: {podIP: 10.0.2.2}\n";
    let yaml = format!("{HEADER}---\n{pods}");
    let mut model = load_sources([("w.yaml", yaml.as_str())]).unwrap();
    let (plain, _) = compile(&Snapshot::from_model(&model), Limits::default());
    assert!(plain.workloads().values().all(|&c| c == WORKLOAD_DIRECT));
    model.hbone_node = Some("node-a".to_string());
    let (tables, _) = compile(&Snapshot::from_model(&model), Limits::default());
    let class = |ip: &str| {
        tables
            .workloads()
            .get(&IpKey::new(ip.parse().unwrap()))
            .copied()
    };
    assert_eq!(class("10.0.1.1"), Some(WORKLOAD_DIRECT));
    assert_eq!(class("10.0.2.1"), Some(WORKLOAD_HBONE));
    assert_eq!(class("fd00::2:1"), Some(WORKLOAD_HBONE), "either family");
    assert_eq!(class("10.0.2.2"), Some(WORKLOAD_DIRECT), "outside the mesh");
    let ns = tables.namespace_id("ns-a");
    let to = |ns, ip: &str| super::kernel::decide_for(&tables, ns, ip.parse().unwrap(), 80);
    for client in [ns, ns | NS_ENROLLED] {
        assert!(matches!(to(client, "10.0.1.1"), FastDecision::Workload));
        assert!(matches!(to(client, "10.0.2.2"), FastDecision::Workload));
    }
    for there in ["10.0.2.1", "fd00::2:1"] {
        assert!(matches!(to(ns | NS_ENROLLED, there), FastDecision::Proxy));
    }
    assert!(
        matches!(to(ns, "10.0.2.1"), FastDecision::Workload),
        "a client outside the mesh goes straight, in plaintext"
    );
    // The client table carries the bit beside the namespace's number.
    let mut clients = Clients::new(&tables);
    clients.set(&tables, 1, "ns-a", true).unwrap();
    clients.set(&tables, 2, "ns-a", false).unwrap();
    assert_eq!(clients.get(1), Some(ns | NS_ENROLLED));
    assert_eq!(clients.get(2), Some(ns));
}

/// A Pod of this node under an authorization policy is marked guarded: the kernel leaves a
/// connection to it alone (its own inbound check decides it at the Pod's socket lookup, and until
/// that runs the program sends it to the proxy); when the workload table is short, such addresses
/// are kept first, and when even they do not fit, the proxy decides everything.
#[test]
fn pods_under_policy_are_marked_guarded_and_kept_first_when_the_table_is_short() {
    use redirect_common::fastpath::{WORKLOAD_DIRECT, WORKLOAD_GUARDED};
    let pods = "apiVersion: v1\nkind: Pod\nmetadata: {name: open, namespace: ns-a}\nstatus: {podIP: 10.0.1.1}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: guarded, namespace: ns-b}\nstatus: {podIP: 10.0.1.2}\n---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-all, namespace: ns-b}\nspec: {action: DENY, rules: [{}]}\n";
    let yaml = format!("{HEADER}---\n{pods}");
    let model = load_sources([("w.yaml", yaml.as_str())]).unwrap();
    let snap = Snapshot::from_model(&model);
    let class = |tables: &Tables, ip: &str| {
        tables
            .workloads()
            .get(&IpKey::new(ip.parse().unwrap()))
            .copied()
    };
    let (tables, _) = compile(&snap, Limits::default());
    assert_eq!(class(&tables, "10.0.1.1"), Some(WORKLOAD_DIRECT));
    assert_eq!(class(&tables, "10.0.1.2"), Some(WORKLOAD_GUARDED));
    let ns = tables.namespace_id("ns-a");
    let proxied = |t: &Tables, ip: &str| {
        matches!(
            super::kernel::decide_for(t, ns, ip.parse().unwrap(), 80),
            FastDecision::Proxy
        )
    };
    assert!(!proxied(&tables, "10.0.1.2"), "left to the inbound check");
    assert!(!proxied(&tables, "10.0.1.1"));

    let one = Limits {
        workloads: 1,
        ..Limits::default()
    };
    let (short, stats) = compile(&snap, one);
    assert_eq!(class(&short, "10.0.1.1"), None, "left out");
    assert_eq!(
        class(&short, "10.0.1.2"),
        Some(WORKLOAD_GUARDED),
        "kept first"
    );
    assert_eq!(stats.fallbacks.get(&Fallback::WorkloadsUncounted), Some(&1));

    let none = Limits {
        workloads: 0,
        ..Limits::default()
    };
    let (empty, _) = compile(&snap, none);
    assert!(proxied(&empty, "10.0.1.1"), "the proxy decides everything");
}
