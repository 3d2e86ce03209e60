//! libFuzzer entry point; the harness and its input format: `converge_fuzz::cache`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::cache::cache_replay(data);
});
