//! The writer: while this agent holds the lease, keeps each ServiceEntry's conditions equal to
//! what `resolve` computes. Compares first (a restart over unchanged entries writes nothing),
//! writes only what differs, at a bounded rate, each failure retried with backoff.
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
};
use serde_json::{Value, json};
use tokio::{sync::watch, time::Instant};
use tracing::{debug, info, warn};

use super::{
    Inputs, Report,
    lease::Tenure,
    observed::FIELD_MANAGER,
    plan::{Plan, plan},
};
use crate::{clock::now_rfc3339, metrics::Metrics};

/// Status writes per second at most: 10,000 changed entries take under four minutes, and the API
/// server never sees a burst from this agent.
pub(super) const WRITES_PER_SECOND: u32 = 50;
/// How often the whole set is compared again, whatever changed.
const RECHECK: Duration = Duration::from_secs(5);
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(60);

type Key = (String, String);

/// A failed write: when to try again, and the wait after that.
struct Retry {
    at: Instant,
    next: Duration,
}

pub(super) async fn run(
    client: Client,
    mut inputs: watch::Receiver<Inputs>,
    mut leading: watch::Receiver<Tenure>,
    report: Arc<std::sync::Mutex<Report>>,
    metrics: Arc<Metrics>,
) {
    // The version each write was made over: until the watch shows a newer one, nothing is written
    // again for that entry (the API has it, the agent has not seen it yet).
    let mut written: HashMap<Key, String> = HashMap::new();
    let mut retries: HashMap<Key, Retry> = HashMap::new();
    let mut others: BTreeMap<Key, String> = BTreeMap::new();
    let pause = Duration::from_secs(1) / WRITES_PER_SECOND;
    loop {
        tokio::select! {
            changed = inputs.changed() => if changed.is_err() { return },
            changed = leading.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(RECHECK) => {}
        }
        let is_leader = leading.borrow_and_update().holds();
        if let Ok(mut r) = report.lock() {
            r.leading = is_leader;
        }
        if !is_leader {
            written.clear();
            retries.clear();
            continue;
        }
        let current = inputs.borrow_and_update().clone();
        let Some(api_version) = current.api_version.as_deref() else {
            continue;
        };
        let api = entries_api(&client, api_version);
        for want in current.desired.iter() {
            // Checked before each write, not once a batch: a writer stopped mid-batch for longer
            // than the lease may find another agent writing when it wakes.
            if !leading.borrow().holds() {
                info!("the status writer's lease ran out mid-batch; stopping the writes");
                written.clear();
                retries.clear();
                break;
            }
            let key = (want.namespace.clone(), want.name.clone());
            let Some(observed) = current.observed.get(&key) else {
                continue;
            };
            if written.get(&key) == Some(&observed.resource_version)
                || retries.get(&key).is_some_and(|r| r.at > Instant::now())
            {
                continue;
            }
            let conditions = match plan(&want.conditions, observed, &now_rfc3339()) {
                Plan::Unchanged => {
                    others.remove(&key);
                    continue;
                }
                Plan::OtherWriter(manager) => {
                    if others.insert(key.clone(), manager.clone()).as_ref() != Some(&manager) {
                        info!(entry = %format!("{}/{}", key.0, key.1), %manager, "another controller writes this ServiceEntry's visibility conditions: left as they are");
                    }
                    continue;
                }
                Plan::Write(conditions) => conditions,
            };
            let written_now = api.write(&key, &observed.resource_version, &conditions);
            let outcome = match written_now.await {
                Ok(()) => {
                    debug!(entry = %format!("{}/{}", key.0, key.1), "status conditions written");
                    written.insert(key.clone(), observed.resource_version.clone());
                    retries.remove(&key);
                    "ok"
                }
                // A newer version is on its way through the watch: compared again then.
                Err(kube::Error::Api(s)) if s.code == 409 => "conflict",
                Err(kube::Error::Api(s)) if s.code == 404 => "gone",
                Err(e) => {
                    let retry = retries.entry(key.clone()).or_insert(Retry {
                        at: Instant::now(),
                        next: FIRST_RETRY,
                    });
                    warn!(entry = %format!("{}/{}", key.0, key.1), error = %e, retry_in = ?retry.next, "cannot write the ServiceEntry's status");
                    retry.at = Instant::now() + retry.next;
                    retry.next = (retry.next * 2).min(MAX_RETRY);
                    "error"
                }
            };
            metrics.kube.status_write(outcome);
            if let Ok(mut r) = report.lock() {
                r.count(outcome);
            }
            tokio::time::sleep(pause).await;
        }
        if let Ok(mut r) = report.lock() {
            r.other_writers = others
                .iter()
                .map(|((ns, name), manager)| (format!("{ns}/{name}"), manager.clone()))
                .collect();
        }
    }
}

/// Status writes go to the version the watch found served.
struct EntriesApi {
    client: Client,
    resource: ApiResource,
}

fn entries_api(client: &Client, api_version: &str) -> EntriesApi {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    EntriesApi {
        client: client.clone(),
        resource: ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, "ServiceEntry"),
            "serviceentries",
        ),
    }
}

impl EntriesApi {
    fn within(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &self.resource)
    }

    /// Writes `conditions` as the status of the entry `key`, over `version`: the version read goes
    /// with the write, so that over a newer one the API answers 409.
    async fn write(&self, key: &Key, version: &str, conditions: &[Value]) -> kube::Result<()> {
        let patch = json!({
            "metadata": {"resourceVersion": version},
            "status": {"conditions": conditions},
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        self.within(&key.0)
            .patch_status(&key.1, &params, &Patch::Merge(&patch))
            .await
            .map(drop)
    }
}
