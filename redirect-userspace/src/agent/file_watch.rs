//! Noticing that one file changed (the audit mesh config): inotify on its directory wakes us, the
//! file's bytes decide whether it really changed, and a slow poll catches what inotify cannot see
//! (a ConfigMap volume swaps its `..data` link, which may not name the file).
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::warn;

use crate::config::{Limits, read_file};

/// Events arriving this close together are one change (an editor's write-rename-chmod).
const SETTLE: Duration = Duration::from_millis(100);
/// Safety net when no event arrives.
const POLL: Duration = Duration::from_secs(2);

pub(super) struct FileWatch {
    path: PathBuf,
    /// The content at the last yield (`None`: not readable then).
    last: Option<String>,
    events: mpsc::Receiver<()>,
    /// Kept alive for its inotify watch; `None` if it could not be set up (the poll still works).
    _watcher: Option<RecommendedWatcher>,
}

impl FileWatch {
    /// Starts watching; the current content is the baseline.
    pub(super) fn new(path: &Path) -> FileWatch {
        let (tx, events) = mpsc::channel(1);
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
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
                warn!(file = %path.display(), error = %e, "cannot watch the file's directory; polling it every {POLL:?}");
                None
            }
        };
        FileWatch {
            path: path.to_path_buf(),
            last: content(path),
            events,
            _watcher: watcher,
        }
    }

    /// Waits until the file's content differs from what it was at the last yield.
    pub(super) async fn changed(&mut self) {
        loop {
            if let Ok(Some(())) = tokio::time::timeout(POLL, self.events.recv()).await {
                tokio::time::sleep(SETTLE).await;
                while self.events.try_recv().is_ok() {}
            }
            let now = content(&self.path);
            if now != self.last {
                self.last = now;
                return;
            }
        }
    }
}

fn content(path: &Path) -> Option<String> {
    read_file(path, Limits::default().max_file_bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_change_of_content_is_noticed_and_a_rewrite_of_the_same_is_not() {
        let dir = std::env::temp_dir().join(format!("redirect-file-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.yaml");
        std::fs::write(&path, "a").unwrap();
        let mut watch = FileWatch::new(&path);
        std::fs::write(&path, "a").unwrap();
        let same = tokio::time::timeout(Duration::from_millis(500), watch.changed()).await;
        assert!(same.is_err(), "the same bytes are no change");
        std::fs::write(&path, "b").unwrap();
        tokio::time::timeout(Duration::from_secs(5), watch.changed())
            .await
            .expect("a new content is a change");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
