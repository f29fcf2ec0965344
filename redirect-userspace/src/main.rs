//! The `redirect` binary: the command line lives in the library (`redirect_userspace::main`).
use std::process::ExitCode;

fn main() -> ExitCode {
    redirect_userspace::main()
}
