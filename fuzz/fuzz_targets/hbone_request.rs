//! The HTTP/2 frames of an HBONE connection, each request checked as the receiving side does.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redirect_userspace::fuzzing::hbone_request(data));
