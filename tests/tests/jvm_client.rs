//! A real JVM client, the kind the IPv6 hooks are for. Without `-Djava.net.preferIPv4Stack` a JVM
//! opens its TCP sockets as `AF_INET6` and reaches an IPv4 address through its v4-mapped form.
//! Checked by hand in a team-a pod of this world, `strace -f -e trace=socket,connect java -cp DIR
//! Fetch http://api.example.com/` shows glibc asking DNS from an `AF_INET` socket (`connect4`'s) and
//! the HTTP connection made from an `AF_INET6` one (`connect6`'s):
//!
//! ```text
//! socket(AF_INET, SOCK_DGRAM|SOCK_CLOEXEC|SOCK_NONBLOCK, IPPROTO_IP) = 4
//! connect(4, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("198.51.100.53")}, 16) = 0
//! socket(AF_INET6, SOCK_STREAM, IPPROTO_IP) = 4
//! connect(4, {sa_family=AF_INET6, sin6_port=htons(80), ..., inet_pton(AF_INET6, "::ffff:203.0.113.10",
//!         &sin6_addr), sin6_scope_id=0}, 28) = -1 EINPROGRESS (Operation now in progress)
//! ```
//!
//! With `connect6` detached from the pods' cgroup (as before the IPv6 hooks), the JVM went straight
//! to the real 203.0.113.10 from team-a, and this test failed on its first fetch.
//!
//! `tests/java/Fetch.java`, compiled with `javac` once per run into the run's state directory,
//! resolves the name with the JVM's own resolver (InetAddress: glibc and the pod's resolv.conf, so
//! through the agent) and fetches it with `HttpURLConnection`. It prints the resolved addresses, the
//! body, and its socket as the kernel lists it. Every expectation comes from `redirect explain`, as
//! in `visibility.rs`.
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use integration::explain::{DnsAction, OutboundOutcome, OutboundVerdict};
use integration::world::{Reach, World, delta, key};
use integration::{GATEWAY, Launch};
// The agent's outbound proxy port (the harness runs the default), where `connect6` sends a
// v4-mapped destination, on the IPv4 gateway.
use redirect_common::PROXY_PORT;

const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/java/Fetch.java");
/// Generous for a JVM starting on two shared cores, still bounded.
const JVM_TIMEOUT: Duration = Duration::from_secs(90);
const TCP_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="tcp_redirected"}"#;
const OUTBOUND_ERRORS: &str = r#"redirect_outbound_connections_total{outcome="error"}"#;

/// What one run of `Fetch` printed.
#[derive(Debug)]
struct Fetched {
    resolved: Vec<IpAddr>,
    /// (family, the socket's peer in the kernel's table) for each TCP socket open during the fetch.
    sockets: Vec<(String, SocketAddr)>,
    status: u16,
    body: String,
}

impl Fetched {
    fn parse(text: &str) -> Result<Fetched> {
        let mut got = Fetched {
            resolved: Vec::new(),
            sockets: Vec::new(),
            status: 0,
            body: String::new(),
        };
        for line in text.lines() {
            let (what, value) = line.split_once(' ').unwrap_or((line, ""));
            match what {
                "resolved" => got
                    .resolved
                    .push(value.parse().context("resolved address")?),
                "socket" => {
                    let (family, peer) = value.split_once(' ').context("socket line")?;
                    got.sockets
                        .push((family.to_string(), peer.parse().context("socket peer")?));
                }
                "status" => got.status = value.parse().context("status")?,
                "body" => got.body = value.to_string(),
                _ => bail!("unexpected line {line:?}"),
            }
        }
        Ok(got)
    }
}

/// Both `java` and `javac` on PATH.
fn jdk_present() -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["java", "javac"]
        .iter()
        .all(|tool| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
}

/// `javac` into the run's state directory; the directory to put on the class path.
fn compile(w: &World) -> Result<PathBuf> {
    let classes = w.topo.scratch_path("java");
    std::fs::create_dir_all(&classes).with_context(|| format!("creating {}", classes.display()))?;
    w.topo
        .node_cmd("javac")
        .args(["-d".as_ref(), classes.as_os_str(), SOURCE.as_ref()])
        .timeout(JVM_TIMEOUT)
        .ok()?;
    Ok(classes)
}

/// `java Fetch url` in the client pod of `from`, with the JVM's defaults for sockets and DNS.
fn fetch(w: &World, classes: &Path, from: &str, url: &str) -> Result<Fetched> {
    let out = w
        .client(from)
        .cmd("java")
        // Startup only: one GC thread, no C2 compiler, no shared perf file in /tmp.
        .args([
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
        ])
        .arg("-cp")
        .arg(classes)
        .args(["Fetch", url])
        .timeout(JVM_TIMEOUT)
        .ok()?;
    Fetched::parse(&out.stdout_str()).with_context(|| format!("reading {out}"))
}

/// Fetches `url` from the client pod of `from`, which leads to `dest`: the server explain names must
/// answer, over an `AF_INET6` socket that the kernel shows connected to the v4-mapped gateway, and
/// the agent's counters must move as for curl (the outcome explain says, once; a hidden service
/// counted once; no identity doubt). Returns what the JVM printed.
fn check_fetch(
    w: &World,
    classes: &Path,
    from: &str,
    url: &str,
    dest: SocketAddr,
) -> Result<(OutboundVerdict, Fetched)> {
    let (verdict, want) = w.expected_reach(from, dest)?;
    let Reach::Server(server) = want else {
        bail!(
            "{url} from {from}: covers reachable destinations only; explain: {}",
            verdict.json
        );
    };
    let counter = key::outbound(&verdict.action);
    let before = w.agent.metrics()?;
    let got = fetch(w, classes, from, url)?;
    let what = format!(
        "java Fetch {url} from {from}: {got:#?}\nexplain: {}",
        verdict.json
    );
    ensure!(
        (got.status, got.body.as_str()) == (200, server.as_str()),
        "explain says {server} answers; {what}"
    );
    let gateway = SocketAddr::new(GATEWAY.to_ipv6_mapped().into(), PROXY_PORT);
    ensure!(
        got.sockets == [("AF_INET6".to_string(), gateway)],
        "one AF_INET6 socket, connected (in the kernel) to the agent at the v4-mapped gateway \
         (an AF_INET one means the JVM was told to prefer IPv4: JAVA_TOOL_OPTIONS?); {what}"
    );
    let after = w
        .agent
        .wait_metrics(&format!("{counter} +1"), Duration::from_secs(5), |m| {
            delta(&before, m, &counter) == 1.0
        })
        .with_context(|| what.clone())?;
    let hidden = if verdict.hidden.is_some() { 1.0 } else { 0.0 };
    for (key, want) in [
        (TCP_REDIRECTED, 1.0),
        (key::HIDDEN_OUTBOUND, hidden),
        (key::IDENTITY_MISMATCHES, 0.0),
        (OUTBOUND_ERRORS, 0.0),
    ] {
        ensure!(
            delta(&before, &after, key) == want,
            "{key} must move by {want}: {after:#?}\n{what}"
        );
    }
    Ok((verdict, got))
}

/// The JVM resolves `host` through the agent and reaches what explain says: the addresses of the
/// entry it may see (the agent answered every question), or the upstream's (every question forwarded).
/// IPv4 first, as the JVM orders them by default, and that is the one it connects to.
fn check_fetch_host(
    w: &World,
    classes: &Path,
    from: &str,
    host: &str,
) -> Result<(DnsAction, OutboundVerdict)> {
    let (dns, first) = w.expected_address(from, host)?;
    let mut want: Vec<IpAddr> = match dns.action {
        DnsAction::Answer => dns.addresses.clone(),
        DnsAction::Forward => w
            .dig_upstream_with(&[&dns.query, "A"])?
            .addresses()
            .into_iter()
            .chain(w.dig_upstream_with(&[&dns.query, "AAAA"])?.addresses())
            .collect(),
    };
    want.sort();
    let before = w.agent.metrics()?;
    let url = format!("http://{host}/");
    let (outbound, got) = check_fetch(w, classes, from, &url, SocketAddr::new(first.into(), 80))?;
    let after = w.agent.metrics()?;
    let what = format!(
        "java Fetch {url} from {from}: {got:#?}\nexplain: {}",
        dns.json
    );
    ensure!(
        got.resolved.first() == Some(&IpAddr::V4(first)),
        "the JVM lists IPv4 first: {first} (explain); {what}"
    );
    let mut resolved = got.resolved.clone();
    resolved.sort();
    ensure!(resolved == want, "resolved {want:?} expected; {what}");
    let (answered, forwarded) = (
        delta(&before, &after, key::DNS_ANSWERED),
        delta(&before, &after, key::DNS_FORWARDED),
    );
    let as_explain_says = match dns.action {
        DnsAction::Answer => answered >= 1.0 && forwarded == 0.0,
        DnsAction::Forward => forwarded >= 1.0 && answered == 0.0,
    };
    ensure!(
        as_explain_says,
        "the agent {:?} the JVM's questions? answered {answered}, forwarded {forwarded}; {what}",
        dns.action
    );
    Ok((dns.action, outbound))
}

/// team-a's NAMESPACE entry for `api.example.com`, from a JVM: team-a resolves the entry's address
/// and reaches its endpoint; team-b resolves the real address and reaches the real host, through the
/// agent as passthrough. The literal address the entry claims: the same split, with no DNS at all.
#[test]
fn a_jvm_client_sees_a_namespace_entry_only_in_its_namespace() -> Result<()> {
    if !jdk_present() {
        ensure!(
            std::env::var_os("CI").is_none(),
            "java and javac are missing on CI: `cargo xtask setup` installs default-jdk-headless"
        );
        // Straight to stderr, past the test harness's capture: a skip must be seen.
        let _ = writeln!(
            std::io::stderr(),
            "jvm_client: SKIPPED: java or javac is not on PATH (`sudo cargo xtask setup` installs them)"
        );
        return Ok(());
    }
    let w = World::start_launched(&Launch::no_fast_path())?;
    let classes = compile(&w)?;

    // By name. explain is pinned to the rule as visibility.rs pins it.
    let (dns, outbound) = check_fetch_host(&w, &classes, "team-a", "api.example.com")?;
    assert_eq!(dns, DnsAction::Answer);
    assert_eq!(
        outbound.action,
        OutboundOutcome::Service,
        "{}",
        outbound.json
    );
    assert_eq!(outbound.service.as_deref(), Some("team-a/api-example"));
    let (dns, outbound) = check_fetch_host(&w, &classes, "team-b", "api.example.com")?;
    assert_eq!(dns, DnsAction::Forward);
    assert_eq!(
        outbound.action,
        OutboundOutcome::Passthrough,
        "{}",
        outbound.json
    );
    assert_eq!(outbound.hidden, None, "the real address is nobody's");

    // The literal address team-a's entry claims: no DNS question at all.
    let dest: SocketAddr = "203.0.113.10:80".parse()?;
    for (from, action) in [
        ("team-a", OutboundOutcome::Service),
        ("team-b", OutboundOutcome::Passthrough),
    ] {
        let before = w.agent.metrics()?;
        let (outbound, got) = check_fetch(&w, &classes, from, "http://203.0.113.10/", dest)?;
        let after = w.agent.metrics()?;
        assert_eq!(outbound.action, action, "{}", outbound.json);
        if action == OutboundOutcome::Passthrough {
            assert_eq!(outbound.hidden.as_deref(), Some("team-a/api-example"));
        }
        assert_eq!(got.resolved, [dest.ip()], "{got:#?}");
        for key in [key::DNS_ANSWERED, key::DNS_FORWARDED] {
            assert_eq!(delta(&before, &after, key), 0.0, "{key}: {after:#?}");
        }
    }
    Ok(())
}
