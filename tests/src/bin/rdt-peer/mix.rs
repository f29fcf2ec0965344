//! `rdt-peer mix`: a pod's steady traffic (new HTTP connections and DNS questions, in turn, paced)
//! that must never fail, for as long as the test needs (until a line on stdin).
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};

/// A request that takes longer than this counts as failed (a client would have given up or retried).
const TIMEOUT: Duration = Duration::from_secs(2);
const MAX_REPORTED: usize = 50;

#[derive(Clone)]
enum Op {
    Http { addr: SocketAddr, body: String },
    Dns { server: SocketAddr, name: String },
}

impl Op {
    fn what(&self) -> String {
        match self {
            Op::Http { addr, .. } => format!("http {addr}"),
            Op::Dns { server, name } => format!("dns {name} @{server}"),
        }
    }

    fn run(&self, id: u16) -> Result<()> {
        match self {
            Op::Http { addr, body } => http(*addr, body),
            Op::Dns { server, name } => dns(*server, name, id),
        }
    }
}

pub(crate) fn run(http: &[String], dns: &[String], rate: u32, workers: usize) -> Result<()> {
    let mut ops = Vec::new();
    for spec in http {
        let (addr, body) = spec.split_once('=').context("--http wants IP:PORT=BODY")?;
        ops.push(Op::Http {
            addr: addr.parse().context("--http address")?,
            body: body.to_string(),
        });
    }
    for spec in dns {
        let (server, name) = spec.split_once('=').context("--dns wants SERVER=NAME")?;
        ops.push(Op::Dns {
            server: server.parse().context("--dns server")?,
            name: name.to_string(),
        });
    }
    if ops.is_empty() || rate == 0 || workers == 0 {
        bail!("nothing to do");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new((0u64, Vec::<String>::new())));
    let started = Instant::now();
    // Each worker keeps its own share of the rate on a fixed schedule (no catch-up bursts).
    let interval = Duration::from_secs_f64(workers as f64 / f64::from(rate));
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let (ops, stop, ok, failures) =
                (ops.clone(), stop.clone(), ok.clone(), failures.clone());
            std::thread::spawn(move || {
                let mut next = Instant::now();
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let op = &ops[i % ops.len()];
                    match op.run(i as u16) {
                        Ok(()) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            let mut f = failures.lock().unwrap_or_else(|p| p.into_inner());
                            f.0 += 1;
                            if f.1.len() < MAX_REPORTED {
                                let at = started.elapsed().as_secs_f64();
                                f.1.push(format!("{:.3}s {}: {e:#}", at, op.what()));
                            }
                        }
                    }
                    i += workers;
                    next += interval;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                }
            })
        })
        .collect();
    println!("started");
    std::io::stdout().flush()?;
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let secs = started.elapsed().as_secs_f64();
    let f = failures.lock().unwrap_or_else(|p| p.into_inner());
    println!(
        "done ok={} failed={} secs={secs:.3}",
        ok.load(Ordering::Relaxed),
        f.0
    );
    for fail in &f.1 {
        println!("fail {fail}");
    }
    if f.0 > 0 {
        bail!("{} failed", f.0);
    }
    Ok(())
}

/// A fresh connection, `GET /` over HTTP/1.0, the body read to the server's close.
fn http(addr: SocketAddr, want: &str) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).context("connect")?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .context("send")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).context("receive")?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head.split_whitespace().nth(1);
    if !head.starts_with("HTTP/1.") || status != Some("200") || body.trim() != want {
        bail!(
            "unexpected reply {:?}",
            reply.chars().take(120).collect::<String>()
        );
    }
    Ok(())
}

/// An A question from a connected UDP socket, as glibc asks; one try.
fn dns(server: SocketAddr, name: &str, id: u16) -> Result<()> {
    let mut query = Message::query();
    query.metadata.id = id;
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(
        Name::from_ascii(name).context("name")?,
        RecordType::A,
    ));
    let query = query.to_vec().context("encoding")?;
    let any = if server.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let socket = UdpSocket::bind(any).context("bind")?;
    socket.connect(server).context("connect")?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    socket.send(&query).context("send")?;
    let mut buf = vec![0u8; 4096];
    let n = socket.recv(&mut buf).context("receive")?;
    let reply = Message::from_vec(&buf[..n]).context("decoding")?;
    if reply.metadata.id != id
        || reply.metadata.response_code != ResponseCode::NoError
        || reply.answers.is_empty()
    {
        bail!("unexpected reply {reply:?}");
    }
    Ok(())
}
