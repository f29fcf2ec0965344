//! Configuration errors: each names the file, the object (`Kind namespace/name`) and the field.
//!
//! Every part of an error is bounded ([`MAX_QUOTED`]): a 100 MB bad value never becomes a 100 MB log
//! line or `/config_dump`.
use std::{borrow::Cow, fmt};

use serde::Serialize;

/// One problem in the input. `object` and `field` are `None` when the problem is above that level
/// (a file that cannot be read, a document that is not YAML).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub object: Option<String>,
    pub field: Option<String>,
    pub message: String,
}

/// One error line per error, naming file, object and field (each already bounded in length), its
/// message after `context`.
pub(crate) fn log_errors(errors: &[ConfigError], context: &str) {
    for e in errors {
        tracing::error!(
            file = %e.file,
            object = e.object.as_deref().unwrap_or("-"),
            field = e.field.as_deref().unwrap_or("-"),
            "{context}{}",
            e.message
        );
    }
}

impl ConfigError {
    pub fn new(
        file: impl Into<String>,
        object: Option<String>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError {
            file: bounded(&file.into(), MAX_QUOTED).into_owned(),
            object: object.map(|o| bounded(&o, MAX_QUOTED).into_owned()),
            field: field.map(|f| bounded(&f, MAX_QUOTED).into_owned()),
            message: bounded(&message.into(), MAX_MESSAGE).into_owned(),
        }
    }
}

/// The longest file name, object or field an error repeats from the input, in bytes.
pub(super) const MAX_QUOTED: usize = 256;
/// The longest message, in bytes: room for a quoted value and what was expected of it.
pub(crate) const MAX_MESSAGE: usize = 512;

/// `text` cut to at most `max` bytes (on a character boundary), marked `…` when cut.
pub(super) fn bounded(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…", &text[..end]))
}

/// A deserializer's message in the user's terms: the form a field expects ("an integer", "a
/// mapping"), never the Rust type that would have held it ("i64", "struct RawPort").
pub(crate) fn plain_message(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("invalid type: ")
        && let Some((got, expected)) = rest.split_once(", expected ")
    {
        return format!("expected {}, got {}", plain_form(expected), plain_got(got));
    }
    if let Some(rest) = message.strip_prefix("invalid value: ")
        && let Some((got, expected)) = rest.split_once(", expected ")
    {
        return format!("expected {}, got {}", plain_form(expected), plain_got(got));
    }
    if message.starts_with("data did not match any variant of untagged enum") {
        let expected = if message.contains("IntOrString") {
            "a port number or a port name"
        } else {
            "a value of another form"
        };
        return format!("expected {expected}");
    }
    if let Some((head, expected)) = message.split_once(", expected ") {
        return format!("{head}, expected {}", plain_form(expected));
    }
    message.to_string()
}

/// serde's name for what a visitor wanted -> the form a user writes.
fn plain_form(expected: &str) -> Cow<'_, str> {
    let form = match expected {
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" | "u8" | "u16" | "u32" | "u64" | "u128"
        | "usize" => "an integer",
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a string" | "a borrowed string" | "a character" => "a string",
        "a sequence" => "a list",
        "a map" => "a mapping",
        "option" | "any value" => "a value",
        e if e.starts_with("struct ") => "a mapping",
        e if e.starts_with("tuple") || e.starts_with("newtype struct") => "a value",
        e if e.starts_with("enum ") => "one of the documented values",
        e => return Cow::Borrowed(e),
    };
    Cow::Borrowed(form)
}

/// serde's name for what it found -> YAML's.
fn plain_got(got: &str) -> Cow<'_, str> {
    match got {
        "map" => Cow::Borrowed("a mapping"),
        "sequence" => Cow::Borrowed("a list"),
        "unit value" => Cow::Borrowed("null"),
        g => match g.split_once(' ') {
            Some(("floating", rest)) => Cow::Owned(format!(
                "number {}",
                rest.trim_start_matches("point ").trim_matches('`')
            )),
            Some((kind, value)) if value.starts_with('`') => {
                Cow::Owned(format!("{kind} {}", value.trim_matches('`')))
            }
            _ => Cow::Borrowed(g),
        },
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(object) = &self.object {
            write!(f, ": {object}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem found in one load. A load that returns this applied nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    pub fn iter(&self) -> impl Iterator<Item = &ConfigError> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One line per error, so a log line or a terminal shows each problem on its own.
impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

/// Collects the errors of one object while it is converted, so one bad field does not hide the next.
pub(crate) struct Ctx<'a> {
    pub file: &'a str,
    pub object: String,
    /// Prefix for field paths, for objects nested in another document (`items[2].`, `data.mesh.`).
    pub prefix: String,
    pub errors: &'a mut Vec<ConfigError>,
}

impl Ctx<'_> {
    pub(super) fn error(&mut self, field: impl AsRef<str>, message: impl Into<String>) {
        let error = self.kept_error(field, message);
        self.errors.push(error);
    }

    /// An error of this object that does not refuse it: named as [`Ctx::error`] names one, but
    /// returned for the object to carry (and a later step to report) instead of recorded here.
    pub(super) fn kept_error(
        &self,
        field: impl AsRef<str>,
        message: impl Into<String>,
    ) -> ConfigError {
        let field = field.as_ref();
        let field = match (self.prefix.is_empty(), field.is_empty()) {
            (true, _) => field.to_string(),
            (false, true) => self.prefix.trim_end_matches('.').to_string(),
            (false, false) => format!("{}{field}", self.prefix),
        };
        ConfigError::new(
            self.file,
            Some(self.object.clone()),
            (!field.is_empty()).then_some(field),
            message,
        )
    }

    /// Something Istio accepts with a warning: logged with file, object and field, not refused.
    pub(super) fn warn(&mut self, field: &str, message: impl AsRef<str>) {
        tracing::warn!(
            file = self.file,
            object = %self.object,
            field = %format!("{}{field}", self.prefix),
            "{}",
            message.as_ref()
        );
    }

    /// Number of errors recorded so far (all objects), to tell whether this object added any.
    pub(super) fn error_count(&self) -> usize {
        self.errors.len()
    }
}
