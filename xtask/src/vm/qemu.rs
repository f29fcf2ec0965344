//! Booting a kernel in qemu with the host's root shared read-only, until the guest powers off.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

/// Kernel command line: serial console, no reboot loop on panic, the TSC as clock (without
/// `tsc=reliable` emulation falls back to the much slower HPET), quiet boot.
const CMDLINE: &str =
    "console=ttyS0 edd=off panic=-1 tsc=reliable mitigations=off quiet loglevel=3 rdinit=/init";

/// How the guest CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Accel {
    Kvm,
    /// Emulation: about 20 times slower than the host.
    Tcg,
}

/// KVM only when the CPU offers hardware virtualisation: a `/dev/kvm` without vmx/svm here is a
/// paravirtual backend that cannot run a stock kernel.
pub(super) fn accel() -> Accel {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hardware = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if hardware && Path::new("/dev/kvm").exists() {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

pub(super) struct Boot<'a> {
    pub image: &'a Path,
    pub initramfs: &'a Path,
    /// Shared writable as tag `results`: the guest script, the exit code.
    pub results: &'a Path,
    pub accel: Accel,
    pub cpus: u32,
    pub memory_mib: u32,
    pub timeout: Duration,
}

/// Boots and waits for the guest to power off; the guest's console goes to our stdout.
pub(super) fn boot(boot: &Boot) -> anyhow::Result<()> {
    let mut qemu = Command::new("qemu-system-x86_64");
    match boot.accel {
        Accel::Kvm => qemu.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => qemu.args(["-accel", "tcg,thread=multi,tb-size=512", "-cpu", "max"]),
    };
    qemu.args(["-m", &boot.memory_mib.to_string()])
        .args(["-smp", &boot.cpus.to_string()])
        .args(["-display", "none", "-nodefaults", "-no-reboot"])
        .args([
            "-chardev",
            "stdio,id=console,signal=off",
            "-serial",
            "chardev:console",
        ])
        .arg("-kernel")
        .arg(boot.image)
        .arg("-initrd")
        .arg(boot.initramfs)
        .args(["-append", CMDLINE])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ])
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=results,security_model=none,multidevs=remap",
            boot.results.display()
        ))
        .stdin(Stdio::null());
    println!(
        "xtask vm: booting {} ({:?}, {} CPUs, {} MiB)",
        boot.image.display(),
        boot.accel,
        boot.cpus,
        boot.memory_mib
    );
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().context("waiting for qemu")? {
            if !status.success() {
                bail!("qemu exited with {status}");
            }
            return Ok(());
        }
        if started.elapsed() > boot.timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the VM did not finish within {} s: stopped",
                boot.timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
