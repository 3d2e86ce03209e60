//! libFuzzer entry point; the harness and its input format: `converge_fuzz::rpc`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    converge_fuzz::rpc::rpc_wire(data);
});
