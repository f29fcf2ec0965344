//! wrk with `Connection: close`: every request on a new connection (connect, one request, close).
//!
//! wrk honours the header: when a response says `Connection: close` it closes the socket and connects
//! again, so its Requests/sec is new connections per second. The bench checks this from the kernel's side
//! (the pod's TCP ActiveOpens must grow by about the request count).
use anyhow::{Context, bail};

/// `wrk -t 1 -c CONNS -d SECSs -H "Connection: close" URL`
pub(crate) fn client_args(url: &str, conns: u32, secs: u32) -> Vec<String> {
    vec![
        "-t".into(),
        "1".into(),
        "-c".into(),
        conns.to_string(),
        "-d".into(),
        format!("{secs}s"),
        "-H".into(),
        "Connection: close".into(),
        url.to_string(),
    ]
}

/// What one wrk run reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct WrkStats {
    pub requests: u64,
    pub per_second: f64,
    /// Socket errors (connect, read, write, timeout) plus non-2xx/3xx answers.
    pub errors: u64,
}

pub(crate) fn parse(out: &str) -> anyhow::Result<WrkStats> {
    let requests = out
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ").map(|(n, _)| n.trim()))
        .context("wrk printed no `N requests in` line")?;
    let requests = requests
        .parse()
        .with_context(|| format!("wrk request count {requests:?}"))?;
    let per_second = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .context("wrk printed no Requests/sec")?
        .trim();
    let per_second = per_second
        .parse()
        .with_context(|| format!("wrk Requests/sec {per_second:?}"))?;
    let mut errors = 0;
    for line in out.lines().map(str::trim) {
        if let Some(list) = line.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            for part in list.split(',') {
                let n = part.split_whitespace().nth(1).unwrap_or("");
                errors += n
                    .parse::<u64>()
                    .with_context(|| format!("wrk socket errors {list:?}"))?;
            }
        } else if let Some(n) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += n
                .trim()
                .parse::<u64>()
                .with_context(|| format!("wrk non-2xx count {n:?}"))?;
        }
    }
    if requests == 0 {
        bail!("wrk completed no request");
    }
    Ok(WrkStats {
        requests,
        per_second,
        errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rate_and_errors() {
        let out = "\
Running 2s test @ http://203.0.113.20:80/
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.57ms  532.53us   8.13ms   81.22%
    Req/Sec    10.06k   474.15    10.70k    75.00%
  20024 requests in 2.00s, 2.25MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 2
Requests/sec:  10009.32
Transfer/sec:      1.12MB
";
        assert_eq!(
            parse(out).unwrap(),
            WrkStats {
                requests: 20024,
                per_second: 10009.32,
                errors: 6
            }
        );
    }

    #[test]
    fn a_clean_run_has_no_errors_and_garbage_is_refused() {
        let out = "  100 requests in 1.00s, 10KB read\nRequests/sec:    100.00\n";
        assert_eq!(parse(out).unwrap().errors, 0);
        assert!(parse("unable to connect to 203.0.113.20:80 Connection refused").is_err());
    }
}
