//! Client identity (`docs/data-plane.md#client-identity-check`).
//! The registry gives a pod IP to a namespace, and the agent checks that word
//! against the kernel's. The programs record the cgroup of every connecting process; on a kubelet node
//! that cgroup names the pod's uid. When the pod the registry names and the pod the kernel names differ,
//! the connection is served as an unknown client (PUBLIC services only), never as the namespace the
//! address claims.
//!
//! The case that happens on real nodes: a pod ends, a new pod of another team gets its recycled IP, and
//! the registry has not caught up yet. Here the registry still gives 10.244.1.10 to team-a's `a1`,
//! while the pod really holding that address is team-b's `b1`.
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use integration::fixtures::{self, API_ENDPOINT_BODY, API_REAL_BODY, API_URL, API6_URL};
use integration::world::{delta, replace_file};
use integration::{Agent, DnsRecords, Dnsmasq, NO_FAST_PATH, Peer, RESOLVER_IP, Topology, dig};

const A1_UID: &str = "0a1a1a1a-0000-4000-8000-000000000001";
const A2_UID: &str = "0a2a2a2a-0000-4000-8000-000000000002";
const B1_UID: &str = "0b1b1b1b-0000-4000-8000-000000000003";
const C1_UID: &str = "0c1c1c1c-0000-4000-8000-000000000004";

const MISMATCHES: &str = "redirect_client_identity_mismatches_total";
const SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;
const PASSTHROUGH: &str = r#"redirect_outbound_connections_total{outcome="passthrough"}"#;

/// The registry as the control plane last said, with `holder` holding 10.244.1.10.
fn registry(holder: &str) -> String {
    [
        fixtures::team_a_api(),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-b}\n".to_string(),
        fixtures::pod("team-a/a2", A2_UID, "10.244.1.12", "{}"),
        fixtures::pod("team-a/c1", C1_UID, "10.244.1.13", "{}"),
        holder.to_string(),
    ]
    .join("---\n")
}

/// Fields drop in order: the agent, the servers, then the topology.
struct Setup {
    agent: Agent,
    _servers: (Peer, Peer, Dnsmasq),
    topo: Topology,
}

/// What the real resolver says `api.example.com` is (team-a's entry says 203.0.113.10).
const REAL_ANSWER: &str = "192.0.2.80";

fn setup() -> Result<Setup> {
    let mut topo = Topology::new()?;
    // b1 really holds the address the registry still gives to a1.
    topo.add_kube_pod("team-b/b1", "10.244.1.10".parse()?, B1_UID)?;
    topo.add_kube_pod("team-a/a2", "10.244.1.12".parse()?, A2_UID)?;
    // Not laid out by kubelet: its cgroup names no pod, so there is nothing to check against.
    topo.add_pod("team-a/c1", "10.244.1.13".parse()?)?;
    let (endpoint, real) = fixtures::start_api_servers(&topo)?;
    let dnsmasq = topo.start_dnsmasq(
        RESOLVER_IP,
        DnsRecords::new().host("api.example.com", REAL_ANSWER.parse()?),
    )?;
    let config = topo.scratch_path("config");
    std::fs::create_dir_all(&config)?;
    let stale = fixtures::pod("team-a/a1", A1_UID, "10.244.1.10", "{}");
    replace_file(&config, "registry.yaml", &registry(&stale))?;
    let upstream = format!("{RESOLVER_IP}:53");
    let agent = Agent::start(
        &topo,
        &[
            NO_FAST_PATH,
            "--config",
            &config.to_string_lossy(),
            "--dns-upstream",
            &upstream,
        ],
    )?;
    Ok(Setup {
        agent,
        _servers: (endpoint, real, dnsmasq),
        topo,
    })
}

/// `dig api.example.com` from `pod`, over TCP or UDP.
fn dig_api(s: &Setup, pod: &str, tcp: bool) -> Result<Vec<String>> {
    let transport = if tcp { "+tcp" } else { "+notcp" };
    let reply = dig::run(s.topo.pod(pod).cmd("dig").args([
        "+tries=1",
        "+time=2",
        transport,
        &format!("@{RESOLVER_IP}"),
        "api.example.com",
    ]))?;
    Ok(reply.a_records().iter().map(|a| a.to_string()).collect())
}

fn curl_api(s: &Setup, pod: &str) -> Result<String> {
    fixtures::curl_body(s.topo.pod(pod), API_URL)
}

/// The same from IPv6 sockets: the registry's word for a pod's IPv6 address is held against the
/// kernel's exactly as for its IPv4 one.
#[test]
fn the_identity_check_applies_to_a_client_known_by_its_ipv6_address() -> Result<()> {
    let s = setup()?;
    let before = s.agent.metrics()?;
    assert_eq!(
        fixtures::curl_body(s.topo.pod("team-a/a2"), API6_URL)?,
        API_ENDPOINT_BODY,
        "a2 is team-a's by its IPv6 address, and the kernel agrees"
    );
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, SERVICE), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");

    // b1 holds the IPv6 address the registry still gives to a1: an unknown client again.
    let before = after;
    assert_eq!(
        fixtures::curl_body(s.topo.pod("team-b/b1"), API6_URL)?,
        API_REAL_BODY
    );
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, SERVICE), 0.0, "{after:#?}");
    Ok(())
}

#[test]
fn a_pod_on_a_recycled_ip_is_not_served_as_the_namespace_the_registry_still_gives_that_ip()
-> Result<()> {
    let s = setup()?;

    // The registry and the kernel agree on a2: team-a gets its own NAMESPACE entry.
    let before = s.agent.metrics()?;
    assert_eq!(curl_api(&s, "team-a/a2")?, API_ENDPOINT_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, SERVICE), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");

    // b1 sits on the IP the registry gives to team-a's a1, but its cgroup is b1's: an unknown
    // client, which sees PUBLIC services only, so team-a's entry is absent and the real host answers.
    let before = after;
    assert_eq!(curl_api(&s, "team-b/b1")?, API_REAL_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, SERVICE), 0.0, "{after:#?}");
    let log = s.agent.log();
    ensure!(
        log.contains("not in the cgroup of the pod that holds its address")
            && log.contains(A1_UID)
            && log.contains(B1_UID),
        "the agent must say whom it refused to believe, and why:\n{log}"
    );

    // c1's cgroup names no pod: the registry's word stands (team-a), nothing is counted.
    let before = after;
    assert_eq!(curl_api(&s, "team-a/c1")?, API_ENDPOINT_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");

    // The registry catches up: b1 is team-b's, registry and kernel agree, and team-b still does not
    // see team-a's entry; no mismatch is counted any more.
    let caught_up = fixtures::pod("team-b/b1", B1_UID, "10.244.1.10", "{}");
    replace_file(
        &s.topo.scratch_path("config"),
        "registry.yaml",
        &registry(&caught_up),
    )?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.agent.admin_get("/config_dump")?.text().contains(B1_UID) {
        ensure!(
            Instant::now() < deadline,
            "the agent did not take the new registry"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = s.agent.metrics()?;
    assert_eq!(curl_api(&s, "team-b/b1")?, API_REAL_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 1.0, "{after:#?}");
    Ok(())
}

/// The DNS proxy establishes its clients as the proxy does wherever the kernel can tell: over TCP,
/// the asking process's cgroup is held against the registry, so b1 on a1's recycled address does
/// not get team-a's answer. Over UDP the kernel files nothing per query, and the address decides
/// (`docs/data-plane.md#client-identity-check` says so).
#[test]
fn a_dns_query_over_tcp_from_a_recycled_ip_is_answered_as_an_unknown_clients() -> Result<()> {
    let s = setup()?;
    assert_eq!(
        dig_api(&s, "team-a/a2", true)?,
        ["203.0.113.10"],
        "team-a's own pod, over TCP"
    );

    let before = s.agent.metrics()?;
    assert_eq!(
        dig_api(&s, "team-b/b1", true)?,
        [REAL_ANSWER],
        "b1 in team-b's cgroup on the address the registry gives a1: the real resolver answers"
    );
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 1.0, "{after:#?}");

    assert_eq!(
        dig_api(&s, "team-b/b1", false)?,
        ["203.0.113.10"],
        "over UDP the address is all there is to go by"
    );
    Ok(())
}
