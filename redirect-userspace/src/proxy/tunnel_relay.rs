//! Carrying a client's bytes through a tunnel (an HBONE stream is no socket, so the socket relay's
//! readiness loop does not apply): one loop each way, half-close passed on, under the same idle
//! timeout. A write the far side does not take is no movement either, so a stalled peer ends the
//! connection at the idle timeout too.
//!
//! Bytes are copied once on their way in (socket to our buffer) and not again: a chunk read is
//! handed to HTTP/2 as it is, and a received frame is written to the socket from where it arrived.
use std::io;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::relay::{Activity, Carried, RelayError, Timeouts};
use crate::hbone::{H2Stream, Receiving, Sending};

/// Bytes read at a time from the socket: 16 KiB (one TLS record) while a connection is young, so
/// that many connections waiting to read hold little; 1 MiB (one HTTP/2 frame at most) once it
/// has moved [`BULK_AFTER`], so that a bulk transfer crosses in few reads, frames and wake-ups
/// (the stream's send buffer holds up to 4 MiB of it anyway). With 256 KiB, one stream carried
/// about a tenth less; with 64 KiB frames, less again.
const READ: usize = 16 * 1024;
const BULK_READ: usize = 1024 * 1024;
const BULK_AFTER: u64 = 1 << 20;

/// Both ways between the client (its reading and writing halves) and `tunnel` until both are
/// done, or nothing moved for `timeouts.idle`.
pub(super) async fn relay_tunnel<R, W>(
    (mut from_client, mut to_client): (R, W),
    tunnel: &mut H2Stream,
    timeouts: Timeouts,
) -> Result<Carried, RelayError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let up = into_tunnel(&mut from_client, &mut tunnel.send, &activity);
    let down = out_of_tunnel(&mut tunnel.recv, &mut to_client, &activity);
    tokio::select! {
        carried = futures::future::try_join(up, down) => {
            let (sent, received) = carried?;
            Ok(Carried { sent, received, upstream_closed_first: false })
        }
        idle = activity.idle_for(timeouts.idle) => Err(idle),
    }
}

/// The client's bytes into the tunnel; its end of stream ends the tunnel's sending side.
async fn into_tunnel<R: AsyncRead + Unpin>(
    from: &mut R,
    to: &mut Sending,
    activity: &Activity,
) -> io::Result<u64> {
    let mut buffer = BytesMut::new();
    let mut moved = 0u64;
    loop {
        buffer.reserve(if moved < BULK_AFTER { READ } else { BULK_READ });
        let n = from.read_buf(&mut buffer).await?;
        if n == 0 {
            to.finish().await?;
            return Ok(moved);
        }
        activity.progress();
        to.send(buffer.split().freeze()).await?;
        activity.progress();
        moved += n as u64;
    }
}

/// The tunnel's bytes to the client; the tunnel's end of stream ends the client's receiving side.
async fn out_of_tunnel<W: AsyncWrite + Unpin>(
    from: &mut Receiving,
    to: &mut W,
    activity: &Activity,
) -> io::Result<u64> {
    let mut moved = 0u64;
    while let Some(data) = from.recv().await? {
        activity.progress();
        to.write_all(&data).await?;
        activity.progress();
        moved += data.len() as u64;
    }
    to.shutdown().await?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::hbone::test_pair;

    fn timeouts(idle_ms: u64) -> Timeouts {
        Timeouts {
            idle: Duration::from_millis(idle_ms),
            write: Duration::from_secs(30),
        }
    }

    #[tokio::test]
    async fn bytes_and_half_closes_go_both_ways() {
        let (client, mut client_far) = tokio::io::duplex(1024);
        let (mut tunnel, mut tunnel_far) = test_pair().await;
        let relay = tokio::spawn(async move {
            relay_tunnel(tokio::io::split(client), &mut tunnel, timeouts(5000)).await
        });
        client_far.write_all(b"ping").await.unwrap();
        client_far.shutdown().await.unwrap();
        assert_eq!(tunnel_far.recv.read_to_end().await.unwrap(), b"ping");
        // The tunnel's side still answers after the client half-closed.
        tunnel_far
            .send
            .send(Bytes::from_static(b"pong!"))
            .await
            .unwrap();
        tunnel_far.send.finish().await.unwrap();
        let mut back = Vec::new();
        client_far.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"pong!");
        let carried = relay.await.unwrap().unwrap();
        assert_eq!((carried.sent, carried.received), (4, 5));
    }

    #[tokio::test]
    async fn a_bulk_transfer_arrives_whole_in_both_directions() {
        let (client, client_far) = tokio::io::duplex(64 * 1024);
        let (mut tunnel, mut tunnel_far) = test_pair().await;
        let relay = tokio::spawn(async move {
            relay_tunnel(tokio::io::split(client), &mut tunnel, timeouts(5000)).await
        });
        // Past the switch to bulk reads, and past a stream window, each way.
        let data: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 253) as u8).collect();
        let upload = data.clone();
        let (mut client_read, mut client_write) = tokio::io::split(client_far);
        let writer = tokio::spawn(async move {
            client_write.write_all(&upload).await.unwrap();
            client_write.shutdown().await.unwrap();
        });
        let got = tunnel_far.recv.read_to_end().await.unwrap();
        assert!(
            got == data,
            "the upload changed on the way ({} bytes)",
            got.len()
        );
        let download = Bytes::from(data.clone());
        let far_writer = tokio::spawn(async move {
            tunnel_far.send.send(download).await.unwrap();
            tunnel_far.send.finish().await.unwrap();
            tunnel_far
        });
        let mut back = Vec::new();
        client_read.read_to_end(&mut back).await.unwrap();
        far_writer.await.unwrap();
        assert!(
            back == data,
            "the download changed on the way ({} bytes)",
            back.len()
        );
        writer.await.unwrap();
        let carried = relay.await.unwrap().unwrap();
        assert_eq!((carried.sent, carried.received), (9 << 20, 9 << 20));
    }

    #[tokio::test]
    async fn a_tunnel_where_nothing_moves_ends_at_the_idle_timeout() {
        let (client, _client_far) = tokio::io::duplex(1024);
        let (mut tunnel, _tunnel_far) = test_pair().await;
        let started = std::time::Instant::now();
        let ended = relay_tunnel(tokio::io::split(client), &mut tunnel, timeouts(200)).await;
        assert!(matches!(ended, Err(RelayError::Idle(_))), "{ended:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_far_side_that_takes_nothing_ends_at_the_idle_timeout() {
        let (client, mut client_far) = tokio::io::duplex(64 * 1024);
        // The far end never reads: once the stream's window is spent, nothing moves.
        let (mut tunnel, _tunnel_far) = test_pair().await;
        let writer = tokio::spawn(async move {
            let _ = client_far.write_all(&vec![7u8; 16 << 20]).await;
            client_far
        });
        let ended = relay_tunnel(tokio::io::split(client), &mut tunnel, timeouts(300)).await;
        assert!(matches!(ended, Err(RelayError::Idle(_))), "{ended:?}");
        writer.abort();
    }

    #[tokio::test]
    async fn a_reset_from_the_far_side_ends_the_relay_with_an_error() {
        let (client, _client_far) = tokio::io::duplex(1024);
        let (mut tunnel, mut tunnel_far) = test_pair().await;
        tunnel_far.send.send_reset(h2::Reason::INTERNAL_ERROR);
        let ended = relay_tunnel(tokio::io::split(client), &mut tunnel, timeouts(5000)).await;
        assert!(matches!(ended, Err(RelayError::Io(_))), "{ended:?}");
    }
}
