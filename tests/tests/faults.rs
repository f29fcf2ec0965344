//! No fault turns enforcement off or blocks the node by accident (`docs/handover.md#faults`): a
//! start-up that fails after the programs are attached detaches them, a SIGTERM during start-up is
//! an ordinary stop, and a bpf filesystem lost under a running agent changes nothing while it runs.
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use integration::fixtures::{self, API_ENDPOINT_BODY, API_URL};
use integration::world::{delta, replace_file};
use integration::{Agent, Peer, Topology, bpf, pace};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;

/// Fields drop in order: the servers, then the topology.
struct World {
    config_dir: String,
    _servers: (Peer, Peer),
    topo: Topology,
}

fn world() -> Result<World> {
    let topo = Topology::with_pods(&[A1])?;
    let servers = fixtures::start_api_servers(&topo)?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let a1 = fixtures::pod(A1.0, "0a1a1a1a-0000-4000-8000-0000000000a1", A1.1, "{}");
    replace_file(
        &dir,
        "mesh.yaml",
        &format!("{}---\n{a1}", fixtures::team_a_api()),
    )?;
    Ok(World {
        config_dir: dir.display().to_string(),
        _servers: servers,
        topo,
    })
}

fn attached(topo: &Topology) -> Result<usize> {
    Ok(bpf::attached_programs(topo.attach_cgroup())?.len())
}

/// Links pinned in the run's pin directory (none once everything was removed).
fn pinned_links(topo: &Topology) -> usize {
    std::fs::read_dir(topo.pin_dir().join("links")).map_or(0, |d| d.count())
}

/// The hand-over socket cannot be made (here a directory sits at its path, as a read-only root
/// filesystem would refuse it): the error comes after the programs are attached, and the agent
/// must not leave them attached with nobody serving.
#[test]
fn a_start_up_error_after_attaching_detaches_everything() -> Result<()> {
    let w = world()?;
    std::fs::create_dir_all(w.topo.handover_socket())?;
    let agent = Agent::spawn(&w.topo, &["--config", &w.config_dir])?;
    let (status, log) = agent.wait_any_exit(Duration::from_secs(20))?;
    ensure!(
        !status.success(),
        "the agent must fail to start; log:\n{log}"
    );
    ensure!(
        log.contains("eBPF programs attached"),
        "the error must come after attaching, or this tests nothing; log:\n{log}"
    );
    assert_eq!(attached(&w.topo)?, 0, "programs left attached; log:\n{log}");
    assert_eq!(pinned_links(&w.topo), 0, "links left pinned; log:\n{log}");
    Ok(())
}

/// SIGTERM at any moment of the start-up: the agent leaves nothing attached. Before, a signal
/// between attaching and installing the handler killed it with the links pinned.
#[test]
fn sigterm_during_start_up_leaves_nothing_attached() -> Result<()> {
    let w = world()?;
    let mut tries = Vec::new();
    for delay_ms in (15..=120).step_by(5) {
        let agent = Agent::spawn(&w.topo, &["--config", &w.config_dir])?;
        std::thread::sleep(Duration::from_millis(delay_ms));
        agent.terminate_async();
        let (status, log) = agent.wait_any_exit(Duration::from_secs(20))?;
        let left = attached(&w.topo)?;
        tries.push((delay_ms, status.code(), left));
        ensure!(
            left == 0 && pinned_links(&w.topo) == 0,
            "SIGTERM {delay_ms} ms after start left {left} programs attached (exit {status}); tries {tries:?}; log:\n{log}"
        );
    }
    eprintln!("(delay ms, exit code, programs left): {tries:?}");
    Ok(())
}

/// The bpf filesystem unmounted under a running agent: its pins are gone, but the agent holds its
/// links, so pods are still steered and visibility still applies; it says so, and on SIGTERM it
/// still detaches what it holds.
#[test]
fn a_lost_bpf_filesystem_changes_nothing_while_the_agent_runs() -> Result<()> {
    let w = world()?;
    let agent = Agent::start(&w.topo, &["--config", &w.config_dir])?;
    let bpffs = w.topo.id().bpffs_dir();
    let target = std::ffi::CString::new(bpffs.as_os_str().as_encoded_bytes())?;
    // SAFETY: a NUL-terminated path that outlives the call (the run's own bpf filesystem).
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    ensure!(
        rc == 0,
        "unmounting {}: {}",
        bpffs.display(),
        std::io::Error::last_os_error()
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(attached(&w.topo)?, 9, "the links went with their pins");

    let before = agent.metrics()?;
    let body = fixtures::curl_body(w.topo.pod("team-a/a1"), API_URL)?;
    assert_eq!(body, API_ENDPOINT_BODY, "team-a still gets its own entry");
    let after = agent.metrics()?;
    assert_eq!(
        delta(&before, &after, SERVICE),
        1.0,
        "carried by the agent: {after:#?}"
    );

    let deadline = Instant::now() + pace::scaled(Duration::from_secs(5));
    while !agent.log().contains("the pinned links are gone") {
        ensure!(
            Instant::now() < deadline,
            "the agent never said so; log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.stop()?;
    assert_eq!(attached(&w.topo)?, 0, "SIGTERM detaches the links it held");
    Ok(())
}

/// Program ids on the pods' cgroup, sorted.
fn program_ids(topo: &Topology) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = bpf::attached_programs(topo.attach_cgroup())?
        .iter()
        .map(|a| a.prog_id)
        .collect();
    ids.sort_unstable();
    Ok(ids)
}

/// A successor takes the sockets, starts putting its programs into the pinned links, and dies
/// before it says it is ready: the old agent, which serves on, puts its own programs back. So its
/// SIGTERM later detaches everything, rather than leave the dead successor's programs attached
/// because they are not its own.
#[test]
fn an_old_agent_whose_successor_died_takes_its_links_back() -> Result<()> {
    let w = world()?;
    let args = ["--config", w.config_dir.as_str()];
    let old = Agent::start(&w.topo, &args)?;
    let ours = program_ids(&w.topo)?;
    ensure!(ours.len() == 9, "{ours:?}");

    let successor = Agent::spawn(&w.topo, &args)?;
    // Killed at the first link it swaps: mid-way through attaching, long before "ready".
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(20));
    loop {
        if program_ids(&w.topo)? != ours {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the successor never swapped a link; its log:\n{}",
            successor.log()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    successor.kill()?;

    let deadline = Instant::now() + pace::scaled(Duration::from_secs(5));
    while program_ids(&w.topo)? != ours {
        ensure!(
            Instant::now() < deadline,
            "the old agent did not take its links back: {:?} (ours {ours:?}); log:\n{}",
            program_ids(&w.topo)?,
            old.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // It still serves, with its own programs.
    let before = old.metrics()?;
    assert_eq!(
        fixtures::curl_body(w.topo.pod("team-a/a1"), API_URL)?,
        API_ENDPOINT_BODY
    );
    let after = old.metrics()?;
    assert_eq!(delta(&before, &after, SERVICE), 1.0, "{after:#?}");
    old.stop()?;
    assert_eq!(attached(&w.topo)?, 0, "SIGTERM detaches everything");
    Ok(())
}
