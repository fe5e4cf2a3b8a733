#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| celer_fuzz::targets::celer_toml(data));
