//! Loading rules of `docs/inputs.md`: what is read, what is skipped, and every kind of bad input.
use super::*;

fn load(yaml: &str) -> Result<Model, ConfigErrors> {
    load_sources([("dir/a.yaml", yaml)])
}

const SE_HEAD: &str = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: team-a}\n";

#[test]
fn bad_input_rules() {
    // A case names what it checks: no object or field unless named (an error about the file itself).
    #[derive(Default)]
    struct Case {
        name: &'static str,
        yaml: String,
        object: Option<&'static str>,
        field: Option<&'static str>,
        message: &'static str,
    }
    let se = |spec: &str| format!("{SE_HEAD}spec: {spec}\n");
    let cases = [
        Case { name: "file that does not parse", yaml: "kind: [unclosed\n".into(), message: "not valid YAML", ..Default::default() },
        Case { name: "document without a kind", yaml: "apiVersion: v1\nmetadata: {name: x}\n".into(), field: Some("kind"), message: "no kind", ..Default::default() },
        Case { name: "document that is not a mapping", yaml: "- just\n- a list\n".into(), field: Some("kind"), message: "not a Kubernetes object", ..Default::default() },
        Case { name: "invalid IP address", yaml: se("{hosts: [a.example.com], addresses: [300.1.2.3]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.addresses[0]"), message: "not a valid IP address or CIDR" },
        Case { name: "invalid CIDR prefix", yaml: se("{hosts: [a.example.com], addresses: [198.51.100.0/33]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.addresses[0]"), message: "not a valid IP address or CIDR" },
        Case { name: "port out of range", yaml: se("{hosts: [a.example.com], ports: [{number: 70000, name: http}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.ports[0].number"), message: "out of range" },
        Case { name: "port zero", yaml: se("{hosts: [a.example.com], ports: [{number: 0, name: http}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.ports[0].number"), message: "out of range" },
        Case { name: "targetPort out of range", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http, targetPort: 65536}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.ports[0].targetPort"), message: "out of range" },
        Case { name: "port of the wrong type", yaml: se("{hosts: [a.example.com], ports: [{number: eighty, name: http}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.ports[0].number"), message: "expected an integer, got string \"eighty\"" },
        Case { name: "endpoint port out of range", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.1, ports: {http: 99999}}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].ports.http"), message: "out of range" },
        Case { name: "endpoint port name not declared", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 198.51.100.1, ports: {grpc: 9000}}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].ports.grpc"), message: "no port named" },
        Case { name: "host name endpoint with resolution STATIC", yaml: se("{hosts: [a.example.com], resolution: STATIC, endpoints: [{address: origin.example.org}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].address"), message: "resolution STATIC needs IP endpoints" },
        Case { name: "endpoints with resolution NONE", yaml: se("{hosts: [a.example.com], endpoints: [{address: 198.51.100.1}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints"), message: "resolution NONE takes no endpoints" },
        Case { name: "unknown resolution", yaml: se("{hosts: [a.example.com], resolution: MAGIC}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.resolution"), message: "unknown resolution" },
        Case { name: "unknown location", yaml: se("{hosts: [a.example.com], location: MESH_SOMEWHERE}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.location"), message: "unknown location" },
        Case { name: "no hosts", yaml: se("{addresses: [203.0.113.1]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.hosts"), message: "at least one host" },
        Case { name: "wildcard not leading", yaml: se("{hosts: [api.*.example.com]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.hosts[0]"), message: "not a valid host name" },
        Case { name: "exportTo ~ with others", yaml: se("{hosts: [a.example.com], exportTo: [\"~\", \".\"]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.exportTo"), message: "only value" },
        Case { name: "endpoints and workloadSelector together", yaml: se("{hosts: [a.example.com], resolution: STATIC, endpoints: [{address: 198.51.100.1}], workloadSelector: {labels: {app: x}}}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.workloadSelector"), message: "only one of" },
        Case { name: "duplicate port number", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: a}, {number: 80, name: b}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.ports[1].number"), message: "declared twice" },
        Case { name: "missing name", yaml: "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {namespace: team-a}\nspec: {hosts: [a.example.com]}\n".into(), object: Some("ServiceEntry"), field: Some("metadata.name"), message: "name is required" },
        Case { name: "bad creationTimestamp", yaml: "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: api, namespace: team-a, creationTimestamp: yesterday}\nspec: {hosts: [a.example.com]}\n".into(), object: Some("ServiceEntry team-a/api"), field: Some("metadata.creationTimestamp"), message: "RFC 3339" },
        Case { name: "label value that is not a string", yaml: "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-c, labels: {trusted: true}}\n".into(), object: Some("Namespace team-c"), field: Some("metadata.labels.trusted"), message: "expected a string, got boolean true" },
        Case { name: "invalid pod IP", yaml: "apiVersion: v1\nkind: Pod\nmetadata: {name: a1, namespace: team-a}\nstatus: {podIP: 10.244.1.300}\n".into(), object: Some("Pod team-a/a1"), field: Some("status.podIP"), message: "not a valid IP address" },
        Case { name: "pod uid that is not a UUID", yaml: "apiVersion: v1\nkind: Pod\nmetadata: {name: a1, namespace: team-a, uid: pod-a1}\nstatus: {podIP: 10.244.1.10}\n".into(), object: Some("Pod team-a/a1"), field: Some("metadata.uid"), message: "not a UUID" },
        Case { name: "invalid Service clusterIP", yaml: "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: team-a}\nspec: {clusterIP: nope, ports: [{port: 80}]}\n".into(), object: Some("Service team-a/web"), field: Some("spec.clusterIP"), message: "not a valid IP address" },
        Case { name: "Service port out of range", yaml: "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: team-a}\nspec: {ports: [{port: 80, targetPort: 0}]}\n".into(), object: Some("Service team-a/web"), field: Some("spec.ports[0].targetPort"), message: "out of range" },
        Case { name: "WorkloadEntry without an address or a network", yaml: "apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {name: vm, namespace: team-a}\nspec: {}\n".into(), object: Some("WorkloadEntry team-a/vm"), field: Some("spec.address"), message: "Address is required" },
        Case { name: "unknown selector operator", yaml: "kind: MeshConfig\nserviceEntryVisibility:\n  policies:\n  - visibility: PUBLIC\n    matchingRules: [{namespaceSelector: {matchExpressions: [{key: a, operator: Matches, values: [x]}]}}]\n".into(), object: Some("MeshConfig"), field: Some("serviceEntryVisibility.policies[0].matchingRules[0].namespaceSelector.matchExpressions[0].operator"), message: "unknown operator \"Matches\"" },
        Case { name: "In without values", yaml: "kind: MeshConfig\nserviceEntryVisibility:\n  policies:\n  - matchingRules: [{namespaceSelector: {matchExpressions: [{key: a, operator: In}]}}]\n".into(), object: Some("MeshConfig"), field: Some("serviceEntryVisibility.policies[0].matchingRules[0].namespaceSelector.matchExpressions[0].values"), message: "at least one value" },
        Case { name: "Exists with values", yaml: "kind: MeshConfig\nserviceEntryVisibility:\n  policies:\n  - matchingRules: [{namespaceSelector: {matchExpressions: [{key: a, operator: Exists, values: [x]}]}}]\n".into(), object: Some("MeshConfig"), field: Some("serviceEntryVisibility.policies[0].matchingRules[0].namespaceSelector.matchExpressions[0].values"), message: "takes no values" },
        Case { name: "unknown visibility value is an error, not a default", yaml: "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec:\n  meshConfig:\n    serviceEntryVisibility: {defaultVisibility: PRIVATE}\n".into(), object: Some("IstioOperator"), field: Some("spec.meshConfig.serviceEntryVisibility.defaultVisibility"), message: "unknown visibility \"PRIVATE\"" },
        Case { name: "unknown policy visibility", yaml: "kind: MeshConfig\nserviceEntryVisibility:\n  policies: [{visibility: public}]\n".into(), object: Some("MeshConfig"), field: Some("serviceEntryVisibility.policies[0].visibility"), message: "unknown visibility" },
        Case { name: "bad mesh YAML inside a ConfigMap", yaml: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: istio-system}\ndata:\n  mesh: |\n    serviceEntryVisibility:\n      applyToSidecars: maybe\n".into(), object: Some("ConfigMap istio-system/istio"), field: Some("data.mesh.serviceEntryVisibility.applyToSidecars"), message: "expected true or false, got string \"maybe\"" },
        Case { name: "bad visibility inside a ConfigMap", yaml: "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: istio-system}\ndata:\n  mesh: |\n    serviceEntryVisibility: {defaultVisibility: SOMETIMES}\n".into(), object: Some("ConfigMap istio-system/istio"), field: Some("data.mesh.serviceEntryVisibility.defaultVisibility"), message: "unknown visibility" },
        Case { name: "duplicate object in one file", yaml: format!("{SE_HEAD}spec: {{hosts: [a.example.com]}}\n---\n{SE_HEAD}spec: {{hosts: [b.example.com]}}\n"), object: Some("ServiceEntry team-a/api"), field: Some("metadata.name"), message: "already defined earlier in this file" },
        Case { name: "two mesh configs", yaml: "kind: MeshConfig\n---\napiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {meshConfig: {}}\n".into(), object: Some("IstioOperator"), field: Some("spec.meshConfig"), message: "a second mesh config: MeshConfig in dir/a.yaml" },
        Case { name: "loopback endpoint (the proxy would dial the node itself)", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 127.0.0.1}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].address"), message: "\"127.0.0.1\" is a loopback address: the agent dials endpoints from the node" },
        Case { name: "IPv6 loopback endpoint", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: \"::1\"}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].address"), message: "is a loopback address" },
        Case { name: "unspecified endpoint", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 0.0.0.0}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].address"), message: "is an unspecified address" },
        Case { name: "link-local endpoint (a metadata service)", yaml: se("{hosts: [a.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: 169.254.169.254}]}"), object: Some("ServiceEntry team-a/api"), field: Some("spec.endpoints[0].address"), message: "is a link-local address" },
        Case { name: "WorkloadEntry on loopback", yaml: "apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {name: vm, namespace: team-a}\nspec: {address: 127.0.0.2}\n".into(), object: Some("WorkloadEntry team-a/vm"), field: Some("spec.address"), message: "is a loopback address" },
        Case { name: "bad item inside a List", yaml: "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: a1, namespace: team-a}\n  status: {podIP: nope}\n".into(), object: Some("Pod team-a/a1"), field: Some("items[0].status.podIP"), message: "not a valid IP address" },
    ];
    for case in cases {
        let errors = match load(&case.yaml) {
            Ok(_) => panic!("{}: loaded, expected an error", case.name),
            Err(e) => e,
        };
        assert_eq!(errors.len(), 1, "{}: {errors}", case.name);
        let e = &errors.0[0];
        assert_eq!(e.file, "dir/a.yaml", "{}", case.name);
        assert_eq!(e.object.as_deref(), case.object, "{}: {e}", case.name);
        assert_eq!(e.field.as_deref(), case.field, "{}: {e}", case.name);
        assert!(
            e.message.contains(case.message),
            "{}: message {:?} lacks {:?}",
            case.name,
            e.message,
            case.message
        );
    }
}

#[test]
fn several_errors_are_reported_together_and_nothing_is_applied() {
    let good = "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n";
    let bad1 = format!(
        "{SE_HEAD}spec: {{hosts: [a.example.com], addresses: [1.2.3.999], ports: [{{number: 0}}]}}\n"
    );
    let bad2 =
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: team-b}\nstatus: {podIP: x}\n";
    let errors = load_sources([
        ("a.yaml", good),
        ("b.yaml", bad1.as_str()),
        ("c.yaml", bad2),
    ])
    .unwrap_err();
    let lines: Vec<String> = errors.to_string().lines().map(String::from).collect();
    assert_eq!(lines.len(), 3, "one line per error: {lines:?}");
    assert!(
        lines[0].starts_with("b.yaml: ServiceEntry team-a/api: spec.addresses[0]: "),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("b.yaml: ServiceEntry team-a/api: spec.ports[0].number: "),
        "{}",
        lines[1]
    );
    assert!(
        lines[2].starts_with("c.yaml: Pod team-b/p: status.podIP: "),
        "{}",
        lines[2]
    );
}

#[test]
fn duplicates_across_files_name_both_files() {
    let se = format!("{SE_HEAD}spec: {{hosts: [a.example.com]}}\n");
    let errors = load_sources([("a.yaml", se.as_str()), ("b.yaml", se.as_str())]).unwrap_err();
    assert_eq!(errors.0[0].file, "b.yaml");
    assert!(errors.0[0].message.contains("in a.yaml"), "{}", errors.0[0]);
}

#[test]
fn what_is_read_and_what_is_skipped() {
    let yaml = r#"
apiVersion: v1
kind: Namespace
metadata: {name: team-c, labels: {trusted: "true", kubernetes.io/metadata.name: wrong}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: team-a}
spec: {gatewayClassName: istio-waypoint}
---
apiVersion: serving.knative.dev/v1
kind: Service
metadata: {name: not-core, namespace: team-a}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: other, namespace: team-a}
data: {mesh: "not: [valid"}
---
apiVersion: networking.istio.io/v1beta1
kind: ServiceEntry
metadata: {name: api, namespace: team-a, annotations: {a: b}}
spec:
  hosts: [API.example.com]
  addresses: [203.0.113.10/32]
  ports: [{number: 80, name: http, protocol: HTTP}]
  resolution: STATIC
  endpoints: [{address: 198.51.100.20, weight: 3}]
  someFutureField: {x: 1}
---
apiVersion: networking.istio.io/v1alpha3
kind: ServiceEntry
metadata: {name: old, namespace: team-b}
spec: {hosts: [old.example.com]}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {clusterIP: None, ports: [{port: 80, targetPort: "8080"}]}
---
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata: {name: a1, namespace: team-a}
  status: {podIPs: [{ip: 10.244.1.10}, {ip: "fd00::10"}]}
"#;
    let model = load(yaml).unwrap();
    assert_eq!(
        model.service_entries.len(),
        2,
        "all three ServiceEntry versions, other kinds skipped"
    );
    let api = &model.service_entries[0];
    assert_eq!(api.hosts, vec![Host::Exact("api.example.com".into())]);
    assert_eq!(
        api.addresses,
        vec![Address::Ip("203.0.113.10".parse().unwrap())],
        "a /32 is an exact address"
    );
    assert_eq!(
        model.services.len(),
        1,
        "a Service of another group is skipped"
    );
    assert_eq!(
        model.services[0].meta.namespace, "default",
        "no namespace means default, as with kubectl"
    );
    assert!(model.services[0].cluster_ips.is_empty(), "headless");
    assert_eq!(
        model.services[0].ports[0].target_port,
        TargetPort::Number(8080),
        "numeric string targetPort"
    );
    assert_eq!(model.workloads[0].ips.len(), 2, "podIPs read");
    assert_eq!(
        model.mesh,
        MeshConfig::default(),
        "a ConfigMap other than istio is skipped"
    );
    let team_c = model.namespace_labels("team-c");
    assert_eq!(
        team_c.get(NAMESPACE_NAME_LABEL).map(String::as_str),
        Some("team-c"),
        "the name label is always the name"
    );
    let team_b = model.namespace_labels("team-b");
    assert_eq!(
        team_b.len(),
        1,
        "an undeclared namespace has only its name label"
    );
    assert!(!model.namespaces["team-b"].declared);
    assert_eq!(
        model
            .namespace_labels("nowhere")
            .get(NAMESPACE_NAME_LABEL)
            .map(String::as_str),
        Some("nowhere")
    );
}

#[test]
fn load_dir_reads_manifests_and_skips_hidden_entries() {
    struct TempDir(std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let guard =
        TempDir(std::env::temp_dir().join(format!("redirect-config-test-{}", std::process::id())));
    let dir = guard.0.clone();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("..data")).unwrap();
    // The layout of a mounted ConfigMap: files are links into `..data/`.
    std::fs::write(
        dir.join("..data/se.yaml"),
        format!("{SE_HEAD}spec: {{hosts: [a.example.com]}}\n"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..data/se.yaml", dir.join("se.yaml")).unwrap();
    std::fs::write(dir.join("README.md"), "not a manifest").unwrap();
    std::fs::write(dir.join(".hidden.yaml"), "not: [valid").unwrap();
    let model = load_dir(&dir).unwrap();
    assert_eq!(
        model.service_entries.len(),
        1,
        "loaded once, through the link"
    );
    let one_file = load_dir(&dir.join("se.yaml")).unwrap();
    assert_eq!(
        one_file.service_entries.len(),
        1,
        "a file path loads that file"
    );
    let missing = load_dir(&dir.join("missing")).unwrap_err();
    assert!(missing.0[0].message.contains("cannot read"), "{missing}");
}

/// `status.addresses` (docs/visibility.md#istios-allocations): only Istio's allocation ranges are
/// used; any other value is refused with an error naming file, object and field, and the entry
/// stays (its author did not write its status).
#[test]
fn status_addresses_outside_istios_ranges_are_refused_and_the_entry_stays() {
    let entry = |values: &[&str]| {
        let addresses: Vec<String> = values
            .iter()
            .map(|v| format!("{{value: \"{v}\", host: api.example.com}}"))
            .collect();
        format!(
            "{SE_HEAD}spec: {{hosts: [api.example.com], ports: [{{number: 80, name: http}}], resolution: DNS}}\nstatus: {{addresses: [{}]}}\n",
            addresses.join(", ")
        )
    };
    let refused = [
        ("loopback", "127.0.0.1"),
        ("cloud metadata (link-local)", "169.254.169.254"),
        ("a cluster IP", "10.96.0.1"),
        ("a public address", "8.8.8.8"),
        ("the agent's own gateway", "169.254.7.1"),
        ("another team's VIP", "203.0.113.10"),
        ("next to the IPv4 range", "240.241.0.1"),
        ("IPv6 outside 2001:2::/48", "2001:db8::1"),
        ("next to the IPv6 range", "2001:2:1::1"),
        ("IPv6 loopback", "::1"),
        ("IPv6 gateway", "fd00:7::1"),
        ("IPv4-mapped form of an allocation", "::ffff:240.240.0.1"),
    ];
    for (name, value) in refused {
        let yaml = entry(&[value]);
        let model = load(&yaml).unwrap_or_else(|e| panic!("{name}: the entry is refused: {e}"));
        let [se] = model.service_entries.as_slice() else {
            panic!("{name}: the entry is not kept")
        };
        assert!(se.status_addresses.is_empty(), "{name}: {value} is used");
        let [e] = se.refused_status.as_slice() else {
            panic!("{name}: {:?}", se.refused_status)
        };
        assert_eq!(e.file, "dir/a.yaml", "{name}");
        assert_eq!(
            e.object.as_deref(),
            Some("ServiceEntry team-a/api"),
            "{name}"
        );
        assert_eq!(
            e.field.as_deref(),
            Some("status.addresses[0].value"),
            "{name}"
        );
        assert!(
            e.message.contains(&format!("{value:?}"))
                && e.message.contains("240.240.0.0/16")
                && e.message.contains("2001:2::/48")
                && e.message.contains("not used"),
            "{name}: {e}"
        );
    }

    for value in [
        "240.240.3.7",
        "2001:2::7",
        "240.240.0.1",
        "2001:2:0:ffff::1",
    ] {
        let yaml = entry(&[value]);
        let model = load(&yaml).unwrap();
        let se = &model.service_entries[0];
        assert!(
            se.refused_status.is_empty(),
            "{value}: {:?}",
            se.refused_status
        );
        assert_eq!(
            se.status_addresses,
            [StatusAddress {
                host: "api.example.com".into(),
                ip: value.parse().unwrap()
            }],
            "{value} is accepted"
        );
    }

    // Each refusal names its own place; the accepted values around it stay.
    let yaml = entry(&["240.240.3.7", "8.8.8.8", "2001:2::7", "127.0.0.1"]);
    let model = load(&yaml).unwrap();
    let se = &model.service_entries[0];
    let kept: Vec<String> = se
        .status_addresses
        .iter()
        .map(|a| a.ip.to_string())
        .collect();
    assert_eq!(kept, ["240.240.3.7", "2001:2::7"]);
    let fields: Vec<&str> = se
        .refused_status
        .iter()
        .filter_map(|e| e.field.as_deref())
        .collect();
    assert_eq!(
        fields,
        ["status.addresses[1].value", "status.addresses[3].value"]
    );
    assert_eq!(
        se.refused_status[0].to_string(),
        "dir/a.yaml: ServiceEntry team-a/api: status.addresses[1].value: \"8.8.8.8\" is outside 240.240.0.0/16 and 2001:2::/48, the only addresses Istio's allocator writes: not used (neither answered nor claimed); the entry stays"
    );
}

#[test]
fn status_addresses_that_do_not_read_are_refused_by_field() {
    let status = |addresses: &str| {
        format!(
            "{SE_HEAD}spec: {{hosts: [api.example.com], resolution: DNS}}\nstatus: {{addresses: [{addresses}]}}\n"
        )
    };
    let cases = [
        (
            "{value: not-an-address, host: api.example.com}",
            "status.addresses[0].value",
            "is not an IP address",
        ),
        (
            "{value: 240.240.0.999, host: api.example.com}",
            "status.addresses[0].value",
            "is not an IP address",
        ),
        (
            "{value: 240.240.0.0/16, host: api.example.com}",
            "status.addresses[0].value",
            "is not an IP address",
        ),
        (
            "{host: api.example.com}",
            "status.addresses[0].value",
            "a value is required",
        ),
        (
            "{value: 240.240.3.7}",
            "status.addresses[0].host",
            "a host is required",
        ),
        (
            "{value: 240.240.3.7, host: \"\"}",
            "status.addresses[0].host",
            "a host is required",
        ),
    ];
    for (address, field, message) in cases {
        let model = load(&status(address)).unwrap_or_else(|e| panic!("{address}: {e}"));
        let se = &model.service_entries[0];
        assert!(se.status_addresses.is_empty(), "{address}");
        let [e] = se.refused_status.as_slice() else {
            panic!("{address}: {:?}", se.refused_status)
        };
        assert_eq!(e.field.as_deref(), Some(field), "{address}");
        assert!(e.message.contains(message), "{address}: {e}");
    }
    // Inside a List, the field carries the item's place, as every other error does.
    let list = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: networking.istio.io/v1\n  kind: ServiceEntry\n  metadata: {name: api, namespace: team-a}\n  spec: {hosts: [api.example.com], resolution: DNS}\n  status: {addresses: [{value: 8.8.8.8, host: api.example.com}]}\n";
    let model = load(list).unwrap();
    assert_eq!(
        model.service_entries[0].refused_status[0].field.as_deref(),
        Some("items[0].status.addresses[0].value")
    );
}
