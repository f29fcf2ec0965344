//! A real upstream resolver: dnsmasq in the ext netns, answering only the records a test gives it and
//! NXDOMAIN for every other name. It can be stopped and started again (upstream-failure tests).
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::exec::Place;
use crate::proc::Proc;
use crate::procfs::{self, Proto};

const DEFAULT_BIN: &str = "/usr/sbin/dnsmasq";

/// dnsmasq as a bare upstream: in the foreground, no config file, no `/etc/resolv.conf` or
/// `/etc/hosts`, bound only to the addresses given, logging to stderr, and NXDOMAIN for every name no
/// record names (more specific records win over `#`). Add `--listen-address` and the records.
pub const BASE_ARGS: [&str; 10] = [
    "--keep-in-foreground",
    "--conf-file=/dev/null",
    "--no-resolv",
    "--no-hosts",
    "--bind-interfaces",
    "--port=53",
    "--user=root",
    "--pid-file=",
    "--log-facility=-",
    "--address=/#/",
];

/// The answers dnsmasq holds (turned into its own command-line options).
#[derive(Clone, Debug, Default)]
pub struct DnsRecords {
    args: Vec<String>,
}

impl DnsRecords {
    pub fn new() -> DnsRecords {
        DnsRecords::default()
    }
    /// `name` (exactly) has address `ip` (A or AAAA), with the matching PTR.
    pub fn host(mut self, name: &str, ip: IpAddr) -> Self {
        self.args.push(format!("--host-record={name},{ip}"));
        self
    }
    /// As [`DnsRecords::host`], answered with this TTL (dnsmasq's own records have TTL 0 otherwise).
    pub fn host_ttl(mut self, name: &str, ip: IpAddr, ttl: u32) -> Self {
        self.args.push(format!("--host-record={name},{ip},{ttl}"));
        self
    }
    /// `domain` and every name below it answer `ip`.
    pub fn domain(mut self, domain: &str, ip: IpAddr) -> Self {
        self.args.push(format!("--address=/{domain}/{ip}"));
        self
    }
    /// Any other dnsmasq option, verbatim.
    pub fn raw(mut self, option: &str) -> Self {
        self.args.push(option.to_string());
        self
    }
}

/// A dnsmasq process (while started); killed on drop.
pub struct Dnsmasq {
    place: Place,
    listen: Vec<IpAddr>,
    records: DnsRecords,
    proc: Option<Proc>,
}

impl Dnsmasq {
    /// Starts dnsmasq in `place` on each of `listen`:53 (UDP and TCP); they must be addresses of that
    /// netns.
    pub fn start(place: &Place, listen: &[IpAddr], records: DnsRecords) -> Result<Dnsmasq> {
        if listen.is_empty() {
            bail!("dnsmasq: no address to listen on");
        }
        let mut d = Dnsmasq {
            place: place.clone(),
            listen: listen.to_vec(),
            records,
            proc: None,
        };
        d.start_again()?;
        Ok(d)
    }

    fn bin() -> Result<PathBuf> {
        let bin = std::env::var_os("DNSMASQ_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN));
        if !bin.is_file() {
            bail!(
                "{} not found: install Debian package dnsmasq-base (`cargo xtask setup` does)",
                bin.display()
            );
        }
        Ok(bin)
    }

    /// Starts it again after [`Dnsmasq::stop`], with the same records; waits until it is listening.
    pub fn start_again(&mut self) -> Result<()> {
        if self.proc.as_mut().is_some_and(|p| p.is_running()) {
            bail!("dnsmasq on {} is already running", self.addr());
        }
        let mut proc = self
            .place
            .cmd(Self::bin()?)
            .args(BASE_ARGS)
            // The tests read which queries reached the upstream.
            .arg("--log-queries")
            .args(
                self.listen
                    .iter()
                    .map(|ip| format!("--listen-address={ip}")),
            )
            .args(&self.records.args)
            .spawn()?;
        let pid = proc.pid();
        let addr: Vec<SocketAddr> = self.listen.iter().map(|&ip| (ip, 53).into()).collect();
        let ready = procfs::wait_bound(pid, Proto::Udp, &addr, Duration::from_secs(10), || {
            proc.is_running()
        })
        .and_then(|()| {
            procfs::wait_bound(pid, Proto::Tcp, &addr, Duration::from_secs(10), || {
                proc.is_running()
            })
        });
        ready.with_context(|| format!("dnsmasq in {}; log:\n{}", self.place.label, proc.log()))?;
        self.proc = Some(proc);
        Ok(())
    }

    /// Stops it and starts it again answering `records` instead (the upstream's answers change).
    pub fn restart_with(&mut self, records: DnsRecords) -> Result<()> {
        self.stop()?;
        self.records = records;
        self.start_again()
    }

    /// Stops it (SIGTERM); queries to it then go unanswered.
    pub fn stop(&mut self) -> Result<()> {
        let mut proc = self.proc.take().context("dnsmasq is not running")?;
        proc.terminate(Duration::from_secs(5))?;
        Ok(())
    }

    /// Its first address, port 53.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.listen[0], 53)
    }

    /// What dnsmasq logged (each query and its answer) since it was last started.
    pub fn log(&self) -> String {
        self.proc.as_ref().map(|p| p.log()).unwrap_or_default()
    }
}
