//! Synthetic meshes of any size (the benchmarks' fixtures), written from the same documents:
//!
//! - [`large_mesh_yaml`], one multi-document manifest: what the criterion benches load and what
//!   `cargo xtask bench` gives the real agent to measure its memory, so both measure the same thing.
//!   Every tenth namespace is trusted (PUBLIC by policy), the rest keep their entries (NAMESPACE).
//!   One entry in ten shares a host name with other namespaces (never within its own); one in five
//!   declares no address (allocated). Each namespace has one client pod.
//! - [`cluster_files`], a big cluster beside the bench's own config ([`AT_SIZE`]): STATIC entries
//!   with one address each and many Pods, in files the agent accepts, for the fast path measured at
//!   size. It declares no mesh config: the bench's own (NAMESPACE by default) applies.
use std::fmt::Write;
use std::net::Ipv4Addr;

/// The scale the performance targets are stated at (BENCHMARKS.md, "Targets").
pub const NAMESPACES: usize = 1_000;
pub const ENTRIES: usize = 10_000;

/// A cluster's size for [`cluster_files`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterSize {
    pub namespaces: usize,
    pub entries: usize,
    pub pods: usize,
}

impl ClusterSize {
    /// `20k entries, 100k pods`: what the rows at size are named by.
    pub fn words(&self) -> String {
        format!(
            "{}k entries, {}k pods",
            self.entries / 1000,
            self.pods / 1000
        )
    }
}

/// The big cluster the fast path is measured at (`cargo xtask bench`, the "at size" rows).
pub const AT_SIZE: ClusterSize = ClusterSize {
    namespaces: 100,
    entries: 20_000,
    pods: 100_000,
};

/// The largest file [`cluster_files`] writes, in bytes.
pub const FILE_BYTES: usize = 3 << 20;
/// What the agent reads at most of one file, and of a config directory in one load
/// (`config::source::Limits`' defaults).
pub const AGENT_FILE_BYTES: u64 = 4 << 20;
pub const AGENT_DIR_BYTES: u64 = 32 << 20;

pub fn large_mesh_yaml(namespaces: usize, entries: usize) -> String {
    let mut yaml = String::from(
        "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchLabels: {trusted: \"true\"}}}]\n",
    );
    for n in 0..namespaces {
        let labels = if n % 10 == 0 {
            "{trusted: \"true\"}"
        } else {
            "{}"
        };
        namespace_doc(&mut yaml, &format!("ns-{n}"), labels);
        let ip = Ipv4Addr::new(10, (n / 256) as u8, (n % 256) as u8, 10);
        pod_doc(&mut yaml, "client", &format!("ns-{n}"), ip);
    }
    for i in 0..entries {
        let n = i % namespaces.max(1);
        // The same shared name never twice in one namespace: a namespace publishes one service per
        // host (the oldest entry), so a repeat would be a service less, not a claimant more.
        let host = if i % 10 == 0 {
            format!("shared-{}.example.com", i / namespaces.max(1))
        } else {
            format!("svc-{i}.ns-{n}.example.com")
        };
        let address = (i % 5 != 4).then(|| nth_address(Ipv4Addr::new(100, 64, 0, 0), i as u32));
        static_entry_doc(&mut yaml, i, &format!("ns-{n}"), &host, address);
    }
    yaml
}

/// `size`'s cluster as manifest files (name, contents), each at most [`FILE_BYTES`], in compact
/// flow style: `size.namespaces` namespaces `ns-N`; `size.entries` STATIC ServiceEntries `se-I`
/// spread over them, each with a host of its own, one address from 100.65.0.0 on (clear of the
/// bench's 100.64.0.10) and port 80 to two endpoints in 198.18.0.0/15, none of which is ever
/// contacted; `size.pods` Pods `pod-J` spread over them, their addresses from 10.128.0.0 on.
pub fn cluster_files(size: ClusterSize) -> Vec<(String, String)> {
    // Entries within 100.65.0.0–100.255.255.255; pods below 10.192.0.0, clear of the bench's
    // client (10.244.1.10).
    assert!(
        size.namespaces > 0 && size.entries <= 190 << 16 && size.pods <= 1 << 22,
        "{size:?} does not fit the address ranges"
    );
    let mut files = Files::default();
    let mut doc = String::new();
    for n in 0..size.namespaces {
        doc.clear();
        namespace_doc(&mut doc, &format!("ns-{n}"), "{}");
        files.push(&doc);
    }
    for i in 0..size.entries {
        let n = i % size.namespaces;
        doc.clear();
        let address = nth_address(Ipv4Addr::new(100, 65, 0, 0), i as u32);
        static_entry_doc(
            &mut doc,
            i,
            &format!("ns-{n}"),
            &format!("svc-{i}.ns-{n}.example.com"),
            Some(address),
        );
        files.push(&doc);
    }
    for j in 0..size.pods {
        doc.clear();
        pod_doc(
            &mut doc,
            &format!("pod-{j}"),
            &format!("ns-{}", j % size.namespaces),
            nth_address(Ipv4Addr::new(10, 128, 0, 0), j as u32),
        );
        files.push(&doc);
    }
    files.done()
}

/// Documents gathered into files of at most [`FILE_BYTES`] each.
#[derive(Default)]
struct Files {
    done: Vec<(String, String)>,
    current: String,
}

impl Files {
    fn push(&mut self, doc: &str) {
        if !self.current.is_empty() && self.current.len() + doc.len() > FILE_BYTES {
            self.finish();
        }
        self.current.push_str(doc);
    }

    fn finish(&mut self) {
        let name = format!("cluster-{:03}.yaml", self.done.len());
        self.done.push((name, std::mem::take(&mut self.current)));
    }

    fn done(mut self) -> Vec<(String, String)> {
        if !self.current.is_empty() {
            self.finish();
        }
        self.done
    }
}

/// The address `n` after `base`.
fn nth_address(base: Ipv4Addr, n: u32) -> Ipv4Addr {
    Ipv4Addr::from_bits(base.to_bits() + n)
}

fn namespace_doc(out: &mut String, name: &str, labels: &str) {
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {labels}}}\n"
    );
}

fn pod_doc(out: &mut String, name: &str, namespace: &str, ip: Ipv4Addr) {
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}}}\nstatus: {{podIP: {ip}}}\n"
    );
}

/// Entry `se-{i}`: `host`, port 80 (target 8080), STATIC to 198.18.x.y and 198.19.x.y (x.y from
/// `i`), with `address` or none (allocated).
fn static_entry_doc(
    out: &mut String,
    i: usize,
    namespace: &str,
    host: &str,
    address: Option<Ipv4Addr>,
) {
    let addresses = address.map_or(String::new(), |a| format!("addresses: [{a}], "));
    let (x, y) = (i / 256 % 256, i % 256);
    let _ = write!(
        out,
        "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: se-{i}, namespace: {namespace}}}\nspec: {{hosts: [{host}], {addresses}ports: [{{number: 80, name: http, targetPort: 8080}}], resolution: STATIC, endpoints: [{{address: 198.18.{x}.{y}}}, {{address: 198.19.{x}.{y}}}]}}\n"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use redirect_userspace::model::{Snapshot, load_sources};

    #[test]
    fn a_small_one_loads_with_every_object() {
        let yaml = large_mesh_yaml(20, 100);
        assert_eq!(yaml.matches("kind: ServiceEntry").count(), 100);
        assert_eq!(yaml.matches("kind: Namespace").count(), 20);
        let model = load_sources([("synthetic.yaml", yaml.as_str())]).expect("loads");
        assert_eq!(model.service_entries.len(), 100);
        assert_eq!(model.workloads.len(), 20);
        // Every entry is published, also with many entries per namespace (the bench's ten): the
        // agent holds one service for each, which the bench checks.
        let yaml = large_mesh_yaml(20, 400);
        let model = load_sources([("synthetic.yaml", yaml.as_str())]).expect("loads");
        let snapshot = Snapshot::from_model(&model);
        assert_eq!(snapshot.services().count(), 400);
    }

    #[test]
    fn the_large_mesh_keeps_its_addresses() {
        let yaml = large_mesh_yaml(NAMESPACES, ENTRIES);
        for needle in [
            "metadata: {name: ns-999, labels: {}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: client, namespace: ns-999}\nstatus: {podIP: 10.3.231.10}\n",
            "metadata: {name: se-9998, namespace: ns-998}\nspec: {hosts: [svc-9998.ns-998.example.com], addresses: [100.64.39.14], ports: [{number: 80, name: http, targetPort: 8080}], resolution: STATIC, endpoints: [{address: 198.18.39.14}, {address: 198.19.39.14}]}\n",
            // One in five has no address (allocated).
            "spec: {hosts: [svc-9999.ns-999.example.com], ports: [",
            "metadata: {name: se-9000, namespace: ns-0}\nspec: {hosts: [shared-9.example.com], addresses: [100.64.35.40], ports: [",
        ] {
            assert!(yaml.contains(needle), "no {needle:?}");
        }
    }

    /// The bench's config and a small cluster beside it, loaded as the agent loads its directory.
    #[test]
    fn a_small_cluster_loads_beside_the_bench_config() {
        let size = ClusterSize {
            namespaces: 10,
            entries: 300,
            pods: 1_000,
        };
        let files = cluster_files(size);
        let bench = crate::scene::bench_config();
        let sources = std::iter::once(("bench.yaml", bench.as_str())).chain(
            files
                .iter()
                .map(|(name, text)| (name.as_str(), text.as_str())),
        );
        let model = load_sources(sources).expect("loads");
        // The bench's two entries and its client beside the cluster's.
        assert_eq!(model.service_entries.len(), size.entries + 2);
        assert_eq!(model.workloads.len(), size.pods + 1);
        let snapshot = Snapshot::from_model(&model);
        let cluster: Vec<_> = snapshot
            .services()
            .filter(|s| s.name.starts_with("se-"))
            .collect();
        assert_eq!(cluster.len(), size.entries);
        for svc in cluster {
            // NAMESPACE by the bench's mesh default: never the bench client's, nor its VIP.
            assert!(svc.visible_to(Some(&svc.namespace)), "{}", svc.name);
            assert!(!svc.visible_to(Some("bench")), "{}", svc.name);
            assert_eq!(svc.vips_v4.len(), 1, "{}", svc.name);
            assert_ne!(svc.vips_v4[0], crate::scene::VIP);
        }
    }

    #[test]
    fn the_cluster_at_size_fits_the_agent_limits() {
        let files = cluster_files(AT_SIZE);
        let bench_bytes = crate::scene::bench_config().len() as u64;
        let total: u64 = bench_bytes + files.iter().map(|(_, t)| t.len() as u64).sum::<u64>();
        for (name, text) in &files {
            assert!(text.len() <= FILE_BYTES, "{name}: {} bytes", text.len());
            assert!(text.len() as u64 <= AGENT_FILE_BYTES);
            assert!(text.starts_with("---\n"), "{name} starts mid-document");
        }
        assert!(total <= AGENT_DIR_BYTES, "{total} bytes in all");
        let count = |kind: &str| {
            files
                .iter()
                .map(|(_, t)| t.matches(&format!("\nkind: {kind}\n")).count())
                .sum::<usize>()
        };
        assert_eq!(count("Namespace"), AT_SIZE.namespaces);
        assert_eq!(count("ServiceEntry"), AT_SIZE.entries);
        assert_eq!(count("Pod"), AT_SIZE.pods);
        let all: String = files.iter().map(|(_, t)| t.as_str()).collect();
        // The last of each, at the ends of their ranges: clear of the bench's pod and VIP.
        assert!(all.contains(
            "metadata: {name: pod-99999, namespace: ns-99}\nstatus: {podIP: 10.129.134.159}\n"
        ));
        assert!(all.contains("hosts: [svc-19999.ns-99.example.com], addresses: [100.65.78.31]"));
        assert!(!all.contains("podIP: 10.244.1.10\n") && !all.contains("[100.64.0.10]"));
    }
}
