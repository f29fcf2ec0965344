//! `redirect explain`: the report of [`crate::explain`] over manifests, as a table or JSON.
use std::process::ExitCode;

use super::output::{self, TableOrJson};
pub use crate::explain::*;
use crate::state::Snapshot;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["host", "ip"])))]
pub(crate) struct ExplainArgs {
    #[command(flatten)]
    pub input: super::InputArgs,
    /// The client namespace (a namespace with no pods is still that namespace).
    #[arg(long = "from", value_name = "NAMESPACE")]
    pub from: String,
    /// A host name as the client's application would ask for it (short names are expanded with
    /// the namespace's search domains; a trailing dot makes it absolute).
    #[arg(long, value_name = "NAME")]
    pub host: Option<String>,
    /// An original destination, `IP`, `IP:PORT` or `[IPv6]:PORT`.
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_destination)]
    pub ip: Option<Destination>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
    pub output: TableOrJson,
}

/// Explains over everything valid; with any error, also lists every error (stderr) and exits 1.
pub(crate) fn explain(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    let (model, resolution, errors) = match output::load(&args.input) {
        Ok(loaded) => loaded,
        Err(unreadable) => return Ok(output::invalid_input(&[unreadable])),
    };
    let snapshot = Snapshot::build(&model, &resolution);
    let text = match (&args.host, args.ip) {
        (Some(host), _) => {
            let e = explain_host(&snapshot, &args.from, host);
            match args.output {
                TableOrJson::Json => output::json(&e)?,
                TableOrJson::Table => host_table(&e),
            }
        }
        (None, Some(dst)) => {
            let e = explain_ip(&snapshot, &args.from, dst);
            match args.output {
                TableOrJson::Json => output::json(&e)?,
                TableOrJson::Table => ip_table(&e),
            }
        }
        (None, None) => anyhow::bail!("one of --host and --ip is required"),
    };
    println!("{}", text.trim_end());
    if errors.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(output::invalid_input(&errors))
    }
}

fn or_dash(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "-".to_string())
}

/// `team-a`, or `team-a/a1 (pod)` when the agent named the pod.
fn client(c: &Client) -> String {
    match &c.pod {
        Some(pod) => format!("{pod} (pod)"),
        None => c.namespace.clone(),
    }
}

pub(crate) fn host_table(e: &HostExplanation) -> String {
    let d = &e.dns;
    let queries: Vec<String> = d
        .queries
        .iter()
        .map(|q| format!("{} -> {}", q.name, q.action.as_str()))
        .collect();
    let rows = [
        ("client", client(&e.client)),
        ("action", d.action.as_str().to_string()),
        ("service", or_dash(&d.service)),
        ("query", d.query.clone()),
        ("cname", or_dash(&d.cname)),
        (
            "addresses",
            if d.addresses.is_empty() {
                "-".into()
            } else {
                let addresses: Vec<String> = d.addresses.iter().map(|a| a.to_string()).collect();
                addresses.join(", ")
            },
        ),
        ("hidden", or_dash(&d.hidden)),
        ("queries", queries.join("\n           ")),
        ("why", d.reason.clone()),
    ];
    rows.iter().map(|(k, v)| format!("{k:<10} {v}\n")).collect()
}

pub(crate) fn ip_table(e: &IpExplanation) -> String {
    let o = &e.outbound;
    let rows = [
        ("client", client(&e.client)),
        ("action", o.action.json_name().to_string()),
        ("service", or_dash(&o.service)),
        ("workload", or_dash(&o.workload)),
        ("endpoint", or_dash(&o.endpoint)),
        (
            "candidates",
            if o.candidates.is_empty() {
                "-".into()
            } else {
                o.candidates.join(", ")
            },
        ),
        ("hidden", or_dash(&o.hidden)),
        (
            "decided by",
            format!("{} (the proxy with --no-fast-path)", o.decided_by.name()),
        ),
        ("why", o.reason.clone()),
    ];
    rows.iter().map(|(k, v)| format!("{k:<10} {v}\n")).collect()
}
