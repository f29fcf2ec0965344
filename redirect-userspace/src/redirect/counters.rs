//! The programs' own counters, read at scrape time (`docs/observability.md#metrics`).
use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::counter::ConstCounter,
};

use super::RedirectMaps;

/// A Prometheus collector of the per-CPU counters the programs keep, summed.
pub(crate) fn collector(maps: Arc<RedirectMaps>) -> Box<dyn Collector> {
    Box::new(EbpfEvents(maps))
}

/// Reads the programs' per-CPU counters at scrape time.
#[derive(Debug)]
struct EbpfEvents(Arc<RedirectMaps>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

impl Collector for EbpfEvents {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let counts = self.0.event_counts();
        let mut family = encoder.encode_descriptor(
            "ebpf_events",
            "Events counted by the eBPF programs (summed over CPUs)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (stat, total) in counts {
            let labels = EventLabels { event: stat.name() };
            ConstCounter::new(total).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
