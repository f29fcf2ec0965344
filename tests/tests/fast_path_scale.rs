//! The fast path at a real cluster's size (`docs/data-plane.md#what-the-kernel-holds`): the
//! kernel's tables are sized to what the configuration needs, within a memory budget, and what
//! does not fit goes to the proxy by namespace, never whole. A team-a pod's connections to its own
//! entry and to an address nobody claims stay in the kernel with 20,000 ServiceEntries, with 70,000
//! Pods beside them, and with one tenant claiming 40,000 addresses; a tenant's hidden entry of
//! thousands of addresses leaves its neighbours in the kernel, even when the budget is too small
//! for it.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use integration::world::{World, delta};
use integration::{Launch, pace};

/// team-a's own NAMESPACE entry (`api-example`), and the endpoint the kernel rewrites it to.
const OWN_VIP: &str = "203.0.113.10";
const OWN_ANSWER: &str = "api-endpoint";
/// An address nothing claims, with a real host behind it.
const UNCLAIMED: &str = "203.0.113.80";
const UNCLAIMED_ANSWER: &str = "real-203.0.113.80";
/// team-b's own copy of `shared.example.com`, and its endpoint.
const B_OWN_VIP: &str = "203.0.113.41";
const B_OWN_ANSWER: &str = "shared-private-endpoint";
const B1_IP: &str = "10.244.2.10";

const CONNECTIONS: usize = 100;

/// Each test here starts an agent with tens of thousands of objects and times what it does; two
/// at once on a small machine would time each other. They take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    // A test that failed while holding the turn poisons it; the next one may still run.
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

const KERNEL_REWRITTEN: &str =
    r#"redirect_fast_path_connections_total{outcome="rewritten",reason=""}"#;
const KERNEL_PASSTHROUGH: &str =
    r#"redirect_fast_path_connections_total{outcome="passthrough",reason=""}"#;
const PROXY_CONNECTIONS: [&str; 3] = [
    r#"redirect_outbound_connections_total{outcome="service"}"#,
    r#"redirect_outbound_connections_total{outcome="passthrough"}"#,
    r#"redirect_outbound_connections_total{outcome="workload"}"#,
];

/// `entries` STATIC ServiceEntries in `namespaces` namespaces (`scale-N`, NAMESPACE visibility
/// by the examples' default), one address each in 100.64.0.0/10, one file a namespace.
fn write_entries(dir: &Path, namespaces: usize, entries: usize) -> Result<()> {
    let per_namespace = entries / namespaces;
    for n in 0..namespaces {
        let mut yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: scale-{n}}}\n");
        for k in 0..per_namespace {
            let i = n * per_namespace + k;
            let ip = format!("100.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256);
            write!(
                yaml,
                "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: se-{i}, namespace: scale-{n}}}\nspec: {{hosts: [se-{i}.scale-{n}.example], addresses: [{ip}], ports: [{{number: 80, name: http}}], resolution: STATIC, endpoints: [{{address: 198.18.{}.{}}}]}}\n",
                (i / 256) % 256,
                i % 256
            )?;
        }
        std::fs::write(dir.join(format!("50-scale-{n}.yaml")), yaml)?;
    }
    Ok(())
}

/// `pods` Pods in the `scale-N` namespaces (as the Pods of other nodes look to this agent), in
/// 10.128.0.0/9, 10,000 a file.
fn write_pods(dir: &Path, pods: usize) -> Result<()> {
    for (file, start) in (0..pods).step_by(10_000).enumerate() {
        let mut yaml = String::new();
        for i in start..(start + 10_000).min(pods) {
            write!(
                yaml,
                "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p-{i}, namespace: scale-{}}}\nstatus: {{podIP: 10.{}.{}.{}}}\n",
                i % 100,
                128 + i / 65536,
                (i / 256) % 256,
                i % 256
            )?;
        }
        std::fs::write(dir.join(format!("60-pods-{file}.yaml")), yaml)?;
    }
    Ok(())
}

/// Entries `name-0`, `name-1`... of `namespace` (NAMESPACE) claiming `addresses` addresses in
/// 100.96.0.0/12 (networks: 100.112.0.0/12), 4,000 an entry, in file `70-name.yaml`; `as_cidrs` writes each as a /32 network.
fn write_tenant(
    dir: &Path,
    namespace: &str,
    name: &str,
    addresses: usize,
    as_cidrs: bool,
) -> Result<()> {
    let mut yaml = if namespace.starts_with("team-") {
        String::new()
    } else {
        format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {namespace}}}\n")
    };
    for (e, start) in (0..addresses).step_by(4000).enumerate() {
        let list: Vec<String> = (start..(start + 4000).min(addresses))
            .map(|i| {
                // Networks in 100.112.0.0/12, addresses in 100.96.0.0/12: apart.
                let base = if as_cidrs { 112 } else { 96 };
                let ip = format!("100.{}.{}.{}", base + i / 65536, (i / 256) % 256, i % 256);
                if as_cidrs { format!("{ip}/32") } else { ip }
            })
            .collect();
        write!(
            yaml,
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}-{e}, namespace: {namespace}}}\nspec: {{hosts: [{name}-{e}.{namespace}.example], addresses: [{}], ports: [{{number: 80, name: http}}], resolution: STATIC, endpoints: [{{address: 198.18.255.{}}}]}}\n",
            list.join(", "),
            e % 250
        )?;
    }
    std::fs::write(dir.join(format!("70-{name}.yaml")), yaml)?;
    Ok(())
}

/// `CONNECTIONS` curls from `namespace`'s pod to `ip:80`, one after the other; how many got
/// `answer`.
fn curls(w: &World, namespace: &str, ip: &str, answer: &str) -> Result<usize> {
    let script = format!(
        "for i in $(seq {CONNECTIONS}); do curl -sS --max-time {} http://{ip}/; echo; done",
        pace::scaled_secs(5)
    );
    let out = w.client(namespace).cmd("sh").args(["-c", &script]).ok()?;
    let text = out.stdout_str();
    Ok(text.lines().filter(|l| l.trim() == answer).count())
}

/// 100 connections to each of `targets` from `namespace`: every one answered right, and how many
/// the kernel rewrote and passed through, and the proxy carried, meanwhile.
fn connect(w: &World, namespace: &str, targets: &[(&str, &str)]) -> Result<(f64, f64, f64)> {
    let before = w.agent.metrics()?;
    for (ip, answer) in targets {
        let got = curls(w, namespace, ip, answer)?;
        ensure!(
            got == CONNECTIONS,
            "{namespace} -> {ip}: {got} of {CONNECTIONS} answered {answer:?}"
        );
    }
    let after = w.agent.metrics()?;
    let proxied: f64 = PROXY_CONNECTIONS
        .iter()
        .map(|key| delta(&before, &after, key))
        .sum();
    Ok((
        delta(&before, &after, KERNEL_REWRITTEN),
        delta(&before, &after, KERNEL_PASSTHROUGH),
        proxied,
    ))
}

fn config_dump(w: &World) -> Result<serde_json::Value> {
    let r = w.agent.admin_get("/config_dump")?;
    ensure!(r.status == 200, "/config_dump answered {}", r.status);
    serde_json::from_str(&r.text()).context("/config_dump is not JSON")
}

/// The kernel memory the dump says the tables take, in MiB (the kernel's word where it has one).
fn table_mib(fast: &serde_json::Value) -> f64 {
    let Some(tables) = fast["memory"].as_object() else {
        return 0.0;
    };
    let bytes: u64 = tables
        .values()
        .map(|t| {
            t["kernelBytes"]
                .as_u64()
                .or(t["estimatedBytes"].as_u64())
                .unwrap_or(0)
        })
        .sum();
    bytes as f64 / f64::from(1 << 20)
}

#[test]
fn the_kernel_decides_for_a_pod_at_a_big_clusters_size() -> Result<()> {
    let _turn = take_turn();
    type Edit = fn(&Path) -> Result<()>;
    let configurations: [(&str, Edit); 3] = [
        ("20,000 entries", |dir| write_entries(dir, 100, 20_000)),
        ("20,000 entries and 70,000 Pods", |dir| {
            write_entries(dir, 100, 20_000)?;
            write_pods(dir, 70_000)
        }),
        (
            "20,000 entries and a tenant claiming 40,000 addresses",
            |dir| {
                write_entries(dir, 100, 20_000)?;
                write_tenant(dir, "scale-tenant", "tenant", 40_000, false)
            },
        ),
    ];
    for (name, edit) in configurations {
        let w = World::start_args(edit, &Launch::default(), &[])?;
        let (rewritten, passed, proxied) = connect(
            &w,
            "team-a",
            &[(OWN_VIP, OWN_ANSWER), (UNCLAIMED, UNCLAIMED_ANSWER)],
        )?;
        let fast = &config_dump(&w)?["fastPath"];
        eprintln!(
            "{name}: kernel rewrote {rewritten}, passed {passed} through; the proxy carried {proxied}; agent {:.1} MiB, tables {:.1} MiB in the kernel; fallbacks {}",
            w.agent.rss_kib()? as f64 / 1024.0,
            table_mib(fast),
            fast["fallbacks"]
        );
        ensure!(
            rewritten >= 90.0 && passed >= 90.0 && proxied <= 10.0,
            "{name}: the kernel must decide at least 90 of each 100 ({rewritten} rewritten, {passed} passed through, {proxied} proxied); fast path: {}",
            fast["fallbacks"]
        );
        ensure!(
            fast["fallbacks"].get("shared_full").is_none(),
            "{name}: {fast:#}"
        );
        drop(w);
    }
    Ok(())
}

/// team-a's hidden entries claim 4,097 networks and 16,385 addresses. team-b's pod still reaches
/// its own entry and team-a's address (passed through, from the pod's own address) in the
/// kernel, with the default budget and with one too small for team-a, which then has its own
/// clients decided by the proxy, with the same answers.
#[test]
fn one_tenants_hidden_addresses_leave_its_neighbours_in_the_kernel() -> Result<()> {
    let _turn = take_turn();
    let edit = |dir: &Path| -> Result<()> {
        write_tenant(dir, "team-a", "networks", 4097, true)?;
        write_tenant(dir, "team-a", "addresses", 16_385, false)
    };
    for budget in [None, Some("1MiB")] {
        let extra: Vec<&str> = budget
            .map(|b| vec!["--fast-path-memory", b])
            .unwrap_or_default();
        let w = World::start_args(edit, &Launch::default(), &extra)?;
        let (rewritten, passed, proxied) = connect(
            &w,
            "team-b",
            &[
                (B_OWN_VIP, B_OWN_ANSWER),
                (OWN_VIP, UNCLAIMED_ANSWER_OF_OWN_VIP),
            ],
        )?;
        let fast = &config_dump(&w)?["fastPath"];
        eprintln!(
            "budget {budget:?}: team-b: kernel rewrote {rewritten}, passed {passed} through; the proxy carried {proxied}; fallbacks {}",
            fast["fallbacks"]
        );
        ensure!(
            rewritten >= 90.0 && passed >= 90.0 && proxied <= 10.0,
            "budget {budget:?}: team-b must stay in the kernel ({rewritten} rewritten, {passed} passed through, {proxied} proxied): {}",
            fast["fallbacks"]
        );
        let source = w
            .client("team-b")
            .cmd("curl")
            .args(["-sS", "--fail", "--max-time", &pace::scaled_secs(10)])
            .arg(format!("http://{OWN_VIP}/peer"))
            .ok()?
            .stdout_str();
        ensure!(
            source.trim().starts_with(&format!("{B1_IP}:")),
            "team-b's passthrough must leave from the pod's own address, the real host saw {source}"
        );
        let team_a_full = fast["fallbacks"].get("namespace_full").is_some();
        ensure!(
            team_a_full == budget.is_some(),
            "budget {budget:?}: team-a's own entries fit only in the default budget: {}",
            fast["fallbacks"]
        );
        // team-a itself: its own entry answers the same, from the kernel or the proxy.
        let (a_rewritten, _, a_proxied) = connect(&w, "team-a", &[(OWN_VIP, OWN_ANSWER)])?;
        match budget {
            None => ensure!(a_rewritten >= 90.0, "team-a in the kernel: {a_rewritten}"),
            Some(_) => ensure!(a_proxied >= 90.0, "team-a by the proxy: {a_proxied}"),
        }
        drop(w);
    }
    Ok(())
}

/// What the real host behind team-a's VIP answers (team-b does not see team-a's entry).
const UNCLAIMED_ANSWER_OF_OWN_VIP: &str = "real-203.0.113.10";

/// team-a's 4,096 `resolution: DNS` entries, one host each, answered by the upstream with TTL 0
/// (kept 5 s, the floor): far more lookups than the agent's rate allows, so their answers keep
/// ending and coming back. Another namespace is not held back: a new team-b entry is in force
/// within a second, `/config_dump` answers within a second, and istio-system's endpoint host name
/// is still resolved ahead and decided in the kernel; the tables change at most ten times a second.
#[test]
fn one_tenants_churning_host_names_hold_no_one_else_back() -> Result<()> {
    let _turn = take_turn();
    use integration::DnsRecords;
    use integration::world::{LASTING_DNS, PUBLIC_DNS, PUBLIC_DNS6};
    use std::time::{Duration, Instant};

    const TENANT_DOMAIN: &str = "dns-tenant.example";
    let edit = |dir: &Path| -> Result<()> {
        let mut yaml = String::new();
        for i in 0..4096 {
            write!(
                yaml,
                "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: dns-{i}, namespace: team-a}}\nspec: {{hosts: [h{i}.{TENANT_DOMAIN}], ports: [{{number: 80, name: http}}], resolution: DNS}}\n"
            )?;
        }
        std::fs::write(dir.join("70-team-a-dns.yaml"), yaml)?;
        Ok(())
    };
    let mut w = World::start_args(edit, &Launch::default(), &[])?;
    // The world's answers, and every name of the tenant's domain.
    let mut records = DnsRecords::new();
    for (host, ip) in PUBLIC_DNS.iter().chain(PUBLIC_DNS6) {
        records = records.host(host, ip.parse()?);
    }
    for (host, ip, ttl) in LASTING_DNS {
        records = records.host_ttl(host, ip.parse()?, *ttl);
    }
    w.upstream
        .restart_with(records.domain(TENANT_DOMAIN, "198.18.5.5".parse()?))?;
    // Let the tenant's names resolve, and their answers start to end.
    std::thread::sleep(pace::scaled(Duration::from_secs(8)));

    let swaps = |w: &World| {
        w.agent
            .log()
            .matches("fast path: new tables in force")
            .count()
    };
    let (swaps_before, watched) = (swaps(&w), Instant::now());
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let asked = Instant::now();
        let dump = config_dump(&w)?;
        slowest = slowest.max(asked.elapsed());
        let fast = &dump["fastPath"];
        let cdn = fast["services"].as_array().and_then(|s| {
            s.iter()
                .find(|d| d["service"] == "istio-system/cdn" && d["address"] == "203.0.113.60")
        });
        ensure!(
            cdn.is_some_and(|d| d["decidedBy"] == "kernel"),
            "istio-system's host name must stay resolved ahead: {cdn:?}; host names {}",
            w.agent
                .metrics()?
                .get("redirect_fast_path_host_names{state=\"fresh\"}")
                .unwrap_or(-1.0)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    ensure!(
        slowest < Duration::from_secs(1),
        "/config_dump took {slowest:?}"
    );

    // A new team-b entry, in force within a second.
    let written = Instant::now();
    std::fs::write(
        w.config_dir().join("80-team-b-new.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: newcomer, namespace: team-b}\nspec: {hosts: [newcomer.example.com], addresses: [203.0.113.77], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.41}]}\n",
    )?;
    let in_force = loop {
        let fast = &config_dump(&w)?["fastPath"];
        let found = fast["services"].as_array().is_some_and(|s| {
            s.iter()
                .any(|d| d["service"] == "team-b/newcomer" && d["decidedBy"] == "kernel")
        });
        if found {
            break written.elapsed();
        }
        ensure!(
            written.elapsed() < pace::scaled(Duration::from_secs(10)),
            "team-b's new entry never came in force"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let got = curls(&w, "team-b", "203.0.113.77", "shared-private-endpoint")?;
    ensure!(
        got == CONNECTIONS,
        "team-b -> its new entry: {got} answered"
    );
    let per_second = (swaps(&w) - swaps_before) as f64 / watched.elapsed().as_secs_f64();
    eprintln!(
        "config_dump at most {slowest:?}; team-b's new entry in force in {in_force:?}; {per_second:.1} table swaps a second"
    );
    ensure!(
        in_force < Duration::from_secs(1),
        "team-b's new entry took {in_force:?}"
    );
    // Answers are told at most every 100 ms; the new entry adds a swap or two.
    ensure!(per_second <= 15.0, "{per_second:.1} table swaps a second");
    Ok(())
}
