//! `cargo xtask demo`: the whole product on one machine, in a few seconds, for someone who has never
//! heard of ServiceEntry visibility.
//!
//! It builds the agent, creates a throwaway node (network namespaces and cgroups, see tests/src), starts
//! the "world" (web servers that say who they are, a real DNS resolver with the public answers), runs the
//! agent on `examples/`, asks the same names from pods of several namespaces with real `dig` and `curl`,
//! and prints what each namespace got, who answered, and why (`redirect explain`, the same lookups
//! the agent makes). Everything is removed at the end, or on Ctrl-C.
use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context, bail};
use integration::{Agent, DnsRecords, Metrics, Peer, RESOLVER_IP, Topology, world};
use serde_json::Value;

use crate::{build, cmd};

/// team-a's web backend, from examples/; the clients, one per namespace, are `world::CLIENTS`.
const WEB: (&str, &str) = ("team-a/web-1", "10.244.1.20");

/// The world outside the node: (address, what the server answers when asked who it is).
const SERVERS: &[(&str, &str)] = &[
    ("198.51.100.20:80", "api endpoint of team-a's entry"),
    ("203.0.113.10:80", "the real api.example.com"),
    (
        "198.51.100.41:80",
        "shared.example.com, team-b's private copy",
    ),
    (
        "198.51.100.40:80",
        "shared.example.com, team-c's public copy",
    ),
    ("198.51.100.30:80", "metrics, published by istio-system"),
    ("203.0.113.55:80", "the real login.example.com"),
    (
        "198.51.100.200:22",
        "a partner host, on a port partner-net does not declare",
    ),
];

/// What the real DNS says (the upstream resolver every pod's node forwards to).
const PUBLIC_DNS: &[(&str, &str)] = &[
    ("api.example.com", "203.0.113.10"),
    ("shared.example.com", "203.0.113.40"),
    ("metrics.example.com", "203.0.113.30"),
    ("login.example.com", "203.0.113.55"),
];

/// One thing a pod does.
enum Ask {
    /// `dig NAME` (an absolute name, as dig sends it).
    Dig(&'static str),
    /// `curl URL` (glibc resolves the host through the pod's search path).
    Curl(&'static str),
}

const SCRIPT: &[(&str, Ask)] = &[
    ("team-a/a1", Ask::Dig("api.example.com")),
    ("team-b/b1", Ask::Dig("api.example.com")),
    ("team-a/a1", Ask::Curl("http://api.example.com/")),
    ("team-b/b1", Ask::Curl("http://api.example.com/")),
    ("team-b/b1", Ask::Dig("shared.example.com")),
    ("team-a/a1", Ask::Dig("shared.example.com")),
    ("team-b/b1", Ask::Curl("http://shared.example.com/")),
    ("team-a/a1", Ask::Curl("http://shared.example.com/")),
    ("team-b/b1", Ask::Curl("http://metrics.example.com/")),
    ("quarantine/q1", Ask::Dig("login.example.com")),
    ("quarantine/q1", Ask::Curl("http://login.example.com/")),
    ("team-a/a1", Ask::Curl("http://web/")),
    (
        "team-b/b1",
        Ask::Curl("http://web.team-a.svc.cluster.local/"),
    ),
    ("team-c/c1", Ask::Curl("http://198.51.100.200:22/")),
];

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn check_interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: tearing down");
    }
    Ok(())
}

/// One line of the result table.
struct Row {
    namespace: String,
    asked: String,
    got: String,
    answered_by: String,
    why: String,
    /// Did what happened match what `redirect explain` said would happen?
    agrees: bool,
}

pub(crate) fn demo() -> anyhow::Result<()> {
    if !crate::setup::is_root() {
        bail!("the demo creates network namespaces and cgroups and loads eBPF: run it as root");
    }
    // Ctrl-C ends the current step, then everything is torn down by the guards' Drop.
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let (agent_bin, peer_bin) = build::build_with_peer()?;
    // The harness finds its binaries through these (as the integration tests do).
    // SAFETY: single-threaded at this point; nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("REDIRECT_BIN", &agent_bin);
        std::env::set_var("RDT_PEER_BIN", &peer_bin);
    }
    let examples = cmd::workspace_root().join("examples");

    println!(
        "\n== Setting up a throwaway node: network namespaces, one pod per namespace, and the world"
    );
    let mut topo = Topology::new()?;
    for (key, ip, uid) in world::CLIENTS {
        topo.add_kube_pod(key, ip.parse()?, uid)?;
    }
    topo.add_pod(WEB.0, WEB.1.parse()?)?;
    let mut servers = Vec::new();
    for (addr, name) in SERVERS {
        let addr: SocketAddr = addr.parse()?;
        servers.push(topo.start_ext_peer(name, &[addr], &[])?);
    }
    let web = topo.pod("team-a/web-1");
    servers.push(Peer::start(
        web.place(),
        "web-1, team-a's pod behind Service web",
        &["10.244.1.20:8080".parse()?],
        &[],
    )?);
    let mut records = DnsRecords::new();
    for (name, ip) in PUBLIC_DNS {
        records = records.host(name, ip.parse()?);
    }
    let _dns = topo.start_dnsmasq(RESOLVER_IP, records)?;
    check_interrupted()?;

    println!(
        "== Starting the agent on examples/ (NAMESPACE by default; istio-system and trusted team-c publish; quarantine is NONE)"
    );
    let dns_upstream = format!("{RESOLVER_IP}:53");
    let config = examples.to_string_lossy().into_owned();
    let agent = Agent::start(
        &topo,
        &["--config", &config, "--dns-upstream", &dns_upstream],
    )?;

    println!("== Asking from the pods\n");
    let mut rows = Vec::new();
    for (pod, ask) in SCRIPT {
        check_interrupted()?;
        rows.push(run_one(&topo, &agent, &agent_bin, &examples, pod, ask)?);
    }
    print_rows(&rows);

    println!("\n== What the agent holds (`redirect config service`, from its admin server)\n");
    let view = topo
        .node_cmd(&agent_bin)
        .args(["config", "service"])
        .ok()
        .context("redirect config service")?;
    print!("{}", view.stdout_str());

    let disagreements = rows.iter().filter(|r| !r.agrees).count();
    println!();
    agent.stop()?;
    drop(servers);
    if disagreements > 0 {
        bail!("{disagreements} outcome(s) differ from what `redirect explain` predicts (marked !)");
    }
    println!(
        "All {} outcomes match `redirect explain`. Everything the demo created is being removed.",
        rows.len()
    );
    Ok(())
}

fn run_one(
    topo: &Topology,
    agent: &Agent,
    agent_bin: &Path,
    examples: &Path,
    pod: &str,
    ask: &Ask,
) -> anyhow::Result<Row> {
    let namespace = pod.split('/').next().unwrap_or(pod).to_string();
    let before = agent.metrics()?;
    let row = match ask {
        Ask::Dig(name) => {
            let out = topo
                .pod(pod)
                .cmd("dig")
                .args(["+short", "+time=2", "+tries=1", name])
                .output()?;
            let after = agent.metrics()?;
            let answered = delta(
                &before,
                &after,
                r#"redirect_dns_queries_total{outcome="answered"}"#,
            );
            let forwarded = delta(
                &before,
                &after,
                r#"redirect_dns_queries_total{outcome="forwarded"}"#,
            );
            let explain = explain(
                agent_bin,
                examples,
                &namespace,
                &["--host", &format!("{name}.")],
            )?;
            let predicted = explain["dns"]["action"].as_str().unwrap_or("?");
            let observed = if answered == 1.0 {
                "answer"
            } else if forwarded == 1.0 {
                "forward"
            } else {
                "?"
            };
            let got = out
                .stdout_str()
                .lines()
                .last()
                .unwrap_or("(no answer)")
                .to_string();
            Row {
                namespace,
                asked: format!("dig {name}"),
                got,
                answered_by: match observed {
                    "answer" => "the agent (local answer)".into(),
                    "forward" => "the real DNS (forwarded)".into(),
                    _ => "?".into(),
                },
                why: text(&explain["dns"]["reason"]),
                agrees: predicted == observed,
            }
        }
        Ask::Curl(url) => {
            // %{remote_ip}:%{remote_port} is what the pod connected to (getpeername, not the gateway).
            let out = topo
                .pod(pod)
                .cmd("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "5",
                    "-w",
                    "\n%{remote_ip}:%{remote_port}",
                    url,
                ])
                .output()?;
            let after = agent.metrics()?;
            let stdout = out.stdout_str();
            let mut lines: Vec<&str> = stdout.lines().collect();
            let dst = lines.pop().unwrap_or_default().to_string();
            let body = lines.join(" ");
            // Decided by the proxy, or at connect() by the kernel (the agent's default), which
            // counts a service connection as rewritten.
            let counted = |metric: String| delta(&before, &after, &metric) == 1.0;
            let observed = ["service", "workload", "passthrough", "no_healthy_upstream"]
                .into_iter()
                .find(|o| {
                    let kernel = if *o == "service" { "rewritten" } else { o };
                    counted(format!(
                        r#"redirect_outbound_connections_total{{outcome="{o}"}}"#
                    )) || counted(format!(
                        r#"redirect_fast_path_connections_total{{outcome="{kernel}",reason=""}}"#
                    ))
                })
                .unwrap_or("?");
            let dst = if dst.starts_with(':') || dst.is_empty() {
                url.trim_start_matches("http://")
                    .trim_end_matches('/')
                    .to_string()
            } else {
                dst
            };
            let explain = explain(agent_bin, examples, &namespace, &["--ip", &dst])?;
            let predicted = explain["outbound"]["action"].as_str().unwrap_or("?");
            let got = if out.success() {
                body
            } else {
                // "curl: (56) Recv failure: Connection reset by peer" -> "Recv failure: Connection reset by peer"
                let err = out.stderr_str();
                let err = err.trim().trim_start_matches("curl: ");
                let err = err.split_once(") ").map_or(err, |(_, rest)| rest);
                format!("failed: {err}")
            };
            Row {
                namespace,
                asked: format!("curl {url}"),
                got,
                answered_by: match explain["outbound"]["endpoint"].as_str() {
                    Some(endpoint) => format!("{observed}, to {endpoint}"),
                    None => format!("{observed}: reset by the agent"),
                },
                why: text(&explain["outbound"]["reason"]),
                agrees: camel(observed) == predicted,
            }
        }
    };
    Ok(row)
}

/// `redirect explain -o json` for one client: the same lookups the agent just made.
fn explain(
    agent_bin: &Path,
    examples: &Path,
    namespace: &str,
    what: &[&str],
) -> anyhow::Result<Value> {
    let out = Command::new(agent_bin)
        .args(["explain", "-o", "json", "-f"])
        .arg(examples)
        .args(["--from", namespace])
        .args(what)
        .output()
        .context("running redirect explain")?;
    if !out.status.success() {
        bail!(
            "redirect explain failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("redirect explain printed no JSON")
}

fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or("-").to_string()
}

/// The metric label as explain spells the action.
fn camel(outcome: &str) -> &str {
    match outcome {
        "no_healthy_upstream" => "noHealthyUpstream",
        other => other,
    }
}

fn print_rows(rows: &[Row]) {
    let headers = ["#", "NAMESPACE", "ASKED", "GOT", "ANSWERED BY"];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            [
                format!("{}{}", i + 1, if r.agrees { "" } else { "!" }),
                r.namespace.clone(),
                r.asked.clone(),
                r.got.clone(),
                r.answered_by.clone(),
            ]
        })
        .collect();
    let mut widths = headers.map(str::len);
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let text: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(&headers);
    for row in &cells {
        line(&row.each_ref().map(String::as_str));
    }
    println!("\nWhy (`redirect explain`: the same lookups the agent made):");
    for (i, r) in rows.iter().enumerate() {
        println!("{:>3}  {}", i + 1, r.why);
    }
}
