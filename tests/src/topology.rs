//! The run's network: node, ext and pod namespaces, their links and routes, and their cgroups.
//! Built with `ip -n <ns>` only: nothing is ever added to the machine's own netns.
use std::collections::BTreeSet;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

use crate::exec::{Cmd, Place};
use crate::netns::{self, ip};
use crate::run::{self, RunId};
use crate::{
    EXT_NODE_IP, EXT_NODE_IP6, GATEWAY, GATEWAY6, NODE_EXT_IP, NODE_EXT_IP6, RESOLVER_IP,
    RESOLVER_IP6, cgroup, pod_ip6,
};

/// Prefixes the ext netns answers for; the node routes them to ext.
pub const EXT_PREFIXES: [&str; 2] = ["203.0.113.0/24", "198.51.100.0/24"];
/// IPv6 prefixes the ext netns answers for (documentation space, like the TEST-NETs).
pub const EXT_PREFIXES6: [&str; 1] = ["2001:db8::/32"];
/// The pod network; ext routes it back through the node.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The pods' IPv6 network (a ULA).
pub const POD_CIDR6: &str = "fd00:10:244::/48";

/// One run's topology. Dropping it kills every process the run started (whole cgroup subtree), deletes
/// its namespaces and cgroups, and removes its state directory, also while a test is panicking.
pub struct Topology {
    id: RunId,
    cgroup2: PathBuf,
    state_dir: PathBuf,
    /// Parent of the pod cgroups: what the agent attaches its programs to.
    pods_cgroup: PathBuf,
    node: Place,
    ext: Place,
    pods: Vec<Pod>,
    ext_addrs: Mutex<BTreeSet<IpAddr>>,
}

/// A pod: its own netns and child cgroup, a /32 and a /128 address, its own /etc/resolv.conf.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, [`pod_ip6`] of `ip`.
    pub ip6: Ipv6Addr,
    place: Place,
}

impl Pod {
    /// `team-a/a1`
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
    pub fn place(&self) -> &Place {
        &self.place
    }
    pub fn cgroup(&self) -> &Path {
        &self.place.cgroup
    }
    pub fn netns(&self) -> &str {
        &self.place.netns
    }
    /// A command run inside the pod: its cgroup, its netns, its resolv.conf.
    pub fn cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Cmd {
        self.place.cmd(program)
    }
}

impl Topology {
    /// Sweeps leftovers of dead runs, then builds node and ext (no pods yet).
    pub fn new() -> Result<Topology> {
        crate::require_root()?;
        let cgroup2 = cgroup::cgroup2_mount()?;
        run::sweep_stale(&cgroup2);
        let id = RunId::generate();
        let state_dir = run::claim(&id)?;
        // From here on Drop cleans up whatever part got built.
        let run_cgroup = id.cgroup_dir(&cgroup2);
        let place = |role: &str, cgroup: PathBuf| Place {
            label: role.to_string(),
            netns: format!("{}-{role}", id.tag()),
            cgroup,
            resolv_conf: None,
            log_dir: state_dir.join("logs"),
        };
        let mut topo = Topology {
            node: place("node", run_cgroup.join("infra")),
            ext: place("ext", run_cgroup.join("infra")),
            pods_cgroup: run_cgroup.join("pods"),
            id,
            cgroup2,
            state_dir,
            pods: Vec::new(),
            ext_addrs: Mutex::new(BTreeSet::new()),
        };
        topo.build_core()
            .with_context(|| format!("building topology {}", topo.id))?;
        run::mount_bpffs(&topo.id)?;
        Ok(topo)
    }

    /// [`Topology::new`] plus the given pods, e.g. `&[("team-a/a1", "10.244.1.10")]`.
    pub fn with_pods(pods: &[(&str, &str)]) -> Result<Topology> {
        let mut topo = Topology::new()?;
        for (key, addr) in pods {
            let addr: Ipv4Addr = addr
                .parse()
                .with_context(|| format!("pod {key}: address {addr:?}"))?;
            topo.add_pod(key, addr)?;
        }
        Ok(topo)
    }

    fn build_core(&mut self) -> Result<()> {
        // infra: the agent, servers and node-side commands; pods: what the agent attaches to.
        for dir in [&self.node.cgroup, &self.pods_cgroup] {
            fs::create_dir_all(dir)
                .with_context(|| format!("creating cgroup {}", dir.display()))?;
        }
        let (node, ext) = (self.node.netns.clone(), self.ext.netns.clone());
        netns::add(&node)?;
        netns::add(&ext)?;
        for ns in [&node, &ext] {
            no_dad(ns)?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        ip(&[
            "-n",
            &node,
            "addr",
            "add",
            &format!("{GATEWAY}/32"),
            "dev",
            "lo",
        ])?;
        // Also on lo, so the agent can bind it before any pod (and its veth) exists.
        add_v6(&node, &format!("{GATEWAY6}/128"), "lo")?;
        ip(&[
            "-n", &node, "link", "add", "to-ext", "type", "veth", "peer", "name", "to-node",
            "netns", &ext,
        ])?;
        ip(&[
            "-n",
            &node,
            "addr",
            "add",
            &format!("{NODE_EXT_IP}/30"),
            "dev",
            "to-ext",
        ])?;
        ip(&[
            "-n",
            &ext,
            "addr",
            "add",
            &format!("{EXT_NODE_IP}/30"),
            "dev",
            "to-node",
        ])?;
        add_v6(&node, &format!("{NODE_EXT_IP6}/64"), "to-ext")?;
        add_v6(&ext, &format!("{EXT_NODE_IP6}/64"), "to-node")?;
        ip(&["-n", &node, "link", "set", "to-ext", "up"])?;
        ip(&["-n", &ext, "link", "set", "to-node", "up"])?;
        for prefix in EXT_PREFIXES {
            ip(&[
                "-n",
                &node,
                "route",
                "add",
                prefix,
                "via",
                &EXT_NODE_IP.to_string(),
            ])?;
        }
        ip(&[
            "-n",
            &ext,
            "route",
            "add",
            POD_CIDR,
            "via",
            &NODE_EXT_IP.to_string(),
        ])?;
        for prefix in EXT_PREFIXES6 {
            ip(&[
                "-n",
                &node,
                "-6",
                "route",
                "add",
                prefix,
                "via",
                &EXT_NODE_IP6.to_string(),
            ])?;
        }
        ip(&[
            "-n",
            &ext,
            "-6",
            "route",
            "add",
            POD_CIDR6,
            "via",
            &NODE_EXT_IP6.to_string(),
        ])?;
        netns::sysctl(
            &node,
            &["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
        )?;
        Ok(())
    }

    /// Adds pod `namespace/name` with address `ip` (a /32 from 10.244.0.0/16).
    pub fn add_pod(&mut self, key: &str, ip_addr: Ipv4Addr) -> Result<Pod> {
        self.add_pod_in(key, ip_addr, None)
    }

    /// Like [`Topology::add_pod`], with the cgroups kubelet's cgroupfs driver makes for pod `uid`: the
    /// pod's `pod<uid>` and, below it, the container `app` its processes run in.
    pub fn add_kube_pod(&mut self, key: &str, ip_addr: Ipv4Addr, uid: &str) -> Result<Pod> {
        self.add_pod_in(key, ip_addr, Some(uid))
    }

    fn add_pod_in(&mut self, key: &str, ip_addr: Ipv4Addr, uid: Option<&str>) -> Result<Pod> {
        let (namespace, name) = key
            .split_once('/')
            .with_context(|| format!("pod {key:?}: want namespace/name"))?;
        if self
            .pods
            .iter()
            .any(|p| p.key() == key || p.ip == ip_addr || p.ip6 == pod_ip6(ip_addr))
        {
            bail!(
                "pod {key} or address {ip_addr} already exists in {}",
                self.id
            );
        }
        // `_` never occurs in Kubernetes names, so namespace and pod name stay apart.
        let slug = format!("{namespace}_{name}");
        let pod_dir = self.state_dir.join("pods").join(&slug);
        fs::create_dir_all(&pod_dir)?;
        let resolv = pod_dir.join("resolv.conf");
        fs::write(
            &resolv,
            format!(
                "nameserver {RESOLVER_IP}\nsearch {namespace}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
            ),
        )?;
        let pod = Pod {
            namespace: namespace.to_string(),
            name: name.to_string(),
            ip: ip_addr,
            ip6: pod_ip6(ip_addr),
            place: Place {
                label: format!("pod {key}"),
                netns: format!("{}-pod-{slug}", self.id.tag()),
                cgroup: match uid {
                    None => self.pods_cgroup.join(&slug),
                    Some(uid) => self.pods_cgroup.join(format!("pod{uid}")).join("app"),
                },
                resolv_conf: Some(resolv),
                log_dir: self.state_dir.join("logs"),
            },
        };
        fs::create_dir_all(pod.cgroup())
            .with_context(|| format!("creating cgroup {}", pod.cgroup().display()))?;
        let veth = format!("vp{}", self.pods.len());
        self.pods.push(pod.clone());
        self.wire_pod(&pod, &veth)
            .with_context(|| format!("wiring pod {key}"))?;
        Ok(pod)
    }

    fn wire_pod(&self, pod: &Pod, veth: &str) -> Result<()> {
        let (node, ns) = (self.node.netns.as_str(), pod.netns());
        let (pod_ip, gw) = (pod.ip.to_string(), GATEWAY.to_string());
        let (pod_ip6, gw6) = (pod.ip6.to_string(), GATEWAY6.to_string());
        netns::add(ns)?;
        // Before the veth exists: its end in the pod takes the namespace's defaults.
        no_dad(ns)?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n", node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ])?;
        ip(&["-n", node, "link", "set", veth, "up"])?;
        ip(&[
            "-n",
            node,
            "route",
            "add",
            &format!("{pod_ip}/32"),
            "dev",
            veth,
        ])?;
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{pod_ip}/32"),
            "dev",
            "eth0",
        ])?;
        add_v6(ns, &format!("{pod_ip6}/128"), "eth0")?;
        add_v6(node, &format!("{gw6}/128"), veth)?;
        ip(&[
            "-n",
            node,
            "-6",
            "route",
            "add",
            &format!("{pod_ip6}/128"),
            "dev",
            veth,
        ])?;
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        // Calico's pattern: the gateway is on-link from every pod, and it is a local address of the node.
        ip(&[
            "-n", ns, "route", "add", &gw, "dev", "eth0", "scope", "link",
        ])?;
        ip(&[
            "-n", ns, "route", "add", "default", "via", &gw, "dev", "eth0",
        ])?;
        ip(&["-n", ns, "-6", "route", "add", &gw6, "dev", "eth0"])?;
        ip(&[
            "-n", ns, "-6", "route", "add", "default", "via", &gw6, "dev", "eth0",
        ])?;
        Ok(())
    }

    /// Joins the node netns of `a` and `b` as two nodes of one cluster: a veth pair between them
    /// (`a` 100.64.0.1/30, `b` 100.64.0.2/30), and each node's Pods (`a_pods`, `b_pods`, e.g.
    /// `10.244.1.0/24`) routed through it from the other. The link goes with either netns.
    pub fn link_nodes(a: &Topology, a_pods: &str, b: &Topology, b_pods: &str) -> Result<()> {
        let (na, nb) = (a.node.netns.as_str(), b.node.netns.as_str());
        ip(&[
            "-n", na, "link", "add", "to-peer", "type", "veth", "peer", "name", "to-peer", "netns",
            nb,
        ])?;
        for (ns, own, other, pods) in [
            (na, "100.64.0.1/30", "100.64.0.2", b_pods),
            (nb, "100.64.0.2/30", "100.64.0.1", a_pods),
        ] {
            ip(&["-n", ns, "addr", "add", own, "dev", "to-peer"])?;
            ip(&["-n", ns, "link", "set", "to-peer", "up"])?;
            ip(&["-n", ns, "route", "add", pods, "via", other])?;
        }
        // The Pods' IPv6 addresses ([`pod_ip6`]) are routed alike, a /64 per node.
        for (ns, own, other, pods) in [
            (na, "fd00:64::1/64", "fd00:64::2", b_pods),
            (nb, "fd00:64::2/64", "fd00:64::1", a_pods),
        ] {
            let network: Ipv4Addr = pods
                .split_once('/')
                .and_then(|(ip, _)| ip.parse().ok())
                .with_context(|| format!("the Pods' network {pods:?}"))?;
            let pods6 = format!("{}/64", pod_ip6(network));
            add_v6(ns, own, "to-peer")?;
            ip(&["-n", ns, "-6", "route", "add", &pods6, "via", other])?;
        }
        Ok(())
    }

    /// Makes `addr` an address of ext (on its loopback, /32 or /128), once.
    pub fn ensure_ext_address(&self, addr: impl Into<IpAddr>) -> Result<()> {
        let addr = addr.into();
        let mut have = self.ext_addrs.lock().unwrap_or_else(|p| p.into_inner());
        if have.insert(addr) {
            let added = match addr {
                IpAddr::V4(v4) => ip(&[
                    "-n",
                    &self.ext.netns,
                    "addr",
                    "add",
                    &format!("{v4}/32"),
                    "dev",
                    "lo",
                ])
                .map(drop),
                IpAddr::V6(v6) => add_v6(&self.ext.netns, &format!("{v6}/128"), "lo"),
            };
            added.inspect_err(|_| {
                have.remove(&addr);
            })?;
        }
        Ok(())
    }

    /// Starts an identity HTTP server named `name` and TCP echo servers in ext, adding their addresses.
    pub fn start_ext_peer(
        &self,
        name: &str,
        http: &[SocketAddr],
        echo: &[SocketAddr],
    ) -> Result<crate::Peer> {
        for a in http.iter().chain(echo) {
            self.ensure_ext_address(a.ip())?;
        }
        crate::Peer::start(&self.ext, name, http, echo)
    }

    /// Starts dnsmasq in ext on `listen`:53 with `records`.
    pub fn start_dnsmasq(
        &self,
        listen: Ipv4Addr,
        records: crate::DnsRecords,
    ) -> Result<crate::Dnsmasq> {
        self.ensure_ext_address(listen)?;
        crate::Dnsmasq::start(&self.ext, &[listen.into()], records)
    }

    /// Starts dnsmasq in ext on both [`RESOLVER_IP`] and [`RESOLVER_IP6`] (port 53) with `records`.
    pub fn start_dual_stack_dnsmasq(&self, records: crate::DnsRecords) -> Result<crate::Dnsmasq> {
        let listen = [IpAddr::V4(RESOLVER_IP), IpAddr::V6(RESOLVER_IP6)];
        for addr in listen {
            self.ensure_ext_address(addr)?;
        }
        crate::Dnsmasq::start(&self.ext, &listen, records)
    }

    pub fn id(&self) -> &RunId {
        &self.id
    }
    /// The cgroup the agent attaches to (`--cgroup`): the parent of every pod cgroup, never the root.
    pub fn attach_cgroup(&self) -> &Path {
        &self.pods_cgroup
    }
    pub fn node(&self) -> &Place {
        &self.node
    }
    pub fn ext(&self) -> &Place {
        &self.ext
    }
    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }
    /// The pod `namespace/name`; panics if there is none (a test bug).
    pub fn pod(&self, key: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.key() == key)
            .unwrap_or_else(|| panic!("no pod {key} in {}", self.id))
    }
    /// In the node netns but outside any pod cgroup: traffic from here is never redirected.
    pub fn node_cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Cmd {
        self.node.cmd(program)
    }
    pub fn ext_cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Cmd {
        self.ext.cmd(program)
    }
    /// Runs `f` on a thread inside the node netns (for in-process HTTP to the admin port).
    pub fn in_node<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        netns::in_netns(&self.node.netns, f)
    }
    /// This run's private directory (removed on drop): logs, scratch files.
    /// Where the agents of this run pin their links and maps (`--bpffs`), on the run's own bpffs.
    pub fn pin_dir(&self) -> PathBuf {
        self.id.bpffs_dir().join("redirect")
    }

    /// The unix socket on which an agent of this run hands its sockets to a successor.
    pub fn handover_socket(&self) -> PathBuf {
        self.state_dir.join("handover.sock")
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }
    pub fn scratch_path(&self, name: &str) -> PathBuf {
        self.state_dir.join(name)
    }
    /// Every netns name this run owns (for leftover checks).
    pub fn netns_names(&self) -> Vec<String> {
        let mut names = vec![self.node.netns.clone(), self.ext.netns.clone()];
        names.extend(self.pods.iter().map(|p| p.netns().to_string()));
        names
    }
    /// The cgroup v2 mount this run found.
    pub fn cgroup2(&self) -> &Path {
        &self.cgroup2
    }
    pub fn run_cgroup(&self) -> PathBuf {
        self.id.cgroup_dir(&self.cgroup2)
    }
}

/// IPv6 addresses usable at once in `ns`: no duplicate address detection (its delay would make the
/// first connections of a test fail), for interfaces made from now on and those already there.
fn no_dad(ns: &str) -> Result<()> {
    netns::sysctl(
        ns,
        &[
            "net.ipv6.conf.all.accept_dad=0",
            "net.ipv6.conf.default.accept_dad=0",
        ],
    )
}

/// `ip -6 addr add ADDR dev DEV nodad` in `ns`.
fn add_v6(ns: &str, addr: &str, dev: &str) -> Result<()> {
    ip(&["-n", ns, "-6", "addr", "add", addr, "dev", dev, "nodad"]).map(|_| ())
}

impl Drop for Topology {
    fn drop(&mut self) {
        for e in run::remove_run(&self.id, &self.cgroup2) {
            eprintln!("redirect-tests: cleaning up {}: {e}", self.id);
        }
    }
}
