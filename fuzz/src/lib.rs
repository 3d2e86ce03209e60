//! The harnesses behind converge's fuzz targets (docs/FUZZING.md). Each target in
//! `fuzz_targets/` is a one-line wrapper around a function here, so the same code also runs
//! without libFuzzer: `cargo run --example gen_corpus` builds the seed corpora and checks
//! every seed against its harness.
//!
//! A harness returns normally for any input; a panic (or an abort, a hang past the
//! harness's own time bound, a blown memory limit) is the finding.

pub mod api;
pub mod cache;
pub mod config;
pub mod engine;
pub mod input;
pub mod memfile;
pub mod nbd;
pub mod rpc;
pub mod rpc_session;
