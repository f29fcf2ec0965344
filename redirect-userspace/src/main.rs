use std::process::ExitCode;

fn main() -> ExitCode {
    redirect_userspace::main()
}
