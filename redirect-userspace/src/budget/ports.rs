//! Ephemeral ports toward one upstream address. Each upstream connection holds a local port of the
//! node for as long as its four-tuple is in use: while open, and for TIME_WAIT (60 s on Linux) after
//! a close the proxy made first (it passes a client's close on to the upstream as its own). The
//! kernel has only the ephemeral range (28,232 ports by default) for each destination, so one pod
//! making short connections to one endpoint could take them all: then every pod's connection there
//! fails, each failed `connect()` after a scan of the whole range. Counted here per upstream address
//! and per client, a pod at its share is refused at once while the others go on.
//!
//! Each upstream's ports are shared out with a floor and a reserve ([`super::tally`]): a fifth pod
//! always connects, however many ports four others hold.
use std::{
    collections::{HashMap, VecDeque},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use super::tally::{Bounds, Tally};
use super::{BudgetKind, BudgetMetrics, Refusal};
use crate::lock::Locked;

/// How long Linux keeps a connection the node closed first in TIME_WAIT (`TCP_TIMEWAIT_LEN`, fixed).
pub(crate) const TIME_WAIT: Duration = Duration::from_secs(60);

/// The node's ephemeral range when it cannot be read (Linux's default, 32768-60999).
pub(crate) const DEFAULT_EPHEMERAL_PORTS: usize = 28_232;

/// How many ports the kernel's ephemeral range holds in this network namespace.
pub(crate) fn ephemeral_ports() -> std::io::Result<usize> {
    let path = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = std::fs::read_to_string(path)?;
    parse_range(&text).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{path}: expected two port numbers, got {text:?}"),
        )
    })
}

fn parse_range(text: &str) -> Option<usize> {
    let mut ports = text.split_whitespace().map(str::parse::<u16>);
    let (low, high) = (ports.next()?.ok()?, ports.next()?.ok()?);
    (ports.next().is_none() && low <= high).then(|| usize::from(high - low) + 1)
}

/// Ports each upstream address may hold for the proxy (the node's limit), and for any one client
/// of it (its share, and the floor it can always reach).
#[derive(Debug)]
pub(crate) struct UpstreamPorts {
    bounds: Bounds,
    held: Mutex<Held>,
    metrics: Arc<BudgetMetrics>,
}

#[derive(Debug)]
struct Held {
    by_upstream: HashMap<SocketAddr, Upstream>,
    /// Every port held, all upstreams together (the gauge).
    total: usize,
    /// When upstreams with nothing left were last dropped.
    swept: Instant,
}

/// What one upstream address holds: only upstreams holding something have an entry.
#[derive(Debug, Default)]
struct Upstream {
    tally: Tally,
    /// Closed connections still in TIME_WAIT, oldest first: when each ends, and whose it was.
    cooling: VecDeque<(Instant, IpAddr)>,
}

impl Upstream {
    /// Gives back the ports whose TIME_WAIT is over; returns how many.
    fn expire(&mut self, now: Instant, floor: usize) -> usize {
        let mut freed = 0;
        while let Some(&(ends, client)) = self.cooling.front() {
            if ends > now {
                break;
            }
            self.cooling.pop_front();
            self.tally.release(client, floor);
            freed += 1;
        }
        freed
    }
}

impl UpstreamPorts {
    pub(crate) fn new(
        node: usize,
        client: usize,
        metrics: Arc<BudgetMetrics>,
    ) -> Arc<UpstreamPorts> {
        let bounds = Bounds::new(node, client);
        metrics.limits(BudgetKind::UpstreamPorts, node, Some(bounds.share));
        metrics.floor(BudgetKind::UpstreamPorts, bounds.floor);
        Arc::new(UpstreamPorts {
            bounds,
            held: Mutex::new(Held {
                by_upstream: HashMap::new(),
                total: 0,
                swept: Instant::now(),
            }),
            metrics,
        })
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        // Plain counters: still consistent after a panic elsewhere.
        self.held.locked()
    }

    /// A port toward `upstream` for `client`, or the reason it may not have one (counted).
    pub(crate) fn take(
        self: &Arc<Self>,
        client: IpAddr,
        upstream: SocketAddr,
    ) -> Result<PortPermit, Refusal> {
        self.take_at(client, upstream, Instant::now())
    }

    fn take_at(
        self: &Arc<Self>,
        client: IpAddr,
        upstream: SocketAddr,
        now: Instant,
    ) -> Result<PortPermit, Refusal> {
        let mut held = self.held();
        let held = &mut *held;
        // Now and then, upstreams whose every port came back are dropped: the map holds only what
        // is held.
        if now.duration_since(held.swept) >= Duration::from_secs(1) {
            held.swept = now;
            let mut freed = 0;
            let floor = self.bounds.floor;
            held.by_upstream.retain(|_, u| {
                freed += u.expire(now, floor);
                u.tally.total > 0
            });
            held.total = held.total.saturating_sub(freed);
        }
        let entry = held.by_upstream.entry(upstream).or_default();
        held.total = held
            .total
            .saturating_sub(entry.expire(now, self.bounds.floor));
        if let Some(refusal) = entry.tally.refusal(client, self.bounds) {
            if entry.tally.total == 0 {
                held.by_upstream.remove(&upstream);
            }
            self.metrics.used(BudgetKind::UpstreamPorts, held.total);
            self.metrics.refused(BudgetKind::UpstreamPorts, refusal);
            return Err(refusal);
        }
        entry.tally.hold(client, self.bounds.floor);
        held.total += 1;
        self.metrics.used(BudgetKind::UpstreamPorts, held.total);
        Ok(PortPermit {
            ports: self.clone(),
            client,
            upstream,
            closed_first: false,
        })
    }

    fn give_back(&self, client: IpAddr, upstream: SocketAddr, closed_first: bool, now: Instant) {
        let mut held = self.held();
        let Some(entry) = held.by_upstream.get_mut(&upstream) else {
            return;
        };
        if closed_first {
            // The port stays taken until the kernel lets its four-tuple go.
            entry.cooling.push_back((now + TIME_WAIT, client));
            return;
        }
        entry.tally.release(client, self.bounds.floor);
        if entry.tally.total == 0 {
            held.by_upstream.remove(&upstream);
        }
        held.total = held.total.saturating_sub(1);
        self.metrics.used(BudgetKind::UpstreamPorts, held.total);
    }
}

/// One port toward an upstream, given back when dropped: at once, or after TIME_WAIT when the
/// proxy closed the connection first ([`PortPermit::closed_first`]).
#[derive(Debug)]
pub(crate) struct PortPermit {
    ports: Arc<UpstreamPorts>,
    client: IpAddr,
    upstream: SocketAddr,
    closed_first: bool,
}

impl PortPermit {
    /// The proxy sent the first FIN toward the upstream: its port goes to TIME_WAIT on close.
    pub(crate) fn closed_first(&mut self, closed_first: bool) {
        self.closed_first = closed_first;
    }
}

impl Drop for PortPermit {
    fn drop(&mut self) {
        self.ports.give_back(
            self.client,
            self.upstream,
            self.closed_first,
            Instant::now(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_range_is_read_as_the_kernel_writes_it() {
        assert_eq!(parse_range("32768\t60999\n"), Some(28_232));
        assert_eq!(parse_range("40000 40999"), Some(1000));
        for bad in ["", "1", "60999 32768", "1 2 3", "a b", "1 70000"] {
            assert_eq!(parse_range(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_client_at_its_share_toward_one_upstream_leaves_that_upstream_to_others() {
        let metrics = Arc::new(BudgetMetrics::default());
        let ports = UpstreamPorts::new(3, 2, metrics.clone());
        let (a, b, c) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
        let up = addr("198.51.100.1:80");
        let held: Vec<_> = (0..2).map(|_| ports.take(a, up).unwrap()).collect();
        assert_eq!(ports.take(a, up).unwrap_err(), Refusal::ClientShare);
        // Another upstream is another range of four-tuples.
        let _other = ports.take(a, addr("198.51.100.2:80")).unwrap();
        let _b = ports.take(b, up).unwrap();
        assert_eq!(ports.take(c, up).unwrap_err(), Refusal::NodeLimit);
        drop(held);
        let _c = ports.take(c, up).unwrap();
        let text =
            crate::metrics::encode(&crate::metrics::registry_of(|r| metrics.register(r))).unwrap();
        for line in [
            r#"redirect_budget_refusals_total{budget="upstream_ports",reason="client_share"} 1"#,
            r#"redirect_budget_refusals_total{budget="upstream_ports",reason="node_limit"} 1"#,
            r#"redirect_budget_limit{budget="upstream_ports",scope="client"} 2"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    /// Takes ports for `client` until refused; returns how many it got and why it stopped.
    fn take_all(
        ports: &Arc<UpstreamPorts>,
        client: IpAddr,
        up: SocketAddr,
        into: &mut Vec<PortPermit>,
    ) -> (usize, Refusal) {
        let mut got = 0;
        loop {
            match ports.take(client, up) {
                Ok(p) => {
                    into.push(p);
                    got += 1;
                }
                Err(why) => return (got, why),
            }
        }
    }

    #[test]
    fn four_clients_at_their_share_leave_a_fifth_its_floor() {
        let ports = UpstreamPorts::new(640, 160, Arc::new(BudgetMetrics::default()));
        let floor = super::super::tally::floor(640, 160);
        assert_eq!(floor, 10);
        let up = addr("198.51.100.1:80");
        let mut held = Vec::new();
        let hogs: Vec<_> = (1..=4)
            .map(|i| take_all(&ports, ip(&format!("10.0.0.{i}")), up, &mut held))
            .collect();
        assert_eq!(hogs[0], (160, Refusal::ClientShare));
        assert_eq!(hogs[3].1, Refusal::Reserve, "{hogs:?}");
        let fifth = take_all(&ports, ip("10.0.0.5"), up, &mut held);
        assert_eq!(fifth, (floor, Refusal::NodeLimit), "{hogs:?}");
        // A port given back goes to whoever lacks its floor, not to a client above it.
        drop(held.remove(0));
        assert_eq!(
            ports.take(ip("10.0.0.1"), up).unwrap_err(),
            Refusal::Reserve
        );
        let _sixth = ports.take(ip("10.0.0.6"), up).unwrap();
        let held_now = ports.held();
        let entry = &held_now.by_upstream[&up];
        assert_eq!(entry.tally.total, 640);
        assert_eq!(entry.tally.below_floor, floor - 1, "the sixth lacks nine");
    }

    #[test]
    fn what_clients_lack_of_their_floor_is_kept_as_they_take_and_release() {
        let ports = UpstreamPorts::new(640, 160, Arc::new(BudgetMetrics::default()));
        let (a, b, up) = (ip("10.0.0.1"), ip("10.0.0.2"), addr("198.51.100.1:80"));
        let lacking = || {
            ports
                .held()
                .by_upstream
                .get(&up)
                .map_or(0, |u| u.tally.below_floor)
        };
        let mut held: Vec<_> = (0..3).map(|_| ports.take(a, up).unwrap()).collect();
        assert_eq!(lacking(), 7);
        held.extend((0..12).map(|_| ports.take(b, up).unwrap()));
        assert_eq!(lacking(), 7, "b is past its floor");
        held.truncate(3);
        assert_eq!(lacking(), 7, "b holds none: no longer a client");
        held.clear();
        assert_eq!(lacking(), 0);
    }

    #[test]
    fn a_port_closed_first_is_held_for_time_wait_then_given_back() {
        let ports = UpstreamPorts::new(10, 1, Arc::new(BudgetMetrics::default()));
        let (a, up) = (ip("10.0.0.1"), addr("198.51.100.1:80"));
        let start = Instant::now();
        let mut permit = ports.take_at(a, up, start).unwrap();
        permit.closed_first(true);
        drop(permit);
        let later = start + TIME_WAIT - Duration::from_secs(1);
        assert_eq!(
            ports.take_at(a, up, later).unwrap_err(),
            Refusal::ClientShare,
            "still in TIME_WAIT"
        );
        let after = start + TIME_WAIT + Duration::from_secs(1);
        let permit = ports.take_at(a, up, after).unwrap();
        // Closed by the upstream first (or reset): no TIME_WAIT on the node, back at once.
        drop(permit);
        let again = ports.take_at(a, up, after).unwrap();
        drop(again);
        let held = ports.held();
        assert!(held.by_upstream.is_empty() && held.total == 0, "{held:?}");
    }

    #[test]
    fn upstreams_with_nothing_left_are_dropped() {
        let ports = UpstreamPorts::new(10, 5, Arc::new(BudgetMetrics::default()));
        let start = Instant::now();
        for i in 0..100 {
            let mut p = ports
                .take_at(ip("10.0.0.1"), addr(&format!("198.51.100.{i}:80")), start)
                .unwrap();
            p.closed_first(true);
        }
        assert_eq!(ports.held().by_upstream.len(), 100);
        let after = start + TIME_WAIT + Duration::from_secs(2);
        let _p = ports
            .take_at(ip("10.0.0.2"), addr("203.0.113.1:80"), after)
            .unwrap();
        let held = ports.held();
        assert_eq!((held.by_upstream.len(), held.total), (1, 1), "{held:?}");
    }
}
