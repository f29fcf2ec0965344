//! The harness itself, with no agent: the topology routes, pods sit in their cgroups, the servers and the
//! resolver answer, and nothing is left behind (after a drop, a panic, or a run that died).
use std::net::SocketAddr;

use anyhow::{Context, Result, ensure};
use integration::{DnsRecords, ECHO_PORT, HTTP_PORT, Topology, bpf, cgroup, pattern, peer, run};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn direct_path_from_pods_to_ext_without_nat() -> Result<()> {
    let topo = Topology::with_pods(&[A1, B1])?;
    let _ext = topo.start_ext_peer("ext-203.0.113.10", &[addr("203.0.113.10:80")], &[])?;
    for pod in topo.pods() {
        let body = pod
            .cmd("curl")
            .args(["-sS", "--max-time", "5", "http://203.0.113.10/"])
            .ok()?
            .stdout_str();
        assert_eq!(body, "ext-203.0.113.10\n", "from {}", pod.key());
        // Routed, not NATed: the server sees the pod's own address.
        let seen = pod
            .cmd("curl")
            .args(["-sS", "--max-time", "5", "http://203.0.113.10/peer"])
            .ok()?
            .stdout_str();
        assert!(
            seen.starts_with(&format!("{}:", pod.ip)),
            "server saw {seen:?} for {}",
            pod.key()
        );
    }
    // The node itself reaches ext too (from its end of the link).
    let seen = topo
        .node_cmd("curl")
        .args(["-sS", "--max-time", "5", "http://203.0.113.10/peer"])
        .ok()?
        .stdout_str();
    assert!(
        seen.starts_with(&format!("{}:", integration::NODE_EXT_IP)),
        "node seen as {seen:?}"
    );
    Ok(())
}

#[test]
fn pod_commands_run_in_the_pod_cgroup_netns_and_resolv_conf() -> Result<()> {
    let real_resolv = std::fs::read("/etc/resolv.conf")?;
    let topo = Topology::with_pods(&[A1])?;
    let pod = topo.pod("team-a/a1");
    let cg = pod.cmd("cat").arg("/proc/self/cgroup").ok()?.stdout_str();
    let rel = pod.cgroup().strip_prefix(topo.cgroup2())?;
    assert!(
        cg.lines().any(|l| l == format!("0::/{}", rel.display())),
        "cgroup of a pod process: {cg}"
    );
    let addrs = pod
        .cmd("ip")
        .args(["-4", "-o", "addr", "show", "dev", "eth0"])
        .ok()?
        .stdout_str();
    assert!(addrs.contains("10.244.1.10/32"), "{addrs}");
    let resolv = pod.cmd("cat").arg("/etc/resolv.conf").ok()?.stdout_str();
    assert_eq!(
        resolv,
        "nameserver 198.51.100.53\nsearch team-a.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
    );
    assert_eq!(
        std::fs::read("/etc/resolv.conf")?,
        real_resolv,
        "the machine's resolv.conf must not change"
    );
    // /sys was not remounted: the cgroup2 tree (and our own cgroup in it) is visible from the pod.
    pod.cmd("test").arg("-d").arg(pod.cgroup()).ok()?;
    // Node commands sit outside the pods' cgroup.
    let node_cg = topo
        .node_cmd("cat")
        .arg("/proc/self/cgroup")
        .ok()?
        .stdout_str();
    let pods_rel = topo.attach_cgroup().strip_prefix(topo.cgroup2())?;
    assert!(
        !node_cg.contains(&pods_rel.display().to_string()),
        "node process in {node_cg}"
    );
    Ok(())
}

#[test]
fn a_connect4_program_on_the_attach_cgroup_sees_pods_and_not_the_node() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let _ext = topo.start_ext_peer("ext", &[addr("203.0.113.10:80")], &[])?;
    let curl = |cmd: integration::Cmd| {
        cmd.args(["-sS", "--max-time", "5", "http://203.0.113.10/"])
            .output()
    };
    assert!(bpf::attached_programs(topo.attach_cgroup())?.is_empty());

    let link = bpf::attach_connect4_verdict(topo.attach_cgroup(), false)?;
    let attached = bpf::attached_programs(topo.attach_cgroup())?;
    assert_eq!(attached.len(), 1, "{attached:?}");
    assert_eq!(attached[0].attach_type, "cgroup_inet4_connect");
    let refused = curl(topo.pod("team-a/a1").cmd("curl"))?;
    assert!(
        !refused.success(),
        "a pod's connect() must hit the program: {refused}"
    );
    assert!(
        curl(topo.node_cmd("curl"))?.success(),
        "the node is outside the attach cgroup"
    );

    drop(link);
    // A child forked by a parallel test holds a copy of the fd until it execs (O_CLOEXEC): allow a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !bpf::attached_programs(topo.attach_cgroup())?.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "closing the link must detach the program"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let ok = curl(topo.pod("team-a/a1").cmd("curl"))?;
    assert!(ok.success(), "{ok}");
    Ok(())
}

#[test]
fn echo_and_getpeername_on_the_direct_path() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let echo = addr("203.0.113.20:7");
    assert_eq!(echo.port(), ECHO_PORT);
    let _ext = topo.start_ext_peer("echo", &[], &[echo])?;
    let pod = topo.pod("team-a/a1");
    let n: u64 = 3 << 20;
    let out = peer::cmd(pod.place())?
        .args(["echo", &echo.to_string(), "--bytes", &n.to_string()])
        .ok()?;
    let expected = pattern::sha256_of_len(n);
    assert_eq!(
        out.stdout_str(),
        format!("sent {n} {expected}\nreceived {n} {expected}\n")
    );
    let peer_name = peer::cmd(pod.place())?
        .args(["getpeername", &echo.to_string()])
        .ok()?
        .stdout_str();
    assert_eq!(peer_name.trim(), echo.to_string());
    Ok(())
}

#[test]
fn dnsmasq_answers_pods_and_stops_and_starts() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let _ext = topo.start_ext_peer(
        "api-upstream",
        &[SocketAddr::new("203.0.113.10".parse()?, HTTP_PORT)],
        &[],
    )?;
    let mut dns = topo.start_dnsmasq(
        integration::RESOLVER_IP,
        DnsRecords::new().host("api.example.com", "203.0.113.10".parse()?),
    )?;
    let pod = topo.pod("team-a/a1");
    let dig = |name: &str| pod.cmd("dig").args(["+time=1", "+tries=1", name]).output();
    let ok = dig("api.example.com")?;
    assert!(ok.stdout_str().contains("status: NOERROR"), "{ok}");
    let short = pod
        .cmd("dig")
        .args(["+short", "api.example.com"])
        .ok()?
        .stdout_str();
    assert_eq!(short, "203.0.113.10\n");
    let missing = dig("nothing-here.example.com")?;
    assert!(
        missing.stdout_str().contains("status: NXDOMAIN"),
        "{missing}"
    );
    // glibc (curl) resolves through the pod's resolv.conf: search domains first (ndots:5), then the name.
    let body = pod
        .cmd("curl")
        .args(["-sS", "--max-time", "5", "http://api.example.com/"])
        .ok()?
        .stdout_str();
    assert_eq!(body, "api-upstream\n");
    assert!(
        dns.log()
            .contains("api.example.com.team-a.svc.cluster.local"),
        "search list used:\n{}",
        dns.log()
    );

    dns.stop()?;
    let down = dig("api.example.com")?;
    assert!(
        !down.success() && down.stdout_str().contains("no servers could be reached"),
        "dnsmasq stopped: {down}"
    );
    dns.start_again()?;
    assert_eq!(
        pod.cmd("dig")
            .args(["+short", "api.example.com"])
            .ok()?
            .stdout_str(),
        "203.0.113.10\n"
    );
    Ok(())
}

#[test]
fn dropping_the_topology_removes_everything_even_when_panicking() -> Result<()> {
    let cgroup2 = cgroup::cgroup2_mount()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(|| {
        let topo = Topology::with_pods(&[A1, B1]).unwrap();
        let _ext = topo
            .start_ext_peer("ext", &[addr("203.0.113.10:80")], &[addr("203.0.113.10:7")])
            .unwrap();
        let sleeper = topo
            .pod("team-b/b1")
            .cmd("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        // Leak the guard: only the topology's drop is left to stop it.
        let pid = sleeper.pid();
        std::mem::forget(sleeper);
        tx.send((topo.id().clone(), pid)).unwrap();
        panic!("a test failing with everything up");
    });
    assert!(result.is_err());
    let (id, pid) = rx.recv()?;
    let left = run::leftovers(&id, &cgroup2);
    assert!(left.is_empty(), "left behind: {left:?}");
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Killed; a zombie at most, since the leaked guard never reaped it.
    assert!(
        state.is_empty() || state.contains(") Z "),
        "process {pid} survived: {state}"
    );
    Ok(())
}

#[test]
fn a_new_run_sweeps_what_a_dead_run_left() -> Result<()> {
    let cgroup2 = cgroup::cgroup2_mount()?;
    // A stand-in owner we can kill, so the fake run is "alive" while we build its leftovers.
    let mut owner = std::process::Command::new("sleep").arg("1000").spawn()?;
    let dead = run::RunId::generate();
    let state = dead.state_dir();
    std::fs::create_dir_all(&state)?;
    let owner_rec = run::Owner {
        pid: owner.id(),
        start_time: integration::procfs::start_time(owner.id())?.context("owner")?,
    };
    std::fs::write(state.join("owner"), owner_rec.to_record())?;
    let ns = format!("{}-node", dead.tag());
    integration::netns::add(&ns)?;
    let pod_cg = dead.cgroup_dir(&cgroup2).join("pods").join("team-a_a1");
    std::fs::create_dir_all(&pod_cg)?;
    let place = integration::Place {
        label: "leftover".into(),
        netns: ns.clone(),
        cgroup: pod_cg,
        resolv_conf: None,
        log_dir: state.join("logs"),
    };
    let mut orphan = place.cmd("sleep").arg("1000").spawn()?;
    ensure!(orphan.is_running());
    owner.kill()?;
    owner.wait()?;

    let live = Topology::new()?;
    let fresh = Topology::new()?; // sweeps again: must not touch `live`, whose owner (us) is alive
    let left = run::leftovers(&dead, &cgroup2);
    assert!(left.is_empty(), "not swept: {left:?}");
    assert!(
        !orphan.is_running(),
        "the dead run's process must be killed"
    );
    assert!(
        run::leftovers(live.id(), &cgroup2).len() >= 3,
        "a live run was swept"
    );
    drop((live, fresh));
    Ok(())
}

#[test]
fn the_peer_serves_blobs_and_checksums_uploads() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let _ext = topo.start_ext_peer("ext", &[addr("203.0.113.10:80")], &[])?;
    let pod = topo.pod("team-a/a1");
    let n = 1_000_003;
    let blob = pod
        .cmd("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            &format!("http://203.0.113.10/blob/{n}"),
        ])
        .ok()?;
    assert_eq!(blob.stdout, pattern::bytes(n));
    let upload = topo.scratch_path("upload.bin");
    std::fs::write(&upload, pattern::bytes(n))?;
    let sum = pod
        .cmd("curl")
        .args(["-sS", "--max-time", "10", "-X", "POST", "-T"])
        .arg(&upload)
        .arg("http://203.0.113.10/sha256")
        .ok()?;
    assert_eq!(sum.stdout_str().trim(), pattern::sha256_of_len(n as u64));
    Ok(())
}

#[test]
fn a_held_connection_keeps_exchanging_until_dropped() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let echo = addr("203.0.113.20:7");
    let _ext = topo.start_ext_peer("echo", &[], &[echo])?;
    let pod = topo.pod("team-a/a1");
    let mut hold = peer::cmd(pod.place())?
        .args(["hold", &echo.to_string(), "--interval-ms", "20"])
        .spawn()?;
    hold.wait_for_log("ok 5", std::time::Duration::from_secs(10))?;
    assert!(hold.is_running(), "{}", hold.log());
    let bounded = peer::cmd(pod.place())?
        .args([
            "hold",
            &echo.to_string(),
            "--interval-ms",
            "1",
            "--count",
            "3",
        ])
        .ok()?;
    assert!(
        bounded.stdout_str().ends_with("ok 0\nok 1\nok 2\n"),
        "{bounded}"
    );
    Ok(())
}

#[test]
fn a_server_that_cannot_bind_fails_to_start() -> Result<()> {
    let topo = Topology::new()?;
    let _first = topo.start_ext_peer("first", &[addr("203.0.113.10:80")], &[])?;
    // The address is listening (by `first`), but not by this process: the start must fail.
    let second = topo.start_ext_peer("second", &[addr("203.0.113.10:80")], &[]);
    let err = format!(
        "{:#}",
        second
            .err()
            .context("a second server on a taken address started")?
    );
    assert!(
        err.contains("Address already in use") || err.contains("exited"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_command_that_overruns_its_timeout_is_killed_with_its_children() -> Result<()> {
    let topo = Topology::with_pods(&[A1])?;
    let started = std::time::Instant::now();
    // The background sleep inherits stdout: unless it dies too, reading the output never ends.
    let err = topo
        .pod("team-a/a1")
        .cmd("sh")
        .args(["-c", "sleep 30 & echo started; sleep 30"])
        .timeout(std::time::Duration::from_millis(300))
        .output()
        .err()
        .context("a 30 s command finished within 300 ms")?;
    assert!(format!("{err:#}").contains("timed out"), "{err:#}");
    assert!(
        format!("{err:#}").contains("started"),
        "partial output is kept: {err:#}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    Ok(())
}
