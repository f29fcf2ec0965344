//! Embeds the eBPF object so one binary is all a node needs.
//!
//! `cargo xtask build` compiles `redirect-ebpf` with nightly and passes the object's path in
//! `REDIRECT_EBPF_OBJECT`. A plain `cargo build` (stable, no bpf-linker) embeds an empty object instead;
//! such a binary runs every offline command and refuses `redirect run` with a message saying why.
use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    embed_ebpf_object();
    record_git_revision();
}

/// `/config_dump` and `--version` name the commit a binary was built from.
fn record_git_revision() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let rev = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=REDIRECT_GIT_REV={rev}");
    // A commit moves HEAD's branch ref (loose or packed); a checkout moves HEAD. Only existing files
    // are named: cargo reruns the script on every build for a path that does not exist.
    let mut watched = Vec::new();
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        watched.push(PathBuf::from(&git_dir).join("HEAD"));
    }
    if let Some(common) = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]) {
        let common = PathBuf::from(common);
        watched.push(common.join("packed-refs"));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(common.join(branch));
        }
    }
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn embed_ebpf_object() {
    println!("cargo:rerun-if-env-changed=REDIRECT_EBPF_OBJECT");
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("redirect.bpf.o");
    match env::var_os("REDIRECT_EBPF_OBJECT") {
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo:rerun-if-changed={}", path.display());
            fs::copy(&path, &out)
                .unwrap_or_else(|e| panic!("copying eBPF object {}: {e}", path.display()));
        }
        None => fs::write(&out, []).expect("writing empty eBPF object placeholder"),
    }
}
