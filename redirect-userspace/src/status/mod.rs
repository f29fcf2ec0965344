//! The ServiceEntry status the cluster shows (`redirect run --kube --write-status`): the agents of a
//! cluster elect one writer with a Lease ([`lease`]), and the writer keeps each entry's
//! `status.conditions` of the types `resolve` computes ([`plan::MANAGED_TYPES`]) equal to what it
//! computes ([`writer`]). Conditions of other types, and conditions another controller writes
//! (istiod, when it does this itself), are left as they are.
pub(crate) mod lease;
pub(crate) mod observed;
pub(crate) mod plan;
mod writer;

use std::{collections::BTreeMap, sync::Arc};

use serde::Serialize;
use tokio::sync::watch;

pub(crate) use lease::{Holder, LeaseConfig};
pub(crate) use observed::{Observed, observe};

use crate::{metrics::Metrics, visibility::Condition};

/// The conditions `resolve` computes for one ServiceEntry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Desired {
    pub namespace: String,
    pub name: String,
    pub conditions: Vec<Condition>,
}

/// What the writer works from: the latest resolution and the status the API holds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inputs {
    /// The ServiceEntry `apiVersion` served; `None` until discovered.
    pub api_version: Option<String>,
    pub desired: Arc<Vec<Desired>>,
    pub observed: Arc<BTreeMap<(String, String), Arc<Observed>>>,
}

/// What `/config_dump` shows of the status writer.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Report {
    /// `namespace/name` of the Lease.
    pub lease: String,
    pub identity: String,
    /// Whether this agent is the cluster's writer now.
    pub leading: bool,
    /// Status writes since start, by outcome (`ok`, `conflict`, `gone`, `error`).
    pub writes: BTreeMap<&'static str, u64>,
    /// Entries whose conditions another controller writes: `namespace/name` -> its field manager.
    pub other_writers: BTreeMap<String, String>,
}

impl Report {
    fn count(&mut self, outcome: &'static str) {
        *self.writes.entry(outcome).or_default() += 1;
    }
}

/// The election and the writer, running: the report `/config_dump` shows, and the lease to hand
/// back on a graceful stop ([`Holder::release`]).
pub(crate) struct Writer {
    pub report: Arc<std::sync::Mutex<Report>>,
    pub lease: Holder,
}

/// Starts the election and the writer.
pub(crate) fn start(
    client: kube::Client,
    lease: LeaseConfig,
    inputs: watch::Receiver<Inputs>,
    metrics: Arc<Metrics>,
) -> Writer {
    let report = Arc::new(std::sync::Mutex::new(Report {
        lease: format!("{}/{}", lease.namespace, lease.name),
        identity: lease.identity.clone(),
        ..Report::default()
    }));
    let lease = lease::start(client.clone(), lease);
    tokio::spawn(writer::run(
        client,
        inputs,
        lease.tenure.clone(),
        report.clone(),
        metrics,
    ));
    Writer { report, lease }
}
