//! The targets, judged on this run's figures (medians; ratios paired by round).
use super::control::{Criterion, Memory};
use super::model::{Metric, Results, Route};

pub(crate) struct Verdict {
    pub target: String,
    pub measured: String,
    /// None: not measured in this run.
    pub met: Option<bool>,
}

const MIB: f64 = 1024.0;
/// One-core rate the agent must answer DNS at.
pub(crate) const DNS_ANSWERED_QPS: f64 = 50_000.0;
/// Forwarded DNS queries per second, as a share of asking the upstream directly.
pub(crate) const DNS_FORWARDED_RATIO: f64 = 0.7;
pub(crate) const LOOKUP_NS: f64 = 200.0;
pub(crate) const BUILD_MS: f64 = 100.0;
pub(crate) const RSS_MIB: f64 = 64.0;
/// Criterion ids of the pathological-configuration benches (bench/benches/config_bounds.rs).
pub(crate) const CONFIG_BOUNDS: &str = "config_bounds/";

/// The ratio targets: metric, bound, whether the ratio must be at least (true) or at most the bound.
pub(crate) const RATIO_TARGETS: [(Metric, f64, bool); 4] = [
    (Metric::Throughput1, 0.8, true),
    (Metric::LatencyP50, 1.5, false),
    (Metric::LatencyP99, 2.0, false),
    (Metric::ConnRate, 0.5, true),
];

/// As the agent runs by default (the fast path): service (STATIC and DNS-resolved) and passthrough
/// at the speed of the direct path, also with a big cluster's config.
pub(crate) const FAST_PATH_TARGETS: [(Metric, f64, bool); 3] = [
    (Metric::Throughput1, 0.97, true),
    (Metric::LatencyP50, 1.05, false),
    (Metric::ConnRate, 0.9, true),
];

pub(crate) fn judge(
    results: &Results,
    criterion: &[Criterion],
    memory: Option<&Memory>,
) -> Vec<Verdict> {
    let mut out = Vec::new();
    let proxied = RATIO_TARGETS
        .iter()
        .flat_map(|t| [(*t, Route::Service), (*t, Route::Passthrough)]);
    let fast = FAST_PATH_TARGETS.iter().flat_map(|t| {
        [
            (*t, Route::FastService),
            (*t, Route::FastDnsService),
            (*t, Route::FastPassthrough),
            (*t, Route::FastServiceAtSize),
            (*t, Route::FastPassthroughAtSize),
        ]
    });
    for ((metric, bound, at_least), route) in proxied.chain(fast) {
        let ratio = results.ratio(metric, route);
        out.push(Verdict {
            target: format!(
                "{} {} {} {bound}× direct",
                metric.label(),
                route.label(),
                if at_least { "≥" } else { "≤" }
            ),
            measured: ratio.map_or("not measured".into(), |r| {
                format!("{:.2}× ({:.2}–{:.2})", r.median, r.min, r.max)
            }),
            met: ratio.map(|r| {
                if at_least {
                    r.median >= bound
                } else {
                    r.median <= bound
                }
            }),
        });
    }
    let dns = results.summary(Metric::DnsQps, Route::DnsAnswered);
    out.push(Verdict {
        target: format!("DNS answered by the agent ≥ {DNS_ANSWERED_QPS:.0} queries/s on one core"),
        measured: dns.map_or("not measured".into(), |s| {
            format!("{:.0} queries/s", s.median)
        }),
        met: dns.map(|s| s.median >= DNS_ANSWERED_QPS),
    });
    // Forwarded names as a cluster DNS answers them (with a TTL), and the worst case (TTL 0: every
    // query goes upstream), each against the same target.
    for (route, what) in [
        (Route::DnsCached, "answer with a TTL"),
        (Route::DnsForwarded, "TTL 0, every query upstream"),
    ] {
        let forwarded = results.ratio(Metric::DnsQps, route);
        out.push(Verdict {
            target: format!(
                "DNS forwarded by the agent ({what}) ≥ {DNS_FORWARDED_RATIO}× straight to upstream"
            ),
            measured: forwarded.map_or("not measured".into(), |r| {
                format!("{:.2}× ({:.2}–{:.2})", r.median, r.min, r.max)
            }),
            met: forwarded.map(|r| r.median >= DNS_FORWARDED_RATIO),
        });
    }
    let lookups: Vec<&Criterion> = criterion
        .iter()
        .filter(|c| !c.id.starts_with("state_build") && !c.id.starts_with(CONFIG_BOUNDS))
        .collect();
    let slowest = lookups
        .iter()
        .max_by(|a, b| a.median_ns.total_cmp(&b.median_ns));
    out.push(Verdict {
        target: format!("every lookup ≤ {LOOKUP_NS:.0} ns at 10,000 entries"),
        measured: slowest.map_or("not measured".into(), |c| {
            format!("slowest {:.0} ns ({})", c.median_ns, c.id)
        }),
        met: slowest.map(|c| c.median_ns <= LOOKUP_NS),
    });
    let build = criterion.iter().find(|c| c.id.starts_with("state_build"));
    out.push(Verdict {
        target: format!("state build for 10,000 entries ≤ {BUILD_MS:.0} ms"),
        measured: build.map_or("not measured".into(), |c| {
            format!("{:.1} ms", c.median_ns / 1e6)
        }),
        met: build.map(|c| c.median_ns / 1e6 <= BUILD_MS),
    });
    let bounds = criterion
        .iter()
        .filter(|c| c.id.starts_with(CONFIG_BOUNDS))
        .max_by(|a, b| a.median_ns.total_cmp(&b.median_ns));
    out.push(Verdict {
        target: "pathological config (100k hosts, 65,535 ports, 100k-deep nesting, alias bomb) refused or loaded ≤ 1 s each".into(),
        measured: bounds.map_or("not measured".into(), |c| {
            format!("slowest {:.1} ms ({})", c.median_ns / 1e6, c.id)
        }),
        met: bounds.map(|c| c.median_ns <= 1e9),
    });
    out.push(Verdict {
        target: format!("agent RSS with 10,000 entries ≤ {RSS_MIB:.0} MiB"),
        measured: memory.map_or("not measured".into(), |m| {
            format!(
                "{:.1} MiB (peak {:.1} MiB)",
                m.rss_kib as f64 / MIB,
                m.peak_kib as f64 / MIB
            )
        }),
        met: memory.map(|m| m.rss_kib as f64 / MIB <= RSS_MIB),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_targets_are_judged_on_the_median() {
        let mut r = Results::new(3);
        for (round, direct, service) in [(0, 10.0, 7.0), (1, 10.0, 8.5), (2, 10.0, 9.0)] {
            r.record(round, Metric::Throughput1, Route::Direct, Some(direct));
            r.record(round, Metric::Throughput1, Route::Service, Some(service));
        }
        let v = judge(&r, &[], None);
        let tput = v
            .iter()
            .find(|v| v.target.starts_with("throughput, 1 stream service"))
            .unwrap();
        assert_eq!(tput.met, Some(true), "{}", tput.measured);
        let latency = v
            .iter()
            .find(|v| v.target.starts_with("latency p50 service"))
            .unwrap();
        assert_eq!(latency.met, None);
    }

    #[test]
    fn control_plane_targets() {
        let c = |id: &str, ns: f64| Criterion {
            id: id.into(),
            median_ns: ns,
            lower_ns: ns,
            upper_ns: ns,
        };
        let criterion = [
            c("state_build/10k_entries_1k_namespaces", 150e6),
            c("by_ip/own_namespace_service", 40.0),
            c("by_host/exact", 250.0),
            c("config_bounds/100k_hosts", 300e6),
        ];
        let memory = Memory {
            rss_kib: 30 * 1024,
            peak_kib: 70 * 1024,
            ready: std::time::Duration::from_secs(1),
            services: 10_000,
        };
        let v = judge(&Results::new(1), &criterion, Some(&memory));
        let met = |prefix: &str| v.iter().find(|v| v.target.starts_with(prefix)).unwrap().met;
        assert_eq!(met("every lookup"), Some(false));
        assert_eq!(met("state build"), Some(false));
        assert_eq!(met("agent RSS"), Some(true));
        assert_eq!(met("DNS answered"), None);
        assert_eq!(met("DNS forwarded"), None);
        assert_eq!(met("pathological config"), Some(true));
        let lookups = v
            .iter()
            .find(|v| v.target.starts_with("every lookup"))
            .unwrap();
        assert!(
            lookups.measured.contains("by_host/exact"),
            "{}",
            lookups.measured
        );
    }
}
