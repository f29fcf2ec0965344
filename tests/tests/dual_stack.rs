//! Dual-stack pods: IPv6 sockets are caught like IPv4 ones. An `AF_INET6` socket to a v4-mapped
//! address (what a JVM opens for an IPv4 address) is an IPv4 connection to the agent; a native IPv6
//! destination goes to the IPv6 gateway; the node, the agent and hostNetwork processes are left alone
//! in both families. Then the mesh's IPv6 side: an entry with an IPv6 address, AAAA answers, an
//! allocated `2001:2::/48` address, and endpoint host names resolved in both families. (Every
//! scenario of `visibility.rs` also runs from v4-mapped sockets and against the resolver's v4-mapped
//! and IPv6 addresses: see `World::check_*`.)
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::explain::{DnsAction, OutboundOutcome};
use integration::world::{Reach, World, delta, replace_file};
use integration::{Agent, Launch, NO_FAST_PATH, Peer, Place, Topology, peer};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const EXT_NAME: &str = "ext-dual";
/// The same server at an IPv4 and an IPv6 address.
const EXT_HTTP: [&str; 2] = ["203.0.113.10:80", "[2001:db8::10]:80"];
const EXT_ECHO: [&str; 2] = ["203.0.113.10:7", "[2001:db8::10]:7"];

const PASSTHROUGH: &str = r#"redirect_outbound_connections_total{outcome="passthrough"}"#;
const SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;
const OUTBOUND_ERRORS: &str = r#"redirect_outbound_connections_total{outcome="error"}"#;
const TCP_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="tcp_redirected"}"#;
const SKIPPED_NODE_NETNS: &str = r#"redirect_ebpf_events_total{event="skipped_node_netns"}"#;

/// Fields drop in order: the agent first, then the server, then the topology.
struct Setup {
    agent: Agent,
    _ext: Peer,
    topo: Topology,
}

fn setup() -> Result<Setup> {
    let topo = Topology::with_pods(&[A1])?;
    let parse = |list: [&str; 2]| -> Result<Vec<SocketAddr>> {
        list.iter().map(|a| a.parse().context("address")).collect()
    };
    let ext = topo.start_ext_peer(EXT_NAME, &parse(EXT_HTTP)?, &parse(EXT_ECHO)?)?;
    let agent = Agent::start(&topo, &[NO_FAST_PATH])?;
    Ok(Setup {
        agent,
        _ext: ext,
        topo,
    })
}

/// `curl -g` (brackets are an IPv6 literal) that must succeed; its body.
fn curl(place: &Place, url: &str) -> Result<String> {
    Ok(place
        .cmd("curl")
        .args(["-gsS", "--fail", "--max-time", "20", url])
        .ok()?
        .stdout_str())
}

fn getpeername(place: &Place, addr: &str) -> Result<String> {
    Ok(peer::cmd(place)?
        .args(["getpeername", addr])
        .ok()?
        .stdout_str()
        .trim()
        .to_string())
}

/// From a pod: a v4-mapped and a native IPv6 destination are each carried by the agent (its passthrough
/// counter moves, the server sees the node, not the pod) and getpeername() returns what was asked.
#[test]
fn inet6_sockets_are_carried_by_the_agent_and_getpeername_returns_the_original() -> Result<()> {
    let s = setup()?;
    let pod = s.topo.pod("team-a/a1");
    for (url, echo, pod_source) in [
        (
            "http://[::ffff:203.0.113.10]/",
            "[::ffff:203.0.113.10]:7",
            pod.ip.to_string(),
        ),
        (
            "http://[2001:db8::10]/",
            "[2001:db8::10]:7",
            format!("[{}]", pod.ip6),
        ),
    ] {
        let before = s.agent.metrics()?;
        assert_eq!(curl(pod.place(), url)?, format!("{EXT_NAME}\n"), "{url}");
        // Carried, not routed: the server sees the agent's connection, not the pod.
        let seen = curl(pod.place(), &format!("{url}peer"))?;
        assert!(
            !seen.starts_with(&format!("{pod_source}:")),
            "{url}: server saw the pod itself ({seen:?}): not redirected"
        );
        assert_eq!(getpeername(pod.place(), echo)?, echo, "not the gateway");
        let after = s
            .agent
            .wait_metrics("three passthroughs", Duration::from_secs(5), |m| {
                delta(&before, m, PASSTHROUGH) == 3.0
            })?;
        assert_eq!(delta(&before, &after, TCP_REDIRECTED), 3.0, "{after:#?}");
        assert_eq!(delta(&before, &after, OUTBOUND_ERRORS), 0.0, "{after:#?}");
    }
    Ok(())
}

/// Loopback in either form stays in the pod; the node's own IPv6 sockets and the agent's upstream
/// sockets are never steered (one pod connection is one redirect, not a loop).
#[test]
fn loopback_the_node_and_the_agent_ipv6_sockets_are_not_redirected() -> Result<()> {
    let s = setup()?;
    let pod = s.topo.pod("team-a/a1");
    let _local = Peer::start(
        pod.place(),
        "pod-local",
        &["127.0.0.1:8080".parse()?, "[::1]:8080".parse()?],
        &[],
    )?;
    let before = s.agent.metrics()?;
    for url in [
        "http://[::1]:8080/",
        "http://[::ffff:127.0.0.1]:8080/",
        "http://127.0.0.1:8080/",
    ] {
        assert_eq!(curl(pod.place(), url)?, "pod-local\n", "{url}");
    }
    for url in ["http://[2001:db8::10]/", "http://[::ffff:203.0.113.10]/"] {
        assert_eq!(curl(s.topo.node(), url)?, format!("{EXT_NAME}\n"), "{url}");
    }
    let after_local = s.agent.metrics()?;
    assert_eq!(
        delta(&before, &after_local, TCP_REDIRECTED),
        0.0,
        "{after_local:#?}"
    );

    assert_eq!(
        curl(pod.place(), "http://[2001:db8::10]/")?,
        format!("{EXT_NAME}\n")
    );
    std::thread::sleep(Duration::from_millis(200)); // a looped connection would be counted by now
    let after_pod = s.agent.metrics()?;
    for (key, want) in [
        (TCP_REDIRECTED, 1.0),
        (PASSTHROUGH, 1.0),
        (OUTBOUND_ERRORS, 0.0),
    ] {
        assert_eq!(
            delta(&after_local, &after_pod, key),
            want,
            "{key}: {after_pod:#?}"
        );
    }
    Ok(())
}

/// A hostNetwork process (pods' cgroup, node's netns) is left alone from IPv6 sockets too.
#[test]
fn a_host_network_process_is_not_redirected_from_ipv6_sockets() -> Result<()> {
    let s = setup()?;
    let node = s.topo.node();
    let host_network_pod = Place {
        label: "hostNetwork pod".into(),
        netns: node.netns.clone(),
        cgroup: s.topo.pod("team-a/a1").cgroup().to_path_buf(),
        resolv_conf: None,
        log_dir: node.log_dir.clone(),
    };
    let before = s.agent.metrics()?;
    for url in ["http://[2001:db8::10]/", "http://[::ffff:203.0.113.10]/"] {
        assert_eq!(
            curl(&host_network_pod, url)?,
            format!("{EXT_NAME}\n"),
            "{url}"
        );
    }
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, TCP_REDIRECTED), 0.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 0.0, "{after:#?}");
    assert_eq!(
        delta(&before, &after, SKIPPED_NODE_NETNS),
        2.0,
        "the programs saw both connects and skipped them: {after:#?}"
    );
    Ok(())
}

/// team-a's NAMESPACE entry for `api6.example.com` at `2001:db8:113::10` (the real host's address),
/// with an IPv6 endpoint.
const API6_ENTRY: &str = "\
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: api6
  namespace: team-a
  creationTimestamp: \"2026-01-01T00:00:00Z\"
spec:
  hosts: [api6.example.com]
  addresses: [\"2001:db8:113::10\"]
  location: MESH_EXTERNAL
  resolution: STATIC
  ports:
    - {number: 80, name: http, protocol: HTTP}
  endpoints:
    - address: \"2001:db8:100::20\"
";

/// A NAMESPACE entry with an IPv6 address: in its namespace `dig AAAA` is the agent's and `curl -6`
/// reaches the endpoint (the client known by its IPv6 source address); elsewhere the name is the
/// upstream's, byte for byte, and `curl -6` reaches the real host.
#[test]
fn namespace_entry_with_an_ipv6_address_is_the_agents_inside_and_absent_outside() -> Result<()> {
    let w = World::start_with_launched(
        |dir| replace_file(dir, "40-api6.yaml", API6_ENTRY),
        &Launch::no_fast_path(),
    )?;
    let real: IpAddr = "2001:db8:113::10".parse()?;
    assert_eq!(
        w.dig_upstream_with(&["api6.example.com.", "AAAA"])?
            .addresses(),
        [real]
    );

    // DNS: every resolver address, UDP and TCP.
    for tcp in [false, true] {
        let (v, reply) = w.check_dig_with("team-a", "api6.example.com", "AAAA", tcp)?;
        assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
        assert_eq!(v.service.as_deref(), Some("team-a/api6"), "{}", v.json);
        assert_eq!(reply.addresses(), [real]);
        for ns in ["team-b", "team-c", "quarantine"] {
            let (v, _) = w.check_dig_with(ns, "api6.example.com", "AAAA", tcp)?;
            assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
            assert_eq!(v.hidden.as_deref(), Some("team-a/api6"), "{}", v.json);
        }
    }
    // No IPv4 address: an A question is an empty NOERROR from the agent, not the upstream's NXDOMAIN.
    let (v, reply) = w.check_dig_with("team-a", "api6.example.com", "A", false)?;
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    assert_eq!((reply.status.as_str(), reply.answer.len()), ("NOERROR", 0));

    // curl -6 by name (glibc asks AAAA through the agent), and to the address itself.
    let got = w.check_host6("team-a", "api6.example.com", 80)?;
    assert_eq!(got.0.action, OutboundOutcome::Service, "{}", got.0.json);
    assert_eq!(got.1, Reach::server("api6-endpoint"));
    let got = w.check_host6("team-b", "api6.example.com", 80)?;
    assert_eq!(got.0.action, OutboundOutcome::Passthrough, "{}", got.0.json);
    assert_eq!(got.1, Reach::server("real-2001:db8:113::10"));
    let dest = SocketAddr::new(real, 80);
    let got = w.check_connect("team-a", dest)?;
    assert_eq!(got.1, Reach::server("api6-endpoint"));
    let got = w.check_connect("team-c", dest)?;
    assert_eq!(got.1, Reach::server("real-2001:db8:113::10"));
    Ok(())
}

/// team-a's NAMESPACE entry without addresses: allocated a VIP in each family.
const INTERNAL_ENTRY: &str = "\
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: internal
  namespace: team-a
spec:
  hosts: [internal.team-a.example]
  location: MESH_EXTERNAL
  resolution: STATIC
  ports:
    - {number: 80, name: http, protocol: HTTP}
  endpoints:
    - address: 198.51.100.20
";

/// An allocated `2001:2::/48` address is what those who see the entry resolve and reach (and what
/// getpeername() shows them); for everyone else the name is the upstream's.
#[test]
fn an_allocated_ipv6_address_is_reachable_by_those_who_see_the_entry() -> Result<()> {
    let w = World::start_with_launched(
        |dir| replace_file(dir, "40-internal.yaml", INTERNAL_ENTRY),
        &Launch::no_fast_path(),
    )?;
    let (v, reply) = w.check_dig_with("team-a", "internal.team-a.example", "AAAA", false)?;
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    let vip = match reply.addresses()[..] {
        [IpAddr::V6(vip)] if vip.segments()[..3] == [0x2001, 2, 0] => vip,
        _ => anyhow::bail!("one AAAA from 2001:2::/48 expected: {reply:#?}"),
    };
    let before = w.agent.metrics()?;
    let got = w.check_host6("team-a", "internal.team-a.example", 80)?;
    assert_eq!(got.1, Reach::server("api-endpoint"));
    let got = w.check_connect("team-a", SocketAddr::new(vip.into(), 80))?;
    assert_eq!(got.1, Reach::server("api-endpoint"));
    let after = w.agent.metrics()?;
    ensure!(
        delta(&before, &after, SERVICE) >= 2.0,
        "served as the entry: {after:#?}"
    );
    // Another namespace: the name is the upstream's (NXDOMAIN here), so nothing resolves to the VIP.
    for ns in ["team-b", "istio-system"] {
        let (v, reply) = w.check_dig_with(ns, "internal.team-a.example", "AAAA", false)?;
        assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
        assert_eq!(reply.status, "NXDOMAIN", "{reply:#?}");
    }
    Ok(())
}

/// Endpoint host names of both families (resolution `DNS`), as the upstream resolver has them: one
/// with an IPv6 address only, one with both, whose IPv4 side has nothing on port 8080.
const HOST_RECORDS: [(&str, &str); 3] = [
    ("v6only.example.org", "2001:db8:66::10"),
    ("dual.example.org", "198.51.100.67"),
    ("dual.example.org", "2001:db8:67::10"),
];
const HOST_ENTRIES: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
kind: MeshConfig
serviceEntryVisibility: {defaultVisibility: NAMESPACE}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: db6, namespace: team-a}
spec:
  hosts: [db6.example.com]
  addresses: [203.0.113.66]
  ports: [{number: 80, name: http}]
  resolution: DNS
  endpoints: [{address: v6only.example.org}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: dual, namespace: team-a}
spec:
  hosts: [dual.example.com]
  addresses: [203.0.113.67]
  ports: [{number: 80, name: http}, {number: 8080, name: alt}]
  resolution: DNS
  endpoints: [{address: dual.example.org}]
";
const A1_UID: &str = "0a1a1a1a-0000-4000-8000-0000000000a6";

/// Endpoint host names resolve in both families: a host with only an AAAA record is reached over
/// IPv6; a dual-stack host over IPv4 as before, and over IPv6 when its IPv4 address refuses the port.
#[test]
fn endpoint_host_names_resolve_to_ipv6_too_and_ipv4_comes_first() -> Result<()> {
    let mut topo = Topology::new()?;
    topo.add_kube_pod(A1.0, A1.1.parse()?, A1_UID)?;
    // Locals drop in reverse: the agent, dnsmasq, the servers, then the topology.
    let _servers = [
        topo.start_ext_peer("v6only-origin", &["[2001:db8:66::10]:80".parse()?], &[])?,
        topo.start_ext_peer("dual-origin-v4", &["198.51.100.67:80".parse()?], &[])?,
        topo.start_ext_peer(
            "dual-origin-v6",
            &[
                "[2001:db8:67::10]:80".parse()?,
                "[2001:db8:67::10]:8080".parse()?,
            ],
            &[],
        )?,
    ];
    let mut records = integration::DnsRecords::new();
    for (host, ip) in HOST_RECORDS {
        records = records.host(host, ip.parse()?);
    }
    let dns = topo.start_dnsmasq(integration::RESOLVER_IP, records)?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let pod = integration::fixtures::pod(A1.0, A1_UID, A1.1, "{}");
    replace_file(&dir, "entries.yaml", &format!("{HOST_ENTRIES}---\n{pod}"))?;
    let upstream = format!("{}:53", integration::RESOLVER_IP);
    let agent = Agent::start(
        &topo,
        &[
            // The proxy's own resolution of endpoint host names.
            NO_FAST_PATH,
            "--config",
            &dir.to_string_lossy(),
            "--dns-upstream",
            &upstream,
        ],
    )?;

    let a1 = topo.pod(A1.0);
    let before = agent.metrics()?;
    for (url, server) in [
        ("http://203.0.113.66/", "v6only-origin"),
        ("http://203.0.113.67/", "dual-origin-v4"),
        ("http://203.0.113.67:8080/", "dual-origin-v6"),
    ] {
        assert_eq!(curl(a1.place(), url)?, format!("{server}\n"), "{url}");
    }
    let after = agent
        .wait_metrics("three services", Duration::from_secs(5), |m| {
            delta(&before, m, SERVICE) == 3.0
        })
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
    assert_eq!(delta(&before, &after, OUTBOUND_ERRORS), 0.0, "{after:#?}");
    // Both families were asked of the upstream for each host.
    let log = dns.log();
    for (host, _) in HOST_RECORDS {
        for qtype in ["A", "AAAA"] {
            ensure!(
                log.contains(&format!("query[{qtype}] {host} ")),
                "no {qtype} query for {host} upstream; dnsmasq log:\n{log}"
            );
        }
    }
    Ok(())
}
