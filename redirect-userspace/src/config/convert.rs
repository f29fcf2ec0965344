//! Field checks shared by every kind: metadata, ports, addresses, host names.
use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;
use uuid::Uuid;

use super::{
    Timestamp,
    error::Ctx,
    labels::Labels,
    model::{Address, DEFAULT_NAMESPACE, Host, ObjectMeta},
};

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RawMeta {
    pub name: Option<String>,
    pub namespace: Option<String>,
    pub labels: Option<Labels>,
    pub creation_timestamp: Option<String>,
    pub uid: Option<String>,
}

/// Checks `metadata`; a namespaced object without a namespace lands in `default`, as with kubectl.
pub(crate) fn meta(ctx: &mut Ctx<'_>, raw: Option<RawMeta>, namespaced: bool) -> ObjectMeta {
    let raw = raw.unwrap_or_default();
    let name = raw.name.unwrap_or_default();
    if name.is_empty() {
        ctx.error("metadata.name", "a name is required");
    } else if !is_dns_label_or_subdomain(&name) {
        ctx.error(
            "metadata.name",
            format!("{name:?} is not a valid object name"),
        );
    }
    let namespace = if namespaced {
        let ns = raw
            .namespace
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        if !is_dns_label(&ns) {
            ctx.error(
                "metadata.namespace",
                format!("{ns:?} is not a valid namespace name"),
            );
        }
        ns
    } else {
        String::new()
    };
    let creation_timestamp = raw.creation_timestamp.and_then(|text| {
        // RFC 3339 with an offset (`Z` or `±hh:mm`), as the API server writes it.
        let ts = text.parse::<Timestamp>().ok();
        if ts.is_none() {
            ctx.error(
                "metadata.creationTimestamp",
                format!("{text:?} is not an RFC 3339 time such as 2024-05-01T12:00:00Z"),
            );
        }
        ts
    });
    let uid = raw.uid.and_then(|text| {
        let uid = Uuid::try_parse(&text).ok();
        if uid.is_none() {
            ctx.error(
                "metadata.uid",
                format!("{text:?} is not a UUID such as 6b2f0e1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b"),
            );
        }
        uid
    });
    ObjectMeta {
        name,
        namespace,
        labels: raw.labels.unwrap_or_default(),
        creation_timestamp,
        uid,
        file: ctx.file.to_string(),
    }
}

/// A TCP/UDP port: 1..=65535.
pub(crate) fn port(ctx: &mut Ctx<'_>, field: &str, value: Option<i64>) -> Option<u16> {
    match value {
        None => {
            ctx.error(field, "a port number is required");
            None
        }
        Some(n) => match u16::try_from(n) {
            Ok(p) if p != 0 => Some(p),
            _ => {
                ctx.error(field, format!("port {n} is out of range 1-65535"));
                None
            }
        },
    }
}

pub(crate) fn ip(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<IpAddr> {
    text.parse().ok().or_else(|| {
        ctx.error(field, format!("{text:?} is not a valid IP address"));
        None
    })
}

/// An IP or a CIDR. A CIDR must be a network address (no host bits), as Istio validates it.
pub(crate) fn address(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<Address> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(Address::Ip(ip));
    }
    match text.parse::<IpNet>() {
        Ok(net) if net.trunc() != net => {
            ctx.error(
                field,
                format!(
                    "CIDR {text:?} has host bits set (did you mean {}?)",
                    net.trunc()
                ),
            );
            None
        }
        Ok(net) if net.prefix_len() == net.max_prefix_len() => Some(Address::Ip(net.addr())),
        Ok(net) => Some(Address::Cidr(net)),
        Err(_) => {
            ctx.error(field, format!("{text:?} is not a valid IP address or CIDR"));
            None
        }
    }
}

/// A ServiceEntry host: a DNS name, optionally with one leading `*.` label. Stored lower case.
pub(crate) fn host(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<Host> {
    let lower = text.trim_end_matches('.').to_ascii_lowercase();
    if lower == "*" {
        ctx.error(
            field,
            "a host of \"*\" alone is not allowed: name a domain (\"*.example.com\")",
        );
        return None;
    }
    let (wildcard, name) = match lower.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, lower.as_str()),
    };
    if !is_dns_name(name) {
        let hint = if name.contains('*') {
            ": a wildcard is allowed only as the whole first label (\"*.example.com\")"
        } else {
            ""
        };
        ctx.error(field, format!("{text:?} is not a valid host name{hint}"));
        return None;
    }
    Some(if wildcard {
        Host::Wildcard(name.to_string())
    } else {
        Host::Exact(name.to_string())
    })
}

/// RFC 1123 host name: labels of letters, digits and `-`, not starting or ending with `-`.
pub(crate) fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn is_dns_label_or_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::error::ConfigError;

    fn ctx(errors: &mut Vec<ConfigError>) -> Ctx<'_> {
        Ctx {
            file: "f.yaml",
            object: "ServiceEntry ns/x".into(),
            prefix: String::new(),
            errors,
        }
    }

    #[test]
    fn address_rules() {
        struct Case {
            name: &'static str,
            text: &'static str,
            want: Option<&'static str>,
        }
        let cases = [
            Case {
                name: "ipv4",
                text: "203.0.113.10",
                want: Some("203.0.113.10"),
            },
            Case {
                name: "ipv6",
                text: "2001:db8::1",
                want: Some("2001:db8::1"),
            },
            Case {
                name: "cidr v4",
                text: "198.51.100.128/25",
                want: Some("198.51.100.128/25"),
            },
            Case {
                name: "cidr v6",
                text: "2001:db8::/64",
                want: Some("2001:db8::/64"),
            },
            Case {
                name: "full-length prefix is an exact address",
                text: "203.0.113.10/32",
                want: Some("203.0.113.10"),
            },
            Case {
                name: "host bits set is an error",
                text: "198.51.100.129/25",
                want: None,
            },
            Case {
                name: "octet out of range is an error",
                text: "300.1.2.3",
                want: None,
            },
            Case {
                name: "host name is an error",
                text: "example.com",
                want: None,
            },
        ];
        for case in cases {
            let mut errors = Vec::new();
            let got = address(&mut ctx(&mut errors), "spec.addresses[0]", case.text);
            assert_eq!(
                got.map(|a| a.to_string()).as_deref(),
                case.want,
                "{}",
                case.name
            );
            assert_eq!(errors.is_empty(), case.want.is_some(), "{}", case.name);
        }
    }

    #[test]
    fn host_rules() {
        struct Case {
            name: &'static str,
            text: &'static str,
            want: Option<Host>,
        }
        let cases = [
            Case {
                name: "exact host lower-cased",
                text: "API.Example.com",
                want: Some(Host::Exact("api.example.com".into())),
            },
            Case {
                name: "leading wildcard",
                text: "*.example.com",
                want: Some(Host::Wildcard("example.com".into())),
            },
            Case {
                name: "trailing dot dropped",
                text: "api.example.com.",
                want: Some(Host::Exact("api.example.com".into())),
            },
            Case {
                name: "bare star refused",
                text: "*",
                want: None,
            },
            Case {
                name: "wildcard not leading refused",
                text: "api.*.example.com",
                want: None,
            },
            Case {
                name: "partial wildcard label refused",
                text: "api*.example.com",
                want: None,
            },
            Case {
                name: "empty label refused",
                text: "api..example.com",
                want: None,
            },
        ];
        for case in cases {
            let mut errors = Vec::new();
            let got = host(&mut ctx(&mut errors), "spec.hosts[0]", case.text);
            assert_eq!(got, case.want, "{}", case.name);
        }
    }

    #[test]
    fn port_rules() {
        for (name, value, want) in [
            ("lowest port", Some(1), Some(1)),
            ("highest port", Some(65535), Some(65535)),
            ("zero refused", Some(0), None),
            ("above range refused", Some(65536), None),
            ("negative refused", Some(-1), None),
            ("missing refused", None, None),
        ] {
            let mut errors = Vec::new();
            assert_eq!(port(&mut ctx(&mut errors), "p", value), want, "{name}");
        }
    }
}

#[cfg(test)]
mod timestamp_tests {
    use super::Timestamp;

    /// creationTimestamp is RFC 3339 with an offset, as the API server writes it; only its order matters.
    #[test]
    fn creation_timestamps_parse_as_rfc3339_with_an_offset() {
        struct Case {
            name: &'static str,
            text: &'static str,
            unix: Option<i64>,
        }
        let cases = [
            Case {
                name: "epoch",
                text: "1970-01-01T00:00:00Z",
                unix: Some(0),
            },
            Case {
                name: "api server form",
                text: "2024-05-01T12:00:00Z",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "fraction",
                text: "2024-05-01T12:00:00.5Z",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "offset",
                text: "2024-05-01T14:00:00+02:00",
                unix: Some(1_714_564_800),
            },
            Case {
                name: "leap day",
                text: "2024-02-29T00:00:00Z",
                unix: Some(1_709_164_800),
            },
            Case {
                name: "no leap day",
                text: "2023-02-29T00:00:00Z",
                unix: None,
            },
            Case {
                name: "date only",
                text: "2024-05-01",
                unix: None,
            },
            Case {
                name: "no offset",
                text: "2024-05-01T12:00:00",
                unix: None,
            },
            Case {
                name: "garbage",
                text: "yesterday at noon ok",
                unix: None,
            },
            Case {
                name: "bad hour",
                text: "2024-05-01T25:00:00Z",
                unix: None,
            },
        ];
        for case in cases {
            let parsed = case.text.parse::<Timestamp>().ok().map(|t| t.as_second());
            assert_eq!(parsed, case.unix, "{}: {:?}", case.name, case.text);
        }
        let older: Timestamp = "2024-01-01T00:00:00Z".parse().unwrap();
        let newer: Timestamp = "2024-01-01T00:00:00.000000001Z".parse().unwrap();
        assert!(older < newer);
    }
}
