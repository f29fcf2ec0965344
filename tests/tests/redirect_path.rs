//! The redirect path (`docs/data-plane.md`).
//! A pod's TCP connection is caught in the kernel, handed to the agent with its original
//! destination, and delivered (passthrough). Real pods, real eBPF, real curl, the real agent binary.
//! Each test asserts the agent's counters moved (or did not), so a connection that was routed directly
//! instead of redirected fails the test.
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use integration::world::delta;
use integration::{Agent, NO_FAST_PATH, Peer, Topology, bpf, pace, pattern, peer};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");
const EXT_NAME: &str = "ext-203.0.113.10";
const EXT_HTTP: &str = "203.0.113.10:80";
const EXT_ECHO: &str = "203.0.113.10:7";

const PASSTHROUGH: &str = r#"redirect_outbound_connections_total{outcome="passthrough"}"#;
const OUTBOUND_ERRORS: &str = r#"redirect_outbound_connections_total{outcome="error"}"#;
const TCP_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="tcp_redirected"}"#;
const BYTES_SENT: &str = r#"redirect_outbound_bytes_total{direction="sent"}"#;
const BYTES_RECEIVED: &str = r#"redirect_outbound_bytes_total{direction="received"}"#;
const ACTIVE: &str = "redirect_active_connections";

/// Fields drop in order: the agent first, then the server, then the topology.
struct Setup {
    agent: Agent,
    _ext: Peer,
    topo: Topology,
}

fn setup(pods: &[(&str, &str)]) -> Result<Setup> {
    let topo = Topology::with_pods(pods)?;
    let ext = topo.start_ext_peer(EXT_NAME, &[EXT_HTTP.parse()?], &[EXT_ECHO.parse()?])?;
    let agent = Agent::start(&topo, &[NO_FAST_PATH])?;
    Ok(Setup {
        agent,
        _ext: ext,
        topo,
    })
}

fn curl(pod_or_node: integration::Cmd, url: &str) -> integration::Cmd {
    pod_or_node.args(["-sS", "--fail", "--max-time", &pace::scaled_secs(30), url])
}

#[test]
fn curl_from_a_pod_is_carried_by_the_agent() -> Result<()> {
    let s = setup(&[A1])?;
    let pod = s.topo.pod("team-a/a1");
    let before = s.agent.metrics()?;
    let body = curl(pod.cmd("curl"), "http://203.0.113.10/")
        .ok()?
        .stdout_str();
    assert_eq!(body, format!("{EXT_NAME}\n"));
    let after = s.agent.metrics()?;
    assert_eq!(
        delta(&before, &after, PASSTHROUGH),
        1.0,
        "the agent must have carried it: {after:#?}"
    );
    assert_eq!(delta(&before, &after, TCP_REDIRECTED), 1.0, "{after:#?}");
    // Carried, not routed: the server sees the agent's connection from the node, not the pod.
    let seen = curl(pod.cmd("curl"), "http://203.0.113.10/peer")
        .ok()?
        .stdout_str();
    assert!(
        !seen.starts_with(&format!("{}:", pod.ip)),
        "server saw the pod itself ({seen:?}): not redirected"
    );
    Ok(())
}

#[test]
fn sixty_four_mib_arrive_byte_identical_in_both_directions() -> Result<()> {
    const N: usize = 64 << 20;
    let s = setup(&[A1])?;
    let pod = s.topo.pod("team-a/a1");
    let expected = pattern::sha256_of_len(N as u64);
    let before = s.agent.metrics()?;

    let download = curl(pod.cmd("curl"), &format!("http://203.0.113.10/blob/{N}"))
        .timeout(Duration::from_secs(60))
        .ok()?;
    assert_eq!(download.stdout.len(), N);
    assert_eq!(
        pattern::sha256_hex(&download.stdout),
        expected,
        "download differs"
    );
    drop(download);

    let upload = s.topo.scratch_path("upload.bin");
    std::fs::write(&upload, pattern::bytes(N))?;
    let sum = pod
        .cmd("curl")
        .args([
            "-sS",
            "--fail",
            "--max-time",
            &pace::scaled_secs(60),
            "-X",
            "POST",
            "-T",
        ])
        .arg(&upload)
        .arg("http://203.0.113.10/sha256")
        .timeout(Duration::from_secs(60))
        .ok()?;
    assert_eq!(
        sum.stdout_str().trim(),
        expected,
        "upload differs (server's checksum)"
    );

    // Both directions at once on one connection, half-close included.
    let echo = peer::cmd(pod.place())?
        .args(["echo", EXT_ECHO, "--bytes", &N.to_string()])
        .timeout(Duration::from_secs(60))
        .ok()?;
    assert_eq!(
        echo.stdout_str(),
        format!("sent {N} {expected}\nreceived {N} {expected}\n")
    );

    let n = N as f64;
    let after = s.agent.wait_metrics(
        "the bytes of all three transfers",
        Duration::from_secs(5),
        |m| {
            delta(&before, m, BYTES_SENT) >= 2.0 * n && delta(&before, m, BYTES_RECEIVED) >= 2.0 * n
        },
    )?;
    assert_eq!(
        delta(&before, &after, PASSTHROUGH),
        3.0,
        "all three went through the proxy"
    );
    Ok(())
}

/// The agent's fd count at rest: the lowest of a few samples, since answering our own `/metrics`
/// scrape briefly holds one more.
fn settled_fd_count(agent: &Agent) -> Result<usize> {
    let mut lowest = usize::MAX;
    for _ in 0..5 {
        lowest = lowest.min(agent.fd_count()?);
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(lowest)
}

#[test]
fn two_hundred_concurrent_connections_from_two_pods_leave_nothing_behind() -> Result<()> {
    const PER_POD: usize = 100;
    let s = setup(&[A1, B1])?;
    // Warm up (first connection may allocate for good), then take the baseline.
    curl(s.topo.pod("team-a/a1").cmd("curl"), "http://203.0.113.10/").ok()?;
    let warm = s
        .agent
        .wait_metrics("no active connection", Duration::from_secs(5), |m| {
            m.get_or_zero(ACTIVE) == 0.0
        })?;
    let baseline_fds = settled_fd_count(&s.agent)?;

    let mut clients = Vec::new();
    for pod in s.topo.pods() {
        let c = peer::cmd(pod.place())?
            .args([
                "fanout",
                EXT_ECHO,
                "--conns",
                &PER_POD.to_string(),
                "--bytes",
                "65536",
                "--wait-stdin",
            ])
            .spawn()?;
        clients.push(c);
    }
    for c in &mut clients {
        c.wait_for_log(&format!("open {PER_POD}"), Duration::from_secs(30))?;
    }
    // All 200 open at the same time, each one proxied: accepted (active) and connected upstream
    // (passthrough is counted once the upstream connect succeeds, a moment after the accept).
    s.agent.wait_metrics(
        "200 active connections, all connected upstream",
        Duration::from_secs(10),
        |m| m.get_or_zero(ACTIVE) == 200.0 && delta(&warm, m, PASSTHROUGH) == 200.0,
    )?;
    let busy_fds = s.agent.fd_count()?;
    assert!(
        busy_fds >= baseline_fds + 400,
        "a client and an upstream socket per connection: {busy_fds} vs {baseline_fds}"
    );

    for c in &mut clients {
        c.write_stdin(b"go\n")?;
    }
    for c in &mut clients {
        let status = c.wait(Duration::from_secs(60))?;
        assert!(status.success(), "{} failed: {}", c.what(), c.log());
        assert!(
            c.log().contains(&format!("done ok={PER_POD} failed=0")),
            "{}",
            c.log()
        );
    }
    let done = s
        .agent
        .wait_metrics("no active connection", Duration::from_secs(10), |m| {
            m.get_or_zero(ACTIVE) == 0.0
        })?;
    assert_eq!(delta(&warm, &done, OUTBOUND_ERRORS), 0.0);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let fds = s.agent.fd_count()?;
        if fds <= baseline_fds {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "agent holds {fds} fds, {baseline_fds} before the burst"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[test]
fn getpeername_in_the_pod_returns_the_original_destination() -> Result<()> {
    let s = setup(&[A1])?;
    let pod = s.topo.pod("team-a/a1");
    let before = s.agent.metrics()?;
    let seen = peer::cmd(pod.place())?
        .args(["getpeername", EXT_ECHO])
        .ok()?
        .stdout_str();
    assert_eq!(
        seen.trim(),
        EXT_ECHO,
        "not the gateway {}",
        integration::GATEWAY
    );
    let after = s
        .agent
        .wait_metrics("the connection counted", Duration::from_secs(5), |m| {
            delta(&before, m, PASSTHROUGH) == 1.0
        })?;
    assert_eq!(
        delta(&before, &after, TCP_REDIRECTED),
        1.0,
        "it must have been redirected to mean anything"
    );
    Ok(())
}

/// More steered sockets than the programs' old per-socket map held (an LRU of 65,536 keyed by
/// socket cookie), all open at once.
const UDP_SOCKETS: usize = 70_000;

/// Descriptors one process of this run may hold, less a few for its own use.
fn sockets_per_process() -> Result<usize> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit, and `limit` is a valid, exclusively borrowed one.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    ensure!(
        read == 0,
        "getrlimit(RLIMIT_NOFILE): {}",
        std::io::Error::last_os_error()
    );
    Ok((limit.rlim_max as usize).saturating_sub(64).max(1))
}
const DNS_REDIRECTED: &str = r#"redirect_ebpf_events_total{event="dns_redirected"}"#;

/// What `rdt-peer peer-watch` printed, in order.
fn peers_seen(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.strip_prefix("peer "))
        .map(|p| p.trim().to_string())
        .collect()
}

#[test]
fn another_pods_many_udp_sockets_leave_a_connections_original_destination_alone() -> Result<()> {
    let s = setup(&[A1, B1])?;
    let mut watch = peer::cmd(s.topo.pod("team-a/a1").place())?
        .args(["peer-watch", EXT_ECHO])
        .spawn()?;
    watch.wait_for_log("peer ", Duration::from_secs(10))?;
    assert_eq!(peers_seen(&watch.log()), [EXT_ECHO], "before anything else");
    let before = s.agent.metrics()?;
    // Connected UDP sockets to a resolver: each connect() is steered and files its destination.
    // As many processes as the open-files limit needs to hold them all at once.
    let per_process = sockets_per_process()?;
    let mut floods = Vec::new();
    let mut asked = 0;
    while asked < UDP_SOCKETS {
        let count = per_process.min(UDP_SOCKETS - asked);
        asked += count;
        floods.push(
            peer::cmd(s.topo.pod("team-b/b1").place())?
                .args(["udp-connected", "10.96.0.10:53", "--count"])
                .arg(count.to_string())
                .spawn()?,
        );
    }
    let mut original = 0;
    for flood in &mut floods {
        flood.wait_for_log(" original=", Duration::from_secs(120))?;
        original += flood
            .log()
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("original="))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
    }
    // Each of them, read back at once, showed where it was connected.
    assert_eq!(original, UDP_SOCKETS, "sockets that showed their resolver");
    let after = s.agent.metrics()?;
    ensure!(
        delta(&before, &after, DNS_REDIRECTED) >= UDP_SOCKETS as f64,
        "every socket steered: {}",
        delta(&before, &after, DNS_REDIRECTED)
    );
    // The same connection of the other pod still shows where it went, not the gateway.
    watch.write_stdin(b"again\n")?;
    watch.close_stdin();
    watch.wait(Duration::from_secs(10))?;
    let seen = peers_seen(&watch.log());
    assert_eq!(
        seen,
        [EXT_ECHO, EXT_ECHO],
        "getpeername() after {UDP_SOCKETS} sockets of another pod (the gateway is {})",
        integration::GATEWAY
    );
    for mut flood in floods {
        flood.close_stdin();
        flood.wait(Duration::from_secs(30))?;
    }
    Ok(())
}

/// Entries in the programs' flow map (client address -> original destination), read from its pin.
fn flow_entries(topo: &Topology) -> Result<usize> {
    let path = topo.pin_dir().join("maps/FLOW_ORIG_DST");
    let out = topo
        .node_cmd("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&path)
        .ok()?
        .stdout_str();
    let entries: serde_json::Value = serde_json::from_str(&out)?;
    Ok(entries.as_array().map_or(0, Vec::len))
}

/// A connect() abandoned before its handshake never reaches the agent, so it must file nothing in
/// the flow map: otherwise one pod's abandoned attempts pile up there (an LRU map) and crowd out
/// the entries of other pods' connections waiting to be accepted.
#[test]
fn connections_abandoned_before_the_handshake_leave_nothing_in_the_flow_map() -> Result<()> {
    const ATTEMPTS: usize = 5_000;
    let s = setup(&[A1, B1])?;
    // The pod never hears the agent's SYN-ACK (its own netns drops it): every attempt is abandoned
    // before its handshake, however fast the agent answers.
    s.topo
        .pod("team-b/b1")
        .cmd("iptables")
        .args(["-A", "INPUT", "-p", "tcp", "--sport", "15001"])
        .args(["--tcp-flags", "SYN,ACK", "SYN,ACK", "-j", "DROP"])
        .ok()?;
    peer::cmd(s.topo.pod("team-b/b1").place())?
        .args(["abandon", EXT_HTTP, "--count", &ATTEMPTS.to_string()])
        .ok()?;
    // Connections that did complete are accepted (and their entries taken) as the agent gets to
    // them; what is left after that stays for good.
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    let mut left = flow_entries(&s.topo)?;
    while left > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        left = flow_entries(&s.topo)?;
    }
    // And the other pod is served as ever.
    let body = curl(s.topo.pod("team-a/a1").cmd("curl"), "http://203.0.113.10/")
        .ok()?
        .stdout_str();
    assert_eq!(body, format!("{EXT_NAME}\n"));
    eprintln!("{ATTEMPTS} abandoned connects: {left} flow entries left");
    ensure!(
        left == 0,
        "{left} entries of {ATTEMPTS} abandoned connects left in the flow map"
    );
    Ok(())
}

#[test]
fn the_node_and_the_agent_itself_are_not_redirected() -> Result<()> {
    let s = setup(&[A1])?;
    let before = s.agent.metrics()?;
    // In the node netns, outside the pods' cgroup: reaches the server directly.
    let body = curl(s.topo.node_cmd("curl"), "http://203.0.113.10/")
        .ok()?
        .stdout_str();
    assert_eq!(body, format!("{EXT_NAME}\n"));
    let after_node = s.agent.metrics()?;
    assert_eq!(
        delta(&before, &after_node, TCP_REDIRECTED),
        0.0,
        "{after_node:#?}"
    );
    assert_eq!(
        delta(&before, &after_node, PASSTHROUGH),
        0.0,
        "{after_node:#?}"
    );

    // One pod connection: exactly one redirect and one passthrough. Had the agent's own upstream
    // connect() been redirected too, it would come back to the proxy as a second connection.
    let body = curl(s.topo.pod("team-a/a1").cmd("curl"), "http://203.0.113.10/")
        .ok()?
        .stdout_str();
    assert_eq!(body, format!("{EXT_NAME}\n"));
    std::thread::sleep(Duration::from_millis(200)); // a looped connection would be counted by now
    let after_pod = s.agent.metrics()?;
    assert_eq!(
        delta(&after_node, &after_pod, TCP_REDIRECTED),
        1.0,
        "{after_pod:#?}"
    );
    assert_eq!(
        delta(&after_node, &after_pod, PASSTHROUGH),
        1.0,
        "{after_pod:#?}"
    );
    assert_eq!(
        delta(&after_node, &after_pod, OUTBOUND_ERRORS),
        0.0,
        "{after_pod:#?}"
    );
    Ok(())
}

#[test]
fn nothing_stays_attached_after_the_agent_exits_and_a_new_one_starts_cleanly() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let _ext = topo.start_ext_peer(EXT_NAME, &[EXT_HTTP.parse::<std::net::SocketAddr>()?], &[])?;
    let pod = topo.pod("team-a/a1");
    let peer_url = "http://203.0.113.10/peer";

    let agent = Agent::start(&topo, &[NO_FAST_PATH])?;
    let attached = bpf::attached_programs(topo.attach_cgroup())?;
    for hook in [
        "cgroup_inet4_connect",
        "cgroup_inet6_connect",
        "cgroup_sock_ops",
        "cgroup_inet4_getpeername",
        "cgroup_inet6_getpeername",
        "cgroup_udp6_sendmsg",
        "cgroup_udp6_recvmsg",
    ] {
        assert!(
            attached.iter().any(|a| a.attach_type == hook),
            "{hook} not attached: {attached:?}"
        );
    }
    agent.stop()?; // SIGTERM, exit status 0
    bpf::wait_detached(topo.attach_cgroup())?;
    // Back on the direct path: the server sees the pod itself.
    let seen = curl(pod.cmd("curl"), peer_url).ok()?.stdout_str();
    assert!(
        seen.starts_with(&format!("{}:", pod.ip)),
        "after the agent left, server saw {seen:?}"
    );

    // A second agent on the same cgroup: starts, carries traffic, and is killed outright.
    let again = Agent::start(&topo, &[NO_FAST_PATH])?;
    let seen = curl(pod.cmd("curl"), peer_url).ok()?.stdout_str();
    assert!(
        !seen.starts_with(&format!("{}:", pod.ip)),
        "the new agent must carry it, server saw {seen:?}"
    );
    assert_eq!(again.metrics()?.get_or_zero(PASSTHROUGH), 1.0);
    let pinned = bpf::attached_programs(topo.attach_cgroup())?;
    again.kill()?; // SIGKILL: the pinned links stay (fail closed) for the next agent to adopt
    assert_eq!(bpf::attached_programs(topo.attach_cgroup())?, pinned);

    // And a third one after a crash starts cleanly too, in the same links (never a second set).
    let third = Agent::start(&topo, &[NO_FAST_PATH])?;
    assert_eq!(
        curl(pod.cmd("curl"), "http://203.0.113.10/")
            .ok()?
            .stdout_str(),
        format!("{EXT_NAME}\n")
    );
    assert_eq!(third.metrics()?.get_or_zero(PASSTHROUGH), 1.0);
    assert_eq!(
        bpf::attached_programs(topo.attach_cgroup())?.len(),
        pinned.len()
    );
    third.stop()?;
    bpf::wait_detached(topo.attach_cgroup())?;
    Ok(())
}

/// A hostNetwork pod sits in the pods' cgroup tree but in the node's netns: the programs recognise the
/// node's netns (its cookie, set at load) and leave its sockets alone.
#[test]
fn a_host_network_process_inside_the_pods_cgroup_is_not_redirected() -> Result<()> {
    let s = setup(&[A1])?;
    let node = s.topo.node();
    let host_network_pod = integration::Place {
        label: "hostNetwork pod".into(),
        netns: node.netns.clone(),
        cgroup: s.topo.pod("team-a/a1").cgroup().to_path_buf(),
        resolv_conf: None,
        log_dir: node.log_dir.clone(),
    };
    let before = s.agent.metrics()?;
    let body = curl(host_network_pod.cmd("curl"), "http://203.0.113.10/")
        .ok()?
        .stdout_str();
    assert_eq!(body, format!("{EXT_NAME}\n"));
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, TCP_REDIRECTED), 0.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 0.0, "{after:#?}");
    assert_eq!(
        delta(
            &before,
            &after,
            r#"redirect_ebpf_events_total{event="skipped_node_netns"}"#
        ),
        1.0,
        "the programs saw the connect and skipped it: {after:#?}"
    );
    Ok(())
}
