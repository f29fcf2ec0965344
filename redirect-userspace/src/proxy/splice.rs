//! Zero-copy relay: bytes move socket -> pipe -> socket inside the kernel (`splice(2)`), never through
//! a user-space buffer. Readiness comes from tokio, so a connection costs no thread.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::Mutex,
};

use tokio::{io::Interest, net::TcpStream};

use super::relay::Carried;

/// Pipe capacity per direction: a bulk stream moves in few syscalls; pages are used only when full.
const PIPE_SIZE: libc::c_int = 1 << 20;
/// Most bytes asked of one splice.
const CHUNK: usize = 1 << 20;

/// Empty pipes kept for the next connections: making and sizing two pipes is most of what splice adds
/// to a short connection (pipe2, fcntl, close: six syscalls, and the pipe's buffer ring).
const POOL_MAX: usize = 256;
static POOL: Mutex<Vec<Pipe>> = Mutex::new(Vec::new());

/// A pipe used as the kernel-side buffer of one direction.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    /// A pipe from the pool, or a new one.
    fn take() -> io::Result<Pipe> {
        let pooled = POOL.lock().map(|mut pool| pool.pop()).unwrap_or(None);
        match pooled {
            Some(pipe) => Ok(pipe),
            None => Pipe::new(),
        }
    }

    /// Back to the pool. Only a drained pipe may go back: its next user must read only its own bytes.
    fn give_back(self) {
        if let Ok(mut pool) = POOL.lock()
            && pool.len() < POOL_MAX
        {
            pool.push(self);
        }
    }

    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are open descriptors we now own.
        let pipe = unsafe {
            Pipe {
                read: OwnedFd::from_raw_fd(fds[0]),
                write: OwnedFd::from_raw_fd(fds[1]),
            }
        };
        // Larger is faster; if the system caps it (pipe-max-size), the default 64 KiB still works.
        // SAFETY: valid descriptor; F_SETPIPE_SZ takes an int.
        unsafe { libc::fcntl(pipe.write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
        Ok(pipe)
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain descriptors, no offsets; the kernel checks them.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Moves `from`'s bytes to `to` until `from` reaches EOF, then half-closes `to`.
async fn one_way(from: &TcpStream, to: &TcpStream) -> io::Result<u64> {
    // On any error the pipe may still hold bytes: it is dropped, not given back.
    let pipe = Pipe::take()?;
    let mut total = 0u64;
    loop {
        let filled = from
            .async_io(Interest::READABLE, || {
                splice(from.as_raw_fd(), pipe.write.as_raw_fd(), CHUNK)
            })
            .await?;
        if filled == 0 {
            // EOF: pass the half-close on; the other direction may still be talking.
            // SAFETY: valid socket descriptor.
            if unsafe { libc::shutdown(to.as_raw_fd(), libc::SHUT_WR) } != 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::NotConnected {
                    return Err(e);
                }
            }
            // Every byte read into the pipe was written out: it is empty.
            pipe.give_back();
            return Ok(total);
        }
        let mut left = filled;
        while left > 0 {
            left -= to
                .async_io(Interest::WRITABLE, || {
                    splice(pipe.read.as_raw_fd(), to.as_raw_fd(), left)
                })
                .await?;
        }
        total += filled as u64;
    }
}

/// Copies both ways until both sides are done, with half-close passed on, like [`super::relay`].
pub async fn splice_relay(client: &TcpStream, upstream: &TcpStream) -> io::Result<Carried> {
    let (sent, received) = tokio::try_join!(one_way(client, upstream), one_way(upstream, client))?;
    Ok(Carried { sent, received })
}
