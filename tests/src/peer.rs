//! `rdt-peer`, the helper binary of this crate, run in ext or in a pod: identity HTTP + TCP echo servers
//! (`serve`), and the clients curl and dig cannot be (`getpeername`, `echo`, `fanout`, `hold`,
//! `dns-unconnected`).
use std::net::{SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::exec::{Cmd, Place};
use crate::proc::Proc;
use crate::procfs::{self, Proto};

/// Path of the `rdt-peer` binary: `$RDT_PEER_BIN`, else next to the running test binary (cargo puts
/// test executables in `target/<profile>/deps` and the package's binaries one level up).
pub fn bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("RDT_PEER_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating the test binary")?;
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join("rdt-peer"))
        .collect();
    candidates.iter().find(|p| p.is_file()).cloned().with_context(|| {
        format!("rdt-peer not found at {candidates:?}: build it with `cargo build -p tests --bins` (cargo test does)")
    })
}

/// `rdt-peer ARGS...` to run in `place`.
pub fn cmd(place: &Place) -> Result<Cmd> {
    Ok(place.cmd(bin()?))
}

/// What `rdt-peer mix` reported when told to stop: requests that worked, that failed, over how
/// long, and its whole log (with the failures).
pub struct MixReport {
    pub ok: u64,
    pub failed: u64,
    pub secs: f64,
    pub text: String,
}

/// Stops a running `rdt-peer mix` and reads its summary line (`done ok=N failed=N secs=S ...`).
pub fn stop_mix(mut mix: Proc) -> Result<MixReport> {
    mix.write_stdin(b"stop\n")?;
    let _ = mix.wait(crate::pace::scaled(Duration::from_secs(30)))?;
    let text = mix.log();
    let done = text
        .lines()
        .find_map(|l| l.strip_prefix("done "))
        .with_context(|| format!("no summary from the client loop:\n{text}"))?;
    let field = |name: &str| -> Result<f64> {
        done.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .with_context(|| format!("no {name} in {done:?}"))?
            .parse()
            .context(name.to_string())
    };
    Ok(MixReport {
        ok: field("ok")? as u64,
        failed: field("failed")? as u64,
        secs: field("secs")?,
        text,
    })
}

/// A running `rdt-peer serve`: killed on drop.
pub struct Peer {
    name: String,
    http: Vec<SocketAddr>,
    echo: Vec<SocketAddr>,
    proc: Proc,
}

impl Peer {
    /// Starts `rdt-peer serve` in `place` (whose netns must already hold the addresses) and waits until
    /// every listener is bound. `GET /` answers `name` + newline.
    pub fn start(
        place: &Place,
        name: &str,
        http: &[SocketAddr],
        echo: &[SocketAddr],
    ) -> Result<Peer> {
        let listeners: Vec<(&str, SocketAddr)> = http
            .iter()
            .map(|a| ("--listen", *a))
            .chain(echo.iter().map(|a| ("--echo", *a)))
            .collect();
        let mut peer = Self::start_listening(place, name, &listeners)?;
        (peer.http, peer.echo) = (http.to_vec(), echo.to_vec());
        Ok(peer)
    }

    /// Starts `rdt-peer serve` with a stream source (pattern bytes until the client goes) and a sink
    /// (reads to the end, prints `sink eof N` or `sink error N KIND` to its log).
    pub fn start_streams(
        place: &Place,
        name: &str,
        source: SocketAddrV4,
        sink: SocketAddrV4,
    ) -> Result<Peer> {
        Self::start_listening(
            place,
            name,
            &[("--source", source.into()), ("--sink", sink.into())],
        )
    }

    fn start_listening(
        place: &Place,
        name: &str,
        listeners: &[(&str, SocketAddr)],
    ) -> Result<Peer> {
        if listeners.is_empty() {
            bail!("peer {name}: nothing to listen on");
        }
        let mut c = cmd(place)?.args(["serve", "--name", name]);
        for (flag, a) in listeners {
            c = c.arg(flag).arg(a.to_string());
        }
        let mut proc = c.spawn()?;
        let pid = proc.pid();
        let all: Vec<SocketAddr> = listeners.iter().map(|(_, a)| *a).collect();
        procfs::wait_bound(pid, Proto::Tcp, &all, Duration::from_secs(10), || {
            proc.is_running()
        })
        .with_context(|| format!("peer {name} in {}; log:\n{}", place.label, proc.log()))?;
        Ok(Peer {
            name: name.to_string(),
            http: Vec::new(),
            echo: Vec::new(),
            proc,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn http(&self) -> &[SocketAddr] {
        &self.http
    }
    pub fn echo(&self) -> &[SocketAddr] {
        &self.echo
    }
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
    pub fn log(&self) -> String {
        self.proc.log()
    }
    pub fn is_running(&mut self) -> bool {
        self.proc.is_running()
    }
}
