//! Endpoint host names resolved ahead of connections (`docs/dns.md#resolved-ahead`): the agent asks
//! the upstream for every host name a service's endpoints name (`A` and `AAAA`), keeps each answer
//! for its TTL within [`TTL_FLOOR`] and [`TTL_CAP`], asks again before it expires, and hands the
//! fresh addresses to the fast path's compiler and to the proxy's [`HostCache`]. A name that does
//! not resolve, or whose answer expired without a refresh, has no fresh addresses: the proxy resolves
//! it at connect time, as without this.
//!
//! Bounded, and shared fairly between namespaces (one tenant's thousands of names must not crowd
//! out another's few): the names come from the configuration only (never from a pod's DNS), at most
//! [`MAX_NAMES`] of them, taken round robin across the namespaces that name them; queries leave at
//! most [`NAMES_PER_SECOND`] names a second, and when more are due than that allows, they too go
//! round robin across namespaces. The compiler hears of changed addresses at most once per
//! [`CHANGE_BATCH`]: each time recompiles the whole fast path.
use std::{
    collections::{BTreeMap, BTreeSet, btree_set},
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::{sync::Notify, task::JoinSet};
use tracing::debug;

use super::HostAddresses;
use crate::lock::Locked;
use crate::{
    config::EndpointAddress,
    dns::{HostAnswer, HostCache, ResolveError, Upstream, resolve_host},
    state::Snapshot,
};

/// An answer is kept at least this long, whatever its TTL (a TTL of 0 or 1 would otherwise have
/// the agent ask for it all the time).
pub(crate) const TTL_FLOOR: Duration = Duration::from_secs(5);
/// ... and at most this long: endpoints move, and a long TTL should not pin them (the proxy's cap).
pub(crate) const TTL_CAP: Duration = crate::dns::MAX_KEEP;
/// Host names resolved ahead at most, taken round robin across namespaces (each one's in name
/// order), so a namespace with few names keeps them all; the rest are the proxy's to resolve.
pub(crate) const MAX_NAMES: usize = 4096;
/// Names asked of the upstream per second at most, on average (each is an `A` and an `AAAA`
/// query); [`BURST`] at once after a quiet while.
pub(crate) const NAMES_PER_SECOND: f64 = 50.0;
const BURST: f64 = 100.0;
/// A name is asked again when this share of its answer's life has passed.
const REFRESH_AT: f64 = 0.75;
/// After a failure a name is asked again after this, doubling with each failure up to
/// [`RETRY_MAX`] (its last answer, if still fresh, stays in use meanwhile).
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// The compiler is told of changed fresh addresses at most once per this, changes meanwhile taken
/// together: many names with short TTLs would otherwise have it recompile dozens of times a second.
pub(crate) const CHANGE_BATCH: Duration = Duration::from_millis(100);

/// One name's state.
#[derive(Debug)]
struct Name {
    /// The namespace whose turn took the name (the first of those naming it), for the query rate's
    /// round robin.
    owner: Arc<str>,
    /// Addresses (IPv4 first) and when they expire.
    answer: Option<(Vec<IpAddr>, Instant)>,
    next_query: Instant,
    failures: u32,
    asking: bool,
}

/// The names wanted and what is known of them: the pure part, driven by [`Ahead`] (and tests) with
/// the time passed in.
#[derive(Debug)]
pub(crate) struct AheadSet {
    names: BTreeMap<String, Name>,
    /// Names wanted beyond [`MAX_NAMES`].
    left_out: usize,
    tokens: f64,
    refilled: Instant,
    /// The namespace asked for last: the next round robin of due names starts after it, so even
    /// one token at a time goes round.
    last_served: Option<Arc<str>>,
}

/// What one answer did to the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// The fresh addresses changed (a new name, new addresses, or an answer gone).
    Changed,
    Unchanged,
}

impl AheadSet {
    pub(crate) fn new(now: Instant) -> AheadSet {
        AheadSet {
            names: BTreeMap::new(),
            left_out: 0,
            tokens: BURST,
            refilled: now,
            last_served: None,
        }
    }

    /// Makes `wanted` (namespace -> the names it wants) the names resolved ahead: at most
    /// [`MAX_NAMES`], taken round robin across the namespaces in order, each one's in name order.
    /// New ones are due now, names no longer wanted are dropped.
    pub(crate) fn set_names(
        &mut self,
        wanted: BTreeMap<String, BTreeSet<String>>,
        now: Instant,
    ) -> Recorded {
        let mut turns: Vec<(Arc<str>, btree_set::IntoIter<String>)> = wanted
            .into_iter()
            .map(|(namespace, names)| (Arc::from(namespace), names.into_iter()))
            .collect();
        let mut held: BTreeMap<String, Arc<str>> = BTreeMap::new();
        'rounds: while !turns.is_empty() {
            for (namespace, names) in &mut turns {
                if held.len() == MAX_NAMES {
                    break 'rounds;
                }
                // A name an earlier namespace took is this one's too, without costing it its turn.
                if let Some(name) = names.find(|name| !held.contains_key(name)) {
                    held.insert(name, namespace.clone());
                }
            }
            turns.retain(|(_, names)| names.len() > 0);
        }
        // Counted once however many namespaces want it.
        let left_out: BTreeSet<String> = turns
            .into_iter()
            .flat_map(|(_, names)| names)
            .filter(|name| !held.contains_key(name))
            .collect();
        self.left_out = left_out.len();
        let before = self.names.len();
        let mut changed = false;
        self.names.retain(|name, state| match held.remove(name) {
            Some(owner) => {
                state.owner = owner;
                true
            }
            None => {
                changed |= state.answer.is_some();
                false
            }
        });
        for (name, owner) in held {
            self.names.insert(
                name,
                Name {
                    owner,
                    answer: None,
                    next_query: now,
                    failures: 0,
                    asking: false,
                },
            );
        }
        if changed || before != self.names.len() {
            Recorded::Changed
        } else {
            Recorded::Unchanged
        }
    }

    /// Names wanted beyond [`MAX_NAMES`], left to the proxy.
    pub(crate) fn left_out(&self) -> usize {
        self.left_out
    }

    /// The names to ask now, as many as the rate allows: round robin across the namespaces owning
    /// due names (from the one after the last asked for), each one's longest-waiting first, so a
    /// namespace with thousands due cannot starve another's one. Each is marked as being asked
    /// until [`AheadSet::record`].
    pub(crate) fn due(&mut self, now: Instant) -> Vec<String> {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * NAMES_PER_SECOND).min(BURST);
        self.refilled = now;
        let mut due: Vec<(&Arc<str>, Instant, &String)> = self
            .names
            .iter()
            .filter(|(_, s)| !s.asking && s.next_query <= now)
            .map(|(name, s)| (&s.owner, s.next_query, name))
            .collect();
        due.sort_unstable();
        let n = due.len().min(self.tokens.floor() as usize);
        self.tokens -= n as f64;
        // Each namespace's run of `due`: (next to take, end).
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, (owner, _, _)) in due.iter().enumerate() {
            match runs.last_mut() {
                Some(run) if due[run.0].0 == *owner => run.1 = i + 1,
                _ => runs.push((i, i + 1)),
            }
        }
        let start = self.last_served.as_ref().map_or(0, |last| {
            runs.iter().position(|run| due[run.0].0 > last).unwrap_or(0)
        });
        runs.rotate_left(start);
        let mut names = Vec::with_capacity(n);
        // Rounds beyond the first happen only with fewer namespaces than tokens: short.
        'rounds: while names.len() < n {
            for run in &mut runs {
                if names.len() == n {
                    break 'rounds;
                }
                if run.0 < run.1 {
                    let (owner, _, name) = due[run.0];
                    names.push(name.clone());
                    self.last_served = Some(owner.clone());
                    run.0 += 1;
                }
            }
        }
        for name in &names {
            if let Some(state) = self.names.get_mut(name) {
                state.asking = true;
            }
        }
        names
    }

    /// Records what the upstream said about `name`; on success, returns how long the answer is kept.
    pub(crate) fn record(
        &mut self,
        name: &str,
        outcome: &Result<HostAnswer, ResolveError>,
        now: Instant,
    ) -> (Recorded, Option<Duration>) {
        let Some(state) = self.names.get_mut(name) else {
            // No longer wanted.
            return (Recorded::Unchanged, None);
        };
        state.asking = false;
        match outcome {
            Ok(resolved) if !resolved.addresses.is_empty() => {
                let keep = resolved.ttl.clamp(TTL_FLOOR, TTL_CAP);
                let changed = state
                    .answer
                    .as_ref()
                    .is_none_or(|(old, _)| *old != resolved.addresses);
                state.answer = Some((resolved.addresses.clone(), now + keep));
                state.next_query = now + keep.mul_f64(REFRESH_AT);
                state.failures = 0;
                let recorded = match changed {
                    true => Recorded::Changed,
                    false => Recorded::Unchanged,
                };
                (recorded, Some(keep))
            }
            _ => {
                let retry = RETRY_FIRST
                    .saturating_mul(1 << state.failures.min(16))
                    .min(RETRY_MAX);
                state.failures = state.failures.saturating_add(1);
                state.next_query = now + retry;
                (Recorded::Unchanged, None)
            }
        }
    }

    /// Drops the answers expired by `now` (their names go to the proxy until asked again).
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<String> {
        let mut expired = Vec::new();
        for (name, state) in &mut self.names {
            if state.answer.as_ref().is_some_and(|(_, at)| *at <= now) {
                state.answer = None;
                expired.push(name.clone());
            }
        }
        expired
    }

    /// The fresh addresses of every name that has some.
    pub(crate) fn fresh(&self) -> HostAddresses {
        self.names
            .iter()
            .filter_map(|(name, s)| Some((name.clone(), s.answer.as_ref()?.0.clone())))
            .collect()
    }

    /// When something is next to do: a name due (or, while the rate holds names back, when the
    /// next may go), or an answer expiring.
    pub(crate) fn next_event(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut earliest = |at: Instant| next = Some(next.map_or(at, |n| n.min(at)));
        for state in self.names.values() {
            if !state.asking {
                let mut at = state.next_query;
                if self.tokens < 1.0 {
                    let wait = (1.0 - self.tokens) / NAMES_PER_SECOND;
                    at = at.max(self.refilled + Duration::from_secs_f64(wait));
                }
                earliest(at);
            }
            if let Some((_, expires)) = &state.answer {
                earliest(*expires);
            }
        }
        next
    }
}

/// Every endpoint host name of a service that claims an address, which the kernel could rewrite
/// to once resolved, by the namespace of the service naming it (the unit the bounds are shared by).
pub(crate) fn endpoint_hosts(snapshot: &Snapshot) -> BTreeMap<String, BTreeSet<String>> {
    let mut hosts: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for svc in snapshot
        .services()
        .filter(|svc| svc.vips().next().is_some() || !svc.cidrs.is_empty())
    {
        let mut names = svc
            .ports
            .iter()
            .flat_map(|port| &port.endpoints)
            .filter_map(|ep| match &ep.address {
                EndpointAddress::Host(name) => Some(name),
                EndpointAddress::Ip(_) => None,
            })
            .peekable();
        // No namespace without names.
        if names.peek().is_some() {
            hosts
                .entry(svc.namespace.clone())
                .or_default()
                .extend(names.cloned());
        }
    }
    hosts
}

/// When to tell of changed fresh addresses: the first change schedules one telling
/// [`CHANGE_BATCH`] later, changes until then go with it, and one after it schedules the next.
#[derive(Debug, Default)]
struct Batch {
    due_at: Option<Instant>,
}

impl Batch {
    fn change(&mut self, now: Instant) {
        self.due_at.get_or_insert(now + CHANGE_BATCH);
    }

    fn due_at(&self) -> Option<Instant> {
        self.due_at
    }

    /// Whether to tell now; if so, the changes so far are told.
    fn take(&mut self, now: Instant) -> bool {
        let due = self.due_at.is_some_and(|at| at <= now);
        if due {
            self.due_at = None;
        }
        due
    }
}

/// Counters of the resolution ahead.
#[derive(Debug, Default)]
pub(crate) struct AheadStats {
    pub resolved: AtomicU64,
    pub failed: AtomicU64,
    pub expired: AtomicU64,
}

/// The resolution ahead, running: [`AheadSet`] with the clock, the upstream and the proxy's cache.
pub(crate) struct Ahead {
    upstream: Arc<Upstream>,
    /// The proxy's cache of endpoint host names: it gets every answer, kept as long.
    proxy_cache: Arc<HostCache>,
    set: Mutex<AheadSet>,
    wake: Notify,
    pub stats: AheadStats,
}

impl Ahead {
    pub(crate) fn new(upstream: Arc<Upstream>, proxy_cache: Arc<HostCache>) -> Ahead {
        Ahead {
            upstream,
            proxy_cache,
            set: Mutex::new(AheadSet::new(Instant::now())),
            wake: Notify::new(),
            stats: AheadStats::default(),
        }
    }

    fn set(&self) -> std::sync::MutexGuard<'_, AheadSet> {
        // Plain data: after a panic elsewhere it is still consistent enough to go on with.
        self.set.locked()
    }

    /// Makes the endpoint host names of `snapshot` the names resolved ahead.
    pub(crate) fn follow(&self, snapshot: &Snapshot) -> Recorded {
        let recorded = self
            .set()
            .set_names(endpoint_hosts(snapshot), Instant::now());
        self.wake.notify_one();
        recorded
    }

    /// The fresh addresses of every name that has some.
    pub(crate) fn fresh(&self) -> HostAddresses {
        self.set().fresh()
    }

    pub(crate) fn left_out(&self) -> usize {
        self.set().left_out()
    }

    pub(crate) fn names(&self) -> usize {
        self.set().names.len()
    }

    /// Asks for every name due now and waits for the answers, at most `within`: the first tables
    /// then hold what resolved quickly (the rest follow as it resolves).
    pub(crate) async fn resolve_due(&self, within: Duration) {
        let mut asking = JoinSet::new();
        for name in self.set().due(Instant::now()) {
            let upstream = self.upstream.clone();
            asking.spawn(async move {
                let outcome = resolve_host(&upstream, &name).await;
                (name, outcome)
            });
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, asking.join_next()).await {
                Ok(Some(Ok((name, outcome)))) => {
                    self.record(&name, outcome);
                }
                Ok(Some(Err(_))) => {}
                Ok(None) => return,
                Err(_) => {
                    self.finish_in_background(asking);
                    return;
                }
            }
        }
    }

    fn finish_in_background(
        &self,
        mut asking: JoinSet<(String, Result<HostAnswer, ResolveError>)>,
    ) {
        // The answers still on their way are abandoned: their names are due again, for `run`.
        asking.abort_all();
        let mut set = self.set();
        let now = Instant::now();
        for state in set.names.values_mut() {
            if state.asking {
                state.asking = false;
                state.next_query = now;
            }
        }
        self.wake.notify_one();
    }

    /// Records an answer; true when the fresh addresses changed.
    fn record(&self, name: &str, outcome: Result<HostAnswer, ResolveError>) -> bool {
        let now = Instant::now();
        let (recorded, kept) = self.set().record(name, &outcome, now);
        match (&outcome, kept) {
            (Ok(resolved), Some(keep)) => {
                self.stats.resolved.fetch_add(1, Ordering::Relaxed);
                debug!(endpoint = name, addresses = ?resolved.addresses, ttl = ?resolved.ttl, kept = ?keep, "endpoint host name resolved ahead");
                // The proxy uses the same answer for as long.
                let kept = HostAnswer {
                    addresses: resolved.addresses.clone(),
                    ttl: keep,
                };
                self.proxy_cache.store(name, kept, now);
            }
            (Err(e), _) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                debug!(endpoint = name, error = %e, "endpoint host name did not resolve ahead; the proxy resolves it meanwhile");
            }
            _ => {}
        }
        recorded == Recorded::Changed
    }

    /// Keeps the names resolved until `shutdown` fires; `changed` runs when the fresh addresses
    /// changed, at most once per [`CHANGE_BATCH`] (a change is told within it, never dropped).
    pub(crate) async fn run(
        self: Arc<Self>,
        changed: impl Fn() + Send + Sync + 'static,
        mut shutdown: crate::drain::Watcher,
    ) {
        let mut asking = JoinSet::new();
        let mut batch = Batch::default();
        loop {
            let now = Instant::now();
            let (expired, due, next) = {
                let mut set = self.set();
                let expired = set.expire(now);
                let due = set.due(now);
                (expired, due, set.next_event())
            };
            if !expired.is_empty() {
                self.stats
                    .expired
                    .fetch_add(expired.len() as u64, Ordering::Relaxed);
                debug!(endpoints = ?expired, "answers expired without a refresh; the proxy resolves these names meanwhile");
                batch.change(now);
            }
            if batch.take(now) {
                changed();
            }
            let next = next.into_iter().chain(batch.due_at()).min();
            for name in due {
                let upstream = self.upstream.clone();
                asking.spawn(async move {
                    let outcome = resolve_host(&upstream, &name).await;
                    (name, outcome)
                });
            }
            // A minute at most: a name added meanwhile wakes it anyway.
            let sleep = next
                .map(|at| at.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(60))
                .min(Duration::from_secs(60));
            tokio::select! {
                () = shutdown.stopped() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
                Some(done) = asking.join_next(), if !asking.is_empty() => {
                    if let Ok((name, outcome)) = done
                        && self.record(&name, outcome)
                    {
                        batch.change(Instant::now());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::ResponseCode;

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// `list` wanted by one namespace.
    fn one(list: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
        BTreeMap::from([("default".to_string(), names(list))])
    }

    /// `n` names of namespace `ns`.
    fn many(ns: &str, n: usize) -> (String, BTreeSet<String>) {
        let names = (0..n).map(|i| format!("{ns}-{i:05}.example.org"));
        (ns.to_string(), names.collect())
    }

    fn answer(ips: &[&str], ttl: u64) -> Result<HostAnswer, ResolveError> {
        Ok(HostAnswer {
            addresses: ips.iter().map(|s| s.parse().unwrap()).collect(),
            ttl: Duration::from_secs(ttl),
        })
    }

    fn nxdomain() -> Result<HostAnswer, ResolveError> {
        Err(ResolveError::NoAddress {
            name: "a.example.org".into(),
            code: ResponseCode::NXDomain,
        })
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn an_answer_is_kept_for_its_ttl_refreshed_before_it_ends_and_dropped_after() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        set.set_names(one(&["a.example.org"]), t0);
        assert_eq!(set.due(t0), ["a.example.org"]);
        assert_eq!(set.due(t0), Vec::<String>::new(), "being asked");
        let (recorded, kept) = set.record("a.example.org", &answer(&["198.51.100.1"], 20), t0);
        assert_eq!((recorded, kept), (Recorded::Changed, Some(secs(20))));
        assert_eq!(set.fresh()["a.example.org"], [ip("198.51.100.1")]);
        // Asked again at three quarters of its life, not before.
        assert!(set.due(t0 + secs(14)).is_empty());
        assert_eq!(set.next_event(), Some(t0 + secs(15)));
        assert_eq!(set.due(t0 + secs(15)), ["a.example.org"]);
        // The same addresses again: nothing for the kernel to change; kept 20 s from now.
        let (recorded, _) = set.record(
            "a.example.org",
            &answer(&["198.51.100.1"], 20),
            t0 + secs(15),
        );
        assert_eq!(recorded, Recorded::Unchanged);
        assert!(set.expire(t0 + secs(34)).is_empty());
        // The next refresh fails: the answer still serves until it ends, then it is gone.
        assert_eq!(set.due(t0 + secs(30)), ["a.example.org"]);
        set.record("a.example.org", &nxdomain(), t0 + secs(30));
        assert!(set.fresh().contains_key("a.example.org"));
        assert_eq!(set.expire(t0 + secs(35)), ["a.example.org"]);
        assert!(set.fresh().is_empty());
    }

    #[test]
    fn ttls_below_the_floor_and_above_the_cap_are_held_to_them() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        set.set_names(one(&["short.example.org", "long.example.org"]), t0);
        set.due(t0);
        let (_, kept) = set.record("short.example.org", &answer(&["198.51.100.1"], 0), t0);
        assert_eq!(kept, Some(TTL_FLOOR));
        let (_, kept) = set.record("long.example.org", &answer(&["198.51.100.2"], 86_400), t0);
        assert_eq!(kept, Some(TTL_CAP));
    }

    #[test]
    fn a_failing_name_is_asked_again_later_and_later() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        set.set_names(one(&["a.example.org"]), t0);
        let mut at = t0;
        let mut waits = Vec::new();
        for _ in 0..7 {
            assert_eq!(set.due(at), ["a.example.org"]);
            set.record("a.example.org", &nxdomain(), at);
            let next = set.next_event().unwrap();
            waits.push(next.duration_since(at).as_secs());
            at = next;
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert!(set.fresh().is_empty());
    }

    #[test]
    fn the_names_are_bounded_and_so_is_the_rate_of_queries() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        let wanted: BTreeSet<String> = (0..MAX_NAMES + 10)
            .map(|i| format!("h{i:05}.example.org"))
            .collect();
        set.set_names(BTreeMap::from([("default".to_string(), wanted)]), t0);
        assert_eq!(set.left_out(), 10);
        assert_eq!(set.names.len(), MAX_NAMES);
        assert_eq!(set.due(t0).len(), BURST as usize);
        assert!(set.due(t0).is_empty());
        // A second later, a second's worth.
        assert_eq!(set.due(t0 + secs(1)).len(), NAMES_PER_SECOND as usize);
        // A name no longer wanted is dropped, with its answer.
        let first = "h00000.example.org";
        set.record(first, &answer(&["198.51.100.1"], 60), t0);
        assert_eq!(
            set.set_names(one(&["h00001.example.org"]), t0),
            Recorded::Changed
        );
        assert!(set.fresh().is_empty());
        assert_eq!(set.left_out(), 0);
    }

    #[test]
    fn a_namespace_with_few_names_keeps_them_beside_one_with_thousands() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        // The flood's names come first in name order, and its namespace first too.
        let wanted = BTreeMap::from([many("a-flood", 5000), many("b-few", 1)]);
        set.set_names(wanted.clone(), t0);
        assert_eq!(set.names.len(), MAX_NAMES);
        assert_eq!(set.left_out(), 5001 - MAX_NAMES);
        assert!(set.names.contains_key("b-few-00000.example.org"));
        // The flood's first names, in name order, take the rest.
        let flood = |i: usize| format!("a-flood-{i:05}.example.org");
        assert!(set.names.contains_key(&flood(MAX_NAMES - 2)));
        assert!(!set.names.contains_key(&flood(MAX_NAMES - 1)));
        // The same names wanted, the same names held.
        let mut again = AheadSet::new(t0);
        again.set_names(wanted, t0);
        assert!(set.names.keys().eq(again.names.keys()));
    }

    #[test]
    fn a_name_wanted_by_several_namespaces_is_held_once_and_costs_no_slot() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        let (a, a_names) = many("a", MAX_NAMES);
        let mut b_names = names(&["b-1.example.org", "b-2.example.org"]);
        b_names.insert("a-00000.example.org".to_string());
        let wanted = BTreeMap::from([
            (a, a_names),
            ("b".to_string(), b_names),
            ("c".to_string(), names(&["c-1.example.org"])),
        ]);
        set.set_names(wanted, t0);
        assert_eq!(set.names.len(), MAX_NAMES);
        // MAX_NAMES + 3 names wanted (the shared one counted once), three of `a`'s left out.
        assert_eq!(set.left_out(), 3);
        for name in ["b-1.example.org", "b-2.example.org", "c-1.example.org"] {
            assert!(set.names.contains_key(name), "{name}");
        }
        assert_eq!(&*set.names["a-00000.example.org"].owner, "a");
    }

    #[test]
    fn a_namespace_with_one_due_name_is_asked_beside_one_with_thousands() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        let flood = many("a-flood", 3000);
        set.set_names(BTreeMap::from([flood.clone()]), t0);
        // The other namespace's name comes a second later: every one of the flood waited longer.
        let t1 = t0 + secs(1);
        set.set_names(BTreeMap::from([flood, many("b-one", 1)]), t1);
        let due = set.due(t1);
        assert_eq!(due.len(), BURST as usize);
        assert!(due.iter().any(|name| name == "b-one-00000.example.org"));
        // Within the flood, the longest-waiting (here: name order) first.
        assert!(due.iter().any(|name| name == "a-flood-00000.example.org"));
    }

    #[test]
    fn one_token_at_a_time_still_goes_round_the_namespaces() {
        let t0 = Instant::now();
        let mut set = AheadSet::new(t0);
        let wanted = BTreeMap::from([many("a", 1000), many("b", 1000), many("c", 1)]);
        set.set_names(wanted, t0);
        let mut asked: BTreeMap<String, usize> = BTreeMap::new();
        let mut at = t0;
        for _ in 0..200 {
            for name in set.due(at) {
                *asked.entry(set.names[&name].owner.to_string()).or_default() += 1;
            }
            assert!(asked["a"].abs_diff(asked["b"]) <= 1, "{asked:?}");
            assert_eq!(asked["c"], 1);
            // A token, now and then two.
            at += Duration::from_millis(21);
        }
        assert!(asked["a"] + asked["b"] > 250, "{asked:?}");
    }

    #[test]
    fn changes_within_a_batch_are_told_once_and_a_later_one_again() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut batch = Batch::default();
        assert!(!batch.take(t0));
        assert_eq!(batch.due_at(), None);
        // A change every millisecond: told once, a batch after the first.
        for i in 0..100 {
            batch.change(t0 + ms(i));
            assert!(!batch.take(t0 + ms(i)));
        }
        assert_eq!(batch.due_at(), Some(t0 + CHANGE_BATCH));
        assert!(batch.take(t0 + CHANGE_BATCH));
        assert!(!batch.take(t0 + CHANGE_BATCH + ms(1)));
        assert_eq!(batch.due_at(), None);
        // A change after the telling is not lost: it has its own.
        batch.change(t0 + ms(150));
        assert!(!batch.take(t0 + ms(249)));
        assert!(batch.take(t0 + ms(250)));
        // A second of changes, then quiet: told every batch at most, and after the last change.
        let mut told = Vec::new();
        for i in 1000..2200 {
            if i < 2000 {
                batch.change(t0 + ms(i));
            }
            if batch.take(t0 + ms(i)) {
                told.push(i);
            }
        }
        assert!(told.windows(2).all(|w| w[1] - w[0] >= 100), "{told:?}");
        assert!(told.len() >= 9, "{told:?}");
        assert!(told.last().is_some_and(|last| *last >= 1999), "{told:?}");
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const ENTRIES: &str = "\
kind: MeshConfig
serviceEntryVisibility: {defaultVisibility: PUBLIC}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: httpbin, namespace: team-a}
spec:
  hosts: [httpbin.example.com]
  ports: [{number: 80, name: http}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: team-a}
spec:
  hosts: ['*.wild.example.com']
  ports: [{number: 80, name: http}]
  resolution: DNS
  endpoints: [{address: nowhere.example.org}]
";

    /// An upstream on loopback answering every `A` question with `198.51.100.80` (TTL 60) and
    /// every other with no record; counts the questions.
    async fn upstream() -> (Arc<Upstream>, Arc<AtomicU64>) {
        use hickory_proto::{
            op::{Message, MessageType},
            rr::{RData, Record, RecordType, rdata},
        };
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = Arc::new(Upstream::new(server.local_addr().unwrap()));
        let asked = Arc::new(AtomicU64::new(0));
        let count = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = server.recv_from(&mut buf).await {
                let Ok(mut reply) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                count.fetch_add(1, Ordering::Relaxed);
                let question = reply.queries[0].clone();
                reply.metadata.message_type = MessageType::Response;
                if question.query_type() == RecordType::A {
                    let a = RData::A(rdata::A("198.51.100.80".parse().unwrap()));
                    reply.add_answer(Record::from_rdata(question.name().clone(), 60, a));
                }
                let _ = server.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
        (upstream, asked)
    }

    /// A DNS entry without endpoints for each `(namespace, count)`, its host `{namespace}-{i}`.
    fn entries(namespaces: &[(&str, usize)]) -> String {
        let mut yaml =
            String::from("kind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: PUBLIC}\n");
        for (ns, n) in namespaces {
            yaml += &format!("---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}}}\n");
            for i in 0..*n {
                yaml += &format!(
                    "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\n\
                     metadata: {{name: e{i}, namespace: {ns}}}\nspec:\n  \
                     hosts: [{ns}-{i:05}.example.com]\n  ports: [{{number: 80, name: http}}]\n  \
                     resolution: DNS\n"
                );
            }
        }
        yaml
    }

    /// Many answers arriving together change the addresses each, and are told in batches: at least
    /// [`CHANGE_BATCH`] apart, the last one with every answer.
    #[tokio::test]
    async fn answers_are_told_in_batches_and_the_last_is_not_lost() {
        let yaml = entries(&[("team-a", 60), ("team-b", 1)]);
        let model = crate::config::load_sources([("w.yaml", yaml.as_str())]).unwrap();
        let snapshot = Snapshot::from_model(&model);
        let hosts = endpoint_hosts(&snapshot);
        assert_eq!(hosts.keys().collect::<Vec<_>>(), ["team-a", "team-b"]);
        assert_eq!(hosts["team-a"].len(), 60);
        assert_eq!(hosts["team-b"], names(&["team-b-00000.example.com"]));
        let (upstream, _) = upstream().await;
        let proxy_cache = Arc::new(HostCache::new(upstream.clone()));
        let ahead = Arc::new(Ahead::new(upstream, proxy_cache));
        ahead.follow(&snapshot);
        // Each telling: when, and how many names were fresh by then.
        let told = Arc::new(Mutex::new(Vec::<(Instant, usize)>::new()));
        let changed = {
            let (ahead, told) = (ahead.clone(), told.clone());
            move || {
                told.lock()
                    .unwrap()
                    .push((Instant::now(), ahead.fresh().len()))
            }
        };
        let life = crate::drain::Lifecycle::default();
        let running = tokio::spawn(ahead.clone().run(changed, life.serving()));
        let deadline = Instant::now() + secs(10);
        loop {
            let last = told.lock().unwrap().last().copied();
            if last.is_some_and(|(_, fresh)| fresh == 61) {
                break;
            }
            assert!(Instant::now() < deadline, "told {:?}", told.lock().unwrap());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        life.enter(crate::drain::Phase::ShuttingDown);
        let _ = running.await;
        let told = told.lock().unwrap();
        assert!(
            told.windows(2).all(|w| w[1].0 - w[0].0 >= CHANGE_BATCH),
            "{told:?}"
        );
    }

    /// The host of a DNS entry without endpoints is resolved ahead (an entry without an address,
    /// a wildcard, is not: the kernel never sees a connection to it), and the proxy then connects
    /// to the same address without asking again.
    #[tokio::test]
    async fn names_are_resolved_ahead_and_the_proxy_uses_the_same_answer() {
        let model = crate::config::load_sources([("w.yaml", ENTRIES)]).unwrap();
        let snapshot = Snapshot::from_model(&model);
        assert_eq!(
            endpoint_hosts(&snapshot),
            BTreeMap::from([("team-a".to_string(), names(&["httpbin.example.com"]))])
        );
        let (upstream, asked) = upstream().await;
        let proxy_cache = Arc::new(HostCache::new(upstream.clone()));
        let ahead = Ahead::new(upstream, proxy_cache.clone());
        ahead.follow(&snapshot);
        ahead.resolve_due(Duration::from_secs(2)).await;
        assert_eq!(
            ahead.fresh(),
            HostAddresses::from([("httpbin.example.com".to_string(), vec![ip("198.51.100.80")])])
        );
        assert_eq!(asked.load(Ordering::Relaxed), 2, "A and AAAA");
        let pick = proxy_cache.pick("httpbin.example.com").await.unwrap();
        assert_eq!(pick.first, ip("198.51.100.80"));
        assert_eq!(
            asked.load(Ordering::Relaxed),
            2,
            "the proxy asked nothing more"
        );
    }
}
