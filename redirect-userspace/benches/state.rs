//! State build time and lookup cost at 10,000 ServiceEntries across 1,000 namespaces.
//! `cargo bench -p redirect --bench state` (add `-- --quick` for a short run).
use std::{hint::black_box, net::IpAddr};

use criterion::{Criterion, criterion_group, criterion_main};
use redirect::{
    config::{Model, load_sources},
    state::{Pick, Snapshot},
};

const NAMESPACES: usize = 1_000;
const ENTRIES: usize = 10_000;

/// Every tenth namespace publishes (PUBLIC); the rest keep their entries (NAMESPACE). One entry in
/// ten shares a host name with other namespaces, one in five declares no address (allocated).
fn model() -> Model {
    let mut yaml = String::from(
        "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchLabels: {trusted: \"true\"}}}]\n",
    );
    for n in 0..NAMESPACES {
        let labels = if n % 10 == 0 {
            "{trusted: \"true\"}"
        } else {
            "{}"
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: ns-{n}, labels: {labels}}}\n"
        ));
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: ns-{n}}}\nstatus: {{podIP: 10.{}.{}.10}}\n",
            n / 256,
            n % 256
        ));
    }
    for i in 0..ENTRIES {
        let n = i % NAMESPACES;
        let host = if i % 10 == 0 {
            format!("shared-{}.example.com", i % 100)
        } else {
            format!("svc-{i}.ns-{n}.example.com")
        };
        let addresses = if i % 5 == 4 {
            String::new()
        } else {
            format!(
                "addresses: [100.{}.{}.{}], ",
                64 + i / 65536,
                (i / 256) % 256,
                i % 256
            )
        };
        yaml.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: se-{i}, namespace: ns-{n}}}\nspec: {{hosts: [{host}], {addresses}ports: [{{number: 80, name: http, targetPort: 8080}}], resolution: STATIC, endpoints: [{{address: 198.18.{}.{}}}, {{address: 198.19.{}.{}}}]}}\n",
            i / 256 % 256, i % 256, i / 256 % 256, i % 256
        ));
    }
    load_sources([("bench.yaml", yaml.as_str())]).expect("bench model loads")
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn benches(c: &mut Criterion) {
    let model = model();
    let mut group = c.benchmark_group("state_build");
    group.sample_size(10);
    group.bench_function("10k_entries_1k_namespaces", |b| {
        b.iter(|| Snapshot::from_model(black_box(&model)))
    });
    group.finish();

    let snap = Snapshot::from_model(&model);
    // se-1 lives in ns-1 (NAMESPACE) at 100.64.0.1.
    let vip = ip("100.64.0.1");
    c.bench_function("by_ip/own_namespace_service", |b| {
        b.iter(|| black_box(snap.by_ip(black_box(Some("ns-1")), black_box(vip), 80)).outcome())
    });
    c.bench_function("by_ip/hidden_then_passthrough", |b| {
        b.iter(|| {
            black_box(snap.by_ip_with(black_box(Some("ns-2")), black_box(vip), 80, Pick::Peek))
                .outcome()
        })
    });
    c.bench_function("by_ip/unknown_passthrough", |b| {
        b.iter(|| {
            black_box(snap.by_ip(black_box(Some("ns-2")), black_box(ip("192.0.2.1")), 80)).outcome()
        })
    });
    c.bench_function("by_host/exact", |b| {
        b.iter(|| {
            black_box(snap.by_host(
                black_box(Some("ns-1")),
                black_box("svc-1.ns-1.example.com."),
            ))
            .hidden()
            .is_some()
        })
    });
    c.bench_function("by_host/shared_name_ranked", |b| {
        b.iter(|| {
            black_box(snap.by_host(black_box(Some("ns-7")), black_box("shared-10.example.com.")))
                .hidden()
                .is_some()
        })
    });
    c.bench_function("by_host/search_domain_cname", |b| {
        b.iter(|| {
            black_box(snap.by_host(
                black_box(Some("ns-1")),
                black_box("svc-1.ns-1.example.com.ns-1.svc.cluster.local."),
            ))
            .hidden()
            .is_some()
        })
    });
    c.bench_function("by_host/forward_unknown", |b| {
        b.iter(|| {
            black_box(snap.by_host(
                black_box(Some("ns-1")),
                black_box("www.example.org.ns-1.svc.cluster.local."),
            ))
            .hidden()
            .is_some()
        })
    });
    c.bench_function("workload_by_ip", |b| {
        b.iter(|| black_box(snap.workload_by_ip(black_box(ip("10.0.5.10")))).is_some())
    });
}

criterion_group!(state, benches);
criterion_main!(state);
