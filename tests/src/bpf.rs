//! What is attached to a cgroup, read straight from the kernel with `BPF_PROG_QUERY` (no bpftool needed),
//! and a one-instruction `cgroup/connect4` program the harness uses to prove that pod processes (and
//! only they) sit under the attach cgroup.
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;

/// The cgroup attach types (`enum bpf_attach_type`) and bpftool's names for them.
pub const CGROUP_ATTACH_TYPES: &[(u32, &str)] = &[
    (0, "cgroup_inet_ingress"),
    (1, "cgroup_inet_egress"),
    (2, "cgroup_inet_sock_create"),
    (3, "cgroup_sock_ops"),
    (6, "cgroup_device"),
    (8, "cgroup_inet4_bind"),
    (9, "cgroup_inet6_bind"),
    (10, "cgroup_inet4_connect"),
    (11, "cgroup_inet6_connect"),
    (12, "cgroup_inet4_post_bind"),
    (13, "cgroup_inet6_post_bind"),
    (14, "cgroup_udp4_sendmsg"),
    (15, "cgroup_udp6_sendmsg"),
    (18, "cgroup_sysctl"),
    (19, "cgroup_udp4_recvmsg"),
    (20, "cgroup_udp6_recvmsg"),
    (21, "cgroup_getsockopt"),
    (22, "cgroup_setsockopt"),
    (29, "cgroup_inet4_getpeername"),
    (30, "cgroup_inet6_getpeername"),
    (31, "cgroup_inet4_getsockname"),
    (32, "cgroup_inet6_getsockname"),
    (34, "cgroup_inet_sock_release"),
];

/// `bpf_attr` for BPF_PROG_QUERY (the kernel accepts a shorter attr than its own, zero-extended).
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
}

/// A program attached directly to a cgroup (inherited ones are not counted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    pub attach_type: &'static str,
    pub prog_id: u32,
}

/// The cgroup hooks the agent attaches one program to each.
pub const AGENT_HOOKS: usize = 9;

/// The programs attached to `cgroup`: exactly one on each of the agent's hooks, their ids sorted;
/// or an error.
pub fn one_set_attached(cgroup: &Path) -> Result<Vec<u32>> {
    let attached = attached_programs(cgroup)?;
    let mut hooks: Vec<&str> = attached.iter().map(|a| a.attach_type).collect();
    hooks.sort_unstable();
    hooks.dedup();
    ensure!(
        attached.len() == AGENT_HOOKS && hooks.len() == AGENT_HOOKS,
        "want one program on each of {AGENT_HOOKS} hooks of {}, got {attached:?}",
        cgroup.display()
    );
    let mut ids: Vec<u32> = attached.iter().map(|a| a.prog_id).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// Waits until nothing is attached to `cgroup` (5 s, scaled by [`crate::pace`]).
pub fn wait_detached(cgroup: &Path) -> Result<()> {
    let deadline = Instant::now() + crate::pace::scaled(Duration::from_secs(5));
    loop {
        let attached = attached_programs(cgroup)?;
        if attached.is_empty() {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "still attached to {}: {attached:?}",
            cgroup.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every program attached to `cgroup` itself, over all cgroup attach types.
pub fn attached_programs(cgroup: &Path) -> Result<Vec<Attached>> {
    let dir = File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let mut found = Vec::new();
    for &(attach_type, name) in CGROUP_ATTACH_TYPES {
        let mut ids = [0u32; 64];
        let mut attr = QueryAttr {
            target_fd: dir.as_raw_fd() as u32,
            attach_type,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: ids.len() as u32,
            ..Default::default()
        };
        match bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => found.extend(
                ids[..attr.prog_cnt as usize]
                    .iter()
                    .map(|&prog_id| Attached {
                        attach_type: name,
                        prog_id,
                    }),
            ),
            // An attach type this kernel does not know has nothing attached.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("BPF_PROG_QUERY {name} on {}", cgroup.display()));
            }
        }
    }
    Ok(found)
}

/// `bpf_attr` for BPF_PROG_LOAD, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct LoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// A program attached through a BPF link; closing the link (drop) detaches it.
pub struct Link {
    _prog: OwnedFd,
    _link: OwnedFd,
}

/// Attaches to `cgroup` a `cgroup/connect4` program that allows (`allow`) or refuses (EPERM) every
/// IPv4 connect() made by a process in that cgroup or below.
pub fn attach_connect4_verdict(cgroup: &Path, allow: bool) -> Result<Link> {
    // r0 = allow; exit
    let insns: [u64; 2] = [insn(0xb7, 0, allow as i32), insn(0x95, 0, 0)];
    let license = c"GPL";
    let mut attr = LoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_CGROUP_INET4_CONNECT,
        ..Default::default()
    };
    attr.prog_name[..8].copy_from_slice(b"rdt_verd");
    let prog =
        bpf(BPF_PROG_LOAD, &mut attr).context("BPF_PROG_LOAD of the connect4 verdict program")?;
    // SAFETY: BPF_PROG_LOAD returned a new fd that nothing else owns.
    let prog = unsafe { OwnedFd::from_raw_fd(prog) };
    let dir = File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let mut link = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: dir.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_INET4_CONNECT,
        flags: 0,
    };
    let link = bpf(BPF_LINK_CREATE, &mut link)
        .with_context(|| format!("BPF_LINK_CREATE on {}", cgroup.display()))?;
    Ok(Link {
        _prog: prog,
        // SAFETY: BPF_LINK_CREATE returned a new fd that nothing else owns.
        _link: unsafe { OwnedFd::from_raw_fd(link) },
    })
}

/// One eBPF instruction: opcode, dst register, immediate (src register and offset zero).
fn insn(code: u8, dst: u8, imm: i32) -> u64 {
    u64::from(code) | (u64::from(dst & 0xf) << 8) | ((imm as u32 as u64) << 32)
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i32> {
    // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`, valid for its whole size,
    // and every pointer inside it points at memory that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    i32::try_from(rc).map_err(|_| io::Error::other("bpf(2) returned an out-of-range value"))
}

/// Overwrites the one value of a pinned array map (the agent's layout key): how a test makes pinned
/// state look like another version's.
pub fn set_pinned_u32(path: &Path, value: u32) -> Result<()> {
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_OBJ_GET: libc::c_long = 7;
    #[repr(C)]
    struct GetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    struct UpdateAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut get = GetAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut get).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let key = 0u32;
    let mut update = UpdateAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: &key as *const u32 as u64,
        value: &value as *const u32 as u64,
        flags: 0,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut update).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_are_encoded_as_the_kernel_reads_them() {
        // mov64 r0, 1 and exit, as `bpftool prog dump xlated opcodes` prints them.
        assert_eq!(insn(0xb7, 0, 1).to_le_bytes(), [0xb7, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(insn(0x95, 0, 0).to_le_bytes(), [0x95, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            insn(0xb7, 0, -1).to_le_bytes(),
            [0xb7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn attr_layouts_match_the_uapi_offsets() {
        assert_eq!(std::mem::size_of::<QueryAttr>(), 32);
        assert_eq!(std::mem::offset_of!(QueryAttr, prog_ids), 16);
        assert_eq!(std::mem::offset_of!(LoadAttr, prog_name), 48);
        assert_eq!(std::mem::offset_of!(LoadAttr, expected_attach_type), 68);
    }
}
