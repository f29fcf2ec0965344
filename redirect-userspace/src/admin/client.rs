//! Asking a running agent's admin server (what `redirect config …` and the integration tests do).
use std::{net::SocketAddr, time::Duration};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Request, header};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// An answer, whatever its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Bytes,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// GETs `path` from the admin server at `addr`, giving up after `timeout`.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<Response> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    runtime.block_on(async {
        let exchange = async {
            let stream = TcpStream::connect(addr).await.with_context(|| {
                format!("connecting to the agent's admin server at {addr} (is the agent running here? see --admin)")
            })?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(connection);
            let request = Request::get(path)
                .header(header::HOST, addr.to_string())
                .body(Empty::<Bytes>::new())?;
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok(Response { status, body })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .with_context(|| format!("the admin server at {addr} did not answer {path} within {timeout:?}"))?
    })
}

/// GETs `path` and hands each line of the answer to `on_line` as it arrives, until the agent ends
/// the answer or `on_line` says stop (false). An answer other than 2xx is an error with its text.
pub fn follow(
    addr: SocketAddr,
    path: &str,
    mut on_line: impl FnMut(&str) -> bool,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    runtime.block_on(async {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .with_context(|| format!("the admin server at {addr} did not answer within {CONNECT_TIMEOUT:?}"))?
            .with_context(|| {
                format!("connecting to the agent's admin server at {addr} (is the agent running here? see --admin)")
            })?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let request = Request::get(path)
            .header(header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let text = body.collect().await?.to_bytes();
            anyhow::bail!(
                "{} answered {}: {}",
                path.split('?').next().unwrap_or(path),
                status.as_u16(),
                String::from_utf8_lossy(&text).trim()
            );
        }
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if !on_line(String::from_utf8_lossy(&line[..end]).as_ref()) {
                    return Ok(());
                }
            }
        }
        Ok(())
    })
}

/// How long `follow` waits for the admin server to take the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
