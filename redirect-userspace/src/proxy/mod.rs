//! The outbound proxy: accepts the connections the eBPF programs steered to the gateway, finds where
//! each client meant to go, and carries the bytes there; and HBONE's receiving side for the Pods
//! of this node.
mod authorize;
mod forbidden;
mod inbound;
mod metrics;
mod outbound;
mod record;
mod relay;
mod revoke;
mod splice;
#[cfg(test)]
mod tests;
mod tunnel_relay;

pub(crate) use authorize::{Authorizer, Path as AuthzPath, recheck_on_change};
pub(crate) use forbidden::{DialGuard, Forbidden};
pub(crate) use inbound::{
    RECEIVED_FRAME, connect_target, listen_transparent, serve as serve_inbound,
};
pub(crate) use metrics::{Direction, ProxyMetrics, Timeout};
pub(crate) use outbound::{OutboundProxy, ProxyContext, listen};
pub(crate) use relay::{RelayError, Timeouts, relay};
pub(crate) use splice::{Pipes, splice_relay};

/// How the proxy moves bytes between the client and the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum RelayMode {
    /// Kernel-side `splice(2)` through a pipe: no copy into user space.
    #[default]
    Splice,
    /// A user-space buffer per direction (tokio's copy).
    Copy,
}
