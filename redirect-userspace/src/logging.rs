//! Logs to stderr, with a level an operator can change on a running agent (`/logging?level=`), and
//! [`LineLimit`]: at most so many lines of one kind a second, the rest summed up in one line.
use crate::lock::Locked;
use std::{
    io::IsTerminal,
    sync::Mutex,
    time::{Duration, Instant},
};

use tracing_subscriber::{
    EnvFilter, Registry, layer::SubscriberExt, reload, util::SubscriberInitExt,
};

/// Changes the log filter of the running process.
#[derive(Clone)]
pub(crate) struct LogLevel {
    handle: reload::Handle<EnvFilter, Registry>,
}

impl LogLevel {
    /// Sets `directives` (`RUST_LOG` syntax: `debug`, `info,redirect=debug`, ...).
    pub(crate) fn set(&self, directives: &str) -> Result<(), String> {
        let filter = EnvFilter::try_new(directives).map_err(|e| format!("{directives:?}: {e}"))?;
        self.handle.reload(filter).map_err(|e| e.to_string())
    }

    pub(crate) fn current(&self) -> String {
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
pub(crate) enum LogFormat {
    /// `TIME LEVEL target: message key=value ...`, for people.
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields` with `message` and every
    /// key), for a log pipeline.
    Json,
}

/// Installs the global subscriber. `RUST_LOG` wins over `-v` when set.
pub(crate) fn init(verbose: u8, format: LogFormat) -> LogLevel {
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

/// At most `per_second` lines of one kind in each second; the lines held back in a second are
/// counted, for one summary line once that second is over. Time is passed in: the logic is pure.
///
/// A second starts with the first line after the last one ended, so a quiet kind costs nothing and
/// a flood writes at most `per_second` lines and one summary a second, whatever its rate.
#[derive(Debug)]
pub(crate) struct LineLimit {
    per_second: u32,
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    /// When the current second started; `None` before the first line.
    start: Option<Instant>,
    written: u32,
    /// Held back in the current second (or in one that ended with no line since).
    held_back: u64,
}

/// What to do with one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admit {
    /// Write the line.
    pub write: bool,
    /// Lines held back in the second that just ended: write the summary saying so first (0: none).
    pub held_back: u64,
}

const SECOND: Duration = Duration::from_secs(1);

impl LineLimit {
    pub(crate) const fn new(per_second: u32) -> Self {
        LineLimit {
            per_second,
            window: Mutex::new(Window {
                start: None,
                written: 0,
                held_back: 0,
            }),
        }
    }

    /// One line of this kind at `now`.
    pub(crate) fn admit(&self, now: Instant) -> Admit {
        let mut window = self.window.locked();
        let mut held_back = 0;
        let over = window
            .start
            .is_none_or(|start| now.saturating_duration_since(start) >= SECOND);
        if over {
            held_back = std::mem::take(&mut window.held_back);
            window.start = Some(now);
            window.written = 0;
        }
        let write = window.written < self.per_second;
        if write {
            window.written += 1;
        } else {
            window.held_back += 1;
        }
        Admit { write, held_back }
    }

    /// The lines held back in a second that is over by `now`, taken (for the summary of a flood
    /// that stopped: no next line would report them); 0 while the second runs or when none were.
    pub(crate) fn flush(&self, now: Instant) -> u64 {
        let mut window = self.window.locked();
        match window.start {
            Some(start) if now.saturating_duration_since(start) >= SECOND => {
                std::mem::take(&mut window.held_back)
            }
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(limit: &LineLimit, at: Instant, lines: u32) -> (u32, u64) {
        let (mut written, mut summary) = (0, 0);
        for _ in 0..lines {
            let admit = limit.admit(at);
            written += u32::from(admit.write);
            summary += admit.held_back;
        }
        (written, summary)
    }

    #[test]
    fn a_flood_writes_the_limit_a_second_and_reports_the_rest_once() {
        let limit = LineLimit::new(50);
        let t0 = Instant::now();
        assert_eq!(
            run(&limit, t0, 2_000),
            (50, 0),
            "50 written, 1,950 held back"
        );
        // Still the same second: nothing more, nothing reported yet.
        assert_eq!(run(&limit, t0 + Duration::from_millis(999), 10), (0, 0));
        assert_eq!(limit.flush(t0 + Duration::from_millis(999)), 0);
        // The next second's first line carries the count of the one before, once.
        let next = limit.admit(t0 + SECOND);
        assert_eq!(
            next,
            Admit {
                write: true,
                held_back: 1_960
            }
        );
        assert_eq!(run(&limit, t0 + SECOND, 100), (49, 0));
    }

    #[test]
    fn a_flood_that_stops_is_reported_by_flush_and_only_once() {
        let limit = LineLimit::new(2);
        let t0 = Instant::now();
        run(&limit, t0, 5);
        assert_eq!(limit.flush(t0 + SECOND), 3);
        assert_eq!(limit.flush(t0 + SECOND * 2), 0, "taken");
        assert_eq!(limit.admit(t0 + SECOND * 3).held_back, 0, "not again");
    }

    #[test]
    fn below_the_limit_every_line_is_written_and_nothing_is_summed_up() {
        let limit = LineLimit::new(50);
        let t0 = Instant::now();
        for second in 0..10u32 {
            let at = t0 + SECOND * second;
            assert_eq!(run(&limit, at, 50), (50, 0));
            assert_eq!(limit.flush(at + SECOND), 0);
        }
    }

    #[test]
    fn time_going_backwards_keeps_the_current_second() {
        let limit = LineLimit::new(1);
        let t0 = Instant::now() + SECOND;
        assert!(limit.admit(t0).write);
        assert!(!limit.admit(t0 - Duration::from_millis(500)).write);
        assert_eq!(limit.flush(t0 - SECOND), 0);
    }
}
