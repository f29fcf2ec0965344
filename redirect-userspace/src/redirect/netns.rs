//! The cookie of the node's network namespace, which the programs compare each socket's against to
//! leave hostNetwork processes alone (they sit in the pods' cgroup tree but are the node talking).
//!
//! The agent runs in the node's namespace, so its own cookie is the node's. `SO_NETNS_COOKIE` reads
//! it on Linux 5.14 and later. Older kernels give it only to eBPF programs, so there the agent asks
//! one: `netns_probe` (cgroup/sock_create) is attached to a throwaway child of the pods' cgroup; a
//! forked child of the agent moves itself into that cgroup and opens one socket, in the agent's
//! namespace; the program writes that socket's netns cookie to a map. Then everything is removed.
use std::{
    ffi::CString,
    fs,
    os::{fd::AsFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{CgroupAttachMode, CgroupSock},
};
use redirect_common::{maps, programs};

#[derive(Debug, thiserror::Error)]
pub(crate) enum NetnsError {
    #[error(
        "SO_NETNS_COOKIE is not available ({so_error}) and the eBPF fallback failed: {fallback}"
    )]
    Unavailable {
        so_error: std::io::Error,
        fallback: String,
    },
}

/// The node's (this process's) netns cookie: `SO_NETNS_COOKIE`, else the eBPF probe in `cgroup`.
pub(super) fn node_cookie(object: &[u8], cgroup: &Path) -> Result<u64, NetnsError> {
    let so_error = match own_cookie() {
        Ok(cookie) => return Ok(cookie),
        Err(e) => e,
    };
    match probe_cookie(object, cgroup) {
        Ok(cookie) => {
            tracing::info!(
                cookie,
                "read the node's netns cookie with the eBPF probe (no SO_NETNS_COOKIE before Linux 5.14)"
            );
            Ok(cookie)
        }
        Err(fallback) => Err(NetnsError::Unavailable {
            so_error,
            fallback: format!("{fallback:#}"),
        }),
    }
}

/// `SO_NETNS_COOKIE` on a fresh socket (Linux 5.14).
fn own_cookie() -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    // linux/asm-generic/socket.h; not in every libc crate release.
    const SO_NETNS_COOKIE: libc::c_int = 71;
    // Any socket will do, and it need not be bound (lo may still be down).
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid socket fd, and a u64 buffer whose size we pass.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The cookie as `netns_probe` sees it for a socket this process's namespace creates.
fn probe_cookie(object: &[u8], cgroup: &Path) -> anyhow::Result<u64> {
    use anyhow::Context;

    // A second, short-lived copy of the object: the real one needs the cookie at load time.
    let mut ebpf: Ebpf = EbpfLoader::new()
        .load(object)
        .context("loading the eBPF object")?;
    let probe_cgroup = ProbeCgroup::create(cgroup)?;
    let program: &mut CgroupSock = ebpf
        .program_mut(programs::NETNS_PROBE)
        .context("program netns_probe is missing from the eBPF object")?
        .try_into()?;
    program.load().context("loading netns_probe")?;
    let dir = fs::File::open(&probe_cgroup.path)
        .with_context(|| format!("opening {}", probe_cgroup.path.display()))?;
    program
        .attach(dir.as_fd(), CgroupAttachMode::Single)
        .context("attaching netns_probe")?;
    create_socket_in(&probe_cgroup.path.join("cgroup.procs"))?;
    let map: Array<_, u64> = ebpf
        .map(maps::NETNS_PROBE)
        .context("map NETNS_PROBE is missing from the eBPF object")?
        .try_into()?;
    let cookie = map.get(&0, 0).context("reading NETNS_PROBE")?;
    if cookie == 0 {
        anyhow::bail!("netns_probe did not run for the probe socket");
    }
    Ok(cookie)
}

/// Forks a child that moves itself into the cgroup whose `cgroup.procs` is `procs`, opens a socket
/// and exits; waits for it. The child runs only async-signal-safe calls (open, write, socket, _exit),
/// so forking a multi-threaded process is sound.
fn create_socket_in(procs: &Path) -> anyhow::Result<()> {
    let path = CString::new(procs.as_os_str().as_bytes())?;
    // SAFETY: see above; the child touches nothing but the prepared path and raw syscalls.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if pid == 0 {
        // SAFETY: async-signal-safe calls only; the child never returns into Rust code.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            // "0" moves the writing process.
            let moved = fd >= 0 && libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            let sock = moved && libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) >= 0;
            libc::_exit(if sock { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: waiting for the child we just forked.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(std::io::Error::last_os_error().into());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        anyhow::bail!(
            "the probe process could not join {} or open a socket",
            procs.display()
        );
    }
    Ok(())
}

/// A child cgroup of the pods' cgroup that lives only while the probe runs.
struct ProbeCgroup {
    path: PathBuf,
}

impl ProbeCgroup {
    fn create(parent: &Path) -> anyhow::Result<Self> {
        let path = parent.join(format!("redirect-netns-probe-{}", std::process::id()));
        // A leftover from a killed agent with the same pid is empty: reuse it.
        match fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!("creating {}", path.display())));
            }
        }
        Ok(Self { path })
    }
}

impl Drop for ProbeCgroup {
    fn drop(&mut self) {
        // The exited child may take a moment to leave the cgroup.
        for _ in 0..50 {
            match fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        tracing::warn!(path = %self.path.display(), "could not remove the netns probe cgroup");
    }
}
