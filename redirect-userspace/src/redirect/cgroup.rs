//! Checks on the cgroup the programs attach to: it must be cgroup v2 and never the hierarchy's root
//! (that would steer every process on the machine, the agent's neighbours included).
use std::{
    fs::File,
    io,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

#[derive(Debug, thiserror::Error)]
pub(crate) enum CgroupError {
    #[error("cgroup {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not a cgroup v2 directory (cgroup v2 is mounted at: {mounts})")]
    NotCgroup2 { path: PathBuf, mounts: String },
    #[error(
        "{path} is the root of the cgroup v2 hierarchy; attach to the pods' parent cgroup instead"
    )]
    Root { path: PathBuf },
}

/// Opens `path` after checking it is a non-root cgroup v2 directory.
pub(crate) fn check_attachable(path: &Path) -> Result<File, CgroupError> {
    let open_err = |source| CgroupError::Open {
        path: path.to_path_buf(),
        source,
    };
    let canonical = path.canonicalize().map_err(open_err)?;
    let dir = File::open(&canonical).map_err(open_err)?;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: valid fd and a buffer of the right type; the kernel fills it on success.
    let rc = unsafe { libc::fstatfs(dir.as_raw_fd(), fs.as_mut_ptr()) };
    if rc != 0 {
        return Err(open_err(io::Error::last_os_error()));
    }
    // SAFETY: fstatfs returned 0, so the struct is initialised.
    let fs_type = unsafe { fs.assume_init() }.f_type;
    let mounts = cgroup2_mount_points().unwrap_or_default();
    #[expect(
        clippy::useless_conversion,
        reason = "`f_type` is an i64 on 64-bit Linux, narrower on 32-bit"
    )]
    let fs_type = i64::from(fs_type);
    if fs_type != CGROUP2_SUPER_MAGIC {
        return Err(CgroupError::NotCgroup2 {
            path: path.to_path_buf(),
            mounts: join_paths(&mounts),
        });
    }
    if mounts.contains(&canonical) {
        return Err(CgroupError::Root {
            path: path.to_path_buf(),
        });
    }
    Ok(dir)
}

/// Mount points of the cgroup v2 hierarchy, from /proc/self/mountinfo (never hard-coded: hybrid
/// systems mount it at /sys/fs/cgroup/unified, unified ones at /sys/fs/cgroup).
pub fn cgroup2_mount_points() -> io::Result<Vec<PathBuf>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_cgroup2_mounts(&mountinfo))
}

fn parse_cgroup2_mounts(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // "<id> <parent> <dev> <root> <mount point> <opts> [optional...] - <fstype> <source> <opts>"
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let mount_point = left.split_whitespace().nth(4)?;
            (fstype == "cgroup2").then(|| PathBuf::from(unescape_octal(mount_point)))
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as `\040`-style octal escapes (of bytes).
fn unescape_octal(field: &str) -> String {
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
    String::from_utf8_lossy(&out).into_owned()
}

fn join_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "nowhere".to_string();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_and_unified_layouts() {
        let hybrid = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            parse_cgroup2_mounts(hybrid),
            vec![PathBuf::from("/sys/fs/cgroup/unified")]
        );
        let unified =
            "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            parse_cgroup2_mounts(unified),
            vec![PathBuf::from("/sys/fs/cgroup")]
        );
        let v1_only = "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n";
        assert!(parse_cgroup2_mounts(v1_only).is_empty());
    }

    #[test]
    fn unescapes_mount_points_with_spaces() {
        let line = "41 31 0:38 / /mnt/my\\040cgroup rw - cgroup2 none rw\n";
        assert_eq!(
            parse_cgroup2_mounts(line),
            vec![PathBuf::from("/mnt/my cgroup")]
        );
    }

    #[test]
    fn refuses_a_directory_that_is_not_cgroup2() {
        let err = check_attachable(Path::new("/tmp")).unwrap_err();
        assert!(matches!(err, CgroupError::NotCgroup2 { .. }), "{err}");
    }

    #[test]
    fn refuses_a_missing_directory() {
        let err = check_attachable(Path::new("/nonexistent/cgroup")).unwrap_err();
        assert!(matches!(err, CgroupError::Open { .. }), "{err}");
    }
}
