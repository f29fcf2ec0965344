//! The gateway: the address of the node that every pod reaches on its own link, at most one per
//! family. Steered IPv4 (and v4-mapped) traffic goes to the IPv4 one, IPv6 traffic to the IPv6 one;
//! a family without a gateway is left alone by the programs.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Gateways {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum GatewayError {
    #[error("--gateway: give at least one address (an IPv4 and/or an IPv6 one)")]
    None,
    #[error(
        "--gateway: {first} and {second} are both {family}; give at most one address per family"
    )]
    TwoOfAFamily {
        family: &'static str,
        first: IpAddr,
        second: IpAddr,
    },
    #[error(
        "--gateway {0}: not an address a pod can be steered to (unspecified, loopback or multicast)"
    )]
    Unusable(IpAddr),
}

impl Gateways {
    /// From the `--gateway` values: one IPv4 and/or one IPv6 address (a v4-mapped one counts as IPv4).
    pub(crate) fn from_addrs(addrs: &[IpAddr]) -> Result<Self, GatewayError> {
        let mut gateways = Gateways::default();
        for &addr in addrs {
            let addr = addr.to_canonical();
            if addr.is_unspecified() || addr.is_loopback() || addr.is_multicast() {
                return Err(GatewayError::Unusable(addr));
            }
            match addr {
                IpAddr::V4(v4) => {
                    if let Some(first) = gateways.v4.replace(v4) {
                        return Err(GatewayError::TwoOfAFamily {
                            family: "IPv4",
                            first: first.into(),
                            second: addr,
                        });
                    }
                }
                IpAddr::V6(v6) => {
                    if let Some(first) = gateways.v6.replace(v6) {
                        return Err(GatewayError::TwoOfAFamily {
                            family: "IPv6",
                            first: first.into(),
                            second: addr,
                        });
                    }
                }
            }
        }
        if gateways.v4.is_none() && gateways.v6.is_none() {
            return Err(GatewayError::None);
        }
        Ok(gateways)
    }

    /// Every configured address, IPv4 first.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = IpAddr> {
        self.v4
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.v6.map(IpAddr::V6))
    }

    /// The IPv4 gateway as the programs compare it: network byte order, 0 for none.
    pub(crate) fn v4_be(&self) -> u32 {
        self.v4.map_or(0, |ip| u32::from_ne_bytes(ip.octets()))
    }

    /// The IPv6 gateway in the programs' `user_ip6` form (network-order words), zero for none.
    pub(crate) fn v6_words(&self) -> [u32; 4] {
        let o = self.v6.map_or([0; 16], |ip| ip.octets());
        std::array::from_fn(|i| {
            u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
        })
    }
}

impl std::fmt::Display for Gateways {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<String> = self.addrs().map(|a| a.to_string()).collect();
        f.write_str(&addrs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn one_address_per_family() {
        struct Case {
            name: &'static str,
            given: &'static [&'static str],
            expect: Result<(Option<&'static str>, Option<&'static str>), &'static str>,
        }
        let cases = [
            Case {
                name: "IPv4 only",
                given: &["169.254.7.1"],
                expect: Ok((Some("169.254.7.1"), None)),
            },
            Case {
                name: "IPv6 only",
                given: &["fd00:7::1"],
                expect: Ok((None, Some("fd00:7::1"))),
            },
            Case {
                name: "both, any order",
                given: &["fd00:7::1", "169.254.7.1"],
                expect: Ok((Some("169.254.7.1"), Some("fd00:7::1"))),
            },
            Case {
                name: "a v4-mapped address is the IPv4 gateway",
                given: &["::ffff:169.254.7.1"],
                expect: Ok((Some("169.254.7.1"), None)),
            },
            Case {
                name: "two IPv4 addresses",
                given: &["169.254.7.1", "169.254.7.2"],
                expect: Err("both IPv4"),
            },
            Case {
                name: "two IPv6 addresses",
                given: &["fd00:7::1", "fd00:7::2"],
                expect: Err("both IPv6"),
            },
            Case {
                name: "none",
                given: &[],
                expect: Err("at least one"),
            },
            Case {
                name: "loopback",
                given: &["::1"],
                expect: Err("loopback"),
            },
        ];
        for case in cases {
            let got = Gateways::from_addrs(&ips(case.given));
            match (&got, case.expect) {
                (Ok(g), Ok((v4, v6))) => {
                    assert_eq!(g.v4, v4.map(|s| s.parse().unwrap()), "{}", case.name);
                    assert_eq!(g.v6, v6.map(|s| s.parse().unwrap()), "{}", case.name);
                }
                (Err(e), Err(part)) => {
                    assert!(e.to_string().contains(part), "{}: {e}", case.name)
                }
                _ => panic!("{}: got {got:?}", case.name),
            }
        }
    }

    #[test]
    fn kernel_forms() {
        let g = Gateways::from_addrs(&ips(&["169.254.7.1", "fd00:7::1"])).unwrap();
        assert_eq!(g.v4_be().to_ne_bytes(), [169, 254, 7, 1]);
        let words = g.v6_words();
        let sa = redirect_common::SockAddr::from_ip6_words(words, 0);
        assert_eq!(sa.addr, "fd00:7::1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(Gateways::default().v6_words(), [0; 4]);
    }
}
