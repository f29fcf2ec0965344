//! `cargo xtask bench [--quick]`: what the redirect and the proxy cost, side by side with the direct
//! path, in one run on one machine. Writes BENCHMARKS.md and docs/benchmarks.png and prints the table.
//!
//! Order: build (the agent, the harness's `rdt-peer`), then in a fresh netns topology ([`scene`]) the
//! agent with the config at size once (a big cluster's beside the bench's: what it holds and takes,
//! [`synthetic::cluster_files`]), the measuring rounds ([`rounds`]; the fast path at size among
//! their paths) and the agent's memory with a 10,000-entry config, then the criterion benches (built
//! with the same embedded eBPF object, so the agent binary stays whole); last the report. The
//! topology is removed when the scene drops, also on error.
//!
//! `cargo xtask profile` ([`profile`]) runs the same scene under perf instead of measuring. xtask
//! builds what is measured and calls [`bench`] or [`profile`]; this crate does the rest.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};

mod authz;
mod between_nodes;
mod chart;
pub mod cmd;
mod control;
mod dnsperf;
mod iperf;
mod kube;
mod machine;
mod model;
mod profile;
mod report;
mod rounds;
mod scene;
mod sockperf;
mod stats;
pub mod synthetic;
mod targets;
mod verify;
mod wrk;

/// Short runs: under 5 minutes once built.
const QUICK: rounds::Settings = rounds::Settings {
    rounds: 3,
    secs: 1,
    wrk_conns: 64,
};
/// The numbers to commit: under 20 minutes.
const FULL: rounds::Settings = rounds::Settings {
    rounds: 5,
    secs: 4,
    wrk_conns: 64,
};
const CHART: &str = "docs/benchmarks.png";
/// `--authz-only`: connections `conn-timer` makes one after another, per way and round.
const AUTHZ_TIMER_FULL: u32 = 5000;
const AUTHZ_TIMER_QUICK: u32 = 500;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// 3 rounds of 1 s runs and criterion's --quick (a few minutes) instead of 5 rounds of 4 s.
    #[arg(long)]
    quick: bool,
    /// Pin the agent to this CPU for the TCP tests (default: not pinned, as a DaemonSet runs; the DNS
    /// rate always runs it on CPU 1, since its target is per core).
    #[arg(long, value_name = "CPU", value_parser = clap::value_parser!(u32).range(0..2))]
    agent_cpu: Option<u32>,
    /// Measure only these tests (comma-separated) and print their table; writes no files and skips
    /// the agent's memory and criterion. For trying a change to the agent.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<rounds::Pick>,
    /// Measure only the direct path and the agent's fast path at size (its config directory holding
    /// a big cluster's beside the bench's: 20,000 ServiceEntries, 100,000 Pods), over the TCP tests
    /// (or those `--only` picks); print their table and what the agent at size holds and takes.
    /// Writes no files and skips the agent's memory and criterion.
    #[arg(long)]
    at_size_only: bool,
    /// Measure only the direct path and the agent's fast path with and without
    /// `--audit-mesh-config` (a policy that sees the bench's entry otherwise), over the TCP tests
    /// (or those `--only` picks); print their table. Writes no files.
    #[arg(long, conflicts_with = "at_size_only")]
    audit_only: bool,
    /// Measure only the direct path and the agent's fast path with its kernel connection records
    /// on (the default) and off (`--kernel-records off`), over the TCP tests (or those `--only`
    /// picks), with the agent's CPU under new connections and the access log's budget; print their
    /// table. Writes no files.
    #[arg(long, conflicts_with_all = ["at_size_only", "audit_only"])]
    records_only: bool,
    /// Measure only the direct path and the agent's fast path to the bench's service and to a
    /// second entry of the same server bound to a waypoint (carried over HBONE to `rdt-peer hbone`
    /// standing in for the waypoint beside the servers), over the TCP tests (or those `--only`
    /// picks); print their table. Writes no files.
    #[arg(long, conflicts_with_all = ["at_size_only", "audit_only", "records_only"])]
    waypoint_only: bool,
    /// Measure only Pod to Pod between two nodes, directly and over HBONE (an agent on each node
    /// with `--hbone-between-nodes`), with the one-stream throughput, latency and new-connections
    /// tests; print their table. Writes no files.
    #[arg(long, conflicts_with_all = ["at_size_only", "audit_only", "records_only", "waypoint_only", "only"])]
    between_nodes_only: bool,
    /// Measure only what authorization policy costs a Pod's clients on the same node: a client Pod
    /// to a server Pod of the node with no agent, with no policy (the kernel connects), under an
    /// ALLOW policy that admits the client (the kernel decides at the server's socket lookup), with the latency,
    /// new-connections and one-connection tests; and how long a connection refused by a DENY policy
    /// takes the client to fail. Print their tables. Writes no files.
    #[arg(long, conflicts_with_all = ["at_size_only", "audit_only", "records_only", "waypoint_only", "between_nodes_only", "only"])]
    authz_only: bool,
    /// Measure only the cluster as the source at scale (`run --kube`: 1,000 Namespaces, 10,000 Pods,
    /// 10,000 ServiceEntries) and write its section of BENCHMARKS.md, leaving the rest of the file as
    /// it is. A full run measures it too.
    #[arg(long, conflicts_with_all = ["only", "quick", "at_size_only"])]
    kube: bool,
}

/// What xtask built for a run (as root): the agent binary the harness finds in the target directory,
/// its eBPF object, and the harness's helper server.
pub struct Built {
    pub workspace: PathBuf,
    pub target_dir: PathBuf,
    /// The object embedded in the agent: the criterion benches are built with the same one.
    pub ebpf_object: PathBuf,
    /// `rdt-peer`: the servers and clients the scene runs in its namespaces.
    pub peer: PathBuf,
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// Pin the agent to this CPU (default: not pinned, as a DaemonSet runs).
    #[arg(long, value_name = "CPU", value_parser = clap::value_parser!(u32).range(0..2))]
    agent_cpu: Option<u32>,
    /// Profile DNS instead: straight to the upstream vs forwarded by the agent, per query.
    #[arg(long)]
    dns: bool,
}

/// `cargo xtask profile`: where the CPU goes, direct vs service, under perf (see [`profile`]).
pub fn profile(args: ProfileArgs, built: &Built) -> anyhow::Result<()> {
    let scene =
        scene::Scene::build(&built.peer, args.agent_cpu).context("building the bench topology")?;
    let summary = profile::profile(&scene, &built.target_dir, args.dns)?;
    println!("xtask profile: summary in {}", summary.display());
    Ok(())
}

/// Time starts before the build: the report's "done in" counts it.
pub fn bench(args: BenchArgs, built: &Built, started: Instant) -> anyhow::Result<()> {
    if args.kube {
        return kube_phase(built);
    }
    let settings = if args.quick { QUICK } else { FULL };
    if args.between_nodes_only {
        return between_nodes::measure(&built.peer, settings);
    }
    if args.authz_only {
        let attempts = if args.quick {
            AUTHZ_TIMER_QUICK
        } else {
            AUTHZ_TIMER_FULL
        };
        return authz::measure(&built.peer, settings, attempts);
    }
    let root = &built.workspace;
    let peer = &built.peer;
    let mut machine = machine::Machine::probe();
    let measuring = Instant::now();
    // `--only`, `--at-size-only`: the picked tests and paths and their table; no memory, no
    // criterion, no files.
    let full = args.only.is_empty()
        && !args.at_size_only
        && !args.audit_only
        && !args.records_only
        && !args.waypoint_only;
    let mut picked = if args.only.is_empty() {
        rounds::Pick::ALL.to_vec()
    } else {
        args.only.clone()
    };
    let paths = if args.at_size_only {
        picked.retain(|p| *p != rounds::Pick::Dns);
        if picked.is_empty() {
            bail!("--at-size-only measures the TCP tests: --only dns leaves none");
        }
        rounds::Paths::AtSizeOnly
    } else if args.audit_only {
        picked.retain(|p| *p != rounds::Pick::Dns);
        rounds::Paths::AuditOnly
    } else if args.records_only {
        picked.retain(|p| *p != rounds::Pick::Dns);
        rounds::Paths::RecordsOnly
    } else if args.waypoint_only {
        picked.retain(|p| *p != rounds::Pick::Dns);
        if picked.is_empty() {
            bail!("--waypoint-only measures the TCP tests: --only dns leaves none");
        }
        rounds::Paths::WaypointOnly
    } else {
        rounds::Paths::All
    };
    let (results, commands, memory, at_size) = {
        let mut scene =
            scene::Scene::build(peer, args.agent_cpu).context("building the bench topology")?;
        if paths == rounds::Paths::WaypointOnly {
            scene
                .add_waypoint(peer)
                .context("the waypoint and its certificates")?;
        }
        let config = scene.write_at_size_config()?;
        println!(
            "xtask bench: the agent at size ({} files beside bench.yaml, {:.1} MiB)",
            config.files,
            config.bytes as f64 / f64::from(1 << 20)
        );
        let at_size = control::agent_at_size(&scene, &config).context("the agent at size")?;
        println!("xtask bench: {}", report::at_size_paragraph(&at_size));
        let mut runner = rounds::Runner::new(&scene, settings, &picked, paths, &config)?;
        runner.run()?;
        let memory = if full {
            println!("xtask bench: agent memory with the 10,000-entry config");
            Some(control::agent_memory(&scene)?)
        } else {
            None
        };
        (runner.results, runner.commands, memory, Some(at_size))
    };
    let measuring = measuring.elapsed();
    machine.finish();
    let criterion = if full {
        println!(
            "xtask bench: criterion ({})",
            control::criterion_command(args.quick)
        );
        control::run_criterion(args.quick, built)?
    } else {
        Vec::new()
    };

    let verdicts = targets::judge(&results, &criterion, memory.as_ref());
    let report = report::BenchReport {
        quick: args.quick,
        settings,
        machine: &machine,
        results: &results,
        commands: &commands,
        criterion: &criterion,
        criterion_command: control::criterion_command(args.quick),
        agent_cpu: args.agent_cpu,
        memory,
        at_size,
        verdicts: &verdicts,
        measuring,
        chart: CHART,
    };
    if !full {
        println!("\n{}", report.tables());
        println!("xtask bench: --only/--at-size-only: nothing written");
        return Ok(());
    }
    println!("\n{}", report.tables());
    write_outputs(root, &report, &results, &machine)?;
    kube_phase(built)?;
    println!(
        "xtask bench: done in {:.1} min ({:.1} min measuring)",
        started.elapsed().as_secs_f64() / 60.0,
        measuring.as_secs_f64() / 60.0
    );
    Ok(())
}

/// Measures the cluster as the source at scale, prints its verdicts and puts its section into
/// BENCHMARKS.md in place of the last one.
fn kube_phase(built: &Built) -> anyhow::Result<()> {
    println!("xtask bench: the cluster as the source at scale (kube_scale)");
    let load = machine::load_average();
    let figures = kube::measure(built)?;
    let date = cmd::output(std::process::Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
        .unwrap_or_default();
    let section = kube::section(&figures, date.trim(), &load);
    println!("\n{section}");
    let md = built.workspace.join("BENCHMARKS.md");
    let existing = std::fs::read_to_string(&md).unwrap_or_default();
    std::fs::write(&md, kube::splice(&existing, &section))
        .with_context(|| format!("writing {}", md.display()))?;
    println!("xtask bench: wrote the kube section of {}", md.display());
    Ok(())
}

fn write_outputs(
    root: &Path,
    report: &report::BenchReport,
    results: &model::Results,
    machine: &machine::Machine,
) -> anyhow::Result<()> {
    let md: PathBuf = root.join("BENCHMARKS.md");
    let existing = std::fs::read_to_string(&md).unwrap_or_default();
    let why = report::kept_why(&existing);
    // The kube section is the kube phase's: kept here, replaced when that phase runs.
    let mut markdown = report.markdown(&why);
    if let Some(section) = kube::kept_section(&existing) {
        markdown = kube::splice(&markdown, &section);
    }
    std::fs::write(&md, markdown).with_context(|| format!("writing {}", md.display()))?;
    let png = root.join(CHART);
    if let Some(dir) = png.parent() {
        std::fs::create_dir_all(dir)?;
    }
    chart::draw(
        results,
        &format!(
            "redirect: ratio to direct, same run ({}, {} × {}, {})",
            machine.date, machine.cores, machine.cpu, machine.kernel
        ),
        &png,
    )?;
    println!("xtask bench: wrote {} and {}", md.display(), png.display());
    Ok(())
}
