//! What the eBPF programs need from the kernel, checked before anything is loaded, so that an old or
//! trimmed kernel gets a sentence naming what is missing instead of a verifier dump.
//!
//! Every program type, helper (per program type), map type and hook the programs use is listed
//! here with the Linux release that brought it. The oldest kernel the agent runs on is
//! [`OLDEST_SUPPORTED`]; on kernels before 5.14 the node's netns cookie comes from `netns.rs`.
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};

/// The oldest kernel the agent is tested on and supports.
pub const OLDEST_SUPPORTED: (u8, u8) = (5, 10);

/// One kernel feature the programs use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Need {
    /// What it is, as a user reads it.
    pub what: &'static str,
    /// The Linux release that brought it.
    pub since: (u8, u8),
    pub probe: Probe,
}

/// How a feature is checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Probe {
    Program(ProgramType),
    Helper(ProgramType, BpfHelper),
    Map(MapType),
    /// An attach point that cannot be probed without attaching: the kernel release decides.
    Release,
}

use ProgramType::{CgroupSock, CgroupSockAddr, SockOps};

pub(crate) const NEEDS: &[Need] = &[
    Need {
        what: "cgroup sock_addr programs (connect, sendmsg, recvmsg, getpeername; IPv4 and IPv6)",
        since: (4, 17),
        probe: Probe::Program(CgroupSockAddr),
    },
    Need {
        what: "sock_ops programs",
        since: (4, 13),
        probe: Probe::Program(SockOps),
    },
    Need {
        what: "cgroup sock programs (netns_probe, on kernels before 5.14)",
        since: (4, 10),
        probe: Probe::Program(CgroupSock),
    },
    Need {
        what: "the cgroup/getpeername4 and getpeername6 hooks",
        since: (5, 8),
        probe: Probe::Release,
    },
    Need {
        what: "bpf_get_socket_cookie() in sock_addr programs",
        since: (5, 0),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_get_socket_cookie),
    },
    Need {
        what: "bpf_get_socket_cookie() in sock_ops programs",
        since: (5, 0),
        probe: Probe::Helper(SockOps, BpfHelper::BPF_FUNC_get_socket_cookie),
    },
    Need {
        what: "bpf_get_netns_cookie() in sock_addr programs",
        since: (5, 7),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_get_netns_cookie),
    },
    Need {
        what: "bpf_get_netns_cookie() in cgroup sock programs",
        since: (5, 7),
        probe: Probe::Helper(CgroupSock, BpfHelper::BPF_FUNC_get_netns_cookie),
    },
    Need {
        what: "bpf_get_current_cgroup_id() in sock_addr programs",
        since: (5, 7),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_get_current_cgroup_id),
    },
    Need {
        what: "bpf_get_current_ancestor_cgroup_id() in sock_addr programs",
        since: (5, 7),
        probe: Probe::Helper(
            CgroupSockAddr,
            BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id,
        ),
    },
    Need {
        what: "cgroup bpf_links pinned, updated in place, queried and force-detached (the hand-over)",
        since: (5, 9),
        probe: Probe::Release,
    },
    Need {
        what: "socket local storage maps (each steered socket's original destination)",
        since: (5, 2),
        probe: Probe::Map(MapType::SkStorage),
    },
    Need {
        what: "bpf_sk_storage_get() in sock_addr programs",
        since: (5, 3),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_sk_storage_get),
    },
    Need {
        what: "bpf_sk_storage_get() in sock_ops programs",
        since: (5, 3),
        probe: Probe::Helper(SockOps, BpfHelper::BPF_FUNC_sk_storage_get),
    },
    Need {
        what: "LRU hash maps",
        since: (4, 10),
        probe: Probe::Map(MapType::LruHash),
    },
    Need {
        what: "per-CPU array maps",
        since: (4, 6),
        probe: Probe::Map(MapType::PerCpuArray),
    },
    Need {
        what: "ring buffer maps (the fast path's reports of hidden services, the connection records)",
        since: (5, 8),
        probe: Probe::Map(MapType::RingBuf),
    },
    Need {
        what: "bpf_ringbuf_output in cgroup/sock_addr programs",
        since: (5, 8),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_ringbuf_output),
    },
    Need {
        what: "bpf_ringbuf_reserve in cgroup/sock_addr programs (the connection records)",
        since: (5, 8),
        probe: Probe::Helper(CgroupSockAddr, BpfHelper::BPF_FUNC_ringbuf_reserve),
    },
    Need {
        what: "bpf_ringbuf_reserve in sock_ops programs (a connection's close record)",
        since: (5, 8),
        probe: Probe::Helper(SockOps, BpfHelper::BPF_FUNC_ringbuf_reserve),
    },
    Need {
        what: "bpf_sock_ops_cb_flags_set (a connection's state changes, for its close record)",
        since: (4, 16),
        probe: Probe::Helper(SockOps, BpfHelper::BPF_FUNC_sock_ops_cb_flags_set),
    },
];

/// The kernel lacks something the programs need.
#[derive(Debug, thiserror::Error)]
#[error(
    "kernel {release} lacks what the eBPF programs need: {}. The agent needs Linux {}.{} or newer",
    list(missing),
    OLDEST_SUPPORTED.0,
    OLDEST_SUPPORTED.1
)]
pub(crate) struct MissingFeatures {
    pub release: String,
    pub missing: Vec<Need>,
}

fn list(missing: &[Need]) -> String {
    missing
        .iter()
        .map(|n| format!("{} (Linux {}.{})", n.what, n.since.0, n.since.1))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Checks every [`NEEDS`] entry against the running kernel.
pub(crate) fn check() -> Result<(), MissingFeatures> {
    let version = KernelVersion::current().ok();
    let missing = missing(NEEDS, |need| match need.probe {
        Probe::Program(t) => is_program_supported(t).ok(),
        Probe::Helper(t, h) => is_helper_supported(t, h).ok(),
        Probe::Map(m) => is_map_supported(m).ok(),
        Probe::Release => version.map(|v| v >= KernelVersion::new(need.since.0, need.since.1, 0)),
    });
    if missing.is_empty() {
        return Ok(());
    }
    Err(MissingFeatures {
        release: kernel_release(),
        missing,
    })
}

/// The needs `present` says are absent; a probe that cannot tell (`None`) is not counted: loading
/// the programs will tell.
pub(crate) fn missing(needs: &[Need], present: impl Fn(&Need) -> Option<bool>) -> Vec<Need> {
    needs
        .iter()
        .filter(|n| present(n) == Some(false))
        .copied()
        .collect()
}

/// `uname -r`.
pub(crate) fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "(unknown release)".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_need_is_older_than_the_oldest_supported_kernel() {
        for need in NEEDS {
            assert!(need.since <= OLDEST_SUPPORTED, "{need:?}");
        }
    }

    #[test]
    fn the_error_names_the_kernel_each_missing_feature_and_the_minimum() {
        let missing = missing(NEEDS, |n| {
            Some(!matches!(
                n.probe,
                Probe::Helper(_, BpfHelper::BPF_FUNC_get_netns_cookie)
            ))
        });
        assert_eq!(missing.len(), 2);
        let err = MissingFeatures {
            release: "5.4.0-42-generic".into(),
            missing,
        }
        .to_string();
        assert_eq!(
            err,
            "kernel 5.4.0-42-generic lacks what the eBPF programs need: \
             bpf_get_netns_cookie() in sock_addr programs (Linux 5.7); \
             bpf_get_netns_cookie() in cgroup sock programs (Linux 5.7). \
             The agent needs Linux 5.10 or newer"
        );
    }

    #[test]
    fn a_probe_that_cannot_tell_is_not_reported_missing() {
        assert!(missing(NEEDS, |_| None).is_empty());
    }
}
