//! The in-kernel fast path, userspace half: a snapshot compiled into tables shaped like the eBPF
//! maps the `connect4`/`connect6` programs will read, and a model of those programs.
//!
//! The kernel may only decide where its answer is provably [`crate::state::Snapshot::decide_outbound`]'s:
//! leave the socket alone (passthrough, a workload address, a resolution NONE service) or rewrite the
//! destination to one of a service port's endpoints: plain IPs, or host names the agent resolved
//! ahead (`ahead`) while their answer is fresh. Everything else (a host name without a fresh
//! answer, no healthy upstream, a table that ran out of room) is handed to the proxy.
//! `docs/data-plane.md#in-kernel-fast-path` has the rules in prose. The tables' keys and values are
//! `redirect_common::fastpath`'s, the entries the programs read; `maps` writes them, one
//! generation at a time, into the maps the loader (`redirect`) hands over before it attaches.
pub(crate) mod ahead;
mod audited;
mod compile;
mod dump;
mod kernel;
mod limits;
mod lpm;
mod maps;
mod memory;
mod patch;
mod records;
mod tables;
mod upkeep;

pub(crate) use compile::{HostAddresses, compile, compile_after, with_hosts};
#[cfg(test)]
pub(crate) use compile::{compile_with, with_workloads};
pub(crate) use dump::{Dump, fallback_name};
pub use kernel::DecidedBy;
pub(crate) use kernel::decided_by;
#[cfg(test)]
pub(crate) use kernel::{FastDecision, decide, decide_for, decide_hidden};
pub(crate) use limits::{DEFAULT_MEMORY, Fallback, Limits, Stats};
pub(crate) use maps::FastMaps;
pub(crate) use memory::{TableMemory, kernel_bytes};
pub(crate) use records::KernelRecords;
#[cfg(test)]
pub(crate) use tables::ClientsFull;
pub(crate) use tables::{Clients, Install, PortEndpoints, Tables};
pub(crate) use upkeep::FastPath;

#[cfg(test)]
mod tests;
