//! Output formats and a plain-text table for the offline commands.
use std::process::ExitCode;

use crate::config::ConfigErrors;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TableOrJson {
    Table,
    Json,
}

/// Left-aligned columns separated by two spaces, like kubectl.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(&format!("{cell:<width$}", width = widths[i]));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// Prints a load's errors, one per line, on stderr; the exit code for invalid input.
pub fn invalid_input(errors: &ConfigErrors) -> ExitCode {
    eprintln!(
        "error: invalid configuration ({} problem{}):",
        errors.len(),
        if errors.len() == 1 { "" } else { "s" }
    );
    for e in errors.iter() {
        eprintln!("  {e}");
    }
    ExitCode::from(super::EXIT_INVALID_INPUT)
}

pub fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

pub fn yaml<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_yaml_ng::to_string(value)?)
}
