//! Asking a running agent's admin server (what `redirect config …` does).
use std::net::SocketAddr;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Request, header};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// GETs `path` from the admin server at `addr` and returns the body of a 200 answer.
pub fn get(addr: SocketAddr, path: &str) -> anyhow::Result<Bytes> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    runtime.block_on(async {
        let exchange = async {
            let stream = TcpStream::connect(addr)
                .await
                .with_context(|| format!("connecting to the agent's admin server at {addr} (is the agent running here? see --admin)"))?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(connection);
            let request = Request::get(path)
                .header(header::HOST, addr.to_string())
                .body(Empty::<Bytes>::new())?;
            let response = sender.send_request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            if !status.is_success() {
                bail!("{path}: {status}: {}", String::from_utf8_lossy(&body).trim());
            }
            Ok(body)
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), exchange)
            .await
            .with_context(|| format!("the admin server at {addr} did not answer {path} within 10 s"))?
    })
}
