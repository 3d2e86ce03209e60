//! The per-drive store's public face and its hot paths (write, read, zero): extents,
//! per-block crc + version, epoch fencing, and the in-memory view the journal makes durable.

use crate::error::EngineError;
use crate::file::{AlignedBuf, BlockFile};
use crate::layout::{
    BlockMeta, DriveIdentity, ExtentEntry, Layout, Record, Superblock, BATCH_HEADER, BLOCK, RECORD,
};
use crate::pool::Pool;
use crate::stats::{Counters, DriveStats, OpKind, OpStart};
use converge_types::{
    Compression, Epoch, ExtentKey, SettleRows, Version, BLOCK_SIZE, COMPRESSION_GROUP_BLOCKS,
    MAX_IO_BYTES, SETTLE_ROWS_MAX,
};
use serde::Serialize;
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A read retries this many times when a block's crc mismatches because a write raced it.
const READ_RETRIES: usize = 8;

/// Options of `Drive::format_with`; defaults suit production.
#[derive(Clone, Debug, Default)]
pub struct FormatOptions {
    /// Size of the metadata journal; default: 1/128 of the drive, between 1 and 128 MiB.
    /// Small journals checkpoint more often (tests use this to exercise checkpoints).
    pub journal_bytes: Option<u64>,
    /// Extent slots per extent the data region holds (default
    /// [`crate::layout::DEFAULT_OVERCOMMIT`]; 1: as many slots as data extents, the
    /// version-2 layout). Compressed extents store less than their size, so a thin drive
    /// holds more of them.
    pub overcommit: Option<u32>,
}

/// What a read found besides the data.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReadInfo {
    /// Indexes (within this read) of blocks whose data does not match their crc; their
    /// bytes must not be used: read another copy and repair.
    pub bad_blocks: Vec<u32>,
    /// Indexes of blocks whose data is sound but which recovery rolled back to an older
    /// state (see [`crate::layout::F_SUSPECT`]): another copy may hold a newer, acked
    /// version. Their bytes are the block's previous content; the owner compares them with
    /// the other copies before it serves them.
    pub suspect: Vec<u32>,
    /// Highest version among the blocks read (0 if none was ever written).
    pub versions: Version,
}

/// One extent held by this drive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExtentInfo {
    pub key: ExtentKey,
    pub epoch: Epoch,
    pub bytes_allocated: u64,
    /// Bytes of blocks holding data (durably written and not zeroed since): what the
    /// extent's volume wrote to it. Priors of held writes are not counted.
    pub bytes_written: u64,
    /// Bytes of the drive those blocks occupy: as `bytes_written` for plain blocks, less
    /// for compressed groups (a stream counted once).
    pub bytes_stored: u64,
    /// How later writes of the extent are compressed.
    pub compression: Compression,
    /// The newest snapshot epoch whose states the extent preserves (0: none;
    /// [`Drive::set_snapshot_floor`]).
    pub snapshot_floor: u32,
    /// Bytes of the drive that the extent's preserved states occupy (its shadows').
    pub bytes_preserved: u64,
}

/// A shadow extent: the preserved states of one extent for one snapshot (docs/adr/0012).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShadowInfo {
    /// The snapshot's epoch.
    pub snapshot: u32,
    /// Blocks it holds a state of.
    pub blocks: u32,
    /// Bytes of the drive those states occupy.
    pub bytes_stored: u64,
}

/// One run of consecutive blocks for [`Drive::destage`].
pub struct DestageRun<'a> {
    pub key: ExtentKey,
    /// First block of the run within the extent.
    pub first: u32,
    pub data: &'a [u8],
    pub crcs: &'a [u32],
    pub versions: &'a [u64],
}

/// Space of the drive in extents (slabs) and bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capacity {
    /// Extents the data region holds uncompressed.
    pub extents_total: u64,
    /// Extents allocated (slots in use).
    pub extents_used: u64,
    pub bytes_total: u64,
    pub bytes_used: u64,
    /// Extent slots (more than `extents_total` on a thin drive: compressed extents take
    /// only the blocks they store).
    pub slots_total: u64,
    /// Slots in use: the extents (`extents_used`) and the shadow extents that keep
    /// blocks for snapshots (docs/adr/0012). A new extent needs a free one.
    pub slots_used: u64,
    /// Bytes the allocated extents have claimed: plain ones whole, compressed ones what
    /// they store. A new extent is taken only while one more whole extent fits.
    pub bytes_committed: u64,
    /// Bytes the extents' current data occupies.
    pub bytes_stored: u64,
    /// Bytes of the data region no block, stream or prior occupies (nor a write in
    /// flight).
    pub bytes_free: u64,
    /// Bytes the priors of unsettled parity writes occupy (docs/adr/0008).
    pub bytes_held: u64,
    /// Bytes the states preserved for snapshots occupy (docs/adr/0012); counted in
    /// `bytes_committed`, not in `bytes_stored`.
    pub bytes_preserved: u64,
}

/// A block with a write in progress: the metadata a reader or a later writer must see.
pub(crate) struct Overlay {
    pub meta: BlockMeta,
    /// The data pwrite (or the record enqueue) is in progress: others wait.
    pub busy: bool,
    /// Claims whose records are not yet durable and applied to `blocks`.
    pub pending: u32,
    /// Batch holding the latest claim's record: a write skipped because of this claim
    /// is acked only once it is durable (else a crash could lose both).
    pub seq: u64,
}

pub(crate) struct ExtentMeta {
    /// Durable metadata: only changed when a journal batch holding the change is synced.
    /// Checkpoints write exactly this, never a change the journal could still lose.
    pub blocks: Vec<BlockMeta>,
    /// Blocks with writes not yet applied to `blocks` (bounded by writes in flight).
    pub overlay: HashMap<u32, Overlay>,
    /// Digest of the durable version map (see [`version_digest`]), kept up to date by
    /// `apply`, so copies can be compared without reading their block lists.
    pub digest: u64,
    /// Threads waiting on the extent's `cv` for busy blocks (notifiers skip the syscall
    /// when there are none).
    pub waiters: u32,
    /// Released ([`Drive::release_extent`]): the slot is gone from the table, and a write
    /// that found the extent before is refused rather than landing on a freed slot.
    pub freed: bool,
    /// Durable priors: the state each block had before its latest held write (a parity
    /// chunk's), kept with its physical block until settled or reverted, so a row write
    /// that did not complete on every chunk can be undone (docs/adr/0008).
    pub held: HashMap<u32, BlockMeta>,
    /// Blocks of `blocks` that hold data (kept up to date with them).
    pub data_blocks: u32,
    /// Physical blocks the current states of `blocks` occupy: one per plain block, a
    /// stream's blocks once however many members name it (kept up to date with them).
    pub stored_blocks: u32,
}

/// One block's share of an extent's version digest.
fn digest_term(block: u32, version: u64) -> u64 {
    // splitmix64 finaliser over (block, version).
    let mut z =
        version ^ (u64::from(block) << 40 | u64::from(block)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Order-independent digest of a version map: the wrapping sum of one term per block.
/// Equal digests mean equal version maps (with overwhelming probability).
pub(crate) fn version_digest(versions: impl Iterator<Item = u64>) -> u64 {
    versions
        .enumerate()
        .fold(0u64, |d, (b, v)| d.wrapping_add(digest_term(b as u32, v)))
}

/// Physical blocks a block map's states occupy (each stream once).
fn stored_of(blocks: &[BlockMeta]) -> u32 {
    let mut streams = BTreeSet::new();
    blocks
        .iter()
        .filter_map(|m| {
            let (first, len) = m.run()?;
            (!m.is_packed() || streams.insert(first)).then_some(len)
        })
        .sum()
}

/// Whether a settle of `rows` (`None`: every block) covers block `b`.
pub(crate) fn settles(rows: Option<(u32, u32)>, b: u32) -> bool {
    rows.is_none_or(|(first, count)| b >= first && b - first < count)
}

impl ExtentMeta {
    fn current(&self, b: u32) -> BlockMeta {
        match self.overlay.get(&b) {
            Some(o) => o.meta,
            None => self.blocks[b as usize],
        }
    }

    fn any_busy(&self, first: u32, count: u32) -> bool {
        !self.overlay.is_empty()
            && (first..first + count).any(|b| self.overlay.get(&b).is_some_and(|o| o.busy))
    }

    /// Applies a durable record's effect (called in journal order): an unheld write or
    /// zero, which also drops the block's prior. Pushes the physical blocks no state names
    /// any more (free from now on) onto `gone`.
    pub fn apply(&mut self, b: u32, meta: BlockMeta, gone: &mut Vec<u32>) {
        // Mirror copies never hold priors: skip the lookup.
        if let Some(p) = (!self.held.is_empty())
            .then(|| self.held.remove(&b))
            .flatten()
        {
            self.drop_state(b, p, gone);
        }
        self.set(b, meta, gone);
    }

    /// Applies a Prior record: `prior` is block `b`'s prior from now on (an older one is
    /// dropped). Queued before a held write (naming the block's state before it), or
    /// re-logged by a checkpoint (naming the same prior again).
    pub fn apply_prior(&mut self, b: u32, prior: BlockMeta, gone: &mut Vec<u32>) {
        if self.blocks.get(b as usize).is_none() {
            return;
        }
        if let Some(old) = self.held.insert(b, prior) {
            self.drop_state(b, old, gone);
        }
    }

    /// Applies a held write: the block's prior (if any) keeps its physical block, which
    /// may be the one the block held until now.
    pub fn apply_held(&mut self, b: u32, meta: BlockMeta, gone: &mut Vec<u32>) {
        self.set(b, meta, gone);
    }

    /// Applies a revert: a block at `version` with a prior goes back to it (its current
    /// data is dropped). Returns whether it did.
    pub fn apply_revert(&mut self, b: u32, version: u64, gone: &mut Vec<u32>) -> bool {
        let at_version = self
            .blocks
            .get(b as usize)
            .is_some_and(|c| c.version == version);
        match self.held.get(&b).copied() {
            Some(p) if at_version => {
                // The prior becomes the block's state: its storage stays named throughout.
                self.set(b, p, gone);
                self.held.remove(&b);
                true
            }
            _ => {
                self.unpend(b);
                false
            }
        }
    }

    /// Drops the priors of blocks whose current version is at most `upto`.
    pub fn apply_settle(&mut self, upto: u64, rows: Option<(u32, u32)>, gone: &mut Vec<u32>) {
        let blocks = &self.blocks;
        let dropped: Vec<(u32, BlockMeta)> = self
            .held
            .iter()
            .filter(|&(&b, _)| {
                settles(rows, b) && blocks.get(b as usize).is_none_or(|c| c.version <= upto)
            })
            .map(|(&b, &p)| (b, p))
            .collect();
        for &(b, _) in &dropped {
            self.held.remove(&b);
        }
        for (b, p) in dropped {
            self.drop_state(b, p, gone);
        }
    }

    /// The blocks of `old`'s compressed group (block `b` being one of its members).
    fn group_of(&self, b: u32, old: BlockMeta) -> std::ops::Range<u32> {
        let g0 = b.saturating_sub(old.member());
        g0..(g0 + old.group_blocks()).min(self.blocks.len() as u32)
    }

    /// Whether a current state (`current_only`) or a current state or prior names the
    /// physical storage of `old`, block `b`'s state until now: the block itself or a
    /// prior of it for a plain block; any member of its group for a packed one.
    fn named(&self, b: u32, old: BlockMeta, current_only: bool) -> bool {
        let names = |m: u32| {
            self.blocks
                .get(m as usize)
                .is_some_and(|s| s.same_storage(&old))
                || (!current_only
                    && !self.held.is_empty()
                    && self.held.get(&m).is_some_and(|p| p.same_storage(&old)))
        };
        if old.is_packed() {
            self.group_of(b, old).any(names)
        } else {
            names(b)
        }
    }

    /// A state of block `b` (current or prior) is gone: its physical blocks are free
    /// unless another state still names them (a packed block's group shares a stream).
    fn drop_state(&self, b: u32, old: BlockMeta, gone: &mut Vec<u32>) {
        if let Some((first, len)) = old.run() {
            if !self.named(b, old, false) {
                gone.extend(first..first + len);
            }
        }
    }

    /// Sets block `b` to `meta`; the storage of its old state is gone unless a state
    /// still names it (`meta`, a prior, or another member of its compressed group).
    fn set(&mut self, b: u32, meta: BlockMeta, gone: &mut Vec<u32>) {
        if let Some(old) = self.blocks.get(b as usize).copied() {
            self.digest = self
                .digest
                .wrapping_sub(digest_term(b, old.version))
                .wrapping_add(digest_term(b, meta.version));
            let new_already_stored = meta.run().is_some() && self.named(b, meta, true);
            self.blocks[b as usize] = meta;
            if let Some((_, len)) = old.run() {
                if !self.named(b, old, true) {
                    self.stored_blocks -= len;
                }
            }
            if let Some((_, len)) = meta.run() {
                if !new_already_stored {
                    self.stored_blocks += len;
                }
            }
            self.drop_state(b, old, gone);
            match (old.has_data(), meta.has_data()) {
                (false, true) => self.data_blocks += 1,
                (true, false) => self.data_blocks -= 1,
                _ => {}
            }
        }
        self.unpend(b);
    }

    /// Moves block `b`'s durable state out of this (live) extent, storage and all, for a
    /// shadow to keep (a Preserve record): the block is never-written until the write
    /// that follows the record in its batch sets it. Returns the state.
    pub fn take_preserved(&mut self, b: u32) -> Option<BlockMeta> {
        let old = *self.blocks.get(b as usize)?;
        self.digest = self
            .digest
            .wrapping_sub(digest_term(b, old.version))
            .wrapping_add(digest_term(b, 0));
        self.blocks[b as usize] = BlockMeta::default();
        if let Some((_, len)) = old.run() {
            self.stored_blocks -= len;
        }
        if old.has_data() {
            self.data_blocks -= 1;
        }
        Some(old)
    }

    /// Keeps `state` (taken from the live extent) as block `b`'s state in this shadow.
    /// A shadow holding a state of the block already keeps the newer of the two (only
    /// copies written out of order, as a resync's, get here); the other's storage is gone.
    pub fn put_preserved(&mut self, b: u32, state: BlockMeta, gone: &mut Vec<u32>) {
        let Some(&held) = self.blocks.get(b as usize) else {
            if let Some((first, len)) = state.run() {
                gone.extend(first..first + len);
            }
            return;
        };
        if !shadow_takes(&held, &state) {
            if let Some((first, len)) = state.run() {
                gone.extend(first..first + len);
            }
            return;
        }
        self.set(b, state, gone);
    }

    /// A record of block `b` is applied: one claim fewer waits for durability.
    fn unpend(&mut self, b: u32) {
        if let Entry::Occupied(mut o) = self.overlay.entry(b) {
            let ov = o.get_mut();
            ov.pending = ov.pending.saturating_sub(1);
            if ov.pending == 0 && !ov.busy {
                o.remove();
            }
        }
    }
}

/// An allocated extent in memory.
pub(crate) struct Extent {
    pub key: ExtentKey,
    pub slot: u32,
    /// Highest epoch seen (in memory; durable once `epoch_seq` is).
    pub epoch: AtomicU64,
    /// Journal batch holding the latest alloc/epoch record: acks wait for it.
    pub epoch_seq: AtomicU64,
    pub meta: Mutex<ExtentMeta>,
    pub cv: Condvar,
    /// How the extent's volume wants its writes compressed ([`Compression::code`]):
    /// durable in the extent table (set by [`Drive::set_codec`]).
    pub codec: AtomicU8,
    /// A live extent's snapshot floor as writers see it (durable once its Floor record
    /// is; `epoch_seq` covers it): writes replacing a state of an epoch at most this one
    /// preserve it into the shadow of this snapshot.
    pub floor: AtomicU32,
    /// A live extent's oldest snapshot it holds ([`crate::layout::SINCE_NONE`]: none yet):
    /// reads at a snapshot outside `since..=floor` are refused (durable with the floor).
    pub since: AtomicU32,
    /// 0: a live extent. Else a shadow: the snapshot epoch whose replaced states it holds.
    pub shadow: u32,
}

impl Extent {
    pub fn codec(&self) -> Compression {
        Compression::from_code(self.codec.load(Ordering::Relaxed)).unwrap_or_default()
    }

    pub fn new(key: ExtentKey, slot: u32, epoch: u64, seq: u64, blocks: Vec<BlockMeta>) -> Extent {
        Extent {
            key,
            slot,
            epoch: AtomicU64::new(epoch),
            epoch_seq: AtomicU64::new(seq),
            meta: Mutex::new(ExtentMeta {
                digest: version_digest(blocks.iter().map(|m| m.version)),
                data_blocks: blocks.iter().filter(|m| m.has_data()).count() as u32,
                stored_blocks: stored_of(&blocks),
                blocks,
                overlay: HashMap::new(),
                waiters: 0,
                freed: false,
                held: HashMap::new(),
            }),
            cv: Condvar::new(),
            codec: AtomicU8::new(0),
            floor: AtomicU32::new(0),
            since: AtomicU32::new(crate::layout::SINCE_NONE),
            shadow: 0,
        }
    }

    /// A shadow extent of `key` for snapshot `snapshot`, every block absent.
    pub fn new_shadow(key: ExtentKey, slot: u32, snapshot: u32, blocks: Vec<BlockMeta>) -> Extent {
        Extent {
            shadow: snapshot,
            ..Extent::new(key, slot, 0, 0, blocks)
        }
    }
}

/// The epoch a block state was written in (the upper half of its version).
pub(crate) fn epoch_of(m: &BlockMeta) -> u64 {
    m.version >> 32
}

/// Where a Preserve record for snapshot `snapshot` puts its state, on an extent of `key`
/// with snapshot floor `floor`: the snapshot's shadow (`shadow_of`), else, that one being
/// retired, the floor's when older; with the newest epoch a state moved there may have
/// (`u32::MAX`: any). The runtime apply and the journal replay both decide with it.
pub(crate) fn preserve_target(
    snapshot: u32,
    floor: u32,
    shadow_of: impl Fn(u32) -> Option<u32>,
) -> Option<(u32, u32)> {
    match shadow_of(snapshot) {
        Some(s) => Some((s, u32::MAX)),
        None if floor > 0 && floor < snapshot => shadow_of(floor).map(|s| (s, floor)),
        None => None,
    }
}

/// Whether a shadow holding `held` for a block takes `state` in its place: it keeps the
/// newer of the two (an absent block takes any).
pub(crate) fn shadow_takes(held: &BlockMeta, state: &BlockMeta) -> bool {
    *held == BlockMeta::default() || held.version <= state.version
}

/// Whether a write of `new_version` replacing state `cur` must first preserve it for the
/// snapshot at `floor`: `cur` is a state (not a never-written block) that snapshot reads
/// (its epoch is at most the floor) and the write comes after the snapshot.
pub(crate) fn must_preserve(floor: u32, cur: &BlockMeta, new_version: u64) -> bool {
    floor > 0
        && *cur != BlockMeta::default()
        && epoch_of(cur) <= u64::from(floor)
        && new_version >> 32 > u64::from(floor)
}

pub(crate) struct Slot {
    /// The extent as clients see it (set at allocation, cleared at free).
    pub live: Option<Arc<Extent>>,
    /// The extent as the durable journal sees it (set when the alloc record is applied).
    pub durable: Option<Arc<Extent>>,
    /// Durable extent-table entry (what checkpoints write).
    pub entry: ExtentEntry,
}

pub(crate) struct Table {
    pub slots: Vec<Slot>,
    /// Live extents.
    pub by_key: HashMap<ExtentKey, u32>,
    /// Shadow extents as writers and snapshot operations see them: (key, snapshot) →
    /// slot. A shadow is added when allocated, removed when its drop is queued.
    pub shadows: BTreeMap<(ExtentKey, u32), u32>,
    /// Shadow extents as the durable journal sees them (what reads at a snapshot and the
    /// journal's Preserve records use): added when the Shadow record is applied, removed
    /// when its Retire, DropShadow or Free record is.
    pub durable_shadows: BTreeMap<(ExtentKey, u32), u32>,
    /// Free slots, popped from the end (lowest slot first).
    pub free: Vec<u32>,
}

pub(crate) struct CommitState {
    /// Records of the batch being filled.
    pub pending: Vec<u8>,
    /// Sequence number the batch being filled will get.
    pub open_seq: u64,
    /// Every batch up to this one is durable and applied.
    pub durable_seq: u64,
    /// A thread is writing a batch (or checkpointing); others wait or queue.
    pub leader_active: bool,
    /// Sticky: after a failed device write or sync nothing more is acked (fsync errors
    /// cannot be retried safely), until the drive is reopened.
    pub failed: Option<String>,
    /// Writers waiting for free physical blocks while no batch is queued: the next
    /// enqueue wakes them (its batch will free the blocks they wait for).
    pub pool_waiters: u32,
    /// Tasks waiting (without a thread) for a batch to be durable: (batch, waker). Woken
    /// when their batch is durable or the drive fails, and, while a batch is open with no
    /// leader, so that one of them leads it (see [`Drive::poll_durable`]).
    pub wakers: Vec<(u64, std::task::Waker)>,
    /// Threads waiting on `commit_cv` (see `Drive::commit_wait`).
    pub cv_waiters: u32,
}

/// State only the current commit leader touches.
pub(crate) struct LeaderState {
    pub sb: Superblock,
    /// Offset in the journal region where the next batch goes.
    pub head: u64,
    /// Journal bytes between the checkpoint tail and head (what replay would read).
    pub used: u64,
    /// `used` right after the last checkpoint (its re-log of priors).
    pub used_at_checkpoint: u64,
    pub next_seq: u64,
    /// Journal sequence numbers minus commit sequence numbers: a checkpoint's re-log
    /// batch of priors takes a journal number that no commit batch has.
    pub jseq_skew: u64,
    /// Records of the batch being written (swapped with CommitState::pending).
    pub spare: Vec<u8>,
    pub batch_buf: AlignedBuf,
    pub page_buf: AlignedBuf,
    /// (slot, page) metadata pages changed since the last checkpoint.
    pub dirty_meta: BTreeSet<(u32, u32)>,
    pub dirty_table: BTreeSet<u32>,
    /// Physical blocks a batch being applied makes unused (reused buffer).
    pub gone: Vec<u32>,
    /// Storage written for extents freed before the batch applied: (first, blocks), a
    /// stream once per member record (deduplicated before it is given back).
    pub orphans: Vec<(u32, u32)>,
}

#[derive(Clone, Copy)]
pub(crate) enum IoKind {
    Data,
    Journal,
    Meta,
}

/// One formatted drive: a set of extents with per-block crc32c and version.
///
/// `Send + Sync`; every method takes `&self` and may be called from many threads.
pub struct Drive {
    pub(crate) file: Arc<dyn BlockFile>,
    pub(crate) id: DriveIdentity,
    pub(crate) layout: Layout,
    pub(crate) table: Mutex<Table>,
    /// Free physical data blocks (lock order: an extent's meta, then this).
    pub(crate) pool: Mutex<Pool>,
    pub(crate) commit: Mutex<CommitState>,
    pub(crate) commit_cv: Condvar,
    pub(crate) leader: Mutex<LeaderState>,
    pub(crate) counters: Counters,
    /// 512 or 4096: the unit journal batches are padded to.
    pub(crate) journal_sector: usize,
    /// Bytes of records one batch carries at most (bounds batch size and latency).
    pub(crate) batch_records_max: usize,
    /// Priors held (durable, all extents): bounded by [`Drive::held_max`].
    pub(crate) held_blocks: AtomicU64,
    /// The drive's format stores compressed groups (version 3); a version-2 drive stores
    /// every block as is, whatever its extents' codec.
    pub(crate) packing: bool,
    /// Live extents without a codec: each may fill its whole size, so a thin drive keeps
    /// room for what they have not written yet (see `check_thin_room`).
    pub(crate) plain_extents: AtomicU64,
    /// Physical blocks the durable states of extents without a codec occupy.
    pub(crate) plain_stored: AtomicU64,
    /// Physical blocks the durable states of extents with a codec occupy.
    pub(crate) thin_stored: AtomicU64,
    /// Physical blocks the shadow extents' preserved states occupy.
    pub(crate) shadow_stored: AtomicU64,
    /// Snapshot deletions run one at a time (each is two journal steps).
    pub(crate) snapshot_ops: Mutex<()>,
    /// Journal batches written since open, and that count when
    /// [`Drive::checkpoint_if_quiet`] last looked.
    pub(crate) batches_written: AtomicU64,
    pub(crate) batches_seen_quiet: AtomicU64,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
        .expect("engine lock poisoned: a panic left drive state unknown; reopen the drive")
}

#[derive(Default)]
struct Scratch {
    applied: Vec<bool>,
    records: Vec<u8>,
    /// Physical blocks taken for the applied blocks of a piece, in order.
    phys: Vec<u32>,
    metas: Vec<BlockMeta>,
    metas2: Vec<BlockMeta>,
}

mod packed;
mod snapshot;

thread_local! {
    // Per-thread buffers reused across I/Os, so the hot path does not allocate per request.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Indexes of the blocks a claim applied.
fn applied_indexes(applied: &[bool]) -> impl Iterator<Item = usize> + Clone + '_ {
    applied
        .iter()
        .enumerate()
        .filter(|(_, &a)| a)
        .map(|(i, _)| i)
}

/// An iterator whose length is known in advance (a filtered one is not `ExactSizeIterator`).
#[derive(Clone)]
struct ExactLen<I>(I, usize);

impl<I: Iterator> Iterator for ExactLen<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let x = self.0.next();
        if x.is_some() {
            self.1 -= 1;
        }
        x
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.1, Some(self.1))
    }
}

impl<I: Iterator> ExactSizeIterator for ExactLen<I> {}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

impl Drive {
    pub fn identity(&self) -> &DriveIdentity {
        &self.id
    }

    /// The layout in use (region offsets), for tools and tests.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Journal write unit chosen at open (512 if the device accepts 512-byte O_DIRECT I/O).
    pub fn journal_sector_bytes(&self) -> usize {
        self.journal_sector
    }

    pub(crate) fn dev_write(&self, buf: &[u8], off: u64, kind: IoKind) -> Result<(), EngineError> {
        self.file
            .write_at(buf, off)
            .map_err(EngineError::io("write"))?;
        let c = match kind {
            IoKind::Data => &self.counters.data_write_bytes,
            IoKind::Journal => &self.counters.journal_write_bytes,
            IoKind::Meta => &self.counters.metadata_write_bytes,
        };
        c.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn dev_read(&self, buf: &mut [u8], off: u64) -> Result<(), EngineError> {
        self.file
            .read_at(buf, off)
            .map_err(EngineError::io("read"))?;
        self.counters
            .read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn dev_sync(&self) -> Result<(), EngineError> {
        self.file.sync().map_err(EngineError::io("sync"))?;
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Validates a write's range and its per-block crcs against the data (the end-to-end
    /// check: the owner computed them; a mismatch means corruption in flight). Returns
    /// (first block, block count).
    pub(crate) fn checked_write_range(
        &self,
        key: ExtentKey,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(u32, u32), EngineError> {
        let (first, count) = self.range(key, offset, data.len() as u64)?;
        if crcs.len() != count as usize {
            return Err(EngineError::InvalidIo {
                key,
                reason: "one crc per 4 KiB block is required",
                offset,
                len: data.len() as u64,
            });
        }
        for (i, (blk, &crc)) in data.chunks_exact(BLOCK_SIZE).zip(crcs).enumerate() {
            if crc32c::crc32c(blk) != crc {
                return Err(EngineError::ChecksumMismatch {
                    key,
                    block: first + i as u32,
                });
            }
        }
        Ok((first, count))
    }

    /// Validates an I/O range and returns (first block, block count).
    pub(crate) fn range(
        &self,
        key: ExtentKey,
        offset: u64,
        len: u64,
    ) -> Result<(u32, u32), EngineError> {
        let bad = |reason| EngineError::InvalidIo {
            key,
            reason,
            offset,
            len,
        };
        if !offset.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) {
            return Err(bad("offset and length must be multiples of 4096"));
        }
        if len == 0 || len > MAX_IO_BYTES as u64 {
            return Err(bad("length must be between 4 KiB and 32 MiB"));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.layout.slab_size_bytes)
        {
            return Err(bad("range ends beyond the slab"));
        }
        Ok(((offset / BLOCK) as u32, (len / BLOCK) as u32))
    }

    fn lookup(&self, key: ExtentKey) -> Option<Arc<Extent>> {
        let t = lock(&self.table);
        t.by_key
            .get(&key)
            .and_then(|&s| t.slots[s as usize].live.clone())
    }

    fn check_epoch(ext: &Extent, epoch: Epoch) -> Result<(), EngineError> {
        let current = ext.epoch.load(Ordering::Acquire);
        if epoch.0 < current {
            return Err(EngineError::StaleEpoch {
                key: ext.key,
                requested: epoch,
                current: Epoch(current),
            });
        }
        Ok(())
    }

    /// Finds or allocates the extent, applying epoch fencing. Alloc/epoch records are
    /// queued under the table lock so every later write of the extent lands in the same
    /// or a later batch (its ack then implies the fence is durable).
    fn extent_for_write(&self, key: ExtentKey, epoch: Epoch) -> Result<Arc<Extent>, EngineError> {
        if epoch.0 > u64::from(u32::MAX) {
            // No owner holds one (a version's upper half is its epoch), and the extent
            // table keeps 32 bits of it.
            return Err(EngineError::InvalidArgument(format!(
                "epoch {epoch} is beyond 2^32: no owner holds such an epoch"
            )));
        }
        let mut t = lock(&self.table);
        let mut rec = [0u8; RECORD];
        if let Some(&slot) = t.by_key.get(&key) {
            let ext = t.slots[slot as usize]
                .live
                .clone()
                .expect("by_key only names live slots");
            Self::check_epoch(&ext, epoch)?;
            if epoch.0 > ext.epoch.load(Ordering::Acquire) {
                Record::Epoch { slot, epoch }.encode(&mut rec);
                let seq = self.enqueue(&rec, true)?;
                ext.epoch.store(epoch.0, Ordering::Release);
                ext.epoch_seq.fetch_max(seq, Ordering::AcqRel);
            }
            return Ok(ext);
        }
        if t.free.is_empty() {
            return Err(EngineError::NoSpace {
                extents_total: u64::from(self.layout.extents_total),
            });
        }
        // A thin drive (more slots than data extents) takes a new extent only while one
        // more whole extent fits beside what the others hold: plain extents count whole,
        // compressed ones what they store (the new one may be written incompressibly).
        let bpe = u64::from(self.layout.blocks_per_extent);
        if self.layout.overcommit > 1 && self.committed_blocks() + bpe > self.layout.extent_blocks()
        {
            return Err(EngineError::Full {
                committed_bytes: self.committed_blocks() * BLOCK,
                capacity_bytes: self.layout.extent_blocks() * BLOCK,
            });
        }
        let slot = t.free.pop().expect("checked above");
        Record::Alloc { slot, key, epoch }.encode(&mut rec);
        let seq = match self.enqueue(&rec, true) {
            Ok(s) => s,
            Err(e) => {
                t.free.push(slot);
                return Err(e);
            }
        };
        self.plain_extents.fetch_add(1, Ordering::Relaxed);
        let blocks = vec![BlockMeta::default(); self.layout.blocks_per_extent as usize];
        let ext = Arc::new(Extent::new(key, slot, epoch.0, seq, blocks));
        t.slots[slot as usize].live = Some(ext.clone());
        t.by_key.insert(key, slot);
        Ok(ext)
    }

    /// Claims blocks for a write: waits for in-progress writes of the same blocks (so data
    /// and metadata land in one order), applies the version rule, marks claimed blocks busy.
    /// Returns (blocks claimed, batch a skipped block's newer claim must reach first).
    #[allow(clippy::too_many_arguments)]
    fn claim(
        &self,
        ext: &Extent,
        first: u32,
        count: u32,
        new: impl Fn(usize, &BlockMeta) -> BlockMeta,
        accept: impl Fn(usize, &BlockMeta, &BlockMeta) -> bool,
        applied: &mut Vec<bool>,
        mut before: Option<&mut Vec<BlockMeta>>,
    ) -> Result<(u32, u64), EngineError> {
        let mut m = Self::lock_idle(ext, first, count);
        if m.freed {
            return Err(EngineError::Released { key: ext.key });
        }
        applied.clear();
        if let Some(v) = before.as_deref_mut() {
            v.clear();
        }
        let mut n = 0;
        let mut need_seq = 0;
        for i in 0..count as usize {
            let b = first + i as u32;
            let cur = m.current(b);
            let nm = new(i, &cur);
            if let Some(v) = before.as_deref_mut() {
                v.push(cur);
            }
            if accept(i, &cur, &nm) {
                let ExtentMeta {
                    blocks, overlay, ..
                } = &mut *m;
                let o = overlay.entry(b).or_insert(Overlay {
                    meta: blocks[b as usize],
                    busy: false,
                    pending: 0,
                    seq: 0,
                });
                o.meta = nm;
                o.busy = true;
                o.pending += 1;
                applied.push(true);
                n += 1;
            } else {
                // Not busy (we waited), so a claim's seq is already known here.
                if let Some(o) = m.overlay.get(&b) {
                    need_seq = need_seq.max(o.seq);
                }
                applied.push(false);
            }
        }
        Ok((n, need_seq))
    }

    /// Queues the metadata-only records of a claim (zero, revert) and ends it: the batch
    /// that holds them. A failed enqueue fails the drive (what we know may no longer
    /// match the device).
    fn queue_claimed(
        &self,
        ext: &Extent,
        first: u32,
        applied: &[bool],
        records: &[u8],
    ) -> Result<u64, EngineError> {
        let res = self.enqueue(records, false);
        if let Err(e) = &res {
            self.fail(e);
        }
        self.release(ext, first, applied, *res.as_ref().unwrap_or(&0), &[]);
        res
    }

    /// Ends a claim: the blocks' records are queued in batch `seq` (0: nothing queued),
    /// and `phys` (if given) names, in order, the physical block of each applied block.
    fn release(&self, ext: &Extent, first: u32, applied: &[bool], seq: u64, phys: &[u32]) {
        self.release_with(ext, first, applied, seq, |k, m| {
            if let Some(&p) = phys.get(k) {
                m.phys = p;
            }
        });
    }

    /// [`Drive::release`] that lets `finish(k, meta)` set the final metadata of the `k`th
    /// applied block (what readers see until its record is applied).
    fn release_with(
        &self,
        ext: &Extent,
        first: u32,
        applied: &[bool],
        seq: u64,
        finish: impl Fn(usize, &mut BlockMeta),
    ) {
        let mut m = lock(&ext.meta);
        for (k, i) in applied_indexes(applied).enumerate() {
            if let Entry::Occupied(mut o) = m.overlay.entry(first + i as u32) {
                let ov = o.get_mut();
                ov.busy = false;
                ov.seq = ov.seq.max(seq);
                finish(k, &mut ov.meta);
                if ov.pending == 0 {
                    o.remove();
                }
            }
        }
        let wake = m.waiters > 0;
        drop(m);
        if wake {
            ext.cv.notify_all();
        }
    }

    /// Undoes a claim whose write was refused before anything was written or queued:
    /// each applied block gets back the state it had when claimed (`before`, indexed
    /// from `first`) and one claim fewer waits on it.
    fn unclaim(&self, ext: &Extent, first: u32, applied: &[bool], before: &[BlockMeta]) {
        let mut m = lock(&ext.meta);
        for i in applied_indexes(applied) {
            if let Entry::Occupied(mut o) = m.overlay.entry(first + i as u32) {
                let ov = o.get_mut();
                ov.busy = false;
                ov.meta = before[i];
                ov.pending = ov.pending.saturating_sub(1);
                if ov.pending == 0 {
                    o.remove();
                }
            }
        }
        let wake = m.waiters > 0;
        drop(m);
        if wake {
            ext.cv.notify_all();
        }
    }

    /// Takes one free physical block per entry of `homes` (see [`Pool::take`]) onto
    /// `out`. When too few are free, the blocks are held by writes in flight whose new
    /// blocks are not durable yet: commit them (or wait for the leader, or for a writer
    /// that is about to queue its records), which gives the old blocks back. The caller
    /// must hold no taken-but-unqueued blocks (pieces are at most a quarter of the spare
    /// blocks), so this always ends.
    pub(crate) fn take_blocks(
        &self,
        homes: impl ExactSizeIterator<Item = u32> + Clone,
        out: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        let n = homes.len() as u64;
        loop {
            if lock(&self.pool).take(homes.clone(), out) {
                return Ok(());
            }
            self.wait_free_blocks(n)?;
        }
    }

    /// One round of waiting for `n` free physical blocks (see [`Drive::take_blocks`]):
    /// commits the queued batch, or waits for the leader's, or for the next enqueue.
    pub(crate) fn wait_free_blocks(&self, n: u64) -> Result<(), EngineError> {
        let mut st = lock(&self.commit);
        if let Some(reason) = &st.failed {
            return Err(EngineError::Failed {
                reason: reason.clone(),
            });
        }
        // Blocks are given back by the leader before it takes this lock again.
        if lock(&self.pool).free() >= n {
            return Ok(());
        }
        if st.leader_active {
            drop(self.commit_wait(st));
        } else if !st.pending.is_empty() {
            drop(self.lead_one(st));
        } else {
            st.pool_waiters += 1;
            let mut st = self.commit_wait(st);
            st.pool_waiters -= 1;
        }
        Ok(())
    }

    /// Locks the extent's metadata once no write of blocks [first, first + count) has its
    /// data write in progress.
    fn lock_idle(ext: &Extent, first: u32, count: u32) -> MutexGuard<'_, ExtentMeta> {
        let mut m = lock(&ext.meta);
        while m.any_busy(first, count) {
            m.waiters += 1;
            m = ext.cv.wait(m).expect("extent lock poisoned");
            m.waiters -= 1;
        }
        m
    }

    /// Copies the current metadata of a range, waiting for in-progress writes to finish.
    fn snapshot(ext: &Extent, first: u32, count: u32, out: &mut Vec<BlockMeta>) {
        let m = Self::lock_idle(ext, first, count);
        out.clear();
        out.extend((first..first + count).map(|b| m.current(b)));
    }

    /// Writes blocks of one extent; durable when it returns Ok (see the crate docs).
    /// A block whose current version is newer than `version` keeps its data (a later write
    /// already replaced it).
    pub fn write(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(), EngineError> {
        let (seq, t) = self.write_nowait(key, epoch, version, offset, data, crcs)?;
        let r = self.wait_durable(seq);
        self.counters.end(OpKind::Write, t);
        r
    }

    /// [`Drive::write`] up to the wait for durability: the blocks are written and their
    /// records queued in journal batch `seq` (returned with the operation's start, for its
    /// counters: `Durable` waits for the batch and closes them).
    pub(crate) fn write_nowait(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(u64, OpStart), EngineError> {
        self.write_nowait_as(key, epoch, version, offset, data, crcs, false)
    }

    /// [`Drive::write_nowait`], held (`hold`: [`Drive::write_held`]) or not.
    #[allow(clippy::too_many_arguments)]
    fn write_nowait_as(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        hold: bool,
    ) -> Result<(u64, OpStart), EngineError> {
        let t = self.counters.begin();
        let r = self.write_inner(
            key,
            epoch,
            offset,
            data,
            crcs,
            |_| version.0,
            |_, cur, new| new.version >= cur.version,
            hold,
        );
        match r {
            Ok((_, seq)) => Ok((seq, t)),
            Err(e) => {
                self.counters.end(OpKind::Write, t);
                Err(e)
            }
        }
    }

    /// A parity chunk's write (docs/adr/0008): as [`Drive::write`], but each block keeps
    /// its state before the write as its *prior* (data and all) until [`Drive::settle`]
    /// drops it or [`Drive::revert`] puts it back, so the owner can undo a row write that
    /// did not reach every chunk. Durable on Ok, priors included. A block rewritten at
    /// the version it has (a retry) keeps the prior it has. Refused with
    /// [`EngineError::HeldFull`] when the drive holds [`Drive::held_max`] priors.
    pub fn write_held(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(), EngineError> {
        let (seq, t) = self.write_nowait_as(key, epoch, version, offset, data, crcs, true)?;
        let r = self.wait_durable(seq);
        self.counters.end(OpKind::Write, t);
        r
    }

    /// The most priors the drive holds at once: half its spare blocks (so writers always
    /// find free physical blocks, see [`Drive::take_blocks`]) and what an eighth of the
    /// journal can re-log at a checkpoint (which then always fits beside the window it
    /// retires, see `relog_priors`).
    pub fn held_max(&self) -> u64 {
        let spare = self.layout.spare_blocks();
        let relog = (self.layout.journal_len / 8)
            .saturating_sub(BATCH_HEADER as u64 + self.journal_sector as u64)
            / RECORD as u64;
        (spare / 2).min(relog)
    }

    /// Priors the drive holds now (all extents).
    pub fn held_blocks(&self) -> u64 {
        self.held_blocks.load(Ordering::Relaxed)
    }

    /// Drops the priors of the extent's blocks whose current version is at most `upto`
    /// (the owner's row writes up to there completed on every chunk; 0: none), and of each
    /// of `rows`' blocks at versions up to its own (completed writes newer than one still
    /// running). Durable on Ok.
    pub fn settle(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
        rows: &[SettleRows],
    ) -> Result<(), EngineError> {
        self.check_failed()?;
        let bpe = self.layout.blocks_per_extent;
        if rows.len() > SETTLE_ROWS_MAX {
            return Err(EngineError::InvalidArgument(format!(
                "a settle names {} row ranges; at most {SETTLE_ROWS_MAX}",
                rows.len()
            )));
        }
        if let Some(r) = rows
            .iter()
            .find(|r| r.count == 0 || r.first >= bpe || r.count > bpe - r.first)
        {
            return Err(EngineError::InvalidArgument(format!(
                "settle of blocks {}+{}: outside an extent of {bpe} blocks",
                r.first, r.count
            )));
        }
        let Some(ext) = self.lookup(key) else {
            return Ok(());
        };
        Self::check_epoch(&ext, epoch)?;
        if lock(&ext.meta).held.is_empty() {
            return Ok(());
        }
        let whole = (upto.0 > 0).then_some((upto, 0, 0));
        let parts = rows.iter().map(|r| (r.upto, r.first, r.count));
        let mut recs = Vec::with_capacity((rows.len() + 1) * RECORD);
        for (upto, first, count) in whole.into_iter().chain(parts) {
            let mut rec = [0u8; RECORD];
            Record::Settle {
                slot: ext.slot,
                upto: upto.0,
                first,
                count,
            }
            .encode(&mut rec);
            recs.extend_from_slice(&rec);
        }
        if recs.is_empty() {
            return Ok(());
        }
        let seq = self.enqueue(&recs, true)?;
        self.wait_durable(seq)
    }

    /// Puts back the prior of every block of the range whose current version is
    /// `version` (a row write the owner found incomplete): returns how many blocks went
    /// back. A block at `version` without a prior stays (the caller learns it from
    /// [`Drive::priors`]). Durable on Ok.
    pub fn revert(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<u32, EngineError> {
        let (first, count) = self.range(key, offset, len)?;
        self.check_failed()?;
        if self.lookup(key).is_none() {
            return Ok(0);
        }
        let ext = self.extent_for_write(key, epoch)?;
        self.wait_applied(&ext, first, count)?;
        with_scratch(|s| {
            let (n, need_seq) = {
                let m = lock(&ext.meta);
                // The durable priors decide (nothing of the range is pending now).
                let prior: Vec<Option<BlockMeta>> = (first..first + count)
                    .map(|b| {
                        m.held
                            .get(&b)
                            .copied()
                            .filter(|_| m.current(b).version == version.0)
                    })
                    .collect();
                drop(m);
                self.claim(
                    &ext,
                    first,
                    count,
                    |i, _| prior[i].unwrap_or_default(),
                    |i, cur, _| prior[i].is_some() && cur.version == version.0,
                    &mut s.applied,
                    None,
                )?
            };
            let mut seq = need_seq.max(ext.epoch_seq.load(Ordering::Acquire));
            if n > 0 {
                s.records.clear();
                for i in applied_indexes(&s.applied) {
                    Record::Revert {
                        slot: ext.slot,
                        block: first + i as u32,
                        version: version.0,
                    }
                    .push(&mut s.records);
                }
                seq = seq.max(self.queue_claimed(&ext, first, &s.applied, &s.records)?);
            }
            self.wait_durable(seq)?;
            Ok(n)
        })
    }

    /// Waits until no write of blocks [first, first + count) is in progress or waiting
    /// for its journal batch, so the durable metadata (priors included) is current.
    fn wait_applied(&self, ext: &Extent, first: u32, count: u32) -> Result<(), EngineError> {
        loop {
            let wait = {
                let m = Self::lock_idle(ext, first, count);
                (first..first + count)
                    .filter_map(|b| m.overlay.get(&b).map(|o| o.seq))
                    .max()
            };
            match wait {
                Some(seq) => self.wait_durable(seq)?,
                None => return Ok(()),
            }
        }
    }

    /// Current version and prior version (if the block holds one) of `count` blocks
    /// from `offset`, once writes of them in progress are durable: what an owner checking
    /// a row after a crash needs to decide between keeping a version and reverting it.
    pub fn priors(
        &self,
        key: ExtentKey,
        offset: u64,
        count: usize,
    ) -> Result<Vec<(Version, Option<Version>)>, EngineError> {
        let (first, n) = self.range(key, offset, count as u64 * BLOCK)?;
        let Some(ext) = self.lookup(key) else {
            return Ok(vec![(Version(0), None); count]);
        };
        self.wait_applied(&ext, first, n)?;
        let m = lock(&ext.meta);
        Ok((first..first + n)
            .map(|b| {
                (
                    Version(m.current(b).version),
                    m.held.get(&b).map(|p| Version(p.version)),
                )
            })
            .collect())
    }

    /// Copies blocks from another replica (resync, rebuild, reconcile): block `i` gets
    /// `versions[i]`, but only if its current version is still `expect[i]` (what the
    /// copier saw before reading the source). A block changed meanwhile by the owner holds
    /// newer data and is left alone. Returns how many blocks were written. Durable on Ok.
    #[allow(clippy::too_many_arguments)]
    pub fn write_blocks(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        versions: &[Version],
        expect: &[Version],
    ) -> Result<u32, EngineError> {
        let (n, seq, t) =
            self.write_blocks_nowait(key, epoch, offset, data, crcs, versions, expect)?;
        let r = self.wait_durable(seq);
        self.counters.end(OpKind::Write, t);
        r.map(|()| n)
    }

    /// [`Drive::write_blocks`] up to the wait for durability: (blocks written, batch, start).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_blocks_nowait(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        versions: &[Version],
        expect: &[Version],
    ) -> Result<(u32, u64, OpStart), EngineError> {
        let n = data.len() / BLOCK_SIZE;
        if versions.len() != n || expect.len() != n {
            return Err(EngineError::InvalidIo {
                key,
                reason: "one version and one expected version per 4 KiB block are required",
                offset,
                len: data.len() as u64,
            });
        }
        let t = self.counters.begin();
        let r = self.write_inner(
            key,
            epoch,
            offset,
            data,
            crcs,
            |i| versions[i].0,
            |i, cur, _| cur.version == expect[i].0,
            false,
        );
        match r {
            Ok((n, seq)) => Ok((n, seq, t)),
            Err(e) => {
                self.counters.end(OpKind::Write, t);
                Err(e)
            }
        }
    }

    /// Writes and queues the records; returns (blocks written, the batch that must be
    /// durable before the write may be acknowledged).
    #[allow(clippy::too_many_arguments)]
    fn write_inner(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        version_of: impl Fn(usize) -> u64,
        accept: impl Fn(usize, &BlockMeta, &BlockMeta) -> bool,
        hold: bool,
    ) -> Result<(u32, u64), EngineError> {
        let (first, count) = self.checked_write_range(key, offset, data, crcs)?;
        self.check_failed()?;
        if hold {
            let held = self.held_blocks.load(Ordering::Relaxed);
            if held + u64::from(count) > self.held_max() {
                return Err(EngineError::HeldFull { held });
            }
        }
        let ext = self.extent_for_write(key, epoch)?;
        let (n, seq) =
            self.write_claimed(&ext, first, count, data, crcs, version_of, accept, hold)?;
        Ok((n, seq.max(ext.epoch_seq.load(Ordering::Acquire))))
    }

    /// Blocks of one write whose records go into one journal batch (half a batch's bound,
    /// so other writers' records fit beside them) and whose new physical blocks stay well
    /// within the spare ones (see [`Drive::take_blocks`]).
    fn piece_blocks(&self) -> u32 {
        let spare = self.layout.spare_blocks();
        ((self.batch_records_max / RECORD) / 2)
            .min((spare / 4) as usize)
            .max(1) as u32
    }

    /// Claims blocks of an extent under the version rule `accept`, writes the accepted
    /// ones to free physical blocks and queues their records, in pieces whose records fit
    /// one journal batch. Returns (blocks written, the batch a durable ack must wait for);
    /// the caller waits.
    #[allow(clippy::too_many_arguments)]
    fn write_claimed(
        &self,
        ext: &Extent,
        first: u32,
        count: u32,
        data: &[u8],
        crcs: &[u32],
        version_of: impl Fn(usize) -> u64,
        accept: impl Fn(usize, &BlockMeta, &BlockMeta) -> bool,
        hold: bool,
    ) -> Result<(u32, u64), EngineError> {
        let codec = self.codec_for(ext, hold);
        let group = if codec.is_none() {
            1
        } else {
            COMPRESSION_GROUP_BLOCKS
        };
        let piece = self.piece_blocks().max(group);
        let (mut n, mut seq) = (0, 0);
        let mut at = 0u32;
        while at < count {
            let mut len = piece.min(count - at);
            if at + len < count {
                // Pieces of a compressed write end on group boundaries: a group written
                // whole is compressed whole.
                let end = first + at + len;
                let aligned = end - end % group;
                if aligned > first + at {
                    len = aligned - (first + at);
                }
            }
            let (i0, b0) = (at as usize, at as usize * BLOCK_SIZE);
            let piece_data = &data[b0..b0 + len as usize * BLOCK_SIZE];
            let piece_crcs = &crcs[i0..i0 + len as usize];
            let plain = if codec.is_none() {
                self.write_piece(
                    ext,
                    first + at,
                    len,
                    piece_data,
                    piece_crcs,
                    |i| version_of(i0 + i),
                    |i, cur, new| accept(i0 + i, cur, new),
                    hold,
                )?
            } else {
                None
            };
            let (pn, ps) = if let Some(done) = plain {
                done
            } else {
                // With a codec; or without, a piece replacing packed states a snapshot
                // reads (stored while the extent had one), which the group path copies.
                self.write_piece_packed(
                    ext,
                    first + at,
                    len,
                    piece_data,
                    piece_crcs,
                    |i| version_of(i0 + i),
                    |i, cur, new| accept(i0 + i, cur, new),
                    codec,
                )?
            };
            n += pn;
            seq = seq.max(ps);
            at += len;
        }
        Ok((n, seq))
    }

    /// One piece of [`Drive::write_claimed`] (its records go into one batch).
    ///
    /// Out of place: each accepted block is written to a free physical block first and its
    /// record (naming that block) queued after. Until the record is durable the block's
    /// durable metadata still names its previous physical block, which nothing writes
    /// before it is given back (when the record is applied). So a crash at any point,
    /// process kill or power loss, tearing or dropping any unsynced write, leaves the
    /// previous content intact and provable by its crc; recovery picks the newest state
    /// whose data is on disk.
    #[allow(clippy::too_many_arguments)]
    fn write_piece(
        &self,
        ext: &Extent,
        first: u32,
        count: u32,
        data: &[u8],
        crcs: &[u32],
        version_of: impl Fn(usize) -> u64,
        accept: impl Fn(usize, &BlockMeta, &BlockMeta) -> bool,
        hold: bool,
    ) -> Result<Option<(u32, u64)>, EngineError> {
        with_scratch(|s| {
            let snapshots = ext.floor.load(Ordering::Acquire) > 0;
            let (n, need_seq) = self.claim(
                ext,
                first,
                count,
                |i, _| BlockMeta::data(version_of(i), crcs[i], 0),
                accept,
                &mut s.applied,
                (hold || snapshots).then_some(&mut s.metas),
            )?;
            self.counters
                .skipped_blocks
                .fetch_add(u64::from(count - n), Ordering::Relaxed);
            let mut seq = need_seq.max(ext.epoch_seq.load(Ordering::Acquire));
            if n == 0 {
                return Ok(Some((0, seq)));
            }
            let floor = if snapshots {
                match self.plan_preserves(ext, &s.applied, &s.metas, &version_of) {
                    Ok(f) => f,
                    Err(e) => {
                        self.unclaim(ext, first, &s.applied, &s.metas);
                        return Err(e);
                    }
                }
            } else {
                0
            };
            if floor > 0
                && !hold
                && applied_indexes(&s.applied).any(|i| {
                    s.metas[i].is_packed() && must_preserve(floor, &s.metas[i], version_of(i))
                })
            {
                // A packed state the snapshot reads (written while the extent had a
                // codec): the group path copies it out of its stream.
                self.unclaim(ext, first, &s.applied, &s.metas);
                return Ok(None);
            }
            let Scratch {
                applied,
                records,
                phys,
                metas,
                ..
            } = s;
            phys.clear();
            // A held write keeps the state it replaces as the block's prior: a state the
            // snapshot reads is copied for it instead of moved (both name it otherwise).
            let copied = |i: &usize| {
                hold && metas[*i].run().is_some()
                    && must_preserve(floor, &metas[*i], version_of(*i))
            };
            let copies = if floor > 0 && hold {
                applied_indexes(applied).filter(copied).count()
            } else {
                0
            };
            let homes = self.homes(ext, first, applied);
            let taken = homes.len() + copies;
            let copy_homes = applied_indexes(applied)
                .filter(copied)
                .map(|i| self.layout.home_block(ext.slot, first + i as u32));
            let res = self
                .take_blocks(ExactLen(homes.chain(copy_homes), taken), phys)
                .and_then(|()| self.write_runs(data, applied, phys))
                .and_then(|()| {
                    records.clear();
                    if copies > 0 {
                        let n_data = taken - copies;
                        let which = applied_indexes(applied).filter(copied);
                        self.copy_kept_states(
                            ext,
                            first,
                            floor,
                            which,
                            metas,
                            &phys[n_data..],
                            records,
                        )?;
                    }
                    self.push_preserves(
                        ext,
                        first,
                        floor,
                        applied,
                        metas,
                        &version_of,
                        hold,
                        records,
                    );
                    for (i, &p) in applied_indexes(applied).zip(phys.iter()) {
                        let (block, version) = (first + i as u32, version_of(i));
                        // A held write names the block's state before it (the prior);
                        // the same version again (a retry) keeps the prior it has.
                        if hold && metas[i].version < version {
                            Record::Prior {
                                slot: ext.slot,
                                block,
                                meta: metas[i],
                            }
                            .push(records);
                        }
                        Record::Data {
                            slot: ext.slot,
                            block,
                            crc: crcs[i],
                            version,
                            phys: p,
                            hold,
                            pack: 0,
                        }
                        .push(records);
                    }
                    self.enqueue(records, false)
                });
            if let Err(e) = &res {
                // The data on disk may no longer match what we know: stop acking.
                self.fail(e);
            }
            self.release(ext, first, applied, *res.as_ref().unwrap_or(&0), phys);
            seq = seq.max(res?);
            Ok(Some((n, seq)))
        })
    }

    /// For a claim on an extent with a snapshot floor (`before`: each block's state when
    /// claimed): the floor its writes preserve for, once the shadow extent of that
    /// snapshot exists (allocated here, its record queued before the caller's), or 0 when
    /// no applied block replaces a state the snapshot reads. Refused when the drive has no
    /// slot left for the shadow, or no room for the preserved blocks beside what the live
    /// extents may still write.
    fn plan_preserves(
        &self,
        ext: &Extent,
        applied: &[bool],
        before: &[BlockMeta],
        version_of: &impl Fn(usize) -> u64,
    ) -> Result<u32, EngineError> {
        // Under the table lock: the floor and its shadow are read together, as
        // `drop_snapshot` changes them.
        let mut t = lock(&self.table);
        let floor = ext.floor.load(Ordering::Acquire);
        let n = applied_indexes(applied)
            .filter(|&i| must_preserve(floor, &before[i], version_of(i)))
            .count() as u64;
        if n == 0 {
            return Ok(0);
        }
        self.room_to_preserve(n)?;
        if !t.shadows.contains_key(&(ext.key, floor)) {
            self.alloc_shadow(&mut t, ext.key, floor)?;
        }
        Ok(floor)
    }

    /// Refuses keeping `n` more blocks for snapshots when they would not fit beside what
    /// the extents may still write: the pool-full error the owner reports.
    pub(crate) fn room_to_preserve(&self, n: u64) -> Result<(), EngineError> {
        if self.committed_blocks() + n > self.layout.extent_blocks() {
            return Err(EngineError::Full {
                committed_bytes: self.committed_blocks() * BLOCK,
                capacity_bytes: self.layout.extent_blocks() * BLOCK,
            });
        }
        Ok(())
    }

    /// Queues the Shadow record of a new shadow extent of `key` for snapshot `snapshot`
    /// (under the table lock, so it precedes every record that names it).
    fn alloc_shadow(
        &self,
        t: &mut Table,
        key: ExtentKey,
        snapshot: u32,
    ) -> Result<u32, EngineError> {
        let Some(slot) = t.free.pop() else {
            return Err(EngineError::NoSpace {
                extents_total: u64::from(self.layout.extents_total),
            });
        };
        let mut rec = [0u8; RECORD];
        Record::Shadow {
            slot,
            key,
            epoch: snapshot,
        }
        .encode(&mut rec);
        if let Err(e) = self.enqueue(&rec, true) {
            t.free.push(slot);
            return Err(e);
        }
        let blocks = vec![BlockMeta::default(); self.layout.blocks_per_extent as usize];
        let shadow = Arc::new(Extent::new_shadow(key, slot, snapshot, blocks));
        t.slots[slot as usize].live = Some(shadow);
        t.shadows.insert((key, snapshot), slot);
        Ok(slot)
    }

    /// Appends a Preserve record for each applied block whose write replaces a state the
    /// snapshot at `floor` reads (none when `floor` is 0).
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    fn push_preserves(
        &self,
        ext: &Extent,
        first: u32,
        floor: u32,
        applied: &[bool],
        before: &[BlockMeta],
        version_of: &impl Fn(usize) -> u64,
        hold: bool,
        records: &mut Vec<u8>,
    ) {
        if floor == 0 {
            return;
        }
        for i in applied_indexes(applied) {
            // A packed state stays with its group's stream, and a held write's replaced
            // state stays as the block's prior: those are copied instead
            // ([`Drive::copy_preserves`], [`Drive::copy_kept_states`]).
            let copied = before[i].is_packed() || (hold && before[i].run().is_some());
            if must_preserve(floor, &before[i], version_of(i)) && !copied {
                Record::Preserve {
                    slot: ext.slot,
                    block: first + i as u32,
                    snapshot: floor,
                    meta: before[i],
                }
                .push(records);
            }
        }
    }

    /// The home physical block of each applied block of a claim (where it goes if free).
    fn homes<'a>(
        &'a self,
        ext: &'a Extent,
        first: u32,
        applied: &'a [bool],
    ) -> impl ExactSizeIterator<Item = u32> + Clone + 'a {
        let n = applied.iter().filter(|&&a| a).count();
        let it = applied_indexes(applied)
            .map(move |i| self.layout.home_block(ext.slot, first + i as u32));
        ExactLen(it, n)
    }

    /// Makes sure the extent exists at `epoch` or newer (allocating it, or raising its
    /// epoch) and that this is durable, without writing data: the cache tier calls it
    /// before it acks a write that lands in its log, so the epoch fence and the extent's
    /// allocation are on the capacity drive before the data is.
    pub fn prepare_write(&self, key: ExtentKey, epoch: Epoch) -> Result<(), EngineError> {
        self.check_failed()?;
        let ext = self.extent_for_write(key, epoch)?;
        self.wait_durable(ext.epoch_seq.load(Ordering::Acquire))
    }

    /// Refuses `epoch` if the extent has moved past it (nothing else; no allocation).
    pub fn check_epoch_of(&self, key: ExtentKey, epoch: Epoch) -> Result<(), EngineError> {
        self.check_failed()?;
        match self.lookup(key) {
            Some(ext) => Self::check_epoch(&ext, epoch),
            None => Ok(()),
        }
    }

    /// Writes destaged runs from a cache drive: block `i` of a run gets `versions[i]` if
    /// that is not older than what the drive holds (a newer direct write wins). Extents
    /// the drive no longer holds are skipped (freed meanwhile), never allocated. Runs are
    /// written in groups whose records share one journal batch (the same batching as
    /// before the record-first overwrite order); one durability wait for all runs;
    /// returns the blocks written. Durable on Ok.
    pub fn destage(&self, runs: &[DestageRun<'_>]) -> Result<u64, EngineError> {
        self.check_failed()?;
        let mut ranges = Vec::with_capacity(runs.len());
        for r in runs {
            let count = r.crcs.len();
            if r.versions.len() != count || r.data.len() != count * BLOCK_SIZE {
                return Err(EngineError::InvalidIo {
                    key: r.key,
                    reason: "a destage run needs one crc and one version per 4 KiB block",
                    offset: u64::from(r.first) * BLOCK,
                    len: r.data.len() as u64,
                });
            }
            ranges.push(self.range(r.key, u64::from(r.first) * BLOCK, r.data.len() as u64)?);
        }
        let cap = self.piece_blocks();
        // Runs of extents with a codec are compressed on the way, each on its own.
        // So are runs of extents with snapshots (their writes may preserve states first).
        let compressed: Vec<bool> = runs
            .iter()
            .map(|r| {
                self.lookup(r.key).is_some_and(|e| {
                    !self.codec_for(&e, false).is_none() || e.floor.load(Ordering::Acquire) > 0
                })
            })
            .collect();
        let mut seq = 0;
        let mut written = 0u64;
        let mut i = 0;
        while i < runs.len() {
            // A group: runs whose records fit half a batch and whose blocks do not overlap
            // (a claim would wait for the group's own earlier claim).
            let mut end = i;
            let mut blocks = 0u32;
            while end < runs.len() {
                let (f, c) = ranges[end];
                let overlaps = (i..end).any(|j| {
                    runs[j].key == runs[end].key
                        && ranges[j].0 < f + c
                        && f < ranges[j].0 + ranges[j].1
                });
                if end > i && (blocks + c > cap || overlaps || compressed[end] || compressed[i]) {
                    break;
                }
                blocks += c;
                end += 1;
            }
            if end == i + 1 && (blocks > cap || compressed[i]) {
                // One run too big for a batch (or to compress): write it in pieces.
                let r = &runs[i];
                if let Some(ext) = self.lookup(r.key) {
                    let t = self.counters.begin();
                    let res = self.write_claimed(
                        &ext,
                        ranges[i].0,
                        ranges[i].1,
                        r.data,
                        r.crcs,
                        |k| r.versions[k],
                        |_, cur, new| new.version >= cur.version,
                        false,
                    );
                    self.counters.end(OpKind::Write, t);
                    let (n, sq) = res?;
                    written += u64::from(n);
                    seq = seq.max(sq);
                }
            } else {
                let (n, sq) = self.destage_group(&runs[i..end], &ranges[i..end])?;
                written += n;
                seq = seq.max(sq);
            }
            i = end;
        }
        if seq > 0 {
            self.wait_durable(seq)?;
        }
        Ok(written)
    }

    /// Claims every run of a group, then takes physical blocks for all of them, writes
    /// their data, queues all records in one batch and releases. Returns (blocks written,
    /// the batch to wait for). No blocks are taken before every claim is held (a claim may
    /// wait for a writer that waits for blocks).
    fn destage_group(
        &self,
        runs: &[DestageRun<'_>],
        ranges: &[(u32, u32)],
    ) -> Result<(u64, u64), EngineError> {
        struct Claimed {
            ext: Arc<Extent>,
            run: usize,
            applied: Vec<bool>,
            /// Index of this run's first block in `phys`.
            at: usize,
        }
        let t = self.counters.begin();
        let mut claimed: Vec<Claimed> = Vec::with_capacity(runs.len());
        let mut seq = 0;
        let mut n = 0u64;
        for (k, r) in runs.iter().enumerate() {
            let Some(ext) = self.lookup(r.key) else {
                continue;
            };
            let (first, count) = ranges[k];
            let mut applied = Vec::new();
            // Released meanwhile: skipped, like an extent the drive no longer holds.
            let Ok((cn, need_seq)) = self.claim(
                &ext,
                first,
                count,
                |i, _| BlockMeta::data(r.versions[i], r.crcs[i], 0),
                |_, cur, new| new.version >= cur.version,
                &mut applied,
                None,
            ) else {
                continue;
            };
            self.counters
                .skipped_blocks
                .fetch_add(u64::from(count - cn), Ordering::Relaxed);
            seq = seq.max(need_seq).max(ext.epoch_seq.load(Ordering::Acquire));
            n += u64::from(cn);
            claimed.push(Claimed {
                ext,
                run: k,
                applied,
                at: 0,
            });
        }
        let mut phys = Vec::with_capacity(n as usize);
        let mut records = Vec::with_capacity(n as usize * RECORD);
        let mut res: Result<u64, EngineError> = Ok(0);
        if n > 0 {
            let mut homes = Vec::with_capacity(n as usize);
            for c in &mut claimed {
                c.at = homes.len();
                let first = ranges[c.run].0;
                homes.extend(self.homes(&c.ext, first, &c.applied));
            }
            res = self
                .take_blocks(homes.iter().copied(), &mut phys)
                .and_then(|()| {
                    for c in &claimed {
                        let r = &runs[c.run];
                        let first = ranges[c.run].0;
                        let mine = &phys[c.at..];
                        self.write_runs(r.data, &c.applied, mine)?;
                        for (i, &p) in applied_indexes(&c.applied).zip(mine) {
                            Record::Data {
                                slot: c.ext.slot,
                                block: first + i as u32,
                                crc: r.crcs[i],
                                version: r.versions[i],
                                phys: p,
                                hold: false,
                                pack: 0,
                            }
                            .push(&mut records);
                        }
                    }
                    self.enqueue(&records, false)
                });
        }
        if let Err(e) = &res {
            self.fail(e);
        }
        let done = *res.as_ref().unwrap_or(&0);
        for c in &claimed {
            let mine = phys.get(c.at..).unwrap_or(&[]);
            self.release(&c.ext, ranges[c.run].0, &c.applied, done, mine);
        }
        // One write op per run (the group's latency for each).
        for k in 0..claimed.len().max(1) {
            if k > 0 {
                self.counters.begin();
            }
            self.counters.end(OpKind::Write, t);
        }
        Ok((n, seq.max(res?)))
    }

    /// [`Drive::fence_and_digest`] with some blocks' versions replaced (the cache tier's
    /// newer versions of blocks it still holds): the digest of the version map a client
    /// of the tier sees.
    pub fn fence_and_digest_with(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        overrides: &[(u32, u64)],
    ) -> Result<u64, EngineError> {
        self.fence(key, epoch)?;
        let blocks = (self.layout.slab_size_bytes / BLOCK) as u32;
        match self.lookup(key) {
            Some(ext) => {
                let m = lock(&ext.meta);
                let mut d = m.digest;
                for &(b, v) in overrides.iter().filter(|(b, _)| *b < blocks) {
                    d = d
                        .wrapping_sub(digest_term(b, m.blocks[b as usize].version))
                        .wrapping_add(digest_term(b, v));
                }
                Ok(d)
            }
            None => {
                let mut d = version_digest(std::iter::repeat_n(0, blocks as usize));
                for &(b, v) in overrides.iter().filter(|(b, _)| *b < blocks) {
                    d = d
                        .wrapping_sub(digest_term(b, 0))
                        .wrapping_add(digest_term(b, v));
                }
                Ok(d)
            }
        }
    }

    /// Writes the applied blocks of a claim to their physical blocks `phys` (one per
    /// applied block, in order): one pwrite per run that is consecutive both in the
    /// request and on the device (usually one for the whole request).
    fn write_runs(&self, data: &[u8], applied: &[bool], phys: &[u32]) -> Result<(), EngineError> {
        let mut k = 0;
        let mut i = 0;
        while i < applied.len() {
            if !applied[i] {
                i += 1;
                continue;
            }
            let (start, p0) = (i, phys[k]);
            i += 1;
            k += 1;
            while i < applied.len() && applied[i] && phys[k] == p0 + (i - start) as u32 {
                i += 1;
                k += 1;
            }
            self.dev_write(
                &data[start * BLOCK_SIZE..i * BLOCK_SIZE],
                self.layout.phys_off(p0),
                IoKind::Data,
            )?;
        }
        Ok(())
    }

    /// Reads blocks; unallocated or zeroed blocks read as zeros. See [`ReadInfo`].
    pub fn read(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<ReadInfo, EngineError> {
        let t = self.counters.begin();
        let r = self.read_inner(key, epoch, offset, buf, None);
        self.counters.end(OpKind::Read, t);
        r
    }

    /// A read that also reports every block's version (`versions` is replaced), for
    /// copying blocks between replicas with [`Drive::write_blocks`].
    pub fn read_blocks(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: &mut Vec<Version>,
    ) -> Result<ReadInfo, EngineError> {
        let t = self.counters.begin();
        let r = self.read_inner(key, epoch, offset, buf, Some(versions));
        self.counters.end(OpKind::Read, t);
        r
    }

    fn read_inner(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
        block_versions: Option<&mut Vec<Version>>,
    ) -> Result<ReadInfo, EngineError> {
        let (first, count) = self.range(key, offset, buf.len() as u64)?;
        self.check_failed()?;
        let Some(ext) = self.lookup(key) else {
            buf.fill(0);
            if let Some(v) = block_versions {
                v.clear();
                v.resize(count as usize, Version(0));
            }
            return Ok(ReadInfo::default());
        };
        Self::check_epoch(&ext, epoch)?;
        with_scratch(|s| {
            self.read_checked(buf, s, block_versions, &|out: &mut Vec<BlockMeta>| {
                Self::snapshot(&ext, first, count, out)
            })
        })
    }

    /// Reads the blocks whose states `states` gives into `buf` and checks each against
    /// its crc; a mismatch is retried while the states change under it (a write raced
    /// the read). Zeros for blocks without data.
    fn read_checked(
        &self,
        buf: &mut [u8],
        s: &mut Scratch,
        block_versions: Option<&mut Vec<Version>>,
        states: &dyn Fn(&mut Vec<BlockMeta>),
    ) -> Result<ReadInfo, EngineError> {
        let mut bad = Vec::new();
        let mut suspect = Vec::new();
        for attempt in 0..READ_RETRIES {
            states(&mut s.metas);
            self.read_runs(&s.metas, buf)?;
            if s.metas.iter().any(|m| m.is_packed()) {
                self.read_packed(&s.metas, buf)?;
            }
            bad.clear();
            suspect.clear();
            for (i, (m, blk)) in s
                .metas
                .iter()
                .zip(buf.chunks_exact_mut(BLOCK_SIZE))
                .enumerate()
            {
                if m.is_bad() || (m.has_data() && crc32c::crc32c(blk) != m.crc) {
                    bad.push(i as u32);
                    continue;
                } else if !m.has_data() {
                    blk.fill(0);
                }
                if m.is_suspect() {
                    suspect.push(i as u32);
                }
            }
            if bad.is_empty() || attempt + 1 == READ_RETRIES {
                break;
            }
            // A mismatch is real only if no write changed these blocks meanwhile.
            states(&mut s.metas2);
            if s.metas == s.metas2 {
                break;
            }
        }
        self.counters
            .bad_blocks_reported
            .fetch_add(bad.len() as u64, Ordering::Relaxed);
        if !suspect.is_empty() {
            self.counters
                .suspect_blocks_reported
                .fetch_add(suspect.len() as u64, Ordering::Relaxed);
        }
        let versions = Version(s.metas.iter().map(|m| m.version).max().unwrap_or(0));
        if let Some(v) = block_versions {
            v.clear();
            v.extend(s.metas.iter().map(|m| Version(m.version)));
        }
        Ok(ReadInfo {
            bad_blocks: bad,
            suspect,
            versions,
        })
    }

    /// Reads the blocks of `metas` that hold data into their places in `buf`: one pread
    /// per run that is consecutive both in `buf` and on the device.
    fn read_runs(&self, metas: &[BlockMeta], buf: &mut [u8]) -> Result<(), EngineError> {
        // Packed blocks are read by `read_packed`, a stream at a time.
        let held = |m: &BlockMeta| m.has_data() && !m.is_bad() && !m.is_packed();
        let mut i = 0;
        while i < metas.len() {
            if !held(&metas[i]) {
                i += 1;
                continue;
            }
            let (start, p0) = (i, metas[i].phys);
            i += 1;
            while i < metas.len() && held(&metas[i]) && metas[i].phys == p0 + (i - start) as u32 {
                i += 1;
            }
            self.dev_read(
                &mut buf[start * BLOCK_SIZE..i * BLOCK_SIZE],
                self.layout.phys_off(p0),
            )?;
        }
        Ok(())
    }

    /// TRIM / WRITE_ZEROES: the blocks read as zeros at `version`; metadata only.
    pub fn zero(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let (seq, t) = self.zero_nowait(key, epoch, version, offset, len)?;
        let r = self.wait_durable(seq);
        self.counters.end(OpKind::Zero, t);
        r
    }

    /// [`Drive::zero`] up to the wait for durability: (batch, start).
    pub(crate) fn zero_nowait(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(u64, OpStart), EngineError> {
        let t = self.counters.begin();
        match self.zero_inner(key, epoch, version, offset, len) {
            Ok(seq) => Ok((seq, t)),
            Err(e) => {
                self.counters.end(OpKind::Zero, t);
                Err(e)
            }
        }
    }

    fn zero_inner(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<u64, EngineError> {
        let (first, count) = self.range(key, offset, len)?;
        self.check_failed()?;
        let ext = self.extent_for_write(key, epoch)?;
        with_scratch(|s| {
            let new = BlockMeta::zero(version.0);
            let snapshots = ext.floor.load(Ordering::Acquire) > 0;
            let (n, need_seq) = self.claim(
                &ext,
                first,
                count,
                |_, _| new,
                |_, cur, new| new.version >= cur.version,
                &mut s.applied,
                snapshots.then_some(&mut s.metas),
            )?;
            self.counters
                .skipped_blocks
                .fetch_add(u64::from(count - n), Ordering::Relaxed);
            let mut seq = need_seq.max(ext.epoch_seq.load(Ordering::Acquire));
            if n > 0 {
                let version_of = |_| version.0;
                let floor = if snapshots {
                    match self.plan_preserves(&ext, &s.applied, &s.metas, &version_of) {
                        Ok(f) => f,
                        Err(e) => {
                            self.unclaim(&ext, first, &s.applied, &s.metas);
                            return Err(e);
                        }
                    }
                } else {
                    0
                };
                s.records.clear();
                if let Err(e) = self.copy_preserves(
                    &ext,
                    first,
                    floor,
                    &s.applied,
                    &s.metas,
                    &version_of,
                    &mut s.records,
                ) {
                    self.unclaim(&ext, first, &s.applied, &s.metas);
                    return Err(e);
                }
                self.push_preserves(
                    &ext,
                    first,
                    floor,
                    &s.applied,
                    &s.metas,
                    &version_of,
                    false,
                    &mut s.records,
                );
                let mut i = 0;
                while i < s.applied.len() {
                    if !s.applied[i] {
                        i += 1;
                        continue;
                    }
                    let start = i;
                    while i < s.applied.len() && s.applied[i] {
                        i += 1;
                    }
                    Record::Zero {
                        slot: ext.slot,
                        block: first + start as u32,
                        count: (i - start) as u32,
                        version: version.0,
                    }
                    .push(&mut s.records);
                }
                seq = seq.max(self.queue_claimed(&ext, first, &s.applied, &s.records)?);
            }
            Ok(seq.max(ext.epoch_seq.load(Ordering::Acquire)))
        })
    }

    /// Current version of `count` blocks from `offset` (0 for never-written blocks).
    pub fn block_versions(
        &self,
        key: ExtentKey,
        offset: u64,
        count: usize,
    ) -> Result<Vec<Version>, EngineError> {
        let (first, n) = self.range(key, offset, count as u64 * BLOCK)?;
        let Some(ext) = self.lookup(key) else {
            return Ok(vec![Version(0); count]);
        };
        let m = lock(&ext.meta);
        Ok((first..first + n)
            .map(|b| Version(m.current(b).version))
            .collect())
    }

    /// Raises the extent's epoch to `epoch` (durably) so that requests of older owners are
    /// refused from now on; a new owner calls it on every copy before serving.
    pub fn fence(&self, key: ExtentKey, epoch: Epoch) -> Result<(), EngineError> {
        self.check_failed()?;
        // An extent this drive does not hold yet is allocated here, fenced: a new owner
        // fences every copy its slab record names, and a deposed owner's write still in
        // flight must not create the extent afterwards at its older epoch (simulation
        // seed 2796: a copy whose node lost power before the slab's first write landed).
        let ext = self.extent_for_write(key, epoch)?;
        self.wait_durable(ext.epoch_seq.load(Ordering::Acquire))
    }

    /// Fences the extent at `epoch` (as [`Drive::fence`]) and returns the digest of its
    /// durable version map: two copies with equal digests hold the same versions, so a new
    /// owner only compares block by block the slabs whose copies' digests differ (those
    /// with writes in flight at the crash). An extent this drive does not hold has the
    /// digest of a never-written one.
    pub fn fence_and_digest(&self, key: ExtentKey, epoch: Epoch) -> Result<u64, EngineError> {
        self.fence(key, epoch)?;
        match self.lookup(key) {
            Some(ext) => Ok(lock(&ext.meta).digest),
            None => Ok(version_digest(std::iter::repeat_n(
                0,
                (self.layout.slab_size_bytes / BLOCK) as usize,
            ))),
        }
    }

    /// Device offset of the data of block `block` of an extent, if it holds data (for
    /// tools and fault-injection tests; the block may move at its next write).
    pub fn block_offset(&self, key: ExtentKey, block: u32) -> Option<u64> {
        let ext = self.lookup(key)?;
        let m = lock(&ext.meta);
        let meta = m.current(block);
        (block < self.layout.blocks_per_extent && meta.has_data() && !meta.is_bad())
            .then(|| self.layout.phys_off(meta.phys))
    }

    /// Whether this drive holds the extent (a write to a missing one allocates it).
    pub fn has_extent(&self, key: ExtentKey) -> bool {
        self.lookup(key).is_some()
    }

    /// Extents on this drive with their epochs.
    pub fn extents(&self) -> Vec<ExtentInfo> {
        let t = lock(&self.table);
        let mut v: Vec<ExtentInfo> = t
            .by_key
            .values()
            .filter_map(|&s| t.slots[s as usize].live.as_ref())
            .map(|e| {
                let preserved: u64 = t
                    .shadows
                    .range((e.key, 0)..=(e.key, u32::MAX))
                    .filter_map(|(_, &s)| t.slots[s as usize].live.as_ref())
                    .map(|s| u64::from(lock(&s.meta).stored_blocks))
                    .sum();
                let m = lock(&e.meta);
                ExtentInfo {
                    key: e.key,
                    epoch: Epoch(e.epoch.load(Ordering::Acquire)),
                    bytes_allocated: self.layout.slab_size_bytes,
                    bytes_written: u64::from(m.data_blocks) * BLOCK,
                    bytes_stored: u64::from(m.stored_blocks) * BLOCK,
                    compression: e.codec(),
                    snapshot_floor: e.floor.load(Ordering::Acquire),
                    bytes_preserved: preserved * BLOCK,
                }
            })
            .collect();
        v.sort_by_key(|e| e.key);
        v
    }

    /// Frees an extent (durable on Ok). Freeing an unknown extent is Ok (retries are safe).
    /// The caller must not run I/O on the extent concurrently.
    pub fn free_extent(&self, key: ExtentKey) -> Result<(), EngineError> {
        self.check_failed()?;
        let seq = {
            let mut t = lock(&self.table);
            let Some(&slot) = t.by_key.get(&key) else {
                return Ok(());
            };
            self.free_slot(&mut t, key, slot)?
        };
        self.wait_durable(seq)
    }

    /// Frees the extent if it holds nothing newer than `upto` (durable on `Ok(true)`): the
    /// owner releases a slab it has zeroed whole at version `upto`, and a request that
    /// arrives late must never free a later incarnation of the slab (its first operation
    /// carries a higher version) nor lose a write in progress. `Ok(false)`: kept, because a
    /// block is newer or a write to it is in progress. A missing extent is `Ok(true)`; an
    /// extent at a newer epoch refuses the older owner (`StaleEpoch`). Checked and freed
    /// under the extent's lock, so a write that found the extent before is refused
    /// ([`EngineError::Released`]) instead of landing on the freed slot.
    pub fn release_extent(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
    ) -> Result<bool, EngineError> {
        self.check_failed()?;
        let seq = {
            let mut t = lock(&self.table);
            let Some(&slot) = t.by_key.get(&key) else {
                return Ok(true);
            };
            let ext = t.slots[slot as usize]
                .live
                .clone()
                .expect("by_key only names live slots");
            Self::check_epoch(&ext, epoch)?;
            {
                let mut m = lock(&ext.meta);
                if self.holds_newer(&m, upto) {
                    return Ok(false);
                }
                m.freed = true;
            }
            self.free_slot(&mut t, key, slot)?
        };
        self.wait_durable(seq)?;
        Ok(true)
    }

    /// Whether a block of the extent is newer than `upto` or being written.
    fn holds_newer(&self, m: &ExtentMeta, upto: Version) -> bool {
        let blocks = self.layout.blocks_per_extent;
        m.any_busy(0, blocks) || (0..blocks).any(|b| m.current(b).version > upto.0)
    }

    /// Takes the extent out of the table and queues its free record: the journal batch
    /// to wait for. The slot is reused once that is durable (commit).
    /// Its shadows (the states its snapshots preserved) go with it.
    fn free_slot(&self, t: &mut Table, key: ExtentKey, slot: u32) -> Result<u64, EngineError> {
        t.by_key.remove(&key);
        if let Some(ext) = t.slots[slot as usize].live.take() {
            if ext.codec().is_none() {
                self.plain_extents.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let shadows: Vec<(ExtentKey, u32)> = t
            .shadows
            .range((key, 0)..=(key, u32::MAX))
            .map(|(&k, _)| k)
            .collect();
        let mut recs = Vec::with_capacity((shadows.len() + 1) * RECORD);
        for k in shadows {
            if let Some(s) = t.shadows.remove(&k) {
                t.slots[s as usize].live = None;
                Record::Free { slot: s }.push(&mut recs);
            }
        }
        Record::Free { slot }.push(&mut recs);
        self.enqueue(&recs, true)
    }

    /// Whether [`Drive::release_extent`] would free the extent now (it checks the same
    /// under its locks; the cache tier asks first, to drop its own log of the extent only
    /// when the capacity drive will free it).
    pub(crate) fn releasable(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
    ) -> Result<bool, EngineError> {
        self.check_failed()?;
        let Some(ext) = self.lookup(key) else {
            return Ok(true);
        };
        Self::check_epoch(&ext, epoch)?;
        let m = lock(&ext.meta);
        Ok(!self.holds_newer(&m, upto))
    }

    pub fn capacity(&self) -> Capacity {
        let (used, free_slots) = {
            let t = lock(&self.table);
            (t.by_key.len() as u64, t.free.len() as u64)
        };
        let total = u64::from(self.layout.data_extents);
        let slots = u64::from(self.layout.extents_total);
        assert!(
            free_slots <= slots,
            "the free list holds {free_slots} slots of {slots}"
        );
        Capacity {
            extents_total: total,
            extents_used: used,
            bytes_total: total * self.layout.slab_size_bytes,
            bytes_used: used * self.layout.slab_size_bytes,
            slots_total: slots,
            slots_used: slots - free_slots,
            bytes_committed: self.committed_blocks() * BLOCK,
            bytes_stored: (self.plain_stored.load(Ordering::Relaxed)
                + self.thin_stored.load(Ordering::Relaxed))
                * BLOCK,
            bytes_free: lock(&self.pool).free() * BLOCK,
            bytes_held: self.held_storage_blocks() * BLOCK,
            bytes_preserved: self.shadow_stored.load(Ordering::Relaxed) * BLOCK,
        }
    }

    /// Physical blocks the priors occupy beyond what current states name.
    fn held_storage_blocks(&self) -> u64 {
        if self.held_blocks.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let extents: Vec<Arc<Extent>> = {
            let t = lock(&self.table);
            t.slots.iter().filter_map(|s| s.durable.clone()).collect()
        };
        let mut n = 0u64;
        for e in extents {
            let m = lock(&e.meta);
            let mut streams = BTreeSet::new();
            for (&b, p) in &m.held {
                if let Some((first, len)) = p.run() {
                    if m.named(b, *p, true) || (p.is_packed() && !streams.insert(first)) {
                        continue;
                    }
                    n += u64::from(len);
                }
            }
        }
        n
    }

    /// Physical blocks the allocated extents have claimed: plain ones whole, thin ones
    /// (with a codec) and shadows what they store.
    pub(crate) fn committed_blocks(&self) -> u64 {
        self.plain_extents.load(Ordering::Relaxed) * u64::from(self.layout.blocks_per_extent)
            + self.thin_stored.load(Ordering::Relaxed)
            + self.shadow_stored.load(Ordering::Relaxed)
    }

    /// How the extent's later writes are compressed (none if the drive does not hold it).
    pub fn codec_of(&self, key: ExtentKey) -> Compression {
        self.lookup(key).map(|e| e.codec()).unwrap_or_default()
    }

    /// Sets how later writes of the extent are compressed (docs/adr/0010), allocating it
    /// as a write would if the drive does not hold it. The owner's writes carry their
    /// volume's codec and the replica service sets it before writing when it differs;
    /// the extent table keeps it for the cache tier's destage. On a version-2 drive the
    /// setting is kept but writes are stored as is.
    pub fn set_codec(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        codec: Compression,
    ) -> Result<(), EngineError> {
        self.check_failed()?;
        let ext = self.extent_for_write(key, epoch)?;
        if ext.codec() == codec {
            return Ok(());
        }
        // Under the table lock (one change at a time, and after the extent's Alloc) and
        // the extent's (the drive's stored counts move with it, as `apply` moves them).
        let _t = lock(&self.table);
        let m = lock(&ext.meta);
        let old = ext.codec();
        if old == codec || m.freed {
            return Ok(());
        }
        let mut rec = [0u8; RECORD];
        Record::Codec {
            slot: ext.slot,
            codec,
        }
        .encode(&mut rec);
        let seq = self.enqueue(&rec, true)?;
        // Acks of later writes wait for it, as for an epoch: a destage after a crash then
        // knows the codec.
        ext.epoch_seq.fetch_max(seq, Ordering::AcqRel);
        let stored = u64::from(m.stored_blocks);
        let (from, to) = if old.is_none() {
            self.plain_extents.fetch_sub(1, Ordering::Relaxed);
            (&self.plain_stored, &self.thin_stored)
        } else if codec.is_none() {
            self.plain_extents.fetch_add(1, Ordering::Relaxed);
            (&self.thin_stored, &self.plain_stored)
        } else {
            (&self.thin_stored, &self.thin_stored)
        };
        from.fetch_sub(stored, Ordering::Relaxed);
        to.fetch_add(stored, Ordering::Relaxed);
        ext.codec.store(codec.code(), Ordering::Relaxed);
        Ok(())
    }

    pub fn stats(&self) -> DriveStats {
        self.counters.snapshot()
    }
}
