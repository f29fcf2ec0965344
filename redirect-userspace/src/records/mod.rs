//! Connection records, whoever decides (`docs/observability.md#connection-records`): the proxy's
//! connections and the kernel's (the fast path's, reported on a ring buffer and joined to pod and
//! service names by `fastpath`) become the same [`Record`]s. Each goes to one place, [`Connections`],
//! which writes the access-log line of a connection that ended (one budget for both deciders),
//! counts it by service, keeps the recent ones for `/connections` and hands them to followers.
mod access;
mod istio;
mod metrics;
mod recent;

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use serde::{Serialize, Serializer};
use tokio::sync::broadcast;

pub(crate) use access::{AccessLog, Received};
pub(crate) use istio::ends;
pub(crate) use metrics::RecordMetrics;
pub(crate) use recent::Filter;

use crate::{state::OutboundOutcome, telemetry::IstioMetrics};

/// Who decided a connection: the kernel at connect() (the fast path) or the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecidedBy {
    Kernel,
    Proxy,
}

impl DecidedBy {
    pub const fn as_str(self) -> &'static str {
        match self {
            DecidedBy::Kernel => "kernel",
            DecidedBy::Proxy => "proxy",
        }
    }
}

/// What happened to the connection: it was decided (and, for the proxy, its upstream reached), or
/// it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Event {
    Open,
    Close,
}

/// A name a record carries (a pod's `namespace/name`, a namespace, a service's `namespace/name`):
/// shared by every record that names it, never copied per record.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Name(Arc<str>);

impl Name {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, shared.
    pub(crate) fn shared(&self) -> Arc<str> {
        self.0.clone()
    }

    /// The same name, by address: two records naming one shared `Name` are counted together
    /// without comparing the text.
    fn address(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<u8>() as usize
    }
}

impl From<&str> for Name {
    fn from(name: &str) -> Name {
        Name(Arc::from(name))
    }
}

impl From<String> for Name {
    fn from(name: String) -> Name {
        Name(Arc::from(name))
    }
}

impl std::ops::Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Name {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// One connection record: the decision, and at the close what the connection carried.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Record {
    pub event: Event,
    pub decided_by: DecidedBy,
    /// When the event happened.
    #[serde(serialize_with = "rfc3339_millis")]
    pub time: SystemTime,
    /// The client's address and port (the kernel learns the port only by the close).
    pub client: Option<SocketAddr>,
    /// `namespace/name` of the pod the agent took the client for.
    pub workload: Option<Name>,
    pub namespace: Option<Name>,
    pub orig_dst: Option<SocketAddr>,
    #[serde(serialize_with = "outcome_label")]
    pub outcome: OutboundOutcome,
    /// `namespace/name`.
    pub service: Option<Name>,
    /// Where the connection went: the endpoint chosen, or the original destination.
    pub endpoint: Option<SocketAddr>,
    /// `namespace/name` of the waypoint the connection went through (`endpoint` is then the
    /// waypoint's HBONE address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<Name>,
    /// How the destination Pod's authorization policies decided it (`allowed by: ns/name`,
    /// `explicitly denied by: ns/name`, ...), when the proxy carried it to a Pod of this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub authorization: Option<Name>,
    /// The workload identity the client was carried as over HBONE (mutual TLS), when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hbone_identity: Option<Name>,
    /// Whether the connection's open record was written (always, but for a close of the proxy's
    /// refused before its upstream was reached).
    #[serde(skip)]
    pub was_opened: bool,
    /// Bytes from the client to the endpoint (the kernel: those the peer acknowledged).
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// From the decision to the close.
    #[serde(rename = "durationMs", serialize_with = "millis")]
    pub duration: Option<Duration>,
    /// How it ended: `closed`, `reset`, `refused`, `idle timeout`, ... (close records only).
    pub end: Option<&'static str>,
}

impl Record {
    /// A record of `decided_by` with nothing known yet, as of now.
    pub(crate) fn new(event: Event, decided_by: DecidedBy) -> Record {
        Record {
            event,
            decided_by,
            time: SystemTime::now(),
            client: None,
            workload: None,
            namespace: None,
            orig_dst: None,
            outcome: OutboundOutcome::Error,
            service: None,
            endpoint: None,
            waypoint: None,
            authorization: None,
            hbone_identity: None,
            was_opened: true,
            bytes_sent: 0,
            bytes_received: 0,
            duration: None,
            end: None,
        }
    }

    /// The service's namespace and name.
    fn service_parts(&self) -> Option<(&str, &str)> {
        self.service.as_ref()?.as_str().split_once('/')
    }
}

fn rfc3339_millis<S: Serializer>(time: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*time))
}

fn outcome_label<S: Serializer>(outcome: &OutboundOutcome, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(outcome.metric_label())
}

fn millis<S: Serializer>(duration: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match duration {
        Some(d) => s.serialize_some(&u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        None => s.serialize_none(),
    }
}

/// Records kept for `/connections` (the newest; older ones go first).
pub(crate) const RECENT: usize = 4096;
/// Records a follower may fall behind by before it is told it missed some.
const FOLLOW_BACKLOG: usize = 4096;

/// Where every record goes: the access log, the counters, the recent ones and the followers.
#[derive(Debug)]
pub(crate) struct Connections {
    log: AccessLog,
    metrics: Arc<RecordMetrics>,
    /// Istio's TCP families, when served.
    istio: Option<Arc<IstioMetrics>>,
    recent: recent::Recent,
    follow: broadcast::Sender<Arc<Record>>,
}

impl Connections {
    /// `access_log`: whether ended connections are written to the log (`--no-access-log`).
    pub(crate) fn new(access_log: bool, metrics: Arc<RecordMetrics>) -> Connections {
        Connections {
            log: AccessLog::new(access_log, metrics.clone()),
            metrics,
            istio: None,
            recent: recent::Recent::new(RECENT),
            follow: broadcast::channel(FOLLOW_BACKLOG).0,
        }
    }

    /// These connections counted in Istio's families too.
    pub(crate) fn with_istio(mut self, istio: Arc<IstioMetrics>) -> Connections {
        self.istio = Some(istio);
        self
    }

    /// Logs an HBONE stream received for a Pod of this node (within the access log's budget)
    /// when it ends, and counts it in Istio's families at its open and its end.
    pub(crate) fn received(&self, received: &Received<'_>) {
        if let Some(istio) = &self.istio {
            istio.count(istio::received(received));
        }
        if received.event == Event::Close {
            self.log.write_received(received);
        }
    }

    /// Takes one record: a close is logged (within the budget) and its bytes counted, an open
    /// counts a connection of its service; both are kept and followed.
    pub(crate) fn record(&self, record: Record) {
        self.record_all(vec![record]);
    }

    /// Takes records in the order they happened, as [`Connections::record`] each, counted together
    /// and kept under one lock.
    pub(crate) fn record_all(&self, records: Vec<Record>) {
        self.metrics.count(&records);
        if let Some(istio) = &self.istio {
            istio.count(records.iter().filter_map(istio::seen));
        }
        for record in records.iter().filter(|r| r.event == Event::Close) {
            self.log.write(record);
        }
        let records: Vec<Arc<Record>> = records.into_iter().map(Arc::new).collect();
        if self.follow.receiver_count() > 0 {
            for record in &records {
                let _ = self.follow.send(record.clone());
            }
        }
        self.recent.push_all(records);
    }

    /// The recent records `filter` lets through, oldest first.
    pub(crate) fn recent(&self, filter: &Filter) -> Vec<Arc<Record>> {
        self.recent.matching(filter)
    }

    /// Every record from now on (a receiver that falls [`FOLLOW_BACKLOG`] behind is told how many
    /// it missed).
    pub(crate) fn follow(&self) -> broadcast::Receiver<Arc<Record>> {
        self.follow.subscribe()
    }
}

#[cfg(test)]
mod tests;
