//! The multi-tenant mesh of `examples/` made real for one test: a client pod per namespace, the pods and
//! VMs that back services, every endpoint and every "real" host as an identity server in ext, dnsmasq
//! holding the public answers, and the agent enforcing a private copy of the manifests.
//!
//! A scenario asks `redirect explain` (over the same copy) what a client should get, turns that into what
//! dig and curl must observe ([`World::check_dig`], [`World::check_connect`]), and runs them in the pod.
//! Which server answers where and what the public DNS says are facts of this world, written below;
//! what a client gets is never written here: it comes from explain, and each test pins explain to SPEC.
use std::collections::BTreeMap;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::dig::{self, Reply};
use crate::exec::Cmd;
use crate::explain::{DnsAction, DnsVerdict, Explain, OutboundAction, OutboundVerdict};
use crate::metrics::Metrics;
use crate::topology::Pod;
use crate::{Agent, DnsRecords, Dnsmasq, Peer, RESOLVER_IP, Topology};

/// The client pod of each namespace (examples/10-workloads.yaml).
pub const CLIENTS: [(&str, &str); 5] = [
    ("team-a/a1", "10.244.1.10"),
    ("team-b/b1", "10.244.2.10"),
    ("team-c/c1", "10.244.3.10"),
    ("istio-system/sys1", "10.244.4.10"),
    ("quarantine/q1", "10.244.5.10"),
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
    ("partner-host", &["198.51.100.200:80"], &[]),
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

/// TTL of the agent's own answers (SPEC §3).
pub const AGENT_TTL: u32 = 30;

/// Metric keys the scenarios read.
pub mod key {
    pub const DNS_ANSWERED: &str = r#"redirect_dns_queries_total{outcome="answered"}"#;
    pub const DNS_FORWARDED: &str = r#"redirect_dns_queries_total{outcome="forwarded"}"#;
    pub const DNS_SERVFAIL: &str = r#"redirect_dns_queries_total{outcome="servfail"}"#;
    pub const HIDDEN_DNS: &str = r#"redirect_services_hidden_total{lookup="dns"}"#;
    pub const HIDDEN_OUTBOUND: &str = r#"redirect_services_hidden_total{lookup="outbound"}"#;
    pub const RELOAD_OK: &str = r#"redirect_config_reloads_total{result="ok"}"#;
    pub const RELOAD_FAILED: &str = r#"redirect_config_reloads_total{result="failed"}"#;

    /// `redirect_outbound_connections_total{outcome=...}` for an explain action.
    pub fn outbound(action: &crate::explain::OutboundAction) -> String {
        use crate::explain::OutboundAction::*;
        let outcome = match action {
            Service => "service",
            Workload => "workload",
            Passthrough => "passthrough",
            NoHealthyUpstream => "no_healthy_upstream",
        };
        format!(r#"redirect_outbound_connections_total{{outcome="{outcome}"}}"#)
    }
}

/// What a TCP client gets: the named server answered, or the connection was reset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reach {
    Server(String),
    Reset,
}

impl Reach {
    pub fn server(name: &str) -> Reach {
        Reach::Server(name.to_string())
    }
}

/// The world of one test. Fields drop in order: agent, upstream, servers, then the topology.
pub struct World {
    pub agent: Agent,
    pub upstream: Dnsmasq,
    _servers: Vec<Peer>,
    /// Who answers HTTP at each address.
    names: BTreeMap<SocketAddrV4, String>,
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
    pub fn start_with(edit: impl FnOnce(&Path) -> Result<()>) -> Result<World> {
        let mut topo = Topology::new()?;
        for (key, ip) in CLIENTS {
            topo.add_pod(key, ip.parse()?)?;
        }
        for (key, listen, _) in BACKENDS {
            let listen: SocketAddrV4 = listen.parse()?;
            topo.add_pod(key, *listen.ip())?;
        }
        let mut servers = Vec::new();
        let mut names = BTreeMap::new();
        for (key, listen, name) in BACKENDS {
            let listen: SocketAddrV4 = listen.parse()?;
            servers.push(Peer::start(topo.pod(key).place(), name, &[listen], &[])?);
            names.insert(listen, name.to_string());
        }
        for (name, http, echo) in EXT_SERVERS {
            let http: Vec<SocketAddrV4> =
                http.iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
            let echo: Vec<SocketAddrV4> =
                echo.iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
            servers.push(topo.start_ext_peer(name, &http, &echo)?);
            names.extend(http.into_iter().map(|a| (a, name.to_string())));
        }
        let mut records = DnsRecords::new();
        for (host, ip) in PUBLIC_DNS {
            records = records.host(host, ip.parse()?);
        }
        let upstream = topo.start_dnsmasq(RESOLVER_IP, records)?;

        let config = topo.scratch_path("config");
        copy_examples(&config)?;
        edit(&config).context("editing the copy of examples/")?;
        let explain = Explain::new(&config)?;
        let agent = Agent::start(
            &topo,
            &[
                "--config",
                &config.to_string_lossy(),
                "--dns-upstream",
                &format!("{RESOLVER_IP}:53"),
            ],
        )?;
        Ok(World {
            agent,
            upstream,
            _servers: servers,
            names,
            config,
            explain,
            topo,
        })
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

    /// The client pod of `namespace`.
    pub fn client(&self, namespace: &str) -> &Pod {
        let key = CLIENTS
            .iter()
            .find(|(key, _)| key.split('/').next() == Some(namespace))
            .map(|(key, _)| *key)
            .unwrap_or_else(|| panic!("no client pod in namespace {namespace}"));
        self.topo.pod(key)
    }

    /// `dig` in the client pod of `namespace`, with short retries; add the question.
    pub fn dig_cmd(&self, namespace: &str) -> Cmd {
        self.client(namespace)
            .cmd("dig")
            .args(["+tries=2", "+time=2"])
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

    /// [`World::check_dig_with`] for an A question over UDP.
    pub fn check_dig(&self, from: &str, name: &str) -> Result<(DnsVerdict, Reply)> {
        self.check_dig_with(from, name, "A", false)
    }

    /// Asks `dig`'s absolute question `name` (type `qtype`, `A` or `AAAA`; over TCP if `tcp`) from the
    /// client pod of `from` and checks the reply against what `explain` says: the agent's authoritative
    /// answer with explain's addresses of that family (none: an empty NOERROR), or exactly the reply the
    /// upstream gives to the same question. Returns explain's verdict, for the caller to hold against
    /// SPEC, and the pod's reply.
    pub fn check_dig_with(
        &self,
        from: &str,
        name: &str,
        qtype: &str,
        tcp: bool,
    ) -> Result<(DnsVerdict, Reply)> {
        let absolute = format!("{}.", name.trim_end_matches('.'));
        let mut question = vec![absolute.as_str(), qtype];
        if tcp {
            question.push("+tcp");
        }
        let verdict = self.explain.host(from, &absolute)?;
        let before = self.agent.metrics()?;
        let reply = dig::run(self.dig_cmd(from).args(&question))?;
        let after = self.agent.metrics()?;
        let what = format!(
            "dig {question:?} from {from}: {reply:#?}\nexplain: {}",
            verdict.json
        );
        ensure!(
            reply.server.starts_with(&format!("{RESOLVER_IP}#53")),
            "the reply must appear to come from the resolver the pod asked; {what}"
        );
        match verdict.action {
            DnsAction::Answer => {
                ensure!(reply.status == "NOERROR", "{what}");
                ensure!(
                    reply.has_flag("aa"),
                    "the agent answers authoritatively; {what}"
                );
                let want: Vec<IpAddr> = verdict
                    .addresses
                    .iter()
                    .filter(|a| a.is_ipv4() == (qtype == "A"))
                    .copied()
                    .collect();
                ensure!(
                    reply.addresses() == want,
                    "{qtype} records {:?}, explain says {want:?}; {what}",
                    reply.addresses()
                );
                ensure!(
                    reply.answer.iter().all(|r| r.ttl == AGENT_TTL),
                    "the agent's TTL is {AGENT_TTL}; {what}"
                );
                ensure!(
                    delta(&before, &after, key::DNS_ANSWERED) == 1.0
                        && delta(&before, &after, key::DNS_FORWARDED) == 0.0,
                    "the agent must have answered it itself: {after:#?}"
                );
            }
            DnsAction::Forward => {
                let upstream = self.dig_upstream_with(&question)?;
                ensure!(
                    reply.content() == upstream.content(),
                    "the pod must get exactly the upstream's reply; straight from the upstream: {upstream:#?}\n{what}"
                );
                ensure!(
                    delta(&before, &after, key::DNS_FORWARDED) == 1.0
                        && delta(&before, &after, key::DNS_ANSWERED) == 0.0,
                    "the agent must have forwarded it: {after:#?}"
                );
            }
        }
        let hidden = if verdict.hidden.is_some() { 1.0 } else { 0.0 };
        ensure!(
            delta(&before, &after, key::HIDDEN_DNS) == hidden,
            "a hidden service is counted once per query that skipped one: {after:#?}; {what}"
        );
        Ok((verdict, reply))
    }

    /// `dig +search name` from the client pod of `from` (the pod's search path and ndots, as glibc
    /// uses them), for a name explain says the agent answers: the same records, CNAMEd from the
    /// search-domain expansion when there is one. Returns explain's verdict and the reply.
    pub fn check_dig_search(&self, from: &str, name: &str) -> Result<(DnsVerdict, Reply)> {
        let verdict = self.explain.host(from, name)?;
        ensure!(
            verdict.action == DnsAction::Answer,
            "check_dig_search covers answered names only; explain: {}",
            verdict.json
        );
        let before = self.agent.metrics()?;
        let reply = dig::run(self.dig_cmd(from).args(["+search", name]))?;
        let after = self.agent.metrics()?;
        let what = format!(
            "dig +search {name} from {from}: {reply:#?}\nexplain: {}",
            verdict.json
        );
        let want: Vec<IpAddr> = verdict
            .addresses
            .iter()
            .filter(|a| a.is_ipv4())
            .copied()
            .collect();
        let got: Vec<IpAddr> = reply.a_records().into_iter().map(IpAddr::V4).collect();
        ensure!(reply.status == "NOERROR" && reply.has_flag("aa"), "{what}");
        ensure!(
            got == want,
            "A records {got:?}, explain says {want:?}; {what}"
        );
        let cname: Vec<String> = verdict.cname.iter().cloned().collect();
        ensure!(reply.cnames() == cname, "CNAMEs; {what}");
        ensure!(
            reply.answer.first().map(|r| r.name.as_str()) == Some(verdict.query.as_str()),
            "the answered question is explain's {}; {what}",
            verdict.query
        );
        ensure!(
            delta(&before, &after, key::DNS_ANSWERED) == 1.0,
            "exactly the last query answered by the agent: {after:#?}"
        );
        Ok((verdict, reply))
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

    /// What a client of `from` gets connecting to `dest`, per explain: the server at the endpoint it
    /// names (a host-name endpoint resolved through the upstream), or a reset.
    pub fn expected_reach(
        &self,
        from: &str,
        dest: SocketAddrV4,
    ) -> Result<(OutboundVerdict, Reach)> {
        let verdict = self.explain.ip(from, dest)?;
        let reach = match verdict.action {
            OutboundAction::NoHealthyUpstream => Reach::Reset,
            _ => {
                let endpoint = verdict
                    .endpoint
                    .as_deref()
                    .with_context(|| format!("explain names no endpoint: {}", verdict.json))?;
                let at = self.endpoint_addr(endpoint)?;
                Reach::Server(self.server_at(at)?)
            }
        };
        Ok((verdict, reach))
    }

    /// Where a client of `from` connects for `host` (as an application asks, search domains apply):
    /// the agent's first A record, or the upstream's, per explain.
    pub fn expected_address(&self, from: &str, host: &str) -> Result<(DnsVerdict, Ipv4Addr)> {
        let verdict = self.explain.host(from, host)?;
        let ip = match verdict.action {
            DnsAction::Answer => verdict.addresses.iter().find_map(|a| match a {
                IpAddr::V4(v4) => Some(*v4),
                IpAddr::V6(_) => None,
            }),
            DnsAction::Forward => self
                .dig_upstream(&verdict.query)?
                .a_records()
                .first()
                .copied(),
        };
        let ip = ip
            .with_context(|| format!("no IPv4 address for {host} from {from}: {}", verdict.json))?;
        Ok((verdict, ip))
    }

    /// `curl http://<dest>/` from the client pod of `from`, checked against [`World::expected_reach`]
    /// (and the agent's outcome counter). Returns the expectation for the caller to hold against SPEC.
    pub fn check_connect(
        &self,
        from: &str,
        dest: SocketAddrV4,
    ) -> Result<(OutboundVerdict, Reach)> {
        let url = format!("http://{dest}/");
        self.check_url(from, &url, dest)
    }

    /// `curl http://<host>:<port>/` from the client pod of `from`: glibc resolves `host` through the
    /// agent (search domains and all), then connects. Checked against explain's DNS and outbound verdicts.
    pub fn check_host(
        &self,
        from: &str,
        host: &str,
        port: u16,
    ) -> Result<(OutboundVerdict, Reach)> {
        let (_, ip) = self.expected_address(from, host)?;
        let url = format!("http://{host}:{port}/");
        self.check_url(from, &url, SocketAddrV4::new(ip, port))
    }

    fn check_url(
        &self,
        from: &str,
        url: &str,
        dest: SocketAddrV4,
    ) -> Result<(OutboundVerdict, Reach)> {
        let (verdict, want) = self.expected_reach(from, dest)?;
        let counter = key::outbound(&verdict.action);
        let before = self.agent.metrics()?;
        let got = self.curl(from, url)?;
        ensure!(
            got == want,
            "curl {url} from {from}: got {got:?}, explain says {want:?} ({})",
            verdict.json
        );
        // The upstream connect (which counts it) may finish a moment after curl saw the reply.
        let after = self
            .agent
            .wait_metrics(&format!("{counter} +1"), Duration::from_secs(2), |m| {
                delta(&before, m, &counter) == 1.0
            })
            .with_context(|| format!("curl {url} from {from}"))?;
        let hidden = if verdict.hidden.is_some() { 1.0 } else { 0.0 };
        ensure!(
            delta(&before, &after, key::HIDDEN_OUTBOUND) == hidden,
            "curl {url} from {from}: a hidden service is counted once per connection that skipped one: \
             {after:#?}; explain: {}",
            verdict.json
        );
        Ok((verdict, want))
    }

    /// `curl` in the client pod of `from`: the server that answered, or [`Reach::Reset`] for a
    /// connection reset that came at once (within a second); any other failure is an error.
    pub fn curl(&self, from: &str, url: &str) -> Result<Reach> {
        let started = Instant::now();
        let out = self
            .client(from)
            .cmd("curl")
            .args(["-sSv", "--max-time", "10", url])
            .output()?;
        let elapsed = started.elapsed();
        if out.success() {
            return Ok(Reach::Server(out.stdout_str().trim().to_string()));
        }
        // Depending on when the RST lands, curl fails connecting (7), sending (55) or receiving (56);
        // its verbose log names the cause every time.
        if out.stderr_str().contains("Connection reset by peer") {
            ensure!(
                elapsed < Duration::from_secs(1),
                "reset, but only after {elapsed:?}: {out}"
            );
            return Ok(Reach::Reset);
        }
        bail!("curl {url} from {from} failed after {elapsed:?}: {out}")
    }

    /// `ip:port`, or `host:port` with `host` resolved through the upstream (as the agent does).
    fn endpoint_addr(&self, endpoint: &str) -> Result<SocketAddrV4> {
        if let Ok(addr) = endpoint.parse() {
            return Ok(addr);
        }
        let (host, port) = endpoint
            .rsplit_once(':')
            .with_context(|| format!("endpoint {endpoint:?}"))?;
        let ip = self
            .dig_upstream(host)?
            .a_records()
            .first()
            .copied()
            .with_context(|| format!("the upstream does not know {host}"))?;
        Ok(SocketAddrV4::new(ip, port.parse()?))
    }

    fn server_at(&self, addr: SocketAddrV4) -> Result<String> {
        self.names
            .get(&addr)
            .cloned()
            .with_context(|| format!("no server of this world listens on {addr}"))
    }
}

/// `after - before` of one counter.
pub fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}

/// The repository's `examples/`.
pub fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Copies the manifests of `examples/` (not its README) into a new directory `to`.
pub fn copy_examples(to: &Path) -> Result<()> {
    copy_manifests(&examples_dir(), to)
}

/// Copies the `.yaml` files of `from` into a new directory `to`.
pub fn copy_manifests(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path.file_name().context("file name")?;
            fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// Replaces `dir/name` with `contents` in one step (written beside `dir`, then renamed over), so a
/// watcher never reads half a file.
pub fn replace_file(dir: &Path, name: &str, contents: &str) -> Result<()> {
    let parent = dir.parent().context("config dir has no parent")?;
    let staged = parent.join(format!(".staged-{name}"));
    fs::write(&staged, contents)?;
    fs::rename(&staged, dir.join(name))
        .with_context(|| format!("renaming {} into {}", staged.display(), dir.display()))?;
    Ok(())
}

/// Reads `dir/name`, replaces `from` with `to` (which must occur), and writes it back with
/// [`replace_file`].
pub fn edit_file(dir: &Path, name: &str, from: &str, to: &str) -> Result<()> {
    let text = fs::read_to_string(dir.join(name))?;
    ensure!(text.contains(from), "{name} does not contain {from:?}");
    replace_file(dir, name, &text.replacen(from, to, 1))
}
