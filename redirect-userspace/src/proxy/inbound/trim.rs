//! Handing back to the system the heap that received HBONE freed. A peer that floods holds its
//! connections' windows, frames and buffers (hundreds of MiB); once it leaves they are freed, but
//! glibc's malloc keeps the pages in its arenas, and the agent's resident memory stays at its peak.
//! `malloc_trim` returns the free pages of every arena. It runs when the descriptors received
//! HBONE holds fall to half their most since the last trim ([`super::limits`] asks), a moment
//! later (the streams' tasks end one after another), at most once per [`INTERVAL`], on a blocking
//! thread: never on a connection's path. Without glibc it does nothing.
use std::{sync::Arc, time::Duration};

use tokio::{sync::Notify, time::Instant};
use tracing::debug;

use crate::drain::Watcher;

/// How long after the first ask the trim runs: what else ends meanwhile is trimmed with it.
const SETTLE: Duration = Duration::from_secs(1);

/// The least time between two trims: a trim holds each arena's lock while it returns its pages.
const INTERVAL: Duration = Duration::from_secs(10);

/// Asks for a trim; many asks before it runs make one.
#[derive(Debug, Default)]
pub(super) struct Trim(Notify);

impl Trim {
    pub(super) fn ask(&self) {
        self.0.notify_one();
    }

    /// Whether a trim was asked for since the last look.
    #[cfg(test)]
    pub(super) fn asked(&self) -> bool {
        use futures::FutureExt;
        self.0.notified().now_or_never().is_some()
    }
}

/// Trims as asked until `stop`.
pub(super) async fn run(trim: Arc<Trim>, mut stop: Watcher) {
    let mut last: Option<Instant> = None;
    loop {
        tokio::select! {
            () = trim.0.notified() => {}
            () = stop.stopped() => return,
        }
        let at = Instant::now() + SETTLE;
        let at = last.map_or(at, |last| at.max(last + INTERVAL));
        tokio::select! {
            () = tokio::time::sleep_until(at) => {}
            () = stop.stopped() => return,
        }
        last = Some(Instant::now());
        if let Ok(Some(trimmed)) = tokio::task::spawn_blocking(trim_now).await {
            debug!(
                rss_before_mib = trimmed.before >> 20,
                rss_after_mib = trimmed.after >> 20,
                took_ms = trimmed.took.as_millis() as u64,
                "received HBONE fell; freed heap handed back to the system"
            );
        }
    }
}

/// What a trim did: resident bytes before and after, and how long it took.
struct Trimmed {
    before: u64,
    after: u64,
    took: Duration,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_now() -> Option<Trimmed> {
    let before = resident()?;
    let started = std::time::Instant::now();
    // SAFETY: takes no pointer; glibc locks each arena while it trims it.
    unsafe { libc::malloc_trim(0) };
    let took = started.elapsed();
    Some(Trimmed {
        before,
        after: resident()?,
        took,
    })
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_now() -> Option<Trimmed> {
    None
}

/// The process's resident bytes (`/proc/self/statm`, in pages).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn freed_heap_goes_back_to_the_system() {
        // 64 MiB in pieces below the mmap threshold, from this thread's arena, then all but the
        // last freed: the heap's top is held, so only a trim returns the pages under it.
        let mut pieces: Vec<Vec<u8>> = (0..2048).map(|i| vec![i as u8; 32 * 1024]).collect();
        let last = pieces.pop();
        drop(pieces);
        let trimmed = trim_now().unwrap();
        assert!(
            trimmed.before >= trimmed.after + (48 << 20),
            "{} MiB before the trim, {} after",
            trimmed.before >> 20,
            trimmed.after >> 20
        );
        drop(last);
    }
}
