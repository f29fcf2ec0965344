//! The agent's `/metrics` (Prometheus text exposition), as `name{label="value",...} -> value`.
use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};

/// Samples keyed canonically: the metric name, then its labels sorted by name (`name` alone if none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics(BTreeMap<String, f64>);

impl Metrics {
    pub fn parse(text: &str) -> Result<Metrics> {
        let mut samples = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, rest) =
                parse_key(line).with_context(|| format!("metrics line {}: {line:?}", n + 1))?;
            // A timestamp may follow the value.
            let value = rest
                .split_whitespace()
                .next()
                .with_context(|| format!("metrics line {}: no value", n + 1))?;
            let value = parse_value(value)
                .with_context(|| format!("metrics line {}: bad value {value:?}", n + 1))?;
            samples.insert(key, value);
        }
        Ok(Metrics(samples))
    }

    /// The sample `key` (e.g. `redirect_outbound_connections_total{outcome="passthrough"}`; label order
    /// does not matter), if the agent exported it.
    pub fn get(&self, key: &str) -> Option<f64> {
        let (canonical, _) = parse_key(key).ok()?;
        self.0.get(&canonical).copied()
    }

    /// Like [`Metrics::get`], with 0 for a sample not exported yet (a labelled counter appears on first use).
    pub fn get_or_zero(&self, key: &str) -> f64 {
        self.get(key).unwrap_or(0.0)
    }

    /// Sum of every sample of metric `name`, whatever its labels.
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| k.split('{').next() == Some(name))
            .map(|(_, v)| v)
            .sum()
    }

    pub fn samples(&self) -> &BTreeMap<String, f64> {
        &self.0
    }

    /// Sum of the samples of metric `name` whose labels include every pair of `labels` (an Istio
    /// series has 27 labels; a test names the few it is about).
    pub fn sum_matching(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|(_, v)| v).sum()
    }

    /// The labels and value of each sample of `name` whose labels include every pair of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = (BTreeMap<String, String>, f64)> + 'a {
        self.0.iter().filter_map(move |(key, value)| {
            let body = key.strip_prefix(name)?.strip_prefix('{')?;
            let mut held = BTreeMap::new();
            let mut rest = body;
            while let Some((label, after)) = rest.trim_start_matches(',').split_once("=\"") {
                let (v, after) = unescape_until_quote(after)?;
                held.insert(label.to_string(), v);
                rest = after;
            }
            let all = labels
                .iter()
                .all(|(k, v)| held.get(*k).map(String::as_str) == Some(*v));
            all.then_some((held, *value))
        })
    }
}

/// Reads `name` or `name{labels}` from the start of `s`; returns the canonical key and what follows.
fn parse_key(s: &str) -> Result<(String, &str)> {
    let name_end = s
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(s.len());
    let name = &s[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        bail!("bad metric name {name:?}");
    }
    let rest = &s[name_end..];
    let Some(mut labels_src) = rest.strip_prefix('{') else {
        return Ok((name.to_string(), rest));
    };
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    loop {
        labels_src = labels_src.trim_start_matches([' ', ',']);
        if let Some(after) = labels_src.strip_prefix('}') {
            let body: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            return Ok((format!("{name}{{{}}}", body.join(",")), after));
        }
        let (label, after_eq) = labels_src
            .split_once("=\"")
            .context("expected label=\"value\"")?;
        let (value, after_value) =
            unescape_until_quote(after_eq).context("unterminated label value")?;
        labels.insert(label.trim().to_string(), value);
        labels_src = after_value;
    }
}

fn unescape_until_quote(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        v => v.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP redirect_outbound_connections_total Outbound connections by outcome.
# TYPE redirect_outbound_connections_total counter
redirect_outbound_connections_total{outcome="passthrough"} 3
redirect_outbound_connections_total{outcome="reset"} 1
# TYPE redirect_active_connections gauge
redirect_active_connections 0
redirect_outbound_bytes_total{direction="sent",kind="a\"b"} 1.5e3 1712345678
redirect_weird{b="2",a="1"} +Inf
# EOF
"#;

    #[test]
    fn samples_by_canonical_key() {
        let m = Metrics::parse(TEXT).unwrap();
        struct Case {
            name: &'static str,
            key: &'static str,
            expect: Option<f64>,
        }
        let cases = [
            Case {
                name: "labelled counter",
                key: r#"redirect_outbound_connections_total{outcome="passthrough"}"#,
                expect: Some(3.0),
            },
            Case {
                name: "gauge without labels",
                key: "redirect_active_connections",
                expect: Some(0.0),
            },
            Case {
                name: "escaped label, timestamp ignored",
                key: r#"redirect_outbound_bytes_total{direction="sent",kind="a\"b"}"#,
                expect: Some(1500.0),
            },
            Case {
                name: "label order does not matter",
                key: r#"redirect_weird{a="1",b="2"}"#,
                expect: Some(f64::INFINITY),
            },
            Case {
                name: "other label value",
                key: r#"redirect_outbound_connections_total{outcome="denied"}"#,
                expect: None,
            },
            Case {
                name: "name alone is not a labelled sample",
                key: "redirect_outbound_connections_total",
                expect: None,
            },
        ];
        for c in cases {
            assert_eq!(m.get(c.key), c.expect, "{}", c.name);
        }
        assert_eq!(m.sum("redirect_outbound_connections_total"), 4.0);
        assert_eq!(
            m.sum_matching("redirect_weird", &[("a", "1")]),
            f64::INFINITY
        );
        assert_eq!(m.sum_matching("redirect_weird", &[("a", "2")]), 0.0);
        assert_eq!(
            m.sum_matching("redirect_outbound_bytes_total", &[("kind", "a\"b")]),
            1500.0
        );
        assert_eq!(
            m.get_or_zero(r#"redirect_outbound_connections_total{outcome="denied"}"#),
            0.0
        );
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "metric{a=\"1\" 3",
            "metric{a=1} 3",
            "metric",
            "metric abc",
            "bad-name 1",
        ] {
            assert!(Metrics::parse(bad).is_err(), "{bad:?} should not parse");
        }
    }
}
