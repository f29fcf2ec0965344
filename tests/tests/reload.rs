//! The agent follows its configuration directory while it runs. A namespace label changed in the
//! manifests flips what clients see within a second, with no restart and without breaking the
//! connections already open. An object in error is left out (or kept at its last good version) and
//! reported, while every valid change applies; hostile files in the directory change nothing.
//!
//! As in `visibility.rs`, every outcome is what `redirect explain` says over the same manifests, and
//! explain is held to the answer the rules give, written here.
use std::net::{IpAddr, SocketAddrV4};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::explain::{DnsAction, DnsVerdict, OutboundOutcome};
use integration::world::{self, Reach, World, delta, key};
use integration::{Launch, Proc, dig, pace, peer};
use serde_json::Value;

/// Within a second of the change.
const FLIP_DEADLINE: Duration = Duration::from_secs(1);

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

fn is_answer(v: &DnsVerdict, service: &str, address: &str) -> bool {
    v.action == DnsAction::Answer
        && v.service.as_deref() == Some(service)
        && v.addresses == [address.parse::<IpAddr>().unwrap()]
}

fn is_forward(v: &DnsVerdict, hidden: Option<&str>) -> bool {
    v.action == DnsAction::Forward && v.service.is_none() && v.hidden.as_deref() == hidden
}

/// Polls `dig name` from `from` until its A records are `want`; returns how long that took from `since`.
fn wait_dig(
    w: &World,
    from: &str,
    name: &str,
    want: &[IpAddr],
    since: Instant,
) -> Result<Duration> {
    loop {
        let reply = dig::run(
            w.client(from)
                .cmd("dig")
                .args(["+tries=1", "+time=1", name]),
        )?;
        let got: Vec<IpAddr> = reply.a_records().into_iter().map(IpAddr::V4).collect();
        if got == want {
            return Ok(since.elapsed());
        }
        ensure!(
            since.elapsed() < pace::scaled(FLIP_DEADLINE * 5),
            "dig {name} from {from} still gets {got:?}, want {want:?}"
        );
    }
}

/// The highest `ok <i>` a `rdt-peer hold` client printed.
/// Labels team-a `trusted`: the world's mesh config then makes team-a's entries PUBLIC.
fn trust_team_a(dir: &Path) -> Result<()> {
    world::edit_file(
        dir,
        "00-namespaces.yaml",
        "  name: team-a\n",
        "  name: team-a\n  labels:\n    trusted: \"true\"\n",
    )
}

fn last_exchange(hold: &Proc) -> Option<u64> {
    hold.log()
        .lines()
        .filter_map(|l| l.strip_prefix("ok ")?.parse().ok())
        .max()
}

/// The hold client is still exchanging lines on its one connection: a few more after now.
fn still_holding(hold: &mut Proc) -> Result<()> {
    let next = last_exchange(hold).map_or(0, |i| i + 3);
    hold.wait_for_log(&format!("ok {next}"), Duration::from_secs(5))
}

#[test]
fn namespace_label_change_flips_visibility_within_a_second_and_open_connections_survive()
-> Result<()> {
    let w = World::start_launched(&Launch::no_fast_path())?;
    let dir = w.config_dir().to_path_buf();
    let dest = addr("203.0.113.10:80");

    // Before: team-a's entry is NAMESPACE; team-b resolves upstream and reaches the real host.
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    assert!(is_forward(&v, Some("team-a/api-example")), "{}", v.json);
    let (v, reach) = w.check_connect("team-b", dest)?;
    assert_eq!(
        (v.action, reach),
        (
            OutboundOutcome::Passthrough,
            Reach::server("real-203.0.113.10")
        )
    );

    // Long-lived connections opened before the change, each exchanging a line every 50 ms: team-b to
    // the real host's echo (a passthrough: the very decision the change reverses), and team-b through
    // its own entry `payments` to that entry's endpoint (a service connection).
    let hold = |dest: &str| -> Result<Proc> {
        let mut p = peer::cmd(w.client("team-b").place())?
            .args(["hold", dest, "--interval-ms", "50"])
            .spawn()?;
        p.wait_for_log("ok 0", Duration::from_secs(10))?;
        Ok(p)
    };
    let mut passthrough = hold("203.0.113.10:7")?;
    let mut service = hold("203.0.113.70:443")?;
    w.agent.wait_metrics(
        "just the two held connections open",
        Duration::from_secs(5),
        |m| m.get_or_zero("redirect_active_connections") == 2.0,
    )?;
    let pid = w.agent.pid();
    let before = w.agent.metrics()?;

    // team-a becomes trusted: policy 1 makes its entry PUBLIC.
    let plain = std::fs::read_to_string(dir.join("00-namespaces.yaml"))?;
    trust_team_a(&dir)?;
    let changed = Instant::now();
    let v = w.explain().host("team-b", "api.example.com.")?;
    assert!(
        is_answer(&v, "team-a/api-example", "203.0.113.10"),
        "{}",
        v.json
    );
    let took = wait_dig(&w, "team-b", "api.example.com.", &v.addresses, changed)?;
    eprintln!("label added: team-b's answer flipped {took:?} after the change");
    ensure!(
        took < pace::scaled(FLIP_DEADLINE),
        "flipped only after {took:?}"
    );
    w.agent
        .wait_metrics("one good reload", Duration::from_secs(2), |m| {
            delta(&before, m, key::RELOAD_OK) == 1.0
        })?;
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    assert!(
        is_answer(&v, "team-a/api-example", "203.0.113.10"),
        "{}",
        v.json
    );
    let (v, reach) = w.check_connect("team-b", dest)?;
    assert_eq!(
        (v.action, v.service.as_deref(), reach),
        (
            OutboundOutcome::Service,
            Some("team-a/api-example"),
            Reach::server("api-endpoint")
        )
    );
    // A new connection to the held destination is now decided by the PUBLIC entry, which does not
    // declare port 7: reset. The old one keeps its passthrough.
    let (v, reach) = w.check_connect("team-b", addr("203.0.113.10:7"))?;
    assert_eq!(
        (v.action, reach),
        (OutboundOutcome::NoHealthyUpstream, Reach::Reset)
    );
    still_holding(&mut passthrough)?;
    still_holding(&mut service)?;

    // And back: the label removed, team-b is outside again.
    let before = w.agent.metrics()?;
    world::replace_file(&dir, "00-namespaces.yaml", &plain)?;
    let changed = Instant::now();
    let v = w.explain().host("team-b", "api.example.com.")?;
    assert!(is_forward(&v, Some("team-a/api-example")), "{}", v.json);
    let public = w.dig_upstream("api.example.com.")?;
    let want: Vec<IpAddr> = public.a_records().into_iter().map(IpAddr::V4).collect();
    let took = wait_dig(&w, "team-b", "api.example.com.", &want, changed)?;
    eprintln!("label removed: team-b's answer flipped {took:?} after the change");
    ensure!(
        took < pace::scaled(FLIP_DEADLINE),
        "flipped back only after {took:?}"
    );
    w.agent
        .wait_metrics("one more good reload", Duration::from_secs(2), |m| {
            delta(&before, m, key::RELOAD_OK) == 1.0
        })?;
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    assert!(is_forward(&v, Some("team-a/api-example")), "{}", v.json);
    let (v, reach) = w.check_connect("team-b", dest)?;
    assert_eq!(
        (v.action, reach),
        (
            OutboundOutcome::Passthrough,
            Reach::server("real-203.0.113.10")
        )
    );

    // The connections opened before both changes are intact: same connection, still exchanging.
    still_holding(&mut passthrough)?;
    still_holding(&mut service)?;
    for h in [&passthrough, &service] {
        assert_eq!(h.log().matches("connected ").count(), 1, "{}", h.log());
    }
    assert_eq!(w.agent.pid(), pid);
    let dump = w.config_dump()?;
    assert_eq!(
        dump["config"]["generation"], 3,
        "first load and two reloads: {dump:#}"
    );
    Ok(())
}

/// One bad change: `source`'s text with `edits` made, written as `file` (`source` itself, or a new
/// file beside it); and where the error must point.
struct Bad {
    name: &'static str,
    source: &'static str,
    file: &'static str,
    edits: &'static [(&'static str, &'static str)],
    object: &'static str,
    field: &'static str,
}

/// Each would also change what clients see if any of it were applied.
const BAD_CHANGES: [Bad; 5] = [
    Bad {
        name: "bad CIDR",
        source: "30-team-a.yaml",
        file: "30-team-a.yaml",
        edits: &[(
            "addresses: [203.0.113.10]",
            "addresses: [203.0.113.11, 203.0.113.0/33]",
        )],
        object: "ServiceEntry team-a/api-example",
        field: "spec.addresses[1]",
    },
    Bad {
        name: "port out of range",
        source: "30-team-a.yaml",
        file: "30-team-a.yaml",
        edits: &[
            ("addresses: [203.0.113.10]", "addresses: [203.0.113.11]"),
            (
                "{number: 80, name: http, protocol: HTTP}",
                "{number: 70000, name: http, protocol: HTTP}",
            ),
        ],
        object: "ServiceEntry team-a/api-example",
        field: "spec.ports[0].number",
    },
    Bad {
        name: "unknown selector operator",
        source: "01-mesh-config.yaml",
        file: "01-mesh-config.yaml",
        edits: &[
            ("defaultVisibility: NAMESPACE", "defaultVisibility: PUBLIC"),
            (
                "                matchLabels:\n                  trusted: \"true\"",
                "                matchExpressions:\n                  - {key: trusted, operator: Within, values: [\"true\"]}",
            ),
        ],
        object: "IstioOperator",
        field: "spec.meshConfig.serviceEntryVisibility.policies[1].matchingRules[0].namespaceSelector.matchExpressions[0].operator",
    },
    Bad {
        // An unknown value is an error, not a silent default (which would be PUBLIC).
        name: "unknown visibility",
        source: "01-mesh-config.yaml",
        file: "01-mesh-config.yaml",
        edits: &[("defaultVisibility: NAMESPACE", "defaultVisibility: PRIVATE")],
        object: "IstioOperator",
        field: "spec.meshConfig.serviceEntryVisibility.defaultVisibility",
    },
    Bad {
        name: "duplicate object",
        source: "30-team-a.yaml",
        file: "35-duplicate.yaml",
        edits: &[("addresses: [203.0.113.10]", "addresses: [203.0.113.11]")],
        object: "ServiceEntry team-a/api-example",
        field: "metadata.name",
    },
];

/// What the last good configuration gives: team-a's own answer and endpoint, team-b the upstream's.
fn old_behaviour_holds(w: &World) -> Result<()> {
    let (v, _) = w.check_dig("team-a", "api.example.com")?;
    ensure!(
        is_answer(&v, "team-a/api-example", "203.0.113.10"),
        "{}",
        v.json
    );
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    ensure!(is_forward(&v, Some("team-a/api-example")), "{}", v.json);
    let (_, reach) = w.check_connect("team-a", addr("203.0.113.10:80"))?;
    ensure!(reach == Reach::server("api-endpoint"), "{reach:?}");
    let ready = w.agent.admin_get("/healthz/ready")?;
    ensure!(
        ready.status == 200,
        "readiness after a refused change: {} {}",
        ready.status,
        ready.text()
    );
    Ok(())
}

/// `redirect resolve -f dir -o json`: exit status and the errors it reports.
fn cli_errors(dir: &Path) -> Result<(Option<i32>, Value)> {
    let out = std::process::Command::new(integration::Agent::bin()?)
        .args(["resolve", "-o", "json", "-f"])
        .arg(dir)
        .output()?;
    let json: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "resolve printed no JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((out.status.code(), json["errors"].clone()))
}

#[test]
fn an_invalid_object_keeps_its_last_good_version_is_reported_and_the_old_behaviour_continues()
-> Result<()> {
    let mut w = World::start_launched(&Launch::no_fast_path())?;
    let dir = w.config_dir().to_path_buf();
    // explain over the last good configuration (it refuses the bad one, as the agent does).
    let good = w.topo.scratch_path("good");
    world::copy_manifests(&dir, &good)?;
    w.explain_over(&good)?;
    old_behaviour_holds(&w)?;

    for bad in &BAD_CHANGES {
        let original = std::fs::read_to_string(dir.join(bad.source))?;
        let mut text = original.clone();
        for (from, to) in bad.edits {
            ensure!(
                text.contains(from),
                "{}: {} lacks {from:?}",
                bad.name,
                bad.source
            );
            text = text.replacen(from, to, 1);
        }
        let before = w.agent.metrics()?;
        let generation = w.config_dump()?["config"]["generation"]
            .as_u64()
            .context("generation")?;
        world::replace_file(&dir, bad.file, &text)?;
        let kind = bad.object.split(' ').next().unwrap_or_default();
        let m = w.agent.wait_metrics(
            &format!("{}: a partial reload", bad.name),
            Duration::from_secs(2),
            |m| delta(&before, m, key::RELOAD_PARTIAL) == 1.0,
        )?;
        assert_eq!(
            m.get_or_zero(&key::rejected(kind)),
            1.0,
            "{}: one {kind} in error",
            bad.name
        );

        // The offline CLI refuses it too, with the same error.
        let (code, cli) = cli_errors(&dir)?;
        assert_eq!(code, Some(1), "{}: resolve must exit 1", bad.name);
        let dump = w.config_dump()?;
        let config = &dump["config"];
        let agent = &config["lastError"]["errors"];
        assert_eq!(
            agent, &cli,
            "{}: agent and CLI report the same errors",
            bad.name
        );
        // The error names file, object and field.
        let [e] = agent.as_array().map(Vec::as_slice).unwrap_or_default() else {
            panic!("{}: one error expected: {dump:#}", bad.name);
        };
        assert!(
            e["file"].as_str().unwrap_or_default().ends_with(bad.file),
            "{}: {e}",
            bad.name
        );
        assert_eq!(e["object"], bad.object, "{}: {e}", bad.name);
        assert_eq!(e["field"], bad.field, "{}: {e}", bad.name);
        // The rest applied; the object in error is listed, at its last good version where it had one.
        assert_eq!(
            config["generation"].as_u64(),
            Some(generation + 1),
            "{}: the valid rest applied",
            bad.name
        );
        let rejected = config["rejected"].as_array().cloned().unwrap_or_default();
        let listed = rejected.iter().find(|r| {
            bad.object.starts_with(r["kind"].as_str().unwrap_or("?"))
                && r["file"].as_str().unwrap_or_default().ends_with(bad.file)
        });
        let listed = listed.with_context(|| format!("{}: not listed: {config:#}", bad.name))?;
        if bad.file == bad.source {
            assert_eq!(
                listed["lastGoodInForce"], true,
                "{}: its last good version stays",
                bad.name
            );
        }
        let log = w.agent.log();
        assert!(
            log.lines().any(|l| l.contains("ERROR")
                && l.contains(bad.file)
                && l.contains(bad.object)
                && l.contains(bad.field)),
            "{}: no ERROR line naming file, object and field in the agent log",
            bad.name
        );

        // Nothing of it is in force.
        old_behaviour_holds(&w).with_context(|| format!("after the refused {}", bad.name))?;

        // Put right: applied again, the error cleared.
        let before = w.agent.metrics()?;
        if bad.file == bad.source {
            world::replace_file(&dir, bad.file, &original)?;
        } else {
            std::fs::remove_file(dir.join(bad.file))?;
        }
        let m = w.agent.wait_metrics(
            &format!("{}: fixed, a good reload", bad.name),
            Duration::from_secs(2),
            |m| delta(&before, m, key::RELOAD_OK) == 1.0,
        )?;
        assert_eq!(m.get_or_zero(&key::rejected(kind)), 0.0, "{}", bad.name);
        let dump = w.config_dump()?;
        assert_eq!(
            dump["config"]["lastError"],
            Value::Null,
            "{}: {dump:#}",
            bad.name
        );
        assert_eq!(
            dump["config"]["rejected"],
            serde_json::json!([]),
            "{}",
            bad.name
        );
    }
    old_behaviour_holds(&w)
}

/// The rule of one object: a change that is good everywhere but in one object applies, and that
/// object keeps its last good version. team-a turns trusted (its entry becomes PUBLIC: team-b now
/// gets the agent's answer) while the same change breaks `api-example`'s new version (a new address
/// and a port out of range): team-b gets the OLD address. Whole refusal would leave team-b on the
/// upstream's answer; applying the broken version would give the new address.
#[test]
fn one_bad_object_among_good_changes_the_good_apply_and_the_bad_keeps_its_last_good_version()
-> Result<()> {
    let w = World::start_launched(&Launch::no_fast_path())?;
    let dir = w.config_dir().to_path_buf();
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    assert!(is_forward(&v, Some("team-a/api-example")), "{}", v.json);
    let before = w.agent.metrics()?;

    world::edit_file(
        &dir,
        "30-team-a.yaml",
        "addresses: [203.0.113.10]",
        "addresses: [203.0.113.11]",
    )?;
    world::edit_file(
        &dir,
        "30-team-a.yaml",
        "{number: 80, name: http, protocol: HTTP}",
        "{number: 70000, name: http, protocol: HTTP}",
    )?;
    trust_team_a(&dir)?;
    let changed = Instant::now();
    let old: IpAddr = "203.0.113.10".parse()?;
    let took = wait_dig(&w, "team-b", "api.example.com.", &[old], changed)?;
    eprintln!("the good change applied {took:?} after it was written");
    ensure!(
        took < pace::scaled(FLIP_DEADLINE),
        "applied only after {took:?}"
    );
    // team-a's own view: the last good version's address, not the broken version's.
    wait_dig(&w, "team-a", "api.example.com.", &[old], Instant::now())?;

    let m = w
        .agent
        .wait_metrics("the object in error counted", Duration::from_secs(2), |m| {
            m.get_or_zero(&key::rejected("ServiceEntry")) == 1.0
        })?;
    ensure!(
        delta(&before, &m, key::RELOAD_FAILED) == 0.0,
        "nothing refused whole"
    );
    let dump = w.config_dump()?;
    let config = &dump["config"];
    let errors = config["lastError"]["errors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let [e] = errors.as_slice() else {
        panic!("one error expected: {config:#}")
    };
    assert_eq!(e["object"], "ServiceEntry team-a/api-example", "{e}");
    assert_eq!(e["field"], "spec.ports[0].number", "{e}");
    assert_eq!(
        config["rejected"],
        serde_json::json!([{"kind": "ServiceEntry", "namespace": "team-a", "name": "api-example",
            "file": e["file"], "lastGoodInForce": true}]),
        "{config:#}"
    );
    let vips: Vec<&Value> = dump["services"]
        .as_array()
        .context("services")?
        .iter()
        .filter(|s| s["name"] == "api-example")
        .map(|s| &s["vips"])
        .collect();
    assert_eq!(
        vips,
        [&serde_json::json!(["203.0.113.10"])],
        "the last good version"
    );
    assert!(
        w.agent.log().lines().any(|l| l.contains("ERROR")
            && l.contains("ServiceEntry team-a/api-example")
            && l.contains("spec.ports[0].number")),
        "a log line per error"
    );
    Ok(())
}

/// Peak resident memory of a process, from /proc (kB).
fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmHWM in /proc/PID/status")
}

/// What the agent may use at its peak with examples/ and these files: the loader's bounds keep one
/// load within a few tens of MiB however hostile the directory.
const MEMORY_BUDGET_KIB: u64 = 128 * 1024;

/// A FIFO, a link to /dev/zero, a 100 MB file the loader ignores and a YAML alias bomb sit in the
/// configuration directory from the start: the agent starts, serves, applies the next good change
/// within a second, and stays within its memory budget.
#[test]
fn hostile_files_in_the_config_directory_change_nothing() -> Result<()> {
    let w = World::start_with(|dir| {
        let fifo = std::ffi::CString::new(dir.join("fifo.yaml").as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid NUL-terminated path.
        ensure!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) } == 0, "mkfifo");
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml"))?;
        // Sparse: 100 MB to whoever reads it, nothing on disk.
        std::fs::File::create(dir.join("backup.tar"))?.set_len(100 << 20)?;
        let mut bomb = String::from(
            "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
        );
        for level in 1..9u8 {
            let (name, prev) = ((b'a' + level) as char, (b'a' + level - 1) as char);
            let refs = vec![format!("*{prev}"); 9].join(",");
            bomb.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        std::fs::write(dir.join("bomb.yaml"), bomb)?;
        Ok(())
    })?;
    let dir = w.config_dir().to_path_buf();
    // Serving: team-a's own entry is answered by the agent, team-b is forwarded.
    let own: IpAddr = "203.0.113.10".parse()?;
    wait_dig(&w, "team-a", "api.example.com.", &[own], Instant::now())?;
    let dump = w.config_dump()?;
    let rejected = dump["config"]["rejected"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let files: Vec<&str> = rejected
        .iter()
        .filter_map(|r| r["file"].as_str()?.rsplit('/').next())
        .collect();
    assert_eq!(files, ["bomb.yaml"], "only the bomb is in error: {dump:#}");

    // The next good change applies within a second.
    trust_team_a(&dir)?;
    let changed = Instant::now();
    let took = wait_dig(&w, "team-b", "api.example.com.", &[own], changed)?;
    eprintln!("good change applied {took:?} after it was written");
    ensure!(
        took < pace::scaled(FLIP_DEADLINE),
        "applied only after {took:?}"
    );

    // A few more polls of the directory, then the peak.
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        w.agent.admin_get("/healthz/ready")?.status == 200,
        "not ready"
    );
    let peak = peak_rss_kib(w.agent.pid())?;
    eprintln!("agent peak RSS: {} MiB", peak / 1024);
    ensure!(
        peak < MEMORY_BUDGET_KIB,
        "peak RSS {peak} kB over the budget"
    );
    Ok(())
}

/// A mesh config written in place and read while empty, or left empty by a full disk, is not a
/// mesh config without the feature: nothing of it applies (team-a's NAMESPACE entry stays hidden
/// from team-b), the last good one stays and the error is reported. A complete document that
/// removes the feature still applies.
#[test]
fn an_empty_mesh_config_is_not_applied_and_a_complete_one_without_the_feature_is() -> Result<()> {
    let mut w = World::start()?;
    let dir = w.config_dir().to_path_buf();
    let mesh = dir.join("01-mesh-config.yaml");
    ensure!(mesh.is_file(), "the world's mesh config moved");
    // explain over the last good configuration (it refuses the empty file, as the agent does).
    let good = w.topo.scratch_path("good");
    world::copy_manifests(&dir, &good)?;
    w.explain_over(&good)?;
    let before = w.agent.metrics()?;
    // Truncated in place, as `>` leaves it before the write (and a full disk after).
    std::fs::File::create(&mesh)?;
    w.agent.wait_metrics(
        "the empty mesh config: a partial reload",
        Duration::from_secs(2),
        |m| delta(&before, m, key::RELOAD_PARTIAL) == 1.0,
    )?;
    old_behaviour_holds(&w).context("after the mesh config was emptied")?;
    let dump = w.config_dump()?;
    let errors = &dump["config"]["lastError"]["errors"];
    ensure!(
        errors.to_string().contains("holds no document"),
        "the error is reported: {dump:#}"
    );

    // A whole document without serviceEntryVisibility: the feature is off, every entry is seen by
    // every namespace, and team-b now gets team-a's entry from the agent.
    let before = w.agent.metrics()?;
    world::replace_file(
        &dir,
        "01-mesh-config.yaml",
        "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec:\n  meshConfig: {}\n",
    )?;
    w.agent.wait_metrics(
        "the complete mesh config: a good reload",
        Duration::from_secs(2),
        |m| delta(&before, m, key::RELOAD_OK) == 1.0,
    )?;
    w.explain_over(&dir)?;
    let (v, _) = w.check_dig("team-b", "api.example.com")?;
    ensure!(
        is_answer(&v, "team-a/api-example", "203.0.113.10"),
        "the feature removed: {}",
        v.json
    );
    Ok(())
}
