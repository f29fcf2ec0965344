//! The bpf filesystem the hand-over needs (`--bpffs`): the pinned links and maps outlive the agent
//! there, so its successor adopts them. A node whose `/sys/fs/bpf` is a plain directory gets one
//! mounted by the agent, as Cilium does, when the agent may mount (root on the host); the mount lives
//! in the host's mount namespace and outlasts the agent, so the successor finds the same pins.
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::pins::on_bpffs;

/// Whether this agent can hand over, and why not. `/config_dump` shows it as `handover`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Handover {
    pub available: bool,
    /// The bpf filesystem the agent mounted itself (at `--bpffs`'s parent), if it did.
    pub mounted: Option<PathBuf>,
    /// Without hand-over: what was tried, what a rollout costs and how to fix the node.
    pub unavailable: Option<String>,
}

/// What a restart or rollout costs without a bpffs, for the warning and `/config_dump`.
pub(crate) const COST: &str = "every restart or rollout detaches the programs: pods are not steered until the next agent attaches its own, and every connection the agent proxies is reset. Fix the node: mount a bpf filesystem at /sys/fs/bpf (deploy/README.md)";

/// Makes `bpffs` (the pin directory) lie on a bpf filesystem: already so, or one mounted at its
/// parent when that is an empty directory (or can be created) and this process may mount.
pub(crate) fn ensure(bpffs: &Path) -> Handover {
    if on_bpffs(bpffs) {
        return Handover {
            available: true,
            mounted: None,
            unavailable: None,
        };
    }
    let at = bpffs.parent().unwrap_or(bpffs);
    match mount(at) {
        Ok(()) if on_bpffs(bpffs) => Handover {
            available: true,
            mounted: Some(at.to_path_buf()),
            unavailable: None,
        },
        Ok(()) => Handover {
            available: false,
            mounted: None,
            unavailable: Some(format!(
                "{} is still not on a bpf filesystem after mounting one at {}; {COST}",
                bpffs.display(),
                at.display()
            )),
        },
        Err(why) => Handover {
            available: false,
            mounted: None,
            unavailable: Some(format!(
                "{} is not on a bpf filesystem and none could be mounted at {}: {why}; {COST}",
                bpffs.display(),
                at.display()
            )),
        },
    }
}

/// Mounts a bpf filesystem at `at`, never over anything: `at` must be an empty directory or not
/// exist yet.
fn mount(at: &Path) -> Result<(), String> {
    if at.exists() {
        let mut entries = std::fs::read_dir(at).map_err(|e| format!("reading it: {e}"))?;
        if entries.next().is_some() {
            return Err("it is not empty, and a mount would hide what it holds".to_string());
        }
    } else {
        std::fs::create_dir_all(at).map_err(|e| format!("creating it: {e}"))?;
    }
    let target = CString::new(at.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            c"mode=0700".as_ptr().cast(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::EPERM) => format!(
                "{err} (mounting needs CAP_SYS_ADMIN: a container gets the node's bpffs mounted in instead)"
            ),
            _ => err.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_with_contents_is_never_mounted_over() {
        let dir = std::env::temp_dir().join(format!("redirect-bpffs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("keep")).unwrap();
        let h = ensure(&dir.join("redirect"));
        assert!(!h.available, "{h:?}");
        let why = h.unavailable.unwrap();
        assert!(why.contains("not empty"), "{why}");
        assert!(why.contains("rollout"), "{why}");
        assert!(dir.join("keep").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
