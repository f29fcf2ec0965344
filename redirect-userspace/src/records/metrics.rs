//! The records' counters (`docs/observability.md#metrics`): connections and bytes by service, for
//! the kernel's decisions as for the proxy's, so a dashboard sees the default path too. Their label
//! sets are bounded ([`MAX_SERVICE_SERIES`]): a record past the bound is counted apart, never
//! making a new series. Access-log lines left out for want of budget are counted here too.
use std::sync::Mutex;

use foldhash::{HashMap, HashMapExt};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use super::{DecidedBy, Event, Name, Record};
use crate::{lock::Locked, metrics::label_value_as_str};

/// Label sets of the by-service families, at most (client namespace, service, decider).
pub(crate) const MAX_SERVICE_SERIES: usize = 4096;

label_value_as_str!(DecidedBy);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabels {
    decided_by: DecidedBy,
    client_namespace: String,
    service_namespace: String,
    service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabels {
    decided_by: DecidedBy,
    client_namespace: String,
    service_namespace: String,
    service: String,
    direction: &'static str,
}

/// What a batch's records of one series add up to (`record`: one of them, for the labels).
#[derive(Default)]
struct Sums<'r> {
    record: Option<&'r Record>,
    connections: u64,
    sent: u64,
    received: u64,
}

#[derive(Debug, Default)]
pub(crate) struct RecordMetrics {
    connections: Family<ServiceLabels, Counter>,
    bytes: Family<BytesLabels, Counter>,
    /// The label sets made so far (their number is the bound's).
    series: Mutex<std::collections::HashSet<ServiceLabels>>,
    unrecorded: Counter,
    lines_dropped: Counter,
}

impl RecordMetrics {
    /// Counts each record by its service, if it has one: a connection at its open, its bytes at
    /// its close. Records naming the same shared names are summed first, so a batch of a busy
    /// node's records touches each series once.
    pub(super) fn count(&self, records: &[Record]) {
        let mut sums: HashMap<(DecidedBy, usize, usize), Sums<'_>> = HashMap::new();
        for record in records {
            let Some(service) = &record.service else {
                continue;
            };
            let namespace = record.namespace.as_ref();
            let key = (
                record.decided_by,
                namespace.map_or(0, Name::address),
                service.address(),
            );
            let sum = sums.entry(key).or_insert(Sums {
                record: Some(record),
                ..Sums::default()
            });
            match record.event {
                Event::Open => sum.connections += 1,
                Event::Close => {
                    sum.sent += record.bytes_sent;
                    sum.received += record.bytes_received;
                }
            }
        }
        for sum in sums.into_values() {
            self.add(&sum);
        }
    }

    fn add(&self, sum: &Sums<'_>) {
        let Some(record) = sum.record else { return };
        let Some((service_namespace, service)) = record.service_parts() else {
            return;
        };
        let labels = ServiceLabels {
            decided_by: record.decided_by,
            client_namespace: record
                .namespace
                .as_ref()
                .map_or("<unknown>", Name::as_str)
                .into(),
            service_namespace: service_namespace.into(),
            service: service.into(),
        };
        if !self.admit(&labels) {
            self.unrecorded.inc();
            return;
        }
        if sum.connections > 0 {
            self.connections
                .get_or_create(&labels)
                .inc_by(sum.connections);
        }
        for (direction, n) in [("sent", sum.sent), ("received", sum.received)] {
            if n == 0 {
                continue;
            }
            let bytes = BytesLabels {
                decided_by: labels.decided_by,
                client_namespace: labels.client_namespace.clone(),
                service_namespace: labels.service_namespace.clone(),
                service: labels.service.clone(),
                direction,
            };
            self.bytes.get_or_create(&bytes).inc_by(n);
        }
    }

    /// Whether `labels` has a series, or may have one within the bound.
    fn admit(&self, labels: &ServiceLabels) -> bool {
        let mut series = self.series.locked();
        if series.contains(labels) {
            return true;
        }
        if series.len() >= MAX_SERVICE_SERIES {
            return false;
        }
        series.insert(labels.clone());
        true
    }

    pub(super) fn line_dropped(&self) {
        self.lines_dropped.inc();
    }

    #[cfg(test)]
    pub(super) fn lines_dropped(&self) -> u64 {
        self.lines_dropped.get()
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "service_connections",
            "Connections by client namespace and service, counted when decided, whoever decided them (kernel or proxy)",
            self.connections.clone(),
        );
        registry.register(
            "service_bytes",
            "Bytes of ended connections by client namespace, service and direction (sent: from the client), whoever decided them",
            self.bytes.clone(),
        );
        registry.register(
            "service_records_unrecorded",
            "Connection records past the bound of the by-service families, not counted by service",
            self.unrecorded.clone(),
        );
        registry.register(
            "access_log_lines_dropped",
            "Access-log lines not written for want of budget (at most 100 a second, kernel and proxy together)",
            self.lines_dropped.clone(),
        );
    }
}
