use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct RunArgs {}

pub fn run(_args: RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("run: not built yet")
}
