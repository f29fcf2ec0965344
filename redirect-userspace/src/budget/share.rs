//! A count of things held (connections, forwards), capped per client and for the node.
use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex, MutexGuard},
};

use super::{BudgetKind, BudgetMetrics, Refusal};
use crate::lock::Locked;

/// One budget: at most `node` held in all, at most `client` by any one client (a pod, by the key
/// `Snapshot::budget_key` gives its addresses). With `client` below `node`, a pod that uses its
/// whole share leaves the rest to others.
#[derive(Debug)]
pub(crate) struct Share {
    kind: BudgetKind,
    node: usize,
    client: usize,
    held: Mutex<Held>,
    metrics: Arc<BudgetMetrics>,
    /// Woken each time the last unit held is given back (a drain waits on it).
    emptied: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// Only clients holding something have an entry: the map never outgrows what is held.
    by_client: HashMap<IpAddr, usize>,
}

impl Share {
    pub(crate) fn new(
        kind: BudgetKind,
        node: usize,
        client: usize,
        metrics: Arc<BudgetMetrics>,
    ) -> Arc<Share> {
        let client = client.min(node);
        metrics.limits(kind, node, Some(client));
        Arc::new(Share {
            kind,
            node,
            client,
            held: Mutex::new(Held::default()),
            metrics,
            emptied: tokio::sync::Notify::new(),
        })
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        // Plain counters: still consistent after a panic elsewhere.
        self.held.locked()
    }

    /// One more for `client`, or the reason it may not have it (counted).
    pub(crate) fn take(self: &Arc<Self>, client: IpAddr) -> Result<Permit, Refusal> {
        let mut held = self.held();
        let refusal = if held.by_client.get(&client).copied().unwrap_or(0) >= self.client {
            Some(Refusal::ClientShare)
        } else if held.total >= self.node {
            Some(Refusal::NodeLimit)
        } else {
            None
        };
        if let Some(refusal) = refusal {
            drop(held);
            self.metrics.refused(self.kind, refusal);
            return Err(refusal);
        }
        *held.by_client.entry(client).or_default() += 1;
        held.total += 1;
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
        self.node
    }

    fn give_back(&self, client: IpAddr) {
        let mut held = self.held();
        if let Some(n) = held.by_client.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                held.by_client.remove(&client);
            }
        }
        held.total = held.total.saturating_sub(1);
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
}
