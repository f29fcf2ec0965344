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
    /// Set when the API server made up the name (a controller's Pods): read by Pods only.
    pub generate_name: Option<String>,
    pub owner_references: Option<Vec<RawOwnerReference>>,
    /// Of the annotations, only what Pods read (every other key is skipped).
    pub annotations: Option<RawAnnotations>,
}

/// The annotations a Pod is read for.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawAnnotations {
    /// Set by Istio's sidecar injector: the Pod has a sidecar, its own data plane.
    #[serde(rename = "sidecar.istio.io/status")]
    pub sidecar_status: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawOwnerReference {
    pub kind: Option<String>,
    pub name: Option<String>,
    pub controller: Option<bool>,
}

impl RawMeta {
    /// The owner that made the object (`controller: true`), by kind and name.
    pub(crate) fn controller(&self) -> Option<(&str, &str)> {
        let owner =
            (self.owner_references.iter().flatten()).find(|o| o.controller == Some(true))?;
        Some((owner.kind.as_deref()?, owner.name.as_deref()?))
    }
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

/// An IP or a CIDR. A CIDR with host bits set is taken as its network (`192.192.192.192/24` is
/// `192.192.192.0/24`), as Istio accepts it.
pub(crate) fn address(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<Address> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(Address::Ip(ip));
    }
    match text.parse::<IpNet>() {
        Ok(net) if net.prefix_len() == net.max_prefix_len() => Some(Address::Ip(net.addr())),
        Ok(net) => Some(Address::Cidr(net.trunc())),
        Err(_) => {
            ctx.error(field, format!("{text:?} is not a valid IP address or CIDR"));
            None
        }
    }
}

/// A ServiceEntry host: a DNS name, optionally with one leading `*.` label. Stored lower case.
/// A partial wildcard (`*x`, `*foo.example.com`) is accepted with a warning, as Istio does; it
/// names no DNS name the agent answers.
pub(crate) fn host(ctx: &mut Ctx<'_>, field: &str, text: &str) -> Option<Host> {
    let lower = text.trim_end_matches('.').to_ascii_lowercase();
    if lower == "*" {
        ctx.error(
            field,
            "a host of \"*\" alone is not allowed: name a domain (\"*.example.com\")",
        );
        return None;
    }
    if let Some(rest) = lower.strip_prefix("*.") {
        if is_dns_name(rest) {
            return Some(Host::Wildcard(rest.to_string()));
        }
    } else if let Some(rest) = lower.strip_prefix('*')
        && is_dns_name(rest)
    {
        ctx.warn(
            field,
            format!("partial wildcard {text:?}: no DNS name matches it here; use \"*.{rest}\" for a domain"),
        );
        return Some(Host::Partial(lower));
    } else if is_dns_name(&lower) {
        return Some(Host::Exact(lower));
    }
    let hint = if lower.contains('*') {
        ": a wildcard is allowed only at the start (\"*.example.com\")"
    } else {
        ""
    };
    ctx.error(field, format!("{text:?} is not a valid host name{hint}"));
    None
}

/// An enum field as the API writes it: its name, or its number in Istio's protos.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RawEnum {
    Name(String),
    Number(i64),
}

impl<'de> Deserialize<'de> for RawEnum {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RawEnum;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an enum value: its name or its number")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawEnum, E> {
                Ok(RawEnum::Name(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<RawEnum, E> {
                Ok(RawEnum::Number(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<RawEnum, E> {
                Ok(RawEnum::Number(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Reads an enum by name or number from `table` (`(name, number, value)`); `what` names the field
/// in the error ("resolution").
pub(crate) fn enum_value<T: Copy>(
    ctx: &mut Ctx<'_>,
    field: &str,
    raw: &RawEnum,
    what: &str,
    table: &[(&str, i64, T)],
) -> Option<T> {
    let found = table.iter().find(|(name, number, _)| match raw {
        RawEnum::Name(text) => text == name,
        RawEnum::Number(n) => n == number,
    });
    if found.is_none() {
        let names: Vec<String> = table.iter().map(|(n, i, _)| format!("{n} ({i})")).collect();
        let given = match raw {
            RawEnum::Name(text) => format!("{text:?}"),
            RawEnum::Number(n) => n.to_string(),
        };
        ctx.error(
            field,
            format!(
                "unknown {what} {given}: expected one of {}",
                names.join(", ")
            ),
        );
    }
    found.map(|(_, _, value)| *value)
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
                // Istio's own doc example `192.192.192.192/24`: accepted as its network.
                name: "host bits set are cleared, as Istio accepts it",
                text: "198.51.100.129/25",
                want: Some("198.51.100.128/25"),
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
                name: "wildcard inside a label refused",
                text: "api*.example.com",
                want: None,
            },
            Case {
                // pkg/config/validation/testdata/crds/serviceentry-valid.yaml `partial-wildcard`.
                name: "partial wildcard accepted (Istio warns)",
                text: "*x",
                want: Some(Host::Partial("*x".into())),
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
