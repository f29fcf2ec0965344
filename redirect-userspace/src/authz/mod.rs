//! Inbound authorization (`docs/authorization.md`): Istio's `AuthorizationPolicy` and
//! `PeerAuthentication`, converted as Istio converts them for a node's data plane (`policy`,
//! `peer`), the policies that apply to each Pod of the node (`node`), and the decision for one
//! connection (`decide`). One decision for every path: HBONE received, a Pod of the same node
//! through the proxy, and `explain`.
mod decide;
mod node;
mod peer;
mod policy;
mod table;

pub(crate) use decide::{Conn, Decision, Verdict};
pub(crate) use node::{AuthorizationDump, NodePolicies, PodPolicies};
pub(crate) use table::{InboundTable, Rule};

#[cfg(test)]
mod tests;
