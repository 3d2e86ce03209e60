//! libFuzzer entry point; the harness and its input format: `converge_fuzz::engine`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::engine::engine_open(data);
});
