//! `cargo xtask fuzz`: the fuzz targets of `fuzz/` (cargo fuzz, libFuzzer), each built once and
//! run for a while from its checked-in seeds (`fuzz/corpus/<target>/`).
//!
//! What a run finds beyond the seeds goes to a temporary folder, removed at the end, never into
//! the repository; a crash is written to `fuzz/artifacts/<target>/` and fails the run. The stable
//! toolchain builds the targets, its unstable flags let through by `RUSTC_BOOTSTRAP=1`. Unoptimised
//! and without AddressSanitizer (`--dev --sanitizer none`): the code is safe Rust, and that build
//! takes a third of the CPU of the optimised one with the sanitizer while running the targets about
//! as fast (docs/development.md#fuzzing).
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use crate::cmd;

/// Every target, in `fuzz/fuzz_targets/<name>.rs`.
pub(crate) const TARGETS: [&str; 5] = [
    "manifests",
    "kube_object",
    "dns_query",
    "audit_file",
    "hbone_request",
];

/// What `cargo xtask test` gives each target: enough to run its seeds and mutate them for a while,
/// little against the suite's half hour.
pub(crate) const TEST_SECONDS: u64 = 15;

#[derive(clap::Args)]
pub(crate) struct FuzzArgs {
    /// Seconds to run each target.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Only these targets (default: all of them).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(TARGETS))]
    targets: Vec<String>,
}

pub(crate) fn fuzz(args: FuzzArgs) -> anyhow::Result<()> {
    let targets: Vec<&str> = match args.targets.is_empty() {
        true => TARGETS.to_vec(),
        false => args.targets.iter().map(String::as_str).collect(),
    };
    run(&targets, args.seconds)
}

/// Builds every target, then runs each of `targets` for `seconds`; fails on the first crash.
pub(crate) fn run(targets: &[&str], seconds: u64) -> anyhow::Result<()> {
    let dir = fuzz_dir();
    cmd::run(&mut cargo_fuzz(&dir, "build"))?;
    let grown = std::env::temp_dir().join(format!("redirect-fuzz-{}", std::process::id()));
    let result = targets
        .iter()
        .try_for_each(|target| run_one(&dir, &grown, target, seconds));
    let _ = std::fs::remove_dir_all(&grown);
    result
}

fn run_one(dir: &Path, grown: &Path, target: &str, seconds: u64) -> anyhow::Result<()> {
    let seeds = dir.join("corpus").join(target);
    if !seeds.is_dir() {
        bail!("{target} has no seeds in {}", seeds.display());
    }
    // libFuzzer writes what it finds to the first folder and only reads the others.
    let found = grown.join(target);
    std::fs::create_dir_all(&found).with_context(|| format!("creating {}", found.display()))?;
    println!("xtask: fuzzing {target} for {seconds} s");
    let run = cmd::run(
        cargo_fuzz(dir, "run")
            .arg(target)
            .arg(&found)
            .arg(&seeds)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            // One input taking this long is a finding (a hang), not a slow machine.
            .arg("-timeout=10")
            .arg("-rss_limit_mb=4096")
            .arg("-print_final_stats=1"),
    );
    run.with_context(|| {
        format!(
            "fuzz target {target} failed: the input is in {}; make it a unit test of the parser's module (docs/development.md#fuzzing)",
            dir.join("artifacts").join(target).display()
        )
    })
}

/// `cargo fuzz <subcommand>` in `dir` with the flags every build and run share, so that a run
/// finds the build done.
fn cargo_fuzz(dir: &Path, subcommand: &str) -> Command {
    let mut cargo = cmd::cargo();
    cargo
        .current_dir(dir)
        .args(["fuzz", subcommand, "--dev", "--sanitizer", "none"])
        // Its own target folder, instrumented builds never touching the workspace's, kept outside
        // the clone as bpf-linker is: a fresh clone on the same machine rebuilds only our crates
        // (minutes), not every dependency instrumented (a quarter of an hour on two cores).
        .arg("--target-dir")
        .arg(target_dir())
        .env("RUSTC_BOOTSTRAP", "1")
        .env_remove("CARGO_TARGET_DIR");
    cargo
}

/// `~/.cache/redirect-xtask/fuzz-target`, or `fuzz/target` without a home.
fn target_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cache/redirect-xtask/fuzz-target"),
        None => fuzz_dir().join("target"),
    }
}

fn fuzz_dir() -> PathBuf {
    cmd::workspace_root().join("fuzz")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_has_its_file_its_binary_and_its_seeds() {
        let dir = fuzz_dir();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        for target in TARGETS {
            assert!(
                dir.join(format!("fuzz_targets/{target}.rs")).is_file(),
                "{target}"
            );
            assert!(
                manifest.contains(&format!("name = \"{target}\"")),
                "{target}"
            );
            let seeds = std::fs::read_dir(dir.join("corpus").join(target))
                .unwrap()
                .count();
            assert!(seeds >= 3, "{target} has {seeds} seeds");
        }
        let listed = std::fs::read_dir(dir.join("fuzz_targets")).unwrap().count();
        assert_eq!(listed, TARGETS.len());
    }
}
