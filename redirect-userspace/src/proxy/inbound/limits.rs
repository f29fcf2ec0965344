//! What HBONE received may hold of the agent: connections per peer address, and descriptors in all
//! (each connection's socket and each stream's socket to the Pod), a share of the agent's
//! descriptor budget charged to the same ledger as the outbound proxy's, so that peers holding a
//! valid certificate cannot take the agent to its open-files limit.
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use crate::budget::{Ceiling, FdCharge, FdLedger};

/// Connections one peer address may hold: a node pools a few per Pod pair (ztunnel opens one per
/// source and destination identity pair), far fewer than this.
pub(super) const CONNECTIONS_PER_PEER: usize = 16;

/// HBONE received may hold at most a quarter of the agent's descriptor budget; the outbound proxy
/// keeps the rest whatever peers do.
const SHARE_OF_FDS: usize = 4;

/// The fewest descriptors received HBONE may hold, however small the budget.
const MIN_FDS: usize = 64;

#[derive(Debug)]
pub(super) struct InboundLimits {
    per_peer: usize,
    fds: usize,
    ledger: Arc<FdLedger>,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    peers: HashMap<IpAddr, usize>,
    fds: usize,
}

impl InboundLimits {
    /// Limits sized from the agent's descriptor `ledger`, which every charge is also made to.
    pub(super) fn new(ledger: Arc<FdLedger>) -> Arc<Self> {
        let fds = (ledger.limit() / SHARE_OF_FDS).max(MIN_FDS);
        Self::with(ledger, CONNECTIONS_PER_PEER, fds)
    }

    pub(super) fn with(ledger: Arc<FdLedger>, per_peer: usize, fds: usize) -> Arc<Self> {
        Arc::new(InboundLimits {
            per_peer,
            fds,
            ledger,
            held: Mutex::default(),
        })
    }

    /// One more connection from `peer`, or the refusal's label for `hbone_inbound`.
    pub(super) fn connection(
        self: &Arc<Self>,
        peer: IpAddr,
    ) -> Result<ConnectionHeld, &'static str> {
        let mut held = self.lock();
        let count = held.peers.get(&peer).copied().unwrap_or(0);
        if count >= self.per_peer {
            return Err("peer_limit");
        }
        if held.fds >= self.fds {
            return Err("connection_limit");
        }
        let Some(charge) = self.ledger.charge(1, Ceiling::Limit) else {
            return Err("connection_limit");
        };
        held.peers.insert(peer, count + 1);
        held.fds += 1;
        Ok(ConnectionHeld {
            limits: self.clone(),
            peer,
            _charge: charge,
        })
    }

    /// A descriptor for a stream's socket to the Pod, if the share has one.
    pub(super) fn socket(self: &Arc<Self>) -> Option<SocketHeld> {
        let mut held = self.lock();
        if held.fds >= self.fds {
            return None;
        }
        let charge = self.ledger.charge(1, Ceiling::Limit)?;
        held.fds += 1;
        Some(SocketHeld {
            limits: self.clone(),
            _charge: charge,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        // Counts stay right whatever panicked while holding the lock: each change is one statement.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    pub(super) fn fds_held(&self) -> usize {
        self.lock().fds
    }
}

/// A connection's place, released when it ends.
#[derive(Debug)]
pub(super) struct ConnectionHeld {
    limits: Arc<InboundLimits>,
    peer: IpAddr,
    _charge: FdCharge,
}

impl Drop for ConnectionHeld {
    fn drop(&mut self) {
        let mut held = self.limits.lock();
        held.fds -= 1;
        if let Some(count) = held.peers.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                held.peers.remove(&self.peer);
            }
        }
    }
}

/// A stream's socket to the Pod, released when the stream ends.
#[derive(Debug)]
pub(super) struct SocketHeld {
    limits: Arc<InboundLimits>,
    _charge: FdCharge,
}

impl Drop for SocketHeld {
    fn drop(&mut self) {
        self.limits.lock().fds -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BudgetMetrics;

    fn ledger(limit: usize) -> Arc<FdLedger> {
        FdLedger::new(limit, 0, Arc::new(BudgetMetrics::default()))
    }

    #[test]
    fn a_peer_past_its_connections_is_refused_and_the_others_are_not() {
        let limits = InboundLimits::with(ledger(1000), 2, 100);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = limits.connection(a).unwrap();
        let _second = limits.connection(a).unwrap();
        assert_eq!(limits.connection(a).unwrap_err(), "peer_limit");
        let _other = limits.connection(b).unwrap();
        // A connection that ends gives its place back.
        drop(first);
        let _again = limits.connection(a).unwrap();
        assert_eq!(limits.fds_held(), 3);
    }

    #[test]
    fn the_share_of_descriptors_caps_connections_and_streams_together() {
        let limits = InboundLimits::with(ledger(1000), 16, 3);
        let _c1 = limits.connection("10.0.0.1".parse().unwrap()).unwrap();
        let s1 = limits.socket().unwrap();
        let _c2 = limits.connection("10.0.0.2".parse().unwrap()).unwrap();
        assert!(limits.socket().is_none());
        assert_eq!(
            limits.connection("10.0.0.3".parse().unwrap()).unwrap_err(),
            "connection_limit"
        );
        drop(s1);
        assert!(limits.socket().is_some());
    }

    #[test]
    fn the_agent_ledger_is_charged_and_a_full_one_refuses() {
        let ledger = ledger(2);
        let limits = InboundLimits::with(ledger.clone(), 16, 100);
        let held = limits.connection("10.0.0.1".parse().unwrap()).unwrap();
        let _socket = limits.socket().unwrap();
        assert_eq!(ledger.used(), 2);
        assert!(limits.socket().is_none());
        assert_eq!(
            limits.connection("10.0.0.2".parse().unwrap()).unwrap_err(),
            "connection_limit"
        );
        drop(held);
        assert_eq!((ledger.used(), limits.fds_held()), (1, 1));
    }

    #[test]
    fn the_default_share_is_a_quarter_of_the_budget() {
        let limits = InboundLimits::new(ledger(4000));
        assert_eq!(limits.fds, 1000);
        assert_eq!(InboundLimits::new(ledger(10)).fds, MIN_FDS);
    }
}
