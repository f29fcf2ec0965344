//! The kernel's records joined to names: the pod by its cgroup, the service by the decision, a
//! close to its open by the socket's cookie (so a configuration changed in between does not rename
//! it), how a close is said to have ended, and the flag's forms.
use redirect_common::records::OUTCOME_LEFT_ALONE;

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

fn key(ip: &str) -> IpKey {
    IpKey::new(ip.parse().unwrap())
}

fn open(cookie: u64) -> OpenRecord {
    OpenRecord {
        kind: RECORD_OPEN,
        outcome: FastStat::Rewritten as u8,
        _pad: [0; 2],
        dst_port: 80,
        endpoint_port: 80,
        cookie,
        cgroup: CGROUP_A1,
        opened_ns: 1_000_000,
        dst: key("203.0.113.10"),
        endpoint: key("198.51.100.20"),
    }
}

/// The close of `cookie` as the kernel reports a rewritten socket's (its original destination
/// and cgroup kept).
fn close(cookie: u64) -> CloseRecord {
    CloseRecord {
        kind: RECORD_CLOSE,
        outcome: FastStat::Rewritten as u8,
        last_state: tcp_state::FIN_WAIT2,
        _pad: 0,
        dst_port: 80,
        endpoint_port: 80,
        cookie,
        closed_ns: 4_000_000,
        // 77 bytes, and the SYN and the FIN acknowledged; 320 and the peer's FIN received.
        bytes_sent: 79,
        bytes_received: 321,
        cgroup: CGROUP_A1,
        client: key("10.244.1.10"),
        dst: key("203.0.113.10"),
        endpoint: key("198.51.100.20"),
        client_port: 40_000,
        _pad2: 0,
    }
}

/// What `joiner` records of `raw`.
fn join(joiner: &mut Joiner, raw: Raw, names: Option<&NamesInForce>) -> Vec<Record> {
    static BATCH: std::sync::OnceLock<Batch> = std::sync::OnceLock::new();
    let mut records = Vec::new();
    joiner.join(raw, names, BATCH.get_or_init(Batch::now), &mut records);
    records
}

/// The one record `joiner` makes of `raw`.
fn one(joiner: &mut Joiner, raw: Raw, names: Option<&NamesInForce>) -> Record {
    let mut records = join(joiner, raw, names);
    assert_eq!(records.len(), 1, "{records:?}");
    records.remove(0)
}

/// The bytes of `record` as the ring carries them.
fn bytes<T>(record: &T) -> Vec<u8> {
    // SAFETY: the records are plain integers without padding.
    unsafe { std::slice::from_raw_parts(std::ptr::from_ref(record).cast::<u8>(), size_of::<T>()) }
        .to_vec()
}

#[test]
fn an_open_names_the_pod_and_the_service_and_its_close_carries_the_bytes_and_the_end() {
    let names = names(WORLD);
    let mut joiner = Joiner::new();
    let open = one(&mut joiner, Raw::Open(open(7)), Some(&names));
    assert_eq!(open.event, Event::Open);
    assert_eq!(open.decided_by, DecidedBy::Kernel);
    assert_eq!(open.workload.as_deref(), Some("team-a/a1"));
    assert_eq!(open.namespace.as_deref(), Some("team-a"));
    assert_eq!(open.service.as_deref(), Some("team-a/api"));
    assert_eq!(open.outcome, OutboundOutcome::Service);
    assert_eq!(open.orig_dst, Some("203.0.113.10:80".parse().unwrap()));
    assert_eq!(open.endpoint, Some("198.51.100.20:80".parse().unwrap()));
    assert_eq!(open.client, None, "the port is not bound at connect()");

    let close = one(&mut joiner, Raw::Close(close(7)), Some(&names));
    assert_eq!(close.event, Event::Close);
    assert_eq!(close.client, Some("10.244.1.10:40000".parse().unwrap()));
    assert_eq!((close.bytes_sent, close.bytes_received), (77, 320));
    assert_eq!(close.duration, Some(Duration::from_millis(3)));
    assert_eq!(close.end, Some("closed"));
    assert_eq!(close.service.as_deref(), Some("team-a/api"));
    assert_eq!(close.workload.as_deref(), Some("team-a/a1"));
    assert_eq!(close.orig_dst, open.orig_dst);
    assert_eq!(close.endpoint, open.endpoint);
    assert_eq!(
        close.time.duration_since(open.time).ok(),
        Some(Duration::from_millis(3)),
        "each at its own moment"
    );
}

#[test]
fn a_close_names_the_service_its_open_was_decided_for_even_after_the_entry_went() {
    let mut joiner = Joiner::new();
    join(&mut joiner, Raw::Open(open(9)), Some(&names(WORLD)));
    let without_entry = WORLD
        .split("---\napiVersion: networking.istio.io/v1")
        .next()
        .unwrap();
    let later = names(without_entry);
    let close = one(&mut joiner, Raw::Close(close(9)), Some(&later));
    assert_eq!(close.service.as_deref(), Some("team-a/api"));
    // Opens decided on the later tables are named by them.
    let open = one(&mut joiner, Raw::Open(open(10)), Some(&later));
    assert_eq!(open.service, None);
    assert_eq!(open.workload.as_deref(), Some("team-a/a1"));
}

#[test]
fn connections_to_one_destination_share_their_names() {
    let names = names(WORLD);
    let mut joiner = Joiner::new();
    let a = one(&mut joiner, Raw::Open(open(1)), Some(&names));
    let b = one(&mut joiner, Raw::Open(open(2)), Some(&names));
    let (a, b) = (a.service.unwrap(), b.service.unwrap());
    assert!(Arc::ptr_eq(&a.shared(), &b.shared()), "named once");
}

#[test]
fn a_close_whose_open_was_let_go_is_named_from_what_its_socket_kept_and_one_never_opened_is_not_recorded()
 {
    let names = names(WORLD);
    let mut joiner = Joiner::new();
    // Fill the newer half twice over: the first opens are let go.
    for cookie in 1..=OPEN_JOINED as u64 + 1 {
        join(&mut joiner, Raw::Open(open(cookie)), Some(&names));
    }
    let rewritten = one(&mut joiner, Raw::Close(close(1)), Some(&names));
    assert_eq!(rewritten.event, Event::Close);
    assert_eq!(rewritten.service.as_deref(), Some("team-a/api"));
    assert_eq!(rewritten.workload.as_deref(), Some("team-a/a1"));
    assert_eq!(rewritten.outcome, OutboundOutcome::Service);
    assert_eq!(rewritten.orig_dst, Some("203.0.113.10:80".parse().unwrap()));
    assert_eq!(
        rewritten.endpoint,
        Some("198.51.100.20:80".parse().unwrap())
    );
    assert_eq!((rewritten.bytes_sent, rewritten.bytes_received), (77, 320));
    assert_eq!(rewritten.duration, None, "the open's time went with it");
    // A socket left alone kept nothing: the pod is the one at the client address.
    let mut alone = close(2);
    (alone.outcome, alone.cgroup) = (OUTCOME_LEFT_ALONE, 0);
    (alone.dst, alone.endpoint) = (key("192.0.2.7"), key("192.0.2.7"));
    let alone = one(&mut joiner, Raw::Close(alone), Some(&names));
    assert_eq!(alone.workload.as_deref(), Some("team-a/a1"));
    assert_eq!(alone.outcome, OutboundOutcome::Passthrough);
    assert_eq!(alone.orig_dst, Some("192.0.2.7:80".parse().unwrap()));
    // Once only; and a socket whose open this agent never saw is not its to record.
    assert!(join(&mut joiner, Raw::Close(close(2)), Some(&names)).is_empty());
    assert!(join(&mut joiner, Raw::Close(close(u64::MAX)), Some(&names)).is_empty());
    // The newest opens are still joined.
    let last = one(
        &mut joiner,
        Raw::Close(close(OPEN_JOINED as u64)),
        Some(&names),
    );
    assert_eq!(last.duration, Some(Duration::from_millis(3)));
}

#[test]
fn a_cgroup_the_tables_do_not_name_and_a_kind_never_written_are_handled() {
    let mut joiner = Joiner::new();
    let mut stranger = open(11);
    stranger.cgroup = 1;
    let record = one(&mut joiner, Raw::Open(stranger), Some(&names(WORLD)));
    assert_eq!((record.workload, record.namespace), (None, None));
    let before_tables = one(&mut joiner, Raw::Open(open(13)), None);
    assert_eq!(before_tables.service, None);

    assert!(matches!(Raw::read(&bytes(&open(1))), Some(Raw::Open(r)) if r == open(1)));
    assert!(matches!(Raw::read(&bytes(&close(1))), Some(Raw::Close(r)) if r == close(1)));
    let mut unknown = bytes(&open(1));
    unknown[0] = 0;
    assert!(Raw::read(&unknown).is_none());
    let short = bytes(&close(1));
    assert!(Raw::read(&short[..size_of::<OpenRecord>()]).is_none());
    assert!(Raw::read(&[]).is_none());
}

#[test]
fn the_bytes_are_the_applications_without_the_syn_and_the_fins_the_state_says_were_counted() {
    let closed = |last_state, sent, received| {
        let mut r = close(1);
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
    // Shown as the flag takes it (the configuration in force).
    for value in [
        KernelRecords::Off,
        KernelRecords::All,
        KernelRecords::OneIn(20),
    ] {
        assert_eq!(parse(&value.to_string()), Ok(value));
    }
    assert_eq!(KernelRecords::OneIn(20).to_string(), "1/20");
}
