//! State build time and lookup cost at 10,000 ServiceEntries across 1,000 namespaces.
//! `cargo bench -p bench --bench state` (add `-- --quick` for a short run).
use std::{hint::black_box, net::IpAddr};

use bench::synthetic;
use criterion::{Criterion, criterion_group, criterion_main};
use redirect_userspace::model::{Model, Pick, Snapshot, load_sources};

/// The synthetic mesh at the targets' scale (the same one `cargo xtask bench` measures the agent's RSS with).
fn model() -> Model {
    let yaml = synthetic::large_mesh_yaml(synthetic::NAMESPACES, synthetic::ENTRIES);
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
        b.iter(|| {
            black_box(snap.decide_outbound(black_box(Some("ns-1")), black_box(vip), 80)).outcome()
        })
    });
    c.bench_function("by_ip/hidden_then_passthrough", |b| {
        b.iter(|| {
            black_box(snap.decide_outbound_with(
                black_box(Some("ns-2")),
                black_box(vip),
                80,
                Pick::Peek,
            ))
            .outcome()
        })
    });
    c.bench_function("by_ip/unknown_passthrough", |b| {
        b.iter(|| {
            black_box(snap.decide_outbound(black_box(Some("ns-2")), black_box(ip("192.0.2.1")), 80))
                .outcome()
        })
    });
    c.bench_function("by_host/exact", |b| {
        b.iter(|| {
            black_box(snap.decide_dns(
                black_box(Some("ns-1")),
                black_box("svc-1.ns-1.example.com."),
            ))
            .hidden()
            .is_some()
        })
    });
    c.bench_function("by_host/shared_name_ranked", |b| {
        b.iter(|| {
            black_box(snap.decide_dns(black_box(Some("ns-7")), black_box("shared-10.example.com.")))
                .hidden()
                .is_some()
        })
    });
    c.bench_function("by_host/search_domain_cname", |b| {
        b.iter(|| {
            black_box(snap.decide_dns(
                black_box(Some("ns-1")),
                black_box("svc-1.ns-1.example.com.ns-1.svc.cluster.local."),
            ))
            .hidden()
            .is_some()
        })
    });
    c.bench_function("by_host/forward_unknown", |b| {
        b.iter(|| {
            black_box(snap.decide_dns(
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
