//! `redirect resolve`: every ServiceEntry with its resolved visibility, matched policy, status
//! conditions, effective sidecar exportTo and addresses. Offline; no root, no eBPF.
use std::process::ExitCode;

use serde::Serialize;

use super::output::{self, Format};
use crate::{
    config::{Address, ConfigError, Model},
    visibility::{self, Resolved, ResolvedEntry, Visibility},
};

#[derive(Debug, clap::Args)]
pub(crate) struct ResolveArgs {
    #[command(flatten)]
    pub input: super::InputArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// Only the ServiceEntries of this namespace (every namespace's still count for allocation).
    #[arg(short = 'n', long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Also each entry's visibility under this mesh config's `serviceEntryVisibility` (the audit
    /// policy `run --audit-mesh-config` would count against).
    #[arg(long, value_name = "PATH")]
    pub audit_mesh_config: Option<std::path::PathBuf>,
}

/// The JSON/YAML shape: a public interface, keep it stable.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolveReport {
    pub service_entries: Vec<EntryReport>,
    pub errors: Vec<ConfigError>,
}

/// One entry as resolved, and the addresses it is reached at (declared, else allocated).
#[derive(Debug, Serialize)]
pub struct EntryReport {
    #[serde(flatten)]
    pub resolved: ResolvedEntry,
    pub addresses: Vec<Address>,
    /// With `--audit-mesh-config`: the visibility the audit policy gives the entry.
    #[serde(rename = "auditVisibility", skip_serializing_if = "Option::is_none")]
    pub audit_visibility: Option<Visibility>,
}

/// The report for a model and its resolution (`visibility::resolve(model)`), errors left empty.
pub fn report(model: &Model, resolution: Resolved) -> ResolveReport {
    let service_entries = model
        .service_entries
        .iter()
        .zip(resolution.entries)
        .map(|(se, resolved)| EntryReport {
            addresses: resolved.addresses(&se.addresses),
            resolved,
            audit_visibility: None,
        })
        .collect();
    ResolveReport {
        service_entries,
        errors: Vec::new(),
    }
}

/// Prints everything valid; with any error, also every error (stderr) and exit 1.
pub(crate) fn resolve(args: ResolveArgs) -> anyhow::Result<ExitCode> {
    let (mut model, resolution, errors) = match output::load(&args.input) {
        Ok(loaded) => loaded,
        Err(unreadable) => return Ok(output::invalid_input(&[unreadable])),
    };
    let mut report = report(&model, resolution);
    report.errors = errors;
    if let Some(path) = &args.audit_mesh_config {
        let audit = match crate::config::read_mesh_file(path) {
            Ok(mesh) => mesh,
            Err(errors) => return Ok(output::invalid_input(&errors.0)),
        };
        let config = audit.service_entry_visibility.as_ref();
        let audited = visibility::resolve_under(&model, config);
        for (entry, audited) in report.service_entries.iter_mut().zip(audited.entries) {
            entry.audit_visibility = Some(audited.visibility);
        }
    }
    if let Some(ns) = &args.namespace {
        // The two lists hold the same entries in the same order: filtered alike, they stay paired.
        model.service_entries.retain(|se| se.meta.namespace == *ns);
        report
            .service_entries
            .retain(|e| e.resolved.namespace == *ns);
    }
    match args.output {
        Format::Table => print!("{}", render_table(&model, &report)),
        format => print_report(&report, format)?,
    }
    if report.errors.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(output::invalid_input(&report.errors))
    }
}

fn print_report(report: &ResolveReport, format: Format) -> anyhow::Result<()> {
    match format {
        Format::Json => println!("{}", output::json(report)?),
        _ => print!("{}", output::yaml(report)?),
    }
    Ok(())
}

fn render_table(model: &Model, report: &ResolveReport) -> String {
    let mut out = match &model.mesh.service_entry_visibility {
        None => "serviceEntryVisibility: not set (the feature is inert: every ServiceEntry is Public)\n\n".to_string(),
        Some(c) => format!(
            "serviceEntryVisibility: defaultVisibility {}, {} polic{}, applyToSidecars {}\n\n",
            c.default_visibility.api_name(),
            c.policies.len(),
            if c.policies.len() == 1 { "y" } else { "ies" },
            c.apply_to_sidecars
        ),
    };
    let rows: Vec<Vec<String>> = model
        .service_entries
        .iter()
        .zip(&report.service_entries)
        .map(|(se, report)| {
            let e = &report.resolved;
            let hosts: Vec<String> = se.hosts.iter().map(|h| h.to_string()).collect();
            let conditions = conditions_cell(se, e);
            vec![
                e.namespace.clone(),
                e.name.clone(),
                hosts.join(","),
                match report.audit_visibility {
                    Some(audit) if audit != e.visibility => {
                        format!("{} (audit: {})", e.visibility.as_str(), audit.as_str())
                    }
                    _ => e.visibility.as_str().to_string(),
                },
                e.matched_policy
                    .map_or("default".to_string(), |i| i.to_string()),
                e.sidecar_export_to.join(","),
                list_or_dash(&report.addresses),
                conditions,
            ]
        })
        .collect();
    out.push_str(&output::table(
        &[
            "NAMESPACE",
            "NAME",
            "HOSTS",
            "VISIBILITY",
            "POLICY",
            "SIDECAR EXPORTTO",
            "ADDRESSES",
            "CONDITIONS",
        ],
        &rows,
    ));
    let refused: Vec<String> = report
        .service_entries
        .iter()
        .map(|e| &e.resolved)
        .flat_map(|e| {
            e.conditions
                .iter()
                .filter(|c| c.status == visibility::ConditionStatus::False)
                .map(move |c| format!("  {}/{}: {}: {}", e.namespace, e.name, c.reason, c.message))
        })
        .collect();
    if !refused.is_empty() {
        out.push_str("\nRefused:\n");
        out.push_str(&refused.join("\n"));
        out.push('\n');
    }
    let shadowed: Vec<String> = report
        .service_entries
        .iter()
        .map(|e| &e.resolved)
        .flat_map(|e| {
            e.shadowed.iter().map(move |s| {
                format!(
                    "  {}/{}: {} is not published; {} defines it in this namespace",
                    e.namespace, e.name, s.host, s.by
                )
            })
        })
        .collect();
    if !shadowed.is_empty() {
        out.push_str("\nOne namespace, one host:\n");
        out.push_str(&shadowed.join("\n"));
        out.push('\n');
    }
    out
}

fn list_or_dash(addresses: &[Address]) -> String {
    if addresses.is_empty() {
        return "-".to_string();
    }
    addresses
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The CONDITIONS cell: why an entry reaches no data plane, else its conditions.
fn conditions_cell(se: &crate::config::ServiceEntry, e: &ResolvedEntry) -> String {
    if e.visibility == Visibility::None {
        "none (NONE: delivered to no data plane)".to_string()
    } else if !e.discovered {
        "none (namespace not discovered: delivered to no data plane)".to_string()
    } else if e.shadowed.len() == se.hosts.len() {
        "none (every host defined earlier in its namespace: not published)".to_string()
    } else if e.conditions.is_empty() {
        "-".to_string()
    } else {
        e.conditions
            .iter()
            .map(|c| {
                format!(
                    "{}={}/{}",
                    c.type_.trim_start_matches("istio.io/"),
                    c.status,
                    c.reason
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}
