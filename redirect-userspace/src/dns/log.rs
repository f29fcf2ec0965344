//! The DNS proxy's log lines that a pod can cause, one or more per query or connection, held to
//! [`PER_SECOND`] lines a second of each kind (`docs/observability.md#logs`): a pod flooding the
//! proxy with queries cannot flood the log too. The lines held back in a second are summed up in
//! one line per kind once it is over (`DNS log lines held back`, with `kind` and `lines`).
//!
//! Write such a line with [`limited!`]: `limited!(Kind::Forwarded, debug, name = %n, "DNS forwarded")`.
//! A line whose level is off costs nothing and counts against nothing.
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use tracing::Level;

use crate::logging::LineLimit;

/// Lines a second, at most, of each kind (as the kernel's hide reports, `fastpath/upkeep.rs`).
pub(super) const PER_SECOND: u32 = 50;

/// What a line is about; each kind has its own budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// `service hidden from client`.
    Hidden,
    /// `DNS answered`.
    Answered,
    /// `DNS forwarded`.
    Forwarded,
    /// A forward that failed: SERVFAIL.
    ForwardFailed,
    /// A client past its share of forwards or TCP connections.
    OverBudget,
    /// Bytes that are no DNS query: dropped.
    Malformed,
    /// A reply that could not be sent to the client.
    SendFailed,
    /// A UDP receive or TCP accept that failed.
    ListenFailed,
    /// A local answer that could not be encoded.
    EncodeFailed,
    /// A zone transfer the upstream cut.
    TransferCut,
    /// A TCP client's flow entry that could not be read.
    FlowEntry,
    /// A forward that could not be sent upstream (retried).
    UpstreamSend,
    /// One upstream socket's queries in flight at their cap.
    UpstreamBusy,
    /// An error on an upstream socket.
    UpstreamSocket,
    /// A reply from the upstream that matches no query (late, forged or not a response).
    StrayReply,
    /// One address family of an endpoint host name that failed.
    EndpointFamily,
}

impl Kind {
    const ALL: [Kind; 16] = [
        Kind::Hidden,
        Kind::Answered,
        Kind::Forwarded,
        Kind::ForwardFailed,
        Kind::OverBudget,
        Kind::Malformed,
        Kind::SendFailed,
        Kind::ListenFailed,
        Kind::EncodeFailed,
        Kind::TransferCut,
        Kind::FlowEntry,
        Kind::UpstreamSend,
        Kind::UpstreamBusy,
        Kind::UpstreamSocket,
        Kind::StrayReply,
        Kind::EndpointFamily,
    ];

    pub(super) const fn as_str(self) -> &'static str {
        match self {
            Kind::Hidden => "hidden",
            Kind::Answered => "answered",
            Kind::Forwarded => "forwarded",
            Kind::ForwardFailed => "forward_failed",
            Kind::OverBudget => "over_budget",
            Kind::Malformed => "malformed",
            Kind::SendFailed => "send_failed",
            Kind::ListenFailed => "listen_failed",
            Kind::EncodeFailed => "encode_failed",
            Kind::TransferCut => "transfer_cut",
            Kind::FlowEntry => "flow_entry",
            Kind::UpstreamSend => "upstream_send",
            Kind::UpstreamBusy => "upstream_busy",
            Kind::UpstreamSocket => "upstream_socket",
            Kind::StrayReply => "stray_reply",
            Kind::EndpointFamily => "endpoint_family",
        }
    }
}

/// One [`LineLimit`] per kind, and the level its lines (and so its summary) are written at.
struct Limits {
    limits: [LineLimit; Kind::ALL.len()],
    /// Whether each kind's last line was a warning: then its summary is one too.
    warns: [AtomicBool; Kind::ALL.len()],
}

impl Limits {
    const fn new() -> Self {
        Limits {
            limits: [const { LineLimit::new(PER_SECOND) }; Kind::ALL.len()],
            warns: [const { AtomicBool::new(false) }; Kind::ALL.len()],
        }
    }

    fn level(&self, kind: Kind) -> Level {
        if self.warns[kind as usize].load(Ordering::Relaxed) {
            Level::WARN
        } else {
            Level::DEBUG
        }
    }

    /// One line of `kind` at `level`, at `now`: whether to write it, and the summary to write first
    /// (lines held back in the second that just ended), if any.
    fn admit(&self, kind: Kind, level: Level, now: Instant) -> (bool, Option<(Kind, Level, u64)>) {
        let admit = self.limits[kind as usize].admit(now);
        let summary = (admit.held_back > 0).then(|| (kind, self.level(kind), admit.held_back));
        self.warns[kind as usize].store(level == Level::WARN, Ordering::Relaxed);
        (admit.write, summary)
    }

    /// The summaries of every kind whose second is over by `now` with lines held back.
    fn flush(&self, now: Instant) -> Vec<(Kind, Level, u64)> {
        Kind::ALL
            .iter()
            .filter_map(|&kind| {
                let held_back = self.limits[kind as usize].flush(now);
                (held_back > 0).then(|| (kind, self.level(kind), held_back))
            })
            .collect()
    }
}

/// The agent's budgets: one per kind, shared by every listener and the decision.
static LIMITS: Limits = Limits::new();

/// Whether a line of `kind` at `level` may be written now; writes the summary of the second before
/// it first when that one held lines back. Used by [`limited!`], once the level is known to be on.
pub(super) fn admit(kind: Kind, level: Level) -> bool {
    let (write, summary) = LIMITS.admit(kind, level, Instant::now());
    if let Some(summary) = summary {
        write_summary(summary);
    }
    write
}

/// Writes the summaries of a flood that stopped (no next line would), every second, forever.
pub(super) async fn flush_every_second() {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for summary in LIMITS.flush(Instant::now()) {
            write_summary(summary);
        }
    }
}

fn write_summary((kind, level, lines): (Kind, Level, u64)) {
    let kind = kind.as_str();
    let per_second = PER_SECOND;
    if level == Level::WARN {
        tracing::warn!(
            kind,
            lines,
            per_second,
            "DNS log lines held back in the last second"
        );
    } else {
        tracing::debug!(
            kind,
            lines,
            per_second,
            "DNS log lines held back in the last second"
        );
    }
}

/// A `debug!` or `warn!` line of a [`Kind`], written only within that kind's budget:
/// `limited!(Kind::Hidden, debug, client = %ip, "service hidden from client")`.
macro_rules! limited {
    ($kind:expr, debug, $($line:tt)+) => {
        if ::tracing::enabled!(::tracing::Level::DEBUG)
            && $crate::dns::log::admit($kind, ::tracing::Level::DEBUG)
        {
            ::tracing::debug!($($line)+);
        }
    };
    ($kind:expr, warn, $($line:tt)+) => {
        if ::tracing::enabled!(::tracing::Level::WARN)
            && $crate::dns::log::admit($kind, ::tracing::Level::WARN)
        {
            ::tracing::warn!($($line)+);
        }
    };
}
pub(crate) use limited;

#[cfg(test)]
mod tests {
    use super::*;

    /// The flood seen at `-v`: 2,000 queries a second for a hidden name, each writing a `service
    /// hidden from client` and a `DNS forwarded` line, for 10 seconds. Held to 50 of each a second
    /// and one summary per kind a second: 1,020 lines at most instead of 40,000, and the summaries
    /// account for every line held back.
    #[test]
    fn a_dns_flood_writes_50_lines_of_each_kind_a_second_and_one_summary() {
        let limits = Limits::new();
        let t0 = Instant::now();
        let (mut written, mut summaries, mut held_back) = (0u64, 0u64, 0u64);
        let mut count = |(write, summary): (bool, Option<(Kind, Level, u64)>)| {
            written += u64::from(write);
            if let Some((_, level, lines)) = summary {
                assert_eq!(level, Level::DEBUG);
                summaries += 1;
                held_back += lines;
            }
        };
        for query in 0..20_000u32 {
            let at = t0 + Duration::from_micros(u64::from(query) * 500);
            count(limits.admit(Kind::Hidden, Level::DEBUG, at));
            count(limits.admit(Kind::Forwarded, Level::DEBUG, at));
        }
        for (_, _, lines) in limits.flush(t0 + Duration::from_secs(11)) {
            summaries += 1;
            held_back += lines;
        }
        assert_eq!(written, 10 * 2 * u64::from(PER_SECOND));
        assert_eq!(summaries, 10 * 2, "one a second of each kind");
        assert_eq!(written + held_back, 40_000, "every line written or counted");
    }

    /// Each kind has its own budget: a flood of one does not silence another.
    #[test]
    fn a_flood_of_one_kind_leaves_the_others_their_lines() {
        let limits = Limits::new();
        let t0 = Instant::now();
        for _ in 0..1_000 {
            limits.admit(Kind::Malformed, Level::DEBUG, t0);
        }
        assert!(limits.admit(Kind::OverBudget, Level::DEBUG, t0).0);
        assert!(!limits.admit(Kind::Malformed, Level::DEBUG, t0).0);
        // A warn kind's summary is a warn line too.
        for _ in 0..=PER_SECOND {
            limits.admit(Kind::ListenFailed, Level::WARN, t0);
        }
        let flushed = limits.flush(t0 + Duration::from_secs(1));
        assert_eq!(
            flushed,
            [
                (Kind::Malformed, Level::DEBUG, 951),
                (Kind::ListenFailed, Level::WARN, 1)
            ]
        );
    }

    #[test]
    fn every_kind_is_listed_once_in_its_place() {
        for (i, kind) in Kind::ALL.iter().enumerate() {
            assert_eq!(*kind as usize, i, "{}", kind.as_str());
        }
    }
}
