//! `conn-timer ADDR ATTEMPTS TIMEOUT_MS`: one connection at a time to ADDR, ATTEMPTS times. Each
//! connects, sends `GET / HTTP/1.0` and reads until the connection ends; it is timed from before
//! `connect()` to its return (`connect`) and to the end the client sees (`done`): the server's answer
//! read to its close, or the reset of a refused connection. Prints how each attempt ended and the
//! percentiles of both times in µs, one `key value` a line.
//!
//! The bench (`--authz-only`) runs it in the client Pod to time what a refused connection costs
//! the client. It uses the standard library only, so the bench compiles it with `rustc` alone
//! (`bench/src/authz.rs`); as a target of the crate it is built and linted with the rest.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How one attempt ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// Bytes came back (the server's answer), then the connection ended.
    Answered,
    /// Reset before any byte came back: refused.
    Refused,
    /// Closed without a byte and without a reset.
    Closed,
    /// `connect()` itself failed.
    ConnectFailed,
    /// Nothing happened within the timeout.
    TimedOut,
}

const ENDS: [(End, &str); 5] = [
    (End::Answered, "answered"),
    (End::Refused, "refused"),
    (End::Closed, "closed"),
    (End::ConnectFailed, "connect_failed"),
    (End::TimedOut, "timed_out"),
];

const REQUEST: &[u8] = b"GET / HTTP/1.0\r\nHost: bench\r\n\r\n";

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
    for _ in 0..attempts {
        let (end, connected, ended) = attempt(addr, timeout);
        let at = ENDS.iter().position(|(e, _)| *e == end).unwrap_or(0);
        counts[at] += 1;
        connect.extend(connected);
        done.push(ended);
    }
    println!("attempts {attempts}");
    for ((_, name), n) in ENDS.iter().zip(counts) {
        println!("{name} {n}");
    }
    for (name, times) in [("connect", &mut connect), ("done", &mut done)] {
        times.sort_by(f64::total_cmp);
        for (p, label) in [(0.5, "p50"), (0.99, "p99"), (1.0, "max")] {
            println!("{name}_{label}_us {:.1}", percentile(times, p));
        }
    }
    ExitCode::SUCCESS
}

/// One attempt: how it ended, the µs to `connect()`'s return (if it returned) and to the end.
fn attempt(addr: SocketAddr, timeout: Duration) -> (End, Option<f64>, f64) {
    let micros = |since: Instant| since.elapsed().as_secs_f64() * 1e6;
    let start = Instant::now();
    let mut stream = match TcpStream::connect_timeout(&addr, timeout) {
        Ok(stream) => stream,
        Err(e) if e.kind() == ErrorKind::TimedOut => return (End::TimedOut, None, micros(start)),
        Err(_) => return (End::ConnectFailed, None, micros(start)),
    };
    let connected = micros(start);
    let end = talk(&mut stream, timeout);
    (end, Some(connected), micros(start))
}

/// Sends the request and reads until the connection ends.
fn talk(stream: &mut TcpStream, timeout: Duration) -> End {
    let reset = |kind: ErrorKind| {
        matches!(
            kind,
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
        )
    };
    if stream.set_read_timeout(Some(timeout)).is_err() {
        return End::ConnectFailed;
    }
    if let Err(e) = stream.write_all(REQUEST) {
        return if reset(e.kind()) {
            End::Refused
        } else {
            End::ConnectFailed
        };
    }
    let (mut buf, mut got) = ([0u8; 4096], 0usize);
    loop {
        match stream.read(&mut buf) {
            Ok(0) if got > 0 => return End::Answered,
            Ok(0) => return End::Closed,
            Ok(n) => got += n,
            Err(e) if reset(e.kind()) && got > 0 => return End::Answered,
            Err(e) if reset(e.kind()) => return End::Refused,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return End::TimedOut;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return End::Closed,
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
