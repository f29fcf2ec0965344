//! Resolving a service endpoint given by host name (resolution DNS) through the upstream resolver.
use std::net::IpAddr;

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

/// The IPv4 addresses of `host`, in the upstream's order (A records only: pods are steered over IPv4).
pub async fn resolve_host(upstream: &Upstream, host: &str) -> Result<Vec<IpAddr>, ResolveError> {
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
    Ok(addresses)
}

fn parse(bytes: &[u8]) -> Result<Message, ResolveError> {
    Message::from_vec(bytes).map_err(|e| ResolveError::BadReply(e.to_string()))
}
