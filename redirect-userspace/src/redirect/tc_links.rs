//! A tc program kept on a changing set of the node's links: attached to each link of the set it is
//! not on yet, detached from the links gone or renamed. `hbone_replies` (ingress, every Ethernet
//! link) and `node_origin` (egress, every veth) are each kept so.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf,
    programs::{SchedClassifier, TcAttachType, tc, tc::SchedClassifierLinkId},
    util::KernelVersion,
};
use futures::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use tracing::{debug, info, warn};

use super::{RedirectError, attach::program};
use crate::lock::Locked;

/// Which of the node's links a program belongs on.
pub(crate) type LinkSet = fn(&LinkMessage) -> bool;

/// A loaded classifier and the links it is attached to (by index, with the name each had).
pub(crate) struct TcOnLinks {
    ebpf: Arc<Mutex<Ebpf>>,
    handle: rtnetlink::Handle,
    program: &'static str,
    at: TcAttachType,
    set: LinkSet,
    attached: BTreeMap<u32, (String, SchedClassifierLinkId)>,
}

/// The links a program is on, and those it could not be attached to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Links {
    pub on: usize,
    pub missing: usize,
}

impl TcOnLinks {
    /// For `program` (loaded already), at `at` on the links of `set`; none attached yet.
    pub(super) fn new(
        ebpf: &Arc<Mutex<Ebpf>>,
        program: &'static str,
        at: TcAttachType,
        set: LinkSet,
    ) -> Result<Self, RedirectError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(RedirectError::Netlink)?;
        tokio::spawn(connection);
        Ok(TcOnLinks {
            ebpf: ebpf.clone(),
            handle,
            program,
            at,
            set,
            attached: BTreeMap::new(),
        })
    }

    /// Attaches the program to every link of its set it is not on yet, and detaches it from the
    /// links gone or renamed. A link it cannot be attached to is logged, and counted as missing.
    pub(crate) async fn sync(&mut self) -> Result<Links, rtnetlink::Error> {
        let links = links(&self.handle, self.set).await?;
        let mut object = self.ebpf.locked();
        let name = self.program;
        let Ok(program) = program::<SchedClassifier>(&mut object, name) else {
            // Loaded before this was made, as a classifier.
            return Ok(Links {
                on: 0,
                missing: links.len(),
            });
        };
        let gone = self
            .attached
            .extract_if(.., |index, (link, _)| links.get(index) != Some(link));
        for (_, (link, id)) in gone {
            // Gone with its link already, mostly; a renamed link is attached again below.
            if let Err(e) = program.detach(id) {
                debug!(program = name, %link, error = %e, "detaching a tc program from a link gone or renamed");
            }
        }
        let mut missing = 0;
        for (index, link) in links {
            if self.attached.contains_key(&index) {
                continue;
            }
            match attach(program, &link, self.at) {
                Ok(id) => {
                    info!(program = name, %link, "tc program attached to the link");
                    self.attached.insert(index, (link, id));
                }
                Err(e) => {
                    warn!(program = name, %link, error = %e, "attaching a tc program failed");
                    missing += 1;
                }
            }
        }
        Ok(Links {
            on: self.attached.len(),
            missing,
        })
    }
}

/// Attaches `program` to `link` at `at`: with TCX from 6.6, else as a filter under a `clsact`
/// qdisc (added when the link has none).
fn attach(
    program: &mut SchedClassifier,
    link: &str,
    at: TcAttachType,
) -> Result<SchedClassifierLinkId, aya::programs::ProgramError> {
    let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
    if !tcx {
        match tc::qdisc_add_clsact(link) {
            Ok(()) | Err(tc::TcError::AlreadyAttached) => {}
            Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e.into()),
        }
    }
    program.attach(link, at)
}

/// The node's links in `set`, by index, with their names.
async fn links(
    handle: &rtnetlink::Handle,
    set: LinkSet,
) -> Result<BTreeMap<u32, String>, rtnetlink::Error> {
    let links: Vec<_> = handle.link().get().execute().try_collect().await?;
    Ok(links
        .into_iter()
        .filter(set)
        .filter_map(|l| {
            let name = l.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(name) => Some(name.clone()),
                _ => None,
            })?;
            Some((l.header.index, name))
        })
        .collect())
}
