//! `cargo xtask build`: the eBPF object (nightly, bpf-linker) and then the agent embedding it.
use std::{path::PathBuf, process::Command};

use anyhow::Context;

use crate::{cmd, setup};

/// Builds the eBPF object and the agent embedding it; returns the agent binary's path.
pub(crate) fn build() -> anyhow::Result<PathBuf> {
    build_release(&["--package", "redirect-userspace"])
}

/// The agent and the harness's helper server (`rdt-peer`: identity web servers and echo) for the
/// demo and the bench, in one cargo invocation: built one after the other, the two unify their
/// dependencies' features differently, and each build undoes the other's (minutes each time).
/// Returns the agent's path and the server's.
pub(crate) fn build_with_peer() -> anyhow::Result<(PathBuf, PathBuf)> {
    let agent = build_release(&[
        "--package",
        "redirect-userspace",
        "--bin",
        "redirect",
        "--package",
        "tests",
        "--bin",
        "rdt-peer",
    ])?;
    Ok((agent, target_dir().join("release/rdt-peer")))
}

/// The eBPF object, then `cargo build --release` of `packages` with the object embedded.
fn build_release(packages: &[&str]) -> anyhow::Result<PathBuf> {
    let root = cmd::workspace_root();
    let linker_bin = setup::bpf_linker_dir()?.join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path =
        std::env::join_paths(std::iter::once(linker_bin).chain(std::env::split_paths(&path)))
            .context("building PATH")?;
    cmd::run(ebpf_cargo("build").env("PATH", &path))?;
    let object = target_dir().join("bpfel-unknown-none/release/redirect");
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["build", "--release"])
            .args(packages)
            .env("REDIRECT_EBPF_OBJECT", &object),
    )?;
    let agent = target_dir().join("release/redirect");
    println!(
        "xtask: agent built: {} (eBPF object embedded)",
        agent.display()
    );
    Ok(agent)
}

/// `cargo +nightly <subcommand>` on the eBPF crate, for the target it is built for (`build`, or
/// `clippy`, which needs no linker).
pub(crate) fn ebpf_cargo(subcommand: &str) -> Command {
    let mut cargo = Command::new("cargo");
    cargo
        .current_dir(cmd::workspace_root())
        .args([
            "+nightly",
            subcommand,
            "--package",
            "redirect-ebpf",
            "--release",
        ])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        // BTF in the object: socket local storage maps cannot be created without it.
        .args([
            "--config",
            r#"target.bpfel-unknown-none.rustflags = ["-C", "link-arg=--btf"]"#,
        ])
        // The stable cargo running xtask must not leak its toolchain into the nightly build.
        .env_remove("RUSTC")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    cargo
}

pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cmd::workspace_root().join("target"))
}
