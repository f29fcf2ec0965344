//! `follow` as a whole, and the snapshots it builds on the one in force held to whole builds.
use serde_json::{Value, json};

use super::{
    reuse::{InForce, Next, Resolution, Reuse},
    *,
};

fn entry(i: usize) -> Change {
    let object = json!({
        "metadata": {"name": format!("e{i}"), "namespace": "team-a"},
        "spec": {"hosts": [format!("e{i}.example.com")], "addresses": [format!("203.0.113.{i}")]}
    });
    let converted = kinds::convert(Kind::ServiceEntry, "networking.istio.io/v1", object);
    Change::Upsert(
        Kind::ServiceEntry,
        ("team-a".into(), format!("e{i}")),
        Box::new(converted),
    )
}

async fn settle() {
    tokio::time::sleep(COALESCE * 3).await;
}

/// One change the property test makes.
#[derive(Debug, Clone)]
enum Op {
    /// A Pod of another node added or changed: namespace, name, address, label.
    Elsewhere(usize, usize, u8, usize),
    GoneElsewhere(usize, usize),
    /// A Pod of this node: namespace, name, address, label.
    Here(usize, usize, u8, usize),
    /// A ServiceEntry added or changed.
    Entry(EntryOp),
    /// The ServiceEntry of this namespace and name deleted.
    GoneEntry(usize, usize),
    /// A Namespace's labels: trusted (PUBLIC), quarantined (NONE), discovered.
    Namespace(usize, bool, bool, bool),
    /// The mesh config, with `discoverySelectors` or without.
    Mesh(bool),
    /// `b`'s Service `web`, picking `app: l1` Pods, added (or deleted).
    Service(bool),
    /// An EndpointSlice of `web` added (or deleted): the selector picks nothing then.
    Slice(bool),
    /// The AuthorizationPolicy `p` of a namespace of [`POLICY_NAMESPACES`]: DENY from `c`, of the
    /// Pods labelled `app: l{n}` or of the namespace; refused (its last good version kept) when not
    /// valid.
    Policy(usize, Option<usize>, bool),
    GonePolicy(usize),
    /// The PeerAuthentication `p` of a namespace of [`POLICY_NAMESPACES`]: STRICT or PERMISSIVE.
    Peer(usize, bool),
}

/// A ServiceEntry of namespace `ns` named `e{name}`, for `h{host}.example.com` (and another
/// host), whose Pods a selector picks or not.
#[derive(Debug, Clone)]
struct EntryOp {
    ns: usize,
    name: usize,
    hosts: Vec<usize>,
    addresses: Addresses,
    selector: bool,
    /// The day of January it was created (shadowing prefers the oldest).
    day: u8,
}

#[derive(Debug, Clone)]
enum Addresses {
    /// `203.0.113.{10 + n}`, shared by whoever declares the same.
    Declared(u8),
    /// An address of the allocation's pool, `240.240.0.{5 + n}`.
    InPool(u8),
    /// None: allocated.
    Allocated,
    Cidr,
}

const NAMESPACES: [&str; 3] = ["a", "b", "c"];
/// Where policies are written: the Pods' namespaces and the root namespace.
const POLICY_NAMESPACES: [&str; 4] = ["a", "b", "c", "istio-system"];

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    let addresses = prop_oneof![
        4 => (0..4u8).prop_map(Addresses::Declared),
        1 => (0..2u8).prop_map(Addresses::InPool),
        1 => Just(Addresses::Allocated),
        1 => Just(Addresses::Cidr),
    ];
    let entry = (
        0..3usize,
        0..4usize,
        proptest::collection::vec(0..6usize, 1..3),
        addresses,
        proptest::bool::weighted(0.2),
        1..4u8,
    )
        .prop_map(|(ns, name, hosts, addresses, selector, day)| {
            Op::Entry(EntryOp {
                ns,
                name,
                hosts,
                addresses,
                selector,
                day,
            })
        });
    prop_oneof![
        6 => (0..3usize, 0..5usize, 0..8u8, 0..3usize).prop_map(|(n, p, ip, l)| Op::Elsewhere(n, p, ip, l)),
        2 => (0..3usize, 0..5usize).prop_map(|(n, p)| Op::GoneElsewhere(n, p)),
        2 => (0..3usize, 0..3usize, 0..8u8, 0..3usize).prop_map(|(n, p, ip, l)| Op::Here(n, p, ip, l)),
        8 => entry,
        3 => (0..3usize, 0..4usize).prop_map(|(n, e)| Op::GoneEntry(n, e)),
        1 => (0..3usize, any::<bool>(), proptest::bool::weighted(0.2), proptest::bool::weighted(0.8))
            .prop_map(|(n, t, q, d)| Op::Namespace(n, t, q, d)),
        1 => any::<bool>().prop_map(Op::Mesh),
        1 => any::<bool>().prop_map(Op::Service),
        1 => any::<bool>().prop_map(Op::Slice),
        2 => (0..4usize, proptest::option::of(0..3usize), proptest::bool::weighted(0.8))
            .prop_map(|(n, l, valid)| Op::Policy(n, l, valid)),
        1 => (0..4usize).prop_map(Op::GonePolicy),
        1 => (0..4usize, any::<bool>()).prop_map(|(n, strict)| Op::Peer(n, strict)),
    ]
}

fn upsert(kind: Kind, api_version: &str, object: Value) -> Change {
    let key = (
        object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    );
    // Refused (a host listed twice): the last good version stays, with an error.
    let converted = kinds::convert(kind, api_version, object);
    Change::Upsert(kind, key, Box::new(converted))
}

fn mesh(discovery: bool) -> Change {
    let selectors = match discovery {
        true => "discoverySelectors: [{matchLabels: {discovered: \"yes\"}}]\n",
        false => "",
    };
    let mesh = format!(
        "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{{namespaceSelector: {{matchLabels: {{trusted: \"true\"}}}}}}]\n  - visibility: NONE\n    matchingRules: [{{namespaceSelector: {{matchLabels: {{quarantine: \"true\"}}}}}}]\n{selectors}"
    );
    let object = json!({"metadata": {"name": "istio", "namespace": "istio-system"},
                        "data": {"mesh": mesh}});
    upsert(Kind::MeshConfig, "v1", object)
}

fn change(op: &Op) -> Change {
    let pod = |ns: &str, name: String, ip: u8, node: &str, labels: Value| {
        json!({"metadata": {"name": name, "namespace": ns, "labels": labels,
                            "uid": "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1"},
               "spec": {"nodeName": node, "containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
               "status": {"podIP": format!("10.0.0.{ip}")}})
    };
    let istio = "networking.istio.io/v1";
    match op {
        Op::Elsewhere(n, p, ip, l) => {
            let labels = json!({"app": format!("l{l}")});
            let object = pod(NAMESPACES[*n], format!("p{p}"), *ip, "n2", labels);
            upsert(Kind::PodElsewhere, "v1", object)
        }
        Op::GoneElsewhere(n, p) => {
            Change::Deleted(Kind::PodElsewhere, (NAMESPACES[*n].into(), format!("p{p}")))
        }
        Op::Here(n, p, ip, l) => {
            let labels = json!({"app": format!("l{l}")});
            upsert(
                Kind::Pod,
                "v1",
                pod(NAMESPACES[*n], format!("h{p}"), *ip, "n1", labels),
            )
        }
        Op::Entry(e) => {
            let addresses = match e.addresses {
                Addresses::Declared(n) => json!([format!("203.0.113.{}", 10 + n)]),
                Addresses::InPool(n) => json!([format!("240.240.0.{}", 5 + n)]),
                Addresses::Allocated => json!([]),
                Addresses::Cidr => json!(["203.0.113.64/28"]),
            };
            let hosts: Vec<String> = e
                .hosts
                .iter()
                .map(|h| format!("h{h}.example.com"))
                .collect();
            let mut spec = json!({"hosts": hosts, "addresses": addresses, "resolution": "STATIC",
                "ports": [{"number": 80, "name": "http", "protocol": "HTTP", "targetPort": 8080}]});
            match e.selector {
                true => spec["workloadSelector"] = json!({"labels": {"app": "l0"}}),
                false => spec["endpoints"] = json!([{"address": format!("198.51.100.{}", e.name)}]),
            }
            let object = json!({"metadata": {"name": format!("e{}", e.name), "namespace": NAMESPACES[e.ns],
                                             "creationTimestamp": format!("2026-01-0{}T00:00:00Z", e.day)},
                                "spec": spec});
            upsert(Kind::ServiceEntry, istio, object)
        }
        Op::GoneEntry(n, e) => {
            Change::Deleted(Kind::ServiceEntry, (NAMESPACES[*n].into(), format!("e{e}")))
        }
        Op::Namespace(n, trusted, quarantine, discovered) => {
            let mut labels = json!({});
            for (set, key, value) in [
                (trusted, "trusted", "true"),
                (quarantine, "quarantine", "true"),
                (discovered, "discovered", "yes"),
            ] {
                if *set {
                    labels[key] = json!(value);
                }
            }
            upsert(
                Kind::Namespace,
                "v1",
                json!({"metadata": {"name": NAMESPACES[*n], "labels": labels}}),
            )
        }
        Op::Mesh(discovery) => mesh(*discovery),
        Op::Service(false) => Change::Deleted(Kind::Service, ("b".into(), "web".into())),
        Op::Service(true) => {
            let object = json!({"metadata": {"name": "web", "namespace": "b"},
                "spec": {"selector": {"app": "l1"}, "clusterIP": "10.96.0.1",
                         "ports": [{"port": 80, "targetPort": "http"}]}});
            upsert(Kind::Service, "v1", object)
        }
        Op::Slice(false) => Change::Deleted(Kind::EndpointSlice, ("b".into(), "web-x".into())),
        Op::Slice(true) => {
            let object = json!({"metadata": {"name": "web-x", "namespace": "b",
                                             "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}],
                "ports": [{"port": 8080}]});
            upsert(Kind::EndpointSlice, "discovery.k8s.io/v1", object)
        }
        Op::Policy(n, selector, valid) => {
            let action = if *valid { "DENY" } else { "PERMIT" };
            let mut spec =
                json!({"action": action, "rules": [{"from": [{"source": {"namespaces": ["c"]}}]}]});
            if let Some(l) = selector {
                spec["selector"] = json!({"matchLabels": {"app": format!("l{l}")}});
            }
            let object = json!({"metadata": {"name": "p", "namespace": POLICY_NAMESPACES[*n]}, "spec": spec});
            upsert(Kind::AuthorizationPolicy, "security.istio.io/v1", object)
        }
        Op::GonePolicy(n) => Change::Deleted(
            Kind::AuthorizationPolicy,
            (POLICY_NAMESPACES[*n].into(), "p".into()),
        ),
        Op::Peer(n, strict) => {
            let mode = if *strict { "STRICT" } else { "PERMISSIVE" };
            let object = json!({"metadata": {"name": "p", "namespace": POLICY_NAMESPACES[*n]},
                                "spec": {"mtls": {"mode": mode}}});
            upsert(Kind::PeerAuthentication, "security.istio.io/v1", object)
        }
    }
}

/// What a snapshot says: its dump, the addresses reached directly, the outbound decision for
/// every address the test uses (and every address a service has in `also`) and the DNS
/// decision for every name, from every namespace and from none.
fn said(s: &Snapshot, also: &Snapshot) -> (Value, Vec<std::net::IpAddr>, Vec<String>) {
    let mut destinations: Vec<std::net::IpAddr> = s.workload_destinations().collect();
    destinations.sort();
    let fixed = (0..8)
        .map(|i| format!("10.0.0.{i}"))
        .chain((10..14).map(|i| format!("203.0.113.{i}")))
        .chain(["203.0.113.70", "240.240.0.5", "240.240.0.6", "10.96.0.1"].map(String::from))
        .map(|ip| ip.parse().unwrap());
    let vips = s
        .services()
        .chain(also.services())
        .flat_map(|svc| svc.vips());
    let addresses: std::collections::BTreeSet<std::net::IpAddr> = fixed.chain(vips).collect();
    let clients = [None, Some("a"), Some("b"), Some("c")];
    let mut decisions = Vec::new();
    for to in addresses {
        for from in clients {
            let d = s.decide_outbound_with(from, to, 80, crate::state::Pick::Peek);
            let who = match d.action {
                crate::state::Outbound::Workload { workload, .. } => {
                    format!("{}/{}", workload.namespace, workload.name)
                }
                _ => String::new(),
            };
            let target = d.target();
            decisions.push(format!("{to} {from:?} {:?} {who} {target:?}", d.outcome()));
        }
    }
    let names = (0..6)
        .map(|h| format!("h{h}.example.com"))
        .chain(["web.b.svc.cluster.local".into()]);
    for name in names {
        for from in clients {
            let said = match s.decide_dns(from, &name) {
                crate::state::DnsDecision::Answer(a) => {
                    format!("answer {} {}", a.service, a.service.hostname)
                }
                crate::state::DnsDecision::Forward { hidden } => {
                    format!("forward {:?}", hidden.map(|h| h.to_string()))
                }
            };
            decisions.push(format!("{name} {from:?} {said}"));
        }
    }
    // The policies of each Pod of the node (which every snapshot finds anew) among it.
    let dump = serde_json::to_value(s.config_dump()).unwrap();
    (dump, destinations, decisions)
}

/// The fast path's limits the property test compiles with: the kernel's room, and little room
/// (the shared entries or the workload addresses do not always fit).
const LIMITS: [crate::fastpath::Limits; 2] = [
    crate::fastpath::Limits {
        namespaces: 4096,
        clients: 64,
        exact: 65_536,
        cidrs: 64,
        ports: 64,
        workloads: 65_536,
        bytes: usize::MAX,
        namespace_bytes: usize::MAX,
    },
    crate::fastpath::Limits {
        namespaces: 2,
        clients: 64,
        exact: 6,
        cidrs: 1,
        ports: 4,
        workloads: 4,
        bytes: 4096,
        namespace_bytes: 1024,
    },
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
    /// Every change as `follow` takes it: the snapshot built on the one in force (keeping its
    /// services, its workloads, or its workloads and every other entry's services), the errors
    /// put in force, the status conditions and the fast path's tables compiled on the tables
    /// before say exactly what building and compiling the same model whole says.
    #[test]
    fn a_snapshot_built_on_the_one_in_force_says_what_one_built_whole_says(
        discovery in proptest::bool::weighted(0.3),
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        use crate::fastpath::{compile, compile_after};
        let kinds = Kind::watched(true);
        let mut store = Store::new(&kinds);
        for &kind in &kinds {
            store.apply(Change::Relist(kind), "t");
            if kind == Kind::MeshConfig {
                store.apply(mesh(discovery), "t");
            }
            store.apply(Change::Listed(kind), "t");
        }
        let mut previous = Arc::new(Snapshot::default());
        let mut in_force: Option<InForce> = None;
        let mut desired = Arc::new(Vec::new());
        let mut compiled: Vec<Option<(crate::fastpath::Tables, crate::fastpath::Stats)>> =
            vec![None; LIMITS.len()];
        let none = crate::fastpath::HostAddresses::new();
        for op in std::iter::once(None).chain(ops.iter().map(Some)) {
            if let Some(op) = op {
                store.apply(change(op), "t");
            }
            let changes = store.take_changes();
            if !changes.any() {
                continue;
            }
            let selecting = store.selecting_namespaces();
            let reuse = Reuse::of(changes, &selecting, in_force.as_ref());
            let selecting = selecting.into_iter().map(str::to_string).collect();
            let (model, errors, _) = store.model();
            let whole = pipeline::build(&model, errors.clone());
            let next = Next::build(reuse.clone(), &previous, in_force.take(), &model, errors);
            let context = format!("after {op:?}, keeping {}", next.kept);
            proptest::prop_assert_eq!(
                said(&next.snapshot, &whole.snapshot),
                said(&whole.snapshot, &next.snapshot),
                "{}", context
            );
            proptest::prop_assert_eq!(&next.errors, &whole.errors, "{}", context);
            desired = next.resolved.desired(&desired);
            let whole_desired = Resolution::Whole(whole.resolution.entries).desired(&desired);
            proptest::prop_assert_eq!(&desired, &whole_desired, "{}", context);
            for (limits, compiled) in LIMITS.into_iter().zip(&mut compiled) {
                let before = compiled.as_ref().map(|(t, s)| (&*previous, t, s));
                let patched = compile_after(before, true, &next.snapshot, limits, &none);
                let whole = compile(&whole.snapshot, limits);
                // The namespaces may be numbered apart (a patch keeps a namespace's number).
                proptest::prop_assert_eq!(
                    patched.0.by_name(),
                    whole.0.by_name(),
                    "{} limits {:?}",
                    context,
                    limits
                );
                proptest::prop_assert_eq!(&patched.1, &whole.1, "{} limits {:?}", context, limits);
                *compiled = Some(patched);
            }
            in_force = Some(InForce {
                entries: model.service_entries.clone(),
                selecting,
                allocation: next.allocation,
            });
            previous = Arc::new(next.snapshot);
        }
    }
}

#[tokio::test]
async fn nothing_is_applied_before_every_watch_has_listed_and_a_burst_is_one_snapshot() {
    let live = LiveState::new(Some("kubernetes API".into()));
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = mpsc::channel(4096);
    let task = tokio::spawn(follow(rx, Store::default(), live.clone(), metrics, None));
    for kind in Kind::ALL {
        tx.send(Change::Relist(kind)).await.unwrap();
    }
    for i in 1..=10 {
        tx.send(entry(i)).await.unwrap();
    }
    for kind in Kind::ALL.iter().filter(|k| **k != Kind::MeshConfig) {
        tx.send(Change::Listed(*kind)).await.unwrap();
    }
    settle().await;
    assert_eq!(
        live.status_report().generation,
        0,
        "one watch has not listed"
    );
    assert!(!live.has_config());
    tx.send(Change::Listed(Kind::MeshConfig)).await.unwrap();
    settle().await;
    assert_eq!(live.status_report().generation, 1);
    assert_eq!(live.snapshot().services().count(), 10);

    // Fifty changes at once: one more snapshot, holding all of them.
    for i in 11..=60 {
        tx.send(entry(i)).await.unwrap();
    }
    settle().await;
    let status = live.status_report();
    assert_eq!(status.generation, 2);
    assert_eq!(live.snapshot().services().count(), 60);
    assert_eq!(status.watches.len(), Kind::ALL.len());
    // A failure changes no snapshot; it shows in the watch's state.
    tx.send(Change::Failed(Kind::Pod, "connection refused".into()))
        .await
        .unwrap();
    settle().await;
    let status = live.status_report();
    assert_eq!(status.generation, 2);
    let pods = status.watches.iter().find(|w| w.kind == "Pod").unwrap();
    assert_eq!(pods.last_error.as_deref(), Some("connection refused"));
    drop(tx);
    task.await.unwrap();
}
