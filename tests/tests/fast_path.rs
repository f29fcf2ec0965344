//! The fast path, on by default (`docs/data-plane.md#in-kernel-fast-path`): the kernel decides at
//! connect() what needs no proxy. Passthrough then keeps the pod's own source address (the proxy's
//! own connection shows the node's), a `resolution: DNS` entry is rewritten to the addresses the
//! agent resolved ahead and follows the upstream's answer, and a reload swaps the kernel's tables
//! whole while connections keep coming, without failing one. (The visibility suite runs whole both
//! ways: `cargo xtask test` runs it a second time with `REDIRECT_FAST_PATH=0`, `--no-fast-path`.)
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
        "with --no-fast-path the kernel decides nothing: {after:#?}"
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
    // Plain-IP endpoints: the kernel rewrites. Endpoints by host name too, once the agent has
    // resolved them ahead (before it called itself ready; the world's upstream knows them).
    assert_eq!(
        decided("team-a/api-example", "203.0.113.10").as_deref(),
        Some("kernel"),
        "{fast:#}"
    );
    assert_eq!(
        decided("istio-system/cdn", "203.0.113.60").as_deref(),
        Some("kernel"),
        "{fast:#}"
    );
    assert_eq!(
        fast["fallbacks"].get("host_name_endpoint"),
        None,
        "{fast:#}"
    );

    // With --no-fast-path the dump says so and shows no tables.
    drop(w);
    let w = World::start_launched(&launch(false))?;
    let dump = config_dump(&w)?;
    assert_eq!(dump["fastPath"]["enabled"], false, "{dump:#}");
    assert!(dump["fastPath"].get("tables").is_none(), "{dump:#}");
    Ok(())
}

/// The entry people write most: `resolution: DNS`, hosts and no addresses (an allocated
/// `240.240.x.y`), the host itself its endpoint.
const DNS_ENTRY: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: httpbin, namespace: team-a}
spec:
  hosts: [httpbin.dns.example]
  ports: [{number: 80, name: http}]
  resolution: DNS
";
const DNS_HOST: &str = "httpbin.dns.example";
/// The upstream's answer, first and after the change, and its TTL.
const ORIGINS: [(&str, &str); 2] = [("origin-1", "198.51.100.91"), ("origin-2", "198.51.100.92")];
const DNS_TTL: u64 = 5;
const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const A1_UID: &str = "0a1a1a1a-0000-4000-8000-0000000000d1";

/// With no flags, a `resolution: DNS` entry with an allocated address is reached by curl from a pod
/// with the kernel rewriting the VIP to the address the agent resolved ahead: the kernel's counter
/// moves and the proxy's does not. When the upstream's answer changes, the new address is in use
/// within the TTL plus one refresh.
#[test]
fn a_dns_entry_is_rewritten_in_the_kernel_to_the_hosts_address_and_follows_its_changes()
-> Result<()> {
    use integration::{Agent, DnsRecords, Topology};
    let mut topo = Topology::new()?;
    topo.add_kube_pod(A1.0, A1.1.parse()?, A1_UID)?;
    let _servers = ORIGINS
        .iter()
        .map(|(name, ip)| topo.start_ext_peer(name, &[format!("{ip}:80").parse()?], &[]))
        .collect::<Result<Vec<_>>>()?;
    let answer = |ip: &str| -> Result<DnsRecords> {
        Ok(DnsRecords::new().host_ttl(DNS_HOST, ip.parse()?, DNS_TTL as u32))
    };
    let mut dns = topo.start_dnsmasq(RESOLVER_IP, answer(ORIGINS[0].1)?)?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let pod = integration::fixtures::pod(A1.0, A1_UID, A1.1, "{}");
    world::replace_file(&dir, "entries.yaml", &format!("{DNS_ENTRY}---\n{pod}"))?;
    let upstream = format!("{RESOLVER_IP}:53");
    // No flag: the agent as shipped.
    let agent = Agent::launch(
        &topo,
        &Launch::default(),
        &[
            "--config",
            &dir.to_string_lossy(),
            "--dns-upstream",
            &upstream,
        ],
    )?;
    ensure!(agent.fast_path(), "REDIRECT_FAST_PATH=0 in the environment");

    // The pod resolves the host to its allocated address through the agent, then connects.
    let a1 = topo.pod(A1.0);
    let get = || -> Result<(String, String)> {
        let out = a1
            .cmd("curl")
            .args(["-sS", "--fail", "--max-time", &pace::scaled_secs(10)])
            .args(["-w", "\n%{remote_ip}"])
            .arg(format!("http://{DNS_HOST}/"))
            .ok()?;
        let text = out.stdout_str();
        let (body, vip) = text.rsplit_once('\n').context("curl's output")?;
        Ok((body.trim().to_string(), vip.trim().to_string()))
    };
    let before = agent.metrics()?;
    let (body, vip) = get()?;
    assert_eq!(body, ORIGINS[0].0);
    ensure!(vip.starts_with("240.240."), "an allocated address: {vip}");
    let after = agent.wait_metrics("kernel rewrite +1", Duration::from_secs(2), |m| {
        delta(&before, m, KERNEL_REWRITTEN) == 1.0
    })?;
    assert_eq!(
        delta(&before, &after, PROXY_SERVICE),
        0.0,
        "the proxy never saw it: {after:#?}"
    );

    // The upstream's answer changes: within the TTL plus one refresh (a quarter of it early), the
    // kernel rewrites to the new address.
    dns.restart_with(answer(ORIGINS[1].1)?)?;
    let changed = std::time::Instant::now();
    let deadline = pace::scaled(Duration::from_secs(DNS_TTL + DNS_TTL * 3 / 4 + 1));
    loop {
        let (body, _) = get()?;
        if body == ORIGINS[1].0 {
            break;
        }
        assert_eq!(body, ORIGINS[0].0);
        ensure!(
            changed.elapsed() < deadline,
            "still the old address {deadline:?} after the change; agent log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = changed.elapsed();
    let after_change = agent.metrics()?;
    eprintln!("the new address was in use {took:?} after the upstream changed");
    assert_eq!(
        delta(&before, &after_change, PROXY_SERVICE),
        0.0,
        "every connection decided in the kernel: {after_change:#?}"
    );
    // Asked of the upstream in both families.
    let log = dns.log();
    for qtype in ["A", "AAAA"] {
        ensure!(
            log.contains(&format!("query[{qtype}] {DNS_HOST} ")),
            "no {qtype} query upstream; dnsmasq log:\n{log}"
        );
    }
    Ok(())
}

/// `getpeername()` on an MPTCP socket (`IPPROTO_MPTCP`, which recent curl, Go and systemd services
/// open) shows where the application connected, as on a TCP socket: an address the kernel
/// rewrote to its endpoint, one the proxy carries, and one passed through, with the fast path and
/// without. The kernel steers the MPTCP socket's first subflow, not the socket itself.
#[test]
fn getpeername_on_an_mptcp_socket_shows_the_original_destination() -> Result<()> {
    // Debian's 5.10 is built without MPTCP (no net.mptcp at all).
    let enabled = std::fs::read_to_string("/proc/sys/net/mptcp/enabled");
    if !enabled.is_ok_and(|v| v.trim() == "1") {
        eprintln!("SKIPPED: this kernel has no MPTCP, or it is off (net.mptcp.enabled)");
        return Ok(());
    }
    // team-a's own entry (rewritten by the kernel, or carried by the proxy), and team-a's address
    // as team-b sees it (passed through).
    let targets = [("team-a", "203.0.113.10:80"), ("team-b", HIDDEN_REAL)];
    for fast_path in [true, false] {
        let w = World::start_launched(&launch(fast_path))?;
        for (from, addr) in targets {
            let mut seen = Vec::new();
            for mptcp in [false, true] {
                let mut args = vec!["getpeername", addr];
                if mptcp {
                    args.push("--mptcp");
                }
                let out = peer::cmd(w.client(from).place())?.args(args).ok()?;
                seen.push(out.stdout_str().trim().to_string());
            }
            ensure!(
                seen == [addr, addr],
                "fast path {fast_path}: {from} -> {addr}: getpeername() on TCP and MPTCP sockets: {seen:?}"
            );
        }
    }
    Ok(())
}

/// `/explain` (what `redirect config explain` asks) reads who decides from the tables in force: an
/// endpoint host name the agent resolved ahead is the kernel's, and the kernel's counter is the one
/// that moves. (A compilation of the manifests alone, as the offline explain makes, has no answer
/// for the name and would say proxy.)
#[test]
fn the_live_explain_names_the_kernel_for_an_endpoint_resolved_ahead_and_its_counter_moves()
-> Result<()> {
    const CDN: &str = "203.0.113.60:80";
    let w = World::start_launched(&launch(true))?;
    let decided_by = || -> Result<String> {
        let r = w
            .agent
            .admin_get(&format!("/explain?from=team-a&ip={CDN}"))?;
        ensure!(
            r.status == 200,
            "/explain answered {}: {}",
            r.status,
            r.text()
        );
        let e: serde_json::Value = serde_json::from_str(&r.text())?;
        Ok(e["outbound"]["decidedBy"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    };
    // The name is resolved within the agent's first second; its tables follow.
    let deadline = std::time::Instant::now() + pace::scaled(Duration::from_secs(5));
    while decided_by()? != "kernel" {
        ensure!(
            std::time::Instant::now() < deadline,
            "/explain never said kernel for {CDN}: {}",
            decided_by()?
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = w.agent.metrics()?;
    let connections = 5;
    for _ in 0..connections {
        let reach = w.curl("team-a", &format!("http://{CDN}/"))?;
        ensure!(matches!(reach, world::Reach::Server(_)), "{reach:?}");
    }
    let after = w.agent.metrics()?;
    assert_eq!(
        delta(&before, &after, KERNEL_REWRITTEN),
        f64::from(connections)
    );
    assert_eq!(
        delta(&before, &after, PROXY_SERVICE),
        0.0,
        "the proxy decided none"
    );
    Ok(())
}
