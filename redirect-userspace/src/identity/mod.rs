//! Who is really connecting. The pod registry gives a source IP to a pod, and so to a namespace; the
//! kernel tells which cgroup the connecting process runs in, and on a kubelet node a pod's cgroup
//! carries the pod's uid in its name. When both name a pod and they disagree (an IP reused by a new pod
//! before the registry caught up, or a process using an address that is not its pod's), the connection
//! is served as an unknown client: PUBLIC services only, never the namespace the IP claims.
mod cgroups;
mod client;

use uuid::Uuid;

pub(crate) use cgroups::CgroupPods;
pub(crate) use client::{Client, KernelView};

/// The outcome of comparing the registry with the kernel for one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Both name the same pod.
    Confirmed,
    /// Nothing to compare: the registry holds no uid for the address, or the connecting process is
    /// not in a kubelet pod cgroup (another layout, or a cgroup we could not find).
    Unchecked,
    /// The process runs in another pod's cgroup than the pod the registry gives the address to.
    Mismatch { registry: Uuid, kernel: Uuid },
}

impl Check {
    /// `registry`: uid of the workload holding the source IP; `kernel`: pod uid of the connecting
    /// process's cgroup.
    pub(crate) fn compare(registry: Option<Uuid>, kernel: Option<Uuid>) -> Check {
        match (registry, kernel) {
            (Some(registry), Some(kernel)) if registry != kernel => {
                Check::Mismatch { registry, kernel }
            }
            (Some(_), Some(_)) => Check::Confirmed,
            _ => Check::Unchecked,
        }
    }

    /// Whether the registry's namespace may be used for this client.
    pub(crate) fn trusted(self) -> bool {
        !matches!(self, Check::Mismatch { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Uuid = Uuid::from_u128(0x0a);
    const B: Uuid = Uuid::from_u128(0x0b);

    #[test]
    fn the_registry_is_trusted_unless_the_kernel_names_another_pod() {
        let cases = [
            ("same pod", Some(A), Some(A), Check::Confirmed),
            ("no uid in the registry", None, Some(A), Check::Unchecked),
            ("not a pod cgroup", Some(A), None, Check::Unchecked),
            ("neither", None, None, Check::Unchecked),
            (
                "another pod's cgroup",
                Some(A),
                Some(B),
                Check::Mismatch {
                    registry: A,
                    kernel: B,
                },
            ),
        ];
        for (name, registry, kernel, want) in cases {
            let got = Check::compare(registry, kernel);
            assert_eq!(got, want, "{name}");
            assert_eq!(
                got.trusted(),
                !matches!(want, Check::Mismatch { .. }),
                "{name}"
            );
        }
    }
}
