//! Logs to stderr, with a level an operator can change on a running agent (`/logging?level=`).
use std::io::IsTerminal;

use tracing_subscriber::{
    EnvFilter, Registry, layer::SubscriberExt, reload, util::SubscriberInitExt,
};

/// Changes the log filter of the running process.
#[derive(Clone)]
pub struct LogLevel {
    handle: reload::Handle<EnvFilter, Registry>,
}

impl LogLevel {
    /// Sets `directives` (`RUST_LOG` syntax: `debug`, `info,redirect=debug`, ...).
    pub fn set(&self, directives: &str) -> Result<(), String> {
        let filter = EnvFilter::try_new(directives).map_err(|e| format!("{directives:?}: {e}"))?;
        self.handle.reload(filter).map_err(|e| e.to_string())
    }

    pub fn current(&self) -> String {
        self.handle
            .with_current(|filter| filter.to_string())
            .unwrap_or_default()
    }
}

impl std::fmt::Debug for LogLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLevel")
            .field("current", &self.current())
            .finish()
    }
}

/// How each log line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `TIME LEVEL target: message key=value ...`, for people.
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields` with `message` and every
    /// key), for a log pipeline.
    Json,
}

/// Installs the global subscriber. `RUST_LOG` wins over `-v` when set.
pub fn init(verbose: u8, format: LogFormat) -> LogLevel {
    // -v is about this agent's decisions, not its libraries' internals. The Kubernetes client's own
    // lines repeat, less clearly, what the agent's watches report on every failure.
    let default = match verbose {
        0 => "info,kube_client=off,kube_runtime=off",
        1 => "info,redirect=debug,kube_client=off,kube_runtime=off",
        _ => "debug,redirect=trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let (filter, handle) = reload::Layer::new(filter);
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
    });
    let json = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
    });
    // A second init (tests) keeps the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .try_init();
    LogLevel { handle }
}
