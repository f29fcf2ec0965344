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
        // The kernel knows a client by its cgroup; one it could not name is unknown at its open
        // and its close alike (it learns the address only at the close).
        (None, _) if record.decided_by == DecidedBy::Kernel => Client::At(unnamed()),
        (None, Some(client)) => Client::At(client.ip()),
        (None, None) => return None,
    };
    let seen = Seen {
        reporter: Reporter::Source,
        client,
        service: record.service.as_ref().map(super::Name::shared),
        addressed: record.orig_dst.map(|a| a.ip()),
        destination: record.endpoint.map(|a| a.ip().to_canonical()),
        port: None,
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
        port: Some(received.dst.port()),
        waypoint: None,
        mutual_tls: (!plain).then(|| received.src_identity.into()),
        flags,
    };
    Some((seen, counts))
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, time::Duration};

    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    fn proxy_close(opened: bool, end: &'static str) -> Record {
        let mut r = Record::new(Event::Close, DecidedBy::Proxy);
        r.client = Some(addr("10.244.1.10:40000"));
        r.workload = Some("team-a/a1".into());
        r.service = Some("team-a/api".into());
        r.orig_dst = Some(addr("203.0.113.10:80"));
        r.endpoint = Some(addr("198.51.100.20:80"));
        r.was_opened = opened;
        r.end = Some(end);
        r.bytes_sent = 75;
        r.bytes_received = 300;
        r
    }

    #[test]
    fn a_close_counts_its_bytes_client_to_server_as_istio_received() {
        let Some((seen, counts)) = seen(&proxy_close(true, "closed")) else {
            panic!("not counted")
        };
        assert_eq!(seen.flags, Flags::None);
        assert_eq!(seen.reporter, Reporter::Source);
        assert_eq!(seen.client, Client::Named("team-a/a1".into()));
        assert_eq!(seen.addressed, Some(addr("203.0.113.10:80").ip()));
        let want = Counts {
            opened: 0,
            closed: 1,
            from_client: 75,
            to_client: 300,
        };
        assert_eq!(counts, want);
    }

    #[test]
    fn a_refusal_counts_only_when_a_dial_failed_or_policy_refused() {
        for (end, flags) in [
            (ends::UPSTREAM_CONNECT_FAILED, Flags::Connect),
            (ends::TUNNEL_FAILED, Flags::Connect),
            (ends::DENIED, Flags::Deny),
        ] {
            let Some((seen, counts)) = seen(&proxy_close(false, end)) else {
                panic!("{end}: not counted")
            };
            assert_eq!(seen.flags, flags, "{end}");
            assert_eq!((counts.opened, counts.closed), (1, 1), "{end}");
        }
        for early in ["no healthy upstream", "destination refused", "reset"] {
            assert!(seen(&proxy_close(false, early)).is_none(), "{early}");
        }
    }

    #[test]
    fn a_client_the_kernel_could_not_name_is_one_unknown_at_open_and_close() {
        let mut open = Record::new(Event::Open, DecidedBy::Kernel);
        open.endpoint = Some(addr("198.51.100.20:80"));
        let mut close = Record::new(Event::Close, DecidedBy::Kernel);
        close.endpoint = open.endpoint;
        close.client = Some(addr("10.244.9.9:40000"));
        close.end = Some(ends::CONNECT_FAILED);
        close.duration = Some(Duration::from_millis(1));
        let (Some((opened, _)), Some((closed, counts))) = (seen(&open), seen(&close)) else {
            panic!("not counted")
        };
        assert_eq!(opened.client, closed.client);
        assert_eq!(closed.flags, Flags::Connect);
        assert_eq!((counts.opened, counts.closed), (0, 1));
    }

    #[test]
    fn a_stream_received_is_the_destinations_and_mutual_tls_unless_the_kernel_refused_it() {
        let received = |event, end, decided_by| Received {
            event,
            src_identity: "spiffe://cluster.local/ns/team-a/sa/default",
            src: addr("10.244.1.10:40000"),
            dst: addr("10.244.2.20:8080"),
            bytes_in: 10,
            bytes_out: 20,
            duration: Duration::ZERO,
            end,
            authorization: "-",
            decided_by,
        };
        let (seen_open, open) = super::received(&received(Event::Open, "-", "proxy")).unwrap();
        assert_eq!(seen_open.reporter, Reporter::Destination);
        assert_eq!(seen_open.port, Some(8080));
        assert!(seen_open.mutual_tls.is_some());
        assert_eq!((open.opened, open.closed), (1, 0));
        let (_, close) = super::received(&received(Event::Close, "closed", "proxy")).unwrap();
        assert_eq!(
            (close.closed, close.from_client, close.to_client),
            (1, 10, 20)
        );
        let (refused, counts) =
            super::received(&received(Event::Close, ends::REFUSED, "kernel")).unwrap();
        assert_eq!((refused.flags, refused.mutual_tls), (Flags::Deny, None));
        assert_eq!(
            (counts.opened, counts.closed, counts.from_client),
            (1, 1, 0)
        );
    }
}
