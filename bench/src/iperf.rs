//! iperf3: bulk TCP throughput.
use std::net::SocketAddrV4;

use anyhow::{Context, bail};

/// `iperf3 -c IP -p PORT -P STREAMS -t SECS [-O 1] -J`. Runs of 3 s or more leave out their first second
/// (slow start); shorter ones keep everything, which on a veth path costs little.
pub(crate) fn client_args(server: SocketAddrV4, streams: u32, secs: u32) -> Vec<String> {
    let mut args = vec![
        "-c".to_string(),
        server.ip().to_string(),
        "-p".into(),
        server.port().to_string(),
        "-P".into(),
        streams.to_string(),
        "-t".into(),
        secs.to_string(),
    ];
    if secs >= 3 {
        args.extend(["-O".into(), "1".into()]);
    }
    args.push("-J".into());
    args
}

/// `iperf3 -s -B IP -p PORT`
pub(crate) fn server_args(listen: SocketAddrV4) -> Vec<String> {
    vec![
        "-s".into(),
        "-B".into(),
        listen.ip().to_string(),
        "-p".into(),
        listen.port().to_string(),
    ]
}

/// Gbit/s the receiver got (`end.sum_received.bits_per_second`).
pub(crate) fn parse(json: &str) -> anyhow::Result<f64> {
    let v: serde_json::Value =
        serde_json::from_str(json).context("iperf3 -J output is not JSON")?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        bail!("iperf3: {err}");
    }
    let bps = v
        .pointer("/end/sum_received/bits_per_second")
        .and_then(|b| b.as_f64())
        .context("iperf3 output has no end.sum_received.bits_per_second")?;
    Ok(bps / 1e9)
}

/// Bytes the receiver got (`end.sum_received.bytes`).
pub(crate) fn received_bytes(json: &str) -> anyhow::Result<u64> {
    let v: serde_json::Value =
        serde_json::from_str(json).context("iperf3 -J output is not JSON")?;
    v.pointer("/end/sum_received/bytes")
        .and_then(|b| b.as_u64())
        .context("iperf3 output has no end.sum_received.bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_receiver_rate() {
        let out = r#"{"start":{},"intervals":[],"end":{"sum_sent":{"bits_per_second":2.1e10},
            "sum_received":{"bits_per_second":2.05e10,"bytes":2562500000}}}"#;
        assert_eq!(parse(out).unwrap(), 20.5);
        assert_eq!(received_bytes(out).unwrap(), 2_562_500_000);
    }

    #[test]
    fn an_iperf_error_is_an_error() {
        let out = r#"{"start":{},"intervals":[],"end":{},"error":"unable to connect to server"}"#;
        let e = parse(out).unwrap_err().to_string();
        assert!(e.contains("unable to connect"), "{e}");
        assert!(parse("not json").is_err());
    }

    #[test]
    fn long_runs_omit_slow_start() {
        let server = "203.0.113.20:5201".parse().unwrap();
        assert!(!client_args(server, 1, 1).contains(&"-O".to_string()));
        let args = client_args(server, 8, 5).join(" ");
        assert_eq!(args, "-c 203.0.113.20 -p 5201 -P 8 -t 5 -O 1 -J");
    }
}
