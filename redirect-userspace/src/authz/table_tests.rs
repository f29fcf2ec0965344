//! The table against the decision it compiles: unit cases written as policies a user writes, and a
//! property test holding the kernel's lookup (modelled) to `PodPolicies::decide` on random policies.
use std::net::IpAddr;

use proptest::prelude::*;
use redirect_common::inbound::{INBOUND_ALLOW, INBOUND_DENY, InboundVerdict};
use serde_json::json;

use super::*;
use crate::{
    authz::{
        NodePolicies, Verdict,
        tests::{DB, PODS, WEB, id, ip, peer, policy},
    },
    config::load_sources,
};

/// An IPv6-only Pod beside the authorization tests' Pods.
const V6_POD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: v6-1, namespace: team-c, labels: {app: v6}, uid: 00000000-0000-0000-0000-0000000000c1}
status: {podIPs: [{ip: "fd00::30"}]}
"#;

const B1: &str = "10.244.2.10";
const V6POD: &str = "fd00::30";

fn node_of(pods: &str, policies: &str) -> NodePolicies {
    let text = format!("{pods}---\n{policies}");
    let model = match load_sources([("dir/a.yaml", text.as_str())]) {
        Ok(model) => model,
        Err(e) => panic!("refused:\n{e}\n{text}"),
    };
    NodePolicies::build(&model, model.workloads.iter().map(|w| &**w))
}

fn node(policies: &str) -> NodePolicies {
    node_of(&format!("{PODS}---\n{V6_POD}"), policies)
}

/// The node's Pods as clients, each with its identity.
fn clients() -> Vec<LocalClient> {
    vec![
        LocalClient {
            ip: ip(WEB),
            identity: Some(id("team-a", "web")),
        },
        LocalClient {
            ip: ip(DB),
            identity: Some(id("team-a", "default")),
        },
        LocalClient {
            ip: ip(B1),
            identity: Some(id("team-b", "default")),
        },
        LocalClient {
            ip: ip(V6POD),
            identity: Some(id("team-c", "default")),
        },
    ]
}

fn table(n: &NodePolicies) -> InboundTable {
    InboundTable::compile(n, &clients(), usize::MAX)
}

/// Whether the table admits `src` -> `dst:port`; panics on a destination it does not guard.
fn admits(t: &InboundTable, src: &str, dst: &str, port: u16) -> bool {
    let v = (t.lookup(ip(src), ip(dst), port)).unwrap_or_else(|| panic!("{dst} not guarded"));
    v.allow == INBOUND_ALLOW
}

fn label(t: &InboundTable, src: &str, dst: &str, port: u16) -> Rule {
    let v = t.lookup(ip(src), ip(dst), port).unwrap();
    t.rules()[usize::from(v.rule)].clone()
}

/// Every lookup of `srcs` x `ports` on every guarded address, held to `decide`.
fn agrees(
    n: &NodePolicies,
    t: &InboundTable,
    clients: &[LocalClient],
    srcs: &[IpAddr],
    ports: &[u16],
) {
    for pod in n.guarded_pods() {
        for dst in &pod.ips {
            for src in srcs {
                for port in ports {
                    if let Err(e) = check(n, t, clients, *src, *dst, *port) {
                        panic!("{e}");
                    }
                }
            }
        }
    }
}

/// The model's lookup against `decide` for one connection (and against a linear LPM scan).
fn check(
    n: &NodePolicies,
    t: &InboundTable,
    clients: &[LocalClient],
    src: IpAddr,
    dst: IpAddr,
    port: u16,
) -> Result<(), String> {
    let got = t.lookup(src, dst, port);
    let scanned = scan(t, src, dst, port);
    if got != scanned {
        return Err(format!(
            "{src} -> {dst}:{port}: lookup {got:?}, linear LPM {scanned:?}"
        ));
    }
    let Some(pod) = n.pod(dst) else {
        return match got {
            None => Ok(()),
            Some(v) => Err(format!("{src} -> {dst}:{port}: unguarded, yet {v:?}")),
        };
    };
    let Some(got) = got else {
        return Err(format!("{src} -> {dst}:{port}: guarded, yet no entry"));
    };
    let label = &t.rules()[usize::from(got.rule)];
    let allowed = got.allow == INBOUND_ALLOW;
    if src.to_canonical() == IpAddr::V4(KUBELET_PROBE) {
        return (allowed && *label == Rule::KubeletProbe)
            .then_some(())
            .ok_or_else(|| format!("probe -> {dst}:{port}: {got:?} {label}"));
    }
    if t.left_out().iter().any(|p| Arc::ptr_eq(p, pod)) {
        return (!allowed && *label == Rule::LeftOut)
            .then_some(())
            .ok_or_else(|| format!("{src} -> {dst}:{port}: left out, yet {got:?} {label}"));
    }
    let identity = (clients.iter())
        .find(|c| c.ip.to_canonical() == src.to_canonical())
        .and_then(|c| c.identity.as_ref());
    let decision = pod.decide(&Conn {
        src_identity: identity,
        src_ip: src,
        dst_ip: dst.to_canonical(),
        dst_port: port,
    });
    let want = &decision.verdict;
    if allowed != want.allowed()
        || !(*label == Rule::Decided(decision.clone()) || *label == Rule::Other)
    {
        return Err(format!(
            "{src} ({identity:?}) -> {dst}:{port}: table {got:?} ({label}), decide {want}"
        ));
    }
    Ok(())
}

/// The LPM's definition, entry by entry: the longest prefix whose bits are the key's.
fn scan(t: &InboundTable, src: IpAddr, dst: IpAddr, port: u16) -> Option<InboundVerdict> {
    let lpm = |class: u16| {
        let key = inbound_bytes(&addr16(dst), class, &addr16(src));
        // Every entry fixes the destination and the class, and the entries are sorted: only the
        // run of this destination and class can match (found by bisection, to keep this quick).
        let all = &t.entries;
        let start = all.partition_point(|(k, _, _)| k[..18] < key[..18]);
        let end = all.partition_point(|(k, _, _)| k[..18] <= key[..18]);
        (all[start..end].iter())
            .filter(|(k, len, _)| mask(&key, *len) == *k)
            .max_by_key(|(_, len, _)| *len)
            .map(|(_, _, v)| *v)
    };
    lpm(port).or_else(|| lpm(OTHER_PORTS))
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| ip(s)).collect()
}

#[test]
fn deny_from_a_namespace_refuses_its_clients_and_no_other() {
    let n = node(&policy(
        "team-a",
        "deny-b",
        "{action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}]}]}",
    ));
    let t = table(&n);
    assert!(!admits(&t, B1, WEB, 8080), "team-b's client");
    assert_eq!(
        label(&t, B1, WEB, 8080),
        Rule::decided(Verdict::ExplicitlyDenied("team-a/deny-b".into()))
    );
    assert!(admits(&t, DB, WEB, 8080), "team-a's client");
    assert!(
        admits(&t, "10.244.3.3", WEB, 8080),
        "plaintext has no namespace"
    );
    assert!(admits(&t, "fd00::99", WEB, 8080), "plaintext IPv6 too");
    // The team-a Pods are guarded, team-b's not.
    assert!(t.lookup(ip(WEB), ip(B1), 80).is_none());
    let plaintext_refused = node(&policy(
        "team-a",
        "deny-not-a",
        "{action: DENY, rules: [{from: [{source: {notNamespaces: [team-a]}}]}]}",
    ));
    let t = table(&plaintext_refused);
    assert!(!admits(&t, "10.244.3.3", WEB, 8080));
    assert!(!admits(&t, "2001:db8::1", WEB, 8080));
    assert!(!admits(&t, B1, WEB, 8080));
    assert!(admits(&t, DB, WEB, 8080));
    // No address range decides otherwise: per Pod a root per family, the probe, and the two
    // team-a clients (b1 and the IPv6 Pod decide as plaintext from their address).
    assert_eq!(t.len(), 2 * 5, "{:?}", t.entries().collect::<Vec<_>>());
}

/// A dry-run policy changes no verdict, but the rule a connection hits names what it matched: a
/// team-b client's connection and a plaintext one decide alike (allowed) under two rules.
#[test]
fn a_dry_run_match_is_a_rule_of_its_own() {
    let n = node(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-b-dry, namespace: team-a, annotations: {istio.io/dry-run: \"true\"}}\nspec: {action: DENY, rules: [{from: [{source: {namespaces: [team-b]}}]}]}\n",
    );
    let t = table(&n);
    assert!(admits(&t, B1, WEB, 8080), "a dry run refuses nothing");
    let Rule::Decided(matched) = label(&t, B1, WEB, 8080) else {
        panic!("b1's connection is decided by the policies");
    };
    assert_eq!(matched.verdict, Verdict::Allowed);
    assert_eq!(matched.dry_run_matches, ["team-a/deny-b-dry (DENY)"]);
    assert_eq!(
        label(&t, "10.244.3.3", WEB, 8080),
        Rule::decided(Verdict::Allowed)
    );
}

#[test]
fn allow_by_principal_refuses_plaintext() {
    let n = node(&policy(
        "team-a",
        "only-web",
        "{selector: {matchLabels: {app: db}}, rules: [{from: [{source: {principals: [cluster.local/ns/team-a/sa/web]}}]}]}",
    ));
    let t = table(&n);
    assert!(admits(&t, WEB, DB, 5432));
    assert_eq!(
        label(&t, WEB, DB, 5432),
        Rule::decided(Verdict::AllowedBy("team-a/only-web".into()))
    );
    assert!(!admits(&t, B1, DB, 5432));
    assert!(!admits(&t, "10.9.9.9", DB, 5432));
    assert_eq!(
        label(&t, "10.9.9.9", DB, 5432),
        Rule::decided(Verdict::NotAllowed)
    );
    assert!(!admits(&t, "fd00::99", DB, 5432));
    // The selector picks db alone: web is not guarded, so the kernel lets everything through.
    assert!(t.lookup(ip(B1), ip(WEB), 80).is_none());
    assert_eq!(t.pods().len(), 1);
    assert!(t.left_out().is_empty());
}

#[test]
fn ip_blocks_decide_at_their_edges() {
    let n = node(&policy(
        "team-a",
        "ten",
        "{selector: {matchLabels: {app: web}}, rules: [{from: [{source: {ipBlocks: [10.0.0.0/8], notIpBlocks: [10.1.0.0/16]}}]}]}",
    ));
    let t = table(&n);
    for (src, want) in [
        ("10.0.0.0", true),
        ("10.0.255.255", true),
        ("10.1.0.0", false),
        ("10.1.255.255", false),
        ("10.2.0.0", true),
        ("10.255.255.255", true),
        ("9.255.255.255", false),
        ("11.0.0.0", false),
        ("0.0.0.0", false),
        ("255.255.255.255", false),
        ("::ffff:10.0.0.1", true),
        ("fd00::1", false),
    ] {
        assert_eq!(admits(&t, src, WEB, 80), want, "{src}");
    }
    let srcs = ips(&[
        "10.0.0.0",
        "10.1.0.0",
        "10.2.0.0",
        "9.255.255.255",
        "11.0.0.0",
        "::1",
    ]);
    agrees(&n, &t, &clients(), &srcs, &[80, 443]);
    // Tens of entries, not thousands: 10/8 minus 10.1/16 is 8 prefixes; the v4 root, the v6
    // root, the probe; the clients decide as plaintext from their address.
    assert_eq!(t.len(), 11, "{:?}", t.entries().collect::<Vec<_>>());
}

#[test]
fn named_ports_are_classes_and_the_rest_one() {
    let n = node(&policy(
        "team-a",
        "deny",
        "{selector: {matchLabels: {app: web}}, action: DENY, rules: [{from: [{source: {ipBlocks: [10.244.2.0/24]}}], to: [{operation: {notPorts: [\"9090\"]}}]}, {to: [{operation: {ports: [\"22\"]}}]}]}",
    ));
    let t = table(&n);
    assert!(!admits(&t, B1, WEB, 8080));
    assert!(admits(&t, B1, WEB, 9090), "notPorts");
    assert!(!admits(&t, "10.244.1.99", WEB, 22), "port 22 from anywhere");
    assert!(!admits(&t, "fd00::1", WEB, 22));
    assert!(admits(&t, "10.244.1.99", WEB, 8080));
    assert!(admits(&t, "10.244.1.99", WEB, 1));
    let classes: BTreeSet<u16> = t
        .entries()
        .map(|(k, _, _)| u16::from_be_bytes([k[16], k[17]]))
        .collect();
    assert_eq!(classes, BTreeSet::from([OTHER_PORTS, 22, 9090]));
    agrees(
        &n,
        &t,
        &clients(),
        &ips(&[B1, "10.244.2.0", "10.244.3.0", "10.244.1.255", WEB]),
        &[1, 22, 80, 9090, 65535],
    );
}

#[test]
fn a_named_port_deciding_as_the_others_takes_no_class() {
    // 8080 is named, but every source of 8080 and of any other port is allowed alike.
    let n = node(&policy(
        "team-a",
        "allow",
        "{selector: {matchLabels: {app: web}}, rules: [{to: [{operation: {ports: [\"8080\"]}}]}, {to: [{operation: {notPorts: [\"8080\"]}}]}]}",
    ));
    let t = table(&n);
    let classes: BTreeSet<u16> = t
        .entries()
        .map(|(k, _, _)| u16::from_be_bytes([k[16], k[17]]))
        .collect();
    // One policy admits every port, by one rule or the other: one verdict everywhere.
    assert_eq!(classes, BTreeSet::from([OTHER_PORTS]));
    assert!(admits(&t, "1.2.3.4", WEB, 8080));
    assert!(admits(&t, "1.2.3.4", WEB, 8081));
}

#[test]
fn the_kubelet_probe_is_admitted_under_strict() {
    let n = node(&peer("istio-system", "default", "{mtls: {mode: STRICT}}"));
    let t = table(&n);
    for dst in [WEB, DB, B1, V6POD] {
        assert!(admits(&t, "169.254.7.127", dst, 8080), "{dst}");
        assert_eq!(label(&t, "169.254.7.127", dst, 8080), Rule::KubeletProbe);
        assert!(!admits(&t, "169.254.7.126", dst, 8080));
        assert!(!admits(&t, "10.0.0.1", dst, 8080));
        assert!(admits(&t, WEB, dst, 8080), "a client with an identity");
    }
    assert_eq!(
        Rule::KubeletProbe.to_string(),
        "kubelet health probe (169.254.7.127), never decided, as upstream"
    );
    // The probe has its own label: STRICT's refusal stays the policy's.
    assert_eq!(
        label(&t, "10.0.0.1", WEB, 1),
        Rule::decided(Verdict::ExplicitlyDenied(
            "istio-system/istio_converted_static_strict".into()
        ))
    );
}

#[test]
fn a_pod_that_does_not_fit_is_refused_on_every_port_from_every_source() {
    let n = node(&format!(
        "{}{}",
        policy(
            "team-a",
            "ten",
            "{selector: {matchLabels: {app: web}}, rules: [{from: [{source: {ipBlocks: [10.0.0.0/8], notIpBlocks: [10.1.0.0/16]}}], to: [{operation: {ports: [\"80\"]}}]}]}",
        ),
        policy("team-b", "all", "{rules: [{}]}"),
    ));
    let full = table(&n);
    let web_alone = full
        .entries()
        .filter(|(k, _, _)| k[..16] == addr16(ip(WEB)))
        .count();
    let b1_alone = full.len() - web_alone;
    assert!(web_alone > b1_alone, "{web_alone} {b1_alone}");

    let tiny = InboundTable::compile(&n, &clients(), 1);
    assert_eq!(
        tiny.addresses().collect::<Vec<_>>(),
        ips(&[WEB, B1]),
        "left out, still guarded"
    );
    assert_eq!(
        tiny.len(),
        4,
        "a refusal and the probe per address: the table cannot be smaller"
    );
    assert_eq!(tiny.left_out().len(), 2);
    assert!(tiny.pods().is_empty());
    for (k, len, v) in tiny.entries() {
        assert_eq!(
            u16::from_be_bytes([k[16], k[17]]),
            OTHER_PORTS,
            "no port class"
        );
        match len {
            INBOUND_FIXED_BITS => assert_eq!(v.allow, INBOUND_DENY),
            _ => assert_eq!(
                (&k[20..], v.allow),
                (&addr16(ip("169.254.7.127"))[..], INBOUND_ALLOW)
            ),
        }
    }
    for src in ["10.0.0.1", WEB, DB, "169.254.7.126", "fd00::1", "0.0.0.0"] {
        for port in [1, 80, 443, 65535] {
            assert!(!admits(&tiny, src, WEB, port), "{src}:{port}");
            assert!(!admits(&tiny, src, B1, port), "{src}:{port}");
            assert_eq!(label(&tiny, src, WEB, port), Rule::LeftOut);
        }
    }
    assert!(
        admits(&tiny, "169.254.7.127", WEB, 8080),
        "kubelet's probes keep the Pod in service"
    );
    assert_eq!(
        Rule::LeftOut.to_string(),
        "not in the kernel's table: only the proxy's connections reach it"
    );

    // Room for b1 and web's two: the larger Pod, web, is left out.
    let some = InboundTable::compile(&n, &clients(), b1_alone + 2);
    assert_eq!(some.len(), b1_alone + 2);
    let names = |pods: &[Arc<PodPolicies>]| -> Vec<String> {
        pods.iter().map(|p| p.name.clone()).collect()
    };
    assert_eq!(names(some.left_out()), ["web-1"]);
    assert_eq!(names(some.pods()), ["b1"]);
    assert!(!admits(&some, "10.0.0.1", WEB, 80));
    assert!(admits(&some, "10.0.0.1", B1, 80));
    let srcs = ips(&["10.0.0.1", "10.1.0.0", WEB, "169.254.7.127"]);
    agrees(&n, &some, &clients(), &srcs, &[1, 80]);
    agrees(&n, &tiny, &clients(), &srcs, &[1, 80]);
}

#[test]
fn an_unguarded_destination_has_no_entry() {
    let n = node(&policy("team-b", "deny-all", "{action: DENY, rules: [{}]}"));
    let t = table(&n);
    assert!(t.lookup(ip(B1), ip(WEB), 80).is_none());
    assert!(t.lookup(ip(B1), ip("10.9.9.9"), 80).is_none());
    assert!(!admits(&t, WEB, B1, 80));
    let none = table(&node(""));
    assert_eq!(none.len(), 0);
    assert_eq!(none.addresses().len(), 0);
    assert!(none.lookup(ip(B1), ip(WEB), 80).is_none());
    let default = InboundTable::default();
    assert_eq!((default.len(), default.rules().len()), (0, 0));
    assert!(default.lookup(ip(B1), ip(WEB), 80).is_none());
}

#[test]
fn an_ipv6_pod_and_ipv6_source_ranges() {
    let n = node(&policy(
        "team-c",
        "deny",
        "{action: DENY, rules: [{from: [{source: {ipBlocks: [\"fd00:1::/32\"], notIpBlocks: [\"fd00:1:2::/48\"]}}]}]}",
    ));
    let t = table(&n);
    for (src, want) in [
        ("fd00:1::", false),
        ("fd00:1::1", false),
        ("fd00:1:ffff:ffff:ffff:ffff:ffff:ffff", false),
        ("fd00:1:2::5", true),
        ("fd00:1:1:ffff:ffff:ffff:ffff:ffff", false),
        ("fd00:1:3::", false),
        ("fd00:0:ffff:ffff:ffff:ffff:ffff:ffff", true),
        ("fd00:2::", true),
        ("::", true),
        ("10.0.0.1", true),
        ("::ffff:10.0.0.1", true),
    ] {
        assert_eq!(admits(&t, src, V6POD, 80), want, "{src}");
    }
    // Everything IPv6 refused leaves IPv4 (v4-mapped: inside ::/0) alone.
    let all6 = node(&policy(
        "team-c",
        "deny6",
        "{action: DENY, rules: [{from: [{source: {ipBlocks: [\"::/0\"]}}]}]}",
    ));
    let t = table(&all6);
    assert!(!admits(&t, "fd00::1", V6POD, 80));
    assert!(!admits(&t, "::", V6POD, 80));
    assert!(!admits(
        &t,
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        V6POD,
        80
    ));
    assert!(!admits(&t, "::fffe:ffff:ffff", V6POD, 80));
    assert!(!admits(&t, "::1:0:0:0", V6POD, 80));
    assert!(admits(&t, "10.0.0.1", V6POD, 80));
    assert!(admits(&t, "0.0.0.0", V6POD, 80));
    assert!(admits(&t, "255.255.255.255", V6POD, 80));
    let srcs = ips(&[
        "fd00::1",
        "::",
        "::fffe:ffff:ffff",
        "::1:0:0:0",
        "10.0.0.1",
        "::ffff:1.2.3.4",
    ]);
    agrees(&all6, &t, &clients(), &srcs, &[80]);
}

#[test]
fn a_dual_stack_pod_is_decided_at_both_addresses() {
    let pods = r#"
apiVersion: v1
kind: Pod
metadata: {name: dual, namespace: team-a, uid: 00000000-0000-0000-0000-0000000000d1}
status: {podIPs: [{ip: 10.244.1.30}, {ip: "fd00::31"}]}
"#;
    let n = node_of(
        pods,
        &policy(
            "team-a",
            "v4-only",
            "{rules: [{when: [{key: destination.ip, values: [10.244.1.30]}]}]}",
        ),
    );
    let t = table(&n);
    assert!(admits(&t, "1.2.3.4", "10.244.1.30", 80));
    assert!(!admits(&t, "1.2.3.4", "fd00::31", 80));
}

#[test]
fn masks_keep_the_first_bits() {
    let key = [0xff; 36];
    assert_eq!(mask(&key, 0), [0; 36]);
    assert_eq!(mask(&key, 288), key);
    let m = mask(&key, 163);
    assert!(m[..20].iter().all(|b| *b == 0xff));
    assert_eq!(m[20], 0xe0);
    assert!(m[21..].iter().all(|b| *b == 0));
}

#[test]
fn covers_are_the_fewest_aligned_prefixes() {
    assert_eq!(cover(0, u32::MAX.into(), 32), [(0, 0)]);
    assert_eq!(cover(0, u128::MAX, 128), [(0, 0)]);
    assert_eq!(cover(1, 6, 32), [(1, 32), (2, 31), (4, 31), (6, 32)]);
    assert_eq!(cover(5, 5, 32), [(5, 32)]);
    assert_eq!(cover(u128::MAX - 1, u128::MAX, 128), [(u128::MAX - 1, 127)]);
}

#[test]
fn rules_saturate_into_one_shared_last_label() {
    let mut rules = Rules::default();
    for i in 0..1100 {
        let r = Rule::decided(Verdict::AllowedBy(format!("ns/p{i}")));
        let want = u16::try_from(i.min(1023)).unwrap();
        assert_eq!(rules.index(r.clone()), want);
        assert_eq!(rules.index(r), want, "the same label again");
    }
    assert_eq!(rules.list.len(), 1024);
    assert_eq!(rules.list[1023], Rule::Other);
    assert_eq!(
        rules.list[1022],
        Rule::decided(Verdict::AllowedBy("ns/p1022".into()))
    );
}

#[test]
fn the_same_policies_compile_to_the_same_table() {
    let text = format!(
        "{}{}{}",
        policy(
            "team-a",
            "ten",
            "{rules: [{from: [{source: {ipBlocks: [10.0.0.0/8]}}], to: [{operation: {ports: [\"80\"]}}]}]}"
        ),
        policy(
            "team-b",
            "deny",
            "{action: DENY, rules: [{from: [{source: {namespaces: [team-a]}}]}]}"
        ),
        peer("team-c", "strict", "{mtls: {mode: STRICT}}"),
    );
    let (a, b) = (table(&node(&text)), table(&node(&text)));
    assert_eq!(
        a.entries().collect::<Vec<_>>(),
        b.entries().collect::<Vec<_>>()
    );
    assert_eq!(a.rules(), b.rules());
    assert_eq!(a.entries_exact().len(), a.len());
    assert_eq!(
        a.addresses().collect::<Vec<_>>(),
        ips(&[WEB, DB, B1, V6POD])
    );
    let sorted: Vec<_> = a.entries().map(|(k, len, _)| (*k, len)).collect();
    assert!(sorted.windows(2).all(|w| w[0] < w[1]));
}

// The property test: random policies, clients and connections.

const PRINCIPALS: [&str; 5] = [
    "cluster.local/ns/team-a/sa/web",
    "*/sa/default",
    "cluster.local/ns/team-b/*",
    "*",
    "other.domain/ns/team-a/sa/web",
];
const NAMESPACES: [&str; 4] = ["team-a", "team-b", "team-*", "*"];
const ACCOUNTS: [&str; 3] = ["web", "default", "team-b/default"];
const PORTS: [u16; 4] = [80, 8080, 9090, 15008];
/// The random world's Pods: web-1 is dual-stack.
const RANDOM_PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: team-a, labels: {app: web}, uid: 00000000-0000-0000-0000-0000000000a1}
status: {podIPs: [{ip: 10.0.1.20}, {ip: "fd00::1:20"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db-1, namespace: team-a, labels: {app: db}, uid: 00000000-0000-0000-0000-0000000000a2}
status: {podIP: 10.0.1.21}
---
apiVersion: v1
kind: Pod
metadata: {name: b1, namespace: team-b, labels: {app: client}, uid: 00000000-0000-0000-0000-0000000000b1}
status: {podIP: 10.0.2.10}
---
apiVersion: v1
kind: Pod
metadata: {name: c1, namespace: team-c, labels: {app: client}, uid: 00000000-0000-0000-0000-0000000000c1}
status: {podIPs: [{ip: "fd00::3:10"}]}
"#;
const POD_IPS: [&str; 5] = [
    "10.0.1.20",
    "fd00::1:20",
    "10.0.1.21",
    "10.0.2.10",
    "fd00::3:10",
];

/// A subset of `values`, empty two times in three.
fn some<T: Clone + std::fmt::Debug + 'static>(values: Vec<T>) -> impl Strategy<Value = Vec<T>> {
    let n = values.len();
    prop_oneof![2 => Just(Vec::new()), 1 => prop::sample::subsequence(values, 1..=n.min(2))]
}

/// A network within a small space, so that ranges collide; sometimes IPv6, or everything.
fn cidr() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (0u8..4, any::<u8>(), 8u8..=32).prop_map(|(x, y, p)| format!("10.0.{x}.{y}/{p}")),
        1 => (0u8..4, any::<u8>()).prop_map(|(x, y)| format!("10.0.{x}.{y}")),
        2 => (0u16..4, any::<u16>(), 100u8..=128).prop_map(|(x, y, p)| format!("fd00::{x:x}:{y:x}/{p}")),
        1 => prop::sample::select(vec!["0.0.0.0/0", "::/0", "fd00::/16", "169.254.0.0/16", "::ffff:10.0.0.0/104"]).prop_map(String::from),
    ]
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn source() -> impl Strategy<Value = serde_json::Value> {
    (
        (some(strings(&PRINCIPALS)), some(strings(&PRINCIPALS))),
        (some(strings(&NAMESPACES)), some(strings(&NAMESPACES))),
        (some(strings(&ACCOUNTS)), some(strings(&ACCOUNTS))),
        (
            prop::collection::vec(cidr(), 0..3),
            prop::collection::vec(cidr(), 0..2),
        ),
    )
        .prop_map(|((p, np), (ns, nns), (sa, nsa), (ip, nip))| {
            let mut s = serde_json::Map::new();
            for (k, v) in [
                ("principals", p),
                ("notPrincipals", np),
                ("namespaces", ns),
                ("notNamespaces", nns),
                ("serviceAccounts", sa),
                ("notServiceAccounts", nsa),
                ("ipBlocks", ip),
                ("notIpBlocks", nip),
            ] {
                if !v.is_empty() {
                    s.insert(k.into(), json!(v));
                }
            }
            json!({"source": s})
        })
}

fn ports() -> impl Strategy<Value = Vec<String>> {
    some(PORTS.iter().map(|p| p.to_string()).collect())
}

fn operation() -> impl Strategy<Value = serde_json::Value> {
    (ports(), ports()).prop_map(|(p, np)| {
        let mut o = serde_json::Map::new();
        if !p.is_empty() {
            o.insert("ports".into(), json!(p));
        }
        if !np.is_empty() {
            o.insert("notPorts".into(), json!(np));
        }
        json!({"operation": o})
    })
}

fn condition() -> impl Strategy<Value = serde_json::Value> {
    let values = prop_oneof![
        (Just("source.ip"), prop::collection::vec(cidr(), 1..3)),
        (
            Just("source.namespace"),
            prop::sample::subsequence(strings(&NAMESPACES), 1..3)
        ),
        (
            Just("source.principal"),
            prop::sample::subsequence(strings(&PRINCIPALS), 1..3)
        ),
        (
            Just("destination.port"),
            prop::sample::subsequence(
                PORTS.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
                1..3
            )
        ),
        (
            Just("destination.ip"),
            prop::sample::subsequence(strings(&POD_IPS), 1..3)
        ),
    ];
    (values, any::<bool>()).prop_map(|((key, v), not)| {
        if not {
            json!({"key": key, "notValues": v})
        } else {
            json!({"key": key, "values": v})
        }
    })
}

fn rule() -> impl Strategy<Value = serde_json::Value> {
    (
        prop::collection::vec(source(), 0..3),
        prop::collection::vec(operation(), 0..2),
        prop::collection::vec(condition(), 0..2),
    )
        .prop_map(|(from, to, when)| {
            let mut r = serde_json::Map::new();
            if !from.is_empty() {
                r.insert("from".into(), json!(from));
            }
            if !to.is_empty() {
                r.insert("to".into(), json!(to));
            }
            if !when.is_empty() {
                r.insert("when".into(), json!(when));
            }
            serde_json::Value::Object(r)
        })
}

fn one_policy() -> impl Strategy<Value = (String, String)> {
    (
        prop::sample::select(vec!["team-a", "team-b", "istio-system"]),
        prop::option::of(prop::sample::select(vec!["web", "db", "client"])),
        prop::sample::select(vec!["ALLOW", "DENY"]),
        prop::collection::vec(rule(), 0..3),
    )
        .prop_map(|(ns, app, action, rules)| {
            let mut spec = json!({"action": action, "rules": rules});
            if let Some(app) = app {
                spec["selector"] = json!({"matchLabels": {"app": app}});
            }
            (ns.to_string(), spec.to_string())
        })
}

fn policies() -> impl Strategy<Value = String> {
    let peers = prop::sample::select(vec![
        String::new(),
        peer("istio-system", "default", "{mtls: {mode: STRICT}}"),
        peer(
            "team-a",
            "web",
            "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}, portLevelMtls: {\"9090\": {mode: DISABLE}}}",
        ),
        peer(
            "team-a",
            "web",
            "{selector: {matchLabels: {app: web}}, portLevelMtls: {\"8080\": {mode: STRICT}}}",
        ),
    ]);
    (prop::collection::vec(one_policy(), 1..4), peers).prop_map(|(list, peers)| {
        let mut text = peers;
        for (i, (ns, spec)) in list.into_iter().enumerate() {
            text.push_str(&policy(&ns, &format!("p{i}"), &spec));
        }
        text
    })
}

fn identity() -> impl Strategy<Value = Option<Identity>> {
    prop::option::of(
        prop::sample::select(vec![
            ("team-a", "web"),
            ("team-a", "default"),
            ("team-b", "default"),
            ("team-c", "x"),
        ])
        .prop_map(|(ns, sa)| id(ns, sa)),
    )
}

/// Every Pod as a client, each with a random identity or none, and a few more on 10.0/16.
fn random_clients() -> impl Strategy<Value = Vec<LocalClient>> {
    (
        prop::collection::vec(identity(), POD_IPS.len()),
        prop::collection::vec(((0u8..4, any::<u8>()), identity()), 0..4),
    )
        .prop_map(|(pods, more)| {
            let mut out: Vec<LocalClient> = POD_IPS
                .iter()
                .zip(pods)
                .map(|(a, identity)| LocalClient {
                    ip: ip(a),
                    identity,
                })
                .collect();
            out.extend(more.into_iter().map(|((x, y), identity)| LocalClient {
                ip: IpAddr::V4(Ipv4Addr::new(10, 0, x, y)),
                identity,
            }));
            out
        })
}

/// Sources worth asking: the clients, every edge of every network the policies name (and one
/// past), and a few elsewhere.
fn sources(n: &NodePolicies, clients: &[LocalClient], random: &[IpAddr]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = clients.iter().map(|c| c.ip).collect();
    out.extend(random);
    out.extend(ips(&[
        "0.0.0.0",
        "9.255.255.255",
        "10.0.0.0",
        "11.0.0.0",
        "255.255.255.255",
        "169.254.7.127",
        "169.254.7.126",
        "::",
        "::1",
        "fd00::1",
        "2001:db8::1",
        "ffff::1",
        "::fffe:ffff:ffff",
        "::1:0:0:0",
        "::ffff:10.0.1.20",
        "::ffff:10.0.0.7",
    ]));
    let nets = (n.converted().iter())
        .flat_map(|p| &p.groups)
        .flat_map(|g| &g.clauses)
        .flat_map(|c| &c.matches)
        .flat_map(|m| m.source_ips.iter().chain(&m.not_source_ips));
    for net in nets {
        match net {
            IpNet::V4(n) => {
                let (lo, hi) = (u32::from(n.network()), u32::from(n.broadcast()));
                for a in [lo.wrapping_sub(1), lo, hi, hi.wrapping_add(1)] {
                    out.push(IpAddr::V4(a.into()));
                }
            }
            IpNet::V6(n) => {
                let (lo, hi) = (u128::from(n.network()), u128::from(n.broadcast()));
                for a in [lo.wrapping_sub(1), lo, hi, hi.wrapping_add(1)] {
                    out.push(IpAddr::V6(a.into()));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn random_addr() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        (0u8..4, any::<u8>()).prop_map(|(x, y)| IpAddr::V4(Ipv4Addr::new(10, 0, x, y))),
        any::<u32>().prop_map(|a| IpAddr::V4(a.into())),
        (0u16..4, any::<u16>())
            .prop_map(|(x, y)| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, x, y))),
        any::<u128>().prop_map(|a| IpAddr::V6(a.into())),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// What the kernel would decide (its lookup, modelled) is `decide`'s verdict, under its
    /// label, for every guarded Pod; nothing for the others; a refusal for a Pod left out.
    #[test]
    fn kernel_lookups_decide_as_the_policies(
        text in policies(),
        clients in random_clients(),
        random in prop::collection::vec(random_addr(), 0..6),
        random_port in 1u16..,
        budget in prop_oneof![3 => Just(usize::MAX), 1 => 0..300usize],
    ) {
        let n = node_of(RANDOM_PODS, &text);
        let t = InboundTable::compile(&n, &clients, budget);
        let guarded: usize = t.pods().iter().chain(t.left_out()).map(|p| 2 * p.ips.len()).sum();
        prop_assert!(t.len() <= budget.max(guarded), "{} entries over {budget}", t.len());
        prop_assert_eq!(t.pods().len() + t.left_out().len(), n.guarded_pods().count());
        let srcs = sources(&n, &clients, &random);
        let mut ports: Vec<u16> = PORTS.to_vec();
        ports.extend([1, 443, 65535, random_port]);
        for dst in POD_IPS.iter().map(|a| ip(a)).chain([ip("10.0.9.9"), ip("::ffff:10.0.1.20")]) {
            for src in &srcs {
                for port in &ports {
                    if let Err(e) = check(&n, &t, &clients, *src, dst, *port) {
                        return Err(TestCaseError::fail(format!("{e}\npolicies:\n{text}")));
                    }
                }
            }
        }
    }
}
