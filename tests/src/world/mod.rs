//! The multi-tenant mesh of `examples/` made real for one test: a client pod per namespace, the pods and
//! VMs that back services, every endpoint and every "real" host as an identity server in ext, dnsmasq
//! holding the public answers, and the agent enforcing a private copy of the manifests.
//!
//! A scenario asks `redirect explain` (over the same copy) what a client should get, turns that into what
//! dig and curl must observe ([`World::check_dig`], [`World::check_connect`]), and runs them in the pod.
//! Which server answers where and what the public DNS says are facts of this world, written below;
//! what a client gets is never written here: it comes from explain, and each test pins explain to the rules in `docs/`.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};

use crate::apiserver::ApiServer;
use crate::dig::{self, Reply};
use crate::exec::Cmd;
use crate::explain::Explain;
use crate::metrics::Metrics;
use crate::topology::Pod;
use crate::{Agent, DnsRecords, Dnsmasq, Launch, Peer, RESOLVER_IP, RESOLVER_IP6, Topology};

mod check;
mod manifests;

pub use check::{Reach, Resolver};
pub use manifests::{
    copy_examples, copy_manifests, dual_stack_pods, edit_file, examples_dir, replace_file,
};

/// The client pod of each namespace (examples/10-workloads.yaml).
/// (pod, address, `metadata.uid`). Each gets the cgroups kubelet would make for its uid, so every
/// connection in the suite goes through the agent's identity check (and must pass it).
pub const CLIENTS: [(&str, &str, &str); 5] = [
    (
        "team-a/a1",
        "10.244.1.10",
        "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1",
    ),
    (
        "team-b/b1",
        "10.244.2.10",
        "5d2e8c4b-1f3a-4b6c-8d9e-b1b1b1b1b1b1",
    ),
    (
        "team-c/c1",
        "10.244.3.10",
        "7a9b1c3d-5e7f-4a1b-9c2d-c1c1c1c1c1c1",
    ),
    (
        "istio-system/sys1",
        "10.244.4.10",
        "9c4d6e8f-2a4b-4c6d-8e0f-5151515151a1",
    ),
    (
        "quarantine/q1",
        "10.244.5.10",
        "b8e0f2a4-6c8e-4a0b-9d1f-91919191a1a1",
    ),
];

/// Workloads of examples/10-workloads.yaml that back services: (pod in the topology, where it listens,
/// the name it answers with). `team-c/legacy-vm` is a WorkloadEntry in the manifests; here it is a netns.
const BACKENDS: [(&str, &str, &str); 2] = [
    ("team-a/web-1", "10.244.1.20:8080", "web-1"),
    ("team-c/legacy-vm", "10.244.3.50:8080", "legacy-vm"),
];

/// Identity servers in ext: (name, HTTP addresses, echo addresses). Endpoints named in the manifests
/// answer `*-endpoint`; the hosts a name or address really points to outside the mesh answer `real-*`
/// or `public-*`.
const EXT_SERVERS: &[(&str, &[&str], &[&str])] = &[
    ("api-endpoint", &["198.51.100.20:80"], &[]),
    ("metrics-endpoint", &["198.51.100.30:80"], &[]),
    ("shared-public-endpoint", &["198.51.100.40:80"], &[]),
    ("shared-private-endpoint", &["198.51.100.41:80"], &[]),
    ("login-hijack-endpoint", &["198.51.100.50:80"], &[]),
    ("origin", &["198.51.100.60:80"], &[]),
    // An echo, for long-lived connections through a service.
    ("payments-endpoint", &[], &["198.51.100.70:443"]),
    ("public-httpbin", &["198.51.100.80:80"], &[]),
    ("apps-endpoint", &["198.51.100.90:80"], &[]),
    // Port 22 too: partner-net (resolution NONE) declares 80 and 443 only.
    (
        "partner-host",
        &["198.51.100.200:80", "198.51.100.200:22"],
        &[],
    ),
    (
        "real-203.0.113.10",
        &["203.0.113.10:80", "203.0.113.10:443"],
        &["203.0.113.10:7"],
    ),
    ("real-203.0.113.41", &["203.0.113.41:80"], &[]),
    ("real-203.0.113.50", &["203.0.113.50:80"], &[]),
    ("real-203.0.113.80", &["203.0.113.80:80"], &[]),
    ("public-api", &["203.0.113.110:80"], &[]),
    ("public-metrics", &["203.0.113.130:80"], &[]),
    ("public-shared", &["203.0.113.140:80"], &[]),
    ("public-login", &["203.0.113.150:80"], &[]),
    // The IPv6 side of the world: the real host of a name a NAMESPACE entry claims with an IPv6
    // address, and that entry's endpoint.
    ("real-2001:db8:113::10", &["[2001:db8:113::10]:80"], &[]),
    ("api6-endpoint", &["[2001:db8:100::20]:80"], &[]),
];

/// The upstream resolver's (public) answers. Each differs from any address the mesh gives the same
/// name, so a reply tells who answered. Every other name is NXDOMAIN.
pub const PUBLIC_DNS: &[(&str, &str)] = &[
    ("api.example.com", "203.0.113.110"),
    ("metrics.example.com", "203.0.113.130"),
    ("shared.example.com", "203.0.113.140"),
    ("login.example.com", "203.0.113.150"),
    ("origin.example.org", "198.51.100.60"),
    ("httpbin.example.com", "198.51.100.80"),
];

/// The upstream resolver's AAAA answers (the same names' A answers are in [`PUBLIC_DNS`]).
pub const PUBLIC_DNS6: &[(&str, &str)] = &[
    ("api.example.com", "2001:db8:113::110"),
    ("api6.example.com", "2001:db8:113::10"),
];

/// Upstream answers with a TTL (name, address, TTL): the agent may keep them. All others have TTL 0.
pub const LASTING_DNS: &[(&str, &str, u32)] = &[("stable.example.com", "203.0.113.170", 60)];

/// TTL of the agent's own answers.
pub const AGENT_TTL: u32 = 30;

/// Metric keys the scenarios read.
pub mod key {
    pub const DNS_ANSWERED: &str = r#"redirect_dns_queries_total{outcome="answered"}"#;
    pub const DNS_FORWARDED: &str = r#"redirect_dns_queries_total{outcome="forwarded"}"#;
    pub const DNS_CACHED: &str = r#"redirect_dns_queries_total{outcome="cached"}"#;
    pub const DNS_SERVFAIL: &str = r#"redirect_dns_queries_total{outcome="servfail"}"#;
    pub const HIDDEN_DNS: &str = r#"redirect_services_hidden_total{lookup="dns"}"#;
    pub const HIDDEN_OUTBOUND: &str = r#"redirect_services_hidden_total{lookup="outbound"}"#;
    pub const IDENTITY_MISMATCHES: &str = "redirect_client_identity_mismatches_total";
    pub const RELOAD_OK: &str = r#"redirect_config_reloads_total{result="ok"}"#;
    pub const RELOAD_FAILED: &str = r#"redirect_config_reloads_total{result="failed"}"#;
    /// Applied, with objects in error left out or kept at their last good version.
    pub const RELOAD_PARTIAL: &str = r#"redirect_config_reloads_total{result="partial"}"#;

    /// `redirect_config_objects_rejected{kind=...}`: objects of that kind in error now.
    pub fn rejected(kind: &str) -> String {
        format!(r#"redirect_config_objects_rejected{{kind="{kind}"}}"#)
    }

    /// `redirect_fast_path_connections_total{outcome=...}` for the kernel's counterpart of an
    /// explain action: `service` is a rewrite, `passthrough` and `workload` are themselves.
    pub fn fast_path(outcome: &crate::explain::OutboundOutcome) -> String {
        let outcome = match outcome.metric_label() {
            "service" => "rewritten",
            other => other,
        };
        format!(r#"redirect_fast_path_connections_total{{outcome="{outcome}",reason=""}}"#)
    }

    /// `redirect_outbound_connections_total{outcome=...}` for an explain action or outcome.
    pub fn outbound(outcome: &crate::explain::OutboundOutcome) -> String {
        let outcome = outcome.metric_label();
        format!(r#"redirect_outbound_connections_total{{outcome="{outcome}"}}"#)
    }
}

/// The world of one test. Fields drop in order: agent, upstream, servers, then the topology.
pub struct World {
    pub agent: Agent,
    /// The test API server the agent watches, for a world started with [`World::start_kube_with`].
    api: Option<ApiServer>,
    pub upstream: Dnsmasq,
    _servers: Vec<Peer>,
    /// Who answers HTTP at each address.
    names: BTreeMap<SocketAddr, String>,
    /// Pods the manifests do not know: (the name explain knows their view by, pod key).
    strangers: Vec<(String, String)>,
    config: PathBuf,
    explain: Explain,
    pub topo: Topology,
}

impl World {
    /// The world with an unchanged copy of `examples/`.
    pub fn start() -> Result<World> {
        World::start_with(|_| Ok(()))
    }

    /// The world with a copy of `examples/` that `edit` may change before the agent starts.
    ///
    /// With `REDIRECT_WORLD_SOURCE=kube` in the environment, the agent watches a test API server
    /// serving the same objects instead ([`World::start_kube_with`]): any suite built on the world
    /// then runs against the Kubernetes API source.
    pub fn start_with(edit: impl FnOnce(&Path) -> Result<()>) -> Result<World> {
        World::start_with_launched(edit, &Launch::default())
    }

    /// As [`World::start_with`], the agent started as `launch` says (e.g. `Launch::no_fast_path()`
    /// for a suite that tests the proxy's own behaviour).
    pub fn start_with_launched(
        edit: impl FnOnce(&Path) -> Result<()>,
        launch: &Launch,
    ) -> Result<World> {
        let kube = std::env::var("REDIRECT_WORLD_SOURCE").is_ok_and(|s| s == "kube");
        World::start_source(edit, kube, launch, &[], None)
    }

    /// The world with an unchanged copy of `examples/` and the agent started as `launch` says
    /// (e.g. with or without the fast path).
    pub fn start_launched(launch: &Launch) -> Result<World> {
        World::start_source(|_| Ok(()), false, launch, &[], None)
    }

    /// The world with the agent run from `image` as the DaemonSet runs it, watching a test API
    /// server ([`World::start_kube_with`]) as the DaemonSet's `--kube` does.
    pub fn start_kube_image(image: &crate::container::Image) -> Result<World> {
        World::start_source(|_| Ok(()), true, &Launch::default(), &[], Some(image))
    }

    /// As [`World::start_with`], the agent learning the same objects from a test API server
    /// (`run --kube`) instead of the directory; explain still reads the directory.
    pub fn start_kube_with(edit: impl FnOnce(&Path) -> Result<()>) -> Result<World> {
        World::start_source(edit, true, &Launch::default(), &[], None)
    }

    /// [`World::start_with_launched`] (the directory as the source), the agent given `extra`
    /// arguments too.
    pub fn start_args(
        edit: impl FnOnce(&Path) -> Result<()>,
        launch: &Launch,
        extra: &[&str],
    ) -> Result<World> {
        World::start_source(edit, false, launch, extra, None)
    }

    /// [`World::start_kube_with`], the agent given `extra` arguments too.
    pub fn start_kube_args(
        edit: impl FnOnce(&Path) -> Result<()>,
        extra: &[&str],
    ) -> Result<World> {
        World::start_source(edit, true, &Launch::default(), extra, None)
    }

    fn start_source(
        edit: impl FnOnce(&Path) -> Result<()>,
        kube: bool,
        launch: &Launch,
        extra: &[&str],
        image: Option<&crate::container::Image>,
    ) -> Result<World> {
        let mut topo = Topology::new()?;
        for (key, ip, uid) in CLIENTS {
            topo.add_kube_pod(key, ip.parse()?, uid)?;
        }
        for (key, listen, _) in BACKENDS {
            let listen: std::net::SocketAddrV4 = listen.parse()?;
            topo.add_pod(key, *listen.ip())?;
        }
        let mut servers = Vec::new();
        let mut names = BTreeMap::new();
        for (key, listen, name) in BACKENDS {
            let listen: SocketAddr = listen.parse()?;
            servers.push(Peer::start(topo.pod(key).place(), name, &[listen], &[])?);
            names.insert(listen, name.to_string());
        }
        for (name, http, echo) in EXT_SERVERS {
            let http: Vec<SocketAddr> = http.iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
            let echo: Vec<SocketAddr> = echo.iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
            servers.push(topo.start_ext_peer(name, &http, &echo)?);
            names.extend(http.into_iter().map(|a| (a, name.to_string())));
        }
        let mut records = DnsRecords::new();
        for (host, ip) in PUBLIC_DNS.iter().chain(PUBLIC_DNS6) {
            records = records.host(host, ip.parse()?);
        }
        for (host, ip, ttl) in LASTING_DNS {
            records = records.host_ttl(host, ip.parse()?, *ttl);
        }
        // The same resolver on both families: a pod may ask it at either address.
        let upstream = topo.start_dual_stack_dnsmasq(records)?;

        let config = topo.scratch_path("config");
        copy_examples(&config)?;
        // The pods are dual-stack (see the topology): so are their manifests.
        dual_stack_pods(&config, "10-workloads.yaml")?;
        edit(&config).context("editing the copy of examples/")?;
        let explain = Explain::new(&config)?;
        let upstream_arg = format!("{RESOLVER_IP}:53");
        let (agent, api) = if kube {
            let api = ApiServer::start(&topo.node().netns)?;
            api.sync_dir(&config)?;
            let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
            let kubeconfig = kubeconfig.to_string_lossy();
            let mut args = vec![
                "--kube",
                "--kubeconfig",
                &kubeconfig,
                "--dns-upstream",
                &upstream_arg,
            ];
            args.extend(extra);
            let agent = match image {
                Some(image) => Agent::launch_image(&topo, image, &args)?,
                None => Agent::launch(&topo, launch, &args)?,
            };
            (agent, Some(api))
        } else {
            let config = config.to_string_lossy();
            let mut args = vec!["--config", &config, "--dns-upstream", &upstream_arg];
            args.extend(extra);
            (Agent::launch(&topo, launch, &args)?, None)
        };
        Ok(World {
            agent,
            api,
            upstream,
            _servers: servers,
            names,
            strangers: Vec::new(),
            config,
            explain,
            topo,
        })
    }

    /// The test API server of a world started with [`World::start_kube_with`].
    pub fn api(&self) -> &ApiServer {
        self.api
            .as_ref()
            .expect("a world started with World::start_kube_with")
    }

    /// The kubeconfig that points at the test API server (for `kubectl` in the node netns).
    pub fn kubeconfig(&self) -> PathBuf {
        self.topo.scratch_path("kubeconfig")
    }

    /// [`World::api`], to stop and resume it.
    pub fn api_mut(&mut self) -> &mut ApiServer {
        self.api
            .as_mut()
            .expect("a world started with World::start_kube_with")
    }

    /// The agent's copy of the manifests (edit it to reload; see [`replace_file`]).
    pub fn config_dir(&self) -> &Path {
        &self.config
    }
    pub fn explain(&self) -> &Explain {
        &self.explain
    }
    /// Makes the checks ask explain about `dir` instead of the live copy: the last good configuration,
    /// while the live copy holds a change the agent refused (explain rejects it too).
    pub fn explain_over(&mut self, dir: &Path) -> Result<()> {
        self.explain = Explain::new(dir)?;
        Ok(())
    }

    /// The client pod of `namespace` (or the stranger known by that name).
    pub fn client(&self, namespace: &str) -> &Pod {
        let key = CLIENTS
            .iter()
            .find(|(key, _, _)| key.split('/').next() == Some(namespace))
            .map(|(key, _, _)| *key)
            .or_else(|| {
                self.strangers
                    .iter()
                    .find(|(view, _)| view == namespace)
                    .map(|(_, key)| key.as_str())
            })
            .unwrap_or_else(|| panic!("no client pod in namespace {namespace}"));
        self.topo.pod(key)
    }

    /// Adds a pod `key` at `ip` that no manifest declares: the agent cannot tell its namespace, so it
    /// must see what a namespace owning nothing sees (PUBLIC only). The checks address it as `view`,
    /// a namespace no manifest mentions, and ask explain about that namespace.
    pub fn add_stranger(&mut self, key: &str, ip: &str, view: &str) -> Result<()> {
        self.topo.add_pod(key, ip.parse()?)?;
        self.strangers.push((view.to_string(), key.to_string()));
        Ok(())
    }

    /// Whether `view` names a pod no manifest declares ([`World::add_stranger`]).
    pub fn is_stranger(&self, view: &str) -> bool {
        self.strangers.iter().any(|(v, _)| v == view)
    }

    /// `dig` in the client pod of `namespace`, with short retries; add the question.
    pub fn dig_cmd(&self, namespace: &str) -> Cmd {
        self.client(namespace)
            .cmd("dig")
            .args(["+tries=2", "+time=2"])
    }

    /// The upstream resolver at each address a pod may ask it at: its IPv4 address (from
    /// `/etc/resolv.conf`, an `AF_INET` socket), the v4-mapped form of it and its IPv6 address (both
    /// `AF_INET6` sockets).
    pub fn resolvers() -> [Resolver; 3] {
        [
            Resolver::ResolvConf,
            Resolver::At(RESOLVER_IP.to_ipv6_mapped().into()),
            Resolver::At(RESOLVER_IP6.into()),
        ]
    }

    /// `dig @upstream name` from the node netns, outside the pods' cgroup: nothing steers it.
    pub fn dig_upstream(&self, name: &str) -> Result<Reply> {
        self.dig_upstream_with(&[name])
    }

    /// `dig @upstream QUESTION...` from the node netns.
    pub fn dig_upstream_with(&self, question: &[&str]) -> Result<Reply> {
        dig::run(
            self.topo
                .node_cmd("dig")
                .args([&format!("@{RESOLVER_IP}"), "+tries=2", "+time=2"])
                .args(question),
        )
    }

    /// `/config_dump`, parsed.
    pub fn config_dump(&self) -> Result<serde_json::Value> {
        let r = self.agent.admin_get("/config_dump")?;
        ensure!(
            r.status == 200,
            "/config_dump answered {}: {}",
            r.status,
            r.text()
        );
        serde_json::from_slice(&r.body).context("/config_dump is not JSON")
    }
}

/// `after - before` of one counter.
pub fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}
