//! The upstream's answers, kept for as long as their TTLs allow, so a question pods ask again and
//! again costs one upstream query per TTL instead of one per ask.
//!
//! Only what the upstream said is kept, byte for byte: a hit is the stored reply under the asking
//! client's id and with its question as it spelled it (case included), each TTL lowered by the time
//! the reply has spent here. Nothing in it depends on who asked: a forwarded name is one no service
//! visible to the client owns, and the upstream answers it the same for every client. The decision
//! (answer it ourselves or forward) is always taken first, so a change of configuration never
//! serves a stale mesh answer from here.
use std::{
    num::NonZeroUsize,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Header, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, Record, RecordType},
    serialize::binary::{BinDecodable, BinDecoder},
};
use lru::LruCache;
use prometheus_client::metrics::gauge::Gauge;

/// No answer is kept longer than this, whatever its TTL: a record the upstream changes shows within
/// this time, as with a node-local cache in front of cluster DNS.
pub(super) const MAX_TTL: Duration = Duration::from_secs(30);

/// Larger replies are not kept, so the cache holds at most its entries times this (about 5 MiB
/// at the default 4,096 entries), whatever a pod asks for: the DNS flag day's UDP payload.
pub(super) const MAX_KEPT_REPLY: usize = 1232;

/// What a query must match for a stored reply to be its answer: the question, and every flag of
/// the query that can change what the upstream says or how much it may send.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(crate) struct CacheKey {
    /// Compared without case, as DNS names are.
    question: Query,
    recursion_desired: bool,
    checking_disabled: bool,
    authentic_data: bool,
    /// EDNS payload size and DNSSEC OK bit, when the query has EDNS.
    edns: Option<(u16, bool)>,
}

impl CacheKey {
    /// The key of a query whose reply may be shared: a plain query with one question and no EDNS
    /// options (a cookie or a client subnet makes the reply belong to one client).
    pub(crate) fn of(query: &Message) -> Option<Self> {
        let [question] = query.queries.as_slice() else {
            return None;
        };
        let meta = &query.metadata;
        if meta.message_type != MessageType::Query || meta.op_code != OpCode::Query {
            return None;
        }
        let edns = match &query.edns {
            Some(edns) if !edns.options().options.is_empty() => return None,
            Some(edns) => Some((edns.max_payload(), edns.flags().dnssec_ok)),
            None => None,
        };
        Some(Self {
            question: question.clone(),
            recursion_desired: meta.recursion_desired,
            checking_disabled: meta.checking_disabled,
            authentic_data: meta.authentic_data,
            edns,
        })
    }
}

#[derive(Clone, Copy)]
enum Section {
    Answer,
    Authority,
    Additional,
}

/// A stored reply and where its TTLs sit.
#[derive(Debug)]
struct Stored {
    reply: Box<[u8]>,
    /// End of the question section (it starts after the 12-byte header).
    question_end: usize,
    /// Offset of each record's TTL and the TTL it had when stored (capped at [`MAX_TTL`]).
    ttls: Vec<(usize, u32)>,
    stored_at: Instant,
    expires: Instant,
}

/// A bounded cache of upstream replies; the least recently used goes first when it is full.
#[derive(Debug)]
pub(crate) struct AnswerCache {
    entries: Mutex<LruCache<CacheKey, Arc<Stored>>>,
    /// Kept at the number of entries (`redirect_dns_cache_entries`).
    gauge: Gauge,
}

impl AnswerCache {
    pub(crate) fn new(capacity: NonZeroUsize, gauge: Gauge) -> Self {
        Self {
            entries: Mutex::new(LruCache::new(capacity)),
            gauge,
        }
    }

    /// The stored reply for `query` (the client's datagram, whose key is `key`), made the client's
    /// own; `None` when there is none, or it has expired.
    pub(crate) fn lookup(&self, key: &CacheKey, query: &[u8]) -> Option<Vec<u8>> {
        self.lookup_at(key, query, Instant::now())
    }

    /// Keeps the upstream's `reply` to the query of `key`, if it may be kept (see [`Stored::parse`]).
    pub(crate) fn store(&self, key: CacheKey, reply: &[u8]) {
        self.store_at(key, reply, Instant::now());
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    fn lookup_at(&self, key: &CacheKey, query: &[u8], now: Instant) -> Option<Vec<u8>> {
        let stored = {
            let mut entries = self.lock();
            let stored = entries.get(key)?.clone();
            if now >= stored.expires {
                entries.pop(key);
                self.gauge.set(entries.len() as i64);
                return None;
            }
            stored
        };
        stored.answer(query, now)
    }

    fn store_at(&self, key: CacheKey, reply: &[u8], now: Instant) {
        if let Some(stored) = Stored::parse(reply, now) {
            let mut entries = self.lock();
            entries.put(key, Arc::new(stored));
            self.gauge.set(entries.len() as i64);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<CacheKey, Arc<Stored>>> {
        // The map is consistent after every call: a panic elsewhere leaves nothing half-done.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Stored {
    /// Reads where the TTLs of `reply` sit and how long it may be kept. Kept: a whole reply of at
    /// most [`MAX_KEPT_REPLY`] bytes (not truncated, not signed) with one question, NOERROR with
    /// records or a negative answer that carries its zone's SOA (RFC 2308), every TTL above zero.
    /// Kept for the smallest TTL, the SOA's MINIMUM for a negative answer, at most [`MAX_TTL`].
    fn parse(reply: &[u8], now: Instant) -> Option<Self> {
        if reply.len() > MAX_KEPT_REPLY {
            return None;
        }
        let mut decoder = BinDecoder::new(reply);
        let header = Header::read(&mut decoder).ok()?;
        let meta = &header.metadata;
        if meta.message_type != MessageType::Response
            || meta.truncation
            || header.counts.queries != 1
            || !matches!(
                meta.response_code,
                ResponseCode::NoError | ResponseCode::NXDomain
            )
        {
            return None;
        }
        Query::read(&mut decoder).ok()?;
        let question_end = decoder.index();
        let counts = &header.counts;
        let sections = [
            (Section::Answer, counts.answers),
            (Section::Authority, counts.authorities),
            (Section::Additional, counts.additionals),
        ];
        let mut ttls = Vec::new();
        let mut lifetime = MAX_TTL.as_secs() as u32;
        let mut soa_minimum = None;
        for (section, count) in sections {
            for _ in 0..count {
                let start = u16::try_from(decoder.index()).ok()?;
                // The TTL follows the owner name, the type and the class.
                let mut owner = decoder.clone(start);
                Name::read(&mut owner).ok()?;
                let ttl_at = owner.index() + 4;
                let record = Record::read(&mut decoder).ok()?;
                match record.record_type() {
                    // Its "TTL" holds the extended RCODE and flags: with an extended RCODE the
                    // reply is no answer to keep; otherwise there is no TTL to age.
                    RecordType::OPT if record.ttl >> 24 == 0 => continue,
                    RecordType::OPT | RecordType::TSIG | RecordType::SIG => return None,
                    _ => {}
                }
                if let (Section::Authority, RData::SOA(soa)) = (section, &record.data) {
                    soa_minimum = Some(soa.minimum);
                }
                lifetime = lifetime.min(record.ttl);
                ttls.push((ttl_at, record.ttl));
            }
        }
        let negative = meta.response_code == ResponseCode::NXDomain || counts.answers == 0;
        if negative {
            lifetime = lifetime.min(soa_minimum?);
        }
        if lifetime == 0 {
            return None;
        }
        let cap = MAX_TTL.as_secs() as u32;
        for (_, ttl) in &mut ttls {
            *ttl = (*ttl).min(cap);
        }
        Some(Self {
            reply: reply.into(),
            question_end,
            ttls,
            stored_at: now,
            expires: now + Duration::from_secs(u64::from(lifetime)),
        })
    }

    /// The reply under `query`'s id and question spelling, its TTLs aged to `now`. `None` when the
    /// query's question does not sit where the stored one does (it cannot: same name, same length).
    fn answer(&self, query: &[u8], now: Instant) -> Option<Vec<u8>> {
        let mut decoder = BinDecoder::new(query);
        Header::read(&mut decoder).ok()?;
        Query::read(&mut decoder).ok()?;
        if decoder.index() != self.question_end {
            return None;
        }
        let mut reply = self.reply.to_vec();
        reply[..2].copy_from_slice(&query[..2]);
        reply[12..self.question_end].copy_from_slice(&query[12..self.question_end]);
        // Whole seconds spent here: below the lifetime, so every TTL stays at least 1.
        let spent = now.saturating_duration_since(self.stored_at).as_secs() as u32;
        for &(at, ttl) in &self.ttls {
            reply[at..at + 4].copy_from_slice(&ttl.saturating_sub(spent).to_be_bytes());
        }
        Some(reply)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::{
        op::Edns,
        rr::{
            DNSClass,
            rdata::{A, SOA, opt::EdnsOption},
        },
    };

    use super::*;

    fn query(id: u16, name: &str, qtype: RecordType) -> Message {
        let mut q = Message::query();
        q.metadata.id = id;
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        q
    }

    /// The upstream's reply to `q`: one A record per TTL given.
    fn reply(q: &Message, ttls: &[u32]) -> Message {
        let mut r = q.clone();
        r.metadata.message_type = MessageType::Response;
        r.metadata.recursion_available = true;
        let owner = q.queries[0].name().clone();
        for (i, ttl) in ttls.iter().enumerate() {
            let ip = Ipv4Addr::new(203, 0, 113, i as u8 + 1);
            r.add_answer(Record::from_rdata(owner.clone(), *ttl, RData::A(A(ip))));
        }
        r
    }

    fn nxdomain(q: &Message, soa_ttl: u32, minimum: u32) -> Message {
        let mut r = q.clone();
        r.metadata.message_type = MessageType::Response;
        r.metadata.response_code = ResponseCode::NXDomain;
        let zone = Name::from_ascii("example.com.").unwrap();
        let soa = SOA::new(zone.clone(), zone.clone(), 1, 3600, 600, 86400, minimum);
        r.add_authority(Record::from_rdata(zone, soa_ttl, RData::SOA(soa)));
        r
    }

    fn key(q: &Message) -> CacheKey {
        CacheKey::of(q).unwrap()
    }

    fn cache() -> AnswerCache {
        AnswerCache::new(NonZeroUsize::new(16).unwrap(), Gauge::default())
    }

    #[test]
    fn a_hit_is_the_stored_reply_under_the_askers_id_and_spelling_with_ttls_aged() {
        let cache = cache();
        let t0 = Instant::now();
        let first = query(1, "api.example.com.", RecordType::A);
        let upstream = reply(&first, &[300, 20]).to_vec().unwrap();
        cache.store_at(key(&first), &upstream, t0);

        let again = query(2, "API.Example.com.", RecordType::A);
        let raw = again.to_vec().unwrap();
        let hit = cache
            .lookup_at(&key(&again), &raw, t0 + Duration::from_millis(7_400))
            .expect("a hit");
        let hit_msg = Message::from_vec(&hit).unwrap();
        assert_eq!(hit_msg.metadata.id, 2);
        assert_eq!(hit_msg.queries[0].name().to_ascii(), "API.Example.com.");
        // 300 is capped at 30, 20 stays; 7 whole seconds spent.
        let ttls: Vec<u32> = hit_msg.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [23, 13]);
        // Everything else is the upstream's bytes.
        assert_eq!(hit.len(), upstream.len());
        assert_eq!(hit[2..12], upstream[2..12]);
    }

    #[test]
    fn a_reply_expires_with_its_smallest_ttl() {
        let cache = cache();
        let t0 = Instant::now();
        let q = query(1, "api.example.com.", RecordType::A);
        cache.store_at(key(&q), &reply(&q, &[300, 5]).to_vec().unwrap(), t0);
        let raw = q.to_vec().unwrap();
        let last = cache.lookup_at(&key(&q), &raw, t0 + Duration::from_millis(4_999));
        let ttls: Vec<u32> = Message::from_vec(&last.unwrap())
            .unwrap()
            .answers
            .iter()
            .map(|r| r.ttl)
            .collect();
        assert_eq!(ttls, [26, 1], "never a TTL of 0 from the cache");
        assert!(
            cache
                .lookup_at(&key(&q), &raw, t0 + Duration::from_secs(5))
                .is_none()
        );
        assert_eq!(cache.len(), 0, "an expired entry is dropped when met");
    }

    #[test]
    fn ttls_are_capped_so_upstream_changes_show_within_the_cap() {
        let cache = cache();
        let t0 = Instant::now();
        let q = query(1, "api.example.com.", RecordType::A);
        cache.store_at(key(&q), &reply(&q, &[86_400]).to_vec().unwrap(), t0);
        let raw = q.to_vec().unwrap();
        assert!(
            cache
                .lookup_at(&key(&q), &raw, t0 + MAX_TTL - Duration::from_millis(1))
                .is_some()
        );
        assert!(cache.lookup_at(&key(&q), &raw, t0 + MAX_TTL).is_none());
    }

    #[test]
    fn what_must_not_be_kept_is_not() {
        let cache = cache();
        let now = Instant::now();
        let q = query(1, "api.example.com.", RecordType::A);
        let raw = q.to_vec().unwrap();
        let mut servfail = reply(&q, &[]);
        servfail.metadata.response_code = ResponseCode::ServFail;
        let mut truncated = reply(&q, &[60]);
        truncated.metadata.truncation = true;
        let large = reply(&q, &[60; 80]);
        assert!(large.to_vec().unwrap().len() > MAX_KEPT_REPLY);
        let cases = [
            ("TTL 0", reply(&q, &[60, 0])),
            ("SERVFAIL", servfail),
            ("truncated", truncated),
            ("larger than the cap", large),
            ("NODATA without SOA", reply(&q, &[])),
            ("NXDOMAIN without SOA", {
                let mut r = reply(&q, &[]);
                r.metadata.response_code = ResponseCode::NXDomain;
                r
            }),
        ];
        for (what, upstream) in cases {
            cache.store_at(key(&q), &upstream.to_vec().unwrap(), now);
            assert!(
                cache.lookup_at(&key(&q), &raw, now).is_none(),
                "{what} was kept"
            );
        }
    }

    #[test]
    fn a_negative_answer_is_kept_for_its_soa_minimum() {
        let cache = cache();
        let t0 = Instant::now();
        let q = query(1, "gone.example.com.", RecordType::A);
        cache.store_at(key(&q), &nxdomain(&q, 3600, 10).to_vec().unwrap(), t0);
        let raw = q.to_vec().unwrap();
        let hit = cache
            .lookup_at(&key(&q), &raw, t0 + Duration::from_secs(3))
            .unwrap();
        let hit = Message::from_vec(&hit).unwrap();
        assert_eq!(hit.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(
            hit.authorities[0].ttl, 27,
            "SOA TTL capped at 30, 3 s spent"
        );
        assert!(
            cache
                .lookup_at(&key(&q), &raw, t0 + Duration::from_secs(10))
                .is_none()
        );
    }

    #[test]
    fn queries_that_differ_in_what_changes_the_answer_do_not_share() {
        let cache = cache();
        let now = Instant::now();
        let q = query(1, "api.example.com.", RecordType::A);
        cache.store_at(key(&q), &reply(&q, &[60]).to_vec().unwrap(), now);
        let aaaa = query(1, "api.example.com.", RecordType::AAAA);
        let mut no_rd = q.clone();
        no_rd.metadata.recursion_desired = false;
        let mut cd = q.clone();
        cd.metadata.checking_disabled = true;
        let mut with_edns = q.clone();
        with_edns.edns = Some(Edns::new());
        let mut dnssec_ok = with_edns.clone();
        if let Some(edns) = dnssec_ok.edns.as_mut() {
            edns.set_dnssec_ok(true);
        }
        for other in [aaaa, no_rd, cd, with_edns, dnssec_ok] {
            let raw = other.to_vec().unwrap();
            assert!(
                cache.lookup_at(&key(&other), &raw, now).is_none(),
                "{other:?}"
            );
        }
        assert!(
            cache
                .lookup_at(&key(&q), &q.to_vec().unwrap(), now)
                .is_some()
        );
    }

    #[test]
    fn a_query_with_edns_options_or_several_questions_is_never_shared() {
        let mut cookie = query(1, "api.example.com.", RecordType::A);
        let mut edns = Edns::new();
        edns.options_mut()
            .insert(EdnsOption::Unknown(10, vec![1, 2, 3, 4, 5, 6, 7, 8]));
        cookie.edns = Some(edns);
        assert!(CacheKey::of(&cookie).is_none());
        let mut two = query(1, "api.example.com.", RecordType::A);
        two.add_query(Query::query(
            Name::from_ascii("b.example.com.").unwrap(),
            RecordType::A,
        ));
        assert!(CacheKey::of(&two).is_none());
        let mut chaos = query(1, "version.bind.", RecordType::TXT);
        chaos.queries[0].set_query_class(DNSClass::CH);
        assert_ne!(
            CacheKey::of(&chaos),
            CacheKey::of(&query(1, "version.bind.", RecordType::TXT))
        );
    }

    #[test]
    fn the_edns_record_of_a_reply_is_left_as_it_came() {
        let cache = cache();
        let t0 = Instant::now();
        let mut q = query(1, "api.example.com.", RecordType::A);
        q.edns = Some(Edns::new());
        let mut r = reply(&q, &[60]);
        let mut edns = Edns::new();
        edns.set_dnssec_ok(true);
        r.edns = Some(edns);
        let upstream = r.to_vec().unwrap();
        cache.store_at(key(&q), &upstream, t0);
        let hit = cache
            .lookup_at(&key(&q), &q.to_vec().unwrap(), t0 + Duration::from_secs(4))
            .unwrap();
        let hit = Message::from_vec(&hit).unwrap();
        assert!(
            hit.edns.unwrap().flags().dnssec_ok,
            "OPT's flags are not a TTL to age"
        );
        assert_eq!(hit.answers[0].ttl, 26);
    }

    #[test]
    fn the_least_recently_used_goes_first_when_full() {
        let gauge = Gauge::default();
        let cache = AnswerCache::new(NonZeroUsize::new(2).unwrap(), gauge.clone());
        let now = Instant::now();
        let names = ["a.example.com.", "b.example.com.", "c.example.com."];
        let queries: Vec<Message> = names.iter().map(|n| query(1, n, RecordType::A)).collect();
        for q in &queries[..2] {
            cache.store_at(key(q), &reply(q, &[60]).to_vec().unwrap(), now);
        }
        // `a` is used, so `b` is the one to go.
        assert!(
            cache
                .lookup_at(&key(&queries[0]), &queries[0].to_vec().unwrap(), now)
                .is_some()
        );
        cache.store_at(
            key(&queries[2]),
            &reply(&queries[2], &[60]).to_vec().unwrap(),
            now,
        );
        let held: Vec<bool> = queries
            .iter()
            .map(|q| {
                cache
                    .lookup_at(&key(q), &q.to_vec().unwrap(), now)
                    .is_some()
            })
            .collect();
        assert_eq!(held, [true, false, true]);
        assert_eq!(gauge.get(), 2);
    }
}
