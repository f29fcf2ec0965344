//! The Kubernetes API source at cluster scale: 10,000 Pods, 10,000 ServiceEntries and 1,000
//! Namespaces served by the test API server, watched by the real agent (`run --kube`) in a node
//! netns. Measures what the agent holds (RSS), how long one snapshot rebuild takes over that model,
//! and how soon a burst of 1,000 pod changes is in force. Needs root (netns, cgroups, eBPF).
//!
//! `cargo build --release -p tests --bin kube_scale && sudo target/release/kube_scale [--json FILE]`
//! (after `cargo xtask build`; `REDIRECT_BIN` names another agent binary). `--json` also writes the
//! figures and their targets to FILE, for `cargo xtask bench --kube`; `--rebuild-only` times the
//! rebuild alone, in this process.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::apiserver::ApiServer;
use integration::{Agent, Topology};
use redirect_userspace::cluster::{self, Change, Kind, Store};
use serde_json::{Value, json};

const NAMESPACES: usize = 1_000;
const PODS: usize = 10_000;
const ENTRIES: usize = 10_000;
const BURST: usize = 1_000;

const RSS_TARGET_MIB: f64 = 96.0;
const REBUILD_TARGET: Duration = Duration::from_millis(50);
const BURST_TARGET: Duration = Duration::from_secs(1);

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
fn pod(i: usize, revision: usize) -> Value {
    let ip = format!("10.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("app-{i}-7d9f8b6c5-x2x4z"), "namespace": format!("ns-{}", i % NAMESPACES),
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
            "nodeName": format!("node-{}", i % 20), "serviceAccountName": "default", "restartPolicy": "Always",
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

fn entry(i: usize) -> Value {
    json!({
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
        "metadata": {"name": format!("svc-{i}"), "namespace": format!("ns-{}", i % NAMESPACES),
                     "uid": uid(4, i), "creationTimestamp": "2026-01-01T00:00:00Z",
                     "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"networking.istio.io/v1\",\"kind\":\"ServiceEntry\"}"}},
        "spec": {"hosts": [format!("svc-{i}.example.com")],
                 "addresses": [format!("100.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256)],
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

fn objects() -> Vec<(Kind, Value)> {
    let mut all = vec![(Kind::MeshConfig, mesh())];
    all.extend((0..NAMESPACES).map(|i| (Kind::Namespace, namespace(i))));
    all.extend((0..PODS).map(|i| (Kind::Pod, pod(i, 0))));
    all.extend((0..ENTRIES).map(|i| (Kind::ServiceEntry, entry(i))));
    all
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
fn rebuild_time() -> Result<Rebuild> {
    let mut store = Store::default();
    let now = "2026-01-01T00:00:00Z";
    for kind in Kind::ALL {
        store.apply(Change::Relist(kind), now);
    }
    for (kind, object) in objects() {
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
        let converted = cluster::kinds::convert(kind, &api_version, object);
        ensure!(converted.errors.is_empty(), "{:?}", converted.errors);
        store.apply(Change::Upsert(kind, key, Box::new(converted)), now);
    }
    for kind in Kind::ALL {
        store.apply(Change::Listed(kind), now);
    }
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
        let (snapshot, errors) = cluster::build(&model, errors);
        times.push(started.elapsed());
        cpu.push(thread_cpu_time().saturating_sub(cpu_started));
        ensure!(errors.is_empty(), "{errors:?}");
        services = snapshot.services().count();
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

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json_out = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--json" => Some(std::path::PathBuf::from(path)),
        // The in-process part alone (no agent, no root): for trying a change to the rebuild.
        [flag] if flag == "--rebuild-only" => {
            let r = rebuild_time()?;
            println!(
                "snapshot rebuild (median of 9): {:.1} ms, {:.1} ms on the thread's CPU clock, of which the store's model {:.1} ms ({} services)",
                r.wall.as_secs_f64() * 1e3,
                r.cpu.as_secs_f64() * 1e3,
                r.model.as_secs_f64() * 1e3,
                r.services
            );
            return Ok(());
        }
        _ => anyhow::bail!("usage: kube_scale [--json FILE | --rebuild-only]"),
    };
    integration::require_root()?;
    let Rebuild {
        wall: rebuild,
        cpu: rebuild_cpu,
        model: modelling,
        services,
    } = rebuild_time()?;

    let topo = Topology::new()?;
    let api = ApiServer::start(&topo.node().netns)?;
    for (_, object) in objects() {
        api.put(object)?;
    }
    let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
    let started = Instant::now();
    let agent = Agent::start(
        &topo,
        &[
            "--kube",
            "--kubeconfig",
            &kubeconfig.to_string_lossy(),
            "--dns-upstream",
            "192.0.2.2:53",
        ],
    )?;
    let ready_after = started.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    let rss_mib = agent.rss_kib()? as f64 / 1024.0;

    // A burst: 1,000 pods relabelled, then one pod refused (the marker: when the rejected count
    // shows it, the snapshot holding the whole burst is in force).
    let rejected = r#"redirect_config_objects_rejected{kind="Pod"}"#;
    ensure!(agent.metrics()?.get_or_zero(rejected) == 0.0);
    let started = Instant::now();
    for i in 0..BURST {
        api.put(pod(i, 1))?;
    }
    let mut bad = pod(BURST, 1);
    bad["status"]["podIP"] = json!("10.999.0.1");
    bad["status"]["podIPs"] = json!([{"ip": "10.999.0.1"}]);
    api.put(bad)?;
    let sent = started.elapsed();
    agent
        .wait_metrics("the burst applied", Duration::from_secs(10), |m| {
            m.get_or_zero(rejected) == 1.0
        })
        .context("the burst never applied")?;
    let burst = started.elapsed();
    let rss_after_mib = agent.rss_kib()? as f64 / 1024.0;
    agent.stop()?;
    if let Some(path) = &json_out {
        let figures = json!({
            "namespaces": NAMESPACES, "pods": PODS, "entries": ENTRIES, "services": services,
            "ready_s": ready_after.as_secs_f64(),
            "rss_mib": rss_mib, "rss_after_burst_mib": rss_after_mib, "rss_target_mib": RSS_TARGET_MIB,
            "rebuild_ms": rebuild.as_secs_f64() * 1e3, "rebuild_cpu_ms": rebuild_cpu.as_secs_f64() * 1e3,
            "model_ms": modelling.as_secs_f64() * 1e3,
            "rebuild_target_ms": REBUILD_TARGET.as_secs_f64() * 1e3,
            "burst": BURST, "burst_ms": burst.as_secs_f64() * 1e3,
            "burst_target_ms": BURST_TARGET.as_secs_f64() * 1e3,
        });
        std::fs::write(path, figures.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }

    let verdict = |ok: bool| if ok { "within target" } else { "OVER TARGET" };
    println!(
        "kube source at scale: {NAMESPACES} Namespaces, {PODS} Pods, {ENTRIES} ServiceEntries ({services} services served)"
    );
    println!(
        "  agent ready after the first full list  {:>8.2} s",
        ready_after.as_secs_f64()
    );
    println!(
        "  agent RSS, all held                    {rss_mib:>8.1} MiB  (target <= {RSS_TARGET_MIB} MiB: {})",
        verdict(rss_mib <= RSS_TARGET_MIB)
    );
    println!(
        "  agent RSS after the burst              {rss_after_mib:>8.1} MiB  ({})",
        verdict(rss_after_mib <= RSS_TARGET_MIB)
    );
    println!(
        "  snapshot rebuild (median of 9)         {:>8.1} ms   (target <= {} ms: {})",
        rebuild.as_secs_f64() * 1e3,
        REBUILD_TARGET.as_millis(),
        verdict(rebuild <= REBUILD_TARGET)
    );
    println!(
        "    on the thread's CPU clock            {:>8.1} ms",
        rebuild_cpu.as_secs_f64() * 1e3
    );
    println!(
        "    of which the store's model           {:>8.1} ms",
        modelling.as_secs_f64() * 1e3
    );
    println!(
        "  burst of {BURST} pod changes in force     {:>8.1} ms   (sent in {:.1} ms; target <= {} ms: {})",
        burst.as_secs_f64() * 1e3,
        sent.as_secs_f64() * 1e3,
        BURST_TARGET.as_millis(),
        verdict(burst <= BURST_TARGET)
    );
    Ok(())
}
