//! What a change is: the service one decision used against the service the same decision used under
//! the audit policy. `would_hide`: the enforced answer used a service the audit policy hides from
//! the client's namespace; `would_show`: the audit answer uses a service the enforced policy hides.
//! Any other difference (none can arise from visibility alone) is no change.
use std::collections::HashMap;

use serde::Serialize;

use crate::{
    config::Visibility,
    state::{Service, ServiceKind},
};

/// What was decided: a DNS answer or a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) enum Lookup {
    Dns,
    Connect,
}

impl Lookup {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Lookup::Dns => "dns",
            Lookup::Connect => "connect",
        }
    }
}

/// Which way the audit policy would change the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Direction {
    WouldHide,
    WouldShow,
}

impl Direction {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Direction::WouldHide => "would_hide",
            Direction::WouldShow => "would_show",
        }
    }
}

/// A change to one decision: the service it is about, and which way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change<'a> {
    pub service_namespace: &'a str,
    pub service: &'a str,
    pub direction: Direction,
}

/// The ServiceEntries whose visibility the audit policy changes, by namespace then name: the
/// enforced visibility, then the audit one. An entry absent here is seen alike under both.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Differs(HashMap<String, HashMap<String, (Visibility, Visibility)>>);

impl Differs {
    pub(crate) fn new(
        entries: impl IntoIterator<Item = ((String, String), (Visibility, Visibility))>,
    ) -> Differs {
        let mut by_namespace: HashMap<String, HashMap<String, _>> = HashMap::new();
        for ((namespace, name), both) in entries {
            by_namespace
                .entry(namespace)
                .or_default()
                .insert(name, both);
        }
        Differs(by_namespace)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.0.values().map(HashMap::len).sum()
    }

    pub(crate) fn contains(&self, service: &Service) -> bool {
        self.of(service).is_some()
    }

    /// The two visibilities of `service`'s entry, if they differ. A Kubernetes Service is PUBLIC
    /// under any policy.
    fn of(&self, service: &Service) -> Option<(Visibility, Visibility)> {
        if service.kind != ServiceKind::ServiceEntry {
            return None;
        }
        self.0.get(&service.namespace)?.get(&service.name).copied()
    }
}

/// Whether a client of `client_ns` may see an entry of `service_ns` of this visibility.
fn visible(visibility: Visibility, service_ns: &str, client_ns: Option<&str>) -> bool {
    match visibility {
        Visibility::Public => true,
        Visibility::Namespace => client_ns == Some(service_ns),
        Visibility::None => false,
    }
}

/// The change between the service the enforced decision used and the one the audit decision used,
/// for a client of `client_ns`.
pub(crate) fn compare<'a>(
    enforced: Option<&'a Service>,
    audited: Option<&'a Service>,
    client_ns: Option<&str>,
    differs: &Differs,
) -> Option<Change<'a>> {
    let same = |a: &Service, b: &Service| {
        a.kind == b.kind
            && a.namespace == b.namespace
            && a.name == b.name
            && a.hostname == b.hostname
    };
    match (enforced, audited) {
        (None, None) => return None,
        (Some(e), Some(a)) if same(e, a) => return None,
        _ => {}
    }
    let change = |s: &'a Service, direction| Change {
        service_namespace: &s.namespace,
        service: &s.name,
        direction,
    };
    if let Some(e) = enforced
        && let Some((_, audit)) = differs.of(e)
        && !visible(audit, &e.namespace, client_ns)
    {
        return Some(change(e, Direction::WouldHide));
    }
    if let Some(a) = audited
        && let Some((now, _)) = differs.of(a)
        && !visible(now, &a.namespace, client_ns)
    {
        return Some(change(a, Direction::WouldShow));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ServiceVisibility;

    fn service(namespace: &str, name: &str, kind: ServiceKind) -> Service {
        Service {
            name: name.into(),
            namespace: namespace.into(),
            hostname: "api.example.com".into(),
            kind,
            visibility: ServiceVisibility::Public,
            resolution: crate::config::Resolution::Static,
            vips_v4: Vec::new(),
            vips_v6: Vec::new(),
            cidrs: Vec::new(),
            ports: Vec::new(),
            waypoint: None,
            waypoint_address: None,
            created: None,
            next_endpoint: Default::default(),
        }
    }

    fn differs(ns: &str, name: &str, now: Visibility, audit: Visibility) -> Differs {
        Differs::new([((ns.into(), name.into()), (now, audit))])
    }

    #[test]
    fn a_public_entry_the_audit_policy_keeps_home_would_hide_from_others_only() {
        let api = service("team-a", "api", ServiceKind::ServiceEntry);
        let d = differs("team-a", "api", Visibility::Public, Visibility::Namespace);
        let change = compare(Some(&api), None, Some("team-b"), &d).unwrap();
        assert_eq!(change.direction, Direction::WouldHide);
        assert_eq!(
            (change.service_namespace, change.service),
            ("team-a", "api")
        );
        // Its own namespace sees it under both: the answers are the same, nothing changes.
        assert_eq!(compare(Some(&api), Some(&api), Some("team-a"), &d), None);
    }

    #[test]
    fn a_hidden_entry_the_audit_policy_publishes_would_show() {
        let api = service("team-a", "api", ServiceKind::ServiceEntry);
        let d = differs("team-a", "api", Visibility::Namespace, Visibility::Public);
        let change = compare(None, Some(&api), Some("team-b"), &d).unwrap();
        assert_eq!(change.direction, Direction::WouldShow);
        // An unknown client sees what PUBLIC shows: the same.
        let change = compare(None, Some(&api), None, &d).unwrap();
        assert_eq!(change.direction, Direction::WouldShow);
    }

    #[test]
    fn one_visible_copy_replacing_another_names_the_one_hidden() {
        let theirs = service("team-c", "shared", ServiceKind::ServiceEntry);
        let own = service("team-b", "shared", ServiceKind::ServiceEntry);
        // team-c's copy is public now; under audit it is not, and team-b would get its own.
        let d = differs(
            "team-c",
            "shared",
            Visibility::Public,
            Visibility::Namespace,
        );
        let change = compare(Some(&theirs), Some(&own), Some("team-b"), &d).unwrap();
        assert_eq!(change.direction, Direction::WouldHide);
        assert_eq!(change.service_namespace, "team-c");
    }

    #[test]
    fn a_kubernetes_service_of_an_entrys_name_is_never_a_change() {
        let svc = service("team-a", "api", ServiceKind::Service);
        let d = differs("team-a", "api", Visibility::Public, Visibility::None);
        assert_eq!(compare(Some(&svc), None, Some("team-b"), &d), None);
    }

    #[test]
    fn no_entry_that_differs_no_change() {
        let api = service("team-a", "api", ServiceKind::ServiceEntry);
        assert_eq!(
            compare(Some(&api), None, Some("team-b"), &Differs::default()),
            None
        );
    }
}
