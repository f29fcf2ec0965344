//! The manifests in deploy/ pass the Kubernetes schema validator, and the validator really rejects a
//! broken manifest, so a green run means something. Both go through `deploy/validate`, the script an
//! operator runs, with the pinned kubernetes-validate that `cargo xtask setup` installs. No root needed.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// `deploy/validate`'s exit code when the pinned validator is not installed.
const VALIDATOR_MISSING: i32 = 3;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the repository root")
        .to_path_buf()
}

/// Runs `deploy/validate DIR`; returns its exit code and everything it printed.
fn validate(dir: &Path) -> (i32, String) {
    let script = repo_root().join("deploy/validate");
    let out = Command::new(&script)
        .arg(dir)
        .output()
        .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let code = out
        .status
        .code()
        .unwrap_or_else(|| panic!("{} was killed by a signal\n{text}", script.display()));
    assert_ne!(
        code, VALIDATOR_MISSING,
        "the Kubernetes schema validator is not installed: run `cargo xtask setup`\n{text}"
    );
    (code, text)
}

/// A directory under the system temp dir, removed when dropped (also when the test panics).
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_nanos();
        let path = std::env::temp_dir().join(format!(
            "redirect-deploy-{label}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn deploy_manifests_pass_schema_validation() {
    let (code, output) = validate(&repo_root().join("deploy/manifests"));
    assert_eq!(
        code, 0,
        "deploy/validate failed on deploy/manifests:\n{output}"
    );
    // Every object was validated (none skipped for want of a schema), against both versions.
    for object in [
        "namespace/redirect-system",
        "serviceaccount/redirect",
        "clusterrole/redirect",
        "clusterrolebinding/redirect",
        "role/redirect-mesh-config",
        "rolebinding/redirect-mesh-config",
        "daemonset/redirect",
    ] {
        for version in ["1.30", "1.37"] {
            let line = format!("passed for resource {object} against version {version}");
            assert!(output.contains(&line), "no `{line}` in:\n{output}");
        }
    }
}

/// A minimal valid DaemonSet; each case below breaks it with exactly one edit.
const VALID_DAEMONSET: &str = "\
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: probe
  namespace: default
spec:
  selector:
    matchLabels:
      app: probe
  template:
    metadata:
      labels:
        app: probe
    spec:
      hostNetwork: true
      containers:
        - name: agent
          image: registry.example.com/agent:1
          securityContext:
            readOnlyRootFilesystem: true
";

#[test]
fn validator_rejects_broken_manifests() {
    struct Case {
        name: &'static str,
        replace: &'static str,
        with: &'static str,
        /// None: must pass; Some(text): must fail, naming what is wrong.
        rejected_for: Option<&'static str>,
    }
    let cases = [
        Case {
            name: "the unedited manifest passes (the edits, not the harness, cause the failures)",
            replace: "",
            with: "",
            rejected_for: None,
        },
        Case {
            name: "a misspelled field is rejected (strict schema)",
            replace: "readOnlyRootFilesystem",
            with: "readOnlyRootFilesytem",
            rejected_for: Some("'readOnlyRootFilesytem' was unexpected"),
        },
        Case {
            name: "a value of the wrong type is rejected",
            replace: "hostNetwork: true",
            with: "hostNetwork: \"yes\"",
            rejected_for: Some("spec.template.spec.hostNetwork: 'yes' is not of type"),
        },
        Case {
            name: "a missing required field is rejected",
            replace: "- name: agent\n          image:",
            with: "- image:",
            rejected_for: Some("'name' is a required property"),
        },
        Case {
            name: "a kind without a schema is rejected, not skipped",
            replace: "kind: DaemonSet",
            with: "kind: DaemonSett",
            rejected_for: Some("Couldn't find schema for kind DaemonSett"),
        },
    ];
    for (index, case) in cases.iter().enumerate() {
        let manifest = VALID_DAEMONSET.replacen(case.replace, case.with, 1);
        assert!(
            case.replace.is_empty() || manifest != VALID_DAEMONSET,
            "case `{}`: `{}` is not in the manifest",
            case.name,
            case.replace
        );
        let dir = TempDir::new(&format!("case{index}"));
        fs::write(dir.0.join("daemonset.yaml"), &manifest).expect("write manifest");
        let (code, output) = validate(&dir.0);
        match case.rejected_for {
            None => assert_eq!(code, 0, "case `{}`: expected to pass:\n{output}", case.name),
            Some(reason) => {
                assert_eq!(code, 1, "case `{}`: expected exit 1:\n{output}", case.name);
                assert!(
                    output.contains(reason),
                    "case `{}`: expected `{reason}` in:\n{output}",
                    case.name
                );
            }
        }
    }
}
