//! One operation on one extent, and its answer: the unit the owner (`converge-volume`) sends,
//! the peer protocol (`converge-rpc`) carries, and the replica service (`converge-replica`)
//! runs on a drive, in the daemon and in the simulator alike. A field added here reaches
//! every one of those layers from this one place.

use crate::{Compression, Epoch, ExtentKey, Version, BLOCK_SIZE};
use bytes::Bytes;
use std::fmt;
use std::sync::Arc;

/// Blocks `[first, first + count)` of an extent, settled up to `upto` ([`ExtentOp::Settle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettleRows {
    pub first: u32,
    pub count: u32,
    pub upto: Version,
}

/// What a copy that gets a snapshot floor can answer for the snapshots before it
/// (docs/adr/0012): a copy filled after a snapshot (a rebuild, a resync) lacks the states
/// that snapshot kept, so it must refuse reads of it rather than answer with later data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloorHistory {
    /// A new slab's copy, before its first write: every snapshot (before its slab existed
    /// it reads as zeros). An extent that holds blocks already (an earlier incarnation's,
    /// whose release did not reach this drive) holds none: they are no snapshot's.
    Full,
    /// An in-sync copy: what it held before, if its floor was the previous snapshot (else
    /// it missed one, and holds only the new one on).
    Continues,
    /// A copy still being filled: none, until a later floor finds it in sync (or its fill
    /// copies the snapshots' states and says so with `Copied`). Places the extent.
    Joining,
    /// A copy whose fill copied every snapshot's states from `previous` (the oldest it
    /// holds now) up to this one, at or below its floor (docs/adr/0012, step 4); the floor stays.
    Copied,
}

impl FloorHistory {
    pub fn code(self) -> u8 {
        match self {
            FloorHistory::Full => 0,
            FloorHistory::Continues => 1,
            FloorHistory::Joining => 2,
            FloorHistory::Copied => 3,
        }
    }
    pub fn from_code(c: u8) -> Option<FloorHistory> {
        Some(match c {
            0 => FloorHistory::Full,
            1 => FloorHistory::Continues,
            2 => FloorHistory::Joining,
            3 => FloorHistory::Copied,
            _ => return None,
        })
    }
}

/// Most [`SettleRows`] one settle carries.
pub const SETTLE_ROWS_MAX: usize = 1024;

/// An operation on the copy of one slab that one drive holds. The drive is named by whoever
/// routes the operation (the owner's `ExtentLoc`, the request on the wire), not here.
///
/// Every operation but [`ExtentOp::Free`] carries the owner's epoch: a replica refuses an
/// epoch older than the newest it has seen for the extent, so a deposed owner can neither
/// change nor read it. Offsets and lengths are bytes within the slab, in whole blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtentOp {
    /// Write `data` at `offset` with `version`; `crcs[i]` is the crc32c of block `i` of
    /// `data` (the replica verifies them before it writes: end to end). `codec`: how the
    /// volume's data is compressed on the drive (docs/adr/0010; the replica keeps it for
    /// the extent). Answered [`ExtentReply::Ok`] once durable.
    Write {
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
        codec: Compression,
    },
    /// Read `len` bytes at `offset`: [`ExtentReply::Read`].
    Read {
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    },
    /// Zero `len` bytes at `offset` with `version` (metadata only): [`ExtentReply::Ok`].
    Zero {
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    },
    /// A read that answers every block's version, for copying between replicas:
    /// [`ExtentReply::Blocks`].
    ReadBlocks {
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    },
    /// Copy blocks in (resync, rebuild, reconcile, scrub repair): block `i` gets
    /// `versions[i]` only if its version is still `expect[i]` (compare-and-set).
    /// [`ExtentReply::Written`] says how many blocks were written.
    WriteBlocks {
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        crcs: Arc<[u32]>,
        versions: Vec<Version>,
        expect: Vec<Version>,
        data: Bytes,
        codec: Compression,
    },
    /// Fence the extent at `epoch` (older owners are refused from then on), then answer the
    /// versions of `count` blocks from `offset`: [`ExtentReply::Versions`].
    Versions {
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        count: u32,
    },
    /// Fence the extent at `epoch`, then answer the digest of its version map (equal
    /// digests: equal versions): [`ExtentReply::Digest`].
    Digest { key: ExtentKey, epoch: Epoch },
    /// Drop the extent (a deleted volume, an orphan): [`ExtentReply::Ok`]. Not fenced: no
    /// owner writes to an extent that is being freed.
    Free { key: ExtentKey },
    /// The owner releases a slab it zeroed whole at version `upto` (thin reclaim): the
    /// extent is freed unless a block is newer than `upto` or being written (a later
    /// incarnation of the slab, which a late release must not free). Fenced like the
    /// others. [`ExtentReply::Ok`] either way: a kept extent is an orphan to reclaim.
    Release {
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
    },
    /// A parity chunk's write (docs/adr/0008): as [`ExtentOp::Write`], but every block
    /// keeps its state before the write as its prior until settled or reverted.
    /// [`ExtentReply::Ok`] once durable, priors included.
    WriteHeld {
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
    },
    /// Drop the priors of blocks at versions up to `upto` (their rows completed on every
    /// chunk), and of each of `rows`' blocks at versions up to its own (a completed write
    /// newer than one still running): [`ExtentReply::Ok`].
    Settle {
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
        rows: Vec<SettleRows>,
    },
    /// Put back the prior of every block of the range whose version is `version` (a row
    /// write that did not complete): [`ExtentReply::Written`] says how many went back.
    Revert {
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u32,
    },
    /// Each block's version and its prior's, if it holds one: [`ExtentReply::Priors`].
    /// Not a fence (the owner fences with `Digest` or `Versions` first).
    Priors {
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        count: u32,
    },
    /// Sets the extent's snapshot floor to `snapshot`, its volume's newest snapshot
    /// (docs/adr/0012): later writes at a newer epoch preserve the states it reads.
    /// Floors only rise. A drive that does not hold the extent has nothing to preserve.
    /// [`ExtentReply::Ok`] once durable.
    SnapshotFloor {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        /// The volume's snapshot before this one (None: none).
        previous: Option<Epoch>,
        history: FloorHistory,
    },
    /// Deletes snapshot `snapshot` from the extent: what `below` (the next older
    /// remaining snapshot, if any) also reads moves into its keeping, the rest is freed.
    /// [`ExtentReply::Ok`] once durable; unknown snapshots are Ok (retries are safe).
    DropSnapshot {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        below: Option<Epoch>,
    },
    /// Read `len` bytes at `offset` as snapshot `snapshot` holds them:
    /// [`ExtentReply::Read`].
    ReadAt {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        len: u32,
    },
    /// Which of `count` blocks from `offset` read differently at snapshot `from` and at
    /// snapshot `to` (`None`: the live extent): [`ExtentReply::Bitmap`], a bitmap.
    /// Metadata only; refused like `ReadAt` by a copy that does not hold a snapshot named.
    Changed {
        key: ExtentKey,
        epoch: Epoch,
        from: Epoch,
        to: Option<Epoch>,
        offset: u64,
        count: u32,
    },
    /// Which of `count` blocks from `offset` were never written as of snapshot `at`
    /// (`None`: now): [`ExtentReply::Bitmap`]. A clone reads those from its parent.
    Absent {
        key: ExtentKey,
        epoch: Epoch,
        at: Option<Epoch>,
        offset: u64,
        count: u32,
    },
    /// The version of each of `count` blocks from `offset` as snapshot `snapshot` reads it
    /// (0: never written then): [`ExtentReply::Versions`]. Refused like `ReadAt` by a copy
    /// that does not hold the snapshot, unless `any` (the copy a fill is writing answers
    /// what it reads so far; docs/adr/0012, step 4).
    VersionsAt {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        count: u32,
        any: bool,
    },
    /// A read at snapshot `snapshot` that answers every block's version there, for copying
    /// a snapshot's states into a copy being filled: [`ExtentReply::Blocks`]. Refused like
    /// `ReadAt` by a copy that does not hold the snapshot.
    ReadBlocksAt {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        len: u32,
    },
    /// A fill sets what a copy reads at snapshot `snapshot` (at most its floor): block `i`
    /// gets the state of version `versions[i]` with `data`'s block, kept for that snapshot
    /// (a version of 0: the block reads as never written there). [`ExtentReply::Written`].
    WriteShadow {
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        crcs: Arc<[u32]>,
        versions: Vec<Version>,
        data: Bytes,
    },
    /// What the extent keeps for each of `snapshots` (the volume's, oldest first, at most
    /// [`KEPT_SNAPSHOTS_MAX`]): [`ExtentReply::Counts`], two per snapshot — the blocks it
    /// keeps for it, and how many of them deleting it would free (those the next older
    /// snapshot does not read). Metadata only; 0 for a snapshot the extent keeps nothing
    /// for (or an extent the drive does not hold).
    KeptBlocks {
        key: ExtentKey,
        epoch: Epoch,
        snapshots: Vec<Epoch>,
    },
}

/// The most snapshots one [`ExtentOp::KeptBlocks`] names (a volume holds at most 64).
pub const KEPT_SNAPSHOTS_MAX: usize = 256;

impl ExtentOp {
    pub fn key(&self) -> ExtentKey {
        match self {
            ExtentOp::Write { key, .. }
            | ExtentOp::Read { key, .. }
            | ExtentOp::Zero { key, .. }
            | ExtentOp::ReadBlocks { key, .. }
            | ExtentOp::WriteBlocks { key, .. }
            | ExtentOp::Versions { key, .. }
            | ExtentOp::Digest { key, .. }
            | ExtentOp::Release { key, .. }
            | ExtentOp::WriteHeld { key, .. }
            | ExtentOp::Settle { key, .. }
            | ExtentOp::Revert { key, .. }
            | ExtentOp::Priors { key, .. }
            | ExtentOp::SnapshotFloor { key, .. }
            | ExtentOp::DropSnapshot { key, .. }
            | ExtentOp::ReadAt { key, .. }
            | ExtentOp::Changed { key, .. }
            | ExtentOp::Absent { key, .. }
            | ExtentOp::VersionsAt { key, .. }
            | ExtentOp::ReadBlocksAt { key, .. }
            | ExtentOp::WriteShadow { key, .. }
            | ExtentOp::KeptBlocks { key, .. }
            | ExtentOp::Free { key } => *key,
        }
    }

    /// The owner's epoch the operation carries (none for [`ExtentOp::Free`]).
    pub fn epoch(&self) -> Option<Epoch> {
        match self {
            ExtentOp::Write { epoch, .. }
            | ExtentOp::Read { epoch, .. }
            | ExtentOp::Zero { epoch, .. }
            | ExtentOp::ReadBlocks { epoch, .. }
            | ExtentOp::WriteBlocks { epoch, .. }
            | ExtentOp::Versions { epoch, .. }
            | ExtentOp::Digest { epoch, .. }
            | ExtentOp::Release { epoch, .. }
            | ExtentOp::WriteHeld { epoch, .. }
            | ExtentOp::Settle { epoch, .. }
            | ExtentOp::Revert { epoch, .. }
            | ExtentOp::Priors { epoch, .. }
            | ExtentOp::SnapshotFloor { epoch, .. }
            | ExtentOp::DropSnapshot { epoch, .. }
            | ExtentOp::ReadAt { epoch, .. }
            | ExtentOp::Changed { epoch, .. }
            | ExtentOp::Absent { epoch, .. }
            | ExtentOp::VersionsAt { epoch, .. }
            | ExtentOp::ReadBlocksAt { epoch, .. }
            | ExtentOp::WriteShadow { epoch, .. }
            | ExtentOp::KeptBlocks { epoch, .. } => Some(*epoch),
            ExtentOp::Free { .. } => None,
        }
    }

    /// Short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            ExtentOp::Write { .. } => "write",
            ExtentOp::Read { .. } => "read",
            ExtentOp::Zero { .. } => "zero",
            ExtentOp::ReadBlocks { .. } => "read_blocks",
            ExtentOp::WriteBlocks { .. } => "write_blocks",
            ExtentOp::Versions { .. } => "versions",
            ExtentOp::Digest { .. } => "digest",
            ExtentOp::Free { .. } => "free",
            ExtentOp::Release { .. } => "release",
            ExtentOp::WriteHeld { .. } => "write_held",
            ExtentOp::Settle { .. } => "settle",
            ExtentOp::Revert { .. } => "revert",
            ExtentOp::Priors { .. } => "priors",
            ExtentOp::SnapshotFloor { .. } => "snapshot_floor",
            ExtentOp::DropSnapshot { .. } => "drop_snapshot",
            ExtentOp::ReadAt { .. } => "read_at",
            ExtentOp::Changed { .. } => "changed",
            ExtentOp::Absent { .. } => "absent",
            ExtentOp::VersionsAt { .. } => "versions_at",
            ExtentOp::ReadBlocksAt { .. } => "read_blocks_at",
            ExtentOp::WriteShadow { .. } => "write_shadow",
            ExtentOp::KeptBlocks { .. } => "kept_blocks",
        }
    }

    /// Whether the operation stores blocks, and so creates the extent on a drive that does
    /// not hold it yet (the replica admits that only for a copy a slab record places there).
    pub fn stores_blocks(&self) -> bool {
        matches!(
            self,
            ExtentOp::Write { .. }
                | ExtentOp::WriteHeld { .. }
                | ExtentOp::Zero { .. }
                | ExtentOp::WriteBlocks { .. }
        )
    }

    /// Whether the operation creates the extent on a drive that does not hold it: every
    /// one that stores blocks, and the fencing ones (an absent extent is created at the
    /// fencing epoch, so an older owner's late write cannot create it afterwards).
    pub fn creates_extent(&self) -> bool {
        self.stores_blocks()
            || matches!(
                self,
                ExtentOp::Versions { .. }
                    | ExtentOp::Digest { .. }
                    | ExtentOp::SnapshotFloor {
                        history: FloorHistory::Full | FloorHistory::Joining,
                        ..
                    }
            )
    }

    /// What a correct answer to this operation looks like. Taken before the operation is
    /// sent (it moves), and checked on the answer: nothing trusts the network.
    pub fn reply_shape(&self) -> ReplyShape {
        match self {
            ExtentOp::Write { .. }
            | ExtentOp::Zero { .. }
            | ExtentOp::Free { .. }
            | ExtentOp::Release { .. }
            | ExtentOp::WriteHeld { .. }
            | ExtentOp::Settle { .. }
            | ExtentOp::SnapshotFloor { .. }
            | ExtentOp::DropSnapshot { .. } => ReplyShape::Ok,
            ExtentOp::Revert { len, .. } => ReplyShape::Written {
                blocks: len / crate::BLOCK_SIZE as u32,
            },
            ExtentOp::Priors { count, .. } => ReplyShape::Priors { count: *count },
            ExtentOp::Read { len, .. } | ExtentOp::ReadAt { len, .. } => {
                ReplyShape::Read { len: *len }
            }
            ExtentOp::ReadBlocks { len, .. } | ExtentOp::ReadBlocksAt { len, .. } => {
                ReplyShape::Blocks { len: *len }
            }
            ExtentOp::WriteBlocks { versions, .. } | ExtentOp::WriteShadow { versions, .. } => {
                ReplyShape::Written {
                    blocks: u32::try_from(versions.len()).unwrap_or(u32::MAX),
                }
            }
            ExtentOp::Versions { count, .. } | ExtentOp::VersionsAt { count, .. } => {
                ReplyShape::Versions { count: *count }
            }
            ExtentOp::Digest { .. } => ReplyShape::Digest,
            ExtentOp::Changed { count, .. } | ExtentOp::Absent { count, .. } => {
                ReplyShape::Bitmap { count: *count }
            }
            ExtentOp::KeptBlocks { snapshots, .. } => ReplyShape::Counts {
                count: u32::try_from(2 * snapshots.len()).unwrap_or(u32::MAX),
            },
        }
    }
}

/// A replica's answer to a read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadReply {
    pub data: Bytes,
    /// Indexes (within this read) of blocks whose checksum did not match: their bytes must
    /// not be used.
    pub bad_blocks: Vec<u32>,
    /// Indexes of blocks that read soundly but that the replica's recovery rolled back to
    /// an older state after a power loss (the newer write it had in its last journal batch
    /// did not check out): another copy may hold a newer, acked version. The owner checks
    /// them against the other copies before it serves their bytes.
    pub suspect: Vec<u32>,
    /// Highest block version among the blocks read (a repair rewrites a bad copy with the
    /// good copy's version, so that it is not newer than the write it holds).
    pub version: Version,
}

/// A replica's answer to [`ExtentOp::ReadBlocks`]: the data and every block's version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlocksReply {
    pub data: Bytes,
    pub bad_blocks: Vec<u32>,
    /// As [`ReadReply::suspect`].
    pub suspect: Vec<u32>,
    pub versions: Vec<Version>,
}

/// The answer to an [`ExtentOp`] that succeeded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtentReply {
    /// Done (and durable): [`ExtentOp::Write`], [`ExtentOp::Zero`], [`ExtentOp::Free`].
    Ok,
    Read(ReadReply),
    Blocks(BlocksReply),
    /// How many blocks an [`ExtentOp::WriteBlocks`] wrote (the others had changed).
    Written(u32),
    Digest(u64),
    Versions(Vec<Version>),
    /// Per block: its version and its prior's ([`ExtentOp::Priors`]).
    Priors(Vec<(Version, Option<Version>)>),
    /// A bitmap of blocks, bit `i % 64` of word `i / 64` for block `i`
    /// ([`ExtentOp::Changed`], [`ExtentOp::Absent`]).
    Bitmap(Vec<u64>),
    /// Numbers an operation counted ([`ExtentOp::KeptBlocks`]).
    Counts(Vec<u64>),
}

impl ExtentReply {
    pub fn name(&self) -> &'static str {
        match self {
            ExtentReply::Ok => "ok",
            ExtentReply::Read(_) => "read data",
            ExtentReply::Blocks(_) => "blocks",
            ExtentReply::Written(_) => "blocks written",
            ExtentReply::Digest(_) => "a digest",
            ExtentReply::Versions(_) => "versions",
            ExtentReply::Priors(_) => "priors",
            ExtentReply::Bitmap(_) => "a change bitmap",
            ExtentReply::Counts(_) => "counts",
        }
    }

    pub fn into_ok(self) -> Option<()> {
        matches!(self, ExtentReply::Ok).then_some(())
    }

    pub fn into_read(self) -> Option<ReadReply> {
        match self {
            ExtentReply::Read(r) => Some(r),
            _ => None,
        }
    }

    pub fn into_blocks(self) -> Option<BlocksReply> {
        match self {
            ExtentReply::Blocks(r) => Some(r),
            _ => None,
        }
    }

    pub fn into_written(self) -> Option<u32> {
        match self {
            ExtentReply::Written(n) => Some(n),
            _ => None,
        }
    }

    pub fn into_digest(self) -> Option<u64> {
        match self {
            ExtentReply::Digest(d) => Some(d),
            _ => None,
        }
    }

    pub fn into_versions(self) -> Option<Vec<Version>> {
        match self {
            ExtentReply::Versions(v) => Some(v),
            _ => None,
        }
    }

    pub fn into_priors(self) -> Option<Vec<(Version, Option<Version>)>> {
        match self {
            ExtentReply::Priors(v) => Some(v),
            _ => None,
        }
    }

    pub fn into_bitmap(self) -> Option<Vec<u64>> {
        match self {
            ExtentReply::Bitmap(v) => Some(v),
            _ => None,
        }
    }

    pub fn into_counts(self) -> Option<Vec<u64>> {
        match self {
            ExtentReply::Counts(v) => Some(v),
            _ => None,
        }
    }
}

/// The answer an operation must get: its kind, and the sizes the asker will index by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyShape {
    Ok,
    /// `len` bytes of data; bad blocks within them.
    Read {
        len: u32,
    },
    /// `len` bytes of data, one version per block; bad blocks within them.
    Blocks {
        len: u32,
    },
    /// At most `blocks` blocks written.
    Written {
        blocks: u32,
    },
    Digest,
    /// `count` versions.
    Versions {
        count: u32,
    },
    /// `count` (version, prior) pairs.
    Priors {
        count: u32,
    },
    /// A bitmap of `count` blocks: `ceil(count / 64)` words, no bit set past `count`.
    Bitmap {
        count: u32,
    },
    /// `count` numbers.
    Counts {
        count: u32,
    },
}

/// An answer that does not fit its operation (see [`ReplyShape::check`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("answered {0}")]
pub struct BadReply(pub String);

impl ReplyShape {
    /// Checks that `reply` is the answer this shape describes, so that the asker may index
    /// its data, versions and bad blocks without further checks.
    pub fn check(self, reply: &ExtentReply) -> Result<(), BadReply> {
        let blocks_in = |len: u32| (len as usize).div_ceil(BLOCK_SIZE);
        let bad_ok = |bad: &[u32], len: u32| bad.iter().all(|b| (*b as usize) < blocks_in(len));
        let fits = match (self, reply) {
            (ReplyShape::Ok, ExtentReply::Ok) | (ReplyShape::Digest, ExtentReply::Digest(_)) => {
                true
            }
            (ReplyShape::Read { len }, ExtentReply::Read(r)) => {
                r.data.len() == len as usize
                    && bad_ok(&r.bad_blocks, len)
                    && bad_ok(&r.suspect, len)
            }
            (ReplyShape::Blocks { len }, ExtentReply::Blocks(r)) => {
                r.data.len() == len as usize
                    && r.versions.len() == blocks_in(len)
                    && bad_ok(&r.bad_blocks, len)
                    && bad_ok(&r.suspect, len)
            }
            (ReplyShape::Written { blocks }, ExtentReply::Written(n)) => *n <= blocks,
            (ReplyShape::Versions { count }, ExtentReply::Versions(v)) => v.len() == count as usize,
            (ReplyShape::Priors { count }, ExtentReply::Priors(v)) => v.len() == count as usize,
            (ReplyShape::Counts { count }, ExtentReply::Counts(v)) => v.len() == count as usize,
            (ReplyShape::Bitmap { count }, ExtentReply::Bitmap(w)) => {
                let tail = count % 64;
                w.len() == (count as usize).div_ceil(64)
                    && (tail == 0 || w.last().is_none_or(|l| l >> tail == 0))
            }
            _ => false,
        };
        if fits {
            Ok(())
        } else {
            Err(BadReply(format!("{} where {self} was asked", Said(reply))))
        }
    }
}

impl fmt::Display for ReplyShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplyShape::Ok => write!(f, "ok"),
            ReplyShape::Read { len } => write!(f, "{len} bytes of read data"),
            ReplyShape::Blocks { len } => {
                write!(f, "{len} bytes of blocks with one version per block")
            }
            ReplyShape::Written { blocks } => write!(f, "at most {blocks} blocks written"),
            ReplyShape::Digest => write!(f, "a digest"),
            ReplyShape::Versions { count } => write!(f, "{count} versions"),
            ReplyShape::Priors { count } => write!(f, "{count} versions with their priors"),
            ReplyShape::Bitmap { count } => write!(f, "a bitmap of {count} blocks"),
            ReplyShape::Counts { count } => write!(f, "{count} counts"),
        }
    }
}

/// A reply described by its sizes (never its data) for an error message.
struct Said<'a>(&'a ExtentReply);

impl fmt::Display for Said<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            ExtentReply::Read(r) => write!(
                f,
                "{} bytes of read data with bad blocks {:?}",
                r.data.len(),
                r.bad_blocks
            ),
            ExtentReply::Blocks(r) => write!(
                f,
                "{} bytes of blocks with {} versions and bad blocks {:?}",
                r.data.len(),
                r.versions.len(),
                r.bad_blocks
            ),
            ExtentReply::Written(n) => write!(f, "{n} blocks written"),
            ExtentReply::Versions(v) => write!(f, "{} versions", v.len()),
            ExtentReply::Priors(v) => write!(f, "{} versions with their priors", v.len()),
            ExtentReply::Bitmap(w) => write!(f, "a bitmap of {} words", w.len()),
            ExtentReply::Counts(v) => write!(f, "{} counts", v.len()),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SlabIndex, VolumeId};

    const KEY: ExtentKey = ExtentKey {
        volume: VolumeId(1),
        slab: SlabIndex(2),
    };
    const BS: u32 = BLOCK_SIZE as u32;

    fn read(len: usize, bad: Vec<u32>) -> ExtentReply {
        ExtentReply::Read(ReadReply {
            data: Bytes::from(vec![0u8; len]),
            bad_blocks: bad,
            suspect: vec![],
            version: Version(1),
        })
    }

    fn blocks(len: usize, versions: usize, bad: Vec<u32>) -> ExtentReply {
        ExtentReply::Blocks(BlocksReply {
            data: Bytes::from(vec![0u8; len]),
            bad_blocks: bad,
            suspect: vec![],
            versions: vec![Version(1); versions],
        })
    }

    #[test]
    fn a_fitting_answer_passes() {
        let epoch = Epoch(3);
        let cases = [
            (
                ExtentOp::Read {
                    key: KEY,
                    epoch,
                    offset: 0,
                    len: 2 * BS,
                },
                read(2 * BLOCK_SIZE, vec![1]),
            ),
            (
                ExtentOp::ReadBlocks {
                    key: KEY,
                    epoch,
                    offset: 0,
                    len: 2 * BS,
                },
                blocks(2 * BLOCK_SIZE, 2, vec![0, 1]),
            ),
            (
                ExtentOp::Zero {
                    key: KEY,
                    epoch,
                    version: Version(1),
                    offset: 0,
                    len: 4096,
                },
                ExtentReply::Ok,
            ),
            (ExtentOp::Free { key: KEY }, ExtentReply::Ok),
            (
                ExtentOp::WriteBlocks {
                    key: KEY,
                    epoch,
                    offset: 0,
                    crcs: Arc::from([0u32, 0]),
                    versions: vec![Version(2); 2],
                    expect: vec![Version(1); 2],
                    data: Bytes::from(vec![0u8; 2 * BLOCK_SIZE]),
                    codec: Compression::None,
                },
                ExtentReply::Written(2),
            ),
            (
                ExtentOp::Versions {
                    key: KEY,
                    epoch,
                    offset: 0,
                    count: 3,
                },
                ExtentReply::Versions(vec![Version(0); 3]),
            ),
            (ExtentOp::Digest { key: KEY, epoch }, ExtentReply::Digest(7)),
        ];
        for (op, reply) in cases {
            assert_eq!(op.reply_shape().check(&reply), Ok(()), "{op:?}");
            assert_eq!(op.key(), KEY);
        }
    }

    #[test]
    fn an_answer_that_does_not_fit_is_refused() {
        let r = ReplyShape::Read { len: 2 * BS };
        assert!(r.check(&read(BLOCK_SIZE, vec![])).is_err(), "short data");
        assert!(
            r.check(&read(2 * BLOCK_SIZE, vec![2])).is_err(),
            "bad block outside"
        );
        assert!(r.check(&ExtentReply::Ok).is_err(), "other kind");
        let b = ReplyShape::Blocks { len: 2 * BS };
        assert!(
            b.check(&blocks(2 * BLOCK_SIZE, 1, vec![])).is_err(),
            "versions"
        );
        assert!(
            b.check(&blocks(2 * BLOCK_SIZE, 2, vec![5])).is_err(),
            "bad block"
        );
        assert!(
            b.check(&read(2 * BLOCK_SIZE, vec![])).is_err(),
            "other kind"
        );
        let w = ReplyShape::Written { blocks: 2 };
        assert!(
            w.check(&ExtentReply::Written(3)).is_err(),
            "more than asked"
        );
        let v = ReplyShape::Versions { count: 3 };
        assert!(v.check(&ExtentReply::Versions(vec![])).is_err(), "count");
        assert!(ReplyShape::Ok.check(&ExtentReply::Digest(1)).is_err());
        assert!(ReplyShape::Digest.check(&ExtentReply::Ok).is_err());
    }

    #[test]
    fn only_fenced_operations_carry_an_epoch_and_only_stores_create_extents() {
        let free = ExtentOp::Free { key: KEY };
        assert_eq!(free.epoch(), None);
        assert!(!free.stores_blocks());
        let digest = ExtentOp::Digest {
            key: KEY,
            epoch: Epoch(9),
        };
        assert_eq!(digest.epoch(), Some(Epoch(9)));
        assert!(!digest.stores_blocks());
        let zero = ExtentOp::Zero {
            key: KEY,
            epoch: Epoch(9),
            version: Version(1),
            offset: 0,
            len: 0,
        };
        assert!(zero.stores_blocks());
    }
}
