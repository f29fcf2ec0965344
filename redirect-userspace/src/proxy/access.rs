//! The record of each proxied connection: its outcome counted once, and the access log: one line per
//! proxied connection when it ends, as Envoy's and ztunnel's operators
//! expect (client workload and namespace, original destination, outcome, service, endpoint, bytes each
//! way, duration, how it ended). At info, off with `--no-access-log`, and at most [`PER_SECOND`] lines
//! a second with bursts of as many: a flood of connections cannot fill a disk, and the lines it cost
//! are counted in the next one written.
use std::{
    net::SocketAddr,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use tracing::info;

use super::ProxyMetrics;
use crate::lock::Locked;
use crate::state::OutboundOutcome;

/// Lines a second, at most (and the burst allowed).
pub(crate) const PER_SECOND: u32 = 100;

/// Whether to log, and the budget for it.
#[derive(Debug)]
pub(crate) struct AccessLog {
    enabled: bool,
    bucket: Mutex<Bucket>,
    /// Lines not written for want of budget since the last one written.
    dropped: AtomicU64,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl AccessLog {
    pub(crate) fn new(enabled: bool) -> Self {
        AccessLog {
            enabled,
            bucket: Mutex::new(Bucket {
                tokens: f64::from(PER_SECOND),
                at: Instant::now(),
            }),
            dropped: AtomicU64::new(0),
        }
    }

    /// Takes one line's budget; `Some(lines dropped before it)` when there is one.
    fn admit(&self, now: Instant) -> Option<u64> {
        let mut bucket = self.bucket.locked();
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * f64::from(PER_SECOND);
        bucket.tokens = (bucket.tokens + refill).min(f64::from(PER_SECOND));
        bucket.at = now;
        if bucket.tokens < 1.0 {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        bucket.tokens -= 1.0;
        Some(self.dropped.swap(0, Ordering::Relaxed))
    }
}

/// One proxied connection's record, filled in as it is decided and carried. Its outcome is counted
/// once: when the proxy knows it ([`ConnectionResult::decided`]), or else as an error when the record
/// is dropped; the access-log line is written when it is dropped. So every way out of the proxy,
/// including one the code forgot, counts and logs exactly once.
pub(crate) struct ConnectionResult<'a> {
    metrics: &'a ProxyMetrics,
    log: &'a AccessLog,
    started: Instant,
    counted: bool,
    pub client: SocketAddr,
    /// `namespace/name` of the workload the agent took the client for.
    pub workload: Option<String>,
    pub namespace: Option<String>,
    pub orig_dst: Option<SocketAddr>,
    outcome: OutboundOutcome,
    /// `namespace/name`.
    pub service: Option<String>,
    pub endpoint: Option<SocketAddr>,
    pub sent: u64,
    pub received: u64,
    /// How it ended: `closed`, `reset`, `idle timeout`, `write timeout`, or why it was refused.
    pub end: &'static str,
}

impl<'a> ConnectionResult<'a> {
    pub(crate) fn start(metrics: &'a ProxyMetrics, log: &'a AccessLog, client: SocketAddr) -> Self {
        ConnectionResult {
            metrics,
            log,
            started: Instant::now(),
            counted: false,
            client,
            workload: None,
            namespace: None,
            orig_dst: None,
            outcome: OutboundOutcome::Error,
            service: None,
            endpoint: None,
            sent: 0,
            received: 0,
            end: "reset",
        }
    }

    /// The connection's outcome, counted now (a long connection is counted when it starts, not when
    /// it ends). Only the first call counts.
    pub(crate) fn decided(&mut self, outcome: OutboundOutcome) {
        if self.counted {
            return;
        }
        self.counted = true;
        self.outcome = outcome;
        self.metrics.outbound(outcome);
    }

    /// Refused before any byte moved: `outcome` (an error unless said otherwise), ended for `why`.
    pub(crate) fn refused(&mut self, outcome: OutboundOutcome, why: &'static str) {
        self.decided(outcome);
        self.end = why;
    }
}

impl Drop for ConnectionResult<'_> {
    fn drop(&mut self) {
        self.decided(OutboundOutcome::Error);
        if !self.log.enabled {
            return;
        }
        let Some(dropped) = self.log.admit(Instant::now()) else {
            return;
        };
        let or_dash = |v: &Option<String>| v.as_deref().unwrap_or("-").to_string();
        info!(
            target: "access",
            client = %self.client,
            workload = %or_dash(&self.workload),
            namespace = %or_dash(&self.namespace),
            orig_dst = %self.orig_dst.map_or("-".to_string(), |d| d.to_string()),
            outcome = self.outcome.metric_label(),
            service = %or_dash(&self.service),
            endpoint = %self.endpoint.map_or("-".to_string(), |e| e.to_string()),
            bytes_sent = self.sent,
            bytes_received = self.received,
            duration_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            end = self.end,
            decided_by = "proxy",
            lines_dropped_before = dropped,
            "connection"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_budget_and_the_cost_said_in_the_next_line() {
        let log = AccessLog::new(true);
        let t0 = Instant::now();
        let admitted = (0..1_000).filter(|_| log.admit(t0).is_some()).count();
        assert_eq!(admitted, PER_SECOND as usize);
        // A second later the budget is back; the first line says how many were not written.
        assert_eq!(log.admit(t0 + Duration::from_secs(1)), Some(900));
        assert_eq!(log.admit(t0 + Duration::from_secs(1)), Some(0));
    }
}
