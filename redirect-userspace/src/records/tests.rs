//! The records' hub: what it keeps, what a follower gets, what it counts and within what bounds.
use std::sync::Arc;

use super::*;
use crate::metrics::{encode, registry_of};

fn hub() -> (Connections, Arc<RecordMetrics>) {
    let metrics = Arc::new(RecordMetrics::default());
    (Connections::new(false, metrics.clone()), metrics)
}

fn record(event: Event, namespace: &str, service: Option<&str>) -> Record {
    let mut r = Record::new(event, DecidedBy::Kernel);
    r.namespace = Some(namespace.into());
    r.service = service.map(Name::from);
    r.outcome = OutboundOutcome::Service;
    if event == Event::Close {
        (r.bytes_sent, r.bytes_received) = (10, 200);
    }
    r
}

fn metrics_text(metrics: &RecordMetrics) -> String {
    encode(&registry_of(|r| metrics.register(r))).unwrap()
}

#[test]
fn the_recent_records_keep_the_newest_within_their_bound_and_filter_by_namespace_and_service() {
    let (hub, _) = hub();
    for i in 0..RECENT + 10 {
        let ns = if i % 2 == 0 { "team-a" } else { "team-b" };
        hub.record(record(Event::Open, ns, Some("team-a/api")));
    }
    assert_eq!(hub.recent(&Filter::default()).len(), RECENT);
    let team_a = Filter {
        namespace: Some("team-a".into()),
        ..Filter::default()
    };
    let only_a = hub.recent(&team_a);
    assert_eq!(only_a.len(), RECENT / 2);
    assert!(
        only_a
            .iter()
            .all(|r| r.namespace.as_deref() == Some("team-a"))
    );
    let other_service = Filter {
        service: Some("team-b/api".into()),
        ..Filter::default()
    };
    assert!(hub.recent(&other_service).is_empty());
}

#[tokio::test]
async fn a_follower_gets_each_record_after_it_subscribed_in_order() {
    let (hub, _) = hub();
    hub.record(record(Event::Open, "team-a", None));
    let mut follower = hub.follow();
    hub.record(record(Event::Open, "team-b", None));
    hub.record(record(Event::Close, "team-b", None));
    let first = follower.recv().await.unwrap();
    let second = follower.recv().await.unwrap();
    assert_eq!(
        (first.event, first.namespace.as_deref()),
        (Event::Open, Some("team-b"))
    );
    assert_eq!(second.event, Event::Close);
    assert!(follower.try_recv().is_err(), "nothing more");
}

#[test]
fn a_service_counts_a_connection_at_its_open_and_its_bytes_at_its_close_by_decider() {
    let (hub, metrics) = hub();
    hub.record(record(Event::Open, "team-a", Some("team-a/api")));
    hub.record(record(Event::Close, "team-a", Some("team-a/api")));
    // No service (a passthrough): counted by outcome elsewhere, not here.
    hub.record(record(Event::Open, "team-a", None));
    let text = metrics_text(&metrics);
    let series =
        r#"decided_by="kernel",client_namespace="team-a",service_namespace="team-a",service="api""#;
    assert!(
        text.contains(&format!("redirect_service_connections_total{{{series}}} 1")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "redirect_service_bytes_total{{{series},direction=\"received\"}} 200"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "redirect_service_bytes_total{{{series},direction=\"sent\"}} 10"
        )),
        "{text}"
    );
}

#[test]
fn past_the_bound_a_new_series_is_counted_apart_and_the_known_ones_go_on() {
    let (hub, metrics) = hub();
    for i in 0..metrics::MAX_SERVICE_SERIES {
        hub.record(record(Event::Open, "team-a", Some(&format!("ns/svc-{i}"))));
    }
    hub.record(record(Event::Open, "team-a", Some("ns/one-too-many")));
    hub.record(record(Event::Open, "team-a", Some("ns/svc-0")));
    let text = metrics_text(&metrics);
    assert!(
        text.contains("redirect_service_records_unrecorded_total 1"),
        "{}",
        &text[text.len().saturating_sub(600)..]
    );
    assert!(!text.contains("one-too-many"));
    assert!(text.contains(r#"service="svc-0"} 2"#));
}

#[test]
fn a_record_serializes_with_the_names_the_cli_reads() {
    let mut r = record(Event::Close, "team-a", Some("team-a/api"));
    r.duration = Some(std::time::Duration::from_millis(42));
    r.end = Some("closed");
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "event",
        "decidedBy",
        "time",
        "client",
        "workload",
        "namespace",
        "origDst",
        "outcome",
        "service",
        "endpoint",
        "bytesSent",
        "bytesReceived",
        "durationMs",
        "end",
    ] {
        assert!(json.get(key).is_some(), "{key} missing: {json}");
    }
    assert_eq!(json["event"], "close");
    assert_eq!(json["decidedBy"], "kernel");
    assert_eq!(json["outcome"], "service");
    assert_eq!(json["durationMs"], 42);
}
