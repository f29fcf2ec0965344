//! The queries one upstream socket has in flight, each under an id of its own.
//!
//! Many pods' queries share one connected socket, so their ids could collide and a client's id is
//! whatever its resolver chose (dnsperf counts from 0). Each query therefore goes upstream under a
//! fresh random id, unpredictable to anyone who did not see it leave (an off-path spoofer has to guess
//! it, as well as the socket's port). A reply is taken only when its id is in flight *and* its
//! question is the one asked; it then gets the client's own id back. Nothing else is trusted.
use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Header, MessageType, Query, ResponseCode},
    serialize::binary::{BinDecodable, BinDecoder},
};
use rand::{Rng, RngExt};

/// A lost UDP datagram is sent again once after this long.
pub(super) const RETRANSMIT_AFTER: Duration = Duration::from_millis(500);

/// Which ids a socket has in flight: the table owns each query until it is answered or given up.
#[derive(Debug)]
pub(super) struct Pending<W> {
    by_id: HashMap<u16, Outstanding<W>>,
    /// When each query is sent again, and when it is given up, oldest first: every query waits the
    /// same time, so insertion order is deadline order in each. Entries of answered queries stay
    /// until they reach the front (`seq` tells them apart from a reused id).
    resend_at: VecDeque<Due>,
    give_up_at: VecDeque<Due>,
    /// Buffers of answered queries, kept for the next ones: no allocation per query once warm.
    spare: Vec<Vec<u8>>,
    next_seq: u64,
    /// Queries in flight at most: a small share of the 65,536 ids, so a free random id is found at
    /// once and stays hard to guess.
    limit: usize,
    /// The whole time a query may take (retransmit included).
    timeout: Duration,
}

#[derive(Debug)]
struct Outstanding<W> {
    seq: u64,
    client_id: u16,
    question: Vec<Query>,
    /// The query as it went upstream (under the new id): sent again as it was.
    datagram: Vec<u8>,
    waiter: W,
}

#[derive(Debug, Clone, Copy)]
struct Due {
    at: Instant,
    id: u16,
    seq: u64,
}

/// The table is at its limit: the query is handed back, not sent.
#[derive(Debug)]
pub(super) struct Full<W>(pub W);

/// What became of a datagram that came from the upstream.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Reply<W> {
    /// The answer to a query in flight: its waiter, the client's id (already written into the reply).
    Matched { waiter: W, client_id: u16 },
    /// No query in flight has this id (late after a give-up, or forged): dropped.
    UnknownId,
    /// The id is in flight but the question is not the one asked: dropped, the query still waits.
    WrongQuestion,
    /// Not a DNS response at all: dropped.
    Malformed,
}

/// A query whose time came.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Expired<W> {
    /// No answer yet: send these bytes again, once.
    Resend(Vec<u8>),
    /// No answer in time: the waiter gets the query back, under the client's id (for a SERVFAIL).
    GaveUp { waiter: W, query: Vec<u8> },
}

impl<W> Pending<W> {
    pub(super) fn new(limit: usize, timeout: Duration) -> Self {
        Self {
            by_id: HashMap::new(),
            resend_at: VecDeque::new(),
            give_up_at: VecDeque::new(),
            spare: Vec::new(),
            next_seq: 0,
            limit: limit.min(1 << 14),
            timeout,
        }
    }

    /// The whole time a query may take.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Files `query` (a client's datagram, whose `question` was read from it) under a fresh random
    /// id, and rewrites the id in `query` to that one, ready to send.
    pub(super) fn insert(
        &mut self,
        query: &mut [u8],
        question: Vec<Query>,
        waiter: W,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<u16, Full<W>> {
        if self.by_id.len() >= self.limit {
            return Err(Full(waiter));
        }
        let Some(client_id) = id_of(query) else {
            return Err(Full(waiter));
        };
        let id = loop {
            let id: u16 = rng.random();
            if !self.by_id.contains_key(&id) {
                break id;
            }
        };
        set_id(query, id);
        let mut datagram = self.spare.pop().unwrap_or_default();
        datagram.clear();
        datagram.extend_from_slice(query);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_id.insert(
            id,
            Outstanding {
                seq,
                client_id,
                question,
                datagram,
                waiter,
            },
        );
        if RETRANSMIT_AFTER < self.timeout {
            let at = now + RETRANSMIT_AFTER;
            self.resend_at.push_back(Due { at, id, seq });
        }
        let at = now + self.timeout;
        self.give_up_at.push_back(Due { at, id, seq });
        Ok(id)
    }

    /// Takes the query `reply` answers, if any, and gives the reply the client's id.
    pub(super) fn answer(&mut self, reply: &mut [u8]) -> Reply<W> {
        let Some(response) = read_response(reply) else {
            return Reply::Malformed;
        };
        let id = response.id;
        let Some(outstanding) = self.by_id.get(&id) else {
            return Reply::UnknownId;
        };
        // An error reply may leave the question out (QDCOUNT 0: RFC 1035 does not require it, and
        // servers refusing or failing a query often do). Under the id in flight it is that query's
        // answer: the client gets the error at once rather than a SERVFAIL after the deadline.
        let bare_error = response.question.is_empty() && response.error;
        if outstanding.question != response.question && !bare_error {
            return Reply::WrongQuestion;
        }
        let Some(outstanding) = self.by_id.remove(&id) else {
            return Reply::UnknownId;
        };
        set_id(reply, outstanding.client_id);
        self.recycle(outstanding.datagram);
        self.drop_answered_front();
        Reply::Matched {
            waiter: outstanding.waiter,
            client_id: outstanding.client_id,
        }
    }

    /// When the next query in flight needs attention, if any is in flight.
    pub(super) fn next_due(&mut self) -> Option<Instant> {
        self.drop_answered_front();
        let resend = self.resend_at.front().map(|due| due.at);
        let give_up = self.give_up_at.front().map(|due| due.at);
        resend.into_iter().chain(give_up).min()
    }

    /// Everything due by `now`: queries to send again and queries given up (taken out).
    pub(super) fn expire(&mut self, now: Instant) -> Vec<Expired<W>> {
        let mut expired = Vec::new();
        // Give-ups first: a query whose time is up is not sent again in the same breath.
        while let Some(due) = pop_due(&mut self.give_up_at, now) {
            if self.by_id.get(&due.id).is_some_and(|o| o.seq == due.seq)
                && let Some(outstanding) = self.by_id.remove(&due.id)
            {
                let mut query = outstanding.datagram;
                set_id(&mut query, outstanding.client_id);
                expired.push(Expired::GaveUp {
                    waiter: outstanding.waiter,
                    query,
                });
            }
        }
        while let Some(due) = pop_due(&mut self.resend_at, now) {
            if let Some(outstanding) = self.by_id.get(&due.id)
                && outstanding.seq == due.seq
            {
                expired.push(Expired::Resend(outstanding.datagram.clone()));
            }
        }
        self.drop_answered_front();
        expired
    }

    /// Forgets the deadlines of answered queries at the front of each queue.
    fn drop_answered_front(&mut self) {
        for queue in [&mut self.resend_at, &mut self.give_up_at] {
            while let Some(front) = queue.front() {
                match self.by_id.get(&front.id) {
                    Some(outstanding) if outstanding.seq == front.seq => break,
                    _ => {
                        queue.pop_front();
                    }
                }
            }
        }
    }

    fn recycle(&mut self, buffer: Vec<u8>) {
        // Small buffers only, and as many as are usually in flight: a burst of large queries does
        // not stay in memory.
        if buffer.capacity() <= 4096 && self.spare.len() < 1024 {
            self.spare.push(buffer);
        }
    }
}

fn pop_due(queue: &mut VecDeque<Due>, now: Instant) -> Option<Due> {
    queue
        .front()
        .is_some_and(|due| due.at <= now)
        .then(|| queue.pop_front())
        .flatten()
}

/// The id of a DNS message (its first two octets, RFC 1035 4.1.1).
fn id_of(message: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*message.first()?, *message.get(1)?]))
}

fn set_id(message: &mut [u8], id: u16) {
    if let Some(head) = message.get_mut(..2) {
        head.copy_from_slice(&id.to_be_bytes());
    }
}

/// What [`Pending::answer`] reads of a response.
struct Response {
    id: u16,
    question: Vec<Query>,
    /// The response code is not NOERROR.
    error: bool,
}

/// The id, question section and whether it is an error, read with hickory (the records are not
/// read: they go back to the client as they came).
fn read_response(reply: &[u8]) -> Option<Response> {
    let mut decoder = BinDecoder::new(reply);
    let header = Header::read(&mut decoder).ok()?;
    if header.metadata.message_type != MessageType::Response {
        return None;
    }
    let question = (0..header.counts.queries)
        .map(|_| Query::read(&mut decoder))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    Some(Response {
        id: header.metadata.id,
        question,
        error: header.metadata.response_code != ResponseCode::NoError,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::{
        op::{Message, ResponseCode},
        rr::{Name, RecordType},
    };
    use rand::SeedableRng;

    fn query(id: u16, name: &str) -> (Vec<u8>, Vec<Query>) {
        let mut message = Message::query();
        message.metadata.id = id;
        message.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        (message.to_vec().unwrap(), message.queries)
    }

    /// The upstream's answer to `sent` (as it went out: under the remapped id).
    fn answer_to(sent: &[u8]) -> Vec<u8> {
        let mut reply = Message::from_vec(sent).unwrap();
        reply.metadata.message_type = MessageType::Response;
        reply.metadata.response_code = ResponseCode::NXDomain;
        reply.to_vec().unwrap()
    }

    fn table() -> Pending<&'static str> {
        Pending::new(1024, Duration::from_millis(1500))
    }

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(7)
    }

    #[test]
    fn a_reply_goes_to_its_query_with_the_clients_id() {
        let mut pending = table();
        let mut rng = rng();
        let now = Instant::now();
        let (mut a, qa) = query(7, "a.example.");
        let (mut b, qb) = query(7, "b.example.");
        let id_a = pending.insert(&mut a, qa, "pod a", now, &mut rng).unwrap();
        let id_b = pending.insert(&mut b, qb, "pod b", now, &mut rng).unwrap();
        assert_ne!(id_a, id_b, "two clients' id 7 go up under different ids");
        assert_eq!(id_of(&a), Some(id_a), "the query was rewritten to go up");
        // Answers come back out of order.
        let mut reply_b = answer_to(&b);
        assert_eq!(
            pending.answer(&mut reply_b),
            Reply::Matched {
                waiter: "pod b",
                client_id: 7
            }
        );
        assert_eq!(id_of(&reply_b), Some(7), "the client gets its own id back");
        let reply = Message::from_vec(&reply_b).unwrap();
        assert_eq!(reply.queries[0].name().to_ascii(), "b.example.");
        let mut reply_a = answer_to(&a);
        assert!(matches!(
            pending.answer(&mut reply_a),
            Reply::Matched {
                waiter: "pod a",
                ..
            }
        ));
        assert!(pending.is_empty());
        assert_eq!(pending.next_due(), None);
    }

    #[test]
    fn ids_are_random_not_a_sequence() {
        let mut pending = Pending::new(1024, Duration::from_secs(1));
        let mut rng = rand::rng();
        let now = Instant::now();
        let ids: Vec<u16> = (0..64)
            .map(|_| {
                let (mut q, question) = query(1, "x.example.");
                pending.insert(&mut q, question, (), now, &mut rng).unwrap()
            })
            .collect();
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), 64, "ids in flight are unique");
        let steps = ids
            .windows(2)
            .filter(|w| w[1] == w[0].wrapping_add(1))
            .count();
        assert!(steps < 4, "ids follow each other: {ids:?}");
        let high = ids.iter().filter(|id| **id >= 0x8000).count();
        assert!((12..=52).contains(&high), "ids not spread: {ids:?}");
    }

    #[test]
    fn a_reply_that_does_not_match_is_dropped_and_the_query_keeps_waiting() {
        struct Case {
            name: &'static str,
            reply: fn(sent: &[u8]) -> Vec<u8>,
            expect: Reply<&'static str>,
        }
        let cases = [
            Case {
                name: "unknown id",
                reply: |sent| {
                    let mut reply = answer_to(sent);
                    let id = id_of(&reply).unwrap().wrapping_add(1);
                    set_id(&mut reply, id);
                    reply
                },
                expect: Reply::UnknownId,
            },
            Case {
                name: "right id, another name",
                reply: |sent| {
                    let mut reply = Message::from_vec(&answer_to(sent)).unwrap();
                    reply.queries[0].set_name(Name::from_ascii("evil.example.").unwrap());
                    reply.to_vec().unwrap()
                },
                expect: Reply::WrongQuestion,
            },
            Case {
                name: "right id, another type",
                reply: |sent| {
                    let mut reply = Message::from_vec(&answer_to(sent)).unwrap();
                    reply.queries[0].set_query_type(RecordType::AAAA);
                    reply.to_vec().unwrap()
                },
                expect: Reply::WrongQuestion,
            },
            Case {
                name: "right id, no question, NOERROR",
                reply: |sent| {
                    let mut reply = Message::from_vec(&answer_to(sent)).unwrap();
                    reply.metadata.response_code = ResponseCode::NoError;
                    reply.queries.clear();
                    reply.to_vec().unwrap()
                },
                expect: Reply::WrongQuestion,
            },
            Case {
                name: "the query itself reflected (not a response)",
                reply: |sent| sent.to_vec(),
                expect: Reply::Malformed,
            },
            Case {
                name: "truncated header",
                reply: |sent| sent[..5].to_vec(),
                expect: Reply::Malformed,
            },
        ];
        for case in cases {
            let mut pending = table();
            let (mut q, question) = query(9, "a.example.");
            pending
                .insert(&mut q, question, "pod", Instant::now(), &mut rng())
                .unwrap();
            let mut bad = (case.reply)(&q);
            assert_eq!(pending.answer(&mut bad), case.expect, "{}", case.name);
            assert_eq!(pending.len(), 1, "{}: the query still waits", case.name);
            let mut good = answer_to(&q);
            assert!(
                matches!(pending.answer(&mut good), Reply::Matched { .. }),
                "{}: the real answer still gets through",
                case.name
            );
        }
    }

    /// An upstream refusing (or failing) a query may send the error without its question: under
    /// the id in flight it is that query's answer, passed on at once with the client's id.
    #[test]
    fn an_error_reply_without_a_question_answers_its_query() {
        for code in [
            ResponseCode::Refused,
            ResponseCode::FormErr,
            ResponseCode::ServFail,
            ResponseCode::NotImp,
        ] {
            let mut pending = table();
            let (mut q, question) = query(0x4242, "a.example.");
            pending
                .insert(&mut q, question, "pod", Instant::now(), &mut rng())
                .unwrap();
            let mut reply = Message::from_vec(&answer_to(&q)).unwrap();
            reply.metadata.response_code = code;
            reply.queries.clear();
            let mut reply = reply.to_vec().unwrap();
            assert_eq!(
                pending.answer(&mut reply),
                Reply::Matched {
                    waiter: "pod",
                    client_id: 0x4242
                },
                "{code:?}"
            );
            assert_eq!(id_of(&reply), Some(0x4242), "{code:?}: the client's id");
            assert!(pending.is_empty());
        }
    }

    #[test]
    fn a_reply_after_the_give_up_is_not_taken() {
        let mut pending = table();
        let start = Instant::now();
        let (mut q, question) = query(3, "a.example.");
        pending
            .insert(&mut q, question, "pod", start, &mut rng())
            .unwrap();
        assert_eq!(pending.expire(start + Duration::from_secs(2)).len(), 1);
        assert_eq!(pending.answer(&mut answer_to(&q)), Reply::UnknownId);
    }

    #[test]
    fn an_unanswered_query_is_sent_again_once_then_given_up() {
        let mut pending = table();
        let start = Instant::now();
        let (mut q, question) = query(0x1234, "a.example.");
        pending
            .insert(&mut q, question, "pod", start, &mut rng())
            .unwrap();
        assert_eq!(pending.next_due(), Some(start + RETRANSMIT_AFTER));
        assert!(
            pending
                .expire(start + Duration::from_millis(499))
                .is_empty()
        );
        assert_eq!(
            pending.expire(start + RETRANSMIT_AFTER),
            vec![Expired::Resend(q.clone())],
            "sent again as it went the first time"
        );
        assert_eq!(
            pending.next_due(),
            Some(start + Duration::from_millis(1500))
        );
        assert!(
            pending
                .expire(start + Duration::from_millis(1499))
                .is_empty()
        );
        let expired = pending.expire(start + Duration::from_millis(1500));
        let [Expired::GaveUp { waiter, query }] = expired.as_slice() else {
            panic!("{expired:?}");
        };
        assert_eq!(*waiter, "pod");
        assert_eq!(
            id_of(query),
            Some(0x1234),
            "given back under the client's id"
        );
        assert!(pending.is_empty());
        assert_eq!(pending.next_due(), None);
    }

    /// A query's give-up time falls among later queries' resend times: each comes when due.
    #[test]
    fn deadlines_come_in_order_across_retransmits() {
        let mut pending = Pending::new(1024, Duration::from_millis(700));
        let mut rng = rng();
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        for (name, sent) in [("first.", 0), ("second.", 300)] {
            let (mut q, question) = query(1, name);
            pending
                .insert(&mut q, question, name, at(sent), &mut rng)
                .unwrap();
        }
        assert!(matches!(pending.expire(at(500))[..], [Expired::Resend(_)]));
        // first: gives up at 700; second: resends at 800.
        assert_eq!(pending.next_due(), Some(at(700)));
        assert!(matches!(
            pending.expire(at(700))[..],
            [Expired::GaveUp {
                waiter: "first.",
                ..
            }]
        ));
        assert!(matches!(pending.expire(at(800))[..], [Expired::Resend(_)]));
        assert!(matches!(
            pending.expire(at(1000))[..],
            [Expired::GaveUp {
                waiter: "second.",
                ..
            }]
        ));
    }

    #[test]
    fn answered_queries_leave_the_deadline_queue() {
        let mut pending = table();
        let mut rng = rng();
        let now = Instant::now();
        for _ in 0..1000 {
            let (mut q, question) = query(1, "a.example.");
            pending
                .insert(&mut q, question, "pod", now, &mut rng)
                .unwrap();
            assert!(matches!(
                pending.answer(&mut answer_to(&q)),
                Reply::Matched { .. }
            ));
        }
        let stale = pending.resend_at.len() + pending.give_up_at.len();
        assert_eq!(stale, 0, "stale deadlines");
        assert!(pending.spare.len() <= 1, "buffers are reused");
    }

    #[test]
    fn a_full_table_hands_the_query_back() {
        let mut pending = Pending::new(2, Duration::from_secs(1));
        let mut rng = rng();
        let now = Instant::now();
        for _ in 0..2 {
            let (mut q, question) = query(1, "a.example.");
            pending.insert(&mut q, question, 1, now, &mut rng).unwrap();
        }
        let (mut q, question) = query(1, "a.example.");
        let before = q.clone();
        assert!(matches!(
            pending.insert(&mut q, question, 3, now, &mut rng),
            Err(Full(3))
        ));
        assert_eq!(q, before, "a refused query is left as it was");
    }
}
