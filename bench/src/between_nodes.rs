//! `--between-nodes-only`: Pod to Pod across two nodes, directly and over HBONE. Two nodes of the
//! harness (each its own netns with one Pod), joined by a link; the servers in b1, the clients in
//! a1. Each round measures the direct path (no agent: plain routing between the nodes) and the
//! HBONE path (an agent on each node with `--hbone-between-nodes`: a1's agent tunnels to b1's
//! port 15008 from a1's address, b1's agent carries each stream on to b1 from it), in alternating
//! order; the table gives the medians and the paired ratios to direct. Writes no files.
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use integration::pki::TestCa;
use integration::procfs::Proto;
use integration::world::replace_file;
use integration::{Agent, Launch, Proc, Topology};

use super::rounds::Settings;
use super::scene::{CLIENT_CPU, HTTP_PORT, IPERF_PORT, SOCKPERF_PORT, start_server};
use super::stats::{Summary, paired_ratios};
use super::{iperf, sockperf, wrk};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.20");
const B1_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 20);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The two ways from a1 to b1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    Direct,
    Hbone,
}

/// One figure's runs, a slot per round for each way.
#[derive(Default)]
struct Figure {
    direct: Vec<Option<f64>>,
    hbone: Vec<Option<f64>>,
}

impl Figure {
    fn file(&mut self, way: Way, value: Option<f64>) {
        match way {
            Way::Direct => self.direct.push(value),
            Way::Hbone => self.hbone.push(value),
        }
    }
}

/// The figures of a run: one-stream throughput (Gbit/s), p50 and p99 latency (µs), new
/// connections a second.
#[derive(Default)]
struct Figures {
    throughput: Figure,
    p50: Figure,
    p99: Figure,
    conn_rate: Figure,
}

/// The two nodes, their Pods' servers, and what the agents are started with.
struct Nodes {
    _servers: Vec<Proc>,
    ca: TestCa,
    a: Topology,
    b: Topology,
}

/// Runs the rounds and prints the table.
pub(crate) fn measure(peer: &Path, settings: Settings) -> Result<()> {
    let nodes = Nodes::build(peer).context("building the two nodes")?;
    let mut figures = Figures::default();
    for round in 0..settings.rounds {
        let mut ways = [Way::Direct, Way::Hbone];
        if round % 2 == 1 {
            ways.reverse();
        }
        for way in ways {
            println!(
                "xtask bench: round {}/{}: {way:?}",
                round + 1,
                settings.rounds
            );
            nodes.round(way, settings, &mut figures)?;
        }
    }
    println!("\n{}", table(&figures));
    Ok(())
}

impl Nodes {
    fn build(peer: &Path) -> Result<Nodes> {
        let a = Topology::with_pods(&[A1])?;
        let b = Topology::with_pods(&[B1])?;
        Topology::link_nodes(&a, "10.244.1.0/24", &b, "10.244.2.0/24")?;
        let ca = TestCa::new(super::scene::TRUST_DOMAIN)?;
        let b1 = b.pod(B1.0).place();
        let at = |port| SocketAddrV4::new(B1_IP, port);
        let peer = peer.to_string_lossy();
        let http = vec![
            "serve".into(),
            "--name".into(),
            "bench".into(),
            "--listen".into(),
            at(HTTP_PORT).to_string(),
        ];
        let servers = vec![
            start_server(
                b1,
                "iperf3",
                iperf::server_args(at(IPERF_PORT)),
                Proto::Tcp,
                at(IPERF_PORT),
            )?,
            start_server(
                b1,
                "sockperf",
                sockperf::server_args(at(SOCKPERF_PORT)),
                Proto::Tcp,
                at(SOCKPERF_PORT),
            )?,
            start_server(b1, &peer, http, Proto::Tcp, at(HTTP_PORT))?,
        ];
        Ok(Nodes {
            _servers: servers,
            ca,
            a,
            b,
        })
    }

    /// The agent of `topo`, node `node`, with both Pods and their certificates.
    fn agent(&self, topo: &Topology, node: &str) -> Result<Agent> {
        let identities = topo.scratch_path("identities");
        self.ca.write_identity_dir(
            &identities,
            &[("team-a", "default"), ("team-b", "default")],
            DAY,
        )?;
        let config = topo.scratch_path("config");
        std::fs::create_dir_all(&config)?;
        replace_file(&config, "cluster.yaml", &cluster())?;
        let (config, identities) = (config.to_string_lossy(), identities.to_string_lossy());
        let args = [
            "--config",
            &config,
            "--identity-dir",
            &identities,
            "--node-name",
            node,
            "--hbone-between-nodes",
        ];
        Agent::launch(topo, &Launch::as_deployed(None), &args)
    }

    /// Each test once over `way`; over HBONE, checked to have ridden it.
    fn round(&self, way: Way, settings: Settings, figures: &mut Figures) -> Result<()> {
        let agents = match way {
            Way::Direct => None,
            Way::Hbone => Some((
                self.agent(&self.a, "node-a")?,
                self.agent(&self.b, "node-b")?,
            )),
        };
        if let Some((_, agent_b)) = &agents {
            let seen = self.client(
                "curl",
                &["-sS".into(), format!("http://{B1_IP}:{HTTP_PORT}/peer")],
            )?;
            ensure!(
                seen.starts_with(&format!("{}:", A1.1)),
                "over HBONE b1 saw {seen:?}, not a1's address"
            );
            ensure!(
                agent_b.metrics()?.get_or_zero(STREAMS_OK) >= 1.0,
                "node b's agent received nothing"
            );
        }
        let before = received(agents.as_ref())?;
        let secs = settings.secs;
        let throughput = self
            .client(
                "iperf3",
                &iperf::client_args(SocketAddrV4::new(B1_IP, IPERF_PORT), 1, secs),
            )
            .and_then(|out| iperf::parse(&out));
        figures.throughput.file(way, throughput.ok());
        let latency = self
            .client(
                "sockperf",
                &sockperf::client_args(SocketAddrV4::new(B1_IP, SOCKPERF_PORT), secs),
            )
            .and_then(|out| sockperf::parse(&out));
        figures.p50.file(way, latency.as_ref().ok().map(|p| p.p50));
        figures.p99.file(way, latency.as_ref().ok().map(|p| p.p99));
        let url = format!("http://{B1_IP}:{HTTP_PORT}/");
        let conn_rate = self
            .client("wrk", &wrk::client_args(&url, settings.wrk_conns, secs))
            .and_then(|out| wrk::parse(&out));
        figures
            .conn_rate
            .file(way, conn_rate.as_ref().ok().map(|r| r.per_second));
        if let (Some(before), Ok(rate)) = (before, &conn_rate) {
            let streams = received(agents.as_ref())?.unwrap_or_default() - before;
            // Every request of wrk's (one connection each) and the three other tests' own.
            if streams < rate.requests as f64 {
                bail!(
                    "over HBONE node b's agent received {streams} streams for {} connections",
                    rate.requests
                );
            }
        }
        if let Some((a, b)) = agents {
            a.stop()?;
            b.stop()?;
        }
        Ok(())
    }

    /// Runs a client tool in a1, pinned to the client CPU; its stdout.
    fn client(&self, tool: &str, args: &[String]) -> Result<String> {
        let out = self
            .a
            .pod(A1.0)
            .cmd("taskset")
            .args(["-c", &CLIENT_CPU.to_string(), tool])
            .args(args)
            .timeout(Duration::from_secs(120))
            .output()?;
        if !out.success() {
            bail!("{tool}: {out}");
        }
        Ok(out.stdout_str())
    }
}

const STREAMS_OK: &str = r#"redirect_hbone_inbound_total{result="ok"}"#;

/// Streams node b's agent carried so far, over HBONE.
fn received(agents: Option<&(Agent, Agent)>) -> Result<Option<f64>> {
    agents
        .map(|(_, b)| Ok(b.metrics()?.get_or_zero(STREAMS_OK)))
        .transpose()
}

/// Both agents' cluster: the two Pods, each on its node, with a service account, their
/// namespaces in the ambient mesh (traffic between them rides HBONE).
fn cluster() -> String {
    let ambient = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{istio.io/dataplane-mode: ambient}}}}\n"
        )
    };
    let pod = |(key, ip): (&str, &str), node: &str, uid: &str| {
        let (namespace, name) = key.split_once('/').unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}}}\nspec: {{nodeName: {node}, serviceAccountName: default}}\nstatus: {{podIP: {ip}, podIPs: [{{ip: {ip}}}]}}\n"
        )
    };
    let namespaces = [A1, B1].map(|(key, _)| ambient(key.split_once('/').unwrap_or_default().0));
    format!(
        "{}---\n{}---\n{}---\n{}",
        namespaces[0],
        namespaces[1],
        pod(A1, "node-a", "0a1a1a1a-0000-4000-8000-0000000000a1"),
        pod(B1, "node-b", "0b1b1b1b-0000-4000-8000-0000000000b1"),
    )
}

/// The medians of both ways and the median of the paired ratios.
fn table(figures: &Figures) -> String {
    let mut out = String::from(
        "| figure | direct | over HBONE | ratio (paired) |\n| --- | --- | --- | --- |\n",
    );
    let rows = [
        ("one stream, Gbit/s", &figures.throughput),
        ("latency p50, µs", &figures.p50),
        ("latency p99, µs", &figures.p99),
        ("new connections /s", &figures.conn_rate),
    ];
    for (name, figure) in rows {
        let median = |runs: &[Option<f64>]| {
            let values: Vec<f64> = runs.iter().flatten().copied().collect();
            Summary::of(&values).map_or("failed".to_string(), |s| format!("{:.2}", s.median))
        };
        let ratio = Summary::of(&paired_ratios(&figure.hbone, &figure.direct))
            .map_or("-".to_string(), |s| format!("{:.2}×", s.median));
        out.push_str(&format!(
            "| {name} | {} | {} | {ratio} |\n",
            median(&figure.direct),
            median(&figure.hbone)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_pairs_each_round_and_names_a_failed_figure() {
        let mut figures = Figures::default();
        for (direct, hbone) in [(10.0, 4.0), (12.0, 3.0), (8.0, 4.0)] {
            figures.throughput.file(Way::Direct, Some(direct));
            figures.throughput.file(Way::Hbone, Some(hbone));
        }
        figures.p50.file(Way::Direct, Some(20.0));
        figures.p50.file(Way::Hbone, None);
        let table = table(&figures);
        assert!(
            table.contains("| one stream, Gbit/s | 10.00 | 4.00 | 0.40× |"),
            "{table}"
        );
        assert!(
            table.contains("| latency p50, µs | 20.00 | failed | - |"),
            "{table}"
        );
    }
}
