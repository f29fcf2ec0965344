//! Forwarding a query to the upstream resolver and bringing its reply back byte for byte (under the
//! client's own id).
//!
//! UDP queries share a few connected sockets ("lanes") instead of taking a socket each: a forward is
//! then one `send` from the task that received the query, and one reader per lane takes the replies,
//! matches each to its query ([`Pending`]: random ids, question checked) and sends it straight back
//! to the client. No task, socket or allocation per query. A connected socket only receives from the
//! upstream's address, and each lane is replaced by a fresh one (a new random port) after a while, so
//! a spoofer has to guess a port and a random id that both keep changing.
use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering},
    },
    time::Duration,
};

use super::{
    log::{Kind, limited},
    pending::{Expired, Full, Pending, Reply},
    server::PodReply,
};
use crate::lock::Locked;
use crate::net::{connect_marked, udp_connected_marked};
use arc_swap::ArcSwapOption;
use hickory_proto::op::{Message, Query};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UdpSocket,
    sync::{Notify, oneshot},
    time::{Instant, timeout_at},
};

/// Total time a forwarded query may take before the client gets SERVFAIL: within the 2 s of
/// `docs/dns.md#upstream-failure` and well under glibc's and dig's 5 s retry, so the client sees a failure, not a hang.
pub(super) const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// UDP queries a lane carries before a fresh socket (a new random port) takes over.
const LANE_QUERIES: u32 = 10_000;
/// ... or after this long, whichever comes first.
const LANE_AGE: Duration = Duration::from_secs(30);
/// Queries in flight on one lane at most: a small part of the id space, so ids stay hard to guess.
/// (The DNS budgets cap forwards far below this; this holds without them too.)
const LANE_IN_FLIGHT: usize = 4096;
/// Replies a reader takes in one go before it lets other tasks run.
const REPLY_BATCH: usize = 64;
/// The largest UDP reply.
const MAX_UDP: usize = 65_535;

#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    #[error("upstream {0} did not answer within {1:?}")]
    Timeout(SocketAddr, Duration),
    #[error("upstream {0}: too many queries in flight")]
    Busy(SocketAddr),
    #[error("upstream {addr}: {source}")]
    Io {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// Who waits for a forwarded UDP reply. Told exactly once: the reply, or the query back with the
/// reason it failed.
pub(crate) enum ReplyTo {
    /// A pod's query: answered from the lane's reader, straight to the pod.
    Pod(PodReply),
    /// The agent's own lookup (endpoint host names).
    Agent(oneshot::Sender<Result<Vec<u8>, UpstreamError>>),
}

impl ReplyTo {
    fn answered(self, reply: &[u8]) {
        match self {
            ReplyTo::Pod(pod) => pod.answered(reply),
            ReplyTo::Agent(waiter) => {
                let _ = waiter.send(Ok(reply.to_vec()));
            }
        }
    }

    /// `query` is the client's, under its own id.
    fn failed(self, query: &[u8], error: UpstreamError) {
        match self {
            ReplyTo::Pod(pod) => pod.failed(query, error),
            ReplyTo::Agent(waiter) => {
                let _ = waiter.send(Err(error));
            }
        }
    }
}

/// The resolver the agent forwards to.
pub(crate) struct Upstream {
    pub addr: SocketAddr,
    pub timeout: Duration,
    /// The UDP lanes, opened on first use; a query takes the next one in turn.
    lanes: Vec<ArcSwapOption<Lane>>,
    next_lane: AtomicUsize,
    /// Queries a lane carries before it is replaced.
    lane_queries: u32,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

impl Upstream {
    pub(crate) fn new(addr: SocketAddr) -> Self {
        // One lane per worker thread: replies are read in parallel, one lock per lane.
        let lanes = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        Self {
            addr,
            timeout: UPSTREAM_TIMEOUT,
            lanes: (0..lanes).map(|_| ArcSwapOption::empty()).collect(),
            next_lane: AtomicUsize::new(0),
            lane_queries: LANE_QUERIES,
        }
    }

    /// Sends `query` (a client's datagram, its `question` as read from it) upstream over UDP; the
    /// reply, or SERVFAIL's occasion, goes to `reply_to` later, from the lane's reader. `query` is
    /// left under the id it went up with.
    pub(crate) async fn forward(&self, query: &mut [u8], question: Vec<Query>, reply_to: ReplyTo) {
        let mut waiting = Some((question, reply_to));
        let mut filed = None;
        // A lane may close between taking it and filing the query (it was replaced and drained
        // meanwhile): then the lane that replaced it takes the query.
        for _ in 0..2 {
            let Some((question, reply_to)) = waiting.take() else {
                break;
            };
            let lane = match self.lane() {
                Ok(lane) => lane,
                Err(source) => {
                    let error = UpstreamError::Io {
                        addr: self.addr,
                        source,
                    };
                    return reply_to.failed(query, error);
                }
            };
            match lane.file(query, question, reply_to) {
                Filing::Filed => {
                    filed = Some(lane);
                    break;
                }
                Filing::Refused => return,
                Filing::Closed(question, reply_to) => waiting = Some((question, reply_to)),
            }
        }
        let Some(lane) = filed else {
            if let Some((_, reply_to)) = waiting {
                reply_to.failed(query, UpstreamError::Busy(self.addr));
            }
            return;
        };
        let sent = match lane.socket.try_send(query) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => lane.socket.send(query).await,
            other => other,
        };
        // A failed send is left to the query's deadlines: it is sent again, then given up.
        if let Err(e) = sent {
            limited!(Kind::UpstreamSend, debug, upstream = %self.addr, error = %e, "DNS forward send failed; retrying once");
        }
    }

    /// Forwards the agent's own query over UDP and waits for the reply (unchanged but for the id,
    /// which is the query's).
    pub(crate) async fn forward_udp(&self, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
        let question =
            Message::from_vec(query)
                .map(|m| m.queries)
                .map_err(|e| UpstreamError::Io {
                    addr: self.addr,
                    source: io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
                })?;
        let (reply_to, reply) = oneshot::channel();
        let mut datagram = query.to_vec();
        self.forward(&mut datagram, question, ReplyTo::Agent(reply_to))
            .await;
        // The lane's reader answers by its deadline; the margin only guards against a reader gone.
        let give_up = Instant::now() + self.timeout + Duration::from_secs(1);
        match timeout_at(give_up, reply).await {
            Ok(Ok(result)) => result,
            _ => Err(UpstreamError::Timeout(self.addr, self.timeout)),
        }
    }

    /// The next lane in turn, replaced by a fresh one when it has served its time.
    fn lane(&self) -> io::Result<Arc<Lane>> {
        let turn = self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        let slot = &self.lanes[turn];
        if let Some(lane) = slot.load_full()
            && lane.take_turn(self.lane_queries)
        {
            return Ok(lane);
        }
        let lane = Arc::new(Lane::open(self.addr, self.timeout)?);
        tokio::spawn(read_replies(lane.clone()));
        if let Some(old) = slot.swap(Some(lane.clone())) {
            old.retire();
        }
        Ok(lane)
    }

    /// Forwards over TCP (the client came over TCP, e.g. after a truncated UDP reply).
    pub(crate) async fn forward_tcp(&self, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
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
            close_without_time_wait(&stream);
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

/// Closes a DNS-over-TCP connection whose exchange is complete (the whole reply read) with a reset,
/// not a FIN: a FIN from our side first would leave the socket in TIME_WAIT for a minute, holding
/// its port toward the upstream, and a pod asking over TCP quickly would use up the node's ports
/// toward its resolver. Nothing is in flight either way, so the reset loses nothing.
pub(crate) fn close_without_time_wait(stream: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// One connected UDP socket to the upstream and the queries in flight on it.
struct Lane {
    upstream: SocketAddr,
    socket: UdpSocket,
    in_flight: Mutex<InFlight>,
    /// Wakes the reader when its first query goes in flight (it has a deadline to keep again) and
    /// when the lane is retired.
    wake: Notify,
    /// Queries given to this lane so far.
    carried: AtomicU32,
    opened: Instant,
    /// Replaced by a fresh lane: it takes no new query and closes once its last one is done.
    retired: AtomicBool,
}

struct InFlight {
    pending: Pending<ReplyTo>,
    /// The reader has ended: nothing may be filed any more (no one would answer or expire it).
    closed: bool,
}

impl Lane {
    fn open(upstream: SocketAddr, timeout: Duration) -> io::Result<Lane> {
        Ok(Lane {
            upstream,
            socket: udp_connected_marked(upstream)?,
            in_flight: Mutex::new(InFlight {
                pending: Pending::new(LANE_IN_FLIGHT, timeout),
                closed: false,
            }),
            wake: Notify::new(),
            // The query that opens a lane is its first.
            carried: AtomicU32::new(1),
            opened: Instant::now(),
            retired: AtomicBool::new(false),
        })
    }

    fn in_flight(&self) -> MutexGuard<'_, InFlight> {
        // A table of queries: still consistent after a panic elsewhere.
        self.in_flight.locked()
    }

    /// Counts one more query on this lane, or says it has served its time.
    fn take_turn(&self, limit: u32) -> bool {
        !self.retired.load(Ordering::Acquire)
            && self.carried.fetch_add(1, Ordering::Relaxed) < limit
            && self.opened.elapsed() < LANE_AGE
    }

    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Files the query under a fresh id (written into `query`). A full lane fails it at once; a
    /// closed one hands it back.
    fn file(&self, query: &mut [u8], question: Vec<Query>, reply_to: ReplyTo) -> Filing {
        let mut in_flight = self.in_flight();
        if in_flight.closed {
            return Filing::Closed(question, reply_to);
        }
        let first = in_flight.pending.is_empty();
        let now = std::time::Instant::now();
        let filed = in_flight
            .pending
            .insert(query, question, reply_to, now, &mut rand::rng());
        drop(in_flight);
        match filed {
            Ok(_) => {
                if first {
                    self.wake.notify_one();
                }
                Filing::Filed
            }
            Err(Full(reply_to)) => {
                limited!(Kind::UpstreamBusy, debug, upstream = %self.upstream, "too many DNS forwards in flight on one socket; SERVFAIL");
                reply_to.failed(query, UpstreamError::Busy(self.upstream));
                Filing::Refused
            }
        }
    }
}

enum Filing {
    /// In flight: to be sent.
    Filed,
    /// Failed at once (the waiter was told).
    Refused,
    /// The lane no longer takes queries: here they are back.
    Closed(Vec<Query>, ReplyTo),
}

/// A lane's reader: takes the upstream's replies to their clients, sends again what waited too
/// long and fails what waited longer. Ends when the lane is retired and has nothing in flight.
async fn read_replies(lane: Arc<Lane>) {
    let upstream = lane.upstream;
    let timeout = lane.in_flight().pending.timeout();
    let mut buf = vec![0u8; MAX_UDP];
    let sleep = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(sleep);
    let mut armed = None;
    loop {
        let due = {
            let mut in_flight = lane.in_flight();
            let due = in_flight.pending.next_due();
            if due.is_none() && lane.retired.load(Ordering::Acquire) {
                in_flight.closed = true;
                return;
            }
            due
        };
        if due != armed {
            if let Some(at) = due {
                sleep.as_mut().reset(Instant::from_std(at));
            }
            armed = due;
        }
        tokio::select! {
            biased;
            ready = lane.socket.readable() => {
                if ready.is_err() {
                    continue;
                }
                // What is there (a batch at most: other tasks on this thread get their turn), then
                // back to waiting.
                for _ in 0..REPLY_BATCH {
                    match lane.socket.try_recv(&mut buf) {
                        Ok(n) => take_reply(&lane, &mut buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // e.g. ICMP port unreachable: the queries' deadlines deal with it.
                        Err(e) => {
                            limited!(Kind::UpstreamSocket, debug, %upstream, error = %e, "DNS upstream socket error");
                        }
                    }
                }
            }
            () = &mut sleep, if armed.is_some() => {
                let expired = lane.in_flight().pending.expire(std::time::Instant::now());
                for expired in expired {
                    match expired {
                        Expired::Resend(datagram) => {
                            let _ = lane.socket.try_send(&datagram);
                        }
                        Expired::GaveUp { waiter, query } => {
                            waiter.failed(&query, UpstreamError::Timeout(upstream, timeout));
                        }
                    }
                }
            }
            () = lane.wake.notified(), if armed.is_none() => {}
        }
    }
}

fn take_reply(lane: &Lane, reply: &mut [u8]) {
    let taken = lane.in_flight().pending.answer(reply);
    match taken {
        Reply::Matched { waiter, .. } => waiter.answered(reply),
        Reply::UnknownId => {
            limited!(
                Kind::StrayReply,
                debug,
                "DNS reply for no query in flight (late or forged); dropped"
            );
        }
        Reply::WrongQuestion => {
            limited!(
                Kind::StrayReply,
                debug,
                "DNS reply whose question was not asked; dropped"
            );
        }
        Reply::Malformed => {
            limited!(
                Kind::StrayReply,
                debug,
                "DNS upstream sent something that is not a response; dropped"
            );
        }
    }
}

/// The first `nameserver` in a resolv.conf: the default upstream (on a node, the cluster DNS).
pub(crate) fn first_nameserver(resolv_conf: &str) -> Option<SocketAddr> {
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
    use hickory_proto::{
        op::MessageType,
        rr::{Name, RData, Record, RecordType, rdata},
    };
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

    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut message = Message::query();
        message.metadata.id = id;
        message.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        message.to_vec().unwrap()
    }

    /// The upstream's answer to `query` as it arrived: a response with its id and question, an
    /// address record after them (so the bytes past the question go back as they are).
    fn answer(query: &[u8], last_octet: u8) -> Vec<u8> {
        let mut reply = Message::from_vec(query).unwrap();
        reply.metadata.message_type = MessageType::Response;
        let name = reply.queries[0].name().clone();
        let a = rdata::A::new(203, 0, 113, last_octet);
        reply.add_answer(Record::from_rdata(name, 60, RData::A(a)));
        reply.to_vec().unwrap()
    }

    /// An upstream socket that answers what it gets with [`answer`].
    async fn receive(server: &UdpSocket) -> (Vec<u8>, SocketAddr) {
        let mut buf = [0u8; 512];
        let (n, from) = server.recv_from(&mut buf).await.unwrap();
        (buf[..n].to_vec(), from)
    }

    fn id(message: &[u8]) -> u16 {
        u16::from_be_bytes([message[0], message[1]])
    }

    #[tokio::test]
    async fn udp_reply_comes_back_byte_for_byte_under_the_querys_id() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Upstream::new(server.local_addr().unwrap());
        let sent = query(0x0101, "a.example.");
        let serve = async {
            let (got, from) = receive(&server).await;
            let reply = answer(&got, 9);
            server.send_to(&reply, from).await.unwrap();
            reply
        };
        let (forwarded, upstream_saw) = tokio::join!(upstream.forward_udp(&sent), serve);
        let forwarded = forwarded.unwrap();
        assert_eq!(id(&forwarded), 0x0101);
        assert_eq!(
            forwarded[2..],
            upstream_saw[2..],
            "all but the id as the upstream sent it"
        );
    }

    /// Many queries in flight at once, all with the same client id (as from many pods): each goes
    /// up under an id of its own on one shared socket, and each reply, though they come back in
    /// reverse order, reaches the query it answers.
    #[tokio::test]
    async fn concurrent_queries_share_a_socket_and_each_gets_its_own_answer() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Arc::new(Upstream::new(server.local_addr().unwrap()));
        let forwards: Vec<_> = (0..32u8)
            .map(|i| {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let reply = upstream
                        .forward_udp(&query(7, &format!("q{i}.example.")))
                        .await;
                    (i, reply)
                })
            })
            .collect();
        let mut arrived = Vec::new();
        for _ in 0..32 {
            arrived.push(receive(&server).await);
        }
        let ports: std::collections::HashSet<_> =
            arrived.iter().map(|(_, from)| from.port()).collect();
        // Ids are drawn per socket: two sockets may well use the same one (a reply is matched on
        // the socket it came back to), but no two queries in flight on one socket may.
        let ids: std::collections::HashSet<_> = arrived
            .iter()
            .map(|(q, from)| (from.port(), id(q)))
            .collect();
        assert!(
            ports.len() <= upstream.lanes.len(),
            "{} sockets for 32 queries",
            ports.len()
        );
        assert_eq!(
            ids.len(),
            32,
            "every query in flight on a socket has its own id"
        );
        for (got, from) in arrived.iter().rev() {
            let name = Message::from_vec(got).unwrap().queries[0].name().to_ascii();
            let n: u8 = name
                .trim_start_matches('q')
                .trim_end_matches(".example.")
                .parse()
                .unwrap();
            server.send_to(&answer(got, n), from).await.unwrap();
        }
        for forward in forwards {
            let (i, reply) = forward.await.unwrap();
            let reply = Message::from_vec(&reply.unwrap()).unwrap();
            assert_eq!(reply.metadata.id, 7);
            assert_eq!(reply.queries[0].name().to_ascii(), format!("q{i}.example."));
            assert_eq!(
                reply.answers[0].data,
                RData::A(rdata::A::new(203, 0, 113, i))
            );
        }
    }

    /// A reply with the id of a query in flight but another question (a forgery that guessed the
    /// id) and one with an unknown id are dropped; the real answer still gets through.
    #[tokio::test]
    async fn forged_replies_are_dropped_the_real_one_gets_through() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Upstream::new(server.local_addr().unwrap());
        let serve = async {
            let (got, from) = receive(&server).await;
            let mut forged = Message::from_vec(&answer(&got, 66)).unwrap();
            forged.queries[0].set_name(Name::from_ascii("bank.example.").unwrap());
            server
                .send_to(&forged.to_vec().unwrap(), from)
                .await
                .unwrap();
            let mut unknown = answer(&got, 66);
            unknown[..2].copy_from_slice(&id(&got).wrapping_add(1).to_be_bytes());
            server.send_to(&unknown, from).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            server.send_to(&answer(&got, 1), from).await.unwrap();
        };
        let sent = query(5, "a.example.");
        let (reply, ()) = tokio::join!(upstream.forward_udp(&sent), serve);
        let reply = Message::from_vec(&reply.unwrap()).unwrap();
        assert_eq!(
            reply.answers[0].data,
            RData::A(rdata::A::new(203, 0, 113, 1))
        );
    }

    /// A lane that carried its share of queries is replaced by a fresh socket (a new port); the
    /// queries on either side of the change are answered.
    #[tokio::test]
    async fn a_lane_is_replaced_after_its_share_of_queries() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut upstream = Upstream::new(server.local_addr().unwrap());
        upstream.lanes.truncate(1);
        upstream.lane_queries = 3;
        let mut ports = Vec::new();
        for i in 0..6u8 {
            let serve = async {
                let (got, from) = receive(&server).await;
                server.send_to(&answer(&got, i), from).await.unwrap();
                from.port()
            };
            let sent = query(1, "a.example.");
            let (reply, port) = tokio::join!(upstream.forward_udp(&sent), serve);
            assert!(reply.is_ok(), "query {i}: {reply:?}");
            ports.push(port);
        }
        assert_eq!(ports[0], ports[2]);
        assert_ne!(
            ports[2], ports[3],
            "the fourth query goes out on a fresh socket"
        );
        assert_eq!(ports[3], ports[5]);
    }

    #[tokio::test]
    async fn silent_upstream_times_out_within_the_deadline() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut upstream = Upstream::new(server.local_addr().unwrap());
        upstream.timeout = Duration::from_millis(700);
        let started = std::time::Instant::now();
        let err = upstream
            .forward_udp(&query(1, "a.example."))
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::Timeout(..)), "{err}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(700) && took < Duration::from_millis(1000),
            "{took:?}"
        );
        // Sent twice: once, and again after 500 ms, under the same id.
        let mut buf = [0u8; 64];
        let (first, _) = server
            .try_recv_from(&mut buf)
            .map(|(n, a)| (buf[..n].to_vec(), a))
            .unwrap();
        let (second, _) = server
            .try_recv_from(&mut buf)
            .map(|(n, a)| (buf[..n].to_vec(), a))
            .unwrap();
        assert_eq!(first, second);
        assert!(
            server.try_recv_from(&mut buf).is_err(),
            "sent again only once"
        );
    }
}
