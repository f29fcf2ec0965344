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

pub use answer::LocalAnswer;
pub use cache::AnswerCache;
pub use metrics::{DnsMetrics, DnsOutcome};
pub use resolve::{HostAnswer, HostCache, MAX_KEEP, ResolveError, resolve_host};
pub use server::{Decide, Decision, DnsProxy, DnsQuery};
pub use upstream::{Upstream, UpstreamError, first_nameserver};
pub use visible::VisibleNames;

/// TTL of the records the agent answers itself (`docs/dns.md#authoritative-answers`).
pub const ANSWER_TTL: u32 = 30;
