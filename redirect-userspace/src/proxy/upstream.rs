use std::{io, net::SocketAddr, time::Duration};

use redirect_common::AGENT_SOCKET_MARK;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpSocket, TcpStream};

/// How long an upstream connect may take before the client is told it failed.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `dst` from a socket carrying the agent's mark, so the eBPF programs never steer the
/// agent's own connections back to itself (even if the agent runs inside the attached cgroup).
pub async fn connect_marked(dst: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_mark(AGENT_SOCKET_MARK)?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    let socket = TcpSocket::from_std_stream(socket.into());
    match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(dst)).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connect to {dst} timed out after {CONNECT_TIMEOUT:?}"),
        )),
    }
}
