//! libFuzzer entry point; the harness and its input format: `converge_fuzz::nbd`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::nbd::nbd_session(data);
});
