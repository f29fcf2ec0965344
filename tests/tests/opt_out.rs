//! Pods labelled `istio.io/dataplane-mode: none` (Istio's opt-out) are left alone in the kernel: their
//! connections and DNS queries go where they were going, as if no agent ran, and the agent never sees
//! them. This is what the cluster DNS needs on a node (its upstream queries must not come back to the
//! agent). Removing the label captures the pod again, without restarting the agent.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::fixtures::{self, API_ENDPOINT_BODY, API_REAL_BODY, API_URL};
use integration::world::{delta, replace_file};
use integration::{Agent, DnsRecords, Dnsmasq, Peer, RESOLVER_IP, Topology, dig};

const RESOLVER_UID: &str = "0d0d0d0d-0000-4000-8000-00000000000d";
const CLIENT_UID: &str = "0a1a1a1a-0000-4000-8000-000000000001";

/// What dnsmasq, the real resolver, says about the entry's host name.
const REAL_ANSWER: &str = "203.0.113.99";

const TCP_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="tcp_redirected"}"#;
const DNS_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="dns_redirected"}"#;
const SKIPPED: &str = r#"redirect_ebpf_events_total{event="skipped_opted_out"}"#;

const OPTED_OUT: &str = "{istio.io/dataplane-mode: none}";
const CAPTURED: &str = "{app: resolver}";

/// team-a's entry, its client a1, and the pod `resolver` with `resolver_labels`.
fn config(resolver_labels: &str) -> String {
    [
        fixtures::team_a_api(),
        fixtures::pod("team-a/a1", CLIENT_UID, "10.244.1.10", "{}"),
        fixtures::pod(
            "team-a/resolver",
            RESOLVER_UID,
            "10.244.1.53",
            resolver_labels,
        ),
    ]
    .join("---\n")
}

/// Fields drop in order: the agent, the servers, then the topology.
struct Setup {
    agent: Agent,
    _servers: (Peer, Peer, Dnsmasq),
    topo: Topology,
}

fn setup() -> Result<Setup> {
    let mut topo = Topology::new()?;
    topo.add_kube_pod("team-a/a1", "10.244.1.10".parse()?, CLIENT_UID)?;
    topo.add_kube_pod("team-a/resolver", "10.244.1.53".parse()?, RESOLVER_UID)?;
    let (endpoint, real) = fixtures::start_api_servers(&topo)?;
    let dnsmasq = topo.start_dnsmasq(
        RESOLVER_IP,
        DnsRecords::new().host("api.example.com", REAL_ANSWER.parse()?),
    )?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    replace_file(&dir, "pods.yaml", &config(OPTED_OUT))?;
    let upstream = format!("{RESOLVER_IP}:53");
    let agent = Agent::start(
        &topo,
        &[
            "--config",
            &dir.to_string_lossy(),
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

fn curl(s: &Setup, pod: &str) -> Result<String> {
    fixtures::curl_body(s.topo.pod(pod), API_URL)
}

fn dig_api(s: &Setup, pod: &str) -> Result<Vec<String>> {
    let reply = dig::run(s.topo.pod(pod).cmd("dig").args([
        "+tries=1",
        "+time=2",
        &format!("@{RESOLVER_IP}"),
        "api.example.com",
    ]))?;
    Ok(reply.a_records().iter().map(|a| a.to_string()).collect())
}

#[test]
fn a_pod_labelled_dataplane_mode_none_is_left_alone_until_the_label_goes() -> Result<()> {
    let s = setup()?;

    // The captured pod gets team-a's entry, from the agent.
    assert_eq!(curl(&s, "team-a/a1")?, API_ENDPOINT_BODY);
    assert_eq!(dig_api(&s, "team-a/a1")?, ["203.0.113.10"]);

    // The opted-out pod, same namespace: the kernel does not steer it. It reaches the real host and
    // the real resolver's answer, and the agent never sees either.
    let before = s.agent.metrics()?;
    assert_eq!(curl(&s, "team-a/resolver")?, API_REAL_BODY);
    assert_eq!(dig_api(&s, "team-a/resolver")?, [REAL_ANSWER]);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, TCP_REDIRECTED), 0.0, "{after:#?}");
    assert_eq!(delta(&before, &after, DNS_REDIRECTED), 0.0, "{after:#?}");
    assert!(
        delta(&before, &after, SKIPPED) >= 2.0,
        "one connect for curl, one for dig: {after:#?}"
    );
    let dump: serde_json::Value = serde_json::from_str(&s.agent.admin_get("/config_dump")?.text())?;
    let opted: Vec<&str> = dump["workloads"]
        .as_array()
        .context("workloads in /config_dump")?
        .iter()
        .filter(|w| w["optedOut"] == true)
        .filter_map(|w| w["name"].as_str())
        .collect();
    assert_eq!(opted, ["resolver"], "{dump:#}");
    ensure!(
        s.agent.log().contains("team-a/resolver") && s.agent.log().contains("pod opted out"),
        "the agent must say which pod it leaves alone:\n{}",
        s.agent.log()
    );

    // The label goes: the pod is captured again within a few seconds, no restart.
    replace_file(
        &s.topo.scratch_path("config"),
        "pods.yaml",
        &config(CAPTURED),
    )?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while curl(&s, "team-a/resolver")? != API_ENDPOINT_BODY {
        ensure!(
            Instant::now() < deadline,
            "the resolver pod was not captured again after its label was removed:\n{}",
            s.agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(dig_api(&s, "team-a/resolver")?, ["203.0.113.10"]);
    Ok(())
}
