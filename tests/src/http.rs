//! A minimal HTTP/1.1 GET for the agent's admin port, used in-process from a thread inside the node netns.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

#[derive(Debug, PartialEq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `GET path` on `addr` (one request, connection closed after). Must run in the right netns.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Response> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading the answer to GET {path} from {addr}"))?;
    parse_response(&raw).with_context(|| format!("GET {path} from {addr}"))
}

pub fn parse_response(raw: &[u8]) -> Result<Response> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = std::str::from_utf8(&raw[..head_end]).context("headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let header = |name: &str| {
        lines.clone().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let chunked = header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let length = header("content-length")
        .map(|v| v.parse::<usize>())
        .transpose()
        .context("bad content-length")?;
    let rest = &raw[head_end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            bail!("body cut short: {} of {n} bytes", rest.len());
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut src: &[u8]) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = src
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("chunk size line")?;
        let size_text = std::str::from_utf8(&src[..line_end])?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size {size_text:?}"))?;
        src = &src[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if src.len() < size + 2 {
            bail!("chunk cut short");
        }
        body.extend_from_slice(&src[..size]);
        src = &src[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_chunked_and_close_delimited_bodies() {
        struct Case {
            name: &'static str,
            raw: &'static [u8],
            expect: Response,
        }
        let cases = [
            Case {
                name: "content-length",
                raw: b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef",
                expect: Response { status: 200, body: b"abc".to_vec() },
            },
            Case {
                name: "chunked",
                raw: b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n3\r\nnot\r\n6;x=y\r\n ready\r\n0\r\n\r\n",
                expect: Response { status: 503, body: b"not ready".to_vec() },
            },
            Case {
                name: "until close",
                raw: b"HTTP/1.0 200 OK\r\n\r\nall of it",
                expect: Response { status: 200, body: b"all of it".to_vec() },
            },
        ];
        for c in cases {
            assert_eq!(parse_response(c.raw).unwrap(), c.expect, "{}", c.name);
        }
    }

    #[test]
    fn broken_answers_are_errors() {
        for raw in [
            &b"HTTP/1.1 200 OK\r\n"[..],
            b"garbage\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
        ] {
            assert!(
                parse_response(raw).is_err(),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }
}
