//! Closing TCP connections of another network namespace: sock_diag lists the sockets there and
//! `SOCK_DESTROY` resets the ones chosen, as `ss -K` does. How the agent ends a connection the
//! kernel passed directly (no proxy on its path) once a policy denies it. Needs the kernel's
//! `CONFIG_INET_DIAG_DESTROY`; without it the destroy fails and the caller says so.
use std::{
    fs::File,
    io,
    net::SocketAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    message::SockDiagDestroy,
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_SOCK_DIAG};

/// A connected TCP socket, as the namespace it lives in sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpConnection {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Its local port is one a socket of the namespace listens on: a connection it accepted.
    pub accepted: bool,
}

/// What one sweep of a namespace did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Destroyed {
    pub closed: Vec<TcpConnection>,
    /// Chosen, but the kernel refused to destroy them (no `CONFIG_INET_DIAG_DESTROY`, or gone).
    pub failed: usize,
}

/// In the network namespace `netns` (a `/proc/PID/ns/net` path), resets every open TCP connection
/// that `close` picks. Blocking: it runs on a thread of its own, which alone enters the namespace.
pub(crate) fn destroy_in(
    netns: PathBuf,
    close: impl Fn(TcpConnection) -> bool + Send + 'static,
) -> io::Result<Destroyed> {
    std::thread::Builder::new()
        .name("sock-destroy".into())
        .spawn(move || {
            enter(&netns)?;
            let socket = open()?;
            let mut done = Destroyed::default();
            for family in [AF_INET, AF_INET6] {
                let listening: Vec<u16> = list(&socket, family, StateFlags::LISTEN)?
                    .iter()
                    .map(|(_, l)| l.local.port())
                    .collect();
                for (id, mut conn) in list(&socket, family, open_states())? {
                    conn.accepted = listening.contains(&conn.local.port());
                    if !close(conn) {
                        continue;
                    }
                    match destroy(&socket, family, id) {
                        Ok(()) => done.closed.push(conn),
                        Err(_) => done.failed += 1,
                    }
                }
            }
            Ok(done)
        })?
        .join()
        .map_err(|_| io::Error::other("the sock_diag thread panicked"))?
}

/// Moves this thread (only) into the namespace at `path`.
fn enter(path: &Path) -> io::Result<()> {
    let ns = File::open(path)?;
    // SAFETY: `ns` is an open namespace descriptor for the call's duration; setns changes only
    // the calling thread, which ends when the sweep does.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn open() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    Ok(socket)
}

/// States of a connection that still has a peer to reset.
fn open_states() -> StateFlags {
    StateFlags::ESTABLISHED
        | StateFlags::SYN_SENT
        | StateFlags::SYN_RECV
        | StateFlags::FIN_WAIT1
        | StateFlags::FIN_WAIT2
        | StateFlags::CLOSE_WAIT
}

fn request(family: u8, socket_id: SocketId, states: StateFlags) -> SockDiagMessage {
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states,
        socket_id,
    })
}

fn send<T: NetlinkSerializable + Into<NetlinkPayload<T>>>(
    socket: &Socket,
    message: T,
    flags: u16,
) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut packet = NetlinkMessage::new(header, message.into());
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0)?;
    Ok(())
}

/// Every TCP socket of `family` in one of `states` in the socket's namespace.
fn list(
    socket: &Socket,
    family: u8,
    states: StateFlags,
) -> io::Result<Vec<(SocketId, TcpConnection)>> {
    let any = match family {
        AF_INET => SocketId::new_v4(),
        _ => SocketId::new_v6(),
    };
    send(
        socket,
        request(family, any, states),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    let mut found = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[offset..size])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    let id = response.header.socket_id;
                    let conn = TcpConnection {
                        local: SocketAddr::new(id.source_address, id.source_port),
                        remote: SocketAddr::new(id.destination_address, id.destination_port),
                        accepted: false,
                    };
                    found.push((id, conn));
                }
                NetlinkPayload::Done(_) => return Ok(found),
                NetlinkPayload::Error(e) => return Err(e.to_io()),
                _ => {}
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
}

/// Resets the one socket `id` names (its cookie included).
fn destroy(socket: &Socket, family: u8, id: SocketId) -> io::Result<()> {
    send(
        socket,
        SockDiagDestroy::new(request(family, id, StateFlags::all())),
        NLM_F_REQUEST | NLM_F_ACK,
    )?;
    let mut buf = vec![0u8; 4096];
    let size = socket.recv(&mut &mut buf[..], 0)?;
    let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[..size])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    match message.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    /// Needs CAP_NET_ADMIN (and CONFIG_INET_DIAG_DESTROY): skipped otherwise, as root-only
    /// checks are; the integration suite covers it in the Pods' namespaces.
    #[test]
    fn a_chosen_connection_of_a_namespace_is_reset_and_another_left_open() {
        // SAFETY: geteuid takes nothing and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let mut doomed = std::net::TcpStream::connect(server).unwrap();
        let kept = std::net::TcpStream::connect(server).unwrap();
        let (_a, _) = listener.accept().unwrap();
        let (_b, _) = listener.accept().unwrap();
        let doomed_port = doomed.local_addr().unwrap().port();
        let netns = PathBuf::from(format!("/proc/{}/ns/net", std::process::id()));
        let done = destroy_in(netns, move |c| {
            // Only this test's own sockets are looked at: the namespace holds others.
            let ours = c.local == server || c.remote == server;
            ours && c.local.port() == doomed_port && !c.accepted
        })
        .unwrap();
        assert_eq!(done.closed.len(), 1);
        assert_eq!(done.failed, 0);
        let mut byte = [0u8; 1];
        let read = doomed.read(&mut byte);
        assert!(matches!(read, Err(_) | Ok(0)), "{read:?}");
        kept.set_nonblocking(true).unwrap();
        let still = (&kept).read(&mut byte);
        assert!(still.is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock));
    }
}
