//! The audit's counters (`docs/observability.md#metrics`): one per pair the ledger holds, so their
//! label sets are bounded by its [`super::ledger::MAX_PAIRS`]; what is past it is counted apart.
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use super::change::{Change, Direction, Lookup};
use crate::metrics::label_value_as_str;

label_value_as_str!(Lookup);
label_value_as_str!(Direction);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    client_namespace: String,
    service_namespace: String,
    service: String,
    kind: Lookup,
    change: Direction,
}

#[derive(Debug, Default)]
pub(crate) struct AuditMetrics {
    changes: Family<ChangeLabels, Counter>,
    unrecorded: Counter,
}

impl AuditMetrics {
    pub(crate) fn change(&self, client_ns: Option<&str>, change: &Change<'_>, lookup: Lookup) {
        let labels = ChangeLabels {
            client_namespace: client_ns.unwrap_or("<unknown>").to_string(),
            service_namespace: change.service_namespace.to_string(),
            service: change.service.to_string(),
            kind: lookup,
            change: change.direction,
        };
        self.changes.get_or_create(&labels).inc();
    }

    pub(crate) fn unrecorded(&self) {
        self.unrecorded.inc();
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "audit_changes",
            "Decisions the audit mesh config would change, by client namespace, service, kind and change",
            self.changes.clone(),
        );
        registry.register(
            "audit_changes_unrecorded",
            "Changes of pairs past the audit's bound, not recorded by pair",
            self.unrecorded.clone(),
        );
    }
}
