//! Output formats and a plain-text table for the offline commands.
use std::process::ExitCode;

use serde_yaml_ng::Value;

use crate::{
    config::{self, ConfigError, Model},
    visibility::Resolved,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TableOrJson {
    Table,
    Json,
}

/// Left-aligned columns separated by two spaces, like kubectl. Cells of any width: padding is
/// written out, never through a format width (which has a limit).
pub(super) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
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
            text.push_str(cell);
            let pad = widths
                .get(i)
                .copied()
                .unwrap_or(0)
                .saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
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

/// Prints a load's errors, one per line, on stderr; the exit code for invalid input. What was
/// valid has been printed already.
pub(super) fn invalid_input(errors: &[ConfigError]) -> ExitCode {
    eprintln!(
        "error: invalid configuration ({} problem{}; the output above covers everything valid):",
        errors.len(),
        if errors.len() == 1 { "" } else { "s" }
    );
    for e in errors {
        eprintln!("  {e}");
    }
    ExitCode::from(super::EXIT_INVALID_INPUT)
}

/// Reads a configuration for an offline command: everything valid, and every problem (objects
/// left out, and entries the address pool could not serve). `Err`: a path that cannot be read at
/// all, reported before any output.
pub(super) fn load(
    input: &super::InputArgs,
) -> Result<(Model, Resolved, Vec<ConfigError>), ConfigError> {
    let loaded = config::read_inputs(&input.paths, input.recursive, &input.limits.limits())?;
    let (resolution, errors) = crate::pipeline::resolve(&loaded.model, loaded.errors);
    Ok((loaded.model, resolution, errors))
}

pub(super) fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

/// YAML that every reader, YAML 1.1 or 1.2, reads back as the same data: block style, and every
/// string that a reader could take for anything but that string (`no`, `on`, `y`, `1e3`, `0x10`,
/// `2024-01-01`, `~`, text with `: ` or a leading indicator) double-quoted in JSON's escapes,
/// which YAML's double-quoted style shares.
pub(super) fn yaml<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    // serde_yaml_ng's value keeps the fields in their declared order, as the JSON output does.
    let value = serde_yaml_ng::to_value(value)?;
    let mut out = String::new();
    match &value {
        Value::Mapping(map) if !map.is_empty() => emit_map(map, 0, &mut out),
        Value::Sequence(items) if !items.is_empty() => emit_seq(items, 0, &mut out),
        scalar => {
            out.push_str(&yaml_scalar(scalar));
            out.push('\n');
        }
    }
    Ok(out)
}

fn emit_map(map: &serde_yaml_ng::Mapping, indent: usize, out: &mut String) {
    for (key, value) in map {
        out.extend(std::iter::repeat_n(' ', indent));
        out.push_str(&yaml_scalar(key));
        out.push(':');
        emit_child(value, indent, out);
    }
}

fn emit_seq(items: &[Value], indent: usize, out: &mut String) {
    for value in items {
        out.extend(std::iter::repeat_n(' ', indent));
        out.push('-');
        match value {
            // A mapping item starts on the dash's line, its keys aligned after "- ".
            Value::Mapping(map) if !map.is_empty() => {
                let mut first = String::new();
                emit_map(map, indent + 2, &mut first);
                out.push(' ');
                out.push_str(&first[indent + 2..]);
            }
            _ => emit_child(value, indent, out),
        }
    }
}

/// The value after `key:` or `-`: inline for a scalar or an empty collection, else on the lines below.
fn emit_child(value: &Value, indent: usize, out: &mut String) {
    match value {
        Value::Mapping(map) if !map.is_empty() => {
            out.push('\n');
            emit_map(map, indent + 2, out);
        }
        Value::Sequence(items) if !items.is_empty() => {
            out.push('\n');
            emit_seq(items, indent + 2, out);
        }
        scalar => {
            out.push(' ');
            out.push_str(&yaml_scalar(scalar));
            out.push('\n');
        }
    }
}

fn yaml_scalar(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => yaml_string(s),
        Value::Sequence(_) => "[]".into(),
        Value::Mapping(_) => "{}".into(),
        Value::Tagged(t) => yaml_scalar(&t.value),
    }
}

/// A string plain when no YAML 1.1 or 1.2 reader can take it for anything else, else quoted.
fn yaml_string(s: &str) -> String {
    if is_plain_safe(s) {
        s.to_string()
    } else {
        // JSON's string escapes are a subset of YAML's double-quoted ones.
        serde_json::Value::String(s.to_string()).to_string()
    }
}

/// Plain only for a word that starts with a letter, holds letters, digits and `-._/`, and is not
/// one of the words YAML 1.1 reads as a boolean or null (in any case).
fn is_plain_safe(s: &str) -> bool {
    const SPECIAL: [&str; 13] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf", "infinity",
        "none",
    ];
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '/'))
        && !SPECIAL.contains(&s.to_ascii_lowercase().as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real case: an entry with 6,000 CIDRs makes a column far wider than 65,535 characters.
    #[test]
    fn a_column_of_any_width_renders() {
        let wide: String = (0..6000)
            .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256))
            .collect::<Vec<_>>()
            .join(",");
        assert!(wide.len() > 65_535);
        let out = table(
            &["A", "B"],
            &[vec![wide.clone(), "x".into()], vec!["y".into(), "z".into()]],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[1], format!("{wide}  x"));
        assert_eq!(lines[2], format!("y{}  z", " ".repeat(wide.len() - 1)));
    }

    #[test]
    fn yaml_strings_that_readers_could_misread_are_quoted() {
        struct Case {
            text: &'static str,
            quoted: bool,
        }
        let cases = [
            Case {
                text: "team-a",
                quoted: false,
            },
            Case {
                text: "istio.io/VisibilityApplied",
                quoted: false,
            },
            Case {
                text: "api.example.com",
                quoted: false,
            },
            Case {
                text: "no",
                quoted: true,
            },
            Case {
                text: "No",
                quoted: true,
            },
            Case {
                text: "yes",
                quoted: true,
            },
            Case {
                text: "on",
                quoted: true,
            },
            Case {
                text: "OFF",
                quoted: true,
            },
            Case {
                text: "y",
                quoted: true,
            },
            Case {
                text: "n",
                quoted: true,
            },
            Case {
                text: "true",
                quoted: true,
            },
            Case {
                text: "null",
                quoted: true,
            },
            Case {
                text: "~",
                quoted: true,
            },
            Case {
                text: "",
                quoted: true,
            },
            Case {
                text: "1e3",
                quoted: true,
            },
            Case {
                text: "0x10",
                quoted: true,
            },
            Case {
                text: "1_000",
                quoted: true,
            },
            Case {
                text: "10:20",
                quoted: true,
            },
            Case {
                text: "2024-01-01",
                quoted: true,
            },
            Case {
                text: "203.0.113.10",
                quoted: true,
            },
            Case {
                text: ".inf",
                quoted: true,
            },
            Case {
                text: "a: b",
                quoted: true,
            },
            Case {
                text: "*.example.com",
                quoted: true,
            },
            Case {
                text: "- x",
                quoted: true,
            },
            Case {
                text: "#x",
                quoted: true,
            },
            Case {
                text: "line\nbreak",
                quoted: true,
            },
        ];
        for case in cases {
            let got = yaml_string(case.text);
            assert_eq!(
                got.starts_with('"'),
                case.quoted,
                "{:?} -> {got}",
                case.text
            );
            // Read back by a YAML 1.2 reader, it is the same string.
            let back: serde_yaml_ng::Value = serde_yaml_ng::from_str(&format!("k: {got}")).unwrap();
            assert_eq!(back["k"].as_str(), Some(case.text), "{got}");
        }
    }

    #[test]
    fn yaml_output_reads_back_as_the_same_data() {
        let value = serde_json::json!({
            "serviceEntries": [
                {"namespace": "no", "name": "on", "visibility": "Public", "matchedPolicy": null,
                 "conditions": [{"type": "istio.io/VisibilityApplied", "status": "True"}],
                 "sidecarExportTo": ["~"], "addresses": ["203.0.113.10", "2001:db8::/64"], "n": 7}
            ],
            "errors": [],
            "empty": {}
        });
        let text = yaml(&value).unwrap();
        let back: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        assert!(text.contains("namespace: \"no\""), "{text}");
        assert!(text.contains("  - addresses:"), "{text}");
    }
}
