//! The record of each proxied connection: its outcome counted once, and its connection records
//! (an open once its upstream is reached, a close when it ends) handed to the agent's
//! [`Connections`], which writes the access-log line.
use std::{net::SocketAddr, time::Instant};

use super::ProxyMetrics;
use crate::{
    records::{Connections, DecidedBy, Event, Name, Record},
    state::OutboundOutcome,
};

/// One proxied connection's record, filled in as it is decided and carried. Its outcome is counted
/// once: when the proxy knows it ([`ConnectionResult::decided`]), or else as an error when the record
/// is dropped; the close record is written when it is dropped. So every way out of the proxy,
/// including one the code forgot, counts and records exactly once.
pub(crate) struct ConnectionResult<'a> {
    metrics: &'a ProxyMetrics,
    records: &'a Connections,
    started: Instant,
    counted: bool,
    pub client: SocketAddr,
    /// `namespace/name` of the workload the agent took the client for.
    pub workload: Option<Name>,
    pub namespace: Option<Name>,
    pub orig_dst: Option<SocketAddr>,
    outcome: OutboundOutcome,
    /// `namespace/name`.
    pub service: Option<Name>,
    pub endpoint: Option<SocketAddr>,
    /// `namespace/name` of the waypoint it went through.
    pub waypoint: Option<Name>,
    /// How the destination Pod's authorization policies decided it, when it is a Pod of this node.
    pub authorization: Option<Name>,
    /// The workload identity it was carried as over HBONE.
    pub hbone_identity: Option<Name>,
    /// Whether its open record was written.
    opened: bool,
    pub sent: u64,
    pub received: u64,
    /// How it ended: `closed`, `reset`, `idle timeout`, `write timeout`, or why it was refused.
    pub end: &'static str,
}

impl<'a> ConnectionResult<'a> {
    pub(crate) fn start(
        metrics: &'a ProxyMetrics,
        records: &'a Connections,
        client: SocketAddr,
    ) -> Self {
        ConnectionResult {
            metrics,
            records,
            started: Instant::now(),
            counted: false,
            client,
            workload: None,
            namespace: None,
            orig_dst: None,
            outcome: OutboundOutcome::Error,
            service: None,
            endpoint: None,
            waypoint: None,
            authorization: None,
            hbone_identity: None,
            opened: false,
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

    /// The upstream is reached: the connection's open record.
    pub(crate) fn opened(&mut self) {
        self.opened = true;
        self.records.record(self.to_record(Event::Open));
    }

    /// Refused before any byte moved: `outcome` (an error unless said otherwise), ended for `why`.
    pub(crate) fn refused(&mut self, outcome: OutboundOutcome, why: &'static str) {
        self.decided(outcome);
        self.end = why;
    }

    fn to_record(&self, event: Event) -> Record {
        let mut record = Record::new(event, DecidedBy::Proxy);
        record.client = Some(self.client);
        record.workload = self.workload.clone();
        record.namespace = self.namespace.clone();
        record.orig_dst = self.orig_dst;
        record.outcome = self.outcome;
        record.service = self.service.clone();
        record.endpoint = self.endpoint;
        record.waypoint = self.waypoint.clone();
        record.authorization = self.authorization.clone();
        record.hbone_identity = self.hbone_identity.clone();
        record.was_opened = self.opened;
        if event == Event::Close {
            record.bytes_sent = self.sent;
            record.bytes_received = self.received;
            record.duration = Some(self.started.elapsed());
            record.end = Some(self.end);
        }
        record
    }
}

impl Drop for ConnectionResult<'_> {
    fn drop(&mut self) {
        self.decided(OutboundOutcome::Error);
        self.records.record(self.to_record(Event::Close));
    }
}
