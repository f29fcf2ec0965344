use std::process::ExitCode;

fn main() -> ExitCode {
    redirect::cli::main()
}
