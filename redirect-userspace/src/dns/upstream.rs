//! Forwarding a query to the upstream resolver and bringing its reply back byte for byte.
use std::{
    io,
    net::SocketAddr,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UdpSocket,
    time::{Instant, timeout_at},
};

use crate::net::{connect_marked, udp_connected_marked};

/// Total time a forwarded query may take before the client gets SERVFAIL: within the 2 s of
/// `docs/dns.md#upstream-failure` and well under glibc's and dig's 5 s retry, so the client sees a failure, not a hang.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// A lost UDP datagram is sent again once after this long.
const UDP_RETRANSMIT_AFTER: Duration = Duration::from_millis(500);
/// Idle upstream sockets kept for reuse (making one costs socket, SO_MARK, bind, connect and close):
/// as many as forwards are in flight, at most 64; once traffic stops, a few.
const UDP_POOL_MAX: usize = 64;
const UDP_POOL_QUIET: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream {0} did not answer within {1:?}")]
    Timeout(SocketAddr, Duration),
    #[error("upstream {addr}: {source}")]
    Io {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// The resolver the agent forwards to.
#[derive(Debug)]
pub struct Upstream {
    pub addr: SocketAddr,
    pub timeout: Duration,
    /// Sockets whose last query was answered: nothing more is expected on them, so the next query
    /// can use one without a stale reply reaching it (a timed-out socket is closed instead).
    idle: Mutex<Vec<UdpSocket>>,
    /// UDP forwards under way: the pool never keeps more idle sockets than this (or a few).
    in_flight: AtomicUsize,
}

impl Upstream {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            timeout: UPSTREAM_TIMEOUT,
            idle: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
        }
    }

    async fn socket(&self) -> io::Result<UdpSocket> {
        let pooled = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
        match pooled {
            Some(socket) => Ok(socket),
            None => udp_connected_marked(self.addr).await,
        }
    }

    fn reuse(&self, socket: Option<UdpSocket>) {
        // Counted before this forward ends: it still holds its socket.
        let busy = self.in_flight.load(Ordering::Acquire).saturating_sub(1);
        let keep = busy.clamp(UDP_POOL_QUIET, UDP_POOL_MAX);
        if let Ok(mut idle) = self.idle.lock() {
            if let Some(socket) = socket
                && idle.len() < keep
            {
                idle.push(socket);
            }
            // After a burst, sockets beyond what is busy are closed as forwards end.
            idle.truncate(keep);
        }
    }

    /// Forwards over UDP from a connected socket with a random source port (only the upstream can
    /// answer it). Returns the upstream's reply unchanged.
    pub async fn forward_udp(&self, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut kept = None;
        let result = self.forward_udp_on(query, &mut kept).await;
        self.reuse(kept);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// One UDP exchange; the socket is left in `kept` when it may serve another query.
    async fn forward_udp_on(
        &self,
        query: &[u8],
        kept: &mut Option<UdpSocket>,
    ) -> Result<Vec<u8>, UpstreamError> {
        let deadline = Instant::now() + self.timeout;
        let io_err = |source| UpstreamError::Io {
            addr: self.addr,
            source,
        };
        let socket = self.socket().await.map_err(io_err)?;
        // Not zeroed: recv_buf writes into spare capacity. UDP replies are at most 64 KiB.
        let mut buf = Vec::with_capacity(65_535);
        let mut retransmit_at = Some(Instant::now() + UDP_RETRANSMIT_AFTER);
        socket.send(query).await.map_err(io_err)?;
        loop {
            let wake = retransmit_at.map_or(deadline, |at| at.min(deadline));
            buf.clear();
            match timeout_at(wake, socket.recv_buf(&mut buf)).await {
                Ok(Ok(_)) if same_id(query, &buf) => {
                    // After a retransmit a second reply may still come: that socket is not reused.
                    if retransmit_at.is_some() {
                        *kept = Some(socket);
                    }
                    return Ok(buf);
                }
                Ok(Ok(_)) => continue, // a stale reply to the first send: keep waiting
                Ok(Err(e)) => return Err(io_err(e)),
                Err(_) if Instant::now() >= deadline => {
                    return Err(UpstreamError::Timeout(self.addr, self.timeout));
                }
                Err(_) => {
                    retransmit_at = None;
                    socket.send(query).await.map_err(io_err)?;
                }
            }
        }
    }

    /// Forwards over TCP (the client came over TCP, e.g. after a truncated UDP reply).
    pub async fn forward_tcp(&self, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
        let deadline = Instant::now() + self.timeout;
        let exchange = async {
            let mut stream = connect_marked(self.addr, self.timeout).await?;
            let len = u16::try_from(query.len()).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "query over 65535 bytes")
            })?;
            let mut framed = Vec::with_capacity(query.len() + 2);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(query);
            stream.write_all(&framed).await?;
            let len = stream.read_u16().await?;
            let mut reply = vec![0u8; usize::from(len)];
            stream.read_exact(&mut reply).await?;
            Ok::<_, io::Error>(reply)
        };
        match timeout_at(deadline, exchange).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(source)) => Err(UpstreamError::Io {
                addr: self.addr,
                source,
            }),
            Err(_) => Err(UpstreamError::Timeout(self.addr, self.timeout)),
        }
    }
}

fn same_id(query: &[u8], reply: &[u8]) -> bool {
    query.len() >= 2 && reply.len() >= 2 && query[..2] == reply[..2]
}

/// The first `nameserver` in a resolv.conf: the default upstream (on a node, the cluster DNS).
pub fn first_nameserver(resolv_conf: &str) -> Option<SocketAddr> {
    resolv_conf.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("nameserver"))
            .then(|| words.next())
            .flatten()
            .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UdpSocket;

    #[test]
    fn default_upstream_is_the_first_nameserver() {
        let conf =
            "# generated\nsearch svc.cluster.local\nnameserver 10.96.0.10\nnameserver 8.8.8.8\n";
        assert_eq!(
            first_nameserver(conf),
            Some("10.96.0.10:53".parse().unwrap())
        );
        assert_eq!(
            first_nameserver("nameserver fd00::a\n"),
            Some("[fd00::a]:53".parse().unwrap())
        );
        assert_eq!(first_nameserver("search x\n"), None);
    }

    #[tokio::test]
    async fn udp_reply_comes_back_byte_for_byte() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Upstream::new(server.local_addr().unwrap());
        let echo = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, from) = server.recv_from(&mut buf).await.unwrap();
            let mut reply = buf[..n].to_vec();
            reply.extend_from_slice(b"-answer");
            server.send_to(&reply, from).await.unwrap();
        });
        let reply = upstream.forward_udp(b"\x01\x02query").await.unwrap();
        assert_eq!(reply, b"\x01\x02query-answer");
        echo.await.unwrap();
    }

    #[tokio::test]
    async fn a_socket_whose_query_was_answered_is_reused() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Upstream::new(server.local_addr().unwrap());
        let answer_next = |server: &UdpSocket| {
            let mut buf = [0u8; 64];
            let (n, from) = server.try_recv_from(&mut buf).unwrap();
            (buf[..n].to_vec(), from)
        };
        let mut ports = Vec::new();
        for id in [[0, 1], [0, 2]] {
            let query = [id[0], id[1], b'q'];
            let forward = upstream.forward_udp(&query);
            let serve = async {
                server.readable().await.unwrap();
                let (query, from) = answer_next(&server);
                server.send_to(&query, from).await.unwrap();
                from.port()
            };
            let (reply, port) = tokio::join!(forward, serve);
            assert_eq!(reply.unwrap(), vec![id[0], id[1], b'q']);
            ports.push(port);
        }
        assert_eq!(ports[0], ports[1], "the answered socket was not reused");
    }

    /// After a burst of forwards, the pool keeps only a few sockets: an idle agent's descriptors
    /// come back to what they were.
    #[tokio::test]
    async fn after_a_burst_the_pool_shrinks_to_a_few() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = std::sync::Arc::new(Upstream::new(server.local_addr().unwrap()));
        let forwards: Vec<_> = (0..32u8)
            .map(|i| {
                let upstream = upstream.clone();
                tokio::spawn(async move { upstream.forward_udp(&[0, i, b'q']).await })
            })
            .collect();
        for _ in 0..32 {
            let mut buf = [0u8; 64];
            let (n, from) = server.recv_from(&mut buf).await.unwrap();
            server.send_to(&buf[..n], from).await.unwrap();
        }
        for forward in forwards {
            forward.await.unwrap().unwrap();
        }
        let idle = upstream.idle.lock().unwrap().len();
        assert!(idle <= UDP_POOL_QUIET, "{idle} idle sockets kept");
        assert_eq!(upstream.in_flight.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn silent_upstream_times_out_within_the_deadline() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut upstream = Upstream::new(server.local_addr().unwrap());
        upstream.timeout = Duration::from_millis(200);
        let started = std::time::Instant::now();
        let err = upstream.forward_udp(b"\x01\x02query").await.unwrap_err();
        assert!(matches!(err, UpstreamError::Timeout(..)), "{err}");
        assert!(started.elapsed() < Duration::from_millis(600));
        // The retransmit went out: the silent server got the query twice (or once, if the
        // timeout hit first); never zero.
        let mut buf = [0u8; 64];
        assert!(server.try_recv_from(&mut buf).is_ok());
    }
}
