//! The Kubernetes API as the source (`redirect run --kube`), on real traffic: the agent watches a
//! test API server (list, watch, bookmarks, 410 Gone, discovery, 403) through kube-rs, and the
//! pods' real `dig` and `curl` must see what the objects served say, as they change.
//!
//! The world is the one of the file-based suites (`examples/`, five client namespaces, dnsmasq in
//! ext); the test server serves the same objects, and `redirect explain` over the directory says
//! what each client must get.
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use integration::dig::{self, Reply};
use integration::explain::{DnsAction, OutboundOutcome};
use integration::world::{Reach, World, key};
use integration::{pace, pod_ip6};
use serde_json::{Value, json};

const EVERYONE: [&str; 5] = ["team-a", "team-b", "team-c", "istio-system", "quarantine"];

/// How soon a change made through the API must show in dig and curl.
const APPLIED_WITHIN: Duration = Duration::from_secs(1);

fn dig(w: &World, from: &str, name: &str) -> Result<Reply> {
    dig::run(w.dig_cmd(from).arg(name))
}

fn a_records(w: &World, from: &str, name: &str) -> Result<Vec<Ipv4Addr>> {
    Ok(dig(w, from, name)?.a_records())
}

/// Polls `done` until it holds; fails past `limit` (scaled to the machine's pace). Returns how
/// long it took.
fn within(what: &str, limit: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<Duration> {
    let limit = pace::scaled(limit);
    let started = Instant::now();
    loop {
        if done()? {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn service_entry(namespace: &str, name: &str, host: &str, address: &str) -> Value {
    json!({
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"hosts": [host], "addresses": [address], "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}],
                 "location": "MESH_EXTERNAL", "resolution": "STATIC",
                 "endpoints": [{"address": "198.51.100.20"}]}
    })
}

fn watch_states(w: &World) -> Result<Vec<Value>> {
    let dump = w.config_dump()?;
    dump["config"]["watches"]
        .as_array()
        .or_else(|| dump["status"]["watches"].as_array())
        .or_else(|| find_watches(&dump))
        .cloned()
        .with_context(|| format!("no watches in /config_dump: {dump:#}"))
}

/// The `watches` array wherever `/config_dump` keeps the configuration's status.
fn find_watches(v: &Value) -> Option<&Vec<Value>> {
    match v {
        Value::Object(map) => map
            .get("watches")
            .and_then(Value::as_array)
            .or_else(|| map.values().find_map(find_watches)),
        _ => None,
    }
}

fn watch_of<'a>(watches: &'a [Value], kind: &str) -> Result<&'a Value> {
    watches
        .iter()
        .find(|w| w["kind"] == kind)
        .with_context(|| format!("no watch of {kind}"))
}

#[test]
fn the_visibility_scenarios_hold_with_the_cluster_as_source() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    let watches = watch_states(&w)?;
    for kind in [
        "Namespace",
        "Pod",
        "Service",
        "ServiceEntry",
        "WorkloadEntry",
        "ConfigMap",
        "EndpointSlice",
    ] {
        let watch = watch_of(&watches, kind)?;
        ensure!(watch["synced"] == true, "{watch}");
    }
    ensure!(
        watch_of(&watches, "ServiceEntry")?["apiVersion"] == "networking.istio.io/v1",
        "{watches:?}"
    );
    // The agent (watching the API) and explain (reading the directory) agree on every name, from
    // every namespace: NAMESPACE, PUBLIC and NONE entries, a shared host, a Kubernetes Service.
    for ns in EVERYONE {
        for name in [
            "api.example.com",
            "payments.example.com",
            "shared.example.com",
            "login.example.com",
            "metrics.example.com",
            "web.team-a.svc.cluster.local",
        ] {
            w.check_dig(ns, name)?;
        }
        w.check_host(ns, "api.example.com", 80)?;
    }
    // Pinned to the rules: team-a's NAMESPACE entry is answered in team-a only.
    let (v, _) = w.check_dig("team-a", "api.example.com")?;
    assert_eq!(v.action, DnsAction::Answer, "{}", v.json);
    assert_eq!(v.service.as_deref(), Some("team-a/api-example"));
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    assert_eq!(v.action, DnsAction::Forward, "{}", v.json);
    let (v, reach) = w.check_host("team-a", "api.example.com", 80)?;
    assert_eq!(v.action, OutboundOutcome::Service, "{}", v.json);
    assert_eq!(reach, Reach::server("api-endpoint"));
    // Every client passed the identity check against the uids of the watched Pods.
    let m = w.agent.metrics()?;
    assert_eq!(m.get_or_zero(key::IDENTITY_MISMATCHES), 0.0);
    Ok(())
}

/// `requests` with their query decoded as far as field selectors need.
fn decoded(requests: &[String]) -> Vec<String> {
    requests
        .iter()
        .map(|r| {
            r.replace("%3D", "=")
                .replace("%3d", "=")
                .replace("%21", "!")
        })
        .collect()
}

#[test]
fn an_agent_given_its_node_holds_its_pods_as_clients_and_gives_the_same_answers() -> Result<()> {
    // web-1, the pod behind Service web (by its selector and a named port), runs on another node.
    let w = World::start_kube_args(
        |dir| {
            let path = dir.join("10-workloads.yaml");
            let text = std::fs::read_to_string(&path)?;
            ensure!(
                text.matches("\n  nodeName: node-1\n").count() == 1,
                "{text}"
            );
            std::fs::write(
                &path,
                text.replace("\n  nodeName: node-1\n", "\n  nodeName: node-2\n"),
            )?;
            Ok(())
        },
        &["--node-name", "node-1"],
    )?;
    let watches = watch_states(&w)?;
    for kind in ["Pod", "Pod (other nodes)"] {
        let watch = watch_of(&watches, kind)?;
        ensure!(watch["synced"] == true, "{watch}");
    }
    // Each Pod watch asks the API server for its side of the node, in pages.
    let requests = decoded(&w.api().requests());
    for selector in [
        "fieldSelector=spec.nodeName=node-1",
        "fieldSelector=spec.nodeName!=node-1",
    ] {
        ensure!(
            requests.iter().any(|r| r.starts_with("GET /api/v1/pods?")
                && r.contains(selector)
                && r.contains("limit=")),
            "no paged list of pods with {selector}: {requests:#?}"
        );
    }
    // The same answers as explain over the directory, from every namespace.
    for ns in EVERYONE {
        for name in [
            "api.example.com",
            "shared.example.com",
            "web.team-a.svc.cluster.local",
            "legacy.example.internal",
        ] {
            w.check_dig(ns, name)?;
        }
        w.check_host(ns, "api.example.com", 80)?;
    }
    // The pod on the other node is still the Service's endpoint, through its named port.
    ensure!(w.curl("team-a", "http://web.team-a.svc.cluster.local/")? == Reach::server("web-1"));
    // Of a pod elsewhere the agent keeps no uid and no node; its own clients are whole.
    let dump = w.config_dump()?;
    let workloads = dump["config"]["workloads"]
        .as_array()
        .or_else(|| dump["workloads"].as_array())
        .with_context(|| format!("no workloads in /config_dump: {dump:#}"))?;
    let named = |name: &str| {
        workloads
            .iter()
            .find(|w| w["name"] == name)
            .with_context(|| format!("no workload {name} in {workloads:#?}"))
    };
    let web = named("web-1")?;
    ensure!(web["uid"].is_null() && web["node"].is_null(), "{web}");
    let a1 = named("a1")?;
    ensure!(a1["node"] == "node-1" && a1["uid"].is_string(), "{a1}");
    let m = w.agent.metrics()?;
    assert_eq!(m.get_or_zero(key::IDENTITY_MISMATCHES), 0.0);
    Ok(())
}

#[test]
fn a_service_entry_a_namespace_label_and_a_pod_changed_through_the_api_apply_within_a_second()
-> Result<()> {
    let mut w = World::start_kube_with(|_| Ok(()))?;
    // A pod the API does not know yet: it sees what a namespace owning nothing sees.
    w.add_stranger("team-a/late", "10.244.1.77", "nowhere")?;

    // A ServiceEntry added in team-b (NAMESPACE by default): answered there, nowhere else.
    w.api().put(service_entry(
        "team-b",
        "fresh",
        "fresh.example.com",
        "203.0.113.77",
    ))?;
    let took = within("the new entry answered in team-b", APPLIED_WITHIN, || {
        Ok(a_records(&w, "team-b", "fresh.example.com")? == ["203.0.113.77".parse::<Ipv4Addr>()?])
    })?;
    eprintln!("ServiceEntry added: applied in {took:?}");
    ensure!(dig(&w, "team-a", "fresh.example.com")?.status == "NXDOMAIN");
    // Its address reaches its endpoint from team-b.
    ensure!(w.curl("team-b", "http://203.0.113.77/")? == Reach::server("api-endpoint"));

    // The entry changed: a new address.
    w.api().put(service_entry(
        "team-b",
        "fresh",
        "fresh.example.com",
        "203.0.113.78",
    ))?;
    let took = within(
        "the changed entry answered in team-b",
        APPLIED_WITHIN,
        || {
            Ok(a_records(&w, "team-b", "fresh.example.com")?
                == ["203.0.113.78".parse::<Ipv4Addr>()?])
        },
    )?;
    eprintln!("ServiceEntry changed: applied in {took:?}");

    // team-b labelled trusted: its entries become PUBLIC (the mesh config's second policy).
    let mut ns = w.api().get("Namespace", "", "team-b").context("team-b")?;
    ns["metadata"]["labels"]["trusted"] = json!("true");
    w.api().put(ns)?;
    let took = within("team-b's entry seen from team-a", APPLIED_WITHIN, || {
        Ok(a_records(&w, "team-a", "fresh.example.com")? == ["203.0.113.78".parse::<Ipv4Addr>()?])
    })?;
    eprintln!("Namespace label added: applied in {took:?}");

    // The pod appears in the API, in team-a: it now sees team-a's NAMESPACE entry.
    let v4: Ipv4Addr = "10.244.1.77".parse()?;
    ensure!(a_records(&w, "nowhere", "api.example.com")? == ["203.0.113.110".parse::<Ipv4Addr>()?]);
    w.api().put(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "late", "namespace": "team-a", "labels": {"app": "client"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": v4.to_string(),
                   "podIPs": [{"ip": v4.to_string()}, {"ip": pod_ip6(v4).to_string()}]}
    }))?;
    let took = within("the new pod sees team-a's entry", APPLIED_WITHIN, || {
        Ok(a_records(&w, "nowhere", "api.example.com")? == ["203.0.113.10".parse::<Ipv4Addr>()?])
    })?;
    eprintln!("Pod added: applied in {took:?}");
    ensure!(w.curl("nowhere", "http://api.example.com/")? == Reach::server("api-endpoint"));

    // Deleted: the pod is a stranger again, the entry is gone for everyone.
    w.api().delete("Pod", "team-a", "late")?;
    w.api().delete("ServiceEntry", "team-b", "fresh")?;
    let took = within("the deletions applied", APPLIED_WITHIN, || {
        Ok(
            a_records(&w, "nowhere", "api.example.com")? == ["203.0.113.110".parse::<Ipv4Addr>()?]
                && dig(&w, "team-b", "fresh.example.com")?.status == "NXDOMAIN",
        )
    })?;
    eprintln!("Pod and ServiceEntry deleted: applied in {took:?}");
    ensure!(w.curl("nowhere", "http://api.example.com/")? == Reach::server("public-api"));
    Ok(())
}

#[test]
fn discovery_selectors_in_the_mesh_config_map_and_a_namespace_label_apply_live() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    let own = ["203.0.113.10".parse::<Ipv4Addr>()?];
    let public = ["203.0.113.110".parse::<Ipv4Addr>()?];
    ensure!(a_records(&w, "team-a", "api.example.com")? == own);

    // Namespaces labelled mesh-discovery: off are left out; none is yet: nothing changes.
    let mut cm = w
        .api()
        .get("ConfigMap", "istio-system", "istio")
        .context("mesh")?;
    let mesh = cm["data"]["mesh"]
        .as_str()
        .context("data.mesh")?
        .to_string();
    cm["data"]["mesh"] = json!(format!(
        "discoverySelectors:\n- matchExpressions: [{{key: mesh-discovery, operator: NotIn, values: [\"off\"]}}]\n{mesh}"
    ));
    w.api().put(cm)?;
    let mut ns = w.api().get("Namespace", "", "team-a").context("team-a")?;
    ns["metadata"]["labels"]["mesh-discovery"] = json!("off");
    w.api().put(ns)?;
    // team-a is no longer discovered: its entry exists nowhere, even for its own pods.
    let took = within("team-a left out", APPLIED_WITHIN, || {
        Ok(a_records(&w, "team-a", "api.example.com")? == public)
    })?;
    eprintln!("Namespace left out of discovery: applied in {took:?}");
    ensure!(w.curl("team-a", "http://api.example.com/")? == Reach::server("public-api"));
    ensure!(w.curl("team-b", "http://203.0.113.10/")? == Reach::server("real-203.0.113.10"));

    let mut ns = w.api().get("Namespace", "", "team-a").context("team-a")?;
    ns["metadata"]["labels"]["mesh-discovery"] = json!("on");
    w.api().put(ns)?;
    let took = within("team-a discovered again", APPLIED_WITHIN, || {
        Ok(a_records(&w, "team-a", "api.example.com")? == own)
    })?;
    eprintln!("Namespace discovered again: applied in {took:?}");
    ensure!(w.curl("team-a", "http://api.example.com/")? == Reach::server("api-endpoint"));
    Ok(())
}

/// The status writer's flags: a short lease, so a takeover fits a test.
const WRITE_STATUS: [&str; 3] = ["--write-status", "--status-lease-seconds", "3"];

/// `kubectl get serviceentry NAME -n NS -o jsonpath=...`, the feature page's own check, for the
/// `reason` of condition `type`, run in the node netns against the test API server.
fn kubectl_reason(w: &World, namespace: &str, name: &str, type_: &str) -> Result<String> {
    let jsonpath = format!("jsonpath={{.status.conditions[?(@.type==\"{type_}\")].reason}}");
    let out = w
        .topo
        .node_cmd("kubectl")
        .args(["--kubeconfig"])
        .arg(w.kubeconfig())
        .args([
            "get",
            "serviceentry",
            name,
            "-n",
            namespace,
            "-o",
            &jsonpath,
        ])
        .env("HOME", w.topo.scratch_path("home"))
        .output()?;
    ensure!(out.success(), "kubectl failed: {}", out.stderr_str());
    Ok(out.stdout_str().trim().to_string())
}

fn status_writes(w: &World) -> usize {
    w.api()
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH ") && r.contains("/status"))
        .count()
}

/// A second agent on the node, watching the same API server and taking part in the election: its
/// own (empty) cgroup, ports, pins and hand-over socket, so it is no successor of the first.
fn second_agent(w: &World) -> Result<integration::proc::Proc> {
    agent_on_node(w, 2)
}

/// Agent `n` (2 and up) of the election, as [`second_agent`]: `agent-node-<n>`, its ports 100 apart.
fn agent_on_node(w: &World, n: u16) -> Result<integration::proc::Proc> {
    let cgroup = w
        .topo
        .attach_cgroup()
        .parent()
        .context("the pods' cgroup has a parent")?
        .join(format!("node-{n}"));
    std::fs::create_dir_all(&cgroup)?;
    let upstream = format!("{}:53", integration::RESOLVER_IP);
    let base = 25_000 + 100 * (n - 2);
    w.topo
        .node_cmd(integration::agent::Agent::bin()?)
        .args(["run", "--kube", "--kubeconfig"])
        .arg(w.kubeconfig())
        .args(WRITE_STATUS)
        .args(["--cgroup"])
        .arg(&cgroup)
        .args(["--gateway", &integration::GATEWAY.to_string()])
        .args(["--proxy-port", &(base + 1).to_string()])
        .args(["--dns-proxy-port", &(base + 53).to_string()])
        .args(["--admin", &format!("127.0.0.1:{base}")])
        .args(["--stats", &format!("127.0.0.1:{}", base + 20)])
        .args(["--dns-upstream", &upstream])
        .arg("--bpffs")
        .arg(w.topo.scratch_path(&format!("bpffs-{n}")))
        .arg("--handover-socket")
        .arg(w.topo.scratch_path(&format!("handover-{n}.sock")))
        .env("POD_NAME", format!("agent-node-{n}"))
        .spawn()
}

fn lease_holder(w: &World) -> String {
    w.api()
        .get("Lease", "redirect-system", "redirect-status-writer")
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
        .unwrap_or_default()
}

#[test]
fn the_status_writer_shows_each_decision_where_kubectl_looks() -> Result<()> {
    let w = World::start_kube_args(|_| Ok(()), &WRITE_STATUS)?;
    let visibility = "istio.io/VisibilityApplied";
    let took = within("the conditions written", Duration::from_secs(10), || {
        Ok(kubectl_reason(&w, "team-a", "api-example", visibility)? == "Namespace")
    })?;
    eprintln!("conditions written {took:?} after ready");
    ensure!(kubectl_reason(&w, "istio-system", "metrics", visibility)? == "Public");
    ensure!(
        kubectl_reason(&w, "team-b", "payments", "istio.io/WaypointBound")?
            == "CrossNamespaceWaypointForbidden"
    );
    // NONE: delivered to no proxy, no condition.
    ensure!(kubectl_reason(&w, "quarantine", "login-hijack", visibility)?.is_empty());
    let api = w
        .api()
        .get("ServiceEntry", "team-a", "api-example")
        .context("api-example")?;
    let condition = &api["status"]["conditions"][0];
    ensure!(
        condition["observedGeneration"] == api["metadata"]["generation"],
        "{api}"
    );
    ensure!(
        condition["message"]
            .as_str()
            .is_some_and(|m| m.contains("(NAMESPACE)")),
        "{api}"
    );
    let since = condition["lastTransitionTime"].clone();

    // A namespace label makes team-a's entries PUBLIC: the condition follows within seconds.
    let mut ns = w.api().get("Namespace", "", "team-a").context("team-a")?;
    ns["metadata"]["labels"]["trusted"] = json!("true");
    w.api().put(ns)?;
    let took = within("the label change shown", Duration::from_secs(5), || {
        Ok(kubectl_reason(&w, "team-a", "api-example", visibility)? == "Public")
    })?;
    eprintln!("namespace label change shown by kubectl in {took:?}");
    let api = w
        .api()
        .get("ServiceEntry", "team-a", "api-example")
        .context("api-example")?;
    ensure!(
        api["status"]["conditions"][0]["lastTransitionTime"] == since,
        "the status stayed True: the transition time stays; {api}"
    );

    // Another controller's condition of another type is kept beside ours.
    let mut conditions = api["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    conditions.push(json!({"type": "example.com/Probed", "status": "True", "reason": "Reachable"}));
    w.api().put_status(
        "ServiceEntry",
        "team-a",
        "api-example",
        json!({"conditions": conditions}),
        "prober",
    )?;
    // Conditions of our types that istiod writes are left as they are.
    w.api().put_status(
        "ServiceEntry",
        "team-c",
        "shared-public",
        json!({"conditions": [{"type": visibility, "status": "True", "reason": "Public",
                                "message": "written by istiod"}]}),
        "pilot-discovery",
    )?;
    within(
        "the other controller named in /config_dump",
        Duration::from_secs(10),
        || {
            let dump = w.config_dump()?;
            Ok(
                dump["config"]["statusWriter"]["otherWriters"]["team-c/shared-public"]
                    == "pilot-discovery",
            )
        },
    )?;
    let shared = w
        .api()
        .get("ServiceEntry", "team-c", "shared-public")
        .context("shared")?;
    ensure!(
        shared["status"]["conditions"][0]["message"] == "written by istiod",
        "{shared}"
    );
    let api = w
        .api()
        .get("ServiceEntry", "team-a", "api-example")
        .context("api-example")?;
    let types: Vec<&str> = api["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["type"].as_str())
        .collect();
    ensure!(
        types.contains(&"example.com/Probed") && types.contains(&visibility),
        "{api}"
    );
    let m = w.agent.metrics()?;
    ensure!(m.get_or_zero(r#"redirect_status_writes_total{result="ok"}"#) >= 1.0);
    Ok(())
}

#[test]
fn two_agents_one_status_writer_and_the_other_takes_over_without_rewriting() -> Result<()> {
    let w = World::start_kube_args(|_| Ok(()), &WRITE_STATUS)?;
    within(
        "the first agent leads and has written",
        Duration::from_secs(10),
        || {
            Ok(
                kubectl_reason(&w, "team-a", "api-example", "istio.io/VisibilityApplied")?
                    == "Namespace",
            )
        },
    )?;
    let first = lease_holder(&w);
    ensure!(
        !first.is_empty() && !first.starts_with("agent-node-2"),
        "{first}"
    );
    let mut second = second_agent(&w)?;
    // Both run for two lease periods: the first still holds the lease, the second writes nothing.
    std::thread::sleep(Duration::from_secs(6));
    ensure!(second.is_running(), "{}", second.log());
    ensure!(lease_holder(&w) == first);
    let before = status_writes(&w);
    // A change: exactly one write for it, from whichever agent leads.
    let mut ns = w.api().get("Namespace", "", "team-b").context("team-b")?;
    ns["metadata"]["labels"]["trusted"] = json!("true");
    w.api().put(ns)?;
    within("the change written", Duration::from_secs(5), || {
        Ok(
            kubectl_reason(&w, "team-b", "shared-private", "istio.io/VisibilityApplied")?
                == "Public",
        )
    })?;
    std::thread::sleep(Duration::from_secs(2));
    let writes = status_writes(&w) - before;
    // team-b holds two entries (shared-private and payments): one write each, by one writer.
    ensure!(
        writes == 2,
        "{writes} status writes for two changed entries"
    );

    // The writer dies: the second agent takes the lease within its duration, and writes nothing,
    // since every entry already says what it computes.
    let before = status_writes(&w);
    let killed = std::time::Instant::now();
    w.agent.signal(9);
    let took = within("the second agent leads", Duration::from_secs(10), || {
        Ok(lease_holder(&w).starts_with("agent-node-2"))
    })?;
    eprintln!(
        "the second agent took the lease {:?} after the first was killed ({took:?} polling)",
        killed.elapsed()
    );
    ensure!(
        killed.elapsed() < Duration::from_secs(3 + 3 + 2),
        "lease 3 s + one retry period"
    );
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        status_writes(&w) == before,
        "a new writer over unchanged entries writes nothing"
    );
    // And it writes what changes from now on.
    let mut ns = w.api().get("Namespace", "", "team-b").context("team-b")?;
    ns["metadata"]["labels"]
        .as_object_mut()
        .context("labels")?
        .remove("trusted");
    w.api().put(ns)?;
    within("the new writer writes", Duration::from_secs(10), || {
        Ok(
            kubectl_reason(&w, "team-b", "shared-private", "istio.io/VisibilityApplied")?
                == "Namespace",
        )
    })?;
    second.signal(15);
    Ok(())
}

/// PATCHes of `bulk`'s entries' status the API server has seen.
fn bulk_writes(w: &World) -> usize {
    w.api()
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH ") && r.contains("/namespaces/bulk/"))
        .count()
}

/// The `reason` of each of `bulk`'s first `n` entries' visibility condition that is not `want`.
fn bulk_not(w: &World, n: usize, want: &str) -> Vec<String> {
    (0..n)
        .filter_map(|i| {
            let entry = w.api().get("ServiceEntry", "bulk", &format!("e{i}"))?;
            let reason = entry["status"]["conditions"][0]["reason"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            (reason != want).then(|| format!("e{i}: {reason:?}"))
        })
        .collect()
}

/// Sets (`Some`) or removes the `trusted` label of namespace `ns`.
fn set_trusted(w: &World, ns: &str, value: Option<&str>) -> Result<()> {
    let mut namespace = w.api().get("Namespace", "", ns).context("namespace")?;
    let labels = &mut namespace["metadata"]["labels"];
    if !labels.is_object() {
        *labels = json!({});
    }
    let labels = labels.as_object_mut().context("labels")?;
    match value {
        Some(v) => labels.insert("trusted".into(), json!(v)),
        None => labels.remove("trusted"),
    };
    w.api().put(namespace)
}

/// Split brain: the writer is stopped (SIGSTOP) in the middle of a burst of 300 writes, the change
/// is undone while it is stopped, and the second agent takes over and writes the undoing. Woken
/// ten seconds later, the old writer writes nothing more: its last renewal is older than the
/// lease, so it stops before its next write, whatever the API would still accept.
#[test]
fn a_writer_woken_after_losing_the_lease_writes_nothing() -> Result<()> {
    const BULK: usize = 300;
    let w = World::start_kube_args(
        |dir| {
            let namespace = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: bulk}\n";
            let entries = settled_entries(BULK);
            Ok(std::fs::write(
                dir.join("90-bulk.yaml"),
                format!("{namespace}{entries}"),
            )?)
        },
        &WRITE_STATUS,
    )?;
    within("the first agent writes", Duration::from_secs(10), || {
        Ok(
            kubectl_reason(&w, "team-a", "api-example", "istio.io/VisibilityApplied")?
                == "Namespace",
        )
    })?;
    let first = lease_holder(&w);
    let mut second = second_agent(&w)?;
    std::thread::sleep(Duration::from_secs(4));
    ensure!(lease_holder(&w) == first, "the first agent still leads");

    // The burst: 300 entries become PUBLIC, written at 50 a second.
    let before = bulk_writes(&w);
    set_trusted(&w, "bulk", Some("true"))?;
    within("the burst under way", Duration::from_secs(10), || {
        Ok(bulk_writes(&w) - before >= 50)
    })?;
    w.agent.signal(libc::SIGSTOP);
    let stopped = std::time::Instant::now();
    let by_the_first = bulk_writes(&w) - before;
    set_trusted(&w, "bulk", None)?;
    within("the second agent leads", Duration::from_secs(10), || {
        Ok(lease_holder(&w).starts_with("agent-node-2"))
    })?;
    within(
        "the second agent undoes the burst",
        Duration::from_secs(15),
        || Ok(bulk_not(&w, BULK, "Namespace").is_empty()),
    )?;
    ensure!(second.is_running(), "{}", second.log());
    std::thread::sleep(Duration::from_secs(10).saturating_sub(stopped.elapsed()));

    let before_waking = bulk_writes(&w);
    w.agent.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(5));
    let after_waking = bulk_writes(&w) - before_waking;
    eprintln!(
        "the first writer wrote {by_the_first} before it was stopped; {after_waking} writes after it woke"
    );
    ensure!(
        after_waking == 0,
        "{after_waking} status writes after the stale writer woke: {}",
        bulk_not(&w, BULK, "Namespace").join(", ")
    );
    ensure!(bulk_not(&w, BULK, "Namespace").is_empty());
    second.signal(libc::SIGTERM);
    Ok(())
}

/// A writer stopped gracefully hands its lease back: the other agent writes the next change within
/// a second, not a whole lease later.
#[test]
fn a_writer_that_stops_hands_the_lease_over_at_once() -> Result<()> {
    let mut w = World::start_kube_args(|_| Ok(()), &WRITE_STATUS)?;
    within("the first agent writes", Duration::from_secs(10), || {
        Ok(
            kubectl_reason(&w, "team-a", "api-example", "istio.io/VisibilityApplied")?
                == "Namespace",
        )
    })?;
    let second = second_agent(&w)?;
    std::thread::sleep(Duration::from_secs(3));
    ensure!(!lease_holder(&w).starts_with("agent-node-2"));
    w.agent.signal(libc::SIGTERM);
    within("the first agent stops", Duration::from_secs(10), || {
        Ok(!w.agent.is_running())
    })?;
    let stopped = std::time::Instant::now();
    set_trusted(&w, "team-b", Some("true"))?;
    // Read from the API server directly: a kubectl per poll would take a good part of the second.
    let took = within("the successor writes", Duration::from_secs(10), || {
        let entry = w.api().get("ServiceEntry", "team-b", "shared-private");
        Ok(entry.is_some_and(|e| e["status"]["conditions"][0]["reason"] == "Public"))
    })?;
    eprintln!(
        "the successor wrote {:?} after the first agent stopped",
        stopped.elapsed()
    );
    ensure!(lease_holder(&w).starts_with("agent-node-2"));
    ensure!(
        took < Duration::from_secs(1),
        "the successor wrote {took:?} after the first agent stopped (lease 3 s)"
    );
    second.signal(libc::SIGTERM);
    Ok(())
}

/// The Lease's versions as the API server stored them, oldest first: (holder, renewTime and
/// acquireTime in seconds since the epoch, leaseTransitions).
fn lease_versions(w: &World) -> Vec<(String, f64, f64, i64)> {
    w.api()
        .versions_of("Lease", "redirect-system", "redirect-status-writer")
        .iter()
        .map(|l| {
            let spec = &l["spec"];
            let at = |field: &str| spec[field].as_str().and_then(epoch_seconds).unwrap_or(0.0);
            (
                spec["holderIdentity"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                at("renewTime"),
                at("acquireTime"),
                spec["leaseTransitions"].as_i64().unwrap_or(0),
            )
        })
        .collect()
}

/// `2026-12-07T14:31:26.123456Z` in seconds since the epoch (UTC, as a MicroTime is written).
fn epoch_seconds(text: &str) -> Option<f64> {
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    // Days from the civil date (proleptic Gregorian), as chrono and jiff count them.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let sec = t.next()?.parse::<f64>().ok()?;
    Some(days as f64 * 86_400.0 + h * 3_600.0 + min * 60.0 + sec)
}

/// Three agents elect one status writer by watching the Lease, never reading it again: over four
/// lease durations the API serves no GET of the Lease (each agent lists it once, then watches it
/// on one connection; only the holder writes, a renewal each third of a lease), and one agent
/// holds it throughout. Killed, the holder is replaced a lease after its last renewal; stopped
/// gracefully, it hands the lease back and the last agent takes it on the watch's event.
#[test]
fn agents_watch_the_status_lease_and_never_poll_it() -> Result<()> {
    const LEASE: f64 = 3.0;
    let w = World::start_kube_args(|_| Ok(()), &WRITE_STATUS)?;
    within(
        "the first agent holds the lease",
        Duration::from_secs(10),
        || Ok(!lease_holder(&w).is_empty()),
    )?;
    let first = lease_holder(&w);
    let mut others = [agent_on_node(&w, 2)?, agent_on_node(&w, 3)?];
    within(
        "three agents watch the lease",
        Duration::from_secs(10),
        || Ok(w.api().requests_of("watch", "leases") >= 3),
    )?;
    let start = w.api().verbs_of("leases");
    let from = lease_versions(&w).len();
    std::thread::sleep(Duration::from_secs_f64(4.0 * LEASE));
    let run = w.api().verbs_of("leases");
    let steady = lease_versions(&w).split_off(from);
    eprintln!("lease requests by verb: at start-up {start:?}, after four leases {run:?}");
    for other in &mut others {
        ensure!(other.is_running(), "{}", other.log());
    }
    let count = |verbs: &std::collections::BTreeMap<String, usize>, verb: &str| {
        verbs.get(verb).copied().unwrap_or(0)
    };
    // What start-up is allowed: one list and one watch per agent, one create; never a GET.
    ensure!(count(&run, "get") == 0, "GETs of the lease: {run:?}");
    ensure!(
        count(&run, "list") == 3 && count(&run, "watch") == 3,
        "one list and one watch per agent: {run:?}"
    );
    ensure!(count(&run, "create") == 1, "{run:?}");
    let renewals = count(&run, "update") - count(&start, "update");
    ensure!(
        (8..=14).contains(&renewals),
        "{renewals} writes in four leases: the holder's, one each third of a lease"
    );
    ensure!(
        steady.len() == renewals && steady.iter().all(|v| v.0 == first),
        "one holder throughout: {steady:?}"
    );

    // Killed: another agent takes it over a lease after the last renewal it saw.
    let last = lease_versions(&w).last().cloned().context("a version")?;
    w.agent.signal(libc::SIGKILL);
    within(
        "another agent holds the lease",
        Duration::from_secs(10),
        || Ok(!lease_holder(&w).is_empty() && lease_holder(&w) != first),
    )?;
    let second = lease_holder(&w);
    let taken = lease_versions(&w)
        .into_iter()
        .find(|v| v.0 == second)
        .context("the takeover")?;
    let after = taken.2 - last.1;
    eprintln!("taken over {after:.3} s after the killed holder's last renewal (lease {LEASE} s)");
    ensure!(
        taken.3 == last.3 + 1,
        "one transition: {last:?} then {taken:?}"
    );
    ensure!(
        (LEASE - 0.1..LEASE + 1.5).contains(&after),
        "taken over {after:.3} s after the last renewal"
    );

    // Stopped gracefully: handed back, and the last agent takes it on the watch's event.
    let (leader, rest) = match second.starts_with("agent-node-2") {
        true => (0, "agent-node-3"),
        false => (1, "agent-node-2"),
    };
    others[leader].signal(libc::SIGTERM);
    within(
        "the last agent holds the lease",
        Duration::from_secs(10),
        || Ok(lease_holder(&w).starts_with(rest)),
    )?;
    let versions = lease_versions(&w);
    let released = versions
        .iter()
        .position(|v| v.0.is_empty())
        .context("a version handed back")?;
    let (handed, took) = (&versions[released], versions.get(released + 1));
    let took = took.context("a version after the release")?;
    let gap = took.2 - handed.1;
    eprintln!("handed back, taken {:.0} ms later", gap * 1000.0);
    ensure!(took.0.starts_with(rest), "{versions:?}");
    ensure!(
        gap < 0.5,
        "taken {gap:.3} s after the release: {versions:?}"
    );
    ensure!(
        w.api().requests_of("get", "leases") <= 1,
        "a GET only if the release's write was refused: {:?}",
        w.api().verbs_of("leases")
    );
    others[1 - leader].signal(libc::SIGTERM);
    // Whatever the agents asked (every watch, the lease, the entries' status) is what the
    // DaemonSet's roles allow: this server authorizes nothing, a cluster would answer 403.
    let rules = integration::rbac::manifest_rules()?;
    let asked = w.api().asked();
    let denied: Vec<_> = asked
        .iter()
        .filter(|(group, resource, verb)| !rules.iter().any(|r| r.allows(group, resource, verb)))
        .collect();
    ensure!(
        denied.is_empty(),
        "asked of the API but not allowed by deploy/manifests/10-rbac.yaml: {denied:?} (asked: {asked:?})"
    );
    Ok(())
}

/// `n` ServiceEntries in namespace `bulk` whose status already says what the writer computes (as
/// it left them before a restart).
fn settled_entries(n: usize) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        yaml.push_str(&format!(
            "---\napiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: e{i}\n  namespace: bulk\n  managedFields: [{{manager: redirect-agent, operation: Update, subresource: status, fieldsV1: {{'f:status': {{'f:conditions': {{}}}}}}}}]\nspec: {{hosts: [e{i}.bulk.example.com], addresses: [\"100.64.{}.{}\"], ports: [{{number: 80, name: http}}], resolution: STATIC, endpoints: [{{address: 198.51.100.20}}]}}\nstatus:\n  conditions:\n  - {{type: istio.io/VisibilityApplied, status: \"True\", reason: Namespace, message: \"ServiceEntry is visible only within its own namespace (NAMESPACE), per mesh serviceEntryVisibility.\", lastTransitionTime: \"2026-01-01T00:00:00Z\", observedGeneration: 1}}\n",
            i / 250,
            i % 250
        ));
    }
    yaml
}

#[test]
fn a_writer_starting_over_ten_thousand_settled_entries_writes_none_of_them() -> Result<()> {
    let w = World::start_kube_args(
        |dir| {
            Ok(std::fs::write(
                dir.join("90-bulk.yaml"),
                settled_entries(10_000),
            )?)
        },
        &WRITE_STATUS,
    )?;
    within(
        "the examples' entries written",
        Duration::from_secs(20),
        || {
            Ok(
                kubectl_reason(&w, "team-a", "api-example", "istio.io/VisibilityApplied")?
                    == "Namespace",
            )
        },
    )?;
    // Time for a full comparison pass or two (it runs every 5 s, and on every change).
    std::thread::sleep(Duration::from_secs(6));
    let bulk: Vec<String> = w
        .api()
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("PATCH ") && r.contains("/namespaces/bulk/"))
        .collect();
    ensure!(
        bulk.is_empty(),
        "{} writes over settled entries: {:?}",
        bulk.len(),
        &bulk[..bulk.len().min(3)]
    );
    ensure!(status_writes(&w) > 0, "the examples' entries were written");
    Ok(())
}

#[test]
fn addresses_istio_allocated_in_status_are_the_ones_dns_answers() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    // httpbin declares no address: the agent's own allocation answers until istiod's is written.
    let ours = a_records(&w, "team-a", "httpbin.example.com")?;
    ensure!(
        ours.len() == 1 && ours[0].octets()[..2] == [240, 240],
        "{ours:?}"
    );
    let given: Ipv4Addr = "240.240.9.9".parse()?;
    w.api().put_status(
        "ServiceEntry",
        "istio-system",
        "httpbin",
        json!({"addresses": [{"value": given.to_string(), "host": "httpbin.example.com"}]}),
        "pilot-discovery",
    )?;
    let took = within("istiod's address answered", APPLIED_WITHIN, || {
        Ok(a_records(&w, "team-b", "httpbin.example.com")? == [given])
    })?;
    eprintln!("status.addresses applied in {took:?}");
    Ok(())
}

fn endpoint_slice(name: &str, endpoints: &[(&str, bool)]) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready)| {
            json!({"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": false}})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "team-a",
                     "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]
    })
}

#[test]
fn a_services_endpoints_follow_its_endpoint_slices() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    const WEB: &str = "http://web.team-a.svc.cluster.local/";
    ensure!(
        watch_of(&watch_states(&w)?, "EndpointSlice")?["synced"] == true,
        "the EndpointSlice watch has not listed"
    );
    // No slice names web yet: its endpoints come from its selector, the pod web-1.
    ensure!(w.curl("team-a", WEB)? == Reach::server("web-1"));

    // A slice for web: its ready address is web's endpoint now, at the slice's port named http.
    w.api()
        .put(endpoint_slice("web-a1", &[("198.51.100.20", true)]))?;
    let took = within("web reaches the slice's endpoint", APPLIED_WITHIN, || {
        Ok(w.curl("team-a", WEB)? == Reach::server("api-endpoint"))
    })?;
    eprintln!("EndpointSlice added: applied in {took:?}");

    // That endpoint turns not ready and another one appears: only the ready one is used.
    w.api().put(endpoint_slice(
        "web-a1",
        &[("198.51.100.20", false), ("198.51.100.41", true)],
    ))?;
    let took = within("web reaches the new ready endpoint", APPLIED_WITHIN, || {
        Ok(w.curl("team-a", WEB)? == Reach::server("shared-private-endpoint"))
    })?;
    eprintln!("EndpointSlice changed: applied in {took:?}");
    for _ in 0..4 {
        // Round robin over the ready endpoints: the one not ready is never picked.
        ensure!(w.curl("team-b", WEB)? == Reach::server("shared-private-endpoint"));
    }

    // The slice deleted: back to the selector.
    w.api().delete("EndpointSlice", "team-a", "web-a1")?;
    let took = within("web reaches web-1 again", APPLIED_WITHIN, || {
        Ok(w.curl("team-a", WEB)? == Reach::server("web-1"))
    })?;
    eprintln!("EndpointSlice deleted: applied in {took:?}");
    Ok(())
}

#[test]
fn the_api_server_away_for_ten_seconds_changes_nothing_and_what_changed_meanwhile_applies_on_return()
-> Result<()> {
    let mut w = World::start_kube_with(|_| Ok(()))?;
    let answered = ["203.0.113.10".parse::<Ipv4Addr>()?];
    w.api_mut().stop();
    // Changes made while the agent cannot see them.
    w.api().put(service_entry(
        "team-a",
        "meanwhile",
        "meanwhile.example.com",
        "203.0.113.79",
    ))?;
    let away = Instant::now();
    let mut rounds = 0;
    while away.elapsed() < Duration::from_secs(10) {
        ensure!(a_records(&w, "team-a", "api.example.com")? == answered);
        ensure!(
            dig(&w, "team-b", "api.example.com")?.a_records()
                == ["203.0.113.110".parse::<Ipv4Addr>()?]
        );
        ensure!(w.curl("team-a", "http://api.example.com/")? == Reach::server("api-endpoint"));
        let ready = w.agent.admin_get("/healthz/ready")?;
        ensure!(
            ready.status == 200,
            "not ready while the API is away: {}",
            ready.text()
        );
        rounds += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    // A round is two digs, a curl and a readiness check: about 20 a second on the host, many times
    // fewer under emulation.
    let floor = 10 / pace::scale();
    ensure!(rounds > floor, "only {rounds} rounds in 10 s");
    let m = w.agent.metrics()?;
    ensure!(
        m.get_or_zero(r#"redirect_kube_watch_errors_total{kind="Pod"}"#) >= 1.0,
        "{:#?}",
        m.samples()
    );
    let watches = watch_states(&w)?;
    let pods = watch_of(&watches, "Pod")?;
    ensure!(
        pods["lastError"].is_string() && pods["errors"].as_u64() >= Some(1),
        "{pods}"
    );

    w.api_mut().resume()?;
    // Each watch retries at most 5 s apart: back within that, and the change is applied.
    let took = within(
        "the change made while away applied",
        Duration::from_secs(8),
        || {
            Ok(a_records(&w, "team-a", "meanwhile.example.com")?
                == ["203.0.113.79".parse::<Ipv4Addr>()?])
        },
    )?;
    eprintln!("API server back: the change applied in {took:?}");
    ensure!(a_records(&w, "team-a", "api.example.com")? == answered);
    Ok(())
}

#[test]
fn an_expired_watch_lists_again_and_nothing_in_flight_sees_a_gap() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    let answered = ["203.0.113.10".parse::<Ipv4Addr>()?];
    let lists_before = list_requests(&w.api().requests());
    w.api().bookmark();
    // While dig and curl run without pause, the server forgets its history (410 for every watch)
    // and a change lands: the agent lists everything again and serves the new list whole.
    std::thread::scope(|s| -> Result<()> {
        let traffic = s.spawn(|| -> Result<usize> {
            let started = Instant::now();
            let mut rounds = 0;
            while started.elapsed() < pace::scaled(Duration::from_secs(4)) {
                let got = a_records(&w, "team-a", "api.example.com")?;
                ensure!(got == answered, "a gap in DNS: {got:?}");
                let reach = w.curl("team-a", "http://api.example.com/")?;
                ensure!(
                    reach == Reach::server("api-endpoint"),
                    "a gap in traffic: {reach:?}"
                );
                rounds += 1;
            }
            Ok(rounds)
        });
        std::thread::sleep(pace::scaled(Duration::from_millis(500)));
        let api = w.api();
        api.expire_watches();
        api.put(service_entry(
            "team-a",
            "after-gone",
            "after-gone.example.com",
            "203.0.113.80",
        ))?;
        let rounds = traffic
            .join()
            .map_err(|_| anyhow::anyhow!("traffic panicked"))??;
        ensure!(rounds >= 5, "only {rounds} rounds");
        Ok(())
    })?;
    let lists_after = list_requests(&w.api().requests());
    ensure!(
        lists_after.len() >= lists_before.len() + 6,
        "every watch lists again after 410: before {lists_before:?}, after {lists_after:?}"
    );
    within(
        "the change listed after 410 applied",
        APPLIED_WITHIN,
        || {
            Ok(a_records(&w, "team-a", "after-gone.example.com")?
                == ["203.0.113.80".parse::<Ipv4Addr>()?])
        },
    )?;
    Ok(())
}

/// The list (not watch) requests the server saw.
fn list_requests(requests: &[String]) -> Vec<String> {
    requests
        .iter()
        .filter(|r| !r.contains("watch=") && !r.ends_with("/v1") && !r.ends_with("/v1beta1"))
        .cloned()
        .collect()
}

#[test]
fn istio_crds_missing_then_served_at_v1beta1_and_a_forbidden_watch_is_named() -> Result<()> {
    let w = World::start_kube_with(|_| Ok(()))?;
    let answered = ["203.0.113.10".parse::<Ipv4Addr>()?];
    let upstream = ["203.0.113.110".parse::<Ipv4Addr>()?];
    // The CRDs go away: no ServiceEntry is in force, the agent says so and keeps running.
    w.api().serve_istio_versions(&[]);
    w.api().expire_watches();
    within(
        "entries gone with their CRD",
        Duration::from_secs(8),
        || Ok(a_records(&w, "team-a", "api.example.com")? == upstream),
    )?;
    ensure!(
        w.agent.log().contains("serves no serviceentries"),
        "{}",
        w.agent.log()
    );
    let watches = watch_states(&w)?;
    ensure!(
        watch_of(&watches, "ServiceEntry")?["installed"] == false,
        "{watches:?}"
    );

    // Back at v1beta1 only: found again by discovery, at that version.
    w.api().serve_istio_versions(&["v1beta1"]);
    within("entries back at v1beta1", Duration::from_secs(15), || {
        Ok(a_records(&w, "team-a", "api.example.com")? == answered)
    })?;
    let watches = watch_states(&w)?;
    let se = watch_of(&watches, "ServiceEntry")?;
    ensure!(se["apiVersion"] == "networking.istio.io/v1beta1", "{se}");

    // RBAC without pods: the error names the verb and the resource; what is in force stays.
    w.api().forbid("pods");
    w.api().expire_watches();
    within("the forbidden list logged", Duration::from_secs(8), || {
        Ok(w.agent.log().contains("forbidden to list pods"))
    })?;
    ensure!(a_records(&w, "team-a", "api.example.com")? == answered);
    ensure!(w.curl("team-a", "http://api.example.com/")? == Reach::server("api-endpoint"));
    Ok(())
}

#[test]
fn an_api_server_away_at_start_keeps_the_agent_unready_until_it_answers() -> Result<()> {
    let topo = integration::Topology::with_pods(&[("team-a/a1", "10.244.1.10")])?;
    let mut api = integration::apiserver::ApiServer::start(&topo.node().netns)?;
    api.sync_dir(&integration::world::examples_dir())?;
    let kubeconfig = api.write_kubeconfig(&topo.scratch_path("kubeconfig"))?;
    api.stop();
    let mut agent = integration::Agent::spawn(
        &topo,
        &["--kube", "--kubeconfig", &kubeconfig.to_string_lossy()],
    )?;
    // Up, serving its admin port, and saying why it is not ready.
    within(
        "the agent says it cannot reach the API",
        Duration::from_secs(5),
        || {
            Ok(agent
                .log()
                .contains("cannot list pods on the Kubernetes API server"))
        },
    )?;
    let away = Instant::now();
    let mut answers = 0;
    while away.elapsed() < Duration::from_secs(3) {
        // The admin server comes up once the programs are attached.
        if let Ok(ready) = agent.admin_get("/healthz/ready") {
            ensure!(ready.status != 200, "ready without any configuration");
            answers += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(answers > 5, "the admin server hardly answered: {answers}");
    let log = agent.log();
    ensure!(log.contains("Connection refused"), "{log}");
    let m = agent.metrics()?;
    ensure!(m.get_or_zero(r#"redirect_kube_watch_errors_total{kind="Namespace"}"#) >= 2.0);
    api.resume()?;
    agent.wait_ready()?;
    let dump = agent.admin_get("/config_dump")?;
    let dump: Value = serde_json::from_slice(&dump.body)?;
    let watches = find_watches(&dump).context("watches")?;
    ensure!(watches.iter().all(|w| w["synced"] == true), "{watches:?}");
    agent.stop()
}
