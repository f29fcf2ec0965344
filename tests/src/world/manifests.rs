//! The test's private copy of the manifests, and edits to it that a watcher never sees half-done.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};

/// The repository's `examples/`.
pub fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Copies the manifests of `examples/` (not its README) into a new directory `to`.
pub fn copy_examples(to: &Path) -> Result<()> {
    copy_manifests(&examples_dir(), to)
}

/// Makes every Pod of `dir/name` dual-stack as the topology is: `status: {podIP: V4}` gains
/// `podIPs: [{ip: V4}, {ip: <pod_ip6 of V4>}]`, as a dual-stack kubelet reports it.
pub fn dual_stack_pods(dir: &Path, name: &str) -> Result<()> {
    let text = fs::read_to_string(dir.join(name))?;
    let mut out = String::with_capacity(text.len());
    let mut changed = 0;
    for line in text.split_inclusive('\n') {
        let v4 = line
            .trim_end()
            .strip_prefix("status: {podIP: ")
            .and_then(|rest| rest.strip_suffix('}'))
            .and_then(|ip| ip.parse::<std::net::Ipv4Addr>().ok());
        match v4 {
            Some(v4) => {
                let v6 = crate::pod_ip6(v4);
                out.push_str(&format!(
                    "status: {{podIP: {v4}, podIPs: [{{ip: {v4}}}, {{ip: \"{v6}\"}}]}}\n"
                ));
                changed += 1;
            }
            None => out.push_str(line),
        }
    }
    ensure!(changed > 0, "{name} has no `status: {{podIP: ...}}` line");
    replace_file(dir, name, &out)
}

/// Copies the `.yaml` files of `from` into a new directory `to`.
pub fn copy_manifests(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path.file_name().context("file name")?;
            fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// Replaces `dir/name` with `contents` in one step (written beside `dir`, then renamed over), so a
/// watcher never reads half a file.
pub fn replace_file(dir: &Path, name: &str, contents: &str) -> Result<()> {
    let parent = dir.parent().context("config dir has no parent")?;
    let staged = parent.join(format!(".staged-{name}"));
    fs::write(&staged, contents)?;
    fs::rename(&staged, dir.join(name))
        .with_context(|| format!("renaming {} into {}", staged.display(), dir.display()))?;
    Ok(())
}

/// Reads `dir/name`, replaces `from` with `to` (which must occur), and writes it back with
/// [`replace_file`].
pub fn edit_file(dir: &Path, name: &str, from: &str, to: &str) -> Result<()> {
    let text = fs::read_to_string(dir.join(name))?;
    ensure!(text.contains(from), "{name} does not contain {from:?}");
    replace_file(dir, name, &text.replacen(from, to, 1))
}
