//! What Istio's validation accepts loads here, and what it refuses is refused with its reason.
//! Cases follow `pkg/config/validation/testdata/crds/{serviceentry,workloadentry}-{valid,invalid}.yaml`
//! and the rules of `validation.go` (our own shapes, not copies), plus the enum numbering of Istio's protos.
use super::*;

fn load(yaml: &str) -> Result<Model, ConfigErrors> {
    load_sources([("dir/a.yaml", yaml)])
}

fn loaded(name: &str, yaml: &str) -> Model {
    match load(yaml) {
        Ok(model) => model,
        Err(e) => panic!("{name}: refused, Istio accepts it:\n{e}"),
    }
}

const SE: &str = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: se, namespace: team-a}\n";
const WE: &str = "apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {name: we, namespace: team-a}\n";

#[test]
fn service_entries_istio_accepts() {
    struct Case {
        /// The source: a document of serviceentry-valid.yaml, or a pkg/config/validation rule.
        name: &'static str,
        spec: &'static str,
        check: fn(&ServiceEntry) -> bool,
    }
    let cases = [
        Case {
            name: "pkg/config/validation: CIDR with host bits (docs example 192.192.192.192/24) is its network",
            spec: "{hosts: [a.example.com], addresses: [192.192.192.192/24], ports: [{number: 80, name: http}]}",
            check: |se| se.addresses == [Address::Cidr("192.192.192.0/24".parse().unwrap())],
        },
        Case {
            name: "serviceentry-valid.yaml none-cidr: a /32 is one address",
            spec: "{hosts: [example.com], addresses: [1.1.1.1/32]}",
            check: |se| se.addresses == [Address::Ip("1.1.1.1".parse().unwrap())],
        },
        Case {
            name: "serviceentry-valid.yaml partial-wildcard: *x (Istio warns)",
            spec: "{hosts: [\"*x\"]}",
            check: |se| se.hosts == [Host::Partial("*x".into())],
        },
        Case {
            name: "serviceentry-valid.yaml empty-selector: workloadSelector {}",
            spec: "{hosts: [example.com], workloadSelector: {}}",
            check: |se| se.workload_selector == Some(Labels::new()),
        },
        Case {
            name: "serviceentry-valid.yaml full: IPv6 written with a leading zero, exportTo a namespace and .",
            spec: "{hosts: [example.com], workloadSelector: {labels: {foo: bar}}, addresses: [1.2.3.4, \"001:db8::\"], exportTo: [foo, .], location: MESH_EXTERNAL, ports: [{name: foo, protocol: HTTP, number: 1234, targetPort: 2345}], subjectAltNames: [sa], resolution: DNS}",
            check: |se| se.addresses.len() == 2 && se.resolution == Resolution::Dns,
        },
        Case {
            name: "pkg/config/validation: resolution DYNAMIC_DNS with a wildcard and a TLS port",
            spec: "{hosts: [\"*.example.com\"], ports: [{number: 443, name: tls, protocol: tls}], resolution: DYNAMIC_DNS}",
            check: |se| se.resolution == Resolution::DynamicDns,
        },
        Case {
            name: "service_entry.proto numbering: resolution 1 is STATIC, location 1 is MESH_INTERNAL",
            spec: "{hosts: [a.example.com], resolution: 1, location: 1, endpoints: [{address: 198.51.100.1}]}",
            check: |se| {
                se.resolution == Resolution::Static && se.location == Location::MeshInternal
            },
        },
        Case {
            name: "service_entry.proto numbering: resolution 4 is DYNAMIC_DNS",
            spec: "{hosts: [\"*.example.com\"], resolution: 4}",
            check: |se| se.resolution == Resolution::DynamicDns,
        },
        Case {
            name: "pkg/config/validation: STATIC unix:///path endpoint is kept",
            spec: "{hosts: [uds.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: \"unix:///var/run/uds.sock\"}]}",
            check: |se| {
                se.endpoints[0].address == WorkloadAddress::Unix("unix:///var/run/uds.sock".into())
            },
        },
        Case {
            name: "pkg/config/validation: STATIC abstract unix endpoint is kept",
            spec: "{hosts: [uds.example.com], ports: [{number: 80, name: http}], resolution: STATIC, endpoints: [{address: \"unix://@abstract\"}]}",
            check: |se| matches!(se.endpoints[0].address, WorkloadAddress::Unix(_)),
        },
        Case {
            name: "serviceentry-valid.yaml static-endpoints: DNS endpoint by host name",
            spec: "{hosts: [example.com], endpoints: [{address: sub.example.com}], ports: [{name: foo, protocol: HTTP, number: 1234, targetPort: 2345}], resolution: DNS}",
            check: |se| se.endpoints[0].address == WorkloadAddress::Host("sub.example.com".into()),
        },
    ];
    for case in cases {
        let model = loaded(case.name, &format!("{SE}spec: {}\n", case.spec));
        assert!(
            (case.check)(&model.service_entries[0]),
            "{}: {:?}",
            case.name,
            model.service_entries[0]
        );
    }
}

#[test]
fn workload_entries_istio_accepts() {
    // A case names what it checks: no address other than IPs unless named.
    #[derive(Default)]
    struct Case {
        /// The document of workloadentry-valid.yaml it follows.
        name: &'static str,
        spec: &'static str,
        ips: usize,
        other: Option<WorkloadAddress>,
    }
    let cases = [
        Case {
            name: "workloadentry-valid.yaml full",
            spec: "{address: 1.2.3.4, serviceAccount: sa, network: net, labels: {app: app}, ports: {http: 1}, weight: 2, locality: foo/bar/baz}",
            ips: 1,
            ..Default::default()
        },
        Case {
            name: "workloadentry-valid.yaml missing-address-network-set",
            spec: "{network: net}",
            ips: 0,
            ..Default::default()
        },
        Case {
            name: "workloadentry-valid.yaml uds-abstract",
            spec: "{address: \"unix://@foo\"}",
            ips: 0,
            other: Some(WorkloadAddress::Unix("unix://@foo".into())),
        },
        Case {
            name: "workloadentry-valid.yaml uds-path",
            spec: "{address: \"unix:///foo/bar\"}",
            ips: 0,
            other: Some(WorkloadAddress::Unix("unix:///foo/bar".into())),
        },
        Case {
            name: "workloadentry-valid.yaml fqdn",
            spec: "{address: example.com}",
            ips: 0,
            other: Some(WorkloadAddress::Host("example.com".into())),
        },
    ];
    for case in cases {
        let model = loaded(case.name, &format!("{WE}spec: {}\n", case.spec));
        let we = &model.workloads[0];
        assert_eq!(we.ips.len(), case.ips, "{}", case.name);
        assert_eq!(we.other_address, case.other, "{}", case.name);
    }
}

#[test]
fn what_istio_refuses_is_refused_with_its_reason() {
    struct Case {
        /// The document of *-invalid.yaml (or pkg/config/validation rule) it follows.
        name: &'static str,
        yaml: String,
        field: &'static str,
        message: &'static str,
    }
    let se = |spec: &str| format!("{SE}spec: {spec}\n");
    let we = |spec: &str| format!("{WE}spec: {spec}\n");
    let cases = [
        Case {
            name: "serviceentry-invalid.yaml bad-cidr-resolution",
            yaml: se("{hosts: [example.com], addresses: [1.2.3.4/16], resolution: DNS}"),
            field: "spec.addresses",
            message: "CIDR addresses are allowed only for NONE/STATIC resolution types",
        },
        Case {
            name: "serviceentry-invalid.yaml bad-cidr-resolution, with DYNAMIC_DNS",
            yaml: se(
                "{hosts: [\"*.example.com\"], addresses: [1.2.3.0/24], resolution: DYNAMIC_DNS}",
            ),
            field: "spec.addresses",
            message: "CIDR addresses are allowed only for NONE/STATIC",
        },
        Case {
            name: "pkg/config/validation ValidateServiceEntry: DYNAMIC_DNS with an exact host",
            yaml: se(
                "{hosts: [api.example.com], ports: [{number: 443, name: tls, protocol: TLS}], resolution: DYNAMIC_DNS}",
            ),
            field: "spec.hosts[0]",
            message: "host must be wildcarded for resolution mode DYNAMIC_DNS",
        },
        Case {
            name: "pkg/config/validation ValidateServiceEntry: DYNAMIC_DNS with addresses",
            yaml: se(
                "{hosts: [\"*.example.com\"], addresses: [203.0.113.9], ports: [{number: 80, name: http, protocol: HTTP}], resolution: DYNAMIC_DNS}",
            ),
            field: "spec.addresses",
            message: "addresses cannot be set for resolution type DYNAMIC_DNS",
        },
        Case {
            name: "pkg/config/validation ValidateServiceEntry: DYNAMIC_DNS with endpoints",
            yaml: se(
                "{hosts: [\"*.example.com\"], ports: [{number: 80, name: http, protocol: HTTP}], resolution: DYNAMIC_DNS, endpoints: [{address: origin.example.net}]}",
            ),
            field: "spec.endpoints",
            message: "endpoints cannot be set for resolution type DYNAMIC_DNS",
        },
        Case {
            name: "pkg/config/validation ValidateServiceEntry: DYNAMIC_DNS with a TCP port",
            yaml: se(
                "{hosts: [\"*.example.com\"], ports: [{number: 443, name: tls, protocol: TLS}, {number: 5432, name: pg, protocol: TCP}], resolution: DYNAMIC_DNS}",
            ),
            field: "spec.ports[1].protocol",
            message: "only HTTP, TLS, GRPC, and HTTP2 protocols are supported",
        },
        Case {
            name: "serviceentry-invalid.yaml dns-rr-with-multiple-endpoints",
            yaml: se(
                "{hosts: [example.com], resolution: DNS_ROUND_ROBIN, endpoints: [{address: sub1.example.com}, {address: sub2.example.com}]}",
            ),
            field: "spec.endpoints",
            message: "DNS_ROUND_ROBIN mode cannot have multiple endpoints",
        },
        Case {
            name: "serviceentry-invalid.yaml bad-selector-value",
            yaml: se("{hosts: [example.com], workloadSelector: {labels: {val: \"*\"}}}"),
            field: "spec.workloadSelector.labels.val",
            message: "wildcard is not supported in selector",
        },
        Case {
            name: "serviceentry-invalid.yaml selector-and-endpoints",
            yaml: se(
                "{hosts: [example.com], resolution: STATIC, workloadSelector: {}, endpoints: [{address: 1.2.3.4}]}",
            ),
            field: "spec.workloadSelector",
            message: "only one of",
        },
        Case {
            name: "serviceentry-invalid.yaml bad-host-wildcard",
            yaml: se("{hosts: [\"*\"]}"),
            field: "spec.hosts[0]",
            message: "\"*\" alone is not allowed",
        },
        Case {
            name: "serviceentry-invalid.yaml none-with-endpoints",
            yaml: se("{hosts: [example.com], endpoints: [{address: 1.2.3.4}], resolution: NONE}"),
            field: "spec.endpoints",
            message: "resolution NONE takes no endpoints",
        },
        Case {
            name: "serviceentry-invalid.yaml missing-host",
            yaml: se("{}"),
            field: "spec.hosts",
            message: "at least one host",
        },
        Case {
            name: "pkg/config/validation: unknown resolution number",
            yaml: se("{hosts: [example.com], resolution: 9}"),
            field: "spec.resolution",
            message: "unknown resolution 9",
        },
        Case {
            name: "pkg/config/validation: DNS resolution cannot use a unix endpoint",
            yaml: se(
                "{hosts: [example.com], resolution: DNS, endpoints: [{address: \"unix:///sock\"}]}",
            ),
            field: "spec.endpoints[0].address",
            message: "needs resolution STATIC",
        },
        Case {
            name: "workloadentry-invalid.yaml missing-address",
            yaml: we("{}"),
            field: "spec.address",
            message: "Address is required",
        },
        Case {
            name: "workloadentry-invalid.yaml bad-uds-dir",
            yaml: we("{address: \"unix:///dir/\"}"),
            field: "spec.address",
            message: "UDS may not be a dir",
        },
        Case {
            name: "workloadentry-invalid.yaml bad-uds-relative",
            yaml: we("{address: \"unix://relative\"}"),
            field: "spec.address",
            message: "UDS must be an absolute path or abstract socket",
        },
        Case {
            name: "workloadentry-invalid.yaml uds-with-ports",
            yaml: we("{address: \"unix://@foo\", ports: {http: 80}}"),
            field: "spec.ports",
            message: "UDS may not include ports",
        },
        Case {
            name: "workloadentry-invalid.yaml high-port",
            yaml: we("{address: 1.1.1.1, ports: {http: 99999}}"),
            field: "spec.ports.http",
            message: "out of range",
        },
        Case {
            name: "pkg/config/validation: wildcard WorkloadEntry address",
            yaml: we("{address: \"*.example.com\"}"),
            field: "spec.address",
            message: "must not contain a wildcard",
        },
        Case {
            name: "an address that looks like an IPv4 address but is none",
            yaml: we("{address: 300.1.2.3}"),
            field: "spec.address",
            message: "not a valid IP address",
        },
    ];
    for case in cases {
        let errors = match load(&case.yaml) {
            Ok(_) => panic!("{}: loaded, Istio refuses it", case.name),
            Err(e) => e,
        };
        assert!(
            errors.iter().any(|e| e.field.as_deref() == Some(case.field) && e.message.contains(case.message)),
            "{}: no error on {} containing {:?}: {errors}",
            case.name,
            case.field,
            case.message
        );
    }
}

#[test]
fn enum_values_by_number_follow_istios_protos() {
    // mesh config ServiceEntryVisibility.Visibility: 0 unspecified (PUBLIC), 1 PUBLIC, 2 NAMESPACE, 3 NONE.
    for (number, want) in [
        (0, Visibility::Public),
        (1, Visibility::Public),
        (2, Visibility::Namespace),
        (3, Visibility::None),
    ] {
        let model = loaded(
            "defaultVisibility number",
            &format!(
                "kind: MeshConfig\nserviceEntryVisibility:\n  defaultVisibility: {number}\n  policies: [{{visibility: {number}}}]\n"
            ),
        );
        let config = model.mesh.service_entry_visibility.expect("configured");
        assert_eq!(
            config.default_visibility, want,
            "defaultVisibility: {number}"
        );
        assert_eq!(
            config.policies[0].visibility, want,
            "policies[0].visibility: {number}"
        );
    }
    let errors =
        load("kind: MeshConfig\nserviceEntryVisibility: {defaultVisibility: 7}\n").unwrap_err();
    assert_eq!(
        errors.0[0].field.as_deref(),
        Some("serviceEntryVisibility.defaultVisibility")
    );
    assert!(
        errors.0[0].message.contains("unknown visibility 7"),
        "{}",
        errors.0[0]
    );
}

#[test]
fn istio_operator_values_mesh_config_is_merged_under_spec_mesh_config() {
    // A case names what it checks: the rest is the feature unset.
    #[derive(Default)]
    struct Case {
        name: &'static str,
        spec: &'static str,
        default_visibility: Option<Visibility>,
        policies: usize,
        export_to: Option<Vec<&'static str>>,
    }
    let cases = [
        Case {
            name: "only spec.values.meshConfig: read, not silently ignored",
            spec: "{values: {meshConfig: {serviceEntryVisibility: {defaultVisibility: NAMESPACE}}}}",
            default_visibility: Some(Visibility::Namespace),
            ..Default::default()
        },
        Case {
            name: "spec.meshConfig wins field by field",
            spec: "{meshConfig: {serviceEntryVisibility: {defaultVisibility: PUBLIC}}, values: {meshConfig: {serviceEntryVisibility: {defaultVisibility: NONE, policies: [{visibility: NAMESPACE}]}, defaultServiceExportTo: [.]}}}",
            default_visibility: Some(Visibility::Public),
            policies: 1,
            export_to: Some(vec!["."]),
        },
        Case {
            name: "only spec.meshConfig: as before",
            spec: "{meshConfig: {serviceEntryVisibility: {defaultVisibility: NAMESPACE}}}",
            default_visibility: Some(Visibility::Namespace),
            ..Default::default()
        },
        Case {
            name: "neither: the feature is unset",
            spec: "{values: {global: {hub: example}}}",
            ..Default::default()
        },
    ];
    for case in cases {
        let model = loaded(
            case.name,
            &format!(
                "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {}\n",
                case.spec
            ),
        );
        let config = model.mesh.service_entry_visibility.as_ref();
        assert_eq!(
            config.map(|c| c.default_visibility),
            case.default_visibility,
            "{}",
            case.name
        );
        assert_eq!(
            config.map_or(0, |c| c.policies.len()),
            case.policies,
            "{}",
            case.name
        );
        assert_eq!(
            model.mesh.default_service_export_to,
            case.export_to
                .map(|v| v.into_iter().map(String::from).collect()),
            "{}",
            case.name
        );
    }
    // An error in the values names the field where the user wrote it.
    let errors = load("apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec: {values: {meshConfig: {serviceEntryVisibility: {defaultVisibility: PRIVATE}}}}\n").unwrap_err();
    assert_eq!(
        errors.0[0].field.as_deref(),
        Some("spec.values.meshConfig.serviceEntryVisibility.defaultVisibility"),
        "{}",
        errors.0[0]
    );
}
