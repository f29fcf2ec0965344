//! Sockets for the agent's own upstream traffic. Each carries the agent's mark, so the eBPF programs
//! never steer the agent's connections back to itself (even if it ran inside the attached cgroup).
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use redirect_common::AGENT_SOCKET_MARK;
use socket2::{Domain, Protocol, Socket, TcpKeepalive, Type};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

/// How long an upstream TCP connect may take before the client is told it failed.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Idle time before TCP keepalive probes start on proxied connections, both sides: a peer that
/// vanished without a FIN or RST (node gone, pod killed mid-partition) does not pin two sockets and
/// two pipes forever. The kernel's interval and probe count (75 s, 9) do the rest.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(300);

pub(crate) fn keepalive() -> TcpKeepalive {
    TcpKeepalive::new().with_time(KEEPALIVE_IDLE)
}

fn marked_socket(dst: SocketAddr, ty: Type, protocol: Protocol) -> io::Result<Socket> {
    // Non-blocking from birth: one fcntl less per connection.
    let socket = Socket::new(Domain::for_address(dst), ty.nonblocking(), Some(protocol))?;
    socket.set_mark(AGENT_SOCKET_MARK)?;
    Ok(socket)
}

/// Makes the sockets the proxy dials upstreams from.
pub(crate) trait SocketFactory: Send + Sync + std::fmt::Debug {
    /// A new non-blocking TCP socket for a connection to `dst`.
    fn tcp(&self, dst: SocketAddr) -> io::Result<Socket>;
}

/// The agent's sockets: each carries the agent's mark (setting it needs `CAP_NET_ADMIN`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MarkedSockets;

impl SocketFactory for MarkedSockets {
    fn tcp(&self, dst: SocketAddr) -> io::Result<Socket> {
        marked_socket(dst, Type::STREAM, Protocol::TCP)
    }
}

/// Plain sockets, for tests that run the proxy in-process without root (and without eBPF, so
/// nothing needs the mark).
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PlainSockets;

#[cfg(test)]
impl SocketFactory for PlainSockets {
    fn tcp(&self, dst: SocketAddr) -> io::Result<Socket> {
        Socket::new(
            Domain::for_address(dst),
            Type::STREAM.nonblocking(),
            Some(Protocol::TCP),
        )
    }
}

/// A marked TCP connection to `dst`, given up after `timeout`.
pub(crate) async fn connect_marked(dst: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    connect(&MarkedSockets, dst, timeout, None).await
}

/// A connection to `dst` from a socket of `sockets`, given up after `timeout`, with the socket's
/// send and receive buffers fixed at `buffer` bytes each when given (set before the SYN: the window
/// scale offered follows the receive buffer).
pub(crate) async fn connect(
    sockets: &dyn SocketFactory,
    dst: SocketAddr,
    timeout: Duration,
    buffer: Option<usize>,
) -> io::Result<TcpStream> {
    let socket = sockets.tcp(dst)?;
    if let Some(bytes) = buffer {
        socket.set_send_buffer_size(bytes)?;
        socket.set_recv_buffer_size(bytes)?;
    }
    dial(socket, dst, timeout).await
}

/// As [`connect`], from `src`: an address the node's netns does not own (a Pod's, the source kept
/// across nodes). The socket is transparent (`IP_TRANSPARENT`, `CAP_NET_ADMIN`); its port is
/// chosen at connect, as any other's, by the whole four-tuple. The answers reach it only through
/// the marking and the rule of `redirect::hbone_replies`.
pub(crate) async fn connect_from(
    sockets: &dyn SocketFactory,
    src: IpAddr,
    dst: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let socket = sockets.tcp(dst)?;
    match src {
        IpAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
        IpAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
    }
    bind_address_no_port(&socket)?;
    socket.bind(&SocketAddr::new(src, 0).into())?;
    dial(socket, dst, timeout).await
}

/// `IP_BIND_ADDRESS_NO_PORT`: a bind to an address leaves the port to connect, which may give one
/// port to many destinations (a bind alone would take it for all).
fn bind_address_no_port(socket: &Socket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: a valid descriptor owned by `socket`, and a pointer to an int that lives across the
    // call, with its size.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match set {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Connects `socket` to `dst` with the options every upstream has, given up after `timeout`.
async fn dial(socket: Socket, dst: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    socket.set_tcp_nodelay(true)?;
    socket.set_tcp_keepalive(&keepalive())?;
    let socket = TcpSocket::from_std_stream(socket.into());
    match tokio::time::timeout(timeout, socket.connect(dst)).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connect to {dst} timed out after {timeout:?}"),
        )),
    }
}

/// A marked UDP socket connected to `dst` (connected: only `dst` can answer it), on a port the
/// kernel picks at random. Needs a tokio runtime.
pub(crate) fn udp_connected_marked(dst: SocketAddr) -> io::Result<UdpSocket> {
    let socket = marked_socket(dst, Type::DGRAM, Protocol::UDP)?;
    let any: SocketAddr = match dst {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    socket.bind(&any.into())?;
    socket.connect(&dst.into())?;
    UdpSocket::from_std(socket.into())
}
