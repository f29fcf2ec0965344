//! What Istio's telemetry calls a workload: its workload name, canonical service and canonical
//! revision, read from the object alone (nothing else is fetched), as istiod derives them for the
//! workloads it sends ztunnel. Dashboards and Kiali group traffic by these names, so a Deployment's
//! Pods must all be named after the Deployment, not after themselves.

use crate::config::Labels;

/// The label that names a workload outright, on a Pod or a WorkloadEntry.
const WORKLOAD_NAME_LABEL: &str = "service.istio.io/workload-name";
/// Where a Deployment's ReplicaSet and Pods carry the template's hash.
const POD_TEMPLATE_HASH: &str = "pod-template-hash";
/// The same for an Argo Rollout.
const ROLLOUT_TEMPLATE_HASH: &str = "rollouts-pod-template-hash";
/// OpenShift's DeploymentConfig names its ReplicationControllers' Pods with this label.
const DEPLOYMENT_CONFIG: &str = "deploymentconfig";

/// The canonical service, first label found wins; else the workload name.
const CANONICAL_SERVICE: [&str; 3] = [
    "service.istio.io/canonical-name",
    "app.kubernetes.io/name",
    "app",
];
/// The canonical revision, first label found wins; else [`LATEST`].
const CANONICAL_REVISION: [&str; 3] = [
    "service.istio.io/canonical-revision",
    "app.kubernetes.io/version",
    "version",
];
/// The revision of a workload that names none.
const LATEST: &str = "latest";

/// The ownerReference with `controller: true` of a Pod: what made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Controller<'a> {
    pub kind: &'a str,
    pub name: &'a str,
}

/// A Pod's workload name: its `service.istio.io/workload-name` label; else, for a Pod whose name
/// was generated, what its controller says of the object behind it (a Deployment through its
/// ReplicaSet, an Argo Rollout, a DeploymentConfig, a CronJob through its Job, any other
/// controller by its own name); else the Pod's name.
pub(crate) fn pod_workload<'a>(
    name: &'a str,
    generated: bool,
    labels: &'a Labels,
    controller: Option<Controller<'a>>,
) -> &'a str {
    if let Some(named) = labels.get(WORKLOAD_NAME_LABEL) {
        return named;
    }
    let Some(controller) = controller.filter(|_| generated) else {
        return name;
    };
    let label = |key: &str| {
        labels
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    };
    let made_by = match controller.kind {
        "ReplicaSet" => [POD_TEMPLATE_HASH, ROLLOUT_TEMPLATE_HASH]
            .iter()
            .find_map(|key| without_hash(controller.name, label(key)?)),
        "ReplicationController" => label(DEPLOYMENT_CONFIG),
        "Job" => cron_job(controller.name),
        _ => None,
    };
    Some(made_by.unwrap_or(controller.name))
        .filter(|n| !n.is_empty())
        .unwrap_or(name)
}

/// `<name>-<hash>` without its hash. A name that ends in the hash without the dash before it is
/// kept whole, as Istio keeps it.
fn without_hash<'a>(controller: &'a str, hash: &str) -> Option<&'a str> {
    if !controller.ends_with(hash) {
        return None;
    }
    Some(
        controller
            .strip_suffix(hash)
            .and_then(|n| n.strip_suffix('-'))
            .unwrap_or(controller),
    )
}

/// The CronJob behind a Job named `<cron job>-<8 to 10 digits>` (its scheduled time in minutes).
fn cron_job(job: &str) -> Option<&str> {
    let (name, stamp) = job.rsplit_once('-')?;
    let digits = (8..=10).contains(&stamp.len()) && stamp.bytes().all(|b| b.is_ascii_digit());
    (digits && !name.is_empty()).then_some(name)
}

/// A WorkloadEntry's workload name: the WorkloadGroup that registered it (its annotation
/// `istio.io/autoRegistrationGroup`), else its
/// `service.istio.io/workload-name` label, else its own name.
pub(crate) fn entry_workload<'a>(
    name: &'a str,
    group: Option<&'a str>,
    labels: &'a Labels,
) -> &'a str {
    group
        .filter(|g| !g.is_empty())
        .or_else(|| labels.get(WORKLOAD_NAME_LABEL).map(String::as_str))
        .unwrap_or(name)
}

/// The canonical service of a workload with these labels and this workload name.
pub(crate) fn canonical_service<'a>(labels: &'a Labels, workload: &'a str) -> &'a str {
    first_label(labels, &CANONICAL_SERVICE).unwrap_or(workload)
}

/// The canonical revision of a workload with these labels.
pub(crate) fn canonical_revision(labels: &Labels) -> &str {
    first_label(labels, &CANONICAL_REVISION).unwrap_or(LATEST)
}

fn first_label<'a>(labels: &'a Labels, keys: &[&str]) -> Option<&'a str> {
    keys.iter()
        .find_map(|key| labels.get(*key))
        .map(String::as_str)
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

    fn made_by<'a>(kind: &'a str, name: &'a str) -> Option<Controller<'a>> {
        Some(Controller { kind, name })
    }

    #[test]
    fn a_deployments_pod_is_named_after_the_deployment() {
        let l = labels(&[("app", "web"), ("pod-template-hash", "7d9f8b6c5")]);
        let rs = made_by("ReplicaSet", "curl-client-7d9f8b6c5");
        assert_eq!(
            pod_workload("curl-client-7d9f8b6c5-x2k4p", true, &l, rs),
            "curl-client"
        );
        // A name the Pod chose itself is kept, whatever owns it.
        assert_eq!(pod_workload("fixed", false, &l, rs), "fixed");
        // A ReplicaSet whose name does not end in the hash is a workload of its own.
        let bare_rs = made_by("ReplicaSet", "hand-made");
        assert_eq!(
            pod_workload("hand-made-abcde", true, &l, bare_rs),
            "hand-made"
        );
        // Ending in the hash without the dash: kept whole, as upstream keeps it.
        let glued = made_by("ReplicaSet", "web7d9f8b6c5");
        assert_eq!(
            pod_workload("web7d9f8b6c5-q", true, &l, glued),
            "web7d9f8b6c5"
        );
    }

    #[test]
    fn rollouts_deployment_configs_cron_jobs_and_other_controllers() {
        let rollout = labels(&[("rollouts-pod-template-hash", "6b8d")]);
        let rs = made_by("ReplicaSet", "canary-6b8d");
        assert_eq!(pod_workload("canary-6b8d-zz", true, &rollout, rs), "canary");

        let dc = labels(&[("deploymentconfig", "frontend")]);
        let rc = made_by("ReplicationController", "frontend-3");
        assert_eq!(pod_workload("frontend-3-abc", true, &dc, rc), "frontend");
        let no_dc = made_by("ReplicationController", "legacy");
        assert_eq!(
            pod_workload("legacy-abc", true, &Labels::new(), no_dc),
            "legacy"
        );

        let none = Labels::new();
        let job = made_by("Job", "backup-28950720");
        assert_eq!(
            pod_workload("backup-28950720-k", true, &none, job),
            "backup"
        );
        for not_cron in [
            "backup-1234567",
            "backup-12345678901",
            "backup-2895072a",
            "-12345678",
        ] {
            let job = made_by("Job", not_cron);
            assert_eq!(pod_workload("p", true, &none, job), not_cron, "{not_cron}");
        }

        let sts = made_by("StatefulSet", "db");
        assert_eq!(pod_workload("db-0", true, &none, sts), "db");
        assert_eq!(pod_workload("bare", false, &none, None), "bare");
        assert_eq!(pod_workload("orphan-x", true, &none, None), "orphan-x");
    }

    #[test]
    fn the_workload_name_label_wins_over_everything() {
        let l = labels(&[
            ("service.istio.io/workload-name", "billing"),
            ("pod-template-hash", "abc"),
        ]);
        let rs = made_by("ReplicaSet", "web-abc");
        assert_eq!(pod_workload("web-abc-1", true, &l, rs), "billing");
        assert_eq!(entry_workload("vm-1", None, &l), "billing");
        assert_eq!(entry_workload("vm-1", Some("group"), &l), "group");
        assert_eq!(entry_workload("vm-1", Some(""), &Labels::new()), "vm-1");
    }

    #[test]
    fn canonical_names_take_the_first_label_present() {
        let all = labels(&[
            ("service.istio.io/canonical-name", "curl"),
            ("app.kubernetes.io/name", "k8s-name"),
            ("app", "client"),
            ("service.istio.io/canonical-revision", "v1"),
            ("version", "v0"),
        ]);
        assert_eq!(canonical_service(&all, "curl-client"), "curl");
        assert_eq!(canonical_revision(&all), "v1");
        let app = labels(&[("app", "client"), ("version", "v2")]);
        assert_eq!(canonical_service(&app, "curl-client"), "client");
        assert_eq!(canonical_revision(&app), "v2");
        let none = Labels::new();
        assert_eq!(canonical_service(&none, "curl-client"), "curl-client");
        assert_eq!(canonical_revision(&none), "latest");
    }
}
