use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    sync::watch,
};
use tracing::{debug, warn};

use super::{relay, upstream::connect_marked};
use crate::{
    metrics::{Direction, Metrics, OutboundOutcome},
    redirect::RedirectMaps,
};

/// Pending connections the kernel queues for us: bursts of new connections from many pods.
const BACKLOG: u32 = 4096;

/// What every connection task needs.
#[derive(Debug)]
pub struct ProxyContext {
    pub redirect_maps: Arc<RedirectMaps>,
    pub metrics: Arc<Metrics>,
}

pub struct OutboundProxy {
    listener: TcpListener,
    context: Arc<ProxyContext>,
}

/// Binds the proxy's listener.
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "binding the outbound proxy to {addr} (is the gateway an address of this network namespace?): {e}"
            ),
        )
    })?;
    socket.listen(BACKLOG)
}

impl OutboundProxy {
    pub fn new(listener: TcpListener, context: Arc<ProxyContext>) -> Self {
        Self { listener, context }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts until `shutdown` changes. Connection tasks are detached: they end with their
    /// connection, or with the runtime.
    pub async fn serve(self, mut shutdown: watch::Receiver<bool>) {
        loop {
            tokio::select! {
                // Any change (or the sender gone) means stop.
                _ = shutdown.changed() => return,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        tokio::spawn(handle(stream, peer, self.context.clone()));
                    }
                    Err(e) => {
                        // Usually EMFILE: back off instead of spinning, keep serving.
                        warn!(error = %e, "outbound accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }
}

async fn handle(mut client: TcpStream, peer: SocketAddr, context: Arc<ProxyContext>) {
    let _active = context.metrics.track_active();
    let orig = match context.redirect_maps.original_destination(peer) {
        Ok(Some(orig)) => orig.dst.to_socket_addr(),
        Ok(None) => {
            warn!(client = %peer, "no original destination recorded for this connection; closing it");
            context.metrics.outbound(OutboundOutcome::Error);
            reset(client);
            return;
        }
        Err(e) => {
            warn!(client = %peer, error = %e, "reading the original destination failed; closing the connection");
            context.metrics.outbound(OutboundOutcome::Error);
            reset(client);
            return;
        }
    };
    let _ = client.set_nodelay(true);

    // Passthrough: nothing here claims the destination, so it goes where the client sent it.
    let mut upstream = match connect_marked(orig).await {
        Ok(upstream) => upstream,
        Err(e) => {
            debug!(client = %peer, orig_dst = %orig, error = %e, "upstream connect failed");
            context.metrics.outbound(OutboundOutcome::Error);
            reset(client);
            return;
        }
    };
    context.metrics.outbound(OutboundOutcome::Passthrough);
    debug!(client = %peer, orig_dst = %orig, action = "passthrough", "outbound connection");
    match relay(&mut client, &mut upstream).await {
        Ok(carried) => {
            context.metrics.bytes(Direction::Sent, carried.sent);
            context.metrics.bytes(Direction::Received, carried.received);
        }
        Err(e) => {
            debug!(client = %peer, orig_dst = %orig, error = %e, "connection ended with an error");
            reset(client);
        }
    }
}

/// Closes with RST rather than FIN, so the client sees a failure at once instead of an empty reply.
fn reset(stream: TcpStream) {
    if let Ok(std) = stream.into_std() {
        let socket = socket2::Socket::from(std);
        let _ = socket.set_linger(Some(Duration::ZERO));
    }
}
