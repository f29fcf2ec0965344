//! The agent's metrics as a cluster's Prometheus reads them (`docs/observability.md`): a real
//! Prometheus (Debian's package) in the node's netns scrapes the agent's stats address (port
//! 15020 of the node's addresses, where it would scrape ztunnel) every second, and its query API
//! answers what the agent's own text on the admin address says.
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, ensure};
use integration::fixtures::curl_body;
use integration::metrics::Metrics;
use integration::prometheus::{JOB, Prometheus};
use integration::world::World;

/// Where Prometheus listens, in the node's netns.
const PROMETHEUS: &str = "127.0.0.1:19090";
/// Series Prometheus adds to every scrape of its own accord.
const SCRAPE_SERIES: [&str; 5] = [
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
];

/// The stats address as a cluster's Prometheus reaches it: the node's own address (the node's
/// side of its link to ext), port 15020.
const STATS: &str = "192.0.2.1:15020";

fn start_prometheus(w: &World) -> Result<Prometheus> {
    let stats: SocketAddr = STATS.parse()?;
    Prometheus::start(
        w.topo.node(),
        PROMETHEUS.parse()?,
        &w.topo.scratch_path("prometheus"),
        &[stats],
        "/stats/prometheus",
    )
}

/// The HTTP status of `GET path` on the stats address, from the node's netns.
fn stats_status(w: &World, path: &str) -> Result<String> {
    let out = w
        .topo
        .node_cmd("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("http://{STATS}{path}"))
        .ok()?;
    Ok(out.stdout_str())
}

/// The metric names of the agent's text, as Prometheus names the series a family gives (a
/// counter's samples carry `_total`, a histogram's `_bucket`, `_sum` and `_count`).
fn names(metrics: &Metrics) -> BTreeSet<String> {
    metrics
        .samples()
        .keys()
        .filter_map(|key| key.split('{').next())
        .map(String::from)
        .collect()
}

#[test]
fn a_real_prometheus_takes_every_family_the_agent_serves_and_counts_as_it_does() -> Result<()> {
    let w = World::start()?;
    let prometheus = start_prometheus(&w)?;
    // Traffic the agent counts: team-b reaches the real api.example.com, past team-a's entry.
    for _ in 0..5 {
        let body = curl_body(w.client("team-b"), "http://api.example.com/")?;
        ensure!(!body.is_empty(), "no answer from the real api.example.com");
    }
    let up = prometheus.query_until(
        &format!(r#"up{{job="{JOB}"}}"#),
        Duration::from_secs(20),
        |s| s.len() == 1 && s[0].value == 1.0,
    )?;
    ensure!(up.len() == 1, "{up:?}");

    // Every family the agent serves is ingested: a family Prometheus' parser refused would fail
    // the whole scrape (`up` 0), one it misread would be missing or renamed here.
    let ours = names(&w.agent.metrics()?);
    let ingested = prometheus.query_until(
        &format!(r#"count by (__name__) ({{job="{JOB}"}})"#),
        Duration::from_secs(10),
        |s| s.len() >= ours.len(),
    )?;
    let theirs: BTreeSet<String> = ingested
        .iter()
        .filter_map(|s| s.labels.get("__name__").cloned())
        .filter(|name| !SCRAPE_SERIES.contains(&name.as_str()))
        .collect();
    ensure!(
        theirs == ours,
        "Prometheus has {:?} the agent does not serve, and lacks {:?}",
        theirs.difference(&ours).collect::<Vec<_>>(),
        ours.difference(&theirs).collect::<Vec<_>>()
    );

    // The stats address serves the metrics alone, never the node's configuration.
    assert_eq!(stats_status(&w, "/metrics")?, "200");
    for admin_only in ["/config_dump", "/connections", "/healthz/ready", "/logging"] {
        assert_eq!(stats_status(&w, admin_only)?, "404", "{admin_only}");
    }

    // The counters at rest agree: what the proxy and the kernel decided (the kernel's counts
    // are read from its maps every few hundred milliseconds), summed.
    let families = [
        "redirect_outbound_connections_total",
        "redirect_fast_path_connections_total",
    ];
    let counted = |m: &Metrics| families.iter().map(|f| m.sum(f)).sum::<f64>();
    let deadline = std::time::Instant::now() + integration::pace::scaled(Duration::from_secs(10));
    let mut agent_count = counted(&w.agent.metrics()?);
    while agent_count < 5.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        agent_count = counted(&w.agent.metrics()?);
    }
    ensure!(
        agent_count >= 5.0,
        "the agent counted {agent_count} connections"
    );
    let promql = format!(r#"sum({{__name__=~"{}"}})"#, families.join("|"));
    let answer = prometheus.query_until(&promql, Duration::from_secs(10), |s| {
        s.first().is_some_and(|s| s.value == agent_count)
    })?;
    ensure!(answer[0].value == agent_count, "{answer:?}");
    Ok(())
}
