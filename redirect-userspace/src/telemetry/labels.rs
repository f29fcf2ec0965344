//! Istio's labels of a connection, worked out against the snapshot in force as ztunnel fills them:
//! workloads by their workload name (a Deployment's Pods by the Deployment's), canonical names from
//! labels, the service the client addressed by its host name, and `unknown` for anything not
//! known. A label is never absent or empty.
use std::fmt::Write;

use super::{Client, Seen};
use crate::{
    config::{EndpointAddress, Labels, Resolution, canonical_revision, canonical_service},
    state::{Endpoint, Service, ServiceKind, Snapshot, TelemetryName},
};

/// Istio's label names, in the order a series' values are held.
pub(super) const NAMES: [&str; 27] = [
    "reporter",
    "source_workload",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_canonical_service",
    "source_canonical_revision",
    "source_cluster",
    "source_region",
    "source_zone",
    "destination_service",
    "destination_service_namespace",
    "destination_service_name",
    "destination_workload",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_cluster",
    "destination_region",
    "destination_zone",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
];

/// What upstream writes for a value it does not know.
pub(super) const UNKNOWN: &str = "unknown";

/// Separates a series' values in its key: no Kubernetes name, host name or SPIFFE id holds it.
pub(super) const SEPARATOR: char = '\0';

/// The trust domain of a mesh config that names none.
pub(super) const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// What the labels are worked out against.
pub(super) struct Names<'a> {
    pub snapshot: &'a std::sync::Arc<Snapshot>,
    /// This node's cluster: every known workload's.
    pub cluster: &'a str,
    pub trust_domain: &'a str,
}

/// One end of a connection as the labels name it.
#[derive(Debug, Clone, Copy)]
struct End<'a> {
    namespace: &'a str,
    workload: &'a str,
    labels: &'a Labels,
    service_account: Option<&'a str>,
}

impl<'a> From<TelemetryName<'a>> for End<'a> {
    fn from(n: TelemetryName<'a>) -> Self {
        End {
            namespace: n.namespace,
            workload: n.workload,
            labels: n.labels,
            service_account: n.service_account,
        }
    }
}

/// Writes the values of `seen`'s series into `out`, in [`NAMES`]' order, [`SEPARATOR`] between.
pub(super) fn write_values(seen: &Seen, names: &Names<'_>, out: &mut String) {
    let (snapshot, cluster, trust_domain) = (&**names.snapshot, names.cluster, names.trust_domain);
    let none = Labels::new();
    let source = source(seen, snapshot, &none);
    let service = addressed_service(seen, snapshot);
    let destination = destination(seen, snapshot, service, &none);
    let mut values = Values { out, first: true };
    values.put(seen.reporter.as_str());
    values.end(source);
    values.put(seen.mutual_tls.as_deref().unwrap_or(UNKNOWN));
    values.canonical(source);
    values.put(source.map_or(UNKNOWN, |_| cluster));
    values.put(UNKNOWN);
    values.put(UNKNOWN);
    match service {
        Some(s) => {
            values.put(&s.hostname);
            values.put(&s.namespace);
            values.put(&s.name);
        }
        None => (0..3).for_each(|_| values.put(UNKNOWN)),
    }
    values.end(destination);
    match destination.and_then(|d| Some((d.namespace, d.service_account?))) {
        Some((namespace, account)) => values.put_fmt(format_args!(
            "spiffe://{trust_domain}/ns/{namespace}/sa/{account}"
        )),
        None => values.put(UNKNOWN),
    }
    values.canonical(destination);
    values.put(destination.map_or(UNKNOWN, |_| cluster));
    values.put(UNKNOWN);
    values.put(UNKNOWN);
    values.put("tcp");
    values.put(seen.flags.as_str());
    values.put(match seen.mutual_tls {
        Some(_) => "mutual_tls",
        None => UNKNOWN,
    });
}

/// The client: the Pod the decider named (as it named it, if gone from the snapshot since), else
/// the one workload at its address.
fn source<'a>(seen: &'a Seen, snapshot: &'a Snapshot, none: &'a Labels) -> Option<End<'a>> {
    match &seen.client {
        Client::Named(name) => {
            let (namespace, pod) = name.split_once('/')?;
            Some(match snapshot.workload_named(namespace, pod) {
                Some(w) => TelemetryName::of(w).into(),
                None => End {
                    namespace,
                    workload: pod,
                    labels: none,
                    service_account: None,
                },
            })
        }
        Client::At(ip) => snapshot.telemetry_at(*ip).map(End::from),
    }
}

/// The service the client addressed, when it addressed one: the host of a ServiceEntry of several
/// whose address it asked for (else its first). None for a ServiceEntry of `resolution: NONE`,
/// which istiod hands ztunnel as a passthrough, not a service. Of a stream received, which names
/// only a Pod and port, the first service with that endpoint, as ztunnel guesses it.
fn addressed_service<'a>(seen: &Seen, snapshot: &'a Snapshot) -> Option<&'a Service> {
    let Some(service) = seen.service.as_deref() else {
        return serving(snapshot, seen.destination?, seen.port?);
    };
    let (namespace, name) = service.split_once('/')?;
    let mut first = None;
    for service in snapshot.services() {
        if service.namespace != namespace || service.name != name {
            continue;
        }
        if seen
            .addressed
            .is_some_and(|ip| service.vips().any(|v| v == ip))
        {
            first = Some(service);
            break;
        }
        first = first.or(Some(service));
    }
    first.filter(|s| s.kind == ServiceKind::Service || s.resolution != Resolution::None)
}

/// The first service (in rank order) with an endpoint at `ip`:`port`.
fn serving(snapshot: &Snapshot, ip: std::net::IpAddr, port: u16) -> Option<&Service> {
    let at = |e: &Endpoint| e.port == port && e.address == EndpointAddress::Ip(ip);
    snapshot
        .services()
        .find(|s| s.ports.iter().any(|p| p.endpoints.iter().any(at)))
}

/// The workload dialled: the one at its address; else the waypoint it went through; else, for a
/// ServiceEntry's endpoint, the entry itself (upstream makes each inline endpoint a workload named
/// after its entry).
fn destination<'a>(
    seen: &'a Seen,
    snapshot: &'a Snapshot,
    service: Option<&'a Service>,
    none: &'a Labels,
) -> Option<End<'a>> {
    let ip = seen.destination?;
    if let Some(found) = snapshot.telemetry_at(ip) {
        return Some(found.into());
    }
    // Reached at its Service's address: the waypoint by its Gateway's name, whose Deployment and
    // service account Istio names alike.
    if let Some((namespace, name)) = seen.waypoint.as_deref().and_then(|w| w.split_once('/')) {
        return Some(End {
            namespace,
            workload: name,
            labels: none,
            service_account: Some(name),
        });
    }
    let entry = service.filter(|s| s.kind == ServiceKind::ServiceEntry)?;
    Some(End {
        namespace: &entry.namespace,
        workload: &entry.name,
        labels: none,
        service_account: Some("default"),
    })
}

/// The values being written.
struct Values<'o> {
    out: &'o mut String,
    first: bool,
}

impl Values<'_> {
    fn put(&mut self, value: &str) {
        self.separate();
        let value = if value.is_empty() { UNKNOWN } else { value };
        // A separator in a value (none of Kubernetes' names holds one) would shift the rest.
        (self.out).extend(value.chars().map(|c| if c == SEPARATOR { '?' } else { c }));
    }

    fn put_fmt(&mut self, value: std::fmt::Arguments<'_>) {
        self.separate();
        let _ = self.out.write_fmt(value);
    }

    fn separate(&mut self) {
        if !self.first {
            self.out.push(SEPARATOR);
        }
        self.first = false;
    }

    /// An end's workload and its namespace.
    fn end(&mut self, end: Option<End<'_>>) {
        match end {
            Some(e) => {
                self.put(e.workload);
                self.put(e.namespace);
            }
            None => {
                self.put(UNKNOWN);
                self.put(UNKNOWN);
            }
        }
    }

    /// An end's app, version, canonical service and canonical revision (app and version are the
    /// canonical two, as upstream fills them).
    fn canonical(&mut self, end: Option<End<'_>>) {
        let (service, revision) = match end {
            Some(e) => (
                canonical_service(e.labels, e.workload),
                canonical_revision(e.labels),
            ),
            None => (UNKNOWN, UNKNOWN),
        };
        for value in [service, revision, service, revision] {
            self.put(value);
        }
    }
}
