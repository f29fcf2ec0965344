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
///
/// The pool never holds more idle pipes than are in use: under load, connections that end leave
/// their pipes to the ones that start; when traffic stops, the last release empties it, so an idle
/// agent holds no descriptors it does not need.
struct PipePool {
    idle: Vec<Pipe>,
    in_use: usize,
}

const POOL_MAX: usize = 256;
static POOL: Mutex<PipePool> = Mutex::new(PipePool {
    idle: Vec::new(),
    in_use: 0,
});

fn pool() -> std::sync::MutexGuard<'static, PipePool> {
    // The pool holds only pipes: after a panic elsewhere its data is still fine to use.
    POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A pipe lent to one direction of one connection; it goes back to the pool (or is closed) on drop.
struct Lease {
    /// The pipe's ends, copied out for the splice calls; valid while `pipe` is held.
    read: RawFd,
    write: RawFd,
    pipe: Option<Pipe>,
    /// Set once the pipe is known empty; only then may it serve another connection.
    drained: bool,
}

impl Lease {
    fn take() -> io::Result<Lease> {
        let pooled = {
            let mut pool = pool();
            pool.in_use += 1;
            pool.idle.pop()
        };
        let pipe = match pooled {
            Some(pipe) => pipe,
            None => Pipe::new().inspect_err(|_| pool().in_use -= 1)?,
        };
        Ok(Lease {
            read: pipe.read.as_raw_fd(),
            write: pipe.write.as_raw_fd(),
            pipe: Some(pipe),
            drained: false,
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut pool = pool();
        pool.in_use -= 1;
        let keep = pool.in_use.min(POOL_MAX);
        if let Some(pipe) = self.pipe.take()
            && self.drained
            && pool.idle.len() < keep
        {
            pool.idle.push(pipe);
        }
        // Closing happens here, under the lock: a close is cheap and the lock is never contended long.
        pool.idle.truncate(keep);
    }
}

/// A pipe used as the kernel-side buffer of one direction.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
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
    // On any error the pipe may still hold bytes: the lease drops it undrained and it is closed.
    let mut pipe = Lease::take()?;
    let mut total = 0u64;
    loop {
        let filled = from
            .async_io(Interest::READABLE, || {
                splice(from.as_raw_fd(), pipe.write, CHUNK)
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
            pipe.drained = true;
            return Ok(total);
        }
        let mut left = filled;
        while left > 0 {
            left -= to
                .async_io(Interest::WRITABLE, || {
                    splice(pipe.read, to.as_raw_fd(), left)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever runs concurrently, the pool never keeps more idle pipes than are in use, so an agent
    /// whose connections have all ended holds none.
    fn assert_idle_within_in_use() {
        let pool = pool();
        assert!(
            pool.idle.len() <= pool.in_use,
            "{} idle, {} in use",
            pool.idle.len(),
            pool.in_use
        );
    }

    #[test]
    fn idle_pipes_never_outnumber_busy_ones() {
        let leases: Vec<Lease> = (0..4).map(|_| Lease::take().unwrap()).collect();
        for mut lease in leases {
            lease.drained = true;
            drop(lease);
            assert_idle_within_in_use();
        }
        // An undrained pipe (an error mid-stream) is closed, and the invariant still holds.
        drop(Lease::take().unwrap());
        assert_idle_within_in_use();
    }
}
