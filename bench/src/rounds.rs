//! The measuring loop. Each round runs every test over every path back to back (agent detached, agent
//! with splice, agent with copy, agent with its fast path, the same with the config at size,
//! restarting the agent in between), so the runs a ratio compares are seconds apart; odd rounds take
//! the paths in reverse order, so slow drift on a shared machine lands on every path alike. Every run
//! through the agent is checked against its counters: a run that took another path than the one it
//! is filed under fails the bench.
use std::collections::BTreeSet;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use integration::RESOLVER_IP;

use super::model::{Metric, Results, Route};
use super::scene::{self, AtSizeConfig, Relay, Scene};
use super::{dnsperf, iperf, sockperf, verify, wrk};
use integration::Agent;

/// How long and how often.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    pub rounds: usize,
    /// Length of each tool run, seconds.
    pub secs: u32,
    /// Concurrent connections wrk keeps opening.
    pub wrk_conns: u32,
}

/// Whether and how the agent runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Detached,
    Agent(Relay),
    /// The agent as it runs by default (the fast path) with the config at size.
    AtSize,
}

/// Which paths a round takes besides the direct one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Paths {
    /// Every one.
    All,
    /// Only the fast path at size (`--at-size-only`): TCP tests only.
    AtSizeOnly,
    /// Only the fast path with audit on and off (`--audit-only`): TCP tests only.
    AuditOnly,
    /// Only the fast path with the kernel's connection records on (the default) and off
    /// (`--records-only`): TCP tests only.
    RecordsOnly,
    /// Only the fast path's service and the same server through a waypoint (`--waypoint-only`),
    /// one agent: TCP tests only.
    WaypointOnly,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    Tcp(Tcp),
    Dns,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tcp {
    Throughput(u32),
    Latency,
    ConnRate,
}

/// The tests `--only` can pick, in the order a round runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Pick {
    Throughput1,
    Throughput8,
    Latency,
    ConnRate,
    Dns,
}

impl Pick {
    pub(crate) const ALL: [Pick; 5] = [
        Pick::Throughput1,
        Pick::Throughput8,
        Pick::Latency,
        Pick::ConnRate,
        Pick::Dns,
    ];

    fn test(self) -> Test {
        match self {
            Pick::Throughput1 => Test::Tcp(Tcp::Throughput(1)),
            Pick::Throughput8 => Test::Tcp(Tcp::Throughput(8)),
            Pick::Latency => Test::Tcp(Tcp::Latency),
            Pick::ConnRate => Test::Tcp(Tcp::ConnRate),
            Pick::Dns => Test::Dns,
        }
    }
}

pub(crate) struct Runner<'a> {
    scene: &'a Scene,
    settings: Settings,
    tests: Vec<Test>,
    paths: Paths,
    at_size: &'a AtSizeConfig,
    pub results: Results,
    /// Every distinct command line run, for the report.
    pub commands: BTreeSet<String>,
    answered_queries: PathBuf,
    forwarded_queries: PathBuf,
    cached_queries: PathBuf,
}

impl<'a> Runner<'a> {
    /// Runs the `picked` tests (in round order) each round over `paths`; the agent at size reads
    /// `at_size`.
    pub(crate) fn new(
        scene: &'a Scene,
        settings: Settings,
        picked: &[Pick],
        paths: Paths,
        at_size: &'a AtSizeConfig,
    ) -> Result<Runner<'a>> {
        Ok(Runner {
            tests: Pick::ALL
                .into_iter()
                .filter(|p| picked.contains(p))
                .map(Pick::test)
                .collect(),
            paths,
            at_size,
            answered_queries: scene
                .scratch_file("answered.queries", &format!("{} A\n", scene::ANSWERED_NAME))?,
            forwarded_queries: scene.scratch_file(
                "forwarded.queries",
                &format!("{} A\n", scene::FORWARDED_NAME),
            )?,
            cached_queries: scene
                .scratch_file("cached.queries", &format!("{} A\n", scene::CACHED_NAME))?,
            scene,
            settings,
            results: Results::new(settings.rounds),
            commands: BTreeSet::new(),
        })
    }

    pub(crate) fn run(&mut self) -> Result<()> {
        for round in 0..self.settings.rounds {
            println!("xtask bench: round {}/{}", round + 1, self.settings.rounds);
            for test in self.tests.clone() {
                let mut phases = vec![Phase::Detached];
                if self.paths == Paths::All {
                    phases.push(Phase::Agent(Relay::Splice));
                    if matches!(test, Test::Tcp(_)) {
                        phases.push(Phase::Agent(Relay::FastPath));
                    }
                    // The relay's before/after: throughput (zero-copy) and latency (small messages).
                    if matches!(test, Test::Tcp(Tcp::Throughput(_) | Tcp::Latency)) {
                        phases.push(Phase::Agent(Relay::Copy));
                    }
                }
                if matches!(test, Test::Tcp(_)) {
                    phases.extend(match self.paths {
                        Paths::All | Paths::AtSizeOnly => vec![Phase::AtSize],
                        Paths::AuditOnly => vec![
                            Phase::Agent(Relay::FastPath),
                            Phase::Agent(Relay::FastPathAudit),
                        ],
                        Paths::RecordsOnly => vec![
                            Phase::Agent(Relay::FastPath),
                            Phase::Agent(Relay::FastPathNoRecords),
                        ],
                        Paths::WaypointOnly => vec![Phase::Agent(Relay::FastPathWaypoint)],
                    });
                }
                if round % 2 == 1 {
                    phases.reverse();
                }
                for phase in phases {
                    self.step(round, test, phase)
                        .with_context(|| format!("round {}, {test:?} with {phase:?}", round + 1))?;
                }
            }
        }
        Ok(())
    }

    fn step(&mut self, round: usize, test: Test, phase: Phase) -> Result<()> {
        let relay = match phase {
            Phase::Detached => {
                return match test {
                    Test::Dns => self.dns(round, Route::DnsUpstream, None),
                    Test::Tcp(tcp) => self.tcp(round, tcp, Route::Direct, None),
                };
            }
            Phase::AtSize => {
                let Test::Tcp(tcp) = test else {
                    anyhow::bail!("the agent at size runs the TCP tests only");
                };
                let agent = self.scene.start_agent_at_size(self.at_size)?;
                let mut routes = vec![Route::FastServiceAtSize, Route::FastPassthroughAtSize];
                if round % 2 == 1 {
                    routes.reverse();
                }
                for route in routes {
                    self.tcp(round, tcp, route, Some(&agent))?;
                }
                return agent.stop();
            }
            Phase::Agent(relay) => relay,
        };
        // The DNS target is per core: the agent gets one CPU of its own (the server side's) there.
        let agent = match test {
            Test::Dns => self.scene.start_agent_on(relay, Some(scene::SERVER_CPU))?,
            Test::Tcp(_) => self.scene.start_agent(relay)?,
        };
        let mut routes = match (test, relay) {
            (Test::Dns, _) => vec![Route::DnsAnswered, Route::DnsForwarded, Route::DnsCached],
            (_, Relay::Splice) => vec![Route::Service, Route::Passthrough],
            (_, Relay::Copy) => vec![Route::ServiceCopy, Route::PassthroughCopy],
            (_, Relay::FastPath) => vec![
                Route::FastService,
                Route::FastPassthrough,
                Route::FastDnsService,
            ],
            (_, Relay::FastPathAudit) => vec![Route::FastServiceAudit, Route::FastPassthroughAudit],
            (_, Relay::FastPathNoRecords) => {
                vec![Route::FastServiceNoRecords, Route::FastPassthroughNoRecords]
            }
            (_, Relay::FastPathWaypoint) => vec![Route::FastService, Route::FastWaypoint],
        };
        if round % 2 == 1 {
            routes.reverse();
        }
        for route in routes {
            match test {
                Test::Dns => self.dns(round, route, Some(&agent))?,
                Test::Tcp(tcp) => self.tcp(round, tcp, route, Some(&agent))?,
            }
        }
        agent.stop()
    }

    /// One TCP test on one route. A tool failure is recorded as a failed run; a wrong path is fatal.
    fn tcp(&mut self, round: usize, test: Tcp, route: Route, agent: Option<&Agent>) -> Result<()> {
        let (tool, args) = tcp_command(test, route, self.settings);
        let before = agent.map(Agent::metrics).transpose()?;
        let opens_before = self.scene.pod_active_opens()?;
        let agent_before = agent.map(AgentUse::now).transpose()?;
        let out = self.client(tool, &args);
        let opens = self.scene.pod_active_opens()? - opens_before;
        let mut agent_cpu = None;
        if let (Some(agent), Some(before), Some(used)) = (agent, &before, agent_before) {
            let after = agent.metrics()?;
            verify::outbound(route, before, &after, opens)?;
            agent_cpu = Some(used.cpu_percent(agent)?);
            if route == Route::FastWaypoint {
                let (tunnels, connections) = verify::hbone_use(before, &after);
                let (lines, resets) = used.waypoint_lines_since(agent);
                println!(
                    "xtask bench:   HBONE over {opens} connections: {tunnels} tunnels on {connections} new connections to the waypoint; access log: {lines} lines through it, {resets} ended `reset`"
                );
            }
            if test == Tcp::ConnRate && records_every_connection(route) {
                // The last records of the run wait up to the agent's collection tick.
                std::thread::sleep(RECORDS_COLLECTED);
                let after = agent.metrics()?;
                let lines = used.lines_since(agent);
                let budget = verify::log_budget(lines, before, &after, self.settings.secs, opens)?;
                println!(
                    "xtask bench:   access log over {opens} connections: {} lines written, {} left out and counted, {} records lost",
                    budget.lines, budget.dropped, budget.lost
                );
            }
        }
        let parsed: Result<Vec<(Metric, f64)>> = out.and_then(|out| match test {
            Tcp::Throughput(1) => Ok(vec![(Metric::Throughput1, iperf::parse(&out)?)]),
            Tcp::Throughput(_) => Ok(vec![(Metric::Throughput8, iperf::parse(&out)?)]),
            Tcp::Latency => {
                let p = sockperf::parse(&out)?;
                Ok(vec![
                    (Metric::LatencyP50, p.p50),
                    (Metric::LatencyP99, p.p99),
                    (Metric::LatencyP999, p.p999),
                ])
            }
            Tcp::ConnRate => {
                let r = wrk::parse(&out)?;
                verify::new_connections(&r, opens)?;
                let mut values = vec![(Metric::ConnRate, r.per_second)];
                values.extend(agent_cpu.map(|cpu| (Metric::AgentCpu, cpu)));
                Ok(values)
            }
        });
        self.file(round, route, test_metrics(test), parsed);
        Ok(())
    }

    fn dns(&mut self, round: usize, route: Route, agent: Option<&Agent>) -> Result<()> {
        let file = match route {
            Route::DnsAnswered => self.answered_queries.clone(),
            Route::DnsCached => self.cached_queries.clone(),
            _ => self.forwarded_queries.clone(),
        };
        let server = SocketAddrV4::new(RESOLVER_IP, 53);
        for (metric, outstanding) in [
            (Metric::DnsQps, dnsperf::LOAD_OUTSTANDING),
            (Metric::DnsLatency, 1),
        ] {
            let args = dnsperf::client_args(server, &file, self.settings.secs, outstanding);
            let before = agent.map(Agent::metrics).transpose()?;
            let out = self.client("dnsperf", &args);
            let report = out.and_then(|o| dnsperf::parse(&o));
            if let (Some(agent), Some(before), Ok(report)) = (agent, &before, &report) {
                verify::dns(route, before, &agent.metrics()?, report.completed)?;
            }
            let parsed = report.map(|r| {
                vec![(
                    metric,
                    if metric == Metric::DnsQps {
                        r.qps
                    } else {
                        r.mean_latency_us
                    },
                )]
            });
            self.file(round, route, &[metric], parsed);
        }
        Ok(())
    }

    /// Runs a client tool in the pod (pinned to the client CPU), noting its command line for the report.
    fn client(&mut self, tool: &str, args: &[String]) -> Result<String> {
        let line = format!(
            "taskset -c {} {tool} {}",
            scene::CLIENT_CPU,
            shell_words(args)
        );
        let run_dir = self.scene.run_dir().to_string_lossy().into_owned();
        self.commands.insert(line.replace(&run_dir, "<run dir>"));
        let timeout = Duration::from_secs(u64::from(self.settings.secs) + 30);
        self.scene.client(tool, args, timeout)
    }

    fn file(
        &mut self,
        round: usize,
        route: Route,
        metrics: &[Metric],
        parsed: Result<Vec<(Metric, f64)>>,
    ) {
        match parsed {
            Ok(values) => {
                for (metric, value) in values {
                    println!(
                        "xtask bench:   {:<28} {:<23} {value:>12.2} {}",
                        metric.label(),
                        route.label(),
                        metric.unit()
                    );
                    self.results.record(round, metric, route, Some(value));
                }
            }
            Err(e) => {
                let names: Vec<&str> = metrics.iter().map(|m| m.label()).collect();
                let msg = format!(
                    "round {}: {} over {}: {e:#}",
                    round + 1,
                    names.join(", "),
                    route.label()
                );
                eprintln!("xtask bench: run failed: {msg}");
                self.results.failures.push(msg);
                for m in metrics {
                    self.results.record(round, *m, route, None);
                }
            }
        }
    }
}

/// Past the agent's tick for collecting the kernel's records (100 ms): every record of a run is
/// counted by then.
const RECORDS_COLLECTED: Duration = Duration::from_millis(300);

/// Whether the agent of `route` records every connection its kernel decides (its default).
fn records_every_connection(route: Route) -> bool {
    matches!(route, Route::FastService | Route::FastPassthrough)
}

/// What the agent had used when a run began: its CPU time and its log's access lines.
#[derive(Clone, Copy)]
struct AgentUse {
    at: std::time::Instant,
    cpu_seconds: f64,
    lines: u64,
}

impl AgentUse {
    fn now(agent: &Agent) -> Result<AgentUse> {
        Ok(AgentUse {
            at: std::time::Instant::now(),
            cpu_seconds: crate::machine::cpu_seconds(agent.pid())?,
            lines: access_lines(agent),
        })
    }

    /// The agent's CPU since, in percent of one CPU.
    fn cpu_percent(&self, agent: &Agent) -> Result<f64> {
        let used = crate::machine::cpu_seconds(agent.pid())? - self.cpu_seconds;
        Ok(100.0 * used / self.at.elapsed().as_secs_f64().max(1e-3))
    }

    /// Access-log lines written since.
    fn lines_since(&self, agent: &Agent) -> u64 {
        access_lines(agent).saturating_sub(self.lines)
    }

    /// Of the access-log lines written since, those through the bench's waypoint, and how many of
    /// them ended `reset`.
    fn waypoint_lines_since(&self, agent: &Agent) -> (u64, u64) {
        let through = format!(
            "waypoint={}/{}",
            scene::pod_namespace(),
            scene::WAYPOINT_NAME
        );
        let log = agent.log();
        let lines = log
            .lines()
            .filter(|l| l.contains("access: connection"))
            .skip(self.lines as usize)
            .filter(|l| l.contains(&through));
        lines.fold((0, 0), |(n, resets), l| {
            (n + 1, resets + u64::from(l.contains("end=reset")))
        })
    }
}

fn access_lines(agent: &Agent) -> u64 {
    agent
        .log()
        .lines()
        .filter(|l| l.contains("access: connection"))
        .count() as u64
}

/// The client tool and its arguments for `test` over `route`.
pub(crate) fn tcp_command(
    test: Tcp,
    route: Route,
    settings: Settings,
) -> (&'static str, Vec<String>) {
    let ip = match route {
        Route::Service
        | Route::ServiceCopy
        | Route::FastService
        | Route::FastServiceAtSize
        | Route::FastServiceAudit
        | Route::FastServiceNoRecords => scene::VIP,
        Route::FastDnsService => scene::dns_vip(),
        Route::FastWaypoint => scene::WAYPOINT_VIP,
        _ => scene::SERVER_IP,
    };
    let secs = settings.secs;
    match test {
        Tcp::Throughput(streams) => (
            "iperf3",
            iperf::client_args(SocketAddrV4::new(ip, scene::IPERF_PORT), streams, secs),
        ),
        Tcp::Latency => (
            "sockperf",
            sockperf::client_args(SocketAddrV4::new(ip, scene::SOCKPERF_PORT), secs),
        ),
        Tcp::ConnRate => (
            "wrk",
            wrk::client_args(
                &format!("http://{ip}:{}/", scene::HTTP_PORT),
                settings.wrk_conns,
                secs,
            ),
        ),
    }
}

fn test_metrics(test: Tcp) -> &'static [Metric] {
    match test {
        Tcp::Throughput(1) => &[Metric::Throughput1],
        Tcp::Throughput(_) => &[Metric::Throughput8],
        Tcp::Latency => &[Metric::LatencyP50, Metric::LatencyP99, Metric::LatencyP999],
        Tcp::ConnRate => &[Metric::ConnRate, Metric::AgentCpu],
    }
}

/// Arguments as a shell would need them (quoted when they hold spaces).
fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if a.contains(' ') {
                format!("\"{a}\"")
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
