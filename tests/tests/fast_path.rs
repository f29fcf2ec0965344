//! `run --fast-path` (`docs/data-plane.md#in-kernel-fast-path`): the kernel decides at connect()
//! what needs no proxy. Passthrough then keeps the pod's own source address (the proxy's own
//! connection shows the node's), and a reload swaps the kernel's tables whole while connections
//! keep coming, without failing one. (The visibility suite runs whole with `--fast-path` too:
//! `cargo xtask test` runs it a second time with `REDIRECT_FAST_PATH=1`.)
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::world::{self, World, delta};
use integration::{Launch, RESOLVER_IP, pace, peer};

/// team-a's NAMESPACE entry claims this address; team-b does not see it: passthrough to the real host.
const HIDDEN_REAL: &str = "203.0.113.10:80";
const B1_IP: &str = "10.244.2.10";

const PROXY_PASSTHROUGH: &str = r#"redirect_outbound_connections_total{outcome="passthrough"}"#;
const KERNEL_PASSTHROUGH: &str =
    r#"redirect_fast_path_connections_total{outcome="passthrough",reason=""}"#;
const KERNEL_REWRITTEN: &str =
    r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#;
const PROXY_SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;

fn config_dump(w: &World) -> Result<serde_json::Value> {
    let r = w.agent.admin_get("/config_dump")?;
    ensure!(r.status == 200, "/config_dump answered {}", r.status);
    serde_json::from_str(&r.text()).context("/config_dump is not JSON")
}

fn launch(fast_path: bool) -> Launch {
    Launch {
        fast_path,
        ..Launch::default()
    }
}

/// The source address the real host saw for team-b's `GET /peer` (its own handler prints it).
fn seen_source(w: &World) -> Result<String> {
    let out = w
        .client("team-b")
        .cmd("curl")
        .args(["-sS", "--fail", "--max-time", &pace::scaled_secs(10)])
        .arg(format!("http://{HIDDEN_REAL}/peer"))
        .ok()?;
    let peer: SocketAddr = out
        .stdout_str()
        .trim()
        .parse()
        .context("the server's /peer answer")?;
    Ok(peer.ip().to_string())
}

#[test]
fn passthrough_keeps_the_pods_source_address_with_the_fast_path_and_the_nodes_without() -> Result<()>
{
    let w = World::start_launched(&launch(true))?;
    let before = w.agent.metrics()?;
    assert_eq!(seen_source(&w)?, B1_IP, "the kernel left the socket alone");
    let after = w
        .agent
        .wait_metrics("kernel passthrough +1", Duration::from_secs(2), |m| {
            delta(&before, m, KERNEL_PASSTHROUGH) == 1.0
        })?;
    assert_eq!(
        delta(&before, &after, PROXY_PASSTHROUGH),
        0.0,
        "the proxy never saw it: {after:#?}"
    );
    drop(w);

    let w = World::start_launched(&launch(false))?;
    let before = w.agent.metrics()?;
    let source = seen_source(&w)?;
    assert_ne!(source, B1_IP, "the proxy's own connection carries it");
    let after = w
        .agent
        .wait_metrics("proxy passthrough +1", Duration::from_secs(2), |m| {
            delta(&before, m, PROXY_PASSTHROUGH) == 1.0
        })?;
    assert_eq!(
        delta(&before, &after, KERNEL_PASSTHROUGH),
        0.0,
        "without --fast-path the kernel decides nothing: {after:#?}"
    );
    Ok(())
}

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

#[test]
fn reloads_under_load_swap_the_kernels_tables_without_a_failed_connection() -> Result<()> {
    let w = World::start_launched(&launch(true))?;
    let reloads = |m: &integration::Metrics| m.get(world::key::RELOAD_OK).unwrap_or(0.0);
    let before = w.agent.metrics()?;
    // team-b's steady traffic, all of it decided in the kernel whatever team-a's label says: a
    // Kubernetes Service (rewritten to its pod), a PUBLIC entry (rewritten to its endpoint), an
    // address nobody claims (left alone); and a name the agent answers.
    let resolver = format!("{RESOLVER_IP}:53");
    let mut mix = peer::cmd(w.client("team-b").place())?
        .args(["mix", "--rate", "300", "--workers", "8"])
        .args(["--http", "10.244.100.10:80=web-1"])
        .args(["--http", "203.0.113.30:80=metrics-endpoint"])
        .args(["--http", "203.0.113.80:80=real-203.0.113.80"])
        .args(["--dns", &format!("{resolver}=metrics.example.com")])
        .spawn()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;

    // Each change is a new snapshot, so new tables: filled in the idle generation, then flipped.
    let changes = 6;
    for i in 0..changes {
        let trusted = i % 2 == 0;
        let want = reloads(&before) + f64::from(i + 1);
        set_team_a_trusted(w.config_dir(), trusted)?;
        w.agent.wait_metrics(
            &format!("reload {}", i + 1),
            pace::scaled(Duration::from_secs(5)),
            |m| reloads(m) >= want,
        )?;
        std::thread::sleep(pace::scaled(Duration::from_millis(300)));
    }

    let report = peer::stop_mix(mix)?;
    ensure!(
        report.failed == 0,
        "{} connections failed while the tables were swapped:\n{}",
        report.failed,
        report.text
    );
    let after = w.agent.metrics()?;
    let rewritten = delta(&before, &after, KERNEL_REWRITTEN);
    let passed = delta(&before, &after, KERNEL_PASSTHROUGH);
    ensure!(
        rewritten > 100.0 && passed > 50.0,
        "the kernel decided too little to prove anything ({rewritten} rewritten, {passed} passed through) in {} ok connections",
        report.ok
    );
    assert_eq!(
        delta(&before, &after, PROXY_SERVICE),
        0.0,
        "team-b's service traffic never reached the proxy: {after:#?}"
    );
    let log = w.agent.log();
    let swaps = log.matches("fast path: new tables in force").count();
    eprintln!(
        "client loop: {} ok, {} failed in {:.1} s; in the kernel: {rewritten} rewritten, {passed} passed through; {swaps} table swaps",
        report.ok, report.failed, report.secs
    );
    ensure!(
        swaps > changes as usize,
        "every reload must put new tables in force ({swaps} swaps):\n{log}"
    );
    Ok(())
}

#[test]
fn config_dump_says_who_decides_each_service_port() -> Result<()> {
    let w = World::start_launched(&launch(true))?;
    let dump = config_dump(&w)?;
    let fast = &dump["fastPath"];
    assert_eq!(fast["enabled"], true, "{fast:#}");
    assert!(fast["tables"]["exact"].as_u64() > Some(0), "{fast:#}");
    assert!(fast["tables"]["clients"].as_u64() > Some(0), "{fast:#}");
    let decided = |service: &str, address: &str| -> Option<String> {
        fast["services"].as_array()?.iter().find_map(|d| {
            (d["service"] == service && d["address"] == address && d["port"] == 80)
                .then(|| d["decidedBy"].as_str().map(str::to_string))?
        })
    };
    // Plain-IP endpoints: the kernel rewrites. Endpoints by host name: only the proxy resolves.
    assert_eq!(
        decided("team-a/api-example", "203.0.113.10").as_deref(),
        Some("kernel"),
        "{fast:#}"
    );
    assert_eq!(
        decided("istio-system/cdn", "203.0.113.60").as_deref(),
        Some("proxy"),
        "{fast:#}"
    );
    assert!(
        fast["fallbacks"]["host_name_endpoint"].as_u64() > Some(0),
        "{fast:#}"
    );

    // Without --fast-path the dump says so and shows no tables.
    drop(w);
    let w = World::start_launched(&launch(false))?;
    let dump = config_dump(&w)?;
    assert_eq!(dump["fastPath"]["enabled"], false, "{dump:#}");
    assert!(dump["fastPath"].get("tables").is_none(), "{dump:#}");
    Ok(())
}
