//! Kubernetes label selectors (`matchLabels` + `matchExpressions`), as used by `namespaceSelector`.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::Ctx;

pub(crate) type Labels = BTreeMap<String, String>;

/// A validated label selector; all terms are ANDed. The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: Labels,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl LabelSelector {
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }
}

impl Requirement {
    /// Kubernetes semantics: `NotIn` and `DoesNotExist` match an object without the key.
    pub fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// A plain equality selector (`Service.spec.selector`, `workloadSelector.labels`). An empty one
/// selects nothing, as Kubernetes does for a Service without a selector.
pub(crate) fn selects(selector: &Labels, labels: &Labels) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RawLabelSelector {
    match_labels: Option<Labels>,
    match_expressions: Option<Vec<RawRequirement>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RawRequirement {
    key: Option<String>,
    operator: Option<String>,
    values: Option<Vec<String>>,
}

impl RawLabelSelector {
    /// Validates like the API server: known operator, values only (and always) for `In`/`NotIn`.
    pub(crate) fn convert(self, ctx: &mut Ctx<'_>, field: &str) -> Option<LabelSelector> {
        let before = ctx.error_count();
        let mut match_expressions = Vec::new();
        for (i, raw) in self
            .match_expressions
            .unwrap_or_default()
            .into_iter()
            .enumerate()
        {
            let at = format!("{field}.matchExpressions[{i}]");
            let key = match raw.key {
                Some(key) if !key.is_empty() => key,
                _ => {
                    ctx.error(format!("{at}.key"), "a key is required");
                    continue;
                }
            };
            let operator = match raw.operator.as_deref() {
                Some("In") => Operator::In,
                Some("NotIn") => Operator::NotIn,
                Some("Exists") => Operator::Exists,
                Some("DoesNotExist") => Operator::DoesNotExist,
                Some(other) => {
                    ctx.error(
                        format!("{at}.operator"),
                        format!(
                            "unknown operator {other:?}: expected In, NotIn, Exists or DoesNotExist"
                        ),
                    );
                    continue;
                }
                None => {
                    ctx.error(format!("{at}.operator"), "an operator is required");
                    continue;
                }
            };
            let values = raw.values.unwrap_or_default();
            match operator {
                Operator::In | Operator::NotIn if values.is_empty() => ctx.error(
                    format!("{at}.values"),
                    format!("operator {operator:?} needs at least one value"),
                ),
                Operator::Exists | Operator::DoesNotExist if !values.is_empty() => ctx.error(
                    format!("{at}.values"),
                    format!("operator {operator:?} takes no values"),
                ),
                _ => {}
            }
            match_expressions.push(Requirement {
                key,
                operator,
                values,
            });
        }
        (ctx.error_count() == before).then(|| LabelSelector {
            match_labels: self.match_labels.unwrap_or_default(),
            match_expressions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    #[test]
    fn selector_rules() {
        struct Case {
            name: &'static str,
            selector: LabelSelector,
            labels: Labels,
            matches: bool,
        }
        let ns = labels(&[("kubernetes.io/metadata.name", "team-a"), ("tier", "gold")]);
        let expr = |r: Requirement| LabelSelector {
            match_labels: Labels::new(),
            match_expressions: vec![r],
        };
        let cases = [
            Case {
                name: "empty selector matches everything",
                selector: LabelSelector::default(),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "matchLabels equal",
                selector: LabelSelector {
                    match_labels: labels(&[("tier", "gold")]),
                    ..Default::default()
                },
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "matchLabels different value",
                selector: LabelSelector {
                    match_labels: labels(&[("tier", "silver")]),
                    ..Default::default()
                },
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "matchLabels missing key",
                selector: LabelSelector {
                    match_labels: labels(&[("trusted", "true")]),
                    ..Default::default()
                },
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "In with value present",
                selector: expr(req("tier", Operator::In, &["gold", "silver"])),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "In with other value",
                selector: expr(req("tier", Operator::In, &["silver"])),
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "In without the key",
                selector: expr(req("zone", Operator::In, &["a"])),
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "NotIn with listed value",
                selector: expr(req("tier", Operator::NotIn, &["gold"])),
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "NotIn with other value",
                selector: expr(req("tier", Operator::NotIn, &["silver"])),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "NotIn without the key matches",
                selector: expr(req("zone", Operator::NotIn, &["a"])),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "Exists with key",
                selector: expr(req("tier", Operator::Exists, &[])),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "Exists without key",
                selector: expr(req("zone", Operator::Exists, &[])),
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "DoesNotExist with key",
                selector: expr(req("tier", Operator::DoesNotExist, &[])),
                labels: ns.clone(),
                matches: false,
            },
            Case {
                name: "DoesNotExist without key",
                selector: expr(req("zone", Operator::DoesNotExist, &[])),
                labels: ns.clone(),
                matches: true,
            },
            Case {
                name: "all terms are ANDed",
                selector: LabelSelector {
                    match_labels: labels(&[("tier", "gold")]),
                    match_expressions: vec![req("zone", Operator::Exists, &[])],
                },
                labels: ns.clone(),
                matches: false,
            },
        ];
        for case in cases {
            assert_eq!(
                case.selector.matches(&case.labels),
                case.matches,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn equality_selector_rules() {
        let pod = labels(&[("app", "web"), ("version", "v1")]);
        assert!(selects(&labels(&[("app", "web")]), &pod), "subset selects");
        assert!(
            !selects(&labels(&[("app", "db")]), &pod),
            "other value does not"
        );
        assert!(
            !selects(&Labels::new(), &pod),
            "empty selector selects nothing"
        );
    }
}
