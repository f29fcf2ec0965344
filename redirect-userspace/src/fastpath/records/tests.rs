//! The kernel's records joined to names: the pod by its cgroup, the service by the decision, a
//! close to its open by the socket's cookie (so a configuration changed in between does not rename
//! it), how a close is said to have ended, and the flag's forms.
use redirect_common::fastpath::IpKey;

use super::*;
use crate::config::load_sources;

const CGROUP_A1: u64 = 4242;

const WORLD: &str = r#"
kind: MeshConfig
serviceEntryVisibility: {defaultVisibility: NAMESPACE}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Pod
metadata: {name: a1, namespace: team-a, uid: 3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1}
spec: {nodeName: node-1}
status: {podIP: 10.244.1.10}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api, namespace: team-a}
spec:
  hosts: [api.example.com]
  addresses: [203.0.113.10]
  resolution: STATIC
  ports: [{number: 80, name: http, protocol: TCP}]
  endpoints: [{address: 198.51.100.20}]
"#;

fn names(world: &str) -> NamesInForce {
    let model = load_sources([("w.yaml", world)]).unwrap();
    let snapshot = Arc::new(Snapshot::from_model(&model));
    let a1 = snapshot
        .workloads()
        .iter()
        .find(|w| w.meta.name == "a1")
        .cloned()
        .unwrap();
    (
        snapshot,
        Arc::new([(CGROUP_A1, ClientPod::new(&a1))].into_iter().collect()),
    )
}

fn raw(kind: u8, cookie: u64) -> ConnRecord {
    let key = |ip: &str| IpKey::new(ip.parse().unwrap());
    ConnRecord {
        cookie,
        cgroup: CGROUP_A1,
        opened_ns: 1_000_000,
        closed_ns: if kind == RECORD_CLOSE { 4_000_000 } else { 0 },
        // 77 bytes, and the SYN and the FIN acknowledged; 320 and the peer's FIN received.
        bytes_sent: if kind == RECORD_CLOSE { 79 } else { 0 },
        bytes_received: if kind == RECORD_CLOSE { 321 } else { 0 },
        dst: key("203.0.113.10"),
        endpoint: key("198.51.100.20"),
        client: if kind == RECORD_CLOSE {
            key("10.244.1.10")
        } else {
            IpKey {
                family: 0,
                addr: [0; 16],
            }
        },
        dst_port: 80,
        endpoint_port: 80,
        client_port: if kind == RECORD_CLOSE { 40_000 } else { 0 },
        kind,
        outcome: FastStat::Rewritten as u8,
        last_state: if kind == RECORD_CLOSE {
            tcp_state::FIN_WAIT2
        } else {
            0
        },
        generation: 1,
        _pad: [0; 2],
    }
}

#[test]
fn an_open_names_the_pod_and_the_service_and_its_close_carries_the_bytes_and_the_end() {
    let names = names(WORLD);
    let mut joiner = Joiner::new();
    let open = joiner
        .join(&raw(RECORD_OPEN, 7), Some(&names), &Clock::now())
        .unwrap();
    assert_eq!(open.event, Event::Open);
    assert_eq!(open.decided_by, DecidedBy::Kernel);
    assert_eq!(open.workload.as_deref(), Some("team-a/a1"));
    assert_eq!(open.namespace.as_deref(), Some("team-a"));
    assert_eq!(open.service.as_deref(), Some("team-a/api"));
    assert_eq!(open.outcome, OutboundOutcome::Service);
    assert_eq!(open.orig_dst, Some("203.0.113.10:80".parse().unwrap()));
    assert_eq!(open.endpoint, Some("198.51.100.20:80".parse().unwrap()));
    assert_eq!(open.client, None, "the port is not bound at connect()");

    let close = joiner
        .join(&raw(RECORD_CLOSE, 7), Some(&names), &Clock::now())
        .unwrap();
    assert_eq!(close.event, Event::Close);
    assert_eq!(close.client, Some("10.244.1.10:40000".parse().unwrap()));
    assert_eq!((close.bytes_sent, close.bytes_received), (77, 320));
    assert_eq!(close.duration, Some(Duration::from_millis(3)));
    assert_eq!(close.end, Some("closed"));
    assert_eq!(close.service.as_deref(), Some("team-a/api"));
}

#[test]
fn a_close_names_the_service_its_open_was_decided_for_even_after_the_entry_went() {
    let mut joiner = Joiner::new();
    joiner.join(&raw(RECORD_OPEN, 9), Some(&names(WORLD)), &Clock::now());
    let without_entry = WORLD
        .split("---\napiVersion: networking.istio.io/v1")
        .next()
        .unwrap();
    let later = names(without_entry);
    let close = joiner
        .join(&raw(RECORD_CLOSE, 9), Some(&later), &Clock::now())
        .unwrap();
    assert_eq!(close.service.as_deref(), Some("team-a/api"));
    // A close whose open was never seen is named by the tables in force: no entry, no service.
    let unjoined = joiner
        .join(&raw(RECORD_CLOSE, 10), Some(&later), &Clock::now())
        .unwrap();
    assert_eq!(unjoined.service, None);
    assert_eq!(unjoined.workload.as_deref(), Some("team-a/a1"));
}

#[test]
fn a_cgroup_the_tables_do_not_name_and_a_kind_never_written_are_handled() {
    let mut joiner = Joiner::new();
    let mut stranger = raw(RECORD_OPEN, 11);
    stranger.cgroup = 1;
    let record = joiner
        .join(&stranger, Some(&names(WORLD)), &Clock::now())
        .unwrap();
    assert_eq!((record.workload, record.namespace), (None, None));
    assert!(
        joiner
            .join(&raw(0, 12), Some(&names(WORLD)), &Clock::now())
            .is_none()
    );
    let before_tables = joiner
        .join(&raw(RECORD_OPEN, 13), None, &Clock::now())
        .unwrap();
    assert_eq!(before_tables.service, None);
}

#[test]
fn the_bytes_are_the_applications_without_the_syn_and_the_fins_the_state_says_were_counted() {
    let closed = |last_state, sent, received| {
        let mut r = raw(RECORD_CLOSE, 1);
        (r.last_state, r.bytes_sent, r.bytes_received) = (last_state, sent, received);
        payload(&r)
    };
    // Our FIN acknowledged, theirs received: the client closed first, or the server did.
    assert_eq!(closed(tcp_state::FIN_WAIT2, 81, 116), (79, 115));
    assert_eq!(closed(tcp_state::LAST_ACK, 81, 116), (79, 115));
    // Reset while established: only the SYN; reset after their FIN: the SYN, and their FIN.
    assert_eq!(closed(tcp_state::ESTABLISHED, 81, 116), (80, 116));
    assert_eq!(closed(tcp_state::CLOSE_WAIT, 81, 116), (80, 115));
    // Never established: nothing went either way.
    assert_eq!(closed(tcp_state::SYN_SENT, 0, 0), (0, 0));
}

#[test]
fn how_a_connection_ended_follows_the_state_its_socket_left() {
    assert_eq!(end_of(tcp_state::FIN_WAIT2), "closed");
    assert_eq!(end_of(tcp_state::LAST_ACK), "closed");
    assert_eq!(end_of(tcp_state::CLOSING), "closed");
    assert_eq!(end_of(tcp_state::ESTABLISHED), "reset");
    assert_eq!(end_of(tcp_state::CLOSE_WAIT), "reset");
    assert_eq!(end_of(tcp_state::SYN_SENT), "connect failed");
}

#[test]
fn the_flag_reads_all_off_and_one_in_n() {
    let parse = |s: &str| s.parse::<KernelRecords>();
    assert_eq!(parse("all"), Ok(KernelRecords::All));
    assert_eq!(parse("off"), Ok(KernelRecords::Off));
    assert_eq!(parse("1/1"), Ok(KernelRecords::All));
    assert_eq!(parse("1/20"), Ok(KernelRecords::OneIn(20)));
    assert_eq!(parse("1/20").unwrap().sample(), 20);
    assert_eq!(KernelRecords::Off.sample(), 0);
    for bad in ["1/0", "some", "20", "1/x"] {
        let e = parse(bad).unwrap_err();
        assert!(e.contains("1/N"), "{bad}: {e}");
    }
}
