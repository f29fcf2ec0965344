//! BENCHMARKS.md and the table printed at the end of a run.
use std::collections::BTreeSet;
use std::fmt::Write;
use std::time::Duration;

use super::control::{AtSize, Criterion, Memory};
use super::machine::Machine;
use super::model::{Metric, Results, Route};
use super::rounds::Settings;
use super::scene::{self, Relay};
use super::stats::Summary;
use super::synthetic::{self, AT_SIZE};
use super::targets::Verdict;

/// Markers around the hand-written analysis, which a rerun keeps.
pub(crate) const WHY_BEGIN: &str = "<!-- why:begin (kept when the file is regenerated) -->";
pub(crate) const WHY_END: &str = "<!-- why:end -->";

pub(crate) struct BenchReport<'a> {
    pub quick: bool,
    pub settings: Settings,
    pub machine: &'a Machine,
    pub results: &'a Results,
    pub commands: &'a BTreeSet<String>,
    pub criterion: &'a [Criterion],
    pub criterion_command: String,
    /// `--agent-cpu`: where the agent ran for the TCP tests (None: unpinned).
    pub agent_cpu: Option<u32>,
    pub memory: Option<Memory>,
    /// The agent with the config at size (None: not started).
    pub at_size: Option<AtSize>,
    pub verdicts: &'a [Verdict],
    pub measuring: Duration,
    /// The chart, relative to BENCHMARKS.md.
    pub chart: &'a str,
}

const TCP_ROUTES: [Route; 8] = [
    Route::Direct,
    Route::FastService,
    Route::FastDnsService,
    Route::FastPassthrough,
    Route::FastServiceAtSize,
    Route::FastPassthroughAtSize,
    Route::Service,
    Route::Passthrough,
];
const THROUGHPUT_ROUTES: [Route; 10] = [
    Route::Direct,
    Route::FastService,
    Route::FastDnsService,
    Route::FastPassthrough,
    Route::FastServiceAtSize,
    Route::FastPassthroughAtSize,
    Route::Service,
    Route::ServiceCopy,
    Route::Passthrough,
    Route::PassthroughCopy,
];
const AUDIT_ROUTES: [Route; 5] = [
    Route::Direct,
    Route::FastService,
    Route::FastServiceAudit,
    Route::FastPassthrough,
    Route::FastPassthroughAudit,
];
const RECORDS_ROUTES: [Route; 5] = [
    Route::Direct,
    Route::FastService,
    Route::FastServiceNoRecords,
    Route::FastPassthrough,
    Route::FastPassthroughNoRecords,
];
const WAYPOINT_ROUTES: [Route; 3] = [Route::Direct, Route::FastService, Route::FastWaypoint];
const DNS_ROUTES: [Route; 4] = [
    Route::DnsUpstream,
    Route::DnsForwarded,
    Route::DnsCached,
    Route::DnsAnswered,
];

impl BenchReport<'_> {
    /// The figures: headline, one table per section, targets.
    pub(crate) fn tables(&self) -> String {
        let mut s = String::new();
        s.push_str("## Headline: ratio to direct (median of per-round ratios, min–max)\n\n");
        let _ = writeln!(
            s,
            "| | service (default) | DNS-resolved service (default) | passthrough (default) | service (default, {size}) | passthrough (default, {size}) | service (`--no-fast-path`) | passthrough (`--no-fast-path`) |\n| --- | --- | --- | --- | --- | --- | --- | --- |",
            size = AT_SIZE.words()
        );
        for metric in [
            Metric::Throughput1,
            Metric::Throughput8,
            Metric::LatencyP50,
            Metric::LatencyP99,
            Metric::LatencyP999,
            Metric::ConnRate,
        ] {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                metric.label(),
                self.ratio(metric, Route::FastService),
                self.ratio(metric, Route::FastDnsService),
                self.ratio(metric, Route::FastPassthrough),
                self.ratio(metric, Route::FastServiceAtSize),
                self.ratio(metric, Route::FastPassthroughAtSize),
                self.ratio(metric, Route::Service),
                self.ratio(metric, Route::Passthrough)
            );
        }
        let _ = writeln!(
            s,
            "| DNS queries/s (vs straight to upstream) | answered: {} | forwarded, TTL 0: {} | forwarded, TTL 30 s (cached): {} | | | | |",
            self.ratio(Metric::DnsQps, Route::DnsAnswered),
            self.ratio(Metric::DnsQps, Route::DnsForwarded),
            self.ratio(Metric::DnsQps, Route::DnsCached)
        );

        s.push_str("\n## 1. Bulk throughput (iperf3), Gbit/s\n\n");
        self.table(
            &mut s,
            &THROUGHPUT_ROUTES,
            &[Metric::Throughput1, Metric::Throughput8],
        );
        s.push_str(
            "\n`(copy)`: the agent with `--relay copy` (a 64 KiB user-space buffer per direction) instead of \
             the default zero-copy `splice`: the before/after of zero-copy.\n",
        );
        s.push_str("\n## 2. Request/response latency (sockperf ping-pong, 1 KiB, one connection), round trip µs\n\n");
        self.table(
            &mut s,
            &THROUGHPUT_ROUTES,
            &[Metric::LatencyP50, Metric::LatencyP99, Metric::LatencyP999],
        );
        s.push_str("\n## 3. New connections per second (wrk, `Connection: close`: connect, one request, close)\n\n");
        self.table(&mut s, &TCP_ROUTES, &[Metric::ConnRate]);
        s.push('\n');
        match &self.at_size {
            Some(a) => s.push_str(&at_size_paragraph(a)),
            None => s.push_str("The agent at size: not started in this run.\n"),
        }
        let audited = [Metric::Throughput1, Metric::ConnRate]
            .iter()
            .any(|m| self.results.summary(*m, Route::FastServiceAudit).is_some());
        if audited {
            s.push_str("\n### Audit\n\nThe default agent with and without `--audit-mesh-config` (a policy under which the bench's entry is PUBLIC, so the kernel reports every connection to the service and the agent audits it), in the same run:\n\n");
            self.table(
                &mut s,
                &AUDIT_ROUTES,
                &[Metric::Throughput1, Metric::ConnRate],
            );
        }
        let recorded = [Metric::Throughput1, Metric::ConnRate].iter().any(|m| {
            self.results
                .summary(*m, Route::FastServiceNoRecords)
                .is_some()
        });
        if recorded {
            s.push_str("\n### Connection records\n\nThe default agent (the kernel records every connection it decides: an open and a close record each, joined to names, logged within the budget, counted by service) and the same with `--kernel-records off`, in the same run; the agent's CPU is its user and system time over the wrk run:\n\n");
            self.table(
                &mut s,
                &RECORDS_ROUTES,
                &[Metric::Throughput1, Metric::ConnRate, Metric::AgentCpu],
            );
        }
        let waypoint = [Metric::Throughput1, Metric::LatencyP50, Metric::ConnRate]
            .iter()
            .any(|m| self.results.summary(*m, Route::FastWaypoint).is_some());
        if waypoint {
            let _ = write!(
                s,
                "\n### Waypoint (HBONE)\n\nThe default agent with the pods' certificates (`--identity-dir`, `--trust-domain {td}`) and a second entry of the same server (VIP {vip}) bound to the waypoint `{ns}/{name}` (its Service at {wp}:{port}): the kernel hands its connections to the proxy, which carries each as an HTTP/2 CONNECT stream over one pooled mutual-TLS 1.3 connection to the harness's `rdt-peer hbone` standing in for the waypoint (in ext beside the servers, on CPU {cpu}), which connects to the server. Beside it, the same agent's fast path to the unbound entry, in the same run; the agent's CPU is its user and system time over the wrk run:\n\n",
                td = scene::TRUST_DOMAIN,
                vip = scene::WAYPOINT_VIP,
                ns = scene::pod_namespace(),
                name = scene::WAYPOINT_NAME,
                wp = scene::WAYPOINT_IP,
                port = scene::HBONE_PORT,
                cpu = scene::SERVER_CPU,
            );
            self.table(
                &mut s,
                &WAYPOINT_ROUTES,
                &[
                    Metric::Throughput1,
                    Metric::LatencyP50,
                    Metric::LatencyP99,
                    Metric::ConnRate,
                    Metric::AgentCpu,
                ],
            );
        }
        s.push_str("\n## 4. DNS (dnsperf, UDP): queries/s with 64 outstanding; mean latency with 1 outstanding, µs\n\n");
        self.table(&mut s, &DNS_ROUTES, &[Metric::DnsQps, Metric::DnsLatency]);
        s.push_str("\n## 5. Control plane\n\n");
        self.control(&mut s);
        s.push_str("\n## Targets\n\n| target | measured (median) | |\n| --- | --- | --- |\n");
        for v in self.verdicts {
            let mark = match v.met {
                Some(true) => "met",
                Some(false) => "**missed**",
                None => "not measured",
            };
            let _ = writeln!(s, "| {} | {} | {mark} |", v.target, v.measured);
        }
        if !self.results.failures.is_empty() {
            s.push_str("\n## Failed runs (left out of the figures)\n\n");
            for f in &self.results.failures {
                let _ = writeln!(s, "- {}", f.replace('\n', " "));
            }
        }
        s
    }

    /// The whole BENCHMARKS.md; `why` is the kept hand-written analysis.
    pub(crate) fn markdown(&self, why: &str) -> String {
        let m = self.machine;
        let mut s = String::from("# Benchmarks\n\n");
        let _ = writeln!(
            s,
            "What the redirect and the proxy cost against a connection that does not go through them, \
             measured in one run on one machine. Reproduce with `sudo cargo xtask bench` (full run) or \
             `sudo cargo xtask bench --quick`. This file is written by that command; the **Why** section at \
             the end is kept across reruns.\n"
        );
        let _ = writeln!(
            s,
            "**This run:** {} mode, {} rounds of {} s per tool run, {:.1} min of measuring; agent {} for the \
             TCP tests.{}\n",
            if self.quick { "quick" } else { "full" },
            self.settings.rounds,
            self.settings.secs,
            self.measuring.as_secs_f64() / 60.0,
            self.agent_cpu
                .map_or("not pinned".to_string(), |cpu| format!(
                    "pinned to CPU {cpu}"
                )),
            if self.quick {
                " Quick runs are short and noisy: the committed numbers come from a full run."
            } else {
                ""
            }
        );
        let _ = writeln!(s, "![ratios to direct]({})\n", self.chart);
        s.push_str(&self.tables());
        s.push_str("\n## Machine\n\n");
        let _ = writeln!(s, "- CPU: {}, {} CPUs", m.cpu, m.cores);
        let _ = writeln!(s, "- Kernel: {}", m.kernel);
        let _ = writeln!(s, "- Date: {}", m.date);
        let _ = writeln!(
            s,
            "- Load average (1, 5, 15 min) before: {}; after: {}",
            m.load_before, m.load_after
        );
        let _ = writeln!(s, "- Tools (Debian): {}", m.tools.join(", "));
        s.push_str(
            "\nThe machine is shared with other engineers' builds, so absolute numbers move from run to run. \
             **Compare ratios from the same run**: every round runs every path, odd rounds in reverse order, \
             and each ratio is taken between runs of the same round before the median is taken.\n",
        );
        s.push_str(METHOD);
        s.push_str("\n## Commands\n\nServers, in the ext netns:\n\n```\n");
        for c in scene::server_commands() {
            let _ = writeln!(s, "{c}");
        }
        s.push_str(
            "```\n\nThe agent, in the node netns (only in the phases that use it): for the TCP tests, then for DNS:\n\n```\n",
        );
        let tcp_prefix = self
            .agent_cpu
            .map_or(String::new(), |cpu| format!("taskset -c {cpu} "));
        for relay in [Relay::Splice, Relay::Copy, Relay::FastPath] {
            let _ = writeln!(s, "{}", scene::agent_command(&tcp_prefix, relay));
        }
        let _ = writeln!(
            s,
            "{}",
            scene::agent_command_with(&tcp_prefix, "<config dir at size>", Relay::FastPath)
        );
        let dns_prefix = format!("taskset -c {} ", scene::SERVER_CPU);
        let _ = writeln!(s, "{}", scene::agent_command(&dns_prefix, Relay::Splice));
        let _ = write!(
            s,
            "```\n\nIts config (`<config dir>/bench.yaml`):\n\n```yaml\n{}```\n",
            scene::bench_config()
        );
        let sample = synthetic::cluster_files(synthetic::ClusterSize {
            namespaces: 1,
            entries: 1,
            pods: 1,
        });
        let _ = write!(
            s,
            "\n`<config dir at size>` holds the same `bench.yaml` and a big cluster's ({}): {} Namespaces `ns-N`, {} \
             ServiceEntries `se-I` (in `ns-(I mod {})`, address 100.65.0.0 + I) and {} Pods `pod-J` (in \
             `ns-(J mod {})`, address 10.128.0.0 + J), in files `cluster-NNN.yaml` of at most {} MiB \
             (`bench::synthetic::cluster_files`), one document after another like these:\n\n```yaml\n{}```\n",
            AT_SIZE.words(),
            AT_SIZE.namespaces,
            thousands(AT_SIZE.entries),
            AT_SIZE.namespaces,
            thousands(AT_SIZE.pods),
            AT_SIZE.namespaces,
            synthetic::FILE_BYTES >> 20,
            sample
                .iter()
                .map(|(_, text)| text.as_str())
                .collect::<String>()
        );
        let _ = write!(
            s,
            "\nClients, in the pod `bench/client` (its cgroup and netns), every one run each round \
             (`<run dir>/answered.queries` holds `{} A`, `forwarded.queries` holds `{} A`, \
             `cached.queries` holds `{} A`):\n\n```\n",
            scene::ANSWERED_NAME,
            scene::FORWARDED_NAME,
            scene::CACHED_NAME
        );
        for c in self.commands {
            let _ = writeln!(s, "{c}");
        }
        let _ = writeln!(
            s,
            "```\n\nControl plane, from the workspace root:\n\n```\n{}\n```\n\nProfiles (the **Why** below): \
             `sudo cargo xtask profile` writes `target/bench-profile/summary.txt`\n\
             (`--dns`: DNS straight to the upstream vs forwarded, per query).",
            self.criterion_command
        );
        s.push_str("\n## Why\n\n");
        s.push_str(WHY_BEGIN);
        s.push('\n');
        s.push_str(why.trim());
        s.push('\n');
        s.push_str(WHY_END);
        s.push('\n');
        s
    }

    fn ratio(&self, metric: Metric, route: Route) -> String {
        self.results
            .ratio(metric, route)
            .map_or("–".into(), |r| ratio_cell(&r))
    }

    fn table(&self, s: &mut String, routes: &[Route], metrics: &[Metric]) {
        s.push_str("| path |");
        for m in metrics {
            let _ = write!(s, " {} ({}) | ratio |", m.label(), m.unit());
        }
        s.push_str("\n| --- |");
        for _ in metrics {
            s.push_str(" ---: | ---: |");
        }
        s.push('\n');
        for route in routes {
            let _ = write!(s, "| {} |", route.label());
            for m in metrics {
                let value = self
                    .results
                    .summary(*m, *route)
                    .map_or("–".into(), |v| value_cell(*m, &v));
                let ratio = if route.baseline() == *route {
                    "1".into()
                } else {
                    self.ratio(*m, *route)
                };
                let _ = write!(s, " {value} | {ratio} |");
            }
            s.push('\n');
        }
    }

    fn control(&self, s: &mut String) {
        s.push_str(
            "Criterion (`bench/benches/state.rs`, 10,000 ServiceEntries in 1,000 namespaces): \
                    median time per call with criterion's 95 % interval of the median.\n\n",
        );
        s.push_str("| benchmark | median | interval |\n| --- | ---: | ---: |\n");
        for c in self.criterion {
            let _ = writeln!(
                s,
                "| {} | {} | {} – {} |",
                c.id,
                duration_cell(c.median_ns),
                duration_cell(c.lower_ns),
                duration_cell(c.upper_ns)
            );
        }
        if self.criterion.is_empty() {
            s.push_str("| (not run) | | |\n");
        }
        match &self.memory {
            Some(m) => {
                let _ = writeln!(
                    s,
                    "\nAgent with the same 10,000-entry config loaded through `--config` ({} services in its \
                     state): VmRSS **{:.1} MiB**, peak (VmHWM) {:.1} MiB, ready {:.2} s after start \
                     (load, resolve, build the state, attach).",
                    m.services,
                    m.rss_kib as f64 / 1024.0,
                    m.peak_kib as f64 / 1024.0,
                    m.ready.as_secs_f64()
                );
            }
            None => s.push_str("\nAgent RSS: not measured.\n"),
        }
    }
}

const METHOD: &str = "
## Method

- The harness's topology (`tests/`): a pod netns + cgroup `bench/client` (10.244.1.10), the node netns with the
  agent, and an ext netns holding the servers on 203.0.113.20 and dnsmasq on 198.51.100.53. Veth pairs link them;
  nothing runs in the machine's own netns.
- **direct**: no agent (no program attached); the pod's connection is routed by the node to ext.
  **service**: the agent runs with a NAMESPACE ServiceEntry in the pod's namespace that claims VIP
  100.64.0.10 (ports 80, 5201, 11111) with the ext server as its endpoint; the client connects to the VIP,
  which is routed nowhere, so only the proxy can carry it. **passthrough**: the agent runs, the client connects
  to 203.0.113.20 itself, which nothing claims.
- Every run through the agent is checked against its counters (`redirect_outbound_connections_total` by outcome,
  `redirect_dns_queries_total` by outcome): all of the run's connections (as counted by the pod's kernel,
  `Tcp: ActiveOpens`) must carry the route's outcome and none another, or the bench fails.
- Pinning: clients on CPU 0; servers and dnsmasq on CPU 1 (`taskset`). The agent is not pinned for the TCP tests
  (a DaemonSet is not: the scheduler places it; `--agent-cpu N` pins it), and runs on CPU 1 alone for the DNS tests,
  whose target is per core. On 2 CPUs the agent's placement moves the ratios a lot: see **Why**. The agent runs at
  log level `info`, as on a node.
- Connection rate: wrk with `-H \"Connection: close\"` and 64 connections at a time (enough to keep the CPUs
  busy, so the figure is capacity, not round-trip time); the server (the harness's `rdt-peer`, release build,
  hyper on tokio) answers with `Connection: close` and wrk opens a new connection for each request. The pod's
  `ActiveOpens` must grow by at least 95 % of wrk's request count, so the figure is connections, not requests on
  kept-alive connections. The server is the same for all three paths.
- DNS: dnsperf sends one name over and over: `backend.bench.example` (owned by the ServiceEntry: answered by the
  agent), `upstream.bench.example` (only in dnsmasq, TTL 0: forwarded by the agent every time, or asked of dnsmasq
  directly with the agent detached) or `lasting.bench.example` (only in dnsmasq, TTL 30 s, as a cluster DNS
  answers: forwarded once per TTL, the rest answered from the agent's cache). dnsperf sends no EDNS options,
  as glibc's and musl's stub resolvers.
";

/// What the agent at size held and took, and what its fast path left to the proxy (printed when
/// it has been read, and under the tables).
pub(crate) fn at_size_paragraph(a: &AtSize) -> String {
    let mib = |kib: u64| kib as f64 / 1024.0;
    let fast = &a.fast_path;
    let mut tables: Vec<String> = fast
        .tables
        .iter()
        .map(|t| {
            format!(
                "{} {} entries in room for {}, {}{}",
                t.table,
                thousands(t.entries as usize),
                thousands(t.capacity as usize),
                if t.from_kernel { "" } else { "~" },
                bytes_cell(t.bytes)
            )
        })
        .collect();
    if tables.is_empty() {
        tables.push("none".into());
    }
    let budget = fast.budget_bytes.map_or(String::new(), |b| {
        format!(" of the {} budget", bytes_cell(b))
    });
    let fallbacks = if fast.fallbacks.is_empty() {
        "none".to_string()
    } else {
        fast.fallbacks
            .iter()
            .map(|(why, n)| format!("`{why}` {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "**At size** (the rows *(fast path, {size})*): the same agent, its config directory holding \
         `bench.yaml` and {entries} STATIC ServiceEntries (one address each, NAMESPACE by the mesh \
         default, never contacted) and {pods} Pods in {namespaces} namespaces, in {files} more files \
         ({total:.1} MiB in all; the agent reads at most {file_max} MiB of a file, {dir_max} MiB of a \
         directory); {services} services and {workloads} workloads in its state. Ready {ready:.2} s \
         after start; VmRSS **{rss:.1} MiB** (peak {peak:.1} MiB). The fast path's tables in the \
         kernel (`/config_dump` `fastPath.memory`, both generations; the kernel's figure, ~ the \
         agent's estimate where the kernel gives none): **{table_bytes}**{budget}: {tables}. Left to \
         the proxy (`fastPath.fallbacks`): {fallbacks}.\n",
        size = AT_SIZE.words(),
        entries = thousands(AT_SIZE.entries),
        pods = thousands(AT_SIZE.pods),
        namespaces = AT_SIZE.namespaces,
        files = a.files,
        total = a.bytes as f64 / f64::from(1 << 20),
        file_max = synthetic::AGENT_FILE_BYTES >> 20,
        dir_max = synthetic::AGENT_DIR_BYTES >> 20,
        services = thousands(a.services),
        workloads = thousands(a.workloads),
        ready = a.ready.as_secs_f64(),
        rss = mib(a.rss_kib),
        peak = mib(a.peak_kib),
        table_bytes = bytes_cell(fast.bytes()),
        tables = tables.join("; "),
    )
}

/// `20000` -> `20,000`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// Bytes as MiB, or KiB below one MiB.
fn bytes_cell(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
    } else {
        format!("{:.0} KiB", bytes as f64 / 1024.0)
    }
}

fn ratio_cell(r: &Summary) -> String {
    format!("{:.2}× ({:.2}–{:.2})", r.median, r.min, r.max)
}

fn value_cell(metric: Metric, v: &Summary) -> String {
    let digits = match metric {
        Metric::Throughput1 | Metric::Throughput8 => 2,
        Metric::LatencyP50
        | Metric::LatencyP99
        | Metric::LatencyP999
        | Metric::DnsLatency
        | Metric::AgentCpu => 1,
        Metric::ConnRate | Metric::DnsQps => 0,
    };
    format!("{:.d$} ({:.d$}–{:.d$})", v.median, v.min, v.max, d = digits)
}

fn duration_cell(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

/// The hand-written analysis of an existing BENCHMARKS.md (between the markers), or a placeholder.
pub(crate) fn kept_why(existing: &str) -> String {
    existing
        .split_once(WHY_BEGIN)
        .and_then(|(_, rest)| rest.split_once(WHY_END))
        .map(|(why, _)| why.trim().to_string())
        .filter(|w| !w.is_empty())
        .unwrap_or_else(|| {
            "(No analysis yet: profile the missed targets and write it here.)".into()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_analysis_survives_regeneration() {
        let old =
            format!("# Benchmarks\n...\n## Why\n\n{WHY_BEGIN}\nperf shows copies.\n{WHY_END}\n");
        assert_eq!(kept_why(&old), "perf shows copies.");
        assert!(kept_why("# no markers").starts_with("(No analysis yet"));
    }

    #[test]
    fn renders_every_section() {
        let mut results = Results::new(2);
        for round in 0..2 {
            results.record(round, Metric::Throughput1, Route::Direct, Some(20.0));
            results.record(round, Metric::Throughput1, Route::Service, Some(16.0));
            results.record(round, Metric::Throughput1, Route::FastWaypoint, Some(5.0));
        }
        let machine = Machine {
            cpu: "Test CPU".into(),
            cores: 2,
            kernel: "6.1".into(),
            date: "2026-01-01 00:00 UTC".into(),
            load_before: "0.1 0.1 0.1".into(),
            load_after: "0.2 0.2 0.2".into(),
            tools: vec!["iperf3 3.12".into()],
        };
        let commands = BTreeSet::from(["taskset -c 0 iperf3 -c 100.64.0.10".to_string()]);
        let verdicts = super::super::targets::judge(&results, &[], None);
        let report = BenchReport {
            quick: true,
            settings: Settings {
                rounds: 2,
                secs: 1,
                wrk_conns: 64,
            },
            machine: &machine,
            results: &results,
            commands: &commands,
            criterion: &[],
            criterion_command: "cargo bench".into(),
            agent_cpu: None,
            memory: None,
            at_size: Some(at_size()),
            verdicts: &verdicts,
            measuring: Duration::from_secs(90),
            chart: "docs/benchmarks.png",
        };
        let md = report.markdown("kept analysis");
        for needle in [
            "| service | 16.00 (16.00–16.00) | 0.80× (0.80–0.80) |",
            "## 5. Control plane",
            "| throughput, 1 stream service ≥ 0.8× direct | 0.80× (0.80–0.80) | met |",
            "addresses: [100.64.0.10]",
            "taskset -c 0 iperf3 -c 100.64.0.10",
            "Test CPU, 2 CPUs",
            "kept analysis",
            "| service (fast path, 20k entries, 100k pods) | – | – |",
            "### Waypoint (HBONE)",
            "| service through a waypoint (HBONE) | 5.00 (5.00–5.00) | 0.25× (0.25–0.25) |",
            "VmRSS **120.0 MiB** (peak 150.0 MiB)",
            "**6.0 MiB** of the 64.0 MiB budget: exact 40,004 entries in room for 65,536, 4.0 MiB; workloads 200,002 entries in room for 262,144, ~2.0 MiB",
            "20,000 STATIC ServiceEntries",
            "20,002 services and 100,001 workloads",
            "(`fastPath.fallbacks`): `namespace_full` 2.",
            "<config dir at size>",
            "metadata: {name: pod-0, namespace: ns-0}",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in:\n{md}");
        }
        assert_eq!(kept_why(&md), "kept analysis");
    }

    fn at_size() -> AtSize {
        use super::super::control::{FastPathFigures, TableFigures};
        AtSize {
            files: 6,
            bytes: 16 << 20,
            ready: Duration::from_millis(4500),
            rss_kib: 120 * 1024,
            peak_kib: 150 * 1024,
            services: 20_002,
            workloads: 100_001,
            fast_path: FastPathFigures {
                tables: vec![
                    TableFigures {
                        table: "exact".into(),
                        entries: 40004,
                        capacity: 65536,
                        bytes: 4 << 20,
                        from_kernel: true,
                    },
                    TableFigures {
                        table: "workloads".into(),
                        entries: 200002,
                        capacity: 262144,
                        bytes: 2 << 20,
                        from_kernel: false,
                    },
                ],
                budget_bytes: Some(64 << 20),
                fallbacks: [("namespace_full".to_string(), 2)].into(),
            },
        }
    }

    #[test]
    fn cells_show_median_and_spread() {
        let s = Summary {
            median: 12.346,
            min: 10.0,
            max: 15.5,
            runs: 3,
        };
        assert_eq!(value_cell(Metric::Throughput1, &s), "12.35 (10.00–15.50)");
        assert_eq!(value_cell(Metric::ConnRate, &s), "12 (10–16)");
        assert_eq!(ratio_cell(&s), "12.35× (10.00–15.50)");
        assert_eq!(duration_cell(87.0), "87.0 ns");
        assert_eq!(thousands(7), "7");
        assert_eq!(thousands(100_000), "100,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(duration_cell(12_500_000.0), "12.50 ms");
    }
}
