//! A count of things held (connections, forwards), capped per client and for the node, shared out
//! with a floor and a reserve ([`super::tally`]): four clients at their share still leave a fifth
//! its floor.
use std::{
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard},
};

use super::tally::{Bounds, Tally};
use super::{BudgetKind, BudgetMetrics, Refusal};
use crate::lock::Locked;

/// One budget: at most `node` held in all, at most a share by any one client (a pod, by the key
/// `Snapshot::budget_key` gives its addresses), and a floor each client can reach whatever the
/// others hold.
#[derive(Debug)]
pub(crate) struct Share {
    kind: BudgetKind,
    bounds: Bounds,
    held: Mutex<Tally>,
    metrics: Arc<BudgetMetrics>,
    /// Woken each time the last unit held is given back (a drain waits on it).
    emptied: tokio::sync::Notify,
}

impl Share {
    pub(crate) fn new(
        kind: BudgetKind,
        node: usize,
        client: usize,
        metrics: Arc<BudgetMetrics>,
    ) -> Arc<Share> {
        let bounds = Bounds::new(node, client);
        metrics.limits(kind, node, Some(bounds.share));
        metrics.floor(kind, bounds.floor);
        Arc::new(Share {
            kind,
            bounds,
            held: Mutex::new(Tally::default()),
            metrics,
            emptied: tokio::sync::Notify::new(),
        })
    }

    fn held(&self) -> MutexGuard<'_, Tally> {
        // Plain counters: still consistent after a panic elsewhere.
        self.held.locked()
    }

    /// One more for `client`, or the reason it may not have it (counted).
    pub(crate) fn take(self: &Arc<Self>, client: IpAddr) -> Result<Permit, Refusal> {
        let mut held = self.held();
        if let Some(refusal) = held.refusal(client, self.bounds) {
            drop(held);
            self.metrics.refused(self.kind, refusal);
            return Err(refusal);
        }
        held.hold(client, self.bounds.floor);
        self.metrics.used(self.kind, held.total);
        Ok(Permit {
            share: self.clone(),
            client,
        })
    }

    /// Held now, node-wide.
    pub(crate) fn used(&self) -> usize {
        self.held().total
    }

    /// Returns once nothing is held (at once if nothing is).
    pub(crate) async fn until_empty(&self) {
        loop {
            let emptied = self.emptied.notified();
            let mut emptied = std::pin::pin!(emptied);
            // Registered before the check: a give-back between the two still wakes us.
            emptied.as_mut().enable();
            if self.used() == 0 {
                return;
            }
            emptied.await;
        }
    }

    pub(crate) fn node_limit(&self) -> usize {
        self.bounds.node
    }

    fn give_back(&self, client: IpAddr) {
        let mut held = self.held();
        held.release(client, self.bounds.floor);
        self.metrics.used(self.kind, held.total);
        if held.total == 0 {
            drop(held);
            self.emptied.notify_waiters();
        }
    }
}

/// One unit of a [`Share`], given back on drop.
#[derive(Debug)]
pub(crate) struct Permit {
    share: Arc<Share>,
    client: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.share.give_back(self.client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_waits_until_the_last_unit_is_given_back() {
        let share = Share::new(BudgetKind::Connections, 5, 5, Arc::default());
        share.until_empty().await;
        let first = share.take("10.0.0.1".parse().unwrap()).unwrap();
        let second = share.take("10.0.0.2".parse().unwrap()).unwrap();
        let waiting = tokio::spawn({
            let share = share.clone();
            async move { share.until_empty().await }
        });
        drop(first);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "one unit is still held");
        drop(second);
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting)
            .await
            .expect("woken when the last unit went back")
            .unwrap();
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_client_at_its_share_leaves_the_rest_to_others() {
        let metrics = Arc::new(BudgetMetrics::default());
        let share = Share::new(BudgetKind::Connections, 5, 2, metrics.clone());
        let a: Vec<Permit> = (0..2)
            .map(|_| share.take(ip("10.0.0.1")).unwrap())
            .collect();
        assert_eq!(
            share.take(ip("10.0.0.1")).unwrap_err(),
            Refusal::ClientShare
        );
        let b: Vec<Permit> = (0..2)
            .map(|_| share.take(ip("10.0.0.2")).unwrap())
            .collect();
        let c = share.take(ip("10.0.0.3")).unwrap();
        assert_eq!(share.take(ip("10.0.0.4")).unwrap_err(), Refusal::NodeLimit);
        assert_eq!(share.used(), 5);
        drop((a, b, c));
        assert_eq!(share.used(), 0);
        assert!(
            share.held().by_client.is_empty(),
            "no entry outlives its permits"
        );
        let text =
            crate::metrics::encode(&crate::metrics::registry_of(|r| metrics.register(r))).unwrap();
        for line in [
            r#"redirect_budget_refusals_total{budget="connections",reason="client_share"} 1"#,
            r#"redirect_budget_refusals_total{budget="connections",reason="node_limit"} 1"#,
            r#"redirect_budget_used{budget="connections"} 0"#,
            r#"redirect_budget_limit{budget="connections",scope="node"} 5"#,
            r#"redirect_budget_limit{budget="connections",scope="client"} 2"#,
            r#"redirect_budget_limit{budget="connections",scope="floor"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn a_client_share_never_exceeds_the_node_limit() {
        let share = Share::new(
            BudgetKind::DnsForwards,
            1,
            10,
            Arc::new(BudgetMetrics::default()),
        );
        let _one = share.take(ip("10.0.0.1")).unwrap();
        assert_eq!(
            share.take(ip("10.0.0.1")).unwrap_err(),
            Refusal::ClientShare
        );
    }

    /// Takes units for `client` until refused: how many it got and why it stopped.
    fn take_all(share: &Arc<Share>, client: IpAddr, into: &mut Vec<Permit>) -> (usize, Refusal) {
        let mut got = 0;
        loop {
            match share.take(client) {
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
        // An open-files limit of 4,096: 1,792 connections, 448 a client, a floor of 28.
        let metrics = Arc::new(BudgetMetrics::default());
        let share = Share::new(BudgetKind::Connections, 1_792, 448, metrics.clone());
        let floor = 28;
        let mut held = Vec::new();
        let hogs: Vec<_> = (1..=4)
            .map(|i| take_all(&share, ip(&format!("10.0.0.{i}")), &mut held))
            .collect();
        assert_eq!(hogs[0], (448, Refusal::ClientShare));
        assert_eq!(hogs[2], (448, Refusal::ClientShare));
        // The fourth stops where a floor for one more client is still free.
        assert_eq!(hogs[3], (448 - floor, Refusal::Reserve), "{hogs:?}");
        let fifth = take_all(&share, ip("10.0.0.5"), &mut held);
        assert_eq!(fifth, (floor, Refusal::NodeLimit), "{hogs:?}");
        assert_eq!(share.used(), 1_792);
        let sixth = take_all(&share, ip("10.0.0.6"), &mut held);
        assert_eq!(sixth, (0, Refusal::NodeLimit));
        // A unit given back goes to whoever lacks its floor, not to a client above it.
        drop(held.remove(0));
        assert_eq!(share.take(ip("10.0.0.1")).unwrap_err(), Refusal::Reserve);
        let _sixth_again = share.take(ip("10.0.0.6")).unwrap();
        let text =
            crate::metrics::encode(&crate::metrics::registry_of(|r| metrics.register(r))).unwrap();
        for line in [
            r#"redirect_budget_refusals_total{budget="connections",reason="reserve"} 2"#,
            r#"redirect_budget_limit{budget="connections",scope="floor"} 28"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn a_client_below_its_floor_is_never_refused_while_the_node_has_room() {
        let share = Share::new(
            BudgetKind::DnsForwards,
            1_024,
            256,
            Arc::new(BudgetMetrics::default()),
        );
        let mut held = Vec::new();
        for i in 1..=4 {
            take_all(&share, ip(&format!("10.0.1.{i}")), &mut held);
        }
        // Clients come one after another, each taking up to its floor of 16: every one below its
        // floor is served until nothing at all is free.
        let mut served = 0;
        for i in 1..=20 {
            for _ in 0..16 {
                let free = 1_024 - share.used();
                match share.take(ip(&format!("10.0.2.{i}"))) {
                    Ok(p) => {
                        held.push(p);
                        served += 1;
                    }
                    Err(why) => assert_eq!((free, why), (0, Refusal::NodeLimit), "client {i}"),
                }
            }
        }
        assert_eq!(share.used(), 1_024);
        assert_eq!(
            served, 16,
            "the fifth client got its floor, the rest nothing"
        );
    }
}
