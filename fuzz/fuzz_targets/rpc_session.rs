//! libFuzzer entry point; the harness and its input format: `converge_fuzz::rpc_session`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::rpc_session::rpc_session(data);
});
