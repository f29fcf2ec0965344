//! Pinned links that steer none of the agent's pods (`docs/handover.md`, "Links that steer nobody"):
//! severed by the kernel when the pods' cgroup was removed (and made again at the same path) under a
//! killed agent, or attached to another cgroup than `--cgroup`. The next agent on the pin directory
//! says so once at WARN, unpins them with the maps they share and attaches anew: it never exits on
//! them (a DaemonSet would crash-loop, and no pod would be steered).
//!
//! Every cgroup removed or made here is the run's own (`<run>/pods`, below the test's cgroup tree).
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use integration::{
    Agent, DnsRecords, Peer, RESOLVER_IP, Topology, bpf, cgroup, dig, fixtures, pace,
};

const B1: (&str, &str) = ("team-b/b1", "10.244.2.10");
const B1_UID: &str = "6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a62";
/// team-b's own entry: nobody listens at its address, so a connection to it reaches the endpoint
/// only when the programs steer it; its name is known to the agent only (dnsmasq has no record).
const SERVICE_HOST: &str = "svc.example.com";
const SERVICE_VIP: &str = "203.0.113.20";
const SERVICE_ENDPOINT_BODY: &str = "team-b-svc";
/// One program per hook the agent uses.
/// The phrase of the one warning.
const WARNING: &str = "cannot be adopted";

fn config() -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: team-b}}
---
kind: MeshConfig
serviceEntryVisibility: {{defaultVisibility: NAMESPACE}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: svc, namespace: team-b}}
spec:
  hosts: [{SERVICE_HOST}]
  addresses: [{SERVICE_VIP}]
  ports: [{{number: 80, name: http, protocol: HTTP}}]
  resolution: STATIC
  endpoints: [{{address: 198.51.100.21}}]
---
{}"#,
        fixtures::pod(B1.0, B1_UID, B1.1, "{}"),
    )
}

/// Fields drop in order: servers, then the topology (which unmounts the run's bpffs).
struct World {
    config_dir: String,
    dns_upstream: String,
    _servers: Vec<Peer>,
    _dns: integration::Dnsmasq,
    topo: Topology,
}

fn world() -> Result<World> {
    let topo = Topology::with_pods(&[B1])?;
    let dir = topo.scratch_path("config");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("mesh.yaml"), config())?;
    let servers =
        vec![topo.start_ext_peer(SERVICE_ENDPOINT_BODY, &["198.51.100.21:80".parse()?], &[])?];
    let dns = topo.start_dnsmasq(RESOLVER_IP, DnsRecords::new())?;
    Ok(World {
        config_dir: dir.display().to_string(),
        dns_upstream: format!("{RESOLVER_IP}:53"),
        _servers: servers,
        _dns: dns,
        topo,
    })
}

impl World {
    fn agent_args(&self) -> [&str; 4] {
        [
            "--config",
            &self.config_dir,
            "--dns-upstream",
            &self.dns_upstream,
        ]
    }
}

/// The pod's connection to the service's address reaches its endpoint, and its name is answered by
/// the agent: both only when the programs steer the pod.
fn steered(topo: &Topology) -> Result<()> {
    let pod = topo.pod(B1.0);
    let body = fixtures::curl_body(pod, &format!("http://{SERVICE_VIP}/"))?;
    ensure!(
        body == SERVICE_ENDPOINT_BODY,
        "curl {SERVICE_VIP}: {body:?}"
    );
    let reply = dig::run(pod.cmd("dig").args(["+tries=1", "+time=3", SERVICE_HOST]))?;
    ensure!(
        reply.status == "NOERROR"
            && reply.a_records() == [SERVICE_VIP.parse::<std::net::Ipv4Addr>()?],
        "{SERVICE_HOST} not answered by the agent: {reply:#?}"
    );
    Ok(())
}

/// The warning lines of the agent's log about pinned links it cannot adopt; requires exactly one.
fn the_one_warning(log: &str) -> Result<String> {
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains(WARNING))
        .collect();
    ensure!(
        warnings.len() == 1,
        "want one warning about the pinned links, got {}:\n{log}",
        warnings.len()
    );
    Ok(warnings[0].to_string())
}

/// The agent's `agent running` line says how it started.
fn start_of(log: &str) -> Result<String> {
    let line = log
        .lines()
        .find(|l| l.contains("agent running"))
        .with_context(|| format!("no `agent running` line:\n{log}"))?;
    Ok(line.to_string())
}

/// The cgroup id (the kernel's `bpf_link_info.cgroup.cgroup_id`) of the link pinned at `pin`: 0
/// once the link is attached to no cgroup.
fn pinned_link_cgroup_id(pin: &Path) -> Result<u64> {
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    #[repr(C)]
    struct GetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    #[derive(Default)]
    struct LinkInfo {
        link_type: u32,
        id: u32,
        prog_id: u32,
        _pad: u32,
        cgroup_id: u64,
        attach_type: u32,
        _pad2: u32,
    }
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i64> {
        // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`, and every pointer in
        // it points at memory that outlives the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(rc)
    }
    let c = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())?;
    let mut get = GetAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut get).with_context(|| format!("opening {}", pin.display()))?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = LinkInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<LinkInfo>() as u32,
        info: &mut info as *mut LinkInfo as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
        .with_context(|| format!("link info of {}", pin.display()))?;
    Ok(info.cgroup_id)
}

/// The inode number of a cgroup v2 directory: its cgroup id.
fn cgroup_id(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(File::open(dir)?.metadata()?.ino())
}

/// Removes the pods' cgroup (the run's own `<run>/pods`, with every pod's cgroup below it) and makes
/// it again at the same paths, as a node whose cgroup tree was rebuilt. No process may be in it.
fn remake_pods_cgroup(topo: &Topology) -> Result<()> {
    let pods = topo.attach_cgroup();
    ensure!(
        pods.starts_with(topo.run_cgroup()),
        "{} is not the run's own",
        pods.display()
    );
    ensure!(
        !cgroup::populated(pods),
        "processes left in {}: {:?}",
        pods.display(),
        cgroup::pids_below(pods)
    );
    cgroup::remove_tree(pods)?;
    std::fs::create_dir_all(pods).with_context(|| format!("making {}", pods.display()))?;
    for pod in topo.pods() {
        std::fs::create_dir_all(pod.cgroup())
            .with_context(|| format!("making {}", pod.cgroup().display()))?;
    }
    Ok(())
}

/// Waits until the kernel has severed the link pinned at `pin` (it does so once the removed cgroup
/// is released, from a work queue).
fn wait_severed(pin: &Path) -> Result<()> {
    let deadline = Instant::now() + pace::scaled(Duration::from_secs(10));
    loop {
        let id = pinned_link_cgroup_id(pin)?;
        if id == 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} is still attached to cgroup id {id}",
            pin.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The finding: an agent killed, the pods' cgroup removed and made again at the same path. Its
/// pinned links are severed (updating one fails with ENOLINK). The next agent on the pin
/// directory warns once, unpins them and attaches anew to the cgroup `--cgroup` names now, and
/// steers the pods in it.
#[test]
fn links_severed_by_a_remade_pods_cgroup_are_unpinned_and_the_programs_attached_anew() -> Result<()>
{
    let w = world()?;
    let cgroup = w.topo.attach_cgroup();
    let connect4 = w.topo.pin_dir().join("links").join("connect4");
    let first = Agent::start(&w.topo, &w.agent_args())?;
    steered(&w.topo)?;
    let old_id = cgroup_id(cgroup)?;
    ensure!(pinned_link_cgroup_id(&connect4)? == old_id);
    first.kill()?;

    remake_pods_cgroup(&w.topo)?;
    let new_id = cgroup_id(cgroup)?;
    ensure!(new_id != old_id, "the cgroup made again has the old id");
    ensure!(
        bpf::attached_programs(cgroup)?.is_empty(),
        "the new cgroup has programs already"
    );
    wait_severed(&connect4)?;

    let second = Agent::start(&w.topo, &w.agent_args())?;
    let log = second.log();
    let warning = the_one_warning(&log)?;
    eprintln!("{warning}");
    ensure!(
        warning.contains("links/connect4") && warning.contains("severed"),
        "the warning names neither the pin nor why: {warning}"
    );
    let running = start_of(&log)?;
    ensure!(
        running.contains("start=Reattached") && !running.contains("Adopted"),
        "{running}"
    );
    ensure!(
        pinned_link_cgroup_id(&connect4)? == new_id,
        "the pinned link is not the new cgroup's"
    );
    bpf::one_set_attached(cgroup)?;
    steered(&w.topo)?;

    // Its state is its own now: the next agent adopts it, without a word.
    second.kill()?;
    let third = Agent::start(&w.topo, &w.agent_args())?;
    let log = third.log();
    ensure!(start_of(&log)?.contains("start=Adopted"), "{log}");
    ensure!(!log.contains(WARNING), "{log}");
    bpf::one_set_attached(cgroup)?;
    steered(&w.topo)?;
    third.stop()?;
    bpf::wait_detached(cgroup)?;
    let dir = w.topo.pin_dir();
    ensure!(!dir.exists(), "{} left after the last agent", dir.display());
    Ok(())
}

/// Pins left by an agent of another cgroup (`--cgroup A`, killed) on the pin directory of an agent
/// of `--cgroup B`: the second agent warns once, unpins them (their links go: nobody holds them) and
/// attaches to B.
#[test]
fn links_pinned_for_another_cgroup_are_unpinned_and_the_programs_attached_to_this_one() -> Result<()>
{
    // Cgroup A: another run's pods cgroup, with its own node netns for the first agent.
    let other = Topology::new()?;
    let w = world()?;
    let a = other.attach_cgroup();
    let b = w.topo.attach_cgroup();
    let pins = w.topo.pin_dir();
    let connect4 = pins.join("links").join("connect4");
    let first = Agent::launch_wrapped(&other, &[], &pins, &w.agent_args())?;
    bpf::one_set_attached(a)?;
    ensure!(pinned_link_cgroup_id(&connect4)? == cgroup_id(a)?);
    first.kill()?;
    bpf::one_set_attached(a)?;

    let second = Agent::start(&w.topo, &w.agent_args())?;
    let log = second.log();
    let warning = the_one_warning(&log)?;
    eprintln!("{warning}");
    let a_id = cgroup_id(a)?.to_string();
    ensure!(
        warning.contains("links/connect4")
            && warning.contains("another cgroup")
            && warning.contains(&a_id),
        "the warning names neither the pin nor why: {warning}"
    );
    ensure!(
        start_of(&log)?.contains("start=Reattached"),
        "{}",
        start_of(&log)?
    );
    ensure!(
        pinned_link_cgroup_id(&connect4)? == cgroup_id(b)?,
        "the pinned link is not this agent's cgroup's"
    );
    bpf::one_set_attached(b)?;
    // A's links went with their pins: nothing of the first agent is left attached anywhere.
    bpf::wait_detached(a)?;
    steered(&w.topo)?;
    second.stop()?;
    bpf::wait_detached(b)?;
    Ok(())
}

/// The same, caught before the kernel severs the links: a socket made in the removed cgroup (its
/// process moved out) holds that cgroup's programs, so the links still name its id, which no
/// cgroup has any more. The next agent says the cgroup was removed, and attaches to the new one.
#[test]
fn links_of_a_removed_cgroup_not_yet_severed_are_unpinned_and_the_programs_attached_anew()
-> Result<()> {
    let w = world()?;
    let cgroup = w.topo.attach_cgroup();
    let connect4 = w.topo.pin_dir().join("links").join("connect4");
    let first = Agent::start(&w.topo, &w.agent_args())?;
    let old_id = cgroup_id(cgroup)?;
    // A UDP socket made in the pod's cgroup, held by a process that then leaves for the node's.
    let mut holder = w
        .topo
        .pod(B1.0)
        .cmd("bash")
        .args([
            "-c",
            &format!("exec 3<>/dev/udp/{RESOLVER_IP}/53 && echo open && exec sleep 600"),
        ])
        .spawn()?;
    holder.wait_for_log("open", Duration::from_secs(10))?;
    std::fs::write(
        w.topo.node().cgroup.join("cgroup.procs"),
        holder.pid().to_string(),
    )
    .context("moving the holder out of the pods' cgroup")?;
    first.kill()?;
    remake_pods_cgroup(&w.topo)?;
    std::thread::sleep(Duration::from_millis(200));
    ensure!(
        pinned_link_cgroup_id(&connect4)? == old_id,
        "the link was severed although a socket holds its cgroup"
    );

    let second = Agent::start(&w.topo, &w.agent_args())?;
    let log = second.log();
    let warning = the_one_warning(&log)?;
    eprintln!("{warning}");
    ensure!(
        warning.contains("links/connect4")
            && warning.contains(&format!("cgroup id {old_id}, which was removed")),
        "the warning names neither the pin nor why: {warning}"
    );
    ensure!(start_of(&log)?.contains("start=Reattached"), "{log}");
    bpf::one_set_attached(cgroup)?;
    steered(&w.topo)?;
    drop(holder);
    second.stop()?;
    bpf::wait_detached(cgroup)?;
    Ok(())
}
