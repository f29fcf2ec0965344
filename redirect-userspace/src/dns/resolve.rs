//! Resolving a service endpoint given by host name (resolution DNS) through the upstream resolver.
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use super::{
    Upstream, UpstreamError,
    log::{Kind, limited},
};
use crate::lock::Locked;
use hickory_proto::{
    op::{Message, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error("{0:?} is not a valid host name")]
    BadName(String),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("the upstream's reply did not parse: {0}")]
    BadReply(String),
    #[error("{name} did not resolve: {code}")]
    NoAddress { name: String, code: ResponseCode },
    #[error("{name} did not resolve: A: {a}; AAAA: {aaaa}")]
    BothFailed {
        name: String,
        a: Box<ResolveError>,
        aaaa: Box<ResolveError>,
    },
}

/// What the upstream said about a host: its addresses, the IPv4 ones first, each family in the
/// upstream's order, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostAnswer {
    pub addresses: Vec<IpAddr>,
    /// The smallest TTL of the answers that gave addresses, each answer's being the smallest on its
    /// chain (CNAMEs included): when any of them may change.
    pub ttl: Duration,
}

/// One family's answer: its addresses (maybe none), the smallest TTL on its chain, and its code.
#[derive(Debug)]
struct FamilyAnswer {
    addresses: Vec<IpAddr>,
    ttl: u32,
    code: ResponseCode,
}

/// The addresses of `host` in both families: `A` and `AAAA` asked at once, the answers merged
/// (`docs/dns.md#endpoint-host-resolution`). One family failing is logged and the other's addresses
/// used; an error only when neither gives an address.
pub(crate) async fn resolve_host(
    upstream: &Upstream,
    host: &str,
) -> Result<HostAnswer, ResolveError> {
    let mut name = Name::from_ascii(host).map_err(|_| ResolveError::BadName(host.to_string()))?;
    name.set_fqdn(true);
    let (a, aaaa) = tokio::join!(
        ask(upstream, host, &name, RecordType::A),
        ask(upstream, host, &name, RecordType::AAAA),
    );
    merge(host, a, aaaa)
}

/// Asks for one record type: over UDP, again over TCP if the UDP answer is truncated.
async fn ask(
    upstream: &Upstream,
    host: &str,
    name: &Name,
    record_type: RecordType,
) -> Result<FamilyAnswer, ResolveError> {
    let mut query = Message::query();
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(name.clone(), record_type));
    let bytes = query
        .to_vec()
        .map_err(|e| ResolveError::BadName(format!("{host}: {e}")))?;
    let mut reply = parse(&upstream.forward_udp(&bytes).await?)?;
    if reply.metadata.truncation {
        reply = parse(&upstream.forward_tcp(&bytes).await?)?;
    }
    // The answer may lead with CNAMEs; the address records at the end of the chain are what we want.
    let addresses = reply
        .answers
        .iter()
        .filter_map(|record| match (&record.data, record_type) {
            (RData::A(a), RecordType::A) => Some(IpAddr::V4(a.0)),
            (RData::AAAA(aaaa), RecordType::AAAA) => Some(IpAddr::V6(aaaa.0)),
            _ => None,
        })
        .collect();
    Ok(FamilyAnswer {
        addresses,
        ttl: reply.answers.iter().map(|r| r.ttl).min().unwrap_or(0),
        code: reply.metadata.response_code,
    })
}

/// The addresses of both answers, IPv4 first, kept for the smaller TTL of the answers that gave
/// addresses (a family without any says nothing about how long the other's hold).
fn merge(
    host: &str,
    a: Result<FamilyAnswer, ResolveError>,
    aaaa: Result<FamilyAnswer, ResolveError>,
) -> Result<HostAnswer, ResolveError> {
    let with_addresses = || {
        [&a, &aaaa]
            .into_iter()
            .flatten()
            .filter(|answer| !answer.addresses.is_empty())
    };
    let addresses: Vec<IpAddr> = with_addresses()
        .flat_map(|answer| answer.addresses.iter().copied())
        .collect();
    let Some(ttl) = with_addresses().map(|answer| answer.ttl).min() else {
        return Err(match (a, aaaa) {
            (Err(a), Err(aaaa)) => ResolveError::BothFailed {
                name: host.to_string(),
                a: Box::new(a),
                aaaa: Box::new(aaaa),
            },
            // The failure is the likelier reason than the other family's empty answer.
            (Err(e), Ok(_)) | (Ok(_), Err(e)) => e,
            // An NXDOMAIN (or SERVFAIL) says more than the other family's empty NOERROR.
            (Ok(a), Ok(aaaa)) => ResolveError::NoAddress {
                name: host.to_string(),
                code: if a.code == ResponseCode::NoError {
                    aaaa.code
                } else {
                    a.code
                },
            },
        });
    };
    for (record_type, outcome) in [(RecordType::A, &a), (RecordType::AAAA, &aaaa)] {
        if let Err(e) = outcome {
            limited!(Kind::EndpointFamily, debug, endpoint = host, %record_type, error = %e, "one address family of an endpoint host name failed; using the other's addresses");
        }
    }
    Ok(HostAnswer {
        addresses,
        ttl: Duration::from_secs(u64::from(ttl)),
    })
}

fn parse(bytes: &[u8]) -> Result<Message, ResolveError> {
    Message::from_vec(bytes).map_err(|e| ResolveError::BadReply(e.to_string()))
}

/// Endpoint host names (resolution DNS) as last resolved, kept for the answer's TTL, so a new
/// connection to such a service pays a DNS round trip only when the answer has expired. Successive
/// connections take the addresses in turn. Failures are not kept: the next connection asks again.
#[derive(Debug)]
pub(crate) struct HostCache {
    upstream: Arc<Upstream>,
    entries: Mutex<HashMap<String, Entry>>,
}

/// The addresses a connection tries, in order: `first`, and `fallback` if connecting to it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pick {
    /// The next IPv4 address in turn, or the next IPv6 one for a host with no IPv4 address.
    pub first: IpAddr,
    /// For a host with both families, the next IPv6 address in turn.
    pub fallback: Option<IpAddr>,
}

#[derive(Debug)]
struct Entry {
    v4: Turns,
    v6: Turns,
    expires: Instant,
}

/// One family's addresses, taken in turn.
#[derive(Debug)]
struct Turns {
    addresses: Box<[IpAddr]>,
    next: usize,
}

/// Longest an answer is kept whatever its TTL: endpoints move, and a long TTL should not pin them.
pub(crate) const MAX_KEEP: Duration = Duration::from_secs(300);
/// Host names kept at most; only hosts named as endpoints in the config get here, so this is a
/// safety net, emptied whole when reached.
const MAX_HOSTS: usize = 4096;

impl HostCache {
    pub(crate) fn new(upstream: Arc<Upstream>) -> HostCache {
        HostCache {
            upstream,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The addresses of `host` to try: from the cache while fresh, else asked of the upstream.
    pub(crate) async fn pick(&self, host: &str) -> Result<Pick, ResolveError> {
        if let Some(pick) = self.cached(host, Instant::now()) {
            return Ok(pick);
        }
        let resolved = resolve_host(&self.upstream, host).await?;
        self.insert(host, resolved, Instant::now())
            .ok_or_else(|| ResolveError::NoAddress {
                name: host.to_string(),
                code: ResponseCode::NoError,
            })
    }

    /// Keeps `resolved` for its TTL, as if a connection had asked (the agent's resolution ahead
    /// hands every answer here, so the proxy uses the addresses the kernel rewrites to).
    pub(crate) fn store(&self, host: &str, resolved: HostAnswer, now: Instant) {
        self.insert(host, resolved, now);
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Only cached answers inside: after a panic elsewhere they are still fine to use.
        self.entries.locked()
    }

    fn cached(&self, host: &str, now: Instant) -> Option<Pick> {
        let mut entries = self.entries();
        let entry = entries.get_mut(host)?;
        if entry.expires <= now {
            entries.remove(host);
            return None;
        }
        entry.take()
    }

    /// Keeps `resolved` (unless its TTL is 0) and takes the first pick from it; `None` if it holds
    /// no address.
    fn insert(&self, host: &str, resolved: HostAnswer, now: Instant) -> Option<Pick> {
        let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) =
            resolved.addresses.iter().partition(|ip| ip.is_ipv4());
        let mut entry = Entry {
            v4: Turns::new(v4),
            v6: Turns::new(v6),
            expires: now + resolved.ttl.min(MAX_KEEP),
        };
        let pick = entry.take()?;
        if !resolved.ttl.is_zero() {
            let mut entries = self.entries();
            if entries.len() >= MAX_HOSTS {
                entries.clear();
            }
            entries.insert(host.to_string(), entry);
        }
        Some(pick)
    }
}

impl Entry {
    /// IPv4 first: it is what workload endpoints use too, and a host name with IPv4 addresses
    /// connects exactly as it did when only they were asked. IPv6 is the fallback, or the only
    /// choice of an IPv6-only host.
    fn take(&mut self) -> Option<Pick> {
        match self.v4.take() {
            Some(first) => Some(Pick {
                first,
                fallback: self.v6.take(),
            }),
            None => self.v6.take().map(|first| Pick {
                first,
                fallback: None,
            }),
        }
    }
}

impl Turns {
    fn new(addresses: Vec<IpAddr>) -> Turns {
        Turns {
            addresses: addresses.into(),
            next: 0,
        }
    }

    /// The next address in turn.
    fn take(&mut self) -> Option<IpAddr> {
        let ip = *self
            .addresses
            .get(self.next % self.addresses.len().max(1))?;
        self.next = self.next.wrapping_add(1);
        Some(ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::{
        op::MessageType,
        rr::{Record, rdata},
    };
    use tokio::net::UdpSocket;

    fn cache() -> HostCache {
        HostCache::new(Arc::new(Upstream::new("192.0.2.53:53".parse().unwrap())))
    }

    fn resolved(ips: &[&str], ttl: u64) -> HostAnswer {
        HostAnswer {
            addresses: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            ttl: Duration::from_secs(ttl),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pick(first: &str, fallback: Option<&str>) -> Pick {
        Pick {
            first: ip(first),
            fallback: fallback.map(ip),
        }
    }

    #[test]
    fn an_answer_is_used_in_turn_until_its_ttl_ends() {
        let cache = cache();
        let t0 = Instant::now();
        assert_eq!(
            cache.insert(
                "origin.example.org",
                resolved(&["198.51.100.1", "198.51.100.2"], 30),
                t0
            ),
            Some(pick("198.51.100.1", None))
        );
        let at = t0 + Duration::from_secs(29);
        assert_eq!(
            cache.cached("origin.example.org", at),
            Some(pick("198.51.100.2", None))
        );
        assert_eq!(
            cache.cached("origin.example.org", at),
            Some(pick("198.51.100.1", None))
        );
        assert_eq!(cache.cached("other.example.org", at), None);
        assert_eq!(
            cache.cached("origin.example.org", t0 + Duration::from_secs(30)),
            None,
            "expired"
        );
        assert!(cache.entries().is_empty(), "an expired answer is dropped");
    }

    #[test]
    fn ttl_zero_is_not_kept_and_long_ttls_are_capped() {
        let cache = cache();
        let t0 = Instant::now();
        cache.insert("a.example.org", resolved(&["198.51.100.1"], 0), t0);
        assert_eq!(cache.cached("a.example.org", t0), None);
        cache.insert("b.example.org", resolved(&["198.51.100.1"], 86_400), t0);
        assert!(cache.cached("b.example.org", t0 + MAX_KEEP).is_none());
    }

    /// Both families: IPv4 in turn first, IPv6 in turn as the fallback; an IPv6-only host is
    /// connected over IPv6 with nothing to fall back to.
    #[test]
    fn ipv4_comes_first_and_ipv6_is_the_fallback_or_the_only_choice() {
        let cache = cache();
        let t0 = Instant::now();
        let dual = resolved(&["198.51.100.1", "2001:db8::1", "2001:db8::2"], 30);
        assert_eq!(
            cache.insert("dual.example.org", dual, t0),
            Some(pick("198.51.100.1", Some("2001:db8::1")))
        );
        assert_eq!(
            cache.cached("dual.example.org", t0),
            Some(pick("198.51.100.1", Some("2001:db8::2")))
        );
        let v6 = resolved(&["2001:db8::1", "2001:db8::2"], 30);
        assert_eq!(
            cache.insert("v6.example.org", v6, t0),
            Some(pick("2001:db8::1", None))
        );
        assert_eq!(
            cache.cached("v6.example.org", t0),
            Some(pick("2001:db8::2", None))
        );
        assert_eq!(
            cache.insert("none.example.org", resolved(&[], 30), t0),
            None
        );
    }

    /// What the fake upstream does with one record type.
    #[derive(Clone)]
    enum Says {
        /// These addresses, each with this TTL, after a CNAME with `cname_ttl`.
        Addresses {
            ips: Vec<IpAddr>,
            ttl: u32,
            cname_ttl: Option<u32>,
        },
        /// No record, this code (NOERROR is an empty answer).
        Code(ResponseCode),
        /// Nothing at all.
        Silent,
    }

    fn addresses(ips: &[&str], ttl: u32) -> Says {
        Says::Addresses {
            ips: ips.iter().map(|s| ip(s)).collect(),
            ttl,
            cname_ttl: None,
        }
    }

    /// An upstream on loopback that answers `A` as `a` says and `AAAA` as `aaaa` says, and the
    /// record types it was asked for, in order of arrival.
    async fn fake_upstream(a: Says, aaaa: Says) -> (Upstream, Arc<Mutex<Vec<RecordType>>>) {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut upstream = Upstream::new(server.local_addr().unwrap());
        // The silent cases need not wait the full deadline.
        upstream.timeout = Duration::from_millis(300);
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = server.recv_from(&mut buf).await {
                let Ok(mut reply) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let question = reply.queries[0].clone();
                seen.lock().unwrap().push(question.query_type());
                let says = match question.query_type() {
                    RecordType::A => a.clone(),
                    _ => aaaa.clone(),
                };
                reply.metadata.message_type = MessageType::Response;
                match says {
                    Says::Silent => continue,
                    Says::Code(code) => reply.metadata.response_code = code,
                    Says::Addresses {
                        ips,
                        ttl,
                        cname_ttl,
                    } => {
                        let mut owner = question.name().clone();
                        if let Some(cname_ttl) = cname_ttl {
                            let target = Name::from_ascii("edge.example.net.").unwrap();
                            let cname = RData::CNAME(rdata::CNAME(target.clone()));
                            reply.add_answer(Record::from_rdata(owner, cname_ttl, cname));
                            owner = target;
                        }
                        for ip in ips {
                            let data = match ip {
                                IpAddr::V4(v4) => RData::A(rdata::A(v4)),
                                IpAddr::V6(v6) => RData::AAAA(rdata::AAAA(v6)),
                            };
                            reply.add_answer(Record::from_rdata(owner.clone(), ttl, data));
                        }
                    }
                }
                let _ = server.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
        (upstream, asked)
    }

    async fn resolve(a: Says, aaaa: Says) -> (Result<HostAnswer, ResolveError>, Vec<RecordType>) {
        let (upstream, asked) = fake_upstream(a, aaaa).await;
        let result = resolve_host(&upstream, "db.example.org").await;
        let mut asked = asked.lock().unwrap().clone();
        asked.sort_by_key(|t| u16::from(*t));
        (result, asked)
    }

    #[tokio::test]
    async fn both_families_are_asked_and_merged_ipv4_first_for_the_smaller_ttl() {
        let (result, asked) = resolve(
            addresses(&["198.51.100.1", "198.51.100.2"], 60),
            addresses(&["2001:db8::1"], 30),
        )
        .await;
        assert_eq!(asked, [RecordType::A, RecordType::AAAA]);
        assert_eq!(
            result.unwrap(),
            resolved(&["198.51.100.1", "198.51.100.2", "2001:db8::1"], 30)
        );
    }

    #[tokio::test]
    async fn a_cname_on_the_chain_bounds_the_ttl() {
        let aaaa = Says::Addresses {
            ips: vec![ip("2001:db8::1")],
            ttl: 60,
            cname_ttl: Some(10),
        };
        let (result, _) = resolve(addresses(&["198.51.100.1"], 60), aaaa).await;
        assert_eq!(
            result.unwrap(),
            resolved(&["198.51.100.1", "2001:db8::1"], 10)
        );
    }

    #[tokio::test]
    async fn a_host_with_one_family_resolves_and_the_empty_one_sets_no_ttl() {
        let (v6_only, _) = resolve(
            Says::Code(ResponseCode::NoError),
            addresses(&["2001:db8::1"], 30),
        )
        .await;
        assert_eq!(v6_only.unwrap(), resolved(&["2001:db8::1"], 30));

        // A CNAME without an AAAA at its end: no address, so its short TTL does not count.
        let no_aaaa = Says::Addresses {
            ips: vec![],
            ttl: 0,
            cname_ttl: Some(5),
        };
        let (v4_only, _) = resolve(addresses(&["198.51.100.1"], 60), no_aaaa).await;
        assert_eq!(v4_only.unwrap(), resolved(&["198.51.100.1"], 60));
    }

    #[tokio::test]
    async fn one_family_failing_still_gives_the_others_addresses() {
        let (a_failed, _) = resolve(
            Says::Code(ResponseCode::ServFail),
            addresses(&["2001:db8::1"], 30),
        )
        .await;
        assert_eq!(a_failed.unwrap(), resolved(&["2001:db8::1"], 30));
        let (aaaa_silent, _) = resolve(addresses(&["198.51.100.1"], 60), Says::Silent).await;
        assert_eq!(aaaa_silent.unwrap(), resolved(&["198.51.100.1"], 60));
    }

    #[tokio::test]
    async fn neither_family_giving_an_address_is_an_error() {
        let (nx, _) = resolve(
            Says::Code(ResponseCode::NXDomain),
            Says::Code(ResponseCode::NXDomain),
        )
        .await;
        assert!(
            matches!(
                nx,
                Err(ResolveError::NoAddress {
                    code: ResponseCode::NXDomain,
                    ..
                })
            ),
            "{nx:?}"
        );
        // The failing family's code, not the other's empty NOERROR.
        let (servfail, _) = resolve(
            Says::Code(ResponseCode::NoError),
            Says::Code(ResponseCode::ServFail),
        )
        .await;
        assert!(
            matches!(
                servfail,
                Err(ResolveError::NoAddress {
                    code: ResponseCode::ServFail,
                    ..
                })
            ),
            "{servfail:?}"
        );
        // A timeout says more than the other family's empty answer.
        let (one_silent, _) = resolve(Says::Silent, Says::Code(ResponseCode::NoError)).await;
        assert!(
            matches!(
                one_silent,
                Err(ResolveError::Upstream(UpstreamError::Timeout(..)))
            ),
            "{one_silent:?}"
        );
        let (both_silent, _) = resolve(Says::Silent, Says::Silent).await;
        let err = both_silent.unwrap_err();
        assert!(
            matches!(&err, ResolveError::BothFailed { a, aaaa, .. }
                if matches!(**a, ResolveError::Upstream(UpstreamError::Timeout(..)))
                    && matches!(**aaaa, ResolveError::Upstream(UpstreamError::Timeout(..)))),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("db.example.org did not resolve: A: "),
            "{err}"
        );
    }
}
