//! `--authz-only`: what a Pod under authorization policy costs its clients on the same node. One
//! node of the harness with two Pods: the client `bench/client` (laid out by "kubelet" with its
//! uid, so the agent knows its identity, `cluster.local/ns/bench/sa/default`) and the server
//! `bench-server/server` (`app: server`: sockperf and `rdt-peer`'s HTTP server, on CPU 1). Each
//! round takes four ways, in alternating order, an agent started afresh for each:
//!
//! - **no agent**: nothing attached; the node routes the client to the server;
//! - **no policy**: the agent with both Pods and no policy: the kernel connects the client to the
//!   server itself (the fast path's workload table), the proxy never sees it;
//! - **ALLOW**: the server's namespace admits the client's (`allow-client`): the fast path leaves
//!   the connection alone as for no policy, and the agent's `inbound` program, attached in the
//!   server Pod's network namespace, admits it at the server's socket lookup (the table compiled
//!   from the policies, by the client's address); no proxy;
//! - **DENY**: the server's namespace refuses the client's (`deny-client`): the same program
//!   answers the SYN with a reset, so the client's `connect()` fails at once with ECONNREFUSED.
//!
//! The first three run sockperf (ping-pong latency), wrk (`Connection: close`: new connections)
//! and `conn-timer` (one connection at a time: a blocking connect, one request, the answer to its
//! close); DENY runs `conn-timer` only, which times how long a refused connection takes the client
//! to fail and checks that every one was refused. Every run is checked against the agent's
//! counters: the fast path's decision (the kernel's `workload`, never handed to the proxy), the
//! proxy's outcomes (none: it carries nothing), and the kernel's authorization decisions by policy
//! (`path="kernel"`, which the agent reads from the kernel every 200 ms, so the check waits for
//! them). Ratios are the median of each round's ratio to the no-policy way; writes no files.
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use integration::procfs::Proto;
use integration::world::replace_file;
use integration::{Agent, Launch, Metrics, Proc, Topology};

use super::rounds::Settings;
use super::scene::{CLIENT_CPU, HTTP_PORT, SOCKPERF_PORT, start_server};
use super::stats::{Summary, paired_ratios};
use super::{sockperf, verify, wrk};

/// A Pod: key, address, `metadata.uid`, labels (a YAML flow map).
type PodDef = (&'static str, &'static str, &'static str, &'static str);

const CLIENT: PodDef = (
    "bench/client",
    "10.244.1.10",
    "0b1e7c2a-5d3f-4e6a-9b8c-be0cbe0cbe0c",
    "{app: client}",
);
const SERVER: PodDef = (
    "bench-server/server",
    "10.244.1.20",
    "5e5e5e5e-0000-4000-8000-00000000e5e1",
    "{app: server}",
);
const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
const ALLOW_POLICY: &str = "allow-client";
const DENY_POLICY: &str = "deny-client";

/// `conn-timer`'s source: standard library only, compiled with `rustc` at the start of the phase.
const TIMER_SOURCE: &str = include_str!("bin/conn-timer.rs");
/// How long one timed attempt's read may wait before it counts as timed out.
const TIMER_TIMEOUT_MS: u64 = 2000;
/// How long a run's check waits for the agent's counters to show it: the agent reads the kernel's
/// authorization counts every 200 ms.
const COUNTED_WITHIN: Duration = Duration::from_secs(3);

/// The ways from the client to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    NoAgent,
    NoPolicy,
    Allow,
    Deny,
}

impl Way {
    const ALL: [Way; 4] = [Way::NoAgent, Way::NoPolicy, Way::Allow, Way::Deny];

    /// How `conn-timer`'s attempts over this way should end.
    fn wanted(self) -> &'static str {
        if self == Way::Deny {
            "refused"
        } else {
            "answered"
        }
    }

    fn label(self) -> &'static str {
        match self {
            Way::NoAgent => "no agent",
            Way::NoPolicy => "no policy (the kernel connects)",
            Way::Allow => "ALLOW policy admits the client (the kernel)",
            Way::Deny => "DENY policy refuses the client (the kernel)",
        }
    }
}

/// One figure's runs, a slot per round for each way (a way that does not measure it keeps none).
#[derive(Default)]
struct Figure {
    runs: [Vec<Option<f64>>; 4],
}

impl Figure {
    fn file(&mut self, way: Way, value: Option<f64>) {
        self.runs[way as usize].push(value);
    }

    fn of(&self, way: Way) -> &[Option<f64>] {
        &self.runs[way as usize]
    }
}

/// Everything a run measures.
#[derive(Default)]
struct Figures {
    conn_rate: Figure,
    /// The agent's CPU under wrk, percent of one CPU.
    agent_cpu: Figure,
    p50: Figure,
    p99: Figure,
    /// `conn-timer`: connect() returned (connected, or failed: a refusal), p50 and p99, µs.
    connect_p50: Figure,
    connect_p99: Figure,
    /// `conn-timer`: the end the client saw (the answer read to its close, or the refusal), µs.
    done_p50: Figure,
    done_p99: Figure,
    /// `conn-timer` attempts, and those that ended as the way wants (answered; refused).
    attempts: u64,
    as_wanted: u64,
}

/// The node, its two Pods, the servers and the agent's config directories.
struct Node {
    _servers: Vec<Proc>,
    topo: Topology,
    timer: PathBuf,
}

/// Runs the rounds and prints the tables.
pub(crate) fn measure(peer: &Path, settings: Settings, timer_attempts: u32) -> Result<()> {
    let node = Node::build(peer).context("building the node")?;
    let mut figures = Figures::default();
    for round in 0..settings.rounds {
        let mut ways = Way::ALL;
        if round % 2 == 1 {
            ways.reverse();
        }
        for way in ways {
            println!(
                "xtask bench: round {}/{}: {}",
                round + 1,
                settings.rounds,
                way.label()
            );
            node.round(way, settings, timer_attempts, &mut figures)
                .with_context(|| format!("round {}, {}", round + 1, way.label()))?;
        }
    }
    println!("\n{}", tables(&figures));
    Ok(())
}

impl Node {
    fn build(peer: &Path) -> Result<Node> {
        let mut topo = Topology::new()?;
        for (key, ip, uid, _) in [CLIENT, SERVER] {
            topo.add_kube_pod(key, ip.parse()?, uid)?;
        }
        // wrk opens tens of thousands of connections: more ephemeral ports for the client and
        // for the proxy's upstream side (15000-15053 stay clear for the agent).
        for place in [topo.pod(CLIENT.0).place(), topo.node()] {
            place
                .cmd("sysctl")
                .args(["-q", "-w", "net.ipv4.ip_local_port_range=20000 65000"])
                .ok()?;
        }
        for (dir, policy) in [
            ("config-none", None),
            ("config-allow", Some(policy(ALLOW_POLICY, "ALLOW"))),
            ("config-deny", Some(policy(DENY_POLICY, "DENY"))),
        ] {
            let dir = topo.scratch_path(dir);
            std::fs::create_dir_all(&dir)?;
            replace_file(&dir, "cluster.yaml", &cluster())?;
            if let Some(policy) = policy {
                replace_file(&dir, "policy.yaml", &policy)?;
            }
        }
        let timer = compile_timer(&topo)?;
        let server = topo.pod(SERVER.0).place();
        let at = |port| SocketAddrV4::new(SERVER_IP, port);
        let http = vec![
            "serve".into(),
            "--name".into(),
            "server".into(),
            "--listen".into(),
            at(HTTP_PORT).to_string(),
        ];
        let servers = vec![
            start_server(
                server,
                "sockperf",
                sockperf::server_args(at(SOCKPERF_PORT)),
                Proto::Tcp,
                at(SOCKPERF_PORT),
            )?,
            start_server(
                server,
                &peer.to_string_lossy(),
                http,
                Proto::Tcp,
                at(HTTP_PORT),
            )?,
        ];
        Ok(Node {
            _servers: servers,
            topo,
            timer,
        })
    }

    /// The agent of `way` (none without one), as a node runs it.
    fn agent(&self, way: Way) -> Result<Option<Agent>> {
        let dir = match way {
            Way::NoAgent => return Ok(None),
            Way::NoPolicy => "config-none",
            Way::Allow => "config-allow",
            Way::Deny => "config-deny",
        };
        let config = self.topo.scratch_path(dir);
        let config = config.to_string_lossy();
        Agent::launch(
            &self.topo,
            &Launch::as_deployed(None),
            &["--config", &config],
        )
        .map(Some)
    }

    /// Each test of `way` once, each checked against the agent's counters.
    fn round(
        &self,
        way: Way,
        settings: Settings,
        timer_attempts: u32,
        figures: &mut Figures,
    ) -> Result<()> {
        let owned = self.agent(way)?;
        let agent = owned.as_ref();
        let secs = settings.secs;
        if way != Way::Deny {
            let args = sockperf::client_args(SocketAddrV4::new(SERVER_IP, SOCKPERF_PORT), secs);
            let latency = self
                .checked(way, agent, "sockperf", &args)?
                .and_then(|(out, _)| sockperf::parse(&out));
            report(way, "latency p50 (µs)", latency.as_ref().map(|p| p.p50));
            figures.p50.file(way, latency.as_ref().ok().map(|p| p.p50));
            figures.p99.file(way, latency.as_ref().ok().map(|p| p.p99));

            let url = format!("http://{SERVER_IP}:{HTTP_PORT}/");
            let cpu_before = agent.map(cpu_seconds).transpose()?;
            let started = Instant::now();
            let run = self.checked(
                way,
                agent,
                "wrk",
                &wrk::client_args(&url, settings.wrk_conns, secs),
            )?;
            let cpu = match (agent, cpu_before) {
                (Some(agent), Some(before)) => Some(
                    100.0 * (cpu_seconds(agent)? - before)
                        / started.elapsed().as_secs_f64().max(1e-3),
                ),
                _ => None,
            };
            let rate = run.and_then(|(out, opens)| {
                let rate = wrk::parse(&out)?;
                verify::new_connections(&rate, opens)?;
                Ok(rate.per_second)
            });
            report(way, "new connections (conn/s)", rate.as_ref().copied());
            figures.conn_rate.file(way, rate.ok());
            figures.agent_cpu.file(way, cpu);
        }
        if way == Way::Deny {
            let closed = self.close_time_wait()?;
            println!(
                "xtask bench:   the server held {closed} connections in TIME_WAIT from the runs before: closed"
            );
        }
        let timed = self.timer(way, agent, timer_attempts)?;
        report(
            way,
            "one connection, done p50 (µs)",
            timed.as_ref().map(|t| t.done_p50),
        );
        if let Ok(t) = &timed {
            println!(
                "xtask bench:   conn-timer: {} of {} attempts {}; connect() returned p50 {:.1} µs, p99 {:.1} µs; done p50 {:.1} µs, p99 {:.1} µs",
                t.as_wanted,
                t.attempts,
                way.wanted(),
                t.connect_p50,
                t.connect_p99,
                t.done_p50,
                t.done_p99
            );
            figures.attempts += t.attempts;
            figures.as_wanted += t.as_wanted;
        }
        let timed = timed.ok();
        figures
            .connect_p50
            .file(way, timed.as_ref().map(|t| t.connect_p50));
        figures
            .connect_p99
            .file(way, timed.as_ref().map(|t| t.connect_p99));
        figures
            .done_p50
            .file(way, timed.as_ref().map(|t| t.done_p50));
        figures
            .done_p99
            .file(way, timed.as_ref().map(|t| t.done_p99));
        if let Some(agent) = agent {
            let closed = decisions(&agent.metrics()?, &[r#"result="closed""#]);
            if closed > 0.0 {
                println!(
                    "xtask bench:   the agent closed {closed} open connections after a policy change"
                );
            }
        }
        if let Some(agent) = owned {
            agent.stop()?;
        }
        Ok(())
    }

    /// Runs `tool` in the client Pod; its stdout and the connections the Pod opened, once the
    /// agent's counters showed the run took `way`. A tool that failed is a failed run (Ok(Err));
    /// a run that took another way fails the bench.
    fn checked(
        &self,
        way: Way,
        agent: Option<&Agent>,
        tool: &str,
        args: &[String],
    ) -> Result<Result<(String, u64)>> {
        let before = agent.map(Agent::metrics).transpose()?;
        let opens_before = self.active_opens()?;
        let out = self.client(tool, args);
        let opens = self.active_opens()? - opens_before;
        if let (Some(agent), Some(before)) = (agent, &before) {
            // The kernel's decisions reach the counters at the agent's next read of them.
            let deadline = Instant::now() + COUNTED_WITHIN;
            loop {
                match check_way(way, before, &agent.metrics()?, opens) {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => {
                        return Err(e.context(format!("{tool} {}", args.join(" "))));
                    }
                }
            }
        }
        Ok(out.map(|out| (out, opens)))
    }

    /// `conn-timer` in the client Pod: `attempts` connections one at a time; fails the bench
    /// unless every one ended as `way` wants (answered, or refused under DENY) and the agent
    /// decided as many.
    fn timer(&self, way: Way, agent: Option<&Agent>, attempts: u32) -> Result<Result<TimerReport>> {
        let args = [
            SocketAddrV4::new(SERVER_IP, HTTP_PORT).to_string(),
            attempts.to_string(),
            TIMER_TIMEOUT_MS.to_string(),
        ];
        let timer = self.timer.to_string_lossy().into_owned();
        let run = self.checked(way, agent, &timer, &args)?;
        let report = run.and_then(|(out, _)| TimerReport::parse(&out, way));
        if let Ok(r) = &report {
            ensure!(
                r.as_wanted == r.attempts && r.attempts == u64::from(attempts),
                "conn-timer over {}: {} of {attempts} attempts ended as wanted:\n{}",
                way.label(),
                r.as_wanted,
                r.raw
            );
        }
        Ok(report)
    }

    /// Closes the server Pod's connections in TIME_WAIT (`ss -K`); how many it held. wrk's
    /// connections, which the server closes first, leave tens of thousands of them for 60 s, and
    /// a SYN whose ends match one finds it before the socket lookup the kernel decides at: it
    /// answers with the TIME_WAIT's ACK, the client resets that and sends its SYN again after the
    /// kernel's shortest retransmit timer (2 jiffies, ~12 ms here), and only that one is refused.
    /// DENY times a refusal from a server that holds none (a client that had no recent
    /// connection from the same port to the server).
    fn close_time_wait(&self) -> Result<usize> {
        let server = self.topo.pod(SERVER.0).place();
        let count = || -> Result<usize> {
            let out = server
                .cmd("ss")
                .args(["-H", "-t", "-n", "state", "time-wait"])
                .ok()?;
            Ok(out
                .stdout_str()
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count())
        };
        let held = count()?;
        if held > 0 {
            server
                .cmd("ss")
                .args(["-K", "-H", "-t", "-n", "state", "time-wait"])
                .ok()?;
            let left = count()?;
            ensure!(
                left == 0,
                "the server still holds {left} connections in TIME_WAIT after ss -K"
            );
        }
        Ok(held)
    }

    /// Runs a client tool in the client Pod, pinned to the client CPU; its stdout.
    fn client(&self, tool: &str, args: &[String]) -> Result<String> {
        let out = self
            .topo
            .pod(CLIENT.0)
            .cmd("taskset")
            .args(["-c", &CLIENT_CPU.to_string(), tool])
            .args(args)
            .timeout(Duration::from_secs(120))
            .output()?;
        if !out.success() {
            bail!("{tool}: {out}");
        }
        Ok(out.stdout_str())
    }

    /// TCP connections the client Pod opened so far (`Tcp: ActiveOpens` of its netns).
    fn active_opens(&self) -> Result<u64> {
        let out = self
            .topo
            .pod(CLIENT.0)
            .cmd("cat")
            .arg("/proc/net/snmp")
            .ok()?;
        super::scene::active_opens(&out.stdout_str())
    }
}

fn cpu_seconds(agent: &Agent) -> Result<f64> {
    super::machine::cpu_seconds(agent.pid())
}

/// Prints one figure of one run as the other phases do.
fn report(way: Way, what: &str, value: Result<f64, &anyhow::Error>) {
    match value {
        Ok(v) => println!("xtask bench:   {what:<28} {:<44} {v:>10.1}", way.label()),
        Err(e) => eprintln!(
            "xtask bench: run failed: {what} over {}: {e:#}",
            way.label()
        ),
    }
}

const DECISIONS: &str = "redirect_authorization_decisions_total";
const OUTBOUND: &str = "redirect_outbound_connections_total";
const PROXY_OUTCOMES: [&str; 6] = [
    "service",
    "workload",
    "passthrough",
    "no_healthy_upstream",
    "error",
    "denied",
];
const HANDED: &str = r#"redirect_fast_path_connections_total{outcome="proxy",reason="service"}"#;
const KERNEL_WORKLOAD: &str =
    r#"redirect_fast_path_connections_total{outcome="workload",reason=""}"#;

/// `redirect_authorization_decisions_total{path="kernel",result,policy}`: decided at the server
/// Pod's socket lookup.
fn decision(result: &str, policy: &str) -> String {
    format!(r#"{DECISIONS}{{path="kernel",result="{result}",policy="{policy}"}}"#)
}

fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}

/// Decisions counted whose labels hold every one of `labels` (`result="denied"`, ...), whatever
/// the others.
fn decisions(m: &Metrics, labels: &[&str]) -> f64 {
    m.samples()
        .iter()
        .filter(|(k, _)| k.starts_with(DECISIONS) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| v)
        .sum()
}

/// The agent's counters say the client Pod's `opens` connections took `way`. In every way with
/// an agent the fast path left each alone (the kernel's `workload`; none handed to the proxy) and
/// the proxy carried none (no outbound outcome moves, `denied` included); besides:
/// - no policy: nothing decided;
/// - ALLOW: each allowed in the kernel by `allow-client` (`path="kernel"`), none denied, none
///   decided by the proxy (`path="same_node"`);
/// - DENY: each denied in the kernel by `deny-client`, none allowed, none decided by the proxy.
fn check_way(way: Way, before: &Metrics, after: &Metrics, opens: u64) -> Result<()> {
    let ns = namespace(SERVER.0);
    let each = |counted: f64, what: &str| {
        ensure!(
            counted >= 1.0 && counted + 0.5 >= opens as f64 * 0.99,
            "over {}: the client Pod opened {opens} connections; {what}: {counted}",
            way.label()
        );
        Ok(())
    };
    let none = |key: &str| {
        let d = delta(before, after, key);
        ensure!(d == 0.0, "over {}: {key} moved by {d}", way.label());
        Ok(())
    };
    let no_decisions = |labels: &[&str]| {
        let d = decisions(after, labels) - decisions(before, labels);
        ensure!(
            d == 0.0,
            "over {}: {d} decisions {}",
            way.label(),
            labels.join(",")
        );
        Ok(())
    };
    if way == Way::NoAgent {
        bail!("no agent: nothing to check");
    }
    each(
        delta(before, after, KERNEL_WORKLOAD),
        "the fast path left to the kernel (workload)",
    )?;
    none(HANDED)?;
    for o in PROXY_OUTCOMES {
        none(&format!(r#"{OUTBOUND}{{outcome="{o}"}}"#))?;
    }
    no_decisions(&[r#"path="same_node""#])?;
    match way {
        Way::NoAgent => {}
        Way::NoPolicy => {
            no_decisions(&[r#"result="allowed""#])?;
            no_decisions(&[r#"result="denied""#])?;
        }
        Way::Allow => {
            let allowed = decision("allowed", &format!("{ns}/{ALLOW_POLICY}"));
            each(
                delta(before, after, &allowed),
                &format!("counted {allowed}"),
            )?;
            no_decisions(&[r#"result="denied""#])?;
        }
        Way::Deny => {
            let denied = decision("denied", &format!("{ns}/{DENY_POLICY}"));
            each(delta(before, after, &denied), &format!("counted {denied}"))?;
            no_decisions(&[r#"result="allowed""#])?;
        }
    }
    Ok(())
}

/// What `conn-timer` printed.
#[derive(Debug, Clone)]
struct TimerReport {
    attempts: u64,
    /// Answered (or, under DENY, refused).
    as_wanted: u64,
    connect_p50: f64,
    connect_p99: f64,
    done_p50: f64,
    done_p99: f64,
    raw: String,
}

impl TimerReport {
    fn parse(out: &str, way: Way) -> Result<TimerReport> {
        let value = |key: &str| -> Result<f64> {
            let v = out
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .with_context(|| format!("conn-timer printed no {key}:\n{out}"))?;
            v.trim()
                .parse()
                .with_context(|| format!("conn-timer {key} {v:?}"))
        };
        Ok(TimerReport {
            attempts: value("attempts")? as u64,
            as_wanted: value(way.wanted())? as u64,
            connect_p50: value("connect_p50_us")?,
            connect_p99: value("connect_p99_us")?,
            done_p50: value("done_p50_us")?,
            done_p99: value("done_p99_us")?,
            raw: out.to_string(),
        })
    }
}

/// Compiles `conn-timer` into the run's state directory with `rustc` (the toolchain that runs the
/// bench): its path.
fn compile_timer(topo: &Topology) -> Result<PathBuf> {
    let source = topo.scratch_path("conn-timer.rs");
    std::fs::write(&source, TIMER_SOURCE)?;
    let binary = topo.scratch_path("conn-timer");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    super::cmd::run(
        std::process::Command::new(rustc)
            .args(["--edition", "2021", "-C", "opt-level=3", "-o"])
            .arg(&binary)
            .arg(&source),
    )
    .context("compiling conn-timer")?;
    Ok(binary)
}

fn namespace(key: &str) -> &str {
    key.split_once('/').map_or(key, |(ns, _)| ns)
}

/// The agent's config: both Pods, with their uids and labels, dual-stack as the topology's Pods.
fn cluster() -> String {
    let pod = |(key, ip, uid, labels): PodDef| {
        let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
        let v6 = integration::pod_ip6(ip.parse().unwrap_or(Ipv4Addr::UNSPECIFIED));
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}, labels: {labels}}}\nspec: {{serviceAccountName: default}}\nstatus: {{podIP: {ip}, podIPs: [{{ip: {ip}}}, {{ip: \"{v6}\"}}]}}\n"
        )
    };
    format!("{}---\n{}", pod(CLIENT), pod(SERVER))
}

/// The server's namespace's policy `name`: `action` on the server (`app: server`) for connections
/// from the client's namespace.
fn policy(name: &str, action: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: {}}}\nspec:\n  selector: {{matchLabels: {{app: server}}}}\n  action: {action}\n  rules: [{{from: [{{source: {{namespaces: [{}]}}}}]}}]\n",
        namespace(SERVER.0),
        namespace(CLIENT.0)
    )
}

/// `median (min–max)` of a figure's runs over `way`.
fn cell(figure: &Figure, way: Way, digits: usize) -> String {
    let values: Vec<f64> = figure.of(way).iter().flatten().copied().collect();
    Summary::of(&values).map_or("failed".into(), |s| {
        format!(
            "{:.digits$} ({:.digits$}–{:.digits$})",
            s.median, s.min, s.max
        )
    })
}

/// The median (min–max) of the per-round ratios of `way` to no policy.
fn ratio(figure: &Figure, way: Way) -> String {
    if way == Way::NoPolicy {
        return "1".into();
    }
    Summary::of(&paired_ratios(figure.of(way), figure.of(Way::NoPolicy))).map_or("-".into(), |s| {
        format!("{:.2}× ({:.2}–{:.2})", s.median, s.min, s.max)
    })
}

/// The target for ALLOW's new connections, as a share of no policy's.
const ALLOW_CONN_RATE_TARGET: f64 = 0.95;
/// The target for a refused connection's time to fail, µs.
const REFUSED_WITHIN_US: f64 = 1000.0;

/// Two tables (the ways that answer, against no policy; one connection at a time over every
/// way), then the targets.
fn tables(f: &Figures) -> String {
    let mut out = String::from(
        "| path | new connections (conn/s) | ratio | agent CPU (%) | latency p50 (µs) | ratio | latency p99 (µs) | ratio |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for way in [Way::NoAgent, Way::NoPolicy, Way::Allow] {
        let cpu = if way == Way::NoAgent {
            "–".to_string()
        } else {
            cell(&f.agent_cpu, way, 1)
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {cpu} | {} | {} | {} | {} |",
            way.label(),
            cell(&f.conn_rate, way, 0),
            ratio(&f.conn_rate, way),
            cell(&f.p50, way, 1),
            ratio(&f.p50, way),
            cell(&f.p99, way, 1),
            ratio(&f.p99, way),
        );
    }
    let _ = write!(
        out,
        "\nOne connection at a time (conn-timer; {} of {} attempts over all ways ended as wanted: answered, refused under DENY):\n\n| path | ends | connect() returned p50 (µs) | p99 (µs) | done p50 (µs) | p99 (µs) |\n| --- | --- | ---: | ---: | ---: | ---: |\n",
        f.as_wanted, f.attempts,
    );
    for way in Way::ALL {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            way.label(),
            way.wanted(),
            cell(&f.connect_p50, way, 1),
            cell(&f.connect_p99, way, 1),
            cell(&f.done_p50, way, 1),
            cell(&f.done_p99, way, 1),
        );
    }
    let median = |figure: &Figure, way: Way| {
        let values: Vec<f64> = figure.of(way).iter().flatten().copied().collect();
        Summary::of(&values).map(|s| s.median)
    };
    let verdict = |met: Option<bool>| match met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "failed",
    };
    let allow_rate = Summary::of(&paired_ratios(
        f.conn_rate.of(Way::Allow),
        f.conn_rate.of(Way::NoPolicy),
    ))
    .map(|s| s.median);
    let refused = median(&f.done_p99, Way::Deny);
    let _ = write!(
        out,
        "\n| target | measured (median) | |\n| --- | --- | --- |\n| new connections ALLOW ≥ {ALLOW_CONN_RATE_TARGET}× no policy | {} | {} |\n| a refused connection fails < {REFUSED_WITHIN_US:.0} µs (p99) | {} µs | {} |\n",
        ratio(&f.conn_rate, Way::Allow),
        verdict(allow_rate.map(|r| r >= ALLOW_CONN_RATE_TARGET)),
        cell(&f.done_p99, Way::Deny, 1),
        verdict(refused.map(|us| us < REFUSED_WITHIN_US)),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How the agent's own decision (what `redirect explain --over same-node` says) goes for the
    /// client's connection to the server under `policy`, if any applies: allowed, the verdict and
    /// where it is decided.
    fn verdict(policy: Option<String>) -> Option<(bool, String, String)> {
        use redirect_userspace::model::{Snapshot, load_sources};
        use redirect_userspace::report::{Destination, Over, authorize, explain_ip};
        let cluster = cluster();
        let mut files = vec![("cluster.yaml", cluster.as_str())];
        files.extend(policy.as_deref().map(|p| ("policy.yaml", p)));
        let model = load_sources(files).unwrap_or_else(|e| panic!("{e}"));
        let snapshot = Snapshot::from_model(&model);
        let dst = Destination {
            ip: SERVER_IP.into(),
            port: Some(HTTP_PORT),
        };
        let mut e = explain_ip(&snapshot, namespace(CLIENT.0), dst);
        authorize(&snapshot, &mut e, dst, Over::SameNode);
        let report = e.outbound.authorization?;
        (!report.policies.is_empty()).then_some((report.allowed, report.verdict, report.decided_in))
    }

    #[test]
    fn the_allow_policy_admits_the_client_and_the_deny_policy_refuses_it_in_the_kernel() {
        assert_eq!(verdict(None), None);
        assert_eq!(
            verdict(Some(policy(ALLOW_POLICY, "ALLOW"))),
            Some((
                true,
                "allowed by: bench-server/allow-client".into(),
                "kernel".into()
            ))
        );
        assert_eq!(
            verdict(Some(policy(DENY_POLICY, "DENY"))),
            Some((
                false,
                "explicitly denied by: bench-server/deny-client".into(),
                "kernel".into()
            ))
        );
    }

    fn counters(pairs: &[(&str, u32)]) -> Metrics {
        let text: String = pairs.iter().map(|(k, v)| format!("{k} {v}\n")).collect();
        Metrics::parse(&text).unwrap()
    }

    #[test]
    fn each_way_is_held_to_its_counters() {
        let before = counters(&[]);
        let kernel = counters(&[(KERNEL_WORKLOAD, 100)]);
        assert!(check_way(Way::NoPolicy, &before, &kernel, 100).is_ok());
        let allowed = decision("allowed", "bench-server/allow-client");
        let decided = counters(&[(KERNEL_WORKLOAD, 100), (&allowed, 1)]);
        assert!(check_way(Way::NoPolicy, &before, &decided, 100).is_err());

        let allow = counters(&[(KERNEL_WORKLOAD, 100), (&allowed, 100)]);
        assert!(check_way(Way::Allow, &before, &allow, 100).is_ok());
        assert!(
            check_way(Way::Allow, &before, &kernel, 100).is_err(),
            "not decided"
        );
        let half = counters(&[(KERNEL_WORKLOAD, 100), (&allowed, 50)]);
        assert!(check_way(Way::Allow, &before, &half, 100).is_err());
        // As before the kernel decided: handed to the proxy, which carried and decided them.
        let workload = r#"redirect_outbound_connections_total{outcome="workload"}"#;
        let by_proxy = r#"redirect_authorization_decisions_total{path="same_node",result="allowed",policy="bench-server/allow-client"}"#;
        let proxied = counters(&[(HANDED, 100), (workload, 100), (by_proxy, 100)]);
        assert!(check_way(Way::Allow, &before, &proxied, 100).is_err());
        let carried = counters(&[(KERNEL_WORKLOAD, 100), (&allowed, 100), (workload, 1)]);
        assert!(check_way(Way::Allow, &before, &carried, 100).is_err());

        let denied = decision("denied", "bench-server/deny-client");
        let deny = counters(&[(KERNEL_WORKLOAD, 10), (&denied, 10)]);
        assert!(check_way(Way::Deny, &before, &deny, 10).is_ok());
        assert!(check_way(Way::Allow, &before, &deny, 10).is_err());
        let refused = r#"redirect_outbound_connections_total{outcome="denied"}"#;
        let by_proxy = counters(&[(HANDED, 10), (refused, 10), (&denied, 10)]);
        assert!(check_way(Way::Deny, &before, &by_proxy, 10).is_err());
    }

    #[test]
    fn reads_the_timer_and_tabulates() {
        let out = "attempts 3\nanswered 0\nrefused 3\nclosed 0\nfailed 0\ntimed_out 0\nconnect_p50_us 20.5\nconnect_p99_us 40.0\nconnect_max_us 41.0\ndone_p50_us 20.5\ndone_p99_us 40.0\ndone_max_us 41.0\n";
        let r = TimerReport::parse(out, Way::Deny).unwrap();
        assert_eq!((r.attempts, r.as_wanted), (3, 3));
        assert_eq!((r.connect_p50, r.done_p99), (20.5, 40.0));
        assert_eq!(TimerReport::parse(out, Way::Allow).unwrap().as_wanted, 0);
        let mut f = Figures::default();
        for (none, allow) in [(10_000.0, 9_000.0), (12_000.0, 12_000.0)] {
            f.conn_rate.file(Way::NoPolicy, Some(none));
            f.conn_rate.file(Way::Allow, Some(allow));
        }
        f.done_p99.file(Way::Deny, Some(r.done_p99));
        let t = tables(&f);
        assert!(
            t.contains("| 10500 (9000–12000) | 0.95× (0.90–1.00) |"),
            "{t}"
        );
        assert!(
            t.contains("| new connections ALLOW ≥ 0.95× no policy | 0.95× (0.90–1.00) | met |"),
            "{t}"
        );
        assert!(
            t.contains(
                "| a refused connection fails < 1000 µs (p99) | 40.0 (40.0–40.0) µs | met |"
            ),
            "{t}"
        );
    }
}
