//! Waypoints on the data path (`docs/data-plane.md#waypoints`): a service bound to a waypoint is
//! reached through it, over HBONE (HTTP/2 `CONNECT` over mutual TLS to port 15008) as the client
//! pod's workload identity. The waypoint is `rdt-peer hbone`, a stand-in that records each
//! `CONNECT`'s authority and the client's SPIFFE identity and carries the stream to the service's
//! endpoint; the certificates come from the suite's test CA.
use std::{path::Path, time::Duration};

use anyhow::{Context, Result, ensure};
use integration::fixtures::curls_moved;
use integration::pki::TestCa;
use integration::proc::Proc;
use integration::world::{Reach, World};
use integration::{pace, peer};

/// team-a's waypoint (the Service `team-a/team-a-waypoint` the entry `api-example` binds) and
/// istio-system's (`egress-waypoint`, which the PUBLIC `metrics` binds and team-b's NAMESPACE
/// `payments` may not).
const TEAM_A_WAYPOINT: &str = "198.51.100.95";
const EGRESS_WAYPOINT: &str = "198.51.100.96";
const API_VIP: &str = "203.0.113.10:80";
const API_ENDPOINT: &str = "198.51.100.20:80";
const METRICS_VIP: &str = "203.0.113.30:80";
const METRICS_ENDPOINT: &str = "198.51.100.30:80";
const PAYMENTS_VIP: &str = "203.0.113.70:443";
const PAYMENTS_ENDPOINT: &str = "198.51.100.70:443";
const TRUST_DOMAIN: &str = "cluster.local";
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The waypoints' Services, as Istio deploys one beside each waypoint Gateway.
fn waypoint_services() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: team-a-waypoint, namespace: team-a}}\nspec: {{clusterIP: {TEAM_A_WAYPOINT}, ports: [{{port: 15008, name: mesh}}]}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: egress-waypoint, namespace: istio-system}}\nspec: {{clusterIP: {EGRESS_WAYPOINT}, ports: [{{port: 15008, name: mesh}}]}}\n"
    )
}

/// A world whose agent has the waypoints' Services and the pods' certificates from `ca`.
fn world(ca: &TestCa, identities: &Path) -> Result<World> {
    ca.write_identity_dir(
        identities,
        &[
            ("team-a", "default"),
            ("team-b", "default"),
            ("team-c", "default"),
        ],
        DAY,
    )?;
    let dir = identities.to_string_lossy().to_string();
    world_with(
        &["--identity-dir", &dir, "--trust-domain", TRUST_DOMAIN],
        None,
    )
}

/// A world whose agent has the waypoints' Services and `args`, and whose mesh config names
/// `trust_domain` when given.
fn world_with(args: &[&str], trust_domain: Option<&str>) -> Result<World> {
    World::start_args(
        |config| {
            if let Some(domain) = trust_domain {
                let mesh = config.join("01-mesh-config.yaml");
                let text = std::fs::read_to_string(&mesh).context("the mesh config")?;
                ensure!(text.contains("  meshConfig:\n"), "{text}");
                let named = text.replace(
                    "  meshConfig:\n",
                    &format!("  meshConfig:\n    trustDomain: {domain}\n"),
                );
                std::fs::write(&mesh, named).context("naming the trust domain")?;
            }
            std::fs::write(config.join("90-waypoints.yaml"), waypoint_services())
                .context("writing the waypoints' Services")
        },
        &integration::Launch::default(),
        args,
    )
}

/// A waypoint stand-in in ext at `ip`:15008 with the certificate of `namespace/account` from `ca`,
/// carrying each `CONNECT` of `routes` (authority, endpoint) to its endpoint.
fn stand_in(
    w: &World,
    ca: &TestCa,
    name: &str,
    ip: &str,
    (namespace, account): (&str, &str),
    routes: &[(&str, &str)],
) -> Result<Proc> {
    let files = w.topo.scratch_path(&format!("waypoint-{name}"));
    std::fs::create_dir_all(&files)?;
    let tls = ca.write_server_files(&files, namespace, account, DAY)?;
    w.topo.ensure_ext_address(ip.parse::<std::net::IpAddr>()?)?;
    let listen = format!("{ip}:15008");
    let mut cmd = peer::cmd(w.topo.ext())?
        .args(["hbone", "--name", name, "--listen", &listen])
        .args(tls);
    for (authority, endpoint) in routes {
        cmd = cmd.args(["--route", &format!("{authority}={endpoint}")]);
    }
    let mut proc = cmd.spawn()?;
    proc.wait_for_log(
        &format!("listening {listen}"),
        pace::scaled(Duration::from_secs(10)),
    )?;
    Ok(proc)
}

/// team-a's waypoint at its address with the certificate `ca` issues for it, carrying `api` to
/// its endpoint.
fn team_a_waypoint(w: &World, ca: &TestCa, name: &str) -> Result<Proc> {
    stand_in(
        w,
        ca,
        name,
        TEAM_A_WAYPOINT,
        ("team-a", "team-a-waypoint"),
        &[(API_VIP, API_ENDPOINT)],
    )
}

/// The `connect` lines a stand-in printed.
fn connects(proc: &Proc) -> Vec<String> {
    proc.log()
        .lines()
        .filter(|l| l.starts_with("connect "))
        .map(str::to_string)
        .collect()
}

fn spiffe(namespace: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/default")
}

#[test]
fn a_bound_service_is_reached_through_its_waypoint_as_the_client_identity() -> Result<()> {
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let scratch = tempdir("through")?;
    let w = world(&ca, &scratch)?;
    let team_a = team_a_waypoint(&w, &ca, "team-a")?;
    let egress = stand_in(
        &w,
        &ca,
        "egress",
        EGRESS_WAYPOINT,
        ("istio-system", "egress-waypoint"),
        &[
            (METRICS_VIP, METRICS_ENDPOINT),
            (PAYMENTS_VIP, PAYMENTS_ENDPOINT),
        ],
    )?;

    // team-a's NAMESPACE entry, bound to team-a's waypoint: through it, as team-a's pod.
    for _ in 0..3 {
        let reach = w.curl("team-a", "http://api.example.com/")?;
        ensure!(reach == Reach::server("api-endpoint"), "{reach:?}");
    }
    let seen = connects(&team_a);
    ensure!(
        seen.len() == 3,
        "three CONNECTs: {seen:#?}\n{}",
        team_a.log()
    );
    for line in &seen {
        ensure!(
            line.contains(&format!("authority={API_VIP} "))
                && line.contains(&format!("identity={} ", spiffe("team-a")))
                && line.contains("status=200"),
            "{line}"
        );
    }
    // The decision is the proxy's (the kernel hands bound services over), and the access log says
    // which waypoint carried it.
    let explained = w
        .agent
        .admin_get(&format!("/explain?from=team-a&ip={API_VIP}"))?
        .text();
    let compact: String = explained.split_whitespace().collect();
    ensure!(compact.contains("\"decidedBy\":\"proxy\""), "{explained}");
    ensure!(
        explained.contains("waypoint team-a/team-a-waypoint"),
        "{explained}"
    );
    let endpoint = format!("endpoint={TEAM_A_WAYPOINT}:15008");
    w.agent.wait_log_line(
        "of an access naming the waypoint",
        Duration::from_secs(5),
        |l| {
            l.contains("access:")
                && l.contains("waypoint=team-a/team-a-waypoint")
                && l.contains(&endpoint)
        },
    )?;

    // team-b cannot see it: its name is answered upstream and the connection passes through to
    // the real host, never to a waypoint.
    let (_, reach) = w.check_host("team-b", "api.example.com", 80)?;
    ensure!(reach == Reach::server("public-api"), "{reach:?}");
    let reach = w.curl("team-b", &format!("http://{API_VIP}/"))?;
    ensure!(reach == Reach::server("real-203.0.113.10"), "{reach:?}");
    ensure!(
        connects(&team_a).len() == 3,
        "team-b went through team-a's waypoint"
    );

    // A PUBLIC entry binds a waypoint of another namespace: every client goes through it, each
    // as itself.
    for ns in ["team-a", "team-c"] {
        let reach = w.curl(ns, "http://metrics.example.com/")?;
        ensure!(
            reach == Reach::server("metrics-endpoint"),
            "{ns}: {reach:?}"
        );
    }
    let seen = connects(&egress);
    for ns in ["team-a", "team-c"] {
        ensure!(
            seen.iter()
                .any(|l| l.contains(&format!("authority={METRICS_VIP} "))
                    && l.contains(&format!("identity={} ", spiffe(ns)))),
            "{ns} not seen at the egress waypoint: {seen:#?}"
        );
    }

    // team-b's NAMESPACE entry asks for istio-system's waypoint: refused, so reached directly.
    let echoed = peer::cmd(w.client("team-b").place())?
        .args(["echo", PAYMENTS_VIP, "--bytes", "1000"])
        .timeout(pace::scaled(Duration::from_secs(20)))
        .output()?;
    ensure!(echoed.success(), "{echoed}");
    ensure!(
        !connects(&egress).iter().any(|l| l.contains(PAYMENTS_VIP)),
        "a refused binding went through the waypoint: {:#?}",
        connects(&egress)
    );
    let out = std::process::Command::new(integration::Agent::bin()?)
        .args(["resolve", "-o", "json", "-f"])
        .arg(w.config_dir())
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let payments = resolved["serviceEntries"]
        .as_array()
        .and_then(|entries| {
            entries
                .iter()
                .find(|e| e["name"] == "payments" && e["namespace"] == "team-b")
        })
        .context("payments in resolve's output")?;
    ensure!(
        payments["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| {
                c["type"] == "istio.io/WaypointBound"
                    && c["status"] == "False"
                    && c["reason"] == "CrossNamespaceWaypointForbidden"
            })),
        "{payments}"
    );

    let metrics = w.agent.metrics()?;
    ensure!(
        metrics.get_or_zero(r#"redirect_hbone_tunnels_total{result="ok"}"#) >= 5.0,
        "{:#?}",
        metrics.samples()
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// Istio's metrics of the waypoint path (`docs/observability.md#istio-metrics`): 50 connections
/// to team-a's bound entry count as mutual TLS from a1's identity to the waypoint (the workload
/// the connection reaches), for the service the client addressed, with the bytes curl moved.
/// With HBONE between nodes on (the Pods' certificates and the node's name), the waypoint sees
/// the client Pod's address, as ztunnel dials a waypoint: the answers to it are brought back to
/// the agent on the node's links. Without it (the suite's other tests), the node's.
#[test]
fn with_hbone_between_nodes_the_waypoint_sees_the_client_pods_address() -> Result<()> {
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let scratch = tempdir("source")?;
    ca.write_identity_dir(&scratch, &[("team-a", "default")], DAY)?;
    let dir = scratch.to_string_lossy().to_string();
    let w = world_with(
        &[
            "--identity-dir",
            &dir,
            "--trust-domain",
            TRUST_DOMAIN,
            "--node-name",
            "node-1",
        ],
        None,
    )?;
    let team_a = team_a_waypoint(&w, &ca, "team-a")?;
    for _ in 0..3 {
        let reach = w.curl("team-a", "http://api.example.com/")?;
        ensure!(reach == Reach::server("api-endpoint"), "{reach:?}");
    }
    ensure!(connects(&team_a).len() == 3, "{}", team_a.log());
    let client = w.client("team-a").ip;
    let accepted: Vec<String> = (team_a.log().lines())
        .filter(|l| l.starts_with("accepted "))
        .map(str::to_string)
        .collect();
    ensure!(
        !accepted.is_empty()
            && accepted
                .iter()
                .all(|l| l.contains(&format!("from={client}:"))),
        "the waypoint should see team-a's Pod {client}: {accepted:#?}"
    );
    Ok(())
}

#[test]
fn the_waypoint_path_counts_in_istios_series_as_mutual_tls_to_the_waypoint() -> Result<()> {
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let scratch = tempdir("istio")?;
    let w = world(&ca, &scratch)?;
    let _team_a = team_a_waypoint(&w, &ca, "team-a")?;
    let before = w.agent.metrics()?;
    let moved = curls_moved(w.client("team-a"), "http://api.example.com/", 50)?;
    let source = spiffe("team-a");
    let waypoint = format!("spiffe://{TRUST_DOMAIN}/ns/team-a/sa/team-a-waypoint");
    let labels = [
        ("reporter", "source"),
        ("source_workload", "a1"),
        ("source_principal", source.as_str()),
        ("destination_service", "api.example.com"),
        ("destination_service_name", "api-example"),
        ("destination_workload", "team-a-waypoint"),
        ("destination_workload_namespace", "team-a"),
        ("destination_principal", waypoint.as_str()),
        ("connection_security_policy", "mutual_tls"),
        ("response_flags", "-"),
    ];
    // The proxy counts a close as its relay ends, a moment after curl has its answer.
    let deadline = std::time::Instant::now() + pace::scaled(Duration::from_secs(10));
    let closes = "istio_tcp_connections_closed_total";
    let mut after = w.agent.metrics()?;
    while after.sum_matching(closes, &labels) - before.sum_matching(closes, &labels) < 50.0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
        after = w.agent.metrics()?;
    }
    let moved_by =
        |family: &str| after.sum_matching(family, &labels) - before.sum_matching(family, &labels);
    let sent: u64 = moved.iter().map(|m| m.sent).sum();
    let received: u64 = moved.iter().map(|m| m.received).sum();
    let counted = [
        moved_by("istio_tcp_connections_opened_total"),
        moved_by("istio_tcp_connections_closed_total"),
        moved_by("istio_tcp_received_bytes_total"),
        moved_by("istio_tcp_sent_bytes_total"),
    ];
    ensure!(
        counted == [50.0, 50.0, sent as f64, received as f64],
        "opened, closed, bytes from and to the client {counted:?}; curl sent {sent} and received {received}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

#[test]
fn a_waypoint_with_another_trust_domains_certificate_is_refused_and_counted() -> Result<()> {
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let foreign = TestCa::new("other.example")?;
    let scratch = tempdir("foreign")?;
    let w = world(&ca, &scratch)?;
    let impostor = team_a_waypoint(&w, &foreign, "impostor")?;
    let reach = w.curl("team-a", &format!("http://{API_VIP}/"))?;
    ensure!(reach == Reach::Reset, "{reach:?}");
    ensure!(connects(&impostor).is_empty(), "{}", impostor.log());
    // The impostor does not trust our pod either: it saw a handshake fail.
    w.agent
        .wait_metrics("a refused HBONE handshake", Duration::from_secs(5), |m| {
            m.get_or_zero(r#"redirect_hbone_tunnels_total{result="tls_refused"}"#) >= 1.0
        })?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

#[test]
fn certificates_rotate_without_a_failed_connection() -> Result<()> {
    let ca = TestCa::new(TRUST_DOMAIN)?;
    let scratch = tempdir("rotate")?;
    let w = world(&ca, &scratch)?;
    let team_a = team_a_waypoint(&w, &ca, "team-a")?;
    // Curls in a loop while the pod's certificate is replaced twice.
    let script = format!(
        "for i in $(seq 60); do curl -sS -o /dev/null --max-time {} http://api.example.com/ || exit 1; sleep 0.05; done",
        pace::scaled_secs(10)
    );
    let curls = w.client("team-a").cmd("sh").args(["-c", &script]).spawn()?;
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(1200));
        ca.write_identity_dir(&scratch, &[("team-a", "default")], DAY)?;
    }
    let mut curls = curls;
    let status = curls.wait(pace::scaled(Duration::from_secs(60)))?;
    ensure!(
        status.success(),
        "a curl failed during rotation:\n{}",
        curls.log()
    );
    ensure!(connects(&team_a).len() == 60, "{}", team_a.log());
    let metrics = w.agent.metrics()?;
    ensure!(
        metrics.get_or_zero("redirect_hbone_connections_total") >= 2.0,
        "a rotation opens a new connection: {:#?}",
        metrics.samples()
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// A fresh directory for one test's certificates.
/// The trust domain the CA test's mesh config names.
const MESH_TRUST_DOMAIN: &str = "mesh.example";

fn mesh_spiffe(namespace: &str) -> String {
    format!("spiffe://{MESH_TRUST_DOMAIN}/ns/{namespace}/sa/default")
}

/// The CA's address: istiod's stand-in in ext.
const ISTIOD: &str = "198.51.100.97:15012";

/// Istio's CA protocol end to end: the agent asks the stand-in istiod for each client pod's
/// certificate with its own token, impersonating the pod's identity; one call serves a burst of
/// first connections; the certificate is renewed in the background at half its lifetime, so a
/// steady stream of connections sees no failure across several renewals; an identity the CA
/// refuses is reset (never sent around the waypoint) and counted.
#[test]
fn pods_certificates_come_from_istios_ca_and_are_renewed_before_they_expire() -> Result<()> {
    // The trust domain is the mesh config's: no --trust-domain.
    let ca = TestCa::new(MESH_TRUST_DOMAIN)?;
    let scratch = tempdir("ca")?;
    let ca_dir = scratch.join("ca");
    ca.save(&ca_dir)?;
    let token = scratch.join("istio-token");
    std::fs::write(&token, "node-agent-token\n")?;
    let path = |p: &Path| p.to_string_lossy().to_string();
    let w = world_with(
        &[
            "--ca-address",
            &format!("https://{ISTIOD}"),
            "--ca-root",
            &path(&ca_dir.join("root-cert.pem")),
            "--ca-token",
            &path(&token),
            "--cluster-id",
            "rdt-cluster",
            "--workload-cert-ttl",
            "6s",
        ],
        Some(MESH_TRUST_DOMAIN),
    )?;
    let (istiod_ip, _) = ISTIOD.split_once(':').context("ISTIOD")?;
    w.topo
        .ensure_ext_address(istiod_ip.parse::<std::net::IpAddr>()?)?;
    let mut istiod = peer::cmd(w.topo.ext())?
        .args([
            "ca",
            "--listen",
            ISTIOD,
            "--trust-domain",
            MESH_TRUST_DOMAIN,
        ])
        .args(["--ca-dir", &path(&ca_dir), "--token", &path(&token)])
        .args(["--name", istiod_ip, "--name", "istiod.istio-system.svc"])
        .args(["--allow", "team-a/default", "--allow", "team-c/default"])
        .spawn()?;
    istiod.wait_for_log(
        &format!("listening {ISTIOD}"),
        pace::scaled(Duration::from_secs(10)),
    )?;
    let team_a = team_a_waypoint(&w, &ca, "team-a")?;
    let egress = stand_in(
        &w,
        &ca,
        "egress",
        EGRESS_WAYPOINT,
        ("istio-system", "egress-waypoint"),
        &[(METRICS_VIP, METRICS_ENDPOINT)],
    )?;
    let issued = |proc: &Proc, ns: &str| {
        proc.log()
            .lines()
            .filter(|l| {
                l.starts_with(&format!("issued identity={} ", mesh_spiffe(ns)))
                    && l.contains("ttl=6s cluster=rdt-cluster")
            })
            .count()
    };

    // A burst of first connections: one certificate asked for, not one each.
    let reaches = std::thread::scope(|scope| {
        let curls: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| w.curl("team-a", "http://api.example.com/")))
            .collect();
        curls
            .into_iter()
            .map(|c| {
                c.join()
                    .map_err(|_| anyhow::anyhow!("a curl thread panicked"))?
            })
            .collect::<Result<Vec<_>>>()
    })?;
    ensure!(
        reaches.iter().all(|r| *r == Reach::server("api-endpoint")),
        "{reaches:?}"
    );
    let dials = w
        .agent
        .metrics()?
        .get_or_zero("redirect_hbone_connections_total");
    ensure!(
        dials == 1.0,
        "the burst dialled {dials} connections, not one"
    );
    ensure!(
        issued(&istiod, "team-a") == 1,
        "one issuance for the burst:\n{}",
        istiod.log()
    );

    // Connections for three lifetimes: renewed ahead, none fails.
    let until = std::time::Instant::now() + Duration::from_secs(14);
    let mut curls = 0;
    while std::time::Instant::now() < until {
        let reach = w.curl("team-a", "http://api.example.com/")?;
        ensure!(
            reach == Reach::server("api-endpoint"),
            "curl {curls}: {reach:?}\n{}",
            istiod.log()
        );
        curls += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
    let renewals = issued(&istiod, "team-a");
    ensure!(
        (3..=8).contains(&renewals),
        "a 6 s certificate over 14 s is asked for about every 3 s, got {renewals}:\n{}",
        istiod.log()
    );
    ensure!(
        connects(&team_a)
            .iter()
            .all(|l| l.contains(&format!("identity={} ", mesh_spiffe("team-a")))),
        "{}",
        team_a.log()
    );

    // team-c may have a certificate, team-b may not (it runs on no node of this agent, says the
    // CA): its connection is reset, never carried around the waypoint.
    let reach = w.curl("team-c", "http://metrics.example.com/")?;
    ensure!(reach == Reach::server("metrics-endpoint"), "{reach:?}");
    let reach = w.curl("team-b", "http://metrics.example.com/")?;
    ensure!(
        reach == Reach::Reset,
        "team-b without a certificate got {reach:?}"
    );
    ensure!(
        istiod
            .log()
            .lines()
            .any(|l| l.starts_with("refused code=PermissionDenied")
                && l.contains(&mesh_spiffe("team-b"))),
        "{}",
        istiod.log()
    );
    ensure!(
        !connects(&egress)
            .iter()
            .any(|l| l.contains(&mesh_spiffe("team-b"))),
        "{}",
        egress.log()
    );
    let metrics = w.agent.metrics()?;
    ensure!(
        metrics.get_or_zero(r#"redirect_hbone_tunnels_total{result="ca_failed"}"#) >= 1.0
            && metrics.get_or_zero(r#"redirect_hbone_certificates_total{result="issued"}"#) == 2.0
            && metrics.get_or_zero(r#"redirect_hbone_certificates_total{result="renewed"}"#) >= 2.0
            && metrics.get_or_zero(r#"redirect_hbone_certificates_total{result="failed"}"#) >= 1.0,
        "{:#?}",
        metrics.samples()
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

fn tempdir(name: &str) -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("rdt-waypoint-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
