//! `converge lab fault corrupt`: bit rot on demand. The node names written data blocks of
//! its drives and where they sit in the drive files (`POST /v1/lab/blocks/sample`); we flip
//! one bit in each, in the file itself, as a failing disk would. The daemon reads with
//! O_DIRECT, so the next read of that block meets the flipped bit (we write through the
//! page cache and fdatasync; the kernel keeps the two views coherent).

use crate::lab::{self, Lab};
use anyhow::{anyhow, bail, Context, Result};
use converge_api::lab::{SampleBlocks, SampledBlocks};
use converge_api::VolumeInfo;
use converge_types::{DriveId, BLOCK_SIZE};
use serde::Serialize;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;

/// One flipped bit.
#[derive(Clone, Debug, Serialize)]
pub struct Flip {
    pub drive: String,
    pub path: String,
    pub volume: String,
    pub slab: u64,
    /// Block index within the slab.
    pub block: u32,
    /// Byte offset of the block in the drive file.
    pub block_offset_bytes: u64,
    /// Byte offset of the flipped byte in the drive file.
    pub offset_bytes: u64,
    pub bit: u8,
    pub before: u8,
    pub after: u8,
}

#[derive(Clone, Debug, Serialize)]
pub struct CorruptReport {
    pub node: u32,
    /// Replays the same choice of blocks (`--seed`) while the data stays the same.
    pub seed: u64,
    /// Written blocks the node's drives hold (the blocks could be chosen among these).
    pub written_blocks: u64,
    pub flips: Vec<Flip>,
}

/// Small deterministic generator (splitmix64) for the bit positions: reproducible by seed,
/// no dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// `converge lab fault fail-drive`: the node fails one of its capacity drives (the one
/// named, or the one holding the most copies). Returns the drive's id.
pub fn fail_drive(l: &Lab, id: u32, drive: Option<&str>) -> Result<DriveId> {
    let n = serving_node(l, id, "its API must answer")?;
    let drive = drive.map(parse_drive).transpose()?;
    let req = serde_json::json!({ "drive": drive });
    #[derive(serde::Deserialize)]
    struct Failed {
        drive: DriveId,
    }
    let f: Failed = crate::http::call(&n.api, "POST", "/v1/lab/drives/fail", Some(&req))
        .with_context(|| format!("asking node{id} to fail a drive"))?;
    Ok(f.drive)
}

/// Node `id` of the lab, if its API answers (else an error saying `why` it must).
fn serving_node<'a>(l: &'a Lab, id: u32, why: &str) -> Result<&'a lab::LabNode> {
    let n = l
        .nodes
        .iter()
        .find(|n| n.id == id)
        .ok_or_else(|| anyhow!("the lab has no node {id}"))?;
    let st = lab::node_state(l, n);
    if !st.serves() {
        bail!("node{id} is {st}: {why} (`converge lab fault resume|heal|restart {id}` first)");
    }
    Ok(n)
}

fn parse_drive(d: &str) -> Result<DriveId> {
    u64::from_str_radix(d.trim_start_matches("0x"), 16)
        .map(DriveId)
        .map_err(|_| {
            anyhow!("--drive {d:?} is not a drive id (16 hex digits, see `converge drive list`)")
        })
}

pub fn corrupt(
    l: &Lab,
    id: u32,
    blocks: u32,
    seed: Option<u64>,
    drive: Option<&str>,
) -> Result<CorruptReport> {
    let n = serving_node(l, id, "its API must answer to name its written blocks")?;
    let drive = drive.map(parse_drive).transpose()?;
    let req = serde_json::to_value(SampleBlocks {
        count: blocks,
        seed,
        drive,
    })?;
    let s: SampledBlocks = crate::http::call(&n.api, "POST", "/v1/lab/blocks/sample", Some(&req))
        .with_context(|| format!("asking node{id} for written blocks"))?;
    if s.blocks.is_empty() {
        bail!(
            "node{id} has no written data blocks yet: write to a volume with a copy on it first \
             (e.g. `nbdcopy FILE URI`); `converge volume show NAME` lists where copies are"
        );
    }
    // Volume names for the report, best effort.
    let names: HashMap<u64, String> =
        crate::http::call::<Vec<VolumeInfo>>(&n.api, "GET", "/v1/volumes", None)
            .map(|v| v.into_iter().map(|v| (v.id.0, v.name)).collect())
            .unwrap_or_default();
    let mut rng = SplitMix(s.seed);
    let mut flips = Vec::new();
    for b in &s.blocks {
        let r = rng.next();
        let within = r % BLOCK_SIZE as u64;
        let bit = ((r >> 32) % 8) as u8;
        let off = b.offset_bytes + within;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&b.path)
            .with_context(|| format!("opening drive file {}", b.path))?;
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, off)
            .with_context(|| format!("reading {} at {off}", b.path))?;
        let before = byte[0];
        byte[0] ^= 1 << bit;
        f.write_all_at(&byte, off)
            .with_context(|| format!("writing {} at {off}", b.path))?;
        f.sync_data()
            .with_context(|| format!("syncing {}", b.path))?;
        flips.push(Flip {
            drive: format!("{:016x}", b.drive.0),
            path: b.path.clone(),
            volume: names
                .get(&b.volume.0)
                .cloned()
                .unwrap_or_else(|| b.volume.to_string()),
            slab: b.slab,
            block: b.block,
            block_offset_bytes: b.offset_bytes,
            offset_bytes: off,
            bit,
            before,
            after: byte[0],
        });
    }
    Ok(CorruptReport {
        node: id,
        seed: s.seed,
        written_blocks: s.written_blocks,
        flips,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_reproducible_and_spreads() {
        let a: Vec<u64> = {
            let mut r = SplitMix(7);
            (0..4).map(|_| r.next()).collect()
        };
        let mut r = SplitMix(7);
        assert_eq!(a, (0..4).map(|_| r.next()).collect::<Vec<_>>());
        let mut r = SplitMix(1);
        let bits: std::collections::BTreeSet<u64> = (0..64).map(|_| (r.next() >> 32) % 8).collect();
        assert_eq!(bits.len(), 8);
    }
}
