//! Running commands: each is printed before it runs, so a log shows exactly what was done (the
//! runner is the bench crate's, shared).
use std::path::{Path, PathBuf};

pub(crate) use bench::cmd::{cargo, output, run};

/// The workspace root (xtask lives one level below it).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Whether `program` is on PATH (or an absolute path that exists).
pub(crate) fn on_path(program: &str) -> bool {
    if program.contains('/') {
        return Path::new(program).exists();
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
