//! An `AuthorizationPolicy` converted to what the node enforces: groups of clauses of matches on
//! the five L4 attributes, the HTTP attributes dropped as Istio drops them for a data plane without
//! a waypoint (`docs/authorization.md#conversion`), and what was dropped written down.
use std::{fmt, net::IpAddr};

use ipnet::IpNet;
use serde::Serialize;

use crate::config::{
    AuthorizationPolicy, AuthzAction, AuthzCondition, AuthzOperation, AuthzSource,
};

/// What the node does with connections a policy matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub(crate) enum Action {
    Allow,
    Deny,
}

impl Action {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "ALLOW",
            Action::Deny => "DENY",
        }
    }
}

/// Which workloads a policy applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) enum Scope {
    /// The root namespace's, without a selector: every workload of the mesh.
    Global,
    /// Its namespace's workloads.
    Namespace,
    /// The workloads of its namespace (or of every namespace, from the root namespace) whose
    /// labels hold all these. Empty: none.
    Selector(crate::config::Labels),
}

/// A string compared as Istio compares principals and namespaces: `*` is any non-empty value,
/// `*x` a suffix, `x*` a prefix, anything else the exact value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Presence,
}

impl StringMatch {
    pub(crate) fn parse(text: &str) -> StringMatch {
        if text == "*" {
            StringMatch::Presence
        } else if let Some(suffix) = text.strip_prefix('*') {
            StringMatch::Suffix(suffix.to_string())
        } else if let Some(prefix) = text.strip_suffix('*') {
            StringMatch::Prefix(prefix.to_string())
        } else {
            StringMatch::Exact(text.to_string())
        }
    }

    pub(crate) fn matches(&self, value: &str) -> bool {
        match self {
            StringMatch::Exact(s) => value == s,
            StringMatch::Prefix(p) => value.starts_with(p.as_str()),
            StringMatch::Suffix(s) => value.ends_with(s.as_str()),
            StringMatch::Presence => !value.is_empty(),
        }
    }
}

impl fmt::Display for StringMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StringMatch::Exact(s) => f.write_str(s),
            StringMatch::Prefix(p) => write!(f, "{p}*"),
            StringMatch::Suffix(s) => write!(f, "*{s}"),
            StringMatch::Presence => f.write_str("*"),
        }
    }
}

impl Serialize for StringMatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A service account: `namespace/name`; written as `name` alone in a policy, the policy's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

/// One `from` or `to` entry (or one `when`): every field that is set must hold. A match with no
/// field set never holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Match {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<StringMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<ServiceAccount>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<ServiceAccount>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ports: Vec<u16>,
}

impl Match {
    pub(crate) fn is_empty(&self) -> bool {
        *self == Match::default()
    }
}

/// The OR of its matches.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Clause {
    pub matches: Vec<Match>,
}

/// One rule: the AND of its clauses. No clause: every connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Group {
    pub clauses: Vec<Clause>,
}

/// A policy as the node enforces it. It matches a connection when any group does; with no group
/// it matches none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Authorization {
    pub namespace: String,
    pub name: String,
    pub scope: Scope,
    pub action: Action,
    /// Never enforced: its matches are logged and counted.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    pub groups: Vec<Group>,
    /// What the conversion dropped or changed, in the words Istio's status uses.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl Authorization {
    /// `namespace/name`, as decisions and logs name it.
    pub(crate) fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Why a policy puts nothing in force on the node; `None` from [`convert`] carries one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotEnforced {
    /// `targetRef(s)`: a waypoint's.
    Waypoint,
    /// AUDIT or CUSTOM: no node enforces them.
    Unsupported(AuthzAction),
}

impl fmt::Display for NotEnforced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotEnforced::Waypoint => {
                f.write_str("targets a waypoint (targetRef): enforced there, not on the node")
            }
            NotEnforced::Unsupported(action) => {
                write!(
                    f,
                    "the node does not support the {} action",
                    action.as_str()
                )
            }
        }
    }
}

/// The `when` keys a node can match.
const L4_WHEN_KEYS: [&str; 5] = [
    "source.ip",
    "source.namespace",
    "source.principal",
    "destination.ip",
    "destination.port",
];

/// `policy` as the node enforces it, or why it enforces none of it. `root_namespace` decides a
/// selector-less policy's scope.
pub(crate) fn convert(
    policy: &AuthorizationPolicy,
    root_namespace: &str,
) -> Result<Authorization, NotEnforced> {
    if policy.targets_waypoint {
        return Err(NotEnforced::Waypoint);
    }
    let action = match policy.action {
        AuthzAction::Allow => Action::Allow,
        AuthzAction::Deny => Action::Deny,
        other => return Err(NotEnforced::Unsupported(other)),
    };
    let namespace = &policy.meta.namespace;
    let scope = match &policy.selector {
        Some(labels) => Scope::Selector(labels.clone()),
        None if namespace == root_namespace => Scope::Global,
        None => Scope::Namespace,
    };
    let mut notes = Notes::default();
    let groups = policy
        .rules
        .iter()
        .enumerate()
        .filter_map(|(i, rule)| {
            group(
                action,
                namespace,
                &rule.from,
                &rule.to,
                &rule.when,
                &mut notes.at(i),
            )
        })
        .collect();
    Ok(Authorization {
        namespace: namespace.clone(),
        name: policy.meta.name.clone(),
        scope,
        action,
        dry_run: policy.dry_run,
        groups,
        notes: notes.finish(action),
    })
}

/// What the conversion of one policy dropped: HTTP attributes by rule, and values no node can use.
#[derive(Default)]
struct Notes {
    http: Vec<(usize, Vec<String>)>,
    /// DENY rules left with a clause no connection can match: they never fire.
    inert: Vec<usize>,
    dropped: Vec<String>,
}

/// One rule's share of [`Notes`].
struct RuleNotes<'n> {
    notes: &'n mut Notes,
    rule: usize,
}

impl Notes {
    fn at(&mut self, rule: usize) -> RuleNotes<'_> {
        RuleNotes { notes: self, rule }
    }

    fn finish(self, action: Action) -> Vec<String> {
        let mut out = Vec::new();
        for (rule, fields) in self.http {
            let found = fields.join(", ");
            out.push(match action {
                Action::Allow => format!(
                    "rules[{rule}]: the node does not support HTTP attributes (found: {found}); within an ALLOW policy, rules matching HTTP attributes are omitted. This will be more restrictive than requested"
                ),
                Action::Deny if self.inert.contains(&rule) => format!(
                    "rules[{rule}]: the node does not support HTTP attributes (found: {found}); without them the rule has nothing the node can match and will have no effect"
                ),
                Action::Deny => format!(
                    "rules[{rule}]: the node does not support HTTP attributes (found: {found}); the rule is enforced without them, so it denies more than requested"
                ),
            });
        }
        out.extend(self.dropped);
        out
    }
}

impl RuleNotes<'_> {
    fn http(&mut self, field: &str) {
        let rule = self.rule;
        match self.notes.http.last_mut() {
            Some((r, fields)) if *r == rule => {
                if !fields.iter().any(|f| f == field) {
                    fields.push(field.to_string());
                }
            }
            _ => self.notes.http.push((rule, vec![field.to_string()])),
        }
    }

    fn dropped(&mut self, field: &str, value: &str, what: &str) {
        self.notes.dropped.push(format!(
            "rules[{}]: {field} {value:?} is not {what}: dropped, and a match left empty never matches",
            self.rule
        ));
    }
}

/// One rule as a group; `None` when the rule is dropped (an ALLOW rule with HTTP attributes).
fn group(
    action: Action,
    namespace: &str,
    from: &[Option<AuthzSource>],
    to: &[Option<AuthzOperation>],
    when: &[AuthzCondition],
    notes: &mut RuleNotes<'_>,
) -> Option<Group> {
    let mut http = false;
    let mut from_clause = Clause::default();
    for source in from.iter().flatten() {
        for (field, values) in [
            ("requestPrincipals", &source.request_principals),
            ("notRequestPrincipals", &source.not_request_principals),
            ("remoteIpBlocks", &source.remote_ip_blocks),
            ("notRemoteIpBlocks", &source.not_remote_ip_blocks),
        ] {
            if !values.is_empty() {
                http = true;
                notes.http(field);
            }
        }
        from_clause.matches.push(Match {
            namespaces: strings(&source.namespaces),
            not_namespaces: strings(&source.not_namespaces),
            principals: strings(&source.principals),
            not_principals: strings(&source.not_principals),
            service_accounts: accounts(namespace, &source.service_accounts),
            not_service_accounts: accounts(namespace, &source.not_service_accounts),
            source_ips: ips(&source.ip_blocks, "ipBlocks", notes),
            not_source_ips: ips(&source.not_ip_blocks, "notIpBlocks", notes),
            ..Match::default()
        });
    }
    let mut to_clause = Clause::default();
    for operation in to.iter().flatten() {
        for (field, values) in [
            ("hosts", &operation.hosts),
            ("notHosts", &operation.not_hosts),
            ("methods", &operation.methods),
            ("notMethods", &operation.not_methods),
            ("paths", &operation.paths),
            ("notPaths", &operation.not_paths),
        ] {
            if !values.is_empty() {
                http = true;
                notes.http(field);
            }
        }
        to_clause.matches.push(Match {
            destination_ports: ports(&operation.ports, "ports", notes),
            not_destination_ports: ports(&operation.not_ports, "notPorts", notes),
            ..Match::default()
        });
    }
    let mut group = Group::default();
    for clause in [from_clause, to_clause] {
        if !clause.matches.is_empty() {
            group.clauses.push(clause);
        }
    }
    for condition in when {
        let Some(m) = when_match(condition, notes) else {
            http = true;
            notes.http(&format!("when {}", condition.key));
            // In a DENY rule the condition stays as a match that never holds.
            group.clauses.push(Clause {
                matches: vec![Match::default()],
            });
            continue;
        };
        group.clauses.push(Clause { matches: vec![m] });
    }
    // A clause whose every match is empty never holds: the rule never fires.
    if http
        && group
            .clauses
            .iter()
            .any(|c| c.matches.iter().all(Match::is_empty))
    {
        notes.notes.inert.push(notes.rule);
    }
    (!(http && action == Action::Allow)).then_some(group)
}

/// A `when` condition on one of the five L4 keys as a match; `None` for any other key.
fn when_match(c: &AuthzCondition, notes: &mut RuleNotes<'_>) -> Option<Match> {
    let (values, not_values) = (&c.values, &c.not_values);
    let field = format!("when {}", c.key);
    let m = match c.key.as_str() {
        "source.ip" => Match {
            source_ips: ips(values, &field, notes),
            not_source_ips: ips(not_values, &field, notes),
            ..Match::default()
        },
        "source.namespace" => Match {
            namespaces: strings(values),
            not_namespaces: strings(not_values),
            ..Match::default()
        },
        "source.principal" => Match {
            principals: strings(values),
            not_principals: strings(not_values),
            ..Match::default()
        },
        "destination.ip" => Match {
            destination_ips: ips(values, &field, notes),
            not_destination_ips: ips(not_values, &field, notes),
            ..Match::default()
        },
        "destination.port" => Match {
            destination_ports: ports(values, &field, notes),
            not_destination_ports: ports(not_values, &field, notes),
            ..Match::default()
        },
        _ => return None,
    };
    debug_assert!(L4_WHEN_KEYS.contains(&c.key.as_str()));
    Some(m)
}

fn strings(values: &[String]) -> Vec<StringMatch> {
    values.iter().map(|v| StringMatch::parse(v)).collect()
}

/// `namespace/name`, or `name` alone in the policy's namespace.
fn accounts(namespace: &str, values: &[String]) -> Vec<ServiceAccount> {
    values
        .iter()
        .map(|v| match v.split_once('/') {
            Some((ns, name)) => ServiceAccount {
                namespace: ns.to_string(),
                name: name.to_string(),
            },
            None => ServiceAccount {
                namespace: namespace.to_string(),
                name: v.clone(),
            },
        })
        .collect()
}

/// An address is a network of one; a value that is neither is dropped, as Istio drops it.
fn ips(values: &[String], field: &str, notes: &mut RuleNotes<'_>) -> Vec<IpNet> {
    values
        .iter()
        .filter_map(|v| {
            let net = v
                .parse::<IpNet>()
                .ok()
                .or_else(|| v.parse::<IpAddr>().ok().map(IpNet::from));
            if net.is_none() {
                notes.dropped(field, v, "an IP address or network");
            }
            net
        })
        .collect()
}

/// A port number; anything else (a port name, past 65535) is dropped, as Istio drops it.
fn ports(values: &[String], field: &str, notes: &mut RuleNotes<'_>) -> Vec<u16> {
    values
        .iter()
        .filter_map(|v| {
            let port = v.parse::<u16>().ok();
            if port.is_none() {
                notes.dropped(field, v, "a port number");
            }
            port
        })
        .collect()
}
