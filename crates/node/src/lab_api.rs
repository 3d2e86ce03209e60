//! Lab endpoints of the HTTP API (`/v1/lab/...`): debug views for the lab's fault
//! injector, kept apart from the operator API in `api.rs`. They only read state.
//!
//! `POST /v1/lab/blocks/sample` ([`SampleBlocks`]) answers where written data blocks of
//! this node's drives sit in their files, so `converge lab fault corrupt` can flip bits
//! a read will meet. Blocks are drawn uniformly from all written blocks of the drives.

use crate::node::Node;
use converge_api::lab::{SampleBlocks, SampledBlock, SampledBlocks};
use converge_engine::DataBlockSample;
use converge_types::DriveId;
use hyper::{Method, StatusCode};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// At most this many blocks per request: enough for any rehearsal, bounded response size.
pub const SAMPLE_COUNT_MAX: u32 = 4096;

pub type LabError = (StatusCode, String);

/// Routes `/v1/lab/REST`; `rest` is the path after `v1/lab`.
pub async fn route(
    node: &Arc<Node>,
    method: &Method,
    rest: &[&str],
    body: &[u8],
) -> Result<(StatusCode, serde_json::Value), LabError> {
    match (method, rest) {
        (&Method::POST, ["blocks", "sample"]) => {
            let req: SampleBlocks = serde_json::from_slice(body).map_err(|e| {
                (
                    StatusCode::BAD_REQUEST,
                    format!("bad sample request: {e}; send {{\"count\": N}}"),
                )
            })?;
            let out = sample_blocks(node, req).await?;
            let v = serde_json::to_value(out)
                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
            Ok((StatusCode::OK, v))
        }
        (&Method::POST, ["drives", "fail"]) => {
            let req: FailDrive = if body.is_empty() {
                FailDrive::default()
            } else {
                serde_json::from_slice(body).map_err(|e| {
                    (
                        StatusCode::BAD_REQUEST,
                        format!("bad fail request: {e}; send {{}} or {{\"drive\": ID}}"),
                    )
                })?
            };
            let id = fail_drive(node, req.drive)?;
            Ok((StatusCode::OK, serde_json::json!({ "drive": id })))
        }
        _ => Err((
            StatusCode::NOT_FOUND,
            format!(
                "no such lab API: {method} /v1/lab/{}; there are POST /v1/lab/blocks/sample \
                 and POST /v1/lab/drives/fail",
                rest.join("/")
            ),
        )),
    }
}

/// Body of `POST /v1/lab/drives/fail`: which drive (default: the node's capacity drive
/// holding the most extents among those not failed yet).
#[derive(Debug, Default, serde::Deserialize)]
struct FailDrive {
    #[serde(default)]
    drive: Option<DriveId>,
}

/// Fails one of the node's capacity drives as an I/O error would (sticky until the
/// daemon restarts): the node reports it, and its copies are rebuilt elsewhere.
fn fail_drive(node: &Arc<Node>, drive: Option<DriveId>) -> Result<DriveId, LabError> {
    let id = match drive {
        Some(id) => {
            if !node.drives.contains_key(&id) {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("this node has no drive {id}; see `converge drive list`"),
                ));
            }
            id
        }
        None => node
            .drives
            .iter()
            .filter(|(_, t)| t.failure().is_none())
            .max_by_key(|(id, t)| (t.extents().len(), std::cmp::Reverse(**id)))
            .map(|(id, _)| *id)
            .ok_or((
                StatusCode::CONFLICT,
                "every drive of this node has failed already".to_string(),
            ))?,
    };
    log::warn!("lab fault: drive {id} taken out of service");
    node.drives[&id].drive().fail_now("lab fault fail-drive");
    Ok(id)
}

async fn sample_blocks(node: &Arc<Node>, req: SampleBlocks) -> Result<SampledBlocks, LabError> {
    if req.count == 0 || req.count > SAMPLE_COUNT_MAX {
        return Err((
            StatusCode::BAD_REQUEST,
            format!(
                "count {} must be between 1 and {SAMPLE_COUNT_MAX}",
                req.count
            ),
        ));
    }
    let mut drives: Vec<(DriveId, Arc<converge_engine::Drive>)> = node
        .drives
        .iter()
        .filter(|(id, _)| req.drive.is_none_or(|d| d == **id))
        .map(|(id, d)| (*id, d.drive().clone()))
        .collect();
    if drives.is_empty() {
        let id = req.drive.map(|d| d.0).unwrap_or_default();
        return Err((
            StatusCode::NOT_FOUND,
            format!(
                "drive {id:016x} is not on node {}; `converge drive list` shows where each drive is",
                node.cfg.node_id
            ),
        ));
    }
    drives.sort_by_key(|(id, _)| *id);
    // The node keeps drives by id; their paths are in the drive records it registered.
    let paths: HashMap<DriveId, String> = node
        .cluster
        .drives()
        .await
        .map_err(|e| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("control plane unavailable: {e}"),
            )
        })?
        .into_iter()
        .filter(|d| d.node == node.cfg.node_id)
        .map(|d| (d.id, d.path))
        .collect();
    let seed = req.seed.unwrap_or_else(rand::random);
    let count = req.count as usize;
    let samples = tokio::task::spawn_blocking(move || {
        drives
            .into_iter()
            .map(|(id, d)| (id, d.sample_data_blocks(count, seed ^ id.0)))
            .collect::<Vec<(DriveId, DataBlockSample)>>()
    })
    .await
    .map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("sampling failed: {e}"),
        )
    })?;
    let written_blocks = samples.iter().map(|(_, s)| s.written_blocks).sum();
    let mut rng = StdRng::seed_from_u64(seed);
    let picked = merge_uniform(samples, count, &mut rng);
    let mut blocks: Vec<SampledBlock> = picked
        .into_iter()
        .map(|(drive, b)| SampledBlock {
            drive,
            path: paths.get(&drive).cloned().unwrap_or_default(),
            volume: b.key.volume,
            slab: b.key.slab.0,
            block: b.block,
            offset_bytes: b.offset_bytes,
            version: b.version.0,
        })
        .collect();
    if let Some(b) = blocks.iter().find(|b| b.path.is_empty()) {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "drive {:016x} has no record in etcd yet; try again",
                b.drive.0
            ),
        ));
    }
    blocks.sort_by_key(|b| (b.drive, b.volume, b.slab, b.block));
    Ok(SampledBlocks {
        node: node.cfg.node_id,
        seed,
        written_blocks,
        blocks,
    })
}

/// Draws `count` blocks uniformly from the union of the drives' written blocks, given a
/// uniform sample of up to `count` blocks of each drive and each drive's total: pick a
/// drive in proportion to its blocks not yet picked, then the next of its (shuffled) sample.
fn merge_uniform(
    samples: Vec<(DriveId, DataBlockSample)>,
    count: usize,
    rng: &mut StdRng,
) -> Vec<(DriveId, converge_engine::DataBlock)> {
    let mut pools: Vec<(DriveId, u64, Vec<converge_engine::DataBlock>)> = samples
        .into_iter()
        .map(|(id, mut s)| {
            s.blocks.shuffle(rng);
            (id, s.written_blocks, s.blocks)
        })
        .collect();
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let left: u64 = pools.iter().map(|p| p.1).sum();
        if left == 0 {
            break;
        }
        let mut r = rng.gen_range(0..left);
        let Some(p) = pools.iter_mut().find(|p| {
            if r < p.1 {
                true
            } else {
                r -= p.1;
                false
            }
        }) else {
            break;
        };
        match p.2.pop() {
            Some(b) => {
                p.1 -= 1;
                out.push((p.0, b));
            }
            // Cannot happen (a drive's sample holds min(count, written) blocks), but a
            // drive that ran dry simply leaves the draw.
            None => p.1 = 0,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use converge_engine::DataBlock;
    use converge_types::{ExtentKey, SlabIndex, Version, VolumeId};

    fn sample(n: u32, written: u64) -> DataBlockSample {
        DataBlockSample {
            blocks: (0..n)
                .map(|b| DataBlock {
                    key: ExtentKey {
                        volume: VolumeId(1),
                        slab: SlabIndex(0),
                    },
                    block: b,
                    offset_bytes: u64::from(b) * 4096,
                    version: Version(1),
                    members: vec![b],
                })
                .collect(),
            written_blocks: written,
        }
    }

    #[test]
    fn merge_draws_distinct_blocks_in_proportion_to_each_drive() {
        let mut rng = StdRng::seed_from_u64(3);
        // Drive 1 has 3 written blocks, drive 2 has 1000 (sample of 10), drive 3 none.
        let mut from_small = 0;
        for _ in 0..200 {
            let s = vec![
                (DriveId(1), sample(3, 3)),
                (DriveId(2), sample(10, 1000)),
                (DriveId(3), sample(0, 0)),
            ];
            let got = merge_uniform(s, 10, &mut rng);
            assert_eq!(got.len(), 10);
            let mut keys: Vec<(u64, u32)> = got.iter().map(|(d, b)| (d.0, b.block)).collect();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), 10, "distinct");
            assert!(got.iter().all(|(d, _)| d.0 != 3));
            from_small += got.iter().filter(|(d, _)| d.0 == 1).count();
        }
        // Expected 200 * 10 * 3/1003 = about 6; far below what an even split would give.
        assert!(from_small < 40, "{from_small}");
        // Fewer written blocks than asked: all of them.
        let got = merge_uniform(vec![(DriveId(1), sample(2, 2))], 5, &mut rng);
        assert_eq!(got.len(), 2);
    }
}
