//! Running a program "in a place": in a pod (its cgroup, its netns, its resolv.conf), in the node netns or
//! in ext. The child joins the cgroup BEFORE it enters the netns, so the eBPF programs attached to the pods'
//! cgroup see every socket it opens; and it enters the netns with setns(2), not `ip netns exec`, which would
//! remount /sys and hide the cgroup and bpffs mounts.
use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::netns;
use crate::proc::Proc;

/// Where a command runs.
#[derive(Clone, Debug)]
pub struct Place {
    /// For messages: `pod team-a/a1`, `node`, `ext`.
    pub label: String,
    /// Name of the netns (under /run/netns).
    pub netns: String,
    /// The cgroup v2 directory the child is written into.
    pub cgroup: PathBuf,
    /// Bind-mounted over /etc/resolv.conf in a private mount namespace of the child, if set.
    pub resolv_conf: Option<PathBuf>,
    /// Where spawned processes' output goes.
    pub log_dir: PathBuf,
}

impl Place {
    pub fn cmd(&self, program: impl AsRef<OsStr>) -> Cmd {
        Cmd {
            place: self.clone(),
            command: Command::new(program),
            timeout: Duration::from_secs(30),
            stdin: None,
        }
    }
}

/// A command about to run in a [`Place`]. `output()` runs it to completion (with a timeout, 30 s unless
/// changed); `spawn()` starts a long-lived one.
pub struct Cmd {
    place: Place,
    command: Command,
    timeout: Duration,
    stdin: Option<Vec<u8>>,
}

/// The finished command: status and everything it printed.
#[derive(Debug)]
pub struct Output {
    pub what: String,
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status.success()
    }
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

impl fmt::Display for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |b: &[u8]| {
            let s = String::from_utf8_lossy(&b[..b.len().min(4096)]).into_owned();
            if b.len() > 4096 {
                format!("{s}... ({} bytes)", b.len())
            } else {
                s
            }
        };
        write!(
            f,
            "{} exited with {}\n--- stdout\n{}\n--- stderr\n{}",
            self.what,
            self.status,
            show(&self.stdout),
            show(&self.stderr)
        )
    }
}

impl Cmd {
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.command.arg(arg);
        self
    }
    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> Self {
        self.command.args(args);
        self
    }
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.command.env(key, value);
        self
    }
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// Bytes fed to the program's stdin by `output()` (closed after).
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "[{}] {}",
            self.place.label,
            self.command.get_program().to_string_lossy()
        );
        for a in self.command.get_args() {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    }

    /// Runs to completion; a non-zero exit is not an error here (see [`Cmd::ok`]). A timeout is.
    pub fn output(mut self) -> Result<Output> {
        let what = self.describe();
        let input = self.stdin.take();
        self.command.stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        self.command.stdout(Stdio::piped()).stderr(Stdio::piped());
        // Its own process group, so a timeout also kills what it started (which would hold the pipes).
        self.command.process_group(0);
        let mut child = self
            .spawn_entered()
            .with_context(|| format!("starting {what}"))?;
        let feeder = (child.stdin.take(), input);
        let feeder = std::thread::spawn(move || {
            if let (Some(mut pipe), Some(bytes)) = feeder {
                // The program may exit without reading everything; that is its business.
                let _ = pipe.write_all(&bytes);
            }
        });
        let stdout = read_all_in_background(child.stdout.take());
        let stderr = read_all_in_background(child.stderr.take());
        let timeout = crate::pace::scaled(self.timeout);
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() > deadline {
                // SAFETY: kill(2) of the process group led by our own child (still unreaped).
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = feeder.join();
        let stdout = stdout.join().unwrap_or_default();
        let stderr = stderr.join().unwrap_or_default();
        match status {
            Some(status) => Ok(Output {
                what,
                status,
                stdout,
                stderr,
            }),
            None => {
                let partial = Output {
                    what,
                    status: ExitStatus::from_raw(libc::SIGKILL),
                    stdout,
                    stderr,
                };
                bail!("timed out after {timeout:?}, killed: {partial}")
            }
        }
    }

    /// Runs to completion and requires exit status 0; the error shows what it printed.
    pub fn ok(self) -> Result<Output> {
        let out = self.output()?;
        if !out.success() {
            bail!("{out}");
        }
        Ok(out)
    }

    /// Starts a long-lived process; stdout and stderr go to a log file, stdin stays open for the caller.
    pub fn spawn(mut self) -> Result<Proc> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let what = self.describe();
        let program = Path::new(self.command.get_program())
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let label: String = self
            .place
            .label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let log = self.place.log_dir.join(format!(
            "{label}-{program}-{}.log",
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&self.place.log_dir)?;
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("creating {}", log.display()))?;
        self.command
            .stdin(Stdio::piped())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = self
            .spawn_entered()
            .with_context(|| format!("starting {what}"))?;
        Ok(Proc::new(what, child, log))
    }

    fn spawn_entered(&mut self) -> Result<Child> {
        let place = &self.place;
        let procs_path = place.cgroup.join("cgroup.procs");
        let cgroup_procs = OpenOptions::new()
            .write(true)
            .open(&procs_path)
            .with_context(|| format!("opening {}", procs_path.display()))?;
        let netns_path = netns::path(&place.netns);
        let netns =
            File::open(&netns_path).with_context(|| format!("opening {}", netns_path.display()))?;
        let resolv = match &place.resolv_conf {
            Some(file) => Some((
                CString::new(file.as_os_str().as_bytes())?,
                CString::new("/etc/resolv.conf")?,
            )),
            None => None,
        };
        let (procs_fd, netns_fd) = (cgroup_procs.as_raw_fd(), netns.as_raw_fd());
        // SAFETY: the closure runs in the forked child before exec and only makes raw system calls on
        // fds and C strings prepared here (no allocation, no locks); the fds stay open until spawn returns.
        unsafe {
            self.command
                .pre_exec(move || enter(procs_fd, netns_fd, resolv.as_ref()));
        }
        let child = self.command.spawn()?;
        drop((cgroup_procs, netns));
        Ok(child)
    }
}

/// In the child: join the cgroup, give it its own resolv.conf, then enter the netns. Order matters:
/// the cgroup first, so no socket is ever created outside it.
fn enter(procs_fd: i32, netns_fd: i32, resolv: Option<&(CString, CString)>) -> std::io::Result<()> {
    let check = |rc: libc::c_long| {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // SAFETY: raw system calls on valid fds and NUL-terminated strings (see spawn_entered).
    unsafe {
        // "0" means "the writing process".
        check(libc::write(procs_fd, b"0".as_ptr().cast(), 1) as libc::c_long)?;
        if let Some((source, target)) = resolv {
            check(libc::unshare(libc::CLONE_NEWNS) as libc::c_long)?;
            // Private, so the bind mount below never propagates back to the machine's namespace.
            let root = c"/".as_ptr();
            check(libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) as libc::c_long)?;
            check(libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) as libc::c_long)?;
        }
        check(libc::setns(netns_fd, libc::CLONE_NEWNET) as libc::c_long)?;
    }
    Ok(())
}

fn read_all_in_background(
    pipe: Option<impl Read + Send + 'static>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}
