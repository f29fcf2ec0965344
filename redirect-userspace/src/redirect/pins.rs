//! The programs' state pinned on a bpf filesystem, so that it outlives one agent process.
//!
//! ```text
//! DIR/layout          one-entry array: the layout version of everything below
//! DIR/maps/NAME       the maps the programs share (flows, sockets, opted-out cgroups, counters)
//! DIR/links/PROGRAM   one bpf_link per hook, attached to the pods' cgroup
//! ```
//!
//! A pinned link stays attached when its process dies. A successor loads its own programs on the
//! pinned maps and swaps each link's program in place (`BPF_LINK_UPDATE`): a hook is never missing
//! and never run twice, and a flow filed by the old program is found by the new agent. Every change
//! to the directory happens under an exclusive `flock` on it, so an agent exiting and one taking
//! over never interleave.
//!
//! Only links attached to the agent's own cgroup are adopted. A link severed by the kernel (its
//! cgroup was removed, perhaps made again at the same path) or attached to another cgroup steers
//! none of its pods: it is unpinned with everything else of the directory, and the agent attaches
//! anew ([`PinnedLink::unadoptable`], [`PinDir::clear_for`]).
use std::{
    ffi::CString,
    fs::{self, File},
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use aya::maps::{Array, Map, MapData};

/// Bump whenever a pinned map's key, value, size or meaning changes, or the set of pinned objects
/// does: an agent adopts only state whose version it knows.
pub(crate) const LAYOUT_VERSION: u32 = 5;

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

#[derive(Debug, thiserror::Error)]
pub(crate) enum PinError {
    #[error("pin directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{path} is not on a bpf filesystem (mount one, e.g. `mount -t bpf bpf /sys/fs/bpf`, or mount the host's /sys/fs/bpf into the container)"
    )]
    NotBpffs { path: PathBuf },
    #[error("layout key {path}: {source}")]
    Layout {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
}

/// What a pin directory held when an agent locked it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    /// Nothing: this agent creates and pins everything.
    Empty,
    /// State of this agent's layout: adopted as it is.
    Ours,
    /// State this agent does not know how to read (another layout version, or no layout key):
    /// never adopted, only removed.
    Unknown(String),
}

/// A locked pin directory. The lock (an exclusive `flock`) is held until this is dropped.
pub(crate) struct PinDir {
    path: PathBuf,
    _lock: File,
}

impl PinDir {
    /// Creates `path` if needed, checks it is on a bpf filesystem, and locks it (waiting for a
    /// concurrent agent to finish its own change).
    pub(crate) fn lock(path: &Path) -> Result<PinDir, PinError> {
        let io_err = |source| PinError::Io {
            path: path.to_path_buf(),
            source,
        };
        fs::create_dir_all(path).map_err(io_err)?;
        if !is_bpffs(path).map_err(io_err)? {
            return Err(PinError::NotBpffs {
                path: path.to_path_buf(),
            });
        }
        let lock = File::open(path).map_err(io_err)?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err(io::Error::last_os_error()));
        }
        for sub in ["maps", "links"] {
            fs::create_dir_all(path.join(sub)).map_err(io_err)?;
        }
        Ok(PinDir {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn map_path(&self, name: &str) -> PathBuf {
        self.path.join("maps").join(name)
    }

    pub(crate) fn link_path(&self, program: &str) -> PathBuf {
        self.path.join("links").join(program)
    }

    fn layout_path(&self) -> PathBuf {
        self.path.join("layout")
    }

    /// What the directory holds.
    pub(crate) fn found(&self) -> Found {
        let layout = self.layout_path();
        let pinned = self.pinned_names("maps").len() + self.pinned_names("links").len();
        if !layout.exists() {
            return if pinned == 0 {
                Found::Empty
            } else {
                Found::Unknown(format!("{pinned} pinned objects but no layout key"))
            };
        }
        match read_layout(&layout) {
            Ok(LAYOUT_VERSION) => Found::Ours,
            Ok(other) => Found::Unknown(format!(
                "layout version {other} (this agent knows {LAYOUT_VERSION})"
            )),
            Err(e) => Found::Unknown(format!("an unreadable layout key ({e})")),
        }
    }

    /// Writes this agent's layout key: done last, once everything it describes is pinned.
    pub(crate) fn write_layout(&self) -> Result<(), PinError> {
        let path = self.layout_path();
        let layout_err = |source| PinError::Layout {
            path: path.clone(),
            source,
        };
        let _ = fs::remove_file(&path);
        let mut key: Array<MapData, u32> = Array::create(1, 0).map_err(layout_err)?;
        key.set(0, LAYOUT_VERSION, 0).map_err(layout_err)?;
        key.pin(&path).map_err(|e| PinError::Io {
            path: path.clone(),
            source: io::Error::other(e.to_string()),
        })
    }

    /// The pinned link of `program`, if there is one.
    pub(crate) fn link(&self, program: &str) -> io::Result<Option<PinnedLink>> {
        let path = self.link_path(program);
        if !path.exists() {
            return Ok(None);
        }
        Ok(Some(PinnedLink {
            fd: obj_get(&path)?,
            path,
        }))
    }

    /// Every pinned link, by program name.
    pub(crate) fn links(&self) -> Vec<(String, io::Result<PinnedLink>)> {
        self.pinned_names("links")
            .into_iter()
            .map(|name| {
                let path = self.link_path(&name);
                let link = obj_get(&path).map(|fd| PinnedLink { fd, path });
                (name, link)
            })
            .collect()
    }

    /// Detaches every pinned link (even one another process still holds) and removes every pinned
    /// object: afterwards nothing of this directory is attached. Returns how many links it detached.
    pub(crate) fn clear(&self) -> Result<usize, PinError> {
        self.clear_detaching(|_| true)
    }

    /// Removes every pinned object, as [`PinDir::clear`] does, but detaches only the links attached
    /// to the cgroup of id `ours`. Any other link is only unpinned: one nobody else holds goes with
    /// its pin (the kernel detaches it), one an agent still running holds stays attached to that
    /// agent's cgroup until it exits. A severed link is attached to nothing; unpinned, it is gone.
    /// Returns how many links it detached.
    pub(crate) fn clear_for(&self, ours: u64) -> Result<usize, PinError> {
        self.clear_detaching(|link| matches!(link.state(), Ok(s) if s.cgroup_id == ours))
    }

    fn clear_detaching(&self, detach: impl Fn(&PinnedLink) -> bool) -> Result<usize, PinError> {
        let mut detached = 0;
        for (_, link) in self.links() {
            if let Ok(link) = link
                && detach(&link)
                && link.detach().is_ok()
            {
                detached += 1;
            }
        }
        for sub in ["links", "maps"] {
            for name in self.pinned_names(sub) {
                let path = self.path.join(sub).join(name);
                fs::remove_file(&path).map_err(|source| PinError::Io { path, source })?;
            }
        }
        match fs::remove_file(self.layout_path()) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(PinError::Io {
                    path: self.layout_path(),
                    source,
                });
            }
        }
        Ok(detached)
    }

    /// [`PinDir::clear`], then the directory itself (best effort: another agent may be waiting on it).
    pub(crate) fn remove(self) -> Result<usize, PinError> {
        let detached = self.clear()?;
        for sub in ["links", "maps"] {
            let _ = fs::remove_dir(self.path.join(sub));
        }
        let _ = fs::remove_dir(&self.path);
        Ok(detached)
    }

    fn pinned_names(&self, sub: &str) -> Vec<String> {
        fs::read_dir(self.path.join(sub))
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A bpf_link opened from its pin.
pub(crate) struct PinnedLink {
    fd: OwnedFd,
    path: PathBuf,
}

/// What the kernel says a cgroup link runs and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinkState {
    pub prog_id: u32,
    /// The cgroup the link is attached to; 0 once it is attached to none (severed or detached).
    pub cgroup_id: u64,
}

/// Why an agent cannot adopt a pinned link: it steers none of the agent's pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unadoptable {
    /// Attached to no cgroup: the kernel severed it when its cgroup was removed (or it was
    /// detached). `BPF_LINK_UPDATE` on it fails with `ENOLINK`.
    Severed,
    /// Attached to a cgroup that no longer exists: removed, and not yet released by the kernel
    /// (which severs the link then).
    Removed { cgroup_id: u64 },
    /// Attached to another cgroup, which exists.
    OtherCgroup { cgroup_id: u64 },
    /// Attached to another cgroup, which may since have been removed: the kernel would not say
    /// (`why`).
    NotOurs { cgroup_id: u64, why: String },
}

impl std::fmt::Display for Unadoptable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unadoptable::Severed => f.write_str(
                "severed: attached to no cgroup (its cgroup was removed, or the link was detached)",
            ),
            Unadoptable::Removed { cgroup_id } => {
                write!(f, "attached to cgroup id {cgroup_id}, which was removed")
            }
            Unadoptable::OtherCgroup { cgroup_id } => {
                write!(f, "attached to another cgroup (id {cgroup_id})")
            }
            Unadoptable::NotOurs { cgroup_id, why } => write!(
                f,
                "attached to another cgroup (id {cgroup_id}), or to one since removed (could not tell which: {why})"
            ),
        }
    }
}

impl PinnedLink {
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The program the link runs now and the cgroup it is attached to (0 once detached).
    pub(crate) fn state(&self) -> io::Result<LinkState> {
        // struct bpf_link_info: type, id, prog_id, then (8-aligned) the cgroup's id and attach type.
        #[repr(C)]
        #[derive(Default)]
        struct Info {
            link_type: u32,
            id: u32,
            prog_id: u32,
            _pad: u32,
            cgroup_id: u64,
            attach_type: u32,
            _pad2: u32,
        }
        #[repr(C)]
        struct Attr {
            bpf_fd: u32,
            info_len: u32,
            info: u64,
        }
        let mut info = Info::default();
        let mut attr = Attr {
            bpf_fd: self.fd.as_raw_fd() as u32,
            info_len: size_of::<Info>() as u32,
            info: &mut info as *mut Info as u64,
        };
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok(LinkState {
            prog_id: info.prog_id,
            cgroup_id: info.cgroup_id,
        })
    }

    /// Why an agent serving the cgroup of id `ours` (open as `cgroup`) cannot adopt this link;
    /// `None` when it can (the link is attached to that cgroup).
    pub(crate) fn unadoptable(&self, cgroup: &File, ours: u64) -> io::Result<Option<Unadoptable>> {
        let pinned = self.state()?.cgroup_id;
        if pinned == ours {
            return Ok(None);
        }
        if pinned == 0 {
            return Ok(Some(Unadoptable::Severed));
        }
        Ok(Some(match cgroup_exists(cgroup, pinned) {
            Ok(true) => Unadoptable::OtherCgroup { cgroup_id: pinned },
            Ok(false) => Unadoptable::Removed { cgroup_id: pinned },
            Err(e) => Unadoptable::NotOurs {
                cgroup_id: pinned,
                why: e.to_string(),
            },
        }))
    }

    /// Makes the link run `program` instead of what it runs now, in one step.
    pub(crate) fn update(&self, program: BorrowedFd<'_>) -> io::Result<()> {
        #[repr(C)]
        struct Attr {
            link_fd: u32,
            new_prog_fd: u32,
            flags: u32,
            old_prog_fd: u32,
        }
        let mut attr = Attr {
            link_fd: self.fd.as_raw_fd() as u32,
            new_prog_fd: program.as_raw_fd() as u32,
            flags: 0,
            old_prog_fd: 0,
        };
        bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
    }

    /// Detaches the link now, whoever else holds it.
    pub(crate) fn detach(&self) -> io::Result<()> {
        #[repr(C)]
        struct Attr {
            link_fd: u32,
        }
        let mut attr = Attr {
            link_fd: self.fd.as_raw_fd() as u32,
        };
        bpf(BPF_LINK_DETACH, &mut attr).map(drop)
    }
}

/// The cgroup id of a cgroup v2 directory (its inode number, as the kernel reports it).
pub(crate) fn cgroup_id(dir: &File) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(dir.metadata()?.ino())
}

/// Whether the cgroup of id `id` exists (is not removed) on the cgroup v2 hierarchy `on` is a
/// directory of: opened by its file handle, which is the id (`FILEID_KERNFS`). `ESTALE` says it is
/// gone. Opening by handle needs `CAP_DAC_READ_SEARCH`; without it this is an error (`EPERM`).
fn cgroup_exists(on: &File, id: u64) -> io::Result<bool> {
    const FILEID_KERNFS: i32 = 0xfe;
    #[repr(C)]
    struct Handle {
        handle_bytes: u32,
        handle_type: i32,
        id: u64,
    }
    let mut handle = Handle {
        handle_bytes: size_of::<u64>() as u32,
        handle_type: FILEID_KERNFS,
        id,
    };
    // SAFETY: a live descriptor and a `struct file_handle` whose `handle_bytes` match its payload.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            on.as_raw_fd(),
            &mut handle as *mut Handle,
            libc::O_PATH | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ESTALE) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: open_by_handle_at returned a new descriptor that nothing else owns.
    drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    Ok(true)
}

fn read_layout(path: &Path) -> Result<u32, aya::maps::MapError> {
    let data = MapData::from_pin(path)?;
    let key: Array<MapData, u32> = Array::try_from(Map::Array(data))?;
    key.get(&0, 0)
}

/// Whether `path`, or its nearest existing ancestor (where it would be created), is on a bpf
/// filesystem.
pub(crate) fn on_bpffs(path: &Path) -> bool {
    path.ancestors()
        .find(|p| p.exists())
        .is_some_and(|p| is_bpffs(p).unwrap_or(false))
}

fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: a NUL-terminated path and a buffer of the right type.
    if unsafe { libc::statfs(c.as_ptr(), fs.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[expect(
        clippy::useless_conversion,
        reason = "`f_type` is an i64 on 64-bit Linux, narrower on 32-bit"
    )]
    // SAFETY: statfs returned 0, so the struct is initialised.
    let fs_type = i64::from(unsafe { fs.assume_init() }.f_type);
    Ok(fs_type == BPF_FS_MAGIC)
}

fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    #[repr(C)]
    struct Attr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut attr = Attr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The bpf(2) system call with a command's attribute struct (the kernel zero-extends a short one).
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, properly sized `#[repr(C)]` struct for `cmd`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_off_bpffs_is_refused_with_the_way_out() {
        assert!(!on_bpffs(Path::new("/tmp/redirect-not-bpffs/x")));
        let Err(err) = PinDir::lock(Path::new("/proc/redirect-pins")) else {
            panic!("/proc is no bpffs");
        };
        assert!(
            matches!(err, PinError::Io { .. } | PinError::NotBpffs { .. }),
            "{err}"
        );
    }
}
