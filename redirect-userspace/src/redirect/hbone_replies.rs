//! Source addresses kept across nodes, as ztunnel keeps them. The agent sends a Pod's connection to
//! another node from the Pod's own address, and carries a stream it received on to a Pod of this
//! node from the sender's address (another node's Pod), so each Pod sees the other's address, not
//! a node's. Both sockets are bound to an address the node's netns does not own; the answers to
//! them would be forwarded. The `hbone_replies` program, on every Ethernet link of the node, marks
//! those answers, and the rule [`super::pod_routes`] adds delivers marked packets locally.
//!
//! [`ReplyMarker`] keeps the program attached to the node's links; [`HboneSources`] tells it which
//! other nodes' Pods the agent currently sends from.
use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::{Arc, Mutex},
    time::Duration,
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, MapError},
    programs::{SchedClassifier, TcAttachType},
};
use redirect_common::{maps, programs};
use rtnetlink::packet_route::link::{LinkLayerType, LinkMessage};
use tracing::debug;

use super::{RedirectError, attach::program, take_map, tc_links::TcOnLinks};
use crate::lock::Locked;

/// The marker kept on every Ethernet link of the node.
pub(crate) type ReplyMarker = TcOnLinks;

/// Loads `hbone_replies` from the agent's object and takes the map of sources it reads.
pub(super) fn load(
    ebpf: &Arc<Mutex<Ebpf>>,
) -> Result<(ReplyMarker, Arc<HboneSources>), RedirectError> {
    let name = programs::HBONE_REPLIES;
    let mut object = ebpf.locked();
    (program::<SchedClassifier>(&mut object, name)?.load())
        .map_err(|source| RedirectError::Program { name, source })?;
    let v4 = take_map(&mut object, maps::HBONE_SOURCES, HashMap::try_from)?;
    let v6 = take_map(&mut object, maps::HBONE_SOURCES6, HashMap::try_from)?;
    drop(object);
    let marker = TcOnLinks::new(ebpf, name, TcAttachType::Ingress, is_ethernet)?;
    let sources = HboneSources::new(Box::new(KernelSources { v4, v6 }), LINGER);
    Ok((marker, sources))
}

/// A link that carries Ethernet frames (veths, bridges, the uplink, VXLAN): the program reads an
/// Ethernet header. `lo` is not one.
fn is_ethernet(link: &LinkMessage) -> bool {
    link.header.link_layer_type == LinkLayerType::Ether
}

/// The other nodes' Pods the agent sends from, for `hbone_replies`: each held while a stream
/// from it may be carried (an HBONE connection from it is open), counted, since several
/// connections may come from one Pod.
pub(crate) struct HboneSources {
    held: Mutex<Held>,
    /// How long an address stays after its last hold ([`LINGER`]).
    linger: Duration,
}

/// The kernel's map and how many holds each address in it has.
struct Held {
    map: Box<dyn SourceMap>,
    counts: StdHashMap<IpAddr, usize>,
}

/// Where the addresses go: the kernel's map, or a set in tests.
trait SourceMap: Send {
    fn insert(&mut self, ip: IpAddr) -> Result<(), MapError>;
    fn remove(&mut self, ip: IpAddr) -> Result<(), MapError>;
}

/// The kernel's maps, one a family, keyed by the address as the packet carries it.
struct KernelSources {
    v4: HashMap<MapData, u32, u8>,
    v6: HashMap<MapData, [u32; 4], u8>,
}

impl SourceMap for KernelSources {
    fn insert(&mut self, ip: IpAddr) -> Result<(), MapError> {
        match ip {
            IpAddr::V4(v4) => self.v4.insert(key(v4), 1, 0),
            IpAddr::V6(v6) => self.v6.insert(key6(v6), 1, 0),
        }
    }

    fn remove(&mut self, ip: IpAddr) -> Result<(), MapError> {
        match ip {
            IpAddr::V4(v4) => self.v4.remove(&key(v4)),
            IpAddr::V6(v6) => self.v6.remove(&key6(v6)),
        }
    }
}

/// The IPv4 map's key: the address as the packet carries it.
fn key(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// The IPv6 map's key: the address's four words as the packet carries them.
fn key6(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

impl std::fmt::Debug for HboneSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HboneSources").finish_non_exhaustive()
    }
}

impl HboneSources {
    fn new(map: Box<dyn SourceMap>, linger: Duration) -> Arc<Self> {
        Arc::new(HboneSources {
            held: Mutex::new(Held {
                map,
                counts: StdHashMap::new(),
            }),
            linger,
        })
    }

    /// Holds `ip` until the returned guard drops: the answers to sockets bound to it are marked.
    pub(crate) fn hold(self: &Arc<Self>, ip: IpAddr) -> Result<SourceHeld, MapError> {
        let mut held = self.held.locked();
        let Held { map, counts } = &mut *held;
        if !counts.contains_key(&ip) {
            map.insert(ip)?;
        }
        *counts.entry(ip).or_insert(0) += 1;
        Ok(SourceHeld {
            sources: self.clone(),
            ip,
        })
    }

    fn release(&self, ip: IpAddr) {
        let mut held = self.held.locked();
        let Held { map, counts } = &mut *held;
        let Some(count) = counts.get_mut(&ip) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            counts.remove(&ip);
            if let Err(e) = map.remove(ip) {
                debug!(%ip, error = %e, "removing an HBONE source from the kernel's map failed");
            }
        }
    }
}

/// One hold of an address in [`HboneSources`].
#[derive(Debug)]
pub(crate) struct SourceHeld {
    sources: Arc<HboneSources>,
    ip: IpAddr,
}

impl SourceHeld {
    pub(crate) fn ip(&self) -> IpAddr {
        self.ip
    }
}

/// How long an address stays in the map after its last hold: the agent's sockets bound to it
/// may still be closing (FIN_WAIT, LAST_ACK), and the Pod's last packets to them must be brought
/// back too, not forwarded to the sender (which would reset them).
const LINGER: Duration = Duration::from_secs(60);

impl Drop for SourceHeld {
    fn drop(&mut self) {
        let (sources, ip) = (self.sources.clone(), self.ip);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    tokio::time::sleep(sources.linger).await;
                    sources.release(ip);
                });
            }
            Err(_) => sources.release(ip),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeSet,
        sync::{Arc, Mutex},
    };

    use super::*;

    /// The addresses "in the kernel", shared with the test; full after `room` of them.
    #[derive(Clone, Default)]
    struct Set(Arc<Mutex<BTreeSet<IpAddr>>>, usize);

    impl SourceMap for Set {
        fn insert(&mut self, ip: IpAddr) -> Result<(), MapError> {
            let mut set = self.0.locked();
            if set.len() >= self.1 {
                return Err(MapError::OutOfBounds {
                    index: set.len() as u32,
                    max_entries: self.1 as u32,
                });
            }
            set.insert(ip);
            Ok(())
        }

        fn remove(&mut self, ip: IpAddr) -> Result<(), MapError> {
            self.0.locked().remove(&ip);
            Ok(())
        }
    }

    const A1: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 244, 1, 10));
    const A2: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x11));

    #[test]
    fn an_address_stays_in_the_map_while_any_connection_from_it_holds_it() {
        let set = Set(Arc::default(), 8);
        let sources = HboneSources::new(Box::new(set.clone()), Duration::ZERO);
        let first = sources.hold(A1).unwrap();
        let second = sources.hold(A1).unwrap();
        assert_eq!(first.ip(), A1);
        assert!(set.0.locked().contains(&A1));
        drop(first);
        assert!(set.0.locked().contains(&A1), "one hold is left");
        drop(second);
        assert!(set.0.locked().is_empty(), "the last hold took it out");
    }

    #[test]
    fn a_full_map_refuses_the_hold_and_keeps_no_count() {
        let set = Set(Arc::default(), 1);
        let sources = HboneSources::new(Box::new(set.clone()), Duration::ZERO);
        let held = sources.hold(A1).unwrap();
        assert!(sources.hold(A2).is_err());
        drop(held);
        assert!(set.0.locked().is_empty());
        // Room again: A2 is taken now, and counted from zero.
        let again = sources.hold(A2).unwrap();
        assert_eq!(set.0.locked().iter().copied().collect::<Vec<_>>(), [A2]);
        drop(again);
        assert!(set.0.locked().is_empty());
    }

    #[tokio::test]
    async fn an_address_lingers_after_its_last_hold_while_its_sockets_close() {
        const SHORT: Duration = Duration::from_millis(200);
        let set = Set(Arc::default(), 8);
        let sources = HboneSources::new(Box::new(set.clone()), SHORT);
        drop(sources.hold(A1).unwrap());
        tokio::time::sleep(SHORT / 4).await;
        assert!(set.0.locked().contains(&A1), "still closing");
        // Held again meanwhile: the release that lingered leaves it held.
        let again = sources.hold(A1).unwrap();
        tokio::time::sleep(SHORT * 2).await;
        assert!(set.0.locked().contains(&A1));
        drop(again);
        tokio::time::sleep(SHORT * 2).await;
        assert!(set.0.locked().is_empty());
    }

    #[test]
    fn the_key_is_the_address_as_the_packet_carries_it() {
        assert_eq!(
            key(Ipv4Addr::new(10, 244, 1, 10)).to_ne_bytes(),
            [10, 244, 1, 10]
        );
        let words = key6("fd00:10:244:1::11".parse().unwrap());
        assert_eq!(words[0].to_ne_bytes(), [0xfd, 0, 0, 0x10]);
        assert_eq!(words[3].to_ne_bytes(), [0, 0, 0, 0x11]);
    }
}
