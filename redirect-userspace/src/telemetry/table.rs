//! The series of Istio's TCP families: one per label set, at most [`MAX_ISTIO_SERIES`]; an event
//! past the bound is counted apart (`redirect_istio_series_unrecorded_total`), never making a new
//! series. A connection's labels are worked out once for each kind of connection ([`Seen`]), when
//! one of that kind opens under the configuration in force, and its later events count in the
//! same series: a close is counted where its open was, even when the Pods it names have left the
//! configuration since, as ztunnel fixes a connection's labels at its open.
use std::{
    fmt,
    sync::{Arc, Mutex},
};

use foldhash::HashMap;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter},
};

use super::{
    Counts, Flags, Reporter, Seen,
    labels::{DEFAULT_TRUST_DOMAIN, NAMES, Names, SEPARATOR, write_values},
};
use crate::{live::LiveState, lock::Locked, state::Snapshot};

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
    /// The snapshot last counted against, and how many there have been.
    snapshot: Option<Arc<Snapshot>>,
    generation: u64,
    /// Each kind of connection's series, and the generation they were worked out in.
    kinds: HashMap<Seen, (Kind, u64)>,
    /// Each label set's series, by its values joined.
    by_values: HashMap<Arc<str>, u32>,
    series: Vec<Series>,
    unrecorded: u64,
    /// Where values are written before they are looked up.
    scratch: String,
}

#[derive(Clone)]
struct Series {
    /// The values, in [`NAMES`]' order, joined by [`SEPARATOR`].
    values: Arc<str>,
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
        if !(self.snapshot.as_ref()).is_some_and(|held| Arc::ptr_eq(held, names.snapshot)) {
            self.snapshot = Some(names.snapshot.clone());
            self.generation += 1;
        }
        if self.kinds.len() >= MAX_KINDS {
            self.kinds.clear();
        }
        // A connection that opens takes the labels of the configuration in force; its later
        // events, those its open took.
        let opens = counts.opened > 0;
        let kind = match self.kinds.get(&seen) {
            Some((kind, made)) if *made == self.generation || !opens => *kind,
            _ => {
                let kind = self.series_of_kind(&seen, names);
                self.kinds.insert(seen.clone(), (kind, self.generation));
                kind
            }
        };
        let [own, twin] = kind;
        self.count(own, counts, seen.flags != Flags::None);
        // The destination's side of a connection delivered here is counted once it ended, when it
        // is known to have reached the Pod: refused on its way (its SYN reset by the Pod's policy,
        // a port closed), the destination never had it, or reports it itself (`DENY`).
        if twin.is_some() && counts.closed > 0 && seen.flags != Flags::Connect {
            let delivered = Counts {
                opened: counts.closed,
                ..counts
            };
            self.count(twin, delivered, seen.flags != Flags::None);
        }
    }

    fn count(&mut self, index: Option<u32>, counts: Counts, failed: bool) {
        let Some(index) = index else { return };
        match self.series.get_mut(index as usize) {
            Some(series) if index != UNRECORDED => {
                series.counts += counts;
                series.failed += u64::from(failed) * counts.closed;
            }
            _ => self.unrecorded += 1,
        }
    }

    /// The series a connection of this kind counts in: its reporter's, and for a connection this
    /// node delivers in plain TCP to a Pod of its own, the `destination`'s too (ztunnel reports
    /// what it delivers to a local Pod, as the other end's node would). A client refused by the
    /// destination's policies sees its connection fail, as upstream's client side does: `CONNECT`;
    /// the destination says why.
    fn series_of_kind(&mut self, seen: &Seen, names: &Names<'_>) -> Kind {
        let delivered_here = seen.reporter == Reporter::Source
            && seen.mutual_tls.is_none()
            && seen
                .destination
                .is_some_and(|ip| names.snapshot.local_pod(ip).is_some());
        let own = match (seen.reporter, seen.flags) {
            (Reporter::Source, Flags::Deny) => {
                let refused = Seen {
                    flags: Flags::Connect,
                    ..seen.clone()
                };
                self.series_of(&refused, names)
            }
            _ => self.series_of(seen, names),
        };
        let twin = delivered_here.then(|| Seen {
            reporter: Reporter::Destination,
            ..seen.clone()
        });
        [Some(own), twin.map(|twin| self.series_of(&twin, names))]
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
        let values: Arc<str> = self.scratch.as_str().into();
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
        // Copied out (the values are shared): the connections' path never waits for a scrape.
        let (series, unrecorded) = {
            let table = self.table.locked();
            (table.series.clone(), table.unrecorded)
        };
        for (name, help, value) in FAMILIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for series in &series {
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
        let unrecorded_family = encoder.encode_descriptor(
            "redirect_istio_series_unrecorded",
            "Connection events past the bound of the Istio families' label sets, counted in no series",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(unrecorded).encode(unrecorded_family)
    }
}
