//! The access log: one `connection` line per connection when it ends, whoever decided it, as
//! Envoy's and ztunnel's operators expect (client, workload and namespace, original destination,
//! outcome, service, endpoint, bytes each way, duration, how it ended, `decided_by`). At info,
//! target `access`, off with `--no-access-log`; at most [`PER_SECOND`] lines a second for the
//! proxy and the kernel together, with bursts of as many: a flood of connections cannot fill a
//! disk, and the lines it cost are said in the next line written and counted.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use tracing::info;

use super::{Record, RecordMetrics};
use crate::lock::Locked;

/// Lines a second, at most (and the burst allowed).
pub(crate) const PER_SECOND: u32 = 100;

/// Whether to log, and the budget for it.
#[derive(Debug)]
pub(crate) struct AccessLog {
    enabled: bool,
    bucket: Mutex<Bucket>,
    /// Lines not written for want of budget since the last one written.
    dropped: AtomicU64,
    metrics: Arc<RecordMetrics>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl AccessLog {
    pub(crate) fn new(enabled: bool, metrics: Arc<RecordMetrics>) -> Self {
        AccessLog {
            enabled,
            bucket: Mutex::new(Bucket {
                tokens: f64::from(PER_SECOND),
                at: Instant::now(),
            }),
            dropped: AtomicU64::new(0),
            metrics,
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
            self.metrics.line_dropped();
            return None;
        }
        bucket.tokens -= 1.0;
        Some(self.dropped.swap(0, Ordering::Relaxed))
    }

    /// Writes `record`'s line if the budget allows.
    pub(super) fn write(&self, record: &Record) {
        if !self.enabled {
            return;
        }
        let Some(dropped) = self.admit(Instant::now()) else {
            return;
        };
        fn or_dash(name: &Option<super::Name>) -> &str {
            name.as_ref().map_or("-", super::Name::as_str)
        }
        let addr_or_dash =
            |v: Option<std::net::SocketAddr>| v.map_or("-".to_string(), |a| a.to_string());
        info!(
            target: "access",
            client = %addr_or_dash(record.client),
            workload = %or_dash(&record.workload),
            namespace = %or_dash(&record.namespace),
            orig_dst = %addr_or_dash(record.orig_dst),
            outcome = record.outcome.metric_label(),
            service = %or_dash(&record.service),
            endpoint = %addr_or_dash(record.endpoint),
            waypoint = %or_dash(&record.waypoint),
            authorization = %or_dash(&record.authorization),
            bytes_sent = record.bytes_sent,
            bytes_received = record.bytes_received,
            duration_ms = record
                .duration
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            end = record.end.unwrap_or("-"),
            decided_by = record.decided_by.as_str(),
            lines_dropped_before = dropped,
            "connection"
        );
    }
}

/// An HBONE stream received for a Pod of this node, as its access-log line tells it.
#[derive(Debug)]
pub(crate) struct Received<'a> {
    /// The stream's start (counted by Istio's families only) or its end (logged too).
    pub event: super::Event,
    /// The workload identity the sender's certificate names (`-`: plain TCP, refused by the kernel).
    pub src_identity: &'a str,
    /// The address the sender connected from.
    pub src: std::net::SocketAddr,
    /// The Pod and port the stream was carried to.
    pub dst: std::net::SocketAddr,
    /// Bytes toward the Pod, and from it.
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub duration: std::time::Duration,
    pub end: &'static str,
    /// How the Pod's authorization policies decided it.
    pub authorization: &'a str,
    /// `proxy` (carried), `kernel` (refused at the Pod's socket lookup).
    pub decided_by: &'static str,
}

impl AccessLog {
    /// Writes a received stream's line if the budget allows (the same budget as connections').
    pub(super) fn write_received(&self, received: &Received<'_>) {
        if !self.enabled {
            return;
        }
        let Some(dropped) = self.admit(Instant::now()) else {
            return;
        };
        info!(
            target: "access",
            src_identity = received.src_identity,
            client = %received.src,
            endpoint = %received.dst,
            bytes_sent = received.bytes_in,
            bytes_received = received.bytes_out,
            duration_ms = u64::try_from(received.duration.as_millis()).unwrap_or(u64::MAX),
            end = received.end,
            authorization = received.authorization,
            decided_by = received.decided_by,
            lines_dropped_before = dropped,
            "inbound"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_budget_and_the_cost_said_in_the_next_line_and_counted() {
        let metrics = Arc::new(RecordMetrics::default());
        let log = AccessLog::new(true, metrics.clone());
        let t0 = Instant::now();
        let admitted = (0..1_000).filter(|_| log.admit(t0).is_some()).count();
        assert_eq!(admitted, PER_SECOND as usize);
        assert_eq!(metrics.lines_dropped(), 900);
        // A second later the budget is back; the first line says how many were not written.
        assert_eq!(log.admit(t0 + Duration::from_secs(1)), Some(900));
        assert_eq!(log.admit(t0 + Duration::from_secs(1)), Some(0));
        assert_eq!(metrics.lines_dropped(), 900);
    }
}
