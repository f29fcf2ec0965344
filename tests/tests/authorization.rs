//! Inbound authorization: Istio's `AuthorizationPolicy` and `PeerAuthentication` read from the
//! agent's configuration directory and enforced, as ztunnel does, for connections to the Pods of
//! its node (DENY first, then ALLOW; no ALLOW policy selecting a Pod lets everyone in, some ALLOW
//! policy and no match keeps everyone out).
//!
//! - **Same node**: a Pod's connection to a Pod under some policy is handed to the proxy, which
//!   decides it as the client Pod's identity (`cluster.local/ns/<ns>/sa/<account>`, only when the
//!   kernel confirmed the client's cgroup is its Pod's: every client here is laid out by "kubelet"
//!   with its uid, except c1). A refused connection is accepted, then reset: curl fails at once
//!   ([`reset`]), never hangs.
//! - **HBONE received**: the sender's certificate is the identity; a refused stream is answered
//!   401 and never reaches the Pod.
//! - **Live**: every connection the proxy carries to a Pod of the node is decided again when a new
//!   configuration is in force, and one now denied is reset.
//!
//! Each test builds one node (or two) of its own and changes the policies in the directory under
//! the running agent, waiting for the reload to be reported before it looks.
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use integration::metrics::Metrics;
use integration::pki::TestCa;
use integration::world::{delta, key, replace_file};
use integration::{Agent, Output, Peer, Pod, Proc, Topology, pace, peer};

const TRUST_DOMAIN: &str = "cluster.local";
const DAY: Duration = Duration::from_secs(24 * 3600);

/// A Pod of the test: key, address, `metadata.uid`, labels (a YAML flow map).
type PodDef = (&'static str, &'static str, &'static str, &'static str);

const A1: PodDef = (
    "team-a/a1",
    "10.244.1.10",
    "a1a1a1a1-0000-4000-8000-0000000000a1",
    "{app: client}",
);
const B1: PodDef = (
    "team-b/b1",
    "10.244.2.10",
    "b1b1b1b1-0000-4000-8000-0000000000b1",
    "{app: client}",
);
/// team-a's server: the Pod the policies select (`app: web`).
const WEB: PodDef = (
    "team-a/web-1",
    "10.244.1.20",
    "0eb10eb1-0000-4000-8000-0000000eb001",
    "{app: web}",
);
/// team-c's server, selected by no team's policy.
const DB: PodDef = (
    "team-c/db-1",
    "10.244.3.20",
    "0db10db1-0000-4000-8000-000000000db1",
    "{app: db}",
);
/// A Pod the registry knows (with a uid) but whose processes run in a cgroup that names no Pod:
/// the kernel cannot confirm it, so it has no identity (plaintext).
const C1: PodDef = (
    "team-c/c1",
    "10.244.3.10",
    "0c1c0c1c-0000-4000-8000-0000000000c1",
    "{app: client}",
);

const WEB_HTTP: &str = "10.244.1.20:8080";
const WEB_HTTP2: &str = "10.244.1.20:9090";
const WEB_ECHO: &str = "10.244.1.20:7";
const DB_HTTP: &str = "10.244.3.20:8080";

const OUTBOUND_DENIED: &str = r#"redirect_outbound_connections_total{outcome="denied"}"#;
/// A connection to a Pod carried by the proxy.
const PROXY_WORKLOAD: &str = r#"redirect_outbound_connections_total{outcome="workload"}"#;
/// A connection to a Pod passed directly by the kernel (the fast path).
const KERNEL_WORKLOAD: &str =
    r#"redirect_fast_path_connections_total{outcome="workload",reason=""}"#;
const DECISIONS: &str = "redirect_authorization_decisions_total";
const CLOSED_LOG: &str = "connection closed because it's no longer allowed after a policy update";
const NOT_ALLOWED: &str = "allow policies exist, but none allowed";

/// `redirect_authorization_decisions_total{path,result,policy}`.
fn decision(path: &str, result: &str, policy: &str) -> String {
    format!(r#"{DECISIONS}{{path="{path}",result="{result}",policy="{policy}"}}"#)
}

/// `redirect_hbone_inbound_total{result}`.
fn hbone_inbound(result: &str) -> String {
    format!(r#"redirect_hbone_inbound_total{{result="{result}"}}"#)
}

/// Every decision counted on `path` with `result`, whatever the policy.
fn decisions_sum(m: &Metrics, path: &str, result: &str) -> f64 {
    let (path, result) = (format!(r#"path="{path}""#), format!(r#"result="{result}""#));
    m.samples()
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{DECISIONS}{{")))
        .filter(|(k, _)| k.contains(&path) && k.contains(&result))
        .map(|(_, v)| v)
        .sum()
}

/// Whether the decisions counted on `path` with `result` (any policy) moved by `want` from `before`.
fn counted(
    before: &Metrics,
    path: &'static str,
    result: &'static str,
    want: f64,
) -> impl Fn(&Metrics) -> bool + use<> {
    let before = decisions_sum(before, path, result);
    move |m: &Metrics| decisions_sum(m, path, result) - before == want
}

/// A Pod manifest: its uid and labels, its service account left to the default (`default`), on
/// `node` if given; dual-stack as the topology's Pods are.
fn pod_manifest((key, ip, uid, labels): PodDef, node: Option<&str>) -> String {
    let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
    let v6 = integration::pod_ip6(ip.parse().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED));
    let spec = node.map_or(String::new(), |n| format!("spec: {{nodeName: {n}}}\n"));
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}, labels: {labels}}}\n{spec}status: {{podIP: {ip}, podIPs: [{{ip: {ip}}}, {{ip: \"{v6}\"}}]}}\n"
    )
}

/// An `AuthorizationPolicy` (security.istio.io/`version`) `namespace/name`: `action`, selecting
/// `selector` (matchLabels, a YAML flow map) if given, with `rules` (a YAML flow list).
fn policy(
    version: &str,
    (namespace, name): (&str, &str),
    selector: Option<&str>,
    action: &str,
    rules: &str,
) -> String {
    let selector = selector.map_or(String::new(), |s| {
        format!("  selector:\n    matchLabels: {s}\n")
    });
    format!(
        "apiVersion: security.istio.io/{version}\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{selector}  action: {action}\n  rules: {rules}\n"
    )
}

/// team-a's `deny-b`: DENY from namespace team-b, on web-1.
fn deny_team_b_on_web() -> String {
    policy(
        "v1",
        ("team-a", "deny-b"),
        Some("{app: web}"),
        "DENY",
        "[{from: [{source: {namespaces: [team-b]}}]}]",
    )
}

/// team-a's `allow-all` on web-1: one empty rule, which matches every connection.
fn allow_all_on_web() -> String {
    policy(
        "v1",
        ("team-a", "allow-all"),
        Some("{app: web}"),
        "ALLOW",
        "[{}]",
    )
}

/// The mesh-wide `PeerAuthentication` in the root namespace: STRICT.
const STRICT_MESH_WIDE: &str = "apiVersion: security.istio.io/v1beta1\nkind: PeerAuthentication\nmetadata: {name: default, namespace: istio-system}\nspec:\n  mtls: {mode: STRICT}\n";

/// What a client's connection must come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// The server answered with its name.
    Answered(&'static str),
    /// Accepted, then reset at once ([`reset`]).
    Refused,
}

/// Whether curl's exit code says the connection was reset, never answered nor timed out: 56
/// ("Connection reset by peer"), 52 ("Empty reply"), 55 (the reset came while it sent), or 7
/// (the proxy's reset came before curl saw its connect finish: "Couldn't connect").
fn reset(code: Option<i32>) -> bool {
    matches!(code, Some(7 | 52 | 55 | 56))
}

/// `curl http://addr/` from `pod`, with a bound: a connection that hangs fails the test.
fn curl(pod: &Pod, addr: &str) -> Result<(Output, Duration)> {
    let started = Instant::now();
    let out = pod
        .cmd("curl")
        .args(["-sS", "--max-time", &pace::scaled_secs(10)])
        .arg(format!("http://{addr}/"))
        .output()?;
    Ok((out, started.elapsed()))
}

/// Runs curl from `pod` to `addr` and requires `want`.
fn check(pod: &Pod, addr: &str, want: Want) -> Result<()> {
    let (out, took) = curl(pod, addr)?;
    let what = format!("{} -> {addr}", pod.key());
    match want {
        Want::Answered(name) => ensure!(
            out.success() && out.stdout_str().trim() == name,
            "{what}: want an answer from {name} ({took:?}): {out}"
        ),
        Want::Refused => ensure!(
            reset(out.status.code()),
            "{what}: want the connection reset (curl exit 7, 52, 55 or 56) ({took:?}): {out}"
        ),
    }
    Ok(())
}

/// The `access` log line of a connection: with `outcome`, from `client` (an IP), and its
/// `authorization` field saying `why` (quoted or not).
fn find_access_line(log: &str, outcome: &str, client: &str, why: &str) -> Option<String> {
    log.lines()
        .find(|l| {
            l.contains("access:")
                && l.contains(" connection ")
                && l.contains(&format!("outcome=\"{outcome}\""))
                && l.contains(&format!("client={client}:"))
                && (l.contains(&format!("authorization={why}"))
                    || l.contains(&format!("authorization=\"{why}\"")))
        })
        .map(str::to_string)
}

/// Polls the agent's log (2 s) for the access line [`find_access_line`] describes.
fn wait_access_line(agent: &Agent, outcome: &str, client: &str, why: &str) -> Result<String> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(2));
    loop {
        let log = agent.log();
        if let Some(line) = find_access_line(&log, outcome, client, why) {
            return Ok(line);
        }
        if Instant::now() > deadline {
            let access: Vec<&str> = log.lines().filter(|l| l.contains("access:")).collect();
            bail!(
                "no access-log `connection` line with outcome={outcome:?}, client={client}, authorization={why:?}; the access lines:\n{}",
                access.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One node: a1, b1 (clients), web-1 (HTTP on 8080 and 9090, echo on 7), db-1 (HTTP on 8080), c1
/// (a client the kernel cannot confirm), and an agent reading `config`. Fields drop in order: the
/// agent and the servers before the topology.
struct Node {
    agent: Agent,
    _servers: Vec<Peer>,
    config: PathBuf,
    topo: Topology,
}

impl Node {
    /// The node with `files` (name, contents) in the configuration directory beside the Pods.
    fn start(files: &[(&str, &str)]) -> Result<Node> {
        let mut topo = Topology::new()?;
        for (key, ip, uid, _) in [A1, B1, WEB, DB] {
            topo.add_kube_pod(key, ip.parse()?, uid)?;
        }
        // Not laid out by kubelet: its cgroup names no Pod.
        topo.add_pod(C1.0, C1.1.parse()?)?;
        let servers = vec![
            Peer::start(
                topo.pod(WEB.0).place(),
                "web-1",
                &[WEB_HTTP.parse()?, WEB_HTTP2.parse()?],
                &[WEB_ECHO.parse()?],
            )?,
            Peer::start(topo.pod(DB.0).place(), "db-1", &[DB_HTTP.parse()?], &[])?,
        ];
        let config = topo.scratch_path("config");
        fs::create_dir_all(&config)?;
        let cluster: Vec<String> = [A1, B1, WEB, DB, C1]
            .into_iter()
            .map(|p| pod_manifest(p, None))
            .collect();
        replace_file(&config, "cluster.yaml", &cluster.join("---\n"))?;
        for (name, text) in files {
            replace_file(&config, name, text)?;
        }
        let agent = Agent::start(&topo, &["--config", &config.to_string_lossy()])?;
        Ok(Node {
            agent,
            _servers: servers,
            config,
            topo,
        })
    }

    fn pod(&self, def: PodDef) -> &Pod {
        self.topo.pod(def.0)
    }

    fn check(&self, from: PodDef, addr: &str, want: Want) -> Result<()> {
        check(self.pod(from), addr, want)
    }

    /// Writes `name` into the configuration directory and waits until the agent reports a good
    /// reload; returns when it did.
    fn apply(&self, name: &str, contents: &str) -> Result<Instant> {
        let before = self.agent.metrics()?;
        replace_file(&self.config, name, contents)?;
        wait_reload(&self.agent, &before, name)
    }

    /// Removes `name` from the configuration directory and waits for the reload.
    fn remove(&self, name: &str) -> Result<Instant> {
        let before = self.agent.metrics()?;
        fs::remove_file(self.config.join(name)).with_context(|| format!("removing {name}"))?;
        wait_reload(&self.agent, &before, name)
    }

    /// Waits until the counters moved from `before` as `want` says (`key`, delta), then checks
    /// them exactly: a counter that moves too far fails.
    fn expect_deltas(&self, before: &Metrics, want: &[(&str, f64)]) -> Result<Metrics> {
        let reached = |m: &Metrics| want.iter().all(|(k, d)| delta(before, m, k) >= *d);
        let m =
            self.agent
                .wait_metrics("the decisions counted", Duration::from_secs(2), reached)?;
        for (k, d) in want {
            let got = delta(before, &m, k);
            ensure!(got == *d, "{k} moved by {got}, want {d}; {m:#?}");
        }
        Ok(m)
    }
}

/// Waits (5 s) until `agent` reports a good reload after `before` (a change to `what`).
fn wait_reload(agent: &Agent, before: &Metrics, what: &str) -> Result<Instant> {
    agent
        .wait_metrics(
            &format!("a good reload after the change to {what}"),
            Duration::from_secs(5),
            |m| delta(before, m, key::RELOAD_OK) >= 1.0,
        )
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
    Ok(Instant::now())
}

/// Without any policy every client reaches every port of web-1, and nothing is decided by
/// authorization: the Pod is reached as before.
#[test]
fn without_a_policy_every_client_reaches_every_port() -> Result<()> {
    let n = Node::start(&[])?;
    let before = n.agent.metrics()?;
    for from in [A1, B1] {
        for addr in [WEB_HTTP, WEB_HTTP2] {
            n.check(from, addr, Want::Answered("web-1"))?;
        }
        n.check(from, DB_HTTP, Want::Answered("db-1"))?;
    }
    // Reached as before: with the fast path the kernel decides all six, the proxy none.
    let carried = if n.agent.fast_path() {
        [(KERNEL_WORKLOAD, 6.0), (PROXY_WORKLOAD, 0.0)]
    } else {
        [(KERNEL_WORKLOAD, 0.0), (PROXY_WORKLOAD, 6.0)]
    };
    let m = n.expect_deltas(&before, &carried)?;
    ensure!(
        m.sum(DECISIONS) == before.sum(DECISIONS) && delta(&before, &m, OUTBOUND_DENIED) == 0.0,
        "no policy, nothing decided or denied: {m:#?}"
    );
    Ok(())
}

/// team-a's DENY from namespace team-b on web-1: b1 is reset, a1 is answered; the decisions are
/// counted by policy and the refusal's access-log line names it.
#[test]
fn a_deny_from_a_namespace_resets_that_namespaces_clients_only() -> Result<()> {
    let n = Node::start(&[("deny-b.yaml", &deny_team_b_on_web())])?;
    let before = n.agent.metrics()?;
    n.check(B1, WEB_HTTP, Want::Refused)?;
    n.expect_deltas(
        &before,
        &[
            (&decision("same_node", "denied", "team-a/deny-b"), 1.0),
            (OUTBOUND_DENIED, 1.0),
        ],
    )?;
    wait_access_line(
        &n.agent,
        "denied",
        B1.1,
        "explicitly denied by: team-a/deny-b",
    )?;

    let before = n.agent.metrics()?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(A1, WEB_HTTP2, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision("same_node", "allowed", ""), 2.0),
            (&decision("same_node", "denied", "team-a/deny-b"), 0.0),
            (OUTBOUND_DENIED, 0.0),
            // web-1 is under a policy: the kernel hands its connections to the proxy.
            (PROXY_WORKLOAD, 2.0),
            (KERNEL_WORKLOAD, 0.0),
        ],
    )?;
    // The policy selects web-1 only: b1 still reaches team-c's db-1.
    n.check(B1, DB_HTTP, Want::Answered("db-1"))?;
    Ok(())
}

/// team-a's ALLOW from a1's principal on web-1: a1 is answered (allowed by the policy), b1 is
/// reset because allow policies exist and none allowed it.
#[test]
fn an_allow_for_one_principal_admits_it_and_refuses_everyone_else() -> Result<()> {
    let allow = policy(
        "v1",
        ("team-a", "allow-a"),
        Some("{app: web}"),
        "ALLOW",
        &format!("[{{from: [{{source: {{principals: [{TRUST_DOMAIN}/ns/team-a/sa/default]}}}}]}}]"),
    );
    let n = Node::start(&[("allow-a.yaml", &allow)])?;
    let before = n.agent.metrics()?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(B1, WEB_HTTP, Want::Refused)?;
    n.check(B1, WEB_HTTP2, Want::Refused)?;
    n.expect_deltas(
        &before,
        &[
            (&decision("same_node", "allowed", "team-a/allow-a"), 1.0),
            (&decision("same_node", "denied", ""), 2.0),
            (OUTBOUND_DENIED, 2.0),
        ],
    )?;
    wait_access_line(&n.agent, "denied", B1.1, NOT_ALLOWED)?;
    Ok(())
}

/// A DENY from b1's address (`ipBlocks`, a v1beta1 policy) resets b1 and only b1.
#[test]
fn a_deny_from_an_ip_block_resets_the_client_at_that_address() -> Result<()> {
    let deny = policy(
        "v1beta1",
        ("team-a", "deny-b1-ip"),
        Some("{app: web}"),
        "DENY",
        &format!("[{{from: [{{source: {{ipBlocks: [\"{}/32\"]}}}}]}}]", B1.1),
    );
    let n = Node::start(&[("deny-ip.yaml", &deny)])?;
    let before = n.agent.metrics()?;
    n.check(B1, WEB_HTTP, Want::Refused)?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision("same_node", "denied", "team-a/deny-b1-ip"), 1.0),
            (&decision("same_node", "allowed", ""), 1.0),
        ],
    )?;
    wait_access_line(
        &n.agent,
        "denied",
        B1.1,
        "explicitly denied by: team-a/deny-b1-ip",
    )?;
    Ok(())
}

/// A DENY to port 9090 resets connections to 9090 and answers those to 8080; `notPorts: [8080]`
/// does the same, and so does `when: destination.port`.
#[test]
fn a_deny_to_one_port_resets_that_port_only() -> Result<()> {
    let on_port = |rules: &str| {
        policy(
            "v1",
            ("team-a", "deny-9090"),
            Some("{app: web}"),
            "DENY",
            rules,
        )
    };
    let variants = [
        (
            "ports",
            on_port("[{to: [{operation: {ports: [\"9090\"]}}]}]"),
        ),
        (
            "notPorts",
            on_port("[{to: [{operation: {notPorts: [\"8080\"]}}]}]"),
        ),
        (
            "when destination.port",
            on_port("[{when: [{key: destination.port, values: [\"9090\"]}]}]"),
        ),
    ];
    let n = Node::start(&[])?;
    for (what, text) in variants {
        n.apply("deny-port.yaml", &text)
            .with_context(|| what.to_string())?;
        let before = n.agent.metrics()?;
        for from in [A1, B1] {
            n.check(from, WEB_HTTP, Want::Answered("web-1"))
                .with_context(|| format!("{what}: port 8080"))?;
            n.check(from, WEB_HTTP2, Want::Refused)
                .with_context(|| format!("{what}: port 9090"))?;
        }
        n.expect_deltas(
            &before,
            &[
                (&decision("same_node", "denied", "team-a/deny-9090"), 2.0),
                (&decision("same_node", "allowed", ""), 2.0),
            ],
        )
        .with_context(|| what.to_string())?;
    }
    Ok(())
}

/// An ALLOW rule with an HTTP attribute (`to.operation.methods`) is dropped whole, as for any
/// data plane without a waypoint: the policy then allows nothing, and even a GET is refused,
/// from every client. db-1, selected by no policy, still answers.
#[test]
fn an_allow_on_http_methods_only_refuses_everyone() -> Result<()> {
    let allow_get = policy(
        "v1",
        ("team-a", "allow-get"),
        Some("{app: web}"),
        "ALLOW",
        "[{to: [{operation: {methods: [GET]}}]}]",
    );
    let n = Node::start(&[("allow-get.yaml", &allow_get)])?;
    let before = n.agent.metrics()?;
    for from in [A1, B1] {
        n.check(from, WEB_HTTP, Want::Refused)?;
    }
    n.expect_deltas(
        &before,
        &[
            (&decision("same_node", "denied", ""), 2.0),
            (OUTBOUND_DENIED, 2.0),
        ],
    )?;
    wait_access_line(&n.agent, "denied", A1.1, NOT_ALLOWED)?;
    n.check(A1, DB_HTTP, Want::Answered("db-1"))?;
    Ok(())
}

/// A DENY in the root namespace without a selector applies mesh-wide: b1 is reset by every Pod,
/// of every namespace; a1 is answered by all.
#[test]
fn a_root_namespace_deny_applies_to_every_pod() -> Result<()> {
    let deny = policy(
        "v1",
        ("istio-system", "deny-team-b"),
        None,
        "DENY",
        "[{from: [{source: {namespaces: [team-b]}}]}]",
    );
    let n = Node::start(&[("mesh-deny.yaml", &deny)])?;
    let before = n.agent.metrics()?;
    for addr in [WEB_HTTP, WEB_HTTP2, DB_HTTP] {
        n.check(B1, addr, Want::Refused)?;
    }
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(A1, DB_HTTP, Want::Answered("db-1"))?;
    n.expect_deltas(
        &before,
        &[
            (
                &decision("same_node", "denied", "istio-system/deny-team-b"),
                3.0,
            ),
            (OUTBOUND_DENIED, 3.0),
        ],
    )?;
    wait_access_line(
        &n.agent,
        "denied",
        B1.1,
        "explicitly denied by: istio-system/deny-team-b",
    )?;
    Ok(())
}

/// A mesh-wide STRICT PeerAuthentication: the same node's Pods carry identities (the kernel
/// confirmed their cgroups), so a1 and b1 are still answered; c1, which the kernel cannot
/// confirm, has no identity and is refused.
#[test]
fn strict_mtls_admits_the_same_nodes_pods_and_refuses_a_client_without_identity() -> Result<()> {
    let n = Node::start(&[("strict.yaml", STRICT_MESH_WIDE)])?;
    let before = n.agent.metrics()?;
    for from in [A1, B1] {
        n.check(from, WEB_HTTP, Want::Answered("web-1"))?;
        n.check(from, DB_HTTP, Want::Answered("db-1"))?;
    }
    n.agent.wait_metrics(
        "four connections decided and allowed under STRICT",
        Duration::from_secs(2),
        counted(&before, "same_node", "allowed", 4.0),
    )?;
    let m = n.agent.metrics()?;
    ensure!(
        counted(&before, "same_node", "denied", 0.0)(&m)
            && delta(&before, &m, OUTBOUND_DENIED) == 0.0,
        "none denied: {m:#?}"
    );

    n.check(C1, WEB_HTTP, Want::Refused)?;
    n.agent.wait_metrics(
        "c1's plaintext connection denied",
        Duration::from_secs(2),
        counted(&m, "same_node", "denied", 1.0),
    )?;
    n.expect_deltas(&m, &[(OUTBOUND_DENIED, 1.0)])?;
    Ok(())
}

/// The highest `ok <i>` a `rdt-peer hold` client printed.
fn last_exchange(hold: &Proc) -> Option<u64> {
    hold.log()
        .lines()
        .filter_map(|l| l.strip_prefix("ok ")?.parse().ok())
        .max()
}

/// The hold client is still exchanging lines on its one connection: a few more after now.
fn still_holding(hold: &mut Proc) -> Result<()> {
    let next = last_exchange(hold).map_or(0, |i| i + 3);
    hold.wait_for_log(&format!("ok {next}"), Duration::from_secs(5))
}

/// `rdt-peer hold` from `from` to web-1's echo: one connection exchanging a line every 50 ms.
fn hold(n: &Node, from: PodDef) -> Result<Proc> {
    let mut p = peer::cmd(n.pod(from).place())?
        .args(["hold", WEB_ECHO, "--interval-ms", "50"])
        .spawn()?;
    p.wait_for_log("ok 0", Duration::from_secs(10))?;
    Ok(p)
}

/// Puts team-a's `deny-b` in force under b1's and a1's held connections to web-1: b1's must be
/// reset within a bounded wait after the agent reports the reload, counted `closed` and logged;
/// a1's must go on.
fn deny_b_closes_b1s_connection(n: &Node, held_a1: &mut Proc, held_b1: &mut Proc) -> Result<()> {
    /// The contract: closed within a second of the new configuration in force. Failing only past
    /// this generous bound keeps the test from flaking on a loaded machine.
    const CLOSE_BOUND: Duration = Duration::from_secs(5);
    still_holding(held_b1)?;
    let before = n.agent.metrics()?;
    let written = Instant::now();
    let in_force = n.apply("deny-b.yaml", &deny_team_b_on_web())?;
    let deadline = in_force + pace::scaled(CLOSE_BOUND);
    while held_b1.is_running() {
        ensure!(
            Instant::now() < deadline,
            "b1's connection is still open {:?} after the DENY was in force; its log:\n{}",
            in_force.elapsed(),
            held_b1.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let closed_at = Instant::now();
    eprintln!(
        "b1's connection ended {:?} after the reload was seen ({:?} after the file was written)",
        closed_at - in_force,
        closed_at - written
    );
    let log = held_b1.log();
    ensure!(
        log.contains("Connection reset by peer"),
        "b1's connection was reset, not ended otherwise: {log}"
    );
    n.expect_deltas(
        &before,
        &[(&decision("same_node", "closed", "team-a/deny-b"), 1.0)],
    )?;
    let agent_log = n.agent.log();
    ensure!(
        agent_log
            .lines()
            .any(|l| l.contains(CLOSED_LOG) && l.contains(B1.1)),
        "the agent says why it closed b1's connection; log:\n{agent_log}"
    );
    still_holding(held_a1)
}

/// A DENY put in force under open connections: b1's connection to web-1 (carried by the proxy,
/// since web-1 has an ALLOW-all policy) is reset within a bounded wait, a1's is untouched; the
/// closing is counted and logged. A new connection from b1 is refused; the DENY removed, the next
/// one is answered.
#[test]
fn a_deny_added_under_an_open_connection_closes_it_and_removing_it_admits_again() -> Result<()> {
    let n = Node::start(&[("allow-all.yaml", &allow_all_on_web())])?;
    let mut held_a1 = hold(&n, A1)?;
    let mut held_b1 = hold(&n, B1)?;
    let m = n.agent.metrics()?;
    ensure!(
        m.get_or_zero(&decision("same_node", "allowed", "team-a/allow-all")) == 2.0,
        "both held connections were admitted by team-a/allow-all (so the proxy carries them): {m:#?}"
    );
    deny_b_closes_b1s_connection(&n, &mut held_a1, &mut held_b1)?;

    // New connections: b1 refused, a1 answered.
    n.check(B1, WEB_HTTP, Want::Refused)?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;

    // The DENY removed: b1's next connection is answered; a1's held one never noticed.
    n.remove("deny-b.yaml")?;
    n.check(B1, WEB_HTTP, Want::Answered("web-1"))?;
    still_holding(&mut held_a1)?;
    Ok(())
}

/// The same when web-1 had no policy when the connections opened, so that the kernel connected
/// them directly (`docs/authorization.md#live`: reset in web-1's network namespace with
/// `SOCK_DESTROY`). Beyond the brief this suite was written to, which called this a known gap;
/// the agent's documentation now says it is done.
#[test]
fn a_deny_added_under_a_connection_the_kernel_passed_directly_closes_it() -> Result<()> {
    let n = Node::start(&[])?;
    let before = n.agent.metrics()?;
    let mut held_a1 = hold(&n, A1)?;
    let mut held_b1 = hold(&n, B1)?;
    if n.agent.fast_path() {
        n.expect_deltas(&before, &[(KERNEL_WORKLOAD, 2.0), (PROXY_WORKLOAD, 0.0)])
            .context("both held connections passed directly by the kernel")?;
    }
    deny_b_closes_b1s_connection(&n, &mut held_a1, &mut held_b1)?;
    n.check(B1, WEB_HTTP, Want::Refused)?;
    Ok(())
}

const NODE_A1: PodDef = (
    "team-a/a1",
    "10.244.1.10",
    "a1a1a1a1-0000-4000-8000-0000000000a1",
    "{app: client}",
);
const NODE_B1: PodDef = (
    "team-b/b1",
    "10.244.2.20",
    "b1b1b1b1-0000-4000-8000-0000000000b1",
    "{app: web-b}",
);
const NODE_B1_WEB: &str = "10.244.2.20:8080";
const NODE_B1_SINK: &str = "10.244.2.20:9001";
const NODE_B1_SOURCE: &str = "10.244.2.20:9000";

/// Two nodes joined by HBONE (`between_nodes.rs`): a1 on node a, b1 on node b serving HTTP and a
/// sink (which prints `sink eof N` for each stream that reaches it). Both agents read the same
/// policies (a cluster's). Fields drop in order.
struct Nodes {
    agent_a: Agent,
    agent_b: Agent,
    sink: Peer,
    _web: Peer,
    ca: TestCa,
    config_a: PathBuf,
    config_b: PathBuf,
    a: Topology,
    _b: Topology,
}

impl Nodes {
    fn start() -> Result<Nodes> {
        let mut a = Topology::new()?;
        a.add_kube_pod(NODE_A1.0, NODE_A1.1.parse()?, NODE_A1.2)?;
        let mut b = Topology::new()?;
        b.add_kube_pod(NODE_B1.0, NODE_B1.1.parse()?, NODE_B1.2)?;
        Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
        let ca = TestCa::new(TRUST_DOMAIN)?;
        let web = Peer::start(
            b.pod(NODE_B1.0).place(),
            "web-b1",
            &[NODE_B1_WEB.parse()?],
            &[],
        )?;
        let sink = Peer::start_streams(
            b.pod(NODE_B1.0).place(),
            "sink-b1",
            NODE_B1_SOURCE.parse()?,
            NODE_B1_SINK.parse()?,
        )?;
        let cluster = [
            pod_manifest(NODE_A1, Some("node-a")),
            pod_manifest(NODE_B1, Some("node-b")),
        ]
        .join("---\n");
        let start = |topo: &Topology, node: &str| -> Result<(Agent, PathBuf)> {
            let identities = topo.scratch_path("identities");
            ca.write_identity_dir(
                &identities,
                &[("team-a", "default"), ("team-b", "default")],
                DAY,
            )?;
            let config = topo.scratch_path("config");
            fs::create_dir_all(&config)?;
            replace_file(&config, "cluster.yaml", &cluster)?;
            let agent = Agent::start(
                topo,
                &[
                    "--config",
                    &config.to_string_lossy(),
                    "--identity-dir",
                    &identities.to_string_lossy(),
                    "--node-name",
                    node,
                    "--hbone-between-nodes",
                ],
            )?;
            Ok((agent, config))
        };
        let (agent_a, config_a) = start(&a, "node-a")?;
        let (agent_b, config_b) = start(&b, "node-b")?;
        Ok(Nodes {
            agent_a,
            agent_b,
            sink,
            _web: web,
            ca,
            config_a,
            config_b,
            a,
            _b: b,
        })
    }

    /// Writes `name` into both nodes' directories and waits until both agents reloaded.
    fn apply(&self, name: &str, contents: &str) -> Result<()> {
        let before = (self.agent_a.metrics()?, self.agent_b.metrics()?);
        replace_file(&self.config_a, name, contents)?;
        replace_file(&self.config_b, name, contents)?;
        wait_reload(&self.agent_a, &before.0, name)?;
        wait_reload(&self.agent_b, &before.1, name)?;
        Ok(())
    }

    /// `rdt-peer hbone-client` from node a's netns to b1's HBONE port as `team-a/default`,
    /// sending a line to b1's sink: its output, and whether it succeeded.
    fn hbone_to_sink(&self, name: &str) -> Result<(String, bool)> {
        let files = self.a.scratch_path(name);
        let tls = self
            .ca
            .write_server_files(&files, "team-a", "default", DAY)?;
        let out = peer::cmd(self.a.node())?
            .args(["hbone-client", "--connect", &format!("{}:15008", NODE_B1.1)])
            .args(tls)
            .args(["--authority", NODE_B1_SINK, "--send", "hello\n"])
            .output()?;
        Ok((
            format!("{}{}", out.stdout_str(), out.stderr_str()),
            out.success(),
        ))
    }

    /// How many streams reached b1's sink.
    fn sink_streams(&self) -> usize {
        self.sink
            .log()
            .lines()
            .filter(|l| l.starts_with("sink "))
            .count()
    }
}

/// Over HBONE: a1 reaches b1 with no policy and under a mesh-wide STRICT PeerAuthentication (the
/// sender's certificate is its identity); team-b's DENY from team-a on b1 then makes node b's
/// agent answer a1's streams 401: curl is reset at once, a stream never reaches b1, and node b
/// counts the refusals.
#[test]
fn over_hbone_the_receiving_node_refuses_a_denied_peer_with_401() -> Result<()> {
    let n = Nodes::start()?;
    let a1 = n.a.pod(NODE_A1.0);
    check(a1, NODE_B1_WEB, Want::Answered("web-b1")).context("no policy")?;
    let (out, ok) = n.hbone_to_sink("no-policy")?;
    ensure!(ok && out.contains("status 200"), "no policy: {out}");

    n.apply("strict.yaml", STRICT_MESH_WIDE)?;
    let before = n.agent_b.metrics()?;
    check(a1, NODE_B1_WEB, Want::Answered("web-b1")).context("STRICT")?;
    let (out, ok) = n.hbone_to_sink("strict")?;
    ensure!(ok && out.contains("status 200"), "STRICT: {out}");
    let m = n.agent_b.metrics()?;
    ensure!(
        decisions_sum(&m, "hbone", "allowed") - decisions_sum(&before, "hbone", "allowed") == 2.0
            && delta(&before, &m, &hbone_inbound("denied")) == 0.0,
        "node b decided both streams under STRICT and allowed them: {m:#?}"
    );
    let reached = n.sink_streams();
    ensure!(
        reached == 2,
        "two streams reached b1's sink: {}",
        n.sink.log()
    );

    let deny = policy(
        "v1",
        ("team-b", "deny-a"),
        Some("{app: web-b}"),
        "DENY",
        "[{from: [{source: {namespaces: [team-a]}}]}]",
    );
    n.apply("deny-a.yaml", &deny)?;
    let before = n.agent_b.metrics()?;
    let before_a = n.agent_a.metrics()?;
    let (out, took) = curl(a1, NODE_B1_WEB)?;
    ensure!(
        reset(out.status.code()),
        "a1 -> b1 under team-b/deny-a: want the connection reset (curl exit 7, 52, 55 or 56) ({took:?}): {out}"
    );
    ensure!(
        took < pace::scaled(Duration::from_secs(5)),
        "a1's refusal took {took:?}"
    );
    let (out, ok) = n.hbone_to_sink("denied")?;
    ensure!(
        !ok && out.contains("status 401"),
        "a stream from team-a to b1 under team-b/deny-a: {out}"
    );
    let m = n
        .agent_b
        .wait_metrics("both streams refused", Duration::from_secs(2), |m| {
            delta(&before, m, &hbone_inbound("denied")) >= 2.0
        })?;
    for (k, want) in [
        (hbone_inbound("denied"), 2.0),
        (hbone_inbound("ok"), 0.0),
        (decision("hbone", "denied", "team-b/deny-a"), 2.0),
    ] {
        let got = delta(&before, &m, &k);
        ensure!(
            got == want,
            "node b: {k} moved by {got}, want {want}; {m:#?}"
        );
    }
    // The sending side saw the 401 for a1's tunnel and reset a1.
    let tunnel_refused = r#"redirect_hbone_tunnels_total{result="status"}"#;
    let m = n.agent_a.metrics()?;
    ensure!(
        delta(&before_a, &m, tunnel_refused) == 1.0,
        "node a: {tunnel_refused} moved by {}, want 1; {m:#?}",
        delta(&before_a, &m, tunnel_refused)
    );
    std::thread::sleep(Duration::from_millis(200));
    ensure!(
        n.sink_streams() == reached,
        "a refused stream reached b1's sink: {}",
        n.sink.log()
    );
    Ok(())
}

/// One (client, destination) pair of an [`explain_agrees_with_the_agent_on_every_policy_case`]
/// case: the client Pod, the destination, whether it must be allowed, the policy that must decide
/// (`""` when none does), and the dry-run policy it must match (`namespace/name (ACTION)`, or `""`).
type Pair = (PodDef, &'static str, bool, &'static str, &'static str);

/// The policy that decided, as a verdict names it: `allowed by: X` and `explicitly denied by: X`
/// name X; the other verdicts none (`""`).
fn deciding_policy(verdict: &str) -> &str {
    verdict
        .strip_prefix("explicitly denied by: ")
        .or_else(|| verdict.strip_prefix("allowed by: "))
        .unwrap_or("")
}

/// Every `redirect_authorization_decisions_total` counter that moved from `before` to `after`,
/// with how far.
fn decisions_moved(before: &Metrics, after: &Metrics) -> Vec<(String, f64)> {
    after
        .samples()
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{DECISIONS}{{")))
        .map(|(k, _)| (k.clone(), delta(before, after, k)))
        .filter(|(_, d)| *d != 0.0)
        .collect()
}

/// The text the agent logged after the first `from` bytes.
fn log_since(agent: &Agent, from: usize) -> String {
    let log = agent.log();
    log.get(from..).unwrap_or(&log).to_string()
}

/// Polls the agent's log (2 s) past its first `from` bytes for the access line of a connection
/// [`find_access_line`] describes, its `authorization` exactly `why` (not merely starting so).
fn wait_new_access_line(
    agent: &Agent,
    from: usize,
    outcome: &str,
    client: &str,
    why: &str,
) -> Result<String> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(2));
    loop {
        let log = log_since(agent, from);
        let exact = |l: &&str| {
            l.contains(&format!("authorization={why} "))
                || l.contains(&format!("authorization=\"{why}\""))
        };
        let lines = log.lines().filter(exact).collect::<Vec<_>>().join("\n");
        if let Some(line) = find_access_line(&lines, outcome, client, why) {
            return Ok(line);
        }
        if Instant::now() > deadline {
            let access: Vec<&str> = log.lines().filter(|l| l.contains("access:")).collect();
            bail!(
                "no new access-log `connection` line with outcome={outcome:?}, client={client}, authorization={why:?}; the new access lines:\n{}",
                access.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Offline `redirect explain` over the agent's own directory says what the case means for `pair`
/// (pinned), then the live agent does the same: curl is answered exactly when explain allows, the
/// decision is counted under the policy explain names (and the dry-run policy it lists), carried
/// by whom explain says, and the access line's `authorization` is explain's verdict, word for word.
fn explain_and_agent_agree(
    n: &Node,
    explain: &integration::explain::Explain,
    pair: Pair,
) -> Result<()> {
    use integration::explain::DecidedBy;
    let (from, to, want_allowed, want_by, want_dry_run) = pair;
    let (namespace, _) = from.0.split_once('/').context("a Pod key")?;
    let v = explain.ip_from_pod(from.0, to.parse()?)?;
    let what = format!("{} -> {to}", from.0);
    let authz = v.authorization.as_ref().with_context(|| {
        format!(
            "{what}: explain has no authorization for a Pod of the node: {}",
            v.json
        )
    })?;

    // What explain says, pinned to what the case means.
    let identity = format!("spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/default");
    ensure!(
        authz.over.as_str() == "same-node"
            && authz.identity.as_deref() == Some(identity.as_str())
            && authz.decided_in == "kernel",
        "{what}: explain decides as the Pod's identity on the same node, enforced: {}",
        v.json
    );
    ensure!(
        authz.allowed == want_allowed && deciding_policy(&authz.verdict) == want_by,
        "{what}: explain says allowed={} by {:?} ({}), want allowed={want_allowed} by {want_by:?}: {}",
        authz.allowed,
        deciding_policy(&authz.verdict),
        authz.verdict,
        v.json
    );
    let dry_run: Vec<&str> = authz.dry_run.iter().map(String::as_str).collect();
    let want_dry: Vec<&str> = [want_dry_run]
        .into_iter()
        .filter(|d| !d.is_empty())
        .collect();
    ensure!(
        dry_run == want_dry,
        "{what}: explain's dry-run matches {dry_run:?}, want {want_dry:?}: {}",
        v.json
    );
    let under_policy = !authz.policies.is_empty();
    ensure!(
        (v.decided_by == DecidedBy::Proxy) == under_policy,
        "{what}: explain hands the connection to the proxy exactly when the Pod is under policy: {}",
        v.json
    );

    // The live agent.
    let server = if to == DB_HTTP { "db-1" } else { "web-1" };
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    let (out, took) = curl(n.pod(from), to)?;
    let answered = out.success() && out.stdout_str().trim() == server;
    ensure!(
        answered || reset(out.status.code()),
        "{what}: neither answered by {server} nor reset ({took:?}): {out}"
    );
    ensure!(
        answered == authz.allowed,
        "{what}: the agent {} it ({took:?}: {out}) but explain says {:?}: {}",
        if answered { "answered" } else { "reset" },
        authz.verdict,
        v.json
    );

    // Counted as explain says: the deciding policy, the dry run, and who carried it.
    let mut want: Vec<(String, f64)> = Vec::new();
    if under_policy {
        let result = if authz.allowed { "allowed" } else { "denied" };
        want.push((
            decision("same_node", result, deciding_policy(&authz.verdict)),
            1.0,
        ));
        want.extend(
            authz
                .dry_run
                .iter()
                .map(|d| (decision("same_node", "dry_run", d), 1.0)),
        );
    }
    let carrier = match (v.decided_by, n.agent.fast_path(), authz.allowed) {
        (_, _, false) => OUTBOUND_DENIED,
        (DecidedBy::Kernel, true, true) => KERNEL_WORKLOAD,
        _ => PROXY_WORKLOAD,
    };
    let carriers = [OUTBOUND_DENIED, KERNEL_WORKLOAD, PROXY_WORKLOAD];
    let m = n
        .agent
        .wait_metrics(
            &format!("{what}: its decision and its carrier counted"),
            Duration::from_secs(2),
            |m| {
                delta(&before, m, carrier) >= 1.0
                    && want.iter().all(|(k, d)| delta(&before, m, k) >= *d)
            },
        )
        .with_context(|| format!("{what}: explain said {}", v.json))?;
    // The counters are keyed with their labels in a canonical order: each wanted one is read
    // through `delta`, and nothing else moved.
    let moved = decisions_moved(&before, &m);
    let moved_total: f64 = moved.iter().map(|(_, d)| d).sum();
    let want_total: f64 = want.iter().map(|(_, d)| d).sum();
    ensure!(
        want.iter().all(|(k, d)| delta(&before, &m, k) == *d) && moved_total == want_total,
        "{what}: the decisions counted {moved:?}, want {want:?} (explain: {:?})",
        authz.verdict
    );
    for k in carriers {
        let (got, want) = (delta(&before, &m, k), if k == carrier { 1.0 } else { 0.0 });
        ensure!(
            got == want,
            "{what}: {k} moved by {got}, want {want}; explain: {}",
            v.json
        );
    }

    // The access line of a connection the proxy decided says explain's verdict.
    if under_policy {
        let outcome = if authz.allowed { "workload" } else { "denied" };
        wait_new_access_line(&n.agent, log_from, outcome, from.1, &authz.verdict)
            .with_context(|| what.clone())?;
    }
    Ok(())
}

/// Offline `redirect explain` (over the agent's own directory, client Pods named so that the
/// identity is theirs) and the live agent agree on each of eleven policy cases, put in force one
/// after the other under one agent: for each (client, destination) pair curl is answered exactly
/// when explain's `authorization.allowed` says, the decision is counted under the policy explain's
/// verdict names, and the access log's `authorization` is explain's verdict. Each pair is also
/// pinned to what the case means, so that the two cannot agree on a wrong answer.
#[test]
fn explain_agrees_with_the_agent_on_every_policy_case() -> Result<()> {
    let web_deny =
        |name: &str, rules: &str| policy("v1", ("team-a", name), Some("{app: web}"), "DENY", rules);
    let allow_a = policy(
        "v1",
        ("team-a", "allow-a"),
        Some("{app: web}"),
        "ALLOW",
        &format!("[{{from: [{{source: {{principals: [{TRUST_DOMAIN}/ns/team-a/sa/default]}}}}]}}]"),
    );
    let deny_ip = policy(
        "v1beta1",
        ("team-a", "deny-b1-ip"),
        Some("{app: web}"),
        "DENY",
        &format!("[{{from: [{{source: {{ipBlocks: [\"{}/32\"]}}}}]}}]", B1.1),
    );
    let allow_get = policy(
        "v1",
        ("team-a", "allow-get"),
        Some("{app: web}"),
        "ALLOW",
        "[{to: [{operation: {methods: [GET]}}]}]",
    );
    let root_deny = policy(
        "v1",
        ("istio-system", "deny-team-b"),
        None,
        "DENY",
        "[{from: [{source: {namespaces: [team-b]}}]}]",
    );
    let dry_run = deny_team_b_on_web().replace(
        "metadata: {name: deny-b, namespace: team-a}",
        "metadata: {name: deny-b-dry, namespace: team-a, annotations: {istio.io/dry-run: \"true\"}}",
    );
    ensure!(dry_run.contains("istio.io/dry-run"), "{dry_run}");
    const DENY_B: &str = "team-a/deny-b";
    const DENY_9090: &str = "team-a/deny-9090";
    const ROOT_DENY: &str = "istio-system/deny-team-b";
    let cases: Vec<(&str, String, Vec<Pair>)> = vec![
        (
            "DENY from namespace team-b",
            deny_team_b_on_web(),
            vec![
                (B1, WEB_HTTP, false, DENY_B, ""),
                (A1, WEB_HTTP, true, "", ""),
            ],
        ),
        (
            "ALLOW by a1's principal",
            allow_a,
            vec![
                (A1, WEB_HTTP, true, "team-a/allow-a", ""),
                (B1, WEB_HTTP, false, "", ""),
            ],
        ),
        (
            "DENY from b1's ipBlock",
            deny_ip,
            vec![
                (B1, WEB_HTTP, false, "team-a/deny-b1-ip", ""),
                (A1, WEB_HTTP, true, "", ""),
            ],
        ),
        (
            "DENY to ports [9090]",
            web_deny("deny-9090", "[{to: [{operation: {ports: [\"9090\"]}}]}]"),
            vec![
                (A1, WEB_HTTP2, false, DENY_9090, ""),
                (A1, WEB_HTTP, true, "", ""),
            ],
        ),
        (
            "DENY to notPorts [8080]",
            web_deny("deny-9090", "[{to: [{operation: {notPorts: [\"8080\"]}}]}]"),
            vec![
                (B1, WEB_HTTP2, false, DENY_9090, ""),
                (B1, WEB_HTTP, true, "", ""),
            ],
        ),
        (
            "DENY when destination.port 9090",
            web_deny(
                "deny-9090",
                "[{when: [{key: destination.port, values: [\"9090\"]}]}]",
            ),
            vec![
                (A1, WEB_HTTP2, false, DENY_9090, ""),
                (B1, WEB_HTTP, true, "", ""),
            ],
        ),
        (
            "ALLOW on HTTP methods only",
            allow_get,
            vec![
                (A1, WEB_HTTP, false, "", ""),
                (B1, WEB_HTTP2, false, "", ""),
                (B1, DB_HTTP, true, "", ""),
            ],
        ),
        (
            "root-namespace DENY from team-b",
            root_deny,
            vec![
                (B1, DB_HTTP, false, ROOT_DENY, ""),
                (B1, WEB_HTTP, false, ROOT_DENY, ""),
                (A1, DB_HTTP, true, "", ""),
            ],
        ),
        (
            "mesh-wide STRICT, clients with identities",
            STRICT_MESH_WIDE.to_string(),
            vec![(B1, WEB_HTTP, true, "", ""), (A1, DB_HTTP, true, "", "")],
        ),
        (
            "DENY beside ALLOW-all",
            format!("{}---\n{}", deny_team_b_on_web(), allow_all_on_web()),
            vec![
                (B1, WEB_HTTP, false, DENY_B, ""),
                (A1, WEB_HTTP, true, "team-a/allow-all", ""),
            ],
        ),
        (
            "dry-run DENY from team-b",
            dry_run,
            vec![
                (B1, WEB_HTTP, true, "", "team-a/deny-b-dry (DENY)"),
                (A1, WEB_HTTP, true, "", ""),
            ],
        ),
    ];
    let n = Node::start(&[])?;
    let explain = integration::explain::Explain::new(&n.config)?;
    let mut disagreements = Vec::new();
    for (what, text, pairs) in cases {
        n.apply("policy.yaml", &text)
            .with_context(|| format!("{what}: putting the policy in force"))?;
        for pair in pairs {
            if let Err(e) = explain_and_agent_agree(&n, &explain, pair) {
                disagreements.push(format!("{what}: {e:#}"));
            }
        }
    }
    ensure!(
        disagreements.is_empty(),
        "{} pair(s) where explain, the case and the agent disagree:\n{}",
        disagreements.len(),
        disagreements.join("\n\n")
    );
    Ok(())
}

/// The policies `/config_dump` lists for the Pod `namespace/name` of the node (none when it has
/// none).
fn dumped_policies(agent: &Agent, (namespace, name): (&str, &str)) -> Result<Vec<String>> {
    let r = agent.admin_get("/config_dump")?;
    ensure!(r.status == 200, "/config_dump answered {}", r.status);
    let dump: serde_json::Value =
        serde_json::from_slice(&r.body).context("/config_dump is not JSON")?;
    let pods = dump["authorization"]["pods"]
        .as_array()
        .with_context(|| format!("no authorization.pods in /config_dump: {dump:#}"))?;
    Ok(pods
        .iter()
        .filter(|p| p["namespace"] == namespace && p["name"] == name)
        .flat_map(|p| p["policies"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p.as_str().map(str::to_string))
        .collect())
}

/// Waits (5 s) until `/config_dump` says `policy` does (`want`) or does not apply to web-1 and a
/// configuration was put in force whole (its fast-path tables written) since `before`: the
/// agent counts a load only then. Returns how long it took.
fn wait_web_policy(agent: &Agent, before: &Metrics, policy: &str, want: bool) -> Result<Duration> {
    let started = Instant::now();
    let deadline = started + pace::scaled(Duration::from_secs(5));
    loop {
        let policies = dumped_policies(agent, ("team-a", "web-1"))?;
        let reloaded = delta(before, &agent.metrics()?, key::RELOAD_OK) >= 1.0;
        if policies.iter().any(|p| p == policy) == want && reloaded {
            return Ok(started.elapsed());
        }
        if Instant::now() > deadline {
            bail!(
                "web-1's policies are {policies:?} (a load counted since: {reloaded}) {:?} after the change; want {policy} {}; agent log:\n{}",
                started.elapsed(),
                if want { "among them" } else { "gone" },
                agent.log()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The same policies from the Kubernetes API (`run --kube` with a node name): the agent watches
/// the test API server, which serves a1, b1 and web-1 on its node. team-a's `deny-b` put through
/// the API resets b1's connections to web-1 and answers a1's, counted and logged under its name;
/// deleted through the API, b1 is answered again, and nothing more is decided.
#[test]
fn a_deny_put_through_the_kubernetes_api_resets_its_clients_until_deleted() -> Result<()> {
    const NODE: &str = "node-1";
    // Dropped in reverse: the agent, the API server, the server, then the topology.
    let mut topo = Topology::new()?;
    for (key, ip, uid, _) in [A1, B1, WEB] {
        topo.add_kube_pod(key, ip.parse()?, uid)?;
    }
    let _web = Peer::start(
        topo.pod(WEB.0).place(),
        "web-1",
        &[WEB_HTTP.parse()?, WEB_HTTP2.parse()?],
        &[],
    )?;
    let cluster = topo.scratch_path("cluster");
    fs::create_dir_all(&cluster)?;
    let objects: Vec<String> = ["team-a", "team-b", "istio-system"]
        .into_iter()
        .map(|ns| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}}}\n"))
        .chain(
            [A1, B1, WEB]
                .into_iter()
                .map(|p| pod_manifest(p, Some(NODE))),
        )
        .collect();
    replace_file(&cluster, "cluster.yaml", &objects.join("---\n"))?;
    let api = integration::apiserver::ApiServer::start(&topo.node().netns)?;
    api.sync_dir(&cluster)?;
    let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
    let agent = Agent::start(
        &topo,
        &[
            "--kube",
            "--kubeconfig",
            &kubeconfig.to_string_lossy(),
            "--node-name",
            NODE,
        ],
    )?;
    let check = |from: PodDef, addr: &str, want: Want| check(topo.pod(from.0), addr, want);
    // The agent watches the security kinds, at the version served, and has listed them.
    let r = agent.admin_get("/config_dump")?;
    let dump: serde_json::Value =
        serde_json::from_slice(&r.body).context("/config_dump is not JSON")?;
    for kind in ["AuthorizationPolicy", "PeerAuthentication"] {
        let watch = dump["config"]["watches"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["kind"] == kind))
            .with_context(|| format!("no watch of {kind} in /config_dump: {dump:#}"))?;
        ensure!(
            watch["synced"] == true && watch["apiVersion"] == "security.istio.io/v1",
            "{kind}: {watch}"
        );
    }

    // No policy yet: both answered, nothing decided.
    let before = agent.metrics()?;
    check(A1, WEB_HTTP, Want::Answered("web-1")).context("no policy")?;
    check(B1, WEB_HTTP, Want::Answered("web-1")).context("no policy")?;
    ensure!(
        decisions_moved(&before, &agent.metrics()?).is_empty(),
        "no policy, nothing decided"
    );

    // team-a's deny-b through the API.
    let before = agent.metrics()?;
    api.put(serde_json::json!({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-b", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "action": "DENY",
                 "rules": [{"from": [{"source": {"namespaces": ["team-b"]}}]}]}
    }))?;
    let took = wait_web_policy(&agent, &before, "team-a/deny-b", true)?;
    eprintln!("team-a/deny-b in force {took:?} after it was put");
    let before = agent.metrics()?;
    check(B1, WEB_HTTP, Want::Refused).context("under team-a/deny-b from the API")?;
    check(B1, WEB_HTTP2, Want::Refused).context("under team-a/deny-b from the API")?;
    check(A1, WEB_HTTP, Want::Answered("web-1")).context("under team-a/deny-b from the API")?;
    let m = agent.wait_metrics(
        "b1's two refusals and a1's admission counted",
        Duration::from_secs(2),
        |m| {
            delta(
                &before,
                m,
                &decision("same_node", "denied", "team-a/deny-b"),
            ) >= 2.0
                && delta(&before, m, &decision("same_node", "allowed", "")) >= 1.0
        },
    )?;
    for (k, want) in [
        (decision("same_node", "denied", "team-a/deny-b"), 2.0),
        (decision("same_node", "allowed", ""), 1.0),
        (OUTBOUND_DENIED.to_string(), 2.0),
    ] {
        let got = delta(&before, &m, &k);
        ensure!(got == want, "{k} moved by {got}, want {want}; {m:#?}");
    }
    wait_access_line(
        &agent,
        "denied",
        B1.1,
        "explicitly denied by: team-a/deny-b",
    )?;

    // Deleted through the API: b1 is answered again, and web-1 is no longer decided.
    let before = agent.metrics()?;
    ensure!(
        api.delete("AuthorizationPolicy", "team-a", "deny-b")?,
        "the API server held team-a/deny-b"
    );
    let took = wait_web_policy(&agent, &before, "team-a/deny-b", false)?;
    eprintln!("team-a/deny-b gone {took:?} after it was deleted");
    let before = agent.metrics()?;
    check(B1, WEB_HTTP, Want::Answered("web-1")).context("team-a/deny-b deleted")?;
    check(A1, WEB_HTTP, Want::Answered("web-1")).context("team-a/deny-b deleted")?;
    let m = agent.metrics()?;
    ensure!(
        decisions_moved(&before, &m).is_empty() && delta(&before, &m, OUTBOUND_DENIED) == 0.0,
        "no policy left: nothing decided or denied; {m:#?}"
    );
    Ok(())
}
