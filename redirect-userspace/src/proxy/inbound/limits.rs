//! What HBONE received may hold of the agent: connections per peer address, and descriptors in all
//! (each connection's socket and each stream's socket to the Pod), a share of the agent's
//! descriptor budget charged to the same ledger as the outbound proxy's, so that peers holding a
//! valid certificate cannot take the agent to its open-files limit. Each connection also holds a
//! unit of the agent's proxied connections, in its sender's share: what a drain waits for. When
//! the descriptors held fall to half their most, what they held is freed: a trim is asked for.
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use super::trim::Trim;
use crate::budget::{Ceiling, FdCharge, FdLedger, Permit, Share};

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
    /// The agent's proxied connections (a drain waits until none is held).
    relaying: Arc<Share>,
    trim: Arc<Trim>,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    peers: HashMap<IpAddr, usize>,
    fds: usize,
    /// The most `fds` has been since the last ask for a trim.
    most: usize,
}

impl Held {
    fn take(&mut self) {
        self.fds += 1;
        self.most = self.most.max(self.fds);
    }

    /// One descriptor fewer; asks for a trim once half of the most held is gone.
    fn give_back(&mut self, trim: &Trim) {
        self.fds -= 1;
        if self.fds * 2 <= self.most {
            self.most = self.fds;
            trim.ask();
        }
    }
}

impl InboundLimits {
    /// Limits sized from the agent's descriptor `ledger`, which every charge is also made to;
    /// each connection holds a unit of `relaying`.
    pub(super) fn new(ledger: Arc<FdLedger>, relaying: Arc<Share>) -> Arc<Self> {
        let fds = (ledger.limit() / SHARE_OF_FDS).max(MIN_FDS);
        Self::with(ledger, relaying, CONNECTIONS_PER_PEER, fds)
    }

    pub(super) fn with(
        ledger: Arc<FdLedger>,
        relaying: Arc<Share>,
        per_peer: usize,
        fds: usize,
    ) -> Arc<Self> {
        Arc::new(InboundLimits {
            per_peer,
            fds,
            ledger,
            relaying,
            trim: Arc::default(),
            held: Mutex::default(),
        })
    }

    /// What asks for a trim as the descriptors held fall.
    pub(super) fn trim(&self) -> Arc<Trim> {
        self.trim.clone()
    }

    /// One more connection from `peer`, whose share of the proxied connections is kept under
    /// `share` (`Snapshot::budget_key`), or the refusal's label for `hbone_inbound`.
    pub(super) fn connection(
        self: &Arc<Self>,
        peer: IpAddr,
        share: IpAddr,
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
        let Ok(relaying) = self.relaying.take(share) else {
            return Err("connection_budget");
        };
        held.peers.insert(peer, count + 1);
        held.take();
        Ok(ConnectionHeld {
            limits: self.clone(),
            peer,
            _charge: charge,
            _relaying: relaying,
        })
    }

    /// A descriptor for a stream's socket to the Pod, if the share has one.
    pub(super) fn socket(self: &Arc<Self>) -> Option<SocketHeld> {
        let mut held = self.lock();
        if held.fds >= self.fds {
            return None;
        }
        let charge = self.ledger.charge(1, Ceiling::Limit)?;
        held.take();
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
    _relaying: Permit,
}

impl Drop for ConnectionHeld {
    fn drop(&mut self) {
        let mut held = self.limits.lock();
        held.give_back(&self.limits.trim);
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
        self.limits.lock().give_back(&self.limits.trim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{BudgetKind, BudgetMetrics};

    fn ledger(limit: usize) -> Arc<FdLedger> {
        FdLedger::new(limit, 0, Arc::new(BudgetMetrics::default()))
    }

    fn relaying(node: usize, client: usize) -> Arc<Share> {
        Share::new(BudgetKind::Connections, node, client, Arc::default())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A connection from `peer`, its share kept under its own address.
    fn connect(limits: &Arc<InboundLimits>, peer: &str) -> Result<ConnectionHeld, &'static str> {
        limits.connection(ip(peer), ip(peer))
    }

    #[test]
    fn a_peer_past_its_connections_is_refused_and_the_others_are_not() {
        let limits = InboundLimits::with(ledger(1000), relaying(100, 100), 2, 100);
        let first = connect(&limits, "10.0.0.1").unwrap();
        let _second = connect(&limits, "10.0.0.1").unwrap();
        assert_eq!(connect(&limits, "10.0.0.1").unwrap_err(), "peer_limit");
        let _other = connect(&limits, "10.0.0.2").unwrap();
        // A connection that ends gives its place back.
        drop(first);
        let _again = connect(&limits, "10.0.0.1").unwrap();
        assert_eq!(limits.fds_held(), 3);
    }

    #[test]
    fn the_share_of_descriptors_caps_connections_and_streams_together() {
        let limits = InboundLimits::with(ledger(1000), relaying(100, 100), 16, 3);
        let _c1 = connect(&limits, "10.0.0.1").unwrap();
        let s1 = limits.socket().unwrap();
        let _c2 = connect(&limits, "10.0.0.2").unwrap();
        assert!(limits.socket().is_none());
        assert_eq!(
            connect(&limits, "10.0.0.3").unwrap_err(),
            "connection_limit"
        );
        drop(s1);
        assert!(limits.socket().is_some());
    }

    #[test]
    fn the_agent_ledger_is_charged_and_a_full_one_refuses() {
        let ledger = ledger(2);
        let limits = InboundLimits::with(ledger.clone(), relaying(100, 100), 16, 100);
        let held = connect(&limits, "10.0.0.1").unwrap();
        let _socket = limits.socket().unwrap();
        assert_eq!(ledger.used(), 2);
        assert!(limits.socket().is_none());
        assert_eq!(
            connect(&limits, "10.0.0.2").unwrap_err(),
            "connection_limit"
        );
        drop(held);
        assert_eq!((ledger.used(), limits.fds_held()), (1, 1));
    }

    #[test]
    fn each_connection_holds_a_unit_of_the_proxied_connections_in_its_senders_share() {
        let relaying = relaying(100, 2);
        let ledger = ledger(1000);
        let limits = InboundLimits::with(ledger.clone(), relaying.clone(), 16, 100);
        // Two addresses of one workload share one key.
        let a = limits.connection(ip("10.0.0.1"), ip("10.0.0.1")).unwrap();
        let _b = limits.connection(ip("10.0.0.2"), ip("10.0.0.1")).unwrap();
        assert_eq!(relaying.used(), 2);
        assert_eq!(
            limits
                .connection(ip("10.0.0.2"), ip("10.0.0.1"))
                .unwrap_err(),
            "connection_budget"
        );
        // Nothing is kept of a refused connection.
        assert_eq!((ledger.used(), limits.fds_held()), (2, 2));
        drop(a);
        assert_eq!(relaying.used(), 1);
        let _c = connect(&limits, "10.0.0.3").unwrap();
    }

    #[test]
    fn a_trim_is_asked_for_once_half_of_the_most_held_is_given_back() {
        let limits = InboundLimits::with(ledger(1000), relaying(100, 100), 16, 100);
        let mut held: Vec<_> = (1..=4)
            .map(|i| connect(&limits, &format!("10.0.0.{i}")).unwrap())
            .collect();
        let socket = limits.socket().unwrap();
        held.pop();
        drop(socket);
        assert!(!limits.trim.asked(), "3 of 5 held");
        held.pop();
        assert!(limits.trim.asked(), "2 of 5 held");
        // Counted again from what is held now.
        held.push(connect(&limits, "10.0.0.5").unwrap());
        held.pop();
        assert!(!limits.trim.asked(), "2 of 3 held");
        held.pop();
        assert!(limits.trim.asked(), "1 of 3 held");
    }

    #[test]
    fn the_default_share_is_a_quarter_of_the_budget() {
        let limits = InboundLimits::new(ledger(4000), relaying(10, 10));
        assert_eq!(limits.fds, 1000);
        assert_eq!(
            InboundLimits::new(ledger(10), relaying(10, 10)).fds,
            MIN_FDS
        );
    }
}
