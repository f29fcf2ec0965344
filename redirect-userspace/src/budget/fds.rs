//! The file descriptors the outbound proxy may hold, counted before they are opened, so the process
//! never reaches its limit: accepts, DNS and admin keep working and every refusal is an immediate reset.
use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use super::{BudgetKind, BudgetMetrics, Refusal};

/// How full the ledger may get for a charge: splice pipes only while there is room to spare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ceiling {
    /// The whole budget: the two sockets of a connection.
    Limit,
    /// Below the splice mark: past it, new connections relay by copy (2 fds instead of 6).
    Splice,
}

#[derive(Debug)]
pub(crate) struct FdLedger {
    limit: usize,
    splice_below: usize,
    used: AtomicUsize,
    metrics: Arc<BudgetMetrics>,
}

impl FdLedger {
    pub(crate) fn new(
        limit: usize,
        splice_below: usize,
        metrics: Arc<BudgetMetrics>,
    ) -> Arc<FdLedger> {
        metrics.limits(BudgetKind::Fds, limit, None);
        Arc::new(FdLedger {
            limit,
            splice_below: splice_below.min(limit),
            used: AtomicUsize::new(0),
            metrics,
        })
    }

    /// Charges `n` descriptors if they fit under `ceiling`; the charge is released on drop. A refusal
    /// at the full limit is counted; a splice charge that does not fit is only a fallback to copy.
    pub(crate) fn charge(self: &Arc<Self>, n: usize, ceiling: Ceiling) -> Option<FdCharge> {
        let top = match ceiling {
            Ceiling::Limit => self.limit,
            Ceiling::Splice => self.splice_below,
        };
        let charged = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + n <= top).then_some(used + n)
            });
        match charged {
            Ok(before) => {
                self.metrics.used(BudgetKind::Fds, before + n);
                Some(FdCharge {
                    ledger: self.clone(),
                    n,
                })
            }
            Err(_) => {
                if ceiling == Ceiling::Limit {
                    self.metrics.refused(BudgetKind::Fds, Refusal::Fds);
                }
                None
            }
        }
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }
}

/// Descriptors charged to the ledger for as long as this lives.
#[derive(Debug)]
pub(crate) struct FdCharge {
    ledger: Arc<FdLedger>,
    n: usize,
}

impl Drop for FdCharge {
    fn drop(&mut self) {
        let after = self.ledger.used.fetch_sub(self.n, Ordering::AcqRel) - self.n;
        self.ledger.metrics.used(BudgetKind::Fds, after);
    }
}

/// Lifts the soft limit on open files to the hard one (as Go's runtime does) and returns the limit in
/// force. The hard limit is the operator's word on what the agent may hold: it is never raised.
pub(crate) fn raise_fd_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit on a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    // An unlimited hard limit still stops at the kernel's per-process maximum.
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
        .unwrap_or(1 << 20);
    let wanted = limit.rlim_max.min(nr_open);
    if limit.rlim_cur < wanted {
        let raised = libc::rlimit {
            rlim_cur: wanted,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit on a valid struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = wanted;
        } else {
            tracing::warn!(
                soft = limit.rlim_cur,
                "could not raise the open-files limit"
            );
        }
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_under_their_ceiling_and_are_released_on_drop() {
        let ledger = FdLedger::new(10, 6, Arc::new(BudgetMetrics::default()));
        let socket_pair = ledger.charge(2, Ceiling::Limit).unwrap();
        let pipes = ledger.charge(4, Ceiling::Splice).unwrap();
        // 6 used: no more pipes, but sockets still fit up to the limit.
        assert!(ledger.charge(2, Ceiling::Splice).is_none());
        let more: Vec<FdCharge> = (0..2)
            .map(|_| ledger.charge(2, Ceiling::Limit).unwrap())
            .collect();
        assert!(ledger.charge(2, Ceiling::Limit).is_none());
        assert_eq!(ledger.used(), 10);
        drop((socket_pair, pipes, more));
        assert_eq!(ledger.used(), 0);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let got = raise_fd_limit();
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(
            // SAFETY: getrlimit writes into a valid, exclusively borrowed struct.
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!(got as libc::rlim_t, limit.rlim_cur);
        assert!(limit.rlim_cur == limit.rlim_max || limit.rlim_cur >= 1 << 20);
    }
}
