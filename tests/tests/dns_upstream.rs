//! `docs/dns.md#upstream-failure`.
//! The upstream resolver goes away and comes back. Names the agent forwards get SERVFAIL
//! within two seconds (never a hang), over UDP and TCP, whether the upstream refuses (dnsmasq stopped:
//! the port is closed) or stays silent (its address gone: packets vanish); the names the agent answers
//! itself keep working; once the upstream is back its answers resume. And many queries in flight at
//! once from two pods, under the same ids, each get their own answer. And an answer with a TTL is
//! asked upstream once, then served from the agent's cache, never in place of the mesh's own answer.
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::explain::DnsAction;
use integration::world::{self, LASTING_DNS, PUBLIC_DNS, World, delta, key};
use integration::{Launch, RESOLVER_IP, dig, netns, pace, peer};

/// `docs/dns.md#upstream-failure`: SERVFAIL within 2 s of the query.
const SERVFAIL_DEADLINE: Duration = Duration::from_secs(2);

/// Asks `name` from team-b once, with a client timeout well past the deadline, over UDP or TCP, and
/// requires SERVFAIL in time. Returns how long it took.
fn servfail(w: &World, name: &str, tcp: bool) -> Result<Duration> {
    let mut cmd = w
        .client("team-b")
        .cmd("dig")
        .args(["+tries=1", "+time=5", name]);
    if tcp {
        cmd = cmd.arg("+tcp");
    }
    let reply = dig::run(cmd)?;
    let how = if tcp { "TCP" } else { "UDP" };
    ensure!(reply.status == "SERVFAIL", "{how} {name}: {reply:#?}");
    ensure!(
        reply.server.starts_with(&format!("{RESOLVER_IP}#53")),
        "{how}: the SERVFAIL must appear to come from the resolver the pod asked: {reply:#?}"
    );
    // Timed by dig itself, from the query to the reply: starting dig is not the resolver's time.
    let took = reply
        .query_time
        .with_context(|| format!("{how} {name}: dig printed no query time: {reply:#?}"))?;
    ensure!(
        took < SERVFAIL_DEADLINE,
        "{how} {name}: SERVFAIL only after {took:?}"
    );
    Ok(took)
}

#[test]
fn upstream_down_gives_servfail_within_two_seconds_and_answers_resume() -> Result<()> {
    let mut w = World::start_launched(&Launch::no_fast_path())?;
    let name = "login.example.com";
    // A forwarded name (the NONE entry's), per explain; and one the agent answers.
    let (v, up) = w.check_dig("team-b", name)?;
    assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
    assert_eq!(up.status, "NOERROR");
    let (v, _) = w.check_dig("team-b", "metrics.example.com")?;
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);

    let before = w.agent.metrics()?;
    w.upstream.stop()?;
    for tcp in [false, true] {
        let took = servfail(&w, name, tcp)?;
        eprintln!("upstream stopped: SERVFAIL (tcp={tcp}) after {took:?}");
    }
    // The agent's own answers need no upstream.
    let (v, _) = w.check_dig("team-b", "metrics.example.com")?;
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);

    // Silent: the resolver's address leaves ext and what is sent to it is dropped without an ICMP.
    let ext = w.topo.ext().netns.clone();
    let resolver = format!("{RESOLVER_IP}/32");
    netns::ip(&["-n", &ext, "addr", "del", &resolver, "dev", "lo"])?;
    netns::ip(&["-n", &ext, "route", "add", "blackhole", &resolver])?;
    for tcp in [false, true] {
        let took = servfail(&w, name, tcp)?;
        eprintln!("upstream silent: SERVFAIL (tcp={tcp}) after {took:?}");
    }
    netns::ip(&["-n", &ext, "route", "del", "blackhole", &resolver])?;
    netns::ip(&["-n", &ext, "addr", "add", &resolver, "dev", "lo"])?;

    let after = w.agent.metrics()?;
    assert_eq!(delta(&before, &after, key::DNS_SERVFAIL), 4.0, "{after:#?}");
    assert!(w.agent.is_running(), "the agent must survive its upstream");

    // Back: the very next query gets the upstream's answer again, exactly.
    w.upstream.start_again()?;
    let (v, reply) = w.check_dig("team-b", name)?;
    assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
    assert_eq!(reply.content(), up.content());
    Ok(())
}

/// Two pods each keep 200 queries in flight at once, under the same ids 0..200 but asking different
/// names under each id. The agent forwards them all over its shared upstream sockets: every reply
/// reaches the pod that asked, under the id it used, with the answer to its own question.
#[test]
fn many_queries_in_flight_from_two_pods_each_get_their_own_answer() -> Result<()> {
    // 200 in flight fit in each pod's default share of forwards (256), whatever the open-files limit.
    let w = World::start_launched(&Launch::no_fast_path())?;
    let pods = ["team-a", "team-b"];
    // The names the upstream holds that both pods' queries are forwarded for, per explain.
    let mut expect = Vec::new();
    for (name, ip) in PUBLIC_DNS {
        let forwarded = pods.iter().try_fold(true, |all, pod| {
            Ok::<_, anyhow::Error>(all && w.explain().host(pod, name)?.action == DnsAction::Forward)
        })?;
        if forwarded {
            expect.push(format!("--expect={name}.={ip}"));
        }
    }
    ensure!(
        expect.len() >= 2,
        "too few forwarded names to tell answers apart: {expect:?}"
    );
    let before = w.agent.metrics()?;
    let server = format!("{RESOLVER_IP}:53");
    let bursts = pods
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            peer::cmd(w.client(pod).place())?
                .args([
                    "dns-burst",
                    &server,
                    "--count",
                    "200",
                    "--offset",
                    &i.to_string(),
                ])
                .args(&expect)
                .spawn()
        })
        .collect::<Result<Vec<_>>>()?;
    for (mut burst, pod) in bursts.into_iter().zip(pods) {
        let status = burst.wait(pace::scaled(Duration::from_secs(20)))?;
        let log = burst.log();
        ensure!(status.success(), "{pod}: {log}");
        ensure!(
            log.contains("sent=200 answered=200 wrong=0 missing=0"),
            "{pod}: {log}"
        );
    }
    let after = w.agent.metrics()?;
    assert_eq!(
        delta(&before, &after, key::DNS_FORWARDED),
        400.0,
        "{after:#?}"
    );
    assert_eq!(delta(&before, &after, key::DNS_SERVFAIL), 0.0, "{after:#?}");
    Ok(())
}

/// How many queries for `name` (type A) reached dnsmasq, from its query log.
fn upstream_asked(w: &World, name: &str) -> usize {
    w.upstream
        .log()
        .matches(&format!("query[A] {name} from"))
        .count()
}

/// `dig +nocookie` from `pod`: a stub resolver's query (glibc and musl send no EDNS options; a
/// query with options, as dig's cookie, is never answered from the cache).
fn dig_plain(w: &World, pod: &str, name: &str) -> Result<dig::Reply> {
    dig::run(
        w.client(pod)
            .cmd("dig")
            .args(["+nocookie", "+tries=1", name]),
    )
}

/// `docs/dns.md#answer-cache`: a forwarded answer with a TTL goes upstream once; the next askers,
/// from any namespace, get it from the agent with its TTL counting down; a query with EDNS options
/// still goes upstream; and a service that starts owning the name answers at once, the cached
/// upstream answer notwithstanding.
#[test]
fn an_upstream_answer_with_a_ttl_is_asked_once_and_never_hides_the_meshs_own_answer() -> Result<()>
{
    let w = World::start_launched(&Launch::no_fast_path())?;
    let (name, ip, ttl) = LASTING_DNS[0];
    let want: std::net::Ipv4Addr = ip.parse()?;
    let before = w.agent.metrics()?;
    let first = dig_plain(&w, "team-b", name)?;
    ensure!(first.a_records() == [want], "{first:#?}");
    ensure!(
        first.answer[0].ttl == ttl,
        "the first answer is the upstream's own: {first:#?}"
    );
    std::thread::sleep(Duration::from_millis(1_100));
    for pod in ["team-b", "team-a", "team-c"] {
        let again = dig_plain(&w, pod, name)?;
        ensure!(again.a_records() == [want], "{pod}: {again:#?}");
        ensure!(
            (1..30).contains(&again.answer[0].ttl),
            "{pod}: a cached answer's TTL is capped at 30 s and counts down: {again:#?}"
        );
    }
    ensure!(
        upstream_asked(&w, name) == 1,
        "four asks, one upstream query:\n{}",
        w.upstream.log()
    );
    let after = w.agent.metrics()?;
    assert_eq!(
        delta(&before, &after, key::DNS_FORWARDED),
        1.0,
        "{after:#?}"
    );
    assert_eq!(delta(&before, &after, key::DNS_CACHED), 3.0, "{after:#?}");
    assert_eq!(
        after.get_or_zero("redirect_dns_cache_entries"),
        1.0,
        "{after:#?}"
    );

    // dig's own query carries a cookie: it goes upstream.
    let cookie = dig::run(w.client("team-b").cmd("dig").args(["+tries=1", name]))?;
    ensure!(cookie.a_records() == [want], "{cookie:#?}");
    ensure!(upstream_asked(&w, name) == 2, "{}", w.upstream.log());

    // team-b's own entry now claims the name: team-b gets the mesh's address at once, while
    // team-a still gets the upstream's (from the cache).
    let mesh_ip = "203.0.113.171";
    let entry = format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: stable\n  namespace: team-b\n\
         spec:\n  hosts: [{name}]\n  addresses: [{mesh_ip}]\n  ports:\n    - {{number: 80, name: http}}\n\
         \x20 resolution: STATIC\n  endpoints:\n    - address: 198.51.100.20\n"
    );
    let before = w.agent.metrics()?;
    world::replace_file(w.config_dir(), "90-stable.yaml", &entry)?;
    w.agent.wait_metrics(
        "the new entry loaded",
        pace::scaled(Duration::from_secs(5)),
        |m| delta(&before, m, key::RELOAD_OK) >= 1.0,
    )?;
    let own = dig_plain(&w, "team-b", name)?;
    ensure!(
        own.a_records() == [mesh_ip.parse::<std::net::Ipv4Addr>()?],
        "{own:#?}"
    );
    ensure!(own.has_flag("aa"), "the agent's own answer: {own:#?}");
    let other = dig_plain(&w, "team-a", name)?;
    ensure!(other.a_records() == [want], "{other:#?}");
    ensure!(upstream_asked(&w, name) == 2, "{}", w.upstream.log());
    Ok(())
}
