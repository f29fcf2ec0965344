//! The changes seen, one record per (client namespace, service, lookup, direction): counts, first and
//! last seen, an example client, and when it was last logged. Bounded: past [`MAX_PAIRS`] records a
//! new pair is counted as unrecorded and nothing else, so the metric's label sets stay bounded too.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant, SystemTime},
};

use serde::Serialize;

use super::change::{Change, Direction, Lookup};

/// The most pairs kept (and so the most label sets of `redirect_audit_changes_total`).
pub(crate) const MAX_PAIRS: usize = 4096;

/// A pair is logged when first seen, then at most once per this long.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Pair {
    pub client_namespace: String,
    pub service_namespace: String,
    pub service: String,
    pub lookup: Lookup,
    pub direction: Direction,
}

#[derive(Debug, Clone)]
struct Record {
    count: u64,
    first_seen: SystemTime,
    last_seen: SystemTime,
    example_client: Option<String>,
    logged_at: Instant,
    /// Seen since the last log line.
    since_logged: u64,
}

/// What recording one change asks of the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// A pair not seen before: count it and log it.
    New,
    /// Log it, saying how many were seen since the last line.
    Log { since: u64 },
    /// Count it, log nothing.
    Quiet,
    /// No room for another pair: counted as unrecorded only.
    Unrecorded,
}

#[derive(Debug, Default)]
pub(crate) struct Ledger {
    records: BTreeMap<Pair, Record>,
    unrecorded: u64,
}

/// One pair as `/audit` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PairReport {
    pub client_namespace: String,
    pub service_namespace: String,
    pub service: String,
    pub kind: Lookup,
    pub change: Direction,
    pub count: u64,
    pub first_seen: String,
    pub last_seen: String,
    pub example_client: Option<String>,
}

impl Ledger {
    /// Records one change seen by a client of `client_ns` (`<unknown>` for a client the registry
    /// does not name), `client` the example to show (`namespace/pod`).
    pub(crate) fn record(
        &mut self,
        client_ns: Option<&str>,
        change: &Change<'_>,
        lookup: Lookup,
        client: Option<String>,
        now: (SystemTime, Instant),
    ) -> Recorded {
        let pair = Pair {
            client_namespace: client_ns.unwrap_or("<unknown>").to_string(),
            service_namespace: change.service_namespace.to_string(),
            service: change.service.to_string(),
            lookup,
            direction: change.direction,
        };
        let (wall, mono) = now;
        if let Some(record) = self.records.get_mut(&pair) {
            record.count += 1;
            record.last_seen = wall;
            record.since_logged += 1;
            if record.example_client.is_none() {
                record.example_client = client;
            }
            if mono.duration_since(record.logged_at) < LOG_EVERY {
                return Recorded::Quiet;
            }
            let since = record.since_logged;
            record.logged_at = mono;
            record.since_logged = 0;
            return Recorded::Log { since };
        }
        if self.records.len() >= MAX_PAIRS {
            self.unrecorded += 1;
            return Recorded::Unrecorded;
        }
        self.records.insert(
            pair,
            Record {
                count: 1,
                first_seen: wall,
                last_seen: wall,
                example_client: client,
                logged_at: mono,
                since_logged: 0,
            },
        );
        Recorded::New
    }

    /// Changes past [`MAX_PAIRS`], not recorded.
    pub(crate) fn unrecorded(&self) -> u64 {
        self.unrecorded
    }

    /// Every pair, those of `client_ns` only when given, in order.
    pub(crate) fn report(&self, client_ns: Option<&str>) -> Vec<PairReport> {
        let stamp = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
        self.records
            .iter()
            .filter(|(pair, _)| client_ns.is_none_or(|ns| pair.client_namespace == ns))
            .map(|(pair, record)| PairReport {
                client_namespace: pair.client_namespace.clone(),
                service_namespace: pair.service_namespace.clone(),
                service: pair.service.clone(),
                kind: pair.lookup,
                change: pair.direction,
                count: record.count,
                first_seen: stamp(record.first_seen),
                last_seen: stamp(record.last_seen),
                example_client: record.example_client.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(service: &str) -> Change<'_> {
        Change {
            service_namespace: "team-a",
            service,
            direction: Direction::WouldHide,
        }
    }

    #[test]
    fn a_pair_is_logged_first_then_once_a_minute_with_what_it_saw_between() {
        let mut ledger = Ledger::default();
        let (wall, start) = (SystemTime::now(), Instant::now());
        let c = change("api");
        let mut at = |secs| {
            ledger.record(
                Some("team-b"),
                &c,
                Lookup::Dns,
                Some("team-b/client".into()),
                (wall, start + Duration::from_secs(secs)),
            )
        };
        assert_eq!(at(0), Recorded::New);
        assert_eq!(at(1), Recorded::Quiet);
        assert_eq!(at(59), Recorded::Quiet);
        assert_eq!(at(60), Recorded::Log { since: 3 });
        assert_eq!(at(61), Recorded::Quiet);
        let report = ledger.report(None);
        assert_eq!(report.len(), 1);
        assert_eq!(report[0].count, 5);
        assert_eq!(report[0].example_client.as_deref(), Some("team-b/client"));
    }

    #[test]
    fn lookups_and_namespaces_are_pairs_apart_and_the_filter_keeps_one_namespace() {
        let mut ledger = Ledger::default();
        let now = (SystemTime::now(), Instant::now());
        let c = change("api");
        ledger.record(Some("team-b"), &c, Lookup::Dns, None, now);
        ledger.record(Some("team-b"), &c, Lookup::Connect, None, now);
        ledger.record(Some("team-c"), &c, Lookup::Dns, None, now);
        assert_eq!(ledger.report(None).len(), 3);
        let b = ledger.report(Some("team-b"));
        assert_eq!(b.len(), 2);
        assert!(b.iter().all(|p| p.client_namespace == "team-b"));
    }

    #[test]
    fn past_the_bound_new_pairs_are_only_counted() {
        let mut ledger = Ledger::default();
        let now = (SystemTime::now(), Instant::now());
        let names: Vec<String> = (0..=MAX_PAIRS).map(|i| format!("svc-{i}")).collect();
        let results: Vec<Recorded> = names
            .iter()
            .map(|n| ledger.record(Some("team-b"), &change(n), Lookup::Dns, None, now))
            .collect();
        assert_eq!(results[MAX_PAIRS - 1], Recorded::New);
        assert_eq!(results[MAX_PAIRS], Recorded::Unrecorded);
        assert_eq!(ledger.unrecorded(), 1);
        assert_eq!(ledger.report(None).len(), MAX_PAIRS);
        // A pair already held is still counted.
        let again = ledger.record(Some("team-b"), &change("svc-0"), Lookup::Dns, None, now);
        assert_eq!(again, Recorded::Quiet);
    }
}
