//! A mesh config read on its own from one file, as the audit policy is given: a Kubernetes object
//! (`MeshConfig`, an Istio `ConfigMap` with `data.mesh`, an `IstioOperator`), or the bare mesh
//! config a mounted ConfigMap's key holds (Istio's `mesh` key has no `kind`). Read by the same
//! loader as the directory, so its errors name the file, the object and the field alike.
use std::path::Path;

use super::{ConfigError, ConfigErrors, MeshConfig, read_sources};

/// The mesh config `path` holds. An error for a file that cannot be read, holds anything in error,
/// or holds no mesh config at all.
pub(crate) fn read_mesh_file(path: &Path) -> Result<MeshConfig, ConfigErrors> {
    let file = path.display().to_string();
    let refused =
        |message: String| ConfigErrors(vec![ConfigError::new(&file, None, None, message)]);
    let text = super::read_file(path, super::Limits::default().max_file_bytes).map_err(refused)?;
    mesh_of(&file, &text)
}

/// [`read_mesh_file`] on text already read.
pub(crate) fn mesh_of(file: &str, text: &str) -> Result<MeshConfig, ConfigErrors> {
    // A document without `kind` is a bare mesh config: read as the MeshConfig kind.
    let bare = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text)
        .ok()
        .is_some_and(|v| v.is_mapping() && v.get("kind").is_none());
    let wrapped;
    let text = if bare {
        wrapped = format!("kind: MeshConfig\n{text}");
        wrapped.as_str()
    } else {
        text
    };
    let loaded = read_sources([(file, text)]);
    if !loaded.errors.is_empty() {
        return Err(ConfigErrors(loaded.errors));
    }
    match loaded.model.mesh.file {
        Some(_) => Ok(loaded.model.mesh),
        None => Err(ConfigErrors(vec![ConfigError::new(
            file,
            None,
            None,
            "holds no mesh config (a MeshConfig, a ConfigMap with data.mesh, an IstioOperator, or a bare mesh config)",
        )])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Visibility;

    #[test]
    fn a_bare_mesh_config_reads_as_the_mesh_config_kind() {
        let mesh = mesh_of(
            "audit.yaml",
            "serviceEntryVisibility:\n  defaultVisibility: NAMESPACE\n",
        )
        .unwrap();
        let config = mesh.service_entry_visibility.unwrap();
        assert_eq!(config.default_visibility, Visibility::Namespace);
    }

    #[test]
    fn a_config_map_reads_from_its_mesh_key() {
        let text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: istio-system}\ndata:\n  mesh: |\n    serviceEntryVisibility:\n      defaultVisibility: NONE\n";
        let mesh = mesh_of("audit.yaml", text).unwrap();
        assert_eq!(
            mesh.service_entry_visibility.unwrap().default_visibility,
            Visibility::None
        );
    }

    #[test]
    fn a_bad_field_is_an_error_naming_file_and_field() {
        let errors = mesh_of(
            "audit.yaml",
            "serviceEntryVisibility:\n  defaultVisibility: SOMETIMES\n",
        )
        .unwrap_err();
        let e = &errors.0[0];
        assert_eq!(e.file, "audit.yaml");
        let field = e.field.as_deref().unwrap_or_default();
        assert!(field.contains("defaultVisibility"), "{e:?}");
    }

    #[test]
    fn a_file_without_a_mesh_config_is_an_error() {
        let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n";
        let errors = mesh_of("audit.yaml", text).unwrap_err();
        assert!(
            errors.0[0].message.contains("holds no mesh config"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_file_that_is_not_there_is_an_error_naming_it() {
        let errors = read_mesh_file(Path::new("/nonexistent/audit.yaml")).unwrap_err();
        assert_eq!(errors.0[0].file, "/nonexistent/audit.yaml");
    }
}
