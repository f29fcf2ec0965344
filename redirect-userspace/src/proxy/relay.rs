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
    async fn carries_both_ways_and_keeps_half_close() {
        let (mut client, mut client_side) = pair().await;
        let (mut upstream_side, mut server) = pair().await;
        let relay = tokio::spawn(async move { relay(&mut client_side, &mut upstream_side).await });

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
