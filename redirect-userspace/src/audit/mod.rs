//! The audit mode (`docs/audit.md`): a second mesh config whose `serviceEntryVisibility` is resolved
//! beside the enforced one by the same rules and never enforced. Every DNS answer and every
//! connection decision is made again under it; where the service used differs, the change is
//! counted, logged (paced) and kept for `/audit`. What a client gets is the enforced answer, always.
//!
//! The audit policy's snapshot shares the enforced snapshot's workloads; only its services are its
//! own. It is rebuilt with every configuration put in force, and when the audit file changes.
mod change;
mod ledger;
mod metrics;
#[cfg(test)]
mod tests;

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Instant, SystemTime},
};

use arc_swap::ArcSwapOption;
use ipnet::IpNet;
use serde::Serialize;
use tracing::info;

use change::{Change, Differs, Lookup, compare};
use ledger::{Ledger, PairReport, Recorded};
pub(crate) use metrics::AuditMetrics;

use crate::{
    clock::now_rfc3339,
    config::{self, ConfigError, Model, VisibilityConfig},
    lock::Locked,
    state::{DnsDecision, Pick, Service, Snapshot},
    visibility,
};

/// The audit policy in force: its snapshot, and the entries it sees otherwise than the enforced one.
#[derive(Debug)]
pub(crate) struct Policy {
    snapshot: Snapshot,
    differs: Differs,
    /// Every address of a service in `differs`, under either policy (a host address as its /32 or
    /// /128): where the kernel must report its decisions.
    addresses: Vec<IpNet>,
}

impl Policy {
    /// `model`'s entries resolved under `config`, beside their resolution under the model's own mesh
    /// config; `enforced` is the snapshot in force for `model` (its workloads are shared).
    pub(crate) fn build(
        config: Option<&VisibilityConfig>,
        model: &Model,
        enforced: &Snapshot,
    ) -> Policy {
        // The enforced side needs only each entry's visibility; the audit side its whole
        // resolution, for its snapshot.
        let now = visibility::visibilities(model);
        let audited = visibility::resolve_under(model, config);
        let differs = Differs::new(
            now.iter()
                .zip(&audited.entries)
                .filter(|(now, audit)| **now != audit.visibility)
                .map(|(now, audit)| {
                    let key = (audit.namespace.clone(), audit.name.clone());
                    (key, (*now, audit.visibility))
                }),
        );
        let snapshot = enforced.with_services(model, &audited);
        let mut addresses: Vec<IpNet> = [enforced, &snapshot]
            .into_iter()
            .flat_map(|s| s.services())
            .filter(|s| differs.contains(s))
            .flat_map(|s| s.vips().map(IpNet::from).chain(s.cidrs.iter().copied()))
            .collect();
        addresses.sort();
        addresses.dedup();
        Policy {
            snapshot,
            differs,
            addresses,
        }
    }

    /// The addresses the kernel must report its decisions for.
    pub(crate) fn addresses(&self) -> &[IpNet] {
        &self.addresses
    }
}

/// The audit file as last read.
#[derive(Debug, Default)]
struct FileState {
    /// The last good `serviceEntryVisibility` (`None`: unset, so the audit policy is inert and every
    /// entry is PUBLIC under it).
    config: Option<VisibilityConfig>,
    /// Whether a good version was ever read: until then, nothing is audited.
    read: bool,
    loaded_at: Option<String>,
    last_error: Option<Vec<ConfigError>>,
}

pub(crate) struct Audit {
    file: PathBuf,
    state: Mutex<FileState>,
    policy: ArcSwapOption<Policy>,
    /// What the policy was last built from, to build it again when only the audit file changes.
    inputs: Mutex<Option<(Model, Arc<Snapshot>)>>,
    ledger: Mutex<Ledger>,
    metrics: Arc<AuditMetrics>,
    /// Bumped with every policy put in force (the fast path marks its addresses).
    generation: tokio::sync::watch::Sender<u64>,
}

/// What `/audit` reports.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AuditReport {
    pub file: String,
    /// The audit policy's `serviceEntryVisibility` in force (`None`: unset, inert).
    pub service_entry_visibility: Option<VisibilityConfig>,
    pub loaded_at: Option<String>,
    /// The errors of the last read of the file; the version before stays in force.
    pub last_error: Option<Vec<ConfigError>>,
    /// ServiceEntries whose visibility the audit policy changes.
    pub entries_changed: usize,
    /// Changes of pairs past the bound, not recorded by pair.
    pub unrecorded: u64,
    pub changes: Vec<PairReport>,
}

impl Audit {
    /// The audit of `file`, read once now: a file in error is logged and reported, and nothing is
    /// audited until a good version is read.
    pub(crate) fn new(file: PathBuf, metrics: Arc<AuditMetrics>) -> Arc<Audit> {
        let audit = Arc::new(Audit {
            file,
            state: Mutex::default(),
            policy: ArcSwapOption::empty(),
            inputs: Mutex::new(None),
            ledger: Mutex::default(),
            metrics,
            generation: tokio::sync::watch::Sender::new(0),
        });
        audit.read_file();
        audit
    }

    pub(crate) fn file(&self) -> &Path {
        &self.file
    }

    /// Reads the audit file again; a good version replaces the one in force and the policy is
    /// built again, a bad one is logged and leaves everything as it was. True when it changed.
    pub(crate) fn reload_file(&self) -> bool {
        if !self.read_file() {
            return false;
        }
        let inputs = self.inputs.locked().clone();
        if let Some((model, enforced)) = inputs {
            self.put_in_force(&model, &enforced);
        }
        true
    }

    /// Reads the file; true when a good version unlike the one before was read.
    fn read_file(&self) -> bool {
        let file = self.file.display().to_string();
        match config::read_mesh_file(&self.file) {
            Ok(mesh) => {
                let mut state = self.state.locked();
                state.last_error = None;
                let config = mesh.service_entry_visibility;
                if state.read && state.config == config {
                    return false;
                }
                info!(
                    file,
                    configured = config.is_some(),
                    "audit mesh config read"
                );
                state.config = config;
                state.read = true;
                state.loaded_at = Some(now_rfc3339());
                true
            }
            Err(errors) => {
                config::log_errors(
                    &errors.0,
                    "audit mesh config refused, the one before stays (enforcement is untouched): ",
                );
                self.state.locked().last_error = Some(errors.0);
                false
            }
        }
    }

    /// Builds the policy for a configuration just put in force: `model`, and `enforced` its
    /// snapshot. Takes tens of milliseconds at 10,000 entries: off the async workers.
    pub(crate) fn rebuild(&self, model: Model, enforced: Arc<Snapshot>) {
        self.put_in_force(&model, &enforced);
        *self.inputs.locked() = Some((model, enforced));
    }

    fn put_in_force(&self, model: &Model, enforced: &Snapshot) {
        let state = self.state.locked();
        if !state.read {
            return;
        }
        let config = state.config.clone();
        drop(state);
        let policy = Policy::build(config.as_ref(), model, enforced);
        self.policy.store(Some(Arc::new(policy)));
        self.generation.send_modify(|g| *g += 1);
    }

    /// The policy in force, if one is.
    pub(crate) fn policy(&self) -> Option<Arc<Policy>> {
        self.policy.load_full()
    }

    /// A receiver that changes with every policy put in force.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Audits a DNS decision: `enforced` is what the client was answered, `client` names it for the
    /// report (only called when a change is recorded).
    pub(crate) fn dns(
        &self,
        client_ns: Option<&str>,
        client: impl FnOnce() -> Option<String>,
        qname: &str,
        enforced: &DnsDecision<'_, '_>,
    ) {
        // A guard, not a clone of the `Arc`: this runs for every query.
        let policy = self.policy.load();
        let Some(policy) = policy.as_deref() else {
            return;
        };
        if policy.differs.is_empty() {
            return;
        }
        let audited = policy.snapshot.decide_dns(client_ns, qname);
        let change = compare(
            enforced.service(),
            audited.service(),
            client_ns,
            &policy.differs,
        );
        if let Some(change) = change {
            self.note(client_ns, &change, Lookup::Dns, client);
        }
    }

    /// Audits a connection decision to `ip:port`: `enforced` is the service the decision in force
    /// used (whoever made it, kernel or proxy).
    pub(crate) fn connect(
        &self,
        client_ns: Option<&str>,
        client: impl FnOnce() -> Option<String>,
        (ip, port): (IpAddr, u16),
        enforced: Option<&Service>,
    ) {
        let policy = self.policy.load();
        let Some(policy) = policy.as_deref() else {
            return;
        };
        if policy.differs.is_empty() {
            return;
        }
        let audited = policy
            .snapshot
            .decide_outbound_with(client_ns, ip, port, Pick::Peek);
        let change = compare(enforced, audited.service(), client_ns, &policy.differs);
        if let Some(change) = change {
            self.note(client_ns, &change, Lookup::Connect, client);
        }
    }

    /// Counts one change, and logs it when it is new or its pair was not logged for a minute.
    fn note(
        &self,
        client_ns: Option<&str>,
        change: &Change<'_>,
        lookup: Lookup,
        client: impl FnOnce() -> Option<String>,
    ) {
        let client = client();
        let now = (SystemTime::now(), Instant::now());
        let recorded = self
            .ledger
            .locked()
            .record(client_ns, change, lookup, client.clone(), now);
        let since = match recorded {
            Recorded::Unrecorded => return self.metrics.unrecorded(),
            Recorded::Quiet => return self.metrics.change(client_ns, change, lookup),
            Recorded::New => 1,
            Recorded::Log { since } => since,
        };
        self.metrics.change(client_ns, change, lookup);
        info!(
            client_namespace = client_ns.unwrap_or("<unknown>"),
            service = %format_args!("{}/{}", change.service_namespace, change.service),
            kind = lookup.as_str(),
            change = change.direction.as_str(),
            client = client.as_deref().unwrap_or("<unknown>"),
            seen = since,
            "audit: the audit mesh config would change this decision"
        );
    }

    /// What `/audit` shows, the pairs of `client_ns` only when given.
    pub(crate) fn report(&self, client_ns: Option<&str>) -> AuditReport {
        let state = self.state.locked();
        let (service_entry_visibility, loaded_at, last_error) = (
            state.config.clone(),
            state.loaded_at.clone(),
            state.last_error.clone(),
        );
        drop(state);
        let ledger = self.ledger.locked();
        AuditReport {
            file: self.file.display().to_string(),
            service_entry_visibility,
            loaded_at,
            last_error,
            entries_changed: self.policy().map_or(0, |p| p.differs.len()),
            unrecorded: ledger.unrecorded(),
            changes: ledger.report(client_ns),
        }
    }
}
