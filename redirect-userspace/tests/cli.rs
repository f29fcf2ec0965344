//! The offline CLI, run as a user runs it: the built `redirect` binary over `examples/` and over
//! bad manifests. Checks the JSON shapes (a public interface), exit codes and the examples' outcomes.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use serde_json::Value;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn redirect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_redirect"))
        .args(args)
        .output()
        .expect("the redirect binary runs")
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A scratch directory removed on drop, also when a test panics.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, files: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!("redirect-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, text) in files {
            std::fs::write(dir.join(file), text).unwrap();
        }
        Scratch(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn resolve_json_shape_and_outcomes_for_examples() {
    let out = redirect(&["resolve", "-f", examples().to_str().unwrap(), "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    assert_eq!(v["errors"], serde_json::json!([]));
    let entries = v["serviceEntries"].as_array().unwrap();
    let find = |ns: &str, name: &str| {
        entries
            .iter()
            .find(|e| e["namespace"] == ns && e["name"] == name)
            .unwrap_or_else(|| panic!("{ns}/{name} missing"))
            .clone()
    };
    for e in entries {
        let keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "addresses",
                "conditions",
                "discovered",
                "matchedPolicy",
                "name",
                "namespace",
                "sidecarExportTo",
                "visibility"
            ],
            "resolve entry keys are the documented ones"
        );
    }
    struct Case {
        entry: (&'static str, &'static str),
        visibility: &'static str,
        matched: Value,
        export_to: &'static [&'static str],
        conditions: &'static [(&'static str, &'static str, &'static str)],
    }
    let cases = [
        Case {
            entry: ("team-a", "api-example"),
            visibility: "Namespace",
            matched: Value::Null,
            export_to: &["."],
            conditions: &[
                ("istio.io/VisibilityApplied", "True", "Namespace"),
                ("istio.io/WaypointBound", "True", "WaypointAccepted"),
            ],
        },
        Case {
            entry: ("team-b", "payments"),
            visibility: "Namespace",
            matched: Value::Null,
            export_to: &["~"],
            conditions: &[
                ("istio.io/VisibilityApplied", "True", "Namespace"),
                (
                    "istio.io/WaypointBound",
                    "False",
                    "CrossNamespaceWaypointForbidden",
                ),
            ],
        },
        Case {
            entry: ("team-c", "shared-public"),
            visibility: "Public",
            matched: 1.into(),
            export_to: &["*"],
            conditions: &[("istio.io/VisibilityApplied", "True", "Public")],
        },
        Case {
            entry: ("istio-system", "metrics"),
            visibility: "Public",
            matched: 0.into(),
            export_to: &["*"],
            conditions: &[
                ("istio.io/VisibilityApplied", "True", "Public"),
                ("istio.io/WaypointBound", "True", "WaypointAccepted"),
            ],
        },
        Case {
            entry: ("quarantine", "login-hijack"),
            visibility: "None",
            matched: 2.into(),
            export_to: &["~"],
            conditions: &[],
        },
    ];
    for case in cases {
        let e = find(case.entry.0, case.entry.1);
        let name = format!("{}/{}", case.entry.0, case.entry.1);
        assert_eq!(e["visibility"], case.visibility, "{name}");
        assert_eq!(e["matchedPolicy"], case.matched, "{name}");
        assert_eq!(
            e["sidecarExportTo"],
            serde_json::json!(case.export_to),
            "{name}"
        );
        let got: Vec<(String, String, String)> = e["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["type"].as_str().unwrap().into(),
                    c["status"].as_str().unwrap().into(),
                    c["reason"].as_str().unwrap().into(),
                )
            })
            .collect();
        let want: Vec<(String, String, String)> = case
            .conditions
            .iter()
            .map(|(t, s, r)| (t.to_string(), s.to_string(), r.to_string()))
            .collect();
        assert_eq!(got, want, "{name}");
    }
    let httpbin = find("istio-system", "httpbin");
    let v4 = httpbin["addresses"][0].as_str().unwrap();
    assert!(
        v4.starts_with("240.240."),
        "allocated VIP shown in addresses: {v4}"
    );
    assert!(
        httpbin["addresses"][1]
            .as_str()
            .unwrap()
            .starts_with("2001:2:"),
        "and the IPv6 one"
    );
    // Same answer on every run: allocation is stable.
    let again = json(&redirect(&[
        "resolve",
        "-f",
        examples().to_str().unwrap(),
        "-o",
        "json",
    ]));
    assert_eq!(again, v);
}

#[test]
fn resolve_yaml_and_table_outputs() {
    let dir = examples();
    let yaml = redirect(&["resolve", "-f", dir.to_str().unwrap(), "-o", "yaml"]);
    assert!(yaml.status.success());
    let parsed: serde_yaml_ng::Value = serde_yaml_ng::from_slice(&yaml.stdout).unwrap();
    assert!(
        parsed["serviceEntries"]
            .as_sequence()
            .is_some_and(|s| s.len() == 11)
    );
    let table = redirect(&["resolve", "-f", dir.to_str().unwrap()]);
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("CrossNamespaceWaypointForbidden"), "{text}");
    assert!(text.contains("NONE: delivered to no data plane"), "{text}");
}

/// The outcomes examples/README.md promises, through `explain` (the same lookups the proxy uses).
#[test]
fn explain_outcomes_for_examples() {
    struct Case {
        name: &'static str,
        from: &'static str,
        host: Option<&'static str>,
        ip: Option<&'static str>,
        action: &'static str,
        service: Value,
        /// DNS: addresses; outbound: endpoint.
        result: Value,
    }
    let null = Value::Null;
    let cases = [
        Case {
            name: "team-a resolves its own api.example.com",
            from: "team-a",
            host: Some("api.example.com"),
            ip: None,
            action: "answer",
            service: "team-a/api-example".into(),
            result: serde_json::json!(["203.0.113.10"]),
        },
        Case {
            name: "team-b: api.example.com is forwarded upstream",
            from: "team-b",
            host: Some("api.example.com"),
            ip: None,
            action: "forward",
            service: null.clone(),
            result: serde_json::json!([]),
        },
        Case {
            name: "team-a connects to its api endpoint",
            from: "team-a",
            host: None,
            ip: Some("203.0.113.10:80"),
            action: "service",
            service: "team-a/api-example".into(),
            result: "198.51.100.20:80".into(),
        },
        Case {
            name: "team-b passes through to the real api",
            from: "team-b",
            host: None,
            ip: Some("203.0.113.10:80"),
            action: "passthrough",
            service: null.clone(),
            result: "203.0.113.10:80".into(),
        },
        Case {
            name: "metrics is PUBLIC for team-b",
            from: "team-b",
            host: Some("metrics.example.com"),
            ip: None,
            action: "answer",
            service: "istio-system/metrics".into(),
            result: serde_json::json!(["203.0.113.30"]),
        },
        Case {
            name: "shared host: team-b gets its own",
            from: "team-b",
            host: Some("shared.example.com"),
            ip: None,
            action: "answer",
            service: "team-b/shared-private".into(),
            result: serde_json::json!(["203.0.113.41"]),
        },
        Case {
            name: "shared host: team-a gets the PUBLIC one",
            from: "team-a",
            host: Some("shared.example.com"),
            ip: None,
            action: "answer",
            service: "team-c/shared-public".into(),
            result: serde_json::json!(["203.0.113.40"]),
        },
        Case {
            name: "NONE entry: even quarantine forwards",
            from: "quarantine",
            host: Some("login.example.com"),
            ip: None,
            action: "forward",
            service: null.clone(),
            result: serde_json::json!([]),
        },
        Case {
            name: "NONE entry address passes through",
            from: "quarantine",
            host: None,
            ip: Some("203.0.113.50:80"),
            action: "passthrough",
            service: null.clone(),
            result: "203.0.113.50:80".into(),
        },
        Case {
            name: "CIDR entry passes through with its service",
            from: "team-a",
            host: None,
            ip: Some("198.51.100.200:443"),
            action: "passthrough",
            service: "team-c/partner-net".into(),
            result: "198.51.100.200:443".into(),
        },
        Case {
            // ztunnel find_upstream: resolution NONE goes to the original destination on any port.
            name: "resolution NONE CIDR entry on an undeclared port passes through",
            from: "team-a",
            host: None,
            ip: Some("198.51.100.200:22"),
            action: "passthrough",
            service: "team-c/partner-net".into(),
            result: "198.51.100.200:22".into(),
        },
        Case {
            name: "resolution DNS endpoint by name",
            from: "team-b",
            host: None,
            ip: Some("203.0.113.60:80"),
            action: "service",
            service: "istio-system/cdn".into(),
            result: "origin.example.org:80".into(),
        },
        Case {
            name: "Kubernetes Service by short name",
            from: "team-a",
            host: Some("web"),
            ip: None,
            action: "answer",
            service: "team-a/web".into(),
            result: serde_json::json!(["10.244.100.10"]),
        },
        Case {
            name: "Kubernetes Service by FQDN from another namespace",
            from: "team-b",
            host: Some("web.team-a.svc.cluster.local"),
            ip: None,
            action: "answer",
            service: "team-a/web".into(),
            result: serde_json::json!(["10.244.100.10"]),
        },
        Case {
            name: "Kubernetes Service VIP to the pod's named port",
            from: "team-c",
            host: None,
            ip: Some("10.244.100.10:80"),
            action: "service",
            service: "team-a/web".into(),
            result: "10.244.1.20:8080".into(),
        },
        Case {
            name: "wildcard host",
            from: "team-c",
            host: Some("shop.apps.example.com"),
            ip: None,
            action: "answer",
            service: "istio-system/apps".into(),
            result: serde_json::json!(["203.0.113.90"]),
        },
        Case {
            name: "pod reached directly",
            from: "team-b",
            host: None,
            ip: Some("10.244.1.10:8080"),
            action: "workload",
            service: null.clone(),
            result: "10.244.1.10:8080".into(),
        },
        Case {
            name: "unknown address passes through",
            from: "team-a",
            host: None,
            ip: Some("192.0.2.7:80"),
            action: "passthrough",
            service: null.clone(),
            result: "192.0.2.7:80".into(),
        },
        Case {
            name: "a namespace with no pods is still that namespace",
            from: "team-z",
            host: Some("api.example.com"),
            ip: None,
            action: "forward",
            service: null.clone(),
            result: serde_json::json!([]),
        },
    ];
    let dir = examples();
    let dir = dir.to_str().unwrap();
    for case in cases {
        let mut args = vec!["explain", "-f", dir, "--from", case.from, "-o", "json"];
        match (case.host, case.ip) {
            (Some(h), _) => args.extend(["--host", h]),
            (_, Some(ip)) => args.extend(["--ip", ip]),
            _ => unreachable!(),
        }
        let out = redirect(&args);
        assert!(
            out.status.success(),
            "{}: {}",
            case.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let v = json(&out);
        assert_eq!(v["client"]["namespace"], case.from, "{}", case.name);
        let (section, result_key) = if case.host.is_some() {
            ("dns", "addresses")
        } else {
            ("outbound", "endpoint")
        };
        assert_eq!(v[section]["action"], case.action, "{}: {v}", case.name);
        assert_eq!(v[section]["service"], case.service, "{}: {v}", case.name);
        assert_eq!(v[section][result_key], case.result, "{}: {v}", case.name);
    }
}

#[test]
fn allocated_vip_resolves_and_routes_to_the_host() {
    let dir = examples();
    let dns = json(&redirect(&[
        "explain",
        "-f",
        dir.to_str().unwrap(),
        "--from",
        "team-a",
        "--host",
        "httpbin.example.com",
        "-o",
        "json",
    ]));
    let vip = dns["dns"]["addresses"][0].as_str().unwrap().to_string();
    assert!(vip.starts_with("240.240."), "{dns}");
    let out = json(&redirect(&[
        "explain",
        "-f",
        dir.to_str().unwrap(),
        "--from",
        "team-a",
        "--ip",
        &format!("{vip}:80"),
        "-o",
        "json",
    ]));
    assert_eq!(out["outbound"]["endpoint"], "httpbin.example.com:80");
}

/// What an outside probe found answered and claimed: `status.addresses` values outside Istio's
/// allocation ranges. Each is refused (an error naming file, entry and field, exit 1), never
/// answered and never claimed; the entry stays, with an address of the agent's own.
#[test]
fn status_addresses_outside_istios_ranges_are_neither_answered_nor_claimed() {
    let probes = [
        ("loopback", "127.0.0.1"),
        ("metadata", "169.254.169.254"),
        ("vip", "203.0.113.10"),
        ("cluster-ip", "10.96.0.1"),
        ("public", "8.8.8.8"),
        ("gateway", "169.254.7.1"),
        ("v6", "2001:db8::1"),
    ];
    let entry = |name: &str, addresses: &str| {
        format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: team-a}}\nspec: {{hosts: [{name}.example.com], resolution: DNS, ports: [{{number: 80, name: http}}]}}\nstatus: {{addresses: [{addresses}]}}\n"
        )
    };
    let mut yaml = String::new();
    for (name, value) in probes {
        yaml.push_str(&entry(
            name,
            &format!("{{value: \"{value}\", host: {name}.example.com}}"),
        ));
    }
    yaml.push_str(&entry(
        "good",
        "{value: 240.240.3.7, host: good.example.com}, {value: \"2001:2::7\", host: good.example.com}",
    ));
    let others = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: team-b}\nspec: {hosts: [api.example.com], addresses: [203.0.113.10], resolution: STATIC, ports: [{number: 80, name: http}], endpoints: [{address: 198.51.100.20}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: kubernetes, namespace: default}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
    let scratch = Scratch::new(
        "status-addresses",
        &[("others.yaml", others), ("status.yaml", yaml.as_str())],
    );

    let out = redirect(&["resolve", "-f", scratch.path(), "-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "a refusal is an error");
    let v = json(&out);
    let errors = v["errors"].as_array().unwrap();
    assert_eq!(errors.len(), probes.len(), "{v}");
    let entries = v["serviceEntries"].as_array().unwrap();
    for (name, value) in probes {
        let object = format!("ServiceEntry team-a/{name}");
        let e = errors
            .iter()
            .find(|e| e["object"] == object.as_str())
            .unwrap_or_else(|| panic!("no error for {object}: {v}"));
        assert_eq!(e["field"], "status.addresses[0].value", "{e}");
        assert!(e["file"].as_str().unwrap().ends_with("status.yaml"), "{e}");
        assert!(e["message"].as_str().unwrap().contains(value), "{e}");
        let se = entries
            .iter()
            .find(|e| e["namespace"] == "team-a" && e["name"] == name)
            .unwrap_or_else(|| panic!("{name}: the entry is not kept: {v}"));
        let addresses: Vec<&str> = se["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(!addresses.contains(&value), "{name}: {addresses:?}");
        assert!(
            addresses[0].starts_with("240.240.") && addresses[1].starts_with("2001:2:"),
            "{name}: the agent's own allocation instead: {addresses:?}"
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("status.yaml: ServiceEntry team-a/public: status.addresses[0].value: \"8.8.8.8\" is outside 240.240.0.0/16 and 2001:2::/48"),
        "{stderr}"
    );

    let explain = |args: &[&str]| {
        let mut all = vec!["explain", "-f", scratch.path(), "--from", "team-a"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        json(&redirect(&all))
    };
    for (name, value) in probes {
        let host = format!("{name}.example.com");
        let dns = explain(&["--host", &host]);
        assert_eq!(dns["dns"]["action"], "answer", "{name}: {dns}");
        assert!(
            !dns["dns"]["addresses"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a == value),
            "{name}: {value} answered: {dns}"
        );
        let ip = match value.contains(':') {
            true => format!("[{value}]:80"),
            false => format!("{value}:80"),
        };
        let outbound = explain(&["--ip", &ip]);
        let own = format!("team-a/{name}");
        assert_ne!(
            outbound["outbound"]["service"],
            own.as_str(),
            "{name}: {value} claimed: {outbound}"
        );
        match name {
            "vip" => assert_eq!(outbound["outbound"]["service"], "team-b/api", "{outbound}"),
            "cluster-ip" => assert_eq!(
                outbound["outbound"]["service"], "default/kubernetes",
                "{outbound}"
            ),
            _ => assert_eq!(outbound["outbound"]["action"], "passthrough", "{outbound}"),
        }
    }
    let good = explain(&["--host", "good.example.com"]);
    assert_eq!(
        good["dns"]["addresses"],
        serde_json::json!(["240.240.3.7", "2001:2::7"]),
        "Istio's allocations are answered as written"
    );
    let claimed = explain(&["--ip", "240.240.3.7:80"]);
    assert_eq!(claimed["outbound"]["service"], "team-a/good", "{claimed}");
}

/// One object in error never takes down the rest: the valid result is printed, every error is
/// listed, and the exit code is 1.
#[test]
fn bad_input_prints_the_valid_result_lists_every_error_and_exits_1() {
    let scratch = Scratch::new(
        "bad",
        &[
            (
                "0-good.yaml",
                "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: good, namespace: team-a}\nspec: {hosts: [good.example.com], addresses: [203.0.113.7], ports: [{number: 80, name: http}]}\n",
            ),
            (
                "a.yaml",
                "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: team-a}\nspec: {hosts: [a.example.com], addresses: [300.0.0.1], ports: [{number: 70000, name: http}]}\n",
            ),
            (
                "b.yaml",
                "kind: MeshConfig\nserviceEntryVisibility:\n  policies: [{matchingRules: [{namespaceSelector: {matchExpressions: [{key: x, operator: Near}]}}]}]\n",
            ),
            ("c.yaml", "kind: [broken\n"),
        ],
    );
    let out = redirect(&["resolve", "-f", scratch.path(), "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    let names: Vec<&Value> = v["serviceEntries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["name"])
        .collect();
    assert_eq!(
        names,
        ["good"],
        "everything valid applies, nothing invalid: {v}"
    );
    let errors = v["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 4, "{v}");
    assert_eq!(errors[0]["object"], "ServiceEntry team-a/api");
    assert_eq!(errors[0]["field"], "spec.addresses[0]");
    assert!(errors[0]["file"].as_str().unwrap().ends_with("a.yaml"));
    assert_eq!(errors[1]["field"], "spec.ports[0].number");
    assert_eq!(errors[2]["object"], "MeshConfig");
    assert!(
        errors[2]["message"]
            .as_str()
            .unwrap()
            .contains("unknown operator")
    );
    assert!(errors[3]["file"].as_str().unwrap().ends_with("c.yaml"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a.yaml: ServiceEntry team-a/api: spec.addresses[0]: "),
        "{stderr}"
    );

    let table = redirect(&["resolve", "-f", scratch.path()]);
    assert_eq!(table.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&table.stdout).contains("good.example.com"));
    assert_eq!(
        String::from_utf8_lossy(&table.stderr).lines().count(),
        5,
        "a header and one line per error"
    );

    let explain = redirect(&[
        "explain",
        "-f",
        scratch.path(),
        "--from",
        "team-a",
        "--host",
        "a.example.com",
    ]);
    assert_eq!(explain.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&explain.stderr).contains("unknown operator"));
    let explain = redirect(&[
        "explain",
        "-f",
        scratch.path(),
        "--from",
        "team-a",
        "--host",
        "good.example.com",
        "-o",
        "json",
    ]);
    assert_eq!(explain.status.code(), Some(1));
    assert_eq!(
        json(&explain)["dns"]["service"],
        "team-a/good",
        "explained over the valid objects"
    );
}

/// An entry with 6,000 CIDRs: a table column far past 65,535 characters renders, no panic.
#[test]
fn a_very_wide_table_renders() {
    let cidrs: Vec<String> = (0..6000)
        .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
        .collect();
    let entry = format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: wide, namespace: team-a}}\nspec: {{hosts: [wide.example.com], addresses: [{}], ports: [{{number: 80, name: http}}]}}\n",
        cidrs.join(", ")
    );
    let scratch = Scratch::new("wide", &[("wide.yaml", &entry)]);
    let out = redirect(&["resolve", "-f", scratch.path()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&cidrs.join(",")), "every CIDR shown");
}

/// `-o yaml` read back by a YAML 1.1 reader gives the same data: a namespace named `no` stays a
/// string (a YAML 1.1 reader takes a plain `no` for false).
#[test]
fn yaml_output_quotes_what_yaml_1_1_would_misread() {
    let entry = "apiVersion: v1\nkind: Namespace\nmetadata: {name: \"no\"}\n---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: \"on\", namespace: \"no\"}\nspec: {hosts: [y.example.com], addresses: [203.0.113.8], ports: [{number: 80, name: http}]}\n";
    let scratch = Scratch::new("yaml11", &[("a.yaml", entry)]);
    let out = redirect(&["resolve", "-f", scratch.path(), "-o", "yaml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("namespace: \"no\""), "{text}");
    assert!(text.contains("name: \"on\""), "{text}");
    assert!(text.contains("- \"203.0.113.8\""), "{text}");
    let json_out = json(&redirect(&["resolve", "-f", scratch.path(), "-o", "json"]));
    let back: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(back, json_out, "YAML and JSON carry the same data");
}

#[test]
fn missing_directory_exits_1() {
    let out = redirect(&["resolve", "-f", "/nonexistent/redirect-config"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/redirect-config: cannot read")
    );
    // Before any table: nothing on stdout, even when other paths could be read.
    let examples = examples();
    let out = redirect(&[
        "resolve",
        "-f",
        examples.to_str().unwrap(),
        "-f",
        "/nonexistent/redirect-config",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// kubectl's habits: `-f -` reads standard input, `-f` repeats, `-R` walks subdirectories, and
/// `resolve -n` shows one namespace.
#[test]
fn filename_takes_stdin_repeats_recurses_and_resolve_filters_by_namespace() {
    let examples = examples();
    let mut all = String::new();
    let mut files: Vec<_> = std::fs::read_dir(&examples)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for file in &files {
        all.push_str(&std::fs::read_to_string(file).unwrap());
        all.push_str("\n---\n");
    }
    let from_dir = json(&redirect(&[
        "resolve",
        "-f",
        examples.to_str().unwrap(),
        "-o",
        "json",
    ]));
    let mut child = Command::new(env!("CARGO_BIN_EXE_redirect"))
        .args(["resolve", "-f", "-", "-o", "json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(all.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(json(&out)["serviceEntries"], from_dir["serviceEntries"]);

    // The same manifests split over a file, a directory and a subdirectory.
    let split = Scratch::new("split", &[]);
    std::fs::create_dir_all(split.0.join("teams/more")).unwrap();
    for file in &files {
        let name = file.file_name().unwrap().to_str().unwrap();
        let to = match name.as_bytes()[0] {
            b'0' => split.0.join(name),
            b'1' | b'2' => split.0.join("teams").join(name),
            _ => split.0.join("teams/more").join(name),
        };
        std::fs::copy(file, to).unwrap();
    }
    let teams = split.0.join("teams");
    let flat = json(&redirect(&[
        "resolve",
        "-f",
        split.path(),
        "-f",
        teams.to_str().unwrap(),
        "-o",
        "json",
    ]));
    assert_eq!(
        flat["serviceEntries"].as_array().unwrap().len(),
        0,
        "no -R: teams/more unread"
    );
    let deep = json(&redirect(&[
        "resolve",
        "-R",
        "-f",
        split.path(),
        "-o",
        "json",
    ]));
    assert_eq!(deep["serviceEntries"], from_dir["serviceEntries"]);

    let team_b = json(&redirect(&[
        "resolve",
        "-f",
        examples.to_str().unwrap(),
        "-n",
        "team-b",
        "-o",
        "json",
    ]));
    let namespaces: Vec<&str> = team_b["serviceEntries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["namespace"].as_str().unwrap())
        .collect();
    assert!(
        !namespaces.is_empty() && namespaces.iter().all(|n| *n == "team-b"),
        "{namespaces:?}"
    );
    let table = redirect(&["resolve", "-f", examples.to_str().unwrap(), "-n", "team-b"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("shared-private") && !table.contains("api-example"),
        "{table}"
    );
}

#[test]
fn usage_errors_exit_2() {
    let dir = examples();
    let dir = dir.to_str().unwrap();
    for (name, args) in [
        ("no target", vec!["explain", "-f", dir, "--from", "team-a"]),
        (
            "both targets",
            vec![
                "explain", "-f", dir, "--from", "team-a", "--host", "a", "--ip", "1.2.3.4",
            ],
        ),
        (
            "bad ip",
            vec!["explain", "-f", dir, "--from", "team-a", "--ip", "1.2.3"],
        ),
        ("no namespace", vec!["explain", "-f", dir, "--host", "a"]),
        ("unknown output", vec!["resolve", "-f", dir, "-o", "xml"]),
        (
            "yaml is not an explain format",
            vec![
                "explain", "-f", dir, "--from", "a", "--host", "a", "-o", "yaml",
            ],
        ),
        ("no directory", vec!["resolve"]),
    ] {
        assert_eq!(redirect(&args).status.code(), Some(2), "{name}");
    }
}

/// `--log-format json` (or `REDIRECT_LOG_FORMAT=json`, as the DaemonSet sets it): every log line is
/// one JSON object carrying the message and its fields.
#[test]
fn json_logs_are_one_object_per_line() {
    let dir = Scratch::new(
        "json-logs",
        &[(
            "se.yaml",
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: p, namespace: a}\nspec: {hosts: [\"*x\"], ports: [{number: 80, name: http}]}\n",
        )],
    );
    for args in [
        vec!["--log-format", "json", "resolve", "-f", dir.path()],
        vec!["resolve", "-f", dir.path()],
    ] {
        let json_env = args[0] != "--log-format";
        let mut command = Command::new(env!("CARGO_BIN_EXE_redirect"));
        command.args(&args);
        if json_env {
            command.env("REDIRECT_LOG_FORMAT", "json");
        }
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
        assert!(!lines.is_empty(), "the partial wildcard is logged");
        for line in lines {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            assert_eq!(v["level"], "WARN", "{line}");
            assert!(v["fields"]["message"].is_string(), "{line}");
        }
    }
}

#[test]
fn resolve_with_an_audit_mesh_config_gives_each_entry_its_audit_visibility_and_refuses_a_bad_one() {
    let audit = Scratch::new(
        "audit",
        &[
            (
                "good.yaml",
                "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n    - visibility: PUBLIC\n      matchingRules:\n        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: team-a\n",
            ),
            (
                "bad.yaml",
                "serviceEntryVisibility:\n  defaultVisibility: SOMETIMES\n",
            ),
        ],
    );
    let examples = examples();
    let examples = examples.to_str().unwrap();
    let good = format!("{}/good.yaml", audit.path());
    let out = redirect(&[
        "resolve",
        "-f",
        examples,
        "-o",
        "json",
        "--audit-mesh-config",
        &good,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = json(&out);
    let entry = |ns: &str, name: &str| {
        report["serviceEntries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["namespace"] == ns && e["name"] == name)
            .cloned()
            .unwrap()
    };
    let api = entry("team-a", "api-example");
    assert_eq!(api["visibility"], "Namespace");
    assert_eq!(api["auditVisibility"], "Public");
    // istio-system publishes under the examples' policy, not under this one.
    let metrics = entry("istio-system", "metrics");
    assert_eq!(metrics["visibility"], "Public");
    assert_eq!(metrics["auditVisibility"], "Namespace");
    // The table says both where they differ.
    let out = redirect(&["resolve", "-f", examples, "--audit-mesh-config", &good]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("Namespace (audit: Public)"), "{table}");
    // Without the flag, no audit field at all.
    let plain = json(&redirect(&["resolve", "-f", examples, "-o", "json"]));
    assert!(plain["serviceEntries"][0].get("auditVisibility").is_none());

    let bad = format!("{}/bad.yaml", audit.path());
    let out = redirect(&["resolve", "-f", examples, "--audit-mesh-config", &bad]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&bad) && stderr.contains("serviceEntryVisibility.defaultVisibility"),
        "{stderr}"
    );
}

#[test]
fn explain_with_an_audit_mesh_config_shows_both_answers_and_whether_they_differ() {
    let audit = Scratch::new(
        "explain-audit",
        &[(
            "audit.yaml",
            "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n    - visibility: PUBLIC\n      matchingRules:\n        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: team-a\n",
        )],
    );
    let examples = examples();
    let file = format!("{}/audit.yaml", audit.path());
    let explain = |from: &str| {
        let args = [
            "explain",
            "-f",
            examples.to_str().unwrap(),
            "--from",
            from,
            "--host",
            "api.example.com",
            "-o",
            "json",
            "--audit-mesh-config",
            &file,
        ];
        json(&redirect(&args))
    };
    // team-b is forwarded now; under the audit policy team-a's entry would answer.
    let b = explain("team-b");
    assert_eq!(b["changes"], true);
    assert_eq!(b["enforced"]["dns"]["action"], "forward");
    assert_eq!(b["audit"]["dns"]["action"], "answer");
    assert_eq!(b["audit"]["dns"]["service"], "team-a/api-example");
    // team-a sees its own entry under both.
    assert_eq!(explain("team-a")["changes"], false);
}
