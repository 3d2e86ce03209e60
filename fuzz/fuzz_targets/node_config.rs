//! libFuzzer entry point; the harness and its input format: `converge_fuzz::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::config::node_config(data);
});
