//! Debian's kernel packages, fetched once and kept under `~/.cache/redirect-xtask/kernels/`: the
//! package, its unpacked tree (modules with a `modules.dep`), and the uncompressed `vmlinux` that
//! boots about 5 s faster under emulation than the compressed image.
//!
//! Each series is looked up with a private apt state (its own sources list, lists and cache), so the
//! machine's apt configuration is never changed to reach an older release.
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::cmd::{self, output};

const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// A kernel series the VM tests know how to fetch, oldest first.
pub(crate) struct Series {
    /// What `--kernel` takes: "5.10".
    pub name: &'static str,
    /// Debian suites serving it (one-line apt sources, without the `deb [...]` prefix).
    suites: &'static [&'static str],
}

pub(crate) const SERIES: &[Series] = &[
    Series {
        name: "5.10",
        suites: &["http://deb.debian.org/debian-security bullseye-security main"],
    },
    Series {
        name: "6.1",
        suites: &[
            "http://deb.debian.org/debian bookworm main",
            "http://deb.debian.org/debian-security bookworm-security main",
        ],
    },
    Series {
        name: "6.12",
        suites: &["http://deb.debian.org/debian bookworm-backports main"],
    },
];

/// A kernel ready to boot.
pub(super) struct Kernel {
    /// `uname -r` of the kernel, e.g. "6.1.0-41-amd64".
    pub release: String,
    /// The image qemu boots: `vmlinux` when it could be extracted, else the package's `vmlinuz`.
    pub image: PathBuf,
    /// The unpacked package root (holds `lib/modules/<release>` with its `modules.dep`).
    pub root: PathBuf,
}

impl Kernel {
    pub(super) fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
}

fn cache_dir() -> anyhow::Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    Ok(PathBuf::from(home).join(".cache/redirect-xtask/kernels"))
}

pub(super) fn series(name: &str) -> Option<&'static Series> {
    SERIES.iter().find(|s| s.name == name)
}

/// The newest kernel package of `series`: the one already cached, or fetched from Debian.
pub(super) fn fetch_series(series: &Series) -> anyhow::Result<Kernel> {
    let dir = cache_dir()?.join(series.name);
    if let Some(ready) = cached(&dir)? {
        return prepare(&ready);
    }
    println!(
        "xtask vm: fetching Debian's {} kernel package into {}",
        series.name,
        dir.display()
    );
    let apt = PrivateApt::new(&dir.join("apt"), series.suites)?;
    apt.update()?;
    let package = apt.image_package()?;
    let deb_dir = dir.join(&package);
    fs::create_dir_all(&deb_dir).with_context(|| format!("creating {}", deb_dir.display()))?;
    apt.download(&package, &deb_dir)?;
    prepare(&deb_dir)
}

/// A kernel from a package file the user gave.
pub(super) fn from_deb(deb: &Path) -> anyhow::Result<Kernel> {
    let stem = deb
        .file_stem()
        .with_context(|| format!("{} has no file name", deb.display()))?;
    let dir = cache_dir()?.join("deb").join(stem);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let copy = dir.join(deb.file_name().unwrap_or(stem));
    if !copy.is_file() {
        fs::copy(deb, &copy)
            .with_context(|| format!("copying {} to {}", deb.display(), copy.display()))?;
    }
    prepare(&dir)
}

/// The package folder already fetched for a series, if any (the newest by name).
fn cached(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("ready").is_file())
        .collect();
    found.sort();
    Ok(found.pop())
}

/// Unpacks the one `.deb` in `dir` (once), runs depmod and extracts vmlinux.
fn prepare(dir: &Path) -> anyhow::Result<Kernel> {
    let root = dir.join("root");
    if !dir.join("ready").is_file() {
        let deb = fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .with_context(|| format!("no .deb in {}", dir.display()))?;
        let _ = fs::remove_dir_all(&root);
        cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        // Newer packages install under /usr/lib; depmod -b looks in <base>/lib/modules.
        if !root.join("lib/modules").is_dir() && root.join("usr/lib/modules").is_dir() {
            std::os::unix::fs::symlink("usr/lib", root.join("lib"))
                .context("linking lib -> usr/lib in the unpacked kernel")?;
        }
    }
    let release = single_entry(&root.join("lib/modules"))?;
    let kernel = Kernel {
        image: PathBuf::new(),
        root: root.clone(),
        release: release.clone(),
    };
    if !dir.join("ready").is_file() {
        // The packages ship no modules.dep: the guest's modprobe needs one.
        cmd::run(Command::new(depmod()).arg("-b").arg(&root).arg(&release))?;
        let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
        match extract_vmlinux(&vmlinuz)? {
            Some(elf) => fs::write(dir.join("vmlinux"), elf).context("writing vmlinux")?,
            None => println!(
                "xtask vm: no uncompressed kernel found in {}; booting it as is (slower)",
                vmlinuz.display()
            ),
        }
        fs::write(dir.join("ready"), &release).context("marking the kernel ready")?;
    }
    let vmlinux = dir.join("vmlinux");
    let image = if vmlinux.is_file() {
        vmlinux
    } else {
        root.join("boot").join(format!("vmlinuz-{release}"))
    };
    Ok(Kernel { image, ..kernel })
}

pub(super) fn depmod() -> &'static str {
    ["/usr/sbin/depmod", "/sbin/depmod"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("depmod")
}

fn single_entry(dir: &Path) -> anyhow::Result<String> {
    let names: Vec<String> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one kernel release in {}, found {names:?}",
            dir.display()
        ),
    }
}

/// The ELF kernel inside a bzImage: the first compressed stream (by magic number) whose
/// decompression starts with an ELF header.
fn extract_vmlinux(vmlinuz: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    let image = fs::read(vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
    let formats: [(&[u8], &str); 3] = [
        (&[0x1f, 0x8b, 0x08], "gzip"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0x00], "xz"),
        (&[0x28, 0xb5, 0x2f, 0xfd], "zstd"),
    ];
    for (magic, tool) in formats {
        for offset in memmem_all(&image, magic) {
            let elf = decompress(tool, &image[offset..])?;
            if elf.starts_with(b"\x7fELF") {
                return Ok(Some(elf));
            }
        }
    }
    Ok(None)
}

fn memmem_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .take(8)
        .collect()
}

/// `tool -dc` on `data`; the image carries trailing bytes, so the exit status is not checked.
fn decompress(tool: &str, data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut child = Command::new(tool)
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {tool}"))?;
    let mut stdin = child.stdin.take().context("decompressor stdin")?;
    let data = data.to_vec();
    let writer = std::thread::spawn(move || {
        // It may stop reading at the end of its stream: a broken pipe is expected.
        let _ = stdin.write_all(&data);
    });
    let out = child.wait_with_output().context("running decompressor")?;
    let _ = writer.join();
    Ok(out.stdout)
}

/// apt with its own sources, lists and cache under `dir`.
struct PrivateApt {
    options: Vec<String>,
}

impl PrivateApt {
    fn new(dir: &Path, suites: &[&str]) -> anyhow::Result<Self> {
        for sub in ["lists/partial", "cache/archives/partial", "parts.d"] {
            fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let sources: String = suites
            .iter()
            .map(|s| format!("deb [signed-by={KEYRING}] {s}\n"))
            .collect();
        fs::write(dir.join("sources.list"), sources).context("writing the private sources")?;
        // An empty dpkg status: the candidate is the suite's newest, whatever this machine runs.
        fs::write(dir.join("status"), "").context("writing the private status")?;
        let d = dir.display();
        let options = [
            format!("Dir::Etc::SourceList={d}/sources.list"),
            format!("Dir::Etc::SourceParts={d}/parts.d"),
            format!("Dir::State::Lists={d}/lists"),
            format!("Dir::State::status={d}/status"),
            format!("Dir::Cache={d}/cache"),
            // The private folders live under $HOME, which apt's sandbox user cannot write.
            "APT::Sandbox::User=root".to_string(),
        ]
        .into_iter()
        .flat_map(|o| ["-o".to_string(), o])
        .collect();
        Ok(Self { options })
    }

    fn update(&self) -> anyhow::Result<()> {
        cmd::run(
            Command::new("apt-get")
                .args(&self.options)
                .args(["update", "-q"]),
        )
    }

    /// The versioned image package `linux-image-amd64` points at, e.g. linux-image-6.1.0-41-amd64.
    fn image_package(&self) -> anyhow::Result<String> {
        let deps = output(
            Command::new("apt-cache")
                .args(&self.options)
                .args(["depends", "linux-image-amd64"]),
        )
        .context("apt-cache depends linux-image-amd64 failed")?;
        deps.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .map(str::trim)
            .find(|p| p.starts_with("linux-image-") && !p.starts_with('<'))
            .map(str::to_string)
            .context("linux-image-amd64 depends on no linux-image package")
    }

    fn download(&self, package: &str, into: &Path) -> anyhow::Result<()> {
        cmd::run(
            Command::new("apt-get")
                .current_dir(into)
                .args(&self.options)
                .args(["download", "-q", package]),
        )
    }
}
