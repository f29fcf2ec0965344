//! Istio's standard TCP metrics (`docs/observability.md#istio-metrics`): the four families Kiali
//! draws its graph from and Istio's dashboards and alerts read, with Istio's labels, for every
//! connection the agent sees, whoever decided it. A connection is told here once per event, in
//! terms the deciders know ([`Seen`]); the labels are worked out against the snapshot in force
//! ([`labels`]) once per kind of connection, and counted in a bounded table ([`table`]).
mod labels;
mod table;
#[cfg(test)]
mod tests;

use std::{net::IpAddr, sync::Arc};

pub(crate) use table::IstioMetrics;
#[cfg(test)]
use table::MAX_ISTIO_SERIES;

/// Which end of the connection this node stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reporter {
    /// The client's node: every connection a Pod of this node makes.
    Source,
    /// The server's node: what it delivers to a Pod of its own.
    Destination,
}

impl Reporter {
    const fn as_str(self) -> &'static str {
        match self {
            Reporter::Source => "source",
            Reporter::Destination => "destination",
        }
    }
}

/// How a connection failed, in Istio's words (`-`: it did not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Flags {
    None,
    /// The upstream (or the tunnel to it) could not be connected.
    Connect,
    /// Refused by the destination's authorization policies.
    Deny,
}

impl Flags {
    const fn as_str(self) -> &'static str {
        match self {
            Flags::None => "-",
            Flags::Connect => "CONNECT",
            Flags::Deny => "DENY",
        }
    }
}

/// Who the client is, as the decider knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Client {
    /// The Pod of this node the agent took it for, `namespace/name`.
    Named(Arc<str>),
    /// Only its address (a stream received, a client the agent could not name).
    At(IpAddr),
}

/// What one event of a connection adds to its series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub opened: u64,
    pub closed: u64,
    /// Istio's `received`: client to server.
    pub from_client: u64,
    /// Istio's `sent`: server to client.
    pub to_client: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, other: Counts) {
        self.opened += other.opened;
        self.closed += other.closed;
        self.from_client += other.from_client;
        self.to_client += other.to_client;
    }
}

/// A connection as a decider saw it: everything the labels are worked out from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Seen {
    pub reporter: Reporter,
    pub client: Client,
    /// The service it was decided for, `namespace/name`.
    pub service: Option<Arc<str>>,
    /// The address the client asked for: which host of a ServiceEntry of several it meant.
    pub addressed: Option<IpAddr>,
    /// The workload dialled: the endpoint, the Pod, or the waypoint.
    pub destination: Option<IpAddr>,
    /// The port a stream received was carried to: the service it names, when the sender named
    /// none (`None` for what a client of this node addressed itself).
    pub port: Option<u16>,
    /// The waypoint it went through, `namespace/name`: the workload upstream names as its
    /// destination.
    pub waypoint: Option<Arc<str>>,
    /// The peer's identity when carried over mutual TLS (HBONE): the client's own going out, the
    /// sender's certificate's coming in. `None`: plain TCP.
    pub mutual_tls: Option<Arc<str>>,
    pub flags: Flags,
}
