//! The node agent under test (`redirect run`), started in the node netns outside the pod cgroups.
//! The bench starts it here too, as a node runs it ([`Launch::as_deployed`]).
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::container;
use crate::metrics::Metrics;
use crate::proc::Proc;
use crate::topology::Topology;
use crate::{ADMIN_ADDR, GATEWAY, GATEWAY6, netns, procfs};
use redirect_userspace::admin_client::{self as client, Response};

const READY_TIMEOUT: Duration = Duration::from_secs(20);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How the agent is started. The default is a test's: debug log (`-v`), both gateways, and the end of
/// the log printed when the agent is dropped without a clean stop.
#[derive(Clone, Debug)]
pub struct Launch {
    /// `-v`: the debug log a failed test shows.
    pub verbose: bool,
    /// `--gateway fd00:7::1` besides the IPv4 one.
    pub ipv6_gateway: bool,
    /// Every thread pinned to this CPU from the start (`taskset -c`).
    pub cpu: Option<u32>,
    /// The open-files limit, soft and hard (`prlimit`, which then runs the agent in its own place:
    /// same pid).
    pub nofile: Option<u64>,
    /// Print the end of the log on a drop without a clean `stop()`.
    pub log_tail_on_drop: bool,
    /// The fast path, as the agent runs by default; `false` passes `--no-fast-path`. By default on
    /// unless the environment has `REDIRECT_FAST_PATH=0`, so a whole suite can run again with the
    /// proxy deciding everything. (A suite that tests the proxy's own behaviour passes
    /// `--no-fast-path` among its arguments, which wins.)
    pub fast_path: bool,
}

/// Whether the environment lets the agents of the run keep their default, the fast path
/// (`REDIRECT_FAST_PATH=0` turns it off).
pub fn fast_path_from_env() -> bool {
    std::env::var("REDIRECT_FAST_PATH").map_or(true, |v| v != "0")
}

/// The argument that turns the fast path off.
pub const NO_FAST_PATH: &str = "--no-fast-path";

impl Default for Launch {
    fn default() -> Launch {
        Launch {
            verbose: true,
            ipv6_gateway: true,
            cpu: None,
            nofile: None,
            log_tail_on_drop: true,
            fast_path: fast_path_from_env(),
        }
    }
}

impl Launch {
    /// A test's agent with `--no-fast-path`: every TCP connection goes to the proxy (the suites
    /// that test the proxy's own behaviour).
    pub fn no_fast_path() -> Launch {
        Launch {
            fast_path: false,
            ..Launch::default()
        }
    }

    /// The agent as a node runs it, for measuring: the default log level (info), the IPv4 gateway,
    /// unpinned or pinned to `cpu`, and quiet when dropped (a bench restarts it dozens of times).
    pub fn as_deployed(cpu: Option<u32>) -> Launch {
        Launch {
            verbose: false,
            ipv6_gateway: false,
            cpu,
            nofile: None,
            log_tail_on_drop: false,
            fast_path: fast_path_from_env(),
        }
    }
}

/// A running agent. Dropping it sends SIGTERM (then SIGKILL) and prints the end of its log, which the
/// test runner shows only for a failed test.
pub struct Agent {
    proc: Proc,
    /// Run from the image: the container, removed after the process above is gone.
    _container: Option<container::Guard>,
    /// Started with the fast path on (not `--no-fast-path`).
    fast_path: bool,
    admin: SocketAddr,
    node_netns: String,
    /// What the launch asked for, cleared by a successful `stop()` (a clean stop needs no post-mortem).
    log_tail_on_drop: bool,
    /// Logging at debug (`-v`): each decision and each hide has its line.
    debug_log: bool,
}

impl Agent {
    /// Whether this agent runs with the fast path (the default; not `--no-fast-path`).
    pub fn fast_path(&self) -> bool {
        self.fast_path
    }

    /// Whether it logs at debug (`-v`).
    pub fn debug_log(&self) -> bool {
        self.debug_log
    }

    /// `$REDIRECT_BIN`, else `<target dir>/release/redirect` of this workspace.
    pub fn bin() -> Result<PathBuf> {
        if let Some(p) = std::env::var_os("REDIRECT_BIN") {
            return Ok(PathBuf::from(p));
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("workspace root")?;
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace.join("target"));
        let bin = target.join("release").join("redirect");
        if !bin.is_file() {
            bail!(
                "agent binary {} is missing: run `cargo xtask build` (or set REDIRECT_BIN)",
                bin.display()
            );
        }
        Ok(bin)
    }

    /// Starts `redirect run --cgroup <pods cgroup> --gateway 169.254.7.1 --gateway fd00:7::1
    /// --admin 127.0.0.1:15000 -v`
    /// plus `extra_args` in the node netns, and waits until `/healthz/ready` answers 200.
    pub fn start(topo: &Topology, extra_args: &[&str]) -> Result<Agent> {
        Self::launch(topo, &Launch::default(), extra_args)
    }

    /// Like [`Agent::start`], with the open-files limit (soft and hard) set to `nofile`.
    pub fn start_with_fd_limit(topo: &Topology, nofile: u64, extra_args: &[&str]) -> Result<Agent> {
        let launch = Launch {
            nofile: Some(nofile),
            ..Launch::default()
        };
        Self::launch(topo, &launch, extra_args)
    }

    /// Like [`Agent::start`], started as `launch` says.
    pub fn launch(topo: &Topology, launch: &Launch, extra_args: &[&str]) -> Result<Agent> {
        let mut agent = Self::spawn_with(topo, launch, extra_args)?;
        agent.wait_ready()?;
        Ok(agent)
    }

    /// The agent run from `image` as the DaemonSet runs it ([`container::podman_run`]), in the
    /// node netns; `extra_args` name the source and upstream. Waits until it is ready.
    pub fn launch_image(
        topo: &Topology,
        image: &container::Image,
        extra_args: &[&str],
    ) -> Result<Agent> {
        let mut agent = Self::spawn_image(topo, image, extra_args)?;
        agent.wait_ready()?;
        Ok(agent)
    }

    /// Starts a successor while `self`'s agent on `topo` still serves: it takes over the listening
    /// sockets and the pinned programs. Returns once it says it serves alone and is ready.
    pub fn start_successor(topo: &Topology, extra_args: &[&str]) -> Result<Agent> {
        let agent = Self::spawn(topo, extra_args)?;
        agent.successor_ready()
    }

    /// [`Agent::start_successor`] from `image`, as the DaemonSet's surge pod starts beside the old.
    pub fn start_successor_image(
        topo: &Topology,
        image: &container::Image,
        extra_args: &[&str],
    ) -> Result<Agent> {
        let agent = Self::spawn_image(topo, image, extra_args)?;
        agent.successor_ready()
    }

    fn successor_ready(self) -> Result<Agent> {
        let mut agent = self;
        // Until the hand-over completes, the admin port still answers for the old agent.
        agent
            .proc
            .wait_for_log("agent running", READY_TIMEOUT)
            .with_context(|| format!("the successor never ran; log:\n{}", agent.log()))?;
        agent.wait_ready()?;
        Ok(agent)
    }

    /// `podman run` of the image in the foreground: the agent's output is podman's, and SIGTERM to
    /// podman reaches the agent (podman proxies signals), as the kubelet's does.
    fn spawn_image(
        topo: &Topology,
        image: &container::Image,
        extra_args: &[&str],
    ) -> Result<Agent> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{}-agent-{}",
            topo.id().tag(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let (cmd, guard) = container::podman_run(topo, &image.tag, &name, &image.edit, extra_args)?;
        // podman itself runs in the test's own netns (runc refuses the default sysctls of a container
        // whose netns is its own: "not allowed in host network namespace"); the container joins the
        // node's (`--network ns:`). The process stays in the run's cgroup, for the cleanup.
        let place = crate::Place {
            label: "podman".to_string(),
            netns: "/proc/self/ns/net".to_string(),
            ..topo.node().clone()
        };
        let proc = place.cmd(&cmd[0]).args(&cmd[1..]).spawn()?;
        Ok(Agent {
            proc,
            _container: Some(guard),
            // The DaemonSet runs the agent's default: the kernel decides what needs no proxy, and
            // the log at info.
            fast_path: true,
            debug_log: false,
            admin: ADMIN_ADDR.parse().context("admin address")?,
            node_netns: topo.node().netns.clone(),
            log_tail_on_drop: true,
        })
    }

    /// SIGTERM without waiting for the exit (a handed-over agent drains first); see [`Agent::wait_exit`].
    pub fn terminate_async(&self) {
        self.proc.signal(libc::SIGTERM);
    }

    /// Sends `signal` to the agent (9: it dies on the spot, as an OOM kill or a node failure does).
    pub fn signal(&self, signal: i32) {
        self.proc.signal(signal);
    }

    /// Waits for the exit after [`Agent::terminate_async`], requires status 0; returns the whole log.
    pub fn wait_exit(mut self, timeout: Duration) -> Result<String> {
        let status = self.proc.wait(crate::pace::scaled(timeout))?;
        if !status.success() {
            bail!("the agent exited with {status}; log:\n{}", self.log());
        }
        self.log_tail_on_drop = false;
        Ok(self.log())
    }

    /// Waits for the agent to exit by itself (or after a signal), whatever its status; returns the
    /// status and the whole log.
    pub fn wait_any_exit(
        mut self,
        timeout: Duration,
    ) -> Result<(std::process::ExitStatus, String)> {
        let status = self.proc.wait(timeout)?;
        self.log_tail_on_drop = false;
        Ok((status, self.log()))
    }

    /// Like [`Agent::start`] without waiting for readiness (to watch an agent that is not ready).
    pub fn spawn(topo: &Topology, extra_args: &[&str]) -> Result<Agent> {
        Self::spawn_with(topo, &Launch::default(), extra_args)
    }

    fn spawn_with(topo: &Topology, launch: &Launch, extra_args: &[&str]) -> Result<Agent> {
        Self::spawn_full(topo, launch, &[], &topo.pin_dir(), extra_args)
    }

    /// Like [`Agent::start`], the agent run by `wrapper` (e.g. `nsenter -t PID -m --`: in another
    /// mount namespace) and pinning under `bpffs` instead of the run's own bpffs. Waits until ready.
    pub fn launch_wrapped(
        topo: &Topology,
        wrapper: &[&str],
        bpffs: &Path,
        extra_args: &[&str],
    ) -> Result<Agent> {
        let wrapper: Vec<OsString> = wrapper.iter().map(OsString::from).collect();
        let mut agent = Self::spawn_full(topo, &Launch::default(), &wrapper, bpffs, extra_args)?;
        agent.wait_ready()?;
        Ok(agent)
    }

    /// [`Agent::start_successor`] for agents started with [`Agent::launch_wrapped`].
    pub fn start_successor_wrapped(
        topo: &Topology,
        wrapper: &[&str],
        bpffs: &Path,
        extra_args: &[&str],
    ) -> Result<Agent> {
        let wrapper: Vec<OsString> = wrapper.iter().map(OsString::from).collect();
        Self::spawn_full(topo, &Launch::default(), &wrapper, bpffs, extra_args)?.successor_ready()
    }

    fn spawn_full(
        topo: &Topology,
        launch: &Launch,
        wrapper: &[OsString],
        bpffs: &Path,
        extra_args: &[&str],
    ) -> Result<Agent> {
        // `[wrapper] [taskset -c CPU] [prlimit --nofile=N:N] redirect`: each execs the next, same pid.
        let mut program: Vec<OsString> = wrapper.to_vec();
        if let Some(cpu) = launch.cpu {
            program.extend(["taskset".into(), "-c".into(), cpu.to_string().into()]);
        }
        if let Some(nofile) = launch.nofile {
            program.extend([
                "prlimit".into(),
                format!("--nofile={nofile}:{nofile}").into(),
            ]);
        }
        program.push(Self::bin()?.into());
        let mut args = vec!["--gateway".to_string(), GATEWAY.to_string()];
        if launch.ipv6_gateway {
            args.extend(["--gateway".to_string(), GATEWAY6.to_string()]);
        }
        args.extend(["--admin".to_string(), ADMIN_ADDR.to_string()]);
        if launch.verbose {
            args.push("-v".to_string());
        }
        let fast_path = launch.fast_path && !extra_args.contains(&NO_FAST_PATH);
        if !fast_path && !extra_args.contains(&NO_FAST_PATH) {
            args.push(NO_FAST_PATH.to_string());
        }
        let proc = topo
            .node_cmd(&program[0])
            .args(&program[1..])
            .env("RUST_BACKTRACE", "1")
            .arg("run")
            .arg("--cgroup")
            .arg(topo.attach_cgroup())
            .args(args)
            // Run-unique: a successor started on the same topology takes over from this agent.
            .arg("--bpffs")
            .arg(bpffs)
            .arg("--handover-socket")
            .arg(topo.handover_socket())
            .args(extra_args)
            .spawn()?;
        Ok(Agent {
            proc,
            _container: None,
            fast_path,
            admin: ADMIN_ADDR.parse().context("admin address")?,
            node_netns: topo.node().netns.clone(),
            log_tail_on_drop: launch.log_tail_on_drop,
            debug_log: launch.verbose,
        })
    }

    /// Polls `/healthz/ready` until it answers 200; fails if the agent exits or the deadline passes.
    pub fn wait_ready(&mut self) -> Result<()> {
        let ready_timeout = crate::pace::scaled(READY_TIMEOUT);
        let deadline = Instant::now() + ready_timeout;
        loop {
            let last = match self.admin_get("/healthz/ready") {
                Ok(r) if r.status == 200 => return Ok(()),
                Ok(r) => format!("status {}: {}", r.status, r.text().trim()),
                Err(e) => format!("{e:#}"),
            };
            if !self.proc.is_running() {
                bail!("the agent exited before it was ready; log:\n{}", self.log());
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent was not ready within {ready_timeout:?} (last: {last}); log:\n{}",
                    self.log()
                );
            }
            // Short: the bench counts the time to ready.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `GET path` on the admin port, from inside the node netns.
    pub fn admin_get(&self, path: &str) -> Result<Response> {
        let addr = self.admin;
        netns::in_netns(&self.node_netns, || {
            client::get(addr, path, Duration::from_secs(5))
        })?
    }

    /// `/metrics`, parsed.
    pub fn metrics(&self) -> Result<Metrics> {
        let r = self.admin_get("/metrics")?;
        if r.status != 200 {
            bail!("/metrics answered {}: {}", r.status, r.text());
        }
        Metrics::parse(&r.text())
    }

    /// Polls `/metrics` until `done` holds; returns the last metrics seen, or fails at the deadline.
    pub fn wait_metrics(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Metrics) -> bool,
    ) -> Result<Metrics> {
        let timeout = crate::pace::scaled(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.metrics()?;
            if done(&m) {
                return Ok(m);
            }
            if Instant::now() > deadline {
                bail!(
                    "metrics never showed {what} within {timeout:?}; last: {:#?}",
                    m.samples()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
    /// Open file descriptors of the agent now.
    pub fn fd_count(&self) -> Result<usize> {
        procfs::fd_count(self.pid())
    }
    /// Resident memory of the agent now, in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        procfs::rss_kib(self.pid())
    }
    pub fn thread_count(&self) -> Result<usize> {
        procfs::thread_count(self.pid())
    }
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// Waits until a line of the agent's log satisfies `found` (the access log is written as a
    /// connection ends, after the client already has its answer); fails with the log at the deadline.
    pub fn wait_log_line(
        &self,
        what: &str,
        timeout: Duration,
        found: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let timeout = crate::pace::scaled(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if log.lines().any(&found) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the agent's log has no line {what} within {timeout:?}; log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    pub fn is_running(&mut self) -> bool {
        self.proc.is_running()
    }

    /// SIGKILL, as if the agent crashed; returns once it is gone.
    pub fn kill(mut self) -> Result<()> {
        self.proc.signal(libc::SIGKILL);
        self.proc.wait(STOP_TIMEOUT)?;
        Ok(())
    }

    /// SIGTERM, wait, and require a clean exit (status 0).
    pub fn stop(mut self) -> Result<()> {
        let status = self.proc.terminate(STOP_TIMEOUT)?;
        if !status.success() {
            bail!(
                "the agent exited with {status} after SIGTERM; log:\n{}",
                self.log()
            );
        }
        self.log_tail_on_drop = false;
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        const TAIL: usize = 200;
        if !self.log_tail_on_drop {
            return;
        }
        // Stop it first so the log printed below is complete (SIGKILL follows in Proc's drop if needed).
        let _ = self.proc.terminate(Duration::from_secs(3));
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(TAIL)..];
        eprintln!(
            "---- agent log ({}, last {} lines)\n{}\n---- end of agent log",
            self.proc.log_path().display(),
            tail.len(),
            tail.join("\n")
        );
    }
}
