//! The checks: run dig or curl in a client pod and hold what it observed (and the agent's counters)
//! to what `redirect explain` says over the same manifests.
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::{AGENT_TTL, World, delta, key};
use crate::RESOLVER_IP;
use crate::dig::{self, Reply};
use crate::explain::{DecidedBy, DnsAction, DnsVerdict, OutboundOutcome, OutboundVerdict};

/// What a TCP client gets: the named server answered, or the connection was reset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reach {
    Server(String),
    Reset,
}

/// Where a pod sends a DNS query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolver {
    /// The resolver of the pod's `/etc/resolv.conf` (IPv4), as an application asks.
    ResolvConf,
    /// `dig @ip`: an IPv6 address (v4-mapped or not) makes dig use an `AF_INET6` socket.
    At(IpAddr),
}

impl Resolver {
    /// dig refuses v4-mapped server addresses: those are asked with `rdt-peer dns` (same layout).
    fn is_v4_mapped(self) -> bool {
        matches!(self, Resolver::At(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some())
    }

    /// How the reply's source must read in dig's `;; SERVER:` line.
    fn server_prefix(self) -> String {
        match self {
            Resolver::ResolvConf => format!("{RESOLVER_IP}#53"),
            Resolver::At(ip) => format!("{ip}#53"),
        }
    }
}

impl Reach {
    pub fn server(name: &str) -> Reach {
        Reach::Server(name.to_string())
    }
}

impl World {
    /// [`World::check_dig_with`] for an A question over UDP.
    pub fn check_dig(&self, from: &str, name: &str) -> Result<(DnsVerdict, Reply)> {
        self.check_dig_with(from, name, "A", false)
    }

    /// Asks `dig`'s absolute question `name` (type `qtype`, `A` or `AAAA`; over TCP if `tcp`) from the
    /// client pod of `from`, at every address of the resolver ([`World::resolvers`]: IPv4, v4-mapped,
    /// IPv6), and checks each reply against what `explain` says: the agent's authoritative answer with
    /// explain's addresses of that family (none: an empty NOERROR), or exactly the reply the upstream
    /// gives to the same question. Returns explain's verdict, for the caller to hold against the rules in `docs/`, and
    /// the reply to the question asked as an application asks it (`/etc/resolv.conf`).
    pub fn check_dig_with(
        &self,
        from: &str,
        name: &str,
        qtype: &str,
        tcp: bool,
    ) -> Result<(DnsVerdict, Reply)> {
        let mut first = None;
        for resolver in World::resolvers() {
            let got = self.check_dig_at(from, name, qtype, tcp, resolver)?;
            first.get_or_insert(got);
        }
        first.context("no resolver asked")
    }

    /// [`World::check_dig_with`] at one address of the resolver.
    pub fn check_dig_at(
        &self,
        from: &str,
        name: &str,
        qtype: &str,
        tcp: bool,
        resolver: Resolver,
    ) -> Result<(DnsVerdict, Reply)> {
        let absolute = format!("{}.", name.trim_end_matches('.'));
        let mut question = vec![absolute.as_str(), qtype];
        if tcp {
            question.push("+tcp");
        }
        let verdict = self.explain.host(from, &absolute)?;
        let before = self.agent.metrics()?;
        let reply = self.ask(from, &absolute, qtype, tcp, resolver)?;
        let after = self.agent.metrics()?;
        let what = format!(
            "{question:?} at {resolver:?} from {from}: {reply:#?}\nexplain: {}",
            verdict.json
        );
        ensure!(
            reply.server.starts_with(&resolver.server_prefix()),
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
                let upstream = if resolver.is_v4_mapped() {
                    self.ask_upstream_as_rdt_peer(&absolute, qtype, tcp)?
                } else {
                    self.dig_upstream_with(&question)?
                };
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

    /// The question from the client pod of `from`, at `resolver`: dig, or `rdt-peer dns` (a connected
    /// `AF_INET6` socket, or TCP) for a v4-mapped address, which dig refuses.
    fn ask(
        &self,
        from: &str,
        name: &str,
        qtype: &str,
        tcp: bool,
        resolver: Resolver,
    ) -> Result<Reply> {
        match resolver {
            Resolver::ResolvConf => dig::run(
                self.dig_cmd(from)
                    .args([name, qtype])
                    .args(tcp.then_some("+tcp")),
            ),
            Resolver::At(ip) if resolver.is_v4_mapped() => {
                let server = SocketAddr::new(ip, 53).to_string();
                let out = crate::peer::cmd(self.client(from).place())?
                    .args(["dns", &server, name, qtype])
                    .args(tcp.then_some("--tcp"))
                    .ok()?;
                dig::parse(&out.stdout_str()).with_context(|| format!("reading {out}"))
            }
            Resolver::At(ip) => dig::run(
                self.dig_cmd(from)
                    .arg(format!("@{ip}"))
                    .args([name, qtype])
                    .args(tcp.then_some("+tcp")),
            ),
        }
    }

    /// `rdt-peer dns` from the node netns straight to the upstream: the same client's query, so its
    /// reply is what a forwarded one must be.
    fn ask_upstream_as_rdt_peer(&self, name: &str, qtype: &str, tcp: bool) -> Result<Reply> {
        let out = crate::peer::cmd(self.topo.node())?
            .args(["dns", &format!("{RESOLVER_IP}:53"), name, qtype])
            .args(tcp.then_some("--tcp"))
            .ok()?;
        dig::parse(&out.stdout_str()).with_context(|| format!("reading {out}"))
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
            reply.answer.iter().all(|r| r.ttl == AGENT_TTL),
            "the agent's TTL is {AGENT_TTL}; {what}"
        );
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

    /// What a client of `from` gets connecting to `dest`, per explain: the server at the endpoint it
    /// names (a host-name endpoint resolved through the upstream), or a reset.
    pub fn expected_reach(&self, from: &str, dest: SocketAddr) -> Result<(OutboundVerdict, Reach)> {
        let verdict = self.explain.ip(from, dest)?;
        let reach = match verdict.action {
            OutboundOutcome::NoHealthyUpstream => Reach::Reset,
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
    /// (and the agent's outcome counter); for an IPv4 `dest` also `curl http://[::ffff:<ip>]/` (an
    /// `AF_INET6` socket), which must get the same. Returns the expectation for the caller to hold
    /// against the rules in `docs/`.
    pub fn check_connect(
        &self,
        from: &str,
        dest: impl Into<SocketAddr>,
    ) -> Result<(OutboundVerdict, Reach)> {
        let dest = dest.into();
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
        self.check_url(from, &url, SocketAddrV4::new(ip, port).into())
    }

    /// `curl -6 http://<host>:<port>/` from the client pod of `from`: glibc asks AAAA through the agent,
    /// then connects over IPv6. Checked like [`World::check_host`], against the first IPv6 address.
    pub fn check_host6(
        &self,
        from: &str,
        host: &str,
        port: u16,
    ) -> Result<(OutboundVerdict, Reach)> {
        let verdict = self.explain.host(from, host)?;
        let first_v6 = |addrs: &[IpAddr]| addrs.iter().copied().find(IpAddr::is_ipv6);
        let ip = match verdict.action {
            DnsAction::Answer => first_v6(&verdict.addresses),
            DnsAction::Forward => first_v6(
                &self
                    .dig_upstream_with(&[&verdict.query, "AAAA"])?
                    .addresses(),
            ),
        };
        let ip = ip
            .with_context(|| format!("no IPv6 address for {host} from {from}: {}", verdict.json))?;
        let dest = SocketAddr::new(ip, port);
        let (verdict, want) = self.expected_reach(from, dest)?;
        let url = format!("http://{host}:{port}/");
        self.check_one_url(from, &["-6"], &url, dest, &verdict, &want)?;
        Ok((verdict, want))
    }

    /// `url` (which leads to `dest`), then for an IPv4 `dest` the v4-mapped literal of it: each must
    /// reach what explain says, and where a server answers, `getpeername()` on a connection to the
    /// same address must return that address (not the gateway).
    fn check_url(
        &self,
        from: &str,
        url: &str,
        dest: SocketAddr,
    ) -> Result<(OutboundVerdict, Reach)> {
        let (verdict, want) = self.expected_reach(from, dest)?;
        self.check_one_url(from, &[], url, dest, &verdict, &want)?;
        if let SocketAddr::V4(v4) = dest {
            let mapped = SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port());
            let url = format!("http://{mapped}/");
            self.check_one_url(from, &[], &url, mapped, &verdict, &want)?;
        }
        Ok((verdict, want))
    }

    fn check_one_url(
        &self,
        from: &str,
        curl_args: &[&str],
        url: &str,
        connect_to: SocketAddr,
        verdict: &OutboundVerdict,
        want: &Reach,
    ) -> Result<()> {
        // With the fast path, what explain says the kernel decides never reaches the proxy: the
        // kernel's counter moves and the proxy's does not. A pod no manifest names is not in the
        // kernel's client table: the proxy decides for it.
        let in_kernel = self.agent.fast_path()
            && (verdict.decided_by == DecidedBy::Kernel || resolved_ahead(verdict, connect_to))
            && !self.is_stranger(from);
        let proxy_counter = key::outbound(&verdict.action);
        let counter = match in_kernel {
            true => key::fast_path(&verdict.action),
            false => proxy_counter.clone(),
        };
        let before = self.agent.metrics()?;
        let hides_logged = |log: &str| hides_logged(log, verdict.hidden.as_deref());
        let logged_before = hides_logged(&self.agent.log());
        let got = self.curl_with(from, curl_args, url)?;
        ensure!(
            &got == want,
            "curl {url} from {from}: got {got:?}, explain says {want:?} ({})",
            verdict.json
        );
        let mut connections = 1.0;
        if matches!(want, Reach::Server(_)) {
            let peer = self.getpeername(from, connect_to)?;
            ensure!(
                peer == connect_to.to_string(),
                "getpeername() on a connection to {connect_to} from {from} returned {peer}"
            );
            connections += 1.0;
        }
        // A hidden service is counted once per connection that skipped one, by the proxy or by
        // the kernel (whose count the agent adds to the proxy's every 100 ms).
        let hidden = if verdict.hidden.is_some() {
            connections
        } else {
            0.0
        };
        // The upstream connect (which counts it) may finish a moment after curl saw the reply.
        let after = self
            .agent
            .wait_metrics(
                &format!(
                    "{counter} +{connections} (from {}), hidden +{hidden} (from {})",
                    before.get_or_zero(&counter),
                    before.get_or_zero(key::HIDDEN_OUTBOUND)
                ),
                Duration::from_secs(2),
                |m| {
                    delta(&before, m, &counter) == connections
                        && delta(&before, m, key::HIDDEN_OUTBOUND) == hidden
                },
            )
            .with_context(|| format!("curl {url} from {from}; explain: {}", verdict.json))?;
        ensure!(
            !in_kernel || delta(&before, &after, &proxy_counter) == 0.0,
            "curl {url} from {from}: decided in the kernel, yet the proxy counted it: {after:#?}"
        );
        ensure!(
            delta(&before, &after, key::HIDDEN_OUTBOUND) == hidden,
            "curl {url} from {from}: a hidden service is counted once per connection that skipped one: \
             {after:#?}; explain: {}",
            verdict.json
        );
        // The clients are kubelet-style pods whose uids the manifests give: the check must agree.
        ensure!(
            delta(&before, &after, key::IDENTITY_MISMATCHES) == 0.0,
            "curl {url} from {from}: the agent doubted the client's identity: {after:#?}"
        );
        // At -v each hide is logged, by the proxy or (reported by the kernel) by the agent.
        if verdict.hidden.is_some() && self.agent.debug_log() {
            let want = logged_before + hidden as usize;
            let deadline = Instant::now() + crate::pace::scaled(Duration::from_secs(2));
            while hides_logged(&self.agent.log()) < want {
                ensure!(
                    Instant::now() < deadline,
                    "curl {url} from {from}: {hidden} hide(s) of {:?} not logged (\"service hidden from client\")",
                    verdict.hidden
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// What `getpeername()` returns in the client pod of `from` on a TCP connection to `addr`
    /// (`rdt-peer getpeername`, an `AF_INET6` socket for an IPv6 or v4-mapped address).
    pub fn getpeername(&self, from: &str, addr: SocketAddr) -> Result<String> {
        let out = crate::peer::cmd(self.client(from).place())?
            .args(["getpeername", &addr.to_string()])
            .ok()?;
        Ok(out.stdout_str().trim().to_string())
    }

    /// `curl` in the client pod of `from`: the server that answered, or [`Reach::Reset`] for a
    /// connection reset that came at once (within a second); any other failure is an error.
    pub fn curl(&self, from: &str, url: &str) -> Result<Reach> {
        self.curl_with(from, &[], url)
    }

    /// [`World::curl`] with extra curl options (`-6`).
    pub fn curl_with(&self, from: &str, args: &[&str], url: &str) -> Result<Reach> {
        let started = Instant::now();
        let out = self
            .client(from)
            .cmd("curl")
            .args(args)
            // -g: brackets are an IPv6 literal, not a glob.
            .args(["-gsSv", "--max-time", &crate::pace::scaled_secs(10), url])
            .output()?;
        let elapsed = started.elapsed();
        if out.success() {
            return Ok(Reach::Server(out.stdout_str().trim().to_string()));
        }
        // Depending on when the RST lands, curl fails connecting (7), sending (55) or receiving (56);
        // its verbose log names the cause every time.
        if out.stderr_str().contains("Connection reset by peer") {
            ensure!(
                elapsed < crate::pace::scaled(Duration::from_secs(1)),
                "reset, but only after {elapsed:?}: {out}"
            );
            return Ok(Reach::Reset);
        }
        bail!("curl {url} from {from} failed after {elapsed:?}: {out}")
    }

    /// `ip:port`, or `host:port` with `host` resolved through the upstream (as the agent does).
    fn endpoint_addr(&self, endpoint: &str) -> Result<SocketAddr> {
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
        Ok(SocketAddrV4::new(ip, port.parse()?).into())
    }

    fn server_at(&self, addr: SocketAddr) -> Result<String> {
        self.names
            .get(&addr)
            .cloned()
            .with_context(|| format!("no server of this world listens on {addr}"))
    }
}

/// Whether the agent's kernel rewrites a connection explain leaves to the proxy for its endpoint
/// host name: explain reads manifests only, while the agent resolves such names ahead, and the
/// world's upstream gives each of [`super::PUBLIC_DNS`] an IPv4 address (what an IPv4 socket is
/// rewritten to, v4-mapped included).
fn resolved_ahead(verdict: &OutboundVerdict, connect_to: SocketAddr) -> bool {
    let host = verdict
        .endpoint
        .as_deref()
        .and_then(|e| e.rsplit_once(':'))
        .map(|(host, _)| host);
    verdict.action.metric_label() == "service"
        && connect_to.ip().to_canonical().is_ipv4()
        && host.is_some_and(|h| super::PUBLIC_DNS.iter().any(|(name, _)| *name == h))
}

/// Debug log lines saying `service` was hidden from a client's connection.
fn hides_logged(log: &str, service: Option<&str>) -> usize {
    let Some(service) = service else { return 0 };
    let field = format!("service={service} ");
    log.lines()
        // A connection's (the DNS proxy logs its own hides without a destination).
        .filter(|l| {
            l.contains("service hidden from client")
                && l.contains(&field)
                && l.contains("orig_dst=")
        })
        .count()
}
