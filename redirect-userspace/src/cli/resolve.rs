use std::{path::PathBuf, process::ExitCode};

#[derive(Debug, clap::Args)]
pub struct ResolveArgs {
    /// Directory of Kubernetes YAML manifests.
    #[arg(short = 'f', long = "filename")]
    pub dir: PathBuf,
}

pub fn resolve(_args: ResolveArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("resolve: not built yet")
}
