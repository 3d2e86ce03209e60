//! libFuzzer entry point; the harness and its input format: `converge_fuzz::api`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::api::api_json(data);
});
