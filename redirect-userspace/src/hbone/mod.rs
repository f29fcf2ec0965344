//! HBONE, the ambient mesh's tunnel (`docs/data-plane.md#waypoints`): an HTTP/2 `CONNECT` to the
//! original destination, over mutual TLS 1.3 to port 15008, each side authenticated by a
//! certificate naming its workload identity `spiffe://<trust domain>/ns/<namespace>/sa/<account>`.
//! The proxy carries a connection to a service bound to a waypoint this way, as ztunnel does.
mod ca;
mod ca_cache;
mod certs;
mod client;
mod identity;
mod metrics;
mod source;
mod stream;
mod tls;

pub(crate) use ca::{CaError, CaSettings, IstioCa};
pub(crate) use certs::{CertError, IdentityDir};
pub(crate) use client::HboneClient;
#[cfg(test)]
use client::HboneError;
pub(crate) use identity::{Identity, TrustDomain};
pub(crate) use metrics::HboneMetrics;
pub(crate) use source::{CertSource, IdentityError, WorkloadCerts};
#[cfg(test)]
pub(crate) use stream::test_pair;
pub(crate) use stream::{H2Stream, Receiving, Sending, keep_alive, server_builder};

/// The port a waypoint (and ztunnel) accepts HBONE on.
pub(crate) const PORT: u16 = redirect_common::HBONE_PORT;

/// HTTP/2 flow control and framing of HBONE connections, both ways, as ztunnel sets them: a stream
/// may have 4 MiB in flight and a connection 16 MiB, in frames of up to 1 MiB. HTTP/2's defaults
/// (64 KiB windows, 16 KiB frames) hold one stream to a fraction of what the link carries.
pub(crate) const STREAM_WINDOW: u32 = 4 << 20;
pub(crate) const CONNECTION_WINDOW: u32 = 16 << 20;
pub(crate) const FRAME_SIZE: u32 = 1 << 20;

/// The trust domain of a mesh that configures none.
pub(crate) const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

#[cfg(test)]
mod tests;
