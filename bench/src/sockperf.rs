//! sockperf: request/response latency on one long-lived TCP connection (ping-pong).
use std::net::SocketAddrV4;

use anyhow::{Context, bail};

/// Bytes per request and per reply.
pub(crate) const MESSAGE: u32 = 1024;

/// `sockperf ping-pong --tcp -i IP -p PORT -m 1024 -t SECS --full-rtt`: one connection, one message in
/// flight, round-trip times.
pub(crate) fn client_args(server: SocketAddrV4, secs: u32) -> Vec<String> {
    vec![
        "ping-pong".into(),
        "--tcp".into(),
        "-i".into(),
        server.ip().to_string(),
        "-p".into(),
        server.port().to_string(),
        "-m".into(),
        MESSAGE.to_string(),
        "-t".into(),
        secs.to_string(),
        "--full-rtt".into(),
    ]
}

/// `sockperf server --tcp -i IP -p PORT`
pub(crate) fn server_args(listen: SocketAddrV4) -> Vec<String> {
    vec![
        "server".into(),
        "--tcp".into(),
        "-i".into(),
        listen.ip().to_string(),
        "-p".into(),
        listen.port().to_string(),
    ]
}

/// Round-trip percentiles in µs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

/// Reads sockperf's `---> percentile 50.000 =   12.345` lines.
pub(crate) fn parse(out: &str) -> anyhow::Result<Percentiles> {
    let percentile = |which: &str| -> anyhow::Result<f64> {
        let value = out
            .lines()
            .find_map(|l| {
                let rest = l.split("---> percentile").nth(1)?;
                let (p, v) = rest.split_once('=')?;
                (p.trim() == which).then(|| v.trim().to_string())
            })
            .with_context(|| format!("sockperf printed no percentile {which}"))?;
        value
            .parse()
            .with_context(|| format!("sockperf percentile {which}: {value:?}"))
    };
    if !out.contains("Summary: ") {
        bail!("sockperf printed no summary (did the connection work?)");
    }
    Ok(Percentiles {
        p50: percentile("50.000")?,
        p99: percentile("99.000")?,
        p999: percentile("99.900")?,
    })
}

/// How many round trips a run measured (`Total N observations`).
pub(crate) fn observations(out: &str) -> anyhow::Result<u64> {
    out.lines()
        .find_map(|l| {
            let rest = l.split("Total ").nth(1)?;
            rest.split_once(" observations")?.0.trim().parse().ok()
        })
        .context("sockperf printed no `Total N observations`")
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
sockperf: ========= Printing statistics for Server No: 0
sockperf: [Valid Duration] RunTime=0.950 sec; SentMessages=21007; ReceivedMessages=21007
sockperf: ====> avg-rtt=45.165 (std-dev=11.371, mean-ad=5.126, median-ad=3.151, siqr=2.473, cv=0.252, std-error=0.078, 99.0% ci=[44.963, 45.367])
sockperf: # dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0
sockperf: Summary: Round trip is 45.165 usec
sockperf: Total 21007 observations; each percentile contains 210.07 observations
sockperf: ---> <MAX> observation =  553.618
sockperf: ---> percentile 99.999 =  553.618
sockperf: ---> percentile 99.990 =  390.224
sockperf: ---> percentile 99.900 =  150.531
sockperf: ---> percentile 99.000 =   91.061
sockperf: ---> percentile 90.000 =   53.284
sockperf: ---> percentile 75.000 =   46.770
sockperf: ---> percentile 50.000 =   42.993
sockperf: ---> percentile 25.000 =   40.497
sockperf: ---> <MIN> observation =   32.335
";

    #[test]
    fn reads_the_percentiles() {
        assert_eq!(
            parse(OUT).unwrap(),
            Percentiles {
                p50: 42.993,
                p99: 91.061,
                p999: 150.531
            }
        );
    }

    #[test]
    fn counts_observations() {
        assert_eq!(observations(OUT).unwrap(), 21007);
        assert!(observations("sockperf: nothing").is_err());
    }

    #[test]
    fn no_summary_is_an_error() {
        assert!(parse("sockperf: ERROR: connect failed\n").is_err());
        let cut = OUT.replace("percentile 99.900", "percentile 99.800");
        assert!(parse(&cut).unwrap_err().to_string().contains("99.900"));
    }
}
