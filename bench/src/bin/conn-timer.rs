//! `conn-timer ADDR ATTEMPTS TIMEOUT_MS`: one connection at a time to ADDR, ATTEMPTS times. Each
//! connects with a blocking `connect()`, as most clients do, sends `GET / HTTP/1.0` and reads
//! until the connection ends (a read waits at most TIMEOUT_MS). It is timed from before
//! `connect()` to its return (`connect`, whether it connected or failed) and to the end the client
//! sees (`done`): the server's answer read to its close, or the refusal: `connect()` failing with
//! ECONNREFUSED (a reset answered the SYN, as the kernel's inbound authorization does) or a reset
//! of an established connection before any byte came back. Prints how each attempt ended, each
//! distinct error of the attempts that failed otherwise (`error COUNT TEXT`), and the percentiles
//! of both times in µs, one `key value` a line.
//!
//! The bench (`--authz-only`) runs it in the client Pod to time what one connection costs the
//! client, answered or refused. It uses the standard library only, so the bench compiles it with
//! `rustc` alone (`bench/src/authz.rs`); as a target of the crate it is built and linted with the
//! rest.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How one attempt ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// Bytes came back (the server's answer), then the connection ended.
    Answered,
    /// Refused: `connect()` failed with a refusal (ECONNREFUSED, or ECONNRESET), or the connection
    /// was reset before any byte came back.
    Refused,
    /// Closed without a byte and without a reset.
    Closed,
    /// `connect()` failed otherwise, or the connection ended in an error that is not a reset.
    Failed,
    /// A read waited past the timeout (or `connect()` gave up: ETIMEDOUT).
    TimedOut,
}

const ENDS: [(End, &str); 5] = [
    (End::Answered, "answered"),
    (End::Refused, "refused"),
    (End::Closed, "closed"),
    (End::Failed, "failed"),
    (End::TimedOut, "timed_out"),
];

const REQUEST: &[u8] = b"GET / HTTP/1.0\r\nHost: bench\r\n\r\n";

/// How an attempt ended, with the error that ended a failed one.
type Ended = (End, Option<String>);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [addr, attempts, timeout] => addr
            .parse::<SocketAddr>()
            .ok()
            .zip(attempts.parse::<usize>().ok())
            .zip(timeout.parse::<u64>().ok()),
        _ => None,
    };
    let Some(((addr, attempts), timeout_ms)) = parsed else {
        eprintln!("usage: conn-timer ADDR ATTEMPTS TIMEOUT_MS");
        return ExitCode::from(2);
    };
    let timeout = Duration::from_millis(timeout_ms);
    let mut counts = [0usize; ENDS.len()];
    let (mut connect, mut done) = (Vec::new(), Vec::new());
    let mut errors: Vec<(String, usize)> = Vec::new();
    for _ in 0..attempts {
        let ((end, error), connected, ended) = attempt(addr, timeout);
        let at = ENDS.iter().position(|(e, _)| *e == end).unwrap_or(0);
        counts[at] += 1;
        if let Some(error) = error {
            match errors.iter_mut().find(|(e, _)| *e == error) {
                Some((_, n)) => *n += 1,
                None => errors.push((error, 1)),
            }
        }
        connect.push(connected);
        done.push(ended);
    }
    println!("attempts {attempts}");
    for ((_, name), n) in ENDS.iter().zip(counts) {
        println!("{name} {n}");
    }
    for (error, n) in errors {
        println!("error {n} {error}");
    }
    for (name, times) in [("connect", &mut connect), ("done", &mut done)] {
        times.sort_by(f64::total_cmp);
        for (p, label) in [(0.5, "p50"), (0.99, "p99"), (1.0, "max")] {
            println!("{name}_{label}_us {:.1}", percentile(times, p));
        }
    }
    ExitCode::SUCCESS
}

/// One attempt: how it ended, the µs to `connect()`'s return and to the end.
fn attempt(addr: SocketAddr, timeout: Duration) -> (Ended, f64, f64) {
    let micros = |since: Instant| since.elapsed().as_secs_f64() * 1e6;
    let start = Instant::now();
    // A blocking connect(): it returns once the handshake is done, or with the error of a SYN
    // answered by a reset.
    let mut stream = match TcpStream::connect(addr) {
        Ok(stream) => stream,
        Err(e) => {
            let took = micros(start);
            let end = match e.kind() {
                ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => (End::Refused, None),
                ErrorKind::TimedOut => (End::TimedOut, Some(format!("connect: {e}"))),
                _ => (End::Failed, Some(format!("connect: {e}"))),
            };
            return (end, took, took);
        }
    };
    let connected = micros(start);
    let end = talk(&mut stream, timeout);
    (end, connected, micros(start))
}

/// Sends the request and reads until the connection ends.
fn talk(stream: &mut TcpStream, timeout: Duration) -> Ended {
    let reset = |kind: ErrorKind| {
        matches!(
            kind,
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
        )
    };
    if let Err(e) = stream.set_read_timeout(Some(timeout)) {
        return (End::Failed, Some(format!("SO_RCVTIMEO: {e}")));
    }
    if let Err(e) = stream.write_all(REQUEST) {
        return if reset(e.kind()) {
            (End::Refused, None)
        } else {
            (End::Failed, Some(format!("write: {e}")))
        };
    }
    let (mut buf, mut got) = ([0u8; 4096], 0usize);
    loop {
        match stream.read(&mut buf) {
            Ok(0) if got > 0 => return (End::Answered, None),
            Ok(0) => return (End::Closed, None),
            Ok(n) => got += n,
            Err(e) if reset(e.kind()) && got > 0 => return (End::Answered, None),
            Err(e) if reset(e.kind()) => return (End::Refused, None),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return (End::TimedOut, None);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return (End::Failed, Some(format!("read: {e}"))),
        }
    }
}

/// The value at rank `p` (0 to 1, nearest rank) of sorted `values`; 0 for none.
fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}
