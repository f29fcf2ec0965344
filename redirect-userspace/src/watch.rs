//! Noticing that a configuration directory changed.
//!
//! inotify (through `notify`) wakes us within milliseconds; a content fingerprint decides whether
//! anything really changed (editors and ConfigMap updates fire several events per change); a slow
//! poll catches what inotify cannot see, such as the watched directory itself being replaced.
use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::warn;

/// Events arriving this close together are one change (an editor's write-rename-chmod).
const SETTLE: Duration = Duration::from_millis(100);
/// Safety net when no event arrives.
const POLL: Duration = Duration::from_secs(2);

/// A hash of every visible regular file directly in the directory: names and contents, links
/// followed (a ConfigMap's files are links into its `..data` directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub fn of(dir: &Path) -> Fingerprint {
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                if let Ok(contents) = fs::read(entry.path()) {
                    files.push((name, contents));
                }
            }
        } else if let Ok(contents) = fs::read(dir) {
            files.push((String::new(), contents)); // a single file
        }
        files.sort();
        let mut hasher = Sha256::new();
        for (name, contents) in &files {
            hasher.update((name.len() as u64).to_le_bytes());
            hasher.update(name.as_bytes());
            hasher.update((contents.len() as u64).to_le_bytes());
            hasher.update(contents);
        }
        Fingerprint(hasher.finalize().into())
    }
}

/// Yields each time the directory's content differs from what it was at the last yield.
pub struct DirWatch {
    dir: PathBuf,
    last: Fingerprint,
    events: mpsc::Receiver<()>,
    // Kept alive for its inotify watch; None if it could not be set up (polling still works).
    _watcher: Option<RecommendedWatcher>,
}

impl DirWatch {
    /// Starts watching; the current content is the baseline.
    pub fn new(dir: &Path) -> DirWatch {
        let (tx, events) = mpsc::channel(1);
        let watcher = notify::recommended_watcher(move |_event| {
            // A full channel already holds a wake-up: that is enough.
            let _ = tx.try_send(());
        })
        .and_then(|mut watcher| {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
            Ok(watcher)
        });
        let watcher = match watcher {
            Ok(watcher) => Some(watcher),
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot watch the config directory; polling it every {POLL:?}");
                None
            }
        };
        DirWatch {
            dir: dir.to_path_buf(),
            last: Fingerprint::of(dir),
            events,
            _watcher: watcher,
        }
    }

    /// Waits until the content changed.
    pub async fn changed(&mut self) {
        loop {
            if let Ok(None) = tokio::time::timeout(POLL, self.events.recv()).await {
                // No watcher (it could not be set up): the channel is closed, so only the poll is left.
                tokio::time::sleep(POLL).await;
            }
            // Let a burst of events settle, then drain what queued meanwhile.
            tokio::time::sleep(SETTLE).await;
            while self.events.try_recv().is_ok() {}
            // Reading and hashing every file is blocking work: keep it off the proxy's workers.
            let dir = self.dir.clone();
            let Ok(now) = tokio::task::spawn_blocking(move || Fingerprint::of(&dir)).await else {
                continue;
            };
            if now != self.last {
                self.last = now;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("redirect-watch-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn fingerprint_follows_content_and_ignores_hidden_entries() {
        let dir = temp_dir("fp");
        fs::write(dir.join("a.yaml"), "kind: Namespace").unwrap();
        let first = Fingerprint::of(&dir);
        fs::write(dir.join(".hidden"), "ignored").unwrap();
        assert_eq!(Fingerprint::of(&dir), first);
        fs::write(dir.join("a.yaml"), "kind: Namespace ").unwrap();
        assert_ne!(Fingerprint::of(&dir), first);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn wakes_on_a_change_within_a_second_but_not_on_a_rewrite_of_the_same_bytes() {
        let dir = temp_dir("watch");
        fs::write(dir.join("a.yaml"), "one").unwrap();
        let mut watch = DirWatch::new(&dir);

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

    #[tokio::test]
    async fn follows_a_configmap_style_symlink_swap() {
        // Kubernetes updates a mounted ConfigMap by writing a new hidden directory and renaming a
        // `..data` link onto it; the visible files are links through `..data`.
        let dir = temp_dir("configmap");
        fs::create_dir(dir.join("..v1")).unwrap();
        fs::write(dir.join("..v1/mesh.yaml"), "v1").unwrap();
        std::os::unix::fs::symlink("..v1", dir.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/mesh.yaml", dir.join("mesh.yaml")).unwrap();
        let mut watch = DirWatch::new(&dir);

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
