//! The faults `rdt-peer hbone` plays for the HBONE client's tests: a peer that takes TCP and never
//! answers TLS, and one whose first connection turns away its first `CONNECT` before hyper sees
//! it, with GOAWAY(last_stream_id=0, NO_ERROR) or RST_STREAM(REFUSED_STREAM). hyper's server
//! cannot say either: it has processed a stream once it hands it over, so the turning away is
//! done on the HTTP/2 frames between the client and hyper. hyper never sees the stream turned
//! away, so its header block must not index headers for the next ones: hyper's settings tell the
//! client so (HPACK table size 0), and the answer is sent after them, so a stream the client
//! sends again is encoded without the table.
use std::io::ErrorKind;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

use super::say;

/// What the stand-in does wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Nothing: every connection is served.
    None,
    /// Every connection is taken and held, and TLS never answered.
    StallTls,
    /// The first connection's first `CONNECT` gets GOAWAY(last_stream_id=0, NO_ERROR).
    GoawayFirst,
    /// The first connection's first `CONNECT` gets RST_STREAM(REFUSED_STREAM).
    RefuseFirstStream,
}

impl Fault {
    /// Whether connection `n` (from 1) has its first stream turned away.
    pub(super) fn turns_away(self, n: usize) -> bool {
        n == 1 && matches!(self, Fault::GoawayFirst | Fault::RefuseFirstStream)
    }
}

const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const NO_ERROR: u32 = 0x0;
const REFUSED_STREAM: u32 = 0x7;

/// Holds connection `n` without a word until the client leaves; prints `stalled n= secs=`.
pub(super) async fn stall(mut stream: TcpStream, n: usize) {
    let start = Instant::now();
    let mut sink = [0u8; 4096];
    while let Ok(read) = stream.read(&mut sink).await {
        if read == 0 {
            break;
        }
    }
    say(&format!(
        "stalled n={n} secs={:.1}",
        start.elapsed().as_secs_f64()
    ));
}

/// One whole frame (header and payload), or `None` at the end of the stream.
async fn read_frame<R: AsyncRead + Unpin>(from: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut frame = vec![0u8; FRAME_HEADER];
    match from.read_exact(&mut frame).await {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes([0, frame[0], frame[1], frame[2]]) as usize;
    frame.resize(FRAME_HEADER + len, 0);
    from.read_exact(&mut frame[FRAME_HEADER..]).await?;
    Ok(Some(frame))
}

fn stream_id(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff
}

fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, 0];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// The frame turning away `stream`, and the line saying so.
fn turn_away(fault: Fault, stream: u32) -> (Vec<u8>, String) {
    if fault == Fault::RefuseFirstStream {
        let rst = frame(RST_STREAM, stream, &REFUSED_STREAM.to_be_bytes());
        return (
            rst,
            format!("refused stream={stream} reason=REFUSED_STREAM"),
        );
    }
    let mut payload = 0u32.to_be_bytes().to_vec();
    payload.extend_from_slice(&NO_ERROR.to_be_bytes());
    let goaway = frame(GOAWAY, 0, &payload);
    (
        goaway,
        format!("goaway stream={stream} last_stream_id=0 reason=NO_ERROR"),
    )
}

/// Carries HTTP/2 between the client (`tls`) and hyper's end of `server`, frame by frame, except
/// the client's first stream: its frames never reach hyper, and the client gets `fault`'s frame.
pub(super) async fn turn_away_first_stream<S>(
    tls: S,
    server: DuplexStream,
    fault: Fault,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut from_client, mut to_client) = tokio::io::split(tls);
    let (mut from_server, mut to_server) = tokio::io::split(server);
    // Whole frames to the client, from hyper and from the turning away, one at a time.
    let (out, mut outgoing) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = async move {
        while let Some(frame) = outgoing.recv().await {
            to_client.write_all(&frame).await?;
            to_client.flush().await?;
        }
        to_client.shutdown().await
    };
    let server_out = out.clone();
    // Whether hyper's settings went out.
    let (settled, mut settings_sent) = watch::channel(false);
    let server_frames = async move {
        while let Some(frame) = read_frame(&mut from_server).await? {
            if server_out.send(frame).is_err() {
                break;
            }
            settled.send_replace(true);
        }
        Ok(())
    };
    let client_frames = async move {
        let mut preface = [0u8; PREFACE_LEN];
        from_client.read_exact(&mut preface).await?;
        to_server.write_all(&preface).await?;
        let mut turned_away = None;
        while let Some(frame) = read_frame(&mut from_client).await? {
            let stream = stream_id(&frame);
            if turned_away.is_none() && frame[3] == HEADERS {
                turned_away = Some(stream);
                // Without settings from hyper, hyper has ended: the answer goes nowhere.
                let _ = settings_sent.wait_for(|sent| *sent).await;
                let (answer, line) = turn_away(fault, stream);
                let _ = out.send(answer);
                say(&line);
                continue;
            }
            // Its CONTINUATION and DATA frames, if any, go nowhere.
            if turned_away == Some(stream) {
                continue;
            }
            // A client that took GOAWAY opens no stream on the connection: one that does is
            // told in the log, and its stream goes nowhere.
            if fault == Fault::GoawayFirst && frame[3] == HEADERS {
                say(&format!("late stream={stream} after goaway"));
                turned_away = Some(stream);
                continue;
            }
            to_server.write_all(&frame).await?;
        }
        drop(out);
        to_server.shutdown().await
    };
    tokio::try_join!(writer, server_frames, client_frames).map(|_| ())
}
