//! EndpointSlices (`discovery.k8s.io/v1`): where a Kubernetes Service's endpoints come from on a
//! cluster. Read from the API only; a directory's Services keep taking theirs from their selector.

use serde::Deserialize;

use super::{
    convert::{self, RawMeta},
    error::Ctx,
    model::{EndpointSlice, SliceEndpoint},
};

/// The label naming the Service a slice belongs to.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RawEndpointSlice {
    metadata: Option<RawMeta>,
    address_type: Option<String>,
    endpoints: Option<Vec<RawEndpoint>>,
    ports: Option<Vec<RawEndpointPort>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawEndpoint {
    addresses: Option<Vec<String>>,
    conditions: Option<RawConditions>,
    target_ref: Option<RawTargetRef>,
}

#[derive(Debug, Default, Deserialize)]
struct RawConditions {
    ready: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct RawTargetRef {
    kind: Option<String>,
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawEndpointPort {
    name: Option<String>,
    port: Option<i64>,
}

impl RawEndpointSlice {
    /// Keeps the ready endpoints' addresses and the ports by name; `None` when a field is invalid.
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<EndpointSlice> {
        let before = ctx.error_count();
        let meta = convert::meta(ctx, self.metadata, true);
        let service = meta
            .labels
            .get(SERVICE_NAME_LABEL)
            .cloned()
            .unwrap_or_default();
        let mut ports = Vec::new();
        for (i, raw) in self.ports.unwrap_or_default().into_iter().enumerate() {
            // A port without a number means "all ports": nothing this proxy can connect to.
            if raw.port.is_none() {
                continue;
            }
            if let Some(number) = convert::port(ctx, &format!("ports[{i}].port"), raw.port) {
                ports.push((raw.name.unwrap_or_default(), number));
            }
        }
        let ip_family = match self.address_type.as_deref() {
            Some("IPv4") => Some(false),
            Some("IPv6") => Some(true),
            // FQDN slices are deprecated and name hosts, not addresses: none of their endpoints is kept.
            Some("FQDN") => None,
            other => {
                ctx.error(
                    "addressType",
                    format!("expected IPv4, IPv6 or FQDN, got {:?}", other.unwrap_or("")),
                );
                None
            }
        };
        let mut endpoints = Vec::new();
        if let Some(v6) = ip_family {
            for (e, raw) in self.endpoints.unwrap_or_default().into_iter().enumerate() {
                // Kubernetes: a missing `ready` means ready.
                let ready = raw.conditions.unwrap_or_default().ready.unwrap_or(true);
                let pod = raw
                    .target_ref
                    .filter(|t| t.kind.as_deref() == Some("Pod"))
                    .and_then(|t| t.name);
                for (a, text) in raw.addresses.unwrap_or_default().iter().enumerate() {
                    let field = format!("endpoints[{e}].addresses[{a}]");
                    let Some(ip) = convert::ip(ctx, &field, text) else {
                        continue;
                    };
                    if ip.is_ipv6() != v6 {
                        ctx.error(field, format!("{ip} is not of the slice's addressType"));
                        continue;
                    }
                    if ready {
                        endpoints.push(SliceEndpoint {
                            ip,
                            pod: pod.clone(),
                        });
                    }
                }
            }
        }
        (ctx.error_count() == before).then_some(EndpointSlice {
            namespace: meta.namespace,
            name: meta.name,
            service,
            endpoints,
            ports,
        })
    }
}
