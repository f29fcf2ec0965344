//! Loading and attaching the eBPF programs, and reading what they record.
//!
//! [`Redirector`] owns the loaded object. Without a pin directory its links live with it: dropping it
//! (or the process dying) detaches everything. With one (`pins`), the links and maps are pinned: they
//! outlive the process, a successor swaps its programs into the same links, and only
//! [`Redirector::release`] by the last agent detaches them.
use crate::lock::Locked;
pub mod bpffs;
mod cgroup;
pub mod counters;
pub mod features;
mod gateway;
mod netns;
pub mod pins;

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, MapError, PerCpuArray},
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, ProgramFd, ProgramInfo, SockOps,
        cgroup_sock_addr::CgroupSockAddrLinkId,
        links::{FdLink, LinkError},
        sock_ops::SockOpsLinkId,
    },
};
use redirect_common::{OrigDst, SockAddr, Stat, globals, maps, programs};

pub use cgroup::{CgroupError, cgroup2_mount_points, check_attachable};
pub use features::MissingFeatures;
pub use gateway::Gateways;
pub use netns::NetnsError;
pub use pins::{Found, PinError};

/// The maps a successor must find as they were: pinned when a pin directory is given.
/// The fast path's counters among them: a successor's programs count on where the predecessor's
/// left off.
const PINNED_MAPS: [&str; 6] = [
    maps::SOCKET_ORIG_DST,
    maps::FLOW_ORIG_DST,
    maps::SUBFLOW_ORIG_DST,
    maps::OPTED_OUT_CGROUPS,
    maps::STATS,
    maps::FAST_STATS,
];

/// The cgroup/sock_addr programs; sock_ops comes after them.
const SOCK_ADDR_PROGRAMS: [&str; 8] = [
    programs::CONNECT4,
    programs::SENDMSG4,
    programs::RECVMSG4,
    programs::GETPEERNAME4,
    programs::CONNECT6,
    programs::SENDMSG6,
    programs::RECVMSG6,
    programs::GETPEERNAME6,
];

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
    /// bpffs directory for the links and maps; `None` ties them to this process (no hand-over).
    pub pin_dir: Option<PathBuf>,
}

/// How the programs came to be attached.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
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
pub enum Release {
    /// This agent's programs were the attached ones: they are detached and the pins removed.
    Detached,
    /// Another agent's programs run in the links now: nothing was touched.
    Superseded,
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
    #[error(transparent)]
    Pin(#[from] PinError),
    #[error("pinned link {path}: {source}")]
    Link {
        path: PathBuf,
        #[source]
        source: std::io::Error,
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
    /// The pinned links, held open by this process, and this agent's programs for them.
    held: Option<Arc<HeldLinks>>,
    maps: Arc<RedirectMaps>,
    start: Start,
    pinned: Option<Pinned>,
    _ebpf: Ebpf,
}

/// Where this agent's links are pinned and which program it put in each.
struct Pinned {
    dir: PathBuf,
    programs: Vec<(&'static str, u32)>,
}

/// The maps the agent reads: shared by every connection task and the metrics collector.
pub struct RedirectMaps {
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
    pub fn attach(
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
        let (start, unknown_since) = match &pin_dir {
            None => (Start::Unpinned, None),
            Some(dir) => match dir.found() {
                Found::Empty => (Start::Fresh, None),
                Found::Ours => {
                    let unadoptable = unadoptable_links(dir, &cgroup, cgroup_id)?;
                    if unadoptable.is_empty() {
                        (Start::Adopted, None)
                    } else {
                        let found = describe_unadoptable(&unadoptable);
                        tracing::warn!(dir = %dir.path().display(), cgroup = %config.cgroup.display(), cgroup_id, %found, "pinned links that steer none of this agent's pods cannot be adopted; unpinning them with the maps they share and attaching anew");
                        dir.clear_for(cgroup_id)?;
                        (Start::Reattached { found }, None)
                    }
                }
                Found::Unknown(found) => {
                    tracing::warn!(dir = %dir.path().display(), %found, "refusing to adopt pinned state of an unknown layout; detaching it and attaching anew (pods are not steered until then)");
                    let since = Instant::now();
                    dir.clear()?;
                    (
                        Start::Replaced {
                            found,
                            window: Duration::ZERO,
                        },
                        Some(since),
                    )
                }
            },
        };
        raise_memlock_limit();
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
        let mut undo = Undo {
            dir: pin_dir.as_ref().filter(|_| start != Start::Adopted),
        };
        let mut attached = Vec::new();
        let mut program_fds = Vec::new();
        for name in SOCK_ADDR_PROGRAMS {
            let sock_addr: &mut CgroupSockAddr = program(&mut ebpf, name)?;
            let (prog_id, fd) = load_and_attach(sock_addr, name, cgroup.as_fd(), pin_dir.as_ref())?;
            attached.push((name, prog_id));
            program_fds.push(fd);
        }
        let name = programs::SOCK_OPS;
        let sock_ops: &mut SockOps = program(&mut ebpf, name)?;
        let (prog_id, fd) = load_and_attach(sock_ops, name, cgroup.as_fd(), pin_dir.as_ref())?;
        attached.push((name, prog_id));
        program_fds.push(fd);
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
            _ebpf: ebpf,
        })
    }

    pub fn maps(&self) -> Arc<RedirectMaps> {
        self.maps.clone()
    }

    pub fn start(&self) -> &Start {
        &self.start
    }

    /// The pinned links this agent holds open (`None` without a pin directory: then the links
    /// live with the loaded programs anyway).
    pub fn held_links(&self) -> Option<Arc<HeldLinks>> {
        self.held.clone()
    }

    /// The agent is leaving for good. If its programs are the attached ones, detaches them and removes
    /// every pin (the uninstall path); if a successor's are, touches nothing. Unpinned links go with
    /// `self`.
    pub fn release(self) -> Result<Release, RedirectError> {
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
        if !owns(&dir, pinned) {
            return Ok(Release::Superseded);
        }
        let detached = dir.remove()?;
        tracing::info!(links = detached, dir = %pinned.dir.display(), "detached the pinned programs and removed the pins");
        Ok(Release::Detached)
    }
}

/// Detaches what a failed [`Redirector::attach`] attached and pinned, when dropped armed.
struct Undo<'a> {
    dir: Option<&'a pins::PinDir>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            match dir.clear() {
                Ok(links) => {
                    tracing::warn!(links, dir = %dir.path().display(), "attaching failed part way; detached what was attached")
                }
                Err(e) => {
                    tracing::warn!(error = %e, dir = %dir.path().display(), "attaching failed part way, and detaching what was attached failed too")
                }
            }
        }
    }
}

/// The pinned links, opened and held by this process, each with the program this agent put in it.
///
/// Held, a link stays attached while this agent runs even when its pin goes (the bpf filesystem
/// unmounted under the agent); and the agent can put its own program back in a link a successor
/// updated and then died before it said it was ready.
pub struct HeldLinks {
    dir: PathBuf,
    links: Vec<(&'static str, pins::PinnedLink, u32, OwnedFd)>,
    /// The pins were found gone once (said once).
    lost: std::sync::atomic::AtomicBool,
}

impl HeldLinks {
    fn open(
        dir: &pins::PinDir,
        attached: &[(&'static str, u32)],
        programs: Vec<OwnedFd>,
    ) -> Result<HeldLinks, RedirectError> {
        let mut links = Vec::new();
        for ((name, prog_id), program) in attached.iter().zip(programs) {
            let link_err = |source| RedirectError::Link {
                path: dir.link_path(name),
                source,
            };
            let link = dir
                .link(name)
                .map_err(link_err)?
                .ok_or_else(|| link_err(std::io::ErrorKind::NotFound.into()))?;
            links.push((*name, link, *prog_id, program));
        }
        Ok(HeldLinks {
            dir: dir.path().to_path_buf(),
            links,
            lost: Default::default(),
        })
    }

    /// Puts this agent's program back into every link that runs another one now; returns how many
    /// it changed. For an agent that serves on after a successor updated the links and died.
    pub fn retake(&self) -> usize {
        let mut retaken = 0;
        for (name, link, ours, program) in &self.links {
            let runs = link.state().map(|s| s.prog_id).ok();
            if runs == Some(*ours) {
                continue;
            }
            match link.update(program.as_fd()) {
                Ok(()) => retaken += 1,
                Err(e) => {
                    tracing::warn!(program = name, error = %e, "putting our program back in its link failed")
                }
            }
        }
        retaken
    }

    /// True (once) when a pin of a held link is gone: the links stay attached while this agent
    /// holds them, but a successor cannot take them over, and they go when this agent does.
    pub fn pins_lost_now(&self) -> bool {
        use std::sync::atomic::Ordering;
        if self.lost.load(Ordering::Relaxed) {
            return false;
        }
        self.pins_gone() && !self.lost.swap(true, Ordering::Relaxed)
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    fn pins_gone(&self) -> bool {
        self.links
            .iter()
            .any(|(_, link, _, _)| !link.path().exists())
    }

    /// Detaches every held link when all still run this agent's programs; false (and nothing
    /// touched) when a successor's run in them.
    fn detach_if_ours(&self) -> bool {
        let ours = self
            .links
            .iter()
            .all(|(_, link, prog_id, _)| link.state().map(|s| s.prog_id).ok() == Some(*prog_id));
        if !ours {
            return false;
        }
        for (name, link, _, _) in &self.links {
            if let Err(e) = link.detach() {
                tracing::warn!(program = name, error = %e, "detaching a held link failed");
            }
        }
        tracing::info!(
            links = self.links.len(),
            "detached the links this agent held (their pins were gone)"
        );
        true
    }
}

/// True when every pinned link runs the program this agent put there.
fn owns(dir: &pins::PinDir, pinned: &Pinned) -> bool {
    pinned.programs.iter().all(|(name, prog_id)| {
        matches!(dir.link(name), Ok(Some(link)) if link.state().map(|s| s.prog_id).ok() == Some(*prog_id))
    })
}

/// The pinned links an agent of the cgroup `ours` (open as `cgroup`) cannot adopt, by program, and
/// why. Putting a program into a severed link fails (`ENOLINK`); into one attached to another
/// cgroup, it would steer someone else's pods and none of ours. A pin that cannot be opened is left
/// to [`swap_into_pinned`], which says so.
fn unadoptable_links(
    dir: &pins::PinDir,
    cgroup: &std::fs::File,
    ours: u64,
) -> Result<Vec<(String, pins::Unadoptable)>, RedirectError> {
    let mut found = Vec::new();
    for (name, link) in dir.links() {
        let Ok(link) = link else { continue };
        let why = link
            .unadoptable(cgroup, ours)
            .map_err(|source| RedirectError::Link {
                path: link.path().to_path_buf(),
                source,
            })?;
        if let Some(why) = why {
            found.push((name, why));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// `links/connect4, links/connect6: severed: ...; links/sock_ops: attached to ...`: each reason
/// once, with the pins it holds for.
fn describe_unadoptable(links: &[(String, pins::Unadoptable)]) -> String {
    let mut reasons: Vec<(&pins::Unadoptable, Vec<String>)> = Vec::new();
    for (name, why) in links {
        let pin = format!("links/{name}");
        match reasons.iter_mut().find(|(w, _)| *w == why) {
            Some((_, pins)) => pins.push(pin),
            None => reasons.push((why, vec![pin])),
        }
    }
    reasons
        .iter()
        .map(|(why, pins)| format!("{}: {why}", pins.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Puts `program` into the pinned link of `name`, if there is one; false when there is none.
fn swap_into_pinned(
    dir: &pins::PinDir,
    name: &'static str,
    program: BorrowedFd<'_>,
) -> Result<bool, RedirectError> {
    let link_err = |source| RedirectError::Link {
        path: dir.link_path(name),
        source,
    };
    let Some(link) = dir.link(name).map_err(link_err)? else {
        return Ok(false);
    };
    link.update(program).map_err(link_err)?;
    Ok(true)
}

fn pin_link(
    dir: &pins::PinDir,
    name: &'static str,
    link: Result<FdLink, LinkError>,
) -> Result<(), RedirectError> {
    let path = dir.link_path(name);
    let link_err = |e: String| RedirectError::Link {
        path: path.clone(),
        source: std::io::Error::other(e),
    };
    let link = link.map_err(|e| link_err(e.to_string()))?;
    // The pin keeps the link attached; our descriptor closes here.
    link.pin(&path).map_err(|e| link_err(e.to_string()))?;
    Ok(())
}

/// Loads `name` and gets it running on `cgroup`: swapped into its pinned link when a predecessor
/// left one, else attached anew, its link pinned when there is a pin directory (or tied to this
/// process when not). Returns the program's id, by which [`owns`] later tells whose program a link
/// runs, and a descriptor of the program, to put it back in its link ([`HeldLinks::retake`]).
fn load_and_attach<P: CgroupProgram>(
    program: &mut P,
    name: &'static str,
    cgroup: BorrowedFd<'_>,
    pin_dir: Option<&pins::PinDir>,
) -> Result<(u32, OwnedFd), RedirectError> {
    let program_err = |source| RedirectError::Program { name, source };
    program
        .load_program()
        .map_err(|source| load_error(name, source))?;
    let prog_id = program.program_info().map_err(program_err)?.id();
    let fd = program.program_fd().map_err(program_err)?;
    let own = fd
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| RedirectError::Link {
            path: PathBuf::from(name),
            source,
        })?;
    let swapped = match pin_dir {
        Some(dir) => swap_into_pinned(dir, name, fd.as_fd())?,
        None => false,
    };
    if !swapped {
        let id = program.attach_to(cgroup).map_err(program_err)?;
        if let Some(dir) = pin_dir {
            let link = program.take_fd_link(id).map_err(program_err)?;
            pin_link(dir, name, link)?;
        }
    }
    Ok((prog_id, own))
}

/// What [`load_and_attach`] needs of a program attached to the pods' cgroup: the sock_addr programs
/// and sock_ops take the same steps through different aya types.
trait CgroupProgram {
    type LinkId;
    fn load_program(&mut self) -> Result<(), ProgramError>;
    fn program_info(&self) -> Result<ProgramInfo, ProgramError>;
    fn program_fd(&self) -> Result<&ProgramFd, ProgramError>;
    fn attach_to(&mut self, cgroup: BorrowedFd<'_>) -> Result<Self::LinkId, ProgramError>;
    /// Takes the link away from the program (which would detach it when dropped), to be pinned.
    fn take_fd_link(&mut self, id: Self::LinkId)
    -> Result<Result<FdLink, LinkError>, ProgramError>;
}

macro_rules! impl_cgroup_program {
    ($($program:ty => $link_id:ty),+ $(,)?) => {$(
        impl CgroupProgram for $program {
            type LinkId = $link_id;
            fn load_program(&mut self) -> Result<(), ProgramError> {
                self.load()
            }
            fn program_info(&self) -> Result<ProgramInfo, ProgramError> {
                self.info()
            }
            fn program_fd(&self) -> Result<&ProgramFd, ProgramError> {
                self.fd()
            }
            fn attach_to(&mut self, cgroup: BorrowedFd<'_>) -> Result<$link_id, ProgramError> {
                self.attach(cgroup, ATTACH_MODE)
            }
            fn take_fd_link(
                &mut self,
                id: $link_id,
            ) -> Result<Result<FdLink, LinkError>, ProgramError> {
                self.take_link(id).map(FdLink::try_from)
            }
        }
    )+};
}

impl_cgroup_program!(
    CgroupSockAddr => CgroupSockAddrLinkId,
    SockOps => SockOpsLinkId,
);

/// Where each steered connection meant to go, as the kernel filed it under the client's address and
/// port: the agent's maps, or a table a test fills.
pub trait Flows: Send + Sync + std::fmt::Debug {
    /// The entry for the connection from `client`, taken out (read once; see
    /// [`RedirectMaps::take_original_destination`]).
    fn take(&self, client: SocketAddr) -> Result<Option<OrigDst>, MapError>;
    /// Drops the entry of a connection refused before it was read.
    fn forget(&self, client: SocketAddr);
}

/// Flows as a test files them: what sock_ops would have filed for a connection from an address.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FiledFlows(Mutex<std::collections::HashMap<SocketAddr, OrigDst>>);

#[cfg(test)]
impl FiledFlows {
    /// Files `orig` for the connection from `client`, as the programs would.
    pub fn file(&self, client: SocketAddr, orig: OrigDst) {
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
    pub fn take_original_destination(
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
    pub fn forget_flow(&self, client: SocketAddr) {
        let key = SockAddr::from_socket_addr(client);
        let mut flows = self.flows.locked();
        let _ = flows.remove(&key);
    }

    /// Makes `want` the set of pod cgroups the programs leave alone; returns the ids it added and
    /// removed. On an error the map holds part of the change and the next call completes it.
    pub fn set_opted_out(&self, want: &BTreeSet<u64>) -> Result<(Vec<u64>, Vec<u64>), MapError> {
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
    pub fn event_counts(&self) -> Vec<(Stat, u64)> {
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
            // Newer kernels end with statistics lines; the reason is the line before them.
            !l.is_empty()
                && !l.starts_with("processed ")
                && !l.starts_with("verification time")
                && !l.starts_with("stack depth")
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

/// Kernels before 5.11 charge maps to `RLIMIT_MEMLOCK` (at the most they can hold), which the
/// fast path's maps, sized to the configuration, can pass: lifted for this process, best effort
/// (later kernels charge the cgroup's memory instead and ignore it).
fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads a valid struct; a refusal changes nothing.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "RLIMIT_MEMLOCK not lifted");
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use pins::Unadoptable;

    #[test]
    fn unadoptable_links_are_told_once_per_reason_with_their_pins() {
        let links = vec![
            ("connect4".to_string(), Unadoptable::Severed),
            (
                "connect6".to_string(),
                Unadoptable::OtherCgroup { cgroup_id: 7 },
            ),
            ("sock_ops".to_string(), Unadoptable::Severed),
        ];
        assert_eq!(
            describe_unadoptable(&links),
            "links/connect4, links/sock_ops: severed: attached to no cgroup (its cgroup was removed, or the link was detached); links/connect6: attached to another cgroup (id 7)"
        );
    }
}
