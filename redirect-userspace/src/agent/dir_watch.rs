//! Noticing that a configuration directory changed.
//!
//! inotify (through `notify`) wakes us within milliseconds; a fingerprint of the files the loader
//! reads decides whether anything really changed (editors and ConfigMap updates fire several events
//! per change); a slow poll catches what inotify cannot see, such as the watched directory itself
//! being replaced. Only the loader's own files count, listed as the loader lists them: a FIFO, a
//! device or an ignored file is never opened, and a file is read again only when its `stat` changed.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::warn;

use crate::config::{self, Limits};

/// Events arriving this close together are one change (an editor's write-rename-chmod).
const SETTLE: Duration = Duration::from_millis(100);
/// Safety net when no event arrives.
const POLL: Duration = Duration::from_secs(2);

/// A hash of the names and contents of the files a load would read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Fingerprint([u8; 32]);

/// Content hashes by file, valid while the file's `stat` is unchanged: an unchanged directory
/// costs a listing, not a read.
#[derive(Debug, Default)]
pub(super) struct Fingerprinter {
    limits: Limits,
    known: HashMap<PathBuf, (config::FileStat, [u8; 32])>,
}

impl Fingerprinter {
    pub(super) fn new(limits: Limits) -> Self {
        Fingerprinter {
            limits,
            known: HashMap::new(),
        }
    }

    pub(super) fn of(&mut self, dir: &Path) -> Fingerprint {
        let mut hasher = Sha256::new();
        let files = match config::list_files(dir) {
            Ok(files) => files,
            Err(message) => {
                hasher.update(message.as_bytes());
                return Fingerprint(hasher.finalize().into());
            }
        };
        let mut known = HashMap::with_capacity(files.len());
        let mut total: u64 = 0;
        for file in files {
            let stat = file.stat();
            total = total.saturating_add(file.len);
            let digest = match self.known.remove(&file.path) {
                Some((was, digest)) if was == stat => digest,
                // Past the directory's cap the loader reads nothing: its `stat` stands for it.
                _ if total > self.limits.max_dir_bytes => {
                    Sha256::digest(format!("{stat:?}").as_bytes()).into()
                }
                _ => {
                    let content = config::read_file(&file.path, self.limits.max_file_bytes);
                    let mut h = Sha256::new();
                    match &content {
                        Ok(text) => h.update(text.as_bytes()),
                        Err(message) => h.update(message.as_bytes()),
                    }
                    h.finalize().into()
                }
            };
            let name = file.path.to_string_lossy();
            hasher.update((name.len() as u64).to_le_bytes());
            hasher.update(name.as_bytes());
            hasher.update(digest);
            known.insert(file.path, (stat, digest));
        }
        self.known = known;
        Fingerprint(hasher.finalize().into())
    }
}

/// Yields each time the directory's content differs from what it was at the last yield.
pub(super) struct DirWatch {
    dir: PathBuf,
    fingerprinter: Option<Fingerprinter>,
    last: Fingerprint,
    events: mpsc::Receiver<()>,
    /// Kept alive for its inotify watches; None if it could not be set up (polling still works).
    watcher: Option<RecommendedWatcher>,
    /// The directory the watch is on (device, inode): a directory deleted and made again under the
    /// same name is another inode, and the watch on the old one is gone with it.
    watched: Option<(u64, u64)>,
}

impl DirWatch {
    /// Starts watching; the current content is the baseline.
    pub(super) fn new(dir: &Path, limits: Limits) -> DirWatch {
        let (tx, events) = mpsc::channel(1);
        let own = dir.to_path_buf();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            // The parent is watched too, for the directory's own name only: its other entries are
            // none of our business.
            let ours = match &event {
                Ok(event) => {
                    event.paths.is_empty() || event.paths.iter().any(|p| p.starts_with(&own))
                }
                Err(_) => true,
            };
            // A full channel already holds a wake-up: that is enough.
            if ours {
                let _ = tx.try_send(());
            }
        })
        .and_then(|mut watcher| {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
            // The parent tells when the directory is made again after a removal (a missing or
            // unwatchable parent leaves that to the poll).
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                let _ = watcher.watch(parent, RecursiveMode::NonRecursive);
            }
            Ok(watcher)
        });
        let watcher = match watcher {
            Ok(watcher) => Some(watcher),
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot watch the config directory; polling it every {POLL:?}");
                None
            }
        };
        let mut fingerprinter = Fingerprinter::new(limits);
        DirWatch {
            dir: dir.to_path_buf(),
            last: fingerprinter.of(dir),
            fingerprinter: Some(fingerprinter),
            events,
            watched: inode(dir),
            watcher,
        }
    }

    /// Puts the watch back on the directory when it is another one than the watch was on (removed
    /// and made again): without it, changes would be seen only by the poll.
    fn rewatch_if_replaced(&mut self) {
        let now = inode(&self.dir);
        if now == self.watched || now.is_none() {
            return;
        }
        let Some(watcher) = self.watcher.as_mut() else {
            return;
        };
        // The old watch went with the old directory; the name may still be registered.
        let _ = watcher.unwatch(&self.dir);
        match watcher.watch(&self.dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                tracing::info!(dir = %self.dir.display(), "the config directory was made again; watching the new one");
                self.watched = now;
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), error = %e, "cannot watch the config directory made again; polling it every {POLL:?}");
            }
        }
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Waits until the content changed.
    pub(super) async fn changed(&mut self) {
        loop {
            if let Ok(None) = tokio::time::timeout(POLL, self.events.recv()).await {
                // No watcher (it could not be set up): the channel is closed, so only the poll is left.
                tokio::time::sleep(POLL).await;
            }
            // Let a burst of events settle, then drain what queued meanwhile.
            tokio::time::sleep(SETTLE).await;
            while self.events.try_recv().is_ok() {}
            // Listing and hashing changed files is blocking work: keep it off the proxy's workers.
            let dir = self.dir.clone();
            let mut fingerprinter = self
                .fingerprinter
                .take()
                .unwrap_or_else(|| Fingerprinter::new(Limits::default()));
            let Ok((fingerprinter, now)) = tokio::task::spawn_blocking(move || {
                let now = fingerprinter.of(&dir);
                (fingerprinter, now)
            })
            .await
            else {
                continue;
            };
            self.fingerprinter = Some(fingerprinter);
            self.rewatch_if_replaced();
            if now != self.last {
                self.last = now;
                return;
            }
        }
    }
}

/// The directory's device and inode, following links; `None` when it is not there.
fn inode(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("redirect-watch-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn fingerprint_follows_content_and_ignores_what_the_loader_ignores() {
        let dir = temp_dir("fp");
        let mut fp = Fingerprinter::new(Limits::default());
        fs::write(dir.join("a.yaml"), "kind: Namespace").unwrap();
        let first = fp.of(&dir);
        fs::write(dir.join(".hidden.yaml"), "ignored").unwrap();
        fs::write(dir.join("notes.txt"), "ignored").unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.yaml")).unwrap();
        crate::config::source_tests::mkfifo(&dir.join("fifo.yaml"));
        let started = std::time::Instant::now();
        assert_eq!(fp.of(&dir), first);
        assert!(started.elapsed() < Duration::from_secs(1));
        fs::write(dir.join("a.yaml"), "kind: Namespace ").unwrap();
        assert_ne!(fp.of(&dir), first);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn wakes_on_a_change_within_a_second_but_not_on_a_rewrite_of_the_same_bytes() {
        let dir = temp_dir("watch");
        fs::write(dir.join("a.yaml"), "one").unwrap();
        let mut watch = DirWatch::new(&dir, Limits::default());

        // Same bytes rewritten: events fire, nothing changed, no wake-up.
        fs::write(dir.join("a.yaml"), "one").unwrap();
        let same = tokio::time::timeout(Duration::from_millis(500), watch.changed()).await;
        assert!(same.is_err(), "woke up for identical content");

        let started = std::time::Instant::now();
        let writer = {
            let dir = dir.clone();
            tokio::spawn(async move { fs::write(dir.join("a.yaml"), "two").unwrap() })
        };
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("change noticed within a second");
        assert!(started.elapsed() < Duration::from_secs(1));
        writer.await.unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The directory removed and made again (a redeploy, an operator's `rm -r; cp -r`): changes
    /// in the new one are seen as fast as in the first, not at the next poll.
    #[tokio::test]
    async fn follows_a_directory_removed_and_made_again() {
        let dir = temp_dir("recreated");
        fs::write(dir.join("a.yaml"), "one").unwrap();
        let mut watch = DirWatch::new(&dir, Limits::default());

        fs::remove_dir_all(&dir).unwrap();
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("the removal noticed within a second");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("a.yaml"), "two").unwrap();
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("the directory made again noticed within a second");
        for round in 3..6 {
            let started = std::time::Instant::now();
            fs::write(dir.join("a.yaml"), format!("round {round}")).unwrap();
            tokio::time::timeout(Duration::from_secs(1), watch.changed())
                .await
                .unwrap_or_else(|_| {
                    panic!("change {round} in the new directory noticed within a second")
                });
            assert!(
                started.elapsed() < POLL / 2,
                "seen by inotify, not the poll"
            );
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn follows_a_configmap_style_symlink_swap() {
        // Kubernetes updates a mounted ConfigMap by writing a new hidden directory and renaming a
        // `..data` link onto it; the visible files are links through `..data`.
        let dir = temp_dir("configmap");
        fs::create_dir(dir.join("..v1")).unwrap();
        fs::write(dir.join("..v1/mesh.yaml"), "v1").unwrap();
        std::os::unix::fs::symlink("..v1", dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/mesh.yaml", dir.join("mesh.yaml")).unwrap();
        let mut watch = DirWatch::new(&dir, Limits::default());

        fs::create_dir(dir.join("..v2")).unwrap();
        fs::write(dir.join("..v2/mesh.yaml"), "v2").unwrap();
        std::os::unix::fs::symlink("..v2", dir.join("..data_tmp")).unwrap();
        fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("symlink swap noticed within a second");
        fs::remove_dir_all(&dir).unwrap();
    }
}
