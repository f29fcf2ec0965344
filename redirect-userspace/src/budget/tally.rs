//! The arithmetic every per-client budget shares: what each client holds and all of them
//! together, a share no client passes, and a floor each client can always reach.
//!
//! Shares alone do not keep a newcomer in: four clients at a quarter each hold the node's whole
//! limit. So a client holding its floor ([`floor`], a 64th of the node's limit) or more may take
//! another unit only while what stays free covers a floor for one more client and what each other
//! client holding units still lacks of its floor. Below its floor a client takes from that
//! reserve: a fifth client always gets its floor, as many clients as the reserve has floors for.
use std::{collections::HashMap, net::IpAddr};

use super::Refusal;

/// The units a client may always reach, however many the others hold: a 64th of the node's
/// limit, at least one, at most the client's share.
pub(crate) fn floor(node: usize, share: usize) -> usize {
    (node / 64).max(1).min(share)
}

/// What a client holding `held` units lacks of `floor`: nothing for one holding none (it is no
/// client yet; the reserve's own floor stands for it).
fn lacks(held: usize, floor: usize) -> usize {
    match held {
        0 => 0,
        n => floor.saturating_sub(n),
    }
}

/// Units held, by client and in all, with what the clients holding units lack of their floor.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) total: usize,
    /// Only clients holding something have an entry: the map never outgrows what is held.
    pub(super) by_client: HashMap<IpAddr, usize>,
    /// What the clients holding units lack of the floor, together (kept as they take and give
    /// back).
    pub(super) below_floor: usize,
}

/// The limits a [`Tally`] is judged by: the node's, one client's share, the floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bounds {
    pub(super) node: usize,
    pub(super) share: usize,
    pub(super) floor: usize,
}

impl Bounds {
    /// `share` capped at `node`, and the floor that goes with them.
    pub(super) fn new(node: usize, share: usize) -> Bounds {
        let share = share.min(node);
        Bounds {
            node,
            share,
            floor: floor(node, share),
        }
    }
}

impl Tally {
    /// Why `client` may not take one more unit, if it may not.
    pub(super) fn refusal(&self, client: IpAddr, bounds: Bounds) -> Option<Refusal> {
        let mine = self.by_client.get(&client).copied().unwrap_or(0);
        let free = bounds.node.saturating_sub(self.total);
        if mine >= bounds.share {
            Some(Refusal::ClientShare)
        } else if free == 0 {
            Some(Refusal::NodeLimit)
        } else if mine >= bounds.floor && free - 1 < bounds.floor + self.below_floor {
            Some(Refusal::Reserve)
        } else {
            None
        }
    }

    /// Counts one more unit for `client`.
    pub(super) fn hold(&mut self, client: IpAddr, floor: usize) {
        let n = self.by_client.entry(client).or_default();
        self.below_floor = self.below_floor + lacks(*n + 1, floor) - lacks(*n, floor);
        *n += 1;
        self.total += 1;
    }

    /// Counts one unit of `client`'s back.
    pub(super) fn release(&mut self, client: IpAddr, floor: usize) {
        if let Some(n) = self.by_client.get_mut(&client) {
            self.below_floor = self.below_floor + lacks(*n - 1, floor) - lacks(*n, floor);
            *n -= 1;
            if *n == 0 {
                self.by_client.remove(&client);
            }
        }
        self.total = self.total.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(i: usize) -> IpAddr {
        IpAddr::from([10, 0, 0, u8::try_from(i).unwrap()])
    }

    /// Takes units for `client` until refused: how many it got and why it stopped.
    fn take_all(tally: &mut Tally, client: IpAddr, bounds: Bounds) -> (usize, Refusal) {
        let mut got = 0;
        loop {
            if let Some(why) = tally.refusal(client, bounds) {
                return (got, why);
            }
            tally.hold(client, bounds.floor);
            got += 1;
        }
    }

    #[test]
    fn the_floor_is_a_64th_of_the_node_at_least_one_at_most_the_share() {
        assert_eq!(Bounds::new(640, 160).floor, 10);
        assert_eq!(Bounds::new(100, 25).floor, 1);
        assert_eq!(Bounds::new(6_400, 50).floor, 50);
        assert_eq!(
            Bounds::new(10, 100),
            Bounds {
                node: 10,
                share: 10,
                floor: 1
            }
        );
        assert_eq!(Bounds::new(0, 0).floor, 0);
    }

    #[test]
    fn a_client_below_its_floor_is_never_refused_while_the_node_has_room() {
        // Every order of clients filling a small node: below its floor a client is refused only
        // when nothing at all is free.
        let bounds = Bounds::new(256, 64);
        for hogs in 0..=5 {
            let mut tally = Tally::default();
            for i in 0..hogs {
                take_all(&mut tally, ip(i), bounds);
            }
            for newcomer in hogs..hogs + 8 {
                for _ in 0..bounds.floor {
                    let free = bounds.node - tally.total;
                    match tally.refusal(ip(newcomer), bounds) {
                        None => tally.hold(ip(newcomer), bounds.floor),
                        Some(why) => {
                            assert_eq!((free, why), (0, Refusal::NodeLimit), "{hogs} hogs");
                            break;
                        }
                    }
                }
            }
        }
    }
}
