//! The servers: identity HTTP (hyper; keep-alive, or one request per connection with
//! `Connection: close`) and a raw TCP echo.
use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, channel::Channel, combinators::BoxBody};
use hyper::{Method, Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use integration::pattern::{self, Pattern};
use sha2::{Digest, Sha256};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
};

type Body = BoxBody<Bytes, Infallible>;

/// Blob chunks: large enough that a 64 MiB download is a few thousand frames.
const CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Http,
    Echo,
    Source,
    Sink,
}

pub(crate) fn serve(
    name: &str,
    http: &[SocketAddr],
    echo: &[SocketAddr],
    source: &[SocketAddr],
    sink: &[SocketAddr],
) -> Result<()> {
    if http.is_empty() && echo.is_empty() && source.is_empty() && sink.is_empty() {
        bail!("nothing to serve: give --listen, --echo, --source or --sink");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        // Bind everything before accepting anything: a bad address fails the start, not a test later.
        let mut listeners = Vec::new();
        for (addr, kind) in http
            .iter()
            .map(|a| (a, Kind::Http))
            .chain(echo.iter().map(|a| (a, Kind::Echo)))
            .chain(source.iter().map(|a| (a, Kind::Source)))
            .chain(sink.iter().map(|a| (a, Kind::Sink)))
        {
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            listeners.push((listener, kind));
        }
        let name: Arc<str> = Arc::from(name);
        eprintln!("rdt-peer {name}: serving");
        let mut tasks = Vec::new();
        for (listener, kind) in listeners {
            let name = name.clone();
            tasks.push(tokio::spawn(accept_loop(listener, kind, name)));
        }
        for task in tasks {
            let _ = task.await;
        }
        Ok(())
    })
}

async fn accept_loop(listener: TcpListener, kind: Kind, name: Arc<str>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("rdt-peer: accept: {e}");
                continue;
            }
        };
        let name = name.clone();
        tokio::spawn(async move {
            let result = match kind {
                Kind::Http => serve_http(stream, peer, name).await,
                Kind::Echo => echo(stream).await,
                Kind::Source => source(stream).await,
                Kind::Sink => sink(stream).await,
            };
            if let Err(e) = result {
                eprintln!("rdt-peer: connection from {peer}: {e:#}");
            }
        });
    }
}

/// Echo until the client half-closes, then half-close back (so half-close through a proxy is exercised).
async fn echo(mut stream: TcpStream) -> Result<()> {
    let (mut r, mut w) = stream.split();
    tokio::io::copy(&mut r, &mut w).await?;
    w.shutdown().await?;
    Ok(())
}

/// Pattern bytes until the client goes away.
async fn source(mut stream: TcpStream) -> Result<()> {
    let mut pattern = Pattern::new();
    let mut chunk = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        pattern.fill(&mut chunk);
        if let Err(e) = stream.write_all(&chunk).await {
            println!("source error {total} {:?}", e.kind());
            return Ok(());
        }
        total += CHUNK as u64;
    }
}

/// Reads to the end and says how the stream ended: a clean end, or an error.
async fn sink(mut stream: TcpStream) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => {
                println!("sink eof {total}");
                return Ok(());
            }
            Ok(n) => total += n as u64,
            Err(e) => {
                println!("sink error {total} {:?}", e.kind());
                return Ok(());
            }
        }
    }
}

async fn serve_http(stream: TcpStream, peer: SocketAddr, name: Arc<str>) -> Result<()> {
    let service = service_fn(move |req| {
        let name = name.clone();
        async move { Ok::<_, Infallible>(route(req, peer, &name).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await?;
    Ok(())
}

/// `GET /` -> the server's name; `GET /peer` -> the client address it saw; `GET /blob/<n>` -> n pattern
/// bytes; `POST|PUT /sha256` -> hex sha256 of the body.
async fn route(req: Request<Incoming>, peer: SocketAddr, name: &str) -> Response<Body> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/") => text(StatusCode::OK, format!("{name}\n")),
        (&Method::GET, "/peer") => text(StatusCode::OK, format!("{peer}\n")),
        (&Method::GET, p) if p.starts_with("/blob/") => match p["/blob/".len()..].parse::<u64>() {
            Ok(n) => blob(n),
            Err(_) => text(StatusCode::BAD_REQUEST, "want /blob/<bytes>\n".into()),
        },
        (&Method::POST | &Method::PUT, "/sha256") => {
            let mut body = req.into_body();
            let mut hasher = Sha256::new();
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(frame) => {
                        if let Some(data) = frame.data_ref() {
                            hasher.update(data);
                        }
                    }
                    Err(e) => return text(StatusCode::BAD_REQUEST, format!("body: {e}\n")),
                }
            }
            text(
                StatusCode::OK,
                format!("{}\n", pattern::hex(&hasher.finalize())),
            )
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body)).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain"),
    );
    response
}

/// `n` pattern bytes, streamed chunk by chunk (a 64 MiB download never sits in memory whole).
fn blob(n: u64) -> Response<Body> {
    let (mut sender, body) = Channel::<Bytes, Infallible>::new(4);
    tokio::spawn(async move {
        let mut pattern = Pattern::new();
        let mut left = n;
        while left > 0 {
            let len = left.min(CHUNK as u64) as usize;
            let mut chunk = vec![0; len];
            pattern.fill(&mut chunk);
            if sender.send_data(Bytes::from(chunk)).await.is_err() {
                return; // the client went away
            }
            left -= len as u64;
        }
    });
    let mut response = Response::new(body.boxed());
    let headers = response.headers_mut();
    headers.insert(hyper::header::CONTENT_LENGTH, n.into());
    headers.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    response
}
