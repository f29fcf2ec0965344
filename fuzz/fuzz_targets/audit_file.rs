//! The audit mesh config file, and the audit policy built from it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redirect_userspace::fuzzing::audit_file(data));
