//! What the small scenario suites share (`identity.rs`, `opt_out.rs`): team-a's NAMESPACE entry for
//! `api.example.com` at 203.0.113.10, the two servers that tell whether it was reached, Pod manifests,
//! and fetching a body with curl from a pod.
use anyhow::Result;

use crate::{Peer, Pod, Topology};

/// team-a's entry for api.example.com, as the unit tests have it (written once, in
/// `redirect-userspace/tests/fixtures/`).
const API_ENTRY: &str = include_str!("../../redirect-userspace/tests/fixtures/team-a-api.yaml");
/// The entry's IPv4 address as the shared document writes it, and with the IPv6 one the pods here
/// (dual-stack) reach it by too.
const API_ADDRESSES: (&str, &str) = (
    "addresses: [203.0.113.10]",
    "addresses: [203.0.113.10, \"2001:db8::10\"]",
);

/// team-a, default visibility NAMESPACE, and team-a's entry `api`: `api.example.com` at 203.0.113.10:80
/// and [2001:db8::10]:80, its endpoint 198.51.100.20. Outside team-a the entry is absent and both
/// addresses are the real host.
pub fn team_a_api() -> String {
    let (v4, dual) = API_ADDRESSES;
    assert!(
        API_ENTRY.contains(v4),
        "the shared entry no longer has `{v4}`: update API_ADDRESSES"
    );
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: team-a}}\n---\n\
         kind: MeshConfig\nserviceEntryVisibility: {{defaultVisibility: NAMESPACE}}\n---\n{}",
        API_ENTRY.replace(v4, dual)
    )
}

/// The body the entry's endpoint answers with.
pub const API_ENDPOINT_BODY: &str = "team-a-api";
/// The body the real host at 203.0.113.10 (and 2001:db8::10) answers with.
pub const API_REAL_BODY: &str = "real-203.0.113.10";
/// The entry's address, as a URL.
pub const API_URL: &str = "http://203.0.113.10/";
/// The entry's IPv6 address, as a URL: a pod connects to it from its IPv6 address.
pub const API6_URL: &str = "http://[2001:db8::10]/";

/// Starts the entry's endpoint and the real host, in ext.
pub fn start_api_servers(topo: &Topology) -> Result<(Peer, Peer)> {
    Ok((
        topo.start_ext_peer(API_ENDPOINT_BODY, &["198.51.100.20:80".parse()?], &[])?,
        topo.start_ext_peer(
            API_REAL_BODY,
            &["203.0.113.10:80".parse()?, "[2001:db8::10]:80".parse()?],
            &[],
        )?,
    ))
}

/// A Pod manifest (a document to append after `---`). `labels` is a YAML flow map, e.g. `{app: x}`.
/// An IPv4 `ip` is reported dual-stack, with the topology's IPv6 address for it in `podIPs`.
pub fn pod(key: &str, uid: &str, ip: &str, labels: &str) -> String {
    let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
    let ips = match ip.parse::<std::net::Ipv4Addr>() {
        Ok(v4) => format!(
            "{{podIP: {ip}, podIPs: [{{ip: {ip}}}, {{ip: \"{}\"}}]}}",
            crate::pod_ip6(v4)
        ),
        Err(_) => format!("{{podIP: \"{ip}\"}}"),
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, uid: {uid}, labels: {labels}}}\nstatus: {ips}\n"
    )
}

/// The body of `url` as curl in `pod` gets it, trimmed; an error if curl fails.
pub fn curl_body(pod: &Pod, url: &str) -> Result<String> {
    Ok(pod
        .cmd("curl")
        // -g: brackets are an IPv6 literal, not a glob.
        .args(["-gsS", "--fail", "--max-time", "10", url])
        .ok()?
        .stdout_str()
        .trim()
        .to_string())
}

/// What curl says it moved over one connection: its request, and the response's header and body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub sent: u64,
    pub received: u64,
}

/// `count` sequential curls from `pod` to `url`, in one shell: what each moved. Each must succeed.
pub fn curls_moved(pod: &Pod, url: &str, count: usize) -> Result<Vec<Moved>> {
    use anyhow::{Context, ensure};
    let script = format!(
        "for i in $(seq {count}); do curl -gsS -o /dev/null --max-time {} \
         -w '%{{size_request}} %{{size_header}} %{{size_download}}\\n' '{url}' || exit 1; done",
        crate::pace::scaled_secs(10)
    );
    let out = pod
        .cmd("sh")
        .args(["-c", &script])
        .timeout(crate::pace::scaled(std::time::Duration::from_secs(120)))
        .ok()?;
    let moved: Vec<Moved> = out
        .stdout_str()
        .lines()
        .map(|line| {
            let n: Vec<u64> = line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .with_context(|| format!("curl's -w line {line:?}"))?;
            ensure!(n.len() == 3, "curl's -w line {line:?}");
            Ok(Moved {
                sent: n[0],
                received: n[1] + n[2],
            })
        })
        .collect::<Result<_>>()?;
    ensure!(moved.len() == count, "{} curls of {count}", moved.len());
    Ok(moved)
}
