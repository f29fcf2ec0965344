//! `cargo xtask <command>`: the one way in for people and CI.
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod build;
mod cmd;
mod demo;
#[cfg(test)]
mod doc_links;
mod fuzz;
mod image;
#[cfg(test)]
mod layers;
mod setup;
#[cfg(test)]
mod shape;
mod test;
mod vm;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, test and run the redirect data plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install everything the build, tests and demo need (idempotent).
    Setup,
    /// Build the eBPF object and the agent that embeds it (target/release/redirect).
    Build,
    /// Build the agent's OCI image (FROM scratch, no registry needed) into podman's store, tagged
    /// localhost/redirect:<version> and :<version>-<commit>; prints its size (as root).
    Image,
    /// Build, set up a throwaway node, run real traffic from several namespaces, show what each saw.
    Demo,
    /// Run every test: format and lint checks, unit tests, then the integration suite (as root).
    Test(test::TestArgs),
    /// Run each fuzz target (fuzz/, cargo fuzz) from its seeds for a while; a crash fails it.
    Fuzz(fuzz::FuzzArgs),
    /// Measure the data plane against the direct path and write BENCHMARKS.md (as root).
    Bench(::bench::BenchArgs),
    /// Where the CPU goes on the proxy path: perf profiles of direct vs service (latency, new
    /// connections, 1- and 8-stream throughput), or with --dns of DNS straight to the upstream vs
    /// forwarded, into target/bench-profile/ (as root; needs linux-perf).
    Profile(::bench::ProfileArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Setup => setup::setup(),
        Command::Build => setup::ensure().and_then(|()| build::build().map(|_| ())),
        Command::Image => setup::ensure().and_then(|()| image::image()),
        Command::Demo => setup::ensure().and_then(|()| demo::demo()),
        Command::Test(args) => setup::ensure().and_then(|()| test::test(args)),
        Command::Fuzz(args) => setup::ensure().and_then(|()| fuzz::fuzz(args)),
        Command::Bench(args) => setup::ensure().and_then(|()| bench::bench(args)),
        Command::Profile(args) => setup::ensure().and_then(|()| bench::profile(args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
