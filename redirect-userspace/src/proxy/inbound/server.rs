//! One HBONE connection's HTTP/2 side, as the receiving end serves it: streams in flight (dialling
//! the Pod included) capped per connection, a connection without streams closed once idle, and a
//! stream's dial given up when the peer resets the stream.
use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use h2::{Reason, RecvStream, server::SendResponse};
use http::Request;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tracing::debug;

use crate::hbone::{self, HboneMetrics};

/// Streams a peer may have at once on one connection, counted until each stream's task ends (its
/// dial to the Pod too, not only while HTTP/2 deems the stream open), as ztunnel's server caps them.
pub(super) const STREAMS_PER_CONNECTION: usize = 200;

/// How long a connection may go without a stream before it is closed: the pings that keep a pooled
/// connection alive would otherwise hold an idle one, and its descriptor, forever.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a closing connection is given to end its last exchanges (`GOAWAY`).
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The largest frame a peer may send: `hbone::Receiving` gives a frame's window back as it hands the
/// frame to the relay, which holds it until the Pod takes it, so a Pod that never reads holds one
/// frame per stream beyond the connection's window: 200 of 1 MiB (`hbone::FRAME_SIZE`) would be
/// 200 MiB a connection, 200 of 128 KiB are 25 MiB. What we send is framed as the peer asks.
pub(crate) const RECEIVED_FRAME: u32 = 128 * 1024;

/// How long a peer may take over the HTTP/2 handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug)]
pub(super) struct Settings {
    pub streams: usize,
    pub idle: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            streams: STREAMS_PER_CONNECTION,
            idle: IDLE_TIMEOUT,
        }
    }
}

/// A stream's place among its connection's, held by its task until it ends.
pub(super) type StreamPermit = OwnedSemaphorePermit;

/// Serves HTTP/2 on `io` until the peer ends the connection, fails, leaves a ping unanswered, or
/// holds no stream for `settings.idle`; each stream accepted is handed to `on_stream` with its
/// place, one past the cap is refused (`REFUSED_STREAM`). Once `closing` resolves the peer is
/// told to open no more streams (`GOAWAY`); the connection ends after the last one open.
pub(super) async fn serve<IO, F>(
    io: IO,
    settings: Settings,
    metrics: &HboneMetrics,
    peer: std::net::SocketAddr,
    closing: impl Future<Output = ()>,
    mut on_stream: F,
) where
    IO: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(Request<RecvStream>, SendResponse<Bytes>, StreamPermit),
{
    let mut builder = hbone::server_builder();
    builder
        .max_concurrent_streams(u32::try_from(settings.streams).unwrap_or(u32::MAX))
        .max_frame_size(RECEIVED_FRAME);
    let handshake = builder.handshake::<_, Bytes>(io);
    let mut connection = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "HBONE peer failed the HTTP/2 handshake");
            return;
        }
        Err(_) => {
            debug!(%peer, "HBONE peer did not finish the HTTP/2 handshake in time");
            return;
        }
    };
    let streams = Arc::new(Semaphore::new(settings.streams));
    let keep_alive = hbone::keep_alive(connection.ping_pong());
    tokio::pin!(keep_alive);
    // Streams end in their own tasks: whether any is left is looked at a few times per idle period.
    let mut look = tokio::time::interval(settings.idle / 4);
    let mut busy = Instant::now();
    tokio::pin!(closing);
    let mut told = false;
    loop {
        // Accepting is also what drives the connection's I/O, for the streams already open too.
        tokio::select! {
            accepted = connection.accept() => match accepted {
                Some(Ok((request, mut respond))) => match streams.clone().try_acquire_owned() {
                    Ok(permit) => {
                        busy = Instant::now();
                        on_stream(request, respond, permit);
                    }
                    Err(_) => {
                        metrics.inbound("stream_limit");
                        debug!(%peer, "HBONE peer past its streams in flight; stream refused");
                        respond.send_reset(Reason::REFUSED_STREAM);
                    }
                },
                Some(Err(e)) => {
                    debug!(%peer, error = %e, "HBONE connection ended with an error");
                    return;
                }
                None => return,
            },
            () = &mut closing, if !told => {
                told = true;
                debug!(%peer, "the agent stops serving; the HBONE peer is told to open no more streams");
                connection.graceful_shutdown();
            }
            () = &mut keep_alive => {
                debug!(%peer, "HBONE peer left a ping unanswered; closing the connection");
                return;
            }
            _ = look.tick() => {
                if streams.available_permits() < settings.streams {
                    busy = Instant::now();
                } else if busy.elapsed() >= settings.idle {
                    metrics.inbound("idle_closed");
                    debug!(%peer, "HBONE connection without streams for the idle timeout; closing");
                    return close(connection).await;
                }
            }
        }
    }
}

/// Ends a connection that has no stream: `GOAWAY`, then its last frames, for [`CLOSE_GRACE`] at most.
async fn close<IO: AsyncRead + AsyncWrite + Unpin>(
    mut connection: h2::server::Connection<IO, Bytes>,
) {
    connection.graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while let Some(Ok(_)) = connection.accept().await {}
    })
    .await;
}

/// `work` (a stream's dial to the Pod), unless the peer resets the stream first: then `None`, and
/// `work` is dropped, its socket closed, at once.
pub(super) async fn unless_reset<T>(
    respond: &mut SendResponse<Bytes>,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        done = work => Some(done),
        _ = std::future::poll_fn(|cx| respond.poll_reset(cx)) => None,
    }
}
