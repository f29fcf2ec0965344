//! Building the replies the agent gives itself: authoritative answers and SERVFAIL.
use std::net::{Ipv4Addr, Ipv6Addr};

use hickory_proto::{
    ProtoError,
    op::{Edns, Message, Metadata, ResponseCode},
    rr::{Name, RData, Record, RecordType, rdata},
};

use super::ANSWER_TTL;

/// UDP payload we advertise and respect when the client speaks EDNS (the DNS flag day 2020 value).
const EDNS_PAYLOAD: u16 = 1232;

/// What the agent answers for a name a visible service owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalAnswer {
    /// Set when the client's name was a search-domain expansion of the service's host: the reply
    /// carries `qname CNAME target` and the records under the target.
    pub cname_target: Option<Name>,
    pub v4: Vec<Ipv4Addr>,
    pub v6: Vec<Ipv6Addr>,
}

/// The authoritative reply to `query`, whose single question asks a name a visible service owns
/// (`docs/dns.md#other-types`): A and AAAA get the service's addresses of that family, ANY those of
/// both (RFC 8482: a subset of what the name holds), every other type none. A type with no record
/// is an empty NOERROR answer (NODATA), never NXDOMAIN: the name exists.
pub(super) fn authoritative_reply(
    query: &Message,
    answer: &LocalAnswer,
) -> Result<Message, ProtoError> {
    let mut reply = reply_to(query);
    reply.metadata.authoritative = true;
    let Some(question) = query.queries.first() else {
        return Ok(reply);
    };
    let qname = question.name().clone();
    let owner = match &answer.cname_target {
        Some(target) => {
            reply.add_answer(Record::from_rdata(
                qname,
                ANSWER_TTL,
                RData::CNAME(rdata::CNAME(target.clone())),
            ));
            target.clone()
        }
        None => qname,
    };
    let qtype = question.query_type();
    let (v4, v6) = match qtype {
        RecordType::A => (true, false),
        RecordType::AAAA => (false, true),
        RecordType::ANY => (true, true),
        _ => (false, false),
    };
    if v4 {
        reply.add_answers(
            answer
                .v4
                .iter()
                .map(|ip| Record::from_rdata(owner.clone(), ANSWER_TTL, RData::A(rdata::A(*ip)))),
        );
    }
    if v6 {
        reply.add_answers(answer.v6.iter().map(|ip| {
            Record::from_rdata(owner.clone(), ANSWER_TTL, RData::AAAA(rdata::AAAA(*ip)))
        }));
    }
    Ok(reply)
}

/// SERVFAIL for `query`: what the client gets when the upstream cannot be reached in time.
pub(super) fn servfail_reply(query: &Message) -> Message {
    let mut reply = reply_to(query);
    reply.metadata.response_code = ResponseCode::ServFail;
    reply
}

/// SERVFAIL for bytes that did not parse as a query: only the id can be trusted.
pub(super) fn servfail_for_raw(raw: &[u8]) -> Option<Vec<u8>> {
    let id = u16::from_be_bytes([*raw.first()?, *raw.get(1)?]);
    Message::error_msg(id, hickory_proto::op::OpCode::Query, ResponseCode::ServFail)
        .to_vec()
        .ok()
}

/// A reply skeleton: the query's id, opcode, RD and CD, its question, and an OPT record when the
/// client sent one (RFC 6891: a responder must include OPT if the request had it), with the query's
/// DO bit (RFC 3225: echoed; the agent's answers are unsigned, so nothing else follows from it).
fn reply_to(query: &Message) -> Message {
    let mut reply = Message::new(
        query.metadata.id,
        hickory_proto::op::MessageType::Response,
        query.metadata.op_code,
    );
    reply.metadata = Metadata::response_from_request(&query.metadata);
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.iter().cloned());
    if let Some(asked) = &query.edns {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD)
            .set_dnssec_ok(asked.flags().dnssec_ok);
        reply.set_edns(edns);
    }
    reply
}

/// The largest reply the client accepts over UDP.
pub(crate) fn max_udp_reply(query: &Message) -> usize {
    match &query.edns {
        Some(edns) => usize::from(edns.max_payload().clamp(512, EDNS_PAYLOAD)),
        None => 512,
    }
}

/// Encodes a reply for UDP, setting TC (and dropping the records) when it does not fit, so the client
/// retries over TCP.
pub(super) fn encode_for_udp(reply: &Message, limit: usize) -> Result<Vec<u8>, ProtoError> {
    let bytes = reply.to_vec()?;
    if bytes.len() <= limit {
        return Ok(bytes);
    }
    let mut truncated = reply.clone();
    truncated.answers.clear();
    truncated.metadata.truncation = true;
    truncated.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;

    fn query(name: &str, qtype: RecordType, edns: bool) -> Message {
        let mut q = Message::query();
        q.metadata.id = 4242;
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        if edns {
            q.set_edns(Edns::new());
        }
        q
    }

    fn answer(v4: &[&str], v6: &[&str], cname: Option<&str>) -> LocalAnswer {
        LocalAnswer {
            cname_target: cname.map(|n| Name::from_ascii(n).unwrap()),
            v4: v4.iter().map(|s| s.parse().unwrap()).collect(),
            v6: v6.iter().map(|s| s.parse().unwrap()).collect(),
        }
    }

    fn round_trip(m: &Message) -> Message {
        Message::from_vec(&m.to_vec().unwrap()).unwrap()
    }

    #[test]
    fn answers_a_authoritatively_with_ttl_30() {
        let q = query("api.example.com.", RecordType::A, false);
        let reply =
            round_trip(&authoritative_reply(&q, &answer(&["240.240.0.1"], &[], None)).unwrap());
        assert_eq!(reply.metadata.id, 4242);
        assert!(reply.metadata.authoritative);
        assert!(reply.metadata.recursion_desired);
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.queries, q.queries);
        assert_eq!(reply.answers.len(), 1);
        assert_eq!(reply.answers[0].ttl, ANSWER_TTL);
        assert_eq!(
            reply.answers[0].data,
            RData::A(rdata::A("240.240.0.1".parse().unwrap()))
        );
    }

    #[test]
    fn no_address_of_the_family_is_an_empty_noerror_not_nxdomain() {
        let q = query("api.example.com.", RecordType::AAAA, false);
        let reply =
            round_trip(&authoritative_reply(&q, &answer(&["240.240.0.1"], &[], None)).unwrap());
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert!(reply.answers.is_empty());
    }

    #[test]
    fn search_domain_expansion_answers_cname_then_records_of_the_target() {
        let q = query(
            "api.example.com.team-a.svc.cluster.local.",
            RecordType::A,
            false,
        );
        let reply = round_trip(
            &authoritative_reply(
                &q,
                &answer(&["203.0.113.10"], &[], Some("api.example.com.")),
            )
            .unwrap(),
        );
        assert_eq!(reply.answers.len(), 2);
        assert_eq!(
            reply.answers[0].name,
            Name::from_ascii("api.example.com.team-a.svc.cluster.local.").unwrap()
        );
        assert_eq!(
            reply.answers[0].data,
            RData::CNAME(rdata::CNAME(Name::from_ascii("api.example.com.").unwrap()))
        );
        assert_eq!(
            reply.answers[1].name,
            Name::from_ascii("api.example.com.").unwrap()
        );
    }

    #[test]
    fn edns_query_gets_an_opt_record_back() {
        let q = query("api.example.com.", RecordType::A, true);
        let reply =
            round_trip(&authoritative_reply(&q, &answer(&["240.240.0.1"], &[], None)).unwrap());
        assert_eq!(reply.edns.map(|e| e.max_payload()), Some(EDNS_PAYLOAD));
        let plain = round_trip(
            &authoritative_reply(&query("a.", RecordType::A, false), &answer(&[], &[], None))
                .unwrap(),
        );
        assert!(plain.edns.is_none());
    }

    /// RFC 3225: a query with the DO bit gets a reply whose OPT record has it too. The agent's own
    /// answers are unsigned, so nothing else changes: the same records, the same payload size.
    #[test]
    fn a_do_query_gets_the_do_bit_back_on_local_answers() {
        let mut q = query("api.example.com.", RecordType::A, true);
        if let Some(edns) = q.edns.as_mut() {
            edns.set_dnssec_ok(true).set_max_payload(4096);
        }
        let reply =
            round_trip(&authoritative_reply(&q, &answer(&["240.240.0.1"], &[], None)).unwrap());
        let edns = reply.edns.as_ref().expect("an OPT record back");
        assert!(edns.flags().dnssec_ok, "DO echoed");
        assert_eq!(edns.max_payload(), EDNS_PAYLOAD, "payload size as before");
        assert_eq!(
            reply.answers.len(),
            1,
            "unsigned: the A record alone, no RRSIG"
        );
        // SERVFAIL, the other reply the agent builds, echoes it as well.
        let failed = round_trip(&servfail_reply(&q));
        assert!(failed.edns.is_some_and(|e| e.flags().dnssec_ok));
        // Without DO in the query, none in the reply.
        let plain = query("api.example.com.", RecordType::A, true);
        let reply =
            round_trip(&authoritative_reply(&plain, &answer(&["240.240.0.1"], &[], None)).unwrap());
        assert!(reply.edns.is_some_and(|e| !e.flags().dnssec_ok));
    }

    /// RFC 8482 lets ANY be answered with a subset of what the name holds: the agent gives the
    /// addresses it has, of both families, after the CNAME when a search domain was stripped.
    #[test]
    fn any_is_answered_with_the_addresses_of_both_families() {
        let q = query("api.example.com.", RecordType::ANY, false);
        let reply = round_trip(
            &authoritative_reply(&q, &answer(&["240.240.0.1"], &["2001:db8::1"], None)).unwrap(),
        );
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert!(reply.metadata.authoritative);
        let data: Vec<_> = reply.answers.iter().map(|r| r.data.clone()).collect();
        assert_eq!(
            data,
            [
                RData::A(rdata::A("240.240.0.1".parse().unwrap())),
                RData::AAAA(rdata::AAAA("2001:db8::1".parse().unwrap())),
            ]
        );
        let q = query(
            "api.example.com.team-a.svc.cluster.local.",
            RecordType::ANY,
            false,
        );
        let reply = round_trip(
            &authoritative_reply(&q, &answer(&["240.240.0.1"], &[], Some("api.example.com.")))
                .unwrap(),
        );
        assert_eq!(reply.answers.len(), 2, "CNAME, then the A record");
        assert_eq!(reply.answers[0].record_type(), RecordType::CNAME);
    }

    /// Any other type of an owned name: NODATA (NOERROR, no records, no SOA), the CNAME alone when
    /// a search domain was stripped.
    #[test]
    fn other_types_of_an_owned_name_are_nodata() {
        for qtype in [RecordType::TXT, RecordType::HINFO, RecordType::MX] {
            let q = query("api.example.com.", qtype, false);
            let reply =
                round_trip(&authoritative_reply(&q, &answer(&["240.240.0.1"], &[], None)).unwrap());
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
            assert!(reply.metadata.authoritative);
            assert!(
                reply.answers.is_empty() && reply.authorities.is_empty(),
                "{qtype}"
            );
        }
        let q = query(
            "api.example.com.team-a.svc.cluster.local.",
            RecordType::TXT,
            false,
        );
        let reply = round_trip(
            &authoritative_reply(&q, &answer(&["240.240.0.1"], &[], Some("api.example.com.")))
                .unwrap(),
        );
        assert_eq!(reply.answers.len(), 1);
        assert_eq!(reply.answers[0].record_type(), RecordType::CNAME);
    }

    #[test]
    fn servfail_keeps_id_and_question() {
        let q = query("api.example.com.", RecordType::A, false);
        let reply = round_trip(&servfail_reply(&q));
        assert_eq!(reply.metadata.id, 4242);
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(reply.queries, q.queries);
        let raw = servfail_for_raw(&[0x12, 0x34, 0xff]).unwrap();
        let parsed = Message::from_vec(&raw).unwrap();
        assert_eq!(parsed.metadata.id, 0x1234);
        assert_eq!(parsed.metadata.response_code, ResponseCode::ServFail);
        assert!(servfail_for_raw(&[1]).is_none());
    }

    #[test]
    fn oversized_udp_reply_is_truncated_with_tc() {
        let q = query("big.example.com.", RecordType::A, false);
        let many: Vec<String> = (0..60).map(|i| format!("240.240.1.{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let reply = authoritative_reply(&q, &answer(&many, &[], None)).unwrap();
        let bytes = encode_for_udp(&reply, max_udp_reply(&q)).unwrap();
        assert!(bytes.len() <= 512);
        let parsed = Message::from_vec(&bytes).unwrap();
        assert!(parsed.metadata.truncation);
        assert!(parsed.answers.is_empty());
    }
}
