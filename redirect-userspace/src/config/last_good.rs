//! A running agent's rule for what a load left out: the last good version of each such object stays
//! in force. Identity is kind, namespace and name.
use std::{collections::HashSet, sync::Arc};

use super::{
    AuthorizationPolicy, PeerAuthentication,
    loader::{Loaded, MESH_KINDS, complete},
    model::{KubeService, Model, Namespace, ObjectMeta, ServiceEntry, Workload, WorkloadKind},
};

type Id<'a> = (&'static str, &'a str, &'a str);

/// The objects a model holds, or the ones kept for it: lists of the same kinds.
struct Objects {
    entries: Vec<Arc<ServiceEntry>>,
    services: Vec<Arc<KubeService>>,
    workloads: Vec<Arc<Workload>>,
    authorization: Vec<Arc<AuthorizationPolicy>>,
    peer_authentication: Vec<Arc<PeerAuthentication>>,
    /// Declared ones only: a namespace only named by its objects has nothing to keep.
    namespaces: Vec<Namespace>,
}

/// Each object of `model` (or of kept lists) with its identity and the file it was read from
/// (a Namespace records none).
fn identities<'a>(
    entries: &'a [Arc<ServiceEntry>],
    services: &'a [Arc<KubeService>],
    workloads: &'a [Arc<Workload>],
    security: Security<'a>,
    namespaces: impl Iterator<Item = &'a Namespace> + 'a,
) -> impl Iterator<Item = (Id<'a>, Option<&'a str>)> + 'a {
    let of = |kind: &'static str, meta: &'a ObjectMeta| {
        let id = (kind, meta.namespace.as_str(), meta.name.as_str());
        (id, Some(meta.file.as_str()))
    };
    let entries = entries.iter().map(move |s| of("ServiceEntry", &s.meta));
    let services = services.iter().map(move |s| of("Service", &s.meta));
    let workloads = workloads
        .iter()
        .map(move |w| of(workload_kind(w.kind), &w.meta));
    let authorization = (security.0.iter()).map(move |p| of("AuthorizationPolicy", &p.meta));
    let peer = (security.1.iter()).map(move |p| of("PeerAuthentication", &p.meta));
    let namespaces = namespaces
        .filter(|n| n.declared)
        .map(|n| (("Namespace", "", n.name.as_str()), None));
    entries
        .chain(services)
        .chain(workloads)
        .chain(authorization)
        .chain(peer)
        .chain(namespaces)
}

/// The security policies of a model, or the ones kept for it.
type Security<'a> = (
    &'a [Arc<AuthorizationPolicy>],
    &'a [Arc<PeerAuthentication>],
);

impl Objects {
    fn identities(&self) -> impl Iterator<Item = (Id<'_>, Option<&str>)> {
        identities(
            &self.entries,
            &self.services,
            &self.workloads,
            (&self.authorization, &self.peer_authentication),
            self.namespaces.iter(),
        )
    }
}

/// Puts back into `loaded.model` the version in `previous` of every object that `loaded` left out:
/// an object whose new version is invalid, any object last read from a file that could not be read
/// to its end (its new content is unknown), and the mesh config when the new one is invalid. An
/// object that is new and invalid stays out; one deleted from a good file stays deleted. Marks
/// each rejection whose last good version is in force.
pub(crate) fn keep_last_good(loaded: &mut Loaded, previous: &Model) {
    let (kept, keep_mesh) = to_keep(loaded, previous);
    let model = &mut loaded.model;
    model.service_entries.extend(kept.entries.iter().cloned());
    model.services.extend(kept.services.iter().cloned());
    model.workloads.extend(kept.workloads.iter().cloned());
    (model.authorization_policies).extend(kept.authorization.iter().cloned());
    (model.peer_authentications).extend(kept.peer_authentication.iter().cloned());
    for n in &kept.namespaces {
        model.namespaces.insert(n.name.clone(), n.clone());
    }
    if keep_mesh {
        model.mesh = previous.mesh.clone();
    }
    complete(model);

    // Sets, so marking stays linear however many objects are in error.
    let kept_files: HashSet<&str> = kept.identities().filter_map(|(_, f)| f).collect();
    let kept_ids: HashSet<Id<'_>> = kept.identities().map(|(id, _)| id).collect();
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

/// The objects of `previous` to keep, and whether its mesh config is kept: each one missing from
/// the load whose new version was refused or whose file broke.
fn to_keep(loaded: &Loaded, previous: &Model) -> (Objects, bool) {
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
    let present: HashSet<Id<'_>> = identities(
        &model.service_entries,
        &model.services,
        &model.workloads,
        (&model.authorization_policies, &model.peer_authentications),
        model.namespaces.values(),
    )
    .map(|(id, _)| id)
    .collect();
    // A Namespace does not record its file: while any file is broken, a declared namespace that
    // went missing is kept (its labels decide visibility; dropping them could widen it).
    let keep = |id: Id<'_>, file: Option<&str>| {
        !present.contains(&id)
            && (everything
                || rejected.contains(&id)
                || file.is_none_or(|f| broken.contains(f)) && !broken.is_empty())
    };
    let kept_meta = |kind: &'static str, meta: &ObjectMeta| {
        keep((kind, &meta.namespace, &meta.name), Some(&meta.file))
    };
    let kept = Objects {
        entries: (previous.service_entries.iter())
            .filter(|s| kept_meta("ServiceEntry", &s.meta))
            .cloned()
            .collect(),
        services: (previous.services.iter())
            .filter(|s| kept_meta("Service", &s.meta))
            .cloned()
            .collect(),
        workloads: (previous.workloads.iter())
            .filter(|w| kept_meta(workload_kind(w.kind), &w.meta))
            .cloned()
            .collect(),
        authorization: (previous.authorization_policies.iter())
            .filter(|p| kept_meta("AuthorizationPolicy", &p.meta))
            .cloned()
            .collect(),
        peer_authentication: (previous.peer_authentications.iter())
            .filter(|p| kept_meta("PeerAuthentication", &p.meta))
            .cloned()
            .collect(),
        namespaces: (previous.namespaces.values())
            .filter(|n| n.declared && keep(("Namespace", "", &n.name), None))
            .cloned()
            .collect(),
    };
    let mesh_refused = loaded.rejected.iter().any(|r| MESH_KINDS.contains(&r.kind));
    let previous_mesh = previous.mesh.file.as_deref();
    let keep_mesh = loaded.model.mesh.file.is_none()
        && previous_mesh.is_some()
        && (everything || mesh_refused || previous_mesh.is_some_and(|f| broken.contains(f)));
    (kept, keep_mesh)
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
