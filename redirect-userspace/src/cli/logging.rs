use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Logs go to stderr; `RUST_LOG` wins over `-v` when set.
pub fn init(verbose: u8) {
    // -v is about this agent's decisions, not its libraries' internals.
    let default = match verbose {
        0 => "info",
        1 => "info,redirect=debug",
        _ => "debug,redirect=trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
