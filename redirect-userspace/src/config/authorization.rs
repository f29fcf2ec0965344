//! `AuthorizationPolicy` and `PeerAuthentication` (`security.istio.io` v1 and v1beta1), read as
//! written. What the node enforces of them, and how, is `authz`'s: this module only checks that an
//! object is well formed, as Istio's admission webhook does, and keeps every field the conversion
//! reads (the HTTP ones too, so the conversion can say what it dropped).
use std::collections::BTreeMap;

use serde::Deserialize;

use super::{
    convert::{RawEnum, RawMeta, meta},
    error::Ctx,
    labels::Labels,
    model::ObjectMeta,
};

/// The annotation that makes a policy a dry run: never enforced, its matches only logged.
pub(crate) const DRY_RUN_ANNOTATION: &str = "istio.io/dry-run";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AuthorizationPolicy {
    pub(crate) meta: ObjectMeta,
    /// `spec.selector.matchLabels`; `Some` of an empty map for `selector: {}` (which selects no
    /// workload).
    pub(crate) selector: Option<Labels>,
    /// `spec.targetRef` or `spec.targetRefs` is set: the policy is a waypoint's, not the node's.
    pub(crate) targets_waypoint: bool,
    pub(crate) action: AuthzAction,
    pub(crate) rules: Vec<AuthzRule>,
    /// `metadata.annotations["istio.io/dry-run"] == "true"`.
    pub(crate) dry_run: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub(crate) enum AuthzAction {
    Allow,
    Deny,
    Audit,
    Custom,
}

impl AuthzAction {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AuthzAction::Allow => "ALLOW",
            AuthzAction::Deny => "DENY",
            AuthzAction::Audit => "AUDIT",
            AuthzAction::Custom => "CUSTOM",
        }
    }
}

/// One `rules[]` entry. A `from`/`to` entry without `source`/`operation` is `None`: Istio skips
/// it, where an empty `source: {}` is a match that never holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AuthzRule {
    pub(crate) from: Vec<Option<AuthzSource>>,
    pub(crate) to: Vec<Option<AuthzOperation>>,
    pub(crate) when: Vec<AuthzCondition>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AuthzSource {
    pub(crate) principals: Vec<String>,
    pub(crate) not_principals: Vec<String>,
    pub(crate) namespaces: Vec<String>,
    pub(crate) not_namespaces: Vec<String>,
    pub(crate) service_accounts: Vec<String>,
    pub(crate) not_service_accounts: Vec<String>,
    pub(crate) ip_blocks: Vec<String>,
    pub(crate) not_ip_blocks: Vec<String>,
    /// HTTP attributes (no node enforces them): kept to be named when dropped.
    pub(crate) request_principals: Vec<String>,
    pub(crate) not_request_principals: Vec<String>,
    pub(crate) remote_ip_blocks: Vec<String>,
    pub(crate) not_remote_ip_blocks: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AuthzOperation {
    pub(crate) ports: Vec<String>,
    pub(crate) not_ports: Vec<String>,
    /// HTTP attributes (no node enforces them): kept to be named when dropped.
    pub(crate) hosts: Vec<String>,
    pub(crate) not_hosts: Vec<String>,
    pub(crate) methods: Vec<String>,
    pub(crate) not_methods: Vec<String>,
    pub(crate) paths: Vec<String>,
    pub(crate) not_paths: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AuthzCondition {
    pub(crate) key: String,
    pub(crate) values: Vec<String>,
    pub(crate) not_values: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerAuthentication {
    pub(crate) meta: ObjectMeta,
    /// `spec.selector.matchLabels`, as for an AuthorizationPolicy.
    pub(crate) selector: Option<Labels>,
    /// `spec.mtls.mode`; `Unset` when absent.
    pub(crate) mode: MtlsMode,
    /// `spec.portLevelMtls`: workload port -> mode.
    pub(crate) port_level: BTreeMap<u16, MtlsMode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub(crate) enum MtlsMode {
    Unset,
    Disable,
    Permissive,
    Strict,
}

impl MtlsMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MtlsMode::Unset => "UNSET",
            MtlsMode::Disable => "DISABLE",
            MtlsMode::Permissive => "PERMISSIVE",
            MtlsMode::Strict => "STRICT",
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawAuthorizationPolicy {
    metadata: Option<RawMetaWithAnnotations>,
    spec: Option<RawAuthorizationSpec>,
}

/// `metadata` with the annotations, which only these kinds read.
#[derive(Debug, Default, Deserialize)]
struct RawMetaWithAnnotations {
    #[serde(flatten)]
    meta: RawMeta,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawAuthorizationSpec {
    selector: Option<RawSelector>,
    target_ref: Option<serde_yaml_ng::Value>,
    target_refs: Option<Vec<serde_yaml_ng::Value>>,
    action: Option<RawEnum>,
    provider: Option<serde_yaml_ng::Value>,
    rules: Option<Vec<Option<RawRule>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSelector {
    match_labels: Option<Labels>,
}

#[derive(Debug, Default, Deserialize)]
struct RawRule {
    from: Option<Vec<RawFrom>>,
    to: Option<Vec<RawTo>>,
    when: Option<Vec<RawCondition>>,
}

#[derive(Debug, Default, Deserialize)]
struct RawFrom {
    source: Option<RawSource>,
}

#[derive(Debug, Default, Deserialize)]
struct RawTo {
    operation: Option<RawOperation>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSource {
    principals: Option<Vec<String>>,
    not_principals: Option<Vec<String>>,
    namespaces: Option<Vec<String>>,
    not_namespaces: Option<Vec<String>>,
    service_accounts: Option<Vec<String>>,
    not_service_accounts: Option<Vec<String>>,
    ip_blocks: Option<Vec<String>>,
    not_ip_blocks: Option<Vec<String>>,
    request_principals: Option<Vec<String>>,
    not_request_principals: Option<Vec<String>>,
    remote_ip_blocks: Option<Vec<String>>,
    not_remote_ip_blocks: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawOperation {
    ports: Option<Vec<String>>,
    not_ports: Option<Vec<String>>,
    hosts: Option<Vec<String>>,
    not_hosts: Option<Vec<String>>,
    methods: Option<Vec<String>>,
    not_methods: Option<Vec<String>>,
    paths: Option<Vec<String>>,
    not_paths: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawCondition {
    key: Option<String>,
    values: Option<Vec<String>>,
    not_values: Option<Vec<String>>,
}

impl RawAuthorizationPolicy {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<AuthorizationPolicy> {
        let before = ctx.error_count();
        let raw_meta = self.metadata.unwrap_or_default();
        let dry_run = raw_meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(DRY_RUN_ANNOTATION))
            .is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let meta = meta(ctx, Some(raw_meta.meta), true);
        let spec = self.spec.unwrap_or_default();
        let targets_waypoint =
            spec.target_ref.is_some() || spec.target_refs.as_ref().is_some_and(|t| !t.is_empty());
        if targets_waypoint && spec.selector.is_some() {
            ctx.error(
                "spec.selector",
                "selector and targetRef(s) cannot both be set",
            );
        }
        let action = match spec.action {
            None => AuthzAction::Allow,
            Some(RawEnum::Name(name)) => match name.as_str() {
                "ALLOW" => AuthzAction::Allow,
                "DENY" => AuthzAction::Deny,
                "AUDIT" => AuthzAction::Audit,
                "CUSTOM" => AuthzAction::Custom,
                other => {
                    ctx.error(
                        "spec.action",
                        format!("{other:?} is not an action: ALLOW, DENY, AUDIT or CUSTOM"),
                    );
                    AuthzAction::Allow
                }
            },
            Some(RawEnum::Number(n)) => match n {
                0 => AuthzAction::Allow,
                1 => AuthzAction::Deny,
                2 => AuthzAction::Audit,
                3 => AuthzAction::Custom,
                _ => {
                    ctx.error("spec.action", format!("{n} is not an action number (0-3)"));
                    AuthzAction::Allow
                }
            },
        };
        if action == AuthzAction::Custom && spec.provider.is_none() {
            ctx.error("spec.provider", "a CUSTOM policy names its provider");
        }
        let rules = spec
            .rules
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, rule)| convert_rule(ctx, &format!("spec.rules[{i}]"), rule))
            .collect();
        (ctx.error_count() == before).then_some(AuthorizationPolicy {
            meta,
            selector: spec.selector.map(|s| s.match_labels.unwrap_or_default()),
            targets_waypoint,
            action,
            rules,
            dry_run,
        })
    }
}

fn convert_rule(ctx: &mut Ctx<'_>, at: &str, rule: Option<RawRule>) -> AuthzRule {
    let rule = rule.unwrap_or_default();
    let from = rule
        .from
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let s = f.source?;
            Some(AuthzSource {
                principals: s.principals.unwrap_or_default(),
                not_principals: s.not_principals.unwrap_or_default(),
                namespaces: s.namespaces.unwrap_or_default(),
                not_namespaces: s.not_namespaces.unwrap_or_default(),
                service_accounts: s.service_accounts.unwrap_or_default(),
                not_service_accounts: s.not_service_accounts.unwrap_or_default(),
                ip_blocks: s.ip_blocks.unwrap_or_default(),
                not_ip_blocks: s.not_ip_blocks.unwrap_or_default(),
                request_principals: s.request_principals.unwrap_or_default(),
                not_request_principals: s.not_request_principals.unwrap_or_default(),
                remote_ip_blocks: s.remote_ip_blocks.unwrap_or_default(),
                not_remote_ip_blocks: s.not_remote_ip_blocks.unwrap_or_default(),
            })
        })
        .collect();
    let to = rule
        .to
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            let o = t.operation?;
            Some(AuthzOperation {
                ports: o.ports.unwrap_or_default(),
                not_ports: o.not_ports.unwrap_or_default(),
                hosts: o.hosts.unwrap_or_default(),
                not_hosts: o.not_hosts.unwrap_or_default(),
                methods: o.methods.unwrap_or_default(),
                not_methods: o.not_methods.unwrap_or_default(),
                paths: o.paths.unwrap_or_default(),
                not_paths: o.not_paths.unwrap_or_default(),
            })
        })
        .collect();
    let mut when = Vec::new();
    for (j, c) in rule.when.unwrap_or_default().into_iter().enumerate() {
        let field = format!("{at}.when[{j}]");
        let key = c.key.unwrap_or_default();
        if key.is_empty() {
            ctx.error(format!("{field}.key"), "a condition names its key");
        }
        let values = c.values.unwrap_or_default();
        let not_values = c.not_values.unwrap_or_default();
        if values.is_empty() && not_values.is_empty() {
            ctx.error(
                field,
                format!("condition {key:?} has neither values nor notValues"),
            );
        }
        when.push(AuthzCondition {
            key,
            values,
            not_values,
        });
    }
    AuthzRule { from, to, when }
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawPeerAuthentication {
    metadata: Option<RawMeta>,
    spec: Option<RawPeerAuthenticationSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPeerAuthenticationSpec {
    selector: Option<RawSelector>,
    mtls: Option<RawMtls>,
    port_level_mtls: Option<BTreeMap<String, Option<RawMtls>>>,
}

#[derive(Debug, Default, Deserialize)]
struct RawMtls {
    mode: Option<RawEnum>,
}

impl RawPeerAuthentication {
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>) -> Option<PeerAuthentication> {
        let before = ctx.error_count();
        let meta = meta(ctx, self.metadata, true);
        let spec = self.spec.unwrap_or_default();
        let mode = mtls_mode(ctx, "spec.mtls.mode", spec.mtls);
        let mut port_level = BTreeMap::new();
        let ports = spec.port_level_mtls.unwrap_or_default();
        if !ports.is_empty() && spec.selector.is_none() {
            ctx.error(
                "spec.portLevelMtls",
                "port-level mTLS needs a workload selector (a mesh or namespace policy cannot have it)",
            );
        }
        for (port, mtls) in ports {
            let field = format!("spec.portLevelMtls.{port}");
            let Some(number) = port.parse::<u16>().ok().filter(|p| *p != 0) else {
                ctx.error(&field, format!("{port:?} is not a port number (1-65535)"));
                continue;
            };
            port_level.insert(number, mtls_mode(ctx, &format!("{field}.mode"), mtls));
        }
        (ctx.error_count() == before).then_some(PeerAuthentication {
            meta,
            selector: spec.selector.map(|s| s.match_labels.unwrap_or_default()),
            mode,
            port_level,
        })
    }
}

fn mtls_mode(ctx: &mut Ctx<'_>, field: &str, raw: Option<RawMtls>) -> MtlsMode {
    let Some(mode) = raw.and_then(|m| m.mode) else {
        return MtlsMode::Unset;
    };
    let parsed = match &mode {
        RawEnum::Name(name) => match name.as_str() {
            "UNSET" => Some(MtlsMode::Unset),
            "DISABLE" => Some(MtlsMode::Disable),
            "PERMISSIVE" => Some(MtlsMode::Permissive),
            "STRICT" => Some(MtlsMode::Strict),
            _ => None,
        },
        RawEnum::Number(n) => match n {
            0 => Some(MtlsMode::Unset),
            1 => Some(MtlsMode::Disable),
            2 => Some(MtlsMode::Permissive),
            3 => Some(MtlsMode::Strict),
            _ => None,
        },
    };
    parsed.unwrap_or_else(|| {
        let shown = match mode {
            RawEnum::Name(n) => format!("{n:?}"),
            RawEnum::Number(n) => n.to_string(),
        };
        ctx.error(
            field,
            format!("{shown} is not a mode: UNSET, DISABLE, PERMISSIVE or STRICT"),
        );
        MtlsMode::Unset
    })
}
