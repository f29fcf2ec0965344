//! The node agent and its offline tools.
//!
//! Data flows one way: files -> `config` (typed, validated resources) -> `visibility` (the control
//! plane's resolution) -> `state` (the per-node snapshot, swapped whole on reload) -> `proxy`, `dns`
//! and `admin` read it. `redirect` loads the eBPF programs that bring pod traffic to the proxy.
//!
//! Every module is private to the crate, so the compiler sees what nothing uses. What other crates
//! need is re-exported below, by purpose: the `redirect` binary's entry point, and the narrow surface
//! the bench, the integration suite, the conformance cases and xtask drive.
mod admin;
mod agent;
mod audit;
mod authz;
mod budget;
mod cli;
mod clock;
mod cluster;
mod config;
mod dns;
mod drain;
mod explain;
mod fastpath;
mod hbone;
mod identity;
mod live;
mod lock;
mod logging;
mod metrics;
mod net;
mod pipeline;
mod proxy;
mod records;
mod redirect;
mod state;
mod status;
mod telemetry;
mod visibility;

/// The entry points of the fuzz targets in `fuzz/`; not an interface.
#[doc(hidden)]
pub mod fuzzing;

/// The `redirect` command line.
pub use cli::main;

/// Manifests in, decisions out, offline: load a configuration, resolve visibility, build the
/// per-node snapshot and ask it what a client gets (the bench and the conformance cases).
pub mod model {
    pub use crate::{
        config::{ConfigErrors, Host, Model, load_sources, read_sources},
        state::{OutboundOutcome, Pick, Snapshot},
        visibility::{Discovery, allocate, resolve},
    };
}

/// What `redirect explain` and `redirect resolve` report, built from a snapshot or read back from a
/// running agent (the integration suite checks every outcome against it).
pub mod report {
    pub use crate::{
        cli::{
            explain::{
                AuthorizationReport, Destination, DnsAction, DnsReport, HostExplanation,
                IpExplanation, OutboundReport, Over, authorize, explain_host, explain_ip,
            },
            resolve::report as resolve_report,
        },
        fastpath::DecidedBy,
    };
}

/// Talking to a running agent's admin server.
pub mod admin_client {
    pub use crate::admin::client::*;
}

/// The Kubernetes API source's store, driven without an API server (the scale bench feeds it a
/// cluster's objects as the watches would).
pub mod kube {
    pub use crate::cluster::{Change, Kind, Store, build, kinds::convert};
}

/// What the node must offer: the cgroup v2 mounts, the oldest kernel the agent runs on.
pub mod node {
    pub use crate::redirect::{cgroup2_mount_points, features::OLDEST_SUPPORTED};
}
