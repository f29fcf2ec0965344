//! Getting the programs running on the pods' cgroup: what a pin directory holds decides how
//! (attached afresh, swapped into a predecessor's links, or the pinned state cleared first), then
//! each program is loaded and attached or swapped in, its link pinned; a failure part way undoes
//! what was attached.
use std::{
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, ProgramFd, ProgramInfo, SockOps,
        cgroup_sock_addr::CgroupSockAddrLinkId,
        links::{FdLink, LinkError},
        sock_ops::SockOpsLinkId,
    },
};
use redirect_common::programs;

use super::{RedirectError, Start, features, pins, pins::Found};

/// What the pin directory holds, and so how this agent starts: the `Start`, and for pinned state
/// of an unknown layout (cleared here, pods unsteered from now on) when that began.
pub(super) fn found_start(
    pin_dir: Option<&pins::PinDir>,
    cgroup: &std::fs::File,
    cgroup_id: u64,
    cgroup_path: &Path,
) -> Result<(Start, Option<Instant>), RedirectError> {
    let Some(dir) = pin_dir else {
        return Ok((Start::Unpinned, None));
    };
    Ok(match dir.found() {
        Found::Empty => (Start::Fresh, None),
        Found::Ours => {
            let unadoptable = unadoptable_links(dir, cgroup, cgroup_id)?;
            if unadoptable.is_empty() {
                (Start::Adopted, None)
            } else {
                let found = describe_unadoptable(&unadoptable);
                tracing::warn!(dir = %dir.path().display(), cgroup = %cgroup_path.display(), cgroup_id, %found, "pinned links that steer none of this agent's pods cannot be adopted; unpinning them with the maps they share and attaching anew");
                dir.clear_for(cgroup_id)?;
                (Start::Reattached { found }, None)
            }
        }
        Found::Unknown(found) => {
            tracing::warn!(dir = %dir.path().display(), %found, "refusing to adopt pinned state of an unknown layout; detaching it and attaching anew (pods are not steered until then)");
            let since = Instant::now();
            dir.clear()?;
            let window = Duration::ZERO;
            (Start::Replaced { found, window }, Some(since))
        }
    })
}

/// Every program running on `cgroup`, sock_addr ones first: each program's name and id, and a
/// descriptor of it (for [`super::HeldLinks`]).
pub(super) type Running = (Vec<(&'static str, u32)>, Vec<OwnedFd>);

pub(super) fn attach_all(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
    pin_dir: Option<&pins::PinDir>,
) -> Result<Running, RedirectError> {
    let mut attached = Vec::new();
    let mut program_fds = Vec::new();
    for name in SOCK_ADDR_PROGRAMS {
        let sock_addr: &mut CgroupSockAddr = program(ebpf, name)?;
        let (prog_id, fd) = load_and_attach(sock_addr, name, cgroup.as_fd(), pin_dir)?;
        attached.push((name, prog_id));
        program_fds.push(fd);
    }
    let name = programs::SOCK_OPS;
    let sock_ops: &mut SockOps = program(ebpf, name)?;
    let (prog_id, fd) = load_and_attach(sock_ops, name, cgroup.as_fd(), pin_dir)?;
    attached.push((name, prog_id));
    program_fds.push(fd);
    Ok((attached, program_fds))
}

/// On kernels >= 5.7 aya attaches with a bpf_link, which always coexists with other programs on the
/// hierarchy (systemd, the CNI) and takes no flags: passing ALLOW_MULTI there is EINVAL.
const ATTACH_MODE: CgroupAttachMode = CgroupAttachMode::Single;

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

/// Detaches what a failed [`Redirector::attach`] attached and pinned, when dropped armed.
pub(super) struct Undo<'a> {
    pub(super) dir: Option<&'a pins::PinDir>,
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
/// runs, and a descriptor of the program, to put it back in its link ([`super::HeldLinks::retake`]).
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

/// Program `name` of the loaded object, as a `T`.
pub(super) fn program<'a, T>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut T, RedirectError>
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
pub(super) fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads a valid struct; a refusal changes nothing.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "RLIMIT_MEMLOCK not lifted");
    }
}

#[cfg(test)]
mod tests {
    use super::pins::Unadoptable;
    use super::*;

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
