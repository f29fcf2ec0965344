//! A running agent's rule for what a load left out: the last good version of each such object stays
//! in force. Identity is kind, namespace and name.
use std::collections::HashSet;

use super::{
    loader::{Loaded, MESH_KINDS, complete},
    model::{Model, WorkloadKind},
};

type Id<'a> = (&'static str, &'a str, &'a str);

/// Puts back into `loaded.model` the version in `previous` of every object that `loaded` left out:
/// an object whose new version is invalid, any object last read from a file that could not be read
/// to its end (its new content is unknown), and the mesh config when the new one is invalid. An
/// object that is new and invalid stays out; one deleted from a good file stays deleted. Marks
/// each rejection whose last good version is in force.
pub fn keep_last_good(loaded: &mut Loaded, previous: &Model) {
    let rejected: HashSet<Id<'_>> = loaded
        .rejected
        .iter()
        .map(|r| (r.kind, r.namespace.as_str(), r.name.as_str()))
        .collect();
    let broken: HashSet<&str> = loaded
        .rejected
        .iter()
        .filter(|r| r.kind == "File")
        .map(|r| r.file.as_str())
        .collect();
    let everything = loaded.unreadable;
    let model = &loaded.model;
    let present: HashSet<Id<'_>> = model
        .service_entries
        .iter()
        .map(|s| {
            (
                "ServiceEntry",
                s.meta.namespace.as_str(),
                s.meta.name.as_str(),
            )
        })
        .chain(
            model
                .services
                .iter()
                .map(|s| ("Service", s.meta.namespace.as_str(), s.meta.name.as_str())),
        )
        .chain(model.workloads.iter().map(|w| {
            (
                workload_kind(w.kind),
                w.meta.namespace.as_str(),
                w.meta.name.as_str(),
            )
        }))
        .chain(
            model
                .namespaces
                .values()
                .filter(|n| n.declared)
                .map(|n| ("Namespace", "", n.name.as_str())),
        )
        .collect();
    // Keep a previous object that is missing now when its new version was refused or its file broke.
    let keep = |id: Id<'_>, file: Option<&str>| {
        !present.contains(&id)
            && (everything
                || rejected.contains(&id)
                || file.is_none_or(|f| broken.contains(f)) && !broken.is_empty())
    };

    let mut kept: Vec<(&'static str, String, String, Option<String>)> = Vec::new();
    let entries: Vec<_> = previous
        .service_entries
        .iter()
        .filter(|s| {
            keep(
                ("ServiceEntry", &s.meta.namespace, &s.meta.name),
                Some(&s.meta.file),
            )
        })
        .cloned()
        .collect();
    let services: Vec<_> = previous
        .services
        .iter()
        .filter(|s| {
            keep(
                ("Service", &s.meta.namespace, &s.meta.name),
                Some(&s.meta.file),
            )
        })
        .cloned()
        .collect();
    let workloads: Vec<_> = previous
        .workloads
        .iter()
        .filter(|w| {
            keep(
                (workload_kind(w.kind), &w.meta.namespace, &w.meta.name),
                Some(&w.meta.file),
            )
        })
        .cloned()
        .collect();
    // A Namespace does not record its file: while any file is broken, a declared namespace that
    // went missing is kept (its labels decide visibility; dropping them could widen it).
    let namespaces: Vec<_> = previous
        .namespaces
        .values()
        .filter(|n| n.declared && keep(("Namespace", "", &n.name), None))
        .cloned()
        .collect();
    let mesh_refused = loaded.rejected.iter().any(|r| MESH_KINDS.contains(&r.kind));
    let keep_mesh = loaded.model.mesh.file.is_none()
        && previous.mesh.file.is_some()
        && (everything
            || mesh_refused
            || previous
                .mesh
                .file
                .as_deref()
                .is_some_and(|f| broken.contains(f)));

    for s in &entries {
        kept.push((
            "ServiceEntry",
            s.meta.namespace.clone(),
            s.meta.name.clone(),
            Some(s.meta.file.clone()),
        ));
    }
    for s in &services {
        kept.push((
            "Service",
            s.meta.namespace.clone(),
            s.meta.name.clone(),
            Some(s.meta.file.clone()),
        ));
    }
    for w in &workloads {
        kept.push((
            workload_kind(w.kind),
            w.meta.namespace.clone(),
            w.meta.name.clone(),
            Some(w.meta.file.clone()),
        ));
    }
    for n in &namespaces {
        kept.push(("Namespace", String::new(), n.name.clone(), None));
    }
    let model = &mut loaded.model;
    model.service_entries.extend(entries);
    model.services.extend(services);
    model.workloads.extend(workloads);
    for n in namespaces {
        model.namespaces.insert(n.name.clone(), n);
    }
    if keep_mesh {
        model.mesh = previous.mesh.clone();
    }
    complete(model);

    // Sets, so marking stays linear however many objects are in error.
    let kept_files: HashSet<&str> = kept
        .iter()
        .filter_map(|(_, _, _, f)| f.as_deref())
        .collect();
    let kept_ids: HashSet<Id<'_>> = kept
        .iter()
        .map(|(k, ns, name, _)| (*k, ns.as_str(), name.as_str()))
        .collect();
    let mesh_file = previous.mesh.file.as_deref();
    for r in &mut loaded.rejected {
        r.last_good_in_force = if r.kind == "File" {
            kept_files.contains(r.file.as_str()) || keep_mesh && mesh_file == Some(r.file.as_str())
        } else if MESH_KINDS.contains(&r.kind) {
            keep_mesh
        } else {
            kept_ids.contains(&(r.kind, r.namespace.as_str(), r.name.as_str()))
        };
    }
}

fn workload_kind(kind: WorkloadKind) -> &'static str {
    match kind {
        WorkloadKind::Pod => "Pod",
        WorkloadKind::WorkloadEntry => "WorkloadEntry",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Address, read_sources};

    const NS: &str =
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a, labels: {trusted: \"true\"}}\n";

    fn entry(name: &str, address: &str) -> String {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: team-a}}\nspec: {{hosts: [{name}.example.com], addresses: [{address}], ports: [{{number: 80, name: http}}]}}\n"
        )
    }

    const MESH: &str = "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {meshConfig: {serviceEntryVisibility: {defaultVisibility: NAMESPACE}}}\n";
    const BAD_MESH: &str = "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {meshConfig: {serviceEntryVisibility: {defaultVisibility: PRIVATE}}}\n";

    fn addresses(model: &Model, name: &str) -> Option<Vec<String>> {
        model
            .service_entries
            .iter()
            .find(|s| s.meta.name == name)
            .map(|s| s.addresses.iter().map(Address::to_string).collect())
    }

    /// The first load as the agent had it, then the second with last good versions put back.
    fn reload(first: &[(&str, &str)], second: &[(&str, &str)]) -> Loaded {
        let previous = read_sources(first.iter().copied());
        assert!(previous.errors.is_empty(), "{:?}", previous.errors);
        let mut loaded = read_sources(second.iter().copied());
        keep_last_good(&mut loaded, &previous.model);
        loaded
    }

    #[test]
    fn an_invalid_new_version_keeps_the_last_good_one_and_the_good_change_applies() {
        let (a, b) = (entry("a", "203.0.113.1"), entry("b", "203.0.113.2"));
        let (a2, b2) = (entry("a", "203.0.113.11"), entry("b", "203.0.113.0/33"));
        let loaded = reload(
            &[("0.yaml", NS), ("a.yaml", &a), ("b.yaml", &b)],
            &[("0.yaml", NS), ("a.yaml", &a2), ("b.yaml", &b2)],
        );
        assert_eq!(addresses(&loaded.model, "a").unwrap(), ["203.0.113.11"]);
        assert_eq!(addresses(&loaded.model, "b").unwrap(), ["203.0.113.2"]);
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        let [r] = loaded.rejected.as_slice() else {
            panic!("{:?}", loaded.rejected)
        };
        assert_eq!(
            (r.kind, r.name.as_str(), r.last_good_in_force),
            ("ServiceEntry", "b", true)
        );
    }

    #[test]
    fn a_new_invalid_object_is_not_applied_and_a_deleted_one_stays_deleted() {
        let a = entry("a", "203.0.113.1");
        let c = entry("c", "not-an-ip");
        let loaded = reload(
            &[("0.yaml", NS), ("a.yaml", &a)],
            &[("0.yaml", NS), ("c.yaml", &c)],
        );
        assert_eq!(
            addresses(&loaded.model, "a"),
            None,
            "deleted from a good file"
        );
        assert_eq!(addresses(&loaded.model, "c"), None, "new and invalid");
        assert!(!loaded.rejected[0].last_good_in_force);
    }

    #[test]
    fn a_file_that_no_longer_parses_keeps_what_it_held() {
        let a = entry("a", "203.0.113.1");
        let loaded = reload(
            &[("0.yaml", NS), ("a.yaml", &a)],
            &[("0.yaml", NS), ("a.yaml", "kind: [unclosed")],
        );
        assert_eq!(addresses(&loaded.model, "a").unwrap(), ["203.0.113.1"]);
        let [r] = loaded.rejected.as_slice() else {
            panic!("{:?}", loaded.rejected)
        };
        assert_eq!((r.kind, r.last_good_in_force), ("File", true));
    }

    #[test]
    fn an_invalid_mesh_config_keeps_the_last_good_one() {
        let loaded = reload(&[("mesh.yaml", MESH)], &[("mesh.yaml", BAD_MESH)]);
        let vis = loaded.model.mesh.service_entry_visibility.as_ref();
        assert!(vis.is_some(), "last good mesh config kept");
        assert!(loaded.rejected[0].last_good_in_force);
        // Deleted for real: the feature is off.
        let loaded = reload(&[("mesh.yaml", MESH)], &[]);
        assert!(loaded.model.mesh.service_entry_visibility.is_none());
    }

    /// A mesh config read while it is rewritten in place (empty), or left empty by a full disk,
    /// is not a mesh config without the feature: the last good one stays and the error is
    /// reported. A complete document without the feature still turns it off.
    #[test]
    fn an_empty_mesh_config_file_keeps_the_last_good_one_a_complete_one_without_the_feature_applies()
     {
        let a = entry("a", "203.0.113.1");
        for empty in ["", "\n", "  \n# nothing yet\n", "---\n"] {
            let loaded = reload(
                &[("mesh.yaml", MESH), ("a.yaml", &a)],
                &[("mesh.yaml", empty), ("a.yaml", &a)],
            );
            assert!(
                loaded.model.mesh.service_entry_visibility.is_some(),
                "{empty:?}: the last good mesh config stays"
            );
            let [r] = loaded.rejected.as_slice() else {
                panic!("{empty:?}: {:?}", loaded.rejected)
            };
            assert_eq!((r.kind, r.last_good_in_force), ("File", true), "{empty:?}");
            assert!(
                loaded.errors[0].message.contains("holds no document"),
                "{empty:?}: {:?}",
                loaded.errors
            );
            assert_eq!(addresses(&loaded.model, "a").unwrap(), ["203.0.113.1"]);
        }
        let without =
            "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {meshConfig: {}}\n";
        let loaded = reload(&[("mesh.yaml", MESH)], &[("mesh.yaml", without)]);
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        assert!(
            loaded.model.mesh.service_entry_visibility.is_none(),
            "a complete document that removes the feature applies"
        );
    }
}
