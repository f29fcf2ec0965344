//! One status writer per cluster: a `coordination.k8s.io/v1` Lease, held by renewing it, taken
//! over once its holder has not renewed it for the lease's duration. As client-go does, expiry is
//! judged by when this agent last saw the lease change, never by comparing clocks across nodes.
use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tracing::{info, warn};

/// Where the lease lives and who this agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseConfig {
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

/// Whether this agent holds the lease, by its own monotonic clock: when it sent the last renewal
/// the API took. Another agent takes the lease over no sooner than a whole duration after it saw
/// that renewal, so a write sent before [`Tenure::holds`] turns false is this agent's to make
/// however long the process was stopped in between (SIGSTOP, a frozen cgroup, a paused VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tenure {
    renewed: Option<Instant>,
    duration: Duration,
}

impl Tenure {
    fn vacant(duration: Duration) -> Tenure {
        Tenure {
            renewed: None,
            duration,
        }
    }

    /// Whether a write sent now is still this agent's: its last renewal is younger than the lease
    /// duration, less a quarter for the write to reach the API server.
    pub(crate) fn holds(&self) -> bool {
        let deadline = self.duration - self.duration / 4;
        self.renewed.is_some_and(|at| at.elapsed() < deadline)
    }
}

/// The lease held, for the writer to read ([`Tenure::holds`] before each write), and a way to give
/// it up on a graceful stop.
pub(crate) struct Holder {
    pub tenure: watch::Receiver<Tenure>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Holder {
    /// Stops renewing and hands the lease back (its holder cleared), so another agent takes it at
    /// its next try instead of a whole lease later. Bounded: an API server that does not answer
    /// leaves the lease to expire.
    pub(crate) async fn release(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(RELEASE_TIMEOUT, self.task)
            .await
            .is_err()
        {
            warn!("the status writer's lease was not released in time; it expires instead");
        }
    }
}

/// How long a graceful stop waits for the lease to be handed back.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Starts trying to hold the lease.
pub(crate) fn start(client: Client, config: LeaseConfig) -> Holder {
    let (tenure_tx, tenure) = watch::channel(Tenure::vacant(config.duration));
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(hold(client, config, tenure_tx, stopped));
    Holder { tenure, stop, task }
}

/// Keeps trying to hold the lease, telling `tenure` each renewal (its receivers are woken only
/// when it is gained or lost), until `stop`; then releases it if held.
async fn hold(
    client: Client,
    config: LeaseConfig,
    tenure: watch::Sender<Tenure>,
    mut stop: watch::Receiver<bool>,
) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let lease = format!("{}/{}", config.namespace, config.name);
    let mut seen: Option<Seen> = None;
    let mut now = Tenure::vacant(config.duration);
    let mut was_held = false;
    loop {
        let asked = Instant::now();
        match try_hold(&api, &config, &mut seen).await {
            Ok(true) => now.renewed = Some(asked),
            Ok(false) => now.renewed = None,
            // Still the writer while the last renewal lasts (`Tenure::holds`).
            Err(e) => {
                warn!(%lease, error = %e, "cannot read or renew the status writer's lease; retrying")
            }
        }
        let held = now.holds();
        tenure.send_if_modified(|t| {
            *t = now;
            held != was_held
        });
        if held != was_held {
            was_held = held;
            match held {
                true => {
                    info!(%lease, identity = %config.identity, "this agent writes ServiceEntry status now")
                }
                false => info!(%lease, "another agent writes ServiceEntry status"),
            }
        }
        // The holder renews three times a lease; the others look twice as often, so a lease
        // handed back is taken within a sixth of its duration.
        let retry = if held {
            config.duration / 3
        } else {
            config.duration / 6
        };
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = stop.changed() => break,
        }
    }
    // Nothing is written from here on, whatever the release's fate.
    let held = tenure
        .send_replace(Tenure::vacant(config.duration))
        .renewed
        .is_some();
    if held {
        match release(&api, &config).await {
            Ok(()) => info!(%lease, "status writer's lease released"),
            Err(e) => {
                warn!(%lease, error = %e, "cannot release the status writer's lease; it expires instead")
            }
        }
    }
}

/// Hands the lease back if this agent still holds it: no holder, and a duration of one second for
/// agents that judge expiry by it.
async fn release(api: &Api<Lease>, config: &LeaseConfig) -> Result<(), kube::Error> {
    let Some(mut lease) = api.get_opt(&config.name).await? else {
        return Ok(());
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return Ok(());
    }
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.acquire_time = Some(now.clone());
    spec.renew_time = Some(now);
    api.replace(&config.name, &PostParams::default(), &lease)
        .await
        .map(|_| ())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn renewed_ago(ago: Duration, duration: Duration) -> Tenure {
        Tenure {
            renewed: Instant::now().checked_sub(ago),
            duration,
        }
    }

    #[test]
    fn a_renewal_lets_writes_through_for_three_quarters_of_the_lease_whatever_happened_since() {
        let lease = Duration::from_secs(4);
        assert!(!Tenure::vacant(lease).holds());
        assert!(renewed_ago(Duration::ZERO, lease).holds());
        assert!(renewed_ago(Duration::from_millis(2_800), lease).holds());
        // A process stopped past the deadline finds its tenure over when it wakes.
        assert!(!renewed_ago(Duration::from_millis(3_000), lease).holds());
        assert!(!renewed_ago(Duration::from_secs(60), lease).holds());
    }
}
