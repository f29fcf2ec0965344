//! Which visibility a ServiceEntry gets: ordered policies, first match wins, else the default.
use crate::config::{Labels, MatchingRule, Policy, Visibility, VisibilityConfig};

/// The visibility of a ServiceEntry living in a namespace with `namespace_labels`, and the 0-based
/// index of the policy that decided it (`None`: the default applied, or the feature is unset).
pub(crate) fn visibility_for(
    config: Option<&VisibilityConfig>,
    namespace_labels: &Labels,
) -> (Visibility, Option<usize>) {
    let Some(config) = config else {
        // Inert when unset: exactly a mesh without the feature.
        return (Visibility::Public, None);
    };
    match config
        .policies
        .iter()
        .position(|p| policy_matches(p, namespace_labels))
    {
        Some(index) => (config.policies[index].visibility, Some(index)),
        None => (config.default_visibility, None),
    }
}

/// All rules must match; an empty rule list matches everything (a catch-all policy).
pub(super) fn policy_matches(policy: &Policy, namespace_labels: &Labels) -> bool {
    policy
        .matching_rules
        .iter()
        .all(|rule| rule_matches(rule, namespace_labels))
}

fn rule_matches(rule: &MatchingRule, namespace_labels: &Labels) -> bool {
    match rule {
        MatchingRule::NamespaceSelector(selector) => selector.matches(namespace_labels),
        // A matcher this agent does not know could mean anything: fail closed.
        MatchingRule::Unrecognized => false,
    }
}
