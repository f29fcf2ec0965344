//! cgroup v2 directories: where the hierarchy is mounted, and killing and removing a subtree.
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The cgroup v2 mount point (`/sys/fs/cgroup/unified` on a hybrid host, `/sys/fs/cgroup` on a unified
/// one), found the way the agent finds it.
pub fn cgroup2_mount() -> Result<PathBuf> {
    redirect_userspace::node::cgroup2_mount_points()
        .context("reading /proc/self/mountinfo")?
        .into_iter()
        .next()
        .context("no cgroup2 file system is mounted (see /proc/self/mountinfo)")
}

/// True while any process lives in `dir` or below it.
pub fn populated(dir: &Path) -> bool {
    fs::read_to_string(dir.join("cgroup.events"))
        .map(|ev| ev.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// SIGKILLs every process in `dir` and below, and waits until the subtree is empty.
pub fn kill_all(dir: &Path, timeout: Duration) -> Result<()> {
    let kill_file = dir.join("cgroup.kill");
    let deadline = Instant::now() + timeout;
    while populated(dir) {
        if kill_file.exists() {
            // Linux >= 5.14: atomic against processes forking while we kill.
            fs::write(&kill_file, "1")
                .with_context(|| format!("writing {}", kill_file.display()))?;
        } else {
            for pid in pids_below(dir) {
                // SAFETY: plain kill(2) of a pid read from a cgroup of ours.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if Instant::now() > deadline {
            bail!(
                "{} still has processes {:?} after {timeout:?}",
                dir.display(),
                pids_below(dir)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Pids of every process in `dir` and its descendants.
pub fn pids_below(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for child in subdirs(dir) {
        pids.extend(pids_below(&child));
    }
    pids
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes `dir` and every cgroup below it, deepest first (cgroupfs only lets empty directories go).
pub fn remove_tree(dir: &Path) -> Result<()> {
    for child in subdirs(dir) {
        remove_tree(&child)?;
    }
    fs::remove_dir(dir).with_context(|| format!("rmdir {}", dir.display()))
}
