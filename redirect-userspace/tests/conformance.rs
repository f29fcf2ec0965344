//! The conformance folder: cases translated from upstream Istio and ztunnel test tables, and our own
//! copies of the shapes of Istio's example manifests. Each case is a folder under `conformance/`
//! holding ordinary manifests and an `expect.yaml`:
//!
//! ```yaml
//! source: the upstream test (file and case) this case comes from
//! resolve:                       # per ServiceEntry (namespace/name): a part of `redirect resolve -o json`
//!   team-a/api: {visibility: Namespace}
//! explain:                       # each: a part of `redirect explain -o json` for one client
//!   - {from: team-b, ip: "203.0.113.10:80", outbound: {action: passthrough}}
//!   - {from: team-b, host: api.example.com, dns: {action: forward}}
//! errors:                        # a refused case: each must be among the reported errors
//!   - {field: spec.addresses, message: "CIDR addresses are allowed only"}
//! ```
//!
//! Expected values are matched as parts: every key given must be there with that value (lists
//! element by element, same length); keys not given are not checked.
use std::{
    fs,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use redirect_userspace::{
    model::{self, Snapshot},
    report::{self, Destination},
};
use serde_json::Value;

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    let mut dirs: Vec<PathBuf> = fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Where `actual` differs from the part `expected` gives, as `path: expected X, got Y` lines.
fn differences(path: &str, expected: &Value, actual: &Value, out: &mut Vec<String>) {
    match (expected, actual) {
        (Value::Object(want), Value::Object(got)) => {
            for (key, want) in want {
                let at = format!("{path}.{key}");
                match got.get(key) {
                    Some(got) => differences(&at, want, got, out),
                    None => out.push(format!("{at}: expected {want}, missing")),
                }
            }
        }
        (Value::Array(want), Value::Array(got)) if want.len() == got.len() => {
            for (i, (want, got)) in want.iter().zip(got).enumerate() {
                differences(&format!("{path}[{i}]"), want, got, out);
            }
        }
        // YAML numbers and strings in expectations compare by their text (`port: 443`, `"443"`).
        (Value::String(want), got) if !got.is_string() && want == &got.to_string() => {}
        (want, got) if want == got => {}
        (want, got) => out.push(format!("{path}: expected {want}, got {got}")),
    }
}

fn destination(text: &str) -> Destination {
    match text.parse::<SocketAddr>() {
        Ok(addr) => Destination {
            ip: addr.ip(),
            port: Some(addr.port()),
        },
        Err(_) => Destination {
            ip: text
                .parse::<IpAddr>()
                .unwrap_or_else(|_| panic!("{text:?} is not IP or IP:PORT")),
            port: None,
        },
    }
}

/// Runs one case; returns its failures.
fn run(dir: &Path) -> Vec<String> {
    let text = fs::read_to_string(dir.join("expect.yaml"))
        .unwrap_or_else(|e| panic!("{}/expect.yaml: {e}", dir.display()));
    let expect: Value = serde_yaml_ng::from_str(&text)
        .unwrap_or_else(|e| panic!("{}/expect.yaml: {e}", dir.display()));
    assert!(
        expect.get("source").and_then(Value::as_str).is_some(),
        "{}: expect.yaml names no upstream source",
        dir.display()
    );
    let sources = manifests(dir);
    let mut failures = Vec::new();
    let model = match model::load_sources(sources.iter().map(|(f, t)| (f.as_str(), t.as_str()))) {
        Ok(model) => {
            if expect.get("errors").is_some() {
                failures.push("loaded, expected errors".to_string());
            }
            model
        }
        Err(errors) => {
            let got = serde_json::to_value(&errors.0).unwrap_or_default();
            match expect.get("errors").and_then(Value::as_array) {
                None => failures.push(format!("refused, expected to load:\n{errors}")),
                Some(wanted) => {
                    for want in wanted {
                        let found = got.as_array().into_iter().flatten().any(|e| {
                            let mut d = Vec::new();
                            let mut want = want.clone();
                            // Messages are matched by a part of their text.
                            let message = want
                                .as_object_mut()
                                .and_then(|m| m.remove("message"))
                                .and_then(|m| m.as_str().map(String::from));
                            differences("error", &want, e, &mut d);
                            d.is_empty()
                                && message.is_none_or(|m| {
                                    e["message"].as_str().is_some_and(|t| t.contains(&m))
                                })
                        });
                        if !found {
                            failures.push(format!("no reported error matches {want}: {errors}"));
                        }
                    }
                }
            }
            return failures;
        }
    };

    let resolution = model::resolve(&model);
    let report =
        serde_json::to_value(report::resolve_report(&model, resolution)).unwrap_or_default();
    if let Some(entries) = expect.get("resolve").and_then(Value::as_object) {
        for (key, want) in entries {
            let got = report["serviceEntries"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| {
                    format!(
                        "{}/{}",
                        e["namespace"].as_str().unwrap_or(""),
                        e["name"].as_str().unwrap_or("")
                    ) == *key
                });
            match got {
                Some(got) => differences(&format!("resolve {key}"), want, got, &mut failures),
                None => failures.push(format!("resolve {key}: no such ServiceEntry")),
            }
        }
    }

    let snapshot = Snapshot::from_model(&model);
    for (i, ask) in expect
        .get("explain")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let from = ask["from"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: explain[{i}] has no from", dir.display()));
        let (label, got, key) = if let Some(ip) = ask["ip"].as_str() {
            let got = report::explain_ip(&snapshot, from, destination(ip));
            (
                format!("explain[{i}] --from {from} --ip {ip}"),
                serde_json::to_value(got).unwrap_or_default(),
                "outbound",
            )
        } else if let Some(host) = ask["host"].as_str() {
            let got = report::explain_host(&snapshot, from, host);
            (
                format!("explain[{i}] --from {from} --host {host}"),
                serde_json::to_value(got).unwrap_or_default(),
                "dns",
            )
        } else {
            panic!("{}: explain[{i}] has neither ip nor host", dir.display());
        };
        match ask.get(key) {
            Some(want) => differences(&label, want, &got[key], &mut failures),
            None => failures.push(format!("{label}: expect.yaml gives no {key}")),
        }
    }
    failures
}

/// The case's manifests: every file but `expect.yaml`, by name, as (file, text).
fn manifests(dir: &Path) -> Vec<(String, String)> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "expect.yaml"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.display().to_string(), text)
        })
        .collect()
}

#[test]
fn conformance_cases() {
    let cases = cases();
    assert!(
        cases.len() >= 20,
        "the conformance folder holds {} cases",
        cases.len()
    );
    let mut report = Vec::new();
    for dir in &cases {
        let failures = run(dir);
        if !failures.is_empty() {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            report.push(format!("{name}:\n  {}", failures.join("\n  ")));
        }
    }
    assert!(
        report.is_empty(),
        "{} of {} cases fail:\n{}",
        report.len(),
        cases.len(),
        report.join("\n")
    );
}
