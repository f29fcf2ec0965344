use std::{path::PathBuf, process::ExitCode};

#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// Directory of Kubernetes YAML manifests.
    #[arg(short = 'f', long = "filename")]
    pub dir: PathBuf,
}

pub fn explain(_args: ExplainArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("explain: not built yet")
}
