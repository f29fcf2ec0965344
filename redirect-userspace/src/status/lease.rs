//! One status writer per cluster: a `coordination.k8s.io/v1` Lease, held by renewing it, taken
//! over once its holder has not renewed it for the lease's duration. As client-go does, expiry is
//! judged by when this agent last saw the lease change, never by comparing clocks across nodes.
use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use tokio::{sync::watch, time::Instant};
use tracing::{info, warn};

/// Where the lease lives and who this agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// Unique per agent: the node's name and the process id.
    pub identity: String,
    /// How long a holder that stopped renewing keeps the lease.
    pub duration: Duration,
}

/// What this agent last saw of the lease: a record that has not changed for a whole lease
/// duration has a holder that stopped renewing.
struct Seen {
    record: (Option<String>, Option<MicroTime>),
    since: Instant,
}

/// Keeps trying to hold the lease, telling `leading` whether it does, until `leading` has no
/// receiver left.
pub async fn hold(client: Client, config: LeaseConfig, leading: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let retry = config.duration / 3;
    let mut seen: Option<Seen> = None;
    let mut last_renewed: Option<Instant> = None;
    loop {
        let held = match try_hold(&api, &config, &mut seen).await {
            Ok(held) => {
                if held {
                    last_renewed = Some(Instant::now());
                }
                held
            }
            Err(e) => {
                warn!(lease = %config.name, error = %e, "cannot read or renew the status writer's lease; retrying");
                // Still the writer until the lease could have passed to another agent.
                *leading.borrow() && last_renewed.is_some_and(|at| at.elapsed() < config.duration)
            }
        };
        let was = leading.send_replace(held);
        if held != was {
            match held {
                true => {
                    info!(lease = %format!("{}/{}", config.namespace, config.name), identity = %config.identity, "this agent writes ServiceEntry status now")
                }
                false => {
                    info!(lease = %format!("{}/{}", config.namespace, config.name), "another agent writes ServiceEntry status")
                }
            }
        }
        if leading.is_closed() {
            return;
        }
        tokio::time::sleep(retry).await;
    }
}

/// One round: create the lease, renew it, or take it over once expired. Ok(true) when held.
async fn try_hold(
    api: &Api<Lease>,
    config: &LeaseConfig,
    seen: &mut Option<Seen>,
) -> Result<bool, kube::Error> {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let seconds = i32::try_from(config.duration.as_secs()).unwrap_or(i32::MAX);
    let Some(mut lease) = api.get_opt(&config.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(config.name.clone()),
                namespace: Some(config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(config.identity.clone()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return accepted(api.create(&PostParams::default(), &lease).await);
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let record = (spec.holder_identity.clone(), spec.renew_time.clone());
    let mine = spec.holder_identity.as_deref() == Some(config.identity.as_str());
    let vacant = spec.holder_identity.as_deref().is_none_or(str::is_empty);
    let stale = match seen {
        Some(s) if s.record == record => s.since.elapsed() >= config.duration,
        _ => {
            *seen = Some(Seen {
                record,
                since: Instant::now(),
            });
            false
        }
    };
    if !mine && !vacant && !stale {
        return Ok(false);
    }
    if !mine {
        spec.holder_identity = Some(config.identity.clone());
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(now);
    spec.lease_duration_seconds = Some(seconds);
    accepted(
        api.replace(&config.name, &PostParams::default(), &lease)
            .await,
    )
}

/// A write the API took means the lease is held; a conflict means another agent got there first.
fn accepted(result: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
