//! `cargo xtask image`: the agent's OCI image, built from the binary `cargo xtask build` makes, with
//! no registry: FROM scratch, holding the stripped binary and the libraries it links
//! (`deploy/image-rootfs`, which `deploy/Containerfile` runs too, so both images have one layout).
use std::{fs, path::Path, process::Command};

use anyhow::{Context, bail};

use crate::{build, cmd, setup::is_root};

/// The repository part of the image's name (podman's local store; push it wherever you like).
pub(crate) const REPOSITORY: &str = "localhost/redirect";
/// The OCI runtime podman is told to use: `crun` refuses hybrid cgroup hierarchies, `runc` runs
/// everywhere podman does.
pub(crate) const OCI_RUNTIME: &str = "runc";

/// Builds the agent, then its image; prints the image's names and size.
pub(crate) fn image() -> anyhow::Result<()> {
    let agent = build::build()?;
    from_binary(&agent).map(drop)
}

/// The image of the agent binary `agent`: tagged `localhost/redirect:<version>-<commit>` (the name
/// returned: it says exactly what is inside) and `localhost/redirect:<version>` (moved to the newest
/// build).
pub(crate) fn from_binary(agent: &Path) -> anyhow::Result<String> {
    if !is_root() {
        bail!(
            "podman keeps root's images in root's store, where the integration suite runs them: run `sudo cargo xtask image`"
        );
    }
    let version = binary_version(agent)?;
    let commit = commit();
    let dir = build::target_dir().join("image");
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let rootfs = dir.join("rootfs");
    cmd::run(
        Command::new(cmd::workspace_root().join("deploy/image-rootfs"))
            .arg(agent)
            .arg(&rootfs),
    )?;
    let containerfile = dir.join("Containerfile");
    fs::write(&containerfile, containerfile_text(&version, &commit))
        .with_context(|| format!("writing {}", containerfile.display()))?;
    let version_tag = format!("{REPOSITORY}:{version}");
    let tag = format!("{REPOSITORY}:{version}-{commit}");
    cmd::run(
        Command::new("podman")
            .args(["--runtime", OCI_RUNTIME, "build", "--quiet"])
            .args(["--tag", &tag, "--tag", &version_tag])
            .arg("--file")
            .arg(&containerfile)
            .arg(&dir),
    )?;
    let size_bytes = size(&tag)?;
    println!(
        "xtask: image built: {tag} (also {version_tag}), {:.1} MB ({size_bytes} bytes): the stripped agent, the glibc, libm and libgcc_s it links and the CA bundle, FROM scratch",
        size_bytes as f64 / 1e6
    );
    Ok(tag)
}

/// The Containerfile for a root file system already assembled by `deploy/image-rootfs` (the runtime
/// stage of `deploy/Containerfile`, with the same labels and entry point).
fn containerfile_text(version: &str, commit: &str) -> String {
    format!(
        "FROM scratch\n\
         COPY rootfs/ /\n\
         LABEL org.opencontainers.image.title=redirect \\\n      \
         org.opencontainers.image.version={version} \\\n      \
         org.opencontainers.image.revision={commit}\n\
         USER 0:0\n\
         ENTRYPOINT [\"/usr/local/bin/redirect\"]\n"
    )
}

/// `redirect --version` of the binary itself: the image is named for what it holds.
fn binary_version(agent: &Path) -> anyhow::Result<String> {
    let out = cmd::output(Command::new(agent).arg("--version"))
        .with_context(|| format!("running {} --version", agent.display()))?;
    out.split_whitespace()
        .nth(1)
        .map(str::to_string)
        .with_context(|| format!("{} --version printed {out:?}", agent.display()))
}

/// The checkout's commit (12 hex digits), `-dirty` when the work tree differs from it; `nogit`
/// outside a git checkout.
fn commit() -> String {
    let root = cmd::workspace_root();
    let Some(head) = cmd::output(Command::new("git").current_dir(&root).args([
        "rev-parse",
        "--short=12",
        "HEAD",
    ])) else {
        return "nogit".to_string();
    };
    let dirty = cmd::output(Command::new("git").current_dir(&root).args([
        "status",
        "--porcelain",
        "--untracked-files=no",
    ]))
    .is_some_and(|s| !s.trim().is_empty());
    format!("{}{}", head.trim(), if dirty { "-dirty" } else { "" })
}

/// The image's size as `podman image ls` shows it.
fn size(tag: &str) -> anyhow::Result<u64> {
    let out = cmd::output(Command::new("podman").args([
        "image",
        "inspect",
        "--format",
        "{{.Size}}",
        tag,
    ]))
    .with_context(|| format!("podman image inspect {tag}"))?;
    out.trim()
        .parse()
        .with_context(|| format!("podman image inspect {tag}: size {out:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_containerfile_names_the_version_and_commit_and_runs_the_agent() {
        let text = containerfile_text("0.1.0", "0123456789ab");
        assert!(text.starts_with("FROM scratch\n"), "{text}");
        assert!(
            text.contains("org.opencontainers.image.version=0.1.0"),
            "{text}"
        );
        assert!(
            text.contains("org.opencontainers.image.revision=0123456789ab"),
            "{text}"
        );
        assert!(
            text.contains("ENTRYPOINT [\"/usr/local/bin/redirect\"]"),
            "{text}"
        );
    }
}
