//! cgroup v2 directories: where the hierarchy is mounted, and killing and removing a subtree.
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The cgroup v2 mount point, from `/proc/self/mountinfo` (`/sys/fs/cgroup/unified` on a hybrid host,
/// `/sys/fs/cgroup` on a unified one).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mountinfo =
        fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    parse_cgroup2_mount(&mountinfo)
        .context("no cgroup2 file system is mounted (see /proc/self/mountinfo)")
}

fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // `id parent maj:min root mount-point options [optional...] - fstype source super-options`
        let (before, after) = line.split_once(" - ")?;
        if after.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        before.split_whitespace().nth(4).map(unescape_octal)
    })
}

/// mountinfo writes space, tab, newline and backslash as `\040`-style octal escapes.
fn unescape_octal(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    PathBuf::from(String::from_utf8_lossy(&out).into_owned())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount_among_v1_mounts() {
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
";
        assert_eq!(
            parse_cgroup2_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            parse_cgroup2_mount("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"),
            None
        );
    }

    #[test]
    fn mount_points_with_escaped_spaces() {
        let mountinfo = "41 31 0:38 / /mnt/my\\040cgroup rw - cgroup2 none rw\n";
        assert_eq!(
            parse_cgroup2_mount(mountinfo),
            Some(PathBuf::from("/mnt/my cgroup"))
        );
    }
}
