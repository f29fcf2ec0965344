//! Mesh configuration: `serviceEntryVisibility`, `defaultServiceExportTo`, `discoverySelectors`,
//! `trustDomain`, `rootNamespace`, from any of its three forms (IstioOperator `spec.meshConfig`, ConfigMap `istio` key `mesh`, `kind: MeshConfig`).
use serde::{Deserialize, Serialize};

use super::{
    convert::{self, RawEnum},
    error::Ctx,
    labels::{LabelSelector, RawLabelSelector},
};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MeshConfig {
    /// `None`: the feature is inert (every ServiceEntry PUBLIC, no VisibilityApplied condition).
    pub service_entry_visibility: Option<VisibilityConfig>,
    pub default_service_export_to: Option<Vec<String>>,
    /// Namespaces the control plane sees: when not empty, a namespace no selector matches is not
    /// discovered, and its objects do not exist for the data plane. Empty: every namespace is.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub discovery_selectors: Vec<LabelSelector>,
    pub trust_domain: Option<String>,
    /// Where mesh-wide security policies live; `None`: Istio's default, [`DEFAULT_ROOT_NAMESPACE`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_namespace: Option<String>,
    /// The file it came from; `None` when the directory holds no mesh config.
    #[serde(skip)]
    pub file: Option<String>,
}

/// Istio's root namespace when the mesh config names none.
pub(crate) const DEFAULT_ROOT_NAMESPACE: &str = "istio-system";

impl MeshConfig {
    /// The namespace whose policies without a selector apply mesh-wide.
    pub(crate) fn root_namespace(&self) -> &str {
        self.root_namespace
            .as_deref()
            .unwrap_or(DEFAULT_ROOT_NAMESPACE)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Visibility {
    Public,
    Namespace,
    None,
}

impl Visibility {
    /// The API's enum names; unspecified means PUBLIC, anything else is a configuration error.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "PUBLIC" | "VISIBILITY_UNSPECIFIED" => Some(Visibility::Public),
            "NAMESPACE" => Some(Visibility::Namespace),
            "NONE" => Some(Visibility::None),
            _ => None,
        }
    }

    /// The API's own spelling (`NAMESPACE`), as written in mesh config.
    pub fn api_name(self) -> &'static str {
        match self {
            Visibility::Public => "PUBLIC",
            Visibility::Namespace => "NAMESPACE",
            Visibility::None => "NONE",
        }
    }

    /// The status condition's spelling (`Namespace`), as `resolve` and dumps show it.
    pub fn as_str(self) -> &'static str {
        match self {
            Visibility::Public => "Public",
            Visibility::Namespace => "Namespace",
            Visibility::None => "None",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VisibilityConfig {
    pub default_visibility: Visibility,
    pub apply_to_sidecars: bool,
    pub policies: Vec<Policy>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    pub visibility: Visibility,
    pub matching_rules: Vec<MatchingRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum MatchingRule {
    NamespaceSelector(LabelSelector),
    /// A rule without a matcher this agent knows. It never matches (fails closed).
    Unrecognized,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RawMeshConfig {
    service_entry_visibility: Option<RawVisibilityConfig>,
    default_service_export_to: Option<Vec<String>>,
    discovery_selectors: Option<Vec<RawLabelSelector>>,
    trust_domain: Option<String>,
    root_namespace: Option<String>,
    /// Where each field came from, when not from the document's own mesh config (an IstioOperator's
    /// `spec.values.meshConfig.`): errors name the field the user wrote.
    #[serde(skip)]
    origin: Origin,
}

#[derive(Debug, Default, Clone, Copy)]
struct Origin {
    default_visibility: Option<&'static str>,
    policies: Option<&'static str>,
    default_service_export_to: Option<&'static str>,
    discovery_selectors: Option<&'static str>,
}

/// Where an IstioOperator's Helm values hold the mesh config.
const VALUES_MESH_CONFIG: &str = "spec.values.meshConfig.";

impl RawMeshConfig {
    /// Fills every field `self` leaves unset from `under`, field by field (lists are replaced
    /// whole, not merged): `self` wins, as `spec.meshConfig` wins over `spec.values.meshConfig`.
    fn over(mut self, under: RawMeshConfig, under_origin: &'static str) -> RawMeshConfig {
        let from_under = |mine: bool| (!mine).then_some(under_origin);
        self.service_entry_visibility = match (
            self.service_entry_visibility,
            under.service_entry_visibility,
        ) {
            (Some(mine), Some(theirs)) => {
                self.origin.default_visibility = from_under(mine.default_visibility.is_some());
                self.origin.policies = from_under(mine.policies.is_some());
                Some(RawVisibilityConfig {
                    default_visibility: mine.default_visibility.or(theirs.default_visibility),
                    apply_to_sidecars: mine.apply_to_sidecars.or(theirs.apply_to_sidecars),
                    policies: mine.policies.or(theirs.policies),
                })
            }
            (Some(mine), None) => Some(mine),
            (None, theirs) => {
                if theirs.is_some() {
                    self.origin.default_visibility = Some(under_origin);
                    self.origin.policies = Some(under_origin);
                }
                theirs
            }
        };
        if self.default_service_export_to.is_none() && under.default_service_export_to.is_some() {
            self.origin.default_service_export_to = Some(under_origin);
            self.default_service_export_to = under.default_service_export_to;
        }
        if self.discovery_selectors.is_none() && under.discovery_selectors.is_some() {
            self.origin.discovery_selectors = Some(under_origin);
            self.discovery_selectors = under.discovery_selectors;
        }
        self.trust_domain = self.trust_domain.or(under.trust_domain);
        self.root_namespace = self.root_namespace.or(under.root_namespace);
        self
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawVisibilityConfig {
    default_visibility: Option<RawEnum>,
    apply_to_sidecars: Option<bool>,
    policies: Option<Vec<RawPolicy>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPolicy {
    visibility: Option<RawEnum>,
    matching_rules: Option<Vec<RawMatchingRule>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawMatchingRule {
    namespace_selector: Option<RawLabelSelector>,
}

/// `kind: IstioOperator`: `spec.meshConfig`, merged over the Helm values' `spec.values.meshConfig`
/// (as the operator does: `spec.meshConfig` wins field by field).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawIstioOperator {
    spec: Option<RawIstioOperatorSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawIstioOperatorSpec {
    mesh_config: Option<RawMeshConfig>,
    values: Option<RawHelmValues>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawHelmValues {
    mesh_config: Option<RawMeshConfig>,
}

impl RawIstioOperator {
    pub(crate) fn into_mesh(self) -> RawMeshConfig {
        let spec = self.spec.unwrap_or_default();
        let values = spec.values.and_then(|v| v.mesh_config).unwrap_or_default();
        spec.mesh_config
            .unwrap_or_default()
            .over(values, VALUES_MESH_CONFIG)
    }
}

/// `kind: ConfigMap`: the mesh config is YAML text under `data.mesh`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawConfigMap {
    pub data: Option<std::collections::BTreeMap<String, String>>,
}

/// Istio's proto numbering of `ServiceEntryVisibility.Visibility`; unspecified means PUBLIC.
const VISIBILITIES: &[(&str, i64, Visibility)] = &[
    ("VISIBILITY_UNSPECIFIED", 0, Visibility::Public),
    ("PUBLIC", 1, Visibility::Public),
    ("NAMESPACE", 2, Visibility::Namespace),
    ("NONE", 3, Visibility::None),
];

fn parse_visibility(ctx: &mut Ctx<'_>, field: &str, value: Option<&RawEnum>) -> Option<Visibility> {
    match value {
        None => Some(Visibility::Public),
        Some(raw) => convert::enum_value(ctx, field, raw, "visibility", VISIBILITIES),
    }
}

pub(crate) fn validate_export_to(ctx: &mut Ctx<'_>, field: &str, values: &[String]) {
    if values.len() > 1 && values.iter().any(|v| v == "~") {
        ctx.error(field, "\"~\" must be the only value");
    }
}

impl RawMeshConfig {
    /// `field` is the path of the mesh config inside its document (`spec.meshConfig.`, `data.mesh.`, ``).
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>, field: &str) -> Option<MeshConfig> {
        let before = ctx.error_count();
        let origin = self.origin;
        let at = |from: Option<&str>| format!("{}serviceEntryVisibility", from.unwrap_or(field));
        let visibility = self.service_entry_visibility.map(|raw| {
            let default_visibility = parse_visibility(
                ctx,
                &format!("{}.defaultVisibility", at(origin.default_visibility)),
                raw.default_visibility.as_ref(),
            );
            let mut policies = Vec::new();
            for (i, policy) in raw.policies.unwrap_or_default().into_iter().enumerate() {
                let pat = format!("{}.policies[{i}]", at(origin.policies));
                let visibility = parse_visibility(
                    ctx,
                    &format!("{pat}.visibility"),
                    policy.visibility.as_ref(),
                );
                let mut matching_rules = Vec::new();
                for (j, rule) in policy
                    .matching_rules
                    .unwrap_or_default()
                    .into_iter()
                    .enumerate()
                {
                    let rat = format!("{pat}.matchingRules[{j}].namespaceSelector");
                    matching_rules.push(match rule.namespace_selector {
                        Some(sel) => match sel.convert(ctx, &rat) {
                            Some(sel) => MatchingRule::NamespaceSelector(sel),
                            None => MatchingRule::Unrecognized,
                        },
                        None => MatchingRule::Unrecognized,
                    });
                }
                policies.push(Policy {
                    visibility: visibility.unwrap_or(Visibility::Public),
                    matching_rules,
                });
            }
            VisibilityConfig {
                default_visibility: default_visibility.unwrap_or(Visibility::Public),
                apply_to_sidecars: raw.apply_to_sidecars.unwrap_or(false),
                policies,
            }
        });
        if let Some(export_to) = &self.default_service_export_to {
            let from = origin.default_service_export_to.unwrap_or(field);
            validate_export_to(ctx, &format!("{from}defaultServiceExportTo"), export_to);
        }
        let from = origin.discovery_selectors.unwrap_or(field);
        let discovery_selectors = self
            .discovery_selectors
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .filter_map(|(i, raw)| raw.convert(ctx, &format!("{from}discoverySelectors[{i}]")))
            .collect();
        (ctx.error_count() == before).then_some(MeshConfig {
            service_entry_visibility: visibility,
            default_service_export_to: self.default_service_export_to,
            discovery_selectors,
            trust_domain: self.trust_domain,
            root_namespace: self.root_namespace,
            file: Some(ctx.file.to_string()),
        })
    }
}
