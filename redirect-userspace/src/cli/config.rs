//! `redirect config ...`: what a running agent holds and decides, asked of its admin server, like
//! `istioctl ztunnel-config`: services, workloads, the log filter, everything at once, and `explain`
//! computed by the agent on the snapshot in force.
use std::{net::SocketAddr, process::ExitCode, time::Duration};

use anyhow::Context;
use serde_json::Value;

use super::output::{self, Format, TableOrJson};
use crate::admin::client;

#[derive(Debug, clap::Args)]
pub(crate) struct ConfigArgs {
    #[command(subcommand)]
    pub what: ConfigWhat,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ConfigWhat {
    /// The services the agent holds, with the visibility it applies to each.
    Service(ServiceArgs),
    /// The workloads the agent knows: namespace, name, addresses, node, opted out or not.
    Workload(WorkloadArgs),
    /// The log filter in force; with --level, a new one.
    Log(LogArgs),
    /// Services, workloads and the log filter in one document.
    All(AllArgs),
    /// What the agent decides for a client, and why: `redirect explain` on the snapshot in force.
    Explain(LiveExplainArgs),
    /// What the audit mesh config would change (`run --audit-mesh-config`): each client namespace,
    /// service, kind and change with its count, first and last seen, and an example client.
    Audit(AuditArgs),
    /// The recent connection records, the kernel's and the proxy's (who, where, which service and
    /// endpoint, bytes, how it ended); with --follow, each new one as it happens.
    Connections(super::connections::ConnectionsArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct AuditArgs {
    /// Only the changes seen by clients of this namespace.
    #[arg(long)]
    pub namespace: Option<String>,
    #[command(flatten)]
    pub admin: AdminArg,
    /// Output format (json and yaml are `/audit`'s document, unchanged).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

/// The agent's admin server.
#[derive(Debug, clap::Args)]
pub(crate) struct AdminArg {
    #[arg(long, default_value = "127.0.0.1:15000")]
    pub admin: SocketAddr,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ServiceArgs {
    /// Only services of this namespace.
    #[arg(long)]
    pub service_namespace: Option<String>,
    #[command(flatten)]
    pub admin: AdminArg,
    /// Output format (json and yaml are `/config_dump`'s service objects, unchanged).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(Debug, clap::Args)]
pub(crate) struct WorkloadArgs {
    /// Only workloads of this namespace.
    #[arg(long)]
    pub workload_namespace: Option<String>,
    #[command(flatten)]
    pub admin: AdminArg,
    /// Output format (json and yaml are `/config_dump`'s workload objects, unchanged).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LogArgs {
    /// A new filter (`RUST_LOG` syntax: `debug`, `info,redirect=debug`).
    #[arg(long)]
    pub level: Option<String>,
    #[command(flatten)]
    pub admin: AdminArg,
}

#[derive(Debug, clap::Args)]
pub(crate) struct AllArgs {
    #[command(flatten)]
    pub admin: AdminArg,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Yaml)]
    pub output: Format,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["host", "ip"])))]
pub(crate) struct LiveExplainArgs {
    /// The client: a namespace, a pod as `namespace/name`, or a pod's address.
    #[arg(long = "from", value_name = "NAMESPACE|NAMESPACE/POD|POD-IP")]
    pub from: String,
    /// A host name as the client's application would ask for it.
    #[arg(long, value_name = "NAME")]
    pub host: Option<String>,
    /// An original destination, `IP`, `IP:PORT` or `[IPv6]:PORT`.
    #[arg(long, value_name = "IP[:PORT]")]
    pub ip: Option<String>,
    /// How the connection reaches the destination Pod, when it is a Pod of the node (its
    /// authorization policies decide it with the client's identity or without one).
    #[arg(long, value_enum, default_value_t = crate::explain::Over::Auto)]
    pub over: crate::explain::Over,
    #[command(flatten)]
    pub admin: AdminArg,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
    pub output: TableOrJson,
}

pub(super) fn config(args: ConfigArgs) -> anyhow::Result<ExitCode> {
    let text = match args.what {
        ConfigWhat::Connections(args) => return super::connections::connections(&args),
        ConfigWhat::Service(args) => {
            let services = services(&dump(args.admin.admin)?, args.service_namespace.as_deref())?;
            render(&services, args.output, table)?
        }
        ConfigWhat::Workload(args) => {
            let workloads =
                workloads(&dump(args.admin.admin)?, args.workload_namespace.as_deref())?;
            render(&workloads, args.output, workload_table)?
        }
        ConfigWhat::Log(args) => {
            let path = with_query("/logging", "level", args.level.as_deref());
            get(args.admin.admin, &path)?
        }
        ConfigWhat::All(args) => {
            let dump = dump(args.admin.admin)?;
            let all = serde_json::json!({
                "services": services(&dump, None)?,
                "workloads": workloads(&dump, None)?,
                "logLevel": get(args.admin.admin, "/logging")?.trim(),
            });
            match args.output {
                Format::Json => output::json(&all)? + "\n",
                Format::Yaml => output::yaml(&all)?,
                Format::Table => format!(
                    "{}\n{}\nLOG FILTER  {}\n",
                    table(&services(&dump, None)?),
                    workload_table(&workloads(&dump, None)?),
                    all["logLevel"].as_str().unwrap_or("-")
                ),
            }
        }
        ConfigWhat::Explain(args) => live_explain(&args)?,
        ConfigWhat::Audit(args) => {
            let path = with_query("/audit", "namespace", args.namespace.as_deref());
            let audit: Value = serde_json::from_str(&get(args.admin.admin, &path)?)
                .context("/audit is not JSON")?;
            match args.output {
                Format::Json => output::json(&audit)? + "\n",
                Format::Yaml => output::yaml(&audit)?,
                Format::Table => audit_table(&audit),
            }
        }
    };
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

/// `path`, with `?key=value` (encoded) when a value is given.
fn with_query(path: &str, key: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!(
            "{path}?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair(key, value)
                .finish()
        ),
        None => path.to_string(),
    }
}

/// The audit's changes as a table, and what the policy is.
pub(super) fn audit_table(audit: &Value) -> String {
    let field = |v: &Value, k: &str| match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    };
    let rows: Vec<Vec<String>> = audit["changes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|c| {
            vec![
                field(c, "clientNamespace"),
                format!("{}/{}", field(c, "serviceNamespace"), field(c, "service")),
                field(c, "kind"),
                field(c, "change"),
                field(c, "count"),
                field(c, "firstSeen"),
                field(c, "lastSeen"),
                field(c, "exampleClient"),
            ]
        })
        .collect();
    let mut out = format!(
        "audit mesh config {} (read {}): {} entries seen otherwise\n",
        field(audit, "file"),
        field(audit, "loadedAt"),
        field(audit, "entriesChanged"),
    );
    if !audit["lastError"].is_null() {
        out.push_str(&format!(
            "its last version was refused, the one before stays: {}\n",
            audit["lastError"]
        ));
    }
    if rows.is_empty() {
        out.push_str("no decision would change yet\n");
        return out;
    }
    out.push_str(&output::table(
        &[
            "CLIENT NAMESPACE",
            "SERVICE",
            "KIND",
            "CHANGE",
            "COUNT",
            "FIRST SEEN",
            "LAST SEEN",
            "EXAMPLE CLIENT",
        ],
        &rows,
    ));
    out
}

/// GETs `path` from the agent; an answer other than 2xx is an error carrying its text.
fn get(admin: SocketAddr, path: &str) -> anyhow::Result<String> {
    let response = client::get(admin, path, Duration::from_secs(10))?;
    if !response.is_success() {
        anyhow::bail!(
            "{} answered {}: {}",
            path.split('?').next().unwrap_or(path),
            response.status,
            response.text().trim()
        );
    }
    Ok(response.text())
}

fn dump(admin: SocketAddr) -> anyhow::Result<Value> {
    serde_json::from_str(&get(admin, "/config_dump")?).context("/config_dump is not JSON")
}

fn render(
    items: &[Value],
    format: Format,
    table: fn(&[Value]) -> String,
) -> anyhow::Result<String> {
    Ok(match format {
        Format::Json => output::json(&items)? + "\n",
        Format::Yaml => output::yaml(&items)?,
        Format::Table => table(items),
    })
}

fn live_explain(args: &LiveExplainArgs) -> anyhow::Result<String> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("from", &args.from);
    match (&args.host, &args.ip) {
        (Some(host), _) => query.append_pair("host", host),
        (None, Some(ip)) => query
            .append_pair("ip", ip)
            .append_pair("over", args.over.as_str()),
        (None, None) => anyhow::bail!("one of --host and --ip is required"),
    };
    let body = get(args.admin.admin, &format!("/explain?{}", query.finish()))?;
    if args.output == TableOrJson::Json {
        return Ok(body);
    }
    let report: Value = serde_json::from_str(&body).context("/explain is not JSON")?;
    let text = if args.host.is_some() {
        super::explain::host_table(&serde_json::from_value(report)?)
    } else {
        super::explain::ip_table(&serde_json::from_value(report)?)
    };
    Ok(text.trim_end().to_string() + "\n")
}

/// The dump's workloads, optionally of one namespace, as the dump gives them.
pub(super) fn workloads(dump: &Value, namespace: Option<&str>) -> anyhow::Result<Vec<Value>> {
    let all = dump["workloads"]
        .as_array()
        .context("/config_dump has no workloads list")?;
    Ok(all
        .iter()
        .filter(|w| namespace.is_none_or(|ns| w["namespace"] == ns))
        .cloned()
        .collect())
}

pub(super) fn workload_table(workloads: &[Value]) -> String {
    let rows: Vec<Vec<String>> = workloads
        .iter()
        .map(|w| {
            vec![
                text(&w["namespace"]),
                text(&w["name"]),
                text(&w["kind"]),
                list(&w["ips"]),
                text(&w["node"]),
                if w["optedOut"] == true { "yes" } else { "no" }.to_string(),
                if w["cgroup"].is_u64() { "found" } else { "-" }.to_string(),
            ]
        })
        .collect();
    let mut out = output::table(
        &[
            "NAMESPACE",
            "NAME",
            "KIND",
            "ADDRESSES",
            "NODE",
            "OPTED-OUT",
        ],
        &rows,
    );
    if workloads.is_empty() {
        out.push_str("(no workloads: the agent holds no configuration, or none matches)\n");
    }
    out
}

/// The dump's services, optionally of one namespace, as the dump gives them.
pub(super) fn services(dump: &Value, namespace: Option<&str>) -> anyhow::Result<Vec<Value>> {
    let all = dump["services"]
        .as_array()
        .context("/config_dump has no services list")?;
    Ok(all
        .iter()
        .filter(|s| namespace.is_none_or(|ns| s["namespace"] == ns))
        .cloned()
        .collect())
}

const COLUMNS: [&str; 6] = [
    "NAMESPACE",
    "SERVICE-NAME",
    "HOSTNAME",
    "VIPS",
    "ENDPOINTS",
    "VISIBILITY",
];

pub(super) fn table(services: &[Value]) -> String {
    let rows: Vec<Vec<String>> = services
        .iter()
        .map(|s| {
            let endpoints: Vec<String> = s["endpoints"]
                .as_array()
                .map(|eps| eps.iter().map(|e| text(&e["address"])).collect())
                .unwrap_or_default();
            vec![
                text(&s["namespace"]),
                text(&s["name"]),
                text(&s["hostname"]),
                list(&s["vips"]),
                if endpoints.is_empty() {
                    "-".to_string()
                } else {
                    endpoints.join(",")
                },
                text(&s["visibility"]),
            ]
        })
        .collect();
    let mut out = output::table(&COLUMNS, &rows);
    if services.is_empty() {
        out.push_str("(no services: the agent holds no configuration, or none matches)\n");
    }
    out
}

fn text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| "-".to_string(), str::to_string)
}

fn list(value: &Value) -> String {
    let items: Vec<String> = value
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    if items.is_empty() {
        "-".to_string()
    } else {
        items.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dump() -> Value {
        json!({"services": [
            {"name": "api", "namespace": "team-a", "hostname": "api.example.com",
             "vips": ["203.0.113.10"], "ports": {"80": 80},
             "endpoints": [{"address": "198.51.100.20", "ports": {"80": 80}}],
             "visibility": "Namespace"},
            {"name": "web", "namespace": "team-b", "hostname": "web.team-b.svc.cluster.local",
             "vips": [], "ports": {}, "endpoints": [], "visibility": "Public"}
        ]})
    }

    #[test]
    fn filters_by_namespace_and_keeps_objects_unchanged() {
        let dump = dump();
        let only_a = services(&dump, Some("team-a")).unwrap();
        assert_eq!(only_a, vec![dump["services"][0].clone()]);
        assert_eq!(services(&dump, None).unwrap().len(), 2);
        assert!(services(&json!({}), None).is_err());
    }

    #[test]
    fn table_has_the_istioctl_like_columns() {
        let text = table(&services(&dump(), None).unwrap());
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("NAMESPACE  SERVICE-NAME  HOSTNAME"),
            "{text}"
        );
        assert!(lines[0].ends_with("ENDPOINTS      VISIBILITY"), "{text}");
        assert!(
            lines[1].contains("203.0.113.10")
                && lines[1].contains("198.51.100.20")
                && lines[1].ends_with("Namespace"),
            "{text}"
        );
        assert!(
            lines[2].ends_with("Public") && lines[2].contains(" - "),
            "{text}"
        );
    }

    #[test]
    fn empty_state_renders_headers_and_says_why() {
        let text = table(&[]);
        assert!(
            text.starts_with("NAMESPACE  SERVICE-NAME  HOSTNAME  VIPS  ENDPOINTS  VISIBILITY\n"),
            "{text}"
        );
        assert!(text.contains("no services"), "{text}");
    }
}
