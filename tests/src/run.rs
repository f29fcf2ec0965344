//! A run's identity and lifetime: the id every created name carries, the owner record that tells a later
//! run whether we are still alive, and the one teardown used both by `Drop` and by the stale sweep.
use std::collections::BTreeSet;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use crate::{cgroup, netns, procfs};

/// Every netns, cgroup and state directory the harness creates starts with this, then the run id.
pub const PREFIX: &str = "rdt";
/// Per-run state: owner record, logs, per-pod resolv.conf, scratch files.
pub const STATE_ROOT: &str = "/run/redirect-tests";
/// Name of the directory under the cgroup2 mount that holds every run's cgroup.
pub const CGROUP_PARENT: &str = "redirect-tests";

const ID_LEN: usize = 8;

/// A run-unique id: 8 hex digits. A run is one [`crate::Topology`]; tests in one process each have their own.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId(String);

impl RunId {
    pub fn generate() -> RunId {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        // RandomState is seeded from the OS; mixing in pid, time and a counter keeps ids apart even if not.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        RunId(format!("{:08x}", h.finish() as u32))
    }

    /// `rdt<id>`: the common start of every name this run creates.
    pub fn tag(&self) -> String {
        format!("{PREFIX}{}", self.0)
    }

    /// The run whose tag starts `name` (`rdt1a2b3c4d` or `rdt1a2b3c4d-node`), if any.
    pub fn from_name(name: &str) -> Option<RunId> {
        let rest = name.strip_prefix(PREFIX)?;
        let id = rest.get(..ID_LEN)?;
        let well_formed = id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
        let ends = rest.len() == ID_LEN || rest[ID_LEN..].starts_with('-');
        (well_formed && ends).then(|| RunId(id.to_string()))
    }

    pub fn state_dir(&self) -> PathBuf {
        Path::new(STATE_ROOT).join(self.tag())
    }

    /// A bpf filesystem of this run's own (mounted by [`mount_bpffs`]): the agents' pinned links and
    /// maps live there and go with its unmount.
    pub fn bpffs_dir(&self) -> PathBuf {
        self.state_dir().join("bpffs")
    }

    pub fn cgroup_dir(&self, cgroup2: &Path) -> PathBuf {
        cgroup2.join(CGROUP_PARENT).join(self.tag())
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.tag())
    }
}

/// The process that owns a run. Its start time guards against pid reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub start_time: u64,
}

impl Owner {
    pub fn current() -> Result<Owner> {
        let pid = std::process::id();
        let start_time = procfs::start_time(pid)?.context("reading our own /proc/self/stat")?;
        Ok(Owner { pid, start_time })
    }

    pub fn is_alive(&self) -> bool {
        matches!(procfs::start_time(self.pid), Ok(Some(t)) if t == self.start_time)
    }

    pub fn to_record(self) -> String {
        format!("{} {}\n", self.pid, self.start_time)
    }

    pub fn parse(record: &str) -> Option<Owner> {
        let mut fields = record.split_whitespace();
        let pid = fields.next()?.parse().ok()?;
        let start_time = fields.next()?.parse().ok()?;
        Some(Owner { pid, start_time })
    }
}

/// Claims a run: creates its state directory with the owner record in it, before anything else exists,
/// so the sweep never mistakes a run that is starting for a leftover.
pub fn claim(id: &RunId) -> Result<PathBuf> {
    let dir = id.state_dir();
    // Filled under a name no sweep takes for a run, then renamed into place: a concurrent sweep (another
    // test, another process) must never see the directory without its owner record and remove it.
    let staging = staging_dir(id);
    create_dir_all_shared(&staging)?;
    fs::write(staging.join("owner"), Owner::current()?.to_record())
        .with_context(|| format!("writing {}/owner", staging.display()))?;
    fs::rename(&staging, &dir)
        .with_context(|| format!("renaming {} to {}", staging.display(), dir.display()))?;
    Ok(dir)
}

fn staging_dir(id: &RunId) -> PathBuf {
    Path::new(STATE_ROOT).join(format!(".{}{STAGING_SUFFIX}", id.tag()))
}

const STAGING_SUFFIX: &str = ".claiming";

/// Removes everything of one run: its processes (the whole cgroup subtree, then anything left in its
/// netns), its netns, its cgroups, and last its state directory. Best effort: returns what failed.
pub fn remove_run(id: &RunId, cgroup2: &Path) -> Vec<String> {
    let mut errors = Vec::new();
    // Containers of the run (the image suite's agents), first: they hold the node netns and the
    // run's bpffs. Their guards remove them; this catches a run killed before its guards ran.
    if id.state_dir().join(crate::container::MARKER).exists() {
        crate::container::remove_all(&id.tag());
    }
    let cg = id.cgroup_dir(cgroup2);
    if cg.exists()
        && let Err(e) = cgroup::kill_all(&cg, Duration::from_secs(5))
    {
        errors.push(format!("killing processes of {}: {e:#}", cg.display()));
    }
    let prefix = format!("{}-", id.tag());
    for ns in netns::list().into_iter().filter(|n| n.starts_with(&prefix)) {
        // A process that escaped the cgroup would keep the namespace (and its veths) alive.
        for pid in netns::pids(&ns) {
            // SAFETY: plain kill(2) on a pid that `ip netns pids` reported inside our namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if let Err(e) = netns::del(&ns) {
            errors.push(format!("deleting netns {ns}: {e:#}"));
        }
    }
    if cg.exists()
        && let Err(e) = cgroup::remove_tree(&cg)
    {
        errors.push(format!("removing {}: {e:#}", cg.display()));
    }
    let bpffs = id.bpffs_dir();
    if bpffs.exists()
        && let Err(e) = unmount(&bpffs)
    {
        errors.push(format!("unmounting {}: {e:#}", bpffs.display()));
    }
    let state = id.state_dir();
    if state.exists()
        && let Err(e) = fs::remove_dir_all(&state)
    {
        errors.push(format!("removing {}: {e}", state.display()));
    }
    // The shared parents go with the last run (rmdir fails harmlessly while another run uses them).
    let _ = fs::remove_dir(cgroup2.join(CGROUP_PARENT));
    let _ = fs::remove_dir(STATE_ROOT);
    errors
}

/// Mounts a fresh bpf filesystem at the run's [`RunId::bpffs_dir`] (its own instance: nothing pinned by
/// another run or the machine is visible there).
pub fn mount_bpffs(id: &RunId) -> Result<PathBuf> {
    let dir = id.bpffs_dir();
    create_dir_all_shared(&dir)?;
    let target = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mounting a bpf filesystem at {}", dir.display()));
    }
    Ok(dir)
}

/// Unmounts the run's bpf filesystem (lazily: a process still holding a pin's descriptor keeps only
/// that object); what was pinned there is released with it.
fn unmount(dir: &Path) -> Result<()> {
    let target = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        let e = std::io::Error::last_os_error();
        // Not mounted (EINVAL): a run that failed before mounting.
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e.into());
        }
    }
    Ok(())
}

/// `create_dir_all` that survives another run removing the shared parent between its steps.
pub fn create_dir_all_shared(dir: &Path) -> Result<()> {
    let mut attempt = 0;
    loop {
        match fs::create_dir_all(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempt < 5 => attempt += 1,
            r => return r.with_context(|| format!("creating {}", dir.display())),
        }
    }
}

/// What still exists of run `id` (netns, cgroup, state directory): empty once it is fully removed.
pub fn leftovers(id: &RunId, cgroup2: &Path) -> Vec<String> {
    let prefix = format!("{}-", id.tag());
    let mut left: Vec<String> = netns::list()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .map(|n| format!("netns {n}"))
        .collect();
    for dir in [id.cgroup_dir(cgroup2), id.state_dir()] {
        if dir.exists() {
            left.push(dir.display().to_string());
        }
    }
    left
}

/// Finds runs whose owner is dead (or that never wrote an owner record) and removes them.
/// Returns the runs it removed.
pub fn sweep_stale(cgroup2: &Path) -> Vec<RunId> {
    let mut candidates = BTreeSet::new();
    let names_in = |dir: &Path| -> Vec<String> {
        fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    candidates.extend(
        names_in(Path::new(STATE_ROOT))
            .iter()
            .filter_map(|n| RunId::from_name(n)),
    );
    candidates.extend(netns::list().iter().filter_map(|n| RunId::from_name(n)));
    candidates.extend(
        names_in(&cgroup2.join(CGROUP_PARENT))
            .iter()
            .filter_map(|n| RunId::from_name(n)),
    );

    // A run that died between creating its staging directory and renaming it.
    for name in names_in(Path::new(STATE_ROOT)) {
        let staged = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(STAGING_SUFFIX))
            .and_then(RunId::from_name);
        if let Some(id) = staged {
            let dir = staging_dir(&id);
            let owner = fs::read_to_string(dir.join("owner")).ok();
            // No record yet may mean it is being written right now: only a dead owner's is removed.
            if owner
                .as_deref()
                .and_then(Owner::parse)
                .is_some_and(|o| !o.is_alive())
            {
                let _ = fs::remove_dir_all(&dir);
            }
        }
    }

    let mut removed = Vec::new();
    for id in candidates {
        let owner = fs::read_to_string(id.state_dir().join("owner")).ok();
        let alive = owner
            .as_deref()
            .and_then(Owner::parse)
            .is_some_and(|o| o.is_alive());
        if alive {
            continue;
        }
        for e in remove_run(&id, cgroup2) {
            eprintln!("redirect-tests: stale sweep of {id}: {e}");
        }
        removed.push(id);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_tag_and_parse_back() {
        let id = RunId::generate();
        assert_eq!(id.tag().len(), PREFIX.len() + ID_LEN);
        assert_eq!(RunId::from_name(&id.tag()), Some(id.clone()));
        assert_eq!(
            RunId::from_name(&format!("{}-pod-team-a_a1", id.tag())),
            Some(id.clone())
        );
        assert_ne!(RunId::generate(), id, "two ids in a row must differ");
    }

    #[test]
    fn foreign_names_are_not_ours() {
        struct Case {
            name: &'static str,
            input: &'static str,
        }
        let cases = [
            Case {
                name: "other prefix",
                input: "cni-1234abcd",
            },
            Case {
                name: "too short",
                input: "rdt1234",
            },
            Case {
                name: "id runs on",
                input: "rdt1234abcd9",
            },
            Case {
                name: "not hex",
                input: "rdt1234abcz-node",
            },
            Case {
                name: "upper case",
                input: "rdt1234ABCD",
            },
            Case {
                name: "no separator",
                input: "rdt1234abcdnode",
            },
        ];
        for c in cases {
            assert_eq!(RunId::from_name(c.input), None, "{}", c.name);
        }
    }

    #[test]
    fn owner_record_round_trips() {
        let o = Owner {
            pid: 4242,
            start_time: 987654,
        };
        assert_eq!(Owner::parse(&o.to_record()), Some(o));
        assert_eq!(Owner::parse("4242"), None);
        assert_eq!(Owner::parse("x 1"), None);
    }

    #[test]
    fn we_are_alive_and_a_reused_pid_is_not() {
        let me = Owner::current().unwrap();
        assert!(me.is_alive());
        assert!(
            !Owner {
                start_time: me.start_time + 1,
                ..me
            }
            .is_alive()
        );
    }
}
