//! The tables in the byte layout of the eBPF maps (`redirect_common::fastpath`): what the loader
//! writes into one generation of maps.
use std::collections::HashMap;

use redirect_common::fastpath as wire;

use super::{
    compile::Limits,
    tables::{AddrKey, Backends, Claim, IpKey, PortKey, Tables},
};

/// One snapshot's tables, as map entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wire {
    pub clients: HashMap<u64, u32>,
    pub exact: HashMap<wire::AddrKey, wire::Claim>,
    /// (prefix length, key bytes) -> claim.
    pub cidrs: HashMap<(u32, wire::LpmBytes), wire::Claim>,
    pub ports: HashMap<wire::PortKey, wire::Backends>,
    /// Workload address -> 1.
    pub workloads: HashMap<wire::IpKey, u8>,
    pub config: wire::Config,
}

impl Limits {
    /// The room the eBPF maps have.
    pub fn kernel() -> Limits {
        Limits {
            namespaces: wire::MAX_NAMESPACES as usize,
            clients: wire::MAX_CLIENTS as usize,
            exact: wire::MAX_EXACT as usize,
            cidrs: wire::MAX_CIDRS as usize,
            ports: wire::MAX_PORTS as usize,
            workloads: wire::MAX_WORKLOADS as usize,
        }
    }
}

impl Tables {
    pub fn wire(&self) -> Wire {
        let config = self.config();
        Wire {
            clients: self.clients.clone(),
            exact: self
                .exact
                .iter()
                .map(|(k, c)| (addr_key(k), claim(c)))
                .collect(),
            cidrs: self
                .cidrs
                .iter()
                .map(|(len, bytes, c)| ((len, *bytes), claim(c)))
                .collect(),
            ports: self
                .ports
                .iter()
                .map(|(k, b)| (port_key(k), backends(b)))
                .collect(),
            workloads: self.workloads.iter().map(|k| (ip_key(k), 1)).collect(),
            config: wire::Config {
                proxy_everything: config.proxy_everything.into(),
                workloads_incomplete: config.workloads_incomplete.into(),
                clients_incomplete: config.clients_incomplete.into(),
                _pad: 0,
            },
        }
    }
}

fn ip_key(k: &IpKey) -> wire::IpKey {
    wire::IpKey {
        family: k.family as u32,
        addr: k.addr,
    }
}

fn addr_key(k: &AddrKey) -> wire::AddrKey {
    wire::AddrKey {
        ns: k.ns,
        ip: ip_key(&k.ip),
    }
}

fn claim(c: &Claim) -> wire::Claim {
    wire::Claim {
        action: c.action as u32,
        service: c.service,
        hidden: c.hidden.unwrap_or(wire::NOT_HIDDEN),
    }
}

fn port_key(k: &PortKey) -> wire::PortKey {
    wire::PortKey {
        service: k.service,
        port: k.port,
        _pad: 0,
    }
}

fn backends(b: &Backends) -> wire::Backends {
    let mut out = wire::Backends {
        family: b.family as u32,
        count: b.count,
        endpoints: [wire::Backend::default(); wire::MAX_ENDPOINTS],
    };
    for (to, from) in out.endpoints.iter_mut().zip(&b.endpoints) {
        to.addr = from.addr;
        to.port = from.port;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lpm_bytes_of_both_sides_agree() {
        let ip = IpKey::new("2001:db8::1".parse().unwrap());
        let k = AddrKey { ns: 7, ip };
        assert_eq!(k.lpm_bytes(), addr_key(&k).lpm_bytes());
        let ip = IpKey::new("::ffff:10.0.0.1".parse().unwrap());
        let k = AddrKey { ns: 0, ip };
        assert_eq!(k.lpm_bytes(), addr_key(&k).lpm_bytes());
        assert_eq!(addr_key(&k).ip.family, wire::FAMILY_V4);
    }
}
