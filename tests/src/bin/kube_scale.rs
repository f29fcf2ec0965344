//! The Kubernetes API source at cluster scale: Namespaces, Pods (some on the agent's node, the rest
//! spread over 19 other nodes) and ServiceEntries served by the test API server, watched by the real
//! agent (`run --kube --node-name node-0`) in a node netns. Measures what the agent holds (RSS), how
//! soon it is ready, how long one snapshot rebuild takes over that model, and how soon one pod change
//! on another node, one ServiceEntry change and a burst of pod changes are in force. Needs root
//! (netns, cgroups, eBPF).
//!
//! `cargo build --release -p tests --bin kube_scale && sudo target/release/kube_scale [--json FILE]`
//! (after `cargo xtask build`; `REDIRECT_BIN` names another agent binary). The cluster's size is
//! given by flags (`--namespaces`, `--pods`, `--entries`, `--node-pods`); `--cluster-wide` runs the
//! agent without a node name (every pod of the cluster held whole, as before node scoping).
//! `--json` also writes the figures and their targets to FILE, for `cargo xtask bench --kube`;
//! `--rebuild-only` times the rebuild alone, in this process.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use integration::apiserver::ApiServer;
use integration::{Agent, Topology};
use redirect_userspace::kube::{self, Change, Kind, Store};
use serde_json::{Value, json};

/// The agent's node; the other pods are spread over `node-1` .. `node-19`.
const NODE: &str = "node-0";
const OTHER_NODES: usize = 19;

const REBUILD_TARGET: Duration = Duration::from_millis(50);
const READY_TARGET: Duration = Duration::from_secs(5);
const ONE_CHANGE_TARGET: Duration = Duration::from_millis(100);
const BURST_TARGET: Duration = Duration::from_secs(1);
/// Agents started to time readiness (the median counts).
const READY_STARTS: usize = 3;

/// The cluster: its size, and how the agent watches it.
#[derive(Debug, Clone, Parser)]
#[command(about = "The --kube agent against a cluster of a given size")]
struct Cluster {
    #[arg(long, default_value_t = 1_000)]
    namespaces: usize,
    #[arg(long, default_value_t = 10_000)]
    pods: usize,
    /// ServiceEntries.
    #[arg(long, default_value_t = 10_000)]
    entries: usize,
    /// Pods on the agent's node (the first ones; at most `--pods`).
    #[arg(long, default_value_t = 110)]
    node_pods: usize,
    /// Pods changed at once in the burst.
    #[arg(long, default_value_t = 1_000)]
    burst: usize,
    /// Run the agent without `--node-name`: it holds every pod of the cluster as a client.
    #[arg(long)]
    cluster_wide: bool,
    /// One more argument for the agent (repeatable), e.g. `--agent-arg=--no-fast-path`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    agent_arg: Vec<String>,
    /// Also write the figures to this file, as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Time the rebuild alone, in this process (no agent, no root).
    #[arg(long)]
    rebuild_only: bool,
    /// Also write the agent's log (timestamped: where a change's time went) to this file.
    #[arg(long, value_name = "FILE")]
    agent_log: Option<PathBuf>,
}

impl Cluster {
    /// The agent's memory target: a node's share, growing far slower than the cluster.
    fn rss_target_mib(&self) -> f64 {
        if self.pods <= 10_000 { 64.0 } else { 96.0 }
    }

    fn node_of(&self, pod: usize) -> String {
        if pod < self.node_pods {
            NODE.to_string()
        } else {
            format!("node-{}", 1 + pod % OTHER_NODES)
        }
    }
}

fn namespace(i: usize) -> Value {
    let mut labels = json!({"team": format!("t{}", i % 50)});
    if i.is_multiple_of(10) {
        labels["trusted"] = json!("true");
    }
    json!({"apiVersion": "v1", "kind": "Namespace",
           "metadata": {"name": format!("ns-{i}"), "uid": uid(1, i), "labels": labels,
                        "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}})
}

fn uid(kind: usize, i: usize) -> String {
    format!("{kind:08x}-0000-4000-8000-{i:012x}")
}

/// A pod as the API serves it: the fields the agent ignores are there too, as on a real cluster.
/// A revision moves the pod to another address (as a rescheduled pod gets) and relabels it.
fn pod(c: &Cluster, i: usize, revision: usize) -> Value {
    let ip = format!(
        "10.{}.{}.{}",
        64 + i / 65536 + 4 * revision,
        (i / 256) % 256,
        i % 256
    );
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("app-{i}-7d9f8b6c5-x2x4z"), "namespace": format!("ns-{}", i % c.namespaces),
            "uid": uid(2, i), "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": format!("app-{}", i % 100), "pod-template-hash": "7d9f8b6c5", "revision": revision.to_string()},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z",
                            "prometheus.io/scrape": "true", "prometheus.io/port": "9090"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("app-{i}-7d9f8b6c5"),
                                 "uid": uid(3, i), "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                               "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
                               "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}, "f:pod-template-hash": {}}},
                                            "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {"f:image": {}, "f:ports": {}}}}}},
                              {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "subresource": "status",
                               "time": "2026-01-01T00:00:05Z", "fieldsType": "FieldsV1",
                               "fieldsV1": {"f:status": {"f:conditions": {}, "f:podIP": {}, "f:podIPs": {}}}}]
        },
        "spec": {
            "nodeName": c.node_of(i), "serviceAccountName": "default", "restartPolicy": "Always",
            "containers": [{
                "name": "app", "image": "registry.example.com/app:1.2.3", "imagePullPolicy": "IfNotPresent",
                "args": ["--port=8080", "--log-level=info"],
                "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "MODE", "value": "production"}],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                "volumeMounts": [{"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}]
            }],
            "volumes": [{"name": "kube-api-access", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        },
        "status": {
            "phase": "Running", "hostIP": "192.0.2.10", "podIP": ip, "podIPs": [{"ip": ip}],
            "startTime": "2026-01-01T00:00:01Z", "qosClass": "Burstable",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"}],
            "containerStatuses": [{"name": "app", "ready": true, "restartCount": 0, "image": "registry.example.com/app:1.2.3",
                                   "imageID": "registry.example.com/app@sha256:0123456789abcdef", "containerID": "containerd://0123456789abcdef",
                                   "state": {"running": {"startedAt": "2026-01-01T00:00:04Z"}}}]
        }
    })
}

/// A revision moves the entry to another address.
fn entry(c: &Cluster, i: usize, revision: usize) -> Value {
    json!({
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
        "metadata": {"name": format!("svc-{i}"), "namespace": format!("ns-{}", i % c.namespaces),
                     "uid": uid(4, i), "creationTimestamp": "2026-01-01T00:00:00Z",
                     "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"networking.istio.io/v1\",\"kind\":\"ServiceEntry\"}"}},
        "spec": {"hosts": [format!("svc-{i}.example.com")],
                 "addresses": [format!("100.{}.{}.{}", 64 + i / 65536 + 4 * revision, (i / 256) % 256, i % 256)],
                 "ports": [{"number": 443, "name": "https", "protocol": "TLS"}],
                 "location": "MESH_EXTERNAL", "resolution": "STATIC",
                 "endpoints": [{"address": format!("198.18.{}.{}", (i / 256) % 256, i % 256)}]}
    })
}

fn mesh() -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "istio", "namespace": "istio-system"},
           "data": {"mesh": "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n  policies:\n  - visibility: PUBLIC\n    matchingRules:\n    - namespaceSelector:\n        matchLabels: {trusted: \"true\"}\n"}})
}

/// Every object, with the watch that reports it to an agent on `node-0`.
fn objects(c: &Cluster) -> impl Iterator<Item = (Kind, Value)> + '_ {
    let pod_kind = |i: usize| match c.cluster_wide || i < c.node_pods {
        true => Kind::Pod,
        false => Kind::PodElsewhere,
    };
    std::iter::once((Kind::MeshConfig, mesh()))
        .chain((0..c.namespaces).map(|i| (Kind::Namespace, namespace(i))))
        .chain((0..c.pods).map(move |i| (pod_kind(i), pod(c, i, 0))))
        .chain((0..c.entries).map(|i| (Kind::ServiceEntry, entry(c, i, 0))))
}

/// The CPU time this thread has used: unlike the wall clock, not stretched when the shared machine
/// runs something else.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given, nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The medians of a few rebuilds.
struct Rebuild {
    /// Wall clock: the store's model, visibility, the snapshot.
    wall: Duration,
    /// The same on this thread's CPU clock.
    cpu: Duration,
    /// Wall clock of the first step alone (the store's model).
    model: Duration,
    services: usize,
}

/// One snapshot rebuild over the whole model, in this process: the store's model, visibility,
/// the snapshot. The median of a few.
fn rebuild_time(c: &Cluster) -> Result<Rebuild> {
    let kinds = Kind::watched(!c.cluster_wide);
    let mut store = Store::new(&kinds);
    let now = "2026-01-01T00:00:00Z";
    for &kind in &kinds {
        store.apply(Change::Relist(kind), now);
    }
    for (kind, object) in objects(c) {
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
        let api_version = object["apiVersion"].as_str().unwrap_or("v1").to_string();
        let converted = kube::convert(kind, &api_version, object);
        ensure!(converted.errors.is_empty(), "{:?}", converted.errors);
        store.apply(Change::Upsert(kind, key, Box::new(converted)), now);
    }
    for &kind in &kinds {
        store.apply(Change::Listed(kind), now);
    }
    let held = rss_mib()?;
    let mut times = Vec::new();
    let mut cpu = Vec::new();
    let mut modelling = Vec::new();
    let mut services = 0;
    for _ in 0..9 {
        let started = Instant::now();
        let cpu_started = thread_cpu_time();
        let (model, errors) = {
            let (model, errors, _) = store.model();
            (model, errors)
        };
        modelling.push(started.elapsed());
        let (snapshot, errors) = kube::build(&model, errors);
        times.push(started.elapsed());
        cpu.push(thread_cpu_time().saturating_sub(cpu_started));
        ensure!(errors.is_empty(), "{errors:?}");
        services = snapshot.services().count();
    }
    if c.rebuild_only {
        let (model, errors, _) = store.model();
        let (snapshot, _) = kube::build(&model, errors);
        let with_snapshot = rss_mib()?;
        drop(model);
        println!(
            "this process's RSS: {held:.1} MiB with the store filled, {with_snapshot:.1} MiB with a model and a snapshot ({} services) besides",
            snapshot.services().count()
        );
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    Ok(Rebuild {
        wall: median(times),
        cpu: median(cpu),
        model: median(modelling),
        services,
    })
}

/// This process's resident memory.
fn rss_mib() -> Result<f64> {
    Ok(integration::procfs::rss_kib(std::process::id())? as f64 / 1024.0)
}

/// Polls the agent's metrics, often (a change is in force within milliseconds), until `done`.
fn wait_for(
    agent: &Agent,
    what: &str,
    done: impl Fn(&integration::metrics::Metrics) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if done(&agent.metrics()?) {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{what}: not in force after 60 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Snapshots put in force so far.
fn applied(m: &integration::metrics::Metrics) -> f64 {
    m.get_or_zero(r#"redirect_config_reloads_total{result="ok"}"#)
        + m.get_or_zero(r#"redirect_config_reloads_total{result="partial"}"#)
}

/// Puts `objects` and waits until a snapshot newer than the one in force holds them; `marker`
/// tells when it is that one. Returns the time from the first put.
fn in_force(
    api: &ApiServer,
    agent: &Agent,
    what: &str,
    objects: Vec<Value>,
    marker: impl Fn(&integration::metrics::Metrics, f64) -> bool,
) -> Result<Duration> {
    let before = applied(&agent.metrics()?);
    let started = Instant::now();
    for object in objects {
        api.put(object)?;
    }
    wait_for(agent, what, |m| marker(m, before))?;
    Ok(started.elapsed())
}

fn main() -> Result<()> {
    let c = Cluster::parse();
    if c.rebuild_only {
        let r = rebuild_time(&c)?;
        println!(
            "snapshot rebuild (median of 9): {:.1} ms, {:.1} ms on the thread's CPU clock, of which the store's model {:.1} ms ({} services)",
            r.wall.as_secs_f64() * 1e3,
            r.cpu.as_secs_f64() * 1e3,
            r.model.as_secs_f64() * 1e3,
            r.services
        );
        return Ok(());
    }
    ensure!(
        c.node_pods < c.pods && c.burst < c.pods,
        "--node-pods and --burst must be below --pods (a pod elsewhere changes too)"
    );
    integration::require_root()?;
    let Rebuild {
        wall: rebuild,
        cpu: rebuild_cpu,
        model: modelling,
        services,
    } = rebuild_time(&c)?;

    let topo = Topology::new()?;
    let api = ApiServer::start(&topo.node().netns)?;
    for (_, object) in objects(&c) {
        api.put(object)?;
    }
    let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
    let kubeconfig = kubeconfig.to_string_lossy().to_string();
    let mut args = vec![
        "--kube",
        "--kubeconfig",
        &kubeconfig,
        "--dns-upstream",
        "192.0.2.2:53",
    ];
    if !c.cluster_wide {
        args.extend(["--node-name", NODE]);
    }
    args.extend(c.agent_arg.iter().map(String::as_str));
    // Readiness is one sample per start, and a start moves by a second on a shared machine: the
    // median of a few starts (each agent but the last stopped cleanly), the range printed beside.
    let mut starts = Vec::new();
    let agent = loop {
        let started = Instant::now();
        let agent = Agent::start(&topo, &args)?;
        starts.push(started.elapsed());
        if starts.len() == READY_STARTS {
            break agent;
        }
        agent.stop()?;
    };
    starts.sort();
    let ready_after = starts[starts.len() / 2];
    let ready_range = format!(
        "{:.2}-{:.2} s over {} starts",
        starts[0].as_secs_f64(),
        starts[starts.len() - 1].as_secs_f64(),
        starts.len()
    );
    std::thread::sleep(Duration::from_secs(2));
    let rss_mib = agent.rss_kib()? as f64 / 1024.0;

    // One pod on another node moves (a new address), then one ServiceEntry does: each in force once
    // a snapshot after it is.
    let one_pod = in_force(
        &api,
        &agent,
        "a pod elsewhere moved",
        vec![pod(&c, c.node_pods, 1)],
        |m, before| applied(m) > before,
    )?;
    let one_entry = in_force(
        &api,
        &agent,
        "a ServiceEntry moved",
        vec![entry(&c, 0, 1)],
        |m, before| applied(m) > before,
    )?;

    // A burst: pods moved and relabelled, then one pod refused (the marker: when the rejected
    // count shows it, the snapshot holding the whole burst is in force).
    let rejected = r#"redirect_config_objects_rejected{kind="Pod"}"#;
    ensure!(agent.metrics()?.get_or_zero(rejected) == 0.0);
    let mut burst: Vec<Value> = (0..c.burst).map(|i| pod(&c, i, 2)).collect();
    let mut bad = pod(&c, c.burst, 2);
    bad["status"]["podIP"] = json!("10.999.0.1");
    bad["status"]["podIPs"] = json!([{"ip": "10.999.0.1"}]);
    burst.push(bad);
    let burst_took = in_force(&api, &agent, "the burst", burst, |m, _| {
        m.get_or_zero(rejected) == 1.0
    })?;
    let rss_after_mib = agent.rss_kib()? as f64 / 1024.0;
    if let Some(path) = &c.agent_log {
        std::fs::write(path, agent.log()).with_context(|| format!("writing {}", path.display()))?;
    }
    agent.stop()?;
    let rss_target_mib = c.rss_target_mib();
    if let Some(path) = &c.json {
        let figures = json!({
            "namespaces": c.namespaces, "pods": c.pods, "entries": c.entries, "services": services,
            "node_pods": c.node_pods, "cluster_wide": c.cluster_wide,
            "ready_s": ready_after.as_secs_f64(), "ready_target_s": READY_TARGET.as_secs_f64(),
            "ready_min_s": starts[0].as_secs_f64(), "ready_max_s": starts[starts.len() - 1].as_secs_f64(),
            "rss_mib": rss_mib, "rss_after_burst_mib": rss_after_mib, "rss_target_mib": rss_target_mib,
            "rebuild_ms": rebuild.as_secs_f64() * 1e3, "rebuild_cpu_ms": rebuild_cpu.as_secs_f64() * 1e3,
            "model_ms": modelling.as_secs_f64() * 1e3,
            "rebuild_target_ms": REBUILD_TARGET.as_secs_f64() * 1e3,
            "one_pod_ms": one_pod.as_secs_f64() * 1e3, "one_entry_ms": one_entry.as_secs_f64() * 1e3,
            "one_change_target_ms": ONE_CHANGE_TARGET.as_secs_f64() * 1e3,
            "burst": c.burst, "burst_ms": burst_took.as_secs_f64() * 1e3,
            "burst_target_ms": BURST_TARGET.as_secs_f64() * 1e3,
        });
        std::fs::write(path, figures.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }

    let verdict = |ok: bool| if ok { "within target" } else { "OVER TARGET" };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "kube source at scale: {} Namespaces, {} Pods ({} on the agent's node{}), {} ServiceEntries ({services} services served)",
        c.namespaces,
        c.pods,
        c.node_pods,
        if c.cluster_wide {
            "; agent cluster-wide"
        } else {
            ""
        },
        c.entries
    );
    println!(
        "  agent ready after start (median)       {:>8.2} s    (target <= {} s: {}; {ready_range})",
        ready_after.as_secs_f64(),
        READY_TARGET.as_secs(),
        verdict(ready_after <= READY_TARGET)
    );
    println!(
        "  agent RSS, all held                    {rss_mib:>8.1} MiB  (target <= {rss_target_mib} MiB: {})",
        verdict(rss_mib <= rss_target_mib)
    );
    println!(
        "  agent RSS after the burst              {rss_after_mib:>8.1} MiB  ({})",
        verdict(rss_after_mib <= rss_target_mib)
    );
    println!(
        "  snapshot rebuild (median of 9)         {:>8.1} ms   (target <= {} ms: {})",
        ms(rebuild),
        REBUILD_TARGET.as_millis(),
        verdict(rebuild <= REBUILD_TARGET)
    );
    println!(
        "    on the thread's CPU clock            {:>8.1} ms",
        ms(rebuild_cpu)
    );
    println!(
        "    of which the store's model           {:>8.1} ms",
        ms(modelling)
    );
    for (what, took, target) in [
        ("one pod elsewhere moved", one_pod, ONE_CHANGE_TARGET),
        ("one ServiceEntry moved ", one_entry, ONE_CHANGE_TARGET),
        ("burst of pod changes   ", burst_took, BURST_TARGET),
    ] {
        println!(
            "  {what} in force      {:>8.1} ms   (target <= {} ms: {})",
            ms(took),
            target.as_millis(),
            verdict(took <= target)
        );
    }
    Ok(())
}
