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
        server::serve(far, settings, &metrics, peer, on_stream).await;
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
