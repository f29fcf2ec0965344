//! The receiving side's HTTP/2 serving, in memory: a client plays the hostile peer (TLS is
//! `hbone`'s and tested there).
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use h2::{Reason, client::SendRequest};
use http::{Method, Request};
use prometheus_client::registry::Registry;
use tokio::{sync::oneshot, task::JoinHandle};

use super::server::{self, Settings, StreamPermit};
use crate::hbone::HboneMetrics;

const PEER: &str = "10.0.0.9:40000";

/// A connection served with `settings`, each stream handed to `on_stream`; the client's side, and
/// the server's task, which ends with the connection.
async fn connection<F>(
    settings: Settings,
    metrics: Arc<HboneMetrics>,
    on_stream: F,
) -> (SendRequest<Bytes>, JoinHandle<()>, JoinHandle<()>)
where
    F: FnMut(Request<h2::RecvStream>, h2::server::SendResponse<Bytes>, StreamPermit)
        + Send
        + 'static,
{
    let (near, far) = tokio::io::duplex(1 << 20);
    let peer: SocketAddr = PEER.parse().unwrap();
    let served = tokio::spawn(async move {
        server::serve(
            far,
            settings,
            &metrics,
            peer,
            std::future::pending(),
            on_stream,
        )
        .await;
    });
    let (client, driver) = h2::client::handshake(near).await.unwrap();
    let driver = tokio::spawn(async move {
        let _ = driver.await;
    });
    (client, served, driver)
}

fn connect() -> Request<()> {
    Request::builder()
        .method(Method::CONNECT)
        .uri("10.0.0.1:8080")
        .body(())
        .unwrap()
}

fn inbound(metrics: &HboneMetrics, result: &str) -> bool {
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let text = crate::metrics::encode(&registry).unwrap();
    text.lines()
        .any(|l| l.starts_with(&format!("hbone_inbound_total{{result=\"{result}\"}} 1")))
}

/// Sends on drop: the work it is held by was given up.
struct Dropped(Option<oneshot::Sender<()>>);

impl Drop for Dropped {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

#[tokio::test]
async fn a_stream_reset_by_the_peer_gives_up_its_dial_at_once() {
    let (dropped_tx, dropped) = oneshot::channel();
    let (outcome_tx, outcome) = oneshot::channel();
    let mut handed = Some((dropped_tx, outcome_tx));
    let metrics = Arc::new(HboneMetrics::default());
    let (client, _served, _driver) = connection(
        Settings::default(),
        metrics,
        move |_, mut respond, permit| {
            let Some((dropped_tx, outcome_tx)) = handed.take() else {
                return;
            };
            tokio::spawn(async move {
                let _permit = permit;
                // A dial to a Pod whose SYNs go unanswered: never done.
                let dial = async move {
                    let _held = Dropped(Some(dropped_tx));
                    std::future::pending::<()>().await
                };
                let _ = outcome_tx.send(server::unless_reset(&mut respond, dial).await);
            });
        },
    )
    .await;
    let mut client = client.ready().await.unwrap();
    let (_response, mut send) = client.send_request(connect(), false).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    send.send_reset(Reason::CANCEL);
    let given_up = tokio::time::timeout(Duration::from_millis(500), dropped).await;
    assert!(given_up.is_ok(), "the dial outlived the stream's reset");
    assert_eq!(outcome.await.unwrap(), None);
}

#[tokio::test]
async fn dials_in_flight_count_against_the_streams_of_a_connection_even_once_reset() {
    let settings = Settings {
        streams: 2,
        ..Settings::default()
    };
    let metrics = Arc::new(HboneMetrics::default());
    // The streams' tasks, still dialling after their streams were reset.
    let held: Arc<Mutex<Vec<StreamPermit>>> = Arc::default();
    let holding = held.clone();
    let (client, _served, _driver) =
        connection(settings, metrics.clone(), move |_, respond, permit| {
            holding.lock().unwrap().push(permit);
            drop(respond);
        })
        .await;
    let mut client = client.ready().await.unwrap();
    for _ in 0..2 {
        let (_response, mut send) = client.send_request(connect(), false).unwrap();
        send.send_reset(Reason::CANCEL);
        client = client.ready().await.unwrap();
    }
    let (response, _send) = client.send_request(connect(), false).unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(1), response)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.reason(), Some(Reason::REFUSED_STREAM));
    assert!(inbound(&metrics, "stream_limit"));
    assert_eq!(held.lock().unwrap().len(), 2);
    // A dial that ends gives its place back.
    held.lock().unwrap().pop();
    let mut client = client.ready().await.unwrap();
    let (response, _send) = client.send_request(connect(), false).unwrap();
    // Taken this time: the handler drops it unanswered, which cancels it.
    let taken = tokio::time::timeout(Duration::from_secs(1), response)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(taken.reason(), Some(Reason::CANCEL));
    assert_eq!(held.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_connection_without_streams_is_closed_once_idle_and_one_with_a_stream_is_not() {
    let settings = Settings {
        idle: Duration::from_millis(200),
        ..Settings::default()
    };
    let metrics = Arc::new(HboneMetrics::default());
    let (_client, served, driver) = connection(settings, metrics.clone(), |_, _, _| {}).await;
    tokio::time::timeout(Duration::from_secs(2), served)
        .await
        .expect("an idle connection stayed open")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), driver)
        .await
        .expect("the peer did not see its connection end")
        .unwrap();
    assert!(inbound(&metrics, "idle_closed"));

    // A stream still in its task keeps the connection open past the idle time.
    let held: Arc<Mutex<Vec<StreamPermit>>> = Arc::default();
    let holding = held.clone();
    let (client, served, _driver) = connection(settings, metrics, move |_, _, permit| {
        holding.lock().unwrap().push(permit);
    })
    .await;
    let mut client = client.ready().await.unwrap();
    let (_response, _send) = client.send_request(connect(), false).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        !served.is_finished(),
        "a connection with a stream was closed"
    );
    held.lock().unwrap().clear();
    tokio::time::timeout(Duration::from_secs(2), served)
        .await
        .expect("the connection stayed open once its stream ended")
        .unwrap();
}

/// A Pod that sends without end and never reads, counting what it gave.
struct Chatty(Arc<std::sync::atomic::AtomicUsize>);

impl tokio::io::AsyncRead for Chatty {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let n = buf.remaining();
        buf.put_slice(&vec![7; n]);
        self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_peer_that_grants_window_and_never_reads_leaves_the_connection_holding_its_budget() {
    use super::{
        super::{Timeouts, tunnel_relay::relay_tunnel},
        buffered::{Gated, Metered, SendBudget},
    };
    const BUDGET: usize = 1 << 20;
    const STREAMS: usize = 20;
    let budget = SendBudget::new(BUDGET);
    let given = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (near, far) = tokio::io::duplex(64 * 1024);
    let far = Metered::new(far, budget.clone());
    // The wire between them, counting what the peer reads, until it stops reading.
    let (wire_near, client_side) = tokio::io::duplex(64 * 1024);
    let (mut from_server, mut to_server) = tokio::io::split(near);
    let (mut from_client, mut to_client) = tokio::io::split(wire_near);
    let read_by_peer = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counting = read_by_peer.clone();
    let reading = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0; 16 * 1024];
        while let Ok(n @ 1..) = from_server.read(&mut buf).await {
            counting.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move { tokio::io::copy(&mut from_client, &mut to_server).await });
    let (pods, metrics) = (given.clone(), Arc::new(HboneMetrics::default()));
    let on_budget = budget.clone();
    let served = tokio::spawn(async move {
        let peer: SocketAddr = PEER.parse().unwrap();
        server::serve(
            far,
            Settings::default(),
            &metrics,
            peer,
            std::future::pending(),
            move |request, mut respond, permit| {
                let (pods, budget) = (pods.clone(), on_budget.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    let send = respond
                        .send_response(http::Response::new(()), false)
                        .unwrap();
                    let mut tunnel = crate::hbone::H2Stream::new(send, request.into_body());
                    let pod = (Gated::new(Chatty(pods), budget), tokio::io::sink());
                    let _ = relay_tunnel(pod, &mut tunnel, Timeouts::default()).await;
                });
            },
        )
        .await;
    });
    // The hostile peer: the largest windows HTTP/2 allows, then it stops reading.
    let (client, driver) = h2::client::Builder::new()
        .initial_window_size(i32::MAX as u32)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(client_side)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    let mut client = client.ready().await.unwrap();
    let mut responses = Vec::new();
    for _ in 0..STREAMS {
        let (response, send) = client.send_request(connect(), false).unwrap();
        responses.push((response, send));
        client = client.ready().await.unwrap();
    }
    for (response, _) in &mut responses {
        response.await.unwrap();
    }
    reading.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let given_then = given.load(std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let given = given.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(given, given_then, "the Pods are still read from");
    // What the Pods gave and the peer did not take: held by the agent (and the wire's buffer).
    // Without the budget each stream would have queued its own 4 MiB.
    let held = given - read_by_peer.load(std::sync::atomic::Ordering::Relaxed);
    assert!(held <= BUDGET + 64 * 1024, "{held} bytes held for the peer");
    assert!(
        held > BUDGET / 2,
        "{held} bytes held: the Pods were not read"
    );
    served.abort();
    driver.abort();
}

/// A Pod that never reads.
struct Deaf;

impl tokio::io::AsyncWrite for Deaf {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Pending
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_peer_sending_to_pods_that_never_read_gets_no_more_in_than_the_window_and_a_frame_a_stream()
 {
    use super::super::{Timeouts, tunnel_relay::relay_tunnel};
    const STREAMS: usize = 20;
    let (near, far) = tokio::io::duplex(1 << 20);
    let metrics = Arc::new(HboneMetrics::default());
    let served = tokio::spawn(async move {
        let peer: SocketAddr = PEER.parse().unwrap();
        server::serve(
            far,
            Settings::default(),
            &metrics,
            peer,
            std::future::pending(),
            move |request, mut respond, permit| {
                tokio::spawn(async move {
                    let _permit = permit;
                    let send = respond
                        .send_response(http::Response::new(()), false)
                        .unwrap();
                    let mut tunnel = crate::hbone::H2Stream::new(send, request.into_body());
                    let pod = (tokio::io::empty(), Deaf);
                    let _ = relay_tunnel(pod, &mut tunnel, Timeouts::default()).await;
                });
            },
        )
        .await;
    });
    let (client, driver) = h2::client::handshake(near).await.unwrap();
    let driver = tokio::spawn(driver);
    let mut client = client.ready().await.unwrap();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..STREAMS {
        let (response, mut send) = client.send_request(connect(), false).unwrap();
        client = client.ready().await.unwrap();
        let sent = sent.clone();
        tokio::spawn(async move {
            let _response = response.await;
            loop {
                send.reserve_capacity(1 << 20);
                match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                    Some(Ok(n)) if n > 0 => {
                        if send.send_data(Bytes::from(vec![7; n]), false).is_err() {
                            return;
                        }
                        sent.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    }
                    Some(Ok(_)) => {}
                    _ => return,
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent_then = sent.load(std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(sent, sent_then, "the peer still sends");
    // What the agent took of it: h2's buffers (the connection's window), a frame per stream in
    // the relay, and the wire's buffer.
    let bound = crate::hbone::CONNECTION_WINDOW as usize
        + STREAMS * server::RECEIVED_FRAME as usize
        + (1 << 20);
    assert!(sent <= bound, "{sent} bytes taken for Pods that never read");
    served.abort();
    driver.abort();
}

#[tokio::test]
async fn streams_stalled_on_the_peers_window_leave_room_for_the_others() {
    use super::{
        super::{Timeouts, tunnel_relay::relay_tunnel},
        buffered::{Gated, Metered, SendBudget},
    };
    const STALLED: usize = 40;
    let budget = SendBudget::new(crate::hbone::CONNECTION_WINDOW as usize);
    let (near, far) = tokio::io::duplex(1 << 20);
    let far = Metered::new(far, budget.clone());
    let metrics = Arc::new(HboneMetrics::default());
    let served = tokio::spawn(async move {
        let peer: SocketAddr = PEER.parse().unwrap();
        server::serve(
            far,
            Settings::default(),
            &metrics,
            peer,
            std::future::pending(),
            move |request, mut respond, permit| {
                let budget = budget.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let send = respond
                        .send_response(http::Response::new(()), false)
                        .unwrap();
                    let mut tunnel = crate::hbone::H2Stream::new(send, request.into_body());
                    let pod = (
                        Gated::new(Chatty(Arc::default()), budget),
                        tokio::io::sink(),
                    );
                    let _ = relay_tunnel(pod, &mut tunnel, Timeouts::default()).await;
                });
            },
        )
        .await;
    });
    // A peer with ztunnel's stream window whose clients stop reading on all streams but one.
    let (client, driver) = h2::client::Builder::new()
        .initial_window_size(crate::hbone::STREAM_WINDOW)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(near)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    let mut client = client.ready().await.unwrap();
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        let (response, send) = client.send_request(connect(), false).unwrap();
        stalled.push((response.await.unwrap(), send));
        client = client.ready().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (response, _send) = client.send_request(connect(), false).unwrap();
    let mut body = response.await.unwrap().into_body();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut read = 0;
        while read < 8 << 20 {
            let Some(Ok(data)) = body.data().await else {
                break;
            };
            read += data.len();
            let _ = body.flow_control().release_capacity(data.len());
        }
        read
    })
    .await;
    assert!(
        matches!(read, Ok(n) if n >= 8 << 20),
        "the stream still read was starved: {read:?}"
    );
    served.abort();
    driver.abort();
}
