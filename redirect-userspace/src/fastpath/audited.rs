//! The audit on the kernel's path: the addresses the audit policy sees otherwise, written into
//! `FAST_AUDITED` so that the kernel reports each connection it decides to one (on the ring buffer
//! that carries its hides), and each report made into the audit's own decision. The kernel decides
//! as before, reports cost it one trie lookup, and a connection is never sent to the proxy for it.
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use aya::maps::{LpmTrie, MapData, MapError, lpm_trie::Key};
use ipnet::IpNet;
use redirect_common::fastpath::{
    AUDITED_ENTRIES, AddrKey, HiddenEvent, IpKey, LpmBytes, NS_UNKNOWN,
};
use tracing::{info, warn};

use super::lpm::mask;
use crate::{audit::Audit, state::Pick};

/// `FAST_AUDITED`, and what this agent wrote into it.
pub(crate) struct AuditedMap {
    map: LpmTrie<MapData, LpmBytes, u8>,
    held: BTreeSet<(u32, LpmBytes)>,
}

/// The trie key of `net` in the shared view: its prefix length and masked bytes.
fn key_of(net: &IpNet) -> (u32, LpmBytes) {
    let key = AddrKey {
        ns: NS_UNKNOWN,
        ip: IpKey::new(net.network()),
    };
    let len = 64 + u32::from(net.prefix_len());
    (len, mask(key.lpm_bytes(), len))
}

impl AuditedMap {
    pub(super) fn new(map: LpmTrie<MapData, LpmBytes, u8>) -> AuditedMap {
        AuditedMap {
            map,
            held: BTreeSet::new(),
        }
    }

    /// Makes the trie hold `nets` (the first [`AUDITED_ENTRIES`]), writing what differs. Returns
    /// how many were left out.
    pub(crate) fn set(&mut self, nets: &[IpNet]) -> Result<usize, MapError> {
        let wanted: BTreeSet<(u32, LpmBytes)> = nets
            .iter()
            .map(key_of)
            .take(AUDITED_ENTRIES as usize)
            .collect();
        for (len, bytes) in self.held.difference(&wanted) {
            match self.map.remove(&Key::new(*len, *bytes)) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(e),
            }
        }
        for (len, bytes) in wanted.difference(&self.held) {
            self.map.insert(&Key::new(*len, *bytes), 1, 0)?;
        }
        self.held = wanted;
        Ok(nets.len().saturating_sub(self.held.len()))
    }
}

/// Keeps `FAST_AUDITED` equal to the audit policy in force, until `shutdown` changes.
pub(super) async fn follow(
    mut map: AuditedMap,
    audit: Arc<Audit>,
    mut shutdown: crate::drain::Watcher,
) {
    let mut changes = audit.subscribe();
    loop {
        if let Some(policy) = audit.policy() {
            match map.set(policy.addresses()) {
                Ok(0) => info!(
                    addresses = policy.addresses().len(),
                    "fast path: the kernel reports its decisions on the audited addresses"
                ),
                Ok(left_out) => warn!(
                    left_out,
                    most = AUDITED_ENTRIES,
                    "fast path: more audited addresses than the kernel's table holds; connections to those left out are audited only when the proxy decides them"
                ),
                Err(e) => {
                    warn!(error = %e, "fast path: writing the audited addresses failed; the kernel's decisions are audited as far as they were written")
                }
            }
        }
        tokio::select! {
            () = shutdown.stopped() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

impl super::FastPath {
    /// Audits one decision the kernel reported: the client as the tables in force knew it, and
    /// the service the kernel's decision used (its decisions are `decide_outbound`'s).
    pub(super) fn audit_decision(&self, audit: &Audit, event: &HiddenEvent) {
        let Some((snapshot, pod)) = self.compiled_client(event.cgroup) else {
            return;
        };
        let client_ns = pod.as_ref().map(|w| w.meta.namespace.as_str());
        let dst: (IpAddr, u16) = (event.dst.ip(), event.port);
        let enforced = snapshot.decide_outbound_with(client_ns, dst.0, dst.1, Pick::Peek);
        let client = || {
            pod.as_ref()
                .map(|w| format!("{}/{}", w.meta.namespace, w.meta.name))
        };
        audit.connect(client_ns, client, dst, enforced.service());
    }
}
