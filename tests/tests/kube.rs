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
