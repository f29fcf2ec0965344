//! No pod can take the agent down for the others: floods, piles of idle connections and connection
//! storms hit one pod's share (or the node's budget) and are refused at once, while other pods keep
//! being served; and an agent killed mid-stream resets both ends instead of ending them cleanly.
//! Every load here is bounded in count and time and stays inside the run's namespaces.
use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::{
    Agent, DnsRecords, Dnsmasq, NO_FAST_PATH, Peer, Proc, RESOLVER_IP, Topology, dig, fixtures,
    pace, peer,
};

const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");
const EXT_HTTP: &str = "203.0.113.10:80";
const EXT_ECHO: &str = "203.0.113.10:7";
const NAME: &str = "api.example.com";
const NAME_IP: &str = "203.0.113.10";
const RESOLVER: &str = "198.51.100.53:53";

const ACTIVE: &str = "redirect_active_connections";
const MALFORMED: &str = r#"redirect_dns_queries_total{outcome="malformed"}"#;

fn refusals(budget: &str, reason: &str) -> String {
    format!(r#"redirect_budget_refusals_total{{budget="{budget}",reason="{reason}"}}"#)
}

fn limit(budget: &str, scope: &str) -> String {
    format!(r#"redirect_budget_limit{{budget="{budget}",scope="{scope}"}}"#)
}

/// Fields drop in order: the agent first, then the servers, then the topology.
struct Setup {
    agent: Agent,
    _ext: Peer,
    _dns: Dnsmasq,
    topo: Topology,
}

fn setup(pods: &[(&str, &str)], fd_limit: Option<u64>, agent_args: &[&str]) -> Result<Setup> {
    setup_on(Topology::with_pods(pods)?, fd_limit, agent_args)
}

/// [`setup`] on a topology made (and adjusted) already.
fn setup_on(topo: Topology, fd_limit: Option<u64>, agent_args: &[&str]) -> Result<Setup> {
    let ext = topo.start_ext_peer("ext", &[EXT_HTTP.parse()?], &[EXT_ECHO.parse()?])?;
    let dns = topo.start_dnsmasq(RESOLVER_IP, DnsRecords::new().host(NAME, NAME_IP.parse()?))?;
    // The proxy's own budgets: every connection goes to it.
    let mut args = vec!["--dns-upstream", RESOLVER, NO_FAST_PATH];
    args.extend_from_slice(agent_args);
    let agent = match fd_limit {
        Some(n) => Agent::start_with_fd_limit(&topo, n, &args)?,
        None => Agent::start(&topo, &args)?,
    };
    Ok(Setup {
        agent,
        _ext: ext,
        _dns: dns,
        topo,
    })
}

/// The agent's fd count at rest: the lowest of a few samples (a scrape briefly holds one more).
fn settled_fds(agent: &Agent) -> Result<usize> {
    let mut lowest = usize::MAX;
    for _ in 0..5 {
        lowest = lowest.min(agent.fd_count()?);
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(lowest)
}

/// Polls until the agent's fds are back to at most `most`; returns the count seen.
fn fds_settle_to(agent: &Agent, most: usize, within: Duration) -> Result<usize> {
    let deadline = Instant::now() + pace::scaled(within);
    loop {
        let fds = settled_fds(agent)?;
        if fds <= most || Instant::now() > deadline {
            return Ok(fds);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `key=value` pairs of the last line of `log` that has `first_key=`.
fn counts(log: &str, first_key: &str) -> Result<BTreeMap<String, u64>> {
    let line = log
        .lines()
        .rev()
        .find(|l| l.starts_with(&format!("{first_key}=")))
        .with_context(|| format!("no {first_key}= line in:\n{log}"))?;
    line.split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').context("key=value")?;
            Ok((k.to_string(), v.parse()?))
        })
        .collect()
}

/// One forwarded name and one connection from `pod`, each required to work.
fn other_pod_is_served(s: &Setup, pod: &str) -> Result<()> {
    let reply = dig::run(
        s.topo
            .pod(pod)
            .cmd("dig")
            .args(["+tries=1", "+time=2", NAME]),
    )?;
    ensure!(
        reply.status == "NOERROR" && reply.a_records() == [NAME_IP.parse::<std::net::Ipv4Addr>()?],
        "{reply:#?}"
    );
    let body = s
        .topo
        .pod(pod)
        .cmd("curl")
        .args([
            "-sS",
            "--fail",
            "--max-time",
            "5",
            &format!("http://{EXT_HTTP}/"),
        ])
        .ok()?
        .stdout_str();
    ensure!(body == "ext\n", "{body:?}");
    Ok(())
}

#[test]
fn a_pod_flooding_udp_dns_leaves_other_pods_served_and_the_agent_within_budget() -> Result<()> {
    const FLOOD: (&str, &str) = ("team-a/flood", "10.244.1.66");
    const SHARE: usize = 64;
    const SECONDS: u64 = 10;
    let share = SHARE.to_string();
    let s = setup(
        &[FLOOD, B1],
        None,
        &["--max-dns-forwards-per-client", &share],
    )?;
    // Warm up the paths the other pod uses, then take the baseline.
    other_pod_is_served(&s, "team-b/b1")?;
    let fds_before = settled_fds(&s.agent)?;
    let rss_before = s.agent.rss_kib()?;

    // Under emulation a round of dig + curl takes many times longer: the flood lasts as much longer,
    // so the other pod still has room for the same number of rounds.
    let seconds = pace::scaled_secs(SECONDS);
    let mut flood = peer::cmd(s.topo.pod("team-a/flood").place())?
        .args(["dns-flood", RESOLVER, "--seconds", &seconds])
        .spawn()?;
    let (mut served, mut max_fds, mut max_rss) = (0, 0, 0);
    while flood.is_running() {
        other_pod_is_served(&s, "team-b/b1")
            .with_context(|| format!("after {served} rounds served during the flood"))?;
        served += 1;
        max_fds = max_fds.max(s.agent.fd_count()?);
        max_rss = max_rss.max(s.agent.rss_kib()?);
    }
    let status = flood.wait(Duration::from_secs(5))?;
    ensure!(status.success(), "{}", flood.log());
    let sent = counts(&flood.log(), "valid")?;
    let m = s.agent.metrics()?;
    let fds_after = fds_settle_to(&s.agent, fds_before + 8, Duration::from_secs(5))?;
    let rss_after = s.agent.rss_kib()?;
    eprintln!(
        "flood {sent:?}; other pod served {served} rounds (dig + curl) during it; agent fds {fds_before} -> max {max_fds} -> {fds_after}; RSS {rss_before} KiB -> max {max_rss} KiB -> {rss_after} KiB; malformed {}; forwards refused {}",
        m.get_or_zero(MALFORMED),
        m.get_or_zero(&refusals("dns_forwards", "client_share")),
    );
    ensure!(served >= 5, "the other pod was served only {served} times");
    ensure!(
        sent["valid"] > 10_000,
        "the flood was too weak to show anything: {sent:?}"
    );
    // Junk is dropped and counted, never forwarded; the flooding pod hit its share.
    ensure!(m.get_or_zero(MALFORMED) > 0.0, "{m:#?}");
    ensure!(
        m.get_or_zero(&refusals("dns_forwards", "client_share")) > 0.0,
        "{m:#?}"
    );
    // Descriptors: the flooding pod's share of forwards, the upstream's socket pool (64) and the
    // other pod's traffic, never one per junk packet.
    ensure!(
        max_fds <= fds_before + SHARE + 64 + 32,
        "agent fds went from {fds_before} to {max_fds}"
    );
    ensure!(
        max_rss <= rss_before + 64 * 1024,
        "agent RSS went from {rss_before} KiB to {max_rss} KiB"
    );
    ensure!(
        fds_after <= fds_before + 8,
        "fds did not come back: {fds_before} -> {fds_after}"
    );
    ensure!(
        rss_after <= rss_before + 32 * 1024,
        "RSS did not come back: {rss_before} KiB -> {rss_after} KiB"
    );
    s.agent.stop()
}

#[test]
fn idle_tcp_dns_connections_from_one_pod_leave_another_pods_tcp_dns_answered() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    const CONNS: u64 = 1100;
    let s = setup(&[A1, B1], None, &[])?;
    let mut hold = peer::cmd(s.topo.pod("team-a/a1").place())?
        .args(["hold-idle", RESOLVER, "--conns", &CONNS.to_string()])
        .spawn()?;
    hold.wait_for_log("open=", Duration::from_secs(30))?;
    let held = counts(&hold.log(), "open")?;
    // While they are held, another pod's DNS over TCP is answered.
    let reply = dig::run(
        s.topo
            .pod("team-b/b1")
            .cmd("dig")
            .args(["+tcp", "+tries=1", "+time=2", NAME]),
    )?;
    ensure!(
        reply.status == "NOERROR" && !reply.answer.is_empty(),
        "{reply:#?}"
    );
    eprintln!(
        "one pod's {CONNS} idle TCP DNS connections: {held:?}; the other pod answered over TCP in {:?}",
        reply.elapsed
    );
    let m = s.agent.metrics()?;
    let share = m.get_or_zero(&limit("dns_tcp_clients", "client")) as u64;
    let node = m.get_or_zero(&limit("dns_tcp_clients", "node")) as u64;
    ensure!(
        share > 0 && share < node && node < CONNS,
        "share {share} of {node}"
    );
    ensure!(
        held["open"] == share && held["reset"] == CONNS - share && held["closed"] == 0,
        "the pod keeps its share ({share}), the rest is reset at once: {held:?}"
    );
    ensure!(
        m.get_or_zero(&refusals("dns_tcp_clients", "client_share")) == (CONNS - share) as f64,
        "{m:#?}"
    );
    hold.close_stdin();
    hold.wait(Duration::from_secs(10))?;
    s.agent.stop()
}

/// A dual-stack pod is one client: the connections it holds from its IPv4 address count against
/// the same share as those from its IPv6 address, so having two addresses does not give it twice
/// the room. Another pod keeps its own share.
#[test]
fn a_dual_stack_pods_ipv4_and_ipv6_connections_share_one_budget() -> Result<()> {
    const B2: (&str, &str) = ("team-b/b2", "10.244.2.11");
    const SHARE: u64 = 4;
    const ECHO6: &str = "[2001:db8::10]:7";
    let topo = Topology::with_pods(&[B1, B2])?;
    let _ext = topo.start_ext_peer(
        "ext",
        &[EXT_HTTP.parse()?],
        &[EXT_ECHO.parse()?, ECHO6.parse()?],
    )?;
    // Both pods registered dual-stack (`podIPs` holds each one's IPv4 and IPv6 address).
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let pods = [
        fixtures::pod(B1.0, "0b1b1b1b-0000-4000-8000-0000000000b1", B1.1, "{}"),
        fixtures::pod(B2.0, "0b2b2b2b-0000-4000-8000-0000000000b2", B2.1, "{}"),
    ];
    std::fs::write(dir.join("pods.yaml"), pods.join("---\n"))?;
    let share = SHARE.to_string();
    let agent = Agent::start(
        &topo,
        &[
            NO_FAST_PATH,
            "--config",
            &dir.to_string_lossy(),
            "--max-connections-per-client",
            &share,
        ],
    )?;
    let storm = |pod: &str, addr: &str, conns: u64| -> Result<(Proc, BTreeMap<String, u64>)> {
        let mut p = peer::cmd(topo.pod(pod).place())?
            .args(["storm", addr, "--conns", &conns.to_string()])
            .spawn()?;
        p.wait_for_log("worked=", Duration::from_secs(60))?;
        let c = counts(&p.log(), "worked")?;
        Ok((p, c))
    };
    let (mut v4, c) = storm("team-b/b1", EXT_ECHO, SHARE)?;
    ensure!(
        c["worked"] == SHARE,
        "b1 over IPv4 gets its whole share: {c:?}"
    );
    // The same pod from its IPv6 address: its share is already taken.
    let (mut v6, c) = storm("team-b/b1", ECHO6, 2)?;
    ensure!(
        c["worked"] == 0 && c["reset"] == 2,
        "b1 over IPv6 while its IPv4 connections hold its share: {c:?}"
    );
    let m = agent.metrics()?;
    ensure!(
        m.get_or_zero(&refusals("connections", "client_share")) == 2.0,
        "{m:#?}"
    );
    // Another pod, over IPv6 too, has room of its own.
    let (mut other, c) = storm("team-b/b2", ECHO6, 2)?;
    ensure!(c["worked"] == 2, "b2 keeps its share: {c:?}");
    for p in [&mut v4, &mut v6, &mut other] {
        p.write_stdin(b"done\n")?;
        p.wait(Duration::from_secs(30))?;
    }
    agent.stop()
}

/// 10,000 connections at once from four pods against an agent limited to 4,096 open files: it can
/// carry about 1,600 of them; every other one must be reset at once, none may hang, and readiness
/// must say the proxy is saturated while they are held.
#[test]
fn ten_thousand_connections_under_a_low_fd_limit_work_or_are_reset_at_once() -> Result<()> {
    const PODS: [(&str, &str); 4] = [
        ("team-a/s1", "10.244.1.21"),
        ("team-a/s2", "10.244.1.22"),
        ("team-b/s3", "10.244.2.23"),
        ("team-b/s4", "10.244.2.24"),
    ];
    const PER_POD: u64 = 2500;
    const FD_LIMIT: u64 = 4096;
    let s = setup(&PODS, Some(FD_LIMIT), &[])?;
    let fds_before = settled_fds(&s.agent)?;

    let started = Instant::now();
    let mut storms: Vec<Proc> = PODS
        .iter()
        .map(|(pod, _)| {
            peer::cmd(s.topo.pod(pod).place())?
                .args(["storm", EXT_ECHO, "--conns", &PER_POD.to_string()])
                .spawn()
        })
        .collect::<Result<_>>()?;
    let mut worked_total = 0;
    for (storm, (pod, _)) in storms.iter_mut().zip(PODS) {
        storm.wait_for_log("worked=", Duration::from_secs(120))?;
        let c = counts(&storm.log(), "worked")?;
        eprintln!("{pod}: {c:?}");
        ensure!(
            c["hung"] == 0 && c["closed"] == 0 && c["failed"] == 0,
            "{pod}: every connection works or is reset: {c:?}\n{}",
            storm.log()
        );
        ensure!(c["worked"] + c["reset"] == PER_POD, "{pod}: {c:?}");
        ensure!(c["worked"] > 0, "{pod} got none of the node's room: {c:?}");
        ensure!(
            c["slowest_reset_ms"] < pace::scaled(Duration::from_secs(5)).as_millis() as u64,
            "{pod}: a reset came only after {} ms",
            c["slowest_reset_ms"]
        );
        worked_total += c["worked"];
    }
    let took = started.elapsed();
    let ready = s.agent.admin_get("/healthz/ready")?;
    let busy_fds = s.agent.fd_count()?;
    let m = s.agent.metrics()?;
    eprintln!(
        "{} connections in {took:?}: {worked_total} carried at once; agent fds {fds_before} -> {busy_fds} (limit {FD_LIMIT}); readiness {} {:?}",
        PER_POD * 4,
        ready.status,
        ready.text().trim()
    );
    ensure!(
        ready.status == 503 && ready.text().contains("the outbound proxy is at its"),
        "readiness must report saturation: {} {}",
        ready.status,
        ready.text()
    );
    ensure!(
        m.get_or_zero(ACTIVE) == worked_total as f64,
        "every connection that worked is still carried: {m:#?}"
    );
    ensure!(busy_fds < FD_LIMIT as usize, "{busy_fds} fds");
    // Sized from the 4,096 limit: 256 kept back, DNS over TCP an eighth of the rest (240 clients at
    // 2 each), the proxy the remaining 3,360 descriptors: 1,680 connections, 420 a pod. UDP forwards
    // hold no descriptor: their 1,024 do not depend on the limit.
    for (budget, scope, expect) in [
        ("fds", "node", 3360.0),
        ("connections", "node", 1680.0),
        ("connections", "client", 420.0),
        ("dns_forwards", "node", 1024.0),
        ("dns_tcp_clients", "node", 240.0),
    ] {
        ensure!(
            m.get_or_zero(&limit(budget, scope)) == expect,
            "{budget} {scope}: {m:#?}"
        );
    }

    for storm in &mut storms {
        storm.write_stdin(b"done\n")?;
    }
    for storm in &mut storms {
        storm.wait(Duration::from_secs(30))?;
    }
    s.agent
        .wait_metrics("no connection left", Duration::from_secs(10), |m| {
            m.get_or_zero(ACTIVE) == 0.0
        })?;
    let fds_after = fds_settle_to(&s.agent, fds_before + 4, Duration::from_secs(10))?;
    ensure!(
        fds_after <= fds_before + 4,
        "fds did not come back: {fds_before} -> {fds_after}"
    );
    let ready = s.agent.admin_get("/healthz/ready")?;
    ensure!(ready.status == 200, "ready again: {}", ready.text());
    s.agent.stop()
}

/// How a stream client ended: its exit status must be a failure and its log an error, never `eof`.
fn ended_with_error(client: &mut Proc) -> Result<String> {
    let status = client.wait(Duration::from_secs(10))?;
    let log = client.log();
    ensure!(
        !status.success() && log.contains("error") && !log.contains("eof"),
        "{} ended cleanly (a short stream taken for a whole one): {log}",
        client.what()
    );
    Ok(log
        .lines()
        .find(|l| l.starts_with("error"))
        .unwrap_or("")
        .to_string())
}

#[test]
fn killing_the_agent_mid_download_and_mid_upload_resets_both_ends() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    const SOURCE: &str = "203.0.113.20:9000";
    const SINK: &str = "203.0.113.20:9001";
    let s = setup(&[A1], None, &[])?;
    let source: SocketAddrV4 = SOURCE.parse()?;
    s.topo.ensure_ext_address(*source.ip())?;
    let streams = Peer::start_streams(s.topo.ext(), "streams", source, SINK.parse()?)?;
    let pod = s.topo.pod("team-a/a1").place();
    let mut download = peer::cmd(pod)?.args(["read", SOURCE]).spawn()?;
    let mut upload = peer::cmd(pod)?.args(["write", SINK]).spawn()?;
    // Both streams well under way through the agent.
    s.agent
        .wait_metrics("both streams flowing", Duration::from_secs(10), |m| {
            m.get_or_zero(ACTIVE) == 2.0
        })?;
    std::thread::sleep(Duration::from_millis(500));
    s.agent.kill()?;

    let down = ended_with_error(&mut download)?;
    let up = ended_with_error(&mut upload)?;
    // The servers see the same: the upload was cut, not finished.
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(5));
    while !streams.log().contains("sink ") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let server = streams.log();
    eprintln!("download client: {down}; upload client: {up}; server: {server}");
    ensure!(
        server.contains("sink error") && !server.contains("sink eof"),
        "the upload's server took the cut stream for a whole one: {server}"
    );
    Ok(())
}

/// A proxied connection on which nothing moves is reset at the idle timeout (here 1 s), both sides.
#[test]
fn an_idle_proxied_connection_is_reset_at_the_idle_timeout() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    let s = setup(&[A1], None, &["--idle-timeout", "1s"])?;
    let started = Instant::now();
    // The echo server sends nothing unless sent to: the connection stays idle.
    let mut idle = peer::cmd(s.topo.pod("team-a/a1").place())?
        .args(["read", EXT_ECHO])
        .spawn()?;
    let down = ended_with_error(&mut idle)?;
    let took = started.elapsed();
    eprintln!("idle connection: {down} after {took:?}");
    ensure!(down.contains("ConnectionReset"), "{down}");
    ensure!(
        took < pace::scaled(Duration::from_secs(5)),
        "reset only after {took:?}"
    );
    let m = s.agent.metrics()?;
    ensure!(
        m.get_or_zero(r#"redirect_outbound_timeouts_total{timeout="idle"}"#) == 1.0,
        "{m:#?}"
    );
    s.agent.stop()
}

/// Kernel memory the agent's sockets of one stream hold, in bytes (`ss -tm` in the node netns:
/// receive queue `r`, send queue `w` and in flight `t`), summed over the sockets whose local port
/// is the proxy's or whose peer is `upstream`.
fn agent_socket_memory(topo: &integration::Topology, upstream: &str) -> Result<(u64, usize)> {
    let out = topo.node_cmd("ss").args(["-tmniH"]).ok()?.stdout_str();
    let (mut total, mut sockets) = (0u64, 0usize);
    let mut ours = false;
    for line in out.lines() {
        if !line.starts_with(char::is_whitespace) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, peer) = (fields.get(3), fields.get(4));
            ours = local.is_some_and(|l| l.ends_with(":15001")) || peer == Some(&upstream);
            if ours {
                sockets += 1;
            }
        }
        let Some(skmem) = line.split("skmem:(").nth(1) else {
            continue;
        };
        if !ours {
            continue;
        }
        for part in skmem.trim_end_matches(')').split(',') {
            for key in ["r", "w", "t"] {
                if let Some(n) = part.strip_prefix(key).and_then(|n| n.parse::<u64>().ok()) {
                    total += n;
                }
            }
        }
    }
    Ok((total, sockets))
}

/// Connections that never read: whatever the upstream sends piles up in the agent's socket
/// buffers. Each proxied socket's buffers are bounded (`--connection-buffer`, 1 MiB by default,
/// per socket and direction), so a pod cannot make the node hold more than about 2 MiB of socket
/// memory per connection (autotuned, this test measured 11.1 MiB).
#[test]
fn a_client_that_never_reads_holds_a_bounded_buffer_per_connection() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    const SOURCE: &str = "203.0.113.20:9000";
    const SINK: &str = "203.0.113.20:9001";
    const CONNS: usize = 4;
    let s = setup(&[A1], None, &[])?;
    let source: SocketAddrV4 = SOURCE.parse()?;
    s.topo.ensure_ext_address(*source.ip())?;
    let _streams = Peer::start_streams(s.topo.ext(), "streams", source, SINK.parse()?)?;
    let hold = peer::cmd(s.topo.pod("team-a/a1").place())?
        .args(["hold-idle", SOURCE, "--conns", &CONNS.to_string()])
        .spawn()?;
    s.agent
        .wait_metrics("the streams open", Duration::from_secs(10), |m| {
            m.get_or_zero(ACTIVE) == CONNS as f64
        })?;
    // Until the buffers stop growing.
    let mut held = (0, 0);
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let now = agent_socket_memory(&s.topo, SOURCE)?;
        if now.0 == held.0 && now.0 > 0 {
            break;
        }
        held = now;
    }
    let (bytes, sockets) = held;
    let per_connection = bytes as f64 / CONNS as f64 / f64::from(1 << 20);
    eprintln!(
        "{CONNS} connections that never read: {sockets} agent sockets hold {:.1} MiB, {per_connection:.2} MiB per connection",
        bytes as f64 / f64::from(1 << 20)
    );
    ensure!(sockets >= 2 * CONNS, "both legs of each stream: {sockets}");
    // Two legs, 1 MiB each by default, and the kernel's accounting overhead.
    ensure!(
        per_connection <= 2.5,
        "{per_connection:.2} MiB per connection held in the agent's sockets"
    );
    drop(hold);
    s.agent.stop()
}

/// DNS over TCP opens one upstream connection per query. Closed with a FIN from the agent first,
/// each would sit in TIME_WAIT for a minute holding a port toward the resolver: one pod asking over
/// TCP quickly would use up the node's ports to it. They are closed with a reset once the reply is
/// read: none is left in TIME_WAIT.
#[test]
fn tcp_queries_leave_no_upstream_connection_in_time_wait() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    const QUERIES: usize = 100;
    let s = setup(&[A1], None, &[])?;
    let script = format!(
        "for i in $(seq {QUERIES}); do dig +tcp +tries=1 +time=2 +short other-$i.example.com >/dev/null || exit 1; done"
    );
    s.topo
        .pod("team-a/a1")
        .cmd("sh")
        .args(["-c", &script])
        .ok()?;
    let time_wait = s
        .topo
        .node_cmd("ss")
        .args([
            "-tnH",
            "state",
            "time-wait",
            "dst",
            RESOLVER_IP.to_string().as_str(),
        ])
        .ok()?
        .stdout_str();
    let left = time_wait.lines().filter(|l| !l.trim().is_empty()).count();
    eprintln!("{QUERIES} TCP queries: {left} upstream connections left in TIME_WAIT");
    ensure!(
        left == 0,
        "{left} of {QUERIES} upstream connections in TIME_WAIT:\n{time_wait}"
    );
    s.agent.stop()
}

/// A pod with CAP_NET_RAW forges the source of its UDP DNS queries, a fresh address for each:
/// addresses no workload holds that come in on one interface (the pod's own link) share one share
/// of the forwards in flight, so the forger holds one share, not the node's whole budget, and
/// another pod's queries are still forwarded, not refused.
#[test]
fn forged_dns_sources_from_one_pod_take_one_share_not_the_nodes_budget() -> Result<()> {
    const FORGER: (&str, &str) = ("team-a/forger", "10.244.1.77");
    let topo = Topology::with_pods(&[FORGER, B1])?;
    // Nothing answers there: every forward stays in flight until its deadline.
    let agent = Agent::start(
        &topo,
        &[
            "--dns-upstream",
            "203.0.113.99:53",
            "--max-dns-forwards",
            "32",
            "--max-dns-forwards-per-client",
            "8",
        ],
    )?;
    struct Bare {
        agent: Agent,
        topo: Topology,
    }
    let s = Bare { agent, topo };
    let used = r#"redirect_budget_used{budget="dns_forwards"}"#;
    let forged = peer::cmd(s.topo.pod("team-a/forger").place())?
        .args([
            "dns-forge",
            &format!("{}:15053", integration::GATEWAY),
            "other.example.com",
            "--from",
            "10.244.200.1",
            "--count",
            "64",
        ])
        .ok()?;
    ensure!(
        forged.stdout_str().contains("sent 64"),
        "{}",
        forged.stdout_str()
    );
    let m = s
        .agent
        .wait_metrics("the forged queries taken in", Duration::from_secs(2), |m| {
            m.get_or_zero(used) > 0.0
        })?;
    let held = m.get_or_zero(used);
    eprintln!(
        "64 queries from forged sources: {held} forwards in flight; refused {} (share), {} (node)",
        m.get_or_zero(&refusals("dns_forwards", "client_share")),
        m.get_or_zero(&refusals("dns_forwards", "node_limit"))
    );
    ensure!(
        held <= 8.0,
        "the forger holds {held} forwards, more than one share: {m:#?}"
    );
    // Another pod's query is forwarded (it waits for the silent upstream), not refused at once.
    let before = s.agent.metrics()?;
    let _ = s
        .topo
        .pod("team-b/b1")
        .cmd("dig")
        .args([
            "+tries=1",
            "+time=1",
            "@169.254.7.1",
            "-p",
            "15053",
            "mine.example.com",
        ])
        .output()?;
    let after = s.agent.metrics()?;
    assert_eq!(
        integration::world::delta(&before, &after, &refusals("dns_forwards", "node_limit")),
        0.0,
        "{after:#?}"
    );
    s.agent.stop()
}

/// The ports tests' node: `pods`, the node's ephemeral range cut to 1,000 ports, the proxy deciding
/// every connection. Returns it with the ports toward one upstream address a client and the node may
/// hold, checked to be sized from that range (187 of 750).
fn with_a_thousand_ports(pods: &[(&str, &str)]) -> Result<(Setup, u64, u64)> {
    let topo = Topology::with_pods(pods)?;
    // The node's own netns (the test's): a small range, read by the agent at start.
    topo.node_cmd("sysctl")
        .args(["-q", "-w", "net.ipv4.ip_local_port_range=40000 40999"])
        .ok()?;
    let s = setup_on(topo, None, &[])?;
    let m = s.agent.metrics()?;
    let share = m.get_or_zero(&limit("upstream_ports", "client")) as u64;
    let node = m.get_or_zero(&limit("upstream_ports", "node")) as u64;
    ensure!(
        (share, node) == (187, 750),
        "sized from the range: {share} of {node}"
    );
    Ok((s, share, node))
}

/// Short connections from one pod to one endpoint, each closed by the pod first: the proxy closes
/// toward the endpoint first too, so each leaves a node port in TIME_WAIT toward that address. On a
/// node with 1,000 ephemeral ports, 2,000 of them in a row take one pod's share of the ports toward
/// the endpoint and are then refused (reset at once), while another pod still connects to the same
/// endpoint and gets DNS answers. Without the budget the range runs out and every pod's connections
/// there fail.
#[test]
fn one_pods_short_connections_leave_other_pods_ports_toward_the_same_endpoint() -> Result<()> {
    const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
    const CONNS: usize = 2_000;
    let (s, share, _) = with_a_thousand_ports(&[A1, B1])?;

    let churn = peer::cmd(s.topo.pod("team-a/a1").place())?
        .args(["churn", EXT_ECHO, "--conns", &CONNS.to_string()])
        .timeout(Duration::from_secs(300))
        .ok()?
        .stdout_str();
    let report = counts(&churn, "ok")?;
    let time_wait = s
        .topo
        .node_cmd("ss")
        .args(["-tnH", "state", "time-wait", "dst", EXT_ECHO])
        .ok()?
        .stdout_str()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();
    // The other pod, to the same endpoint and for a name, while those ports are still held.
    let started = Instant::now();
    let echo = peer::cmd(s.topo.pod("team-b/b1").place())?
        .args(["echo", EXT_ECHO, "--bytes", "1000"])
        .output()?;
    let connect_took = started.elapsed();
    let reply = dig::run(
        s.topo
            .pod("team-b/b1")
            .cmd("dig")
            .args(["+tries=1", "+time=2", NAME]),
    )?;
    eprintln!(
        "{CONNS} short connections from one pod: {report:?}, {time_wait} node ports in TIME_WAIT toward {EXT_ECHO}; the other pod's echo there {} in {connect_took:?}, its DNS {} in {:?}",
        if echo.success() { "worked" } else { "failed" },
        reply.status,
        reply.elapsed
    );
    ensure!(
        echo.success(),
        "the other pod's connection to the same endpoint failed: {}{}",
        echo.stdout_str(),
        echo.stderr_str()
    );
    ensure!(
        reply.status == "NOERROR" && !reply.answer.is_empty(),
        "{reply:#?}"
    );
    ensure!(
        report["ok"] >= share && report["reset"] > 0 && report["failed"] == 0,
        "the pod gets its share, then is reset at once: {report:?}"
    );
    let m = s.agent.metrics()?;
    ensure!(
        m.get_or_zero(&refusals("upstream_ports", "client_share")) as u64 == report["reset"],
        "each refusal counted: {m:#?}"
    );
    s.agent.stop()
}

/// Four pods, each making short connections to one endpoint until refused, take their shares of
/// the node's ports toward it (a quarter each) but not the floor kept for a newcomer: a fifth pod
/// then makes its three connections there, where before it found the node's limit reached.
#[test]
fn four_pods_at_their_share_leave_a_fifth_pod_ports_toward_the_same_endpoint() -> Result<()> {
    const HOGS: [(&str, &str); 4] = [
        ("team-a/a1", "10.244.1.10"),
        ("team-a/a2", "10.244.1.11"),
        ("team-a/a3", "10.244.1.12"),
        ("team-a/a4", "10.244.1.13"),
    ];
    let mut pods = HOGS.to_vec();
    pods.push(B1);
    let (s, share, node) = with_a_thousand_ports(&pods)?;

    // One after another: each leaves its ports in TIME_WAIT for a minute.
    let mut taken = Vec::new();
    for (pod, _) in HOGS {
        let churn = peer::cmd(s.topo.pod(pod).place())?
            .args(["churn", EXT_ECHO, "--conns", "250"])
            .timeout(Duration::from_secs(120))
            .ok()?
            .stdout_str();
        taken.push(counts(&churn, "ok")?["ok"]);
    }
    let mut fifth = Vec::new();
    for _ in 0..3 {
        let echo = peer::cmd(s.topo.pod("team-b/b1").place())?
            .args(["echo", EXT_ECHO, "--bytes", "1000"])
            .output()?;
        fifth.push(echo.success());
    }
    let m = s.agent.metrics()?;
    eprintln!(
        "four pods took {taken:?} of {node} ports; the fifth pod's connections: {fifth:?}; refused for the reserve {}",
        m.get_or_zero(&refusals("upstream_ports", "reserve"))
    );
    ensure!(
        taken[..3].iter().all(|&t| t == share),
        "each of the first three gets its share: {taken:?}"
    );
    ensure!(fifth.iter().all(|&ok| ok), "the fifth pod: {fifth:?}");
    ensure!(m.get_or_zero(&refusals("upstream_ports", "reserve")) > 0.0);
    s.agent.stop()
}

/// Four pods each holding idle connections through the proxy and idle DNS-over-TCP connections
/// until refused take their shares, a quarter of the node each, but not the floor kept for a
/// newcomer (a 64th of the node): a fifth pod then gets its echo and its `dig +tcp` answered and
/// holds its floor of each, where before it found the node's limit reached. Under a 4,096
/// open-files limit (240 DNS-over-TCP clients, 60 a pod, a floor of 3) and 256 connections (64 a
/// pod, a floor of 4).
#[test]
fn four_pods_at_their_share_leave_a_fifth_pod_its_floor_of_connections_and_tcp_dns() -> Result<()> {
    const HOGS: [(&str, &str); 4] = [
        ("team-a/a1", "10.244.1.10"),
        ("team-a/a2", "10.244.1.11"),
        ("team-a/a3", "10.244.1.12"),
        ("team-a/a4", "10.244.1.13"),
    ];
    const ASKED: u64 = 80;
    let mut pods = HOGS.to_vec();
    pods.push(B1);
    let s = setup(&pods, Some(4096), &["--max-connections", "256"])?;
    let m = s.agent.metrics()?;
    let sized = |budget: &str| -> [u64; 3] {
        ["node", "client", "floor"].map(|scope| m.get_or_zero(&limit(budget, scope)) as u64)
    };
    ensure!(sized("connections") == [256, 64, 4], "{m:#?}");
    ensure!(sized("dns_tcp_clients") == [240, 60, 3], "{m:#?}");

    // One pod after another, each holding what it got: (connections, DNS over TCP) open.
    let hold = |pod: &str, to: &str, conns: u64| -> Result<(Proc, BTreeMap<String, u64>)> {
        let mut held = peer::cmd(s.topo.pod(pod).place())?
            .args(["hold-idle", to, "--conns", &conns.to_string()])
            .spawn()?;
        held.wait_for_log("open=", Duration::from_secs(30))?;
        let c = counts(&held.log(), "open")?;
        ensure!(
            c["open"] + c["reset"] == conns && c["closed"] == 0,
            "{pod}: {c:?}"
        );
        Ok((held, c))
    };
    let mut holders = Vec::new();
    let mut hogs = Vec::new();
    for (pod, _) in HOGS {
        let (a, conns) = hold(pod, EXT_ECHO, ASKED)?;
        let (b, dns) = hold(pod, RESOLVER, ASKED)?;
        hogs.push((conns["open"], dns["open"]));
        holders.extend([a, b]);
    }
    let fifth = "team-b/b1";
    let echo = peer::cmd(s.topo.pod(fifth).place())?
        .args(["echo", EXT_ECHO, "--bytes", "1000"])
        .output()?;
    let reply = dig::run(
        s.topo
            .pod(fifth)
            .cmd("dig")
            .args(["+tcp", "+tries=1", "+time=2", NAME]),
    )?;
    let (a, conns) = hold(fifth, EXT_ECHO, 10)?;
    let (b, dns) = hold(fifth, RESOLVER, 10)?;
    holders.extend([a, b]);
    let m = s.agent.metrics()?;
    let refused = |budget: &str| {
        ["client_share", "reserve", "node_limit"]
            .map(|reason| m.get_or_zero(&refusals(budget, reason)) as u64)
    };
    eprintln!(
        "four pods held (connections, DNS over TCP) {hogs:?}; the fifth pod's echo {}, its dig +tcp {} in {:?}, then it held {} connections and {} DNS-over-TCP; refused (share, reserve, node): connections {:?}, DNS over TCP {:?}",
        if echo.success() { "worked" } else { "failed" },
        reply.status,
        reply.elapsed,
        conns["open"],
        dns["open"],
        refused("connections"),
        refused("dns_tcp_clients"),
    );
    ensure!(
        hogs == [(64, 60), (64, 60), (64, 60), (60, 57)],
        "three pods at their share, the fourth a floor short: {hogs:?}"
    );
    ensure!(echo.success(), "{}{}", echo.stdout_str(), echo.stderr_str());
    ensure!(
        reply.status == "NOERROR" && !reply.answer.is_empty(),
        "{reply:#?}"
    );
    ensure!(
        (conns["open"], dns["open"]) == (4, 3),
        "the fifth pod holds its floor of each: {conns:?} {dns:?}"
    );
    ensure!(refused("connections") == [3 * 16, 20, 6], "{m:#?}");
    ensure!(refused("dns_tcp_clients") == [3 * 20, 23, 7], "{m:#?}");
    for mut h in holders {
        h.close_stdin();
        h.wait(Duration::from_secs(10))?;
    }
    s.agent.stop()
}
