//! The guest's first filesystem: a static busybox, the modules needed to reach the host's files
//! (virtio, 9p, overlay) and `/init`, written as a `newc` cpio archive.
use std::{fs, path::Path, process::Command};

use anyhow::{Context, bail};

use super::kernel::Kernel;
use crate::cmd::output;

/// Modules `/init` loads before it can mount the host's root (dependencies come with them).
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

const BUSYBOX: &str = "/bin/busybox";

/// Writes the initramfs for `kernel` to `path`.
pub(super) fn write(kernel: &Kernel, path: &Path) -> anyhow::Result<()> {
    let busybox = fs::read(BUSYBOX).with_context(|| format!("reading {BUSYBOX}"))?;
    if !busybox.starts_with(b"\x7fELF") {
        bail!("{BUSYBOX} is not a binary: install busybox-static");
    }
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "proc", "sys", "lib", "newroot", "lower", "rw"] {
        cpio.dir(dir);
    }
    // The kernel opens /dev/console for /init before anything is mounted.
    cpio.char_device("dev/console", 5, 1);
    cpio.file("bin/busybox", 0o755, &busybox);
    cpio.symlink("bin/sh", "busybox");
    let mut order = String::new();
    for (i, module) in boot_modules(kernel)?.iter().enumerate() {
        let name = format!("{i:02}.ko");
        cpio.file(&format!("lib/{name}"), 0o644, &read_module(module)?);
        order.push_str(&name);
        order.push('\n');
    }
    cpio.file("lib/order", 0o644, order.as_bytes());
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/modprobe-chroot", 0o755, MODPROBE.as_bytes());
    fs::write(path, cpio.finish()).with_context(|| format!("writing {}", path.display()))
}

/// `/init`: mounts the host's root read-only with a tmpfs on top, the results share, and runs the
/// guest script there; then powers off (qemu runs with -no-reboot).
const INIT: &str = r#"#!/bin/sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /lib/order); do insmod /lib/$m || echo "vm init: insmod $m failed"; done
mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,msize=512000 hostroot /lower
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot
mkdir -p /newroot/rdt-results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /newroot/rdt-results
# Modules loaded on demand (veth, ...) come from the guest kernel's tree inside the new root.
echo /bin/modprobe-chroot > /proc/sys/kernel/modprobe
chroot /newroot /bin/bash /rdt-results/guest.sh
sync
umount /newroot/rdt-results
poweroff -f
"#;

const MODPROBE: &str = "#!/bin/sh\nexec /bin/busybox chroot /newroot /sbin/modprobe \"$@\"\n";

/// The module files for [`BOOT_MODULES`] in load order, from the kernel's own dependency data.
fn boot_modules(kernel: &Kernel) -> anyhow::Result<Vec<String>> {
    let base = kernel.root.display().to_string();
    let out = output(
        Command::new("modprobe")
            .args(["-d", &base, "-S", &kernel.release, "--show-depends", "-a"])
            .args(BOOT_MODULES),
    )
    .with_context(|| format!("modprobe --show-depends for {} failed", kernel.release))?;
    let mut modules = Vec::new();
    for line in out.lines() {
        // "insmod /path/x.ko[.xz] [params]" or "builtin x".
        if let Some(rest) = line.strip_prefix("insmod ") {
            let path = rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            if !modules.contains(&path) {
                modules.push(path);
            }
        }
    }
    Ok(modules)
}

/// A module file, decompressed (busybox's insmod takes plain `.ko` only).
fn read_module(path: &str) -> anyhow::Result<Vec<u8>> {
    let tool = if path.ends_with(".xz") {
        "xz"
    } else if path.ends_with(".zst") {
        "zstd"
    } else if path.ends_with(".gz") {
        "gzip"
    } else {
        return fs::read(path).with_context(|| format!("reading {path}"));
    };
    let out = Command::new(tool)
        .args(["-dc", path])
        .output()
        .with_context(|| format!("starting {tool}"))?;
    if !out.status.success() {
        bail!("{tool} -dc {path} failed: {}", out.status);
    }
    Ok(out.stdout)
}

/// A `newc` cpio archive (the format the kernel unpacks into its first root).
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    next_inode: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 0, 0, &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, 0, 0, data);
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120_777, 0, 0, target.as_bytes());
    }

    fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, major, minor, &[]);
    }

    fn entry(&mut self, name: &str, mode: u32, rdev_major: u32, rdev_minor: u32, data: &[u8]) {
        self.next_inode += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.next_inode,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev_major,
            rdev_minor,
            name.len() as u32 + 1,
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, 0, &[]);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_entries_are_aligned_and_end_with_the_trailer() {
        let mut cpio = Cpio::default();
        cpio.file("init", 0o755, b"#!/bin/sh\n");
        cpio.char_device("dev/console", 5, 1);
        let bytes = cpio.finish();
        assert!(bytes.len().is_multiple_of(4));
        assert!(bytes.starts_with(b"070701"));
        // File size field (7th) of the first entry: 10 bytes.
        assert_eq!(&bytes[6 + 6 * 8..6 + 7 * 8], b"0000000a");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("TRAILER!!!"));
        // The console node: mode 020600, rdev 5:1.
        let console = text.find("dev/console").unwrap() - 110;
        assert_eq!(&text[console + 14..console + 22], "00002180");
        assert_eq!(&text[console + 78..console + 94], "0000000500000001");
    }
}
