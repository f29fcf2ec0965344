use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
};

use redirect_common::PROXY_PORT;

use crate::agent::{self, AgentConfig};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// cgroup v2 directory holding the pods (their parent, never the hierarchy's root).
    #[arg(long)]
    pub cgroup: PathBuf,
    /// Address of this node's netns that every pod reaches on its own link (e.g. 169.254.7.1).
    #[arg(long)]
    pub gateway: Ipv4Addr,
    /// Port the outbound proxy listens on at the gateway.
    #[arg(long, default_value_t = PROXY_PORT)]
    pub proxy_port: u16,
    /// Admin server address (`/healthz/ready`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:15000")]
    pub admin: SocketAddr,
    /// Allow the admin server on a non-loopback address (it shows the node's configuration).
    #[arg(long)]
    pub admin_allow_non_loopback: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    agent::run(AgentConfig {
        cgroup: args.cgroup,
        gateway: args.gateway,
        proxy_port: args.proxy_port,
        admin: args.admin,
        admin_allow_non_loopback: args.admin_allow_non_loopback,
    })?;
    Ok(ExitCode::SUCCESS)
}
