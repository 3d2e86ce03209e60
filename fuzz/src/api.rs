//! Target `api_json`: the HTTP API's JSON bodies (crates/api), as the daemon reads
//! requests and the CLI reads answers.
//!
//! Byte 0 picks the type (modulo the table below), the rest is the body. Properties: no
//! panic; a body that decodes encodes to JSON that decodes again and encodes to the same
//! JSON (what one side writes, the other reads back the same).
//!
//! Floats are compared to within a few ULP: serde_json (without its `float_roundtrip`
//! feature, as the product builds it) may parse a float one ULP off what was written, so
//! `f64` fields (`CacheInfo::destage_bytes_per_s`, `FleetSample::converged_cpu_s`, ...) can
//! drift by an ULP per hop. The fuzzer found that at once; it is reported in
//! docs/FUZZING.md and tolerated here so that the target goes on finding other changes.

use converge_api::fleet::{FleetNode, FleetSample, WorkerSpec, WorkerStatus};
use converge_api::lab::{SampleBlocks, SampledBlocks};
use converge_api::{
    CacheInfo, CreateJoinToken, CreateToken, CreateVolume, CreatedToken, ErrorBody, JobInfo,
    Joined, Maintenance, MoveVolume, NodeInfo, ResizeVolume, RevokeCert, RevokedCert, ScrubRequest,
    ScrubResult, SetCacheMode, Settings, Status, TokenInfo, VolumeInfo,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

fn round_trip<T: Serialize + DeserializeOwned>(body: &[u8]) {
    let Ok(v) = serde_json::from_slice::<T>(body) else {
        return;
    };
    let once = serde_json::to_string(&v).expect("a decoded body encodes");
    let back: T = match serde_json::from_str(&once) {
        Ok(b) => b,
        Err(e) => panic!(
            "{} re-encoded as {once} does not decode: {e}",
            std::any::type_name::<T>()
        ),
    };
    let twice = serde_json::to_string(&back).expect("encodes again");
    if once != twice {
        let a: Value = serde_json::from_str(&once).expect("valid JSON");
        let b: Value = serde_json::from_str(&twice).expect("valid JSON");
        assert!(
            same(&a, &b),
            "{} changes on a round trip:\n{once}\n{twice}",
            std::any::type_name::<T>()
        );
    }
}

/// Equal JSON, floats to within 4 ULP.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => {
                    x == y || (x - y).abs() <= 4.0 * f64::EPSILON * x.abs().max(y.abs())
                }
                _ => false,
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// The types, in the order byte 0 picks them (seed files start with the index).
pub const TYPES: &[&str] = &[
    "CreateVolume",
    "ResizeVolume",
    "SetCacheMode",
    "Settings",
    "ScrubRequest",
    "MoveVolume",
    "Maintenance",
    "CreateToken",
    "WorkerSpec",
    "SampleBlocks",
    "Status",
    "VolumeInfo",
    "NodeInfo",
    "CacheInfo",
    "JobInfo",
    "ScrubResult",
    "TokenInfo",
    "CreatedToken",
    "WorkerStatus",
    "FleetNode",
    "FleetSample",
    "SampledBlocks",
    "ErrorBody",
    "CreateJoinToken",
    "Joined",
    "RevokeCert",
    "RevokedCert",
];

pub fn api_json(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match usize::from(which) % TYPES.len() {
        0 => round_trip::<CreateVolume>(body),
        1 => round_trip::<ResizeVolume>(body),
        2 => round_trip::<SetCacheMode>(body),
        3 => round_trip::<Settings>(body),
        4 => round_trip::<ScrubRequest>(body),
        5 => round_trip::<MoveVolume>(body),
        6 => round_trip::<Maintenance>(body),
        7 => round_trip::<CreateToken>(body),
        8 => round_trip::<WorkerSpec>(body),
        9 => round_trip::<SampleBlocks>(body),
        10 => round_trip::<Status>(body),
        11 => round_trip::<VolumeInfo>(body),
        12 => round_trip::<NodeInfo>(body),
        13 => round_trip::<CacheInfo>(body),
        14 => round_trip::<JobInfo>(body),
        15 => round_trip::<ScrubResult>(body),
        16 => round_trip::<TokenInfo>(body),
        17 => round_trip::<CreatedToken>(body),
        18 => round_trip::<WorkerStatus>(body),
        19 => round_trip::<FleetNode>(body),
        20 => round_trip::<FleetSample>(body),
        21 => round_trip::<SampledBlocks>(body),
        22 => round_trip::<ErrorBody>(body),
        23 => round_trip::<CreateJoinToken>(body),
        24 => round_trip::<Joined>(body),
        25 => round_trip::<RevokeCert>(body),
        _ => round_trip::<RevokedCert>(body),
    }
}
