//! What an operator sees (`docs/observability.md`). The admin endpoints and `redirect config service` of a running agent,
//! checked against the configuration it was given (and against `redirect resolve` on the same files).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::world::delta;
use integration::{Agent, DnsRecords, RESOLVER_IP, Topology};
use serde_json::Value;

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");
const RELOAD_FAILED: &str = r#"redirect_config_reloads_total{result="failed"}"#;
const RELOAD_OK: &str = r#"redirect_config_reloads_total{result="ok"}"#;
const RELOAD_PARTIAL: &str = r#"redirect_config_reloads_total{result="partial"}"#;
const REJECTED_SERVICE_ENTRIES: &str = r#"redirect_config_objects_rejected{kind="ServiceEntry"}"#;

/// A copy of examples/ the test may edit.
fn examples_copy(topo: &Topology) -> Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let dst = topo.scratch_path("config");
    std::fs::create_dir_all(&dst)?;
    for entry in std::fs::read_dir(&src)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(".yaml") {
            std::fs::copy(entry.path(), dst.join(entry.file_name()))?;
        }
    }
    Ok(dst)
}

fn start(topo: &Topology, config: &Path) -> Result<Agent> {
    let upstream = format!("{RESOLVER_IP}:53");
    Agent::start(
        topo,
        &[
            "--config",
            &config.to_string_lossy(),
            "--dns-upstream",
            &upstream,
        ],
    )
}

fn config_dump(agent: &Agent) -> Result<Value> {
    let r = agent.admin_get("/config_dump")?;
    ensure!(r.status == 200, "/config_dump answered {}", r.status);
    serde_json::from_str(&r.text()).context("/config_dump is not JSON")
}

/// `redirect <args>` run offline (resolve, explain).
fn redirect_offline(args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new(Agent::bin()?)
        .args(args)
        .output()?;
    ensure!(
        out.status.success(),
        "redirect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("not JSON")
}

/// `redirect config service <args>` run where the agent's admin server is (the node netns).
fn config_service(topo: &Topology, args: &[&str]) -> Result<String> {
    Ok(topo
        .node_cmd(Agent::bin()?)
        .args(["config", "service"])
        .args(args)
        .ok()?
        .stdout_str())
}

fn services_named<'a>(dump: &'a Value, namespace: &str, name: &str) -> Vec<&'a Value> {
    dump["services"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter(|s| s["namespace"] == namespace && s["name"] == name)
                .collect()
        })
        .unwrap_or_default()
}

/// The flags in force, defaults included, are in `/config_dump` and in the log at start: what
/// the agent was given and what it made of what it was not.
#[test]
fn config_dump_and_the_log_show_the_flags_in_force_with_their_defaults() -> Result<()> {
    let topo = Topology::new()?;
    let config = examples_copy(&topo)?;
    let upstream = format!("{RESOLVER_IP}:53");
    let agent = Agent::start(
        &topo,
        &[
            "--config",
            &config.to_string_lossy(),
            "--dns-upstream",
            &upstream,
            "--kernel-records",
            "1/4",
            "--drain-timeout",
            "7s",
        ],
    )?;
    let in_force = &config_dump(&agent)?["inForce"];
    let expect = [
        (
            "source",
            Value::from(format!("directory {}", config.display())),
        ),
        ("dnsUpstream", Value::from(upstream.as_str())),
        ("kernelRecords", Value::from("1/4")),
        ("drainTimeoutSecs", Value::from(7.0)),
        // Not given: the defaults.
        ("proxyPort", Value::from(15001)),
        ("accessLog", Value::from(true)),
        ("hboneBetweenNodes", Value::from(false)),
    ];
    for (field, want) in &expect {
        ensure!(
            &in_force[field] == want,
            "inForce.{field} is {}, not {want}: {in_force:#}",
            in_force[field]
        );
    }
    ensure!(
        agent.log().lines().any(|l| l.contains("configuration in force")
            && l.contains(r#""kernelRecords":"1/4""#)),
        "the log at start has no line with the configuration in force:\n{}",
        agent.log()
    );
    Ok(())
}

#[test]
fn config_dump_shows_every_delivered_service_with_the_visibility_resolve_gives() -> Result<()> {
    let topo = Topology::new()?;
    let config = examples_copy(&topo)?;
    let agent = start(&topo, &config)?;
    let dump = config_dump(&agent)?;
    let resolved = redirect_offline(&["resolve", "-o", "json", "-f", &config.to_string_lossy()])?;

    ensure!(
        dump["version"].as_str().is_some_and(|v| !v.is_empty()),
        "no version: {dump}"
    );
    ensure!(
        dump["config"]["generation"] == 1,
        "generation: {}",
        dump["config"]
    );
    ensure!(
        dump["config"]["lastError"].is_null(),
        "lastError: {}",
        dump["config"]
    );
    ensure!(
        dump["serviceEntryVisibility"]["configured"] == true,
        "{}",
        dump["serviceEntryVisibility"]
    );

    let entries = resolved["serviceEntries"]
        .as_array()
        .context("serviceEntries")?;
    ensure!(entries.len() >= 10, "examples changed? {entries:?}");
    for entry in entries {
        let (ns, name) = (
            entry["namespace"].as_str().unwrap_or_default(),
            entry["name"].as_str().unwrap_or_default(),
        );
        let held = services_named(&dump, ns, name);
        match entry["visibility"].as_str() {
            // `docs/data-plane.md#what-the-data-plane-holds`:
            // a NONE entry exists nowhere in the data plane, not in /config_dump either.
            Some("None") => ensure!(
                held.is_empty(),
                "NONE entry {ns}/{name} is in /config_dump: {held:?}"
            ),
            Some(visibility) => {
                ensure!(
                    !held.is_empty(),
                    "{ns}/{name} ({visibility}) missing from /config_dump"
                );
                for service in held {
                    ensure!(
                        service["visibility"] == visibility,
                        "{ns}/{name}: dump says {}, resolve says {visibility}",
                        service["visibility"]
                    );
                    // Declared or allocated addresses are what the data plane claims.
                    ensure!(
                        service["vips"] == entry["addresses"],
                        "{ns}/{name}: vips {} vs addresses {}",
                        service["vips"],
                        entry["addresses"]
                    );
                }
            }
            None => anyhow::bail!("no visibility for {ns}/{name}"),
        }
    }
    // Kubernetes Services are always Public, whatever the default.
    let web = services_named(&dump, "team-a", "web");
    ensure!(
        web.len() == 1 && web[0]["visibility"] == "Public",
        "team-a/web: {web:?}"
    );
    ensure!(
        web[0]["hostname"] == "web.team-a.svc.cluster.local",
        "{:?}",
        web[0]
    );
    // A bound waypoint shows; a refused cross-namespace one does not.
    ensure!(!services_named(&dump, "istio-system", "metrics")[0]["waypoint"].is_null());
    ensure!(services_named(&dump, "team-b", "payments")[0]["waypoint"].is_null());
    agent.stop()
}

/// A new object in error is left out and reported (log line, gauge, `/config_dump`); what runs stays.
#[test]
fn an_object_in_error_shows_in_config_dump_and_metrics_and_the_rest_stays() -> Result<()> {
    let topo = Topology::new()?;
    let config = examples_copy(&topo)?;
    let agent = start(&topo, &config)?;
    let before = config_dump(&agent)?;

    std::fs::write(
        config.join("90-broken.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: broken, namespace: team-a}\n\
         spec:\n  hosts: [broken.example.com]\n  addresses: [203.0.113.300]\n  ports: [{number: 80, name: http}]\n",
    )?;
    let m = agent.wait_metrics("a partial reload", Duration::from_secs(5), |m| {
        m.get_or_zero(RELOAD_PARTIAL) >= 1.0
    })?;
    ensure!(
        m.get_or_zero(RELOAD_OK) == 1.0 && m.get_or_zero(RELOAD_FAILED) == 0.0,
        "only the first load was clean, and nothing was refused whole"
    );
    ensure!(m.get_or_zero(REJECTED_SERVICE_ENTRIES) == 1.0, "gauge");

    let dump = config_dump(&agent)?;
    let errors = dump["config"]["lastError"]["errors"]
        .as_array()
        .context("lastError.errors")?;
    let error = errors
        .iter()
        .find(|e| {
            e["file"]
                .as_str()
                .is_some_and(|f| f.ends_with("90-broken.yaml"))
        })
        .with_context(|| format!("no error for 90-broken.yaml: {errors:?}"))?;
    ensure!(
        error["object"] == "ServiceEntry team-a/broken",
        "object: {error}"
    );
    ensure!(
        error["field"]
            .as_str()
            .is_some_and(|f| f.starts_with("spec.addresses")),
        "field: {error}"
    );
    // The object in error is listed; it was new, so nothing of it is in force: the services are
    // exactly what they were.
    ensure!(
        dump["config"]["rejected"]
            == serde_json::json!([{"kind": "ServiceEntry", "namespace": "team-a", "name": "broken",
                "file": error["file"], "lastGoodInForce": false}]),
        "rejected: {}",
        dump["config"]
    );
    ensure!(
        dump["services"] == before["services"],
        "services changed after a change with only an object in error"
    );
    ensure!(
        dump["config"]["generation"] == 2,
        "generation: {}",
        dump["config"]
    );
    ensure!(
        agent.admin_get("/healthz/ready")?.status == 200,
        "a refused change made the agent unready"
    );
    ensure!(
        agent.log().lines().any(|l| l.contains("90-broken.yaml")
            && l.contains("ServiceEntry team-a/broken")
            && l.contains("spec.addresses")),
        "no log line naming file, object and field"
    );

    // Fixing it clears the error and applies the next generation.
    std::fs::remove_file(config.join("90-broken.yaml"))?;
    agent.wait_metrics("a good reload", Duration::from_secs(5), |m| {
        m.get_or_zero(RELOAD_OK) >= 2.0
    })?;
    let dump = config_dump(&agent)?;
    ensure!(dump["config"]["lastError"].is_null(), "{}", dump["config"]);
    ensure!(
        dump["config"]["rejected"] == serde_json::json!([]),
        "{}",
        dump["config"]
    );
    ensure!(dump["config"]["generation"] == 3, "{}", dump["config"]);
    ensure!(agent.metrics()?.get_or_zero(REJECTED_SERVICE_ENTRIES) == 0.0);
    agent.stop()
}

#[test]
fn a_hidden_service_is_counted_and_logged_in_dns_and_outbound() -> Result<()> {
    let topo = Topology::with_pods(&[A1, B1])?;
    let config = examples_copy(&topo)?;
    let _real = topo.start_ext_peer("real-api", &["203.0.113.10:80".parse()?], &[])?;
    let _dns = topo.start_dnsmasq(
        RESOLVER_IP,
        DnsRecords::new().host("api.example.com", "203.0.113.10".parse()?),
    )?;
    let agent = start(&topo, &config)?;
    let hidden_dns = r#"redirect_services_hidden_total{lookup="dns"}"#;
    let hidden_outbound = r#"redirect_services_hidden_total{lookup="outbound"}"#;

    // team-a sees its own entry: nothing hidden.
    let before = agent.metrics()?;
    topo.pod("team-a/a1")
        .cmd("dig")
        .args(["+short", "api.example.com"])
        .ok()?;
    let after = agent.metrics()?;
    ensure!(
        delta(&before, &after, hidden_dns) == 0.0,
        "hidden counted for team-a's own entry"
    );

    // team-b does not: one DNS query, one hidden count, one log line saying what happened instead.
    let before = after;
    topo.pod("team-b/b1")
        .cmd("dig")
        .args(["+short", "api.example.com"])
        .ok()?;
    let after = agent.metrics()?;
    ensure!(
        delta(&before, &after, hidden_dns) == 1.0,
        "dns hidden delta {}",
        delta(&before, &after, hidden_dns)
    );
    let logged = |needle: &str| {
        agent.log().lines().any(|l| {
            l.contains("service hidden from client")
                && l.contains(r#"client_namespace="team-b""#)
                && l.contains("service=team-a/api-example")
                && l.contains(needle)
        })
    };
    ensure!(
        logged("forwarded upstream"),
        "no debug line for the hidden DNS answer:\n{}",
        agent.log()
    );

    let body = topo
        .pod("team-b/b1")
        .cmd("curl")
        .args(["-sS", "--max-time", "10", "http://203.0.113.10/"])
        .ok()?
        .stdout_str();
    ensure!(body == "real-api\n", "team-b reached {body:?}");
    // Counted by the proxy at once, or by the kernel and added within 100 ms.
    agent
        .wait_metrics("outbound hidden +1", Duration::from_secs(2), |m| {
            delta(&after, m, hidden_outbound) == 1.0
        })
        .context("outbound hidden not counted")?;
    ensure!(
        logged(r#"instead="passthrough""#),
        "no debug line for the hidden outbound decision"
    );
    agent.stop()
}

#[test]
fn config_service_json_round_trips_with_config_dump() -> Result<()> {
    let topo = Topology::new()?;
    let config = examples_copy(&topo)?;
    let agent = start(&topo, &config)?;
    let dump = config_dump(&agent)?;

    let all: Value = serde_json::from_str(&config_service(&topo, &["-o", "json"])?)?;
    ensure!(
        all == dump["services"],
        "config service -o json differs from /config_dump services"
    );

    let team_a: Value = serde_json::from_str(&config_service(
        &topo,
        &["-o", "json", "--service-namespace", "team-a"],
    )?)?;
    let expected: Vec<Value> = dump["services"]
        .as_array()
        .context("services")?
        .iter()
        .filter(|s| s["namespace"] == "team-a")
        .cloned()
        .collect();
    ensure!(
        !expected.is_empty() && team_a == Value::Array(expected),
        "namespace filter: {team_a}"
    );

    let table = config_service(&topo, &[])?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .context("empty table")?
        .split_whitespace()
        .collect();
    ensure!(
        header
            == [
                "NAMESPACE",
                "SERVICE-NAME",
                "HOSTNAME",
                "VIPS",
                "ENDPOINTS",
                "VISIBILITY"
            ],
        "header: {header:?}"
    );
    ensure!(
        lines.count() == dump["services"].as_array().map_or(0, Vec::len),
        "one row per service:\n{table}"
    );
    ensure!(
        table.lines().any(|l| l.starts_with("team-a")
            && l.contains("api.example.com")
            && l.trim_end().ends_with("Namespace")),
        "team-a's entry row:\n{table}"
    );
    agent.stop()
}

#[test]
fn config_service_renders_an_empty_state() -> Result<()> {
    let topo = Topology::new()?;
    // No --config: the agent holds nothing and passes everything through.
    let agent = Agent::start(&topo, &["--dns-upstream", &format!("{RESOLVER_IP}:53")])?;
    let table = config_service(&topo, &[])?;
    ensure!(
        table
            .lines()
            .next()
            .is_some_and(|h| h.split_whitespace().count() == 6 && h.starts_with("NAMESPACE")),
        "header missing:\n{table}"
    );
    ensure!(
        table.contains("no services"),
        "no explanation for an empty table:\n{table}"
    );
    let json: Value = serde_json::from_str(&config_service(&topo, &["-o", "json"])?)?;
    ensure!(json == Value::Array(vec![]), "{json}");
    agent.stop()
}

/// A configuration directory that cannot be read (not mounted yet) applies nothing: unready until
/// it can be read. (An object in error does not hold readiness back: the rest is in force.)
#[test]
fn ready_only_once_a_configuration_is_in_force() -> Result<()> {
    let topo = Topology::new()?;
    let config = topo.scratch_path("config");
    let upstream = format!("{RESOLVER_IP}:53");
    let mut agent = Agent::spawn(
        &topo,
        &[
            "--config",
            &config.to_string_lossy(),
            "--dns-upstream",
            &upstream,
        ],
    )?;

    // The admin server comes up, reports the refusal, and stays unready.
    let deadline = Instant::now() + Duration::from_secs(20);
    let failed = loop {
        if let Ok(m) = agent.metrics()
            && m.get_or_zero(RELOAD_FAILED) >= 1.0
        {
            break m;
        }
        ensure!(
            Instant::now() < deadline,
            "no failed reload reported; log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    ensure!(failed.get_or_zero(RELOAD_OK) == 0.0);
    ensure!(
        agent.admin_get("/healthz/ready")?.status == 503,
        "ready without a configuration"
    );
    ensure!(
        config_dump(&agent)?["config"]["lastError"]["errors"][0]["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("config"))
    );

    std::fs::create_dir_all(&config)?;
    std::fs::write(
        config.join("ns.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n",
    )?;
    agent.wait_ready()?;
    agent.stop()
}

#[test]
fn the_log_level_changes_at_runtime() -> Result<()> {
    let topo = Topology::new()?;
    let agent = Agent::start(&topo, &["--dns-upstream", &format!("{RESOLVER_IP}:53")])?;
    let current = agent.admin_get("/logging")?;
    ensure!(
        current.status == 200 && current.text().contains("redirect=debug"),
        "{}",
        current.text()
    );
    // Percent-encoded, as curl --data-urlencode or a browser sends it.
    let set = agent.admin_get("/logging?level=warn%2Credirect%3Dtrace")?;
    ensure!(set.status == 200, "{}", set.text());
    let now = agent.admin_get("/logging")?.text();
    ensure!(
        now.contains("warn") && now.contains("redirect=trace"),
        "{now}"
    );
    let bad = agent.admin_get("/logging?level=redirect%3Dloud")?;
    ensure!(bad.status == 400, "invalid filter accepted: {}", bad.text());
    ensure!(
        agent.admin_get("/logging")?.text() == now,
        "a refused filter changed the level"
    );
    agent.stop()
}

/// `redirect config explain | workload | log | all`, asked of the running agent: its explain is the
/// offline one over the same manifests, for a namespace, a pod by name and a pod by address.
#[test]
fn config_explain_workload_log_and_all_ask_the_running_agent() -> Result<()> {
    let w = integration::world::World::start()?;
    let cli = |args: &[&str]| -> Result<String> {
        Ok(w.topo
            .node_cmd(Agent::bin()?)
            .arg("config")
            .args(args)
            .ok()?
            .stdout_str())
    };
    for from in ["team-b", "team-b/b1", "10.244.2.10"] {
        let live: Value = serde_json::from_str(&cli(&[
            "explain",
            "--from",
            from,
            "--host",
            "api.example.com",
            "-o",
            "json",
        ])?)?;
        let offline = w.explain().host("team-b", "api.example.com")?.json;
        ensure!(live["dns"] == offline["dns"], "{from}: {live} vs {offline}");
        ensure!(live["client"]["namespace"] == "team-b", "{live}");
        let live: Value = serde_json::from_str(&cli(&[
            "explain",
            "--from",
            from,
            "--ip",
            "203.0.113.10:80",
            "-o",
            "json",
        ])?)?;
        let offline = w.explain().ip("team-b", "203.0.113.10:80".parse()?)?.json;
        ensure!(
            live["outbound"]["action"] == offline["outbound"]["action"]
                && live["outbound"]["service"] == offline["outbound"]["service"]
                && live["outbound"]["reason"] == offline["outbound"]["reason"],
            "{from}: {live} vs {offline}"
        );
    }
    let table = cli(&[
        "explain",
        "--from",
        "team-a/a1",
        "--host",
        "api.example.com",
    ])?;
    ensure!(
        table.contains("team-a/a1 (pod)") && table.contains("team-a/api-example"),
        "{table}"
    );
    let unknown = w
        .topo
        .node_cmd(Agent::bin()?)
        .args([
            "config",
            "explain",
            "--from",
            "team-a/ghost",
            "--host",
            "a.example.com",
        ])
        .output()?;
    ensure!(!unknown.success() && unknown.stderr_str().contains("no pod team-a/ghost"));

    let workloads = cli(&["workload", "--workload-namespace", "team-a"])?;
    ensure!(
        workloads.contains("a1") && workloads.contains("10.244.1.10"),
        "{workloads}"
    );
    ensure!(!workloads.contains("team-b"), "{workloads}");
    // The client pods are kubelet-style: the agent has found each one's cgroup.
    let a1 = workloads
        .lines()
        .find(|l| l.contains(" a1 "))
        .unwrap_or_default();
    ensure!(a1.trim_end().ends_with("found"), "{workloads}");
    ensure!(cli(&["log", "--level", "warn,redirect=trace"])?.contains("redirect=trace"));
    ensure!(cli(&["log"])?.contains("redirect=trace"));
    let all: Value = serde_json::from_str(&cli(&["all", "-o", "json"])?)?;
    ensure!(
        all["services"].as_array().is_some_and(|s| !s.is_empty()),
        "{all}"
    );
    ensure!(
        all["workloads"].as_array().is_some_and(|s| !s.is_empty()),
        "{all}"
    );
    ensure!(
        all["logLevel"]
            .as_str()
            .is_some_and(|l| l.contains("redirect=trace")),
        "{all}"
    );
    Ok(())
}

/// One access-log line per proxied connection when it ends, with who, where, what and how it
/// ended; none with `--no-access-log`.
#[test]
fn the_access_log_has_one_line_per_proxied_connection() -> Result<()> {
    use integration::{Launch, world::World};
    let w = World::start_with_launched(|_| Ok(()), &Launch::no_fast_path())?;
    w.curl("team-a", "http://api.example.com/")?;
    w.curl("team-b", "http://203.0.113.10/")?;
    let line = |needle: &str| -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(l) = w
                .agent
                .log()
                .lines()
                .find(|l| l.contains("access:") && l.contains(needle))
            {
                return Ok(l.to_string());
            }
            ensure!(
                Instant::now() < deadline,
                "no access line with {needle}:\n{}",
                w.agent.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let a = line("namespace=team-a")?;
    for field in [
        "workload=team-a/a1",
        "orig_dst=203.0.113.10:80",
        "outcome=\"service\"",
        "service=team-a/api-example",
        "endpoint=198.51.100.20:80",
        "end=\"closed\"",
    ] {
        ensure!(a.contains(field), "{field} missing: {a}");
    }
    ensure!(!a.contains("bytes_received=0"), "{a}");
    let b = line("namespace=team-b")?;
    ensure!(
        b.contains("outcome=\"passthrough\"") && b.contains("service=-"),
        "{b}"
    );

    drop(w);
    let quiet = World::start_args(|_| Ok(()), &Launch::no_fast_path(), &["--no-access-log"])?;
    quiet.curl("team-a", "http://api.example.com/")?;
    let m = quiet.agent.metrics()?;
    ensure!(m.get_or_zero(r#"redirect_outbound_connections_total{outcome="service"}"#) >= 1.0);
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        !quiet.agent.log().contains("access:"),
        "{}",
        quiet.agent.log()
    );
    Ok(())
}
