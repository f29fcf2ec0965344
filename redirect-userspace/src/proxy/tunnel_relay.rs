//! Carrying a client's bytes through a tunnel (an HBONE stream is no socket, so the socket relay's
//! readiness loop does not apply): tokio's bidirectional copy, half-close passed on, under the same
//! idle timeout. A write the far side does not take is no movement either, so a stalled peer ends
//! the connection at the idle timeout too.
use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::relay::{Activity, Carried, RelayError, Timeouts};

/// Bytes read at a time each way: 8 KiB (tokio's default) makes a tunnel write an HTTP/2 frame,
/// and a TLS record, per 8 KiB; 32 KiB lets a busy stream fill whole records (16 KiB each).
const COPY_BUFFER: usize = 32 * 1024;

/// Both ways between `client` and `tunnel` until both are done, or nothing moved for
/// `timeouts.idle`.
pub(super) async fn relay_tunnel<A, B>(
    client: &mut A,
    tunnel: &mut B,
    timeouts: Timeouts,
) -> Result<Carried, RelayError>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut client = Moving {
        inner: client,
        activity: &activity,
    };
    let mut tunnel = Moving {
        inner: tunnel,
        activity: &activity,
    };
    tokio::select! {
        copied = tokio::io::copy_bidirectional_with_sizes(&mut client, &mut tunnel, COPY_BUFFER, COPY_BUFFER) => {
            let (sent, received) = copied?;
            Ok(Carried { sent, received, upstream_closed_first: false })
        }
        idle = activity.idle_for(timeouts.idle) => Err(idle),
    }
}

/// A stream that marks `activity` whenever bytes move through it.
struct Moving<'a, T> {
    inner: &'a mut T,
    activity: &'a Activity,
}

impl<T: AsyncRead + Unpin> AsyncRead for Moving<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut *self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.progress();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Moving<'_, T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut *self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.progress();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn timeouts(idle_ms: u64) -> Timeouts {
        Timeouts {
            idle: Duration::from_millis(idle_ms),
            write: Duration::from_secs(30),
        }
    }

    #[tokio::test]
    async fn bytes_and_half_closes_go_both_ways() {
        let (mut client, mut client_far) = tokio::io::duplex(1024);
        let (mut tunnel, mut tunnel_far) = tokio::io::duplex(1024);
        let relay =
            tokio::spawn(
                async move { relay_tunnel(&mut client, &mut tunnel, timeouts(5000)).await },
            );
        client_far.write_all(b"ping").await.unwrap();
        client_far.shutdown().await.unwrap();
        let mut got = Vec::new();
        tunnel_far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ping");
        // The tunnel's side still answers after the client half-closed.
        tunnel_far.write_all(b"pong!").await.unwrap();
        tunnel_far.shutdown().await.unwrap();
        let mut back = Vec::new();
        client_far.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"pong!");
        let carried = relay.await.unwrap().unwrap();
        assert_eq!((carried.sent, carried.received), (4, 5));
    }

    #[tokio::test]
    async fn a_tunnel_where_nothing_moves_ends_at_the_idle_timeout() {
        let (mut client, _client_far) = tokio::io::duplex(1024);
        let (mut tunnel, _tunnel_far) = tokio::io::duplex(1024);
        let started = std::time::Instant::now();
        let ended = relay_tunnel(&mut client, &mut tunnel, timeouts(200)).await;
        assert!(matches!(ended, Err(RelayError::Idle(_))), "{ended:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_far_side_that_takes_nothing_ends_at_the_idle_timeout() {
        let (mut client, mut client_far) = tokio::io::duplex(64 * 1024);
        // A tunnel with room for 16 bytes whose far end never reads.
        let (mut tunnel, _tunnel_far) = tokio::io::duplex(16);
        let writer = tokio::spawn(async move {
            let _ = client_far.write_all(&[7u8; 32 * 1024]).await;
            client_far
        });
        let ended = relay_tunnel(&mut client, &mut tunnel, timeouts(300)).await;
        assert!(matches!(ended, Err(RelayError::Idle(_))), "{ended:?}");
        writer.abort();
    }
}
