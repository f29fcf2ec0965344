//! Resolving a service endpoint given by host name (resolution DNS) through the upstream resolver.
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};

use super::{Upstream, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{0:?} is not a valid host name")]
    BadName(String),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("the upstream's reply did not parse: {0}")]
    BadReply(String),
    #[error("{name} did not resolve: {code}")]
    NoAddress { name: String, code: ResponseCode },
}

/// What the upstream said about a host: its IPv4 addresses in the upstream's order, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub addresses: Vec<IpAddr>,
    /// The smallest TTL on the answer's chain (CNAMEs included): when any link may change.
    pub ttl: Duration,
}

/// The IPv4 addresses of `host` (A records only: pods are steered over IPv4).
pub async fn resolve_host(upstream: &Upstream, host: &str) -> Result<Resolved, ResolveError> {
    let mut name = Name::from_ascii(host).map_err(|_| ResolveError::BadName(host.to_string()))?;
    name.set_fqdn(true);
    let mut query = Message::query();
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(name, RecordType::A));
    let bytes = query
        .to_vec()
        .map_err(|e| ResolveError::BadName(format!("{host}: {e}")))?;
    let mut reply = parse(&upstream.forward_udp(&bytes).await?)?;
    if reply.metadata.truncation {
        reply = parse(&upstream.forward_tcp(&bytes).await?)?;
    }
    // The answer may lead with CNAMEs; the A records at the end of the chain are what we want.
    let addresses: Vec<IpAddr> = reply
        .answers
        .iter()
        .filter_map(|record| match &record.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            _ => None,
        })
        .collect();
    if addresses.is_empty() {
        return Err(ResolveError::NoAddress {
            name: host.to_string(),
            code: reply.metadata.response_code,
        });
    }
    let ttl = reply.answers.iter().map(|r| r.ttl).min().unwrap_or(0);
    Ok(Resolved {
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
pub struct HostCache {
    upstream: Arc<Upstream>,
    entries: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug)]
struct Entry {
    addresses: Arc<[IpAddr]>,
    expires: Instant,
    next: usize,
}

/// Longest an answer is kept whatever its TTL: endpoints move, and a long TTL should not pin them.
const MAX_KEEP: Duration = Duration::from_secs(300);
/// Host names kept at most; only hosts named as endpoints in the config get here, so this is a
/// safety net, emptied whole when reached.
const MAX_HOSTS: usize = 4096;

impl HostCache {
    pub fn new(upstream: Arc<Upstream>) -> HostCache {
        HostCache {
            upstream,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// One address of `host`: from the cache while fresh, else asked of the upstream.
    pub async fn address(&self, host: &str) -> Result<IpAddr, ResolveError> {
        if let Some(ip) = self.cached(host, Instant::now()) {
            return Ok(ip);
        }
        let resolved = resolve_host(&self.upstream, host).await?;
        Ok(self.insert(host, resolved, Instant::now()))
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Only cached answers inside: after a panic elsewhere they are still fine to use.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, host: &str, now: Instant) -> Option<IpAddr> {
        let mut entries = self.entries();
        let entry = entries.get_mut(host)?;
        if entry.expires <= now {
            entries.remove(host);
            return None;
        }
        Some(entry.take())
    }

    fn insert(&self, host: &str, resolved: Resolved, now: Instant) -> IpAddr {
        let mut entry = Entry {
            addresses: resolved.addresses.into(),
            expires: now + resolved.ttl.min(MAX_KEEP),
            next: 0,
        };
        let ip = entry.take();
        if !resolved.ttl.is_zero() {
            let mut entries = self.entries();
            if entries.len() >= MAX_HOSTS {
                entries.clear();
            }
            entries.insert(host.to_string(), entry);
        }
        ip
    }
}

impl Entry {
    /// The next address in turn.
    fn take(&mut self) -> IpAddr {
        let ip = self.addresses[self.next % self.addresses.len()];
        self.next = self.next.wrapping_add(1);
        ip
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> HostCache {
        HostCache::new(Arc::new(Upstream::new("192.0.2.53:53".parse().unwrap())))
    }

    fn resolved(ips: &[&str], ttl: u64) -> Resolved {
        Resolved {
            addresses: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            ttl: Duration::from_secs(ttl),
        }
    }

    #[test]
    fn an_answer_is_used_in_turn_until_its_ttl_ends() {
        let cache = cache();
        let t0 = Instant::now();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            cache.insert(
                "origin.example.org",
                resolved(&["198.51.100.1", "198.51.100.2"], 30),
                t0
            ),
            ip("198.51.100.1")
        );
        let at = t0 + Duration::from_secs(29);
        assert_eq!(
            cache.cached("origin.example.org", at),
            Some(ip("198.51.100.2"))
        );
        assert_eq!(
            cache.cached("origin.example.org", at),
            Some(ip("198.51.100.1"))
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
}
