//! Issue 4: what each namespace sees, on real traffic. Real `dig` and `curl` in pods of five namespaces,
//! the agent enforcing a copy of `examples/`, dnsmasq in ext holding the public answers.
//!
//! Every check runs twice over: `redirect explain` over the same manifests says what a client gets and
//! the agent must do exactly that (`World::check_*`), and explain's answer must be the SPEC's, written
//! out in each test. A bug in either one fails the test.
use std::net::{IpAddr, SocketAddrV4};

use anyhow::Result;
use integration::explain::{DnsAction, DnsVerdict, OutboundAction, OutboundVerdict};
use integration::world::{Reach, World};

const EVERYONE: [&str; 5] = ["team-a", "team-b", "team-c", "istio-system", "quarantine"];

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// SPEC: the agent answers for `service` with `addresses`.
fn spec_answer(v: &DnsVerdict, service: &str, addresses: &[&str]) {
    let want: Vec<IpAddr> = addresses.iter().map(|a| a.parse().unwrap()).collect();
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    assert_eq!(v.service.as_deref(), Some(service), "{}", v.json);
    assert_eq!(v.addresses, want, "{}", v.json);
}

/// SPEC: the query goes upstream; `hidden` is the service it skipped, if any.
fn spec_forward(v: &DnsVerdict, hidden: Option<&str>) {
    assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
    assert_eq!(v.service, None, "{}", v.json);
    assert_eq!(v.hidden.as_deref(), hidden, "{}", v.json);
}

/// SPEC: the outbound decision and who answers.
fn spec_outbound(
    got: &(OutboundVerdict, Reach),
    action: OutboundAction,
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

    let (v, _) = w.check_dig("team-a", "api.example.com")?;
    spec_answer(&v, "team-a/api-example", &["203.0.113.10"]);
    for ns in &EVERYONE[1..] {
        let (v, reply) = w.check_dig(ns, "api.example.com")?;
        spec_forward(&v, Some("team-a/api-example"));
        assert_eq!(reply.status, "NOERROR");
    }

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
        OutboundAction::Service,
        Some("team-a/api-example"),
        Reach::server("api-endpoint"),
    );
    let got = w.check_host("team-b", "api.example.com", 80)?;
    spec_outbound(
        &got,
        OutboundAction::Passthrough,
        None,
        Reach::server("public-api"),
    );
    Ok(())
}
