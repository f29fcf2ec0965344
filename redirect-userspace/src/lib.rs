//! The node agent and its offline tools.
//!
//! Data flows one way: files -> [`config`] (typed, validated resources) -> [`visibility`] (the control
//! plane's resolution) -> [`state`] (the per-node snapshot, swapped whole on reload) -> [`proxy`], `dns`
//! and [`admin`] read it. [`redirect`] loads the eBPF programs that bring pod traffic to the proxy.
pub mod admin;
pub mod agent;
pub mod budget;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod dns;
pub mod explain;
pub mod fastpath;
pub mod identity;
pub mod live;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod pipeline;
pub mod proxy;
pub mod redirect;
pub mod state;
pub mod status;
pub mod visibility;
pub mod watch;
