//! A node whose `--bpffs` is not on a bpf filesystem (as `/sys/fs/bpf` is a plain directory on some
//! machines) still gets the hand-over: the agent mounts one at the pin directory's parent when it may,
//! and the successor adopts the pins there. Where it may not, it says what a rollout costs, at WARN,
//! in `/config_dump` and in `redirect_handover_available`.
//!
//! The agents run in a private mount namespace of the test's own (held by a `sleep`), so the mount
//! never reaches the machine's, and goes with that namespace.
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::{Agent, DnsRecords, RESOLVER_IP, Topology, fixtures, peer};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");

struct World {
    config: String,
    upstream: String,
    /// The pin directory, on no bpf filesystem.
    pins: std::path::PathBuf,
    /// The process holding the private mount namespace the agents run in.
    holder: integration::Proc,
    _servers: (integration::Peer, integration::Peer),
    _dns: integration::Dnsmasq,
    topo: Topology,
}

fn world() -> Result<World> {
    let topo = Topology::with_pods(&[A1, B1])?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let config = format!(
        "{}---\n{}---\n{}",
        fixtures::team_a_api(),
        fixtures::pod(A1.0, "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a61", A1.1, "{}"),
        fixtures::pod(B1.0, "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a62", B1.1, "{}"),
    );
    std::fs::write(dir.join("mesh.yaml"), config)?;
    let servers = fixtures::start_api_servers(&topo)?;
    let dns = topo.start_dnsmasq(
        RESOLVER_IP,
        DnsRecords::new().host("api.example.com", "203.0.113.10".parse()?),
    )?;
    let mut holder = topo
        .node_cmd("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg("echo private; exec sleep 600")
        .spawn()?;
    holder.wait_for_log("private", Duration::from_secs(5))?;
    // A tmpfs directory: no bpf filesystem there.
    let pins = topo.scratch_path("no-bpffs").join("redirect");
    Ok(World {
        config: dir.display().to_string(),
        upstream: format!("{RESOLVER_IP}:53"),
        pins,
        holder,
        _servers: servers,
        _dns: dns,
        topo,
    })
}

impl World {
    fn args(&self) -> [&str; 4] {
        ["--config", &self.config, "--dns-upstream", &self.upstream]
    }

    /// `nsenter -t HOLDER -m --` plus `more`: the agent in the private mount namespace.
    fn wrapper(&self, more: &[&str]) -> Vec<String> {
        let mut w: Vec<String> = ["nsenter", "-t", &self.holder.pid().to_string(), "-m", "--"]
            .map(String::from)
            .to_vec();
        w.extend(more.iter().map(|s| s.to_string()));
        w
    }

    /// Whether a bpf filesystem is mounted at the pin directory's parent in `pid`'s mount namespace.
    fn mounted_in(&self, pid: &str) -> Result<bool> {
        let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
        let parent = self.pins.parent().context("pin dir parent")?;
        let at = format!(" {} ", parent.display());
        Ok(info
            .lines()
            .any(|l| l.contains(&at) && l.contains(" - bpf ")))
    }
}

fn handover_dump(agent: &Agent) -> Result<serde_json::Value> {
    let r = agent.admin_get("/config_dump")?;
    ensure!(r.status == 200, "/config_dump: {}", r.status);
    let dump: serde_json::Value = serde_json::from_str(&r.text())?;
    Ok(dump["handover"].clone())
}

#[test]
fn without_a_bpf_filesystem_the_agent_mounts_one_and_hands_over_through_it() -> Result<()> {
    let w = world()?;
    ensure!(
        !w.mounted_in("self")?,
        "the machine has a bpffs there already"
    );
    let wrapper = w.wrapper(&[]);
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let old = Agent::launch_wrapped(&w.topo, &wrapper, &w.pins, &w.args())?;
    assert!(
        old.log()
            .contains("mounted a bpf filesystem for the pinned programs"),
        "{}",
        old.log()
    );
    let dump = handover_dump(&old)?;
    assert_eq!(dump["available"], true, "{dump}");
    assert_eq!(
        dump["mounted"].as_str(),
        w.pins.parent().and_then(|p| p.to_str()),
        "{dump}"
    );
    assert_eq!(
        old.metrics()?.get_or_zero("redirect_handover_available"),
        1.0
    );
    ensure!(
        w.mounted_in(&w.holder.pid().to_string())?,
        "no bpffs in the agents' mount namespace"
    );
    ensure!(
        !w.mounted_in("self")?,
        "the mount reached the machine's own mount namespace"
    );

    let pod = w.topo.pod(A1.0);
    let mut mix = peer::cmd(pod.place())?
        .args(["mix", "--rate", "300", "--workers", "8"])
        .args(["--http", "203.0.113.10:80=team-a-api"])
        .args(["--dns", &format!("{RESOLVER_IP}:53=api.example.com")])
        .spawn()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;
    std::thread::sleep(Duration::from_secs(1));
    let new = Agent::start_successor_wrapped(&w.topo, &wrapper, &w.pins, &w.args())?;
    assert!(new.log().contains("start=Adopted"), "{}", new.log());
    old.terminate_async();
    old.wait_exit(Duration::from_secs(40))?;
    std::thread::sleep(Duration::from_millis(500));
    let report = peer::stop_mix(mix)?;
    eprintln!(
        "hand-over on the mounted bpffs: {} ok, {} failed",
        report.ok, report.failed
    );
    assert_eq!(report.failed, 0, "{}", report.text);
    assert!(report.ok > 0);
    assert_eq!(
        fixtures::curl_body(pod, fixtures::API_URL)?,
        fixtures::API_ENDPOINT_BODY
    );
    new.stop()?;
    ensure!(
        !w.mounted_in("self")?,
        "the mount reached the machine's own mount namespace"
    );
    Ok(())
}

#[test]
fn an_agent_that_may_not_mount_says_what_rollouts_cost() -> Result<()> {
    let w = world()?;
    // Root without CAP_SYS_ADMIN, as in a container granted BPF and NET_ADMIN only.
    let wrapper = w.wrapper(&["setpriv", "--bounding-set", "-sys_admin", "--"]);
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let agent = Agent::launch_wrapped(&w.topo, &wrapper, &w.pins, &w.args())?;
    let log = agent.log();
    let warn = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("no hand-over"))
        .with_context(|| format!("no warning:\n{log}"))?;
    eprintln!("{warn}");
    assert!(
        warn.contains("CAP_SYS_ADMIN") && warn.contains("connection the agent proxies is reset"),
        "{warn}"
    );
    let dump = handover_dump(&agent)?;
    assert_eq!(dump["available"], false, "{dump}");
    assert!(
        dump["unavailable"]
            .as_str()
            .is_some_and(|s| s.contains("rollout") && s.contains("deploy/README.md")),
        "{dump}"
    );
    assert_eq!(
        agent.metrics()?.get_or_zero("redirect_handover_available"),
        0.0
    );
    // It serves all the same.
    assert_eq!(
        fixtures::curl_body(w.topo.pod(A1.0), fixtures::API_URL)?,
        fixtures::API_ENDPOINT_BODY
    );
    agent.stop()?;
    Ok(())
}

#[test]
fn the_daemonsets_init_step_mounts_the_bpf_filesystem_the_agent_then_pins_on() -> Result<()> {
    let w = world()?;
    let bin = Agent::bin()?;
    let mut init = w.wrapper(&[]);
    init.push(bin.display().to_string());
    init.extend([
        "mount-bpffs".to_string(),
        format!("--bpffs={}", w.pins.display()),
    ]);
    let out = w.topo.node_cmd(&init[0]).args(&init[1..]).ok()?;
    assert!(
        out.stdout_str().contains("mounted a bpf filesystem at"),
        "{out}"
    );
    ensure!(w.mounted_in(&w.holder.pid().to_string())?, "{out}");
    ensure!(!w.mounted_in("self")?, "the mount reached the machine's");
    // Run again it finds the mount and leaves it.
    let again = w.topo.node_cmd(&init[0]).args(&init[1..]).ok()?;
    assert!(
        again.stdout_str().contains("on a bpf filesystem already"),
        "{again}"
    );
    // The agent pins there without mounting anything itself.
    let wrapper = w.wrapper(&[]);
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let agent = Agent::launch_wrapped(&w.topo, &wrapper, &w.pins, &w.args())?;
    assert!(
        !agent.log().contains("mounted a bpf filesystem"),
        "{}",
        agent.log()
    );
    assert_eq!(handover_dump(&agent)?["available"], true);
    agent.stop()?;
    Ok(())
}
