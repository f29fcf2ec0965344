//! The machine a run happened on, for the report.
use std::fs;
use std::process::Command;

use crate::cmd::output;

/// Debian packages of the measuring tools (their versions go in the report).
const TOOLS: &[&str] = &["iperf3", "sockperf", "wrk", "dnsperf", "dnsmasq-base"];

#[derive(Clone, Debug)]
pub(crate) struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub kernel: String,
    /// UTC, `YYYY-MM-DD HH:MM`.
    pub date: String,
    pub load_before: String,
    pub load_after: String,
    pub tools: Vec<String>,
}

impl Machine {
    pub(crate) fn probe() -> Machine {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_string(), |(_, v)| v.trim().to_string());
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| "unknown".to_string(), |s| s.trim().to_string());
        let date = output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
            .map_or_else(|| "unknown".to_string(), |s| s.trim().to_string());
        let tools = output(
            Command::new("dpkg-query")
                .args(["-W", "-f", "${Package} ${Version}\\n"])
                .args(TOOLS),
        )
        .map(|s| s.lines().map(str::to_string).collect())
        .unwrap_or_default();
        Machine {
            cpu,
            cores,
            kernel,
            date,
            load_before: load_average(),
            load_after: String::new(),
            tools,
        }
    }

    /// Notes the load when the measuring is over.
    pub(crate) fn finish(&mut self) {
        self.load_after = load_average();
    }
}

/// The 1, 5 and 15 minute load averages.
pub(crate) fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The CPU time process `pid` has used so far (user and system, every thread), in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name (in parentheses, which may hold spaces) come fields 3 on; utime and
    // stime are the 14th and 15th, in clock ticks.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: no command name"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |field: usize| -> anyhow::Result<f64> {
        let text = fields.get(field - 3).copied().unwrap_or("");
        Ok(text.parse::<u64>()? as f64)
    };
    // SAFETY: sysconf reads a constant of the system; no memory is involved.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(14)? + ticks(15)?) / per_second.max(1.0))
}
