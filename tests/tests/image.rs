//! What a user installs is what runs here: the agent's image (`cargo xtask image`), run by podman the
//! way `deploy/manifests/30-daemonset.yaml` runs it (its arguments, capabilities, mounts and security
//! settings read from the manifest; see `integration::container`), in the test node's netns, watching
//! a test API server. Through it: visibility from two namespaces with real dig and curl, and a
//! rollout as the DaemonSet does it under a loop of new connections and DNS queries.
//!
//! Skipped, saying so, only where podman cannot run (`cargo xtask setup` installs it).
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use integration::container::{self, DaemonSetContainer, Edit, Image};
use integration::world::{Reach, Resolver, World};
use integration::{Agent, RESOLVER_IP, Topology, apiserver::ApiServer, bpf, peer};

/// The image to run, or None (and why, printed) where no container runtime is installed.
fn image() -> Result<Option<Image>> {
    integration::require_root()?;
    if let Err(why) = container::runtime_available() {
        eprintln!("SKIPPED: the image suite needs a container runtime: {why:#}");
        return Ok(None);
    }
    let image = Image::from_env();
    container::require_image(&image.tag)?;
    Ok(Some(image))
}

/// The arguments naming this run's cluster: its API server and DNS upstream.
fn source_args(kubeconfig: &str) -> Vec<String> {
    [
        "--kube",
        "--kubeconfig",
        kubeconfig,
        "--dns-upstream",
        &format!("{RESOLVER_IP}:53"),
    ]
    .map(String::from)
    .to_vec()
}

/// A client loop in the client pod of `from`: new connections to `http` (address = the server that
/// must answer, from explain) and DNS queries for `names`, until stopped.
fn start_mix(w: &World, from: &str, http: &[&str], names: &[&str]) -> Result<integration::Proc> {
    let mut cmd =
        peer::cmd(w.client(from).place())?.args(["mix", "--rate", "300", "--workers", "8"]);
    for addr in http {
        let dest = addr.parse()?;
        let (_, reach) = w.expected_reach(from, dest)?;
        let Reach::Server(name) = reach else {
            anyhow::bail!("{from} -> {addr}: explain expects a reset, the loop wants a server");
        };
        cmd = cmd.args(["--http", &format!("{addr}={name}")]);
    }
    for name in names {
        cmd = cmd.args(["--dns", &format!("{RESOLVER_IP}:53={name}")]);
    }
    let mut mix = cmd.spawn()?;
    mix.wait_for_log("started", Duration::from_secs(10))?;
    Ok(mix)
}

#[test]
fn the_image_run_as_the_daemonset_runs_it_serves_each_namespace_its_view_and_rolls_out_without_a_failure()
-> Result<()> {
    let Some(image) = image()? else {
        return Ok(());
    };
    let mut w = World::start_kube_image(&image)?;
    // The DaemonSet's init step from the same image: the bpf filesystem is there, it leaves it.
    let init = container::run_init(&w.topo, &image.tag)?;
    assert!(init.contains("on a bpf filesystem already"), "{init}");
    let ds = DaemonSetContainer::from_manifest()?;
    eprintln!(
        "running {} with --cap-drop {:?} --cap-add {:?}",
        image.tag, ds.cap_drop, ds.cap_add
    );

    // Visibility, dig and curl from two namespaces: team-a's entry is answered in team-a only;
    // team-b gets the public answer and reaches the real host.
    // The DaemonSet gives the IPv4 gateway only: the pods ask the resolver's IPv4 address, over UDP
    // and TCP.
    for tcp in [false, true] {
        let (_, reply) =
            w.check_dig_at("team-a", "api.example.com", "A", tcp, Resolver::ResolvConf)?;
        assert_eq!(
            reply.a_records(),
            ["203.0.113.10".parse::<std::net::Ipv4Addr>()?]
        );
        let (_, reply) =
            w.check_dig_at("team-b", "api.example.com", "A", tcp, Resolver::ResolvConf)?;
        assert_eq!(
            reply.a_records(),
            ["203.0.113.110".parse::<std::net::Ipv4Addr>()?]
        );
    }
    let (_, got) = w.check_host("team-a", "api.example.com", 80)?;
    assert_eq!(got, Reach::server("api-endpoint"));
    let (_, got) = w.check_host("team-b", "api.example.com", 80)?;
    assert_eq!(got, Reach::server("public-api"));
    // The entry's address itself: its endpoint for team-a, the real host for team-b.
    let (_, got) = w.check_connect("team-b", "203.0.113.10:80".parse::<std::net::SocketAddr>()?)?;
    assert_eq!(got, Reach::server("real-203.0.113.10"));

    // The rollout: the surge container starts beside the old one, takes its sockets over the
    // shared hand-over directory and swaps its programs into the pins on the shared bpffs; then
    // the old one is stopped (SIGTERM, it drains), under new connections and queries from both.
    let before = bpf::one_set_attached(w.topo.attach_cgroup())?;
    let names = ["api.example.com", "httpbin.example.com"];
    let mix_a = start_mix(
        &w,
        "team-a",
        &["203.0.113.10:80", "198.51.100.80:80"],
        &names,
    )?;
    let mix_b = start_mix(
        &w,
        "team-b",
        &["203.0.113.10:80", "198.51.100.80:80"],
        &names,
    )?;
    std::thread::sleep(Duration::from_secs(1));
    let kubeconfig = w.kubeconfig().display().to_string();
    let args = source_args(&kubeconfig);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let new = Agent::start_successor_image(&w.topo, &image, &args)?;
    let handover = started.elapsed();
    if let Some(line) = new
        .log()
        .lines()
        .find(|l| l.contains("configuration in force"))
    {
        eprintln!("successor: {line}");
    }
    let old = std::mem::replace(&mut w.agent, new);
    old.terminate_async();
    let old_log = old.wait_exit(Duration::from_secs(ds.termination_grace_secs))?;
    std::thread::sleep(Duration::from_secs(1));
    let a = peer::stop_mix(mix_a)?;
    let b = peer::stop_mix(mix_b)?;
    eprintln!(
        "hand-over between containers: {handover:?} (successor start to ready); team-a loop {} ok {} failed, team-b loop {} ok {} failed",
        a.ok, a.failed, b.ok, b.failed
    );
    let logs = format!(
        "---- old agent\n{old_log}\n---- new agent\n{}",
        w.agent.log()
    );
    assert_eq!(
        a.failed, 0,
        "team-a failures during the rollout:\n{}\n{logs}",
        a.text
    );
    assert_eq!(
        b.failed, 0,
        "team-b failures during the rollout:\n{}\n{logs}",
        b.text
    );
    assert!(a.ok > 0 && b.ok > 0, "the loops did nothing");
    assert!(
        old_log.contains("handed over to a successor"),
        "the old container's agent did not hand over:\n{old_log}"
    );

    // One set of programs, the successor's, and it serves both views.
    let after = bpf::one_set_attached(w.topo.attach_cgroup())?;
    assert_ne!(
        before, after,
        "the successor's programs must be the attached ones"
    );
    // Each view still holds, and the successor's kernel counters follow what its programs
    // rewrite. (Not through `check_host`: its kernel hide count can come a second late right after
    // a hand-over between containers; see docs/known-gaps.md.)
    let rewritten = r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#;
    let before = w.agent.metrics()?;
    assert_eq!(
        w.curl("team-a", "http://api.example.com/")?,
        Reach::server("api-endpoint")
    );
    w.agent
        .wait_metrics("the rewrite counted", Duration::from_secs(2), |m| {
            integration::world::delta(&before, m, rewritten) == 1.0
        })?;
    assert_eq!(
        w.curl("team-b", "http://api.example.com/")?,
        Reach::server("public-api")
    );
    Ok(())
}

/// Capabilities the DaemonSet adds for a feature the agent starts without (deploy/README.md):
/// `SYS_PTRACE` opens a non-root Pod's network namespace to check its inbound authorization there.
const FOR_A_FEATURE: [&str; 1] = ["SYS_PTRACE"];

#[test]
fn the_image_does_not_start_without_any_one_of_the_daemonsets_added_capabilities() -> Result<()> {
    let Some(image) = image()? else {
        return Ok(());
    };
    let ds = DaemonSetContainer::from_manifest()?;
    ensure!(!ds.cap_add.is_empty(), "the DaemonSet adds no capability");
    let topo = Topology::new()?;
    let api = ApiServer::start(&topo.node().netns)?;
    let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
    let args = source_args(&kubeconfig.display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for cap in FOR_A_FEATURE {
        ensure!(
            ds.cap_add.iter().any(|c| c == cap),
            "{cap} is no longer added: drop it from FOR_A_FEATURE"
        );
    }
    for cap in ds
        .cap_add
        .iter()
        .filter(|c| !FOR_A_FEATURE.contains(&c.as_str()))
    {
        let without = Image {
            edit: Edit {
                without_caps: vec![cap.clone()],
            },
            ..image.clone()
        };
        let err = match Agent::launch_image(&topo, &without, &args) {
            Ok(agent) => {
                agent.stop()?;
                anyhow::bail!("the agent ran without {cap}: the DaemonSet need not add it");
            }
            Err(e) => format!("{e:#}"),
        };
        let refused = err
            .lines()
            .find(|l| l.contains("error:"))
            .with_context(|| {
                format!("without {cap} the agent failed without saying why:\n{err}")
            })?;
        eprintln!("without {cap}: {refused}");
        assert!(
            err.contains("eBPF") || err.contains("Operation not permitted"),
            "without {cap}: {err}"
        );
    }
    Ok(())
}
