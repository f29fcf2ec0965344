//! Which files of a configuration directory are read, and how: only regular files with a manifest
//! extension, each through a size cap, and all of them through a cap for the directory.
//!
//! A FIFO, a device (a link to `/dev/zero`), a socket, a subdirectory, a hidden entry or a file with
//! another extension is never opened: the watcher and the loader both list files here, so neither
//! can block on one or read one in full.
use std::{
    fs::{self, File, Metadata},
    io::Read,
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// Extensions the loader reads; anything else in the directory is ignored, unread.
pub(super) const EXTENSIONS: [&str; 3] = [".yaml", ".yml", ".json"];

/// The input bounds of one load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The largest file read, in bytes. A file's YAML expanded through its aliases may count at
    /// most twice this ([`Limits::expansion_budget`]).
    pub max_file_bytes: u64,
    /// The most read from the directory in one load, in bytes.
    pub max_dir_bytes: u64,
}

/// Kubernetes stores no object over about 1.5 MB (etcd's limit) and no ConfigMap over 1 MiB: a
/// file of 4 MiB holds several of the largest objects a cluster can have.
impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_file_bytes: 4 << 20,
            max_dir_bytes: 32 << 20,
        }
    }
}

impl Limits {
    /// What one file's documents may expand to through YAML aliases, in bytes of text plus 16 per
    /// node (about what a node costs in memory): twice the file limit.
    pub(crate) fn expansion_budget(&self) -> usize {
        usize::try_from(self.max_file_bytes.saturating_mul(2)).unwrap_or(usize::MAX)
    }
}

/// A manifest file to read: a regular file (links followed) with a manifest extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub path: PathBuf,
    /// What `stat` says; a change of any of these is a change of the file.
    pub len: u64,
    pub modified_ns: i128,
    pub inode: (u64, u64),
}

/// What identifies a file's version without reading it.
pub(crate) type FileStat = (u64, i128, (u64, u64));

impl Candidate {
    pub(crate) fn stat(&self) -> FileStat {
        (self.len, self.modified_ns, self.inode)
    }

    fn new(path: PathBuf, meta: &Metadata) -> Self {
        Candidate {
            path,
            len: meta.len(),
            modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            inode: (meta.dev(), meta.ino()),
        }
    }
}

/// Whether a directory entry's name is one the loader reads: not hidden (a mounted ConfigMap's
/// `..data` links), with a manifest extension.
pub(super) fn is_manifest_name(name: &str) -> bool {
    !name.starts_with('.') && EXTENSIONS.iter().any(|ext| name.ends_with(ext))
}

/// The files a load reads, sorted by name: `path` itself when it is a file, else the manifests
/// directly in it. Entries that are not regular files are left out without being opened.
pub(crate) fn list(path: &Path) -> Result<Vec<Candidate>, String> {
    let meta = fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if meta.is_file() {
        return Ok(vec![Candidate::new(path.to_path_buf(), &meta)]);
    }
    if !meta.is_dir() {
        return Err("not a regular file or a directory".into());
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(|e| format!("cannot list directory: {e}"))? {
        let entry = entry.map_err(|e| format!("cannot list directory: {e}"))?;
        let name = entry.file_name();
        if !is_manifest_name(&name.to_string_lossy()) {
            continue;
        }
        // `metadata` follows links (ConfigMap files link into `..data/`); a link to a device or a
        // FIFO shows as what it points to, and is left out here.
        match fs::metadata(entry.path()) {
            Ok(meta) if meta.is_file() => files.push(Candidate::new(entry.path(), &meta)),
            Ok(_) => tracing::debug!(file = %entry.path().display(), "not a regular file: ignored"),
            Err(_) => {} // gone since listing, or a dangling link
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// Reads one file as text, at most `max` bytes. Opened non-blocking and checked again once open,
/// so a file swapped for a FIFO after listing cannot stall the caller.
pub(crate) fn read(path: &Path, max: u64) -> Result<String, String> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file: not read".into());
    }
    if meta.len() > max {
        return Err(too_large(meta.len(), max));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // One byte past the cap tells a file that grew since `stat` from one that fits.
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64, max));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

fn too_large(len: u64, max: u64) -> String {
    format!(
        "{len} bytes is more than the {max}-byte limit for one file (--config-max-file-bytes): not read"
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{
        ffi::CString,
        time::{Duration, Instant},
    };

    use super::*;

    pub(crate) fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("redirect-source-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    pub(crate) fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    #[test]
    fn lists_only_regular_manifest_files() {
        let dir = temp_dir("list");
        fs::write(dir.join("b.yaml"), "kind: Namespace").unwrap();
        fs::write(dir.join("a.json"), "{}").unwrap();
        fs::write(dir.join("notes.txt"), "ignored").unwrap();
        fs::write(dir.join(".hidden.yaml"), "ignored").unwrap();
        fs::create_dir(dir.join("sub.yaml")).unwrap();
        mkfifo(&dir.join("pipe.yaml"));
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).unwrap();
        std::os::unix::fs::symlink("b.yaml", dir.join("link.yml")).unwrap();
        let started = Instant::now();
        let names: Vec<String> = list(&dir)
            .unwrap()
            .iter()
            .map(|c| c.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a.json", "b.yaml", "link.yml"]);
        assert!(started.elapsed() < Duration::from_secs(1));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_through_a_cap_and_never_blocks_on_a_fifo() {
        let dir = temp_dir("read");
        fs::write(dir.join("small.yaml"), "a: 1\n").unwrap();
        fs::write(dir.join("big.yaml"), vec![b'a'; 2000]).unwrap();
        fs::write(dir.join("binary.yaml"), [0xff, 0xfe]).unwrap();
        mkfifo(&dir.join("pipe.yaml"));
        assert_eq!(read(&dir.join("small.yaml"), 100).unwrap(), "a: 1\n");
        let big = read(&dir.join("big.yaml"), 100).unwrap_err();
        assert!(
            big.contains("2000 bytes") && big.contains("100-byte"),
            "{big}"
        );
        assert!(
            read(&dir.join("binary.yaml"), 100)
                .unwrap_err()
                .contains("UTF-8")
        );
        let started = Instant::now();
        let fifo = read(&dir.join("pipe.yaml"), 100).unwrap_err();
        assert!(fifo.contains("not a regular file"), "{fifo}");
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(read(Path::new("/dev/zero"), 100).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
