//! One DNS query datagram as the DNS proxy answers it (first byte: client and transport).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| redirect_userspace::fuzzing::dns_query(data));
