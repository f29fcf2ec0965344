//! The series of Istio's TCP families: one per label set, at most [`MAX_ISTIO_SERIES`]; an event
//! past the bound is counted apart (`redirect_istio_series_unrecorded_total`), never making a new
//! series. A connection's labels are worked out once per snapshot for each kind of connection
//! ([`Seen`]), so the busy path is one lookup of that kind and a few additions.
use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter},
};

use super::{
    Counts, Flags, Reporter, Seen,
    labels::{DEFAULT_TRUST_DOMAIN, NAMES, Names, SEPARATOR, write_values},
};
use crate::{live::LiveState, lock::Locked};

/// Label sets of the Istio families, at most: a node's Pods times what they reach.
pub(crate) const MAX_ISTIO_SERIES: usize = 10_000;

/// Kinds of connection remembered per snapshot before the memory is started afresh (a client
/// reaching many addresses directly makes many kinds for few series).
const MAX_KINDS: usize = 4 * MAX_ISTIO_SERIES;

/// Istio's four TCP families and the failed connections, for every connection the agent sees.
pub(crate) struct IstioMetrics {
    live: Arc<LiveState>,
    /// `--cluster-id`: every known workload's cluster.
    cluster: Box<str>,
    /// `--trust-domain`, over the mesh config's.
    trust_domain: Option<Box<str>>,
    table: Mutex<Table>,
}

impl fmt::Debug for IstioMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IstioMetrics")
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

/// The series a kind of connection counts in: its reporter's, and maybe a second.
type Kind = [Option<u32>; 2];

/// The index of no series: the bound was reached.
const UNRECORDED: u32 = u32::MAX;

#[derive(Default)]
struct Table {
    /// The snapshot the kinds were worked out against (by address).
    kinds_of: usize,
    /// Each kind of connection's series.
    kinds: HashMap<Seen, Kind>,
    /// Each label set's series, by its values joined.
    by_values: HashMap<Box<str>, u32>,
    series: Vec<Series>,
    unrecorded: u64,
    /// Where values are written before they are looked up.
    scratch: String,
}

struct Series {
    /// The values, in [`NAMES`]' order, joined by [`SEPARATOR`].
    values: Box<str>,
    counts: Counts,
    failed: u64,
}

impl IstioMetrics {
    pub(crate) fn new(live: Arc<LiveState>, cluster: &str) -> Self {
        IstioMetrics {
            live,
            cluster: cluster.into(),
            trust_domain: None,
            table: Mutex::new(Table::default()),
        }
    }

    /// Principals in `trust_domain` (`--trust-domain`) rather than the mesh config's.
    pub(crate) fn with_trust_domain(mut self, trust_domain: Option<&str>) -> Self {
        self.trust_domain = trust_domain.map(Box::from);
        self
    }

    /// Adds each connection's counts to its series.
    pub(crate) fn count(&self, seen: impl IntoIterator<Item = (Seen, Counts)>) {
        let snapshot = self.live.snapshot();
        let names = Names {
            snapshot: &snapshot,
            cluster: &self.cluster,
            trust_domain: (self.trust_domain.as_deref())
                .or(snapshot.trust_domain())
                .unwrap_or(DEFAULT_TRUST_DOMAIN),
        };
        let mut table = self.table.locked();
        for (seen, counts) in seen {
            table.add(&names, seen, counts);
        }
    }

    /// Series, and events left uncounted for want of one.
    #[cfg(test)]
    pub(crate) fn series(&self) -> (usize, u64) {
        let table = self.table.locked();
        (table.series.len(), table.unrecorded)
    }
}

impl Table {
    fn add(&mut self, names: &Names<'_>, seen: Seen, counts: Counts) {
        let at = Arc::as_ptr(names.snapshot) as usize;
        if self.kinds_of != at || self.kinds.len() >= MAX_KINDS {
            self.kinds.clear();
            self.kinds_of = at;
        }
        let failed = u64::from(seen.flags != Flags::None) * counts.closed;
        let indices = match self.kinds.get(&seen) {
            Some(indices) => *indices,
            None => {
                let indices = self.series_of_kind(&seen, names);
                self.kinds.insert(seen, indices);
                indices
            }
        };
        for index in indices.into_iter().flatten() {
            match self.series.get_mut(index as usize) {
                Some(series) if index != UNRECORDED => {
                    series.counts += counts;
                    series.failed += failed;
                }
                _ => self.unrecorded += 1,
            }
        }
    }

    /// The series a connection of this kind counts in: its reporter's, and for a connection this
    /// node delivers in plain TCP to a Pod of its own, the `destination`'s too (ztunnel reports
    /// what it delivers to a local Pod, as the other end's node would).
    fn series_of_kind(&mut self, seen: &Seen, names: &Names<'_>) -> Kind {
        let delivered_here = seen.reporter == Reporter::Source
            && seen.mutual_tls.is_none()
            && seen
                .destination
                .is_some_and(|ip| names.snapshot.local_pod(ip).is_some());
        let twin = delivered_here.then(|| Seen {
            reporter: Reporter::Destination,
            ..seen.clone()
        });
        [
            Some(self.series_of(seen, names)),
            twin.map(|twin| self.series_of(&twin, names)),
        ]
    }

    /// The series of `seen`'s label values, made if within the bound ([`UNRECORDED`] past it).
    fn series_of(&mut self, seen: &Seen, names: &Names<'_>) -> u32 {
        self.scratch.clear();
        write_values(seen, names, &mut self.scratch);
        if let Some(index) = self.by_values.get(self.scratch.as_str()) {
            return *index;
        }
        if self.series.len() >= MAX_ISTIO_SERIES {
            return UNRECORDED;
        }
        let index = self.series.len() as u32;
        let values: Box<str> = self.scratch.as_str().into();
        self.by_values.insert(values.clone(), index);
        self.series.push(Series {
            values,
            counts: Counts::default(),
            failed: 0,
        });
        index
    }
}

/// A family: its name, its help, and what it takes of a series.
type Family = (&'static str, &'static str, fn(&Series) -> u64);

/// The families.
const FAMILIES: [Family; 5] = [
    (
        "istio_tcp_connections_opened",
        "TCP connections opened, as Istio counts them (every connection the agent decides or receives)",
        |s| s.counts.opened,
    ),
    (
        "istio_tcp_connections_closed",
        "TCP connections closed, failed or not",
        |s| s.counts.closed,
    ),
    (
        "istio_tcp_received_bytes",
        "Bytes from the client to the server (Istio's name: received by the server)",
        |s| s.counts.from_client,
    ),
    (
        "istio_tcp_sent_bytes",
        "Bytes from the server to the client (Istio's name: sent by the server)",
        |s| s.counts.to_client,
    ),
    (
        "istio_tcp_connections_failed",
        "TCP connections closed with a failure (response_flags other than -)",
        |s| s.failed,
    ),
];

impl Collector for IstioMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let table = self.table.locked();
        for (name, help, value) in FAMILIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for series in &table.series {
                let n = value(series);
                // A failure count is shown once there is one; the others from the start.
                if n == 0 && name == "istio_tcp_connections_failed" {
                    continue;
                }
                let labels: Vec<(&str, &str)> = NAMES
                    .iter()
                    .copied()
                    .zip(series.values.split(SEPARATOR))
                    .collect();
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        let unrecorded = encoder.encode_descriptor(
            "redirect_istio_series_unrecorded",
            "Connection events past the bound of the Istio families' label sets, counted in no series",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(table.unrecorded).encode(unrecorded)
    }
}
