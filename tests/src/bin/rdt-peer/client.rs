//! Clients for what curl cannot show: the peer address the application sees, byte-exact bidirectional
//! streams with half-close, many connections open at once, and one long-lived connection.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use integration::pattern::{self, Pattern};
use sha2::{Digest, Sha256};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn connect(addr: SocketAddr) -> Result<TcpStream> {
    TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))
}

/// `IPPROTO_MPTCP` (linux/in.h).
const IPPROTO_MPTCP: i32 = 262;

pub(crate) fn getpeername(addr: SocketAddr, mptcp: bool) -> Result<()> {
    let s = match mptcp {
        false => connect(addr)?,
        true => {
            let domain = socket2::Domain::for_address(addr);
            let protocol = Some(socket2::Protocol::from(IPPROTO_MPTCP));
            let socket = socket2::Socket::new(domain, socket2::Type::STREAM, protocol)
                .context("an MPTCP socket (net.mptcp.enabled?)")?;
            socket
                .connect_timeout(&addr.into(), CONNECT_TIMEOUT)
                .with_context(|| format!("connecting to {addr} over MPTCP"))?;
            socket.into()
        }
    };
    println!("{}", s.peer_addr().context("getpeername")?);
    Ok(())
}

pub(crate) fn peer_watch(addr: SocketAddr) -> Result<()> {
    let s = connect(addr)?;
    let mut lines = std::io::stdin().lock().lines();
    loop {
        println!("peer {}", s.peer_addr().context("getpeername")?);
        match lines.next() {
            Some(line) => drop(line.context("reading stdin")?),
            None => return Ok(()),
        }
    }
}

/// Writes `n` pattern bytes and half-closes; returns the hex sha256 of what it wrote.
fn send_pattern(mut s: TcpStream, n: u64, rate_mib: u64) -> Result<String> {
    let started = std::time::Instant::now();
    let mut p = Pattern::new();
    let mut h = Sha256::new();
    let mut buf = vec![0; 1 << 16];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        p.fill(&mut buf[..k]);
        s.write_all(&buf[..k]).context("sending")?;
        h.update(&buf[..k]);
        left -= k as u64;
        if rate_mib > 0 {
            // Ahead of schedule: wait until the bytes sent so far are due.
            let due = Duration::from_secs_f64((n - left) as f64 / (rate_mib << 20) as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    s.shutdown(Shutdown::Write).context("half-closing")?;
    Ok(pattern::hex(&h.finalize()))
}

/// Reads to EOF; returns how many bytes and their hex sha256.
fn receive_all(mut s: TcpStream) -> Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).context("receiving")?;
        if n == 0 {
            return Ok((total, pattern::hex(&h.finalize())));
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
}

pub(crate) fn echo(addr: SocketAddr, bytes: u64, rate_mib: u64) -> Result<()> {
    let s = connect(addr)?;
    let writer = s.try_clone()?;
    // Write and read at once: an echo of more than the socket buffers would deadlock otherwise.
    let sender = std::thread::spawn(move || send_pattern(writer, bytes, rate_mib));
    let (received, received_sha) = receive_all(s)?;
    let sent_sha = sender
        .join()
        .map_err(|_| anyhow::anyhow!("sender panicked"))??;
    println!("sent {bytes} {sent_sha}");
    println!("received {received} {received_sha}");
    if received != bytes || received_sha != sent_sha {
        bail!("echo differs from what was sent");
    }
    Ok(())
}

pub(crate) fn fanout(addr: SocketAddr, conns: usize, bytes: usize, wait_stdin: bool) -> Result<()> {
    let streams: Vec<TcpStream> = (0..conns)
        .map(|i| connect(addr).with_context(|| format!("connection {i}")))
        .collect::<Result<_>>()?;
    println!("open {}", streams.len());
    if wait_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .context("waiting for a line on stdin")?;
    }
    let expected = pattern::bytes(bytes);
    let workers: Vec<_> = streams
        .into_iter()
        .map(|s| {
            let expected = expected.clone();
            std::thread::spawn(move || -> Result<()> {
                let mut w = s.try_clone()?;
                w.write_all(&expected)?;
                w.shutdown(Shutdown::Write)?;
                let mut got = Vec::with_capacity(expected.len());
                (&s).read_to_end(&mut got)?;
                if got != expected {
                    bail!(
                        "echo of {} bytes came back as {} different bytes",
                        expected.len(),
                        got.len()
                    );
                }
                Ok(())
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for (i, w) in workers.into_iter().enumerate() {
        match w.join() {
            Ok(Ok(())) => ok += 1,
            Ok(Err(e)) => {
                failed += 1;
                eprintln!("connection {i}: {e:#}");
            }
            Err(_) => failed += 1,
        }
    }
    println!("done ok={ok} failed={failed}");
    if failed > 0 {
        bail!("{failed} of {conns} connections failed");
    }
    Ok(())
}

pub(crate) fn hold(addr: SocketAddr, interval_ms: u64, count: Option<u64>) -> Result<()> {
    let mut w = connect(addr)?;
    let mut r = BufReader::new(w.try_clone()?);
    let mut line = String::new();
    println!("connected {}", w.local_addr()?);
    for i in 0.. {
        if count.is_some_and(|c| i >= c) {
            break;
        }
        let ping = format!("ping {i}\n");
        w.write_all(ping.as_bytes())
            .with_context(|| format!("exchange {i}: sending"))?;
        line.clear();
        r.read_line(&mut line)
            .with_context(|| format!("exchange {i}: receiving"))?;
        if line != ping {
            bail!("exchange {i}: sent {ping:?}, got back {line:?}");
        }
        println!("ok {i}");
        std::thread::sleep(Duration::from_millis(interval_ms));
    }
    Ok(())
}

/// One DNS question (type A, recursion desired) sent with an unconnected UDP socket (`sendto`, as some
/// resolvers do, unlike glibc and dig which `connect()` first). Prints where the reply came from as
/// `recvfrom` reports it, the header, and the answer records it can read (A, CNAME).
pub(crate) fn dns_unconnected(server: SocketAddr, name: &str) -> Result<()> {
    let id = (std::process::id() & 0xffff) as u16;
    let query = dns_query(id, name)?;

    // An IPv6 (or v4-mapped) server gets an AF_INET6 socket, as a dual-stack runtime uses.
    let any = if server.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let socket = std::net::UdpSocket::bind(any).context("binding")?;
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    socket.send_to(&query, server).context("sendto")?;
    let mut buf = [0u8; 4096];
    let (n, from) = socket.recv_from(&mut buf).context("recvfrom")?;
    let reply = &buf[..n];
    if n < 12 || reply[..2] != id.to_be_bytes() {
        bail!("not a reply to our query: {:02x?}", reply);
    }
    println!("from {from}");
    println!("rcode {}", reply[3] & 0x0f);
    println!("aa {}", reply[2] & 0x04 != 0);
    let answers = u16::from_be_bytes([reply[6], reply[7]]);
    let mut at = skip_name(reply, 12)? + 4; // the question
    for _ in 0..answers {
        at = skip_name(reply, at)?;
        let field = |i: usize| -> Result<u16> {
            let b = reply.get(at + i..at + i + 2).context("record cut short")?;
            Ok(u16::from_be_bytes([b[0], b[1]]))
        };
        let (rtype, len) = (field(0)?, usize::from(field(8)?));
        let rdata = reply
            .get(at + 10..at + 10 + len)
            .context("rdata cut short")?;
        match (rtype, rdata) {
            (1, &[a, b, c, d]) => println!("A {a}.{b}.{c}.{d}"),
            (5, _) => println!("CNAME"),
            _ => println!("type {rtype}"),
        }
        at += 10 + len;
    }
    Ok(())
}

/// A DNS question for the A records of `name` (recursion desired), in wire format.
pub(crate) fn dns_query(id: u16, name: &str) -> Result<Vec<u8>> {
    let mut query = Vec::with_capacity(64);
    query.extend_from_slice(&id.to_be_bytes());
    query.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.trim_end_matches('.').split('.') {
        let len = u8::try_from(label.len()).context("label too long")?;
        query.push(len);
        query.extend_from_slice(label.as_bytes());
    }
    query.extend_from_slice(&[0, 0, 1, 0, 1]); // root, type A, class IN
    Ok(query)
}

/// The offset just past the (possibly compressed) name at `at`.
fn skip_name(msg: &[u8], mut at: usize) -> Result<usize> {
    loop {
        let len = *msg.get(at).context("name cut short")?;
        match len {
            0 => return Ok(at + 1),
            l if l & 0xc0 == 0xc0 => return Ok(at + 2),
            l => at += 1 + usize::from(l),
        }
    }
}

/// `GET /` from local port `from_port`; prints the body. Closes with a reset (linger 0): no
/// TIME_WAIT is left on either side, so the same address and port can connect again at once.
pub(crate) fn fetch(addr: SocketAddr, from_port: u16) -> Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: a fresh socket; its descriptor is owned by the TcpStream below.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket");
    }
    // SAFETY: `fd` is ours alone.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and an int option.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let local: SocketAddr = match addr {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, from_port).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, from_port).into(),
    };
    // SAFETY: `fd` is a valid socket, and `sockaddr_call` passes a sockaddr of `len` bytes that
    // lives for the call.
    sockaddr_call(&local, |sa, len| unsafe { libc::bind(fd, sa, len) })
        .with_context(|| format!("binding port {from_port}"))?;
    // SAFETY: as for `bind` above.
    sockaddr_call(&addr, |sa, len| unsafe { libc::connect(fd, sa, len) })
        .with_context(|| format!("connecting to {addr} from port {from_port}"))?;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid descriptor and a linger struct.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    let mut stream = stream;
    stream.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    stream
        .write_all(b"GET / HTTP/1.0\r\nHost: fetch\r\n\r\n")
        .context("sending the request")?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .context("reading the reply")?;
    let text = String::from_utf8_lossy(&reply);
    let body = text.split_once("\r\n\r\n").map_or(&*text, |(_, body)| body);
    print!("{body}");
    Ok(())
}

/// Calls `f` with `addr` as a C sockaddr.
fn sockaddr_call(
    addr: &SocketAddr,
    f: impl FnOnce(*const libc::sockaddr, libc::socklen_t) -> libc::c_int,
) -> Result<()> {
    let rc = match addr {
        SocketAddr::V4(v4) => {
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            f(
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of_val(&sa) as libc::socklen_t,
            )
        }
        SocketAddr::V6(v6) => {
            let sa = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            f(
                (&sa as *const libc::sockaddr_in6).cast(),
                std::mem::size_of_val(&sa) as libc::socklen_t,
            )
        }
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// DNS queries over UDP from forged source addresses (`from`, `from + 1`, ...), written whole
/// (IPv4 and UDP headers included) to a raw socket. Prints `sent N`.
pub(crate) fn dns_forge(
    server: std::net::SocketAddrV4,
    name: &str,
    from: std::net::Ipv4Addr,
    count: u32,
) -> Result<()> {
    // SAFETY: a fresh raw socket, closed at the end.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("a raw socket (CAP_NET_RAW)");
    }
    let mut question = Vec::new();
    for label in name.trim_end_matches('.').split('.') {
        question.push(label.len() as u8);
        question.extend_from_slice(label.as_bytes());
    }
    question.extend_from_slice(&[0, 0, 1, 0, 1]); // root, type A, class IN
    let mut sent = 0;
    for i in 0..count {
        let source = std::net::Ipv4Addr::from(u32::from(from) + i);
        let mut dns = Vec::new();
        dns.extend_from_slice(&(i as u16).to_be_bytes()); // id
        dns.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD, one question
        dns.extend_from_slice(&question);
        let udp_len = (8 + dns.len()) as u16;
        let total = 20 + udp_len;
        let mut packet = vec![0x45, 0];
        packet.extend_from_slice(&total.to_be_bytes());
        packet.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]); // id (kernel), DF, TTL, UDP, sum
        packet.extend_from_slice(&source.octets());
        packet.extend_from_slice(&server.ip().octets());
        packet.extend_from_slice(&(40_000 + (i % 20_000) as u16).to_be_bytes());
        packet.extend_from_slice(&server.port().to_be_bytes());
        packet.extend_from_slice(&udp_len.to_be_bytes());
        packet.extend_from_slice(&[0, 0]); // no UDP checksum (optional over IPv4)
        packet.extend_from_slice(&dns);
        let dst = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(*server.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: a valid descriptor, buffer and address for the call.
        let rc = unsafe {
            libc::sendto(
                fd,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&dst as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: our descriptor, closed once.
            unsafe { libc::close(fd) };
            return Err(e).with_context(|| format!("sending from {source}"));
        }
        sent += 1;
    }
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    println!("sent {sent}");
    Ok(())
}
