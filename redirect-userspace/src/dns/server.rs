//! The DNS proxy's listeners (UDP and TCP at gateway:15053) and the per-query decision.
use std::{
    future::Future,
    io,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query},
    rr::{DNSClass, Name, RecordType},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
};

use super::{
    DnsMetrics, DnsOutcome, LocalAnswer,
    answer::{
        authoritative_reply, encode_for_udp, max_udp_reply, servfail_for_raw, servfail_reply,
    },
    cache::{AnswerCache, CacheKey},
    log::{Kind, limited},
    transfer,
    upstream::{ReplyTo, Upstream},
};
use crate::{
    budget::{Budgets, Permit, Refusal},
    identity::KernelView,
};

/// A TCP client that sends nothing for this long is dropped (its fd is worth more than its idleness).
const TCP_IDLE: Duration = Duration::from_secs(10);

/// One question, as the proxy hands it to the decision.
#[derive(Debug)]
pub(crate) struct DnsQuery<'a> {
    /// The pod that asked (its namespace decides what it may see).
    pub client: IpAddr,
    /// What the kernel said of the process behind a TCP connection; nothing over UDP.
    pub kernel: KernelView,
    pub name: &'a Name,
}

/// The agent answers itself, or the upstream does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    Answer(LocalAnswer),
    Forward,
}

/// Who decides: the agent wires this to the state snapshot's host lookup.
pub(crate) trait Decide: Send + Sync + 'static {
    fn decide(&self, query: &DnsQuery<'_>) -> Decision;

    /// Whose share of the DNS budgets a query from `client` takes (see `Snapshot::budget_key`):
    /// by default each address is a client of its own.
    fn budget_key(&self, client: IpAddr) -> IpAddr {
        client
    }

    /// Whether `client` is an address a workload holds (a known client).
    fn known(&self, _client: IpAddr) -> bool {
        true
    }

    /// What the kernel says of the process behind the TCP connection from `client`, read once
    /// when it is accepted; by default nothing.
    fn kernel_view(
        &self,
        _client: SocketAddr,
    ) -> Pin<Box<dyn Future<Output = KernelView> + Send + '_>> {
        Box::pin(std::future::ready(KernelView::Unknown))
    }
}

/// The share key of UDP datagrams from addresses no workload holds, arriving on interface
/// `interface`: all of them together (`100::/64`, the discard prefix, never a real client).
fn interface_key(interface: u32) -> IpAddr {
    IpAddr::V6(std::net::Ipv6Addr::new(
        0x100,
        0,
        0,
        0,
        0,
        0,
        (interface >> 16) as u16,
        interface as u16,
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

struct Shared {
    upstream: Arc<Upstream>,
    decide: Arc<dyn Decide>,
    metrics: Arc<DnsMetrics>,
    /// Forwards in flight and TCP clients, per client and node-wide; `None`: no caps.
    budgets: Option<Arc<Budgets>>,
    /// The upstream's UDP answers, kept for their TTL; `None`: every forward goes upstream.
    cache: Option<Arc<AnswerCache>>,
}

impl Shared {
    /// A place among the forwards in flight for `client` (held until dropped), or `Err` when the
    /// client is at its share or the node at its limit.
    /// For a UDP datagram that came in on `interface` (0: not known). A UDP source address
    /// costs nothing to forge (a pod with `CAP_NET_RAW`): one that no workload holds is not a client
    /// of its own but shares one share with every such address arriving on the same interface, the
    /// kernel's word for where it came from (a pod's own link).
    fn forward_slot_from(&self, client: IpAddr, interface: u32) -> Result<Option<Permit>, Refusal> {
        let key = if interface != 0 && !self.decide.known(client) {
            interface_key(interface)
        } else {
            self.decide.budget_key(client)
        };
        self.budgets
            .as_ref()
            .map(|b| b.dns_forwards.take(key))
            .transpose()
    }

    /// The cached reply to `query`, if it has a key and the cache holds one.
    fn cached(&self, key: Option<&CacheKey>, query: &[u8]) -> Option<Vec<u8>> {
        self.cache.as_ref()?.lookup(key?, query)
    }

    fn tcp_slot(&self, client: IpAddr) -> Result<Option<Permit>, Refusal> {
        self.budgets
            .as_ref()
            .map(|b| b.dns_tcp_clients.take(self.decide.budget_key(client)))
            .transpose()
    }
}

pub(crate) struct DnsProxy {
    /// One socket per client queue (see `queues`).
    udp: Vec<UdpSocket>,
    tcp: TcpListener,
    shared: Arc<Shared>,
}

impl DnsProxy {
    /// Binds UDP and TCP on `addr`.
    pub(crate) async fn bind(
        addr: SocketAddr,
        upstream: Arc<Upstream>,
        decide: Arc<dyn Decide>,
        metrics: Arc<DnsMetrics>,
    ) -> io::Result<Self> {
        let context = |e: io::Error| {
            io::Error::new(e.kind(), format!("binding the DNS proxy to {addr}: {e}"))
        };
        let udp = super::queues::bind_queues(addr).map_err(context)?;
        // Same port for both, also when `addr` asks for any port (0).
        let tcp = TcpListener::bind(udp[0].local_addr()?)
            .await
            .map_err(context)?;
        Ok(Self {
            udp,
            tcp,
            shared: Arc::new(Shared {
                upstream,
                decide,
                budgets: None,
                cache: None,
                metrics,
            }),
        })
    }

    /// Serves on sockets a predecessor bound (its UDP group, reuse-port program included, and its
    /// TCP listener), handed over as they are.
    pub(crate) fn from_sockets(
        udp: Vec<std::net::UdpSocket>,
        tcp: std::net::TcpListener,
        upstream: Arc<Upstream>,
        decide: Arc<dyn Decide>,
        metrics: Arc<DnsMetrics>,
    ) -> io::Result<Self> {
        let udp = udp
            .into_iter()
            .map(|s| {
                s.set_nonblocking(true)?;
                // Its predecessor set it at bind; an older one may not have.
                super::queues::want_ingress_interface(&s, s.local_addr()?)?;
                UdpSocket::from_std(s)
            })
            .collect::<io::Result<Vec<_>>>()?;
        tcp.set_nonblocking(true)?;
        Ok(Self {
            udp,
            tcp: TcpListener::from_std(tcp)?,
            shared: Arc::new(Shared {
                upstream,
                decide,
                budgets: None,
                cache: None,
                metrics,
            }),
        })
    }

    /// Copies of the UDP group's and the TCP listener's descriptors, for a successor.
    pub(crate) fn socket_fds(
        &self,
    ) -> io::Result<(Vec<std::os::fd::OwnedFd>, std::os::fd::OwnedFd)> {
        use std::os::fd::AsFd;
        let udp = self
            .udp
            .iter()
            .map(|s| s.as_fd().try_clone_to_owned())
            .collect::<io::Result<Vec<_>>>()?;
        Ok((udp, self.tcp.as_fd().try_clone_to_owned()?))
    }

    /// Answers repeated forwarded questions from `cache` (shared by every listener of the agent).
    pub(crate) fn with_cache(mut self, cache: Arc<AnswerCache>) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.cache = Some(cache);
        }
        self
    }

    /// Holds forwards and TCP clients to `budgets` (without, nothing is capped).
    pub(crate) fn with_budgets(mut self, budgets: Arc<Budgets>) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.budgets = Some(budgets);
        }
        self
    }

    #[cfg(test)]
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Serves until `shutdown` changes.
    pub(crate) async fn serve(self, mut shutdown: crate::drain::Watcher) {
        let queues: Vec<_> = self
            .udp
            .into_iter()
            .map(|socket| {
                let shared = self.shared.clone();
                tokio::spawn(serve_udp(Arc::new(Queue { socket, shared })))
            })
            .collect();
        // The summary of a flood of log lines that stopped (`log`): no next line would write it.
        let summaries = tokio::spawn(super::log::flush_every_second());
        tokio::select! {
            () = shutdown.stopped() => {}
            _ = serve_tcp(self.tcp, self.shared) => {}
        }
        for queue in queues {
            queue.abort();
        }
        summaries.abort();
    }
}

/// One socket of the UDP group, shared by the task that reads it and the upstream readers that
/// send forwarded replies back on it.
struct Queue {
    socket: UdpSocket,
    shared: Arc<Shared>,
}

async fn serve_udp(queue: Arc<Queue>) {
    let shared = &queue.shared;
    let mut buf = vec![0u8; 65_535];
    loop {
        let (n, client, interface) =
            match super::queues::recv_from_interface(&queue.socket, &mut buf).await {
                Ok(received) => received,
                Err(e) => {
                    limited!(Kind::ListenFailed, warn, error = %e, "DNS UDP receive failed");
                    continue;
                }
            };
        let raw = &mut buf[..n];
        // Local answers are a parse and an encode, forwards a send: both done here, no task per query.
        match local_reply(
            raw,
            client.ip(),
            KernelView::Unknown,
            Transport::Udp,
            shared,
        ) {
            Local::Reply(reply) => queue.send(&reply, client).await,
            Local::Forward(question, key) => {
                if let Some(reply) = shared.cached(key.as_ref(), raw) {
                    shared.metrics.query(DnsOutcome::Cached);
                    queue.send(&reply, client).await;
                    continue;
                }
                // A client past its share of forwards in flight gets SERVFAIL at once (nothing held).
                let Ok(permit) = shared.forward_slot_from(client.ip(), interface) else {
                    limited!(Kind::OverBudget, debug, %client, interface, "DNS client past its share of forwards in flight; answering SERVFAIL");
                    shared.metrics.query(DnsOutcome::Servfail);
                    if let Some(reply) = servfail_for(raw) {
                        queue.send(&reply, client).await;
                    }
                    continue;
                };
                let reply_to = ReplyTo::Pod(PodReply {
                    queue: queue.clone(),
                    client,
                    cache_key: key,
                    _permit: permit,
                });
                shared.upstream.forward(raw, question, reply_to).await;
            }
            Local::Drop => {}
        }
    }
}

impl Queue {
    async fn send(&self, reply: &[u8], client: SocketAddr) {
        if let Err(e) = self.socket.send_to(reply, client).await {
            limited!(Kind::SendFailed, debug, %client, error = %e, "DNS UDP send failed");
        }
    }

    /// Sends without waiting (an upstream reader must not wait on one client's queue); when the
    /// socket's buffer is full, a task of its own waits.
    fn send_now(self: Arc<Self>, reply: &[u8], client: SocketAddr) {
        match self.socket.try_send_to(reply, client) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let reply = reply.to_vec();
                tokio::spawn(async move { self.send(&reply, client).await });
            }
            Err(e) => {
                limited!(Kind::SendFailed, debug, %client, error = %e, "DNS UDP send failed");
            }
        }
    }
}

/// Where a pod's forwarded query is answered: the queue socket it came in on, to its address. Holds
/// the pod's place among the forwards in flight until then.
pub(crate) struct PodReply {
    queue: Arc<Queue>,
    client: SocketAddr,
    /// Set when the reply may be kept for other askers.
    cache_key: Option<CacheKey>,
    _permit: Option<Permit>,
}

impl PodReply {
    /// The upstream's reply, under the client's id.
    pub(crate) fn answered(self, reply: &[u8]) {
        let shared = &self.queue.shared;
        shared.metrics.query(DnsOutcome::Forwarded);
        // Kept before the client has it: its next ask finds it.
        if let (Some(cache), Some(key)) = (&shared.cache, self.cache_key) {
            cache.store(key, reply);
        }
        self.queue.send_now(reply, self.client);
    }

    /// SERVFAIL for `query` (under the client's id).
    pub(crate) fn failed(self, query: &[u8], error: super::UpstreamError) {
        limited!(Kind::ForwardFailed, debug, client = %self.client, %error, "DNS forward failed; answering SERVFAIL");
        self.queue.shared.metrics.query(DnsOutcome::Servfail);
        if let Some(reply) = servfail_for(query) {
            self.queue.send_now(&reply, self.client);
        }
    }
}

async fn serve_tcp(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, client)) => {
                // Past the client's share (or the node's) the connection is reset at once: the
                // client sees the refusal, no fd piles up, and other pods keep their room.
                let Ok(slot) = shared.tcp_slot(client.ip()) else {
                    limited!(Kind::OverBudget, debug, %client, "DNS TCP client over budget; resetting it");
                    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    serve_tcp_client(stream, client, shared).await;
                    drop(slot);
                });
            }
            Err(e) => {
                limited!(Kind::ListenFailed, warn, error = %e, "DNS TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Length-prefixed queries, one after another, until the client closes or idles.
async fn serve_tcp_client(mut stream: TcpStream, client: SocketAddr, shared: Arc<Shared>) {
    let kernel = shared.decide.kernel_view(client).await;
    loop {
        let read = async {
            let len = stream.read_u16().await?;
            let mut query = vec![0u8; usize::from(len)];
            stream.read_exact(&mut query).await?;
            Ok::<_, io::Error>(query)
        };
        let query = match tokio::time::timeout(TCP_IDLE, read).await {
            Ok(Ok(query)) => query,
            _ => return, // closed, broken or idle
        };
        let reply = match local_reply(&query, client.ip(), kernel, Transport::Tcp, &shared) {
            Local::Reply(reply) => Some(reply),
            Local::Forward(question, _) if is_transfer_question(&question) => {
                let qtype = question[0].query_type();
                if relay_transfer(&mut stream, &query, qtype, client, &shared).await {
                    continue;
                }
                return;
            }
            Local::Forward(..) => {
                let result = shared.upstream.forward_tcp(&query).await;
                finish_forward(&query, result, client, &shared)
            }
            Local::Drop => None,
        };
        let Some(reply) = reply else { return };
        if !send_framed(&mut stream, &reply).await {
            return;
        }
    }
}

/// Writes one length-prefixed message to a TCP client; false when it cannot be (too long, the
/// client gone, or not reading).
async fn send_framed(stream: &mut TcpStream, message: &[u8]) -> bool {
    let Ok(len) = u16::try_from(message.len()) else {
        return false;
    };
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(message);
    // A client that sends but never reads must not hold the task and its socket forever.
    matches!(
        tokio::time::timeout(TCP_IDLE, stream.write_all(&framed)).await,
        Ok(Ok(()))
    )
}

fn is_transfer_question(question: &[Query]) -> bool {
    matches!(question, [q] if transfer::is_transfer(q.query_type()))
}

/// Relays a zone transfer: every message the upstream sends for it, in order, until the one that
/// ends it. A failure before the first message is a SERVFAIL; after it the connection is closed,
/// as the upstream's own would be. True when the client may send its next query.
async fn relay_transfer(
    stream: &mut TcpStream,
    query: &[u8],
    qtype: RecordType,
    client: SocketAddr,
    shared: &Shared,
) -> bool {
    let upstream = &shared.upstream;
    let mut transfer =
        match transfer::Transfer::start(upstream.addr, upstream.timeout, query, qtype).await {
            Ok(transfer) => transfer,
            Err(e) => {
                let Some(reply) = finish_forward(query, Err(e), client, shared) else {
                    return false;
                };
                return send_framed(stream, &reply).await;
            }
        };
    let mut sent = 0usize;
    loop {
        match transfer.next().await {
            Ok(Some(message)) => {
                if sent == 0 {
                    shared.metrics.query(DnsOutcome::Forwarded);
                }
                sent += 1;
                if !send_framed(stream, &message).await {
                    return false;
                }
            }
            Ok(None) => return true,
            Err(e) if sent == 0 => {
                let Some(reply) = finish_forward(query, Err(e), client, shared) else {
                    return false;
                };
                return send_framed(stream, &reply).await;
            }
            Err(e) => {
                limited!(Kind::TransferCut, debug, %client, error = %e, messages = sent, "zone transfer cut by the upstream; closing the client's connection");
                return false;
            }
        }
    }
}

enum Local {
    Reply(Vec<u8>),
    /// To the upstream; the question as read, to match its reply with, and the query's cache key
    /// when its reply may be shared.
    Forward(Vec<Query>, Option<CacheKey>),
    Drop,
}

/// What the agent makes of one query, before any budget, cache or socket is involved.
#[derive(Debug)]
pub(crate) enum Handled {
    /// The bytes to send back, and how the query counts (answered, or SERVFAIL when the local
    /// answer could not be encoded).
    Reply(Vec<u8>, DnsOutcome),
    /// For the upstream, unchanged: the query as parsed.
    Forward(Message),
    /// Not a DNS message (`malformed`), or a response sent to the proxy: nothing goes back.
    Drop { malformed: bool },
}

/// Decides whether the agent answers `raw` itself; `over_tcp` when it came over TCP (no UDP size
/// limit on the reply). A query it does not answer goes upstream unchanged: the upstream is the
/// authority on everything the mesh does not claim. Bytes that are not a DNS message at all are
/// dropped: forwarding junk only costs sockets. Pure but for rate-limited logs (the fuzz target
/// `dns_query` drives it).
pub(crate) fn handle_query(
    raw: &[u8],
    client: IpAddr,
    kernel: KernelView,
    over_tcp: bool,
    decide: &dyn Decide,
) -> Handled {
    let Ok(query) = Message::from_vec(raw) else {
        limited!(Kind::Malformed, debug, %client, bytes = raw.len(), "not a DNS message; dropped");
        return Handled::Drop { malformed: true };
    };
    if query.metadata.message_type != MessageType::Query {
        // A response sent to us: never reflect it.
        limited!(Kind::Malformed, debug, %client, "a DNS response sent to the proxy; dropped");
        return Handled::Drop { malformed: false };
    }
    let [question] = query.queries.as_slice() else {
        return Handled::Forward(query);
    };
    if query.metadata.op_code != OpCode::Query
        || question.query_class() != DNSClass::IN
        || !answerable(question.query_type())
    {
        return Handled::Forward(query);
    }
    let decision = decide.decide(&DnsQuery {
        client,
        kernel,
        name: question.name(),
    });
    let Decision::Answer(answer) = decision else {
        return Handled::Forward(query);
    };
    let encoded = authoritative_reply(&query, &answer).and_then(|reply| match over_tcp {
        false => encode_for_udp(&reply, max_udp_reply(&query)),
        true => reply.to_vec(),
    });
    match encoded {
        Ok(bytes) => Handled::Reply(bytes, DnsOutcome::Answered),
        Err(e) => {
            limited!(Kind::EncodeFailed, warn, %client, name = %question.name(), error = %e, "encoding a local DNS answer failed");
            match servfail_reply(&query).to_vec() {
                Ok(bytes) => Handled::Reply(bytes, DnsOutcome::Servfail),
                Err(_) => Handled::Drop { malformed: false },
            }
        }
    }
}

/// [`handle_query`], counted, with the cache key of a UDP query whose reply may be shared.
fn local_reply(
    raw: &[u8],
    client: IpAddr,
    kernel: KernelView,
    transport: Transport,
    shared: &Shared,
) -> Local {
    let over_tcp = transport == Transport::Tcp;
    match handle_query(raw, client, kernel, over_tcp, &*shared.decide) {
        Handled::Reply(bytes, outcome) => {
            shared.metrics.query(outcome);
            Local::Reply(bytes)
        }
        Handled::Forward(mut query) => {
            // Only UDP replies are kept (a TCP query is most often the retry of a truncated one).
            let key = shared
                .cache
                .as_ref()
                .filter(|_| !over_tcp)
                .and_then(|_| CacheKey::of(&query));
            Local::Forward(std::mem::take(&mut query.queries), key)
        }
        Handled::Drop { malformed } => {
            if malformed {
                shared.metrics.query(DnsOutcome::Malformed);
            }
            Local::Drop
        }
    }
}

/// Whether a question of type `qtype` about a name a visible service owns is the agent's to answer
/// (`docs/dns.md#other-types`): every data type and ANY, since the name exists for that client. Not
/// the types that ask nothing of a name's records: 0, OPT (41) and the meta and question types of
/// RFC 6895 but ANY (128 to 254: TKEY, TSIG, IXFR, AXFR, MAILB, MAILA); zone transfers among them
/// are relayed, as the agent holds no zone.
fn answerable(qtype: RecordType) -> bool {
    qtype == RecordType::ANY || !matches!(u16::from(qtype), 0 | 41 | 128..=254)
}

/// SERVFAIL for a query that parsed (only those are forwarded).
fn servfail_for(query: &[u8]) -> Option<Vec<u8>> {
    match Message::from_vec(query) {
        Ok(parsed) => servfail_reply(&parsed).to_vec().ok(),
        Err(_) => servfail_for_raw(query),
    }
}

/// The upstream's reply unchanged, or SERVFAIL when it could not be had in time.
fn finish_forward(
    query: &[u8],
    result: Result<Vec<u8>, super::UpstreamError>,
    client: SocketAddr,
    shared: &Shared,
) -> Option<Vec<u8>> {
    match result {
        Ok(reply) => {
            shared.metrics.query(DnsOutcome::Forwarded);
            Some(reply)
        }
        Err(e) => {
            limited!(Kind::ForwardFailed, debug, %client, error = %e, "DNS forward failed; answering SERVFAIL");
            shared.metrics.query(DnsOutcome::Servfail);
            servfail_for(query)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BudgetMetrics;

    /// The DNS proxy's families and its budgets', as a test reads them.
    #[derive(Default)]
    struct Counted {
        dns: Arc<DnsMetrics>,
        budgets: Arc<BudgetMetrics>,
    }

    impl Counted {
        fn text(&self) -> String {
            let registry = crate::metrics::registry_of(|r| {
                self.dns.register(r);
                self.budgets.register(r);
            });
            crate::metrics::encode(&registry).unwrap()
        }
    }
    use hickory_proto::{
        op::{Query, ResponseCode},
        rr::{RData, rdata},
    };

    /// Answers `api.example.com.` with one address, forwards everything else.
    struct OneName;

    impl Decide for OneName {
        fn decide(&self, query: &DnsQuery<'_>) -> Decision {
            if query
                .name
                .to_ascii()
                .eq_ignore_ascii_case("api.example.com.")
            {
                Decision::Answer(LocalAnswer {
                    cname_target: None,
                    v4: vec!["240.240.0.7".parse().unwrap()],
                    v6: vec![],
                })
            } else {
                Decision::Forward
            }
        }
    }

    fn query(name: &str, qtype: RecordType) -> Vec<u8> {
        let mut q = Message::query();
        q.metadata.id = 77;
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        q.to_vec().unwrap()
    }

    async fn proxy(upstream: SocketAddr) -> (SocketAddr, Arc<Counted>, crate::drain::Lifecycle) {
        proxy_with(upstream, None).await
    }

    /// With `caps` = (forwards per client, TCP clients per client), the node allowing 100 of each.
    async fn proxy_with(
        upstream: SocketAddr,
        caps: Option<(usize, usize)>,
    ) -> (SocketAddr, Arc<Counted>, crate::drain::Lifecycle) {
        proxy_deciding(upstream, caps, Arc::new(OneName)).await
    }

    async fn proxy_deciding(
        upstream: SocketAddr,
        caps: Option<(usize, usize)>,
        decide: Arc<dyn Decide>,
    ) -> (SocketAddr, Arc<Counted>, crate::drain::Lifecycle) {
        let metrics = Arc::new(Counted::default());
        let mut up = Upstream::new(upstream);
        up.timeout = Duration::from_millis(300);
        let proxy = DnsProxy::bind(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(up),
            decide,
            metrics.dns.clone(),
        )
        .await
        .unwrap();
        let proxy = match caps {
            Some((forwards, tcp)) => {
                let args = crate::budget::BudgetArgs {
                    max_dns_forwards: Some(100),
                    max_dns_forwards_per_client: Some(forwards),
                    max_dns_tcp_clients: Some(100),
                    max_dns_tcp_clients_per_client: Some(tcp),
                    ..Default::default()
                };
                let limits = crate::budget::Limits::size(
                    1 << 16,
                    crate::budget::ports::DEFAULT_EPHEMERAL_PORTS,
                    &args,
                );
                proxy.with_budgets(Arc::new(Budgets::new(limits, &metrics.budgets)))
            }
            None => proxy,
        };
        let addr = proxy.local_addr().unwrap();
        let stop = crate::drain::Lifecycle::default();
        tokio::spawn(proxy.serve(stop.serving()));
        (addr, metrics, stop)
    }

    async fn ask_udp(proxy: SocketAddr, raw: &[u8]) -> Message {
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.send_to(raw, proxy).await.unwrap();
        let mut buf = [0u8; 1500];
        let n = tokio::time::timeout(Duration::from_secs(2), client.recv(&mut buf))
            .await
            .expect("reply in time")
            .unwrap();
        Message::from_vec(&buf[..n]).unwrap()
    }

    /// Sends one query over TCP, length-prefixed as DNS frames it.
    async fn send_tcp(tcp: &mut TcpStream, raw: &[u8]) {
        tcp.write_all(&(raw.len() as u16).to_be_bytes())
            .await
            .unwrap();
        tcp.write_all(raw).await.unwrap();
    }

    /// Reads one length-prefixed reply over TCP.
    async fn read_tcp(tcp: &mut TcpStream) -> Message {
        let len = tcp.read_u16().await.unwrap();
        let mut buf = vec![0u8; usize::from(len)];
        tcp.read_exact(&mut buf).await.unwrap();
        Message::from_vec(&buf).unwrap()
    }

    #[tokio::test]
    async fn owned_name_is_answered_locally_over_udp_and_tcp() {
        // Nothing listens upstream: a local answer must not need it.
        let (addr, metrics, _stop) = proxy("127.0.0.1:9".parse().unwrap()).await;
        let reply = ask_udp(addr, &query("API.example.com.", RecordType::A)).await;
        assert_eq!(reply.metadata.id, 77);
        assert_eq!(
            reply.answers[0].data,
            RData::A(rdata::A("240.240.0.7".parse().unwrap()))
        );

        let mut tcp = TcpStream::connect(addr).await.unwrap();
        send_tcp(&mut tcp, &query("api.example.com.", RecordType::A)).await;
        let reply = read_tcp(&mut tcp).await;
        assert!(reply.metadata.authoritative);
        assert_eq!(reply.answers.len(), 1);
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="answered"} 2"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn other_names_and_types_go_upstream_and_come_back_unchanged() {
        let upstream = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy(upstream.local_addr().unwrap()).await;
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut buf = [0u8; 512];
                let (n, from) = upstream.recv_from(&mut buf).await.unwrap();
                let mut reply = Message::from_vec(&buf[..n]).unwrap();
                seen.push(reply.queries[0].clone());
                reply.metadata.message_type = MessageType::Response;
                reply.metadata.response_code = ResponseCode::NXDomain;
                upstream
                    .send_to(&reply.to_vec().unwrap(), from)
                    .await
                    .unwrap();
            }
            seen
        });
        let other = ask_udp(addr, &query("other.example.com.", RecordType::A)).await;
        assert_eq!(other.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(other.metadata.id, 77, "the client's own id comes back");
        // Another type of a name no visible service owns is the upstream's business too.
        let mx = ask_udp(addr, &query("other.example.com.", RecordType::MX)).await;
        assert_eq!(mx.metadata.response_code, ResponseCode::NXDomain);
        let seen = server.await.unwrap();
        assert_eq!(seen[1].query_type(), RecordType::MX);
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="forwarded"} 2"#),
            "{text}"
        );
    }

    #[test]
    fn every_data_type_and_any_is_answerable_transfers_and_meta_types_are_not() {
        for qtype in [
            RecordType::A,
            RecordType::AAAA,
            RecordType::ANY,
            RecordType::TXT,
            RecordType::HINFO,
            RecordType::CNAME,
            RecordType::HTTPS,
            RecordType::Unknown(65_280),
        ] {
            assert!(answerable(qtype), "{qtype}");
        }
        for qtype in [
            RecordType::AXFR,
            RecordType::IXFR,
            RecordType::OPT,
            RecordType::TSIG,
            RecordType::ZERO,
            RecordType::Unknown(249),
        ] {
            assert!(!answerable(qtype), "{qtype}");
        }
    }

    /// A name a visible service owns exists for the client whatever the type asked: the agent
    /// answers every type itself (NODATA for those it holds no record of, its addresses for ANY),
    /// over UDP and TCP, and none reaches the upstream. A zone transfer still goes upstream.
    #[tokio::test]
    async fn every_type_of_an_owned_name_is_answered_by_the_agent_nodata_or_addresses() {
        // It listens but never answers: a forwarded question would come back as SERVFAIL.
        let upstream = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy(upstream.local_addr().unwrap()).await;
        let nodata = [
            RecordType::TXT,
            RecordType::HINFO,
            RecordType::MX,
            RecordType::SRV,
            RecordType::CAA,
            RecordType::AAAA,
        ];
        for qtype in nodata {
            let reply = ask_udp(addr, &query("api.example.com.", qtype)).await;
            assert_eq!(reply.metadata.id, 77);
            assert_eq!(
                reply.metadata.response_code,
                ResponseCode::NoError,
                "{qtype}"
            );
            assert!(reply.metadata.authoritative, "{qtype}: from the agent");
            assert!(reply.answers.is_empty(), "{qtype}: NODATA");
            assert_eq!(reply.queries[0].query_type(), qtype);
        }
        let any = ask_udp(addr, &query("API.example.com.", RecordType::ANY)).await;
        assert!(any.metadata.authoritative);
        let data: Vec<_> = any.answers.iter().map(|r| r.data.clone()).collect();
        assert_eq!(data, [RData::A(rdata::A("240.240.0.7".parse().unwrap()))]);
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        send_tcp(&mut tcp, &query("api.example.com.", RecordType::TXT)).await;
        let reply = read_tcp(&mut tcp).await;
        assert!(reply.metadata.authoritative && reply.answers.is_empty());
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        let mut buf = [0u8; 512];
        assert!(
            upstream.try_recv_from(&mut buf).is_err(),
            "no question of an owned name went upstream"
        );
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="answered"} 8"#),
            "{text}"
        );
        // A transfer is about a zone, which the agent does not hold: the upstream's.
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client
            .send_to(&query("api.example.com.", RecordType::AXFR), addr)
            .await
            .unwrap();
        let (n, _) = tokio::time::timeout(Duration::from_secs(2), upstream.recv_from(&mut buf))
            .await
            .expect("the transfer goes upstream")
            .unwrap();
        let forwarded = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!(forwarded.queries[0].query_type(), RecordType::AXFR);
    }

    #[tokio::test]
    async fn a_repeated_question_is_answered_from_the_cache_until_its_ttl_runs_out() {
        let upstream = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let metrics = Arc::new(Counted::default());
        let proxy = DnsProxy::bind(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(Upstream::new(upstream.local_addr().unwrap())),
            Arc::new(OneName),
            metrics.dns.clone(),
        )
        .await
        .unwrap()
        .with_cache(Arc::new(AnswerCache::new(
            std::num::NonZeroUsize::new(8).unwrap(),
            metrics.dns.cache_entries(),
        )));
        let addr = proxy.local_addr().unwrap();
        let _stop = crate::drain::Lifecycle::default();
        tokio::spawn(proxy.serve(_stop.serving()));
        // The upstream answers with a 1 s TTL and counts what reaches it.
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let (n, from) = upstream.recv_from(&mut buf).await.unwrap();
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut reply = Message::from_vec(&buf[..n]).unwrap();
                reply.metadata.message_type = MessageType::Response;
                let owner = reply.queries[0].name().clone();
                reply.add_answer(hickory_proto::rr::Record::from_rdata(
                    owner,
                    1,
                    RData::A(rdata::A("203.0.113.9".parse().unwrap())),
                ));
                upstream
                    .send_to(&reply.to_vec().unwrap(), from)
                    .await
                    .unwrap();
            }
        });
        let count = || asked.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..3 {
            let reply = ask_udp(addr, &query("other.example.com.", RecordType::A)).await;
            assert_eq!(reply.answers.len(), 1);
            assert_eq!(reply.metadata.id, 77);
        }
        assert_eq!(count(), 1, "asked once, answered thrice");
        // An owned name never comes from the cache: the agent answers it.
        let owned = ask_udp(addr, &query("api.example.com.", RecordType::A)).await;
        assert!(owned.metadata.authoritative);
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        ask_udp(addr, &query("other.example.com.", RecordType::A)).await;
        assert_eq!(count(), 2, "past its TTL the question goes upstream again");
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="cached"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="forwarded"} 2"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn dead_upstream_gives_servfail_in_time() {
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy(silent.local_addr().unwrap()).await;
        let started = std::time::Instant::now();
        let reply = ask_udp(addr, &query("other.example.com.", RecordType::A)).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(reply.metadata.id, 77);
        assert!(started.elapsed() < Duration::from_secs(1));
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="servfail"} 1"#),
            "{text}"
        );
    }

    /// Bytes that are not DNS never reach the upstream: dropped, counted, no reply.
    #[tokio::test]
    async fn junk_is_dropped_and_counted_never_forwarded() {
        let upstream = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy(upstream.local_addr().unwrap()).await;
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        for junk in [&b"\x01"[..], b"not a dns message at all", &[0xff; 40]] {
            client.send_to(junk, addr).await.unwrap();
        }
        // A real query after the junk is still forwarded: the proxy kept serving.
        client
            .send_to(&query("other.example.com.", RecordType::A), addr)
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let (n, _) = tokio::time::timeout(Duration::from_secs(2), upstream.recv_from(&mut buf))
            .await
            .expect("the valid query reaches the upstream")
            .unwrap();
        let forwarded = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!(forwarded.queries[0].name().to_ascii(), "other.example.com.");
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="malformed"} 3"#),
            "{text}"
        );
        assert!(
            upstream.try_recv_from(&mut buf).is_err(),
            "only the one valid query went upstream"
        );
    }

    /// A client with its share of forwards in flight gets SERVFAIL at once; another client's
    /// queries still go upstream.
    #[tokio::test]
    async fn a_client_past_its_forward_share_gets_servfail_others_are_forwarded() {
        // The upstream holds every query unanswered: forwards stay in flight.
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy_with(silent.local_addr().unwrap(), Some((2, 2))).await;
        let greedy = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        for _ in 0..2 {
            greedy
                .send_to(&query("other.example.com.", RecordType::A), addr)
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The third (from the same address) is over the share: answered at once.
        let started = std::time::Instant::now();
        let reply = ask_udp(addr, &query("third.example.com.", RecordType::A)).await;
        // `ask_udp` binds a fresh socket on 127.0.0.1: the same client address.
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(started.elapsed() < Duration::from_millis(250));
        let text = metrics.text();
        assert!(
            text.contains(
                r#"redirect_budget_refusals_total{budget="dns_forwards",reason="client_share"} 1"#
            ),
            "{text}"
        );
        // Another client (another address) still has its share.
        let other = UdpSocket::bind("127.0.0.2:0").await.unwrap();
        other
            .send_to(&query("fourth.example.com.", RecordType::A), addr)
            .await
            .unwrap();
        let mut seen = 0;
        let mut buf = [0u8; 512];
        while let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(300), silent.recv_from(&mut buf)).await
        {
            seen += 1;
        }
        // 2 from the greedy client, 1 from the other (each possibly retransmitted once).
        assert!((3..=6).contains(&seen), "{seen} datagrams upstream");
    }

    /// No workload holds any address: every client is a stranger.
    struct Strangers;

    impl Decide for Strangers {
        fn decide(&self, _: &DnsQuery<'_>) -> Decision {
            Decision::Forward
        }
        fn known(&self, _: IpAddr) -> bool {
            false
        }
    }

    /// UDP source addresses cost nothing to forge: addresses no workload holds that arrive on one
    /// interface share one share of the forwards in flight, rather than each taking a fresh one.
    #[tokio::test]
    async fn addresses_no_workload_holds_share_one_share_per_interface() {
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy_deciding(
            silent.local_addr().unwrap(),
            Some((2, 2)),
            Arc::new(Strangers),
        )
        .await;
        let mut forged = Vec::new();
        for last in 2..=5u8 {
            let socket = UdpSocket::bind((std::net::Ipv4Addr::new(127, 0, 0, last), 0))
                .await
                .unwrap();
            socket
                .send_to(&query("other.example.com.", RecordType::A), addr)
                .await
                .unwrap();
            forged.push(socket);
        }
        // Two go upstream (and wait for the 300 ms deadline); the other two are past the
        // interface's share: SERVFAIL at once.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut servfails = 0;
        let mut buf = [0u8; 512];
        for socket in &forged {
            if let Ok(n) = socket.try_recv(&mut buf) {
                let reply = Message::from_vec(&buf[..n]).unwrap();
                assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
                servfails += 1;
            }
        }
        assert_eq!(
            servfails, 2,
            "four strangers on one interface: one share of two"
        );
        let text = metrics.text();
        assert!(
            text.contains(
                r#"redirect_budget_refusals_total{budget="dns_forwards",reason="client_share"} 2"#
            ),
            "{text}"
        );
    }

    /// A zone transfer over TCP is a stream of messages: each reaches the client, in order, and
    /// the connection then takes the client's next query.
    #[tokio::test]
    async fn every_message_of_a_zone_transfer_reaches_the_client() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics, _stop) = proxy(upstream.local_addr().unwrap()).await;
        tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await.unwrap();
            let len = conn.read_u16().await.unwrap();
            let mut q = vec![0u8; usize::from(len)];
            conn.read_exact(&mut q).await.unwrap();
            let id = u16::from_be_bytes([q[0], q[1]]);
            for message in transfer::tests::axfr_stream(id) {
                conn.write_all(&(message.len() as u16).to_be_bytes())
                    .await
                    .unwrap();
                conn.write_all(&message).await.unwrap();
            }
            // As a real server does: the connection stays open for more.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        send_tcp(&mut tcp, &query("zone.example.", RecordType::AXFR)).await;
        let mut answers = 0;
        for _ in 0..3 {
            let len = tokio::time::timeout(Duration::from_secs(2), tcp.read_u16())
                .await
                .expect("every message of the transfer, in time")
                .unwrap();
            let mut buf = vec![0u8; usize::from(len)];
            tcp.read_exact(&mut buf).await.unwrap();
            let message = Message::from_vec(&buf).unwrap();
            assert_eq!(message.metadata.id, 77, "under the client's id");
            answers += message.answers.len();
        }
        assert_eq!(answers, 7, "every record of the zone");
        // The same connection answers the next query.
        send_tcp(&mut tcp, &query("api.example.com.", RecordType::A)).await;
        assert_eq!(read_tcp(&mut tcp).await.answers.len(), 1);
        let text = metrics.text();
        assert!(
            text.contains(r#"redirect_dns_queries_total{outcome="forwarded"} 1"#),
            "{text}"
        );
    }

    /// A client at its share of TCP connections is reset at once; another client is served.
    #[tokio::test]
    async fn a_client_past_its_tcp_share_is_reset_others_are_answered() {
        let (addr, _metrics, _stop) =
            proxy_with("127.0.0.1:9".parse().unwrap(), Some((2, 2))).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut refused = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(1), refused.read(&mut byte))
            .await
            .expect("refused at once");
        assert_eq!(
            read.unwrap_err().kind(),
            io::ErrorKind::ConnectionReset,
            "a refusal is a reset"
        );
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut other = socket.connect(addr).await.unwrap();
        send_tcp(&mut other, &query("api.example.com.", RecordType::A)).await;
        assert_eq!(read_tcp(&mut other).await.answers.len(), 1);
    }
}
