//! The effective sidecar `exportTo`: the declared scope capped by the visibility, never widened.
use crate::config::Visibility;

/// `declared` is the entry's `exportTo` (an empty list counts as unset), `mesh_default` the mesh's
/// `defaultServiceExportTo`; without either the scope is `*`. The cap applies only when the feature is
/// configured with `applyToSidecars`; otherwise sidecars keep the declared scope.
pub(crate) fn sidecar_export_to(
    declared: Option<&[String]>,
    mesh_default: Option<&[String]>,
    namespace: &str,
    visibility: Visibility,
    cap: bool,
) -> Vec<String> {
    let declared: Vec<String> = declared
        .filter(|d| !d.is_empty())
        .or(mesh_default.filter(|d| !d.is_empty()))
        .map_or_else(|| vec!["*".to_string()], <[String]>::to_vec);
    if !cap || is_private(&declared) {
        return declared;
    }
    match visibility {
        Visibility::Public => declared,
        Visibility::Namespace => {
            let reaches_own = declared
                .iter()
                .any(|e| e == "*" || e == "." || e == namespace);
            vec![if reaches_own { "." } else { "~" }.to_string()]
        }
        Visibility::None => vec!["~".to_string()],
    }
}

fn is_private(scope: &[String]) -> bool {
    scope.len() == 1 && scope[0] == "~"
}
