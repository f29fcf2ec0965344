//! `cargo xtask test`: every test there is, in the order that fails fastest.
//!
//! With `--kernel`, the integration suite runs inside a VM booted with one of Debian's kernels
//! instead (see `vm/`). Plain `cargo xtask test` (CI) ends with a short VM smoke on the oldest kernel
//! the agent supports.
use std::{path::PathBuf, process::Stdio, time::Duration};

use anyhow::{Context, bail};

use crate::{build, cmd, fuzz, image, setup::is_root, vm};

#[derive(clap::Args)]
pub(crate) struct TestArgs {
    /// Only the checks, the unit tests and the fuzz targets (no root needed).
    #[arg(long)]
    unit_only: bool,
    /// Run the integration suite in a VM on this kernel instead of the host's: 5.10, 6.1, 6.12,
    /// `all` (each in turn), or the path of a kernel .deb. Skips the checks and unit tests.
    #[arg(long, value_name = "VERSION|all|PATH.deb")]
    kernel: Option<String>,
    /// Skip the VM smoke test that follows the host's integration suite.
    #[arg(long, conflicts_with = "kernel")]
    no_vm: bool,
    /// Give up on a VM after this many minutes.
    #[arg(long, default_value_t = 150, value_name = "MINUTES")]
    vm_timeout: u64,
    /// Passed to the integration test binaries (e.g. a test name filter).
    #[arg(last = true)]
    filter: Vec<String>,
}

/// The oldest kernel the agent supports (it refuses older ones): CI's VM smoke runs there.
fn smoke_kernel() -> String {
    let (major, minor) = redirect_userspace::node::OLDEST_SUPPORTED;
    format!("{major}.{minor}")
}

/// The smoke: the redirect path, one visibility scenario with real dig, curl and dnsmasq, and the
/// fast path's programs loaded and deciding (the agent's default).
const SMOKE: &[(&str, &[&str])] = &[
    ("redirect_path", &[]),
    (
        "fast_path",
        &["passthrough_keeps_the_pods_source_address_with_the_fast_path_and_the_nodes_without"],
    ),
    (
        "visibility",
        &[
            "namespace_entry_is_answered_in_its_namespace_and_forwarded_upstream_elsewhere",
            "--exact",
        ],
    ),
    // The kernel's records: a socket's state callbacks, its byte counts and the ring, on the
    // oldest kernel.
    (
        "connection_records",
        &["kernel_decided_connections_each_have_an_access_log_line_with_bytes_and_end"],
    ),
    // HBONE between nodes: the tc program (a `clsact` filter before TCX) and its socket lookup
    // pass this verifier, and each Pod sees the other's address.
    (
        "between_nodes",
        &["a_pod_reaches_a_pod_of_the_other_node_over_hbone_as_its_own_identity"],
    ),
];

pub(crate) fn test(args: TestArgs) -> anyhow::Result<()> {
    if let Some(kernel) = &args.kernel {
        let choices = vm::KernelChoice::parse(kernel)?;
        need_root()?;
        let agent = build::build()?;
        let built = build_integration_tests()?;
        let tests = built
            .suites
            .iter()
            .map(|(_, binary)| vm::GuestTest {
                binary: binary.clone(),
                args: args.filter.clone(),
            })
            .collect::<Vec<_>>();
        return run_in_vms(&choices, &tests, &built.env(agent, args.vm_timeout));
    }
    let root = cmd::workspace_root();
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["fmt", "--all", "--check"]),
    )?;
    cmd::run(cmd::cargo().current_dir(&root).args([
        "clippy",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The eBPF crate is no default member (it builds only with nightly, for bpfel): the same
    // workspace lints, checked where it builds.
    cmd::run(build::ebpf_cargo("clippy").args(["--", "-D", "warnings"]))?;
    cmd::run(cmd::cargo().current_dir(&root).args([
        "test",
        "--workspace",
        "--exclude",
        "redirect-ebpf",
        "--exclude",
        "tests",
    ]))?;
    // The parsers of outside input, fuzzed a little each time (no root needed).
    fuzz::run(&fuzz::TARGETS, fuzz::TEST_SECONDS)?;
    if args.unit_only {
        return Ok(());
    }
    need_root()?;
    let agent = build::build()?;
    // The image suite runs the agent as the DaemonSet does: from this build's image.
    let image = image::from_binary(&agent)?;
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["test", "--package", "tests", "--"])
            .args(&args.filter)
            .env("REDIRECT_BIN", &agent)
            .env("REDIRECT_IMAGE", &image),
    )?;
    // The visibility suite again with the proxy deciding everything (the first run had the
    // agent's default, the kernel deciding what needs no proxy): the same outcomes.
    println!("xtask: the visibility suite again, with --no-fast-path");
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["test", "--package", "tests", "--test", "visibility", "--"])
            .args(&args.filter)
            .env("REDIRECT_BIN", &agent)
            .env("REDIRECT_FAST_PATH", "0"),
    )?;
    if args.no_vm {
        return Ok(());
    }
    let built = build_integration_tests()?;
    let mut tests = Vec::new();
    for (suite, suite_args) in SMOKE {
        let binary = built.suite(suite)?;
        tests.push(vm::GuestTest {
            binary,
            args: suite_args.iter().map(|a| a.to_string()).collect(),
        });
    }
    let kernel = smoke_kernel();
    println!("xtask: VM smoke on the oldest supported kernel ({kernel})");
    run_in_vms(
        &vm::KernelChoice::parse(&kernel)?,
        &tests,
        &built.env(agent, args.vm_timeout),
    )
}

fn need_root() -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "the integration suite creates network namespaces, cgroups and loads eBPF: run it as root (`sudo cargo xtask test`), or pass --unit-only"
        );
    }
    Ok(())
}

/// Runs `tests` on each kernel in turn and prints one line per kernel; fails if any failed.
fn run_in_vms(
    choices: &[vm::KernelChoice],
    tests: &[vm::GuestTest],
    env: &vm::GuestEnv,
) -> anyhow::Result<()> {
    let mut outcomes = Vec::new();
    let mut failed = false;
    for choice in choices {
        match vm::run(choice, tests, env) {
            Ok(outcome) => {
                failed |= !outcome.passed;
                outcomes.push(outcome);
            }
            Err(err) => {
                eprintln!("xtask: error: {err:#}");
                failed = true;
            }
        }
    }
    println!("\nxtask: integration suite in VMs:");
    println!(
        "  {:<8} {:<24} {:<8} {:>8}",
        "KERNEL", "UNAME -R", "RESULT", "TIME"
    );
    for o in &outcomes {
        println!(
            "  {:<8} {:<24} {:<8} {:>7}s",
            o.kernel,
            o.release,
            if o.passed { "passed" } else { "FAILED" },
            o.elapsed.as_secs()
        );
    }
    if failed {
        bail!("the integration suite failed in a VM (see above)");
    }
    Ok(())
}

/// The integration suite's test binaries and the helper binary, built for the VM to run.
struct IntegrationTests {
    suites: Vec<(String, PathBuf)>,
    peer: PathBuf,
}

impl IntegrationTests {
    fn suite(&self, name: &str) -> anyhow::Result<PathBuf> {
        self.suites
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .with_context(|| format!("no integration suite named {name}"))
    }

    fn env(&self, agent: PathBuf, timeout_minutes: u64) -> vm::GuestEnv {
        vm::GuestEnv {
            workspace: cmd::workspace_root(),
            vars: vec![
                ("REDIRECT_BIN".into(), agent.display().to_string()),
                ("RDT_PEER_BIN".into(), self.peer.display().to_string()),
            ],
            timeout: Duration::from_secs(timeout_minutes * 60),
        }
    }
}

/// `cargo test -p tests --no-run`, reading the executables from cargo's JSON messages.
fn build_integration_tests() -> anyhow::Result<IntegrationTests> {
    let out = cmd::cargo()
        .current_dir(cmd::workspace_root())
        .args([
            "test",
            "--package",
            "tests",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("starting cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the integration tests failed: {}", out.status);
    }
    let mut suites = Vec::new();
    let mut peer = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        let kinds = &msg["target"]["kind"];
        if msg["profile"]["test"] == true && kinds == &serde_json::json!(["test"]) {
            suites.push((name.to_string(), PathBuf::from(exe)));
        } else if name == "rdt-peer" && msg["profile"]["test"] == false {
            // (cargo also builds the binary's own unit-test harness under the same name)
            peer = Some(PathBuf::from(exe));
        }
    }
    suites.sort();
    let peer = peer.context("cargo built no rdt-peer binary")?;
    Ok(IntegrationTests { suites, peer })
}
