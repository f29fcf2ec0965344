use std::io;

use tokio::{io::copy_bidirectional_with_sizes, net::TcpStream};

/// Buffer per direction: large enough that a bulk transfer moves in few syscalls.
const BUFFER: usize = 64 * 1024;

/// Bytes carried each way by [`relay`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// client -> upstream
    pub sent: u64,
    /// upstream -> client
    pub received: u64,
}

/// Copies both ways until both sides are done. A side that finishes sending (FIN) is passed on as a
/// half-close to the other, which may go on sending: protocols that shut down their write side
/// first (e.g. `nc -N`, HTTP/1.0 uploads) keep working.
pub async fn relay(client: &mut TcpStream, upstream: &mut TcpStream) -> io::Result<Carried> {
    let (sent, received) = copy_bidirectional_with_sizes(client, upstream, BUFFER, BUFFER).await?;
    Ok(Carried { sent, received })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    /// A pair of connected streams over loopback: (the side we keep, the side the relay gets).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn copy_relay_carries_both_ways_and_keeps_half_close() {
        carries_both_ways_and_keeps_half_close(false).await;
    }

    #[tokio::test]
    async fn splice_relay_carries_both_ways_and_keeps_half_close() {
        carries_both_ways_and_keeps_half_close(true).await;
    }

    async fn carries_both_ways_and_keeps_half_close(zero_copy: bool) {
        let (mut client, mut client_side) = pair().await;
        let (mut upstream_side, mut server) = pair().await;
        let relay = tokio::spawn(async move {
            if zero_copy {
                crate::proxy::splice_relay(&client_side, &upstream_side).await
            } else {
                relay(&mut client_side, &mut upstream_side).await
            }
        });

        // The client sends a request and half-closes; the server must still be able to answer.
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"request");
        server.write_all(b"a longer response").await.unwrap();
        server.shutdown().await.unwrap();
        let mut response = Vec::new();
        client.read_to_end(&mut response).await.unwrap();
        assert_eq!(response, b"a longer response");

        let carried = relay.await.unwrap().unwrap();
        assert_eq!(
            carried,
            Carried {
                sent: 7,
                received: 17
            }
        );
    }
}

#[cfg(test)]
mod bulk_tests {
    use sha2::{Digest, Sha256};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    /// 8 MiB each way at once through the splice relay arrive intact (the pipe refills many times).
    #[tokio::test]
    async fn splice_relay_moves_bulk_both_ways_intact() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, client_side) = (client.unwrap(), accepted.unwrap().0);
        let (upstream_side, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (upstream_side, server) = (upstream_side.unwrap(), accepted.unwrap().0);
        let relay =
            tokio::spawn(
                async move { crate::proxy::splice_relay(&client_side, &upstream_side).await },
            );

        let payload: Vec<u8> = (0..8u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
            .collect();
        let digest = Sha256::digest(&payload);
        let exchange = |mut stream: TcpStream, data: Vec<u8>| async move {
            let (mut rx, mut tx) = stream.split();
            let send = async {
                tx.write_all(&data).await.unwrap();
                tx.shutdown().await.unwrap();
            };
            let mut got = Vec::new();
            tokio::join!(send, async { rx.read_to_end(&mut got).await.unwrap() });
            Sha256::digest(&got)
        };
        let (at_server, at_client) =
            tokio::join!(exchange(server, payload.clone()), exchange(client, payload));
        assert_eq!(at_server, digest);
        assert_eq!(at_client, digest);
        let carried = relay.await.unwrap().unwrap();
        assert_eq!((carried.sent, carried.received), (8 << 20, 8 << 20));
    }
}
