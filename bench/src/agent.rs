//! The agent as a node runs it: `redirect run` at its default log level (info), unpinned or with every
//! thread pinned to one CPU from the start. The harness's `Agent` adds `-v` and prints its log tail
//! whenever it is dropped: right for a test, noise for a bench that restarts the agent dozens of times.
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use integration::{ADMIN_ADDR, GATEWAY, Metrics, Proc, Topology, netns};
use redirect_userspace::admin::client::{self, Response};

const READY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct BenchAgent {
    proc: Proc,
    netns: String,
    admin: SocketAddr,
}

impl BenchAgent {
    /// `[taskset -c CPU] redirect run --cgroup <pods> --gateway 169.254.7.1 --admin 127.0.0.1:15000 ARGS`
    /// in the node netns; returns once `/healthz/ready` answers 200.
    pub fn start(topo: &Topology, args: &[String], cpu: Option<u32>) -> Result<BenchAgent> {
        let agent = integration::Agent::bin()?;
        let cmd = match cpu {
            Some(cpu) => topo
                .node_cmd("taskset")
                .args(["-c", &cpu.to_string()])
                .arg(agent),
            None => topo.node_cmd(agent),
        };
        let proc = cmd
            .arg("run")
            .arg("--cgroup")
            .arg(topo.attach_cgroup())
            .args(["--gateway", &GATEWAY.to_string(), "--admin", ADMIN_ADDR])
            .args(args)
            .spawn()?;
        let mut agent = BenchAgent {
            proc,
            netns: topo.node().netns.clone(),
            admin: ADMIN_ADDR.parse().context("admin address")?,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if matches!(agent.get("/healthz/ready"), Ok(r) if r.status == 200) {
                return Ok(agent);
            }
            if !agent.proc.is_running() {
                bail!(
                    "the agent exited before it was ready; log:\n{}",
                    agent.proc.log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent was not ready within {READY_TIMEOUT:?}; log:\n{}",
                    agent.proc.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `GET path` on the admin port, from inside the node netns.
    pub fn get(&self, path: &str) -> Result<Response> {
        let addr = self.admin;
        netns::in_netns(&self.netns, || {
            client::get(addr, path, Duration::from_secs(5))
        })?
    }

    pub fn metrics(&self) -> Result<Metrics> {
        let r = self.get("/metrics")?;
        if r.status != 200 {
            bail!("/metrics answered {}: {}", r.status, r.text());
        }
        Metrics::parse(&r.text())
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// SIGTERM; the agent must exit cleanly (status 0), its programs detached.
    pub fn stop(mut self) -> Result<()> {
        let status = self.proc.terminate(Duration::from_secs(10))?;
        if !status.success() {
            bail!(
                "the agent exited with {status} after SIGTERM; log:\n{}",
                self.proc.log()
            );
        }
        Ok(())
    }
}
