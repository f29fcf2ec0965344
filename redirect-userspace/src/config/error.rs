//! Configuration errors: each names the file, the object (`Kind namespace/name`) and the field.
use std::fmt;

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

impl ConfigError {
    pub fn new(
        file: impl Into<String>,
        object: Option<String>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError {
            file: file.into(),
            object,
            field,
            message: message.into(),
        }
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
    pub fn error(&mut self, field: impl AsRef<str>, message: impl Into<String>) {
        let field = field.as_ref();
        let field = match (self.prefix.is_empty(), field.is_empty()) {
            (true, _) => field.to_string(),
            (false, true) => self.prefix.trim_end_matches('.').to_string(),
            (false, false) => format!("{}{field}", self.prefix),
        };
        self.errors.push(ConfigError::new(
            self.file,
            Some(self.object.clone()),
            (!field.is_empty()).then_some(field),
            message,
        ));
    }

    /// Something Istio accepts with a warning: logged with file, object and field, not refused.
    pub fn warn(&mut self, field: &str, message: impl AsRef<str>) {
        tracing::warn!(
            file = self.file,
            object = %self.object,
            field = %format!("{}{field}", self.prefix),
            "{}",
            message.as_ref()
        );
    }

    /// Number of errors recorded so far (all objects), to tell whether this object added any.
    pub fn error_count(&self) -> usize {
        self.errors.len()
    }
}
