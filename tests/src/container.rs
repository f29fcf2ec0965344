//! The agent run from its image the way `deploy/manifests/30-daemonset.yaml` runs it: the container's
//! arguments, capabilities, mounts and security settings are read from the manifest itself, and only
//! what names the cluster is swapped for this topology's (its pods' cgroup, its bpffs, its hand-over
//! directory, its DNS upstream and API server). podman runs it with `runc` in the topology's node
//! network namespace, as `hostNetwork: true` runs it in the node's.
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_yaml_ng::Value;

use crate::topology::Topology;

/// The OCI runtime: `crun` refuses hybrid cgroup hierarchies, `runc` runs on every machine podman does.
pub const OCI_RUNTIME: &str = "runc";
/// Where the DaemonSet mounts the host's cgroup tree in the container.
const HOST_CGROUP: &str = "/host/sys/fs/cgroup";

/// `$REDIRECT_IMAGE` (what `cargo xtask test` builds), else the version tag `cargo xtask image`
/// moves to its newest build.
pub fn image() -> String {
    std::env::var("REDIRECT_IMAGE")
        .unwrap_or_else(|_| format!("localhost/redirect:{}", env!("CARGO_PKG_VERSION")))
}

/// Whether podman can run containers here; `Err` says why not (the image suite is skipped then).
pub fn runtime_available() -> Result<()> {
    let ok = Command::new("podman")
        .args(["--runtime", OCI_RUNTIME, "version"])
        .output()
        .is_ok_and(|o| o.status.success());
    ensure!(
        ok,
        "podman with runc is not installed (`cargo xtask setup` installs both)"
    );
    Ok(())
}

/// Fails with how to build it when `image` is not in podman's store.
pub fn require_image(image: &str) -> Result<()> {
    let out = Command::new("podman")
        .args(["image", "exists", image])
        .status()
        .context("running podman image exists")?;
    ensure!(
        out.success(),
        "image {image} is not in podman's store: run `sudo cargo xtask image` (or set REDIRECT_IMAGE)"
    );
    Ok(())
}

/// The node's name as the Pods of `examples/` say they run on it: what a container run as the
/// DaemonSet runs it is told its node is (`NODE_NAME`).
pub const NODE_NAME: &str = "node-1";

/// The agent's container of the DaemonSet, as written in the manifest.
#[derive(Clone, Debug)]
pub struct DaemonSetContainer {
    pub args: Vec<String>,
    pub cap_drop: Vec<String>,
    pub cap_add: Vec<String>,
    pub read_only_root: bool,
    pub privileged: bool,
    pub no_new_privileges: bool,
    pub run_as_user: Option<i64>,
    /// (volume's host path, mount path in the container, read-only, propagation).
    pub mounts: Vec<Mount>,
    /// The container's environment variables taken from the pod's own fields, with the field's path
    /// (`POD_NAME` from `metadata.name`, `NODE_NAME` from `spec.nodeName`).
    pub env_from_pod: Vec<(String, String)>,
    pub termination_grace_secs: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
    /// `HostToContainer` becomes `rslave`, none `rprivate`.
    pub propagation: Option<String>,
}

impl DaemonSetContainer {
    /// The first container of `deploy/manifests/30-daemonset.yaml`.
    pub fn from_manifest() -> Result<DaemonSetContainer> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests/30-daemonset.yaml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(text: &str) -> Result<DaemonSetContainer> {
        let doc: Value = serde_yaml_ng::from_str(text).context("parsing YAML")?;
        let pod = &doc["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let strings = |v: &Value, what: &str| -> Result<Vec<String>> {
            match v {
                Value::Null => Ok(Vec::new()),
                Value::Sequence(items) => items
                    .iter()
                    .map(|i| {
                        i.as_str()
                            .map(str::to_string)
                            .with_context(|| format!("{what}: {i:?} is not a string"))
                    })
                    .collect(),
                other => bail!("{what}: want a list, got {other:?}"),
            }
        };
        let args = strings(&c["args"], "containers[0].args")?;
        let sc = &c["securityContext"];
        let mut host_paths = BTreeMap::new();
        for v in pod["volumes"].as_sequence().into_iter().flatten() {
            let name = v["name"].as_str().context("volumes[].name")?;
            if let Some(p) = v["hostPath"]["path"].as_str() {
                host_paths.insert(name.to_string(), p.to_string());
            }
        }
        let mut mounts = Vec::new();
        for m in c["volumeMounts"].as_sequence().into_iter().flatten() {
            let name = m["name"].as_str().context("volumeMounts[].name")?;
            let host_path = host_paths
                .get(name)
                .with_context(|| format!("volumeMounts: {name} is no hostPath volume"))?;
            mounts.push(Mount {
                host_path: host_path.clone(),
                container_path: m["mountPath"]
                    .as_str()
                    .with_context(|| format!("volumeMounts {name}: mountPath"))?
                    .to_string(),
                read_only: m["readOnly"].as_bool().unwrap_or(false),
                propagation: m["mountPropagation"].as_str().map(str::to_string),
            });
        }
        let env_from_pod = c["env"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|e| {
                let field = e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?;
                Some((e["name"].as_str()?.to_string(), field.to_string()))
            })
            .collect();
        Ok(DaemonSetContainer {
            args,
            cap_drop: strings(&sc["capabilities"]["drop"], "capabilities.drop")?,
            cap_add: strings(&sc["capabilities"]["add"], "capabilities.add")?,
            read_only_root: sc["readOnlyRootFilesystem"].as_bool().unwrap_or(false),
            privileged: sc["privileged"].as_bool().unwrap_or(false),
            no_new_privileges: sc["allowPrivilegeEscalation"].as_bool() == Some(false),
            run_as_user: sc["runAsUser"].as_i64(),
            mounts,
            env_from_pod,
            termination_grace_secs: pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30),
        })
    }
}

/// The DaemonSet's first init container's arguments and whether it is privileged (`mount-bpffs`).
pub fn init_container() -> Result<(Vec<String>, bool)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests/30-daemonset.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: Value = serde_yaml_ng::from_str(&text).context("parsing YAML")?;
    let init = &doc["spec"]["template"]["spec"]["initContainers"][0];
    let args = init["args"]
        .as_sequence()
        .context("initContainers[0].args")?
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    Ok((
        args,
        init["securityContext"]["privileged"].as_bool() == Some(true),
    ))
}

/// Runs the DaemonSet's init step from `image` on `topo` to its end, with the run's bpffs where the
/// DaemonSet mounts the node's (`Bidirectional`: `rshared`); returns what it printed.
pub fn run_init(topo: &Topology, image: &str) -> Result<String> {
    let (args, privileged) = init_container()?;
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", OCI_RUNTIME, "run", "--rm", "--network", "none"]);
    let (nofile, nproc) = rlimits();
    cmd.args(["--ulimit", &format!("nofile={nofile}:{nofile}")]);
    cmd.args(["--ulimit", &format!("nproc={nproc}:{nproc}")]);
    if privileged {
        cmd.arg("--privileged");
    }
    cmd.args(["--read-only", "--read-only-tmpfs=false", "--volume"]);
    cmd.arg(format!(
        "{}:/sys/fs/bpf:rw,rshared",
        topo.id().bpffs_dir().display()
    ));
    cmd.arg(image).args(&args);
    let out = cmd.output().context("running podman")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "the init step failed: {text}");
    Ok(text)
}

/// The same flag with another value: `--flag=value` or `--flag value` in `args`, else appended.
fn set_flag(args: &mut Vec<String>, flag: &str, value: Option<&str>) {
    let eq = format!("{flag}=");
    if let Some(i) = args.iter().position(|a| a == flag || a.starts_with(&eq)) {
        let separate = args[i] == flag;
        match value {
            Some(v) => {
                args[i] = format!("{flag}={v}");
                if separate && i + 1 < args.len() && !args[i + 1].starts_with("--") {
                    args.remove(i + 1);
                }
            }
            None => args[i] = flag.to_string(),
        }
        return;
    }
    args.push(match value {
        Some(v) => format!("{flag}={v}"),
        None => flag.to_string(),
    });
}

/// `extra` as (flag, value) pairs: `--x=v`, `--x v`, or a lone `--x`.
fn flag_pairs(extra: &[&str]) -> Result<Vec<(String, Option<String>)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < extra.len() {
        let a = extra[i];
        ensure!(a.starts_with("--"), "argument {a:?} is no --flag");
        if let Some((f, v)) = a.split_once('=') {
            out.push((f.to_string(), Some(v.to_string())));
            i += 1;
        } else if i + 1 < extra.len() && !extra[i + 1].starts_with("--") {
            out.push((a.to_string(), Some(extra[i + 1].to_string())));
            i += 2;
        } else {
            out.push((a.to_string(), None));
            i += 1;
        }
    }
    Ok(out)
}

/// A container of this run: removed (`podman rm -f`) when dropped, whatever state it is in.
pub struct Guard {
    pub name: String,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "--force", "--time", "0", "--ignore", &self.name])
            .output();
    }
}

/// A file in the run's state directory saying the run started containers (so that its cleanup asks
/// podman, and no other run pays for that).
pub const MARKER: &str = "containers";

/// Removes every container whose name starts with `tag-` (a run's); nothing where podman is absent.
pub fn remove_all(tag: &str) {
    let Ok(out) = Command::new("podman")
        .args(["ps", "--all", "--format", "{{.Names}}"])
        .args(["--filter", &format!("name=^{tag}-")])
        .output()
    else {
        return;
    };
    for name in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        drop(Guard {
            name: name.to_string(),
        });
    }
}

/// The DaemonSet's flags that need the API as the source (`--kube`), dropped when a test gives
/// `--config` instead.
const KUBE_ONLY: [&str; 2] = ["--kube", "--write-status"];

/// How the test changes the DaemonSet's container, to show what the manifest's settings are for.
#[derive(Clone, Debug, Default)]
pub struct Edit {
    /// Capabilities removed from the manifest's `add` list.
    pub without_caps: Vec<String>,
}

/// The agent's image and how the DaemonSet's container is changed (not at all, by default).
#[derive(Clone, Debug)]
pub struct Image {
    pub tag: String,
    pub edit: Edit,
}

impl Image {
    /// [`image()`], run as the manifest says.
    pub fn from_env() -> Image {
        Image {
            tag: image(),
            edit: Edit::default(),
        }
    }
}

/// `podman run` for the agent in `image` on `topo`, as the DaemonSet runs it; `extra` are the
/// arguments that name this run's source of configuration (`--kube --kubeconfig FILE` or `--config
/// DIR`) and upstream: a flag the manifest has takes the value given here, any file named is
/// mounted read-only at its own path. Returns the program and arguments, and the container's guard.
pub fn podman_run(
    topo: &Topology,
    image: &str,
    name: &str,
    edit: &Edit,
    extra: &[&str],
) -> Result<(Vec<OsString>, Guard)> {
    let ds = DaemonSetContainer::from_manifest()?;
    ensure!(
        !ds.privileged,
        "the DaemonSet's container must not be privileged"
    );
    std::fs::write(topo.state_dir().join(MARKER), "podman\n")
        .with_context(|| format!("writing {}", topo.state_dir().join(MARKER).display()))?;
    let handover_dir = topo.state_dir().join("run-redirect");
    crate::run::create_dir_all_shared(&handover_dir)?;
    let mut cmd: Vec<OsString> = ["podman", "--runtime", OCI_RUNTIME, "run", "--rm"]
        .iter()
        .map(OsString::from)
        .collect();
    let mut push = |parts: &[&str]| cmd.extend(parts.iter().map(OsString::from));
    push(&["--name", name, "--network"]);
    push(&[&format!("ns:/run/netns/{}", topo.node().netns)]);
    // Explicit limits: the ones podman asks for by default are refused on some machines; these are
    // the test process's own.
    let (nofile, nproc) = rlimits();
    push(&["--ulimit", &format!("nofile={nofile}:{nofile}")]);
    push(&["--ulimit", &format!("nproc={nproc}:{nproc}")]);
    for cap in &ds.cap_drop {
        push(&["--cap-drop", cap]);
    }
    for cap in ds.cap_add.iter().filter(|c| !edit.without_caps.contains(c)) {
        push(&["--cap-add", cap]);
    }
    if ds.read_only_root {
        // Kubernetes adds no writable /tmp or /run: neither does this.
        push(&["--read-only", "--read-only-tmpfs=false"]);
    }
    if ds.no_new_privileges {
        push(&["--security-opt", "no-new-privileges"]);
    }
    // RuntimeDefault as containerd 1.7+ has it: podman's default profile still ties bpf(2) to
    // CAP_SYS_ADMIN; containerd's allows it with CAP_BPF. Same profile otherwise.
    let profile = runtime_default_seccomp(topo)?;
    push(&["--security-opt", &format!("seccomp={}", profile.display())]);
    if let Some(uid) = ds.run_as_user {
        push(&["--user", &uid.to_string()]);
    }
    for (var, field) in &ds.env_from_pod {
        let value = match field.as_str() {
            // The pod's own name; here the container's.
            "metadata.name" => name,
            // The node the pod runs on: the one the examples' Pods are on, as this run's node.
            "spec.nodeName" => NODE_NAME,
            other => bail!(
                "the DaemonSet passes the pod field {other} in {var}, which this test does not map yet"
            ),
        };
        push(&["--env", &format!("{var}={value}")]);
    }
    for m in &ds.mounts {
        let host: PathBuf = match m.host_path.as_str() {
            "/sys/fs/cgroup" => topo.cgroup2().to_path_buf(),
            "/sys/fs/bpf" => topo.id().bpffs_dir(),
            "/run/redirect" => handover_dir.clone(),
            other => bail!("the DaemonSet mounts {other}, which this test does not map yet"),
        };
        let mut opts = vec![if m.read_only { "ro" } else { "rw" }];
        opts.push(match m.propagation.as_deref() {
            Some("HostToContainer") => "rslave",
            Some("Bidirectional") => "rshared",
            _ => "rprivate",
        });
        push(&[
            "--volume",
            &format!("{}:{}:{}", host.display(), m.container_path, opts.join(",")),
        ]);
    }
    // Arguments: the manifest's, with the cluster's values swapped for this run's.
    let mut args = ds.args.clone();
    let pods = topo
        .attach_cgroup()
        .strip_prefix(topo.cgroup2())
        .context("the pods' cgroup is not below the cgroup2 mount")?;
    set_flag(
        &mut args,
        "--cgroup",
        Some(&format!("{HOST_CGROUP}/{}", pods.display())),
    );
    set_flag(&mut args, "--gateway", Some(&crate::GATEWAY.to_string()));
    set_flag(&mut args, "--admin", Some(crate::ADMIN_ADDR));
    let extra = flag_pairs(extra)?;
    if extra.iter().any(|(flag, _)| flag == "--config") {
        // A directory as the source instead of the API: the flags that need the API go.
        args.retain(|a| {
            !KUBE_ONLY
                .iter()
                .any(|k| a == k || a.starts_with(&format!("{k}=")))
        });
    }
    for (flag, value) in extra {
        if let Some(v) = &value
            && v.starts_with('/')
            && Path::new(v).exists()
        {
            push(&["--volume", &format!("{v}:{v}:ro")]);
        }
        set_flag(&mut args, &flag, value.as_deref());
    }
    push(&[image]);
    cmd.extend(args.iter().map(OsString::from));
    Ok((
        cmd,
        Guard {
            name: name.to_string(),
        },
    ))
}

/// The test process's open-files and processes limits (hard).
fn rlimits() -> (u64, u64) {
    let get = |res| {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass.
        if unsafe { libc::getrlimit(res, &mut l) } == 0 && l.rlim_max != libc::RLIM_INFINITY {
            l.rlim_max
        } else {
            1 << 20
        }
    };
    // nproc: the agent needs a few dozen threads; the user's whole limit is refused by runc on some
    // machines.
    (get(libc::RLIMIT_NOFILE), get(libc::RLIMIT_NPROC).min(4096))
}

/// podman's default seccomp profile, with `bpf(2)` allowed to a container holding CAP_BPF as
/// containerd's RuntimeDefault does (written once per run).
fn runtime_default_seccomp(topo: &Topology) -> Result<PathBuf> {
    let out = topo.scratch_path("seccomp-runtime-default.json");
    if out.exists() {
        return Ok(out);
    }
    let base = "/usr/share/containers/seccomp.json";
    let text = std::fs::read_to_string(base).with_context(|| format!("reading {base}"))?;
    let mut profile: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {base}"))?;
    let syscalls = profile["syscalls"]
        .as_array_mut()
        .with_context(|| format!("{base}: no syscalls list"))?;
    // podman's profile also denies bpf(2) outright (EPERM) to a container without CAP_SYS_ADMIN; that
    // rule would win over the one added below. Without either capability the call then gets the
    // profile's default answer, as under containerd's.
    for rule in syscalls.iter_mut() {
        if rule["action"] == "SCMP_ACT_ERRNO"
            && let Some(names) = rule["names"].as_array_mut()
        {
            names.retain(|n| n != "bpf");
        }
    }
    syscalls.push(serde_json::json!({
        "names": ["bpf"],
        "action": "SCMP_ACT_ALLOW",
        "includes": {"caps": ["CAP_BPF"]},
        "comment": "containerd 1.7+: bpf(2) with CAP_BPF",
    }));
    std::fs::write(&out, serde_json::to_vec_pretty(&profile)?)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_container_is_read_as_written() {
        let ds = DaemonSetContainer::from_manifest().unwrap();
        assert_eq!(ds.cap_drop, ["ALL"]);
        assert!(ds.cap_add.contains(&"BPF".to_string()), "{ds:?}");
        assert!(ds.read_only_root && ds.no_new_privileges && !ds.privileged);
        assert!(ds.args.iter().any(|a| a == "--kube"), "{ds:?}");
        let paths: Vec<&str> = ds.mounts.iter().map(|m| m.host_path.as_str()).collect();
        assert_eq!(paths, ["/sys/fs/cgroup", "/sys/fs/bpf", "/run/redirect"]);
        let env: Vec<(&str, &str)> = ds
            .env_from_pod
            .iter()
            .map(|(var, field)| (var.as_str(), field.as_str()))
            .collect();
        assert_eq!(
            env,
            [
                ("NODE_NAME", "spec.nodeName"),
                ("POD_NAME", "metadata.name")
            ]
        );
    }

    #[test]
    fn a_flag_takes_the_run_s_value_in_place() {
        let mut args: Vec<String> = ["run", "--kube", "--dns-upstream=10.96.0.10:53", "--x", "1"]
            .map(String::from)
            .to_vec();
        set_flag(&mut args, "--dns-upstream", Some("198.51.100.53:53"));
        set_flag(&mut args, "--x", Some("2"));
        set_flag(&mut args, "--kubeconfig", Some("/k"));
        set_flag(&mut args, "--kube", None);
        assert_eq!(
            args,
            [
                "run",
                "--kube",
                "--dns-upstream=198.51.100.53:53",
                "--x=2",
                "--kubeconfig=/k"
            ]
        );
        let pairs = flag_pairs(&["--kube", "--kubeconfig", "/k", "--a=b"]).unwrap();
        assert_eq!(
            pairs,
            [
                ("--kube".to_string(), None),
                ("--kubeconfig".to_string(), Some("/k".to_string())),
                ("--a".to_string(), Some("b".to_string())),
            ]
        );
    }
}
