//! The control plane: the criterion benches of `state` (run as they are, by name), the agent's
//! resident memory with the 10,000-entry config loaded, and what the agent holds and takes with the
//! config at size (the fast path's tables in the kernel, what it leaves to the proxy).
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::scene::{AtSizeConfig, Relay, Scene, agent_args, start_agent};
use crate::{Built, cmd, synthetic};
use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The criterion bench targets: lookups and state build (bench/benches/state.rs), and
/// pathological configuration refused or loaded (benches/config_bounds.rs).
pub(crate) const BENCHES: [&str; 2] = ["state", "config_bounds"];

/// One criterion benchmark: its median time per iteration and the 95 % interval of that median, ns.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Criterion {
    pub id: String,
    pub median_ns: f64,
    pub lower_ns: f64,
    pub upper_ns: f64,
}

/// The command line that runs the benches (also what the report prints).
pub(crate) fn criterion_command(quick: bool) -> String {
    let mut c = "cargo bench -p bench".to_string();
    for bench in BENCHES {
        c.push_str(&format!(" --bench {bench}"));
    }
    if quick {
        c.push_str(" -- --quick");
    }
    c
}

/// Runs the benches and reads what criterion saved for each.
pub(crate) fn run_criterion(quick: bool, built: &Built) -> Result<Vec<Criterion>> {
    let started = SystemTime::now();
    let mut c = cmd::cargo();
    c.current_dir(&built.workspace)
        .args(["bench", "-p", "bench"])
        .args(BENCHES.iter().flat_map(|b| ["--bench", b]))
        // The same embedded object as `cargo xtask build`: otherwise cargo would rebuild the agent binary
        // in target/release without its eBPF programs.
        .env("REDIRECT_EBPF_OBJECT", &built.ebpf_object);
    if quick {
        c.args(["--", "--quick"]);
    }
    cmd::run(&mut c)?;
    let dir = built.target_dir.join("criterion");
    let mut found = Vec::new();
    collect(&dir, started, &mut found)?;
    if found.is_empty() {
        bail!("criterion saved no results under {}", dir.display());
    }
    found.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(found)
}

/// Every `new/benchmark.json` + `new/estimates.json` pair under `dir` written since `since`.
fn collect(dir: &Path, since: SystemTime, out: &mut Vec<Criterion>) -> Result<()> {
    let entries = fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        if path.file_name().is_some_and(|n| n == "new") {
            let estimates = path.join("estimates.json");
            let fresh = fs::metadata(&estimates)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if fresh {
                out.push(read_result(&path)?);
            }
        } else {
            collect(&path, since, out)?;
        }
    }
    Ok(())
}

fn read_result(new_dir: &Path) -> Result<Criterion> {
    let read = |name: &str| -> Result<serde_json::Value> {
        let p = new_dir.join(name);
        let text = fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    };
    parse_result(&read("benchmark.json")?, &read("estimates.json")?)
        .with_context(|| format!("criterion results in {}", new_dir.display()))
}

fn parse_result(benchmark: &serde_json::Value, estimates: &serde_json::Value) -> Result<Criterion> {
    let num = |pointer: &str| {
        estimates
            .pointer(pointer)
            .and_then(serde_json::Value::as_f64)
            .with_context(|| format!("estimates.json has no {pointer}"))
    };
    Ok(Criterion {
        id: benchmark
            .get("full_id")
            .and_then(|v| v.as_str())
            .context("benchmark.json has no full_id")?
            .to_string(),
        median_ns: num("/median/point_estimate")?,
        lower_ns: num("/median/confidence_interval/lower_bound")?,
        upper_ns: num("/median/confidence_interval/upper_bound")?,
    })
}

/// The agent's memory with the 10,000-entry config loaded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Memory {
    /// VmRSS once ready, KiB.
    pub rss_kib: u64,
    /// VmHWM (peak RSS) once ready, KiB: loading the config included.
    pub peak_kib: u64,
    /// From start to `/healthz/ready`: loading, resolving and building the state, attaching.
    pub ready: Duration,
    pub services: usize,
}

/// Starts the agent in the scene with the big config (agent otherwise detached), reads its memory,
/// and checks it really loaded every entry.
pub(crate) fn agent_memory(scene: &Scene) -> Result<Memory> {
    let dir: PathBuf = scene.topo().scratch_path("big-config");
    fs::create_dir_all(&dir)?;
    fs::write(
        dir.join("entries.yaml"),
        synthetic::large_mesh_yaml(synthetic::NAMESPACES, synthetic::ENTRIES),
    )?;
    let config = dir.to_string_lossy().into_owned();
    let started = Instant::now();
    let agent = start_agent(
        scene.topo(),
        &agent_args(&config, Relay::Splice),
        scene.agent_cpu(),
    )?;
    let ready = started.elapsed();
    // Let the allocator settle after the build (freed parse buffers).
    std::thread::sleep(Duration::from_millis(500));
    let status = fs::read_to_string(format!("/proc/{}/status", agent.pid()))?;
    let rss_kib = status_kib(&status, "VmRSS:")?;
    let peak_kib = status_kib(&status, "VmHWM:")?;
    // Only now (the dump itself allocates): every entry must be in the agent's state.
    let dump = agent.admin_get("/config_dump")?;
    let dump: serde_json::Value =
        serde_json::from_slice(&dump.body).context("parsing /config_dump")?;
    let services = dump
        .pointer("/services")
        .and_then(|s| s.as_array())
        .map_or(0, Vec::len);
    if services < synthetic::ENTRIES {
        bail!(
            "the agent holds {services} services, expected {} from the big config",
            synthetic::ENTRIES
        );
    }
    agent.stop()?;
    Ok(Memory {
        rss_kib,
        peak_kib,
        ready,
        services,
    })
}

/// The agent with the config at size, as it runs by default (the fast path): what it holds, what
/// it takes, and what its fast path leaves to the proxy.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AtSize {
    /// The cluster's files beside `bench.yaml`, and every file's bytes together.
    pub files: usize,
    pub bytes: u64,
    /// From start to `/healthz/ready`.
    pub ready: Duration,
    /// VmRSS and VmHWM once ready, KiB.
    pub rss_kib: u64,
    pub peak_kib: u64,
    /// Services and workloads in its state (`/config_dump`).
    pub services: usize,
    pub workloads: usize,
    pub fast_path: FastPathFigures,
}

/// `fastPath` of `/config_dump`: its tables' memory (both generations) and its fallbacks.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct FastPathFigures {
    pub tables: Vec<TableFigures>,
    /// `memoryBudgetBytes` (`run --fast-path-memory`).
    pub budget_bytes: Option<u64>,
    /// What the tables leave to the proxy, by reason.
    pub fallbacks: BTreeMap<String, u64>,
}

/// One table of `fastPath.memory`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TableFigures {
    pub table: String,
    pub entries: u64,
    pub capacity: u64,
    /// `kernelBytes` where the kernel says, else the agent's `estimatedBytes`.
    pub bytes: u64,
    pub from_kernel: bool,
}

impl FastPathFigures {
    /// Every table's bytes together.
    pub(crate) fn bytes(&self) -> u64 {
        self.tables.iter().map(|t| t.bytes).sum()
    }

    /// From a `/config_dump`.
    pub(crate) fn from_dump(dump: &Value) -> Result<FastPathFigures> {
        let fast = dump
            .get("fastPath")
            .context("/config_dump has no fastPath")?;
        if fast.get("enabled").and_then(Value::as_bool) != Some(true) {
            bail!("the agent's fast path is off: {fast}");
        }
        let memory = fast
            .get("memory")
            .and_then(Value::as_object)
            .context("/config_dump has no fastPath.memory: no tables in force")?;
        let num = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64);
        let mut tables = Vec::new();
        for (table, m) in memory {
            let kernel = num(m, "kernelBytes");
            let bytes = kernel
                .or_else(|| num(m, "estimatedBytes"))
                .with_context(|| format!("fastPath.memory.{table} has no bytes: {m}"))?;
            tables.push(TableFigures {
                table: table.clone(),
                entries: num(m, "entries").unwrap_or(0),
                capacity: num(m, "capacity").unwrap_or(0),
                bytes,
                from_kernel: kernel.is_some(),
            });
        }
        let fallbacks = fast
            .get("fallbacks")
            .and_then(Value::as_object)
            .map(|f| {
                f.iter()
                    .map(|(why, n)| (why.clone(), n.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default();
        Ok(FastPathFigures {
            tables,
            budget_bytes: num(fast, "memoryBudgetBytes"),
            fallbacks,
        })
    }
}

/// Starts the agent on the config at size (agent otherwise detached), reads its memory and its
/// `/config_dump`, and checks it holds every entry and pod.
pub(crate) fn agent_at_size(scene: &Scene, config: &AtSizeConfig) -> Result<AtSize> {
    let size = synthetic::AT_SIZE;
    let started = Instant::now();
    let agent = scene.start_agent_at_size(config)?;
    let ready = started.elapsed();
    // Let the allocator settle after the build, and the fast path's second generation catch up.
    std::thread::sleep(Duration::from_millis(500));
    let status = fs::read_to_string(format!("/proc/{}/status", agent.pid()))?;
    let rss_kib = status_kib(&status, "VmRSS:")?;
    let peak_kib = status_kib(&status, "VmHWM:")?;
    // Only now (the dump itself allocates). Tens of MB of JSON at this size: more time than the
    // harness's admin client gives.
    let node = scene.topo().node().netns.clone();
    let admin = integration::ADMIN_ADDR.parse()?;
    let dump = integration::netns::in_netns(&node, || {
        redirect_userspace::admin_client::get(admin, "/config_dump", Duration::from_secs(60))
    })??;
    if !dump.is_success() {
        bail!("/config_dump answered {}: {}", dump.status, dump.text());
    }
    let dump: Value = serde_json::from_slice(&dump.body).context("parsing /config_dump")?;
    let count = |key: &str| dump.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    let (services, workloads) = (count("services"), count("workloads"));
    // The bench's own two entries and its client beside the cluster's.
    if services < size.entries + 2 || workloads < size.pods + 1 {
        bail!(
            "the agent at size holds {services} services and {workloads} workloads, expected {} and {}",
            size.entries + 2,
            size.pods + 1
        );
    }
    let fast_path = FastPathFigures::from_dump(&dump)?;
    agent.stop()?;
    Ok(AtSize {
        files: config.files,
        bytes: config.bytes,
        ready,
        rss_kib,
        peak_kib,
        services,
        workloads,
        fast_path,
    })
}

/// `VmRSS:     12345 kB` -> 12345
fn status_kib(status: &str, field: &str) -> Result<u64> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .with_context(|| format!("/proc/PID/status has no {field}"))?;
    let n = line.split_whitespace().next().unwrap_or("");
    n.parse()
        .with_context(|| format!("/proc/PID/status {field} {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_criterion_median_and_interval() {
        let benchmark = serde_json::json!({"group_id": "by_ip", "function_id": "own_namespace_service",
            "full_id": "by_ip/own_namespace_service"});
        let estimates = serde_json::json!({
            "mean": {"point_estimate": 50.0, "standard_error": 1.0,
                     "confidence_interval": {"confidence_level": 0.95, "lower_bound": 49.0, "upper_bound": 51.0}},
            "median": {"point_estimate": 48.5, "standard_error": 1.0,
                     "confidence_interval": {"confidence_level": 0.95, "lower_bound": 48.0, "upper_bound": 49.25}}
        });
        assert_eq!(
            parse_result(&benchmark, &estimates).unwrap(),
            Criterion {
                id: "by_ip/own_namespace_service".into(),
                median_ns: 48.5,
                lower_ns: 48.0,
                upper_ns: 49.25
            }
        );
        assert!(parse_result(&serde_json::json!({}), &estimates).is_err());
    }

    #[test]
    fn reads_the_fast_path_memory_and_fallbacks() {
        let dump = serde_json::json!({"services": [], "fastPath": {"enabled": true,
            "tables": {"exact": 20002},
            "fallbacks": {"namespace_full": 2, "hides_uncounted": 64},
            "memory": {
                "exact": {"entries": 40004, "capacity": 65536, "estimatedBytes": 5000000, "kernelBytes": 6000000},
                "workloads": {"entries": 200002, "capacity": 262144, "estimatedBytes": 17000000}
            },
            "memoryBudgetBytes": 67108864, "services": []}});
        let f = FastPathFigures::from_dump(&dump).unwrap();
        assert_eq!(
            f.bytes(),
            23_000_000,
            "the kernel's figure where it has one"
        );
        assert_eq!(f.budget_bytes, Some(64 << 20));
        assert_eq!(
            f.tables[1],
            TableFigures {
                table: "workloads".into(),
                entries: 200002,
                capacity: 262144,
                bytes: 17000000,
                from_kernel: false
            }
        );
        assert!(f.tables[0].from_kernel);
        assert_eq!(f.fallbacks.get("namespace_full"), Some(&2));
        let off = serde_json::json!({"fastPath": {"enabled": false}});
        assert!(FastPathFigures::from_dump(&off).is_err());
        let none = serde_json::json!({"fastPath": {"enabled": true}});
        assert!(FastPathFigures::from_dump(&none).is_err());
    }

    #[test]
    fn reads_status_fields() {
        let status = "Name:\tredirect\nVmHWM:\t   40960 kB\nVmRSS:\t   30720 kB\n";
        assert_eq!(status_kib(status, "VmRSS:").unwrap(), 30720);
        assert_eq!(status_kib(status, "VmHWM:").unwrap(), 40960);
        assert!(status_kib(status, "VmSwap:").is_err());
    }
}
