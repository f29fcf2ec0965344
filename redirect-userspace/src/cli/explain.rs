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
    /// The client: a namespace (a namespace with no pods is still that namespace), a Pod as
    /// `NAMESPACE/NAME`, or a Pod's address.
    #[arg(long = "from", value_name = "NAMESPACE|NS/POD|POD-IP")]
    pub from: String,
    /// A host name as the client's application would ask for it (short names are expanded with
    /// the namespace's search domains; a trailing dot makes it absolute).
    #[arg(long, value_name = "NAME")]
    pub host: Option<String>,
    /// An original destination, `IP`, `IP:PORT` or `[IPv6]:PORT`.
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_destination)]
    pub ip: Option<Destination>,
    /// How the connection reaches the destination Pod, when it is a Pod of this node: its
    /// authorization policies decide it with the client's identity on the same node or over
    /// HBONE, without one in plaintext.
    #[arg(long, value_enum, default_value_t = Over::Auto)]
    pub over: Over,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
    pub output: TableOrJson,
    /// Also what this client would get under this mesh config's `serviceEntryVisibility` (the
    /// audit policy of `run --audit-mesh-config`), and whether it differs. JSON then holds both,
    /// as `enforced` and `audit`.
    #[arg(long, value_name = "PATH")]
    pub audit_mesh_config: Option<std::path::PathBuf>,
}

/// Explains over everything valid; with any error, also lists every error (stderr) and exits 1.
pub(crate) fn explain(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    let (model, resolution, errors) = match output::load(&args.input) {
        Ok(loaded) => loaded,
        Err(unreadable) => return Ok(output::invalid_input(&[unreadable])),
    };
    let snapshot = Snapshot::build(&model, &resolution);
    let client = match client_of(&snapshot, &args.from) {
        Ok(client) => client,
        Err(why) => anyhow::bail!("--from {}: {why}", args.from),
    };
    let audited = match &args.audit_mesh_config {
        Some(path) => match crate::config::read_mesh_file(path) {
            Ok(mesh) => {
                let config = mesh.service_entry_visibility.as_ref();
                let resolution = crate::visibility::resolve_under(&model, config);
                Some((path, snapshot.with_services(&model, &resolution)))
            }
            Err(errors) => return Ok(output::invalid_input(&errors.0)),
        },
        None => None,
    };
    let text = match (&args.host, args.ip) {
        (Some(host), _) => {
            let under = |s: &Snapshot| {
                let mut e = explain_host(s, &client.namespace, host);
                e.client = client.clone();
                e
            };
            let used = |e: &HostExplanation| e.dns.service.clone();
            render(
                &snapshot,
                audited.as_ref(),
                args.output,
                (under, used),
                host_table,
            )?
        }
        (None, Some(dst)) => {
            let under = |s: &Snapshot| {
                let mut e = explain_ip(s, &client.namespace, dst);
                e.client = client.clone();
                authorize(s, &mut e, dst, args.over);
                e
            };
            let used = |e: &IpExplanation| e.outbound.service.clone();
            render(
                &snapshot,
                audited.as_ref(),
                args.output,
                (under, used),
                ip_table,
            )?
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

/// The explanation under `snapshot`, and with an audit policy the one under it too, said apart.
/// They differ, as the audit counts a change, when the service used (`used`) differs.
fn render<E: serde::Serialize>(
    snapshot: &Snapshot,
    audited: Option<&(&std::path::PathBuf, Snapshot)>,
    format: TableOrJson,
    (explain, used): (impl Fn(&Snapshot) -> E, impl Fn(&E) -> Option<String>),
    table: fn(&E) -> String,
) -> anyhow::Result<String> {
    let enforced = explain(snapshot);
    let Some((path, audit_snapshot)) = audited else {
        return Ok(match format {
            TableOrJson::Json => output::json(&enforced)?,
            TableOrJson::Table => table(&enforced),
        });
    };
    let audit = explain(audit_snapshot);
    let changes = used(&audit) != used(&enforced);
    Ok(match format {
        TableOrJson::Json => output::json(&serde_json::json!({
            "enforced": enforced,
            "audit": audit,
            "changes": changes,
        }))?,
        TableOrJson::Table if changes => format!(
            "{}\nUnder the audit policy ({}), this would change:\n{}",
            table(&enforced),
            path.display(),
            table(&audit)
        ),
        TableOrJson::Table => format!(
            "{}\nUnder the audit policy ({}): the same service.\n",
            table(&enforced),
            path.display()
        ),
    })
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
            format!("{} (the proxy with --no-fast-path)", o.decided_by.as_str()),
        ),
        ("why", o.reason.clone()),
    ];
    let mut rows = rows.to_vec();
    if let Some(a) = &o.authorization {
        let verdict = if a.allowed { "allowed" } else { "denied" };
        let decided_in = match a.decided_in.as_str() {
            "kernel" => " in the kernel",
            "proxy" => " by the proxy",
            _ => "",
        };
        rows.push(("authz", format!("{verdict}{decided_in}: {}", a.reason)));
        let policies = if a.policies.is_empty() {
            "-".to_string()
        } else {
            a.policies.join(", ")
        };
        rows.push(("policies", format!("{policies} (mTLS {})", a.mtls)));
    }
    rows.iter().map(|(k, v)| format!("{k:<10} {v}\n")).collect()
}
