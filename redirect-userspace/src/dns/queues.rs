//! The DNS proxy's UDP port as a group of sockets (`SO_REUSEPORT`), the kernel picking one by the
//! client's address: each client queue is its own socket buffer, so a pod that floods the port
//! overflows only its own queue and other pods' queries are still received.
use std::{io, net::SocketAddr, os::fd::AsRawFd};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;

/// Sockets in the group: two clients share a queue only when their addresses are equal modulo this
/// (for consecutive pod addresses, never among 64 neighbours).
pub(super) const QUEUES: u32 = 64;
/// Receive buffer per queue: a burst of a few thousand queries waits instead of being dropped.
const RECV_BUFFER: usize = 1 << 20;
/// `SO_ATTACH_REUSEPORT_CBPF` (asm-generic/socket.h).
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

/// Asks the kernel to say, with each datagram, which interface it came in on (`IP_PKTINFO`,
/// `IPV6_RECVPKTINFO`), for a socket of `addr`'s family. Set before the socket is bound (and on
/// one handed over, before it is served): the kernel notes the interface as a datagram is queued,
/// so one queued before the option would come without it, and its budget share would go by its
/// (forgeable) source address.
pub(super) fn want_ingress_interface(socket: &impl AsRawFd, addr: SocketAddr) -> io::Result<()> {
    let (level, name) = match addr {
        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_PKTINFO),
        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO),
    };
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and an int option.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A datagram: its length, its source, and the index of the interface it came in on (0 when the
/// kernel did not say).
pub(super) async fn recv_from_interface(
    socket: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr, u32)> {
    loop {
        socket.readable().await?;
        match socket.try_io(tokio::io::Interest::READABLE, || {
            recvmsg_interface(socket.as_raw_fd(), buf)
        }) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            received => return received,
        }
    }
}

fn recvmsg_interface(fd: libc::c_int, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, u32)> {
    // SAFETY: all-zero is a valid sockaddr_storage and msghdr.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for one pktinfo message of either family, 8-aligned as cmsg headers need.
    let mut control = [0u64; 16];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut storage as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: every pointer in `msg` is valid for the lengths it gives, for the whole call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `storage` with a socket address of the family it names.
    let source = unsafe {
        match i32::from(storage.ss_family) {
            libc::AF_INET => {
                let v4 = &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                SocketAddr::new(
                    std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)).into(),
                    u16::from_be(v4.sin_port),
                )
            }
            libc::AF_INET6 => {
                let v6 = &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                SocketAddr::V6(std::net::SocketAddrV6::new(
                    v6.sin6_addr.s6_addr.into(),
                    u16::from_be(v6.sin6_port),
                    v6.sin6_flowinfo,
                    v6.sin6_scope_id,
                ))
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a datagram without an IP source",
                ));
            }
        }
    };
    let mut interface = 0;
    // SAFETY: the cmsg walk stays within the control buffer the kernel filled (msg_controllen).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let header = &*cmsg;
            if header.cmsg_level == libc::IPPROTO_IP && header.cmsg_type == libc::IP_PKTINFO {
                let info: libc::in_pktinfo = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                interface = info.ipi_ifindex as u32;
            } else if header.cmsg_level == libc::IPPROTO_IPV6
                && header.cmsg_type == libc::IPV6_PKTINFO
            {
                let info: libc::in6_pktinfo =
                    std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                interface = info.ipi6_ifindex;
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, source, interface))
}

/// Binds [`QUEUES`] UDP sockets to `addr` (a port of 0 is chosen once, for all of them).
pub(super) fn bind_queues(addr: SocketAddr) -> io::Result<Vec<UdpSocket>> {
    let first = bind_one(addr)?;
    let addr = first.local_addr()?.as_socket().unwrap_or(addr);
    let mut sockets = vec![first];
    for _ in 1..QUEUES {
        sockets.push(bind_one(addr)?);
    }
    // One program for the whole group: socket index = the client's address modulo QUEUES.
    attach_pick_by_source(&sockets[0], addr)?;
    sockets
        .into_iter()
        .map(|s| UdpSocket::from_std(s.into()))
        .collect()
}

fn bind_one(addr: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.nonblocking(),
        Some(Protocol::UDP),
    )?;
    socket.set_reuse_port(true)?;
    // Best effort: the system may cap it (net.core.rmem_max); the default still works.
    let _ = socket.set_recv_buffer_size(RECV_BUFFER);
    want_ingress_interface(&socket, addr)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// A classic BPF program run by the kernel for each datagram: load the last 32 bits of the source
/// address from the network header and return them modulo the group size.
fn attach_pick_by_source(socket: &Socket, addr: SocketAddr) -> io::Result<()> {
    // Offset of the source address's last 4 bytes: IPv4 header 12..16, IPv6 header 20..24.
    let src_low = match addr {
        SocketAddr::V4(_) => 12,
        SocketAddr::V6(_) => 20,
    };
    let mut program = [
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: (libc::SKF_NET_OFF + src_low) as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_ALU | libc::BPF_MOD | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: QUEUES,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_A) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
    ];
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_mut_ptr(),
    };
    // SAFETY: a valid descriptor and a program that outlives the call (the kernel copies it).
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram that arrives before any task reads the group (as at start, before the serving
    /// tasks run) still says which interface it came in on.
    #[tokio::test]
    async fn a_datagram_queued_before_anyone_reads_says_its_interface() {
        let sockets = bind_queues("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = sockets[0].local_addr().unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.send_to(b"q", addr).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let mut buf = [0u8; 8];
        // 127.0.0.1: the group's second socket.
        let (n, from, interface) = recvmsg_interface(sockets[1].as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, from), (1, client.local_addr().unwrap()));
        // SAFETY: a NUL-terminated name, read only.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        assert_eq!(interface, lo, "the loopback's index");
    }

    /// Datagrams from one source address always land in the same socket, and from addresses that
    /// differ modulo the group size in different ones.
    #[tokio::test]
    async fn each_source_address_has_its_own_queue() {
        let sockets = bind_queues("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = sockets[0].local_addr().unwrap();
        let which = |from: &'static str| {
            let sockets = &sockets;
            async move {
                let client = UdpSocket::bind(from).await.unwrap();
                client.send_to(b"q", addr).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                let mut buf = [0u8; 8];
                let got: Vec<usize> = sockets
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.try_recv_from(&mut buf).is_ok())
                    .map(|(i, _)| i)
                    .collect();
                got
            }
        };
        // 127.0.0.1 and 127.0.0.2: last bytes 1 and 2.
        assert_eq!(which("127.0.0.1:0").await, vec![1]);
        assert_eq!(
            which("127.0.0.1:0").await,
            vec![1],
            "another port, the same queue"
        );
        assert_eq!(which("127.0.0.2:0").await, vec![2]);
    }
}
