//! Zero-copy relay: bytes move socket -> pipe -> socket inside the kernel (`splice(2)`), never through
//! a user-space buffer. Readiness comes from tokio, so a connection costs no thread.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::{Arc, Mutex},
};

use tokio::net::TcpStream;

use super::relay::{Buffer, Carried, RelayError, Timeouts, carry};
use crate::budget::{Ceiling, FdCharge, FdLedger};
use crate::lock::Locked;

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
    POOL.locked()
}

/// The two pipes of one connection, one per direction.
pub(crate) struct Pipes {
    to_upstream: Lease,
    to_client: Lease,
}

impl Pipes {
    /// Pooled pipes, or new ones if their descriptors fit under the splice mark of `fds`; `None`
    /// means relay by copy.
    pub(crate) fn lease(fds: &Arc<FdLedger>) -> Option<Pipes> {
        Some(Pipes {
            to_upstream: Lease::take(fds)?,
            to_client: Lease::take(fds)?,
        })
    }
}

/// A pipe lent to one direction of one connection; it goes back to the pool (or is closed) on drop.
struct Lease {
    /// The pipe's ends, copied out for the splice calls; valid while `pipe` is held.
    read: RawFd,
    write: RawFd,
    pipe: Option<Pipe>,
    /// Bytes in the pipe not yet written out.
    pending: usize,
    /// Set once the pipe is known empty; only then may it serve another connection.
    drained: bool,
}

impl Lease {
    fn take(fds: &Arc<FdLedger>) -> Option<Lease> {
        let pooled = {
            let mut pool = pool();
            pool.in_use += 1;
            pool.idle.pop()
        };
        let pipe = pooled.or_else(|| {
            let made = fds
                .charge(2, Ceiling::Splice)
                .and_then(|charge| Pipe::new(charge).ok());
            if made.is_none() {
                pool().in_use -= 1;
            }
            made
        })?;
        Some(Lease {
            read: pipe.read.as_raw_fd(),
            write: pipe.write.as_raw_fd(),
            pipe: Some(pipe),
            pending: 0,
            drained: false,
        })
    }
}

impl Buffer for Lease {
    fn fill(&mut self, from: &TcpStream) -> io::Result<usize> {
        let n = splice(from.as_raw_fd(), self.write, CHUNK)?;
        self.pending = n;
        Ok(n)
    }

    fn drain(&mut self, to: &TcpStream) -> io::Result<usize> {
        let n = splice(self.read, to.as_raw_fd(), self.pending)?;
        self.pending -= n;
        Ok(n)
    }

    fn emptied(&mut self) {
        // Every byte read into the pipe was written out: it may serve another connection.
        self.drained = true;
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

/// A pipe used as the kernel-side buffer of one direction, its two descriptors charged to the
/// budget for as long as it is open (in use or pooled).
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    _charge: FdCharge,
}

impl Pipe {
    fn new(charge: FdCharge) -> io::Result<Pipe> {
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
                _charge: charge,
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

/// Copies both ways through `pipes` until both sides are done, with half-close passed on, like
/// [`super::relay`]. On an error a pipe may still hold bytes: it is closed, never pooled.
pub(crate) async fn splice_relay(
    client: &TcpStream,
    upstream: &TcpStream,
    pipes: Pipes,
    timeouts: Timeouts,
) -> Result<Carried, RelayError> {
    carry(
        client,
        upstream,
        pipes.to_upstream,
        pipes.to_client,
        timeouts,
    )
    .await
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
        let fds = FdLedger::new(64, 64, Default::default());
        let leases: Vec<Lease> = (0..4).map(|_| Lease::take(&fds).unwrap()).collect();
        for mut lease in leases {
            lease.drained = true;
            drop(lease);
            assert_idle_within_in_use();
        }
        // An undrained pipe (an error mid-stream) is closed, and the invariant still holds.
        drop(Lease::take(&fds).unwrap());
        assert_idle_within_in_use();
    }

    #[test]
    fn pipes_past_the_splice_mark_are_refused() {
        let fds = FdLedger::new(100, 4, Default::default());
        let mut held = Vec::new();
        // Pooled pipes (left by other tests) cost nothing new; new ones stop at the mark.
        while let Some(lease) = Lease::take(&fds) {
            held.push(lease);
            assert!(held.len() < 1000, "leases never stopped");
        }
        assert!(fds.used() <= 4);
        assert_idle_within_in_use();
    }
}
