//! The claimants of one key (an address, a CIDR, a host name) and the ranking rule over them.
use std::sync::Arc;

use super::service::{Service, ServiceVisibility};

/// Buckets up to this size are scanned; larger ones (a host name many namespaces define for
/// themselves) get an index so a lookup stays O(log n).
const SCAN: usize = 8;

/// Members are service positions in ascending order, which is rank order.
#[derive(Debug, Default)]
pub(crate) struct Bucket {
    members: Vec<u32>,
    index: Option<Box<Index>>,
}

#[derive(Debug)]
struct Index {
    /// The best-ranked member of each namespace, sorted by namespace.
    by_namespace: Vec<(Box<str>, u32)>,
    first_public: Option<u32>,
    /// The best-ranked NAMESPACE members of two different namespaces: one of them is from
    /// another namespace than any given client's.
    first_scoped: [Option<u32>; 2],
}

/// The outcome of ranking a bucket for one client.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Choice<'a> {
    pub service: Option<&'a Service>,
    /// When the client got no service of its own namespace: the best-ranked claimant it may not
    /// see, for the "service hidden from client" log.
    pub hidden: Option<&'a Service>,
}

impl Bucket {
    pub(super) fn push(&mut self, service: u32) {
        self.members.push(service);
    }

    pub(super) fn seal(&mut self, services: &[Arc<Service>]) {
        if self.members.len() <= SCAN {
            return;
        }
        let mut index = Index {
            by_namespace: Vec::new(),
            first_public: None,
            first_scoped: [None, None],
        };
        for &i in &self.members {
            let svc = &services[i as usize];
            if !index
                .by_namespace
                .iter()
                .any(|(ns, _)| **ns == *svc.namespace)
            {
                index.by_namespace.push((svc.namespace.as_str().into(), i));
            }
            match svc.visibility {
                ServiceVisibility::Public => {
                    index.first_public.get_or_insert(i);
                }
                ServiceVisibility::Namespace => match index.first_scoped {
                    [None, _] => index.first_scoped[0] = Some(i),
                    [Some(first), None] if services[first as usize].namespace != svc.namespace => {
                        index.first_scoped[1] = Some(i)
                    }
                    _ => {}
                },
            }
        }
        index.by_namespace.sort_by(|a, b| a.0.cmp(&b.0));
        self.index = Some(Box::new(index));
    }

    /// The ranking rule: a claimant in the client's own namespace first, then the best-ranked
    /// PUBLIC one (a Kubernetes Service, then the oldest, then `namespace/name`); NAMESPACE
    /// claimants of other namespaces are skipped, as if they did not exist.
    pub(super) fn choose<'a>(
        &self,
        services: &'a [Arc<Service>],
        client_ns: Option<&str>,
    ) -> Choice<'a> {
        let Some(index) = &self.index else {
            let mut choice = Choice::default();
            for &i in &self.members {
                let svc = &*services[i as usize];
                if client_ns == Some(svc.namespace.as_str()) {
                    return Choice {
                        service: Some(svc),
                        hidden: None,
                    };
                }
                // Not the client's own: visible only if PUBLIC (the one rule, `Service::visible_to`).
                if svc.visible_to(client_ns) {
                    choice.service.get_or_insert(svc);
                } else {
                    choice.hidden.get_or_insert(svc);
                }
            }
            return choice;
        };
        if let Some(ns) = client_ns
            && let Ok(p) = index.by_namespace.binary_search_by(|(k, _)| (**k).cmp(ns))
        {
            return Choice {
                service: Some(&*services[index.by_namespace[p].1 as usize]),
                hidden: None,
            };
        }
        Choice {
            service: index.first_public.map(|i| &*services[i as usize]),
            hidden: index
                .first_scoped
                .iter()
                .flatten()
                .map(|&i| &*services[i as usize])
                .find(|s| client_ns != Some(s.namespace.as_str())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use proptest::prelude::*;

    use super::*;
    use crate::config::Resolution;

    fn service(i: usize, ns: usize, public: bool) -> Service {
        Service {
            name: format!("s{i}"),
            namespace: format!("ns-{ns}"),
            hostname: "shared.example.com".into(),
            kind: super::super::ServiceKind::ServiceEntry,
            visibility: if public {
                ServiceVisibility::Public
            } else {
                ServiceVisibility::Namespace
            },
            resolution: Resolution::Static,
            vips_v4: vec!["203.0.113.1".parse().unwrap()],
            vips_v6: Vec::new(),
            cidrs: Vec::new(),
            ports: Vec::new(),
            waypoint: None,
            waypoint_address: None,
            created: None,
            next_endpoint: AtomicUsize::new(0),
        }
    }

    proptest! {
        /// A large bucket's index gives exactly what scanning it gives, for every client.
        #[test]
        fn index_agrees_with_scan(members in proptest::collection::vec((0..6usize, any::<bool>()), 0..30)) {
            let services: Vec<Arc<Service>> = members.iter().enumerate().map(|(i, (ns, p))| Arc::new(service(i, *ns, *p))).collect();
            let mut scanned = Bucket::default();
            let mut indexed = Bucket::default();
            for i in 0..services.len() as u32 {
                scanned.push(i);
                indexed.push(i);
            }
            indexed.seal(&services);
            let names = |c: Choice<'_>| (c.service.map(|s| s.name.clone()), c.hidden.map(|s| s.name.clone()));
            for client in (0..7).map(|n| format!("ns-{n}")) {
                let client = Some(client.as_str());
                prop_assert_eq!(names(indexed.choose(&services, client)), names(scanned.choose(&services, client)));
            }
            prop_assert_eq!(names(indexed.choose(&services, None)), names(scanned.choose(&services, None)));
        }
    }
}
