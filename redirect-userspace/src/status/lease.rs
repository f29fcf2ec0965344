//! One status writer per cluster: a `coordination.k8s.io/v1` Lease, held by renewing it, taken
//! over once its holder has not renewed it for the lease's duration. As client-go does, expiry is
//! judged by when this agent last saw the lease change, never by comparing clocks across nodes.
//!
//! Every agent watches the one Lease (a list, then a watch, by its name) instead of reading it
//! again and again: the holder renews by writing over the version it last saw, the others learn of
//! each renewal from the watch and write only to take a lease that went stale or was handed back.
use std::{pin::pin, time::Duration};

use futures::StreamExt;
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Api, Client,
    api::PostParams,
    runtime::{WatchStreamExt, watcher},
};
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tracing::{debug, info, warn};

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
        self.lapses().is_some_and(|at| Instant::now() < at)
    }

    /// When [`Tenure::holds`] turns false, unless renewed before.
    fn lapses(&self) -> Option<Instant> {
        let deadline = self.duration - self.duration / 4;
        self.renewed.map(|at| at + deadline)
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
    /// Stops renewing and hands the lease back (its holder cleared), so the other agents take it
    /// as soon as their watch tells them instead of a whole lease later. Bounded: an API server
    /// that does not answer leaves the lease to expire.
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

/// The lease as this agent last saw it, from the watch or from the answer to its own write.
#[derive(Debug, Clone, PartialEq)]
enum Sighting {
    /// The first list has not answered yet: nothing is known, nothing is written.
    Unknown,
    /// The API has no such lease.
    Absent,
    /// Its holder (`None` when handed back) and when this agent last saw its record change.
    Held {
        holder: Option<String>,
        since: Instant,
    },
}

/// What this agent did last: its last renewal the API took, a write refused over the version now
/// seen (409: another agent wrote first; nothing is written until the watch shows the newer
/// version), a write that failed otherwise (retried at `retry_at`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Mine {
    renewed: Option<Instant>,
    refused: bool,
    retry_at: Option<Instant>,
}

/// What to do about the lease now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// There is none: create it, held by this agent.
    Create,
    /// Write it as this agent's: a renewal, or a takeover of a lease stale or handed back.
    Write,
    /// Nothing before this instant, or (`None`) before the watch shows something new.
    Wait(Option<Instant>),
}

/// The holder renews three times a lease; another agent takes the lease once it has seen no change
/// for a whole lease, and at once when it is handed back or deleted.
fn decide(seen: &Sighting, me: &str, mine: Mine, duration: Duration, now: Instant) -> Step {
    let due = |at: Instant| {
        if now >= at {
            Step::Write
        } else {
            Step::Wait(Some(at))
        }
    };
    if mine.refused || *seen == Sighting::Unknown {
        return Step::Wait(None);
    }
    if let Some(at) = mine.retry_at.filter(|at| *at > now) {
        return Step::Wait(Some(at));
    }
    match seen {
        Sighting::Unknown => Step::Wait(None),
        Sighting::Absent => Step::Create,
        Sighting::Held { holder: None, .. } => Step::Write,
        Sighting::Held {
            holder: Some(h), ..
        } if h == me => match mine.renewed {
            Some(at) => due(at + duration / 3),
            None => Step::Write,
        },
        Sighting::Held { since, .. } => due(*since + duration),
    }
}

/// The record a holder's renewal changes: who holds it and when it was renewed.
type Record = (Option<String>, Option<MicroTime>);

/// The lease as last seen, and what the watch's (re)list has shown of it so far.
struct View {
    /// `None` until the first list answers.
    lease: Option<Option<Lease>>,
    record: Option<Record>,
    since: Instant,
    /// While a (re)list is under way: whether it has shown the lease. One that ends without it
    /// means the lease is gone.
    listing: Option<bool>,
    /// The version a write was refused over (`None` inside: over no lease); cleared by a newer.
    refused: Option<Option<String>>,
}

impl View {
    fn new() -> View {
        View {
            lease: None,
            record: None,
            since: Instant::now(),
            listing: None,
            refused: None,
        }
    }

    /// The lease is now `lease`: the clock restarts only if its record changed, so a re-list or
    /// a write that renews nothing does not postpone a takeover.
    fn observe(&mut self, lease: Option<Lease>, now: Instant) {
        let record = lease.as_ref().map(|l| {
            let spec = l.spec.clone().unwrap_or_default();
            let holder = spec.holder_identity.filter(|h| !h.is_empty());
            (holder, spec.renew_time)
        });
        if self.lease.is_none() || record != self.record {
            self.since = now;
        }
        self.record = record;
        self.lease = Some(lease);
        if self.refused.as_ref() != Some(&self.version()) {
            self.refused = None;
        }
    }

    fn version(&self) -> Option<String> {
        self.lease
            .as_ref()
            .and_then(|l| l.as_ref()?.metadata.resource_version.clone())
    }

    fn sighting(&self) -> Sighting {
        match (&self.lease, &self.record) {
            (None, _) => Sighting::Unknown,
            (Some(None), _) | (_, None) => Sighting::Absent,
            (Some(Some(_)), Some((holder, _))) => Sighting::Held {
                holder: holder.clone(),
                since: self.since,
            },
        }
    }

    /// Takes in one event of the watch on the lease.
    fn apply(&mut self, event: watcher::Event<Lease>, name: &str, now: Instant) {
        let named = |l: &Lease| l.metadata.name.as_deref() == Some(name);
        match event {
            watcher::Event::Init => self.listing = Some(false),
            watcher::Event::InitApply(l) if named(&l) => {
                self.listing = Some(true);
                self.observe(Some(l), now);
            }
            watcher::Event::InitDone => {
                if self.listing.take() != Some(true) {
                    self.observe(None, now);
                }
            }
            watcher::Event::Apply(l) if named(&l) => self.observe(Some(l), now),
            watcher::Event::Delete(l) if named(&l) => self.observe(None, now),
            watcher::Event::InitApply(_) | watcher::Event::Apply(_) | watcher::Event::Delete(_) => {
            }
        }
    }
}

/// How long after a failed write (not a conflict) it is tried again, as a share of the lease.
const RETRY_DIVISOR: u32 = 6;

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
    // One object, by name: a list, then a watch from its version; listed again (with backoff)
    // only when the watch fails.
    let selector = format!("metadata.name={}", config.name);
    let mut events =
        pin!(watcher(api.clone(), watcher::Config::default().fields(&selector)).default_backoff());
    let mut view = View::new();
    let mut mine = Mine::default();
    let mut now = Tenure::vacant(config.duration);
    let mut was_held = false;
    loop {
        mine.refused = view.refused.is_some();
        match decide(
            &view.sighting(),
            &config.identity,
            mine,
            config.duration,
            Instant::now(),
        ) {
            Step::Create | Step::Write => {
                write_and_note(&api, &config, &mut view, &mut mine).await;
            }
            Step::Wait(until) => {
                // Woken when the tenure lapses too, to tell the writer.
                let wake = [until, now.lapses().filter(|_| was_held)]
                    .into_iter()
                    .flatten()
                    .min();
                let sleep = async {
                    match wake {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    event = events.next() => match event {
                        Some(Ok(event)) => view.apply(event, &config.name, Instant::now()),
                        Some(Err(e)) => warn!(%lease, error = %e, "watching the status writer's lease failed; listing it again"),
                        None => break,
                    },
                    () = sleep => {}
                    _ = stop.changed() => break,
                }
            }
        }
        // Another holder seen: this agent's tenure is over, whatever it renewed before.
        if let Sighting::Held {
            holder: Some(h), ..
        } = view.sighting()
            && h != config.identity
        {
            mine.renewed = None;
        }
        now.renewed = mine.renewed;
        was_held = tell(&tenure, now, was_held, &config);
    }
    // Nothing is written from here on, whatever the release's fate.
    let held = tenure
        .send_replace(Tenure::vacant(config.duration))
        .renewed
        .is_some();
    if held {
        match release(&api, &config, &view).await {
            Ok(()) => info!(%lease, "status writer's lease released"),
            Err(e) => {
                warn!(%lease, error = %e, "cannot release the status writer's lease; it expires instead")
            }
        }
    }
}

/// One write of the lease ([`write`]) and what it teaches: taken (renewed now, the answer is the
/// version seen), refused (nothing until the watch shows a newer version), or failed (retried a
/// sixth of a lease later; still the writer while the last renewal lasts).
async fn write_and_note(api: &Api<Lease>, config: &LeaseConfig, view: &mut View, mine: &mut Mine) {
    let lease = format!("{}/{}", config.namespace, config.name);
    let asked = Instant::now();
    match write(api, config, view).await {
        Ok(written) => {
            view.observe(Some(written), Instant::now());
            mine.renewed = Some(asked);
            mine.retry_at = None;
        }
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
            debug!(%lease, code = s.code, "another agent wrote the lease first");
            view.refused = Some(view.version());
        }
        Err(e) => {
            warn!(%lease, error = %e, "cannot write the status writer's lease; retrying");
            mine.retry_at = Some(Instant::now() + config.duration / RETRY_DIVISOR);
        }
    }
}

/// Tells the writer the tenure `now` (waking it only when gained or lost), and says it in the log;
/// returns whether it is held.
fn tell(tenure: &watch::Sender<Tenure>, now: Tenure, was_held: bool, config: &LeaseConfig) -> bool {
    let held = now.holds();
    tenure.send_if_modified(|t| {
        *t = now;
        held != was_held
    });
    let lease = format!("{}/{}", config.namespace, config.name);
    match (was_held, held) {
        (false, true) => {
            info!(%lease, identity = %config.identity, "this agent writes ServiceEntry status now")
        }
        (true, false) => info!(%lease, "another agent writes ServiceEntry status"),
        _ => {}
    }
    held
}

/// Creates the lease held by this agent, or writes the one seen as this agent's (renewed, or
/// taken over), over the version seen: a newer one makes the API answer 409.
async fn write(api: &Api<Lease>, config: &LeaseConfig, view: &View) -> kube::Result<Lease> {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let seconds = i32::try_from(config.duration.as_secs()).unwrap_or(i32::MAX);
    let Some(Some(mut lease)) = view.lease.clone() else {
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
        return api.create(&PostParams::default(), &lease).await;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        spec.holder_identity = Some(config.identity.clone());
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(now);
    spec.lease_duration_seconds = Some(seconds);
    api.replace(&config.name, &PostParams::default(), &lease)
        .await
}

/// Hands the lease back if this agent still holds it: no holder, and a duration of one second for
/// agents that judge expiry by it. Written over the version last seen; read again once if that
/// was not the latest.
async fn release(api: &Api<Lease>, config: &LeaseConfig, view: &View) -> kube::Result<()> {
    if let Some(Some(lease)) = view.lease.clone() {
        match hand_back(api, config, lease).await {
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            done => return done,
        }
    }
    match api.get_opt(&config.name).await? {
        Some(lease) => hand_back(api, config, lease).await,
        None => Ok(()),
    }
}

async fn hand_back(api: &Api<Lease>, config: &LeaseConfig, mut lease: Lease) -> kube::Result<()> {
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
        .map(drop)
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

    const LEASE: Duration = Duration::from_secs(3);
    const ME: &str = "node-1_42";

    fn held_by(holder: Option<&str>, since: Instant) -> Sighting {
        Sighting::Held {
            holder: holder.map(str::to_string),
            since,
        }
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn what_to_write_and_when_given_what_was_seen() {
        let t0 = Instant::now();
        let renewed = Mine {
            renewed: Some(t0),
            ..Mine::default()
        };
        let idle = Mine::default();
        struct Case {
            name: &'static str,
            seen: Sighting,
            mine: Mine,
            at: Duration,
            want: Step,
        }
        let cases = [
            Case {
                name: "before the first list: nothing is known, nothing written",
                seen: Sighting::Unknown,
                mine: idle,
                at: secs(60.0),
                want: Step::Wait(None),
            },
            Case {
                name: "no lease: created at once",
                seen: Sighting::Absent,
                mine: idle,
                at: Duration::ZERO,
                want: Step::Create,
            },
            Case {
                name: "handed back (no holder): taken at once",
                seen: held_by(None, t0),
                mine: idle,
                at: Duration::ZERO,
                want: Step::Write,
            },
            Case {
                name: "another's, changed a second ago: wait until a whole lease without change",
                seen: held_by(Some("node-2_7"), t0),
                mine: idle,
                at: secs(1.0),
                want: Step::Wait(Some(t0 + LEASE)),
            },
            Case {
                name: "another's, unchanged for a whole lease: taken over",
                seen: held_by(Some("node-2_7"), t0),
                mine: idle,
                at: LEASE,
                want: Step::Write,
            },
            Case {
                name: "mine, renewed now: the next renewal a third of a lease later",
                seen: held_by(Some(ME), t0),
                mine: renewed,
                at: secs(0.5),
                want: Step::Wait(Some(t0 + LEASE / 3)),
            },
            Case {
                name: "mine, a third of a lease after the renewal: renewed",
                seen: held_by(Some(ME), t0),
                mine: renewed,
                at: LEASE / 3,
                want: Step::Write,
            },
            Case {
                name: "mine by the record, never renewed by this process: renewed at once",
                seen: held_by(Some(ME), t0),
                mine: idle,
                at: Duration::ZERO,
                want: Step::Write,
            },
            Case {
                name: "a write refused over the version seen: nothing until the watch shows a newer",
                seen: held_by(None, t0),
                mine: Mine {
                    refused: true,
                    ..renewed
                },
                at: secs(60.0),
                want: Step::Wait(None),
            },
            Case {
                name: "a failed write: tried again at its retry, not before",
                seen: held_by(Some(ME), t0),
                mine: Mine {
                    retry_at: Some(t0 + secs(2.0)),
                    ..renewed
                },
                at: secs(1.5),
                want: Step::Wait(Some(t0 + secs(2.0))),
            },
            Case {
                name: "a failed write, its retry due: written",
                seen: held_by(Some(ME), t0),
                mine: Mine {
                    retry_at: Some(t0 + secs(2.0)),
                    ..renewed
                },
                at: secs(2.0),
                want: Step::Write,
            },
        ];
        for case in cases {
            let got = decide(&case.seen, ME, case.mine, LEASE, t0 + case.at);
            assert_eq!(got, case.want, "{}", case.name);
        }
    }

    fn lease(holder: Option<&str>, renewed_second: i64, version: &str) -> Lease {
        let at = k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + renewed_second)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        Lease {
            metadata: ObjectMeta {
                name: Some("redirect-status-writer".into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                renew_time: Some(MicroTime(at)),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn the_clock_restarts_when_the_record_changes_and_only_then() {
        let name = "redirect-status-writer";
        let t0 = Instant::now();
        let mut view = View::new();
        assert_eq!(view.sighting(), Sighting::Unknown);
        view.apply(watcher::Event::Init, name, t0);
        view.apply(watcher::Event::InitDone, name, t0);
        assert_eq!(view.sighting(), Sighting::Absent, "a list without it");

        let other = Some("node-2_7");
        view.apply(watcher::Event::Apply(lease(other, 1, "5")), name, t0);
        assert_eq!(view.sighting(), held_by(other, t0));
        // Listed again after a watch failure, unchanged: the clock goes on.
        let t1 = t0 + secs(2.0);
        view.apply(watcher::Event::Init, name, t1);
        view.apply(watcher::Event::InitApply(lease(other, 1, "5")), name, t1);
        view.apply(watcher::Event::InitDone, name, t1);
        assert_eq!(view.sighting(), held_by(other, t0));
        // A renewal restarts it; another lease of the same namespace is not this one.
        view.apply(watcher::Event::Apply(lease(other, 2, "6")), name, t1);
        assert_eq!(view.sighting(), held_by(other, t1));
        let mut stranger = lease(None, 9, "7");
        stranger.metadata.name = Some("someone-elses".into());
        view.apply(watcher::Event::Apply(stranger), name, t1 + secs(1.0));
        assert_eq!(view.sighting(), held_by(other, t1));

        // A write refused over version 6 holds until the watch shows another version.
        view.refused = Some(view.version());
        view.apply(watcher::Event::InitApply(lease(other, 2, "6")), name, t1);
        assert!(view.refused.is_some());
        let handed_back = lease(Some(""), 3, "8");
        view.apply(watcher::Event::Apply(handed_back), name, t1 + secs(1.0));
        assert_eq!(view.refused, None);
        assert_eq!(view.sighting(), held_by(None, t1 + secs(1.0)));
        // A re-list that no longer shows it: gone.
        view.apply(watcher::Event::Init, name, t1 + secs(2.0));
        view.apply(watcher::Event::InitDone, name, t1 + secs(2.0));
        assert_eq!(view.sighting(), Sighting::Absent);
    }
}
