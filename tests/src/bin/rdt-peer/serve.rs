//! The servers: a tiny HTTP/1.1 server (one request per connection) and a raw TCP echo.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use integration::pattern::{self, Pattern};
use sha2::{Digest, Sha256};

const MAX_HEAD: usize = 16 * 1024;

pub fn serve(name: &str, http: &[SocketAddr], echo: &[SocketAddr]) -> Result<()> {
    if http.is_empty() && echo.is_empty() {
        bail!("nothing to serve: give --listen and/or --echo");
    }
    // Bind everything before accepting anything: a bad address fails the start, not a test later.
    let bind = |a: &SocketAddr| TcpListener::bind(a).with_context(|| format!("binding {a}"));
    let http: Vec<TcpListener> = http.iter().map(bind).collect::<Result<_>>()?;
    let echo: Vec<TcpListener> = echo.iter().map(bind).collect::<Result<_>>()?;
    let name: Arc<str> = Arc::from(name);
    eprintln!("rdt-peer {name}: serving");
    let mut threads = Vec::new();
    for l in http {
        let name = name.clone();
        threads.push(std::thread::spawn(move || {
            accept_loop(l, move |s| handle_http(s, &name))
        }));
    }
    for l in echo {
        threads.push(std::thread::spawn(move || accept_loop(l, handle_echo)));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn accept_loop(
    listener: TcpListener,
    handle: impl Fn(TcpStream) -> Result<()> + Clone + Send + 'static,
) {
    for conn in listener.incoming() {
        match conn {
            Ok(s) => {
                let handle = handle.clone();
                std::thread::spawn(move || {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    if let Err(e) = handle(s) {
                        eprintln!("rdt-peer: connection from {peer}: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("rdt-peer: accept: {e}"),
        }
    }
}

/// Echo until the client half-closes, then half-close back (so half-close through a proxy is exercised).
fn handle_echo(mut s: TcpStream) -> Result<()> {
    let mut r = s.try_clone()?;
    std::io::copy(&mut r, &mut s)?;
    s.shutdown(Shutdown::Write)?;
    Ok(())
}

struct Request {
    method: String,
    path: String,
    content_length: Option<u64>,
    expect_continue: bool,
}

fn read_head(r: &mut impl BufRead) -> Result<Request> {
    let mut line = String::new();
    let mut total = 0;
    let mut read_line = |line: &mut String| -> Result<()> {
        line.clear();
        total += r.read_line(line)?;
        if total > MAX_HEAD {
            bail!("request head over {MAX_HEAD} bytes");
        }
        Ok(())
    };
    read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        bail!("bad request line {line:?}");
    };
    let mut req = Request {
        method: method.to_string(),
        path: path.to_string(),
        content_length: None,
        expect_continue: false,
    };
    loop {
        read_line(&mut line)?;
        let header = line.trim_end();
        if header.is_empty() {
            return Ok(req);
        }
        let Some((k, v)) = header.split_once(':') else {
            bail!("bad header {header:?}")
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            req.content_length = Some(
                v.parse()
                    .with_context(|| format!("bad content-length {v:?}"))?,
            );
        } else if k.eq_ignore_ascii_case("expect") && v.eq_ignore_ascii_case("100-continue") {
            req.expect_continue = true;
        }
    }
}

fn handle_http(s: TcpStream, name: &str) -> Result<()> {
    let peer = s.peer_addr()?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let req = read_head(&mut r)?;
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/") => respond(&mut w, 200, format!("{name}\n").as_bytes())?,
        ("GET", "/peer") => respond(&mut w, 200, format!("{peer}\n").as_bytes())?,
        ("GET", p) if p.starts_with("/blob/") => match p["/blob/".len()..].parse::<u64>() {
            Ok(n) => send_blob(&mut w, n)?,
            Err(_) => respond(&mut w, 400, b"want /blob/<bytes>\n")?,
        },
        ("POST" | "PUT", "/sha256") => {
            let Some(len) = req.content_length else {
                return respond(&mut w, 411, b"content-length required\n");
            };
            if req.expect_continue {
                w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
            }
            let mut h = Sha256::new();
            let copied = std::io::copy(&mut (&mut r).take(len), &mut HashWriter(&mut h))?;
            if copied != len {
                bail!("body cut short: {copied} of {len} bytes");
            }
            respond(
                &mut w,
                200,
                format!("{}\n", pattern::hex(&h.finalize())).as_bytes(),
            )?;
        }
        _ => respond(&mut w, 404, b"not found\n")?,
    }
    linger_close(w);
    Ok(())
}

fn respond(w: &mut TcpStream, status: u16, body: &[u8]) -> Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        411 => "Length Required",
        _ => "",
    };
    write!(
        w,
        "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    w.write_all(body)?;
    Ok(())
}

fn send_blob(w: &mut TcpStream, n: u64) -> Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n"
    )?;
    let mut p = Pattern::new();
    let mut buf = vec![0; 1 << 16];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        p.fill(&mut buf[..k]);
        w.write_all(&buf[..k])?;
        left -= k as u64;
    }
    Ok(())
}

/// Half-close and let the client read the answer before the socket goes: closing with unread input
/// would send a RST that can destroy the response in flight.
fn linger_close(mut s: TcpStream) {
    let _ = s.shutdown(Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut sink = [0; 4096];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
