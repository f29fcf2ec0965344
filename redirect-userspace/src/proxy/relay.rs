//! Carrying bytes both ways between a client and its upstream, with half-close passed on, and the
//! timeouts that keep a connection from holding its descriptors forever.
//!
//! One loop serves both relays; what differs is where bytes wait between the sockets ([`Buffer`]):
//! a user-space buffer (copy) or a pipe (splice, see `splice.rs`).
use std::{
    io,
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use tokio::{io::Interest, net::TcpStream, time::Instant};

/// Buffer per direction: large enough that a bulk transfer moves in few syscalls.
const BUFFER: usize = 64 * 1024;

/// Bytes carried each way by a relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Carried {
    /// client -> upstream
    pub sent: u64,
    /// upstream -> client
    pub received: u64,
    /// The client's end of stream came first, so the proxy closed toward the upstream first: the
    /// upstream socket is left in TIME_WAIT, holding its local port for a while.
    pub upstream_closed_first: bool,
}

/// How long a connection may go without progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// No byte either way for this long ends the connection.
    pub idle: Duration,
    /// Once one side has closed, a write the other side does not take for this long ends it.
    pub write: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            idle: Duration::from_secs(3600),
            write: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("no byte moved either way for {0:?}")]
    Idle(Duration),
    #[error("a peer took no bytes for {0:?} after one side had closed")]
    Write(Duration),
}

/// Where one direction's bytes wait between the two sockets. Both calls are non-blocking: they
/// return `WouldBlock` when the socket is not ready, and the relay waits for readiness.
pub(super) trait Buffer {
    /// Reads what `from` has into the (empty) buffer; 0 at end of stream.
    fn fill(&mut self, from: &TcpStream) -> io::Result<usize>;
    /// Writes buffered bytes to `to`; returns how many went.
    fn drain(&mut self, to: &TcpStream) -> io::Result<usize>;
    /// The stream ended with every byte written out.
    fn emptied(&mut self) {}
}

/// The copy relay's buffer: bytes pass through user space.
pub(super) struct CopyBuffer {
    bytes: Box<[u8]>,
    start: usize,
    end: usize,
}

impl CopyBuffer {
    pub(super) fn new() -> Self {
        CopyBuffer {
            bytes: vec![0; BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }
}

impl Buffer for CopyBuffer {
    fn fill(&mut self, from: &TcpStream) -> io::Result<usize> {
        let n = from.try_read(&mut self.bytes)?;
        (self.start, self.end) = (0, n);
        Ok(n)
    }

    fn drain(&mut self, to: &TcpStream) -> io::Result<usize> {
        let n = to.try_write(&self.bytes[self.start..self.end])?;
        self.start += n;
        Ok(n)
    }
}

/// Copies both ways through user-space buffers until both sides are done. A side that finishes
/// sending (FIN) is passed on as a half-close to the other, which may go on sending: protocols that
/// shut down their write side first (e.g. `nc -N`, HTTP/1.0 uploads) keep working.
pub(crate) async fn relay(
    client: &TcpStream,
    upstream: &TcpStream,
    timeouts: Timeouts,
) -> Result<Carried, RelayError> {
    carry(
        client,
        upstream,
        CopyBuffer::new(),
        CopyBuffer::new(),
        timeouts,
    )
    .await
}

/// Both directions at once, under the idle timeout.
pub(super) async fn carry(
    client: &TcpStream,
    upstream: &TcpStream,
    to_upstream: impl Buffer,
    to_client: impl Buffer,
    timeouts: Timeouts,
) -> Result<Carried, RelayError> {
    let activity = Activity::new();
    let (sent_done, received_done) = (AtomicBool::new(false), AtomicBool::new(false));
    let sending = Direction {
        from: client,
        to: upstream,
        done: &sent_done,
        other_done: &received_done,
        activity: &activity,
        write_timeout: timeouts.write,
    };
    let receiving = Direction {
        from: upstream,
        to: client,
        done: &received_done,
        other_done: &sent_done,
        activity: &activity,
        write_timeout: timeouts.write,
    };
    let both = async { tokio::try_join!(sending.run(to_upstream), receiving.run(to_client)) };
    tokio::select! {
        carried = both => {
            let ((sent, sent_first), (received, _)) = carried?;
            Ok(Carried { sent, received, upstream_closed_first: sent_first })
        }
        timeout = activity.idle_for(timeouts.idle) => Err(timeout),
    }
}

/// When bytes last moved, either way.
pub(super) struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    pub(super) fn progress(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `idle`.
    pub(super) async fn idle_for(&self, idle: Duration) -> RelayError {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = last + idle;
            if Instant::now() >= due {
                return RelayError::Idle(idle);
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

struct Direction<'a> {
    from: &'a TcpStream,
    to: &'a TcpStream,
    done: &'a AtomicBool,
    other_done: &'a AtomicBool,
    activity: &'a Activity,
    write_timeout: Duration,
}

impl Direction<'_> {
    /// Moves `from`'s bytes to `to` until `from` reaches EOF, then half-closes `to`. Returns the
    /// bytes moved, and whether this direction ended before the other one.
    async fn run(&self, mut buffer: impl Buffer) -> Result<(u64, bool), RelayError> {
        let mut total = 0u64;
        loop {
            let filled = self
                .from
                .async_io(Interest::READABLE, || buffer.fill(self.from))
                .await?;
            if filled == 0 {
                // EOF: pass the half-close on; the other direction may still be talking.
                let first = !self.other_done.load(Ordering::Acquire);
                shutdown_write(self.to)?;
                buffer.emptied();
                self.done.store(true, Ordering::Release);
                return Ok((total, first));
            }
            self.activity.progress();
            let mut left = filled;
            while left > 0 {
                left -= self.write(&mut buffer).await?;
                self.activity.progress();
            }
            total += filled as u64;
        }
    }

    /// One write, given up if it stalls after either side has closed: nobody is left to wait for.
    async fn write(&self, buffer: &mut impl Buffer) -> Result<usize, RelayError> {
        loop {
            let write = self
                .to
                .async_io(Interest::WRITABLE, || buffer.drain(self.to));
            match tokio::time::timeout(self.write_timeout, write).await {
                Ok(written) => return Ok(written?),
                Err(_) if self.other_done.load(Ordering::Acquire) || peer_closed(self.from) => {
                    return Err(RelayError::Write(self.write_timeout));
                }
                Err(_) => {} // both still open: a slow reader is the idle timeout's business
            }
        }
    }
}

fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    // SAFETY: valid socket descriptor.
    if unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_WR) } != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::NotConnected {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether the peer of `stream` has sent its FIN (or is gone), from the kernel's TCP state.
fn peer_closed(stream: &TcpStream) -> bool {
    // SAFETY: tcp_info is plain data; getsockopt fills at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: valid descriptor, buffer and length.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // ESTABLISHED, FIN_WAIT1, FIN_WAIT2: the peer may still send; any other state means it will not.
    rc != 0 || !matches!(info.tcpi_state, 1 | 4 | 5)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    pub(super) fn test_ledger() -> std::sync::Arc<crate::budget::FdLedger> {
        crate::budget::FdLedger::new(1 << 16, 1 << 15, Default::default())
    }

    /// A pair of connected streams over loopback: (the side we keep, the side the relay gets).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn copy_relay_carries_both_ways_and_keeps_half_close() {
        carries_both_ways_and_keeps_half_close(false).await;
    }

    #[tokio::test]
    async fn splice_relay_carries_both_ways_and_keeps_half_close() {
        carries_both_ways_and_keeps_half_close(true).await;
    }

    async fn carries_both_ways_and_keeps_half_close(zero_copy: bool) {
        let (mut client, client_side) = pair().await;
        let (upstream_side, mut server) = pair().await;
        let relay = tokio::spawn(async move {
            if zero_copy {
                let pipes = crate::proxy::Pipes::lease(&test_ledger()).unwrap();
                crate::proxy::splice_relay(&client_side, &upstream_side, pipes, Timeouts::default())
                    .await
            } else {
                relay(&client_side, &upstream_side, Timeouts::default()).await
            }
        });

        // The client sends a request and half-closes; the server must still be able to answer.
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"request");
        server.write_all(b"a longer response").await.unwrap();
        server.shutdown().await.unwrap();
        let mut response = Vec::new();
        client.read_to_end(&mut response).await.unwrap();
        assert_eq!(response, b"a longer response");

        let carried = relay.await.unwrap().unwrap();
        assert_eq!(
            carried,
            Carried {
                sent: 7,
                received: 17,
                // The client half-closed first: the relay closed toward the server first.
                upstream_closed_first: true,
            }
        );
    }
}

#[cfg(test)]
mod timeout_tests {
    use std::time::Duration;

    use tokio::{
        io::AsyncWriteExt,
        net::{TcpListener, TcpStream},
    };

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    async fn run(
        zero_copy: bool,
        client_side: &TcpStream,
        upstream_side: &TcpStream,
        timeouts: Timeouts,
    ) -> Result<Carried, RelayError> {
        if zero_copy {
            let pipes = crate::proxy::Pipes::lease(&super::tests::test_ledger()).unwrap();
            crate::proxy::splice_relay(client_side, upstream_side, pipes, timeouts).await
        } else {
            relay(client_side, upstream_side, timeouts).await
        }
    }

    #[tokio::test]
    async fn a_connection_that_moves_nothing_ends_at_the_idle_timeout() {
        for zero_copy in [false, true] {
            let (_client, client_side) = pair().await;
            let (upstream_side, _server) = pair().await;
            let timeouts = Timeouts {
                idle: Duration::from_millis(200),
                write: Duration::from_secs(60),
            };
            let started = Instant::now();
            let ended = run(zero_copy, &client_side, &upstream_side, timeouts).await;
            assert!(matches!(ended, Err(RelayError::Idle(_))), "{ended:?}");
            assert!(started.elapsed() < Duration::from_secs(2));
        }
    }

    /// The server closed its side and never reads: the client's bytes pile up until the write
    /// timeout ends the connection, long before the idle timeout.
    #[tokio::test]
    async fn a_peer_that_never_reads_after_closing_ends_at_the_write_timeout() {
        for zero_copy in [false, true] {
            let (mut client, client_side) = pair().await;
            let (upstream_side, mut server) = pair().await;
            server.shutdown().await.unwrap();
            let flood = tokio::spawn(async move {
                let chunk = vec![7u8; 1 << 16];
                while client.write_all(&chunk).await.is_ok() {}
            });
            let timeouts = Timeouts {
                idle: Duration::from_secs(3600),
                write: Duration::from_millis(300),
            };
            let started = Instant::now();
            let ended = run(zero_copy, &client_side, &upstream_side, timeouts).await;
            assert!(matches!(ended, Err(RelayError::Write(_))), "{ended:?}");
            assert!(started.elapsed() < Duration::from_secs(5));
            flood.abort();
            drop(server);
        }
    }

    #[tokio::test]
    async fn a_fin_from_the_peer_is_seen_in_the_tcp_state() {
        let (mut ours, theirs) = pair().await;
        assert!(!peer_closed(&theirs));
        ours.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(peer_closed(&theirs));
    }
}

#[cfg(test)]
mod bulk_tests {
    use sha2::{Digest, Sha256};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    /// 8 MiB each way at once through the splice relay arrive intact (the pipe refills many times).
    #[tokio::test]
    async fn splice_relay_moves_bulk_both_ways_intact() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, client_side) = (client.unwrap(), accepted.unwrap().0);
        let (upstream_side, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (upstream_side, server) = (upstream_side.unwrap(), accepted.unwrap().0);
        let relay = tokio::spawn(async move {
            let pipes = crate::proxy::Pipes::lease(&super::tests::test_ledger()).unwrap();
            crate::proxy::splice_relay(
                &client_side,
                &upstream_side,
                pipes,
                super::Timeouts::default(),
            )
            .await
        });

        let payload: Vec<u8> = (0..8u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
            .collect();
        let digest = Sha256::digest(&payload);
        let exchange = |mut stream: TcpStream, data: Vec<u8>| async move {
            let (mut rx, mut tx) = stream.split();
            let send = async {
                tx.write_all(&data).await.unwrap();
                tx.shutdown().await.unwrap();
            };
            let mut got = Vec::new();
            tokio::join!(send, async { rx.read_to_end(&mut got).await.unwrap() });
            Sha256::digest(&got)
        };
        let (at_server, at_client) =
            tokio::join!(exchange(server, payload.clone()), exchange(client, payload));
        assert_eq!(at_server, digest);
        assert_eq!(at_client, digest);
        let carried = relay.await.unwrap().unwrap();
        assert_eq!((carried.sent, carried.received), (8 << 20, 8 << 20));
    }
}
