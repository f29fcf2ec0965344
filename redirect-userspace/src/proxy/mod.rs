//! The outbound proxy: accepts the connections the eBPF programs steered to the gateway, finds where
//! each client meant to go, and carries the bytes there.
mod outbound;
mod relay;
mod upstream;

pub use outbound::{OutboundProxy, ProxyContext, listen};
pub use relay::relay;
pub use upstream::connect_marked;
