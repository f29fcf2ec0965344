//! Whether a policy matches a connection, and the decision of a workload's policies
//! (`docs/authorization.md#decision`): DENY first, then ALLOW.
use std::{fmt, net::IpAddr};

use ipnet::IpNet;
use serde::Serialize;

use super::policy::{Action, Authorization, Match, StringMatch};
use crate::hbone::Identity;

/// What a connection offers to be matched on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Conn<'a> {
    /// The peer's workload identity: over HBONE its certificate's, on the same node the client
    /// Pod's. `None`: plaintext, no identity.
    pub src_identity: Option<&'a Identity>,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    /// The workload's port (after a Service's target port).
    pub dst_port: u16,
}

impl Authorization {
    /// Whether any group matches `conn`.
    pub(crate) fn matches(&self, conn: &Conn<'_>) -> bool {
        self.groups.iter().any(|group| {
            group
                .clauses
                .iter()
                .all(|clause| clause.matches.iter().any(|m| m.holds(conn)))
        })
    }
}

impl Match {
    /// Every field set holds; an empty match never does.
    fn holds(&self, conn: &Conn<'_>) -> bool {
        if self.is_empty() {
            return false;
        }
        let id = conn.src_identity;
        let by_principal = !self.principals.is_empty() || !self.not_principals.is_empty();
        let principal = id.filter(|_| by_principal).map(principal);
        let strings =
            |want: &StringMatch, value: Option<&str>| value.is_some_and(|v| want.matches(v));
        let nets = |net: &IpNet, ip: IpAddr| net.contains(&ip.to_canonical());
        either(&self.destination_ports, &self.not_destination_ports, |p| {
            *p == conn.dst_port
        }) && either(&self.destination_ips, &self.not_destination_ips, |n| {
            nets(n, conn.dst_ip)
        }) && either(&self.source_ips, &self.not_source_ips, |n| {
            nets(n, conn.src_ip)
        }) && either(&self.namespaces, &self.not_namespaces, |m| {
            strings(m, id.map(|i| i.namespace.as_str()))
        }) && either(&self.principals, &self.not_principals, |m| {
            strings(m, principal.as_deref())
        }) && either(&self.service_accounts, &self.not_service_accounts, |sa| {
            id.is_some_and(|i| i.namespace == sa.namespace && i.service_account == sa.name)
        })
    }
}

/// A positive list holds when empty or when any entry matches; a negative one when none does.
fn either<T>(positive: &[T], negative: &[T], matches: impl Fn(&T) -> bool) -> bool {
    (positive.is_empty() || positive.iter().any(&matches)) && !negative.iter().any(&matches)
}

/// An identity as policies name it: without `spiffe://`.
fn principal(id: &Identity) -> String {
    format!(
        "{}/ns/{}/sa/{}",
        id.trust_domain, id.namespace, id.service_account
    )
}

/// How a workload's policies decided a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// No policy applies, or none of the DENY ones matched and there is no ALLOW policy.
    Allowed,
    /// This ALLOW policy matched (`namespace/name`).
    AllowedBy(String),
    /// This DENY policy matched.
    ExplicitlyDenied(String),
    /// ALLOW policies apply and none matched.
    NotAllowed,
}

impl Verdict {
    pub(crate) fn allowed(&self) -> bool {
        matches!(self, Verdict::Allowed | Verdict::AllowedBy(_))
    }

    /// The policy that decided, when one did.
    pub(crate) fn policy(&self) -> Option<&str> {
        match self {
            Verdict::AllowedBy(p) | Verdict::ExplicitlyDenied(p) => Some(p),
            _ => None,
        }
    }

    /// The metric label.
    pub(crate) fn result(&self) -> &'static str {
        if self.allowed() { "allowed" } else { "denied" }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Allowed => {
                f.write_str("allowed: no policy denies it and no ALLOW policy applies")
            }
            Verdict::AllowedBy(p) => write!(f, "allowed by: {p}"),
            Verdict::ExplicitlyDenied(p) => write!(f, "explicitly denied by: {p}"),
            Verdict::NotAllowed => f.write_str("allow policies exist, but none allowed"),
        }
    }
}

impl Serialize for Verdict {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A decision and the dry-run policies that would have matched (logged, never enforced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decision {
    pub verdict: Verdict,
    pub dry_run_matches: Vec<String>,
}

/// Decides `conn` under `policies`, those that apply to its destination workload: a DENY that
/// matches refuses; then no ALLOW policy admits; then an ALLOW that matches admits; else refused.
pub(crate) fn decide<'p>(
    policies: impl IntoIterator<Item = &'p Authorization> + Clone,
    conn: &Conn<'_>,
) -> Decision {
    let mut dry_run_matches = Vec::new();
    for p in policies.clone() {
        if p.dry_run && p.matches(conn) {
            dry_run_matches.push(format!("{} ({})", p.key(), p.action.as_str()));
        }
    }
    let enforced = || policies.clone().into_iter().filter(|p| !p.dry_run);
    let verdict = if let Some(deny) = enforced()
        .filter(|p| p.action == Action::Deny)
        .find(|p| p.matches(conn))
    {
        Verdict::ExplicitlyDenied(deny.key())
    } else {
        let mut allows = enforced().filter(|p| p.action == Action::Allow).peekable();
        if allows.peek().is_none() {
            Verdict::Allowed
        } else {
            match allows.find(|p| p.matches(conn)) {
                Some(allow) => Verdict::AllowedBy(allow.key()),
                None => Verdict::NotAllowed,
            }
        }
    };
    Decision {
        verdict,
        dry_run_matches,
    }
}
