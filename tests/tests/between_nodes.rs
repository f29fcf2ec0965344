//! HBONE between nodes (`docs/data-plane.md#hbone-between-nodes`): two nodes, each its own netns
//! with its own agent, joined by a link. A Pod's connection to a Pod of the other node goes over
//! HBONE (mutual TLS, HTTP/2 `CONNECT` to `<pod IP>:15008`) as the client's workload identity; the
//! other node's agent receives it as the destination Pod's identity, checks the sender against
//! the trust domain, and carries the stream to the Pod. Each Pod sees the other's address, as with
//! ztunnel: the sender dials from its Pod's address, the receiver carries the stream on from it.
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::container::{self, Image};
use integration::fixtures::{curl_body, curls_moved};
use integration::pki::TestCa;
use integration::two_nodes::{self, A1, B1, DAY, TRUST_DOMAIN};
use integration::world::{delta, key, replace_file};
use integration::{Agent, Peer, Topology, pace, peer, pod_ip6};

const B1_WEB: &str = "10.244.2.20:8080";
/// team-b's ServiceEntry whose one endpoint is b1.
const WEB_VIP: &str = "203.0.113.80";

/// How long a count or a log line may lag the client's answer (scaled by `pace`).
const WAIT: Duration = Duration::from_secs(5);
const TUNNELS_OK: &str = r#"redirect_hbone_tunnels_total{result="ok"}"#;
fn inbound(result: &str) -> String {
    format!(r#"redirect_hbone_inbound_total{{result="{result}"}}"#)
}

/// Pods of node a known to its kernel by their cgroups (`namespace/name`, address, uid, labels):
/// a2 in the mesh with a1; p1 of a namespace outside it; a3 of team-a opted out.
const A2: (&str, &str, &str, &str) = (
    "team-a/a2",
    "10.244.1.12",
    "0a2a2a2a-0000-4000-8000-0000000000a2",
    "{}",
);
const P1: (&str, &str, &str, &str) = (
    "plain/p1",
    "10.244.1.11",
    "0f1f1f1f-0000-4000-8000-0000000000f1",
    "{}",
);
const A3: (&str, &str, &str, &str) = (
    "team-a/a3",
    "10.244.1.13",
    "0a3a3a3a-0000-4000-8000-0000000000a3",
    "{istio.io/dataplane-mode: none}",
);

/// The cluster both agents are given: the Pods with their nodes and service accounts (a1 and b1
/// in the mesh), and team-b's entry for b1.
fn cluster() -> String {
    let kernel_known = [A2, P1, A3].map(|(key, ip, uid, labels)| {
        let (namespace, name) = key.split_once('/').unwrap_or_default();
        format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}, labels: {labels}}}\nspec: {{nodeName: node-a, serviceAccountName: default}}\nstatus: {{podIP: {ip}, podIPs: [{{ip: {ip}}}]}}\n"
        )
    });
    format!(
        "{}{}---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: web, namespace: team-b}}\nspec: {{hosts: [web.example.com], addresses: [{WEB_VIP}], ports: [{{number: 80, name: http, targetPort: 8080}}], resolution: STATIC, endpoints: [{{address: {}}}]}}\n",
        two_nodes::pods(),
        kernel_known.concat(),
        B1.1,
    )
}

/// Fields drop in order: agents and servers before their topologies.
struct Nodes {
    agent_a: Agent,
    agent_b: Agent,
    /// What each node's agent was started with (a successor is started alike).
    args_a: Vec<String>,
    args_b: Vec<String>,
    _web: Peer,
    ca: TestCa,
    a: Topology,
    b: Topology,
}

/// How an agent is started on a node, with its arguments: from the binary, or from the image.
type Start<'a> = &'a dyn Fn(&Topology, &[&str]) -> Result<Agent>;

/// Node a with a1 (and a2, p1, a3), node b with b1 (serving HTTP on 8080), linked; an agent on
/// each with the Pods' certificates from one test CA and its node's name, and so HBONE between
/// nodes by default.
fn nodes(extra: &[&str]) -> Result<Nodes> {
    nodes_started_by(extra, &|topo, args| Agent::start(topo, args))
}

/// [`nodes`], each agent started by `start`.
fn nodes_started_by(extra: &[&str], start: Start<'_>) -> Result<Nodes> {
    let mut a = Topology::with_pods(&[A1])?;
    for (key, ip, uid, _) in [A2, P1, A3] {
        a.add_kube_pod(key, ip.parse()?, uid)?;
    }
    let b = Topology::with_pods(&[B1])?;
    Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let b1_web6 = SocketAddr::new(pod_ip6(B1.1.parse()?).into(), 8080);
    let web = Peer::start(
        b.pod(B1.0).place(),
        "web-b1",
        &[B1_WEB.parse()?, b1_web6],
        &[],
    )?;
    let args = |topo: &Topology, node: &str| -> Result<Vec<String>> {
        let identities = topo.scratch_path("identities");
        ca.write_identity_dir(
            &identities,
            &[
                ("team-a", "default"),
                ("team-b", "default"),
                ("plain", "default"),
            ],
            DAY,
        )?;
        let config = topo.scratch_path("config");
        std::fs::create_dir_all(&config)?;
        replace_file(&config, "cluster.yaml", &cluster())?;
        let mut args: Vec<String> = vec![
            "--config".into(),
            config.to_string_lossy().into(),
            "--identity-dir".into(),
            identities.to_string_lossy().into(),
            "--node-name".into(),
            node.into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        Ok(args)
    };
    let start = |topo: &Topology, args: &[String]| -> Result<Agent> {
        start(topo, &args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (args_a, args_b) = (args(&a, "node-a")?, args(&b, "node-b")?);
    let agent_a = start(&a, &args_a)?;
    let agent_b = start(&b, &args_b)?;
    Ok(Nodes {
        agent_a,
        agent_b,
        args_a,
        args_b,
        _web: web,
        ca,
        a,
        b,
    })
}

impl Nodes {
    /// `pod` (`namespace/name`, address) reaches b1, which sees the Pod's own address, and node b
    /// receives one more stream over HBONE (`why` it should).
    fn reaches_b1_over_hbone(&self, (key, ip): (&str, &str), why: &str) -> Result<()> {
        let received = self.agent_b.metrics()?.get_or_zero(&inbound("ok"));
        let seen = curl_body(self.a.pod(key), &format!("http://{B1_WEB}/peer"))?;
        ensure!(
            seen.starts_with(&format!("{ip}:")),
            "b1 saw {seen:?} for {key}, not its address {ip}"
        );
        // Counted as the stream is answered; read again for a moment.
        let received_after =
            counted(&self.agent_b, &inbound("ok"), received + 1.0)?.get_or_zero(&inbound("ok"));
        ensure!(
            received_after >= received + 1.0,
            "{why}: node b should have received its stream over HBONE, got {}",
            received_after - received
        );
        Ok(())
    }

    fn curl_from_a1(&self, url: &str) -> Result<String> {
        curl_body(self.a.pod(A1.0), url)
    }

    /// `rdt-peer hbone-client` from node a's netns to b1's HBONE port, presenting `ca`'s
    /// certificate for `team-a/default`, asking for `authority`. Its output, and whether it
    /// succeeded.
    fn hbone_client(&self, ca: &TestCa, name: &str, authority: &str) -> Result<(String, bool)> {
        let files = self.a.scratch_path(name);
        let tls = ca.write_server_files(&files, "team-a", "default", DAY)?;
        let out = peer::cmd(self.a.node())?
            .args(["hbone-client", "--connect", &format!("{}:15008", B1.1)])
            .args(tls)
            .args([
                "--authority",
                authority,
                "--send",
                "GET /peer HTTP/1.0\r\n\r\n",
            ])
            .output()?;
        let text = format!("{}{}", out.stdout_str(), out.stderr_str());
        Ok((text, out.success()))
    }
}

/// a1 reaches b1 on the other node, by its address and through team-b's entry, and each time the
/// stream rides HBONE: node a's agent opened tunnels, node b's received them from a1's identity
/// and carried them to b1.
#[test]
fn a_pod_reaches_a_pod_of_the_other_node_over_hbone_as_its_own_identity() -> Result<()> {
    let n = nodes(&[])?;
    let body = n.curl_from_a1(&format!("http://{B1_WEB}/"))?;
    ensure!(body == "web-b1", "a1 -> b1 by address: {body:?}");
    let body = n.curl_from_a1(&format!("http://{WEB_VIP}/"))?;
    ensure!(
        body == "web-b1",
        "a1 -> b1 through team-b's entry: {body:?}"
    );

    // b1 sees a1's own address, not a node's; a1 sees b1's (its socket is b1's, so its
    // getpeername is b1 whatever the path, but the bytes came back, so the answers were carried).
    for url in [
        format!("http://{B1_WEB}/peer"),
        format!("http://{WEB_VIP}/peer"),
    ] {
        let seen = n.curl_from_a1(&url)?;
        ensure!(
            seen.starts_with(&format!("{}:", A1.1)),
            "b1 saw {seen:?} for {url}, not a1's address {}",
            A1.1
        );
    }

    let sent = n.agent_a.metrics()?.get_or_zero(TUNNELS_OK);
    ensure!(sent >= 4.0, "node a's agent opened {sent} tunnels");
    let received = n.agent_b.metrics()?.get_or_zero(&inbound("ok"));
    ensure!(
        received >= 4.0,
        "node b's agent received {received} streams"
    );
    let from_a1 = format!("spiffe://{TRUST_DOMAIN}/ns/team-a/sa/default");
    let from_a1_address = format!("client={}:", A1.1);
    n.agent_b.wait_log_line(
        "of a stream received naming a1's identity, a1's address and b1",
        WAIT,
        |l| {
            l.contains(" inbound")
                && l.contains(&from_a1)
                && l.contains(B1_WEB)
                && l.contains(&from_a1_address)
        },
    )
}

/// IPv6 Pods too: a1 reaches b1 at its IPv6 address over HBONE, and b1 sees a1's own IPv6
/// address (node a dials from it; node b carries the stream on from it).
#[test]
fn an_ipv6_pod_reaches_a_pod_of_the_other_node_over_hbone_from_its_own_address() -> Result<()> {
    let n = nodes(&[])?;
    let (a1, b1) = (pod_ip6(A1.1.parse()?), pod_ip6(B1.1.parse()?));
    let (sent, received) = (
        n.agent_a.metrics()?.get_or_zero(TUNNELS_OK),
        n.agent_b.metrics()?.get_or_zero(&inbound("ok")),
    );
    let seen = n.curl_from_a1(&format!("http://[{b1}]:8080/peer"))?;
    ensure!(
        seen.starts_with(&format!("[{a1}]:")),
        "b1 saw {seen:?}, not a1's IPv6 address {a1}"
    );
    let received_after =
        counted(&n.agent_b, &inbound("ok"), received + 1.0)?.get_or_zero(&inbound("ok"));
    let sent_after = n.agent_a.metrics()?.get_or_zero(TUNNELS_OK);
    ensure!(
        sent_after > sent && received_after > received,
        "a1 -> b1 over IPv6 should ride HBONE: node a opened {} tunnels, node b received {} streams",
        sent_after - sent,
        received_after - received
    );
    let from_a1 = format!("client=[{a1}]:");
    n.agent_b
        .wait_log_line("of a stream received from a1's IPv6 address", WAIT, |l| {
            l.contains(" inbound") && l.contains(&from_a1)
        })
}

/// Encryption follows enrollment (`docs/data-plane.md#who-is-in-the-mesh`), with no flag: a2, in
/// the mesh and known to node a's kernel by its cgroup, reaches b1 over HBONE (the kernel hands
/// it to the proxy); p1, of a namespace outside the mesh, and a3, opted out with `none`, reach b1
/// in plaintext, straight from their own addresses, and node b receives no stream from them. Once
/// p1's namespace is labelled into the mesh, p1's next connection goes over HBONE.
#[test]
fn encryption_follows_enrollment_pods_outside_the_mesh_reach_the_other_node_in_plaintext()
-> Result<()> {
    let n = nodes(&[])?;
    // Node a's /config_dump says who is in the mesh.
    let dump: serde_json::Value =
        serde_json::from_slice(&n.agent_a.admin_get("/config_dump")?.body)?;
    let in_mesh = |key: &str| {
        let (namespace, name) = key.split_once('/').unwrap_or_default();
        (dump["workloads"].as_array().into_iter().flatten())
            .find(|w| w["namespace"] == namespace && w["name"] == name)
            .map(|w| w["inMesh"] == true)
    };
    for (key, want) in [(A1.0, true), (A2.0, true), (P1.0, false), (A3.0, false)] {
        ensure!(
            in_mesh(key) == Some(want),
            "/config_dump: {key} inMesh should be {want}: {dump:#}"
        );
    }
    let peer_url = format!("http://{B1_WEB}/peer");
    for (key, ip, ..) in [P1, A3] {
        let (sent, received) = (
            n.agent_a.metrics()?.get_or_zero(TUNNELS_OK),
            n.agent_b.metrics()?.get_or_zero(&inbound("ok")),
        );
        let seen = curl_body(n.a.pod(key), &peer_url)?;
        ensure!(
            seen.starts_with(&format!("{ip}:")),
            "b1 saw {seen:?} for {key}, not its own address {ip}"
        );
        let (sent_after, received_after) = (
            n.agent_a.metrics()?.get_or_zero(TUNNELS_OK),
            n.agent_b.metrics()?.get_or_zero(&inbound("ok")),
        );
        ensure!(
            sent_after == sent && received_after == received,
            "{key} is outside the mesh, yet went over HBONE: node a opened {} tunnels, node b received {} streams",
            sent_after - sent,
            received_after - received
        );
    }
    n.reaches_b1_over_hbone((A2.0, A2.1), "a2 is in the mesh")?;
    let from_a2 = format!("client={}:", A2.1);
    n.agent_b
        .wait_log_line("of a stream received from a2", WAIT, |l| {
            l.contains(" inbound") && l.contains(&from_a2)
        })?;

    // p1's namespace joins the mesh: both agents read it on their next reload.
    let ambient = format!(
        "{}---\n{}",
        two_nodes::ambient_namespaces(&["plain"]),
        cluster()
    );
    for (topo, agent) in [(&n.a, &n.agent_a), (&n.b, &n.agent_b)] {
        let before = agent.metrics()?;
        replace_file(&topo.scratch_path("config"), "cluster.yaml", &ambient)?;
        agent.wait_metrics(
            "a reload with p1's namespace in the mesh",
            Duration::from_secs(5),
            |m| delta(&before, m, key::RELOAD_OK) >= 1.0,
        )?;
    }
    n.reaches_b1_over_hbone((P1.0, P1.1), "p1's namespace is in the mesh now")?;
    Ok(())
}

/// Istio's metrics on both nodes (`docs/observability.md#istio-metrics`): 50 connections a1 → b1
/// over HBONE are 50 opened and closed on node a as the `source` and on node b as the
/// `destination`, mutual TLS with a1's identity as the source principal, and the bytes curl moved.
#[test]
fn both_nodes_count_hbone_in_istios_series_as_source_and_destination() -> Result<()> {
    let n = nodes(&[])?;
    let (before_a, before_b) = (n.agent_a.metrics()?, n.agent_b.metrics()?);
    let moved = curls_moved(n.a.pod(A1.0), &format!("http://{B1_WEB}/"), 50)?;
    let (sent, received) = moved
        .iter()
        .fold((0, 0), |(s, r), m| (s + m.sent, r + m.received));
    let a1 = format!("spiffe://{TRUST_DOMAIN}/ns/team-a/sa/default");
    let b1 = format!("spiffe://{TRUST_DOMAIN}/ns/team-b/sa/default");
    let edge = |reporter: &'static str| {
        [
            ("reporter", reporter),
            ("source_workload", "a1"),
            ("source_workload_namespace", "team-a"),
            ("source_principal", a1.as_str()),
            ("destination_workload", "b1"),
            ("destination_workload_namespace", "team-b"),
            ("destination_principal", b1.as_str()),
            // a1 addressed b1 itself; the stream received names b1's port, which team-b's entry
            // serves (the receiving side guesses the service as ztunnel does).
            (
                "destination_service",
                match reporter {
                    "source" => "unknown",
                    _ => "web.example.com",
                },
            ),
            ("connection_security_policy", "mutual_tls"),
            ("response_flags", "-"),
        ]
    };
    for (agent, before, reporter) in [
        (&n.agent_a, &before_a, "source"),
        (&n.agent_b, &before_b, "destination"),
    ] {
        let labels = edge(reporter);
        let moved_by = |m: &integration::metrics::Metrics, family: &str| {
            m.sum_matching(family, &labels) - before.sum_matching(family, &labels)
        };
        let deadline = std::time::Instant::now() + pace::scaled(Duration::from_secs(10));
        let mut now = agent.metrics()?;
        while moved_by(&now, "istio_tcp_connections_closed_total") < 50.0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
            now = agent.metrics()?;
        }
        let counted = [
            moved_by(&now, "istio_tcp_connections_opened_total"),
            moved_by(&now, "istio_tcp_connections_closed_total"),
            moved_by(&now, "istio_tcp_received_bytes_total"),
            moved_by(&now, "istio_tcp_sent_bytes_total"),
        ];
        ensure!(
            counted == [50.0, 50.0, sent as f64, received as f64],
            "{reporter}: opened, closed, bytes from and to the client {counted:?}; curl sent {sent} and received {received}"
        );
    }
    Ok(())
}

/// Node b's agent takes only peers of the mesh: a certificate of another trust domain is refused
/// in the handshake and counted; a peer of the mesh that is not an agent (as ztunnel would be)
/// reaches b1, but only b1: a stream naming another address is refused with 400.
#[test]
fn the_receiving_node_checks_the_sender_and_carries_only_to_the_pod_dialled() -> Result<()> {
    let n = nodes(&[])?;
    let foreign = TestCa::new("other.example")?;
    let (out, ok) = n.hbone_client(&foreign, "foreign", B1_WEB)?;
    ensure!(!ok, "a foreign trust domain's certificate was taken: {out}");
    // The client may see the refusal before the agent counts it.
    let metrics = counted(&n.agent_b, &inbound("tls_refused"), 1.0)?;
    ensure!(
        metrics.get_or_zero(&inbound("tls_refused")) >= 1.0,
        "the refusal is counted; the client said {out:?}; node b counted {:?}",
        metrics
            .matching("redirect_hbone_inbound_total", &[])
            .collect::<Vec<_>>()
    );

    let (out, ok) = n.hbone_client(&n.ca, "mesh-peer", B1_WEB)?;
    ensure!(
        ok && out.contains("status 200"),
        "a mesh peer's tunnel: {out}"
    );
    ensure!(
        out.contains(&format!(
            "peer identity=spiffe://{TRUST_DOMAIN}/ns/team-b/sa/default"
        )),
        "node b answers as b1's identity: {out}"
    );

    let (out, ok) = n.hbone_client(&n.ca, "elsewhere", "10.244.2.99:8080")?;
    ensure!(
        !ok && out.contains("status 400"),
        "a stream to another address: {out}"
    );
    let (out, ok) = n.hbone_client(&n.ca, "loop", &format!("{}:15008", B1.1))?;
    ensure!(
        !ok && out.contains("status 400"),
        "a stream to the HBONE port: {out}"
    );
    let metrics = counted(&n.agent_b, &inbound("bad_request"), 2.0)?;
    ensure!(
        metrics.get_or_zero(&inbound("bad_request")) >= 2.0,
        "both counted as bad requests; node b counted {:?}",
        metrics
            .matching("redirect_hbone_inbound_total", &[])
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// `agent`'s metrics once `key` reached `at_least`, or as they are after a moment.
fn counted(agent: &Agent, key: &str, at_least: f64) -> Result<integration::metrics::Metrics> {
    let deadline = std::time::Instant::now() + pace::scaled(WAIT);
    loop {
        let metrics = agent.metrics()?;
        if metrics.get_or_zero(key) >= at_least || std::time::Instant::now() > deadline {
            return Ok(metrics);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Only port 15008 is taken from the Pods: plain traffic to b1's other ports is forwarded to it
/// as before, and when the agent stops, its routing goes with it.
#[test]
fn other_ports_pass_to_the_pod_and_the_routing_goes_with_the_agent() -> Result<()> {
    let Nodes {
        agent_a,
        agent_b,
        args_a: _,
        args_b: _,
        _web,
        ca: _,
        a,
        b,
    } = nodes(&[])?;
    let rules =
        || -> Result<String> { Ok(b.node_cmd("ip").args(["rule", "list"]).ok()?.stdout_str()) };
    ensure!(
        rules()?.contains("15008"),
        "the rule is in place: {}",
        rules()?
    );
    // Once the agent is ready, not some time after: a peer may dial b1 at once.
    for family in ["-4", "-6"] {
        let rules = b
            .node_cmd("ip")
            .args([family, "rule", "list"])
            .ok()?
            .stdout_str();
        ensure!(rules.contains("15008"), "the {family} rule: {rules}");
    }
    let b1_ip6 = pod_ip6(B1.1.parse()?).to_string();
    for (family, b1) in [("-4", B1.1), ("-6", b1_ip6.as_str())] {
        let routes = b
            .node_cmd("ip")
            .args([family, "route", "show", "table", "15008"])
            .ok()?
            .stdout_str();
        ensure!(
            routes.contains(b1),
            "b1's {family} route to the agent at once: {routes:?}"
        );
    }
    let body = a
        .node_cmd("curl")
        .args(["-sS", "--max-time", "10", &format!("http://{B1_WEB}/")])
        .ok()
        .context("plain HTTP from node a to b1")?
        .stdout_str();
    ensure!(body.trim() == "web-b1", "plain to b1: {body:?}");
    ensure!(
        rules()?.contains("fwmark 0x1000/0x1000 lookup 15009"),
        "the rule for answers is in place: {}",
        rules()?
    );
    agent_b.stop()?;
    let left = rules()?;
    ensure!(
        !left.contains("15008") && !left.contains("15009"),
        "the rules are gone: {left}"
    );
    let table = b
        .node_cmd("ip")
        .args(["route", "show", "table", "15009"])
        .output()?
        .stdout_str();
    ensure!(table.trim().is_empty(), "table 15009 is empty: {table}");
    drop((agent_a, _web));
    Ok(())
}

/// A successor on node b takes over receiving HBONE from the agent before it (its listener binds
/// beside the old one, the rule and routes in place are taken over, not rebuilt): a1 reaches b1
/// before, across and after the hand-over, and the old agent leaves the routing to its successor.
#[test]
fn a_successor_takes_over_receiving_and_the_routing_stays_in_place() -> Result<()> {
    let Nodes {
        agent_a,
        agent_b,
        args_a: _,
        args_b,
        _web,
        ca: _,
        a,
        b,
    } = nodes(&[])?;
    let curl = || curl_body(a.pod(A1.0), &format!("http://{B1_WEB}/"));
    ensure!(curl()? == "web-b1", "before the hand-over");
    let args: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let successor = Agent::start_successor(&b, &args)?;
    ensure!(curl()? == "web-b1", "across the hand-over");
    agent_b.terminate_async();
    agent_b.wait_exit(Duration::from_secs(60))?;
    let rules = b.node_cmd("ip").args(["rule", "list"]).ok()?.stdout_str();
    ensure!(
        rules.contains("15008"),
        "the old agent left the rule: {rules}"
    );
    let routes = b
        .node_cmd("ip")
        .args(["route", "show", "table", "15008"])
        .ok()?
        .stdout_str();
    ensure!(routes.contains(B1.1), "and b1's route: {routes}");
    ensure!(curl()? == "web-b1", "after the old agent left");
    let received = successor.metrics()?.get_or_zero(&inbound("ok"));
    ensure!(received >= 1.0, "the successor received {received} streams");
    drop((agent_a, successor, _web));
    Ok(())
}

/// A rollout of the DaemonSet's image on both nodes under HBONE traffic fails no connection: each
/// agent runs from the image as the DaemonSet runs it (its capabilities, seccomp profile and
/// arguments, the source swapped for this run's files); a1 (known to the proxy by its address) and
/// a2 (known to the kernel by its cgroup) connect to b1 in a loop while node b's agent, then node
/// a's, is handed over to a surge container and the old one stops. Every connection is answered
/// by b1, and the successors carry streams over HBONE.
#[test]
fn a_rollout_of_both_agents_under_hbone_traffic_fails_no_connection() -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    if let Err(why) = container::runtime_available() {
        eprintln!(
            "SKIPPED: the rollout runs the DaemonSet's image, which needs a container runtime: {why:#}"
        );
        return Ok(());
    }
    let image = Image::from_env();
    container::require_image(&image.tag)?;
    let launch = |topo: &Topology, args: &[&str]| Agent::launch_image(topo, &image, args);
    let Nodes {
        agent_a,
        agent_b,
        args_a,
        args_b,
        _web,
        ca: _,
        a,
        b,
    } = nodes_started_by(&[], &launch)?;
    let url = format!("http://{B1_WEB}/");
    let stop = AtomicBool::new(false);
    let (answered, failures, successor_a, successor_b) = std::thread::scope(|scope| {
        let traffic = scope.spawn(|| {
            let (mut answered, mut failures) = (0, Vec::new());
            for pod in [A1.0, A2.0].iter().cycle() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match curl_body(a.pod(pod), &url) {
                    Ok(body) if body == "web-b1" => answered += 1,
                    Ok(body) => failures.push(format!("{pod}: answered {body:?}")),
                    Err(e) => failures.push(format!("{pod}: {e:#}")),
                }
            }
            (answered, failures)
        });
        let pause = || std::thread::sleep(pace::scaled(Duration::from_millis(500)));
        let hand_over = |topo: &Topology, args: &[String], old: Agent| -> Result<Agent> {
            pause();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let successor = Agent::start_successor_image(topo, &image, &args)?;
            pause();
            old.terminate_async();
            old.wait_exit(Duration::from_secs(60))?;
            Ok(successor)
        };
        let successors =
            hand_over(&b, &args_b, agent_b).and_then(|b| Ok((hand_over(&a, &args_a, agent_a)?, b)));
        pause();
        stop.store(true, Ordering::Relaxed);
        let (answered, failures) = traffic.join().unwrap_or_default();
        successors.map(|(a, b)| (answered, failures, a, b))
    })?;
    ensure!(
        failures.is_empty(),
        "{} of {} connections failed across the rollout: {failures:#?}",
        failures.len(),
        answered + failures.len()
    );
    ensure!(
        answered >= 10,
        "only {answered} connections were made across the rollout"
    );
    let received = successor_b.metrics()?.get_or_zero(&inbound("ok"));
    let sent = successor_a.metrics()?.get_or_zero(TUNNELS_OK);
    ensure!(
        received >= 1.0 && sent >= 1.0,
        "the successors carried the traffic over HBONE: node a's opened {sent} tunnels, node b's received {received} streams"
    );
    drop((successor_a, successor_b, _web));
    Ok(())
}
