//! Inbound authorization: Istio's `AuthorizationPolicy` and `PeerAuthentication` read from the
//! agent's configuration directory and enforced, as ztunnel does, for connections to the Pods of
//! its node (DENY first, then ALLOW; no ALLOW policy selecting a Pod lets everyone in, some ALLOW
//! policy and no match keeps everyone out).
//!
//! - **In the kernel**: an sk_lookup program in each guarded Pod's network namespace decides
//!   every connection that is not HBONE, whoever makes it: a Pod of the same node (as its identity,
//!   `cluster.local/ns/<ns>/sa/<account>`, when the registry holds it with a uid), a Pod of another
//!   node in plaintext, the node itself (no identity). A refused connection finds no listening
//!   socket: its SYN is answered with a reset and curl fails at once with exit 7. The fast path
//!   leaves same-node connections to a guarded Pod alone; the decisions are counted
//!   `path="kernel"` and each refusal has an access line `inbound ... decided_by="kernel"`.
//! - **Through the proxy**: a client the kernel cannot tie to its Pod (c1, whose cgroup names no
//!   Pod) is handed to the proxy, which decides it as plaintext (`path="same_node"`): accepted,
//!   then reset. With `--no-fast-path` (`REDIRECT_FAST_PATH=0`) the proxy carries and decides
//!   every same-node connection this way.
//! - **HBONE received**: the sender's certificate is the identity; a refused stream is answered
//!   401 and never reaches the Pod; the agent's own dial of an admitted one passes the kernel.
//! - **Live**: an open connection a new configuration denies is reset (`SOCK_DESTROY` in the
//!   Pod's namespace for one the kernel passed).
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
use integration::{Agent, Cmd, Launch, Output, Peer, Pod, Proc, Topology, pace, peer};

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
/// A connection the fast path hands to the proxy because its client's cgroup names no Pod.
const UNKNOWN_CLIENT: &str =
    r#"redirect_fast_path_connections_total{outcome="proxy",reason="unknown_client"}"#;
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
    /// Refused at once, where the proxy carries it: accepted, then reset ([`reset`]).
    Refused,
    /// Refused at its SYN by the kernel: curl exit 7 ("Couldn't connect"), at once.
    RefusedAtConnect,
}

/// Whether curl's exit code says the connection was refused or reset, never answered nor timed
/// out: 56 ("Connection reset by peer"), 52 ("Empty reply"), 55 (the reset came while it sent),
/// or 7 ("Couldn't connect": the kernel reset its SYN, or the proxy's reset came before curl saw
/// its connect finish).
fn reset(code: Option<i32>) -> bool {
    matches!(code, Some(7 | 52 | 55 | 56))
}

/// A refusal comes at once: well under curl's 10 s bound, so never a timeout (not a measure of
/// speed).
fn at_once(took: Duration) -> bool {
    took < pace::scaled(Duration::from_secs(5))
}

/// `curl http://addr/` run by `cmd` (a Pod's, or the node's), with a bound: a connection that
/// hangs fails the test.
fn curl_with(cmd: Cmd, addr: &str) -> Result<(Output, Duration)> {
    let started = Instant::now();
    let out = cmd
        .args(["-sS", "--max-time", &pace::scaled_secs(10)])
        .arg(format!("http://{addr}/"))
        .output()?;
    Ok((out, started.elapsed()))
}

/// `curl http://addr/` from `pod`.
fn curl(pod: &Pod, addr: &str) -> Result<(Output, Duration)> {
    curl_with(pod.cmd("curl"), addr)
}

/// Runs curl from `pod` to `addr` and requires `want`.
fn check(pod: &Pod, addr: &str, want: Want) -> Result<()> {
    check_with(&pod.key(), pod.cmd("curl"), addr, want)
}

/// Runs `cmd` (curl, from `who`) to `addr` and requires `want`.
fn check_with(who: &str, cmd: Cmd, addr: &str, want: Want) -> Result<()> {
    let (out, took) = curl_with(cmd, addr)?;
    let what = format!("{who} -> {addr}");
    match want {
        Want::Answered(name) => ensure!(
            out.success() && out.stdout_str().trim() == name,
            "{what}: want an answer from {name} ({took:?}): {out}"
        ),
        Want::Refused => ensure!(
            reset(out.status.code()) && at_once(took),
            "{what}: want the connection reset at once (curl exit 7, 52, 55 or 56) ({took:?}): {out}"
        ),
        Want::RefusedAtConnect => ensure!(
            out.status.code() == Some(7) && at_once(took),
            "{what}: want the connection refused at its SYN, at once (curl exit 7) ({took:?}): {out}"
        ),
    }
    Ok(())
}

/// Whether a `tracing` line has the field `name` with `value` exactly (quoted or not).
fn has_field(line: &str, name: &str, value: &str) -> bool {
    line.contains(&format!(" {name}=\"{value}\""))
        || line.contains(&format!(" {name}={value} "))
        || line.ends_with(&format!(" {name}={value}"))
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

/// A connection the kernel refused, as its access line must tell it.
struct KernelRefusal<'a> {
    /// The client's address; `None`: any (the node's own, whichever it picked).
    client: Option<&'a str>,
    /// The Pod's address and port.
    endpoint: &'a str,
    /// `src_identity`: the client Pod's SPIFFE identity, `-` for plaintext.
    identity: &'a str,
    /// `authorization`: the verdict, exactly.
    why: &'a str,
}

impl KernelRefusal<'_> {
    fn matches(&self, l: &str) -> bool {
        l.contains("access: inbound ")
            && self
                .client
                .is_none_or(|c| l.contains(&format!(" client={c}:")))
            && l.contains(&format!(" endpoint={} ", self.endpoint))
            && has_field(l, "src_identity", self.identity)
            && has_field(l, "end", "refused by authorization policy")
            && has_field(l, "authorization", self.why)
            && has_field(l, "decided_by", "kernel")
    }
}

/// Polls the agent's log past its first `from` bytes (2 s) for the `inbound` access line of
/// `refusal`.
fn wait_kernel_refusal(agent: &Agent, from: usize, refusal: &KernelRefusal) -> Result<String> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(2));
    loop {
        let log = log_since(agent, from);
        if let Some(line) = log.lines().find(|l| refusal.matches(l)) {
            return Ok(line.to_string());
        }
        if Instant::now() > deadline {
            let access: Vec<&str> = log.lines().filter(|l| l.contains("access:")).collect();
            bail!(
                "no access-log `inbound` line refused by the kernel from {:?} to {} as {} with authorization={:?}; the access lines:\n{}",
                refusal.client,
                refusal.endpoint,
                refusal.identity,
                refusal.why,
                access.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The SPIFFE identity of a Pod of `namespace` (service account `default`), as the access log
/// names it.
fn spiffe(namespace: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/default")
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

    /// curl from the node's own network namespace (no Pod, no identity) to `addr`.
    fn check_from_node(&self, addr: &str, want: Want) -> Result<()> {
        check_with("the node", self.topo.node_cmd("curl"), addr, want)
    }

    fn path(&self) -> &'static str {
        same_node_path(&self.agent)
    }

    fn refused(&self) -> Want {
        same_node_refusal(&self.agent)
    }

    /// `n` where the kernel passes a same-node connection to a Pod (the fast path), else 0.
    fn by_kernel(&self, n: f64) -> f64 {
        if self.agent.fast_path() { n } else { 0.0 }
    }

    /// `n` where the proxy carries every same-node connection (`--no-fast-path`), else 0.
    fn by_proxy(&self, n: f64) -> f64 {
        n - self.by_kernel(n)
    }

    fn wait_refusal_line(
        &self,
        from: usize,
        client: PodDef,
        endpoint: &str,
        why: &str,
    ) -> Result<String> {
        wait_same_node_refusal(&self.agent, from, client, endpoint, why)
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
        expect_deltas(&self.agent, before, want)
    }
}

/// The `path` a same-node connection to a guarded Pod is decided on: `kernel` (the fast path
/// leaves it alone, the Pod's socket lookup decides), or `same_node` with `--no-fast-path` (the
/// proxy carries every connection and decides it).
fn same_node_path(agent: &Agent) -> &'static str {
    if agent.fast_path() {
        "kernel"
    } else {
        "same_node"
    }
}

/// How a same-node client whose identity the agent knows is refused: at its SYN by the kernel,
/// or accepted and reset by the proxy without the fast path.
fn same_node_refusal(agent: &Agent) -> Want {
    if agent.fast_path() {
        Want::RefusedAtConnect
    } else {
        Want::Refused
    }
}

/// Waits for the access line of a same-node refusal of `client` to `endpoint`, its
/// authorization `why`, in the log past its first `from` bytes: the kernel's `inbound` line
/// (with the client Pod's identity), or the proxy's `connection` line without the fast path.
fn wait_same_node_refusal(
    agent: &Agent,
    from: usize,
    client: PodDef,
    endpoint: &str,
    why: &str,
) -> Result<String> {
    if !agent.fast_path() {
        return wait_access_line(agent, "denied", client.1, why);
    }
    let (namespace, _) = client.0.split_once('/').context("a Pod key")?;
    let identity = spiffe(namespace);
    let refusal = KernelRefusal {
        client: Some(client.1),
        endpoint,
        identity: &identity,
        why,
    };
    wait_kernel_refusal(agent, from, &refusal)
}

/// Waits (2 s) until `agent`'s counters moved from `before` as `want` says (`key`, delta), then
/// checks them exactly: a counter that moves too far fails. The kernel's decisions are read every
/// 200 ms, so they are waited for like the rest.
fn expect_deltas(agent: &Agent, before: &Metrics, want: &[(&str, f64)]) -> Result<Metrics> {
    let reached = |m: &Metrics| want.iter().all(|(k, d)| delta(before, m, k) >= *d);
    // Short of the wanted deltas after the wait: said below, counter by counter.
    let _ = agent.wait_metrics("the decisions counted", Duration::from_secs(2), reached);
    // A moment more: a counter that would overshoot has had its chance to.
    std::thread::sleep(Duration::from_millis(250));
    let m = agent.metrics()?;
    let wrong: Vec<String> = want
        .iter()
        .map(|(k, d)| (k, d, delta(before, &m, k)))
        .filter(|(_, d, got)| got != *d)
        .map(|(k, d, got)| format!("{k} moved by {got}, want {d}"))
        .collect();
    ensure!(
        wrong.is_empty(),
        "{}; the decisions counted: {:?}",
        wrong.join("; "),
        decisions_moved(before, &m)
    );
    // No decision beside those wanted: not on another path, nor under another policy.
    let stray: Vec<(String, f64)> = decisions_moved(before, &m)
        .into_iter()
        .filter(|(k, _)| !want.iter().any(|(w, _)| same_sample(w, k)))
        .collect();
    ensure!(
        stray.is_empty(),
        "decisions counted beside those wanted {want:?}: {stray:?}"
    );
    Ok(m)
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

/// Without any policy every client reaches every port of web-1, the node itself included, and
/// nothing is decided by authorization: the Pod is reached as before.
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
    n.check_from_node(WEB_HTTP, Want::Answered("web-1"))?;
    // Reached as before: with the fast path the kernel passes all six, the proxy none; no
    // decision counted (checked by `expect_deltas`), none denied.
    n.expect_deltas(
        &before,
        &[
            (KERNEL_WORKLOAD, n.by_kernel(6.0)),
            (PROXY_WORKLOAD, n.by_proxy(6.0)),
            (OUTBOUND_DENIED, 0.0),
        ],
    )?;
    Ok(())
}

/// team-a's DENY from namespace team-b on web-1: b1 is refused at its SYN, a1 is answered. The
/// fast path leaves web-1's connections to the kernel (the proxy carries none), which decides
/// them as the clients' identities; the decisions are counted by policy on `path="kernel"`, and
/// the refusal's access line names the policy and b1's identity.
#[test]
fn a_deny_from_a_namespace_resets_that_namespaces_clients_only() -> Result<()> {
    let n = Node::start(&[("deny-b.yaml", &deny_team_b_on_web())])?;
    let path = n.path();
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    n.check(B1, WEB_HTTP, n.refused())?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "denied", "team-a/deny-b"), 1.0),
            (OUTBOUND_DENIED, n.by_proxy(1.0)),
            // Left alone by the fast path: its SYN met web-1's socket lookup.
            (KERNEL_WORKLOAD, n.by_kernel(1.0)),
            (PROXY_WORKLOAD, 0.0),
        ],
    )?;
    n.wait_refusal_line(
        log_from,
        B1,
        WEB_HTTP,
        "explicitly denied by: team-a/deny-b",
    )?;

    let before = n.agent.metrics()?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(A1, WEB_HTTP2, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "allowed", ""), 2.0),
            (&decision(path, "denied", "team-a/deny-b"), 0.0),
            (OUTBOUND_DENIED, 0.0),
            // web-1 is under a policy, decided in its namespace: the kernel passes a1's
            // connections, the proxy carries none.
            (KERNEL_WORKLOAD, n.by_kernel(2.0)),
            (PROXY_WORKLOAD, n.by_proxy(2.0)),
        ],
    )?;
    // The policy selects web-1 only: b1 still reaches team-c's db-1, and nothing is decided.
    let before = n.agent.metrics()?;
    n.check(B1, DB_HTTP, Want::Answered("db-1"))?;
    n.expect_deltas(&before, &[(KERNEL_WORKLOAD, n.by_kernel(1.0))])?;
    Ok(())
}

/// Istio's metrics of refusals (`docs/observability.md#istio-metrics`): 50 connections team-a's
/// DENY refuses are 50 opened and closed, failed with `DENY`, reported by the `destination` (web-1's
/// node), whichever decides them (the Pod's socket lookup, or the proxy without the fast path).
#[test]
fn denied_connections_count_in_istios_series_as_deny() -> Result<()> {
    let n = Node::start(&[("deny-b.yaml", &deny_team_b_on_web())])?;
    let before = n.agent.metrics()?;
    let script = format!(
        "for i in $(seq 50); do curl -sS --max-time 5 http://{WEB_HTTP}/ && exit 1; done; exit 0"
    );
    n.pod(B1).cmd("sh").args(["-c", &script]).ok()?;
    let denied = [
        ("reporter", "destination"),
        ("source_workload", "b1"),
        ("source_workload_namespace", "team-b"),
        ("destination_workload", "web-1"),
        ("destination_workload_namespace", "team-a"),
        ("response_flags", "DENY"),
    ];
    let moved_by = |m: &Metrics, family: &str| {
        m.sum_matching(family, &denied) - before.sum_matching(family, &denied)
    };
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    let mut now = n.agent.metrics()?;
    while moved_by(&now, "istio_tcp_connections_failed_total") < 50.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        now = n.agent.metrics()?;
    }
    let counted = [
        "istio_tcp_connections_opened_total",
        "istio_tcp_connections_closed_total",
        "istio_tcp_connections_failed_total",
        "istio_tcp_received_bytes_total",
    ]
    .map(|family| moved_by(&now, family));
    ensure!(
        counted == [50.0, 50.0, 50.0, 0.0],
        "opened, closed, failed, bytes: {counted:?}"
    );
    // Once at the destination, whatever the flags; the client saw its connection fail.
    let at = |reporter: &'static str, flags: Option<&'static str>| {
        let mut labels = vec![
            ("reporter", reporter),
            ("source_workload", "b1"),
            ("destination_workload", "web-1"),
        ];
        labels.extend(flags.map(|f| ("response_flags", f)));
        let family = "istio_tcp_connections_closed_total";
        now.sum_matching(family, &labels) - before.sum_matching(family, &labels)
    };
    let closes = [
        at("destination", None),
        at("source", None),
        at("source", Some("CONNECT")),
    ];
    ensure!(
        closes == [50.0; 3],
        "destination, source, source CONNECT: {closes:?}"
    );
    Ok(())
}

/// team-a's ALLOW from a1's principal on web-1: a1 is answered (allowed by the policy), b1 is
/// refused on every port because allow policies exist and none allowed it.
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
    let path = n.path();
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(B1, WEB_HTTP, n.refused())?;
    n.check(B1, WEB_HTTP2, n.refused())?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "allowed", "team-a/allow-a"), 1.0),
            (&decision(path, "denied", ""), 2.0),
            (OUTBOUND_DENIED, n.by_proxy(2.0)),
            (PROXY_WORKLOAD, n.by_proxy(1.0)),
        ],
    )?;
    n.wait_refusal_line(log_from, B1, WEB_HTTP2, NOT_ALLOWED)?;
    Ok(())
}

/// A DENY from b1's address (`ipBlocks`, a v1beta1 policy) refuses b1 and only b1.
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
    let path = n.path();
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    n.check(B1, WEB_HTTP, n.refused())?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "denied", "team-a/deny-b1-ip"), 1.0),
            (&decision(path, "allowed", ""), 1.0),
            (OUTBOUND_DENIED, n.by_proxy(1.0)),
        ],
    )?;
    n.wait_refusal_line(
        log_from,
        B1,
        WEB_HTTP,
        "explicitly denied by: team-a/deny-b1-ip",
    )?;
    Ok(())
}

/// A DENY to port 9090 refuses connections to 9090 and answers those to 8080; `notPorts: [8080]`
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
    let path = n.path();
    for (what, text) in variants {
        n.apply("deny-port.yaml", &text)
            .with_context(|| what.to_string())?;
        let before = n.agent.metrics()?;
        let log_from = n.agent.log().len();
        for from in [A1, B1] {
            n.check(from, WEB_HTTP, Want::Answered("web-1"))
                .with_context(|| format!("{what}: port 8080"))?;
            n.check(from, WEB_HTTP2, n.refused())
                .with_context(|| format!("{what}: port 9090"))?;
        }
        n.expect_deltas(
            &before,
            &[
                (&decision(path, "denied", "team-a/deny-9090"), 2.0),
                (&decision(path, "allowed", ""), 2.0),
                (OUTBOUND_DENIED, n.by_proxy(2.0)),
            ],
        )
        .with_context(|| what.to_string())?;
        n.wait_refusal_line(
            log_from,
            A1,
            WEB_HTTP2,
            "explicitly denied by: team-a/deny-9090",
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
    let log_from = n.agent.log().len();
    for from in [A1, B1] {
        n.check(from, WEB_HTTP, n.refused())?;
    }
    n.expect_deltas(
        &before,
        &[
            (&decision(n.path(), "denied", ""), 2.0),
            (OUTBOUND_DENIED, n.by_proxy(2.0)),
        ],
    )?;
    n.wait_refusal_line(log_from, A1, WEB_HTTP, NOT_ALLOWED)?;
    n.check(A1, DB_HTTP, Want::Answered("db-1"))?;
    Ok(())
}

/// A DENY in the root namespace without a selector applies mesh-wide: b1 is refused by every
/// Pod, of every namespace; a1 is answered by all.
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
    let path = n.path();
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    for addr in [WEB_HTTP, WEB_HTTP2, DB_HTTP] {
        n.check(B1, addr, n.refused())?;
    }
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.check(A1, DB_HTTP, Want::Answered("db-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "denied", "istio-system/deny-team-b"), 3.0),
            (&decision(path, "allowed", ""), 2.0),
            (OUTBOUND_DENIED, n.by_proxy(3.0)),
        ],
    )?;
    // Refused by team-c's db-1 too, in db-1's own namespace.
    n.wait_refusal_line(
        log_from,
        B1,
        DB_HTTP,
        "explicitly denied by: istio-system/deny-team-b",
    )?;
    Ok(())
}

/// STRICT's policy, as the mesh-wide PeerAuthentication in the root namespace becomes.
const STRICT_POLICY: &str = "istio-system/istio_converted_static_strict";

/// A mesh-wide STRICT PeerAuthentication: the same node's Pods carry identities, so a1 and b1
/// are still answered (decided in the kernel); c1, whose cgroup names no Pod, is handed to the
/// proxy by the fast path (the kernel cannot tell who it is), which decides it as plaintext and
/// refuses it.
#[test]
fn strict_mtls_admits_the_same_nodes_pods_and_refuses_a_client_without_identity() -> Result<()> {
    let n = Node::start(&[("strict.yaml", STRICT_MESH_WIDE)])?;
    let before = n.agent.metrics()?;
    for from in [A1, B1] {
        n.check(from, WEB_HTTP, Want::Answered("web-1"))?;
        n.check(from, DB_HTTP, Want::Answered("db-1"))?;
    }
    let m = n.expect_deltas(
        &before,
        &[
            (&decision(n.path(), "allowed", ""), 4.0),
            (OUTBOUND_DENIED, 0.0),
        ],
    )?;

    n.check(C1, WEB_HTTP, Want::Refused)?;
    n.expect_deltas(
        &m,
        &[
            (&decision("same_node", "denied", STRICT_POLICY), 1.0),
            (OUTBOUND_DENIED, 1.0),
            (UNKNOWN_CLIENT, n.by_kernel(1.0)),
        ],
    )?;
    wait_access_line(
        &n.agent,
        "denied",
        C1.1,
        &format!("explicitly denied by: {STRICT_POLICY}"),
    )?;
    Ok(())
}

/// The node itself (its processes, `hostNetwork` Pods, kubelet's probes) is let through undecided,
/// as upstream lets it (Istio's CNI sends every connection a node socket opens to an ambient Pod
/// around ztunnel): under a mesh-wide STRICT PeerAuthentication, which refuses every plaintext
/// client, the node still reaches web-1 and db-1, nothing is decided and each connection is counted
/// as the node's own, while c1 (a Pod of the node the kernel cannot tie to its cgroup, plaintext)
/// is refused.
#[test]
fn the_node_itself_is_admitted_undecided_under_strict_mtls_as_upstream() -> Result<()> {
    const NODE_ADMITTED: &str = "redirect_authorization_node_admitted_total";
    let n = Node::start(&[("strict.yaml", STRICT_MESH_WIDE)])?;
    let before = n.agent.metrics()?;
    n.check_from_node(WEB_HTTP, Want::Answered("web-1"))
        .context("STRICT, from the node")?;
    n.check_from_node(DB_HTTP, Want::Answered("db-1"))
        .context("STRICT, from the node")?;
    let m = n.agent.wait_metrics(
        "the node's two connections counted as its own",
        Duration::from_secs(2),
        |m| delta(&before, m, NODE_ADMITTED) >= 2.0,
    )?;
    ensure!(
        delta(&before, &m, NODE_ADMITTED) == 2.0,
        "{NODE_ADMITTED} moved by {}, want 2",
        delta(&before, &m, NODE_ADMITTED)
    );
    n.expect_deltas(&before, &[])?;
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

/// A DENY put in force under open connections: b1's and a1's connections to web-1 were admitted
/// in the kernel under an ALLOW-all policy (which then passed them straight to web-1); b1's is
/// reset within a bounded wait (`SOCK_DESTROY` in web-1's network namespace), a1's is untouched;
/// the closing is counted and logged. A new connection from b1 is refused at its SYN; the DENY
/// removed, the next one is answered.
#[test]
fn a_deny_added_under_an_open_connection_closes_it_and_removing_it_admits_again() -> Result<()> {
    let n = Node::start(&[("allow-all.yaml", &allow_all_on_web())])?;
    let path = n.path();
    let before = n.agent.metrics()?;
    let mut held_a1 = hold(&n, A1)?;
    let mut held_b1 = hold(&n, B1)?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "allowed", "team-a/allow-all"), 2.0),
            (KERNEL_WORKLOAD, n.by_kernel(2.0)),
            (PROXY_WORKLOAD, n.by_proxy(2.0)),
        ],
    )
    .context("both held connections admitted by team-a/allow-all, passed by the kernel")?;
    deny_b_closes_b1s_connection(&n, &mut held_a1, &mut held_b1)?;

    // New connections: b1 refused, a1 answered.
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    n.check(B1, WEB_HTTP, n.refused())?;
    n.check(A1, WEB_HTTP, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[
            (&decision(path, "denied", "team-a/deny-b"), 1.0),
            (&decision(path, "allowed", "team-a/allow-all"), 1.0),
        ],
    )?;
    n.wait_refusal_line(
        log_from,
        B1,
        WEB_HTTP,
        "explicitly denied by: team-a/deny-b",
    )?;

    // The DENY removed: b1's next connection is answered; a1's held one never noticed.
    n.remove("deny-b.yaml")?;
    let before = n.agent.metrics()?;
    n.check(B1, WEB_HTTP, Want::Answered("web-1"))?;
    n.expect_deltas(
        &before,
        &[(&decision(path, "allowed", "team-a/allow-all"), 1.0)],
    )?;
    still_holding(&mut held_a1)?;
    Ok(())
}

/// The same when web-1 had no policy when the connections opened, so that the kernel connected
/// them directly and nothing decided them (`docs/authorization.md#live`: reset in web-1's
/// network namespace with `SOCK_DESTROY`).
#[test]
fn a_deny_added_under_a_connection_the_kernel_passed_directly_closes_it() -> Result<()> {
    let n = Node::start(&[])?;
    let before = n.agent.metrics()?;
    let mut held_a1 = hold(&n, A1)?;
    let mut held_b1 = hold(&n, B1)?;
    n.expect_deltas(
        &before,
        &[
            (KERNEL_WORKLOAD, n.by_kernel(2.0)),
            (PROXY_WORKLOAD, n.by_proxy(2.0)),
        ],
    )
    .context("both held connections passed directly by the kernel, undecided")?;
    deny_b_closes_b1s_connection(&n, &mut held_a1, &mut held_b1)?;
    n.check(B1, WEB_HTTP, n.refused())?;
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
            integration::two_nodes::ambient_namespaces(&["team-a", "team-b"]),
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
    // Node b decided both streams under STRICT (the sender's identity) and allowed them; its own
    // dials to b1 then passed b1's socket lookup, which decided nothing itself.
    expect_deltas(
        &n.agent_b,
        &before,
        &[
            (&decision("hbone", "allowed", ""), 2.0),
            (&hbone_inbound("denied"), 0.0),
        ],
    )
    .context("STRICT over HBONE")?;
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

/// A second client of node a.
const NODE_A2: PodDef = (
    "team-a/a2",
    "10.244.1.11",
    "a2a2a2a2-0000-4000-8000-0000000000a2",
    "{app: client}",
);
/// A client of node b, beside b1.
const NODE_B2: PodDef = (
    "team-b/b2",
    "10.244.2.10",
    "b2b2b2b2-0000-4000-8000-0000000000b2",
    "{app: client}",
);

/// Two nodes joined without HBONE: a1 and a2 on node a reach b1 (HTTP) on node b in plaintext,
/// routed between the nodes, their source addresses kept. Each agent reads its own node's Pods
/// only (without `--hbone-between-nodes` every Pod of the directory is taken for the node's), and
/// policies are put on node b. Fields drop in order.
struct PlainNodes {
    agent_a: Agent,
    agent_b: Agent,
    _web: Peer,
    config_b: PathBuf,
    a: Topology,
    b: Topology,
}

impl PlainNodes {
    fn start() -> Result<PlainNodes> {
        let mut a = Topology::new()?;
        for (key, ip, uid, _) in [NODE_A1, NODE_A2] {
            a.add_kube_pod(key, ip.parse()?, uid)?;
        }
        let mut b = Topology::new()?;
        for (key, ip, uid, _) in [NODE_B1, NODE_B2] {
            b.add_kube_pod(key, ip.parse()?, uid)?;
        }
        Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
        let web = Peer::start(
            b.pod(NODE_B1.0).place(),
            "web-b1",
            &[NODE_B1_WEB.parse()?],
            &[],
        )?;
        let start = |topo: &Topology, pods: [PodDef; 2], launch: &Launch| {
            let config = topo.scratch_path("config");
            fs::create_dir_all(&config)?;
            let cluster: Vec<String> = pods.into_iter().map(|p| pod_manifest(p, None)).collect();
            replace_file(&config, "cluster.yaml", &cluster.join("---\n"))?;
            let agent = Agent::launch(topo, launch, &["--config", &config.to_string_lossy()])?;
            anyhow::Ok((agent, config))
        };
        // Node a's fast path leaves its Pods' connections to another node alone, so that they
        // reach node b from the Pods' own addresses (its proxy, with `--no-fast-path`, would dial
        // from the node's). Node b runs as the suite does.
        let client_node = Launch {
            fast_path: true,
            ..Launch::default()
        };
        let (agent_a, _) = start(&a, [NODE_A1, NODE_A2], &client_node)?;
        let (agent_b, config_b) = start(&b, [NODE_B1, NODE_B2], &Launch::default())?;
        Ok(PlainNodes {
            agent_a,
            agent_b,
            _web: web,
            config_b,
            a,
            b,
        })
    }

    /// Writes `name` into node b's directory and waits until its agent reloaded.
    fn apply_b(&self, name: &str, contents: &str) -> Result<()> {
        let before = self.agent_b.metrics()?;
        replace_file(&self.config_b, name, contents)?;
        wait_reload(&self.agent_b, &before, name)?;
        Ok(())
    }

    /// curl from `from`, a Pod of node a or of node b, to b1's HTTP port.
    fn check(&self, from: PodDef, want: Want) -> Result<()> {
        let topo = if from.1.starts_with("10.244.1.") {
            &self.a
        } else {
            &self.b
        };
        check(topo.pod(from.0), NODE_B1_WEB, want)
    }

    /// Both clients of node a answered by b1 in plaintext, before any policy; node a decides
    /// nothing (b1 is not its Pod) and node b nothing (no policy).
    fn check_reachable(&self) -> Result<()> {
        let (before_a, before_b) = (self.agent_a.metrics()?, self.agent_b.metrics()?);
        for from in [NODE_A1, NODE_A2, NODE_B2] {
            self.check(from, Want::Answered("web-b1"))
                .context("no policy")?;
        }
        expect_deltas(&self.agent_a, &before_a, &[])?;
        expect_deltas(&self.agent_b, &before_b, &[])?;
        Ok(())
    }

    /// Waits for node b's access line of the kernel's refusal of a1 (plaintext: no identity),
    /// saying `why`, in its log past `from` bytes.
    fn wait_a1_refused(&self, from: usize, why: &str) -> Result<String> {
        let refusal = KernelRefusal {
            client: Some(NODE_A1.1),
            endpoint: NODE_B1_WEB,
            identity: "-",
            why,
        };
        wait_kernel_refusal(&self.agent_b, from, &refusal)
    }
}

/// Plaintext from another node is decided by the receiving node: team-b's DENY of a1's address
/// (`ipBlocks`) on b1 refuses a1 at its SYN, while a2, of the same node a, is answered. Node b
/// counts both in the kernel (a1 under the policy) and logs a1's refusal without an identity;
/// node a decides nothing.
#[test]
fn plaintext_from_another_node_is_refused_by_an_ip_block_deny() -> Result<()> {
    let n = PlainNodes::start()?;
    n.check_reachable()?;
    let deny = policy(
        "v1",
        ("team-b", "deny-a1-ip"),
        Some("{app: web-b}"),
        "DENY",
        &format!(
            "[{{from: [{{source: {{ipBlocks: [\"{}/32\"]}}}}]}}]",
            NODE_A1.1
        ),
    );
    n.apply_b("deny-a1-ip.yaml", &deny)?;
    let (before_a, before_b) = (n.agent_a.metrics()?, n.agent_b.metrics()?);
    let log_from = n.agent_b.log().len();
    n.check(NODE_A1, Want::RefusedAtConnect)?;
    n.check(NODE_A2, Want::Answered("web-b1"))?;
    expect_deltas(
        &n.agent_b,
        &before_b,
        &[
            (&decision("kernel", "denied", "team-b/deny-a1-ip"), 1.0),
            (&decision("kernel", "allowed", ""), 1.0),
        ],
    )?;
    expect_deltas(&n.agent_a, &before_a, &[(OUTBOUND_DENIED, 0.0)])?;
    n.wait_a1_refused(log_from, "explicitly denied by: team-b/deny-a1-ip")?;
    Ok(())
}

/// A mesh-wide STRICT PeerAuthentication on node b refuses plaintext from node a (a1, no
/// identity: not a Pod of node b) at its SYN, counted under STRICT's policy; b2, a Pod of node b
/// with an identity, is still answered.
#[test]
fn strict_mtls_refuses_plaintext_from_another_node_and_admits_the_nodes_own_pods() -> Result<()> {
    let n = PlainNodes::start()?;
    n.check_reachable()?;
    n.apply_b("strict.yaml", STRICT_MESH_WIDE)?;
    let before_b = n.agent_b.metrics()?;
    let log_from = n.agent_b.log().len();
    n.check(NODE_A1, Want::RefusedAtConnect)?;
    n.check(NODE_A2, Want::RefusedAtConnect)?;
    n.check(NODE_B2, Want::Answered("web-b1"))?;
    expect_deltas(
        &n.agent_b,
        &before_b,
        &[
            (&decision("kernel", "denied", STRICT_POLICY), 2.0),
            (&decision(same_node_path(&n.agent_b), "allowed", ""), 1.0),
        ],
    )?;
    n.wait_a1_refused(log_from, &format!("explicitly denied by: {STRICT_POLICY}"))?;
    Ok(())
}

/// An ALLOW by principal on b1, naming a1's own principal and b2's: a1 in plaintext from node a
/// has no identity, so no ALLOW admits it and it is refused at its SYN; b2 (same node, its
/// identity) is admitted by the policy.
#[test]
fn an_allow_by_principal_refuses_plaintext_from_another_node() -> Result<()> {
    let n = PlainNodes::start()?;
    n.check_reachable()?;
    let allow = policy(
        "v1",
        ("team-b", "allow-principals"),
        Some("{app: web-b}"),
        "ALLOW",
        &format!(
            "[{{from: [{{source: {{principals: [{TRUST_DOMAIN}/ns/team-a/sa/default, {TRUST_DOMAIN}/ns/team-b/sa/default]}}}}]}}]"
        ),
    );
    n.apply_b("allow.yaml", &allow)?;
    let before_b = n.agent_b.metrics()?;
    let log_from = n.agent_b.log().len();
    n.check(NODE_A1, Want::RefusedAtConnect)?;
    n.check(NODE_B2, Want::Answered("web-b1"))?;
    expect_deltas(
        &n.agent_b,
        &before_b,
        &[
            (&decision("kernel", "denied", ""), 1.0),
            (
                &decision(
                    same_node_path(&n.agent_b),
                    "allowed",
                    "team-b/allow-principals",
                ),
                1.0,
            ),
        ],
    )?;
    n.wait_a1_refused(log_from, NOT_ALLOWED)?;
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

/// Whether two sample keys name the same sample, whatever the order of their labels.
fn same_sample(a: &str, b: &str) -> bool {
    let canonical = |k: &str| {
        let (name, labels) = k.split_once('{').unwrap_or((k, ""));
        let mut labels: Vec<String> = (labels.trim_end_matches('}').split("\","))
            .map(|l| l.trim_end_matches('"').to_string())
            .collect();
        labels.sort();
        (name.to_string(), labels)
    };
    canonical(a) == canonical(b)
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

/// Offline `redirect explain` over the agent's own directory says what the case means for `pair`
/// (pinned), then the live agent does the same: curl is answered exactly when explain allows (and
/// refused at its SYN when the kernel decides), the decision is counted under the policy explain
/// names on the path explain says (`decidedIn`), carried by whom explain says, and the access
/// line of a refusal has explain's verdict, word for word.
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
    let under_policy = !authz.policies.is_empty();

    // What explain says, pinned to what the case means: decided as the Pod's identity on the
    // same node, in the kernel when the Pod has a policy (every Pod here fits the kernel's
    // table), by nobody when it has none; the fast path leaves the connection to the kernel.
    let identity = spiffe(namespace);
    let want_in = if under_policy { "kernel" } else { "none" };
    ensure!(
        authz.over.as_str() == "same-node"
            && authz.identity.as_deref() == Some(identity.as_str())
            && authz.decided_in == want_in
            && v.decided_by == DecidedBy::Kernel,
        "{what}: explain decides as the Pod's identity on the same node, decidedIn {want_in:?}, the fast path leaving it to the kernel: {}",
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

    // The live agent.
    let server = if to == DB_HTTP { "db-1" } else { "web-1" };
    let before = n.agent.metrics()?;
    let log_from = n.agent.log().len();
    let (out, took) = curl(n.pod(from), to)?;
    let answered = out.success() && out.stdout_str().trim() == server;
    let refused = match n.refused() {
        Want::RefusedAtConnect => out.status.code() == Some(7),
        _ => reset(out.status.code()),
    } && at_once(took);
    ensure!(
        answered || refused,
        "{what}: neither answered by {server} nor refused at once as {:?} ({took:?}): {out}",
        n.refused()
    );
    ensure!(
        answered == authz.allowed,
        "{what}: the agent {} it ({took:?}: {out}) but explain says {:?}: {}",
        if answered { "answered" } else { "refused" },
        authz.verdict,
        v.json
    );

    // Counted as explain says: the deciding policy, the dry run, and who carried it.
    let path = n.path();
    let mut want: Vec<(String, f64)> = Vec::new();
    if under_policy {
        let result = if authz.allowed { "allowed" } else { "denied" };
        want.push((decision(path, result, deciding_policy(&authz.verdict)), 1.0));
        want.extend(
            authz
                .dry_run
                .iter()
                .map(|d| (decision(path, "dry_run", d), 1.0)),
        );
    }
    // With the fast path the kernel leaves every one of these to the Pod (refused or not);
    // without it the proxy carries it, or refuses it.
    let carrier = match (n.agent.fast_path(), authz.allowed) {
        (true, _) => KERNEL_WORKLOAD,
        (false, true) => PROXY_WORKLOAD,
        (false, false) => OUTBOUND_DENIED,
    };
    let carriers = [OUTBOUND_DENIED, KERNEL_WORKLOAD, PROXY_WORKLOAD];
    let mut deltas: Vec<(&str, f64)> = want.iter().map(|(k, d)| (k.as_str(), *d)).collect();
    deltas.extend(
        carriers
            .iter()
            .map(|k| (*k, if *k == carrier { 1.0 } else { 0.0 })),
    );
    n.expect_deltas(&before, &deltas).with_context(|| {
        format!(
            "{what}: its decision and its carrier counted as explain says ({:?}): {}",
            authz.verdict, v.json
        )
    })?;

    // The access line of a refusal says explain's verdict.
    if !authz.allowed {
        n.wait_refusal_line(log_from, from, to, &authz.verdict)
            .with_context(|| what.clone())?;
    }
    Ok(())
}

/// Offline `redirect explain` (over the agent's own directory, client Pods named so that the
/// identity is theirs) and the live agent agree on each of eleven policy cases, put in force one
/// after the other under one agent: for each (client, destination) pair curl is answered exactly
/// when explain's `authorization.allowed` says, the decision is counted under the policy explain's
/// verdict names where explain says it is decided (the kernel), and a refusal's access line has
/// explain's verdict. Each pair is also pinned to what the case means, so that the two cannot
/// agree on a wrong answer.
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
    expect_deltas(&agent, &before, &[(OUTBOUND_DENIED, 0.0)]).context("no policy")?;

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
    let path = same_node_path(&agent);
    let refused = same_node_refusal(&agent);
    let before = agent.metrics()?;
    let log_from = agent.log().len();
    check(B1, WEB_HTTP, refused).context("under team-a/deny-b from the API")?;
    check(B1, WEB_HTTP2, refused).context("under team-a/deny-b from the API")?;
    check(A1, WEB_HTTP, Want::Answered("web-1")).context("under team-a/deny-b from the API")?;
    let proxied = if agent.fast_path() { 0.0 } else { 2.0 };
    expect_deltas(
        &agent,
        &before,
        &[
            (&decision(path, "denied", "team-a/deny-b"), 2.0),
            (&decision(path, "allowed", ""), 1.0),
            (OUTBOUND_DENIED, proxied),
        ],
    )
    .context("b1's two refusals and a1's admission counted")?;
    wait_same_node_refusal(
        &agent,
        log_from,
        B1,
        WEB_HTTP,
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
    // No policy left: nothing decided (checked by `expect_deltas`) or denied.
    expect_deltas(&agent, &before, &[(OUTBOUND_DENIED, 0.0)]).context("team-a/deny-b deleted")?;
    Ok(())
}
