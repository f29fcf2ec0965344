//! One object as a watch reads it from the Kubernetes API (first byte: the kind).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redirect_userspace::fuzzing::kube_object(data));
