//! Replacing the agent (`docs/handover.md`): a successor takes the listening sockets and swaps its
//! programs into the pinned links while the old agent serves; the old one drains. A killed agent
//! leaves its programs attached (steered connections are refused at once) and a restarted one adopts
//! them; pinned state of an unknown layout is never adopted, only replaced.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::{
    Agent, DnsRecords, Peer, RESOLVER_IP, Topology, bpf, fixtures, pace, pattern, peer,
};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");
/// team-a's entry: visible to team-a only, so for team-b its address is the real host's.
const HIDDEN_ADDR: &str = "203.0.113.10:80";
const HIDDEN_REAL_BODY: &str = "real-203.0.113.10";
/// team-b's own entry (answered by the agent, connections go to its endpoint).
const SERVICE_VIP: &str = "203.0.113.20:80";
const SERVICE_ENDPOINT_BODY: &str = "team-b-svc";
/// An address nobody claims: passthrough.
const UNKNOWN_ADDR: &str = "203.0.113.30:80";
const UNKNOWN_BODY: &str = "unknown-203.0.113.30";
const UNKNOWN_ECHO: &str = "203.0.113.30:7";
const A1_UID: &str = "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a51";
const B1_UID: &str = "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a52";
fn config() -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: team-a}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: team-b}}
---
kind: MeshConfig
serviceEntryVisibility: {{defaultVisibility: NAMESPACE}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: api, namespace: team-a}}
spec:
  hosts: [api.example.com]
  addresses: [203.0.113.10]
  ports: [{{number: 80, name: http, protocol: HTTP}}]
  resolution: STATIC
  endpoints: [{{address: 198.51.100.20}}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: svc, namespace: team-b}}
spec:
  hosts: [svc.example.com]
  addresses: [203.0.113.20]
  ports: [{{number: 80, name: http, protocol: HTTP}}]
  resolution: STATIC
  endpoints: [{{address: 198.51.100.21}}]
---
{}---
{}"#,
        fixtures::pod(A1.0, A1_UID, A1.1, "{}"),
        fixtures::pod(B1.0, B1_UID, B1.1, "{}"),
    )
}

/// Fields drop in order: servers, then the topology (which unmounts the run's bpffs).
struct World {
    config_dir: String,
    dns_upstream: String,
    /// The default 30 s, stretched under emulation: the paced transfer must finish inside it.
    drain_timeout: String,
    _servers: Vec<Peer>,
    _dns: integration::Dnsmasq,
    topo: Topology,
}

/// Pods whose cgroups the agent cannot tie to a pod (its proxy decides all their connections):
/// the proxy's own hand-over.
fn world() -> Result<World> {
    world_on(Topology::with_pods(&[A1, B1])?)
}

/// Pods in kubelet's cgroups, whose namespaces the fast path knows: the kernel decides what needs
/// no proxy.
fn kube_world() -> Result<World> {
    let mut topo = Topology::new()?;
    topo.add_kube_pod(A1.0, A1.1.parse()?, A1_UID)?;
    topo.add_kube_pod(B1.0, B1.1.parse()?, B1_UID)?;
    world_on(topo)
}

fn world_on(topo: Topology) -> Result<World> {
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("mesh.yaml"), config())?;
    let servers = vec![
        topo.start_ext_peer("team-a-api", &["198.51.100.20:80".parse()?], &[])?,
        topo.start_ext_peer(HIDDEN_REAL_BODY, &[HIDDEN_ADDR.parse()?], &[])?,
        topo.start_ext_peer(SERVICE_ENDPOINT_BODY, &["198.51.100.21:80".parse()?], &[])?,
        topo.start_ext_peer(
            UNKNOWN_BODY,
            &[UNKNOWN_ADDR.parse()?],
            &[UNKNOWN_ECHO.parse()?],
        )?,
    ];
    let dns = topo.start_dnsmasq(
        RESOLVER_IP,
        DnsRecords::new().host("api.example.com", "203.0.113.10".parse()?),
    )?;
    Ok(World {
        config_dir: dir.display().to_string(),
        dns_upstream: format!("{RESOLVER_IP}:53"),
        drain_timeout: format!("{}s", pace::scaled(Duration::from_secs(30)).as_secs()),
        _servers: servers,
        _dns: dns,
        topo,
    })
}

impl World {
    fn agent_args(&self) -> [&str; 6] {
        [
            "--config",
            &self.config_dir,
            "--dns-upstream",
            &self.dns_upstream,
            "--drain-timeout",
            &self.drain_timeout,
        ]
    }
}

/// The connections the kernel decided itself (left alone or rewritten), over its pinned counters.
fn kernel_decided(m: &integration::Metrics) -> f64 {
    ["passthrough", "workload", "rewritten"]
        .iter()
        .map(|o| {
            m.get_or_zero(&format!(
                r#"redirect_fast_path_connections_total{{outcome="{o}",reason=""}}"#
            ))
        })
        .sum()
}

/// With the fast path (the default) and pods the kernel knows, team-b's steady connections (its
/// service, rewritten; team-a's hidden address and an unknown one, left alone) go on through a
/// hand-over: none fails, and every one of them is counted by the kernel, whose counters go on
/// from the old agent's into the successor's: the successor's programs decided from their first
/// connection, none went to a proxy.
#[test]
fn a_hand_over_under_load_with_the_fast_path_keeps_every_connection_in_the_kernel() -> Result<()> {
    let w = kube_world()?;
    let old = Agent::start(&w.topo, &w.agent_args())?;
    ensure!(old.fast_path(), "REDIRECT_FAST_PATH=0 in the environment");
    let before = old.metrics()?;
    let mut mix = peer::cmd(w.topo.pod(B1.0).place())?
        .args(["mix", "--rate", "700", "--workers", "16"])
        .args(["--http", &format!("{SERVICE_VIP}={SERVICE_ENDPOINT_BODY}")])
        .args(["--http", &format!("{HIDDEN_ADDR}={HIDDEN_REAL_BODY}")])
        .args(["--http", &format!("{UNKNOWN_ADDR}={UNKNOWN_BODY}")])
        .spawn()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;
    std::thread::sleep(pace::scaled(Duration::from_secs(1)));
    let old_counted = kernel_decided(&old.metrics()?);

    let new = Agent::start_successor(&w.topo, &w.agent_args())?;
    // The successor's first look: its counters are the predecessor's, not zero again.
    let new_counted = kernel_decided(&new.metrics()?);
    old.terminate_async();
    old.wait_exit(Duration::from_secs(60))?;
    std::thread::sleep(pace::scaled(Duration::from_secs(1)));
    let report = peer::stop_mix(mix)?;
    let after = new.metrics()?;
    eprintln!(
        "client loop: {} ok, {} failed; kernel-decided: {} before, {old_counted} under the old agent, {new_counted} at the successor's start, {} at the end",
        report.ok,
        report.failed,
        kernel_decided(&before),
        kernel_decided(&after)
    );
    assert_eq!(
        report.failed, 0,
        "failures during the hand-over:\n{}",
        report.text
    );
    ensure!(
        new_counted >= old_counted && old_counted > kernel_decided(&before),
        "the kernel's counters did not go on across the hand-over: {old_counted} under the old agent, {new_counted} at the successor's start"
    );
    assert_eq!(
        kernel_decided(&after) - kernel_decided(&before),
        report.ok as f64,
        "every connection of the loop decided in the kernel, by one agent's programs or the other's: {after:#?}"
    );
    new.stop()?;
    Ok(())
}

/// team-b's steady traffic: its service, team-a's hidden entry's address, an unknown address, a
/// name the agent answers and one it forwards.
fn start_mix(topo: &Topology) -> Result<integration::Proc> {
    let resolver = format!("{RESOLVER_IP}:53");
    let mut mix = peer::cmd(topo.pod(B1.0).place())?
        .args(["mix", "--rate", "700", "--workers", "16"])
        .args(["--http", &format!("{SERVICE_VIP}={SERVICE_ENDPOINT_BODY}")])
        .args(["--http", &format!("{HIDDEN_ADDR}={HIDDEN_REAL_BODY}")])
        .args(["--http", &format!("{UNKNOWN_ADDR}={UNKNOWN_BODY}")])
        .args(["--dns", &format!("{resolver}=svc.example.com")])
        .args(["--dns", &format!("{resolver}=api.example.com")])
        .spawn()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;
    Ok(mix)
}

#[test]
fn a_replaced_agent_fails_no_connection_or_query_and_finishes_a_transfer_begun_before() -> Result<()>
{
    // 256 MiB; under emulation the relay moves a few MiB a second, so the transfer shrinks with the
    // time scale (it must still outlive the hand-over, which is checked below).
    let n: u64 = (256 << 20) / u64::from(pace::scale());
    let w = world()?;
    let old = Agent::start(&w.topo, &w.agent_args())?;
    let before = bpf::one_set_attached(w.topo.attach_cgroup())?;

    let mix = start_mix(&w.topo)?;
    std::thread::sleep(pace::scaled(Duration::from_secs(1)));
    // Upload and download at once on one connection, paced so it outlives the hand-over.
    let mut transfer = peer::cmd(w.topo.pod(B1.0).place())?
        .args([
            "echo",
            UNKNOWN_ECHO,
            "--bytes",
            &n.to_string(),
            "--rate-mib",
            "48",
        ])
        .spawn()?;
    std::thread::sleep(Duration::from_millis(500));
    ensure!(
        transfer.is_running(),
        "the transfer ended early: {}",
        transfer.log()
    );

    let started = Instant::now();
    let new = Agent::start_successor(&w.topo, &w.agent_args())?;
    let handover = started.elapsed();
    ensure!(
        transfer.is_running(),
        "the transfer ended before the hand-over completed: the test proves nothing"
    );
    let after = bpf::one_set_attached(w.topo.attach_cgroup())?;
    assert_ne!(
        before, after,
        "the successor's programs must be the attached ones"
    );

    old.terminate_async();
    let old_log = old.wait_exit(Duration::from_secs(60))?;
    // The old agent carried the transfer to its end: it drained (no reset), for seconds.
    let drained_ms: u64 = old_log
        .lines()
        .find(|l| l.contains("every connection ended"))
        .and_then(|l| l.split("drained_ms=").nth(1))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("the old agent did not drain:\n{old_log}"))?;
    assert!(
        drained_ms >= 1000,
        "drained in {drained_ms} ms: the transfer was not the old agent's"
    );
    std::thread::sleep(pace::scaled(Duration::from_secs(1)));
    let report = peer::stop_mix(mix)?;
    let rate = report.ok as f64 / report.secs;
    eprintln!(
        "hand-over took {handover:?} (successor start to ready); client loop: {} ok, {} failed in {:.1}s ({rate:.0}/s)",
        report.ok, report.failed, report.secs
    );
    assert_eq!(
        report.failed, 0,
        "failures during the hand-over:\n{}",
        report.text
    );
    // Under emulation everything runs many times slower; the floor drops with it.
    let floor = 500.0 / f64::from(pace::scale());
    assert!(
        rate >= floor,
        "the client loop ran at {rate:.0}/s, under {floor:.0}/s"
    );

    let status = transfer.wait(pace::scaled(Duration::from_secs(60)))?;
    let log = transfer.log();
    let expected = pattern::sha256_of_len(n);
    assert!(status.success(), "transfer failed: {log}");
    assert!(
        log.contains(&format!("sent {n} {expected}"))
            && log.contains(&format!("received {n} {expected}")),
        "transfer not byte-identical: {log}"
    );

    // The successor carries everything now, and is the one whose exit uninstalls.
    assert_eq!(bpf::one_set_attached(w.topo.attach_cgroup())?, after);
    assert_eq!(
        fixtures::curl_body(w.topo.pod(B1.0), "http://203.0.113.20/")?,
        SERVICE_ENDPOINT_BODY
    );
    new.stop()?;
    bpf::wait_detached(w.topo.attach_cgroup())?;
    // The uninstall path: the pin directory went with the last agent.
    let dir = w.topo.pin_dir();
    assert!(
        !dir.exists(),
        "{} left after the last agent exited",
        dir.display()
    );
    Ok(())
}

#[test]
fn a_killed_agent_leaves_connections_refused_at_once_and_a_restarted_one_adopts_its_programs()
-> Result<()> {
    let w = world()?;
    let pod = w.topo.pod(B1.0);
    let first = Agent::start(&w.topo, &w.agent_args())?;
    assert_eq!(
        fixtures::curl_body(pod, "http://203.0.113.20/")?,
        SERVICE_ENDPOINT_BODY
    );
    let before = bpf::one_set_attached(w.topo.attach_cgroup())?;
    first.kill()?;

    // Fail closed: the programs stay, nobody listens at the gateway, a connection is refused at once
    // (never passed to the original destination, never left hanging).
    assert_eq!(bpf::one_set_attached(w.topo.attach_cgroup())?, before);
    let tried = Instant::now();
    let out = pod
        .cmd("curl")
        .args(["-sS", "--max-time", "5", "http://203.0.113.10/"])
        .output()?;
    let refused_in = tried.elapsed();
    assert_eq!(out.status.code(), Some(7), "curl: {}", out.stderr_str());
    assert!(
        refused_in < pace::scaled(Duration::from_secs(1)),
        "refusal took {refused_in:?}"
    );

    // The restart: from the process's start to ready is how long pods are refused.
    let restarted = Instant::now();
    let second = Agent::start(&w.topo, &w.agent_args())?;
    let window = restarted.elapsed();
    eprintln!("after kill -9: refused in {refused_in:?}; restart to ready: {window:?}");
    assert!(
        window < pace::scaled(Duration::from_secs(10)),
        "restart window {window:?}"
    );
    assert!(second.log().contains("Adopted"), "{}", second.log());
    let after = bpf::one_set_attached(w.topo.attach_cgroup())?;
    assert_ne!(
        before, after,
        "the restarted agent's programs must be the attached ones"
    );
    assert_eq!(
        fixtures::curl_body(pod, "http://203.0.113.10/")?,
        HIDDEN_REAL_BODY
    );
    second.stop()?;
    bpf::wait_detached(w.topo.attach_cgroup())?;
    Ok(())
}

#[test]
fn pinned_state_of_an_unknown_layout_is_replaced_not_adopted() -> Result<()> {
    let w = world()?;
    let pod = w.topo.pod(B1.0);
    let first = Agent::start(&w.topo, &w.agent_args())?;
    first.kill()?;
    // As if a future version had pinned it.
    bpf::set_pinned_u32(&w.topo.pin_dir().join("layout"), 999)?;

    let second = Agent::start(&w.topo, &w.agent_args())?;
    let log = second.log();
    assert!(
        log.contains("refusing to adopt pinned state of an unknown layout")
            && log.contains("layout version 999"),
        "{log}"
    );
    let window = log
        .lines()
        .find(|l| l.contains("took over from pinned state of an unknown layout"))
        .with_context(|| format!("no window logged:\n{log}"))?;
    eprintln!("{window}");
    assert!(window.contains("window_ms="), "{window}");
    bpf::one_set_attached(w.topo.attach_cgroup())?;
    assert_eq!(
        fixtures::curl_body(pod, "http://203.0.113.20/")?,
        SERVICE_ENDPOINT_BODY
    );
    // And it wrote its own layout: the next agent adopts.
    second.kill()?;
    let third = Agent::start(&w.topo, &w.agent_args())?;
    assert!(third.log().contains("Adopted"), "{}", third.log());
    bpf::one_set_attached(w.topo.attach_cgroup())?;
    third.stop()?;
    bpf::wait_detached(w.topo.attach_cgroup())?;
    Ok(())
}
