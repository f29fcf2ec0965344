//! The entry points of the fuzz targets (`fuzz/`, run by `cargo xtask fuzz`): one function per
//! parser that reads bytes from outside the agent, each run as the agent runs it, on a fixed
//! configuration (the demo's `examples/`) and without any network. A function panics only where
//! the agent would, or where an invariant the unit tests hold breaks (said at each `assert`).
//!
//! This file is part of the crate's surface, as `lib.rs` is: it reaches its modules through
//! `super::`, from above every layer.
use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, OnceLock},
};

use bytes::Bytes;
use hickory_proto::op::Message;
use http::{Response, StatusCode};
use kube::api::DynamicObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{
    audit::Policy,
    cluster::{
        Kind,
        kinds::{ApiEntry, ApiPod, Converted},
        read_watched,
    },
    config::{Model, mesh_of, read_sources},
    dns::{Handled, VisibleNames, handle_query, max_udp_reply},
    hbone,
    identity::KernelView,
    live::LiveState,
    metrics::Metrics,
    pipeline,
    state::Snapshot,
};

/// The demo's configuration: the fixed state the DNS and audit targets decide against.
const EXAMPLES: [(&str, &str); 9] = [
    (
        "00-namespaces.yaml",
        include_str!("../../examples/00-namespaces.yaml"),
    ),
    (
        "01-mesh-config.yaml",
        include_str!("../../examples/01-mesh-config.yaml"),
    ),
    (
        "10-workloads.yaml",
        include_str!("../../examples/10-workloads.yaml"),
    ),
    (
        "20-kubernetes-services.yaml",
        include_str!("../../examples/20-kubernetes-services.yaml"),
    ),
    (
        "30-team-a.yaml",
        include_str!("../../examples/30-team-a.yaml"),
    ),
    (
        "31-team-b.yaml",
        include_str!("../../examples/31-team-b.yaml"),
    ),
    (
        "32-team-c.yaml",
        include_str!("../../examples/32-team-c.yaml"),
    ),
    (
        "33-istio-system.yaml",
        include_str!("../../examples/33-istio-system.yaml"),
    ),
    (
        "34-quarantine.yaml",
        include_str!("../../examples/34-quarantine.yaml"),
    ),
];

/// The examples' model and its snapshot, built once per process.
fn examples() -> &'static (Model, Arc<Snapshot>) {
    static BUILT: OnceLock<(Model, Arc<Snapshot>)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let model = read_sources(EXAMPLES).model;
        let snapshot = Arc::new(Snapshot::from_model(&model));
        (model, snapshot)
    })
}

/// Target `manifests`: one manifest file (YAML or JSON, many documents) read by the loader as a
/// reload reads a directory's file, then resolved and built into a snapshot.
pub fn manifests(data: &[u8]) {
    // The loader reads files as UTF-8 text (`config::read_file`): other bytes never reach it.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let loaded = read_sources([("fuzz.yaml", text)]);
    let built = pipeline::build(&loaded.model, loaded.errors);
    drop(built);
}

/// Target `kube_object`: one object as a watch reads it from the Kubernetes API's JSON. The first
/// byte picks the kind, the rest is the object. A Pod or a ServiceEntry is also read cut down as it
/// is parsed (`ApiPod`, `ApiEntry`): both ways must give the same object and the same errors, as
/// the `same_either_way` unit tests hold.
pub fn kube_object(data: &[u8]) {
    let Some((&pick, json)) = data.split_first() else {
        return;
    };
    let kinds = Kind::watched(true);
    let kind = kinds[usize::from(pick) % kinds.len()];
    let api_version = kind.fixed_api_version();
    let whole = serde_json::from_slice::<DynamicObject>(json)
        .ok()
        .and_then(|object| read_watched(kind, &api_version, object, false).ok());
    let slim = match kind {
        Kind::Pod | Kind::PodElsewhere => serde_json::from_slice::<ApiPod>(json)
            .ok()
            .map(|pod| pod.convert(kind, &api_version)),
        Kind::ServiceEntry => serde_json::from_slice::<ApiEntry>(json)
            .ok()
            .map(|entry| entry.convert(&api_version)),
        _ => None,
    };
    if let (Some(whole), Some(slim)) = (whole, slim) {
        same_either_way(kind, &whole, &slim, json);
    }
}

fn same_either_way(kind: Kind, whole: &Converted, slim: &Converted, json: &[u8]) {
    let text = String::from_utf8_lossy(json);
    assert_eq!(slim.object, whole.object, "{kind:?} read cut down: {text}");
    assert_eq!(slim.errors, whole.errors, "{kind:?} read cut down: {text}");
}

/// The clients the DNS target asks from: a pod of each of two namespaces, and an address no
/// workload holds.
const CLIENTS: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(10, 244, 1, 10)),
    IpAddr::V4(Ipv4Addr::new(10, 244, 2, 10)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
];

/// The DNS decision against the examples' snapshot, built once per process.
fn visible_names() -> &'static VisibleNames {
    static NAMES: OnceLock<VisibleNames> = OnceLock::new();
    NAMES.get_or_init(|| {
        let live = LiveState::new(None);
        live.apply(Snapshot::from_model(&examples().0), Vec::new(), Vec::new());
        VisibleNames::new(live, Arc::new(Metrics::default()))
    })
}

/// Target `dns_query`: one query as the DNS proxy receives it, answered against the examples'
/// snapshot. The first byte picks the client (bits 0-1) and the transport (bit 2: TCP), the rest is
/// the datagram. A reply the agent writes itself must read back as a DNS response to the same id
/// and, over UDP, fit the size the query allows.
pub fn dns_query(data: &[u8]) {
    let Some((&pick, raw)) = data.split_first() else {
        return;
    };
    let client = CLIENTS[usize::from(pick & 3) % CLIENTS.len()];
    let over_tcp = pick & 4 != 0;
    let handled = handle_query(raw, client, KernelView::Unknown, over_tcp, visible_names());
    let Handled::Reply(reply, outcome) = handled else {
        return;
    };
    let query = Message::from_vec(raw);
    let read = Message::from_vec(&reply);
    let (Ok(query), Ok(read)) = (query, read) else {
        panic!(
            "{outcome:?}: the agent's reply does not read back ({} bytes)",
            reply.len()
        );
    };
    assert_eq!(read.metadata.id, query.metadata.id, "{outcome:?}: reply id");
    if !over_tcp {
        let limit = max_udp_reply(&query);
        assert!(
            reply.len() <= limit,
            "{outcome:?}: {} > {limit} bytes",
            reply.len()
        );
    }
}

/// Target `audit_file`: the audit mesh config file (`--audit-mesh-config`) as the agent reads it,
/// and when it reads, the audit policy built from it beside the examples' enforced snapshot.
pub fn audit_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mesh) = mesh_of("audit.yaml", text) else {
        return;
    };
    let (model, enforced) = examples();
    let policy = Policy::build(mesh.service_entry_visibility.as_ref(), model, enforced);
    drop(policy);
}

/// The Pod dialled in the HBONE target: the only address its streams may reach.
const DIALLED: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 244, 1, 20));

/// The client connection preface every HTTP/2 connection opens with.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Target `hbone_request`: the HTTP/2 frames a peer sends on an HBONE connection after the
/// preface, served with the receiving side's settings; each request accepted is checked as a
/// stream's `CONNECT` is (`proxy::connect_target`) and answered.
pub fn hbone_request(data: &[u8]) {
    thread_local! {
        static RUNTIME: Option<tokio::runtime::Runtime> =
            tokio::runtime::Builder::new_current_thread().enable_all().build().ok();
    }
    RUNTIME.with(|runtime| {
        if let Some(runtime) = runtime {
            runtime.block_on(serve_frames(data));
        }
    });
}

async fn serve_frames(data: &[u8]) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let (mut from_server, mut to_server) = tokio::io::split(client);
    let peer = async move {
        let _ = to_server.write_all(PREFACE).await;
        let _ = to_server.write_all(data).await;
        let _ = to_server.shutdown().await;
        let mut answered = Vec::new();
        let _ = from_server.read_to_end(&mut answered).await;
    };
    let serve = async move {
        let mut builder = hbone::server_builder();
        builder.max_frame_size(crate::proxy::RECEIVED_FRAME);
        let Ok(mut connection) = builder.handshake::<_, Bytes>(server).await else {
            return;
        };
        while let Some(Ok((request, mut respond))) = connection.accept().await {
            let code = match crate::proxy::connect_target(&request, DIALLED) {
                Some(target) => {
                    assert_eq!(target.ip().to_canonical(), DIALLED);
                    assert_ne!(target.port(), hbone::PORT);
                    StatusCode::OK
                }
                None => StatusCode::BAD_REQUEST,
            };
            let mut response = Response::new(());
            *response.status_mut() = code;
            let _ = respond.send_response(response, true);
        }
    };
    tokio::join!(peer, serve);
}
