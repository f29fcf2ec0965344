//! The pods' cgroups on this node: cgroup id -> pod uid, read from the cgroup tree the programs are
//! attached to. On cgroup v2 a cgroup's id (what `bpf_get_current_cgroup_id` returns) is the inode
//! number of its directory, so one walk of the tree maps every id to a path, and the path to a pod.
use crate::lock::Locked;
use std::{
    collections::{HashMap, HashSet},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use arc_swap::ArcSwap;
use tracing::{debug, warn};
use uuid::Uuid;

/// What one walk found.
#[derive(Debug, Default)]
struct Table {
    /// cgroup id -> the uid of the pod it belongs to (`None`: in the tree, but not a pod's cgroup).
    ids: HashMap<u64, Option<Uuid>>,
    /// pod uid -> the id of the pod's own cgroup (its containers' are below it).
    pods: HashMap<Uuid, u64>,
    /// pod uid -> the directory of the pod's own cgroup.
    dirs: HashMap<Uuid, PathBuf>,
}

/// Cached view of the tree, walked again when a connection comes from a cgroup it has not seen (a pod
/// started since). Misses wait for each other, so a burst of them walks once or twice, not once each;
/// a cgroup seen once is never walked for again.
#[derive(Debug)]
pub(crate) struct CgroupPods {
    root: PathBuf,
    table: ArcSwap<Table>,
    /// Walks done so far (for tests).
    walks: AtomicU64,
    walking: tokio::sync::Mutex<()>,
    /// cgroups already warned about.
    warned: Mutex<HashSet<u64>>,
}

impl CgroupPods {
    /// Walks `root` (the attached cgroup) once now.
    pub(crate) fn new(root: PathBuf) -> CgroupPods {
        let table = walk(&root);
        debug!(root = %root.display(), cgroups = table.ids.len(), pods = table.pods.len(), "read the pods' cgroups");
        CgroupPods {
            root,
            table: ArcSwap::from_pointee(table),
            walks: AtomicU64::new(1),
            walking: tokio::sync::Mutex::new(()),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// The uid of the pod whose cgroup has id `cgroup_id`, if it is a kubelet pod cgroup.
    pub(crate) async fn pod_uid(&self, cgroup_id: u64) -> Option<Uuid> {
        if let Some(found) = self.table.load().ids.get(&cgroup_id) {
            return *found;
        }
        let _walking = self.walking.lock().await;
        // A walk that ended while we waited may have found it; one that began before the cgroup
        // existed did not, so look again rather than trusting that a walk happened.
        if let Some(found) = self.table.load().ids.get(&cgroup_id) {
            return *found;
        }
        self.walk_now(Some(cgroup_id)).await;
        self.table.load().ids.get(&cgroup_id).copied().flatten()
    }

    /// The ids of the own cgroups of the pods `uids` (those found), walking the tree again first if
    /// one is missing (a pod whose cgroup appeared since).
    pub(crate) async fn pod_cgroups(&self, uids: &[Uuid]) -> HashMap<Uuid, u64> {
        let mut table = self.table.load_full();
        if uids.iter().any(|uid| !table.pods.contains_key(uid)) {
            let _walking = self.walking.lock().await;
            self.walk_now(None).await;
            table = self.table.load_full();
        }
        uids.iter()
            .filter_map(|uid| Some((*uid, *table.pods.get(uid)?)))
            .collect()
    }

    /// The id of pod `uid`'s own cgroup as last walked, without walking (for dumps).
    pub(crate) fn known_pod_cgroup(&self, uid: &Uuid) -> Option<u64> {
        self.table.load().pods.get(uid).copied()
    }

    /// The network namespace of pod `uid` (`/proc/PID/ns/net` of a process in its cgroup tree),
    /// from the last walk; `None` when no process runs there.
    pub(crate) fn pod_netns(&self, uid: &Uuid) -> Option<PathBuf> {
        let dir = self.table.load().dirs.get(uid)?.clone();
        first_process(&dir).map(|pid| PathBuf::from(format!("/proc/{pid}/ns/net")))
    }

    /// Walks the tree anew and returns every cgroup in it that belongs to a pod (the pod's own
    /// and its containers'), with the pod's uid.
    pub(crate) async fn rescan(&self) -> Vec<(u64, Uuid)> {
        {
            let _walking = self.walking.lock().await;
            self.walk_now(None).await;
        }
        let mut found: Vec<(u64, Uuid)> = self
            .table
            .load()
            .ids
            .iter()
            .filter_map(|(id, uid)| Some((*id, (*uid)?)))
            .collect();
        found.sort_unstable();
        found
    }

    /// Walks the tree and puts the result in force. `missed`: an id a connection came from, kept
    /// as "not a pod" if the walk does not find it (a process that left the tree), so it is not
    /// walked for again. Call with `walking` held.
    async fn walk_now(&self, missed: Option<u64>) {
        let root = self.root.clone();
        match tokio::task::spawn_blocking(move || walk(&root)).await {
            Ok(mut table) => {
                if let Some(id) = missed {
                    table.ids.entry(id).or_insert(None);
                }
                self.table.store(Arc::new(table));
            }
            Err(e) => warn!(error = %e, "walking the pods' cgroups failed"),
        }
        self.walks.fetch_add(1, Ordering::Release);
    }

    /// True the first time a mismatch is seen for `cgroup_id`: the warning is logged once per cgroup,
    /// the counter counts every connection.
    pub(crate) fn first_mismatch(&self, cgroup_id: u64) -> bool {
        let mut warned = self.warned.locked();
        warned.insert(cgroup_id)
    }
}

/// A process of the cgroup `dir` or of one below it (the pod's own cgroup holds its containers').
fn first_process(dir: &Path) -> Option<u32> {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    if let Some(pid) = procs.lines().find_map(|l| l.trim().parse().ok()) {
        return Some(pid);
    }
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .find_map(|e| first_process(&e.path()))
}

/// Every cgroup under `root` (itself included) with the pod uid its path names. A directory that
/// vanishes during the walk (a pod ending) is skipped.
fn walk(root: &Path) -> Table {
    let mut table = Table::default();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        let uid = pod_uid_in_path(&dir);
        if let Some(uid) = uid
            && dir.file_name().map(Path::new).and_then(pod_uid_in_path) == Some(uid)
        {
            table.pods.insert(uid, meta.ino());
            table.dirs.insert(uid, dir.clone());
        }
        table.ids.insert(meta.ino(), uid);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
    table
}

/// The pod uid a kubelet cgroup path names, from its deepest component that names one:
/// `pod<uid>` (cgroupfs driver) or `kubepods[-<qos>]-pod<uid with _ for ->.slice` (systemd driver).
/// Container cgroups below the pod's (`cri-containerd-<id>.scope`, `<id>`) name none.
pub(super) fn pod_uid_in_path(path: &Path) -> Option<Uuid> {
    path.components().rev().find_map(|component| {
        let name = component.as_os_str().to_str()?;
        let name = name.strip_suffix(".slice").unwrap_or(name);
        let at = name.rfind("pod")?;
        if at != 0 && !name[..at].ends_with('-') {
            return None;
        }
        let uid = name[at + 3..].replace('_', "-");
        // Only the hyphenated form: a container id is 64 hex digits, never a UUID, but be strict.
        (uid.len() == 36)
            .then(|| Uuid::try_parse(&uid).ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";

    #[test]
    fn kubelet_cgroup_names_give_the_pod_uid() {
        let uid = Uuid::parse_str(UID).ok();
        let systemd = UID.replace('-', "_");
        let cases = [
            (
                "cgroupfs, pod level",
                format!("/sys/fs/cgroup/kubepods/burstable/pod{UID}"),
                uid,
            ),
            (
                "cgroupfs, container below the pod",
                format!(
                    "/sys/fs/cgroup/kubepods/pod{UID}/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
                ),
                uid,
            ),
            (
                "systemd, burstable",
                format!(
                    "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd}.slice"
                ),
                uid,
            ),
            (
                "systemd, guaranteed, containerd scope below",
                format!(
                    "/sys/fs/cgroup/kubepods.slice/kubepods-pod{systemd}.slice/cri-containerd-0123abcd.scope"
                ),
                uid,
            ),
            (
                "QoS level only",
                "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice".into(),
                None,
            ),
            (
                "not kubelet",
                "/sys/fs/cgroup/system.slice/sshd.service".into(),
                None,
            ),
            (
                "pod without a uid",
                "/sys/fs/cgroup/kubepods/podcast".into(),
                None,
            ),
            ("uid not after pod", format!("/sys/fs/cgroup/x{UID}"), None),
            (
                "pod glued to a word",
                format!("/sys/fs/cgroup/ipod{UID}"),
                None,
            ),
        ];
        for (name, path, want) in cases {
            assert_eq!(pod_uid_in_path(Path::new(&path)), want, "{name}: {path}");
        }
    }

    struct TempTree(PathBuf);
    impl Drop for TempTree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[tokio::test]
    async fn a_cgroup_created_after_the_first_walk_is_found_on_a_miss() {
        let root = TempTree(
            std::env::temp_dir().join(format!("redirect-cgroups-test-{}", std::process::id())),
        );
        let pod = root.0.join(format!("pod{UID}"));
        std::fs::create_dir_all(&pod).unwrap();
        let pods = CgroupPods::new(root.0.clone());
        let id = |p: &Path| std::fs::metadata(p).unwrap().ino();
        let uid = Uuid::parse_str(UID).ok();

        assert_eq!(pods.pod_uid(id(&pod)).await, uid);
        assert_eq!(pods.pod_uid(id(&root.0)).await, None, "the root is no pod");

        // A container started later: unknown at first, found by the walk the miss starts.
        let container = pod.join("app");
        std::fs::create_dir(&container).unwrap();
        assert_eq!(pods.pod_uid(id(&container)).await, uid);
        let walks = pods.walks.load(Ordering::Acquire);
        assert_eq!(pods.pod_uid(id(&container)).await, uid);
        assert_eq!(
            pods.walks.load(Ordering::Acquire),
            walks,
            "a hit walks nothing"
        );

        // The pod's own cgroup, not its container's, is what an opt-out names.
        let other = Uuid::from_u128(7);
        let found = pods.pod_cgroups(&[uid.unwrap(), other]).await;
        assert_eq!(found.get(&uid.unwrap()), Some(&id(&pod)));
        assert_eq!(found.get(&other), None);

        // An id no cgroup has: one walk, then "not a pod" without walking again.
        assert_eq!(pods.pod_uid(u64::MAX).await, None);
        let walks = pods.walks.load(Ordering::Acquire);
        assert_eq!(pods.pod_uid(u64::MAX).await, None);
        assert_eq!(pods.walks.load(Ordering::Acquire), walks);
    }
}
