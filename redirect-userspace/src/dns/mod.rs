//! The DNS proxy: answers names that a service visible to the client owns, forwards everything else
//! to the upstream resolver and returns its reply unchanged (hidden means absent).
mod answer;
mod cache;
mod log;
mod metrics;
mod pending;
mod queues;
mod resolve;
mod server;
mod transfer;
mod upstream;
mod visible;

pub(crate) use answer::{LocalAnswer, max_udp_reply};
pub(crate) use cache::AnswerCache;
pub(crate) use metrics::{DnsMetrics, DnsOutcome};
pub(crate) use resolve::{HostAnswer, HostCache, MAX_KEEP, ResolveError, resolve_host};
pub(crate) use server::{Decide, Decision, DnsProxy, DnsQuery, Handled, handle_query};
pub(crate) use upstream::{Upstream, UpstreamError, first_nameserver};
pub(crate) use visible::VisibleNames;

/// TTL of the records the agent answers itself (`docs/dns.md#authoritative-answers`).
pub(crate) const ANSWER_TTL: u32 = 30;
