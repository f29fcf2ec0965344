//! The stage every run plays on: the harness's netns topology with one client pod, the servers in ext
//! (iperf3, sockperf, an HTTP server, dnsmasq), the agent's config, and the agent when a phase needs it.
//!
//! Client programs are pinned to CPU 0; servers and the upstream resolver to CPU 1. On a 2-core machine
//! that keeps the load generator from stealing the server side's CPU, so the direct runs repeat. The
//! agent is not pinned (a DaemonSet is not), unless `--agent-cpu` says so; for the DNS rate it runs on
//! one CPU, the server's, because that target is per core.
use std::fs;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use integration::pki::TestCa;
use integration::procfs::{self, Proto};
use integration::{Agent, Launch, Place, Pod, Proc, RESOLVER_IP, Topology};

use super::{iperf, sockperf, synthetic};

pub(crate) const CLIENT_CPU: u32 = 0;
pub(crate) const SERVER_CPU: u32 = 1;

const POD: (&str, &str) = ("bench/client", "10.244.1.10");
/// The pod's uid: its cgroup is kubelet's for it, so the fast path knows its namespace.
const POD_UID: &str = "0b1e7c2a-5d3f-4e6a-9b8c-be0cbe0cbe0c";
/// The ext host every TCP test talks to (direct and passthrough connect here themselves).
pub(crate) const SERVER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// The ServiceEntry's VIP: routed nowhere, so a connection to it works only through the proxy.
pub(crate) const VIP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 10);
pub(crate) const HTTP_PORT: u16 = 80;
pub(crate) const IPERF_PORT: u16 = 5201;
pub(crate) const SOCKPERF_PORT: u16 = 11111;
/// A name the ServiceEntry owns: the agent answers it.
pub(crate) const ANSWERED_NAME: &str = "backend.bench.example";
/// A name only the upstream knows, answered with TTL 0: the agent forwards every query for it.
pub(crate) const FORWARDED_NAME: &str = "upstream.bench.example";
/// A name only the upstream knows, answered with a TTL: the agent forwards it once per TTL and
/// answers the rest from its cache.
pub(crate) const CACHED_NAME: &str = "lasting.bench.example";
/// The host of the `resolution: DNS` entry without addresses (the entry people write most): the
/// agent resolves it ahead and the kernel rewrites its allocated address to the server's.
pub(crate) const RESOLVED_NAME: &str = "resolved.bench.example";
const RESOLVED_ENTRY: &str = "resolved";
/// The TTL dnsmasq gives [`CACHED_NAME`] and [`RESOLVED_NAME`] (a cluster DNS's usual).
pub(crate) const CACHED_TTL: u32 = 30;

/// `--waypoint-only`: the waypoint (its Service in the bench's namespace, as Istio deploys one
/// beside a waypoint Gateway) and the entry bound to it, whose VIP leads to the same server.
pub(crate) const WAYPOINT_NAME: &str = "bench-waypoint";
/// The waypoint's address (its Service's cluster IP): an address of ext, beside the servers,
/// where `rdt-peer hbone` stands in for it on port 15008.
pub(crate) const WAYPOINT_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 21);
pub(crate) const HBONE_PORT: u16 = 15008;
/// The bound entry's VIP: routed nowhere, like [`VIP`].
pub(crate) const WAYPOINT_VIP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 11);
const WAYPOINT_ENTRY: &str = "backend-waypoint";
const WAYPOINT_HOST: &str = "waypoint.bench.example";
/// The trust domain of the pods' and the waypoint's certificates (the agent's default).
pub(crate) const TRUST_DOMAIN: &str = "cluster.local";
/// How long the bench's certificates are valid: longer than any run.
const CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// How long the agent with the config at size may take to be ready: it loads, checks and compiles
/// 120,000 objects first (seconds in a release build, more on a busy machine).
pub(crate) const AT_SIZE_READY: Duration = Duration::from_secs(60);
/// What the harness waits for an agent to be ready (`tests/src/agent.rs`), before `RDT_TIME_SCALE`
/// stretches it.
const HARNESS_READY: Duration = Duration::from_secs(20);

/// The config directory at size as written: the bench's own config and a big cluster's.
#[derive(Clone, Debug)]
pub(crate) struct AtSizeConfig {
    pub dir: PathBuf,
    /// The cluster's files (beside `bench.yaml`).
    pub files: usize,
    /// Every file's bytes together, `bench.yaml`'s included.
    pub bytes: u64,
}

/// How the proxy moves bytes (`redirect run --relay`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Relay {
    Splice,
    Copy,
    /// `Splice` as the agent runs by default: the kernel decides what needs no proxy. (The other
    /// two are the proxy, `--no-fast-path`.)
    FastPath,
    /// `FastPath` with `--audit-mesh-config`: a policy under which the bench's entry is seen
    /// otherwise (PUBLIC), so the kernel reports every connection to it and the agent audits each.
    FastPathAudit,
    /// `FastPath` with `--kernel-records off`: the kernel records none of its decisions (the
    /// default records all).
    FastPathNoRecords,
    /// `FastPath` on the waypoint config (the bench's and an entry bound to a waypoint, see
    /// [`Scene::add_waypoint`]) with the pods' certificates (`--identity-dir`, `--trust-domain`):
    /// the kernel hands the bound entry's connections to the proxy, which tunnels them over HBONE.
    FastPathWaypoint,
}

impl Relay {
    pub(crate) fn arg(self) -> &'static str {
        match self {
            Relay::Splice
            | Relay::FastPath
            | Relay::FastPathAudit
            | Relay::FastPathNoRecords
            | Relay::FastPathWaypoint => "splice",
            Relay::Copy => "copy",
        }
    }
}

pub(crate) struct Scene {
    // Declared first so they stop before the topology goes.
    _servers: Vec<Proc>,
    topo: Topology,
    pod: Pod,
    config_dir: PathBuf,
    /// The config directory of [`Relay::FastPathWaypoint`], once [`Scene::add_waypoint`] wrote it.
    waypoint_config_dir: Option<PathBuf>,
    /// Where the agent runs for the TCP tests (None: wherever the scheduler puts it).
    agent_cpu: Option<u32>,
}

impl Scene {
    /// Builds the topology, writes the agent's config and starts every server. `peer` is the release
    /// build of the harness's `rdt-peer` (its HTTP server answers `GET /` and closes).
    pub(crate) fn build(peer: &Path, agent_cpu: Option<u32>) -> Result<Scene> {
        let mut topo = Topology::new()?;
        topo.add_kube_pod(POD.0, POD.1.parse()?, POD_UID)?;
        let pod = topo.pod(POD.0).clone();
        // Connection-rate runs open tens of thousands of connections: more ephemeral ports for the
        // pod and the proxy's upstream side (a per-netns sysctl; 15000-15053 stay clear for the agent).
        for place in [pod.place(), topo.node()] {
            place
                .cmd("sysctl")
                .args(["-q", "-w", "net.ipv4.ip_local_port_range=20000 65000"])
                .ok()?;
        }
        let config_dir = topo.scratch_path("config");
        fs::create_dir_all(&config_dir)?;
        fs::write(config_dir.join("bench.yaml"), bench_config())?;
        fs::write(audit_file(&config_dir.to_string_lossy()), AUDIT_MESH_CONFIG)?;

        topo.ensure_ext_address(SERVER_IP)?;
        topo.ensure_ext_address(RESOLVER_IP)?;
        let server = |port| SocketAddrV4::new(SERVER_IP, port);
        let ext = topo.ext();
        let mut servers = Vec::new();
        let start = |program: &str, args: Vec<String>, proto: Proto, addr: SocketAddrV4| {
            start_server(ext, program, args, proto, addr)
        };
        servers.push(start(
            "iperf3",
            iperf::server_args(server(IPERF_PORT)),
            Proto::Tcp,
            server(IPERF_PORT),
        )?);
        servers.push(start(
            "sockperf",
            sockperf::server_args(server(SOCKPERF_PORT)),
            Proto::Tcp,
            server(SOCKPERF_PORT),
        )?);
        let peer = peer.to_string_lossy().into_owned();
        servers.push(start(
            &peer,
            vec![
                "serve".into(),
                "--name".into(),
                "bench".into(),
                "--listen".into(),
                server(HTTP_PORT).to_string(),
            ],
            Proto::Tcp,
            server(HTTP_PORT),
        )?);
        let resolver = SocketAddrV4::new(RESOLVER_IP, 53);
        servers.push(start(
            "/usr/sbin/dnsmasq",
            dnsmasq_args(),
            Proto::Udp,
            resolver,
        )?);
        Ok(Scene {
            _servers: servers,
            topo,
            pod,
            config_dir,
            waypoint_config_dir: None,
            agent_cpu,
        })
    }

    /// For [`Relay::FastPathWaypoint`]: a test CA's certificates for the pod (`bench/default`)
    /// and the waypoint (`bench/bench-waypoint`), the config directory with the bound entry, and
    /// the waypoint's stand-in (`peer hbone`, pinned beside the servers) on [`WAYPOINT_IP`],
    /// carrying each `CONNECT` to the bound entry's VIP and port to the server's same port.
    pub(crate) fn add_waypoint(&mut self, peer: &Path) -> Result<()> {
        let ca = TestCa::new(TRUST_DOMAIN)?;
        let config_dir = self.topo.scratch_path("config-waypoint");
        fs::create_dir_all(&config_dir)?;
        fs::write(config_dir.join("bench.yaml"), bench_config())?;
        fs::write(config_dir.join("waypoint.yaml"), waypoint_config())?;
        let ns = pod_namespace();
        let identities = identity_dir(&config_dir.to_string_lossy());
        ca.write_identity_dir(Path::new(&identities), &[(ns, "default")], CERT_LIFETIME)?;
        let files = self.topo.scratch_path("waypoint-certs");
        let tls = ca.write_server_files(&files, ns, WAYPOINT_NAME, CERT_LIFETIME)?;

        self.topo.ensure_ext_address(WAYPOINT_IP)?;
        let listen = SocketAddrV4::new(WAYPOINT_IP, HBONE_PORT);
        let mut args: Vec<String> = [
            "hbone",
            "--name",
            WAYPOINT_NAME,
            "--listen",
            &listen.to_string(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(tls);
        for port in [HTTP_PORT, IPERF_PORT, SOCKPERF_PORT] {
            args.push("--route".into());
            args.push(format!(
                "{}={}",
                SocketAddrV4::new(WAYPOINT_VIP, port),
                SocketAddrV4::new(SERVER_IP, port)
            ));
        }
        let program = peer.to_string_lossy();
        let proc = start_server(self.topo.ext(), &program, args, Proto::Tcp, listen)?;
        self._servers.push(proc);
        self.waypoint_config_dir = Some(config_dir);
        Ok(())
    }

    pub(crate) fn topo(&self) -> &Topology {
        &self.topo
    }

    /// Starts the agent with the bench config, placed as `--agent-cpu` says (unpinned by default).
    pub(crate) fn start_agent(&self, relay: Relay) -> Result<Agent> {
        self.start_agent_on(relay, self.agent_cpu)
    }

    /// Starts the agent with the bench config (the waypoint's for [`Relay::FastPathWaypoint`]),
    /// every thread on `cpu` (None: unpinned).
    pub(crate) fn start_agent_on(&self, relay: Relay, cpu: Option<u32>) -> Result<Agent> {
        let config = match relay {
            Relay::FastPathWaypoint => self
                .waypoint_config_dir
                .as_ref()
                .context("the waypoint is not set up (Scene::add_waypoint)")?,
            _ => &self.config_dir,
        };
        let config = config.to_string_lossy().into_owned();
        start_agent(&self.topo, &agent_args(&config, relay), cpu)
    }

    pub(crate) fn agent_cpu(&self) -> Option<u32> {
        self.agent_cpu
    }

    /// Writes the config directory at size: `bench.yaml` and [`synthetic::AT_SIZE`]'s cluster,
    /// checked against what the agent reads of a file and of a directory.
    pub(crate) fn write_at_size_config(&self) -> Result<AtSizeConfig> {
        let dir = self.topo.scratch_path("config-at-size");
        fs::create_dir_all(&dir)?;
        let bench = bench_config();
        let mut files = vec![("bench.yaml".to_string(), bench)];
        files.extend(synthetic::cluster_files(synthetic::AT_SIZE));
        let mut bytes = 0;
        for (name, text) in &files {
            let len = text.len() as u64;
            if len > synthetic::AGENT_FILE_BYTES {
                bail!("{name} is {len} bytes, over what the agent reads of a file");
            }
            bytes += len;
            let path = dir.join(name);
            fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        if bytes > synthetic::AGENT_DIR_BYTES {
            bail!("the config at size is {bytes} bytes, over what the agent reads of a directory");
        }
        Ok(AtSizeConfig {
            dir,
            files: files.len() - 1,
            bytes,
        })
    }

    /// Starts the agent as it runs by default (the fast path) on the config at size, placed as
    /// `--agent-cpu` says; waits up to [`AT_SIZE_READY`] for it to be ready.
    pub(crate) fn start_agent_at_size(&self, config: &AtSizeConfig) -> Result<Agent> {
        let dir = config.dir.to_string_lossy().into_owned();
        let args = agent_args(&dir, Relay::FastPath);
        let _wait = ReadyWait::at_least(AT_SIZE_READY);
        start_agent(&self.topo, &args, self.agent_cpu)
    }

    /// Runs a client tool in the pod, pinned to the client CPU; its stdout, or what it printed on failure.
    pub(crate) fn client(&self, tool: &str, args: &[String], timeout: Duration) -> Result<String> {
        let out = self
            .pod
            .cmd("taskset")
            .args(["-c", &CLIENT_CPU.to_string(), tool])
            .args(args)
            .timeout(timeout)
            .output()?;
        if !out.success() {
            bail!("{out}");
        }
        Ok(out.stdout_str())
    }

    /// The run's private directory (in the client command lines the report shows it as `<run dir>`).
    pub(crate) fn run_dir(&self) -> &Path {
        self.topo.state_dir()
    }

    /// Writes `contents` to a file the pod's tools can read (the run's state directory).
    pub(crate) fn scratch_file(&self, name: &str, contents: &str) -> Result<PathBuf> {
        let path = self.topo.scratch_path(name);
        fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// TCP connections the pod has opened so far (`Tcp: ActiveOpens` of its netns).
    pub(crate) fn pod_active_opens(&self) -> Result<u64> {
        let out = self.pod.cmd("cat").arg("/proc/net/snmp").ok()?;
        active_opens(&out.stdout_str())
    }
}

/// What runs on the server side, as command lines (for the report).
pub(crate) fn server_commands() -> Vec<String> {
    let server = |port| SocketAddrV4::new(SERVER_IP, port);
    let cpu = format!("taskset -c {SERVER_CPU}");
    vec![
        format!(
            "{cpu} iperf3 {}",
            iperf::server_args(server(IPERF_PORT)).join(" ")
        ),
        format!(
            "{cpu} sockperf {}",
            sockperf::server_args(server(SOCKPERF_PORT)).join(" ")
        ),
        format!(
            "{cpu} rdt-peer serve --name bench --listen {}",
            server(HTTP_PORT)
        ),
        format!("{cpu} dnsmasq {}", dnsmasq_args().join(" ")),
    ]
}

/// The agent's command line (in the node netns), with `prefix` (e.g. `taskset -c 1 `).
pub(crate) fn agent_command(prefix: &str, relay: Relay) -> String {
    agent_command_with(prefix, "<config dir>", relay)
}

/// [`agent_command`] with another config directory.
pub(crate) fn agent_command_with(prefix: &str, config: &str, relay: Relay) -> String {
    format!(
        "{prefix}redirect run --cgroup <pods cgroup> --gateway {} --admin {} {}",
        integration::GATEWAY,
        integration::ADMIN_ADDR,
        agent_args(config, relay).join(" ")
    )
}

/// Starts `program` with `args` in `ext` (or another place) pinned to the server CPU; returns once
/// it listens on `addr`.
pub(crate) fn start_server(
    ext: &Place,
    program: &str,
    args: Vec<String>,
    proto: Proto,
    addr: SocketAddrV4,
) -> Result<Proc> {
    let mut proc = ext
        .cmd("taskset")
        .args(["-c", &SERVER_CPU.to_string(), program])
        .args(args)
        .spawn()?;
    let pid = proc.pid();
    procfs::wait_bound(pid, proto, &[addr], Duration::from_secs(10), || {
        proc.is_running()
    })
    .with_context(|| format!("{program} in ext; log:\n{}", proc.log()))?;
    Ok(proc)
}

/// The agent as a node runs it (the harness's launcher, [`Launch::as_deployed`]) with `args`,
/// pinned to `cpu` if given; returns once it is ready.
pub(crate) fn start_agent(topo: &Topology, args: &[String], cpu: Option<u32>) -> Result<Agent> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Agent::launch(topo, &Launch::as_deployed(cpu), &args)
}

/// The audit policy of [`Relay::FastPathAudit`]: every entry PUBLIC, where the bench's own mesh
/// config keeps them in their namespace.
const AUDIT_MESH_CONFIG: &str = "serviceEntryVisibility: {defaultVisibility: PUBLIC}\n";

/// Where the audit file of the config directory `config` is: beside it, never in it.
pub(crate) fn audit_file(config: &str) -> String {
    format!("{config}.audit.yaml")
}

/// Where the pods' certificates of the config directory `config` are: beside it, never in it.
pub(crate) fn identity_dir(config: &str) -> String {
    format!("{config}.identities")
}

/// The agent's arguments beyond the harness's own (`--cgroup`, `--gateway`, `--admin`).
pub(crate) fn agent_args(config: &str, relay: Relay) -> Vec<String> {
    vec![
        "--config".into(),
        config.into(),
        "--dns-upstream".into(),
        format!("{RESOLVER_IP}:53"),
        "--relay".into(),
        relay.arg().into(),
    ]
    .into_iter()
    // The fast path is the agent's default; the proxy's routes turn it off.
    .chain(
        (!matches!(
            relay,
            Relay::FastPath
                | Relay::FastPathAudit
                | Relay::FastPathNoRecords
                | Relay::FastPathWaypoint
        ))
        .then(|| integration::NO_FAST_PATH.into()),
    )
    .chain(
        (relay == Relay::FastPathNoRecords)
            .then(|| ["--kernel-records".into(), "off".into()])
            .into_iter()
            .flatten(),
    )
    .chain(
        (relay == Relay::FastPathAudit)
            .then(|| ["--audit-mesh-config".into(), audit_file(config)])
            .into_iter()
            .flatten(),
    )
    .chain(
        (relay == Relay::FastPathWaypoint)
            .then(|| {
                [
                    "--identity-dir".into(),
                    identity_dir(config),
                    "--trust-domain".into(),
                    TRUST_DOMAIN.into(),
                ]
            })
            .into_iter()
            .flatten(),
    )
    .collect()
}

/// `RDT_TIME_SCALE` raised, while it lives, so that the harness waits at least this long for an
/// agent to be ready (it stretches every budget of the harness; only the ready wait is reached
/// while this is held). Put back as it was on drop.
struct ReadyWait {
    before: Option<std::ffi::OsString>,
    raised: bool,
}

impl ReadyWait {
    fn at_least(wait: Duration) -> ReadyWait {
        let before = std::env::var_os("RDT_TIME_SCALE");
        let needed = wait.as_secs().div_ceil(HARNESS_READY.as_secs()) as u32;
        let raised = needed > integration::pace::scale();
        if raised {
            // SAFETY: the bench runs on one thread here: the harness's threads (a command's pipe
            // readers, a netns switch) live only inside its calls, and none is running now.
            unsafe { std::env::set_var("RDT_TIME_SCALE", needed.to_string()) };
        }
        ReadyWait { before, raised }
    }
}

impl Drop for ReadyWait {
    fn drop(&mut self) {
        if !self.raised {
            return;
        }
        // SAFETY: as in `at_least`: the harness's call has returned (or unwound), its threads
        // joined.
        unsafe {
            match &self.before {
                Some(v) => std::env::set_var("RDT_TIME_SCALE", v),
                None => std::env::remove_var("RDT_TIME_SCALE"),
            }
        }
    }
}

/// dnsmasq as the upstream: our two records, NXDOMAIN for the rest, and no per-query logging (the
/// harness's dnsmasq logs every query, which would make it the bottleneck).
fn dnsmasq_args() -> Vec<String> {
    integration::dnsmasq::BASE_ARGS
        .into_iter()
        .map(String::from)
        .chain([
            format!("--listen-address={RESOLVER_IP}"),
            format!("--host-record={FORWARDED_NAME},{SERVER_IP}"),
            format!("--host-record={CACHED_NAME},{SERVER_IP},{CACHED_TTL}"),
            format!("--host-record={RESOLVED_NAME},{SERVER_IP},{CACHED_TTL}"),
        ])
        .collect()
}

/// The client's namespace, its pod, and one NAMESPACE ServiceEntry in it whose VIP leads to the ext server
/// on every port the tests use.
pub(crate) fn bench_config() -> String {
    let (key, ip) = POD;
    let (ns, name) = key.split_once('/').unwrap_or(("bench", "client"));
    format!(
        "apiVersion: v1
kind: Namespace
metadata: {{name: {ns}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, uid: {POD_UID}}}
status: {{podIP: {ip}}}
---
apiVersion: install.istio.io/v1alpha1
kind: IstioOperator
spec: {{meshConfig: {{serviceEntryVisibility: {{defaultVisibility: NAMESPACE}}}}}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: backend, namespace: {ns}}}
spec:
  hosts: [{ANSWERED_NAME}]
  addresses: [{VIP}]
  ports:
    - {{number: {HTTP_PORT}, name: http, protocol: HTTP}}
    - {{number: {IPERF_PORT}, name: tcp-iperf, protocol: TCP}}
    - {{number: {SOCKPERF_PORT}, name: tcp-sockperf, protocol: TCP}}
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints:
    - address: {SERVER_IP}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: {RESOLVED_ENTRY}, namespace: {ns}}}
spec:
  hosts: [{RESOLVED_NAME}]
  ports:
    - {{number: {HTTP_PORT}, name: http, protocol: HTTP}}
    - {{number: {IPERF_PORT}, name: tcp-iperf, protocol: TCP}}
    - {{number: {SOCKPERF_PORT}, name: tcp-sockperf, protocol: TCP}}
  location: MESH_EXTERNAL
  resolution: DNS
"
    )
}

/// The client pod's namespace (the bench's entries' and the waypoint's).
pub(crate) fn pod_namespace() -> &'static str {
    POD.0.split_once('/').map_or("bench", |(ns, _)| ns)
}

/// What the waypoint config adds to [`bench_config`]: the waypoint's Service and a second entry of
/// the same server, bound to it (a same-namespace binding of a NAMESPACE entry).
pub(crate) fn waypoint_config() -> String {
    let ns = pod_namespace();
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {WAYPOINT_NAME}, namespace: {ns}}}
spec: {{clusterIP: {WAYPOINT_IP}, ports: [{{port: {HBONE_PORT}, name: mesh}}]}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: {WAYPOINT_ENTRY}
  namespace: {ns}
  labels: {{istio.io/use-waypoint: {WAYPOINT_NAME}}}
spec:
  hosts: [{WAYPOINT_HOST}]
  addresses: [{WAYPOINT_VIP}]
  ports:
    - {{number: {HTTP_PORT}, name: http, protocol: HTTP}}
    - {{number: {IPERF_PORT}, name: tcp-iperf, protocol: TCP}}
    - {{number: {SOCKPERF_PORT}, name: tcp-sockperf, protocol: TCP}}
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints:
    - address: {SERVER_IP}
"
    )
}

/// The address allocated to the `resolution: DNS` entry (no addresses of its own), as the agent
/// allocates it from the same configuration.
pub(crate) fn dns_vip() -> Ipv4Addr {
    static VIP: std::sync::OnceLock<Ipv4Addr> = std::sync::OnceLock::new();
    *VIP.get_or_init(|| {
        let config = bench_config();
        let model = redirect_userspace::model::load_sources([("bench.yaml", config.as_str())])
            .unwrap_or_else(|e| panic!("the bench's own configuration does not load: {e}"));
        let snapshot = redirect_userspace::model::Snapshot::from_model(&model);
        snapshot
            .services()
            .find(|s| s.name == RESOLVED_ENTRY)
            .and_then(|s| s.vips_v4.first().copied())
            .unwrap_or_else(|| panic!("no address allocated to {RESOLVED_ENTRY}"))
    })
}

/// `Tcp: ... ActiveOpens ...` from /proc/net/snmp (a header line, then a value line).
pub(crate) fn active_opens(snmp: &str) -> Result<u64> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(header), Some(values)) = (tcp.next(), tcp.next()) else {
        bail!("/proc/net/snmp has no Tcp lines");
    };
    let at = header
        .split_whitespace()
        .position(|h| h == "ActiveOpens")
        .context("/proc/net/snmp has no Tcp ActiveOpens")?;
    let v = values.split_whitespace().nth(at).unwrap_or("");
    v.parse()
        .with_context(|| format!("/proc/net/snmp ActiveOpens {v:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dns_entry_gets_an_allocated_address() {
        assert_eq!(dns_vip().octets()[..2], [240, 240]);
    }

    #[test]
    fn the_waypoint_entry_goes_through_the_waypoint_and_the_plain_one_does_not() {
        let (bench, waypoint) = (bench_config(), waypoint_config());
        let model = redirect_userspace::model::load_sources([
            ("bench.yaml", bench.as_str()),
            ("waypoint.yaml", waypoint.as_str()),
        ])
        .unwrap();
        let snapshot = redirect_userspace::model::Snapshot::from_model(&model);
        let service = |name: &str| snapshot.services().find(|s| s.name == name).unwrap();
        let (via, address) = service(WAYPOINT_ENTRY).waypoint_route().unwrap();
        assert_eq!(
            (via.to_string(), address),
            (format!("bench/{WAYPOINT_NAME}"), WAYPOINT_IP.into())
        );
        assert!(service("backend").waypoint_route().is_none());
        assert!(agent_args("/c", Relay::FastPathWaypoint).contains(&"/c.identities".to_string()));
    }

    #[test]
    fn reads_active_opens() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens\nTcp: 1 200 120000 -1 4242 7\nUdp: InDatagrams\nUdp: 3\n";
        assert_eq!(active_opens(snmp).unwrap(), 4242);
        assert!(active_opens("Ip: a\nIp: 1\n").is_err());
    }
}
