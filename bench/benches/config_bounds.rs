//! Pathological configuration: each is refused or loaded (config -> visibility -> state, the path a
//! reload takes) in well under a second. `cargo bench -p bench --bench config_bounds`.
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use redirect_userspace::model::{self, Host, Snapshot, read_sources};

const HOSTS: usize = 100_000;
const PORTS: u16 = 65_535;
const DEPTH: usize = 100_000;
const ALLOCATED: usize = 100_000;

/// Loads one file as a reload does and builds the state; returns how many errors it had.
fn load(text: &str) -> usize {
    let loaded = read_sources([("bench.yaml", text)]);
    let resolution = model::resolve(&loaded.model);
    let snapshot = Snapshot::build(&loaded.model, &resolution);
    black_box(snapshot.services().count());
    loaded.errors.len()
}

fn entry(spec: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: big, namespace: team-a}}\nspec:\n{spec}"
    )
}

fn benches(c: &mut Criterion) {
    let hosts = entry(&format!(
        "  addresses: [203.0.113.1]\n  ports: [{{number: 80, name: http}}]\n  hosts:\n{}",
        (0..HOSTS)
            .map(|i| format!("  - h{i}.example.com\n"))
            .collect::<String>()
    ));
    let ports = entry(&format!(
        "  hosts: [ports.example.com]\n  addresses: [203.0.113.2]\n  ports:\n{}",
        (1..=PORTS)
            .map(|p| format!("  - {{number: {p}, protocol: TCP}}\n"))
            .collect::<String>()
    ));
    let flow = "[".repeat(DEPTH);
    let flow_maps = "{a: ".repeat(DEPTH);
    let block = format!("{}1\n", "- ".repeat(DEPTH));
    let mut bomb = String::from("a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for level in 1..9u8 {
        let (name, prev) = ((b'a' + level) as char, (b'a' + level - 1) as char);
        bomb.push_str(&format!(
            "{name}: &{name} [{}]\n",
            vec![format!("*{prev}"); 9].join(", ")
        ));
    }
    // Each case says whether it must load cleanly (true) or be refused (false).
    let cases: [(&str, &str, bool); 6] = [
        ("100k_hosts", &hosts, true),
        ("65535_ports", &ports, true),
        ("100k_deep_flow_sequences", &flow, false),
        ("100k_deep_flow_mappings", &flow_maps, false),
        ("100k_deep_block_sequences", &block, false),
        ("alias_bomb", &bomb, false),
    ];
    let mut group = c.benchmark_group("config_bounds");
    group.sample_size(10);
    for (name, text, loads) in cases {
        assert_eq!(load(text) == 0, loads, "{name}: loaded {}", load(text) == 0);
        group.bench_function(name, |b| b.iter(|| load(black_box(text))));
    }

    // The address pool past exhaustion: 100,000 hosts to allocate, 65,534 addresses.
    let one = entry(
        "  hosts: [one.example.com]\n  resolution: DNS\n  ports: [{number: 80, name: http}]\n",
    );
    let mut model = read_sources([("one.yaml", one.as_str())]).model;
    let template = model.service_entries[0].clone();
    model.service_entries = (0..ALLOCATED)
        .map(|i| {
            let mut e = (*template).clone();
            e.meta.name = format!("e{i}");
            e.hosts = vec![Host::Exact(format!("e{i}.example.com"))];
            std::sync::Arc::new(e)
        })
        .collect();
    group.bench_function("allocate_100k_hosts", |b| {
        b.iter(|| model::allocate(black_box(&model), &model::Discovery::of(&model)).len())
    });
    group.finish();
}

criterion_group!(config_bounds, benches);
criterion_main!(config_bounds);
