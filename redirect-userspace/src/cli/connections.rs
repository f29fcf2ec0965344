//! `redirect config connections`: a running agent's connection records, kernel's and proxy's, as
//! `hubble observe` shows flows: the recent ones, and with `--follow` each new one as it happens.
//! A table row a record (fixed columns, so a followed row needs no later one to line up), or the
//! records as JSON (an array, or one object a line when following).
use std::{io::Write, net::SocketAddr, process::ExitCode};

use anyhow::Context;
use serde_json::Value;

use super::config::AdminArg;
use super::output::TableOrJson;
use crate::admin::client;

#[derive(Debug, clap::Args)]
pub(crate) struct ConnectionsArgs {
    /// After the recent records, print each new one as it happens, until interrupted.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only connections of clients in this namespace.
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only connections decided for this service.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub service: Option<String>,
    #[command(flatten)]
    pub admin: AdminArg,
    /// Output format (json is `/connections`' records, unchanged; one a line with --follow).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
    pub output: TableOrJson,
}

pub(super) fn connections(args: &ConnectionsArgs) -> anyhow::Result<ExitCode> {
    if let Some(service) = &args.service
        && service
            .split_once('/')
            .is_none_or(|(ns, name)| ns.is_empty() || name.is_empty())
    {
        anyhow::bail!("--service {service:?}: expected NAMESPACE/NAME");
    }
    let path = path(args);
    if args.follow {
        return follow(args.admin.admin, &path, args.output);
    }
    let response = client::get(args.admin.admin, &path, std::time::Duration::from_secs(10))?;
    if !response.is_success() {
        anyhow::bail!(
            "/connections answered {}: {}",
            response.status,
            response.text().trim()
        );
    }
    let text = response.text();
    match args.output {
        TableOrJson::Json => print!("{text}"),
        TableOrJson::Table => {
            let records: Vec<Value> =
                serde_json::from_str(&text).context("/connections is not a JSON array")?;
            print!("{}", header());
            for record in &records {
                print!("{}", row(record));
            }
            if records.is_empty() {
                println!("(no connection records yet, or none matches)");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `/connections` with the filter and `follow` asked for.
fn path(args: &ConnectionsArgs) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    if let Some(ns) = &args.namespace {
        query.append_pair("namespace", ns);
    }
    if let Some(service) = &args.service {
        query.append_pair("service", service);
    }
    if args.follow {
        query.append_pair("follow", "1");
    }
    let query = query.finish();
    match query.is_empty() {
        true => "/connections".to_string(),
        false => format!("/connections?{query}"),
    }
}

/// Prints each record as it comes (flushed: a pipe sees it at once).
fn follow(admin: SocketAddr, path: &str, output: TableOrJson) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    if output == TableOrJson::Table {
        let _ = write!(out, "{}", header());
    }
    client::follow(admin, path, |line| {
        let text = match output {
            TableOrJson::Json => format!("{line}\n"),
            TableOrJson::Table => match serde_json::from_str::<Value>(line) {
                Ok(record) if record["event"] == "missed" => format!(
                    "... {} records missed (this follower fell behind)\n",
                    record["count"]
                ),
                Ok(record) => row(&record),
                Err(_) => format!("{line}\n"),
            },
        };
        // A closed pipe (`| head`) ends the follow.
        write!(out, "{text}").and_then(|()| out.flush()).is_ok()
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Column widths of the table, and their headers.
const COLUMNS: [(&str, usize); 12] = [
    ("TIME", 24),
    ("EVENT", 5),
    ("BY", 6),
    ("CLIENT", 21),
    ("WORKLOAD", 24),
    ("ORIGINAL DST", 21),
    ("OUTCOME", 11),
    ("SERVICE", 28),
    ("ENDPOINT", 21),
    ("SENT", 9),
    ("RECEIVED", 9),
    ("DURATION", 0),
];

fn header() -> String {
    line(COLUMNS.iter().map(|(h, _)| h.to_string()))
}

/// One record as a table row: its cells in the columns' widths (a longer cell pushes the rest
/// along rather than being cut).
pub(super) fn row(record: &Value) -> String {
    let text = |key: &str| match &record[key] {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    };
    let close = record["event"] == "close";
    let when_closed = |cell: String| if close { cell } else { "-".to_string() };
    let duration = match (&record["durationMs"], record["end"].as_str()) {
        (Value::Number(ms), Some(end)) => format!("{ms}ms {end}"),
        _ => "-".to_string(),
    };
    line(
        [
            text("time"),
            text("event"),
            text("decidedBy"),
            text("client"),
            text("workload"),
            text("origDst"),
            text("outcome"),
            text("service"),
            text("endpoint"),
            when_closed(text("bytesSent")),
            when_closed(text("bytesReceived")),
            duration,
        ]
        .into_iter(),
    )
}

fn line(cells: impl Iterator<Item = String>) -> String {
    let mut out = String::new();
    for ((_, width), cell) in COLUMNS.iter().zip(cells) {
        let pad = width.saturating_sub(cell.chars().count());
        out.push_str(&cell);
        out.extend(std::iter::repeat_n(' ', pad + 2));
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_close_row_has_every_field_in_its_column_and_an_open_row_dashes_what_it_cannot_know() {
        let close = json!({
            "event": "close", "decidedBy": "kernel", "time": "2026-12-05T08:00:00.123Z",
            "client": "10.244.1.10:40000", "workload": "team-a/a1", "namespace": "team-a",
            "origDst": "203.0.113.10:80", "outcome": "service", "service": "team-a/api-example",
            "endpoint": "198.51.100.20:80", "bytesSent": 77, "bytesReceived": 320,
            "durationMs": 3, "end": "closed"
        });
        let text = row(&close);
        let cells: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "2026-12-05T08:00:00.123Z",
                "close",
                "kernel",
                "10.244.1.10:40000",
                "team-a/a1",
                "203.0.113.10:80",
                "service",
                "team-a/api-example",
                "198.51.100.20:80",
                "77",
                "320",
                "3ms",
                "closed"
            ]
        );
        // The header and a row start each column at the same place.
        let at = |line: &str, cell: &str| line.find(cell).unwrap();
        assert_eq!(at(&header(), "SERVICE"), at(&text, "team-a/api-example"));
        let open = json!({"event": "open", "decidedBy": "kernel", "client": null,
            "bytesSent": 0, "durationMs": null, "end": null});
        let cells: Vec<String> = row(&open).split_whitespace().map(str::to_string).collect();
        assert_eq!(&cells[1..4], ["open", "kernel", "-"]);
        assert_eq!(cells.last().map(String::as_str), Some("-"));
    }

    #[test]
    fn the_query_carries_the_filter_and_follow() {
        let args = ConnectionsArgs {
            follow: true,
            namespace: Some("team-a".into()),
            service: Some("team-a/api example".into()),
            admin: AdminArg {
                admin: "127.0.0.1:15000".parse().unwrap(),
            },
            output: TableOrJson::Table,
        };
        assert_eq!(
            path(&args),
            "/connections?namespace=team-a&service=team-a%2Fapi+example&follow=1"
        );
    }
}
