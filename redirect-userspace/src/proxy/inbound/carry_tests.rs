//! A received connection's streams carried to a Pod on loopback, in memory up to the Pod's socket:
//! what a hand-over waits for, and what ends when the connection does.
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket},
    task::JoinHandle,
};

use super::{InboundLimits, Sender, buffered::SendBudget, carry};
use crate::{
    budget::{BudgetArgs, BudgetMetrics, Budgets, Limits},
    dns::{HostCache, Upstream},
    drain::{Lifecycle, Phase},
    hbone::{HboneClient, Identity},
    identity::CgroupPods,
    live::LiveState,
    net::PlainSockets,
    proxy::{Authorizer, DialGuard, ProxyContext, ProxyMetrics, RelayMode, Timeouts},
    records::{Connections, RecordMetrics},
    redirect::FiledFlows,
};

const PEER: &str = "10.0.0.9:40000";

/// The agent's side: its context, the limits of received HBONE, and a Pod listening on loopback.
struct Agent {
    context: Arc<ProxyContext>,
    limits: Arc<InboundLimits>,
    pod: TcpListener,
}

impl Agent {
    /// A Pod whose socket takes little before its writer blocks (`rcvbuf` bytes).
    async fn new(rcvbuf: u32) -> Agent {
        let budgets = Arc::new(Budgets::new(
            Limits::size(
                4096,
                crate::budget::ports::DEFAULT_EPHEMERAL_PORTS,
                &BudgetArgs::default(),
            ),
            &Arc::new(BudgetMetrics::default()),
        ));
        let context = Arc::new(ProxyContext {
            flows: Arc::new(FiledFlows::default()),
            sockets: Arc::new(PlainSockets),
            live: LiveState::new(None),
            metrics: Arc::default(),
            proxy_metrics: Arc::new(ProxyMetrics::default()),
            endpoint_hosts: Arc::new(HostCache::new(Arc::new(Upstream::new(
                "127.0.0.1:9".parse().unwrap(),
            )))),
            relay: RelayMode::Splice,
            cgroups: Arc::new(CgroupPods::new("/nonexistent/cgroup".into())),
            budgets: budgets.clone(),
            timeouts: Timeouts::default(),
            guard: Arc::new(DialGuard::allowing_loopback(Vec::new())),
            buffer: None,
            records: Arc::new(Connections::new(false, Arc::new(RecordMetrics::default()))),
            hbone: Arc::new(HboneClient::new(
                None,
                Arc::new(PlainSockets),
                Arc::default(),
            )),
            authorizer: Arc::new(Authorizer::default()),
        });
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(rcvbuf).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        Agent {
            limits: InboundLimits::new(budgets.fds.clone(), budgets.connections.clone()),
            context,
            pod: socket.listen(16).unwrap(),
        }
    }

    /// Proxied connections held: the units a drain waits for.
    fn relaying(&self) -> usize {
        self.context.budgets.connections.used()
    }

    /// Serves one connection over `io`, as its TLS would hand it on, until it ends.
    fn carry<IO>(&self, io: IO, budget: Arc<SendBudget>, life: &Lifecycle) -> JoinHandle<()>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let peer: SocketAddr = PEER.parse().unwrap();
        let held = self.limits.connection(peer.ip(), peer.ip()).unwrap();
        let sender = Arc::new(Sender {
            source: Identity::parse("spiffe://cluster.local/ns/hostile/sa/default").unwrap(),
            peer,
            pod: self.pod.local_addr().unwrap().ip(),
            from: None,
        });
        tokio::spawn(carry(
            self.context.clone(),
            self.limits.clone(),
            held,
            sender,
            budget,
            io,
            life.serving(),
        ))
    }

    fn connect(&self) -> Request<()> {
        let SocketAddr::V4(pod) = self.pod.local_addr().unwrap() else {
            unreachable!("bound on 127.0.0.1");
        };
        Request::builder()
            .method(Method::CONNECT)
            .uri(pod.to_string())
            .body(())
            .unwrap()
    }
}

/// Polls `done` every 10 ms for up to `within`.
async fn within(within: Duration, done: impl Fn() -> bool) -> bool {
    tokio::time::timeout(within, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn a_hand_over_waits_for_a_stream_received_and_tells_the_peer_to_open_no_more() {
    let agent = Agent::new(64 * 1024).await;
    let life = Lifecycle::default();
    life.enter(Phase::Serving);
    let (near, far) = tokio::io::duplex(1 << 20);
    let served = agent.carry(far, SendBudget::new(1 << 20), &life);
    let (client, driver) = h2::client::handshake(near).await.unwrap();
    let driver = tokio::spawn(driver);
    let mut client = client.ready().await.unwrap();
    let (response, mut send) = client.send_request(agent.connect(), false).unwrap();
    let (mut pod, _) = agent.pod.accept().await.unwrap();
    assert_eq!(response.await.unwrap().status(), 200);
    send.send_data(Bytes::from_static(b"ping"), false).unwrap();
    let mut got = [0; 4];
    pod.read_exact(&mut got).await.unwrap();
    assert_eq!((&got, agent.relaying()), (b"ping", 1));

    life.enter(Phase::HandedOver);
    // The drain is held by the stream, up to its deadline.
    let until_empty = agent.context.budgets.connections.until_empty();
    let drained = tokio::time::timeout(Duration::from_millis(300), until_empty).await;
    assert!(drained.is_err(), "the drain did not wait for the stream");
    assert_eq!(agent.relaying(), 1);
    // The peer was told to take new streams elsewhere: one more reaches no Pod.
    let refused = match client.ready().await {
        Ok(mut client) => match client.send_request(agent.connect(), false) {
            Ok((response, _send)) => tokio::time::timeout(Duration::from_secs(1), response)
                .await
                .map(|r| r.is_err())
                .unwrap_or(false),
            Err(_) => true,
        },
        Err(_) => true,
    };
    assert!(refused, "a stream opened after the hand-over was taken");
    let second = tokio::time::timeout(Duration::from_millis(100), agent.pod.accept()).await;
    assert!(second.is_err(), "the Pod was dialled after the hand-over");
    // The old stream still carries.
    send.send_data(Bytes::from_static(b"pong"), true).unwrap();
    pod.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"pong");

    // Both ends close: the drain ends, and the connection with its last stream.
    assert_eq!(pod.read(&mut got).await.unwrap(), 0);
    drop(pod);
    let until_empty = agent.context.budgets.connections.until_empty();
    tokio::time::timeout(Duration::from_secs(2), until_empty)
        .await
        .expect("the drain outlived the stream");
    tokio::time::timeout(Duration::from_secs(2), served)
        .await
        .expect("the connection outlived its last stream after the hand-over")
        .unwrap();
    assert_eq!(agent.limits.fds_held(), 0);
    driver.abort();
}

/// Sends into `send` until the peer's window stops it; what was sent, counted into `sent`.
async fn send_until_stalled(mut send: h2::SendStream<Bytes>, sent: Arc<AtomicUsize>) {
    loop {
        send.reserve_capacity(1 << 20);
        match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(n)) if n > 0 => {
                if send.send_data(Bytes::from(vec![7; n]), false).is_err() {
                    return;
                }
                sent.fetch_add(n, Ordering::Relaxed);
            }
            Some(Ok(_)) => {}
            _ => return,
        }
    }
}

/// Waits until `count` stays put for 300 ms, for up to 10 s.
async fn settled(count: &AtomicUsize) -> usize {
    for _ in 0..33 {
        let then = count.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(300)).await;
        if count.load(Ordering::Relaxed) == then {
            return then;
        }
    }
    panic!("still moving: {}", count.load(Ordering::Relaxed));
}

#[tokio::test]
async fn streams_end_with_their_connection_even_one_whose_pod_neither_reads_nor_has_room_to_send() {
    const BUDGET: usize = 64 * 1024;
    let agent = Agent::new(4096).await;
    let life = Lifecycle::default();
    life.enter(Phase::Serving);
    // The wire: what the agent writes reaches the peer only while `reading` runs.
    let (near, far) = tokio::io::duplex(64 * 1024);
    let (wire, client_side) = tokio::io::duplex(64 * 1024);
    let (mut from_agent, mut to_agent) = tokio::io::split(near);
    let (mut from_peer, mut to_peer) = tokio::io::split(wire);
    let reading = tokio::spawn(async move { tokio::io::copy(&mut from_agent, &mut to_peer).await });
    let writing = tokio::spawn(async move { tokio::io::copy(&mut from_peer, &mut to_agent).await });
    let budget = SendBudget::new(BUDGET);
    let served = agent.carry(far, budget.clone(), &life);
    let (client, driver) = h2::client::Builder::new()
        .initial_window_size(i32::MAX as u32)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(client_side)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    let mut client = client.ready().await.unwrap();
    let (response, send) = client.send_request(agent.connect(), false).unwrap();
    let (mut pod, _) = agent.pod.accept().await.unwrap();
    let _body = response.await.unwrap().into_body();

    // The Pod never reads: the peer's bytes fill its socket and the agent's, then stop.
    let sent = Arc::new(AtomicUsize::new(0));
    let sending = tokio::spawn(send_until_stalled(send, sent.clone()));
    let to_pod = settled(&sent).await;
    // The peer stops reading; the Pod sends until its connection's budget is full.
    reading.abort();
    let (pod_sent, written) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let counting = pod_sent.clone();
    let pod_writer = tokio::spawn(async move {
        let chunk = vec![9; 16 * 1024];
        loop {
            match pod.write(&chunk).await {
                Ok(n) => counting.fetch_add(n, Ordering::Relaxed),
                Err(e) => return e.kind(),
            };
        }
    });
    written.store(settled(&pod_sent).await, Ordering::Relaxed);
    assert_eq!(
        budget.queued(),
        BUDGET,
        "the connection's budget is not full"
    );
    assert_eq!((agent.relaying(), agent.limits.fds_held()), (1, 2));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pod_writer.is_finished() && !served.is_finished());

    // The peer leaves: its connection ends, and the stream with it, its Pod's socket reset.
    driver.abort();
    sending.abort();
    drop(client);
    let _ = writing.await;
    tokio::time::timeout(Duration::from_secs(2), served)
        .await
        .expect("the connection outlived its peer")
        .unwrap();
    // The stream's socket to the Pod and the connection's are given back.
    let ended = within(Duration::from_secs(2), || agent.limits.fds_held() == 0).await;
    assert!(
        ended,
        "the stream outlived its connection (peer sent {to_pod} bytes, the Pod {})",
        written.load(Ordering::Relaxed)
    );
    assert_eq!(agent.relaying(), 0);
    let reset = tokio::time::timeout(Duration::from_secs(2), pod_writer)
        .await
        .expect("the Pod's socket was left open")
        .unwrap();
    assert_eq!(reset, std::io::ErrorKind::ConnectionReset);
}
