//! What is measured (metrics), over which path (routes), and the runs collected for each pair.
use std::collections::BTreeMap;

use super::stats::{Summary, paired_ratios};

/// How a pod's connection reaches the ext server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Route {
    /// No agent: the pod routes through the node to ext.
    Direct,
    /// Through the proxy to a ServiceEntry endpoint (the pod connects to the entry's VIP).
    Service,
    /// Agent running, nothing claims the destination: the proxy connects to it unchanged.
    Passthrough,
    /// `Service` with `--relay copy` (user-space buffers instead of splice).
    ServiceCopy,
    /// `Passthrough` with `--relay copy`.
    PassthroughCopy,
    /// `Service` as the agent runs by default: the kernel rewrites the VIP to the endpoint at
    /// connect().
    FastService,
    /// `Passthrough` as the agent runs by default: the kernel leaves the socket alone.
    FastPassthrough,
    /// `FastService` with a big cluster's config beside the bench's ([`crate::synthetic::AT_SIZE`]).
    FastServiceAtSize,
    /// `FastPassthrough` with the same big config.
    FastPassthroughAtSize,
    /// `FastService` with an audit policy that sees the entry otherwise: each connection is
    /// reported by the kernel and audited.
    FastServiceAudit,
    /// `FastPassthrough` with the same audit policy (the destination is not audited).
    FastPassthroughAudit,
    /// `FastService` with `--kernel-records off` (the default records every connection).
    FastServiceNoRecords,
    /// `FastPassthrough` with `--kernel-records off`.
    FastPassthroughNoRecords,
    /// A second entry of the same server, bound to a waypoint, as the agent runs by default: the
    /// kernel hands it to the proxy, which tunnels it over HBONE to the waypoint's stand-in, which
    /// connects to the server.
    FastWaypoint,
    /// A `resolution: DNS` entry with an allocated address, as the agent runs by default: the
    /// kernel rewrites the VIP to the address the agent resolved ahead.
    FastDnsService,
    /// DNS straight to the upstream resolver (agent detached).
    DnsUpstream,
    /// DNS through the agent, which forwards every query to the upstream (its answer has TTL 0).
    DnsForwarded,
    /// DNS through the agent for a name whose upstream answer has a TTL: forwarded once per TTL,
    /// the rest answered from the agent's cache.
    DnsCached,
    /// DNS answered by the agent (a visible ServiceEntry owns the name).
    DnsAnswered,
}

impl Route {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::Service => "service",
            Route::Passthrough => "passthrough",
            Route::ServiceCopy => "service (copy)",
            Route::PassthroughCopy => "passthrough (copy)",
            Route::FastService => "service (default: fast path)",
            Route::FastPassthrough => "passthrough (default: fast path)",
            Route::FastServiceAtSize => "service (fast path, 20k entries, 100k pods)",
            Route::FastPassthroughAtSize => "passthrough (fast path, 20k entries, 100k pods)",
            Route::FastServiceAudit => "service (fast path, audited)",
            Route::FastPassthroughAudit => "passthrough (fast path, audit on)",
            Route::FastServiceNoRecords => "service (fast path, kernel records off)",
            Route::FastPassthroughNoRecords => "passthrough (fast path, kernel records off)",
            Route::FastWaypoint => "service through a waypoint (HBONE)",
            Route::FastDnsService => "DNS-resolved service (default: fast path)",
            Route::DnsUpstream => "straight to upstream",
            Route::DnsForwarded => "forwarded by agent (TTL 0)",
            Route::DnsCached => "forwarded by agent (TTL 30 s: cached)",
            Route::DnsAnswered => "answered by agent",
        }
    }

    /// What this route is compared with.
    pub(crate) fn baseline(self) -> Route {
        match self {
            Route::DnsUpstream | Route::DnsForwarded | Route::DnsCached | Route::DnsAnswered => {
                Route::DnsUpstream
            }
            _ => Route::Direct,
        }
    }
}

/// One number a run produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Metric {
    /// iperf3, one stream, Gbit/s.
    Throughput1,
    /// iperf3, 8 streams, Gbit/s.
    Throughput8,
    /// sockperf ping-pong round trip, µs.
    LatencyP50,
    LatencyP99,
    LatencyP999,
    /// New connections (connect, one request, close) per second.
    ConnRate,
    /// dnsperf queries per second at saturation.
    DnsQps,
    /// dnsperf mean latency with one query outstanding, µs.
    DnsLatency,
    /// The agent's CPU (user and system, every thread) while wrk opened new connections, in
    /// percent of one CPU.
    AgentCpu,
}

impl Metric {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Metric::Throughput1 => "throughput, 1 stream",
            Metric::Throughput8 => "throughput, 8 streams",
            Metric::LatencyP50 => "latency p50",
            Metric::LatencyP99 => "latency p99",
            Metric::LatencyP999 => "latency p99.9",
            Metric::ConnRate => "new connections",
            Metric::DnsQps => "DNS queries",
            Metric::DnsLatency => "DNS latency (1 outstanding)",
            Metric::AgentCpu => "agent CPU under new connections",
        }
    }

    pub(crate) fn unit(self) -> &'static str {
        match self {
            Metric::Throughput1 | Metric::Throughput8 => "Gbit/s",
            Metric::LatencyP50 | Metric::LatencyP99 | Metric::LatencyP999 => "µs",
            Metric::ConnRate => "conn/s",
            Metric::DnsQps => "queries/s",
            Metric::DnsLatency => "µs",
            Metric::AgentCpu => "% of a CPU",
        }
    }
}

/// Every run's value, by metric and route, indexed by round (None: that run failed).
#[derive(Debug, Default)]
pub(crate) struct Results {
    rounds: usize,
    runs: BTreeMap<(Metric, Route), Vec<Option<f64>>>,
    /// Runs that failed, with the error, to show in the report.
    pub failures: Vec<String>,
}

impl Results {
    pub(crate) fn new(rounds: usize) -> Results {
        Results {
            rounds,
            ..Results::default()
        }
    }

    pub(crate) fn record(
        &mut self,
        round: usize,
        metric: Metric,
        route: Route,
        value: Option<f64>,
    ) {
        let runs = self
            .runs
            .entry((metric, route))
            .or_insert_with(|| vec![None; self.rounds]);
        if let Some(slot) = runs.get_mut(round) {
            *slot = value;
        }
    }

    pub(crate) fn summary(&self, metric: Metric, route: Route) -> Option<Summary> {
        let values: Vec<f64> = self
            .runs
            .get(&(metric, route))?
            .iter()
            .flatten()
            .copied()
            .collect();
        Summary::of(&values)
    }

    /// The route's runs divided by its baseline's runs of the same round (None for the baseline itself).
    pub(crate) fn ratio(&self, metric: Metric, route: Route) -> Option<Summary> {
        let baseline = route.baseline();
        if baseline == route {
            return None;
        }
        let values = self.runs.get(&(metric, route))?;
        let base = self.runs.get(&(metric, baseline))?;
        Summary::of(&paired_ratios(values, base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_pairs_each_round_with_the_baseline() {
        let mut r = Results::new(3);
        for (round, direct, service) in [(0, 10.0, 8.0), (1, 20.0, 10.0), (2, 10.0, 9.0)] {
            r.record(round, Metric::Throughput1, Route::Direct, Some(direct));
            r.record(round, Metric::Throughput1, Route::Service, Some(service));
        }
        let ratio = r.ratio(Metric::Throughput1, Route::Service).unwrap();
        assert_eq!((ratio.median, ratio.min, ratio.max), (0.8, 0.5, 0.9));
        assert_eq!(r.ratio(Metric::Throughput1, Route::Direct), None);
        let s = r.summary(Metric::Throughput1, Route::Service).unwrap();
        assert_eq!(s.median, 9.0);
    }

    #[test]
    fn the_rows_at_size_say_its_size() {
        let said = format!("(fast path, {})", crate::synthetic::AT_SIZE.words());
        for route in [Route::FastServiceAtSize, Route::FastPassthroughAtSize] {
            assert!(route.label().ends_with(&said), "{}", route.label());
        }
    }

    #[test]
    fn a_failed_run_is_left_out() {
        let mut r = Results::new(2);
        r.record(0, Metric::DnsQps, Route::DnsUpstream, Some(100.0));
        r.record(1, Metric::DnsQps, Route::DnsUpstream, Some(110.0));
        r.record(0, Metric::DnsQps, Route::DnsAnswered, None);
        r.record(1, Metric::DnsQps, Route::DnsAnswered, Some(220.0));
        let ratio = r.ratio(Metric::DnsQps, Route::DnsAnswered).unwrap();
        assert_eq!((ratio.median, ratio.runs), (2.0, 1));
    }
}
