//! A bounded soak: the mixed load of a busy node (HTTP through the proxy to a Service, a PUBLIC
//! entry and an address nobody claims, and DNS) while the configuration changes 20 times. Nothing
//! fails, and what the agent holds (resident memory, descriptors) comes back to where it was.
use std::time::Duration;

use anyhow::{Result, ensure};
use integration::world::{self, World, delta};
use integration::{RESOLVER_IP, pace, peer};

const RELOADS: u32 = 20;
/// Operations a second (8 workers), of which two thirds are proxied HTTP connections.
const RATE: u32 = 800;
const OUTBOUND: &str = "redirect_outbound_connections_total";

/// Labels team-a `trusted` (its entries become PUBLIC) or takes the label off again.
fn set_team_a_trusted(dir: &std::path::Path, trusted: bool) -> Result<()> {
    let (from, to) = (
        "  name: team-a\n",
        "  name: team-a\n  labels:\n    trusted: \"true\"\n",
    );
    match trusted {
        true => world::edit_file(dir, "00-namespaces.yaml", from, to),
        false => world::edit_file(dir, "00-namespaces.yaml", to, from),
    }
}

/// The agent's descriptors at rest: the lowest of a few samples (a scrape holds one briefly).
fn settled_fds(w: &World) -> Result<usize> {
    let mut lowest = usize::MAX;
    for _ in 0..5 {
        lowest = lowest.min(w.agent.fd_count()?);
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(lowest)
}

#[test]
fn mixed_load_across_twenty_reloads_fails_nothing_and_leaves_memory_and_descriptors_flat()
-> Result<()> {
    // The proxy is what holds memory and descriptors per connection: every connection goes to it.
    let w = World::start_with_launched(|_| Ok(()), &integration::Launch::no_fast_path())?;
    let reloads = |m: &integration::Metrics| m.get(world::key::RELOAD_OK).unwrap_or(0.0);
    let resolver = format!("{RESOLVER_IP}:53");
    let spawn_mix = || {
        peer::cmd(w.client("team-b").place()).and_then(|c| {
            c.args(["mix", "--rate", &RATE.to_string(), "--workers", "8"])
                .args(["--http", "10.244.100.10:80=web-1"])
                .args(["--http", "203.0.113.30:80=metrics-endpoint"])
                .args(["--http", "203.0.113.80:80=real-203.0.113.80"])
                .args(["--dns", &format!("{resolver}=metrics.example.com")])
                .spawn()
        })
    };
    // A warm-up, so the baseline has the allocator's and the runtime's working set.
    let mut warm = spawn_mix()?;
    warm.wait_for_log("started", Duration::from_secs(10))?;
    std::thread::sleep(Duration::from_secs(3));
    peer::stop_mix(warm)?;
    let (rss_before, fds_before) = (w.agent.rss_kib()?, settled_fds(&w)?);

    let before = w.agent.metrics()?;
    let mut mix = spawn_mix()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;
    for i in 0..RELOADS {
        let want = reloads(&before) + f64::from(i + 1);
        set_team_a_trusted(w.config_dir(), i % 2 == 0)?;
        w.agent.wait_metrics(
            &format!("reload {}", i + 1),
            pace::scaled(Duration::from_secs(5)),
            |m| reloads(m) >= want,
        )?;
        std::thread::sleep(Duration::from_millis(1000));
    }
    let report = peer::stop_mix(mix)?;
    let after =
        w.agent
            .wait_metrics("no proxied connection left", Duration::from_secs(10), |m| {
                m.get_or_zero("redirect_active_connections") == 0.0
            })?;
    let connections = after.sum(OUTBOUND) - before.sum(OUTBOUND);
    let (rss_after, fds_after) = (w.agent.rss_kib()?, settled_fds(&w)?);
    eprintln!(
        "{} ok, {} failed in {:.1} s; {connections} proxied connections; {RELOADS} reloads; RSS {} -> {} KiB; fds {fds_before} -> {fds_after}",
        report.ok, report.failed, report.secs, rss_before, rss_after
    );
    ensure!(
        report.failed == 0,
        "{} failed:\n{}",
        report.failed,
        report.text
    );
    ensure!(
        connections >= 10_000.0,
        "too few connections to show anything: {connections}"
    );
    assert_eq!(
        delta(
            &before,
            &after,
            r#"redirect_outbound_connections_total{outcome="error"}"#
        ),
        0.0
    );
    ensure!(
        fds_after <= fds_before + 2,
        "descriptors grew: {fds_before} -> {fds_after}"
    );
    ensure!(
        rss_after <= rss_before + 8 * 1024,
        "resident memory grew by more than 8 MiB: {rss_before} -> {rss_after} KiB"
    );
    Ok(())
}
