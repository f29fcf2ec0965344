//! What `/proc` says about a process: start time (pid reuse), open fds, and the sockets of its netns.
use std::fs;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Start time of `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`); `None` if it is gone.
pub fn start_time(pid: u32) -> Result<Option<u64>> {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => parse_start_time(&stat)
            .map(Some)
            .context("parsing /proc/<pid>/stat"),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).context(format!("reading /proc/{pid}/stat")),
    }
}

fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Number of open file descriptors of `pid`.
pub fn fd_count(pid: u32) -> Result<usize> {
    let dir = format!("/proc/{pid}/fd");
    Ok(fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .count())
}

/// Resident memory of `pid` in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Result<u64> {
    let file = format!("/proc/{pid}/status");
    let status = fs::read_to_string(&file).with_context(|| format!("reading {file}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no VmRSS in {file}"))
}

/// Number of threads of `pid`.
pub fn thread_count(pid: u32) -> Result<usize> {
    let dir = format!("/proc/{pid}/task");
    Ok(fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .count())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

/// Local addresses (both families) of the listening TCP sockets (or bound UDP sockets) that `pid`
/// itself holds.
pub fn bound(pid: u32, proto: Proto) -> Result<Vec<SocketAddr>> {
    let name = match proto {
        Proto::Tcp => "tcp",
        Proto::Udp => "udp",
    };
    // The tables list the whole netns; the process's own fds say which sockets are its.
    let own = socket_inodes(pid)?;
    let mut found = Vec::new();
    for table in [name.to_string(), format!("{name}6")] {
        let file = format!("/proc/{pid}/net/{table}");
        let text = fs::read_to_string(&file).with_context(|| format!("reading {file}"))?;
        found.extend(
            parse_bound(&text, proto)
                .into_iter()
                .filter(|(_, inode)| own.contains(inode))
                .map(|(addr, _)| addr),
        );
    }
    Ok(found)
}

/// Inodes of the sockets among `pid`'s open fds (`socket:[12345]` links).
fn socket_inodes(pid: u32) -> Result<Vec<u64>> {
    let dir = format!("/proc/{pid}/fd");
    let fds = fs::read_dir(&dir).with_context(|| format!("reading {dir}"))?;
    Ok(fds
        .flatten()
        .filter_map(|fd| fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect())
}

/// Rows of `/proc/net/{tcp,udp}{,6}` in the listening (TCP) or unconnected (UDP) state: address
/// and inode.
fn parse_bound(table: &str, proto: Proto) -> Vec<(SocketAddr, u64)> {
    const TCP_LISTEN: &str = "0A";
    const UDP_UNCONNECTED: &str = "07";
    let want = match proto {
        Proto::Tcp => TCP_LISTEN,
        Proto::Udp => UDP_UNCONNECTED,
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.get(3)? != &want {
                return None;
            }
            let (ip, port) = f.get(1)?.split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let inode = f.get(9)?.parse().ok()?;
            Some((SocketAddr::new(parse_hex_ip(ip)?, port), inode))
        })
        .collect()
}

/// The kernel prints an address as u32 words, each in host (little endian) order: one for IPv4,
/// four for IPv6.
fn parse_hex_ip(hex: &str) -> Option<std::net::IpAddr> {
    let word = |i: usize| {
        let w = u32::from_str_radix(hex.get(8 * i..8 * i + 8)?, 16).ok()?;
        Some(u32::from_be(w).to_be_bytes())
    };
    match hex.len() {
        8 => Some(Ipv4Addr::from(word(0)?).into()),
        32 => {
            let mut octets = [0u8; 16];
            for i in 0..4 {
                octets[4 * i..4 * i + 4].copy_from_slice(&word(i)?);
            }
            Some(Ipv6Addr::from(octets).into())
        }
        _ => None,
    }
}

/// Waits until `pid` itself has every one of `addrs` bound (a wildcard bind counts), or fails at the deadline.
/// `alive` is asked between polls so a process that died is reported at once.
pub fn wait_bound<A: Copy + Into<SocketAddr>>(
    pid: u32,
    proto: Proto,
    addrs: &[A],
    timeout: Duration,
    mut alive: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = addrs.iter().map(|&a| a.into()).collect();
    loop {
        let bound = bound(pid, proto).unwrap_or_default();
        let covered = |a: &SocketAddr| {
            bound
                .iter()
                .any(|b| b.port() == a.port() && (b.ip() == a.ip() || b.ip().is_unspecified()))
        };
        let missing: Vec<_> = addrs.iter().filter(|a| !covered(a)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if !alive() {
            bail!("process {pid} exited before binding {missing:?}");
        }
        if Instant::now() > deadline {
            bail!("process {pid} did not bind {missing:?} ({proto:?}) within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat =
            "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 777 1000 10";
        assert_eq!(parse_start_time(stat), Some(777));
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn our_own_start_time_is_readable() {
        assert!(start_time(std::process::id()).unwrap().is_some());
        assert!(fd_count(std::process::id()).unwrap() >= 3);
        assert!(rss_kib(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn listening_sockets_are_decoded() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0A07FECB:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:3A98 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0
   2: 0A07FECB:0050 0A01F40A:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 100 0 0 10 0";
        let got = parse_bound(tcp, Proto::Tcp);
        assert_eq!(
            got,
            vec![
                ("203.254.7.10:80".parse().unwrap(), 1),
                ("127.0.0.1:15000".parse().unwrap(), 2)
            ],
            "established sockets are not listeners"
        );
        let udp = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  1: 356433C6:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 9 2 0 0";
        assert_eq!(
            parse_bound(udp, Proto::Udp),
            vec![("198.51.100.53:53".parse().unwrap(), 9)]
        );
    }

    #[test]
    fn ipv6_listeners_are_decoded() {
        // fd00:7::1 port 15001, as /proc/net/tcp6 prints it (four little-endian words).
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 070000FD000000000000000001000000:3A99 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5 1 0 100 0 0 10 0";
        assert_eq!(
            parse_bound(tcp6, Proto::Tcp),
            vec![("[fd00:7::1]:15001".parse().unwrap(), 5)]
        );
    }
}
