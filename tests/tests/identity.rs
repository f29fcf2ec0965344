//! Issue 4, client identity: the registry gives a pod IP to a namespace, and the agent checks that word
//! against the kernel's. The programs record the cgroup of every connecting process; on a kubelet node
//! that cgroup names the pod's uid. When the pod the registry names and the pod the kernel names differ,
//! the connection is served as an unknown client (PUBLIC services only), never as the namespace the
//! address claims.
//!
//! The case that happens on real nodes: a pod ends, a new pod of another team gets its recycled IP, and
//! the registry has not caught up yet. Here the registry still gives 10.244.1.10 to team-a's `a1`,
//! while the pod really holding that address is team-b's `b1`.
use std::path::Path;

use anyhow::{Context, Result, ensure};
use integration::{Agent, Metrics, Peer, Topology};

const A1_UID: &str = "0a1a1a1a-0000-4000-8000-000000000001";
const A2_UID: &str = "0a2a2a2a-0000-4000-8000-000000000002";
const B1_UID: &str = "0b1b1b1b-0000-4000-8000-000000000003";
const C1_UID: &str = "0c1c1c1c-0000-4000-8000-000000000004";

const SERVICE_BODY: &str = "team-a-api";
const REAL_BODY: &str = "real-203.0.113.10";

const MISMATCHES: &str = "redirect_client_identity_mismatches_total";
const SERVICE: &str = r#"redirect_outbound_connections_total{outcome="service"}"#;
const PASSTHROUGH: &str = r#"redirect_outbound_connections_total{outcome="passthrough"}"#;

/// The registry: where the node's pods are, as the control plane last said; plus team-a's entry.
fn registry(a1_ip_holder: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: team-a}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: team-b}}
---
kind: MeshConfig
serviceEntryVisibility: {{defaultVisibility: NAMESPACE}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: api, namespace: team-a}}
spec:
  hosts: [api.example.com]
  addresses: [203.0.113.10]
  ports: [{{number: 80, name: http, protocol: HTTP}}]
  resolution: STATIC
  endpoints: [{{address: 198.51.100.20}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: a2, namespace: team-a, uid: {A2_UID}}}
status: {{podIP: 10.244.1.12}}
---
apiVersion: v1
kind: Pod
metadata: {{name: c1, namespace: team-a, uid: {C1_UID}}}
status: {{podIP: 10.244.1.13}}
---
{a1_ip_holder}"#
    )
}

/// Stale: a1 (gone) still holds 10.244.1.10.
const STALE: &str = "apiVersion: v1\nkind: Pod\nmetadata: {name: a1, namespace: team-a, uid: 0a1a1a1a-0000-4000-8000-000000000001}\nstatus: {podIP: 10.244.1.10}\n";
/// Caught up: b1 holds it.
const CAUGHT_UP: &str = "apiVersion: v1\nkind: Pod\nmetadata: {name: b1, namespace: team-b, uid: 0b1b1b1b-0000-4000-8000-000000000003}\nstatus: {podIP: 10.244.1.10}\n";

/// Fields drop in order: the agent, the servers, then the topology.
struct Setup {
    agent: Agent,
    _servers: (Peer, Peer),
    topo: Topology,
}

fn setup() -> Result<Setup> {
    let mut topo = Topology::new()?;
    // b1 really holds the address the registry still gives to a1.
    topo.add_kube_pod("team-b/b1", "10.244.1.10".parse()?, B1_UID)?;
    topo.add_kube_pod("team-a/a2", "10.244.1.12".parse()?, A2_UID)?;
    // Not laid out by kubelet: its cgroup names no pod, so there is nothing to check against.
    topo.add_pod("team-a/c1", "10.244.1.13".parse()?)?;
    let servers = (
        topo.start_ext_peer(SERVICE_BODY, &["198.51.100.20:80".parse()?], &[])?,
        topo.start_ext_peer(REAL_BODY, &["203.0.113.10:80".parse()?], &[])?,
    );
    let config = topo.scratch_path("config");
    std::fs::create_dir_all(&config)?;
    write_registry(&config, STALE)?;
    let agent = Agent::start(&topo, &["--config", &config.to_string_lossy()])?;
    Ok(Setup {
        agent,
        _servers: servers,
        topo,
    })
}

fn write_registry(dir: &Path, a1_ip_holder: &str) -> Result<()> {
    // Write then rename: the agent never reads half a file.
    let tmp = dir.join(".registry.yaml.tmp");
    std::fs::write(&tmp, registry(a1_ip_holder))?;
    std::fs::rename(&tmp, dir.join("registry.yaml")).context("replacing registry.yaml")
}

/// The body of `http://api.example.com/` (by address) as `pod` gets it.
fn curl_api(s: &Setup, pod: &str) -> Result<String> {
    Ok(s.topo
        .pod(pod)
        .cmd("curl")
        .args(["-sS", "--fail", "--max-time", "10", "http://203.0.113.10/"])
        .ok()?
        .stdout_str()
        .trim()
        .to_string())
}

fn delta(before: &Metrics, after: &Metrics, key: &str) -> f64 {
    after.get_or_zero(key) - before.get_or_zero(key)
}

#[test]
fn a_pod_on_a_recycled_ip_is_not_served_as_the_namespace_the_registry_still_gives_that_ip()
-> Result<()> {
    let s = setup()?;

    // The registry and the kernel agree on a2: team-a gets its own NAMESPACE entry.
    let before = s.agent.metrics()?;
    assert_eq!(curl_api(&s, "team-a/a2")?, SERVICE_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, SERVICE), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");

    // b1 sits on the IP the registry gives to team-a's a1, but its cgroup is b1's: an unknown
    // client, which sees PUBLIC services only, so team-a's entry is absent and the real host answers.
    let before = after;
    assert_eq!(curl_api(&s, "team-b/b1")?, REAL_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 1.0, "{after:#?}");
    assert_eq!(delta(&before, &after, SERVICE), 0.0, "{after:#?}");
    let log = s.agent.log();
    ensure!(
        log.contains("not in the cgroup of the pod that holds its address")
            && log.contains(A1_UID)
            && log.contains(B1_UID),
        "the agent must say whom it refused to believe, and why:\n{log}"
    );

    // c1's cgroup names no pod: the registry's word stands (team-a), nothing is counted.
    let before = after;
    assert_eq!(curl_api(&s, "team-a/c1")?, SERVICE_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");

    // The registry catches up: b1 is team-b's, registry and kernel agree, and team-b still does not
    // see team-a's entry; no mismatch is counted any more.
    write_registry(&s.topo.scratch_path("config"), CAUGHT_UP)?;
    let dump_has_b1 =
        || -> Result<bool> { Ok(s.agent.admin_get("/config_dump")?.text().contains(B1_UID)) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !dump_has_b1()? {
        ensure!(
            std::time::Instant::now() < deadline,
            "the agent did not take the new registry"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let before = s.agent.metrics()?;
    assert_eq!(curl_api(&s, "team-b/b1")?, REAL_BODY);
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, MISMATCHES), 0.0, "{after:#?}");
    assert_eq!(delta(&before, &after, PASSTHROUGH), 1.0, "{after:#?}");
    Ok(())
}
