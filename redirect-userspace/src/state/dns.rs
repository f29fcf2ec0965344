//! The DNS decision (`docs/dns.md#authoritative-answers`): answer a name a visible service owns, forward everything else.
//!
//! Queries arrive as the client's resolver sends them, search domain appended
//! (`api.example.com.team-a.svc.cluster.local.`), any case, trailing dot or not. As ztunnel does,
//! the name is tried as asked, then with each of the client's search domains stripped; a match
//! after stripping is answered with a CNAME to the stripped name plus its records.
//!
//! Each of those names that has the shape of a partial Kubernetes name (`<name>`, `<name>.<ns>`,
//! `<name>.<ns>.svc`) is also tried in its full form `<name>.<ns>.svc.<domain>` (a bare name in
//! the client's own namespace), against exact host names: `web.team-a.team-b.svc.cluster.local`,
//! the first query a team-b resolver sends for `web.team-a`, is answered at once with a CNAME to
//! `web.team-a.svc.cluster.local` and its records.
use std::{
    io::{Cursor, Write},
    net::{Ipv4Addr, Ipv6Addr},
};

use super::{Snapshot, service::Service};

/// Longest DNS name in presentation form, without the trailing dot.
const MAX_NAME: usize = 253;

#[derive(Debug, Clone, Copy)]
pub enum DnsDecision<'a, 'q> {
    Answer(DnsAnswer<'a, 'q>),
    /// Send the query to the upstream resolver and relay its answer unchanged.
    Forward {
        hidden: Option<&'a Service>,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct DnsAnswer<'a, 'q> {
    pub service: &'a Service,
    /// The query name without its trailing dot, as asked (owner of the CNAME or of the records).
    pub name: &'q str,
    /// When a search domain was stripped: the CNAME target (the name without the search domain,
    /// or its full Kubernetes form).
    pub cname: Option<&'q str>,
    /// A hidden service skipped on the way, if any.
    pub hidden: Option<&'a Service>,
}

impl<'a> DnsAnswer<'a, '_> {
    /// A records. Empty (with `v6` not empty or both empty) means an empty NOERROR answer for A.
    pub fn v4(&self) -> &'a [Ipv4Addr] {
        &self.service.vips_v4
    }

    pub fn v6(&self) -> &'a [Ipv6Addr] {
        &self.service.vips_v6
    }

    /// The owner name of the address records: the CNAME target, or the query name.
    pub fn record_name(&self) -> &str {
        self.cname.unwrap_or(self.name)
    }
}

impl<'a> DnsDecision<'a, '_> {
    /// The service whose addresses answer, when the agent answers.
    pub fn service(&self) -> Option<&'a Service> {
        match self {
            DnsDecision::Answer(a) => Some(a.service),
            DnsDecision::Forward { .. } => None,
        }
    }

    pub fn hidden(&self) -> Option<&'a Service> {
        match self {
            DnsDecision::Answer(a) => a.hidden,
            DnsDecision::Forward { hidden } => *hidden,
        }
    }
}

/// The search path of a pod in a namespace (`<ns>.svc.<domain> svc.<domain> <domain>`, ndots 5),
/// as Kubernetes writes it into the pod's resolv.conf.
#[derive(Debug, Clone, Copy)]
pub struct SearchDomains<'a> {
    namespace: Option<&'a str>,
    domain: &'a str,
}

/// glibc's default in a Kubernetes pod: names with fewer dots are tried with the search list first.
pub(super) const NDOTS: usize = 5;

impl<'a> SearchDomains<'a> {
    /// `namespace` `None`: a client that is not a known workload; its namespace domain is unknown.
    pub fn new(namespace: Option<&'a str>, domain: &'a str) -> Self {
        SearchDomains { namespace, domain }
    }

    pub fn list(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(ns) = self.namespace {
            out.push(format!("{ns}.svc.{}", self.domain));
        }
        out.push(format!("svc.{}", self.domain));
        out.push(self.domain.to_string());
        out
    }

    /// The names to look up for a query name (lower case, no trailing dot): each search domain the
    /// name ends with, stripped, most specific first. Allocation-free.
    pub fn strip<'n>(&self, name: &'n str) -> impl Iterator<Item = &'n str> + use<'n, 'a> {
        let domain = self.domain;
        let ns = self
            .namespace
            .and_then(|ns| strip_labels(name, &[ns, "svc", domain]));
        let svc = strip_labels(name, &["svc", domain]);
        let cluster = strip_labels(name, &[domain]);
        [ns, svc, cluster].into_iter().flatten()
    }

    /// The queries a pod's resolver sends for `name`, in order, like glibc: an absolute name (trailing
    /// dot) as is; a name with fewer than [`NDOTS`] dots with each search domain first, then as is.
    pub fn expand(&self, name: &str) -> Vec<String> {
        if let Some(absolute) = name.strip_suffix('.') {
            return vec![format!("{absolute}.")];
        }
        let searched = self.list().into_iter().map(|d| format!("{name}.{d}."));
        let as_is = std::iter::once(format!("{name}."));
        if name.matches('.').count() >= NDOTS {
            as_is.chain(searched).collect()
        } else {
            searched.chain(as_is).collect()
        }
    }
}

/// The full Kubernetes form of a partial name, written into `buf`: `<name>` in the client's
/// namespace, `<name>.<ns>`, `<name>.<ns>.svc`, each completed to `<name>.<ns>.svc.<domain>`
/// (ztunnel's `to_kube_fqdns`, for services). `None` for any other shape or a name too long.
fn kube_full_name<'b>(
    name: &str,
    client_ns: Option<&str>,
    domain: &str,
    buf: &'b mut [u8; MAX_NAME],
) -> Option<&'b str> {
    let mut out = Cursor::new(&mut buf[..]);
    let written = match name.split('.').count() {
        1 => write!(out, "{name}.{}.svc.{domain}", client_ns?),
        2 => write!(out, "{name}.svc.{domain}"),
        3 if name.ends_with(".svc") => write!(out, "{name}.{domain}"),
        _ => return None,
    };
    written.ok()?;
    let len = usize::try_from(out.position()).ok()?;
    std::str::from_utf8(&buf[..len]).ok()
}

/// `name` without the trailing labels `suffix` (`a.b.svc.cluster.local` - [`b`,`svc`,`cluster.local`]
/// = `a`); `None` when it does not end with them or nothing would be left.
fn strip_labels<'n>(name: &'n str, suffix: &[&str]) -> Option<&'n str> {
    let mut rest = name;
    for part in suffix.iter().rev() {
        rest = rest.strip_suffix(part)?.strip_suffix('.')?;
    }
    (!rest.is_empty()).then_some(rest)
}

impl Snapshot {
    /// The search domains of a client namespace under this snapshot's cluster domain.
    pub fn search_domains<'s>(&'s self, client_ns: Option<&'s str>) -> SearchDomains<'s> {
        SearchDomains::new(client_ns, &self.cluster_domain)
    }

    /// The DNS decision for a query of `qname` (of any type but the meta types) from a client in
    /// `client_ns`. Allocation-free:
    /// the name is lower-cased, and a full Kubernetes name written, into stack buffers.
    pub fn decide_dns<'a: 'q, 'q>(
        &'a self,
        client_ns: Option<&str>,
        qname: &'q str,
    ) -> DnsDecision<'a, 'q> {
        let name = qname.strip_suffix('.').unwrap_or(qname);
        if name.is_empty() || name.len() > MAX_NAME {
            return DnsDecision::Forward { hidden: None };
        }
        let mut buf = [0u8; MAX_NAME];
        let lower = &mut buf[..name.len()];
        lower.copy_from_slice(name.as_bytes());
        lower.make_ascii_lowercase();
        // Lower-casing ASCII keeps UTF-8 valid and every byte offset the same as in `name`.
        let Ok(lower) = std::str::from_utf8(lower) else {
            return DnsDecision::Forward { hidden: None };
        };
        let search = SearchDomains::new(client_ns, &self.cluster_domain);
        let mut hidden = None;
        let aliases = std::iter::once((lower, false)).chain(search.strip(lower).map(|s| (s, true)));
        for (alias, stripped) in aliases {
            let choice = self.services.by_host(alias, client_ns);
            hidden = hidden.or(choice.hidden);
            if let Some(service) = choice.service {
                return DnsDecision::Answer(DnsAnswer {
                    service,
                    name,
                    cname: stripped.then(|| &name[..alias.len()]),
                    hidden,
                });
            }
            let mut full = [0u8; MAX_NAME];
            let Some(full) = kube_full_name(alias, client_ns, &self.cluster_domain, &mut full)
            else {
                continue;
            };
            let choice = self.services.by_exact_host(full, client_ns);
            hidden = hidden.or(choice.hidden);
            if let Some(service) = choice.service {
                // Asked as a partial name: the records under that name. Built from a search
                // domain: a CNAME to the full name (the service's own) and its records.
                return DnsDecision::Answer(DnsAnswer {
                    service,
                    name,
                    cname: stripped.then_some(service.hostname.as_str()),
                    hidden,
                });
            }
        }
        DnsDecision::Forward { hidden }
    }
}
