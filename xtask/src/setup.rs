//! `cargo xtask setup`: everything the build, tests and demo need, installed idempotently.
//!
//! Every other command calls [`ensure`], which checks each piece cheaply and installs only what is
//! missing. bpf-linker is built against nightly's own LLVM and cached outside the clone, in a folder
//! named for its version and the LLVM version, so a fresh clone on the same machine reuses it.
use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use crate::cmd::{self, on_path, output};

pub(crate) const BPF_LINKER_VERSION: &str = "0.13.0";
/// The fuzz targets' runner (`cargo xtask fuzz`).
const CARGO_FUZZ_VERSION: &str = "0.13.2";
const NIGHTLY: &str = "nightly";

/// Debian packages, a binary each provides (the check that it is installed), and what it is for.
const DEBIAN_PACKAGES: &[(&str, &str, &str)] = &[
    (
        "dnsmasq-base",
        "/usr/sbin/dnsmasq",
        "the tests' real upstream resolver",
    ),
    ("bind9-dnsutils", "dig", "the tests' DNS client"),
    ("iproute2", "ip", "network namespaces and veths"),
    ("util-linux", "nsenter", "entering a pod's netns"),
    ("curl", "curl", "the tests' HTTP client"),
    ("bpftool", "bpftool", "checking the programs attached"),
    ("iperf3", "iperf3", "the bench's throughput"),
    ("sockperf", "sockperf", "the bench's latency"),
    ("wrk", "wrk", "the bench's HTTP load"),
    ("dnsperf", "dnsperf", "the bench's DNS load"),
    ("default-jdk-headless", "javac", "a JVM client in the suite"),
    (
        "kubernetes-client",
        "kubectl",
        "reading ServiceEntry status as users do (any kubectl on the PATH will do)",
    ),
    ("linux-perf", "perf", "`cargo xtask profile`"),
    (
        "podman",
        "podman",
        "builds the agent's image and runs it in the suite (`cargo xtask image`)",
    ),
    (
        "runc",
        "runc",
        "the OCI runtime podman runs the image with (crun refuses hybrid cgroup hierarchies)",
    ),
    ("binutils", "strip", "strips the agent for its image"),
    (
        "prometheus",
        "/usr/bin/prometheus",
        "the suite's real Prometheus, scraping the agent as a cluster's does",
    ),
    (
        "ca-certificates",
        "/etc/ssl/certs/ca-certificates.crt",
        "the CA bundle the image carries",
    ),
];

pub(crate) fn setup() -> anyhow::Result<()> {
    install(true)
}

/// Installs what is missing, saying nothing when everything is there.
pub(crate) fn ensure() -> anyhow::Result<()> {
    install(false)
}

fn install(verbose: bool) -> anyhow::Result<()> {
    let say = |msg: &str| {
        if verbose {
            println!("xtask setup: {msg}");
        }
    };
    say(&format!(
        "one line per step; the tools' own output goes to {}",
        setup_log().display()
    ));
    ensure_nightly_rust_src(&say)?;
    ensure_bpf_linker(&say)?;
    ensure_cargo_fuzz(&say)?;
    ensure_debian_packages(&say)?;
    ensure_manifest_validator(&say)?;
    ensure_vm_tools(&say)?;
    say("everything is installed");
    Ok(())
}

fn ensure_nightly_rust_src(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let Some(sysroot) = nightly_sysroot() else {
        println!("xtask setup: installing the nightly toolchain (it builds the eBPF programs)");
        logged(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
        ]))?;
        return ensure_nightly_rust_src(say);
    };
    if sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        say("nightly rust-src: present");
        return Ok(());
    }
    println!("xtask setup: adding rust-src to nightly (needed for -Z build-std=core)");
    logged(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))
}

fn nightly_sysroot() -> Option<PathBuf> {
    output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "--print", "sysroot"]))
        .map(|s| PathBuf::from(s.trim()))
        .filter(|p| p.is_dir())
}

/// nightly's LLVM version, e.g. "22.1.4".
fn nightly_llvm_version() -> anyhow::Result<String> {
    let version = output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "-vV"]))
        .context("running rustc +nightly -vV")?;
    version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .map(|v| v.trim().to_string())
        .context("rustc +nightly -vV printed no LLVM version")
}

/// Folder holding bpf-linker (bin/) and the LLVM link folder it was built against (llvm/lib).
pub(crate) fn bpf_linker_dir() -> anyhow::Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let llvm = nightly_llvm_version()?;
    Ok(PathBuf::from(home)
        .join(".cache/redirect-xtask")
        .join(format!("bpf-linker-{BPF_LINKER_VERSION}-llvm-{llvm}")))
}

fn ensure_bpf_linker(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let dir = bpf_linker_dir()?;
    let binary = dir.join("bin/bpf-linker");
    if output(Command::new(&binary).arg("--version")).is_some() {
        say(&format!("bpf-linker: cached at {}", binary.display()));
        return Ok(());
    }
    println!(
        "xtask setup: building bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM into {} (about 2 minutes, once per machine)",
        dir.display()
    );
    let sysroot = nightly_sysroot().context("nightly toolchain missing")?;
    let llvm_lib = dir.join("llvm/lib");
    fs::create_dir_all(&llvm_lib).with_context(|| format!("creating {}", llvm_lib.display()))?;
    let library = find_libllvm(&sysroot.join("lib"))?;
    let soname = library
        .file_name()
        .context("libLLVM path has no file name")?
        .to_owned();
    for link in [llvm_lib.join("libLLVM.so"), llvm_lib.join(&soname)] {
        let _ = fs::remove_file(&link);
        symlink(&library, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    let major = nightly_llvm_version()?
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    logged(
        cmd::cargo()
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
            ])
            .arg("--root")
            .arg(&dir)
            .env("LLVM_PREFIX", dir.join("llvm")),
    )?;
    if output(Command::new(&binary).arg("--version")).is_none() {
        bail!("bpf-linker was built but {} does not run", binary.display());
    }
    Ok(())
}

/// cargo-fuzz at [`CARGO_FUZZ_VERSION`], from crates.io into cargo's own bin folder (it is a cargo
/// subcommand); built once per machine, in about half a minute.
fn ensure_cargo_fuzz(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let wanted = format!("cargo-fuzz {CARGO_FUZZ_VERSION}");
    if output(cmd::cargo().args(["fuzz", "--version"])).is_some_and(|v| v.trim() == wanted) {
        say(&format!("{wanted}: present"));
        return Ok(());
    }
    println!("xtask setup: installing {wanted} (runs the fuzz targets)");
    logged(cmd::cargo().args([
        "install",
        "cargo-fuzz",
        "--locked",
        "--version",
        CARGO_FUZZ_VERSION,
    ]))
}

/// The `libLLVM.so.<version>` file of the nightly sysroot (its name is its soname).
fn find_libllvm(lib: &Path) -> anyhow::Result<PathBuf> {
    let entries = fs::read_dir(lib).with_context(|| format!("reading {}", lib.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("libLLVM.so.") {
            return Ok(entry.path());
        }
    }
    bail!("no libLLVM.so.* in {}", lib.display())
}

fn ensure_debian_packages(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let missing: Vec<&(&str, &str, &str)> = DEBIAN_PACKAGES
        .iter()
        .filter(|(_, binary, _)| !on_path(binary))
        .collect();
    if missing.is_empty() {
        say("Debian packages: present");
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|(package, _, _)| *package).collect();
    if !is_root() {
        bail!(
            "installing {} needs root: run `sudo cargo xtask setup`",
            names.join(" ")
        );
    }
    for (package, _, why) in &missing {
        println!("xtask setup: installing {package} ({why})");
    }
    logged(Command::new("apt-get").args(["update", "-q"]))?;
    logged(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&names)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    // The tests start their own Prometheus in a namespace of theirs; the package's service, started
    // by its install where systemd runs, would be a server in the machine's own namespace.
    if names.contains(&"prometheus") && on_path("systemctl") {
        let _ = Command::new("systemctl")
            .args(["disable", "--now", "prometheus"])
            .output();
    }
    Ok(())
}

/// qemu, a static busybox for the guest's initramfs and kmod (depmod, modprobe) for its modules.
/// qemu-system-x86 comes from bookworm-backports: a backports qemu-utils (as on these machines)
/// blocks bookworm's own.
fn ensure_vm_tools(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let qemu = on_path("qemu-system-x86_64");
    let busybox = output(Command::new("dpkg-query").args(["-W", "-f=${Status}", "busybox-static"]))
        .is_some_and(|s| s.ends_with(" installed"));
    let kmod = ["/usr/sbin/depmod", "/sbin/depmod"]
        .iter()
        .any(|p| Path::new(p).exists());
    if qemu && busybox && kmod {
        say("VM tools (qemu-system-x86, busybox-static, kmod): present");
        return Ok(());
    }
    if !is_root() {
        bail!(
            "installing the VM tools (qemu-system-x86, busybox-static, kmod) needs root: run `sudo cargo xtask setup`"
        );
    }
    let mut plain: Vec<&str> = Vec::new();
    if !busybox {
        plain.push("busybox-static");
    }
    if !kmod {
        plain.push("kmod");
    }
    if !qemu {
        ensure_backports_source()?;
        println!("xtask setup: installing qemu-system-x86 from bookworm-backports");
        logged(Command::new("apt-get").args(["update", "-q"]))?;
        logged(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(["-t", BACKPORTS, "qemu-system-x86"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    if plain.is_empty() {
        return Ok(());
    }
    println!("xtask setup: installing {}", plain.join(" "));
    if qemu {
        logged(Command::new("apt-get").args(["update", "-q"]))?;
    }
    logged(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&plain)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

const BACKPORTS: &str = "bookworm-backports";
const BACKPORTS_SOURCE: &str = "/etc/apt/sources.list.d/bookworm-backports.sources";

/// Adds bookworm-backports to apt's sources unless some source already names it.
fn ensure_backports_source() -> anyhow::Result<()> {
    let mut sources = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        sources.extend(entries.flatten().map(|e| e.path()));
    }
    let named = sources
        .iter()
        .filter_map(|p| fs::read_to_string(p).ok())
        .any(|text| text.contains(BACKPORTS));
    if named {
        return Ok(());
    }
    println!("xtask setup: adding {BACKPORTS} to apt's sources ({BACKPORTS_SOURCE})");
    fs::write(
        BACKPORTS_SOURCE,
        format!(
            "# Added by `cargo xtask setup`: qemu-system-x86 for the VM tests.\nTypes: deb\nURIs: http://deb.debian.org/debian\nSuites: {BACKPORTS}\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        ),
    )
    .with_context(|| format!("writing {BACKPORTS_SOURCE}"))
}

/// The Kubernetes schema validator `deploy/validate` runs, in a virtualenv of its own (pinned with its
/// dependencies in deploy/validate-requirements.txt; the schemas ship inside its wheel, so it works
/// offline).
fn ensure_manifest_validator(say: &dyn Fn(&str)) -> anyhow::Result<()> {
    let requirements = cmd::workspace_root().join("deploy/validate-requirements.txt");
    let pins = fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let version = pins
        .lines()
        .find_map(|l| l.trim().strip_prefix("kubernetes-validate=="))
        .with_context(|| format!("{} pins no kubernetes-validate", requirements.display()))?
        .trim()
        .to_string();
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let venv = PathBuf::from(home).join(format!(
        ".cache/redirect-xtask/kubernetes-validate-{version}"
    ));
    let validator = venv.join("bin/kubernetes-validate");
    if output(Command::new(&validator).arg("--version")).is_some_and(|v| v.trim() == version) {
        say(&format!("kubernetes-validate {version}: present"));
        return Ok(());
    }
    println!(
        "xtask setup: installing kubernetes-validate {version} into {}",
        venv.display()
    );
    logged(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    logged(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
            .arg(&requirements),
    )
}

/// Where the tools' own output goes (apt's progress, cargo's build lines): kept out of the terminal,
/// shown only when a step fails.
fn setup_log() -> PathBuf {
    cmd::workspace_root().join("target/xtask-setup.log")
}

/// Runs one install step with its output appended to [`setup_log`]; on failure, says so with the end
/// of that output and where the rest is.
fn logged(command: &mut Command) -> anyhow::Result<()> {
    let log = setup_log();
    if let Some(dir) = log.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("opening {}", log.display()))?;
    let shown = format!("{command:?}");
    use std::io::Write as _;
    writeln!(file, "\n$ {shown}")?;
    let status = command
        .stdin(std::process::Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("starting {shown}"))?;
    if status.success() {
        return Ok(());
    }
    let text = fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(30)..].join("\n");
    bail!(
        "{shown} failed ({status}); its last lines:\n{tail}\n(the whole output is in {})",
        log.display()
    )
}

pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_keeps_its_output_out_of_the_terminal_and_shows_it_when_it_fails() {
        logged(Command::new("sh").args(["-c", "echo quiet-step-output"])).unwrap();
        let log = fs::read_to_string(setup_log()).unwrap();
        assert!(log.contains("quiet-step-output"));
        let err = logged(Command::new("sh").args(["-c", "echo boom-in-the-tail; exit 3"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("boom-in-the-tail"), "{err}");
        assert!(err.contains("xtask-setup.log"), "{err}");
    }
}
