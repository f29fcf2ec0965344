//! Records as Istio's telemetry counts them (`docs/observability.md#istio-metrics`): a record of
//! this node's client is reported as the `source`, a stream received for a Pod of this node as the
//! `destination`. ztunnel counts a connection open before it dials, so an upstream that fails is
//! opened and closed with `CONNECT`; a refusal before any dial is not counted, as upstream only
//! logs it.
use super::{DecidedBy, Event, Received, Record};
use crate::telemetry::{Client, Counts, Flags, Reporter, Seen};

/// How connections end, where Istio's flags are read from them.
pub(crate) mod ends {
    /// The kernel's connection never established.
    pub(crate) const CONNECT_FAILED: &str = "connect failed";
    /// The proxy could not connect its upstream.
    pub(crate) const UPSTREAM_CONNECT_FAILED: &str = "upstream connect failed";
    /// The proxy could not open its HBONE tunnel.
    pub(crate) const TUNNEL_FAILED: &str = "HBONE tunnel failed";
    /// The destination Pod's authorization policies refused it (the proxy's words).
    pub(crate) const DENIED: &str = "denied by authorization policy";
    /// The same, refused by the kernel at the Pod's socket lookup.
    pub(crate) const REFUSED: &str = "refused by authorization policy";
    /// A stream received whose Pod refused the connection.
    pub(crate) const POD_REFUSED: &str = "the Pod refused the connection";
}

/// The flags an end gives.
fn flags(end: Option<&str>) -> Flags {
    match end {
        Some(ends::CONNECT_FAILED | ends::UPSTREAM_CONNECT_FAILED | ends::TUNNEL_FAILED) => {
            Flags::Connect
        }
        Some(ends::POD_REFUSED) => Flags::Connect,
        Some(ends::DENIED | ends::REFUSED) => Flags::Deny,
        _ => Flags::None,
    }
}

/// A record of a connection this node's client made, as the `source` reports it; `None` for a
/// refusal before any dial.
pub(super) fn seen(record: &Record) -> Option<(Seen, Counts)> {
    let flags = match record.event {
        Event::Open => Flags::None,
        Event::Close => flags(record.end),
    };
    let counts = match (record.event, record.was_opened) {
        (Event::Open, _) => Counts {
            opened: 1,
            ..Counts::default()
        },
        (Event::Close, true) => Counts {
            closed: 1,
            from_client: record.bytes_sent,
            to_client: record.bytes_received,
            ..Counts::default()
        },
        // Refused before its upstream was reached: counted only when a dial failed or the
        // destination's policies refused it, opened and closed at once.
        (Event::Close, false) if flags != Flags::None => Counts {
            opened: 1,
            closed: 1,
            ..Counts::default()
        },
        (Event::Close, false) => return None,
    };
    let client = match (&record.workload, record.client) {
        (Some(name), _) => Client::Named(name.shared()),
        (None, Some(client)) => Client::At(client.ip()),
        // The kernel names no unknown client's address at its open: its close will.
        (None, None) if record.decided_by == DecidedBy::Kernel => Client::At(unnamed()),
        (None, None) => return None,
    };
    let seen = Seen {
        reporter: Reporter::Source,
        client,
        service: record.service.as_ref().map(super::Name::shared),
        addressed: record.orig_dst.map(|a| a.ip()),
        destination: record.endpoint.map(|a| a.ip().to_canonical()),
        waypoint: record.waypoint.as_ref().map(super::Name::shared),
        mutual_tls: record.hbone_identity.as_ref().map(super::Name::shared),
        flags,
    };
    Some((seen, counts))
}

/// The address of a client the kernel did not name: no workload has it, so it is `unknown`.
fn unnamed() -> std::net::IpAddr {
    std::net::Ipv4Addr::UNSPECIFIED.into()
}

/// A stream received for a Pod of this node (or refused on its way there), as the `destination`
/// reports it.
pub(super) fn received(received: &Received<'_>) -> Option<(Seen, Counts)> {
    let flags = match received.event {
        Event::Open => Flags::None,
        Event::Close => flags(Some(received.end)),
    };
    let counts = match (received.event, flags) {
        (Event::Open, _) => Counts {
            opened: 1,
            ..Counts::default()
        },
        // Refused before it was carried: never opened on its own.
        (Event::Close, Flags::Connect | Flags::Deny) => Counts {
            opened: 1,
            closed: 1,
            ..Counts::default()
        },
        (Event::Close, Flags::None) => Counts {
            closed: 1,
            from_client: received.bytes_in,
            to_client: received.bytes_out,
            ..Counts::default()
        },
    };
    // The kernel refuses plain TCP at the Pod's socket; what the proxy received came over HBONE.
    let plain = received.decided_by == "kernel" || received.src_identity.is_empty();
    let seen = Seen {
        reporter: Reporter::Destination,
        client: Client::At(received.src.ip().to_canonical()),
        service: None,
        addressed: None,
        destination: Some(received.dst.ip().to_canonical()),
        waypoint: None,
        mutual_tls: (!plain).then(|| received.src_identity.into()),
        flags,
    };
    Some((seen, counts))
}
