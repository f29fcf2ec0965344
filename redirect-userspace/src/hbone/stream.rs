//! One HBONE tunnel's HTTP/2 stream, driven with `h2` directly, and what both ends of a tunnel
//! share: the connection settings and the keep-alive.
//!
//! Bytes cross it without a copy of our own: a chunk read from a socket is frozen and handed to
//! `h2` as it is, and a received frame's payload goes to the socket from `h2`'s read buffer. (An
//! upgraded hyper stream copied each write into a channel to another task, and each read into the
//! caller's buffer.)
use std::{future::poll_fn, io, time::Duration};

use bytes::Bytes;
use h2::{Ping, PingPong, Reason, RecvStream, SendStream};

/// Streams a server takes at once on one connection, as hyper's and ztunnel's servers do.
const MAX_CONCURRENT_STREAMS: u32 = 200;

/// How often an idle connection is pinged, and how long the answer may take before the connection
/// is taken for dead (a peer gone without a FIN would otherwise hold it, and its streams, forever).
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Largest header block taken from a peer: a `CONNECT` and its answer are a few hundred bytes.
const MAX_HEADER_LIST: u32 = 16 * 1024;

/// The client side's connection settings.
pub(crate) fn client_builder() -> h2::client::Builder {
    let mut builder = h2::client::Builder::new();
    builder
        .initial_window_size(super::STREAM_WINDOW)
        .initial_connection_window_size(super::CONNECTION_WINDOW)
        .max_frame_size(super::FRAME_SIZE)
        .max_header_list_size(MAX_HEADER_LIST)
        // A stream may queue a whole window: it is filled, then written out in one go.
        .max_send_buffer_size(super::STREAM_WINDOW as usize)
        .enable_push(false);
    builder
}

/// The receiving side's connection settings.
pub(crate) fn server_builder() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .initial_window_size(super::STREAM_WINDOW)
        .initial_connection_window_size(super::CONNECTION_WINDOW)
        .max_frame_size(super::FRAME_SIZE)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(super::STREAM_WINDOW as usize)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    builder
}

/// Pings the peer every [`PING_INTERVAL`]; returns once it left one unanswered for
/// [`PING_TIMEOUT`], or the connection failed. Polled beside the connection, which carries the
/// pings. Never returns without `pings`.
pub(crate) async fn keep_alive(pings: Option<PingPong>) {
    let Some(mut pings) = pings else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(PING_INTERVAL).await;
        match tokio::time::timeout(PING_TIMEOUT, pings.ping(Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

/// A tunnel's stream: what the peer sends and what we send it.
#[derive(Debug)]
pub(crate) struct H2Stream {
    pub send: Sending,
    pub recv: Receiving,
}

impl H2Stream {
    pub(crate) fn new(send: SendStream<Bytes>, recv: RecvStream) -> Self {
        H2Stream {
            send: Sending(send),
            recv: Receiving(recv),
        }
    }
}

/// The half of a stream we send on.
#[derive(Debug)]
pub(crate) struct Sending(SendStream<Bytes>);

impl Sending {
    /// Queues all of `data`, waiting for flow-control window as the peer grants it.
    pub(crate) async fn send(&mut self, mut data: Bytes) -> io::Result<()> {
        while !data.is_empty() {
            self.0.reserve_capacity(data.len());
            let granted = match poll_fn(|cx| self.0.poll_capacity(cx)).await {
                Some(Ok(granted)) => granted,
                // The stream was reset, or ended: its reason says which.
                Some(Err(_)) | None => return Err(self.reset().await),
            };
            if granted == 0 {
                continue;
            }
            let chunk = data.split_to(granted.min(data.len()));
            if self.0.send_data(chunk, false).is_err() {
                return Err(self.reset().await);
            }
        }
        Ok(())
    }

    /// Ends the stream (a half-close: the peer may go on sending).
    pub(crate) async fn finish(&mut self) -> io::Result<()> {
        match self.0.send_data(Bytes::new(), true) {
            Ok(()) => Ok(()),
            Err(_) => Err(self.reset().await),
        }
    }

    /// Resets the stream with `reason`, as a peer would.
    #[cfg(test)]
    pub(crate) fn send_reset(&mut self, reason: Reason) {
        self.0.send_reset(reason);
    }

    /// Why the stream can take nothing more.
    async fn reset(&mut self) -> io::Error {
        match poll_fn(|cx| self.0.poll_reset(cx)).await {
            Ok(reason) => reset_error(reason),
            Err(e) => h2_error(e),
        }
    }
}

/// The half of a stream we receive on.
#[derive(Debug)]
pub(crate) struct Receiving(RecvStream);

impl Receiving {
    /// The next bytes the peer sent; `None` once it ended its side. The flow-control window is
    /// given back as soon as they are handed out: whoever takes them holds them, not `h2`.
    pub(crate) async fn recv(&mut self) -> io::Result<Option<Bytes>> {
        loop {
            match poll_fn(|cx| self.0.poll_data(cx)).await {
                None => return Ok(None),
                Some(Ok(data)) if data.is_empty() => continue,
                Some(Ok(data)) => {
                    let _ = self.0.flow_control().release_capacity(data.len());
                    return Ok(Some(data));
                }
                Some(Err(e)) => {
                    return match e.reason() {
                        // A peer that cancels its stream closed it.
                        Some(Reason::NO_ERROR | Reason::CANCEL) => Ok(None),
                        _ => Err(h2_error(e)),
                    };
                }
            }
        }
    }

    /// Everything the peer sends until it ends its side.
    #[cfg(test)]
    pub(crate) async fn read_to_end(&mut self) -> io::Result<Vec<u8>> {
        let mut all = Vec::new();
        while let Some(data) = self.recv().await? {
            all.extend_from_slice(&data);
        }
        Ok(all)
    }
}

/// A stream reset by the peer, as an I/O error: what a TCP reset is to a socket.
fn reset_error(reason: Reason) -> io::Error {
    let kind = match reason {
        Reason::NO_ERROR | Reason::CANCEL | Reason::STREAM_CLOSED => io::ErrorKind::BrokenPipe,
        _ => io::ErrorKind::ConnectionReset,
    };
    io::Error::new(kind, h2::Error::from(reason))
}

fn h2_error(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("HTTP/2 I/O error"))
    } else {
        io::Error::other(e)
    }
}

/// A client stream and the server's stream of one `CONNECT`, over an in-memory connection with
/// the settings both ends use.
#[cfg(test)]
pub(crate) async fn test_pair() -> (H2Stream, H2Stream) {
    let (near, far) = tokio::io::duplex(1 << 20);
    let server = tokio::spawn(async move {
        let mut conn = server_builder().handshake::<_, Bytes>(far).await.unwrap();
        let (request, mut respond) = conn.accept().await.unwrap().unwrap();
        let send = respond
            .send_response(http::Response::new(()), false)
            .unwrap();
        tokio::spawn(async move { while conn.accept().await.is_some() {} });
        H2Stream::new(send, request.into_body())
    });
    let (client, conn) = client_builder().handshake(near).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri("10.0.0.1:80")
        .body(())
        .unwrap();
    let (response, send) = client.send_request(request, false).unwrap();
    let server = server.await.unwrap();
    let response = response.await.unwrap();
    (H2Stream::new(send, response.into_body()), server)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: usize = super::super::STREAM_WINDOW as usize;

    #[tokio::test]
    async fn bytes_larger_than_a_window_arrive_whole_and_in_order() {
        let (mut client, mut server) = test_pair().await;
        // Three stream windows: the sender waits for the receiver to give window back.
        let data: Vec<u8> = (0..3 * WINDOW).map(|i| (i % 251) as u8).collect();
        let sent = Bytes::from(data.clone());
        let sender = tokio::spawn(async move {
            client.send.send(sent).await.unwrap();
            client.send.finish().await.unwrap();
            client
        });
        let got = server.recv.read_to_end().await.unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the bytes changed on the way");
        sender.await.unwrap();
    }

    #[tokio::test]
    async fn a_cancelled_stream_ends_for_the_receiver_and_breaks_the_sender() {
        let (mut client, mut server) = test_pair().await;
        server.send.send_reset(Reason::CANCEL);
        assert!(matches!(client.recv.recv().await, Ok(None)));
        let refused = client
            .send
            .send(Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::BrokenPipe, "{refused}");
    }

    #[tokio::test]
    async fn a_stream_reset_on_error_is_an_error_both_ways() {
        let (mut client, mut server) = test_pair().await;
        server.send.send_reset(Reason::INTERNAL_ERROR);
        assert!(client.recv.recv().await.is_err());
        let refused = client
            .send
            .send(Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionReset, "{refused}");
    }
}
