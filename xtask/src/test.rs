//! `cargo xtask test`: every test there is, in the order that fails fastest.
use anyhow::bail;

use crate::{build, cmd, setup};

#[derive(clap::Args)]
pub struct TestArgs {
    /// Only the checks and unit tests (no root needed).
    #[arg(long)]
    unit_only: bool,
    /// Passed to the integration test binaries (e.g. a test name filter).
    #[arg(last = true)]
    filter: Vec<String>,
}

pub fn test(args: TestArgs) -> anyhow::Result<()> {
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
    cmd::run(cmd::cargo().current_dir(&root).args([
        "test",
        "--workspace",
        "--exclude",
        "redirect-ebpf",
        "--exclude",
        "tests",
    ]))?;
    if args.unit_only {
        return Ok(());
    }
    if !setup::is_root() {
        bail!(
            "the integration suite creates network namespaces, cgroups and loads eBPF: run it as root (`sudo cargo xtask test`), or pass --unit-only"
        );
    }
    let agent = build::build()?;
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["test", "--package", "tests", "--"])
            .args(&args.filter)
            .env("REDIRECT_BIN", agent),
    )
}
