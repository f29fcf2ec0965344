//! The integration suite inside a virtual machine running one of Debian's kernels.
//!
//! The host builds everything; the guest boots the kernel with a small initramfs, mounts the
//! host's root read-only with a tmpfs on top (so the tests see the same paths and tools, and
//! nothing they write reaches the host), runs the test binaries and writes their exit code to a
//! shared results folder.
mod initramfs;
mod kernel;
mod qemu;

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

pub(crate) use kernel::SERIES;

/// A kernel named on the command line.
pub(crate) enum KernelChoice {
    Series(&'static kernel::Series),
    Deb(PathBuf),
}

impl KernelChoice {
    /// `5.10`, `6.1`, `6.12`, `all` (every series, oldest first) or a path to a kernel `.deb`.
    pub(crate) fn parse(arg: &str) -> anyhow::Result<Vec<KernelChoice>> {
        if arg == "all" {
            return Ok(SERIES.iter().map(KernelChoice::Series).collect());
        }
        if let Some(series) = kernel::series(arg) {
            return Ok(vec![KernelChoice::Series(series)]);
        }
        let path = Path::new(arg);
        if arg.ends_with(".deb") && path.is_file() {
            return Ok(vec![KernelChoice::Deb(path.to_path_buf())]);
        }
        let known: Vec<&str> = SERIES.iter().map(|s| s.name).collect();
        bail!(
            "--kernel {arg}: expected one of {}, `all`, or the path of a kernel .deb",
            known.join(", ")
        )
    }

    fn label(&self) -> String {
        match self {
            KernelChoice::Series(s) => s.name.to_string(),
            KernelChoice::Deb(p) => p.display().to_string(),
        }
    }
}

/// One test binary to run in the guest, with its arguments (filters, libtest flags).
pub(crate) struct GuestTest {
    pub binary: PathBuf,
    pub args: Vec<String>,
}

/// What the guest needs besides the tests.
pub(crate) struct GuestEnv {
    pub workspace: PathBuf,
    /// Variables for the tests (REDIRECT_BIN, RDT_PEER_BIN).
    pub vars: Vec<(String, String)>,
    pub timeout: Duration,
}

/// How one kernel's run ended.
pub(crate) struct Outcome {
    pub kernel: String,
    /// `uname -r` as the guest printed it.
    pub release: String,
    pub passed: bool,
    pub elapsed: Duration,
}

/// Boots `choice` and runs `tests` inside; Err only when the VM itself could not run.
pub(crate) fn run(
    choice: &KernelChoice,
    tests: &[GuestTest],
    env: &GuestEnv,
) -> anyhow::Result<Outcome> {
    let kernel = match choice {
        KernelChoice::Series(series) => kernel::fetch_series(series)?,
        KernelChoice::Deb(deb) => kernel::from_deb(deb)?,
    };
    // One folder per run: two runs on the same kernel (CI's smoke and a matrix) must not share it.
    let results = env.workspace.join("target/vm").join(format!(
        "{}-{}",
        kernel.release.replace('/', "_"),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&results);
    fs::create_dir_all(&results).with_context(|| format!("creating {}", results.display()))?;
    let accel = qemu::accel();
    // The guest runs its own links: a rebuild on the host during a long run cannot swap binaries under it.
    let (tests, env) = &snapshot(tests, env, &results.join("bin"))?;
    let initramfs = results.join("initramfs.cpio");
    initramfs::write(&kernel, &initramfs)?;
    fs::write(
        results.join("guest.sh"),
        guest_script(&kernel.modules(), tests, env, time_scale(accel)),
    )
    .context("writing the guest script")?;

    let started = Instant::now();
    qemu::boot(&qemu::Boot {
        image: &kernel.image,
        initramfs: &initramfs,
        results: &results,
        accel,
        cpus: 2,
        memory_mib: 2048,
        timeout: env.timeout,
    })?;
    let elapsed = started.elapsed();
    // The copied binaries are large; the script, exit code and kernel name stay for a look.
    let _ = fs::remove_dir_all(results.join("bin"));
    let read = |name: &str| {
        fs::read_to_string(results.join(name))
            .map(|s| s.trim().to_string())
            .ok()
    };
    let Some(code) = read("rc") else {
        bail!(
            "the VM with kernel {} stopped before the tests finished (no exit code in {})",
            kernel.release,
            results.display()
        );
    };
    Ok(Outcome {
        kernel: choice.label(),
        release: read("uname").unwrap_or_else(|| "?".to_string()),
        passed: code == "0",
        elapsed,
    })
}

/// Links (or copies) every binary the guest runs (tests, and the variables naming files) into `dir`.
fn snapshot(
    tests: &[GuestTest],
    env: &GuestEnv,
    dir: &Path,
) -> anyhow::Result<(Vec<GuestTest>, GuestEnv)> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let copy = |path: &Path| -> anyhow::Result<PathBuf> {
        let name = path
            .file_name()
            .with_context(|| format!("{} has no file name", path.display()))?;
        let to = dir.join(name);
        // A hard link costs no disk and survives a rebuild (the linker writes a new file); a
        // copy only where the two paths are on different file systems.
        if fs::hard_link(path, &to).is_err() {
            fs::copy(path, &to)
                .with_context(|| format!("copying {} to {}", path.display(), to.display()))?;
        }
        Ok(to)
    };
    let tests = tests
        .iter()
        .map(|t| {
            Ok(GuestTest {
                binary: copy(&t.binary)?,
                args: t.args.clone(),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let vars = env
        .vars
        .iter()
        .map(|(key, value)| {
            let path = Path::new(value);
            let value = if path.is_file() {
                copy(path)?.display().to_string()
            } else {
                value.clone()
            };
            Ok((key.clone(), value))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let env = GuestEnv {
        workspace: env.workspace.clone(),
        vars,
        timeout: env.timeout,
    };
    Ok((tests, env))
}

/// The script the guest runs in the new root: the mounts a test machine has, the kernel's modules
/// where modprobe looks, then every test binary; the exit code goes to the results share.
fn guest_script(modules: &Path, tests: &[GuestTest], env: &GuestEnv, time_scale: u32) -> String {
    let workspace = quote(&env.workspace.display().to_string());
    let mut s = String::from(
        r#"#!/bin/bash
set -u
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
ln -sf /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr
mount -t devpts devpts /dev/pts
"#,
    );
    // The checkout may live under /tmp or /run (a clone in /tmp): held aside while fresh tmpfs go
    // on those, then put back where the tests look for it.
    let _ = writeln!(
        s,
        "mkdir -p /mnt/rdt-workspace && mount --bind {workspace} /mnt/rdt-workspace"
    );
    s.push_str(
        r#"mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
"#,
    );
    let _ = writeln!(
        s,
        "mkdir -p {workspace} && mount --move /mnt/rdt-workspace {workspace}"
    );
    s.push_str(
        r#"mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
release=$(uname -r)
mkdir -p /lib/modules/$release
"#,
    );
    let _ = writeln!(
        s,
        "mount --bind {} /lib/modules/$release",
        quote(&modules.display().to_string())
    );
    s.push_str(
        r#"ip link set lo up
echo "$release" > /rdt-results/uname
echo "vm: uname -r: $release"
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin RUST_BACKTRACE=1
"#,
    );
    // The harness stretches its timeouts and deadlines by this (tests/src/pace.rs).
    let _ = writeln!(s, "export RDT_TIME_SCALE={time_scale}");
    let _ = writeln!(s, "echo \"vm: test time budgets x{time_scale}\"");
    for (key, value) in &env.vars {
        let _ = writeln!(s, "export {key}={}", quote(value));
    }
    let _ = writeln!(s, "cd {}", quote(&env.workspace.display().to_string()));
    s.push_str("rc=0\n");
    for test in tests {
        let mut line = quote(&test.binary.display().to_string());
        for arg in &test.args {
            line.push(' ');
            line.push_str(&quote(arg));
        }
        let _ = writeln!(s, "echo \"vm: \\$ {}\"", line.replace('"', "\\\""));
        let _ = writeln!(s, "{line} || rc=1");
    }
    s.push_str("echo \"vm: tests on $release exited with $rc\"\necho $rc > /rdt-results/rc\n");
    s
}

/// How much slower than the host the guest runs, for the tests' time budgets: emulation is about 20
/// times slower; 10 covers the measured slowdown of the timed steps with room to spare.
fn time_scale(accel: qemu::Accel) -> u32 {
    match accel {
        qemu::Accel::Kvm => 1,
        qemu::Accel::Tcg => 10,
    }
}

/// Single-quoted for the shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_choices_name_the_series_or_a_package() {
        let all = KernelChoice::parse("all").unwrap();
        let labels: Vec<String> = all.iter().map(KernelChoice::label).collect();
        assert_eq!(labels, ["5.10", "6.1", "6.12"]);
        assert_eq!(KernelChoice::parse("6.12").unwrap()[0].label(), "6.12");
        let err = KernelChoice::parse("4.19").err().unwrap().to_string();
        assert!(err.contains("5.10, 6.1, 6.12"), "{err}");
    }

    #[test]
    fn guest_script_runs_every_test_and_reports_any_failure() {
        let tests = [
            GuestTest {
                binary: "/w/target/debug/deps/redirect_path-1".into(),
                args: vec![],
            },
            GuestTest {
                binary: "/w/target/debug/deps/visibility-2".into(),
                args: vec!["it's one".into(), "--exact".into()],
            },
        ];
        let env = GuestEnv {
            workspace: "/w".into(),
            vars: vec![("REDIRECT_BIN".into(), "/w/target/release/redirect".into())],
            timeout: Duration::from_secs(1),
        };
        let s = guest_script(Path::new("/k/lib/modules/6.1.0-1-amd64"), &tests, &env, 10);
        assert!(s.contains("export RDT_TIME_SCALE=10\n"));
        assert!(s.contains("mount --bind '/k/lib/modules/6.1.0-1-amd64' /lib/modules/$release"));
        assert!(s.contains("'/w/target/debug/deps/redirect_path-1' || rc=1"));
        assert!(s.contains(r"'/w/target/debug/deps/visibility-2' 'it'\''s one' '--exact' || rc=1"));
        assert!(s.contains("export REDIRECT_BIN='/w/target/release/redirect'"));
        assert!(s.ends_with("echo $rc > /rdt-results/rc\n"));
        // A checkout under /tmp stays visible over the guest's own /tmp.
        let held = s.find("mount --bind '/w' /mnt/rdt-workspace").unwrap();
        let tmp = s.find("mount -t tmpfs tmpfs /tmp").unwrap();
        let back = s.find("mount --move /mnt/rdt-workspace '/w'").unwrap();
        assert!(held < tmp && tmp < back, "{s}");
    }
}
