//! Bodies of the lab endpoints (`/v1/lab/...`): debug views the lab's fault injector uses,
//! such as where written blocks sit in a node's drive files so `converge lab fault corrupt`
//! flips bits that a read will meet.

use converge_types::{DriveId, NodeId, VolumeId};
use serde::{Deserialize, Serialize};

/// `POST /v1/lab/blocks/sample`: pick written data blocks of the answering node's drives.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SampleBlocks {
    /// How many distinct blocks to return at most (1..=4096).
    pub count: u32,
    /// Seed of the random choice, to replay one; default: a fresh random seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Only this drive of the node; default: all of them.
    #[serde(default)]
    pub drive: Option<DriveId>,
}

/// One written 4 KiB block and where its bytes are.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SampledBlock {
    pub drive: DriveId,
    /// The drive file or device, as the node opened it.
    pub path: String,
    pub volume: VolumeId,
    pub slab: u64,
    /// Block index within the slab (4 KiB units).
    pub block: u32,
    /// Byte offset of the block's data in `path`.
    pub offset_bytes: u64,
    pub version: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SampledBlocks {
    pub node: NodeId,
    pub seed: u64,
    /// Written blocks on the drives sampled (the population the sample is drawn from).
    pub written_blocks: u64,
    pub blocks: Vec<SampledBlock>,
}
