//! Proof that a run took the path it is filed under, from the agent's counters and the pod's kernel.
//! A run that fails these is a bench bug (or an agent bug), never a slow run: the bench stops.
use anyhow::{Result, bail};
use integration::Metrics;

use super::model::Route;
use super::wrk;

const OUTCOME: &str = "redirect_outbound_connections_total";
const DNS_OUTCOME: &str = "redirect_dns_queries_total";
/// `redirect_hbone_tunnels_total`'s results other than `ok`.
const TUNNEL_FAILURES: [&str; 5] = [
    "no_identity",
    "connect_failed",
    "tls_refused",
    "peer_refused",
    "status",
];
const OUTCOMES: [&str; 5] = [
    "service",
    "workload",
    "passthrough",
    "no_healthy_upstream",
    "error",
];

/// The agent carried every connection the pod opened (`opens`, from its `ActiveOpens`) under the route's
/// outcome, and none under another.
pub(crate) fn outbound(route: Route, before: &Metrics, after: &Metrics, opens: u64) -> Result<()> {
    if route == Route::FastWaypoint {
        return through_waypoint(route, before, after, opens);
    }
    if matches!(
        route,
        Route::FastService
            | Route::FastPassthrough
            | Route::FastDnsService
            | Route::FastServiceAtSize
            | Route::FastPassthroughAtSize
            | Route::FastServiceAudit
            | Route::FastPassthroughAudit
            | Route::FastServiceNoRecords
            | Route::FastPassthroughNoRecords
    ) {
        return in_kernel(route, before, after, opens);
    }
    let expected = match route {
        Route::Service | Route::ServiceCopy => "service",
        Route::Passthrough | Route::PassthroughCopy => "passthrough",
        other => bail!("{other:?} is not an outbound route"),
    };
    let mut counted = 0.0;
    for outcome in OUTCOMES {
        let d = delta(
            before,
            after,
            &format!("{OUTCOME}{{outcome=\"{outcome}\"}}"),
        );
        if outcome == expected {
            counted = d;
        } else if d > 0.0 {
            bail!(
                "a {} run made {d} `{outcome}` connections in the agent",
                route.label()
            );
        }
    }
    // The pod's count may include a connection the agent refused before counting it: allow 1 %.
    if counted < 1.0 || counted + 0.5 < opens as f64 * 0.99 {
        bail!(
            "a {} run: the pod opened {opens} connections, the agent counted {counted} as `{expected}`",
            route.label()
        );
    }
    Ok(())
}

/// With the fast path: the kernel decided every connection the pod opened under the route's outcome,
/// and the proxy carried none.
fn in_kernel(route: Route, before: &Metrics, after: &Metrics, opens: u64) -> Result<()> {
    let expected = match route {
        Route::FastService
        | Route::FastDnsService
        | Route::FastServiceAtSize
        | Route::FastServiceAudit
        | Route::FastServiceNoRecords => "rewritten",
        _ => "passthrough",
    };
    let counted = delta(
        before,
        after,
        &format!("redirect_fast_path_connections_total{{outcome=\"{expected}\",reason=\"\"}}"),
    );
    for outcome in OUTCOMES {
        let d = delta(
            before,
            after,
            &format!("{OUTCOME}{{outcome=\"{outcome}\"}}"),
        );
        if d > 0.0 {
            bail!(
                "a {} run sent {d} `{outcome}` connections through the proxy",
                route.label()
            );
        }
    }
    if counted < 1.0 || counted + 0.5 < opens as f64 * 0.99 {
        bail!(
            "a {} run: the pod opened {opens} connections, the kernel counted {counted} as `{expected}`",
            route.label()
        );
    }
    Ok(())
}

/// Through a waypoint: the kernel handed every connection the pod opened to the proxy (a service
/// it does not rewrite), the proxy carried each as `service` and nothing else, and opened an HBONE
/// tunnel for each (the waypoint answered 200), none failing.
fn through_waypoint(route: Route, before: &Metrics, after: &Metrics, opens: u64) -> Result<()> {
    for result in TUNNEL_FAILURES {
        let d = delta(
            before,
            after,
            &format!("redirect_hbone_tunnels_total{{result=\"{result}\"}}"),
        );
        if d > 0.0 {
            bail!(
                "a {} run: {d} HBONE tunnels failed `{result}`",
                route.label()
            );
        }
    }
    let mut service = 0.0;
    for outcome in OUTCOMES {
        let d = delta(
            before,
            after,
            &format!("{OUTCOME}{{outcome=\"{outcome}\"}}"),
        );
        if outcome == "service" {
            service = d;
        } else if d > 0.0 {
            bail!(
                "a {} run made {d} `{outcome}` connections in the agent",
                route.label()
            );
        }
    }
    let handed = delta(
        before,
        after,
        "redirect_fast_path_connections_total{outcome=\"proxy\",reason=\"service\"}",
    );
    let tunnels = delta(before, after, "redirect_hbone_tunnels_total{result=\"ok\"}");
    for (counted, what) in [
        (handed, "the kernel handed to the proxy"),
        (service, "the proxy counted as `service`"),
        (tunnels, "HBONE tunnels opened"),
    ] {
        if counted < 1.0 || counted + 0.5 < opens as f64 * 0.99 {
            bail!(
                "a {} run: the pod opened {opens} connections, {what}: {counted}",
                route.label()
            );
        }
    }
    Ok(())
}

/// HBONE tunnels opened, and mutual-TLS connections to waypoints opened (the tunnels share them),
/// between two readings.
pub(crate) fn hbone_use(before: &Metrics, after: &Metrics) -> (u64, u64) {
    (
        delta(before, after, "redirect_hbone_tunnels_total{result=\"ok\"}") as u64,
        delta(before, after, "redirect_hbone_connections_total") as u64,
    )
}

/// The agent answered, forwarded or served from its cache at least every query dnsperf got an
/// answer to, the way the route says, and did nothing else.
pub(crate) fn dns(route: Route, before: &Metrics, after: &Metrics, completed: u64) -> Result<()> {
    let count = |o: &str| delta(before, after, &format!("{DNS_OUTCOME}{{outcome=\"{o}\"}}"));
    let (answered, forwarded, cached) = (count("answered"), count("forwarded"), count("cached"));
    let completed = completed as f64;
    let right = match route {
        Route::DnsAnswered => answered >= completed && forwarded == 0.0 && cached == 0.0,
        Route::DnsForwarded => forwarded >= completed && answered == 0.0 && cached == 0.0,
        // The queries in flight before the first answer is kept, and those when it expires, go
        // upstream: a few per TTL, never a share of the run.
        Route::DnsCached => {
            cached + forwarded >= completed
                && forwarded <= completed / 100.0 + 256.0
                && answered == 0.0
        }
        other => bail!("{other:?} is not a DNS route through the agent"),
    };
    if !right {
        bail!(
            "a DNS run {}: dnsperf got {completed} answers, the agent counted {answered} answered, {forwarded} forwarded, {cached} cached",
            route.label()
        );
    }
    Ok(())
}

/// What the records of a run with the kernel recording every connection cost the log.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogBudget {
    /// Access-log lines written during the run.
    pub lines: u64,
    /// Lines left out for the budget, as the agent counted them.
    pub dropped: u64,
    /// Records the kernel could not report.
    pub lost: u64,
}

/// The access log stayed within its budget (100 lines a second and a burst of as many) over a
/// run of `secs` that opened `opens` connections, and every connection's line was either written
/// or counted as left out (or its record counted lost).
pub(crate) fn log_budget(
    lines: u64,
    before: &Metrics,
    after: &Metrics,
    secs: u32,
    opens: u64,
) -> Result<LogBudget> {
    let budget = LogBudget {
        lines,
        dropped: delta(before, after, "redirect_access_log_lines_dropped_total") as u64,
        lost: delta(before, after, "redirect_connection_records_lost_total") as u64,
    };
    let most = 100 * (u64::from(secs) + 2);
    if lines > most {
        bail!(
            "the access log wrote {lines} lines in a {secs} s run: more than the budget's {most}"
        );
    }
    // A close still in the ring when the counters were read is neither: allow 1 %.
    let accounted = lines + budget.dropped + budget.lost;
    if (accounted as f64) < opens as f64 * 0.99 {
        bail!(
            "{opens} connections, but only {accounted} access-log lines written, left out or lost: {budget:?}"
        );
    }
    Ok(budget)
}

/// wrk's requests were each a connection of their own (the pod's kernel opened about as many), and
/// almost all succeeded.
pub(crate) fn new_connections(report: &wrk::WrkStats, opens: u64) -> Result<()> {
    if (opens as f64) < 0.95 * report.requests as f64 {
        bail!(
            "wrk reported {} requests but the pod opened only {opens} connections: not one connection per request",
            report.requests
        );
    }
    if report.errors * 100 > report.requests {
        bail!(
            "wrk: {} errors in {} requests",
            report.errors,
            report.requests
        );
    }
    Ok(())
}

fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(service: u32, passthrough: u32, answered: u32, forwarded: u32) -> Metrics {
        Metrics::parse(&format!(
            "redirect_outbound_connections_total{{outcome=\"service\"}} {service}\n\
             redirect_outbound_connections_total{{outcome=\"passthrough\"}} {passthrough}\n\
             redirect_dns_queries_total{{outcome=\"answered\"}} {answered}\n\
             redirect_dns_queries_total{{outcome=\"forwarded\"}} {forwarded}\n"
        ))
        .unwrap()
    }

    #[test]
    fn a_service_run_must_be_all_service() {
        let before = metrics(10, 5, 0, 0);
        assert!(outbound(Route::Service, &before, &metrics(19, 5, 0, 0), 9).is_ok());
        assert!(outbound(Route::ServiceCopy, &before, &metrics(19, 5, 0, 0), 9).is_ok());
        let e = outbound(Route::Service, &before, &metrics(19, 6, 0, 0), 10).unwrap_err();
        assert!(e.to_string().contains("`passthrough`"), "{e}");
        let e = outbound(Route::Service, &before, &metrics(12, 5, 0, 0), 9).unwrap_err();
        assert!(e.to_string().contains("opened 9"), "{e}");
        assert!(outbound(Route::Passthrough, &before, &before, 0).is_err());
        assert!(outbound(Route::Direct, &before, &before, 0).is_err());
    }

    #[test]
    fn a_waypoint_run_must_be_handed_over_and_tunnelled() {
        let counters = |handed: u32, service: u32, ok: u32, refused: u32| {
            Metrics::parse(&format!(
                "redirect_fast_path_connections_total{{outcome=\"proxy\",reason=\"service\"}} {handed}\n\
                 redirect_outbound_connections_total{{outcome=\"service\"}} {service}\n\
                 redirect_hbone_tunnels_total{{result=\"ok\"}} {ok}\n\
                 redirect_hbone_tunnels_total{{result=\"tls_refused\"}} {refused}\n"
            ))
            .unwrap()
        };
        let before = counters(0, 0, 0, 0);
        let waypoint = |after| outbound(Route::FastWaypoint, &before, &after, 100);
        assert!(waypoint(counters(100, 100, 100, 0)).is_ok());
        let e = waypoint(counters(100, 100, 0, 0)).unwrap_err();
        assert!(e.to_string().contains("HBONE tunnels opened: 0"), "{e}");
        let e = waypoint(counters(0, 100, 100, 0)).unwrap_err();
        assert!(e.to_string().contains("handed to the proxy"), "{e}");
        let e = waypoint(counters(100, 100, 99, 1)).unwrap_err();
        assert!(e.to_string().contains("`tls_refused`"), "{e}");
    }

    #[test]
    fn a_dns_run_must_be_all_one_outcome() {
        let before = metrics(0, 0, 100, 100);
        assert!(dns(Route::DnsAnswered, &before, &metrics(0, 0, 200, 100), 100).is_ok());
        assert!(dns(Route::DnsAnswered, &before, &metrics(0, 0, 200, 101), 100).is_err());
        assert!(dns(Route::DnsForwarded, &before, &metrics(0, 0, 100, 150), 100).is_err());
        assert!(dns(Route::DnsForwarded, &before, &metrics(0, 0, 100, 300), 200).is_ok());
    }

    #[test]
    fn the_log_holds_its_budget_and_every_connection_is_written_or_counted() {
        let counters = |dropped: u32, lost: u32| {
            Metrics::parse(&format!(
                "redirect_access_log_lines_dropped_total {dropped}\nredirect_connection_records_lost_total {lost}\n"
            ))
            .unwrap()
        };
        let before = counters(0, 0);
        let ok = log_budget(500, &before, &counters(59_500, 0), 4, 60_000).unwrap();
        assert_eq!((ok.lines, ok.dropped, ok.lost), (500, 59_500, 0));
        assert!(log_budget(500, &before, &counters(40_000, 10_000), 4, 60_000).is_err());
        assert!(log_budget(700, &before, &counters(59_300, 0), 4, 60_000).is_err());
    }

    #[test]
    fn connections_are_counted_by_the_kernel() {
        let r = wrk::WrkStats {
            requests: 1000,
            per_second: 500.0,
            errors: 0,
        };
        assert!(new_connections(&r, 1000).is_ok());
        assert!(new_connections(&r, 100).is_err(), "kept-alive connections");
        let failing = wrk::WrkStats { errors: 50, ..r };
        assert!(new_connections(&failing, 1000).is_err());
    }
}
