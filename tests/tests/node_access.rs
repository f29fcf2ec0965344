//! No tenant reaches the node through the agent (`docs/data-plane.md#destinations-the-proxy-refuses`).
//! Every proxied connection starts in the node's network namespace, so the proxy must never dial,
//! for a pod, what would be the node itself: its loopback, its link (a metadata service), its own
//! addresses. And a flow the kernel filed belongs to the one connection that filed it.
use anyhow::{Result, ensure};
use integration::fixtures::{self, API_ENDPOINT_BODY, API_REAL_BODY, API_URL};
use integration::world::{delta, replace_file};
use integration::{Agent, GATEWAY, NODE_EXT_IP, Peer, Topology, netns, peer};

const A1: (&str, &str) = ("team-a/a1", "10.244.1.10");
/// What a node-only service answers: a pod reading it through the agent has reached the node.
const NODE_BODY: &str = "node-only";
/// A metadata service on the node's link, as clouds put it.
const METADATA: &str = "169.254.169.254";

const REFUSED: &str = "redirect_outbound_refused_destinations_total";
const UNCLAIMED: &str = "redirect_outbound_unclaimed_total";
const REJECTED_SERVICE_ENTRIES: &str = r#"redirect_config_objects_rejected{kind="ServiceEntry"}"#;

fn refused(reason: &str) -> String {
    format!(r#"{REFUSED}{{reason="{reason}"}}"#)
}

/// Fields drop in order: the agent, the servers, then the topology.
struct Setup {
    agent: Agent,
    _servers: Vec<Peer>,
    topo: Topology,
}

/// team-a's entry for api.example.com with `entry_yaml` as its last document, and servers on the
/// node's loopback (127.0.0.1:8090), its own address (192.0.2.1:8080) and its link (the metadata
/// address on port 80), each answering `node-only`.
fn setup(config: &str, extra_args: &[&str]) -> Result<Setup> {
    let topo = Topology::with_pods(&[A1])?;
    netns::ip(&[
        "-n",
        &topo.node().netns,
        "addr",
        "add",
        &format!("{METADATA}/32"),
        "dev",
        "lo",
    ])?;
    let (endpoint, real) = fixtures::start_api_servers(&topo)?;
    let node = Peer::start(
        topo.node(),
        NODE_BODY,
        &[
            "127.0.0.1:8090".parse()?,
            format!("{NODE_EXT_IP}:8080").parse()?,
            format!("{METADATA}:80").parse()?,
        ],
        &[],
    )?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    let a1 = fixtures::pod(A1.0, "0a1a1a1a-0000-4000-8000-0000000000a1", A1.1, "{}");
    replace_file(&dir, "mesh.yaml", &format!("{config}---\n{a1}"))?;
    // What the proxy dials is the question here: every connection goes to it.
    let mut args = vec![
        "--config",
        dir.to_str().unwrap_or_default(),
        integration::NO_FAST_PATH,
    ];
    args.extend_from_slice(extra_args);
    let agent = Agent::start(&topo, &args)?;
    Ok(Setup {
        agent,
        _servers: vec![endpoint, real, node],
        topo,
    })
}

fn curl(s: &Setup, url: &str) -> Result<String> {
    fixtures::curl_body(s.topo.pod("team-a/a1"), url)
}

/// An entry whose endpoint is the node's loopback is refused at load, naming file, object and
/// field; the pod never reads the node's loopback-only service through it.
#[test]
fn a_loopback_endpoint_is_refused_and_the_pod_never_reaches_the_nodes_loopback() -> Result<()> {
    let entry = fixtures::team_a_api().replace("198.51.100.20", "127.0.0.1");
    let entry = entry.replace("number: 80", "number: 80, targetPort: 8090");
    ensure!(entry.contains("127.0.0.1"), "the fixture changed: {entry}");
    let s = setup(&entry, &[])?;
    let metrics = s.agent.metrics()?;
    assert_eq!(
        metrics.get_or_zero(REJECTED_SERVICE_ENTRIES),
        1.0,
        "the entry is in error: {metrics:#?}"
    );
    let body = curl(&s, API_URL)?;
    assert_ne!(body, NODE_BODY, "a pod read a loopback-only node service");
    assert_eq!(
        body, API_REAL_BODY,
        "the entry left out: the real host answers"
    );
    ensure!(
        s.agent
            .log()
            .contains("is a loopback address: the agent dials endpoints from the node"),
        "the error names why; log:\n{}",
        s.agent.log()
    );
    Ok(())
}

/// Passthrough to the node's own address or to a link-local address (the metadata service) is
/// refused: the pod's connection is reset and the refusal counted by reason. Other destinations
/// are carried as before.
#[test]
fn the_proxy_never_dials_the_nodes_own_addresses_or_its_link_for_a_pod() -> Result<()> {
    let s = setup(&fixtures::team_a_api(), &[])?;
    let before = s.agent.metrics()?;
    for (url, reason) in [
        (format!("http://{NODE_EXT_IP}:8080/"), "node"),
        (format!("http://{METADATA}/"), "link_local"),
    ] {
        let got = curl(&s, &url);
        ensure!(
            got.is_err(),
            "{url}: the pod reached the node through the agent: {got:?}"
        );
        let after = s.agent.metrics()?;
        assert_eq!(
            delta(&before, &after, &refused(reason)),
            1.0,
            "{url}: {after:#?}"
        );
    }
    assert_eq!(
        curl(&s, API_URL)?,
        API_ENDPOINT_BODY,
        "other traffic is carried as before"
    );
    // An interface kept down to hold addresses (kube-proxy's IPVS mode puts every cluster IP on
    // one) is not the node: a connection there is not refused as the node's.
    let node = &s.topo.node().netns;
    // (A veth pair left down stands in for the dummy device: not every test kernel has dummy.)
    netns::ip(&[
        "-n",
        node,
        "link",
        "add",
        "ipvs0",
        "type",
        "veth",
        "peer",
        "name",
        "ipvs0-peer",
    ])?;
    netns::ip(&["-n", node, "addr", "add", "10.96.0.10/32", "dev", "ipvs0"])?;
    std::thread::sleep(std::time::Duration::from_millis(1100)); // the node's addresses, listed again
    let before = s.agent.metrics()?;
    let _ = curl(&s, "http://10.96.0.10/");
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, &refused("node")), 0.0, "{after:#?}");
    ensure!(
        s.agent
            .log()
            .contains("refusing to dial an address of the node itself for a pod"),
        "the refusal is logged; log:\n{}",
        s.agent.log()
    );
    Ok(())
}

/// The node's egress policy as the agent applies it: a prefix given with `--deny-destination` is
/// never dialled for a pod, whatever the entry or passthrough that leads there.
#[test]
fn a_denied_destination_is_refused_for_endpoints_and_passthrough() -> Result<()> {
    let s = setup(
        &fixtures::team_a_api(),
        &["--deny-destination", "198.51.100.0/24"],
    )?;
    let before = s.agent.metrics()?;
    let got = curl(&s, API_URL);
    ensure!(
        got.is_err(),
        "team-a's endpoint is in the denied prefix: {got:?}"
    );
    let got = curl(&s, "http://198.51.100.20/");
    ensure!(got.is_err(), "passthrough into the denied prefix: {got:?}");
    let after = s.agent.metrics()?;
    assert_eq!(
        delta(&before, &after, &refused("denied")),
        2.0,
        "{after:#?}"
    );
    Ok(())
}

/// A flow entry is read once, by the connection that filed it. A pod connecting to the proxy's
/// port itself, from the address and port an earlier steered connection used (a recycled pod IP,
/// a reused port), gets a reset, not that connection's destination.
#[test]
fn a_flow_entry_is_used_once_by_the_connection_that_filed_it() -> Result<()> {
    let s = setup(&fixtures::team_a_api(), &[])?;
    let pod = s.topo.pod("team-a/a1");
    let fetch = |addr: &str| -> Result<integration::Output> {
        peer::cmd(pod.place())?
            .args(["fetch", addr, "--from-port", "41000"])
            .output()
    };
    let before = s.agent.metrics()?;
    let steered = fetch("203.0.113.10:80")?;
    ensure!(
        steered.success(),
        "the steered fetch: {}",
        steered.stderr_str()
    );
    assert_eq!(steered.stdout_str().trim(), API_ENDPOINT_BODY);

    let direct = fetch(&format!("{GATEWAY}:15001"))?;
    assert_ne!(
        direct.stdout_str().trim(),
        API_ENDPOINT_BODY,
        "a direct connection to the proxy got the earlier connection's destination"
    );
    ensure!(
        !direct.success(),
        "the direct connection is reset: {}",
        direct.stdout_str()
    );
    let after = s.agent.metrics()?;
    assert_eq!(delta(&before, &after, UNCLAIMED), 1.0, "{after:#?}");

    // A steered connection from that port again is served as ever.
    let again = fetch("203.0.113.10:80")?;
    ensure!(again.success(), "steered again: {}", again.stderr_str());
    assert_eq!(again.stdout_str().trim(), API_ENDPOINT_BODY);
    Ok(())
}
