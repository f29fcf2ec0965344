//! Istio's standard telemetry: the names its dashboards and Kiali group traffic by.
#[cfg_attr(
    not(test),
    expect(dead_code, reason = "read by Istio's TCP metrics as they are wired in")
)]
mod names;
