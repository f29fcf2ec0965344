//! `cargo xtask bench` and `cargo xtask profile`: thin calls into the bench crate (`bench/`), after
//! building what they measure.
use std::time::Instant;

use anyhow::bail;

use crate::{build, cmd, setup};

pub(crate) fn bench(args: bench::BenchArgs) -> anyhow::Result<()> {
    need_root("bench")?;
    let started = Instant::now();
    let built = built()?;
    bench::bench(args, &built, started)
}

pub(crate) fn profile(args: bench::ProfileArgs) -> anyhow::Result<()> {
    need_root("profile")?;
    bench::profile(args, &built()?)
}

fn need_root(command: &str) -> anyhow::Result<()> {
    if !setup::is_root() {
        bail!(
            "the {command} builds network namespaces and cgroups and loads eBPF: run it as root (`sudo cargo xtask {command}`)"
        );
    }
    Ok(())
}

/// The agent with its eBPF object embedded, and the harness's helper server.
fn built() -> anyhow::Result<bench::Built> {
    let (_agent, peer) = build::build_with_peer()?;
    Ok(bench::Built {
        workspace: cmd::workspace_root(),
        target_dir: build::target_dir(),
        ebpf_object: build::target_dir().join("bpfel-unknown-none/release/redirect"),
        peer,
    })
}
