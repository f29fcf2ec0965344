//! What HBONE counts: tunnels opened to a peer and received from one, by result, and certificates
//! asked of the CA.
use prometheus_client::{
    encoding::EncodeLabelSet, metrics::counter::Counter, metrics::family::Family,
    registry::Registry,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Default)]
pub(crate) struct HboneMetrics {
    tunnels: Family<ResultLabel, Counter>,
    connections: Counter,
    certificates: Family<ResultLabel, Counter>,
    inbound: Family<ResultLabel, Counter>,
}

impl HboneMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "hbone_tunnels",
            "HBONE tunnels (HTTP/2 CONNECT streams) opened toward waypoints and other nodes' Pods, by result: ok, no_identity, ca_failed, connect_failed, tls_refused, peer_refused (the peer's certificate named another namespace), status (not 200)",
            self.tunnels.clone(),
        );
        registry.register(
            "hbone_connections",
            "Mutual-TLS HTTP/2 connections opened toward waypoints and other nodes (tunnels share them)",
            self.connections.clone(),
        );
        registry.register(
            "hbone_certificates",
            "Workload certificates asked of Istio's CA (--ca-address), by result: issued (an identity's first), renewed, failed (a call to the CA failed; the certificate in use is kept until it expires), expired (a tunnel or handshake refused: its identity's certificate expired and the CA has not renewed it)",
            self.certificates.clone(),
        );
        registry.register(
            "hbone_inbound",
            "HBONE received for this node's Pods (--hbone-between-nodes): streams by result ok, bad_request (not a CONNECT to the Pod dialled), connect_failed (the Pod refused), denied (its authorization policies refused the sender: 401), reset (the peer reset it while the Pod was dialled: the dial is given up), stream_limit (past 200 streams in flight on its connection, dials included: REFUSED_STREAM), fd_limit (received HBONE at its share of the descriptor budget: 503); connections by result no_workload (no Pod of this node there), no_identity, ca_failed, tls_refused (the peer's certificate was refused, or no TLS), peer_limit (past 16 from the peer's address), connection_limit (received HBONE at its share of the descriptor budget), connection_budget (the sender at its share of proxied connections), idle_closed (no stream for 60 s)",
            self.inbound.clone(),
        );
    }

    pub(crate) fn inbound(&self, result: &'static str) {
        self.inbound.get_or_create(&ResultLabel { result }).inc();
    }

    pub(crate) fn certificate(&self, result: &'static str) {
        self.certificates
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub(crate) fn tunnel(&self, result: &'static str) {
        self.tunnels.get_or_create(&ResultLabel { result }).inc();
    }

    pub(crate) fn connection(&self) {
        self.connections.inc();
    }

    #[cfg(test)]
    pub(crate) fn connections(&self) -> u64 {
        self.connections.get()
    }

    #[cfg(test)]
    pub(crate) fn certificates(&self, result: &'static str) -> u64 {
        self.certificates
            .get_or_create(&ResultLabel { result })
            .get()
    }

    #[cfg(test)]
    pub(crate) fn tunnels(&self, result: &'static str) -> u64 {
        self.tunnels.get_or_create(&ResultLabel { result }).get()
    }
}
