//! Property tests over random worlds: visibility holds whatever the entries, addresses and ages.
use proptest::prelude::*;

use super::{dns_summary, outbound_summary};
use crate::{
    config::load_sources,
    state::{Pick, Snapshot},
};

const NAMESPACES: [&str; 4] = ["pub-a", "pub-b", "ns-c", "ns-d"];
const ADDRESSES: [&str; 4] = ["203.0.113.1", "203.0.113.2", "203.0.113.3", "203.0.113.4"];
const HOSTS: [&str; 4] = [
    "h1.example.com",
    "h2.example.com",
    "h3.example.com",
    "x.wild.example.com",
];

#[derive(Debug, Clone)]
struct Entry {
    ns: usize,
    address: usize,
    host: usize,
    wildcard: bool,
    cidr: bool,
    age: Option<u8>,
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        0..4usize,
        0..4usize,
        0..4usize,
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(0..5u8),
    )
        .prop_map(|(ns, address, host, wildcard, cidr, age)| Entry {
            ns,
            address,
            host,
            wildcard,
            cidr,
            age,
        })
}

/// `pub-*` namespaces publish (PUBLIC), the others keep their entries (NAMESPACE).
fn world(entries: &[(usize, Entry)]) -> Snapshot {
    let mut yaml = String::from(
        "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchLabels: {publish: \"yes\"}}}]\n",
    );
    for ns in NAMESPACES {
        let labels = if ns.starts_with("pub") {
            "{publish: \"yes\"}"
        } else {
            "{}"
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}, labels: {labels}}}\n"
        ));
    }
    for (i, e) in entries {
        let ts = e.age.map_or(String::new(), |a| {
            format!(", creationTimestamp: \"2024-01-0{}T00:00:00Z\"", a + 1)
        });
        let host = if e.wildcard {
            "\"*.wild.example.com\"".to_string()
        } else {
            HOSTS[e.host].to_string()
        };
        let address = if e.cidr {
            "203.0.113.0/29".to_string()
        } else {
            ADDRESSES[e.address].to_string()
        };
        yaml.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: e{i}, namespace: {}{ts}}}\nspec: {{hosts: [{host}], addresses: [\"{address}\"], ports: [{{number: 80, name: http}}], resolution: STATIC, endpoints: [{{address: 198.51.100.{i}}}]}}\n",
            NAMESPACES[e.ns]
        ));
    }
    Snapshot::from_model(&load_sources([("w.yaml", yaml.as_str())]).expect("generated world loads"))
}

fn clients() -> impl Iterator<Item = Option<&'static str>> {
    NAMESPACES
        .iter()
        .map(|ns| Some(*ns))
        .chain([None, Some("elsewhere")])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn a_namespace_entry_is_never_returned_to_another_namespace(entries in proptest::collection::vec(entry(), 1..8)) {
        let snap = world(&entries.into_iter().enumerate().collect::<Vec<_>>());
        for client in clients() {
            for address in ADDRESSES {
                let d = snap.decide_outbound_with(client, address.parse().unwrap(), 80, Pick::Peek);
                if let Some(s) = d.service() {
                    prop_assert!(s.visible_to(client), "{client:?} got {s} for {address}");
                }
            }
            for host in HOSTS {
                if let crate::state::DnsDecision::Answer(a) = snap.decide_dns(client, host) {
                    prop_assert!(a.service.visible_to(client), "{client:?} got {} for {host}", a.service);
                }
            }
        }
    }

    #[test]
    fn deleting_a_hidden_entry_never_changes_what_an_outsider_gets(
        entries in proptest::collection::vec(entry(), 1..8),
        pick in any::<proptest::sample::Index>(),
    ) {
        let victim = pick.index(entries.len());
        let owner = NAMESPACES[entries[victim].ns];
        // Only NAMESPACE entries are hidden from anyone.
        prop_assume!(!owner.starts_with("pub"));
        let entries: Vec<(usize, Entry)> = entries.into_iter().enumerate().collect();
        let with = world(&entries);
        let mut rest = entries.clone();
        rest.remove(victim);
        let without = world(&rest);
        // Each entry keeps its own endpoint (198.51.100.<id>), so equal targets mean the same entry.
        for client in clients().filter(|c| *c != Some(owner)) {
            for address in ADDRESSES {
                let ip = address.parse().unwrap();
                let a = outbound_summary(&with.decide_outbound_with(client, ip, 80, Pick::Peek));
                let b = outbound_summary(&without.decide_outbound_with(client, ip, 80, Pick::Peek));
                prop_assert_eq!((a.0, &a.2), (b.0, &b.2), "{:?} -> {}", client, address);
            }
            for host in HOSTS {
                let a = dns_summary(&with.decide_dns(client, host));
                let b = dns_summary(&without.decide_dns(client, host));
                prop_assert_eq!((a.0, &a.3, &a.4), (b.0, &b.3, &b.4), "{:?} -> {}", client, host);
            }
        }
    }
}
