#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| convene_fuzz_targets::other_requests(data));
