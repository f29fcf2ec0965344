//! The DNS decision made against the state in force: what the asking pod's namespace may see. The
//! client is established as the proxy establishes its clients ([`Client`]): over TCP the kernel's
//! word on the asking process is held against the registry's; over UDP the address decides.
use std::{
    future::Future,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{Arc, OnceLock},
};

use hickory_proto::rr::Name;

use super::{
    Decide, Decision, DnsQuery, LocalAnswer,
    log::{Kind, limited},
};
use crate::{
    identity::{CgroupPods, Client, KernelView},
    live::LiveState,
    metrics::{Lookup, Metrics},
    redirect::Flows,
    state::DnsDecision,
};

/// Answers from the live snapshot; counts and logs every service hidden from the client.
pub(crate) struct VisibleNames {
    live: Arc<LiveState>,
    metrics: Arc<Metrics>,
    /// What the kernel filed for steered TCP connections and the pods' cgroups, once the programs
    /// are attached (the DNS proxy binds before).
    kernel: OnceLock<KernelSource>,
}

struct KernelSource {
    flows: Arc<dyn Flows>,
    cgroups: Arc<CgroupPods>,
}

impl VisibleNames {
    pub(crate) fn new(live: Arc<LiveState>, metrics: Arc<Metrics>) -> Self {
        VisibleNames {
            live,
            metrics,
            kernel: OnceLock::new(),
        }
    }

    /// From now on, a TCP client's connection is held against the kernel's word on its process.
    pub(crate) fn use_kernel(&self, flows: Arc<dyn Flows>, cgroups: Arc<CgroupPods>) {
        let _ = self.kernel.set(KernelSource { flows, cgroups });
    }

    /// The entry the kernel filed for the connection from `client` (taken: it is read once, and
    /// left in the map it would wait there for the next connection from that address and port).
    async fn read_kernel(&self, client: SocketAddr) -> KernelView {
        let Some(source) = self.kernel.get() else {
            return KernelView::Unknown;
        };
        let client = SocketAddr::new(client.ip().to_canonical(), client.port());
        let cgroup_id = match source.flows.take(client) {
            Ok(Some(orig)) => orig.cgroup_id,
            Ok(None) => return KernelView::Unknown,
            Err(e) => {
                limited!(Kind::FlowEntry, debug, %client, error = %e, "reading a DNS TCP client's flow entry failed");
                return KernelView::Unknown;
            }
        };
        let snapshot = self.live.snapshot_arc();
        KernelView::read(&snapshot, &source.cgroups, client.ip(), cgroup_id).await
    }
}

impl Decide for VisibleNames {
    fn decide(&self, query: &DnsQuery<'_>) -> Decision {
        let snapshot = self.live.snapshot();
        let client = Client::identify(&snapshot, query.client, query.kernel);
        if let Some(source) = self.kernel.get() {
            client.report_mismatch(&source.cgroups, &self.metrics, "DNS query over TCP");
        }
        let client_ns = client.namespace();
        let qname = query.name.to_ascii();
        let decision = snapshot.decide_dns(client_ns, &qname);
        if let Some(audit) = self.live.audit() {
            audit.dns(client_ns, || client.workload_name(), &qname, &decision);
        }
        if let Some(hidden) = decision.hidden() {
            self.metrics.clients.hidden(Lookup::Dns);
            limited!(
                Kind::Hidden,
                debug,
                client = %query.client,
                client_namespace = client_ns.unwrap_or("<unknown>"),
                service = %format_args!("{}/{}", hidden.namespace, hidden.name),
                name = %qname,
                instead = match decision {
                    DnsDecision::Answer(_) => "answered with a visible service",
                    DnsDecision::Forward { .. } => "forwarded upstream",
                },
                "service hidden from client"
            );
        }
        match decision {
            DnsDecision::Answer(answer) => {
                let cname_target = answer.cname.and_then(|target| {
                    let mut name = Name::from_ascii(target).ok()?;
                    name.set_fqdn(true);
                    Some(name)
                });
                limited!(
                    Kind::Answered,
                    debug,
                    client = %query.client,
                    client_namespace = client_ns.unwrap_or("<unknown>"),
                    name = %qname,
                    service = %format_args!("{}/{}", answer.service.namespace, answer.service.name),
                    "DNS answered"
                );
                Decision::Answer(LocalAnswer {
                    cname_target,
                    v4: answer.v4().to_vec(),
                    v6: answer.v6().to_vec(),
                })
            }
            DnsDecision::Forward { .. } => {
                limited!(
                    Kind::Forwarded,
                    debug,
                    client = %query.client,
                    client_namespace = client_ns.unwrap_or("<unknown>"),
                    name = %qname,
                    "DNS forwarded"
                );
                Decision::Forward
            }
        }
    }

    fn budget_key(&self, client: IpAddr) -> IpAddr {
        self.live.snapshot().budget_key(client)
    }

    fn known(&self, client: IpAddr) -> bool {
        self.live
            .snapshot()
            .workload_by_ip(client.to_canonical())
            .is_some()
    }

    fn kernel_view(
        &self,
        client: SocketAddr,
    ) -> Pin<Box<dyn Future<Output = KernelView> + Send + '_>> {
        Box::pin(self.read_kernel(client))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use redirect_common::{OrigDst, SockAddr};

    use super::*;
    use crate::{config::load_sources, redirect::FiledFlows, state::Snapshot};

    const UID_A: &str = "3f1c2a9e-7b4d-4c1a-9e2f-a1a1a1a1a1a1";
    const UID_B: &str = "3f1c2a9e-7b4d-4c1a-9e2f-b2b2b2b2b2b2";

    /// A kubelet-style cgroup tree with one directory per pod; removed when dropped.
    struct Tree(std::path::PathBuf);

    impl Tree {
        fn new(pods: &[&str]) -> Tree {
            let root = std::env::temp_dir().join(format!(
                "redirect-dns-identity-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            for uid in pods {
                std::fs::create_dir_all(root.join(format!("kubepods/pod{uid}"))).unwrap();
            }
            Tree(root)
        }

        /// The cgroup id (inode) of pod `uid`'s cgroup.
        fn cgroup(&self, uid: &str) -> u64 {
            std::fs::metadata(self.0.join(format!("kubepods/pod{uid}")))
                .unwrap()
                .ino()
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// team-a's pod at 10.244.1.20 and a NAMESPACE entry only team-a sees.
    fn names() -> VisibleNames {
        let yaml = format!(
            "kind: MeshConfig\nserviceEntryVisibility: {{defaultVisibility: NAMESPACE}}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {{name: web-1, namespace: team-a, uid: {UID_A}}}\nstatus: {{podIP: 10.244.1.20}}\n---\n\
             apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: api, namespace: team-a}}\n\
             spec: {{hosts: [api.example.com], addresses: [203.0.113.10], resolution: STATIC,\n\
             ports: [{{number: 80, name: http}}], endpoints: [{{address: 198.51.100.20}}]}}\n"
        );
        let model = match load_sources([("case.yaml", yaml.as_str())]) {
            Ok(model) => model,
            Err(e) => panic!("fixture does not load:\n{e}"),
        };
        let live = LiveState::new(None);
        live.apply(Snapshot::from_model(&model), Vec::new(), Vec::new());
        VisibleNames::new(live, Arc::new(Metrics::default()))
    }

    fn answered(names: &VisibleNames, client: SocketAddr, kernel: KernelView) -> bool {
        let name = Name::from_ascii("api.example.com.").unwrap();
        let query = DnsQuery {
            client: client.ip(),
            kernel,
            name: &name,
        };
        matches!(names.decide(&query), Decision::Answer(_))
    }

    fn file(flows: &FiledFlows, client: SocketAddr, cgroup_id: u64) {
        let orig = OrigDst {
            dst: SockAddr::from_socket_addr("10.96.0.10:53".parse().unwrap()),
            protocol: 6,
            cgroup_id,
            netns_cookie: 0,
        };
        flows.file(client, orig);
    }

    /// Every line a client causes, at debug level.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The flood seen at `-v`: 2,000 queries for a name only a hidden entry owns wrote two lines
    /// each (`service hidden from client`, `DNS forwarded`). Now at most 50 of each kind a second.
    #[test]
    fn a_flood_of_hidden_dns_queries_writes_at_most_50_lines_of_each_kind_a_second() {
        let names = names();
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let name = Name::from_ascii("api.example.com.").unwrap();
        let started = std::time::Instant::now();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..2_000 {
                // Not a workload: sees PUBLIC entries only, so team-a's entry is hidden.
                let query = DnsQuery {
                    client: "10.244.9.9".parse().unwrap(),
                    kernel: KernelView::Unknown,
                    name: &name,
                };
                assert_eq!(names.decide(&query), Decision::Forward);
            }
        });
        let seconds = started.elapsed().as_secs() + 1;
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let count = |needle: &str| text.lines().filter(|l| l.contains(needle)).count() as u64;
        let (hidden, forwarded) = (count("service hidden from client"), count("DNS forwarded"));
        let most = u64::from(super::super::log::PER_SECOND) * seconds;
        assert!(
            (1..=most).contains(&hidden),
            "{hidden} hidden lines:\n{text}"
        );
        assert!(
            (1..=most).contains(&forwarded),
            "{forwarded} forwarded lines"
        );
        // Each second past the first may add one summary line per kind.
        assert!(
            text.lines().count() as u64 <= 2 * (most + seconds),
            "{} lines",
            text.lines().count()
        );
        let metrics = crate::metrics::encode(&names.metrics.registry()).unwrap();
        assert!(
            metrics.contains(r#"redirect_services_hidden_total{lookup="dns"} 2000"#),
            "every hide still counted: {metrics}"
        );
    }

    /// Over TCP the DNS proxy holds the registry against the kernel as the proxy does: a process in
    /// another pod's cgroup asking from team-a's address is an unknown client.
    #[tokio::test]
    async fn a_tcp_query_from_another_pods_cgroup_gets_the_unknown_clients_view() {
        let tree = Tree::new(&[UID_A, UID_B]);
        let names = names();
        let flows = Arc::new(FiledFlows::default());
        names.use_kernel(flows.clone(), Arc::new(CgroupPods::new(tree.0.clone())));
        let client: SocketAddr = "10.244.1.20:40000".parse().unwrap();

        assert!(
            answered(&names, client, KernelView::Unknown),
            "UDP: the address decides"
        );

        file(&flows, client, tree.cgroup(UID_A));
        let own = names.read_kernel(client).await;
        assert!(answered(&names, client, own), "the pod's own cgroup");
        assert_eq!(
            names.read_kernel(client).await,
            KernelView::Unknown,
            "an entry is read once"
        );

        file(&flows, client, tree.cgroup(UID_B));
        let other = names.read_kernel(client).await;
        assert!(
            matches!(other, KernelView::Cgroup { pod: Some(_), .. }),
            "{other:?}"
        );
        assert!(!answered(&names, client, other), "another pod's cgroup");
        let text = crate::metrics::encode(&names.metrics.registry()).unwrap();
        assert!(
            text.contains("redirect_client_identity_mismatches_total 1"),
            "{text}"
        );
    }
}
