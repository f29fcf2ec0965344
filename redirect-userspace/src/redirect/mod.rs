//! Loading and attaching the eBPF programs, and reading what they record.
//!
//! [`Redirector`] owns the loaded object: while it lives the programs steer the cgroup's traffic to the
//! agent; dropping it (or the process dying) closes the links and the kernel detaches everything.
mod cgroup;
pub mod features;
mod gateway;
mod netns;

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    os::fd::AsFd,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, MapError, PerCpuArray},
    programs::{CgroupAttachMode, CgroupSockAddr, ProgramError, SockOps},
};
use redirect_common::{OrigDst, SockAddr, Stat, globals, maps, programs};

pub use cgroup::{CgroupError, cgroup2_mount_points, check_attachable};
pub use features::MissingFeatures;
pub use gateway::{GatewayError, Gateways};
pub use netns::NetnsError;

/// The eBPF object, embedded by build.rs (empty when built without `cargo xtask build`).
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirect.bpf.o"));

/// On kernels >= 5.7 aya attaches with a bpf_link, which always coexists with other programs on the
/// hierarchy (systemd, the CNI) and takes no flags: passing ALLOW_MULTI there is EINVAL.
const ATTACH_MODE: CgroupAttachMode = CgroupAttachMode::Single;

/// What the programs need to know, fixed at load time.
#[derive(Debug, Clone)]
pub struct RedirectConfig {
    /// cgroup v2 directory whose processes (the pods) are steered; never the hierarchy's root.
    pub cgroup: PathBuf,
    /// Addresses of the agent that every pod reaches on its own link, one per family at most.
    pub gateway: Gateways,
    pub proxy_port: u16,
    /// Port of the DNS proxy; `None` leaves DNS traffic alone.
    pub dns_proxy_port: Option<u16>,
}

#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
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
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
}

/// The loaded and attached programs. Dropping it detaches them; the maps stay readable through
/// [`RedirectMaps`] for connections already accepted.
pub struct Redirector {
    maps: Arc<RedirectMaps>,
    _ebpf: Ebpf,
}

/// The maps the agent reads: shared by every connection task and the metrics collector.
pub struct RedirectMaps {
    flows: HashMap<MapData, SockAddr, OrigDst>,
    stats: PerCpuArray<MapData, u64>,
    /// The pod cgroups the programs leave alone, and our copy of what the map holds.
    opted_out: Mutex<(HashMap<MapData, u64, u8>, BTreeSet<u64>)>,
}

impl Redirector {
    /// Loads the programs and attaches them to `config.cgroup`.
    pub fn attach(config: &RedirectConfig) -> Result<Self, RedirectError> {
        if EBPF_OBJECT.is_empty() {
            return Err(RedirectError::NoObject);
        }
        let cgroup = check_attachable(&config.cgroup)?;
        features::check()?;
        let gateway_v4 = config.gateway.v4_be();
        let gateway_v6 = config.gateway.v6_words();
        let dns_port = config.dns_proxy_port.unwrap_or(0);
        let node_netns = netns::node_cookie(EBPF_OBJECT, &config.cgroup)?;
        let mut ebpf = EbpfLoader::new()
            .override_global(globals::NODE_NETNS_COOKIE, &node_netns, true)
            .override_global(globals::GATEWAY_V4, &gateway_v4, true)
            .override_global(globals::GATEWAY_V6, &gateway_v6, true)
            .override_global(globals::PROXY_PORT, &config.proxy_port, true)
            .override_global(globals::DNS_PROXY_PORT, &dns_port, true)
            .load(EBPF_OBJECT)?;

        for name in [
            programs::CONNECT4,
            programs::SENDMSG4,
            programs::RECVMSG4,
            programs::GETPEERNAME4,
            programs::CONNECT6,
            programs::SENDMSG6,
            programs::RECVMSG6,
            programs::GETPEERNAME6,
        ] {
            let program: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            program.load().map_err(|source| load_error(name, source))?;
            program
                .attach(cgroup.as_fd(), ATTACH_MODE)
                .map_err(|source| RedirectError::Program { name, source })?;
        }
        let sock_ops: &mut SockOps = program(&mut ebpf, programs::SOCK_OPS)?;
        let name = programs::SOCK_OPS;
        sock_ops.load().map_err(|source| load_error(name, source))?;
        sock_ops
            .attach(cgroup.as_fd(), ATTACH_MODE)
            .map_err(|source| RedirectError::Program { name, source })?;

        let flows = take_map(&mut ebpf, maps::FLOW_ORIG_DST, HashMap::try_from)?;
        let stats = take_map(&mut ebpf, maps::STATS, PerCpuArray::try_from)?;
        let opted_out = take_map(&mut ebpf, maps::OPTED_OUT_CGROUPS, HashMap::try_from)?;
        tracing::info!(
            cgroup = %config.cgroup.display(),
            gateway = %config.gateway,
            proxy_port = config.proxy_port,
            dns_proxy_port = dns_port,
            "eBPF programs attached"
        );
        Ok(Self {
            maps: Arc::new(RedirectMaps {
                flows,
                stats,
                opted_out: Mutex::new((opted_out, BTreeSet::new())),
            }),
            _ebpf: ebpf,
        })
    }

    pub fn maps(&self) -> Arc<RedirectMaps> {
        self.maps.clone()
    }
}

impl RedirectMaps {
    /// Where the client at `client` (the peer of an accepted connection) meant to go.
    ///
    /// sock_ops filed it before the client's SYN left, so it is there by the time accept() returns.
    /// Entries are not removed: the map is LRU and the next connection from the same ip:port
    /// overwrites its entry before its own SYN. An IPv4 client and its v4-mapped form are one key.
    pub fn original_destination(&self, client: SocketAddr) -> Result<Option<OrigDst>, MapError> {
        let key = SockAddr::from_socket_addr(client);
        match self.flows.get(&key, 0) {
            Ok(orig) => Ok(Some(orig)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Makes `want` the set of pod cgroups the programs leave alone; returns the ids it added and
    /// removed. On an error the map holds part of the change and the next call completes it.
    pub fn set_opted_out(&self, want: &BTreeSet<u64>) -> Result<(Vec<u64>, Vec<u64>), MapError> {
        let mut guard = self.opted_out.lock().unwrap_or_else(|p| p.into_inner());
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
    pub fn event_counts(&self) -> Vec<(Stat, u64)> {
        Stat::ALL
            .iter()
            .map(|&stat| {
                let total = self
                    .stats
                    .get(&(stat as u32), 0)
                    .map(|per_cpu| per_cpu.iter().sum())
                    .unwrap_or(0);
                (stat, total)
            })
            .collect()
    }
}

/// A program the verifier refused: the last line of its log says why; the whole log goes to debug.
fn load_error(name: &'static str, source: ProgramError) -> RedirectError {
    let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &source
    else {
        return RedirectError::Program { name, source };
    };
    let log = verifier_log.to_string();
    tracing::debug!(program = name, verifier_log = %log, "verifier output");
    let reason = log
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| {
            !l.is_empty() && !l.starts_with("processed ") && !l.starts_with("verification time")
        })
        .map_or_else(|| io_error.to_string(), str::to_string);
    RedirectError::Refused {
        name,
        release: features::kernel_release(),
        reason,
    }
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, RedirectError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let program = ebpf
        .program_mut(name)
        .ok_or(RedirectError::MissingProgram { name })?;
    program
        .try_into()
        .map_err(|source| RedirectError::Program { name, source })
}

fn take_map<T>(
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
