//! The typed, validated resources: what the rest of the agent reads. Built only by the loader.
use std::{
    borrow::Cow,
    collections::BTreeMap,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Serialize;

use super::{Timestamp, error::ConfigError, labels::Labels, mesh::MeshConfig};

/// The label every namespace carries, set by Kubernetes itself.
pub(crate) const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
pub(crate) const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";
pub(crate) const DEFAULT_NAMESPACE: &str = "default";

/// Everything loaded from one configuration directory. Each object is shared (`Arc`), so a model
/// is copied, and built again from a watch's store, without copying an object.
#[derive(Debug, Clone, Default)]
pub struct Model {
    /// Declared namespaces and every namespace an object lives in, by name.
    pub namespaces: BTreeMap<String, Namespace>,
    /// Sorted by `namespace/name`.
    pub service_entries: Vec<Arc<ServiceEntry>>,
    /// Kubernetes Services, sorted by `namespace/name`.
    pub services: Vec<Arc<KubeService>>,
    /// Pods and WorkloadEntries, sorted by kind then `namespace/name`.
    pub workloads: Vec<Arc<Workload>>,
    /// EndpointSlices, sorted by `namespace/name`; only the Kubernetes API gives them.
    pub endpoint_slices: Vec<Arc<EndpointSlice>>,
    /// Sorted by `namespace/name`.
    pub(crate) authorization_policies: Vec<Arc<super::AuthorizationPolicy>>,
    /// Sorted by `namespace/name`.
    pub(crate) peer_authentications: Vec<Arc<super::PeerAuthentication>>,
    /// Pods of other nodes that no selector of their namespace can pick (only an agent given its
    /// node has them): addresses a connection may reach a workload at, not clients, not endpoints.
    pub pods_elsewhere: super::PodsElsewhere,
    pub mesh: MeshConfig,
    pub cluster_domain: String,
    /// With HBONE between nodes, the node this agent serves: the Pods of any other node are
    /// reached over HBONE. Set by the agent, never read from the cluster.
    pub hbone_node: Option<String>,
}

impl Model {
    /// The labels of a namespace; one that nothing declares still carries its name label.
    pub fn namespace_labels(&self, name: &str) -> Cow<'_, Labels> {
        match self.namespaces.get(name) {
            Some(ns) => Cow::Borrowed(&ns.labels),
            None => Cow::Owned(Namespace::implicit(name).labels),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    pub name: String,
    /// Always holds `kubernetes.io/metadata.name: <name>`.
    pub labels: Labels,
    /// False for a namespace that objects live in but no manifest declares.
    pub declared: bool,
}

impl Namespace {
    pub fn implicit(name: &str) -> Self {
        Namespace {
            name: name.to_string(),
            labels: Labels::from([(NAMESPACE_NAME_LABEL.to_string(), name.to_string())]),
            declared: false,
        }
    }
}

/// The metadata the agent uses, plus the file the object came from (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub name: String,
    pub namespace: String,
    pub labels: Labels,
    pub creation_timestamp: Option<Timestamp>,
    /// `metadata.uid`: for a Pod, what ties it to its cgroup on the node (see `identity`).
    pub uid: Option<uuid::Uuid>,
    pub file: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntry {
    pub meta: ObjectMeta,
    pub hosts: Vec<Host>,
    pub addresses: Vec<Address>,
    pub ports: Vec<ServiceEntryPort>,
    pub location: Location,
    pub resolution: Resolution,
    pub endpoints: Vec<ServiceEntryEndpoint>,
    pub workload_selector: Option<Labels>,
    /// As declared; `None` when the field is absent.
    pub export_to: Option<Vec<String>>,
    /// The entry's own `istio.io/use-waypoint` (+ `-namespace`) labels. Without them the entry
    /// inherits its namespace's (see `visibility`).
    pub use_waypoint: UseWaypoint,
    /// `status.addresses`: what Istio's allocator gave each host, only those inside its ranges
    /// ([`ALLOCATION_V4`], [`ALLOCATION_V6`]). Used instead of an allocation of the agent's own,
    /// so every proxy of the mesh answers the same address.
    pub status_addresses: Vec<StatusAddress>,
    /// One error per `status.addresses` value refused (outside those ranges, not an IP, or
    /// without a host): never used. The entry is kept (the control plane writes status, not the
    /// entry's author); these are reported with the address pool's errors, for as long as the
    /// entry is in force (`visibility::allocation_errors`).
    pub refused_status: Vec<ConfigError>,
}

/// The range Istio's allocator gives IPv4 addresses from (`status.addresses`), and the agent's own.
pub(crate) const ALLOCATION_V4: Ipv4Net = match Ipv4Net::new(Ipv4Addr::new(240, 240, 0, 0), 16) {
    Ok(net) => net,
    Err(_) => panic!("valid prefix"),
};
/// The range Istio's allocator gives IPv6 addresses from (`status.addresses`), and the agent's own.
pub(crate) const ALLOCATION_V6: Ipv6Net =
    match Ipv6Net::new(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0), 48) {
        Ok(net) => net,
        Err(_) => panic!("valid prefix"),
    };

/// Whether `ip` lies in one of Istio's allocation ranges, as written: an IPv4-mapped IPv6
/// address (`::ffff:240.240.0.1`) is no address its allocator writes.
pub(crate) fn in_allocation_ranges(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => ALLOCATION_V4.contains(&v4),
        IpAddr::V6(v6) => ALLOCATION_V6.contains(&v6),
    }
}

/// One address of `status.addresses`, for one host (as written: `*.example.com` for a wildcard).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusAddress {
    pub host: String,
    /// Always inside [`ALLOCATION_V4`] or [`ALLOCATION_V6`].
    pub ip: IpAddr,
}

/// What an object's waypoint labels say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UseWaypoint {
    /// No `istio.io/use-waypoint` label: the namespace's labels decide.
    Unset,
    /// `istio.io/use-waypoint: none`: no waypoint, whatever the namespace says.
    Opted,
    Use(WaypointRef),
}

/// A host name, stored lower case. A wildcard keeps only the suffix after `*.`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Host {
    Exact(String),
    Wildcard(String),
    /// A partial wildcard such as `*x` or `*foo.example.com`, kept whole: Istio accepts it (with a
    /// warning), but it is no DNS name or domain, so the agent never answers for it.
    Partial(String),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Exact(h) | Host::Partial(h) => f.write_str(h),
            Host::Wildcard(suffix) => write!(f, "*.{suffix}"),
        }
    }
}

/// A `spec.addresses` entry. A prefix of full length (`/32`, `/128`) is an exact address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Address {
    Ip(IpAddr),
    Cidr(IpNet),
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Ip(ip) => write!(f, "{ip}"),
            Address::Cidr(net) => write!(f, "{net}"),
        }
    }
}

impl Serialize for Address {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntryPort {
    pub number: u16,
    pub name: Option<String>,
    pub protocol: Option<String>,
    pub target_port: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Location {
    #[default]
    MeshExternal,
    MeshInternal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resolution {
    /// Istio's default: connections go to the address the client asked for.
    #[default]
    None,
    Static,
    Dns,
    DnsRoundRobin,
    /// A wildcard whose host name comes from each request (Envoy's dynamic forward proxy). The
    /// agent reads no request, so it resolves like `DNS`; it differs in validation and allocation.
    DynamicDns,
}

impl Resolution {
    /// Endpoints given by host name are resolved through the upstream resolver.
    pub fn resolves_names(self) -> bool {
        matches!(
            self,
            Resolution::Dns | Resolution::DnsRoundRobin | Resolution::DynamicDns
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntryEndpoint {
    pub address: WorkloadAddress,
    /// Endpoint port by service port name.
    pub ports: BTreeMap<String, u16>,
    pub labels: Labels,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EndpointAddress {
    Ip(IpAddr),
    /// Resolved through the upstream resolver when connecting (resolution `DNS`).
    Host(String),
}

/// The `address` of a ServiceEntry endpoint or a WorkloadEntry, as Istio accepts it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkloadAddress {
    Ip(IpAddr),
    /// Resolved through the upstream resolver when connecting.
    Host(String),
    /// `unix:///path` or `unix://@abstract`, as written: kept in the model, but a socket on some
    /// other machine's file system is never a destination for the node's proxy.
    Unix(String),
}

impl WorkloadAddress {
    /// Where the node's proxy can connect; `None` for a unix socket.
    pub fn reachable(&self) -> Option<EndpointAddress> {
        match self {
            WorkloadAddress::Ip(ip) => Some(EndpointAddress::Ip(*ip)),
            WorkloadAddress::Host(name) => Some(EndpointAddress::Host(name.clone())),
            WorkloadAddress::Unix(_) => None,
        }
    }
}

impl fmt::Display for WorkloadAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadAddress::Ip(ip) => write!(f, "{ip}"),
            WorkloadAddress::Host(h) | WorkloadAddress::Unix(h) => f.write_str(h),
        }
    }
}

impl fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndpointAddress::Ip(ip) => write!(f, "{ip}"),
            EndpointAddress::Host(h) => f.write_str(h),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WaypointRef {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for WaypointRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A Kubernetes Service (`v1`). Always PUBLIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeService {
    pub meta: ObjectMeta,
    /// Empty for a headless Service (`clusterIP: None`).
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    pub selector: Option<Labels>,
}

impl KubeService {
    pub fn hostname(&self, cluster_domain: &str) -> String {
        format!(
            "{}.{}.svc.{cluster_domain}",
            self.meta.name, self.meta.namespace
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub port: u16,
    pub name: Option<String>,
    pub protocol: Option<String>,
    pub target_port: TargetPort,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    /// A container port name, looked up on each selected pod.
    Name(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum WorkloadKind {
    Pod,
    WorkloadEntry,
}

/// A Pod or a WorkloadEntry: a client (its namespace is the client namespace) and an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub meta: ObjectMeta,
    pub ips: Vec<IpAddr>,
    pub node_name: Option<String>,
    /// The service account its workload identity names (`spec.serviceAccountName` of a Pod,
    /// `default` when unset as Kubernetes sets it; `spec.serviceAccount` of a WorkloadEntry).
    /// `None` for a Pod of another node, whose identity this node never presents.
    pub service_account: Option<String>,
    /// Named ports: container ports of a Pod, `spec.ports` of a WorkloadEntry.
    pub ports: BTreeMap<String, u16>,
    /// A WorkloadEntry's `spec.address` when it is not an IP (a host name or a unix socket);
    /// `None` for Pods and for a WorkloadEntry with only a `network`.
    pub other_address: Option<WorkloadAddress>,
    /// What Istio's telemetry names the workload (a Deployment's Pods after the Deployment, see
    /// `docs/observability.md#istio-metrics`), when that is not the object's own name.
    pub workload_name: Option<Arc<str>>,
    /// A Pod with a data plane of its own, never enrolled in ambient mode: an Istio sidecar (the
    /// `sidecar.istio.io/status` annotation) or the node's network (`hostNetwork`).
    pub never_enrolled: bool,
}

/// Istio's label for a pod the data plane must not capture; `none` opts out.
pub(crate) const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";

/// The annotation Istio's sidecar injector sets on a Pod it gave a sidecar.
pub(crate) const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

/// Istio's label on a Namespace or a Pod enrolling it in ambient mode (`ambient`).
pub(crate) const DATAPLANE_AMBIENT: &str = "ambient";

/// Whether a Pod is in the ambient mesh, as Istio decides it: its namespace or itself labelled
/// `istio.io/dataplane-mode: ambient`, not opted out with `none`, and no data plane of its own
/// (`docs/data-plane.md#who-is-in-the-mesh`).
pub(crate) fn enrolled(pod_labels: &Labels, never_enrolled: bool, namespace_ambient: bool) -> bool {
    let labelled_ambient = pod_labels
        .get(DATAPLANE_MODE_LABEL)
        .is_some_and(|mode| mode == DATAPLANE_AMBIENT);
    !never_enrolled && !opts_out_of_capture(pod_labels) && (namespace_ambient || labelled_ambient)
}

impl Workload {
    /// The workload name Istio's telemetry gives it.
    pub fn workload_name(&self) -> &str {
        self.workload_name.as_deref().unwrap_or(&self.meta.name)
    }

    /// Whether this is a Pod labelled `istio.io/dataplane-mode: none`: the programs leave its
    /// processes alone.
    pub fn opts_out_of_capture(&self) -> bool {
        self.kind == WorkloadKind::Pod && opts_out_of_capture(&self.meta.labels)
    }
}

/// Whether a Pod's `labels` opt it out of capture (`istio.io/dataplane-mode: none`).
pub(crate) fn opts_out_of_capture(labels: &Labels) -> bool {
    labels
        .get(DATAPLANE_MODE_LABEL)
        .is_some_and(|mode| mode == "none")
}

/// A Pod of another node as an agent given its node holds it: what the workload lookup and a
/// selector need, without its uid, node or age. Labels and named ports are shared by every Pod that
/// has the same (a Deployment's Pods all do), so each Pod costs little more than its name and
/// address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodElsewhere {
    pub namespace: Arc<str>,
    /// Shared by the copies a change to its namespace's group makes (see [`super::PodsElsewhere`]).
    pub name: Arc<str>,
    pub ips: Box<[IpAddr]>,
    pub labels: Arc<Labels>,
    pub ports: Arc<BTreeMap<String, u16>>,
    /// Its workload name for Istio's telemetry when not its own (shared by a Deployment's Pods).
    pub workload_name: Option<Arc<str>>,
    /// As [`Workload::never_enrolled`].
    pub never_enrolled: bool,
}

impl PodElsewhere {
    pub fn new(pod: &Workload) -> Self {
        PodElsewhere {
            namespace: pod.meta.namespace.as_str().into(),
            name: pod.meta.name.as_str().into(),
            ips: pod.ips.iter().copied().collect(),
            labels: Arc::new(pod.meta.labels.clone()),
            ports: Arc::new(pod.ports.clone()),
            workload_name: pod.workload_name.clone(),
            never_enrolled: pod.never_enrolled,
        }
    }
}

/// An EndpointSlice (`discovery.k8s.io/v1`), cut to what a Service's endpoints need. Only the
/// Kubernetes API gives them: a directory's Services take their endpoints from their selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSlice {
    pub namespace: String,
    pub name: String,
    /// The Service it belongs to (label `kubernetes.io/service-name`); empty when unlabelled.
    pub service: String,
    /// The ready endpoints, one per address.
    pub endpoints: Vec<SliceEndpoint>,
    /// `(name, port)`: the name is empty for a Service's unnamed port.
    pub ports: Vec<(String, u16)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub ip: IpAddr,
    /// The Pod behind it (`targetRef`), for dumps and explanations.
    pub pod: Option<String>,
}
