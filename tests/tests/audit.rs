//! The audit mode (`docs/audit.md`): `run --audit-mesh-config` resolves a second mesh config beside
//! the one in force and never enforces it. Real clients ask and connect; what they get is the
//! enforced answer, and what the audit policy would change is counted per (client namespace,
//! service, kind, change), whoever decides: the kernel's decisions are reported to the agent, not
//! sent to the proxy.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use integration::world::{self, Reach, World, delta};
use integration::{Agent, Launch, pace};
use serde_json::Value;

const KERNEL_REWRITTEN: &str =
    r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#;
const PROXY_SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;

/// The mesh admin's intended policy: NAMESPACE by default, istio-system publishes mesh-wide.
const NAMESPACE_DEFAULT: &str = "\
apiVersion: install.istio.io/v1alpha1
kind: IstioOperator
spec:
  meshConfig:
    serviceEntryVisibility:
      defaultVisibility: NAMESPACE
      policies:
        - visibility: PUBLIC
          matchingRules:
            - namespaceSelector:
                matchLabels:
                  kubernetes.io/metadata.name: istio-system
";

/// A mesh config that leaves the feature off: every ServiceEntry PUBLIC.
const FEATURE_OFF: &str = "\
apiVersion: install.istio.io/v1alpha1
kind: IstioOperator
spec:
  meshConfig: {}
";

/// The examples' policy with team-a published too (as a bare mesh config, the form a mounted
/// ConfigMap key has).
const TEAM_A_PUBLIC: &str = "\
serviceEntryVisibility:
  defaultVisibility: NAMESPACE
  policies:
    - visibility: PUBLIC
      matchingRules:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: istio-system
    - visibility: PUBLIC
      matchingRules:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: team-a
";

/// An audit file outside the agent's configuration directory, removed at the end.
struct AuditFile(PathBuf);

impl AuditFile {
    fn new(name: &str, text: &str) -> Result<AuditFile> {
        let path =
            std::env::temp_dir().join(format!("redirect-audit-{}-{name}.yaml", std::process::id()));
        std::fs::write(&path, text)?;
        Ok(AuditFile(path))
    }

    fn arg(&self) -> String {
        self.0.display().to_string()
    }

    fn write(&self, text: &str) -> Result<()> {
        // As a ConfigMap volume does: a new file put in place whole.
        let next = self.0.with_extension("next");
        std::fs::write(&next, text)?;
        std::fs::rename(&next, &self.0)?;
        Ok(())
    }
}

impl Drop for AuditFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn change_key(client: &str, service: (&str, &str), kind: &str, change: &str) -> String {
    format!(
        r#"redirect_audit_changes_total{{client_namespace="{client}",service_namespace="{}",service="{}",kind="{kind}",change="{change}"}}"#,
        service.0, service.1
    )
}

fn launch_fast() -> Launch {
    Launch {
        fast_path: true,
        ..Launch::default()
    }
}

/// `redirect config audit -o json [args]`, run where the agent's admin server is.
fn config_audit(w: &World, args: &[&str]) -> Result<Value> {
    let out = w
        .topo
        .node_cmd(Agent::bin()?)
        .args(["config", "audit", "-o", "json"])
        .args(args)
        .ok()?;
    serde_json::from_str(&out.stdout_str()).context("config audit -o json is not JSON")
}

/// The pairs of `report` for `client`.
fn pairs<'a>(report: &'a Value, client: &str) -> Vec<&'a Value> {
    report["changes"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter(|c| c["clientNamespace"] == client)
                .collect()
        })
        .unwrap_or_default()
}

fn dig_short(w: &World, from: &str, name: &str) -> Result<String> {
    Ok(w.dig_cmd(from)
        .args(["+short", name])
        .ok()?
        .stdout_str()
        .trim()
        .to_string())
}

fn replace_mesh(dir: &Path, text: &str) -> Result<()> {
    world::replace_file(dir, "01-mesh-config.yaml", text)
}

#[test]
fn with_the_feature_off_the_audit_of_namespace_counts_what_team_b_would_lose_in_dns_and_in_the_kernel()
-> Result<()> {
    let audit = AuditFile::new("hide", NAMESPACE_DEFAULT)?;
    let w = World::start_args(
        |dir| replace_mesh(dir, FEATURE_OFF),
        &launch_fast(),
        &["--audit-mesh-config", &audit.arg()],
    )?;
    let before = w.agent.metrics()?;

    // Enforced: the feature is off, team-a's entry is PUBLIC: team-b gets it.
    ensure!(
        dig_short(&w, "team-b", "api.example.com")? == "203.0.113.10",
        "team-b's dig is answered with team-a's address"
    );
    let connections: u32 = 5;
    for _ in 0..connections {
        let reach = w.curl("team-b", "http://203.0.113.10/")?;
        ensure!(
            reach == Reach::Server("api-endpoint".into()),
            "enforced: team-b reaches team-a's endpoint, got {reach:?}"
        );
    }
    // team-a's own traffic: the same under both policies.
    ensure!(dig_short(&w, "team-a", "api.example.com")? == "203.0.113.10");
    ensure!(w.curl("team-a", "http://203.0.113.10/")? == Reach::Server("api-endpoint".into()));

    let dns = change_key("team-b", ("team-a", "api-example"), "dns", "would_hide");
    let connect = change_key("team-b", ("team-a", "api-example"), "connect", "would_hide");
    let after = w.agent.wait_metrics(
        "the kernel's decisions audited",
        pace::scaled(Duration::from_secs(5)),
        |m| m.get_or_zero(&connect) >= f64::from(connections),
    )?;
    ensure!(
        after.get_or_zero(&dns) >= 1.0,
        "team-b's query counted: {after:#?}"
    );
    assert_eq!(
        after.get_or_zero(&connect),
        f64::from(connections),
        "team-a's own connection is not counted"
    );
    // The kernel decided every one of them; the proxy none.
    ensure!(
        delta(&before, &after, KERNEL_REWRITTEN) >= f64::from(connections + 1),
        "the kernel rewrote team-b's and team-a's connections"
    );
    assert_eq!(
        delta(&before, &after, PROXY_SERVICE),
        0.0,
        "the proxy decided nothing"
    );

    let report = config_audit(&w, &[])?;
    ensure!(
        pairs(&report, "team-a").is_empty(),
        "team-a's own use changes nothing: {report:#}"
    );
    let b = pairs(&report, "team-b");
    let find = |kind: &str| {
        b.iter()
            .find(|c| c["kind"] == kind && c["service"] == "api-example")
            .copied()
    };
    let connect_pair = find("connect").context("team-b's connect pair")?;
    assert_eq!(connect_pair["change"], "would_hide");
    assert_eq!(connect_pair["serviceNamespace"], "team-a");
    assert_eq!(connect_pair["count"], u64::from(connections));
    assert_eq!(connect_pair["exampleClient"], "team-b/b1");
    ensure!(find("dns").is_some_and(|c| c["count"].as_u64() >= Some(1)));
    // Filtered by client namespace, as `--namespace` says.
    let only_a = config_audit(&w, &["--namespace", "team-a"])?;
    ensure!(
        only_a["changes"].as_array().is_some_and(Vec::is_empty),
        "{only_a:#}"
    );
    // One info line per new pair.
    let log = w.agent.log();
    ensure!(
        log.matches("audit: the audit mesh config would change this decision")
            .count()
            >= 2,
        "{log}"
    );
    Ok(())
}

#[test]
fn with_namespace_enforced_an_audit_publishing_team_a_counts_would_show_and_a_bad_file_changes_nothing()
-> Result<()> {
    let audit = AuditFile::new(
        "show",
        "serviceEntryVisibility:\n  defaultVisibility: SOMETIMES\n",
    )?;
    let w = World::start_args(
        |_| Ok(()),
        &launch_fast(),
        &["--audit-mesh-config", &audit.arg()],
    )?;
    // The bad file is refused, naming itself and its field; enforcement is as without audit.
    let report = config_audit(&w, &[])?;
    let error = &report["lastError"][0];
    assert_eq!(error["file"], audit.arg().as_str(), "{report:#}");
    ensure!(
        error["field"]
            .as_str()
            .is_some_and(|f| f.contains("defaultVisibility")),
        "{report:#}"
    );
    let upstream = w.dig_upstream("api.example.com")?.a_records();
    let answer = dig_short(&w, "team-b", "api.example.com")?;
    ensure!(
        upstream.len() == 1 && answer == upstream[0].to_string(),
        "the real api.example.com ({upstream:?}) answers team-b: {answer:?}"
    );
    ensure!(w.curl("team-b", "http://203.0.113.10/")? == Reach::Server("real-203.0.113.10".into()));
    ensure!(pairs(&config_audit(&w, &[])?, "team-b").is_empty());

    // A good version, put in place as a ConfigMap update does, is read without a restart.
    audit.write(TEAM_A_PUBLIC)?;
    let deadline = std::time::Instant::now() + pace::scaled(Duration::from_secs(10));
    while config_audit(&w, &[])?["loadedAt"].is_null() {
        ensure!(
            std::time::Instant::now() < deadline,
            "the new audit file was not read"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Enforced: team-b still gets the real answer, and an address only team-a's entry claims
    // passes through to the real host.
    ensure!(dig_short(&w, "team-b", "api.example.com")? == upstream[0].to_string());
    ensure!(w.curl("team-b", "http://203.0.113.10/")? == Reach::Server("real-203.0.113.10".into()));
    let dns = change_key("team-b", ("team-a", "api-example"), "dns", "would_show");
    let connect = change_key("team-b", ("team-a", "api-example"), "connect", "would_show");
    let after = w.agent.wait_metrics(
        "team-b's would_show",
        pace::scaled(Duration::from_secs(5)),
        |m| m.get_or_zero(&dns) >= 1.0 && m.get_or_zero(&connect) >= 1.0,
    )?;
    ensure!(after.get_or_zero(&dns) >= 1.0);
    let report = config_audit(&w, &[])?;
    ensure!(
        report["lastError"].is_null(),
        "the good version clears the error: {report:#}"
    );
    ensure!(pairs(&report, "team-a").is_empty(), "{report:#}");
    Ok(())
}

#[test]
fn the_audit_follows_the_kubernetes_api_source_too() -> Result<()> {
    let audit = AuditFile::new("kube", NAMESPACE_DEFAULT)?;
    let w = World::start_kube_args(
        |dir| replace_mesh(dir, FEATURE_OFF),
        &["--audit-mesh-config", &audit.arg()],
    )?;
    ensure!(dig_short(&w, "team-b", "api.example.com")? == "203.0.113.10");
    let dns = change_key("team-b", ("team-a", "api-example"), "dns", "would_hide");
    w.agent.wait_metrics(
        "team-b's query audited",
        pace::scaled(Duration::from_secs(5)),
        |m| m.get_or_zero(&dns) >= 1.0,
    )?;
    let report = config_audit(&w, &[])?;
    ensure!(report["entriesChanged"].as_u64() >= Some(1), "{report:#}");
    Ok(())
}
