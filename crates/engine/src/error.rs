//! Typed errors of the engine, so callers (volume, node) can react per cause: fence, repair, fail the drive.

use converge_types::{Epoch, ExtentKey};

/// Why a checkpoint refuses to write a superblock: its generation would reach u64::MAX,
/// which the decoder refuses (only a damaged superblock gets there).
pub(crate) const GENERATION_EXHAUSTED: &str =
    "superblock generation exhausted; copy the drive's extents elsewhere and reformat it";

/// Everything a drive operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "drive I/O failed during {op}: {source}; the drive should be taken offline and checked"
    )]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "drive is failed after an earlier I/O error ({reason}); reopen it to recover from the journal"
    )]
    Failed { reason: String },
    #[error("data of block {block} of extent {key:?} does not match the crc32c sent by the owner; the request was corrupted in flight and nothing was written")]
    ChecksumMismatch { key: ExtentKey, block: u32 },
    #[error("extent {key:?} is at epoch {current}, request carries older epoch {requested}: the sender is no longer the owner")]
    StaleEpoch {
        key: ExtentKey,
        requested: Epoch,
        current: Epoch,
    },
    #[error("extent {key:?} was released (its slab was trimmed whole) while this request waited; nothing was written")]
    Released { key: ExtentKey },
    /// A read at a snapshot this copy does not hold (docs/adr/0012): it was filled after
    /// it, or missed it; another copy may hold it.
    #[error("this copy of volume {} slab {} does not hold snapshot {snapshot} (it holds {holds}): it was filled or missed a snapshot since; read another copy", key.volume, key.slab)]
    NoSnapshot {
        key: ExtentKey,
        snapshot: u32,
        holds: String,
    },
    #[error("drive holds {held} unsettled priors of parity writes, its limit: the owner must settle completed rows before writing more")]
    HeldFull { held: u64 },
    #[error("no free extent on this drive (all {extents_total} in use); place the slab on another drive or free extents")]
    NoSpace { extents_total: u64 },
    #[error("drive is full: {committed_bytes} of its {capacity_bytes} data bytes are claimed by its extents (plain extents count whole, compressed ones what they store); place the slab or copy on another drive, or free space")]
    Full {
        committed_bytes: u64,
        capacity_bytes: u64,
    },
    #[error("invalid I/O on extent {key:?}: {reason} (offset {offset}, length {len})")]
    InvalidIo {
        key: ExtentKey,
        reason: &'static str,
        offset: u64,
        len: u64,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("drive is too small: {len_bytes} bytes, at least {needed_bytes} are needed for one extent plus metadata")]
    TooSmall { len_bytes: u64, needed_bytes: u64 },
    #[error("no converge superblock on this drive; format it first")]
    NotFormatted,
    #[error("drive has engine format version {found}, this build supports {supported}: a newer drive needs a newer converge; an older one (version 1 wrote data in place) has no in-place upgrade: remove the drive, wipe it, add it again and let the cluster rebuild its copies")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("drive metadata is corrupt: {0}")]
    Corrupt(String),
}

impl EngineError {
    /// The drive has no room for what was asked: no free extent slot, or no room for one
    /// more whole extent (or for blocks a snapshot keeps) beside what its extents claim.
    /// Nothing was written; the owner answers the client "no space" (ENOSPC), not EIO.
    pub fn is_no_space(&self) -> bool {
        matches!(self, EngineError::NoSpace { .. } | EngineError::Full { .. })
    }

    pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> EngineError {
        move |source| EngineError::Io { op, source }
    }
}
