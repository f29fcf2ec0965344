//! The pooled HBONE client (`docs/data-plane.md#hbone-between-nodes`) against faulty peers, with
//! real network namespaces, the agent and curl: two nodes as in `between_nodes.rs`, node a with
//! its agent and a1, node b with b1 and no agent. b1's HBONE port is served by `rdt-peer hbone`
//! in b1's own netns, holding b1's workload certificate, so node a's agent dials it exactly as
//! it would node b's agent (`<pod IP>:15008`, mutual TLS as a1, the peer checked to be of
//! team-b), and the stand-in plays the fault:
//! - it takes TCP and never answers TLS: a burst of tunnels waits for one dial and fails at one
//!   handshake timeout, and a dial after the failed one's backoff is a new connection;
//! - it answers the first `CONNECT` with GOAWAY(last_stream_id=0) or RST_STREAM(REFUSED_STREAM):
//!   the stream was never processed, so the client sends it again and curl gets its answer.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::fixtures::curl_body;
use integration::pki::TestCa;
use integration::two_nodes::{self, A1, B1, DAY, TRUST_DOMAIN};
use integration::world::replace_file;
use integration::{Agent, Peer, Proc, Topology, pace, peer};

const B1_WEB: &str = "10.244.2.20:8080";
const B1_HBONE: &str = "10.244.2.20:15008";
/// The client's limit for a TLS handshake (`HANDSHAKE_TIMEOUT` in `hbone/client.rs`).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the client remembers a failed dial (`FAILED_BACKOFF`).
const FAILED_BACKOFF: Duration = Duration::from_secs(1);

/// Fields drop in order: processes before their topologies.
struct Nodes {
    agent: Agent,
    stand_in: Proc,
    _web: Peer,
    a: Topology,
    _b: Topology,
}

/// Node a with a1 and its agent (HBONE between nodes), node b with b1 serving HTTP on 8080, and
/// `rdt-peer hbone FAULT` at b1's HBONE port as team-b's identity, carrying b1's port 8080 to it.
fn nodes(fault: &str) -> Result<Nodes> {
    let a = Topology::with_pods(&[A1])?;
    let b = Topology::with_pods(&[B1])?;
    Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let place = b.pod(B1.0).place();
    let web = Peer::start(place, "web-b1", &[B1_WEB.parse()?], &[])?;

    let tls = ca.write_server_files(&b.scratch_path("stand-in"), "team-b", "default", DAY)?;
    let mut cmd = peer::cmd(place)?
        .args(["hbone", "--name", "node-b-stand-in", "--listen", B1_HBONE])
        .args(tls)
        .args(["--route", &format!("{B1_WEB}={B1_WEB}")]);
    if !fault.is_empty() {
        cmd = cmd.arg(fault);
    }
    let mut stand_in = cmd.spawn()?;
    stand_in.wait_for_log(&format!("listening {B1_HBONE}"), Duration::from_secs(10))?;

    let identities = a.scratch_path("identities");
    ca.write_identity_dir(&identities, &[("team-a", "default")], DAY)?;
    let config = a.scratch_path("config");
    std::fs::create_dir_all(&config)?;
    replace_file(&config, "cluster.yaml", &two_nodes::pods())?;
    let (config, identities) = (config.to_string_lossy(), identities.to_string_lossy());
    let agent = Agent::start(
        &a,
        &[
            "--config",
            &config,
            "--identity-dir",
            &identities,
            "--node-name",
            "node-a",
            "--hbone-between-nodes",
        ],
    )?;
    Ok(Nodes {
        agent,
        stand_in,
        _web: web,
        a,
        _b: b,
    })
}

impl Nodes {
    /// How many lines of the stand-in's log start with `prefix`.
    fn count(&self, prefix: &str) -> usize {
        self.stand_in
            .log()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    fn metric(&self, key: &str) -> Result<f64> {
        Ok(self.agent.metrics()?.get_or_zero(key))
    }

    /// Waits until the stand-in has printed `n` lines starting with `prefix`.
    fn wait_count(&self, prefix: &str, n: usize, within: Duration) -> Result<()> {
        let deadline = Instant::now() + pace::scaled(within);
        while self.count(prefix) < n {
            ensure!(
                Instant::now() < deadline,
                "the stand-in printed {} of {n} {prefix:?} lines within {within:?}; log:\n{}",
                self.count(prefix),
                self.stand_in.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

fn tunnels(result: &str) -> String {
    format!(r#"redirect_hbone_tunnels_total{{result="{result}"}}"#)
}
const CONNECTIONS: &str = "redirect_hbone_connections_total";

/// Four curls at once from a1 to b1, whose HBONE peer takes TCP and never answers TLS: one dial,
/// whose handshake timeout fails all four together (not one after another, 10, 20, 30 and 40 s),
/// and the peer sees one connection. A tunnel asked for after the failed dial's backoff dials
/// again.
#[test]
fn tunnels_waiting_for_a_peer_that_never_answers_tls_share_one_dial_and_fail_together() -> Result<()>
{
    let n = nodes("--stall-tls")?;
    let start = Instant::now();
    let outcomes: Vec<(Duration, bool, String)> = std::thread::scope(|s| {
        let curls: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let out =
                        n.a.pod(A1.0)
                            .cmd("curl")
                            .args(["-sS", "--max-time", &pace::scaled_secs(40)])
                            .arg(format!("http://{B1_WEB}/"))
                            .timeout(pace::scaled(Duration::from_secs(60)))
                            .output();
                    let elapsed = start.elapsed();
                    match out {
                        Ok(out) => (elapsed, out.success(), out.stderr_str()),
                        Err(e) => (elapsed, true, format!("curl did not run: {e:#}")),
                    }
                })
            })
            .collect();
        curls
            .into_iter()
            .map(|c| {
                c.join()
                    .unwrap_or((Duration::ZERO, true, "panicked".into()))
            })
            .collect()
    });
    eprintln!("the four curls: {outcomes:?}");
    for (elapsed, ok, stderr) in &outcomes {
        ensure!(!ok, "a curl succeeded or did not run: {stderr}");
        // Not at once (something other than the handshake refused it), and not after the
        // others' timeouts (a dial of its own after theirs).
        ensure!(
            *elapsed >= HANDSHAKE_TIMEOUT - Duration::from_secs(1)
                && *elapsed <= pace::scaled(HANDSHAKE_TIMEOUT + Duration::from_secs(1)),
            "a curl failed after {elapsed:?}, not at the handshake timeout {HANDSHAKE_TIMEOUT:?} \
             (all four: {outcomes:?}); the stand-in's log:\n{}",
            n.stand_in.log()
        );
    }
    n.wait_count("stalled ", 1, Duration::from_secs(5))?;
    ensure!(
        n.count("accepted ") == 1,
        "the stand-in took {} connections for four tunnels; log:\n{}",
        n.count("accepted "),
        n.stand_in.log()
    );
    let failed = n.metric(&tunnels("connect_failed"))?;
    ensure!(failed == 4.0, "{failed} tunnels counted connect_failed");
    ensure!(n.metric(CONNECTIONS)? == 0.0, "no connection was opened");

    // Past the backoff the peer is dialled again: a second connection (curl need not wait out
    // its handshake).
    std::thread::sleep(FAILED_BACKOFF + Duration::from_millis(500));
    let _ =
        n.a.pod(A1.0)
            .cmd("curl")
            .args(["-sS", "--max-time", "1", &format!("http://{B1_WEB}/")])
            .output()?;
    n.wait_count("accepted ", 2, Duration::from_secs(5))?;
    eprintln!("the stand-in's log:\n{}", n.stand_in.log());
    Ok(())
}

/// b1's peer answers the first `CONNECT` of its first connection with GOAWAY(last_stream_id=0,
/// NO_ERROR): the stream was never processed, so the client sends it again on a new connection
/// and curl gets b1's answer. The connection that took GOAWAY carries no stream after it, and the
/// new one is pooled: a second curl rides it.
#[test]
fn a_connect_above_a_goaway_last_stream_is_sent_again_on_a_new_connection() -> Result<()> {
    let n = nodes("--goaway-first")?;
    let body = curl_body(n.a.pod(A1.0), &format!("http://{B1_WEB}/"))
        .with_context(|| format!("a1 -> b1; the stand-in's log:\n{}", n.stand_in.log()))?;
    ensure!(body == "web-b1", "a1 -> b1: {body:?}");
    let log = n.stand_in.log();
    ensure!(
        n.count("goaway stream=1 last_stream_id=0") == 1
            && n.count("accepted ") == 2
            && n.count("connect authority=10.244.2.20:8080 identity=spiffe://cluster.local/ns/team-a/sa/default backend=10.244.2.20:8080 status=200") == 1,
        "one GOAWAY, two connections, one stream carried; the stand-in's log:\n{log}"
    );

    let body = curl_body(n.a.pod(A1.0), &format!("http://{B1_WEB}/"))?;
    ensure!(body == "web-b1", "the second a1 -> b1: {body:?}");
    let log = n.stand_in.log();
    ensure!(
        n.count("accepted ") == 2 && n.count("connect ") == 2 && n.count("late stream") == 0,
        "the second tunnel rides the pooled connection, none the drained one; log:\n{log}"
    );
    let (ok, connections) = (n.metric(&tunnels("ok"))?, n.metric(CONNECTIONS)?);
    ensure!(
        ok == 2.0 && connections == 2.0,
        "{ok} tunnels ok over {connections} connections"
    );
    Ok(())
}

/// b1's peer resets the first `CONNECT` with REFUSED_STREAM: never processed, so sent again;
/// the connection is not draining, so the retry rides it, and curl gets b1's answer.
#[test]
fn a_connect_refused_unprocessed_is_sent_again() -> Result<()> {
    let n = nodes("--refuse-first-stream")?;
    let body = curl_body(n.a.pod(A1.0), &format!("http://{B1_WEB}/"))
        .with_context(|| format!("a1 -> b1; the stand-in's log:\n{}", n.stand_in.log()))?;
    ensure!(body == "web-b1", "a1 -> b1: {body:?}");
    let log = n.stand_in.log();
    ensure!(
        n.count("refused stream=1 reason=REFUSED_STREAM") == 1
            && n.count("accepted ") == 1
            && n.count("connect ") == 1
            && log.contains(" status=200"),
        "one stream refused, then carried on the same connection; the stand-in's log:\n{log}"
    );
    let (ok, connections) = (n.metric(&tunnels("ok"))?, n.metric(CONNECTIONS)?);
    ensure!(
        ok == 1.0 && connections == 1.0,
        "{ok} tunnels ok over {connections} connections"
    );
    Ok(())
}
