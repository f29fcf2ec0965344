//! What the offline commands read, as kubectl takes `-f`: files and directories in the order given
//! (each directory's manifests; with `recursive`, its subdirectories' too), `-` for standard input.
//! A path that cannot be read at all is an error before anything is loaded.
use std::{
    io::Read,
    path::{Path, PathBuf},
};

use super::{
    ConfigError, Limits,
    loader::{Loaded, Loader},
    source,
};

/// The name standard input goes by in errors.
pub(super) const STDIN: &str = "(stdin)";

/// Loads every input; `Err` names the first path that cannot be read at all.
pub(crate) fn read_inputs(
    paths: &[PathBuf],
    recursive: bool,
    limits: &Limits,
) -> Result<Loaded, ConfigError> {
    // Every path is listed before any is read: a typo in the last one is reported, not a half load.
    let mut listed: Vec<Option<Vec<source::Candidate>>> = Vec::with_capacity(paths.len());
    for path in paths {
        if path == Path::new("-") {
            listed.push(None);
            continue;
        }
        let files = list_tree(path, recursive)
            .map_err(|message| ConfigError::new(path.display().to_string(), None, None, message))?;
        listed.push(Some(files));
    }
    let mut loader = Loader::new(limits);
    for files in listed {
        match files {
            Some(files) => loader.add_files(files),
            None => match read_stdin(limits.max_file_bytes) {
                Ok(text) => loader.add_file(STDIN, &text),
                Err(message) => loader.file_error(STDIN, message),
            },
        }
    }
    Ok(loader.finish())
}

/// `path`'s manifests ([`source::list`]); with `recursive`, each subdirectory's after its own, in
/// name order. Hidden directories (a mounted ConfigMap's `..data`) are not entered.
fn list_tree(path: &Path, recursive: bool) -> Result<Vec<source::Candidate>, String> {
    let mut files = source::list(path)?;
    if !recursive || !path.is_dir() {
        return Ok(files);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| format!("cannot list directory: {e}"))?
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    for dir in dirs {
        files.extend(list_tree(&dir, true)?);
    }
    Ok(files)
}

fn read_stdin(max: u64) -> Result<String, String> {
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "more than the {max}-byte limit for one file (--config-max-file-bytes): not read"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_directories_in_order_subdirectories_only_when_recursive() {
        let root = source::tests::temp_dir("inputs-tree");
        let one = "apiVersion: v1\nkind: Namespace\nmetadata: {name: one}\n";
        let two = "apiVersion: v1\nkind: Namespace\nmetadata: {name: two}\n";
        let three = "apiVersion: v1\nkind: Namespace\nmetadata: {name: three}\n";
        std::fs::create_dir_all(root.join("sub/.hidden")).unwrap();
        std::fs::write(root.join("a.yaml"), one).unwrap();
        std::fs::write(root.join("sub/b.yaml"), two).unwrap();
        std::fs::write(root.join("sub/.hidden/c.yaml"), three).unwrap();
        let extra = source::tests::temp_dir("inputs-extra").join("d.yaml");
        std::fs::write(&extra, three).unwrap();
        let names = |loaded: &Loaded| loaded.model.namespaces.keys().cloned().collect::<Vec<_>>();

        let flat = read_inputs(std::slice::from_ref(&root), false, &Limits::default()).unwrap();
        assert_eq!(names(&flat), ["one"]);
        let deep = read_inputs(std::slice::from_ref(&root), true, &Limits::default()).unwrap();
        assert_eq!(names(&deep), ["one", "two"]);
        let both = read_inputs(&[root.clone(), extra], false, &Limits::default()).unwrap();
        assert_eq!(names(&both), ["one", "three"]);

        let missing = root.join("nope.yaml");
        let err = read_inputs(&[root, missing.clone()], false, &Limits::default()).unwrap_err();
        assert_eq!(err.file, missing.display().to_string());
        assert!(err.message.contains("cannot read"), "{err}");
    }
}
