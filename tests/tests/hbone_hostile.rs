//! The receiving side of HBONE (port 15008) against a hostile peer: one holding a valid workload
//! certificate of the trust domain, so it passes the handshake, that then floods, resets or idles
//! (`rdt-peer hostile`). Two nodes as in `between_nodes.rs`; the peer runs in node a's netns and
//! attacks b1 through node b's agent, whose memory and descriptors are read from /proc.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::fixtures::curl_body;
use integration::pki::TestCa;
use integration::two_nodes::{self, A1, B1, DAY, TRUST_DOMAIN};
use integration::world::replace_file;
use integration::{Agent, Peer, Proc, Topology, pace, peer, procfs};

const WEB: u16 = 8080;
/// b1's port that sends pattern bytes and never reads.
const SOURCE: u16 = 9000;
/// b1's port whose SYNs its netns drops.
const DROPPED: u16 = 9100;

/// Connections one peer address may hold (`proxy/inbound/limits.rs`).
const CONNECTIONS_PER_PEER: usize = 16;
/// Streams in flight on one connection (`proxy/inbound/server.rs`).
const STREAMS_PER_CONNECTION: usize = 200;
/// What one connection may make the agent hold, by construction: its receive window (16 MiB), one
/// frame of 128 KiB per stream handed on to a Pod that does not read (200: 25 MiB), and what its
/// Pods sent that the peer does not read (16 MiB): 57 MiB, and room for the rest (TLS, tasks).
const RSS_PER_CONNECTION_MIB: u64 = 64;
/// What the agent may keep of its memory beyond what it began with once a flood is over: what the
/// streams held is freed and handed back to the system (`proxy/inbound/trim.rs`).
const RSS_AFTER_MIB: u64 = 64;
/// Descriptors the agent may hold beyond those it began with once a peer is done.
const FD_SLACK: u64 = 100;

fn inbound(result: &str) -> String {
    format!(r#"redirect_hbone_inbound_total{{result="{result}"}}"#)
}

/// Fields drop in order: agents and servers before their topologies.
struct Nodes {
    agent_b: Agent,
    _agent_a: Option<Agent>,
    _servers: Vec<Peer>,
    ca: TestCa,
    a: Topology,
    b: Topology,
}

/// Node a with a1, node b with b1 (HTTP on 8080, a source on 9000), linked; node b's agent with
/// HBONE between nodes (its open-files limit `nofile` if given), node a's only if `agent_a`.
fn nodes(nofile: Option<u64>, agent_a: bool) -> Result<Nodes> {
    let a = Topology::with_pods(&[A1])?;
    let b = Topology::with_pods(&[B1])?;
    Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let addr = |ip: &str, port: u16| -> Result<SocketAddr> { Ok(format!("{ip}:{port}").parse()?) };
    let servers = vec![
        Peer::start(b.pod(B1.0).place(), "web-b1", &[addr(B1.1, WEB)?], &[])?,
        Peer::start(a.pod(A1.0).place(), "web-a1", &[addr(A1.1, WEB)?], &[])?,
        Peer::start_streams(
            b.pod(B1.0).place(),
            "source-b1",
            format!("{}:{SOURCE}", B1.1).parse()?,
            format!("{}:{}", B1.1, SOURCE + 1).parse()?,
        )?,
    ];
    let args = |topo: &Topology, node: &str| -> Result<Vec<String>> {
        let identities = topo.scratch_path("identities");
        let accounts = [("team-a", "default"), ("team-b", "default")];
        ca.write_identity_dir(&identities, &accounts, DAY)?;
        let config = topo.scratch_path("config");
        std::fs::create_dir_all(&config)?;
        replace_file(&config, "cluster.yaml", &two_nodes::pods())?;
        Ok([
            "--config",
            &config.to_string_lossy(),
            "--identity-dir",
            &identities.to_string_lossy(),
            "--node-name",
            node,
            "--hbone-between-nodes",
        ]
        .map(String::from)
        .to_vec())
    };
    let args_b = args(&b, "node-b")?;
    let args_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let agent_b = match nofile {
        Some(n) => Agent::start_with_fd_limit(&b, n, &args_b)?,
        None => Agent::start(&b, &args_b)?,
    };
    let agent_a = if agent_a {
        let args_a = args(&a, "node-a")?;
        Some(Agent::start(
            &a,
            &args_a.iter().map(String::as_str).collect::<Vec<_>>(),
        )?)
    } else {
        None
    };
    Ok(Nodes {
        agent_b,
        _agent_a: agent_a,
        _servers: servers,
        ca,
        a,
        b,
    })
}

impl Nodes {
    /// `rdt-peer hostile --mode MODE` from node a's netns against b1's HBONE port, presenting a
    /// workload certificate of the mesh (`hostile/default`), CONNECTing to b1's `port`.
    fn hostile(&self, mode: &str, port: u16, extra: &[String]) -> Result<integration::Cmd> {
        let files = self.a.scratch_path(&format!("hostile-{mode}"));
        let tls = self
            .ca
            .write_server_files(&files, "hostile", "default", DAY)?;
        // `--cert FILE --key FILE`; the peer checks no server certificate.
        Ok(peer::cmd(self.a.node())?
            .args(["hostile", "--mode", mode])
            .args(["--connect", &format!("{}:15008", B1.1)])
            .args(&tls[..4])
            .args(["--authority", &format!("{}:{port}", B1.1)])
            .args(extra))
    }

    fn ready(&self) -> Result<u16> {
        Ok(self.agent_b.admin_get("/healthz/ready")?.status)
    }
}

/// `key=N` out of a line such as `ready conns=16 refused=4`.
fn field(line: &str, key: &str) -> Result<u64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .with_context(|| format!("no {key} in {line:?}"))?
        .parse()
        .with_context(|| format!("{key} in {line:?}"))
}

/// Waits for the hostile peer's `prefix` line and returns it.
fn line_of(proc: &mut Proc, prefix: &str, within: Duration) -> Result<String> {
    proc.wait_for_log(prefix, within)?;
    let log = proc.log();
    log.lines()
        .find(|l| l.starts_with(prefix))
        .map(str::to_string)
        .with_context(|| format!("no {prefix:?} line in:\n{log}"))
}

/// Samples `read` every `every` until stopped; the largest value seen.
struct Peak {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<u64>,
}

impl Peak {
    fn watch(every: Duration, read: impl Fn() -> Option<u64> + Send + 'static) -> Peak {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !stopped.load(Ordering::Acquire) {
                peak = peak.max(read().unwrap_or(0));
                std::thread::sleep(every);
            }
            peak
        });
        Peak { stop, thread }
    }

    fn end(self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or(0)
    }
}

/// Sockets of the agent's netns in SYN-SENT toward `port` (`/proc/PID/net/tcp`, state 02).
fn syn_sent(pid: u32, port: u16) -> Option<u64> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    let remote = format!(":{port:04X}");
    let count = table
        .lines()
        .skip(1)
        .filter(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(2).is_some_and(|r| r.ends_with(&remote)) && cols.get(3) == Some(&"02")
        })
        .count();
    Some(count as u64)
}

/// Polls `read` until `done` holds or `within` passes; the last value read.
fn settle(
    within: Duration,
    read: impl Fn() -> Result<u64>,
    done: impl Fn(u64) -> bool,
) -> Result<u64> {
    let deadline = Instant::now() + pace::scaled(within);
    loop {
        let value = read()?;
        if done(value) || Instant::now() > deadline {
            return Ok(value);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A peer floods node b's agent: 20 connections, the largest windows, 200 CONNECTs each to a Pod
/// that sends and never reads, sending into every stream, then it stops reading. Past 16 its
/// connections are refused (`peer_limit`); the agent's memory grows by at most
/// [`RSS_PER_CONNECTION_MIB`] a connection held, and falls back to within [`RSS_AFTER_MIB`] of where
/// it began once the peer leaves.
#[test]
fn a_peer_that_floods_and_never_reads_holds_a_bounded_part_of_the_agents_memory() -> Result<()> {
    const CONNS: usize = 20;
    let n = nodes(None, false)?;
    let pid = n.agent_b.pid();
    let before = n.agent_b.rss_kib()? / 1024;
    let fds_before = n.agent_b.fd_count()? as u64;
    let peak = Peak::watch(Duration::from_millis(100), move || {
        procfs::rss_kib(pid).ok().map(|k| k / 1024)
    });
    let mut flood = n
        .hostile(
            "flood",
            SOURCE,
            &["--conns", "20", "--streams", "200", "--push-ms", "3000"].map(String::from),
        )?
        .spawn()?;
    let ready = line_of(&mut flood, "ready", Duration::from_secs(60))?;
    // What the Pods send piles up once the peer stopped reading: give it time to.
    std::thread::sleep(Duration::from_secs(3));
    let held = n.agent_b.rss_kib()? / 1024;
    let fds_held = n.agent_b.fd_count()? as u64;
    flood.write_stdin(b"leave\n")?;
    let _ = flood.wait(pace::scaled(Duration::from_secs(10)));
    let peak = peak.end().max(held);
    // Every stream ends with its connection, whatever its Pod does: its socket goes at once.
    let fds_after = settle(
        Duration::from_secs(5),
        || Ok(n.agent_b.fd_count()? as u64),
        |fds| fds <= fds_before + FD_SLACK,
    )?;
    // The agent hands the freed heap back to the system a moment after received HBONE fell.
    let left_at = Instant::now();
    let after = settle(
        Duration::from_secs(15),
        || Ok(n.agent_b.rss_kib()? / 1024),
        |rss| rss <= before + RSS_AFTER_MIB,
    )?;
    let fell_ms = left_at.elapsed().as_millis();
    let trims: Vec<String> = n
        .agent_b
        .log()
        .lines()
        .filter(|l| l.contains("freed heap handed back"))
        .map(str::to_string)
        .collect();
    eprintln!(
        "flood: {ready}; agent RSS MiB before={before} peak={peak} held={held} after={after} \
         (in {fell_ms} ms); fds before={fds_before} held={fds_held} after={fds_after}; trims: {trims:#?}"
    );

    let conns = field(&ready, "conns")? as usize;
    ensure!(
        conns == CONNECTIONS_PER_PEER && field(&ready, "refused")? as usize == CONNS - conns,
        "one peer address holds {CONNECTIONS_PER_PEER} connections: {ready}"
    );
    let streams = (conns * STREAMS_PER_CONNECTION) as u64;
    ensure!(
        field(&ready, "ok")? == streams,
        "every stream reached the Pod: {ready}"
    );
    let metrics = n.agent_b.metrics()?;
    ensure!(
        metrics.get_or_zero(&inbound("peer_limit")) >= (CONNS - conns) as f64,
        "the refusals are counted: {:#?}",
        metrics.samples()
    );
    let bound = RSS_PER_CONNECTION_MIB * conns as u64;
    ensure!(
        peak - before <= bound,
        "the agent grew by {} MiB (before {before}, peak {peak}), over {bound} MiB",
        peak - before
    );
    ensure!(
        fds_after <= fds_before + FD_SLACK,
        "the agent kept {fds_after} descriptors after the peer left (before {fds_before}, held {fds_held})"
    );
    ensure!(
        after <= before + RSS_AFTER_MIB,
        "the agent kept {after} MiB after the peer left (before {before}, peak {peak}): \
         more than {RSS_AFTER_MIB} MiB over"
    );
    Ok(())
}

/// 8,000 CONNECTs in rounds of 200 to a port of b1 whose SYNs are dropped, each round reset 50 ms
/// after it was sent: each reset gives up the agent's dial and its socket, so its descriptors end
/// where they began and its SYN-SENT sockets never exceed one connection's streams.
#[test]
fn streams_reset_while_the_pod_is_dialled_leave_no_socket_behind() -> Result<()> {
    const ROUNDS: usize = 40;
    let n = nodes(None, false)?;
    n.b.pod(B1.0)
        .place()
        .cmd("iptables")
        .args([
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "--dport",
            &DROPPED.to_string(),
            "-j",
            "DROP",
        ])
        .ok()?;
    let pid = n.agent_b.pid();
    let fds_before = n.agent_b.fd_count()? as u64;
    let fds = Peak::watch(Duration::from_millis(20), move || {
        procfs::fd_count(pid).ok().map(|n| n as u64)
    });
    let pending = Peak::watch(Duration::from_millis(20), move || syn_sent(pid, DROPPED));
    let rounds = ROUNDS.to_string();
    let out = n
        .hostile(
            "reset",
            DROPPED,
            &["--rounds", &rounds, "--streams", "200", "--reset-ms", "50"].map(String::from),
        )?
        .timeout(pace::scaled(Duration::from_secs(60)))
        .output()?;
    let done = out
        .stdout_str()
        .lines()
        .find(|l| l.starts_with("done"))
        .map(str::to_string)
        .with_context(|| format!("no summary: {}{}", out.stdout_str(), out.stderr_str()))?;
    let fds_after = settle(
        Duration::from_secs(5),
        || Ok(n.agent_b.fd_count()? as u64),
        |fds| fds <= fds_before + FD_SLACK,
    )?;
    let (fds_peak, pending_peak) = (fds.end(), pending.end());
    let pending_after = syn_sent(pid, DROPPED).unwrap_or(u64::MAX);
    let metrics = n.agent_b.metrics()?;
    let (resets, limited) = (
        metrics.get_or_zero(&inbound("reset")),
        metrics.get_or_zero(&inbound("stream_limit")),
    );
    eprintln!(
        "resets: {done}; agent fds before={fds_before} peak={fds_peak} after={fds_after}; \
         SYN-SENT peak={pending_peak} after={pending_after}; counted reset={resets} stream_limit={limited}"
    );

    let sent = field(&done, "sent")?;
    ensure!(sent == (ROUNDS * STREAMS_PER_CONNECTION) as u64, "{done}");
    ensure!(
        field(&done, "answered")? == 0,
        "no stream reached the Pod: {done}"
    );
    ensure!(
        fds_after <= fds_before + FD_SLACK,
        "the agent ended with {fds_after} descriptors, began with {fds_before} (peak {fds_peak})"
    );
    ensure!(
        pending_peak <= STREAMS_PER_CONNECTION as u64 && pending_after == 0,
        "SYN-SENT sockets toward the dropped port: peak {pending_peak}, after {pending_after}"
    );
    ensure!(
        resets >= (sent / 2) as f64
            && resets + limited >= (sent - field(&done, "other")?) as f64 * 0.9,
        "the resets and refusals are counted: reset={resets} stream_limit={limited}, {done}"
    );
    Ok(())
}

/// Node b's agent under an open-files limit of 1,024 and 800 idle TLS+HTTP/2 connections that
/// answer pings: from one address, all but 16 are refused (`peer_limit`); from 50 addresses,
/// received HBONE stops at its share of descriptors (`connection_limit`). Either way the agent
/// stays ready, below its limit, and serves the Pods.
#[test]
fn idle_connections_stop_at_their_share_and_the_agent_serves_on() -> Result<()> {
    const NOFILE: u64 = 1024;
    const CONNS: &str = "800";
    let n = nodes(Some(NOFILE), true)?;
    let fds_before = n.agent_b.fd_count()?;
    let b1_web = format!("http://{}:{WEB}/", B1.1);
    let a1_web = format!("http://{}:{WEB}/", A1.1);

    let mut one = n
        .hostile("idle", WEB, &["--conns", CONNS].map(String::from))?
        .spawn()?;
    let ready_one = line_of(&mut one, "ready", Duration::from_secs(60))?;
    let fds_one = n.agent_b.fd_count()?;
    let (health_one, a1_to_b1) = (n.ready()?, curl_body(n.a.pod(A1.0), &b1_web));
    let metrics = n.agent_b.metrics()?;
    let peer_limit = metrics.get_or_zero(&inbound("peer_limit"));

    // 50 more source addresses on node a, routed from node b.
    let mut from = Vec::new();
    for i in 1..=50 {
        let ip = format!("100.64.1.{i}");
        n.a.node_cmd("ip")
            .args(["addr", "add", &format!("{ip}/32"), "dev", "lo"])
            .ok()?;
        from.extend(["--from".to_string(), ip]);
    }
    n.b.node_cmd("ip")
        .args(["route", "add", "100.64.1.0/24", "via", "100.64.0.1"])
        .ok()?;
    let mut args = vec!["--conns".to_string(), CONNS.to_string()];
    args.extend(from);
    let mut many = n.hostile("idle", WEB, &args)?.spawn()?;
    let ready_many = line_of(&mut many, "ready", Duration::from_secs(60))?;
    let fds_many = n.agent_b.fd_count()?;
    let health_many = n.ready()?;
    let b1_to_a1 = curl_body(n.b.pod(B1.0), &a1_web);
    let a1_to_b1_many = curl_body(n.a.pod(A1.0), &b1_web);
    let metrics = n.agent_b.metrics()?;
    let connection_limit = metrics.get_or_zero(&inbound("connection_limit"));
    for p in [&mut one, &mut many] {
        p.write_stdin(b"leave\n")?;
    }
    let done_one = line_of(&mut one, "done", Duration::from_secs(10))?;
    let done_many = line_of(&mut many, "done", Duration::from_secs(10))?;
    eprintln!(
        "idle: agent fds before={fds_before} one-address={fds_one} many={fds_many}; \
         {ready_one} / {done_one}; {ready_many} / {done_many}; peer_limit={peer_limit} \
         connection_limit={connection_limit}; a1->b1 {a1_to_b1:?} then {a1_to_b1_many:?}; b1->a1 {b1_to_a1:?}"
    );

    let held_one = field(&ready_one, "conns")?;
    ensure!(
        held_one == CONNECTIONS_PER_PEER as u64 && field(&ready_one, "refused")? == 800 - held_one,
        "one address holds {CONNECTIONS_PER_PEER}: {ready_one}"
    );
    ensure!(
        peer_limit >= (800 - held_one) as f64,
        "peer_limit counted {peer_limit}"
    );
    ensure!(
        health_one == 200 && health_many == 200,
        "ready: {health_one}, then {health_many}"
    );
    ensure!(
        a1_to_b1.as_deref().ok() == Some("web-b1"),
        "a1 -> b1 beside one address: {a1_to_b1:?}"
    );
    ensure!(
        b1_to_a1.as_deref().ok() == Some("web-a1"),
        "b1 -> a1 beside 50 addresses: {b1_to_a1:?}"
    );
    let held_many = field(&ready_many, "conns")?;
    ensure!(
        held_many < 800 && field(&ready_many, "refused")? == 800 - held_many,
        "received HBONE stops at its share: {ready_many}"
    );
    ensure!(
        connection_limit >= 1.0,
        "connection_limit counted {connection_limit}"
    );
    // A quarter of the descriptor budget for received HBONE: the agent stays far below its limit.
    ensure!(
        (fds_many as u64) < NOFILE * 3 / 4,
        "the agent holds {fds_many} descriptors of {NOFILE}"
    );
    ensure!(
        field(&done_one, "alive")? == held_one && field(&done_many, "alive")? == held_many,
        "the connections held stayed open (pings answered): {done_one}, {done_many}"
    );
    Ok(())
}
