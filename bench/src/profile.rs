//! `cargo xtask profile`: where the time goes on the proxy path. For each test it runs direct,
//! then service, once each, under `perf record -a -g -e cpu-clock` (a software clock: this kind of VM
//! exposes no hardware counters), then service once more under `perf trace -s` on the agent, to count
//! its system calls per request. Writes `target/bench-profile/` (perf.data files, reports, summary.txt).
//! With `--dns`: DNS instead, straight to the upstream vs forwarded by the agent (dnsperf, 64 queries
//! outstanding, the agent on the server CPU as in the bench), per query.
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::model::Route;
use super::rounds::{Settings, Tcp, tcp_command};
use super::scene::{self, Relay, Scene};
use super::{dnsperf, sockperf, wrk};

/// Time perf takes to attach: the client starts after it, and perf stops well after the client, so
/// the counts cover the whole run.
const ATTACH: Duration = Duration::from_secs(1);

const SETTINGS: Settings = Settings {
    rounds: 1,
    secs: 4,
    wrk_conns: 64,
};

/// What one profiled run puts on the path.
#[derive(Clone, Copy)]
enum Load {
    Tcp(Tcp),
    /// dnsperf asking the forwarded name, 64 outstanding.
    Dns,
}

pub(crate) fn profile(scene: &Scene, target_dir: &Path, dns: bool) -> Result<PathBuf> {
    let dir = target_dir.join("bench-profile");
    fs::create_dir_all(&dir)?;
    let mut summary = String::new();
    let tests: Vec<(&str, Load, [Route; 2])> = if dns {
        vec![("dns", Load::Dns, [Route::DnsUpstream, Route::DnsForwarded])]
    } else {
        [
            ("latency", Tcp::Latency),
            ("connections", Tcp::ConnRate),
            ("throughput-1", Tcp::Throughput(1)),
            ("throughput-8", Tcp::Throughput(8)),
        ]
        .into_iter()
        .map(|(name, test)| (name, Load::Tcp(test), [Route::Direct, Route::Service]))
        .collect()
    };
    for (name, test, routes) in tests {
        println!("xtask profile: {name}");
        let _ = writeln!(summary, "==== {name}");
        for route in routes {
            let agent = match (route, test) {
                (Route::Direct | Route::DnsUpstream, _) => None,
                // As in the bench: DNS's agent on the server CPU.
                (_, Load::Dns) => {
                    Some(scene.start_agent_on(Relay::Splice, Some(scene::SERVER_CPU))?)
                }
                (_, Load::Tcp(_)) => Some(scene.start_agent(Relay::Splice)?),
            };
            let data = dir.join(format!("{name}-{}.data", route.label()));
            let perf = record(&data, SETTINGS.secs)?;
            std::thread::sleep(ATTACH);
            let out = run(scene, test, route);
            finish(perf, "perf record")?;
            let out = out?;
            let units = work_done(test, &out)?;
            let by_command = report(
                &data,
                &[
                    "--no-children",
                    "--sort",
                    "comm",
                    "--show-nr-samples",
                    "--percent-limit",
                    "2",
                ],
            )?;
            let _ = writeln!(
                summary,
                "-- {} ({})\nCPU by command, whole machine (share, samples, µs of CPU per {}):\n{}",
                route.label(),
                units.describe(),
                units.name,
                cpu_per_unit(&by_command, units.count)
            );
            if let Some(agent) = agent {
                let split = report(
                    &data,
                    &[
                        "--no-children",
                        "--sort",
                        "comm,dso",
                        "--percent-limit",
                        "0.5",
                    ],
                )?;
                // perf report filters by thread: name every thread of the agent.
                let tids = threads(agent.pid())?;
                let inclusive = report(
                    &data,
                    &[
                        "--children",
                        "--tid",
                        &tids,
                        "--percentage",
                        "relative",
                        "--sort",
                        "sym",
                        "--percent-limit",
                        "8",
                    ],
                )?;
                let _ = writeln!(
                    summary,
                    "Kernel or user space, by command (the agent's threads are `proxy`):\n{split}\n\
                     Agent, inclusive time by function (share of the agent's samples):\n{inclusive}"
                );
                // A separate run: tracing every system call slows the agent down.
                let trace_file = dir.join(format!("{name}-syscalls.txt"));
                let tracer = trace(agent.pid(), &trace_file, SETTINGS.secs)?;
                std::thread::sleep(ATTACH);
                let traced = run(scene, test, route);
                finish(tracer, "perf trace")?;
                let traced = work_done(test, &traced?)?;
                let text = fs::read_to_string(&trace_file).unwrap_or_default();
                let _ = writeln!(
                    summary,
                    "Agent system calls per {} (perf trace -s, {}):\n{}",
                    traced.name,
                    traced.describe(),
                    per_unit(&text, traced.count)
                );
                agent.stop()?;
            }
        }
    }
    let path = dir.join("summary.txt");
    fs::write(&path, &summary)?;
    println!("{summary}");
    Ok(path)
}

/// `tid,tid,...` of every thread of `pid`.
fn threads(pid: u32) -> Result<String> {
    let dir = format!("/proc/{pid}/task");
    let tids: Vec<String> = fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    Ok(tids.join(","))
}

fn run(scene: &Scene, test: Load, route: Route) -> Result<String> {
    let (tool, args) = match test {
        Load::Tcp(test) => tcp_command(test, route, SETTINGS),
        Load::Dns => {
            let queries = scene.scratch_file(
                "forwarded.queries",
                &format!("{} A\n", scene::FORWARDED_NAME),
            )?;
            let server = std::net::SocketAddrV4::new(integration::RESOLVER_IP, 53);
            let args =
                dnsperf::client_args(server, &queries, SETTINGS.secs, dnsperf::LOAD_OUTSTANDING);
            ("dnsperf", args)
        }
    };
    scene.client(tool, &args, Duration::from_secs(60))
}

/// How much work a run did, to divide system calls by.
struct Units {
    name: &'static str,
    count: u64,
}

impl Units {
    fn describe(&self) -> String {
        format!("{} {}s", self.count, self.name)
    }
}

fn work_done(test: Load, out: &str) -> Result<Units> {
    let Load::Tcp(test) = test else {
        return Ok(Units {
            name: "query",
            count: dnsperf::parse(out)?.completed,
        });
    };
    Ok(match test {
        Tcp::Latency => Units {
            name: "round trip",
            count: sockperf::observations(out)?,
        },
        Tcp::ConnRate => Units {
            name: "connection",
            count: wrk::parse(out)?.requests,
        },
        // Bytes are what a bulk run does: count MiB.
        Tcp::Throughput(_) => Units {
            name: "MiB",
            count: super::iperf::received_bytes(out)? >> 20,
        },
    })
}

/// `perf record -a -g -e cpu-clock -F 999 -o DATA -- sleep SECS`, started before the client.
fn record(data: &Path, secs: u32) -> Result<Child> {
    Command::new("perf")
        .args([
            "record",
            "-a",
            "-g",
            "-e",
            "cpu-clock",
            "-F",
            "999",
            "-q",
            "-o",
        ])
        .arg(data)
        .args(["--", "sleep", &(secs + 3).to_string()])
        .stdout(Stdio::null())
        .spawn()
        .context("starting perf record (Debian package linux-perf)")
}

/// `perf trace -s -p PID -o FILE -- sleep SECS`: a per-syscall summary of the agent.
fn trace(pid: u32, file: &Path, secs: u32) -> Result<Child> {
    Command::new("perf")
        .args(["trace", "-s", "-p", &pid.to_string(), "-o"])
        .arg(file)
        .args(["--", "sleep", &(secs + 3).to_string()])
        .stdout(Stdio::null())
        .spawn()
        .context("starting perf trace")
}

fn finish(mut child: Child, what: &str) -> Result<()> {
    let status = child.wait()?;
    if !status.success() {
        bail!("{what} failed: {status}");
    }
    Ok(())
}

fn report(data: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("perf")
        .args(["report", "--stdio", "-g", "none", "-i"])
        .arg(data)
        .args(args)
        .output()
        .context("running perf report")?;
    if !out.status.success() {
        bail!("perf report: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .take(30)
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Adds µs of CPU per unit to `perf report --sort comm --show-nr-samples` lines (one sample per
/// 1/999 s of one CPU).
fn cpu_per_unit(by_command: &str, units: u64) -> String {
    by_command
        .lines()
        .map(|line| {
            let samples = line
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.parse::<f64>().ok());
            match samples {
                Some(n) => format!("{line:<40} {:>8.1}", n / 999.0 * 1e6 / units.max(1) as f64),
                None => line.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// perf trace's summary, summed over threads: `syscall calls per-unit`, most frequent first.
fn per_unit(trace: &str, units: u64) -> String {
    let mut calls: Vec<(String, u64)> = Vec::new();
    for line in trace.lines() {
        // "   splice            8123      0     1.234 ..."
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(n)) = (f.first(), f.get(1).and_then(|n| n.parse::<u64>().ok()))
        else {
            continue;
        };
        if f.len() < 7 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        match calls.iter_mut().find(|(s, _)| s == name) {
            Some((_, total)) => *total += n,
            None => calls.push((name.to_string(), n)),
        }
    }
    calls.sort_by_key(|c| std::cmp::Reverse(c.1));
    let total: u64 = calls.iter().map(|(_, n)| n).sum();
    let per = |n: u64| n as f64 / units.max(1) as f64;
    let mut s = format!("  all: {total} calls, {:.1} per unit\n", per(total));
    for (name, n) in calls.iter().take(15) {
        let _ = writeln!(s, "  {name:<16} {n:>10} {:>8.2}", per(*n));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_perf_trace_summaries_over_threads() {
        let trace = "
 Summary of events:

 tokio-runtime-w (1234), 300 events, 40.0%

   syscall            calls  errors  total       min       avg       max       stddev
                                     (msec)    (msec)    (msec)    (msec)        (%)
   --------------- --------  ------ -------- --------- --------- ---------     ------
   splice               200     50     1.000     0.001     0.005     0.010      1.00%
   epoll_wait           100      0     9.000     0.001     0.090     1.000      5.00%

 tokio-runtime-w (1235), 100 events, 10.0%

   syscall            calls  errors  total       min       avg       max       stddev
   --------------- --------  ------ -------- --------- --------- ---------     ------
   splice                50      0     0.200     0.001     0.004     0.010      1.00%
";
        let s = per_unit(trace, 50);
        assert!(s.contains("all: 350 calls, 7.0 per unit"), "{s}");
        assert!(s.contains("splice                  250     5.00"), "{s}");
        assert!(s.contains("epoll_wait              100     2.00"), "{s}");
    }
}
