//! Load and failure clients: a DNS flood, many idle connections, a connection storm that sorts every
//! connection into worked / reset / hung, and one-way streams that report how they ended.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use integration::pattern::Pattern;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::client::dns_query;

/// Sends junk and valid queries in turn, as fast as one socket can, for `seconds`.
pub(crate) fn dns_flood(server: SocketAddr, seconds: u64) -> Result<()> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").context("binding")?;
    // Connected, as glibc and dig do: the kernel hooks steer it to the agent.
    socket.connect(server).context("connecting")?;
    socket.set_nonblocking(true)?;
    let junk: Vec<&[u8]> = vec![b"\x00", b"GET / HTTP/1.1\r\n\r\n", &[0xff; 64]];
    let (mut valid, mut junked, mut replies, mut dropped) = (0u64, 0u64, 0u64, 0u64);
    let mut buf = [0u8; 4096];
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut i = 0u64;
    while Instant::now() < end {
        for _ in 0..64 {
            i += 1;
            let sent = if i.is_multiple_of(2) {
                // A new name each time: nothing is cached, every query goes upstream.
                let query = dns_query((i & 0xffff) as u16, &format!("q{i}.flood.test"))?;
                socket.send(&query).map(|_| valid += 1)
            } else {
                socket.send(junk[(i / 2 % 3) as usize]).map(|_| junked += 1)
            };
            if sent.is_err() {
                dropped += 1; // a full socket buffer: the flood is as fast as it can be
            }
            while socket.recv(&mut buf).is_ok() {
                replies += 1;
            }
        }
    }
    println!("valid={valid} junk={junked} unsent={dropped} replies={replies} seconds={seconds}");
    Ok(())
}

/// Opens `conns` connections, sends nothing, and after a second says how many are still open and
/// how many the far end reset; holds them until stdin closes or a line arrives.
pub(crate) fn hold_idle(addr: SocketAddr, conns: usize) -> Result<()> {
    let (mut open, mut reset, mut closed) = (0, 0, 0);
    let mut streams = Vec::new();
    for i in 0..conns {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
            Ok(s) => streams.push(s),
            // Reset so fast that connect() itself reports it.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => reset += 1,
            Err(e) => return Err(e).with_context(|| format!("connection {i}")),
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let mut byte = [0u8; 1];
    for s in &streams {
        s.set_nonblocking(true)?;
        match (&*s).read(&mut byte) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => open += 1,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => reset += 1,
            _ => closed += 1,
        }
    }
    println!("open={open} reset={reset} closed={closed}");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}

/// Opens `count` UDP sockets connected to `server` (nothing is sent), reads each one's peer back,
/// prints `open N original=M` (M: how many showed `server`) and holds them until stdin closes or a
/// line arrives.
pub(crate) fn udp_connected(server: SocketAddr, count: usize) -> Result<()> {
    // Local ports shared (SO_REUSEADDR): a pod has fewer ephemeral ports than sockets wanted. A few
    // dozen sockets a port, not all on one: bind() checks every socket already on its port.
    const PORTS: std::ops::Range<u16> = 20_000..22_048;
    let domain = match server {
        SocketAddr::V4(_) => socket2::Domain::IPV4,
        SocketAddr::V6(_) => socket2::Domain::IPV6,
    };
    let mut sockets = Vec::with_capacity(count);
    let mut original = 0;
    for i in 0..count {
        let port = PORTS.start + (i % PORTS.len()) as u16;
        let local = SocketAddr::new(
            match server {
                SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
            },
            port,
        );
        let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, None)
            .with_context(|| format!("socket {i}"))?;
        socket.set_reuse_address(true)?;
        socket
            .bind(&local.into())
            .with_context(|| format!("binding socket {i} to {local}"))?;
        socket
            .connect(&server.into())
            .with_context(|| format!("connecting socket {i}"))?;
        // As resolvers do: read the peer back (the kernel looks up the original destination).
        let peer = socket.peer_addr().context("getpeername")?.as_socket();
        if peer == Some(server) {
            original += 1;
        }
        sockets.push(socket);
    }
    println!("open {} original={original}", sockets.len());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}

/// Non-blocking connects, each closed before its handshake completes.
pub(crate) fn abandon(addr: SocketAddr, count: usize) -> Result<()> {
    let domain = match addr {
        SocketAddr::V4(_) => socket2::Domain::IPV4,
        SocketAddr::V6(_) => socket2::Domain::IPV6,
    };
    for i in 0..count {
        let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)
            .with_context(|| format!("socket {i}"))?;
        socket.set_nonblocking(true)?;
        match socket.connect(&addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(e).with_context(|| format!("connect {i}")),
        }
        drop(socket); // in SYN_SENT: gone, no FIN; the SYN-ACK that comes back is answered by RST
    }
    println!("abandoned {count}");
    Ok(())
}

/// Short connections in a row: send a line, read its echo, close first. A connection that fails
/// counts as reset (reset by the far end, at connect or after) or failed (anything else).
pub(crate) fn churn(addr: SocketAddr, conns: usize) -> Result<()> {
    let started = Instant::now();
    let (mut ok, mut reset, mut failed) = (0u64, 0u64, 0u64);
    let mut first_errors = std::collections::BTreeMap::new();
    for _ in 0..conns {
        let attempt = || -> std::io::Result<()> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"ping\n")?;
            let mut echo = [0u8; 5];
            s.read_exact(&mut echo)?;
            Ok(()) // dropped here: this side closes first
        };
        match attempt() {
            Ok(()) => ok += 1,
            Err(e) => {
                let kind = if e.kind() == ErrorKind::ConnectionReset {
                    reset += 1;
                    "reset"
                } else {
                    failed += 1;
                    "failed"
                };
                first_errors.entry(kind).or_insert_with(|| e.to_string());
            }
        }
    }
    for (kind, error) in &first_errors {
        println!("first {kind}: {error}");
    }
    println!(
        "ok={ok} reset={reset} failed={failed} ms={}",
        started.elapsed().as_millis()
    );
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// The echo came back: the connection works.
    Worked,
    /// Reset by the far end.
    Reset,
    /// A clean end of stream before the echo: a refusal that looks like success.
    Closed,
    /// Nothing within the deadline.
    Hung,
    Failed,
}

/// Opens `conns` connections to an echo server, each sending a line and waiting (10 s at most,
/// stretched under emulation) for it back; prints how each ended, holds the working ones until a line on stdin, then closes all.
pub(crate) fn storm(addr: SocketAddr, conns: usize) -> Result<()> {
    let deadline = integration::pace::scaled(Duration::from_secs(10));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // Connects in waves: the point is connections held at once, not a SYN flood.
        let wave = std::sync::Arc::new(tokio::sync::Semaphore::new(256));
        let tasks: Vec<_> = (0..conns)
            .map(|i| {
                let wave = wave.clone();
                tokio::spawn(async move {
                    let _turn = wave.acquire().await;
                    let started = Instant::now();
                    let line = format!("connection {i}\n");
                    let exchange = async {
                        let mut s = tokio::net::TcpStream::connect(addr).await?;
                        s.write_all(line.as_bytes()).await?;
                        let mut back = vec![0u8; line.len()];
                        s.read_exact(&mut back).await?;
                        Ok::<_, std::io::Error>((s, back == line.as_bytes()))
                    };
                    let (ending, stream) = match tokio::time::timeout(deadline, exchange).await {
                        Ok(Ok((s, true))) => (Ending::Worked, Some(s)),
                        Ok(Ok((_, false))) => (Ending::Failed, None),
                        Ok(Err(e)) => match e.kind() {
                            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                                (Ending::Reset, None)
                            }
                            ErrorKind::UnexpectedEof => (Ending::Closed, None),
                            _ => {
                                eprintln!("connection {i}: {e}");
                                (Ending::Failed, None)
                            }
                        },
                        Err(_) => (Ending::Hung, None),
                    };
                    (ending, started.elapsed(), stream)
                })
            })
            .collect();
        let mut held = Vec::new();
        let mut counts = std::collections::BTreeMap::new();
        let mut slowest_reset = Duration::ZERO;
        for task in tasks {
            let (ending, took, stream) = task.await?;
            *counts
                .entry(format!("{ending:?}").to_lowercase())
                .or_insert(0usize) += 1;
            if ending == Ending::Reset {
                slowest_reset = slowest_reset.max(took);
            }
            held.extend(stream);
        }
        let get = |k: &str| counts.get(k).copied().unwrap_or(0);
        println!(
            "worked={} reset={} closed={} hung={} failed={} slowest_reset_ms={}",
            get("worked"),
            get("reset"),
            get("closed"),
            get("hung"),
            get("failed"),
            slowest_reset.as_millis()
        );
        // Held until told: the test looks at the agent while every working connection is open.
        let mut line = String::new();
        let _ = tokio::task::spawn_blocking(move || std::io::stdin().read_line(&mut line)).await;
        drop(held);
        Ok(())
    })
}

/// Reads until the stream ends; prints `eof <bytes>` for a clean end, `error <bytes> <kind>` else.
pub(crate) fn read(addr: SocketAddr) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => {
                println!("eof {total}");
                return Ok(());
            }
            Ok(n) => total += n as u64,
            Err(e) => {
                println!("error {total} {:?}", e.kind());
                anyhow::bail!("reading after {total} bytes: {e}");
            }
        }
    }
}

/// Writes pattern bytes until the stream fails; prints `error <bytes> <kind>`.
pub(crate) fn write(addr: SocketAddr) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut pattern = Pattern::new();
    let mut total = 0u64;
    loop {
        pattern.fill(&mut buf);
        match s.write_all(&buf) {
            Ok(()) => total += buf.len() as u64,
            Err(e) => {
                println!("error {total} {:?}", e.kind());
                anyhow::bail!("writing after {total} bytes: {e}");
            }
        }
    }
}
