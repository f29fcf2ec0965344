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
