//! One manifest file, read, resolved and built into a snapshot.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redirect_userspace::fuzzing::manifests(data));
