//! The cluster as the source (`run --kube`) at scale: `tests/src/bin/kube_scale.rs` run as its own
//! release binary (the rebuild it times must be optimised code, not xtask's), its figures read back
//! from the JSON it writes and judged against their targets. Its section of BENCHMARKS.md sits between
//! two markers, so this phase can run alone (`cargo xtask bench --kube`) and replace only its part.
use std::fmt::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{Built, cmd};

const BEGIN: &str =
    "<!-- kube-scale: written by `cargo xtask bench --kube`, kept by other runs -->";
const END: &str = "<!-- kube-scale end -->";
/// The section's heading, the line it is put before when the file has none yet.
const HEADING: &str = "## 6. The cluster as the source (`run --kube`) at scale";
const BEFORE: &str = "\n## Targets";

/// The two clusters measured: the size the agent was first measured at, and ten times its Pods.
pub(crate) const SIZES: [Size; 2] = [
    Size {
        namespaces: 1_000,
        pods: 10_000,
        entries: 10_000,
        node_pods: 110,
    },
    Size {
        namespaces: 2_000,
        pods: 100_000,
        entries: 20_000,
        node_pods: 110,
    },
];

/// A cluster's size, as `kube_scale`'s flags take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Size {
    pub namespaces: u64,
    pub pods: u64,
    pub entries: u64,
    /// Pods on the agent's node.
    pub node_pods: u64,
}

impl Size {
    pub(crate) fn args(&self) -> Vec<String> {
        vec![
            format!("--namespaces={}", self.namespaces),
            format!("--pods={}", self.pods),
            format!("--entries={}", self.entries),
            format!("--node-pods={}", self.node_pods),
        ]
    }
}

/// What `kube_scale --json` reports.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KubeScale {
    pub namespaces: u64,
    pub pods: u64,
    pub entries: u64,
    pub node_pods: u64,
    pub services: u64,
    /// The median of a few starts, and (when given) the fastest and slowest.
    pub ready_s: f64,
    pub ready_range_s: Option<(f64, f64)>,
    pub ready_target_s: f64,
    pub rss_mib: f64,
    pub rss_after_burst_mib: f64,
    pub rss_target_mib: f64,
    pub rebuild_ms: f64,
    /// The same rebuild on the thread's CPU clock (less stretched by a busy machine).
    pub rebuild_cpu_ms: Option<f64>,
    pub model_ms: f64,
    pub rebuild_target_ms: f64,
    /// One Pod on another node moved, then one ServiceEntry: each until in force.
    pub one_pod_ms: f64,
    pub one_entry_ms: f64,
    pub one_change_target_ms: f64,
    pub burst: u64,
    pub burst_ms: f64,
    pub burst_target_ms: f64,
}

impl KubeScale {
    pub(crate) fn from_json(v: &Value) -> Result<KubeScale> {
        let f = |key: &str| {
            v[key]
                .as_f64()
                .with_context(|| format!("kube_scale's JSON has no number {key}: {v}"))
        };
        let n = |key: &str| f(key).map(|x| x as u64);
        Ok(KubeScale {
            namespaces: n("namespaces")?,
            pods: n("pods")?,
            entries: n("entries")?,
            node_pods: n("node_pods")?,
            services: n("services")?,
            ready_s: f("ready_s")?,
            ready_range_s: v["ready_min_s"].as_f64().zip(v["ready_max_s"].as_f64()),
            ready_target_s: f("ready_target_s")?,
            rss_mib: f("rss_mib")?,
            rss_after_burst_mib: f("rss_after_burst_mib")?,
            rss_target_mib: f("rss_target_mib")?,
            rebuild_ms: f("rebuild_ms")?,
            rebuild_cpu_ms: v["rebuild_cpu_ms"].as_f64(),
            model_ms: f("model_ms")?,
            rebuild_target_ms: f("rebuild_target_ms")?,
            one_pod_ms: f("one_pod_ms")?,
            one_entry_ms: f("one_entry_ms")?,
            one_change_target_ms: f("one_change_target_ms")?,
            burst: n("burst")?,
            burst_ms: f("burst_ms")?,
            burst_target_ms: f("burst_target_ms")?,
        })
    }

    /// (what, target, measured, met) for each target.
    pub(crate) fn verdicts(&self) -> Vec<(&'static str, String, String, bool)> {
        vec![
            (
                "agent RSS, everything held",
                format!("≤ {} MiB", self.rss_target_mib),
                format!(
                    "{:.1} MiB ({:.1} MiB right after the burst)",
                    self.rss_mib, self.rss_after_burst_mib
                ),
                self.rss_mib <= self.rss_target_mib,
            ),
            (
                "ready after start",
                format!("≤ {} s", self.ready_target_s),
                match self.ready_range_s {
                    Some((min, max)) => {
                        format!(
                            "{:.2} s (median of starts from {min:.2} to {max:.2} s)",
                            self.ready_s
                        )
                    }
                    None => format!("{:.2} s", self.ready_s),
                },
                self.ready_s <= self.ready_target_s,
            ),
            (
                "one snapshot rebuild",
                format!("≤ {} ms", self.rebuild_target_ms),
                format!(
                    "{:.1} ms{} (of which {:.1} ms the store's model)",
                    self.rebuild_ms,
                    self.rebuild_cpu_ms
                        .map_or(String::new(), |cpu| format!(", {cpu:.1} ms of CPU")),
                    self.model_ms
                ),
                self.rebuild_ms <= self.rebuild_target_ms,
            ),
            (
                "one pod change elsewhere in force",
                format!("≤ {} ms", self.one_change_target_ms),
                format!("{:.0} ms", self.one_pod_ms),
                self.one_pod_ms <= self.one_change_target_ms,
            ),
            (
                "one ServiceEntry change in force",
                format!("≤ {} ms", self.one_change_target_ms),
                format!("{:.0} ms", self.one_entry_ms),
                self.one_entry_ms <= self.one_change_target_ms,
            ),
            (
                "a burst of pod changes in force",
                format!("{} changes ≤ {} ms", self.burst, self.burst_target_ms),
                format!("{:.0} ms", self.burst_ms),
                self.burst_ms <= self.burst_target_ms,
            ),
        ]
    }

    fn cluster(&self) -> String {
        format!(
            "{} namespaces, {} pods ({} on the node), {} ServiceEntries",
            self.namespaces, self.pods, self.node_pods, self.entries
        )
    }
}

/// The section for every size measured, markers included; `load` is the load average when it ran.
pub(crate) fn section(sizes: &[KubeScale], date: &str, load: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{BEGIN}\n{HEADING}\n");
    let _ = writeln!(
        s,
        "The real agent (`run --kube --node-name node-0`) watching the test API server in a node netns \
         (`tests/src/bin/kube_scale.rs`), which serves the objects with the fields a real API server \
         sends; the node's Pods are its clients, the other Pods are spread over 19 other nodes. Run on \
         {date}, load average {load}: the machine is shared, so times are high by a factor this run does \
         not isolate. Reproduce with `sudo cargo xtask bench --kube`.\n"
    );
    for figures in sizes {
        let _ = writeln!(
            s,
            "**{}** ({} services in the agent's state)\n",
            figures.cluster(),
            figures.services
        );
        s.push_str("| | target | measured | |\n| --- | --- | --- | --- |\n");
        for (what, target, measured, met) in figures.verdicts() {
            let mark = if met { "met" } else { "**missed**" };
            let _ = writeln!(s, "| {what} | {target} | {measured} | {mark} |");
        }
        s.push('\n');
    }
    let _ = writeln!(s, "{END}");
    s
}

/// `existing` with its kube section replaced by `section`, or `section` put before the targets
/// (else at the end) when it has none.
pub(crate) fn splice(existing: &str, section: &str) -> String {
    if let (Some(begin), Some(end)) = (existing.find(BEGIN), existing.find(END))
        && begin < end
    {
        let rest = &existing[end + END.len()..];
        let rest = rest.strip_prefix('\n').unwrap_or(rest);
        return format!("{}{section}{rest}", &existing[..begin]);
    }
    match existing.find(BEFORE) {
        Some(at) => format!("{}\n{section}{}", &existing[..at], &existing[at..]),
        None => format!("{}\n{section}", existing.trim_end()),
    }
}

/// The kept section of an earlier run, markers included, to put back into a regenerated file.
pub(crate) fn kept_section(existing: &str) -> Option<String> {
    let begin = existing.find(BEGIN)?;
    let end = existing[begin..].find(END)? + begin + END.len();
    Some(format!("{}\n", &existing[begin..end]))
}

/// Builds `kube_scale` and runs it at each of [`SIZES`], returning what it measured.
pub(crate) fn measure(built: &Built) -> Result<Vec<KubeScale>> {
    cmd::run(
        cmd::cargo()
            .current_dir(&built.workspace)
            .args(["build", "--release", "-p", "tests", "--bin", "kube_scale"])
            // The same embedded object as `cargo xtask build`, so the agent binary stays whole.
            .env("REDIRECT_EBPF_OBJECT", &built.ebpf_object),
    )?;
    let json = built.target_dir.join("kube-scale.json");
    let mut figures = Vec::new();
    for size in SIZES {
        let _ = std::fs::remove_file(&json);
        let mut run = std::process::Command::new(built.target_dir.join("release/kube_scale"));
        run.args(size.args())
            .arg("--json")
            .arg(&json)
            .env("REDIRECT_BIN", built.target_dir.join("release/redirect"));
        // The harness waits 20 s for an agent to be ready; the first list of 100,000 Pods can take
        // about that on a busy machine. Ready is measured, not bounded, here.
        if std::env::var_os("RDT_TIME_SCALE").is_none() {
            run.env("RDT_TIME_SCALE", "6");
        }
        cmd::run(&mut run)?;
        figures.push(read(&json)?);
    }
    Ok(figures)
}

fn read(path: &Path) -> Result<KubeScale> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    KubeScale::from_json(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(rss: f64) -> KubeScale {
        KubeScale {
            namespaces: 1000,
            pods: 10000,
            entries: 10000,
            node_pods: 110,
            services: 10000,
            ready_s: 2.0,
            ready_range_s: None,
            ready_target_s: 5.0,
            rss_mib: rss,
            rss_after_burst_mib: rss + 4.0,
            rss_target_mib: 64.0,
            rebuild_ms: 40.0,
            rebuild_cpu_ms: Some(38.0),
            model_ms: 1.0,
            rebuild_target_ms: 50.0,
            one_pod_ms: 20.0,
            one_entry_ms: 30.0,
            one_change_target_ms: 100.0,
            burst: 1000,
            burst_ms: 600.0,
            burst_target_ms: 1000.0,
        }
    }

    #[test]
    fn targets_are_judged_met_or_missed() {
        let met: Vec<bool> = figures(60.0).verdicts().iter().map(|v| v.3).collect();
        assert_eq!(met, [true; 6]);
        let met: Vec<bool> = figures(120.0).verdicts().iter().map(|v| v.3).collect();
        assert_eq!(met, [false, true, true, true, true, true]);
        assert!(section(&[figures(120.0)], "d", "1").contains("| **missed** |"));
    }

    #[test]
    fn the_section_goes_before_the_targets_then_is_replaced_in_place() {
        let file = "# Benchmarks\n\n## 5. Control plane\n\nx\n\n## Targets\n\ny\n";
        let once = splice(file, &section(&[figures(120.0)], "d", "1"));
        assert!(once.find(HEADING).unwrap() < once.find("## Targets").unwrap());
        assert!(once.contains("120.0 MiB"));
        let both = [figures(60.0), figures(90.0)];
        let twice = splice(&once, &section(&both, "d", "1"));
        assert_eq!(twice.matches(HEADING).count(), 1);
        assert!(
            twice.contains("90.0 MiB")
                && twice.contains("60.0 MiB")
                && !twice.contains("120.0 MiB")
        );
        assert!(twice.ends_with("## Targets\n\ny\n"), "{twice}");
        assert_eq!(
            kept_section(&twice).as_deref(),
            Some(section(&both, "d", "1").as_str())
        );
    }

    #[test]
    fn reads_what_kube_scale_writes() {
        let v = serde_json::json!({"namespaces": 1000, "pods": 10000, "entries": 10000, "node_pods": 110,
            "services": 10000, "ready_s": 2.0, "ready_target_s": 5.0, "rss_mib": 90.0,
            "rss_after_burst_mib": 94.0, "rss_target_mib": 64.0, "rebuild_ms": 40.0, "rebuild_cpu_ms": 38.0,
            "model_ms": 1.0, "rebuild_target_ms": 50.0, "one_pod_ms": 20.0, "one_entry_ms": 30.0,
            "one_change_target_ms": 100.0, "burst": 1000, "burst_ms": 600.0, "burst_target_ms": 1000.0});
        assert_eq!(KubeScale::from_json(&v).unwrap(), figures(90.0));
        assert!(KubeScale::from_json(&serde_json::json!({"pods": 1})).is_err());
    }

    #[test]
    fn each_size_is_passed_as_flags() {
        assert_eq!(
            SIZES[1].args(),
            [
                "--namespaces=2000",
                "--pods=100000",
                "--entries=20000",
                "--node-pods=110"
            ]
        );
    }
}
