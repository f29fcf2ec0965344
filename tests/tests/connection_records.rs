//! Connection records, whoever decides (`docs/observability.md#connection-records`): real curls
//! from team-a to its own entry, decided in the kernel by default (and by the proxy with
//! `--no-fast-path`), each give one access-log line with the decider, the client pod, the original
//! destination, the endpoint, the bytes curl moved and how it ended; `redirect config connections
//! --follow` prints the records as they happen, and the by-service counters move with them.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use integration::fixtures::{Moved, curls_moved};
use integration::world::World;
use integration::{Agent, Launch, pace};
use serde_json::Value;

const A1_IP: &str = "10.244.1.10";
const ENTRY: &str = "203.0.113.10:80";
const ENDPOINT: &str = "198.51.100.20:80";

fn launch(fast_path: bool) -> Launch {
    Launch {
        fast_path,
        ..Launch::default()
    }
}

/// `count` sequential curls from team-a's pod to its entry: what each moved.
fn curls(w: &World, count: usize) -> Result<Vec<Moved>> {
    curls_moved(w.client("team-a"), "http://api.example.com/", count)
}

/// The access-log lines the agent wrote with `decided_by`, once there are `want` of them.
fn access_lines(w: &World, decided_by: &str, want: usize) -> Result<Vec<BTreeMap<String, String>>> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    loop {
        let lines: Vec<BTreeMap<String, String>> = w
            .agent
            .log()
            .lines()
            .filter(|l| {
                l.contains("access:") && l.contains(&format!("decided_by=\"{decided_by}\""))
            })
            .map(fields)
            .collect();
        if lines.len() >= want || Instant::now() > deadline {
            return Ok(lines);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `key=value` pairs of a log line, quotes taken off.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
        .collect()
}

/// Checks 100 curls' lines against what curl moved, for `decided_by`.
fn hundred_curls_hundred_lines(w: &World, decided_by: &str) -> Result<()> {
    let moved = curls(w, 100)?;
    let lines = access_lines(w, decided_by, 100)?;
    ensure!(
        lines.len() == 100,
        "{} lines with decided_by={decided_by} for 100 curls:\n{}",
        lines.len(),
        w.agent.log()
    );
    for (line, moved) in lines.iter().zip(&moved) {
        let field = |k: &str| line.get(k).map(String::as_str).unwrap_or("");
        ensure!(field("namespace") == "team-a", "{line:?}");
        ensure!(field("workload") == "team-a/a1", "{line:?}");
        ensure!(
            field("client").starts_with(&format!("{A1_IP}:")) && field("client") != "10.244.1.10:0",
            "the pod's address and port: {line:?}"
        );
        ensure!(field("orig_dst") == ENTRY, "{line:?}");
        ensure!(field("endpoint") == ENDPOINT, "{line:?}");
        ensure!(field("service") == "team-a/api-example", "{line:?}");
        ensure!(field("outcome") == "service", "{line:?}");
        ensure!(field("end") == "closed", "{line:?}");
        let sent: u64 = field("bytes_sent").parse()?;
        let received: u64 = field("bytes_received").parse()?;
        ensure!(sent == moved.sent, "sent {sent}, curl {moved:?}: {line:?}");
        // Exactly what curl read, within a few percent.
        ensure!(
            received.abs_diff(moved.received) * 100 <= moved.received * 3,
            "received {received}, curl {moved:?}: {line:?}"
        );
    }
    let metrics = w.agent.metrics()?;
    let series = format!(
        r#"decided_by="{decided_by}",client_namespace="team-a",service_namespace="team-a",service="api-example""#
    );
    ensure!(
        metrics.get_or_zero(&format!("redirect_service_connections_total{{{series}}}")) == 100.0,
        "{series}"
    );
    let received: u64 = moved.iter().map(|m| m.received).sum();
    let counted = metrics.get_or_zero(&format!(
        "redirect_service_bytes_total{{{series},direction=\"received\"}}"
    ));
    ensure!(
        (counted - received as f64).abs() <= received as f64 * 0.03,
        "bytes counted {counted}, curl received {received}"
    );
    Ok(())
}

#[test]
fn kernel_decided_connections_each_have_an_access_log_line_with_bytes_and_end() -> Result<()> {
    let w = World::start_launched(&launch(true))?;
    let before = w.agent.metrics()?;
    hundred_curls_hundred_lines(&w, "kernel")?;
    let after = w.agent.metrics()?;
    let rewritten = r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#;
    ensure!(
        integration::world::delta(&before, &after, rewritten) == 100.0,
        "the kernel decided them"
    );
    ensure!(
        access_lines(&w, "proxy", 0)?.is_empty(),
        "the proxy decided none"
    );
    ensure!(after.get_or_zero("redirect_connection_records_lost_total") == 0.0);
    Ok(())
}

#[test]
fn proxy_decided_connections_have_the_same_lines_with_decided_by_proxy() -> Result<()> {
    let w = World::start_launched(&launch(false))?;
    hundred_curls_hundred_lines(&w, "proxy")?;
    ensure!(access_lines(&w, "kernel", 0)?.is_empty());
    Ok(())
}

/// `redirect config connections --follow --namespace team-a -o json`, run where the agent's admin
/// server is: the records of team-a's connections made after it started, as they happen; another
/// namespace's never.
#[test]
fn config_connections_follow_prints_records_as_they_happen() -> Result<()> {
    let w = World::start_launched(&launch(true))?;
    let mut follow = w
        .topo
        .node_cmd(Agent::bin()?)
        .args([
            "config",
            "connections",
            "--follow",
            "--namespace",
            "team-a",
            "-o",
            "json",
        ])
        .spawn()?;
    // Following: nothing recorded yet, so no line; team-b's connection must not show.
    std::thread::sleep(pace::scaled(Duration::from_millis(500)));
    ensure!(follow.is_running(), "{}", follow.log());
    w.curl("team-b", "http://203.0.113.10/")?;
    curls(&w, 3)?;
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    let records = loop {
        let records: Vec<Value> = follow
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if records.iter().filter(|r| r["event"] == "close").count() >= 3 {
            break records;
        }
        if Instant::now() > deadline {
            bail!("no 3 close records followed:\n{}", follow.log());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for record in &records {
        ensure!(record["namespace"] == "team-a", "{record}");
        ensure!(record["decidedBy"] == "kernel", "{record}");
        ensure!(record["service"] == "team-a/api-example", "{record}");
        ensure!(record["endpoint"] == ENDPOINT, "{record}");
    }
    let opens = records.iter().filter(|r| r["event"] == "open").count();
    ensure!(opens == 3, "an open each: {records:?}");
    // The table form, once, of what is held: team-b's passthrough is there under its namespace.
    let table = w
        .topo
        .node_cmd(Agent::bin()?)
        .args(["config", "connections", "--namespace", "team-b"])
        .ok()?
        .stdout_str();
    ensure!(
        table.starts_with("TIME")
            && table.contains("passthrough")
            && table.contains("203.0.113.10:80"),
        "{table}"
    );
    Ok(())
}

#[test]
fn with_kernel_records_off_the_kernel_decides_as_before_and_records_nothing() -> Result<()> {
    let w = World::start_args(|_| Ok(()), &launch(true), &["--kernel-records", "off"])?;
    curls(&w, 5)?;
    std::thread::sleep(pace::scaled(Duration::from_millis(500)));
    ensure!(
        access_lines(&w, "kernel", 0)?.is_empty(),
        "{}",
        w.agent.log()
    );
    let metrics = w.agent.metrics()?;
    ensure!(
        metrics
            .get_or_zero(r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#)
            >= 5.0
    );
    let listed = w.agent.admin_get("/connections")?;
    ensure!(listed.status == 200, "{}", listed.text());
    let records: Vec<Value> = serde_json::from_str(&listed.text())?;
    ensure!(
        records.iter().all(|r| r["decidedBy"] != "kernel"),
        "{records:?}"
    );
    Ok(())
}

/// Every metric the Grafana dashboard in deploy/ queries is one a running agent serves (with the
/// fast path, after connections were recorded): a renamed family fails here, not on a dashboard.
#[test]
fn the_dashboard_queries_only_families_the_agent_serves() -> Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/redirect-dashboard.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let dashboard: Value = serde_json::from_str(&text).context("the dashboard is not JSON")?;
    let mut queried = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().context("no panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().context("a target without expr")?;
            let mut rest = expr;
            while let Some(at) = rest.find("redirect_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                queried.insert(name);
            }
        }
    }
    ensure!(queried.len() >= 10, "{queried:?}");
    // Every family with something to show, with the fast path and without (the proxy's budgets):
    // team-a reaches its entry; team-b the address of an entry hidden from it, which the audit
    // policy (every entry PUBLIC) would show it.
    let audit =
        std::env::temp_dir().join(format!("rdt-dashboard-audit-{}.yaml", std::process::id()));
    std::fs::write(
        &audit,
        "serviceEntryVisibility: {defaultVisibility: PUBLIC}\n",
    )?;
    let mut served = String::new();
    for fast_path in [true, false] {
        let w = World::start_args(
            |_| Ok(()),
            &launch(fast_path),
            &["--audit-mesh-config", &audit.to_string_lossy()],
        )?;
        curls(&w, 2)?;
        w.curl("team-b", "http://203.0.113.10/")?;
        served.push_str(&w.agent.admin_get("/metrics")?.text());
    }
    let _ = std::fs::remove_file(&audit);
    for name in &queried {
        let family = name.strip_suffix("_total").unwrap_or(name);
        let shown = served.lines().any(|l| {
            l.starts_with(&format!("# HELP {name} "))
                || l.starts_with(&format!("# HELP {family} "))
                || l.starts_with(&format!("{name}{{"))
                || l.starts_with(&format!("{name} "))
        });
        ensure!(
            shown,
            "the dashboard queries {name}, which the agent does not serve:\n{served}"
        );
    }
    Ok(())
}
