//! `redirect config service`: what a running agent holds, like `istioctl ztunnel-config service`.
use std::{net::SocketAddr, process::ExitCode};

use anyhow::Context;
use serde_json::Value;

use super::output::{self, Format};
use crate::admin::client;

#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub what: ConfigWhat,
}

#[derive(Debug, clap::Subcommand)]
pub enum ConfigWhat {
    /// The services the agent holds, with the visibility it applies to each.
    Service(ServiceArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServiceArgs {
    /// Only services of this namespace.
    #[arg(long)]
    pub service_namespace: Option<String>,
    /// The agent's admin server.
    #[arg(long, default_value = "127.0.0.1:15000")]
    pub admin: SocketAddr,
    /// Output format (json and yaml are `/config_dump`'s service objects, unchanged).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

pub fn config(args: ConfigArgs) -> anyhow::Result<ExitCode> {
    match args.what {
        ConfigWhat::Service(args) => service(args),
    }
}

fn service(args: ServiceArgs) -> anyhow::Result<ExitCode> {
    let response = client::get(
        args.admin,
        "/config_dump",
        std::time::Duration::from_secs(10),
    )?;
    if !response.is_success() {
        anyhow::bail!(
            "/config_dump answered {}: {}",
            response.status,
            response.text().trim()
        );
    }
    let dump: Value = serde_json::from_slice(&response.body).context("/config_dump is not JSON")?;
    let services = services(&dump, args.service_namespace.as_deref())?;
    let text = match args.output {
        Format::Json => output::json(&services)? + "\n",
        Format::Yaml => output::yaml(&services)?,
        Format::Table => table(&services),
    };
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

/// The dump's services, optionally of one namespace, as the dump gives them.
pub fn services(dump: &Value, namespace: Option<&str>) -> anyhow::Result<Vec<Value>> {
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

pub fn table(services: &[Value]) -> String {
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
