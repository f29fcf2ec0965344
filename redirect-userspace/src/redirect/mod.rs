//! Loading and attaching the eBPF programs, and reading what they record.
//!
//! [`Redirector`] owns the loaded object. Without a pin directory its links live with it: dropping it
//! (or the process dying) detaches everything. With one (`pins`), the links and maps are pinned: they
//! outlive the process, a successor swaps its programs into the same links, and only
//! [`Redirector::release`] by the last agent detaches them.
use crate::lock::Locked;
mod attach;
pub(crate) mod bpffs;
mod cgroup;
pub(crate) mod counters;
pub(crate) mod features;
mod gateway;
pub(crate) mod hbone_replies;
mod held;
pub(crate) mod inbound;
mod netns;
pub(crate) mod pins;
pub(crate) mod pod_routes;
pub(crate) mod sock_destroy;
pub(crate) mod tc_links;

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, MapError, PerCpuArray},
    programs::ProgramError,
};
use redirect_common::{OrigDst, SockAddr, Stat, globals, maps};

pub use cgroup::cgroup2_mount_points;
pub(crate) use cgroup::{CgroupError, check_attachable};
pub(crate) use features::MissingFeatures;
pub(crate) use gateway::Gateways;
pub(crate) use held::HeldLinks;
pub(crate) use netns::NetnsError;
pub(crate) use pins::PinError;

/// The maps a successor must find as they were: pinned when a pin directory is given.
/// The fast path's counters among them: a successor's programs count on where the predecessor's
/// left off.
/// The agent's own dials to guarded Pods among them: a predecessor's `inbound` programs let a
/// successor's through during a hand-over.
const PINNED_MAPS: [&str; 7] = [
    maps::SOCKET_ORIG_DST,
    maps::FLOW_ORIG_DST,
    maps::SUBFLOW_ORIG_DST,
    maps::OPTED_OUT_CGROUPS,
    maps::STATS,
    maps::FAST_STATS,
    maps::NODE_DIALS,
];

/// The eBPF object, embedded by build.rs (empty when built without `cargo xtask build`).
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirect.bpf.o"));

/// What the programs need to know, fixed at load time.
#[derive(Debug, Clone)]
pub(crate) struct RedirectConfig {
    /// cgroup v2 directory whose processes (the pods) are steered; never the hierarchy's root.
    pub cgroup: PathBuf,
    /// Addresses of the agent that every pod reaches on its own link, one per family at most.
    pub gateway: Gateways,
    pub proxy_port: u16,
    /// Port of the DNS proxy; `None` leaves DNS traffic alone.
    pub dns_proxy_port: Option<u16>,
    /// bpffs directory for the links and maps; `None` ties them to this process (no hand-over).
    pub pin_dir: Option<PathBuf>,
}

/// How the programs came to be attached.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Start {
    /// Links tied to this process, nothing pinned.
    Unpinned,
    /// Nothing was pinned: this agent attached and pinned everything.
    Fresh,
    /// Pinned state of this layout was found: its maps are used and its links now run this agent's
    /// programs, swapped in place (no moment without a program, none with two).
    Adopted,
    /// Pinned state of a layout this agent does not know was found: it was detached and removed,
    /// then everything attached anew. For `window` pods were not steered.
    Replaced { found: String, window: Duration },
    /// Pinned state of this layout was found whose links steer none of this agent's pods (severed
    /// when their cgroup was removed, or attached to another cgroup): they were unpinned with the
    /// maps they share, then everything attached anew. No pod of this agent's cgroup was steered by
    /// them, so none lost its steering.
    Reattached { found: String },
}

/// What [`Redirector::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    /// This agent's programs were the attached ones: they are detached and the pins removed.
    Detached,
    /// Another agent's programs run in the links now: nothing was touched.
    Superseded,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum RedirectError {
    #[error("this binary was built without its eBPF object; build it with `cargo xtask build`")]
    NoObject,
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Kernel(#[from] MissingFeatures),
    #[error(
        "cannot tell the node's network namespace from the pods' (hostNetwork pods would be steered): {0}"
    )]
    NodeNetns(#[from] NetnsError),
    #[error(
        "kernel {release} refused program {name}: {reason} (the agent supports Linux {}.{} and newer; the verifier's full output is logged at debug level)",
        features::OLDEST_SUPPORTED.0,
        features::OLDEST_SUPPORTED.1
    )]
    Refused {
        name: &'static str,
        release: String,
        reason: String,
    },
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name} is missing from the eBPF object")]
    MissingProgram { name: &'static str },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error(transparent)]
    Pin(#[from] PinError),
    #[error("pinned link {path}: {source}")]
    Link {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a netlink socket: {0}")]
    Netlink(#[source] std::io::Error),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
}

/// The loaded and attached programs. Dropping it detaches them; the maps stay readable through
/// [`RedirectMaps`] for connections already accepted.
pub(crate) struct Redirector {
    /// The pinned links, held open by this process, and this agent's programs for them.
    held: Option<Arc<HeldLinks>>,
    maps: Arc<RedirectMaps>,
    start: Start,
    pinned: Option<Pinned>,
    /// The loaded object: its links live with it, and `hbone_replies` is loaded from it later.
    ebpf: Arc<Mutex<Ebpf>>,
}

/// Where this agent's links are pinned and which program it put in each.
struct Pinned {
    dir: PathBuf,
    programs: Vec<(&'static str, u32)>,
}

/// The maps the agent reads: shared by every connection task and the metrics collector.
pub(crate) struct RedirectMaps {
    /// Locked for a read and its removal: removing needs the map mutably.
    flows: Mutex<HashMap<MapData, SockAddr, OrigDst>>,
    stats: PerCpuArray<MapData, u64>,
    /// The pod cgroups the programs leave alone, and our copy of what the map holds.
    opted_out: Mutex<(HashMap<MapData, u64, u8>, BTreeSet<u64>)>,
}

impl Redirector {
    /// Loads the programs and attaches them to `config.cgroup` (or swaps them into a
    /// predecessor's links); `before_attach` is given the loaded object first, to take and fill
    /// the maps it owns.
    pub(crate) fn attach(
        config: &RedirectConfig,
        before_attach: impl FnOnce(&mut Ebpf) -> Result<(), RedirectError>,
    ) -> Result<Self, RedirectError> {
        if EBPF_OBJECT.is_empty() {
            return Err(RedirectError::NoObject);
        }
        let cgroup = check_attachable(&config.cgroup)?;
        features::check()?;
        let gateway_v4 = config.gateway.v4_be();
        let gateway_v6 = config.gateway.v6_words();
        let dns_port = config.dns_proxy_port.unwrap_or(0);
        let node_netns = netns::node_cookie(EBPF_OBJECT, &config.cgroup)?;
        // Locked from here to the end of this function: an exiting agent waits for us, and we for it.
        let pin_dir = config
            .pin_dir
            .as_deref()
            .map(pins::PinDir::lock)
            .transpose()?;
        let cgroup_id = pins::cgroup_id(&cgroup).map_err(|source| CgroupError::Open {
            path: config.cgroup.clone(),
            source,
        })?;
        let (start, unknown_since) =
            attach::found_start(pin_dir.as_ref(), &cgroup, cgroup_id, &config.cgroup)?;
        attach::raise_memlock_limit();
        let mut loader = EbpfLoader::new();
        loader
            .override_global(globals::NODE_NETNS_COOKIE, &node_netns, true)
            .override_global(globals::GATEWAY_V4, &gateway_v4, true)
            .override_global(globals::GATEWAY_V6, &gateway_v6, true)
            .override_global(globals::PROXY_PORT, &config.proxy_port, true)
            .override_global(globals::DNS_PROXY_PORT, &dns_port, true);
        if let Some(dir) = &pin_dir {
            for name in PINNED_MAPS {
                loader.map_pin_path(name, dir.map_path(name));
            }
        }
        let mut ebpf = loader.load(EBPF_OBJECT)?;
        // What the caller fills before any program runs (the fast path's first tables): the
        // kernel decides from the first connection.
        before_attach(&mut ebpf)?;

        // From the first link on, a failure detaches what this call attached (a predecessor's
        // links, updated in place, are left to the predecessor to take back).
        let mut undo = attach::Undo {
            dir: pin_dir.as_ref().filter(|_| start != Start::Adopted),
        };
        let (attached, program_fds) = attach::attach_all(&mut ebpf, &cgroup, pin_dir.as_ref())?;
        let start = match (start, unknown_since) {
            (Start::Replaced { found, .. }, Some(since)) => {
                let window = since.elapsed();
                tracing::warn!(%found, window_ms = window.as_millis() as u64, "took over from pinned state of an unknown layout: pods were not steered for this long");
                Start::Replaced { found, window }
            }
            (start, _) => start,
        };
        if let Some(dir) = &pin_dir
            && start != Start::Adopted
        {
            dir.write_layout()?;
        }
        // This process holds every link too: a pin lost with its bpf filesystem detaches nothing.
        let held_links = match &pin_dir {
            Some(dir) => Some(Arc::new(HeldLinks::open(dir, &attached, program_fds)?)),
            None => None,
        };
        undo.dir = None;
        drop(undo);
        let pinned = pin_dir.map(|dir| Pinned {
            dir: dir.path().to_path_buf(),
            programs: attached,
        });

        let flows = take_map(&mut ebpf, maps::FLOW_ORIG_DST, HashMap::try_from)?;
        let stats = take_map(&mut ebpf, maps::STATS, PerCpuArray::try_from)?;
        let opted_out: HashMap<MapData, u64, u8> =
            take_map(&mut ebpf, maps::OPTED_OUT_CGROUPS, HashMap::try_from)?;
        // A predecessor's opt-outs are in the adopted map: know them, so a later sync can remove them.
        let held: BTreeSet<u64> = opted_out.keys().flatten().collect();
        tracing::info!(
            cgroup = %config.cgroup.display(),
            start = ?start,
            gateway = %config.gateway,
            proxy_port = config.proxy_port,
            dns_proxy_port = dns_port,
            "eBPF programs attached"
        );
        Ok(Self {
            held: held_links,
            maps: Arc::new(RedirectMaps {
                flows: Mutex::new(flows),
                stats,
                opted_out: Mutex::new((opted_out, held)),
            }),
            start,
            pinned,
            ebpf: Arc::new(Mutex::new(ebpf)),
        })
    }

    pub(crate) fn maps(&self) -> Arc<RedirectMaps> {
        self.maps.clone()
    }

    /// Loads `hbone_replies` (HBONE between nodes): the marker to attach to the node's links, and
    /// the sources it reads.
    pub(crate) fn hbone_replies(
        &self,
    ) -> Result<(hbone_replies::ReplyMarker, Arc<hbone_replies::HboneSources>), RedirectError> {
        hbone_replies::load(&self.ebpf)
    }

    /// Loads `inbound` (inbound authorization in the kernel): the gate to attach in each guarded
    /// Pod's namespace, its counters and refusals, and the agent's dials it lets through.
    pub(crate) fn inbound(&self) -> Result<inbound::Loaded, RedirectError> {
        inbound::load(&self.ebpf)
    }

    pub(crate) fn start(&self) -> &Start {
        &self.start
    }

    /// The pinned links this agent holds open (`None` without a pin directory: then the links
    /// live with the loaded programs anyway).
    pub(crate) fn held_links(&self) -> Option<Arc<HeldLinks>> {
        self.held.clone()
    }

    /// The agent is leaving for good. If its programs are the attached ones, detaches them and removes
    /// every pin (the uninstall path); if a successor's are, touches nothing. Unpinned links go with
    /// `self`.
    pub(crate) fn release(self) -> Result<Release, RedirectError> {
        let Some(pinned) = &self.pinned else {
            return Ok(Release::Detached);
        };
        // The pins went with their bpf filesystem: the links this agent holds are the only way to
        // them left. Detach them if they still run our programs.
        if let Some(held) = &self.held
            && held.pins_gone()
        {
            return Ok(match held.detach_if_ours() {
                true => Release::Detached,
                false => Release::Superseded,
            });
        }
        // A successor that left for good already removed everything.
        if !pinned.dir.exists() {
            return Ok(Release::Superseded);
        }
        let dir = pins::PinDir::lock(&pinned.dir)?;
        if !held::owns(&dir, pinned) {
            return Ok(Release::Superseded);
        }
        let detached = dir.remove()?;
        tracing::info!(links = detached, dir = %pinned.dir.display(), "detached the pinned programs and removed the pins");
        Ok(Release::Detached)
    }
}

/// Where each steered connection meant to go, as the kernel filed it under the client's address and
/// port: the agent's maps, or a table a test fills.
pub(crate) trait Flows: Send + Sync + std::fmt::Debug {
    /// The entry for the connection from `client`, taken out (read once; see
    /// [`RedirectMaps::take_original_destination`]).
    fn take(&self, client: SocketAddr) -> Result<Option<OrigDst>, MapError>;
    /// Drops the entry of a connection refused before it was read.
    fn forget(&self, client: SocketAddr);
}

/// Flows as a test files them: what sock_ops would have filed for a connection from an address.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct FiledFlows(Mutex<std::collections::HashMap<SocketAddr, OrigDst>>);

#[cfg(test)]
impl FiledFlows {
    /// Files `orig` for the connection from `client`, as the programs would.
    pub(crate) fn file(&self, client: SocketAddr, orig: OrigDst) {
        let mut flows = self.0.locked();
        flows.insert(client, orig);
    }
}

#[cfg(test)]
impl Flows for FiledFlows {
    fn take(&self, client: SocketAddr) -> Result<Option<OrigDst>, MapError> {
        let mut flows = self.0.locked();
        Ok(flows.remove(&client))
    }

    fn forget(&self, client: SocketAddr) {
        let mut flows = self.0.locked();
        flows.remove(&client);
    }
}

impl Flows for RedirectMaps {
    fn take(&self, client: SocketAddr) -> Result<Option<OrigDst>, MapError> {
        self.take_original_destination(client)
    }

    fn forget(&self, client: SocketAddr) {
        self.forget_flow(client);
    }
}

impl RedirectMaps {
    /// Where the client at `client` (the peer of an accepted connection) meant to go, taken out of
    /// the map: an entry belongs to the one connection that filed it and is read once.
    ///
    /// sock_ops filed it before the client's last ACK left, so it is there by the time accept()
    /// returns.
    /// Left in the map, it would be there for whoever comes next from the same ip:port without a
    /// steered connect() of its own: a pod on a recycled address, connecting to the proxy's port
    /// itself from the port an earlier pod used, would be served that pod's destination. An IPv4
    /// client and its v4-mapped form are one key.
    pub(crate) fn take_original_destination(
        &self,
        client: SocketAddr,
    ) -> Result<Option<OrigDst>, MapError> {
        let key = SockAddr::from_socket_addr(client);
        let mut flows = self.flows.locked();
        let orig = match flows.get(&key, 0) {
            Ok(orig) => orig,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e),
        };
        match flows.remove(&key) {
            // Gone already: another reader took it between the two calls (cannot happen with
            // one accept per connection, but then the entry is still this connection's).
            Ok(()) | Err(MapError::KeyNotFound) => Ok(Some(orig)),
            Err(e) => Err(e),
        }
    }

    /// Drops the entry a refused connection filed (it is never read).
    pub(crate) fn forget_flow(&self, client: SocketAddr) {
        let key = SockAddr::from_socket_addr(client);
        let mut flows = self.flows.locked();
        let _ = flows.remove(&key);
    }

    /// Makes `want` the set of pod cgroups the programs leave alone; returns the ids it added and
    /// removed. On an error the map holds part of the change and the next call completes it.
    pub(crate) fn set_opted_out(
        &self,
        want: &BTreeSet<u64>,
    ) -> Result<(Vec<u64>, Vec<u64>), MapError> {
        let mut guard = self.opted_out.locked();
        let (map, held) = &mut *guard;
        let added: Vec<u64> = want.difference(held).copied().collect();
        let removed: Vec<u64> = held.difference(want).copied().collect();
        for id in &added {
            map.insert(id, 1, 0)?;
            held.insert(*id);
        }
        for id in &removed {
            match map.remove(id) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(e),
            }
            held.remove(id);
        }
        Ok((added, removed))
    }

    /// Totals of the programs' per-CPU counters.
    pub(crate) fn event_counts(&self) -> Vec<(Stat, u64)> {
        per_cpu_totals(&self.stats, &Stat::ALL, |stat| stat as u32)
    }
}

/// Each counter of `all` summed over the CPUs of a per-CPU array indexed by `index`; a slot that
/// cannot be read counts as zero (the counters are for display, never for decisions).
pub(crate) fn per_cpu_totals<S: Copy>(
    map: &PerCpuArray<MapData, u64>,
    all: &[S],
    index: impl Fn(S) -> u32,
) -> Vec<(S, u64)> {
    all.iter()
        .map(|&stat| {
            let total = map
                .get(&index(stat), 0)
                .map(|per_cpu| per_cpu.iter().sum())
                .unwrap_or(0);
            (stat, total)
        })
        .collect()
}

pub(crate) fn take_map<T>(
    ebpf: &mut Ebpf,
    name: &'static str,
    convert: impl FnOnce(aya::maps::Map) -> Result<T, MapError>,
) -> Result<T, RedirectError> {
    let map = ebpf.take_map(name).ok_or(RedirectError::Map {
        name,
        source: MapError::InvalidName {
            name: name.to_string(),
        },
    })?;
    convert(map).map_err(|source| RedirectError::Map { name, source })
}

impl std::fmt::Debug for RedirectMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedirectMaps").finish_non_exhaustive()
    }
}
