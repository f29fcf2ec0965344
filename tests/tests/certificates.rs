//! Workload certificates over time (`docs/operating.md`), on two nodes with HBONE between them
//! and both agents' certificates from Istio's CA (`rdt-peer ca` in node a's netns, granting short
//! lifetimes whatever the agents ask): a tunnel open across its certificate's expiry keeps
//! flowing; with the CA gone, certificates are kept until they expire, then new tunnels fail, are
//! counted `expired` and said at WARN; with the CA back, the next connection works.
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::fixtures::curl_body;
use integration::pki::TestCa;
use integration::two_nodes::{self, A1, B1, TRUST_DOMAIN};
use integration::world::replace_file;
use integration::{Agent, Peer, Proc, Topology, pace, peer};

const B1_WEB: &str = "10.244.2.20:8080";
const B1_ECHO: &str = "10.244.2.20:9000";
/// istiod's stand-in: node a's end of the link between the nodes, so both agents reach it.
const CA_IP: &str = "100.64.0.1";
const CA_ADDRESS: &str = "100.64.0.1:15012";

fn certificates(result: &str) -> String {
    format!(r#"redirect_hbone_certificates_total{{result="{result}"}}"#)
}

/// Fields drop in order: agents and servers before their topologies.
struct Nodes {
    agent_a: Agent,
    agent_b: Agent,
    ca: Option<Proc>,
    /// How `ca` was started (it is started again alike).
    ca_args: Vec<String>,
    _web: Peer,
    a: Topology,
    _b: Topology,
}

/// Node a with a1, node b with b1 (HTTP on 8080, echo on 9000), linked; an agent on each with
/// HBONE between nodes, asking the CA for certificates of the default lifetime (24 h), which the
/// CA shortens to `ttl`.
fn nodes(ttl: Duration) -> Result<Nodes> {
    let a = Topology::with_pods(&[A1])?;
    let b = Topology::with_pods(&[B1])?;
    Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
    let web = Peer::start(
        b.pod(B1.0).place(),
        "web-b1",
        &[B1_WEB.parse()?],
        &[B1_ECHO.parse()?],
    )?;
    let dir = a.scratch_path("ca");
    TestCa::new(TRUST_DOMAIN)?.save(&dir)?;
    let token = dir.join("istio-token");
    std::fs::write(&token, "node-agent-token\n")?;
    let ca_args: Vec<String> = [
        "ca",
        "--listen",
        CA_ADDRESS,
        "--trust-domain",
        TRUST_DOMAIN,
        "--name",
        CA_IP,
        "--allow",
        "team-a/default",
        "--allow",
        "team-b/default",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--ca-dir".into(),
        path(&dir),
        "--token".into(),
        path(&token),
        "--ttl".into(),
        ttl.as_secs().to_string(),
    ])
    .collect();
    let ca = start_ca(&a, &ca_args)?;
    let start = |topo: &Topology, node: &str| -> Result<Agent> {
        let config = topo.scratch_path("config");
        std::fs::create_dir_all(&config)?;
        replace_file(&config, "cluster.yaml", &two_nodes::pods())?;
        let args = [
            "--config".to_string(),
            path(&config),
            "--node-name".into(),
            node.into(),
            "--hbone-between-nodes".into(),
            "--ca-address".into(),
            format!("https://{CA_ADDRESS}"),
            "--ca-root".into(),
            path(&dir.join("root-cert.pem")),
            "--ca-token".into(),
            path(&token),
        ];
        Agent::start(topo, &args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let agent_a = start(&a, "node-a")?;
    let agent_b = start(&b, "node-b")?;
    Ok(Nodes {
        agent_a,
        agent_b,
        ca: Some(ca),
        ca_args,
        _web: web,
        a,
        _b: b,
    })
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn start_ca(a: &Topology, args: &[String]) -> Result<Proc> {
    let mut ca = peer::cmd(a.node())?.args(args).spawn()?;
    ca.wait_for_log(&format!("listening {CA_ADDRESS}"), Duration::from_secs(10))?;
    Ok(ca)
}

/// What a curl from a1 to b1 got: success, or curl's exit code and error.
#[derive(Debug, Clone, PartialEq)]
enum Got {
    Body,
    Failed(Option<i32>, String),
}

impl Nodes {
    fn curl_from_a1(&self) -> Result<String> {
        curl_body(self.a.pod(A1.0), &format!("http://{B1_WEB}/"))
    }

    fn try_curl(&self) -> Result<Got> {
        let out = self
            .a
            .pod(A1.0)
            .cmd("curl")
            .args([
                "-sS",
                "--fail",
                "--max-time",
                "5",
                &format!("http://{B1_WEB}/"),
            ])
            .output()?;
        Ok(match out.success() && out.stdout_str().trim() == "web-b1" {
            true => Got::Body,
            false => Got::Failed(out.status.code(), out.stderr_str().trim().to_string()),
        })
    }

    /// `rdt-peer hold` from a1 to b1's echo: one connection exchanging a line every 50 ms.
    fn hold(&self) -> Result<Proc> {
        let mut hold = peer::cmd(self.a.pod(A1.0).place())?
            .args(["hold", B1_ECHO, "--interval-ms", "50"])
            .spawn()?;
        hold.wait_for_log("ok 0", Duration::from_secs(10))?;
        Ok(hold)
    }

    fn metric_a(&self, key: &str) -> Result<f64> {
        Ok(self.agent_a.metrics()?.get_or_zero(key))
    }

    fn ca_log(&self) -> String {
        self.ca.as_ref().map(Proc::log).unwrap_or_default()
    }
}

/// The highest `ok <i>` a `rdt-peer hold` client printed.
fn last_exchange(hold: &Proc) -> u64 {
    hold.log()
        .lines()
        .filter_map(|l| l.strip_prefix("ok ")?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// The hold client is still exchanging lines on its one connection: ten more after now.
fn still_holding(hold: &mut Proc, when: &str) -> Result<()> {
    let next = last_exchange(hold) + 10;
    hold.wait_for_log(&format!("ok {next}"), Duration::from_secs(5))
        .with_context(|| format!("the held connection {when}"))
}

/// A connection opened on a certificate that then expires keeps flowing: TLS authenticated both
/// ends at the handshake, and neither agent closes it. The certificate is renewed at half its
/// 10 s (the CA's grant, not the 24 h asked), so new connections go on a new HBONE connection
/// made with the new certificate; the held one keeps its own.
#[test]
fn a_tunnel_open_across_its_certificates_expiry_keeps_flowing() -> Result<()> {
    const TTL: Duration = Duration::from_secs(10);
    let n = nodes(TTL)?;
    let started = Instant::now();
    ensure!(n.curl_from_a1()? == "web-b1", "the first connection");
    let mut hold = n.hold()?;
    let connections = n.metric_a("redirect_hbone_connections_total")?;
    ensure!(
        connections == 1.0,
        "the held tunnel rides the first connection, made with the first certificate: {connections}"
    );
    ensure!(
        n.ca_log().contains(&format!(
            "issued identity=spiffe://{TRUST_DOMAIN}/ns/team-a/sa/default ttl=10s cluster=Kubernetes asked=86400s"
        )),
        "the agent asks 24 h and is granted 10 s:\n{}",
        n.ca_log()
    );
    // Past that certificate's expiry, with a few seconds to spare.
    while started.elapsed() < TTL + Duration::from_secs(3) {
        ensure!(
            hold.is_running(),
            "the held connection ended after {:?}:\n{}",
            started.elapsed(),
            hold.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    still_holding(&mut hold, "after its certificate expired")?;
    let exchanged = last_exchange(&hold);
    // 13 s at one exchange each 50 ms and a round trip: at least half of the 260 possible.
    ensure!(exchanged >= 130, "{exchanged} exchanges across the expiry");
    ensure!(n.curl_from_a1()? == "web-b1", "a new connection after");
    let metrics = n.agent_a.metrics()?;
    let (renewed, expired) = (
        metrics.get_or_zero(&certificates("renewed")),
        metrics.get_or_zero(&certificates("expired")),
    );
    let dials = metrics.get_or_zero("redirect_hbone_connections_total");
    ensure!(
        renewed >= 1.0 && expired == 0.0 && dials >= 2.0,
        "renewed {renewed}, expired {expired}, connections {dials}: {:#?}",
        metrics.samples()
    );
    let received = n.agent_b.metrics()?.get_or_zero(&certificates("renewed"));
    ensure!(received >= 1.0, "node b renewed b1's certificate too");
    hold.terminate(Duration::from_secs(5))?;
    Ok(())
}

/// The CA killed right after the first certificates: tunnels keep working on them until they
/// expire, the failed renewals said at WARN (not once per try); past the expiry, a new connection
/// from a1 is reset (curl: could not connect) and counted `expired`, while one held since before goes on; the
/// CA started again, the next connection works.
#[test]
fn with_the_ca_gone_certificates_serve_until_they_expire_and_tunnels_resume_when_it_is_back()
-> Result<()> {
    const TTL: Duration = Duration::from_secs(16);
    let mut n = nodes(TTL)?;
    let before_issue = Instant::now();
    ensure!(n.curl_from_a1()? == "web-b1", "the first connection");
    let after_issue = Instant::now();
    let mut hold = n.hold()?;
    if let Some(mut ca) = n.ca.take() {
        ca.signal(libc::SIGKILL);
        ca.wait(Duration::from_secs(5))?;
    }
    // The certificate expires between these, whole seconds in the certificate.
    let (earliest, latest) = (
        before_issue + TTL - Duration::from_secs(1),
        after_issue + TTL,
    );
    let at = |t: Instant| t.saturating_duration_since(before_issue).as_secs_f64();
    let mut got = Vec::new();
    let mut warned_at = None;
    while Instant::now() < latest + Duration::from_secs(4) {
        got.push((at(Instant::now()), n.try_curl()?));
        if warned_at.is_none()
            && n.agent_a
                .log()
                .contains("renewing a workload certificate failed")
        {
            warned_at = Some(at(Instant::now()));
        }
        std::thread::sleep(Duration::from_millis(400));
    }
    let window = (at(earliest) - 0.5, at(latest) + 1.5);
    let wrong: Vec<_> = got
        .iter()
        .filter(|(t, g)| (*t < window.0 && *g != Got::Body) || (*t > window.1 && *g == Got::Body))
        .collect();
    ensure!(
        wrong.is_empty(),
        "served until the expiry (between {:.1} and {:.1} s), refused after: wrong {wrong:?}\nall {got:?}",
        at(earliest),
        at(latest)
    );
    let first_failure = got.iter().find(|(_, g)| *g != Got::Body).cloned();
    let (failed_at, failure) = first_failure.context("no connection failed")?;
    // The agent resets the Pod's connection as it is made: curl says it could not connect (7),
    // or, had it sent its request, that the connection was reset (56) or closed (52).
    ensure!(
        matches!(&failure, Got::Failed(Some(7 | 52 | 56), _)),
        "a connection after the expiry is reset: {failure:?}"
    );
    still_holding(&mut hold, "after the expiry with the CA gone")?;

    let log = n.agent_a.log();
    let warned = log
        .matches("renewing a workload certificate failed")
        .count();
    let failed = n.metric_a(&certificates("failed"))?;
    ensure!(
        warned == 1 && failed >= 5.0,
        "{failed} failed calls said at WARN {warned} times:\n{log}"
    );
    ensure!(
        log.contains("a workload certificate expired and the CA has not renewed it"),
        "{log}"
    );
    let expired = n.metric_a(&certificates("expired"))?;
    let ca_failed = n.metric_a(r#"redirect_hbone_tunnels_total{result="ca_failed"}"#)?;
    ensure!(
        expired >= 1.0 && ca_failed >= 1.0,
        "expired {expired}, tunnels ca_failed {ca_failed}"
    );

    // The CA back: the next connection (asked at most a second after the last failure) works.
    let ca = start_ca(&n.a, &n.ca_args)?;
    n.ca = Some(ca);
    let back = Instant::now();
    let mut tries = 0;
    while n.try_curl()? != Got::Body {
        tries += 1;
        ensure!(
            back.elapsed() < pace::scaled(Duration::from_secs(10)),
            "no connection within 10 s of the CA's return:\n{}",
            n.agent_a.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let recovered = back.elapsed();
    ensure!(
        recovered < pace::scaled(Duration::from_secs(3)),
        "{recovered:?} after the CA's return"
    );
    let last_success = got
        .iter()
        .filter(|(_, g)| *g == Got::Body)
        .map(|(t, _)| *t)
        .fold(0.0, f64::max);
    eprintln!(
        "WARN at {warned_at:?} s; expiry between {:.1} and {:.1} s; last success at {last_success:.1} s, first failure at {failed_at:.1} s ({failure:?}); recovered {recovered:?} after the CA's return ({tries} failed before)",
        at(earliest),
        at(latest)
    );
    hold.terminate(Duration::from_secs(5))?;
    Ok(())
}
