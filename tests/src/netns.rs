//! Named network namespaces (`ip netns`, files under /run/netns) and running code inside one.
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const NETNS_DIR: &str = "/run/netns";

/// Runs `ip ARGS...`; the error carries the command line and ip's own message.
/// Always call it with `-n <ns>` for anything that changes links, addresses or routes.
pub fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (is iproute2 installed?)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

pub fn add(name: &str) -> Result<()> {
    ip(&["netns", "add", name]).map(drop)
}

/// Sets `key=value` sysctls inside netns `name` (the `net.*` ones are per namespace).
pub fn sysctl(name: &str, settings: &[&str]) -> Result<()> {
    ip(&[&["netns", "exec", name, "sysctl", "-q", "-w"], settings].concat()).map(drop)
}

pub fn del(name: &str) -> Result<()> {
    ip(&["netns", "del", name]).map(drop)
}

/// Names of every named netns on the machine.
pub fn list() -> Vec<String> {
    fs::read_dir(NETNS_DIR)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Pids of processes whose netns is `name`.
pub fn pids(name: &str) -> Vec<i32> {
    ip(&["netns", "pids", name])
        .map(|out| {
            out.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `f` on a fresh thread that has joined the netns `name`, so sockets it opens live there.
/// Only that thread moves; the caller's netns never changes.
pub fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let file = path(name);
    let ns = File::open(&file).with_context(|| format!("opening {}", file.display()))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on an fd we own; CLONE_NEWNET moves only the calling thread.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error()).context(format!("setns into {name}"));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}
