//! Handing the listening sockets to a successor, over a unix socket (`SCM_RIGHTS`).
//!
//! The successor serves on the very sockets the old agent listens on: a connection waiting in an
//! accept queue, or a query in a UDP socket's buffer, is taken by whichever agent reads first and is
//! never lost. (`SO_REUSEPORT` would give the new agent sockets of its own, and closing the old ones
//! would reset what waits in their queues before Linux 5.14's `tcp_migrate_req`.)
//!
//! ```text
//! new -> connect(path)
//! old -> "redirect-handover 1 netns=N cgroup=C\n" + one "KIND ADDR\n" line per descriptor, with them
//! new    checks netns and cgroup are its own, attaches its programs, serves on the sockets
//! new -> "ready"          old stops accepting and reading (its copies close), stops its admin server
//! old -> "stopped"        new starts its admin server on the handed-over admin socket; old drains
//! ```
use std::{
    ffi::CString,
    fs, io,
    net::SocketAddr,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tracing::{info, warn};

const MAGIC: &str = "redirect-handover 1";
/// The kernel passes at most this many descriptors in one message (`SCM_MAX_FD`).
const MAX_FDS: usize = 253;
const MAX_MESSAGE: usize = 64 * 1024;
/// How long the old agent waits for its successor to say it is ready (it loads and attaches
/// programs meanwhile).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What a handed-over descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Proxy,
    DnsUdp,
    DnsTcp,
    Admin,
    Stats,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Proxy => "proxy",
            Kind::DnsUdp => "dns-udp",
            Kind::DnsTcp => "dns-tcp",
            Kind::Admin => "admin",
            Kind::Stats => "stats",
        }
    }
    fn parse(s: &str) -> Option<Kind> {
        [
            Kind::Proxy,
            Kind::DnsUdp,
            Kind::DnsTcp,
            Kind::Admin,
            Kind::Stats,
        ]
        .into_iter()
        .find(|k| k.name() == s)
    }
}

/// One listening socket: what it is, where it is bound, its descriptor.
#[derive(Debug)]
pub(crate) struct Socket {
    pub kind: Kind,
    pub addr: SocketAddr,
    pub fd: OwnedFd,
}

/// The node an agent serves: both agents of a hand-over must share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    netns: u64,
    cgroup: u64,
}

impl Identity {
    pub(crate) fn current(cgroup: &Path) -> io::Result<Identity> {
        Ok(Identity {
            netns: fs::metadata("/proc/self/ns/net")?.ino(),
            cgroup: fs::metadata(cgroup)?.ino(),
        })
    }
}

/// The successor's side: the sockets taken and the line back to the old agent.
pub(crate) struct Predecessor {
    conn: OwnedFd,
}

/// Asks the agent listening at `path` for its sockets. `None` when nobody listens there (first
/// start, or the last agent died) or it serves another node or cgroup.
pub(crate) fn take_over(
    path: &Path,
    me: Identity,
) -> io::Result<Option<(Predecessor, Vec<Socket>)>> {
    let conn = seqpacket()?;
    match connect(&conn, path) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ECONNREFUSED | libc::ENOTSOCK)
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    set_timeout(&conn, READY_TIMEOUT)?;
    let (header, fds) = recv_with_fds(&conn)?;
    let mut lines = header.lines();
    let first = lines.next().unwrap_or_default();
    let Some(theirs) = parse_identity(first) else {
        warn!(path = %path.display(), header = first, "the agent at the hand-over socket speaks another protocol; starting without it");
        return Ok(None);
    };
    if theirs != me {
        warn!(path = %path.display(), ?theirs, ours = ?me, "the agent at the hand-over socket serves another network namespace or cgroup; starting without it");
        return Ok(None);
    }
    let mut sockets = Vec::new();
    let mut fds = fds.into_iter();
    for line in lines {
        let (Some((kind, addr)), Some(fd)) = (line.split_once(' '), fds.next()) else {
            break;
        };
        let (Some(kind), Ok(addr)) = (Kind::parse(kind), addr.parse()) else {
            warn!(
                line,
                "ignoring a handed-over socket this agent does not know"
            );
            continue;
        };
        sockets.push(Socket { kind, addr, fd });
    }
    Ok(Some((Predecessor { conn }, sockets)))
}

impl Predecessor {
    /// Tells the old agent this one serves, and waits until it has stopped accepting.
    pub(crate) fn ready(self) -> io::Result<()> {
        send(&self.conn, b"ready")?;
        let mut buf = [0u8; 16];
        let n = recv(&self.conn, &mut buf)?;
        if &buf[..n] != b"stopped" {
            return Err(io::Error::other(
                "the old agent closed the hand-over without confirming it stopped",
            ));
        }
        Ok(())
    }
}

/// The old agent's side: offers its sockets to whoever connects to `path`.
pub(crate) struct Server {
    path: PathBuf,
    listener: Arc<OwnedFd>,
    closed: Arc<AtomicBool>,
    inode: u64,
}

impl Server {
    /// Listens at `path` (replacing a stale socket file there). When a successor says it is ready,
    /// `on_ready` runs (it must stop this agent's serving) and the successor is told so. When one
    /// took the sockets and then gave up or died before it was ready, `on_failed` runs (it may have
    /// put its programs in the links already) and this agent serves on.
    pub(crate) fn start(
        path: &Path,
        me: Identity,
        sockets: Vec<Socket>,
        on_ready: impl FnOnce() + Send + 'static,
        on_failed: impl Fn() + Send + 'static,
    ) -> io::Result<Server> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        let listener = Arc::new(listen(path)?);
        let inode = fs::metadata(path)?.ino();
        let closed = Arc::new(AtomicBool::new(false));
        let server = Server {
            path: path.to_path_buf(),
            listener: listener.clone(),
            closed: closed.clone(),
            inode,
        };
        let path = path.to_path_buf();
        std::thread::Builder::new()
            .name("handover".into())
            .spawn(move || {
                offer_loop(&path, &listener, &closed, me, &sockets, on_ready, on_failed)
            })?;
        info!(path = %server.path.display(), "hand-over socket listening");
        Ok(server)
    }

    /// Stops offering; removes the socket file unless a successor's has replaced it.
    pub(crate) fn close(self) {
        self.closed.store(true, Ordering::Release);
        // SAFETY: shutdown on a descriptor we hold; it wakes the thread blocked in accept().
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if fs::metadata(&self.path).map(|m| m.ino()).ok() == Some(self.inode) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

fn offer_loop(
    path: &Path,
    listener: &OwnedFd,
    closed: &AtomicBool,
    me: Identity,
    sockets: &[Socket],
    on_ready: impl FnOnce() + Send + 'static,
    on_failed: impl Fn(),
) {
    let mut header = format!("{MAGIC} netns={} cgroup={}\n", me.netns, me.cgroup);
    for s in sockets {
        header.push_str(&format!("{} {}\n", s.kind.name(), s.addr));
    }
    let fds: Vec<RawFd> = sockets.iter().map(|s| s.fd.as_raw_fd()).collect();
    let mut on_ready = Some(on_ready);
    let mut listener_fd = listener.as_raw_fd();
    // A listener re-created after a failed hand-over; the first one is owned by `Server`.
    let mut relisten: Option<OwnedFd> = None;
    loop {
        // SAFETY: accept on a listening socket we hold; null address buffers are allowed.
        let raw = unsafe {
            libc::accept4(
                listener_fd,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if closed.load(Ordering::Acquire) {
            return;
        }
        if raw < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            warn!(error = %e, "hand-over accept failed");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        let conn = unsafe { OwnedFd::from_raw_fd(raw) };
        info!(
            sockets = fds.len(),
            "a successor asked for the listening sockets"
        );
        let answer = set_timeout(&conn, READY_TIMEOUT)
            .and_then(|()| send_with_fds(&conn, header.as_bytes(), &fds))
            .and_then(|()| {
                let mut buf = [0u8; 16];
                let n = recv(&conn, &mut buf)?;
                Ok(buf[..n].to_vec())
            });
        match answer {
            Ok(reply) if reply == b"ready" => {
                if let Some(stop) = on_ready.take() {
                    stop();
                }
                if let Err(e) = send(&conn, b"stopped") {
                    warn!(error = %e, "telling the successor we stopped failed");
                }
                // The path is the successor's now: close our listener without removing it.
                drop(relisten);
                return;
            }
            Ok(reply) => warn!(
                reply = %String::from_utf8_lossy(&reply),
                "the successor gave up the hand-over; serving on"
            ),
            Err(e) => warn!(error = %e, "the hand-over failed; serving on"),
        }
        on_failed();
        // The successor may have taken the path before it gave up: take it back.
        match listen(path) {
            Ok(fd) => {
                listener_fd = fd.as_raw_fd();
                relisten = Some(fd);
            }
            Err(e) => {
                warn!(error = %e, path = %path.display(), "re-creating the hand-over socket failed")
            }
        }
    }
}

fn parse_identity(line: &str) -> Option<Identity> {
    let rest = line.strip_prefix(MAGIC)?.trim();
    let mut netns = None;
    let mut cgroup = None;
    for field in rest.split_whitespace() {
        match field.split_once('=') {
            Some(("netns", v)) => netns = v.parse().ok(),
            Some(("cgroup", v)) => cgroup = v.parse().ok(),
            _ => {}
        }
    }
    Some(Identity {
        netns: netns?,
        cgroup: cgroup?,
    })
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn unix_addr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let bytes = bytes.as_bytes_with_nul();
    // SAFETY: sockaddr_un is plain data; all zeroes is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("hand-over socket path {} is too long", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok((addr, size_of::<libc::sockaddr_un>() as libc::socklen_t))
}

fn connect(fd: &OwnedFd, path: &Path) -> io::Result<()> {
    let (addr, len) = unix_addr(path)?;
    // SAFETY: a valid sockaddr_un of `len` bytes.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn listen(path: &Path) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let _ = fs::remove_file(path);
    let (addr, len) = unix_addr(path)?;
    // SAFETY: a valid sockaddr_un of `len` bytes.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len,
        )
    };
    // SAFETY: listen on the socket just bound.
    if rc != 0 || unsafe { libc::listen(fd.as_raw_fd(), 4) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn set_timeout(fd: &OwnedFd, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: a timeval of the right size for these options.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &tv as *const libc::timeval as *const libc::c_void,
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn send(fd: &OwnedFd, data: &[u8]) -> io::Result<()> {
    send_with_fds(fd, data, &[])
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv into a buffer we own, of its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn send_with_fds(fd: &OwnedFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if fds.len() > MAX_FDS || data.len() > MAX_MESSAGE {
        return Err(io::Error::other(format!(
            "{} sockets in {} bytes do not fit one hand-over message",
            fds.len(),
            data.len()
        )));
    }
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    let space = if fds.is_empty() {
        0
    } else {
        // SAFETY: CMSG_SPACE is a pure computation on a length; it reads no memory.
        unsafe { libc::CMSG_SPACE(fd_bytes) as usize }
    };
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds CMSG_SPACE(fd_bytes) bytes: room for one header and the
        // descriptors.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv_with_fds(fd: &OwnedFd) -> io::Result<(String, Vec<OwnedFd>)> {
    let mut data = vec![0u8; MAX_MESSAGE];
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) as usize };
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, within msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..payload / size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("hand-over message truncated"));
    }
    data.truncate(n as usize);
    Ok((String::from_utf8_lossy(&data).into_owned(), fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_other_protocols_are_refused() {
        let id = Identity {
            netns: 4026531840,
            cgroup: 1234,
        };
        let line = format!("{MAGIC} netns={} cgroup={}", id.netns, id.cgroup);
        assert_eq!(parse_identity(&line), Some(id));
        assert_eq!(parse_identity("redirect-handover 2 netns=1 cgroup=2"), None);
        assert_eq!(parse_identity(&format!("{MAGIC} netns=1")), None);
    }

    #[test]
    fn sockets_cross_a_unix_socket_with_their_description() {
        let dir = std::env::temp_dir().join(format!("redirect-handover-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("h.sock");
        let me = Identity::current(Path::new("/")).unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let (stopped_tx, stopped_rx) = std::sync::mpsc::channel();
        let server = Server::start(
            &path,
            me,
            vec![Socket {
                kind: Kind::Proxy,
                addr,
                fd: OwnedFd::from(tcp),
            }],
            move || stopped_tx.send(()).unwrap(),
            || {},
        )
        .unwrap();
        let (predecessor, sockets) = take_over(&path, me).unwrap().unwrap();
        assert_eq!(sockets.len(), 1);
        assert_eq!(sockets[0].kind, Kind::Proxy);
        assert_eq!(sockets[0].addr, addr);
        let got = std::net::TcpListener::from(sockets.into_iter().next().unwrap().fd);
        assert_eq!(got.local_addr().unwrap(), addr, "the very socket came over");
        predecessor.ready().unwrap();
        stopped_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        server.close();
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn nobody_listening_is_a_fresh_start() {
        let path = std::env::temp_dir().join(format!("redirect-none-{}.sock", std::process::id()));
        let me = Identity::current(Path::new("/")).unwrap();
        assert!(take_over(&path, me).unwrap().is_none());
    }
}
