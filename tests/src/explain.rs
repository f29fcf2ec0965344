//! `redirect explain -o json` run offline over a manifest directory, read into the parts a scenario
//! needs. The scenarios build what they expect of the agent from these answers, so the agent and the CLI
//! (which share the state lookups) are held to the same outcome.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
pub use redirect_userspace::model::OutboundOutcome;
pub use redirect_userspace::report::{DecidedBy, DnsAction};
use redirect_userspace::report::{DnsReport, HostExplanation, IpExplanation, OutboundReport};
use serde_json::Value;

use crate::Agent;

/// What `explain --host` says the DNS proxy does: its report (read through, `verdict.action`), and
/// the JSON it came from.
#[derive(Clone, Debug)]
pub struct DnsVerdict {
    pub report: DnsReport,
    pub json: Value,
}

/// What `explain --ip` says the outbound proxy does (and who decides with the fast path), and the
/// JSON it came from.
#[derive(Clone, Debug)]
pub struct OutboundVerdict {
    pub report: OutboundReport,
    pub json: Value,
}

impl std::ops::Deref for DnsVerdict {
    type Target = DnsReport;

    fn deref(&self) -> &DnsReport {
        &self.report
    }
}

impl std::ops::Deref for OutboundVerdict {
    type Target = OutboundReport;

    fn deref(&self) -> &OutboundReport {
        &self.report
    }
}

/// `redirect explain` over one manifest directory (read afresh on every call, so it follows edits).
#[derive(Clone, Debug)]
pub struct Explain {
    bin: PathBuf,
    dir: PathBuf,
}

impl Explain {
    /// Uses the agent binary under test ([`Agent::bin`]): the CLI and the agent are one binary.
    pub fn new(dir: &Path) -> Result<Explain> {
        Ok(Explain {
            bin: Agent::bin()?,
            dir: dir.to_path_buf(),
        })
    }

    /// `explain --from <from> --host <host>`: `host` as the application asks for it (a trailing dot
    /// makes it absolute, as dig sends it; without one the search domains apply, as for glibc).
    pub fn host(&self, from: &str, host: &str) -> Result<DnsVerdict> {
        let json = self.run(from, "--host", host)?;
        let dns = serde_json::from_value::<HostExplanation>(json.clone())
            .with_context(|| format!("explain --host {host}: unexpected shape: {json}"))?
            .dns;
        Ok(DnsVerdict { report: dns, json })
    }

    /// `explain --from <from> --ip <dest>`.
    pub fn ip(&self, from: &str, dest: SocketAddr) -> Result<OutboundVerdict> {
        let json = self.run(from, "--ip", &dest.to_string())?;
        let out = serde_json::from_value::<IpExplanation>(json.clone())
            .with_context(|| format!("explain --ip {dest}: unexpected shape: {json}"))?
            .outbound;
        Ok(OutboundVerdict { report: out, json })
    }

    /// `explain --from <pod> --ip <dest>` for a client Pod `pod` (`namespace/name`): the identity
    /// explain matches the policies with is that Pod's. Fails unless explain answered for that Pod.
    pub fn ip_from_pod(&self, pod: &str, dest: SocketAddr) -> Result<OutboundVerdict> {
        let json = self.exec(pod, "--ip", &dest.to_string())?;
        if json["client"]["pod"] != pod {
            bail!("explain answered for another client than Pod {pod}: {json}");
        }
        let out = serde_json::from_value::<IpExplanation>(json.clone())
            .with_context(|| format!("explain --ip {dest}: unexpected shape: {json}"))?
            .outbound;
        Ok(OutboundVerdict { report: out, json })
    }

    fn run(&self, from: &str, flag: &str, what: &str) -> Result<Value> {
        let json = self.exec(from, flag, what)?;
        if json["client"]["namespace"] != from {
            bail!("explain answered for another client: {json}");
        }
        Ok(json)
    }

    /// Runs explain and reads its JSON, whoever it answered for.
    fn exec(&self, from: &str, flag: &str, what: &str) -> Result<Value> {
        let out = Command::new(&self.bin)
            .arg("explain")
            .arg("-f")
            .arg(&self.dir)
            .args(["--from", from, flag, what, "-o", "json"])
            .output()
            .with_context(|| format!("running {}", self.bin.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "redirect explain --from {from} {flag} {what} exited with {}: {}{}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let json: Value = serde_json::from_str(&stdout)
            .with_context(|| format!("explain printed no JSON: {stdout}"))?;
        Ok(json)
    }
}
