//! The command line: one binary for the node agent (`run`) and the offline tools (`resolve`, `explain`).
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Limits;

mod config;
mod connections;
/// `explain` and `resolve` are public for the conformance suite, which checks their reports.
pub(crate) mod explain;
mod output;
pub(crate) mod resolve;
mod run;

/// Exit code for invalid input (configuration errors); usage errors exit 2 (clap's own).
pub(crate) const EXIT_INVALID_INPUT: u8 = 1;

/// The input bounds of a load, shared by `run`, `resolve` and `explain`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct LimitArgs {
    /// Largest manifest file read, in bytes; a larger one is reported and left out. Its YAML may
    /// expand through aliases to twice this.
    #[arg(long = "config-max-file-bytes", value_name = "BYTES", default_value_t = Limits::default().max_file_bytes)]
    pub max_file_bytes: u64,
    /// Most read from the configuration directory in one load, in bytes; files past it (by name
    /// order) are reported and left out.
    #[arg(long = "config-max-dir-bytes", value_name = "BYTES", default_value_t = Limits::default().max_dir_bytes)]
    pub max_dir_bytes: u64,
}

/// The manifests an offline command reads, as kubectl's `-f`.
#[derive(Debug, clap::Args)]
pub(crate) struct InputArgs {
    /// Manifests: a file, a directory (its .yaml, .yml and .json files), or `-` for standard input.
    /// Give it again for more; they are read in the order given.
    #[arg(short = 'f', long = "filename", value_name = "PATH", required = true)]
    pub paths: Vec<std::path::PathBuf>,
    /// Also read every subdirectory of a directory given with -f.
    #[arg(short = 'R', long)]
    pub recursive: bool,
    #[command(flatten)]
    pub limits: LimitArgs,
}

impl LimitArgs {
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_file_bytes: self.max_file_bytes,
            max_dir_bytes: self.max_dir_bytes,
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "redirect",
    version,
    about = "ServiceEntry visibility, enforced on a Linux node"
)]
pub(crate) struct Cli {
    /// More log output: -v debug, -vv trace.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log lines as text, or one JSON object each (for a log pipeline).
    #[arg(long, value_enum, default_value_t = crate::logging::LogFormat::Text, env = "REDIRECT_LOG_FORMAT", global = true)]
    pub log_format: crate::logging::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[expect(
    clippy::large_enum_variant,
    reason = "parsed once per process: the size of the `run` variant costs nothing"
)]
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the node agent: load the eBPF programs, proxy outbound connections.
    Run(run::RunArgs),
    /// Offline: every ServiceEntry with its resolved visibility, conditions and addresses.
    Resolve(resolve::ResolveArgs),
    /// Offline: what a client in a namespace gets for a host name or an IP, and why.
    Explain(explain::ExplainArgs),
    /// Ask a running agent what it holds (its admin server).
    Config(config::ConfigArgs),
    /// Mount a bpf filesystem at the parent of --bpffs unless it is on one already (the DaemonSet's
    /// init step, which holds the privilege to mount that the agent does not).
    MountBpffs(run::MountBpffsArgs),
}

/// Arenas glibc's malloc may keep for the agent, unless `MALLOC_ARENA_MAX` says otherwise. By
/// default it keeps up to eight per core, one per thread that allocates at once (the async workers,
/// the blocking pool building snapshots), and each holds on to what it once held: with tens of
/// thousands of objects that is megabytes per arena that a node pays for nothing. One arena: the
/// snapshot built on a blocking thread and the state the workers hold then share their free space
/// (10,000 ServiceEntries: 66 MiB against 73 MiB with two), and each thread's cache of small
/// blocks keeps the data path off the arena's lock.
#[cfg(target_env = "gnu")]
const MALLOC_ARENAS: libc::c_int = 1;

fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: sets a tunable of the allocator before any other thread exists; takes no pointer.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS) };
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run(_)) {
        // A reader that goes away (`redirect explain … | head`) ends the command quietly, as with any
        // Unix tool. The agent keeps SIGPIPE ignored: a closed socket must be an error, not a death.
        // SAFETY: setting a signal disposition before any thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    } else {
        limit_malloc_arenas();
    }
    let log_level = crate::logging::init(cli.verbose, cli.log_format);
    // Both of rustls' providers are built in (HBONE's TLS names aws-lc-rs itself), so the clients
    // that take the process's default (the Kubernetes API's) need one named, or they panic.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let result = match cli.command {
        Command::Run(args) => run::run(args, log_level),
        Command::Resolve(args) => resolve::resolve(args),
        Command::Explain(args) => explain::explain(args),
        Command::Config(args) => config::config(args),
        Command::MountBpffs(args) => run::mount_bpffs(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
