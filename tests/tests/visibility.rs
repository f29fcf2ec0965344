//! What each namespace sees (`docs/data-plane.md`, `docs/dns.md`), on real traffic.
//! Real `dig` and `curl` in pods of five namespaces,
//! the agent enforcing a copy of `examples/`, dnsmasq in ext holding the public answers.
//!
//! Every check runs twice over: `redirect explain` over the same manifests says what a client gets and
//! the agent must do exactly that (`World::check_*`), and explain's answer must be the one the rules in `docs/` give, written
//! out in each test. A bug in either one fails the test.
//!
//! Every check also runs from each kind of client socket: a connection to an IPv4 address is made
//! from an `AF_INET` socket and again from an `AF_INET6` one to its v4-mapped form (`curl
//! http://[::ffff:IP]/`), with `getpeername()` checked on both; a DNS question is asked at the
//! resolver's IPv4 address, its v4-mapped form and its IPv6 address. All must get the same.
use std::net::{IpAddr, SocketAddrV4};

use anyhow::Result;
use integration::explain::{DnsAction, DnsVerdict, OutboundOutcome, OutboundVerdict};
use integration::world::{Reach, World, delta, key};
use integration::{RESOLVER_IP, RESOLVER_IP6, peer};

const EVERYONE: [&str; 5] = ["team-a", "team-b", "team-c", "istio-system", "quarantine"];

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// The rules: the agent answers for `service` with `addresses`.
fn spec_answer(v: &DnsVerdict, service: &str, addresses: &[&str]) {
    let want: Vec<IpAddr> = addresses.iter().map(|a| a.parse().unwrap()).collect();
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    assert_eq!(v.service.as_deref(), Some(service), "{}", v.json);
    assert_eq!(v.addresses, want, "{}", v.json);
}

/// The rules: the query goes upstream; `hidden` is the service it skipped, if any.
fn spec_forward(v: &DnsVerdict, hidden: Option<&str>) {
    assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
    assert_eq!(v.service, None, "{}", v.json);
    assert_eq!(v.hidden.as_deref(), hidden, "{}", v.json);
}

/// The rules (`docs/visibility.md#address-allocation`): an allocated address: v4 from 240.240.0.0/16, v6 from 2001:2::/48.
fn spec_answer_allocated(v: &DnsVerdict, service: &str) {
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    assert_eq!(v.service.as_deref(), Some(service), "{}", v.json);
    let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = v.addresses.iter().partition(|a| a.is_ipv4());
    assert!(
        matches!(v4[..], [IpAddr::V4(a)] if a.octets()[..2] == [240, 240]),
        "{}",
        v.json
    );
    assert!(
        matches!(v6[..], [IpAddr::V6(a)] if a.segments()[..3] == [0x2001, 2, 0]),
        "{}",
        v.json
    );
}

/// The rules: the outbound decision and who answers.
fn spec_outbound(
    got: &(OutboundVerdict, Reach),
    action: OutboundOutcome,
    service: Option<&str>,
    reach: Reach,
) {
    let (v, r) = got;
    assert_eq!(v.action, action, "{}", v.json);
    assert_eq!(v.service.as_deref(), service, "{}", v.json);
    assert_eq!(*r, reach, "{}", v.json);
}

#[test]
fn namespace_entry_is_answered_in_its_namespace_and_forwarded_upstream_elsewhere() -> Result<()> {
    let w = World::start()?;
    // The public answer differs from the entry's, so the replies below tell who answered.
    assert_eq!(
        w.dig_upstream("api.example.com.")?.a_records(),
        ["203.0.113.110".parse::<std::net::Ipv4Addr>()?]
    );

    // A over UDP and TCP, and AAAA (the entry has no IPv6 address: an empty NOERROR from the agent,
    // whatever the upstream says).
    for tcp in [false, true] {
        let (v, _) = w.check_dig_with("team-a", "api.example.com", "A", tcp)?;
        spec_answer(&v, "team-a/api-example", &["203.0.113.10"]);
        for ns in &EVERYONE[1..] {
            let (v, reply) = w.check_dig_with(ns, "api.example.com", "A", tcp)?;
            spec_forward(&v, Some("team-a/api-example"));
            assert_eq!(reply.status, "NOERROR");
        }
    }
    let (_, reply) = w.check_dig_with("team-a", "api.example.com", "AAAA", false)?;
    assert_eq!((reply.status.as_str(), reply.answer.len()), ("NOERROR", 0));
    let (v, _) = w.check_dig_with("team-b", "api.example.com", "AAAA", false)?;
    spec_forward(&v, Some("team-a/api-example"));
    // With the pod's search path (ndots 5), the first expansion is answered with a CNAME.
    let (v, _) = w.check_dig_search("team-a", "api.example.com")?;
    spec_answer(&v, "team-a/api-example", &["203.0.113.10"]);
    assert_eq!(v.query, "api.example.com.team-a.svc.cluster.local.");
    assert_eq!(v.cname.as_deref(), Some("api.example.com"));

    // A hidden name that does not exist upstream: the upstream's own NXDOMAIN.
    let (v, reply) = w.check_dig("team-a", "payments.example.com")?;
    spec_forward(&v, Some("team-b/payments"));
    assert_eq!(reply.status, "NXDOMAIN", "{reply:#?}");
    let (v, _) = w.check_dig("team-b", "payments.example.com")?;
    spec_answer(&v, "team-b/payments", &["203.0.113.70"]);
    // A name nobody defines.
    let (v, reply) = w.check_dig("team-b", "nothing-here.example.com")?;
    spec_forward(&v, None);
    assert_eq!(reply.status, "NXDOMAIN", "{reply:#?}");

    // glibc (curl) asks with the search path first; both sides reach what they resolved.
    let got = w.check_host("team-a", "api.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-a/api-example"),
        Reach::server("api-endpoint"),
    );
    let got = w.check_host("team-b", "api.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Passthrough,
        None,
        Reach::server("public-api"),
    );
    Ok(())
}

#[test]
fn namespace_entry_address_reaches_its_endpoint_inside_and_the_real_host_outside() -> Result<()> {
    let w = World::start()?;
    let dest = addr("203.0.113.10:80");
    let got = w.check_connect("team-a", dest)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-a/api-example"),
        Reach::server("api-endpoint"),
    );
    for ns in &EVERYONE[1..] {
        let got = w.check_connect(ns, dest)?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("real-203.0.113.10"),
        );
        assert_eq!(got.0.hidden.as_deref(), Some("team-a/api-example"));
    }
    // Not secrecy: the agent's dump still shows the entry, with its visibility.
    let dump = w.config_dump()?;
    let entry = dump["services"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["name"] == "api-example"));
    assert_eq!(
        entry.map(|s| (&s["namespace"], &s["visibility"], &s["vips"])),
        Some((
            &"team-a".into(),
            &"Namespace".into(),
            &serde_json::json!(["203.0.113.10"])
        )),
        "{dump:#}"
    );
    Ok(())
}

#[test]
fn public_entries_from_istio_system_and_the_trusted_namespace_are_served_everywhere() -> Result<()>
{
    let w = World::start()?;
    for ns in EVERYONE {
        // istio-system (policy 0): an entry with an endpoint address.
        let (v, _) = w.check_dig(ns, "metrics.example.com")?;
        spec_answer(&v, "istio-system/metrics", &["203.0.113.30"]);
        // No IPv6 address: an empty NOERROR, not NXDOMAIN.
        let (_, reply) = w.check_dig_with(ns, "metrics.example.com", "AAAA", false)?;
        assert_eq!((reply.status.as_str(), reply.answer.len()), ("NOERROR", 0));
        let got = w.check_host(ns, "metrics.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("istio-system/metrics"),
            Reach::server("metrics-endpoint"),
        );
        // A wildcard host.
        let (v, _) = w.check_dig(ns, "x.apps.example.com")?;
        spec_answer(&v, "istio-system/apps", &["203.0.113.90"]);
        let got = w.check_host(ns, "x.apps.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("istio-system/apps"),
            Reach::server("apps-endpoint"),
        );
        // Resolution DNS: the endpoint's host name is resolved through the upstream.
        let (v, _) = w.check_dig(ns, "cdn.example.com")?;
        spec_answer(&v, "istio-system/cdn", &["203.0.113.60"]);
        let got = w.check_host(ns, "cdn.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("istio-system/cdn"),
            Reach::server("origin"),
        );
        // No addresses: an allocated VIP; no endpoints: the host itself, resolved upstream.
        let (v, _) = w.check_dig(ns, "httpbin.example.com")?;
        spec_answer_allocated(&v, "istio-system/httpbin");
        let (_, reply) = w.check_dig_with(ns, "httpbin.example.com", "AAAA", false)?;
        assert!(
            matches!(reply.addresses()[..], [IpAddr::V6(a)] if a.segments()[..3] == [0x2001, 2, 0]),
            "{reply:#?}"
        );
        let got = w.check_host(ns, "httpbin.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("istio-system/httpbin"),
            Reach::server("public-httpbin"),
        );
        // team-c is labelled trusted (policy 1): its VM-backed entry on an allocated VIP.
        let (v, _) = w.check_dig(ns, "legacy.example.internal")?;
        spec_answer_allocated(&v, "team-c/legacy");
        let got = w.check_host(ns, "legacy.example.internal", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("team-c/legacy"),
            Reach::server("legacy-vm"),
        );
        // team-c's CIDR entry with resolution NONE: the original destination, counted as passthrough.
        let got = w.check_connect(ns, addr("198.51.100.200:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            Some("team-c/partner-net"),
            Reach::server("partner-host"),
        );
    }
    Ok(())
}

#[test]
fn none_entry_is_absent_for_every_namespace_its_own_included() -> Result<()> {
    let w = World::start()?;
    for ns in EVERYONE {
        let (v, reply) = w.check_dig(ns, "login.example.com")?;
        // Not even "hidden": it never reached the data plane.
        spec_forward(&v, None);
        assert_eq!(
            reply.a_records(),
            ["203.0.113.150".parse::<std::net::Ipv4Addr>()?]
        );
        let got = w.check_host(ns, "login.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("public-login"),
        );
        // Its address is unknown traffic: passthrough to whatever really is there.
        let got = w.check_connect(ns, addr("203.0.113.50:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("real-203.0.113.50"),
        );
        assert_eq!(got.0.hidden, None, "{}", got.0.json);
    }
    // Nor is it in the agent's configuration dump.
    let dump = w.config_dump()?;
    let services = dump["services"].as_array().expect("services list");
    assert!(
        !services.is_empty() && !services.iter().any(|s| s["name"] == "login-hijack"),
        "{dump:#}"
    );
    Ok(())
}

#[test]
fn shared_host_name_own_namespace_first_public_definition_elsewhere() -> Result<()> {
    let w = World::start()?;
    let (v, _) = w.check_dig("team-b", "shared.example.com")?;
    spec_answer(&v, "team-b/shared-private", &["203.0.113.41"]);
    let got = w.check_host("team-b", "shared.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-b/shared-private"),
        Reach::server("shared-private-endpoint"),
    );
    for ns in ["team-a", "team-c", "istio-system", "quarantine"] {
        let (v, _) = w.check_dig(ns, "shared.example.com")?;
        spec_answer(&v, "team-c/shared-public", &["203.0.113.40"]);
        let hidden = (ns != "team-c").then_some("team-b/shared-private");
        assert_eq!(
            v.hidden.as_deref(),
            hidden.or(v.hidden.as_deref()),
            "{}",
            v.json
        );
        let got = w.check_host(ns, "shared.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("team-c/shared-public"),
            Reach::server("shared-public-endpoint"),
        );
        // team-b's private address is unknown traffic here.
        let got = w.check_connect(ns, addr("203.0.113.41:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("real-203.0.113.41"),
        );
    }
    // The public definition's address still serves team-b: only the name is shadowed there.
    let got = w.check_connect("team-b", addr("203.0.113.40:80"))?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-c/shared-public"),
        Reach::server("shared-public-endpoint"),
    );
    Ok(())
}

#[test]
fn kubernetes_service_by_short_name_and_fqdn_from_every_namespace() -> Result<()> {
    // examples/ sets defaultVisibility NAMESPACE: Services stay Public regardless.
    let w = World::start()?;
    let fqdn = "web.team-a.svc.cluster.local";
    for ns in EVERYONE {
        let (v, _) = w.check_dig(ns, fqdn)?;
        spec_answer(&v, "team-a/web", &["10.244.100.10"]);
        // `web.team-a`: the resolver's first try (the client's own namespace domain appended) is
        // answered, with a CNAME to the FQDN that holds the records.
        let (v, reply) = w.check_dig_search(ns, "web.team-a")?;
        spec_answer(&v, "team-a/web", &["10.244.100.10"]);
        assert_eq!(v.query, format!("web.team-a.{ns}.svc.cluster.local."));
        assert_eq!(reply.cnames(), [fqdn]);
        assert_eq!(reply.answer[1].name, format!("{fqdn}."));
        for host in [fqdn, "web.team-a"] {
            let got = w.check_host(ns, host, 80)?;
            spec_outbound(
                &got,
                OutboundOutcome::Service,
                Some("team-a/web"),
                Reach::server("web-1"),
            );
        }
    }
    // The backing pod's own address: no service claims it, so the workload directly.
    for ns in EVERYONE {
        let got = w.check_connect(ns, addr("10.244.1.20:8080"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Workload,
            None,
            Reach::server("web-1"),
        );
    }
    // The bare short name inside its own namespace (first search domain).
    let (v, _) = w.check_dig_search("team-a", "web")?;
    spec_answer(&v, "team-a/web", &["10.244.100.10"]);
    let got = w.check_host("team-a", "web", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-a/web"),
        Reach::server("web-1"),
    );
    Ok(())
}

/// Upstream's corner rules on real traffic: one namespace one host (a newer duplicate and an entry
/// camping on a Service's name in its namespace are not published), `discoverySelectors` (a namespace
/// left out does not exist for the data plane), and partial Kubernetes names answered at the first try.
const CORNERS: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: legacy, labels: {trusted: \"true\", mesh-discovery: \"off\"}}
---
# Not discovered: older than team-c's public shared.example.com, it would win that name mesh-wide.
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: shared-legacy, namespace: legacy, creationTimestamp: \"2020-01-01T00:00:00Z\"}
spec: {hosts: [shared.example.com, legacy-only.example.com], addresses: [203.0.113.80], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.50}]}
---
# A newer definition of team-b's own shared.example.com: not published.
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: shared-private-copy, namespace: team-b, creationTimestamp: \"2030-01-01T00:00:00Z\"}
spec: {hosts: [shared.example.com], addresses: [203.0.113.50], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.41}]}
";

#[test]
fn upstream_corners_one_host_per_namespace_discovery_selectors_and_partial_names() -> Result<()> {
    let w = World::start_with(|dir| {
        std::fs::write(dir.join("40-corners.yaml"), CORNERS)?;
        integration::world::edit_file(
            dir,
            "01-mesh-config.yaml",
            "    serviceEntryVisibility:\n",
            "    discoverySelectors:\n      - matchExpressions: [{key: mesh-discovery, operator: NotIn, values: [\"off\"]}]\n    serviceEntryVisibility:\n",
        )
    })?;
    // One namespace, one host: team-b's older entry answers; the newer one's address is nobody's.
    let (v, _) = w.check_dig("team-b", "shared.example.com")?;
    spec_answer(&v, "team-b/shared-private", &["203.0.113.41"]);
    for ns in ["team-a", "team-b"] {
        let got = w.check_connect(ns, addr("203.0.113.50:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("real-203.0.113.50"),
        );
    }
    // An undiscovered namespace takes part in nothing: not in a ranking, not in DNS, not in routing.
    let (v, _) = w.check_dig("team-a", "shared.example.com")?;
    spec_answer(&v, "team-c/shared-public", &["203.0.113.40"]);
    let got = w.check_host("team-a", "shared.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-c/shared-public"),
        Reach::server("shared-public-endpoint"),
    );
    for ns in ["team-a", "team-b"] {
        let (v, reply) = w.check_dig(ns, "legacy-only.example.com")?;
        spec_forward(&v, None);
        assert_eq!(reply.status, "NXDOMAIN", "{reply:#?}");
        let got = w.check_connect(ns, addr("203.0.113.80:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            None,
            Reach::server("real-203.0.113.80"),
        );
    }
    // Partial Kubernetes names: asked as such (dig does not search), and the resolver's first try
    // answered at once, nothing sent upstream.
    for ns in ["team-a", "team-b"] {
        for name in ["web.team-a", "web.team-a.svc"] {
            let (v, _) = w.check_dig(ns, name)?;
            spec_answer(&v, "team-a/web", &["10.244.100.10"]);
        }
        let before = w.agent.metrics()?;
        let (v, _) = w.check_dig_search(ns, "web.team-a")?;
        assert_eq!(v.query, format!("web.team-a.{ns}.svc.cluster.local."));
        let got = w.check_host(ns, "web.team-a", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("team-a/web"),
            Reach::server("web-1"),
        );
        let after = w.agent.metrics()?;
        assert_eq!(
            delta(&before, &after, key::DNS_FORWARDED),
            0.0,
            "{after:#?}"
        );
    }
    // A bare name only from its own namespace.
    let (v, _) = w.check_dig("team-a", "web")?;
    spec_answer(&v, "team-a/web", &["10.244.100.10"]);
    let (v, _) = w.check_dig("team-b", "web")?;
    spec_forward(&v, None);
    Ok(())
}

/// A mesh config that sets other things, but not serviceEntryVisibility.
const NO_VISIBILITY: &str = "\
apiVersion: install.istio.io/v1alpha1
kind: IstioOperator
spec:
  meshConfig:
    trustDomain: cluster.local
    defaultServiceExportTo: [\"*\"]
";

#[test]
fn feature_unset_every_entry_is_public() -> Result<()> {
    // The same manifests, the mesh config without serviceEntryVisibility.
    let w = World::start_with(|dir| {
        Ok(std::fs::write(
            dir.join("01-mesh-config.yaml"),
            NO_VISIBILITY,
        )?)
    })?;
    for ns in EVERYONE {
        let (v, _) = w.check_dig(ns, "api.example.com")?;
        spec_answer(&v, "team-a/api-example", &["203.0.113.10"]);
        let got = w.check_connect(ns, addr("203.0.113.10:80"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("team-a/api-example"),
            Reach::server("api-endpoint"),
        );
        // Even the quarantined entry: without the feature nothing is NONE.
        let (v, _) = w.check_dig(ns, "login.example.com")?;
        spec_answer(&v, "quarantine/login-hijack", &["203.0.113.50"]);
        let got = w.check_host(ns, "login.example.com", 80)?;
        spec_outbound(
            &got,
            OutboundOutcome::Service,
            Some("quarantine/login-hijack"),
            Reach::server("login-hijack-endpoint"),
        );
        let (v, _) = w.check_dig(ns, "payments.example.com")?;
        spec_answer(&v, "team-b/payments", &["203.0.113.70"]);
        // Both copies of the shared name are Public: own namespace first, then the older one.
        let (v, _) = w.check_dig(ns, "shared.example.com")?;
        if ns == "team-b" {
            spec_answer(&v, "team-b/shared-private", &["203.0.113.41"]);
        } else {
            spec_answer(&v, "team-c/shared-public", &["203.0.113.40"]);
        }
    }
    let dump = w.config_dump()?;
    assert_eq!(
        dump["serviceEntryVisibility"]["configured"], false,
        "{dump:#}"
    );
    let services = dump["services"].as_array().expect("services list");
    assert!(
        services.iter().any(|s| s["name"] == "login-hijack")
            && services.iter().all(|s| s["visibility"] == "Public"),
        "{dump:#}"
    );
    Ok(())
}

/// A ServiceEntry whose workloads are all gone: it declares port 80, nothing serves it.
const DRAINED: &str = "\
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: drained, namespace: team-a}
spec:
  hosts: [drained.example.com]
  addresses: [203.0.113.80]
  ports:
    - {number: 80, name: http}
  resolution: STATIC
  workloadSelector:
    labels: {app: nothing-matches}
";

#[test]
fn no_endpoint_for_the_port_resets_the_client_at_once() -> Result<()> {
    let w = World::start_with(|dir| Ok(std::fs::write(dir.join("90-drained.yaml"), DRAINED)?))?;
    // The port is not declared by the visible entry; elsewhere the entry is hidden: the real host.
    let got = w.check_connect("team-a", addr("203.0.113.10:443"))?;
    spec_outbound(
        &got,
        OutboundOutcome::NoHealthyUpstream,
        Some("team-a/api-example"),
        Reach::Reset,
    );
    let got = w.check_connect("team-b", addr("203.0.113.10:443"))?;
    spec_outbound(
        &got,
        OutboundOutcome::Passthrough,
        None,
        Reach::server("real-203.0.113.10"),
    );
    // The port is declared but no endpoint serves it.
    let got = w.check_connect("team-a", addr("203.0.113.80:80"))?;
    spec_outbound(
        &got,
        OutboundOutcome::NoHealthyUpstream,
        Some("team-a/drained"),
        Reach::Reset,
    );
    let got = w.check_connect("team-b", addr("203.0.113.80:80"))?;
    spec_outbound(
        &got,
        OutboundOutcome::Passthrough,
        None,
        Reach::server("real-203.0.113.80"),
    );
    Ok(())
}

/// A resolution NONE entry sends every port to the original destination, declared or not, as
/// ztunnel's find_upstream does (Istio's github.yaml declares port 22 only; HTTPS must still work).
#[test]
fn resolution_none_entry_passes_every_port_through() -> Result<()> {
    let w = World::start()?;
    for ns in EVERYONE {
        let got = w.check_connect(ns, addr("198.51.100.200:22"))?;
        spec_outbound(
            &got,
            OutboundOutcome::Passthrough,
            Some("team-c/partner-net"),
            Reach::server("partner-host"),
        );
    }
    Ok(())
}

#[test]
fn a_pod_the_manifests_do_not_know_sees_public_services_only() -> Result<()> {
    let mut w = World::start()?;
    // In team-b's address range, with team-b's search path: neither makes it a team-b client.
    w.add_stranger("team-b/stranger", "10.244.2.99", "unregistered")?;
    let me = "unregistered";
    let (v, _) = w.check_dig(me, "shared.example.com")?;
    spec_answer(&v, "team-c/shared-public", &["203.0.113.40"]);
    let (v, _) = w.check_dig(me, "payments.example.com")?;
    spec_forward(&v, Some("team-b/payments"));
    let (v, _) = w.check_dig(me, "metrics.example.com")?;
    spec_answer(&v, "istio-system/metrics", &["203.0.113.30"]);
    let got = w.check_host(me, "shared.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundOutcome::Service,
        Some("team-c/shared-public"),
        Reach::server("shared-public-endpoint"),
    );
    let got = w.check_connect(me, addr("203.0.113.41:80"))?;
    spec_outbound(
        &got,
        OutboundOutcome::Passthrough,
        None,
        Reach::server("real-203.0.113.41"),
    );
    Ok(())
}

/// What `rdt-peer dns-unconnected` printed: the reply's source, rcode, aa, A records.
fn unconnected_query(
    w: &World,
    from: &str,
    resolver: &str,
    name: &str,
) -> Result<(String, String, String, Vec<IpAddr>)> {
    let out = peer::cmd(w.client(from).place())?
        .args(["dns-unconnected", resolver, name])
        .ok()?
        .stdout_str();
    let field = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .unwrap_or_default()
            .to_string()
    };
    let a = out
        .lines()
        .filter_map(|l| l.strip_prefix("A ")?.parse().ok())
        .collect();
    Ok((field("from"), field("rcode"), field("aa"), a))
}

#[test]
fn unconnected_udp_dns_clients_are_answered_as_from_the_resolver_they_asked() -> Result<()> {
    // glibc and dig connect() first; other resolvers use sendto/recvfrom on an unconnected socket,
    // IPv4 or IPv6 (a JVM's is IPv6 and asks an IPv4 resolver at its v4-mapped address).
    let w = World::start()?;
    let resolvers = [
        format!("{RESOLVER_IP}:53"),
        format!("[::ffff:{RESOLVER_IP}]:53"),
        format!("[{RESOLVER_IP6}]:53"),
    ];
    for (from, name, resolver) in ["team-a", "team-b"]
        .into_iter()
        .flat_map(|from| resolvers.iter().map(move |r| (from, "api.example.com.", r)))
    {
        let v = w.explain().host(from, name)?;
        let before = w.agent.metrics()?;
        let (src, rcode, _, a) = unconnected_query(&w, from, resolver, name)?;
        let after = w.agent.metrics()?;
        assert_eq!(
            &src, resolver,
            "recvfrom must report the resolver asked, from {from}"
        );
        assert_eq!(rcode, "0");
        let want: Vec<IpAddr> = match v.action {
            DnsAction::Answer => v.addresses.clone(),
            DnsAction::Forward => w.dig_upstream(&v.query)?.addresses(),
        };
        assert_eq!(a, want, "from {from}: {}", v.json);
        let counter = match v.action {
            DnsAction::Answer => key::DNS_ANSWERED,
            DnsAction::Forward => key::DNS_FORWARDED,
        };
        assert_eq!(
            delta(&before, &after, counter),
            1.0,
            "steered to the agent: {after:#?}"
        );
    }
    // The rules: team-a's own entry, team-b the upstream's answer.
    let resolver = &resolvers[0];
    let (_, _, aa, a) = unconnected_query(&w, "team-a", resolver, "api.example.com.")?;
    assert_eq!(
        (aa.as_str(), a),
        ("true", vec!["203.0.113.10".parse::<IpAddr>()?])
    );
    let (_, _, _, a) = unconnected_query(&w, "team-b", resolver, "api.example.com.")?;
    assert_eq!(a, vec!["203.0.113.110".parse::<IpAddr>()?]);
    Ok(())
}
