//! The agent's metrics as a cluster's Prometheus reads them (`docs/observability.md`): a real
//! Prometheus (Debian's package) in the node's netns scrapes the agent's admin port every second,
//! and its query API answers what the agent's own text says.
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, ensure};
use integration::metrics::Metrics;
use integration::prometheus::{JOB, Prometheus};
use integration::world::World;
use integration::{ADMIN_ADDR, fixtures::curl_body};

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

fn start_prometheus(w: &World) -> Result<Prometheus> {
    let admin: SocketAddr = ADMIN_ADDR.parse()?;
    Prometheus::start(
        w.topo.node(),
        PROMETHEUS.parse()?,
        &w.topo.scratch_path("prometheus"),
        &[admin],
        "/metrics",
    )
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
