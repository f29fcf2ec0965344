//! dnsperf: DNS queries per second (many outstanding) and latency (one outstanding).
use std::net::SocketAddrV4;
use std::path::Path;

use anyhow::{Context, bail};

/// Queries dnsperf keeps in flight when measuring the rate.
pub(crate) const LOAD_OUTSTANDING: u32 = 64;

/// `dnsperf -s IP -p PORT -d FILE -l SECS -c 1 -q OUTSTANDING -t 2`
pub(crate) fn client_args(
    server: SocketAddrV4,
    queries: &Path,
    secs: u32,
    outstanding: u32,
) -> Vec<String> {
    vec![
        "-s".into(),
        server.ip().to_string(),
        "-p".into(),
        server.port().to_string(),
        "-d".into(),
        queries.display().to_string(),
        "-l".into(),
        secs.to_string(),
        "-c".into(),
        "1".into(),
        "-q".into(),
        outstanding.to_string(),
        "-t".into(),
        "2".into(),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DnsperfStats {
    pub completed: u64,
    pub lost: u64,
    pub qps: f64,
    /// Mean latency, µs.
    pub mean_latency_us: f64,
}

pub(crate) fn parse(out: &str) -> anyhow::Result<DnsperfStats> {
    let field = |name: &str| -> anyhow::Result<&str> {
        out.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .map(str::trim)
            .with_context(|| format!("dnsperf printed no {name:?}"))
    };
    // "Queries completed:    123 (99.50%)"
    let count = |name: &str| -> anyhow::Result<u64> {
        let v = field(name)?;
        let n = v.split_whitespace().next().unwrap_or("");
        n.parse().with_context(|| format!("dnsperf {name} {v:?}"))
    };
    let completed = count("Queries completed:")?;
    let lost = count("Queries lost:")?;
    let qps = field("Queries per second:")?;
    let qps = qps
        .parse()
        .with_context(|| format!("dnsperf queries per second {qps:?}"))?;
    // "Average Latency (s):  0.000031 (min 0.000011, max 0.000420)"
    let latency = field("Average Latency (s):")?;
    let seconds: f64 = latency
        .split_whitespace()
        .next()
        .unwrap_or("")
        .parse()
        .with_context(|| format!("dnsperf average latency {latency:?}"))?;
    if completed == 0 {
        bail!("dnsperf: no query was answered");
    }
    Ok(DnsperfStats {
        completed,
        lost,
        qps,
        mean_latency_us: seconds * 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
DNS Performance Testing Tool
Version 2.10.0

[Status] Command line: dnsperf -s 198.51.100.53 -p 53 -d /tmp/q -l 1 -c 1 -q 64 -t 2
[Status] Sending queries (to 198.51.100.53:53)
[Status] Started at: Sun Nov 30 14:40:01 2025
[Status] Stopping after 1.000000 seconds
[Status] Testing complete (time limit)

Statistics:

  Queries sent:         41234
  Queries completed:    41230 (99.99%)
  Queries lost:         4 (0.01%)

  Response codes:       NOERROR 41230 (100.00%)
  Average packet size:  request 39, response 55
  Run time (s):         1.000123
  Queries per second:   41224.929

  Average Latency (s):  0.001523 (min 0.000041, max 0.004120)
  Latency StdDev (s):   0.000221
";

    #[test]
    fn reads_rate_latency_and_losses() {
        let r = parse(OUT).unwrap();
        assert_eq!((r.completed, r.lost, r.qps), (41230, 4, 41224.929));
        assert!((r.mean_latency_us - 1523.0).abs() < 1e-6);
    }

    #[test]
    fn nothing_answered_is_an_error() {
        let none = OUT.replace("41230 (99.99%)", "0 (0.00%)");
        assert!(parse(&none).is_err());
        assert!(parse("dnsperf: invalid option").is_err());
    }
}
