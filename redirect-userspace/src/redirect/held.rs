//! The pinned links, held open by the agent that put its programs in them: so that they stay
//! attached while it runs when their pins go, so that it can take them back from a successor that
//! died half-way through a hand-over, and so that it can tell, on its way out, whether they are
//! still its own.
use std::{
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
};

use super::{Pinned, RedirectError, pins};

/// The pinned links, opened and held by this process, each with the program this agent put in it.
///
/// Held, a link stays attached while this agent runs even when its pin goes (the bpf filesystem
/// unmounted under the agent); and the agent can put its own program back in a link a successor
/// updated and then died before it said it was ready.
pub(crate) struct HeldLinks {
    dir: PathBuf,
    links: Vec<(&'static str, pins::PinnedLink, u32, OwnedFd)>,
    /// The pins were found gone once (said once).
    lost: std::sync::atomic::AtomicBool,
}

impl HeldLinks {
    pub(super) fn open(
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
    pub(crate) fn retake(&self) -> usize {
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
    pub(crate) fn pins_lost_now(&self) -> bool {
        use std::sync::atomic::Ordering;
        if self.lost.load(Ordering::Relaxed) {
            return false;
        }
        self.pins_gone() && !self.lost.swap(true, Ordering::Relaxed)
    }

    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub(super) fn pins_gone(&self) -> bool {
        self.links
            .iter()
            .any(|(_, link, _, _)| !link.path().exists())
    }

    /// Detaches every held link when all still run this agent's programs; false (and nothing
    /// touched) when a successor's run in them.
    pub(super) fn detach_if_ours(&self) -> bool {
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
pub(super) fn owns(dir: &pins::PinDir, pinned: &Pinned) -> bool {
    pinned.programs.iter().all(|(name, prog_id)| {
        matches!(dir.link(name), Ok(Some(link)) if link.state().map(|s| s.prog_id).ok() == Some(*prog_id))
    })
}
