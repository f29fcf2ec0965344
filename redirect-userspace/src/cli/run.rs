//! `redirect run` and `redirect mount-bpffs`: the agent's flags, read into its configuration and checked
//! (sizes with units, addresses, the gateway) before anything starts.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::Context;
use redirect_common::{DNS_PROXY_PORT, PROXY_PORT};

use crate::{
    agent::{self, AgentConfig},
    budget::BudgetArgs,
    dns::first_nameserver,
    logging::LogLevel,
    proxy::RelayMode,
    redirect::Gateways,
};

/// The Kubernetes API as the source (boxed: rarely read, kept out of the command's size).
#[derive(Debug, clap::Args)]
pub(crate) struct KubeArgs {
    /// Learn the cluster from the Kubernetes API instead of a directory: the pod's service account
    /// in a cluster, else `$KUBECONFIG`, else `~/.kube/config`, as kubectl finds it.
    #[arg(long)]
    pub kube: bool,
    /// With `--kube`: this kubeconfig instead of the usual search.
    #[arg(long, value_name = "FILE", requires = "kube")]
    pub kubeconfig: Option<PathBuf>,
    /// With `--kube`: the node this agent serves (the DaemonSet passes `spec.nodeName` in
    /// `NODE_NAME`). Only this node's Pods are held as clients; the other nodes' Pods are held as
    /// endpoints and workload addresses only. Without it, every Pod of the cluster is a client.
    #[arg(long, value_name = "NODE", env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// With `--kube`: the ConfigMap whose key `mesh` holds the mesh config.
    #[arg(
        long,
        value_name = "NAMESPACE/NAME",
        default_value = "istio-system/istio",
        requires = "kube"
    )]
    pub mesh_configmap: String,
    /// With `--kube`: take part in electing the cluster's one ServiceEntry status writer, and write
    /// each entry's visibility and waypoint conditions while elected.
    #[arg(long, requires = "kube")]
    pub write_status: bool,
    /// With `--write-status`: the Lease that elects the writer.
    #[arg(
        long,
        value_name = "NAMESPACE/NAME",
        default_value = "redirect-system/redirect-status-writer",
        requires = "write_status"
    )]
    pub status_lease: String,
    /// With `--write-status`: how long a writer that stopped renewing keeps the lease.
    #[arg(long, value_name = "SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..=3600), requires = "write_status")]
    pub status_lease_seconds: u64,
}

impl KubeArgs {
    /// The lease of `--write-status`, with this agent's identity: the pod's name (the DaemonSet
    /// passes it), else the host name, and the process id.
    fn status_lease(&self) -> anyhow::Result<Option<crate::status::LeaseConfig>> {
        if !self.write_status {
            return Ok(None);
        }
        let (namespace, name) = self
            .status_lease
            .split_once('/')
            .context("--status-lease takes NAMESPACE/NAME")?;
        let who = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname"))
            .unwrap_or_default();
        Ok(Some(crate::status::LeaseConfig {
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity: format!("{}-{}", who.trim(), std::process::id()),
            duration: std::time::Duration::from_secs(self.status_lease_seconds),
        }))
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Directory of Kubernetes manifests (the same `redirect resolve -f` reads), watched and
    /// reloaded on change. Without it nothing is claimed: all traffic passes through.
    #[arg(long, value_name = "DIR", conflicts_with = "kube")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub kube: Box<KubeArgs>,
    /// cgroup v2 directory holding the pods (their parent, never the hierarchy's root).
    #[arg(long)]
    pub cgroup: PathBuf,
    /// Address of this node's netns that every pod reaches on its own link (e.g. 169.254.7.1).
    /// Give it once per family for dual-stack pods: an IPv4 and an IPv6 address (e.g. fd00:7::1).
    /// IPv4 and v4-mapped traffic goes to the IPv4 one; a family without a gateway is not steered.
    #[arg(long, required = true, value_name = "IP")]
    pub gateway: Vec<IpAddr>,
    /// Port the outbound proxy listens on at the gateway.
    #[arg(long, default_value_t = PROXY_PORT)]
    pub proxy_port: u16,
    /// Port the DNS proxy listens on (UDP and TCP) at the gateway; 0 leaves pods' DNS alone.
    #[arg(long, default_value_t = DNS_PROXY_PORT)]
    pub dns_proxy_port: u16,
    /// Resolver for every name the mesh does not claim [default: first nameserver of /etc/resolv.conf].
    #[arg(long, value_name = "IP:PORT")]
    pub dns_upstream: Option<SocketAddr>,
    /// Upstream answers kept for their TTL (at most 30 s) to answer the same question again;
    /// 0 sends every forwarded query upstream.
    #[arg(long, value_name = "ENTRIES", default_value_t = 4096)]
    pub dns_cache: usize,
    /// How proxied bytes move: `splice` (zero-copy, the default) or `copy` (user-space buffers).
    #[arg(long, value_enum, default_value_t = RelayMode::Splice)]
    pub relay: RelayMode,
    /// Admin server address (`/config_dump`, `/metrics`, `/healthz/ready`, `/logging`).
    #[arg(long, default_value = "127.0.0.1:15000")]
    pub admin: SocketAddr,
    /// Allow the admin server on a non-loopback address (it shows the node's configuration).
    #[arg(long)]
    pub admin_allow_non_loopback: bool,
    /// Where a cluster's Prometheus scrapes the metrics (`/metrics`, `/stats/prometheus`), as it
    /// scrapes ztunnel's: every address of the node by default. Only the metrics are served there.
    #[arg(long, default_value = "0.0.0.0:15020", conflicts_with = "no_stats")]
    pub stats: SocketAddr,
    /// Serve no stats address (the metrics stay on the admin address).
    #[arg(long)]
    pub no_stats: bool,
    /// A prefix the proxy never dials for a pod, as the node's egress policy denies it to pods
    /// (repeatable; e.g. a cloud's metadata range outside link-local). Loopback, unspecified,
    /// link-local and the node's own addresses are always refused.
    #[arg(long, value_name = "CIDR")]
    pub deny_destination: Vec<ipnet::IpNet>,
    /// bpf filesystem directory holding the pinned links and maps, which a successor adopts (hand-over).
    /// When it is not on a bpf filesystem the agent mounts one at its parent (an empty directory) if it
    /// may; if not, the programs live with this process and there is no hand-over.
    #[arg(long, value_name = "DIR", default_value = "/sys/fs/bpf/redirect")]
    pub bpffs: PathBuf,
    /// Unix socket on which a successor takes this agent's listening sockets (hand-over).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/redirect/handover.sock"
    )]
    pub handover_socket: PathBuf,
    /// After handing over, how long proxied connections may run before they are reset.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: std::time::Duration,
    /// The default, kept for scripts that ask for it: decide in the kernel, at connect(), what needs
    /// no proxy (see `--no-fast-path`).
    #[arg(long, conflicts_with = "no_fast_path")]
    pub fast_path: bool,
    /// Send every TCP connection to the proxy. By default the kernel decides at connect() what
    /// needs no proxy: connections nothing claims and workload addresses are left alone (the pod
    /// keeps its source address), a service port whose endpoints are plain IPs, or host names the
    /// agent has resolved, gets its destination rewritten to one of them. The rest goes to the proxy.
    #[arg(long)]
    pub no_fast_path: bool,
    /// Kernel memory the fast path's tables may take, both generations together (`64MiB`; units
    /// `KiB`, `MiB`, `GiB`, or bytes). The maps are sized to what the configuration needs; past
    /// this, a namespace that does not fit has its clients decided by the proxy, the others stay
    /// in the kernel.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_size)]
    pub fast_path_memory: usize,
    /// No access log (by default one info line per connection when it ends, whoever decided it,
    /// at most 100 a second for the kernel and the proxy together).
    #[arg(long)]
    pub no_access_log: bool,
    /// Which of the connections the kernel decides it records (access log, `redirect config
    /// connections`, the by-service counters): `all`, `off`, or `1/N` (one in N, at random).
    #[arg(long, value_name = "all|off|1/N", default_value = "all")]
    pub kernel_records: crate::fastpath::KernelRecords,
    /// A second mesh config whose `serviceEntryVisibility` is audited beside the one in force and
    /// never enforced: every DNS answer and connection it would change is counted
    /// (`redirect_audit_changes_total`), logged and listed by `redirect config audit`. Read again
    /// when it changes; a bad version is refused and the one before stays.
    #[arg(long, value_name = "PATH")]
    pub audit_mesh_config: Option<PathBuf>,
    #[command(flatten)]
    pub identity: IdentityArgs,
    #[command(flatten)]
    pub budget: BudgetArgs,
    #[command(flatten)]
    pub limits: super::LimitArgs,
}

/// Where the node's pods' workload certificates come from, for HBONE to waypoints. Without
/// either source, a connection to a service bound to a waypoint whose address is known is reset,
/// never sent around the waypoint.
#[derive(clap::Args, Debug)]
pub(crate) struct IdentityArgs {
    /// A directory kept by another issuer: `DIR/root-cert.pem` and
    /// `DIR/<namespace>/<service account>/{cert-chain.pem,key.pem}`, read again when they change.
    #[arg(
        long,
        value_name = "DIR",
        env = "REDIRECT_IDENTITY_DIR",
        conflicts_with = "ca_address"
    )]
    pub identity_dir: Option<PathBuf>,
    /// Istio's CA, asked for each pod identity's certificate as ztunnel asks it (a CSR over gRPC,
    /// this agent's token, the pod's identity impersonated); renewed at half its lifetime.
    #[arg(long, value_name = "URL", env = "CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// The mesh's root certificates: the CA's TLS and every HBONE peer chain to them.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    pub ca_root: PathBuf,
    /// This agent's projected service-account token (audience `istio-ca`), read for every call.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/run/secrets/tokens/istio-token"
    )]
    pub ca_token: PathBuf,
    /// The cluster istiod finds the pods in (its `ClusterID` header).
    #[arg(
        long,
        value_name = "NAME",
        env = "CLUSTER_ID",
        default_value = "Kubernetes"
    )]
    pub cluster_id: String,
    /// The lifetime asked of the CA for each workload certificate.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = humantime::parse_duration)]
    pub workload_cert_ttl: std::time::Duration,
    /// The mesh's trust domain: the workload identities presented and accepted are
    /// `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`. Unset: the mesh config's
    /// `trustDomain` as it is at the first tunnel, else `cluster.local`.
    #[arg(long, value_name = "DOMAIN")]
    pub trust_domain: Option<String>,
    /// Carry traffic between the mesh's Pods of different nodes over HBONE, as ztunnel does: a
    /// connection from a Pod in the ambient mesh to a Pod in the mesh of another node goes over
    /// HBONE to `<pod IP>:15008`, and HBONE sent to this node's Pods is received (a routing rule
    /// and table 15008 in the node's netns bring it to the agent), each stream carried to its Pod.
    /// `auto` (the default): on whenever the agent has the Pods' certificates (`--identity-dir`
    /// or `--ca-address`) and its node's name; `on` (the flag alone): refuse to start without
    /// them; `off`: plaintext between nodes.
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        default_value = "auto",
        num_args = 0..=1,
        default_missing_value = "on"
    )]
    pub hbone_between_nodes: HboneBetweenNodes,
}

/// When traffic between nodes goes over HBONE (`--hbone-between-nodes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum HboneBetweenNodes {
    /// Whenever the agent has the Pods' certificates and its node's name.
    Auto,
    /// Always: the agent refuses to start without them.
    On,
    /// Never: plaintext between nodes.
    Off,
}

impl IdentityArgs {
    fn source(&self) -> Option<crate::hbone::CertSource> {
        use crate::hbone::{CaSettings, CertSource};
        if let Some(dir) = &self.identity_dir {
            return Some(CertSource::Dir(dir.clone()));
        }
        self.ca_address.as_ref().map(|address| {
            CertSource::IstioCa(CaSettings {
                address: address.clone(),
                root: self.ca_root.clone(),
                token: self.ca_token.clone(),
                cluster_id: self.cluster_id.clone(),
                validity: self.workload_cert_ttl,
            })
        })
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct MountBpffsArgs {
    /// The agent's --bpffs: its parent gets the bpf filesystem.
    #[arg(long, value_name = "DIR", default_value = "/sys/fs/bpf/redirect")]
    pub bpffs: PathBuf,
}

/// The node whose Pods' traffic to other nodes goes over HBONE, as `--hbone-between-nodes` and
/// what the agent was given decide; `None`: plaintext between nodes (said once at start).
fn hbone_node(identity: &IdentityArgs, node_name: Option<&str>) -> anyhow::Result<Option<String>> {
    let node = node_name.filter(|n| !n.is_empty()).map(String::from);
    let has_certificates = identity.source().is_some();
    match identity.hbone_between_nodes {
        HboneBetweenNodes::Off => {
            tracing::info!("traffic between nodes in plaintext (--hbone-between-nodes=off)");
            Ok(None)
        }
        HboneBetweenNodes::On if !has_certificates => anyhow::bail!(
            "--hbone-between-nodes needs the Pods' certificates: --identity-dir or --ca-address"
        ),
        HboneBetweenNodes::On if node.is_none() => anyhow::bail!(
            "--hbone-between-nodes needs the node's name: --node-name or NODE_NAME is empty"
        ),
        HboneBetweenNodes::Auto if !has_certificates || node.is_none() => {
            let missing = match has_certificates {
                false => "the Pods' certificates (--identity-dir or --ca-address)",
                true => "the node's name (--node-name or NODE_NAME)",
            };
            tracing::info!("traffic between nodes in plaintext: HBONE needs {missing}");
            Ok(None)
        }
        HboneBetweenNodes::Auto | HboneBetweenNodes::On => Ok(node),
    }
}

/// `redirect mount-bpffs`: says what it found or did. Exits 0 even when it could not mount: the agent
/// then runs without hand-over (and says so) rather than not at all.
pub(super) fn mount_bpffs(args: MountBpffsArgs) -> anyhow::Result<ExitCode> {
    let handover = crate::redirect::bpffs::ensure(&args.bpffs);
    match (&handover.mounted, &handover.unavailable) {
        (Some(at), _) => println!("mounted a bpf filesystem at {}", at.display()),
        (None, Some(why)) => eprintln!("warning: no hand-over: {why}"),
        (None, None) => println!("{} is on a bpf filesystem already", args.bpffs.display()),
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) fn run(args: RunArgs, log_level: LogLevel) -> anyhow::Result<ExitCode> {
    let gateway = Gateways::from_addrs(&args.gateway)?;
    let dns_upstream = match args.dns_upstream {
        Some(addr) => addr,
        None => {
            let conf = std::fs::read_to_string("/etc/resolv.conf").context(
                "reading /etc/resolv.conf for the default DNS upstream (or pass --dns-upstream)",
            )?;
            first_nameserver(&conf)
                .context("/etc/resolv.conf names no nameserver; pass --dns-upstream IP:PORT")?
        }
    };
    // Without a bpffs there is nothing a successor could adopt: no hand-over at all (a successor
    // would attach a second set of programs next to ours).
    // None on the node: one is mounted where the agent may (as root on the host).
    let handover = crate::redirect::bpffs::ensure(&args.bpffs);
    if let Some(at) = &handover.mounted {
        tracing::info!(at = %at.display(), "mounted a bpf filesystem for the pinned programs");
    }
    if let Some(why) = &handover.unavailable {
        tracing::warn!(dir = %args.bpffs.display(), "no hand-over: {why}");
    }
    let pinned = handover.available;
    let kube_args = *args.kube;
    let hbone_node = hbone_node(&args.identity, kube_args.node_name.as_deref())?;
    let kube = match kube_args.kube {
        true => {
            let (namespace, name) = kube_args
                .mesh_configmap
                .split_once('/')
                .context("--mesh-configmap takes NAMESPACE/NAME")?;
            Some(crate::cluster::Source {
                status_lease: kube_args.status_lease()?,
                kubeconfig: kube_args.kubeconfig,
                node_name: kube_args.node_name.clone().filter(|n| !n.is_empty()),
                hbone_between_nodes: hbone_node.is_some(),
                mesh: crate::cluster::MeshConfigMap {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                },
            })
        }
        false => None,
    };
    agent::run(
        AgentConfig {
            config_dir: args.config,
            cgroup: args.cgroup,
            gateway,
            proxy_port: args.proxy_port,
            dns_proxy_port: (args.dns_proxy_port != 0).then_some(args.dns_proxy_port),
            dns_upstream,
            dns_cache: std::num::NonZeroUsize::new(args.dns_cache),
            admin: args.admin,
            admin_allow_non_loopback: args.admin_allow_non_loopback,
            stats: (!args.no_stats).then_some(args.stats),
            deny_destinations: args.deny_destination,
            relay: args.relay,
            budget: args.budget,
            limits: args.limits.limits(),
            pin_dir: pinned.then_some(args.bpffs),
            handover_socket: pinned.then_some(args.handover_socket),
            handover,
            drain_timeout: args.drain_timeout,
            kube,
            fast_path: !args.no_fast_path,
            fast_path_memory: args.fast_path_memory,
            access_log: !args.no_access_log,
            kernel_records: args.kernel_records,
            audit_mesh_config: args.audit_mesh_config,
            cluster_id: args.identity.cluster_id.clone(),
            cert_source: args.identity.source(),
            trust_domain: args.identity.trust_domain,
            hbone_node,
        },
        log_level,
    )?;
    Ok(ExitCode::SUCCESS)
}

/// A size in bytes, with an optional `KiB`, `MiB` or `GiB` suffix.
fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown unit {other:?} (use KiB, MiB or GiB)")),
    };
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size"))?;
    n.checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};
    use super::{HboneBetweenNodes, hbone_node};

    fn run_args(extra: &[&str]) -> Result<super::RunArgs, clap::Error> {
        let args = [
            "redirect",
            "run",
            "--cgroup",
            "/x",
            "--gateway",
            "169.254.7.1",
        ];
        match Cli::try_parse_from(args.iter().chain(extra))?.command {
            Command::Run(run) => Ok(run),
            _ => panic!("not run"),
        }
    }

    #[test]
    fn the_daemonsets_commented_identity_flags_are_the_agents() {
        let manifest = include_str!("../../../deploy/manifests/30-daemonset.yaml");
        let flags: Vec<&str> = manifest
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#   - --"))
            .filter(|f| {
                ["ca-", "trust-domain", "identity-dir"]
                    .iter()
                    .any(|p| f.starts_with(p))
            })
            .collect();
        assert!(flags.len() >= 5, "{flags:?}");
        // Two alternatives, in this order: istiod's CA, then a directory.
        let split = flags
            .iter()
            .position(|f| f.starts_with("identity-dir"))
            .expect("the --identity-dir alternative");
        let (ca, dir) = flags.split_at(split);
        for group in [ca, dir] {
            let given: Vec<String> = group.iter().map(|f| format!("--{f}")).collect();
            let given: Vec<&str> = given.iter().map(String::as_str).collect();
            let run = run_args(&given).unwrap_or_else(|e| panic!("{given:?}: {e}"));
            assert!(run.identity.source().is_some(), "{given:?}");
        }
        // HBONE between nodes: on with a source and the node the DaemonSet names; the manifest's
        // commented flag turns it off.
        let off = manifest
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#   - "))
            .find(|f| f.starts_with("--hbone-between-nodes"))
            .expect("the commented --hbone-between-nodes");
        let ids = ["--identity-dir", "/ids"];
        let run = run_args(&[off, ids[0], ids[1]]).unwrap();
        assert_eq!(hbone_node(&run.identity, Some("n")).unwrap(), None);
        // The flag alone insists on both.
        let on = run_args(&["--hbone-between-nodes", ids[0], ids[1]]).unwrap();
        assert_eq!(on.identity.hbone_between_nodes, HboneBetweenNodes::On);
        assert!(
            hbone_node(&on.identity, None).is_err(),
            "needs the node's name"
        );
        let on = run_args(&["--hbone-between-nodes"]).unwrap();
        assert!(
            hbone_node(&on.identity, Some("n")).is_err(),
            "needs certificates"
        );
        // By default: on with certificates and the node's name, plaintext without either.
        let auto = run_args(&ids).unwrap();
        assert_eq!(auto.identity.hbone_between_nodes, HboneBetweenNodes::Auto);
        assert_eq!(
            hbone_node(&auto.identity, Some("n")).unwrap().as_deref(),
            Some("n")
        );
        assert_eq!(hbone_node(&auto.identity, None).unwrap(), None);
        assert_eq!(
            hbone_node(&run_args(&[]).unwrap().identity, Some("n")).unwrap(),
            None
        );
    }

    #[test]
    fn one_source_of_certificates_at_a_time() {
        let run = run_args(&["--ca-address", "https://istiod.istio-system.svc:15012"]).unwrap();
        match run.identity.source() {
            Some(crate::hbone::CertSource::IstioCa(ca)) => {
                assert_eq!(
                    ca.root.to_str(),
                    Some("/var/run/secrets/istio/root-cert.pem")
                );
                assert_eq!(
                    ca.token.to_str(),
                    Some("/var/run/secrets/tokens/istio-token")
                );
                assert_eq!(ca.cluster_id, "Kubernetes");
                assert_eq!(ca.validity, std::time::Duration::from_secs(24 * 3600));
            }
            other => panic!("{other:?}"),
        }
        assert!(run_args(&[]).unwrap().identity.source().is_none());
        let both = [
            "--identity-dir",
            "/d",
            "--ca-address",
            "https://istiod:15012",
        ];
        assert!(run_args(&both).is_err());
    }

    fn fast_path(extra: &[&str]) -> Result<bool, clap::Error> {
        let args = [
            "redirect",
            "run",
            "--cgroup",
            "/x",
            "--gateway",
            "169.254.7.1",
        ];
        let cli = Cli::try_parse_from(args.iter().chain(extra))?;
        match cli.command {
            Command::Run(run) => Ok(!run.no_fast_path),
            _ => panic!("not run"),
        }
    }

    #[test]
    fn sizes_read_with_or_without_a_unit() {
        assert_eq!(super::parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(super::parse_size("512 KiB"), Ok(512 << 10));
        assert_eq!(super::parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(super::parse_size("4096"), Ok(4096));
        assert!(super::parse_size("64MB").is_err());
        assert!(super::parse_size("MiB").is_err());
    }

    #[test]
    fn the_fast_path_is_on_unless_no_fast_path_is_given() {
        assert!(fast_path(&[]).unwrap());
        assert!(fast_path(&["--fast-path"]).unwrap(), "still accepted");
        assert!(!fast_path(&["--no-fast-path"]).unwrap());
        assert!(fast_path(&["--fast-path", "--no-fast-path"]).is_err());
    }
}
