#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| convene_fuzz_targets::policy_file(data));
