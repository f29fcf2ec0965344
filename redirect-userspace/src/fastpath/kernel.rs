//! A model of the `connect4`/`connect6` programs: a few map lookups, no loop over services. The
//! eBPF half is written from this, and a property test holds it to `Snapshot::decide_outbound`.
use std::net::IpAddr;

use redirect_common::fastpath::{
    ACTION_NONE, ACTION_PASSTHROUGH, ACTION_PORTS, AddrKey, Claim, IpKey, NS_ENROLLED, NS_PROXY,
    NS_UNKNOWN, PortKey, WORKLOAD_HBONE, WORKLOAD_PROXY,
};

#[cfg(test)]
use super::tables::Clients;
use super::tables::{NsId, PortEndpoints, Tables};

/// What the kernel does with a `connect()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FastDecision<'t> {
    /// Leave the socket alone: no visible service claims the address, or a resolution NONE one does.
    Passthrough,
    /// Leave the socket alone: the address is a workload's and no visible service claims it.
    Workload,
    /// Rewrite the destination to one of these endpoints, spread evenly.
    Rewrite(&'t PortEndpoints),
    /// Steer the socket to the proxy, as without the fast path.
    Proxy,
}

/// Who decides a connection with `--fast-path` (`explain` and `/config_dump` show it).
pub use crate::records::DecidedBy;

/// The program for a socket of the process in cgroup `cgroup`.
#[cfg(test)]
pub(crate) fn decide<'t>(
    tables: &'t Tables,
    clients: &Clients,
    cgroup: u64,
    ip: IpAddr,
    port: u16,
) -> FastDecision<'t> {
    // A cgroup the agent has not named (a pod started since, one that did not fit, a process
    // outside any pod's cgroup) could be anyone's: only the proxy knows its namespace.
    match clients.get(cgroup) {
        Some(ns) => decide_for(tables, ns, ip, port),
        None => FastDecision::Proxy,
    }
}

/// The program once the client's namespace id is known.
pub(crate) fn decide_for(tables: &Tables, ns: NsId, ip: IpAddr, port: u16) -> FastDecision<'_> {
    decide_hidden(tables, ns, ip, port).0
}

/// [`decide_for`], and the id of the service skipped as hidden that the program counts and
/// reports (only when it decides: never with [`FastDecision::Proxy`], which the proxy counts).
pub(crate) fn decide_hidden(
    tables: &Tables,
    ns: NsId,
    ip: IpAddr,
    port: u16,
) -> (FastDecision<'_>, Option<u32>) {
    if tables.config.proxy_everything != 0 || ns == NS_PROXY {
        return (FastDecision::Proxy, None);
    }
    let enrolled = ns & NS_ENROLLED != 0;
    let ns = ns & !NS_ENROLLED;
    let ip = IpKey::new(ip);
    let own = AddrKey { ns, ip };
    let shared = AddrKey { ns: NS_UNKNOWN, ip };
    // Exact addresses before networks; in each, the client's own entry before the shared one. An
    // exact entry without a visible claimant only says what it hid: the networks come next.
    let exact = tables.exact.get(&own).or_else(|| tables.exact.get(&shared));
    let mut hidden = exact.and_then(Claim::hidden);
    let claim = match exact {
        Some(c) if c.action != ACTION_NONE => Some(c),
        _ => {
            let network = tables
                .cidrs
                .lookup(own)
                .or_else(|| tables.cidrs.lookup(shared));
            hidden = hidden.or(network.and_then(Claim::hidden));
            network.filter(|c| c.action != ACTION_NONE)
        }
    };
    let fast = decide_claim(tables, claim, ip, port, enrolled);
    match fast {
        FastDecision::Proxy => (fast, None),
        _ => (fast, hidden),
    }
}

fn decide_claim<'t>(
    tables: &'t Tables,
    claim: Option<&Claim>,
    ip: IpKey,
    port: u16,
    enrolled: bool,
) -> FastDecision<'t> {
    // Only the proxy may carry a connection there: under authorization it decides, or over HBONE
    // from a client in the mesh.
    let proxy_only = |class: Option<&u8>| match class {
        Some(&WORKLOAD_PROXY) => true,
        Some(&WORKLOAD_HBONE) => enrolled,
        _ => false,
    };
    let Some(claim) = claim else {
        // Left alone either way: the table only counts workloads apart (one it had no room for
        // is counted as a passthrough).
        return match tables.workloads.get(&ip) {
            class if proxy_only(class) => FastDecision::Proxy,
            Some(_) => FastDecision::Workload,
            None => FastDecision::Passthrough,
        };
    };
    // Any other action (`ACTION_PROXY`, or one this model does not know) is the proxy's.
    match claim.action {
        // A network passed through may hold a Pod only the proxy may carry a connection to.
        ACTION_PASSTHROUGH => match tables.workloads.get(&ip) {
            class if proxy_only(class) => FastDecision::Proxy,
            _ => FastDecision::Passthrough,
        },
        ACTION_PORTS => match tables.ports.get(&PortKey::new(claim.service, port)) {
            // A socket is rewritten within its own family. (The kernel sends a connection whose
            // pick lands on an endpoint reached over HBONE to the proxy instead; the rewrite
            // names the endpoints it picks among.)
            Some(backends) if backends.family == ip.family => FastDecision::Rewrite(backends),
            _ => FastDecision::Proxy,
        },
        _ => FastDecision::Proxy,
    }
}

/// Whether the kernel or the proxy would decide a connection from a client in `client_ns`
/// (`None`: unknown) to `ip:port` under these tables.
pub(crate) fn decided_by(
    tables: &Tables,
    client_ns: Option<&str>,
    ip: IpAddr,
    port: u16,
) -> DecidedBy {
    let ns = client_ns.map_or(NS_UNKNOWN, |ns| tables.namespace_id(ns));
    match decide_for(tables, ns, ip, port) {
        FastDecision::Proxy => DecidedBy::Proxy,
        _ => DecidedBy::Kernel,
    }
}
