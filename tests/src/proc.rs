//! A long-lived process started by [`crate::Cmd::spawn`]: its output in a log file, its stdin open for
//! the test, and SIGTERM then SIGKILL when it is dropped.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A long-lived process. Dropping it sends SIGTERM, then SIGKILL if it has not exited within 3 s.
pub struct Proc {
    what: String,
    child: Child,
    log: PathBuf,
    stdin: Option<ChildStdin>,
}

impl Proc {
    pub(crate) fn new(what: String, mut child: Child, log: PathBuf) -> Proc {
        let stdin = child.stdin.take();
        Proc {
            what,
            child,
            log,
            stdin,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    pub fn what(&self) -> &str {
        &self.what
    }
    pub fn log_path(&self) -> &Path {
        &self.log
    }
    /// Everything the process printed so far (stdout and stderr interleaved).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Polls the log until a line contains `needle`; fails at the deadline or if the process exits first.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let timeout = crate::pace::scaled(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().lines().any(|l| l.contains(needle)) {
                return Ok(());
            }
            if !self.is_running() {
                bail!(
                    "{} exited before printing {needle:?}; log:\n{}",
                    self.what,
                    self.log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not print {needle:?} within {timeout:?}; log:\n{}",
                    self.what,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn write_stdin(&mut self, bytes: &[u8]) -> Result<()> {
        let pipe = self.stdin.as_mut().context("stdin already closed")?;
        pipe.write_all(bytes)?;
        pipe.flush()?;
        Ok(())
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child; it stays a zombie (pid reserved) until we wait for it.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits for the process to exit by itself.
    pub fn wait(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let timeout = crate::pace::scaled(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "{} still running after {timeout:?}; log:\n{}",
                    self.what,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait; SIGKILL (and an error) if it does not exit within `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.signal(libc::SIGTERM);
        self.wait(timeout).inspect_err(|_| {
            let _ = self.child.kill();
            let _ = self.child.wait();
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stdin = None;
        if self.terminate(Duration::from_secs(3)).is_err() {
            eprintln!("redirect-tests: {} ignored SIGTERM, killed", self.what);
        }
    }
}
