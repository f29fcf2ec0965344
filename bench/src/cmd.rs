//! Running commands: each is printed before it runs, so a log shows exactly what was done. xtask
//! runs its commands through these too.
use std::{ffi::OsStr, process::Command};

use anyhow::{Context, bail};

/// Runs `command` with inherited stdio and fails unless it exits 0.
pub fn run(command: &mut Command) -> anyhow::Result<()> {
    println!("xtask: $ {}", describe(command));
    let status = command
        .status()
        .with_context(|| format!("starting {}", describe(command)))?;
    if !status.success() {
        bail!("{} failed: {status}", describe(command));
    }
    Ok(())
}

/// Runs `command` quietly and returns its stdout, or None when it cannot run or fails.
pub fn output(command: &mut Command) -> Option<String> {
    let out = command.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Cargo, without incremental compilation: xtask's builds are one-shot (CI, the demo, a VM run),
/// and the incremental caches would double the disk they need.
pub fn cargo() -> Command {
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo.env("CARGO_INCREMENTAL", "0");
    cargo
}

fn describe(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(quote));
    parts.join(" ")
}

fn quote(arg: &OsStr) -> String {
    let s = arg.to_string_lossy();
    if s.is_empty() || s.contains(|c: char| c.is_whitespace() || c == '"') {
        format!("{s:?}")
    } else {
        s.into_owned()
    }
}
