//! The owner of a volume: splits client I/O at slab boundaries, stamps versions, writes
//! every copy in parallel, routes reads (local copy first) and repairs bad blocks.
//!
//! It knows nothing of sockets, etcd or files: replicas are reached through [`ReplicaIo`]
//! and new slabs are placed through [`SlabAllocator`], so the same code runs in the node
//! daemon and in the deterministic simulator.

mod clone;
pub mod crypt;
mod fill_snapshots;
mod mirror_part;
mod mirror_part_snapshots;
pub mod parity;
mod parity_io;
mod parity_snapshots;
mod parity_sync;
pub mod qos;
pub mod resync;
mod scrub_snapshots;
pub use clone::ParentRead;
mod snapshot;
pub use snapshot::{SnapshotSpace, CHANGES_MAX_BYTES};
pub mod stats;
pub mod tenure;

use bytes::{Bytes, BytesMut};
pub use converge_types::{BlocksReply, ExtentOp, ExtentReply, ReadReply};
use converge_types::{
    Compression, DriveId, Epoch, ExtentKey, ExtentState, NodeId, Resiliency, SlabIndex, Version,
    VolumeId, BLOCK_SIZE, MAX_IO_BYTES,
};
use serde::{Deserialize, Serialize};
use stats::{VolumeCounters, VolumeStats};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
// The runtime's clock, not the wall clock: deadlines then follow virtual time in the
// simulator (and in tests with paused time); in production the two are the same.
use tokio::time::Instant;

pub use mirror_part::{MirrorPartUsage, Rotated};
pub use tenure::Tenure;

use parity::{Codec, Geometry};
use parity_io::{RowLocks, RowWrites};

const BS: u64 = BLOCK_SIZE as u64;

/// Where one copy of a slab lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtentLoc {
    pub node: NodeId,
    pub drive: DriveId,
    pub state: ExtentState,
}

/// Why a replica could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaError {
    #[error("fenced: {0}")]
    StaleEpoch(String),
    #[error("checksum mismatch: {0}")]
    Checksum(String),
    #[error("no space: {0}")]
    NoSpace(String),
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// The drive cannot take the operation now but will (a parity chunk's drive holds as
    /// many priors as it may until owners settle): try again shortly.
    #[error("busy: {0}")]
    Busy(String),
    #[error("I/O error: {0}")]
    Io(String),
}

/// The path from the owner to one extent (its own node's drive or a peer's). One method:
/// every operation is an [`ExtentOp`], and the owner checks every answer against its
/// operation ([`converge_types::ReplyShape`]), whichever implementation gave it.
pub trait ReplicaIo: Send + Sync + 'static {
    /// Runs `op` on the copy at `at`. An [`ExtentOp::Free`] is never sent by the owner (it
    /// releases a slab with the fenced [`ExtentOp::Release`]).
    fn call(
        &self,
        at: ExtentLoc,
        op: ExtentOp,
    ) -> impl Future<Output = Result<ExtentReply, ReplicaError>> + Send;
}

/// A change to one slab's record in the control plane (a compare-and-swap there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlabChange {
    /// Set the state of the extent on `drive`, if it is currently in one of `from`.
    /// `min_replicas`: the slab's, for the record's `holds_acked` marks (docs/adr/0014).
    State {
        drive: DriveId,
        from: Vec<ExtentState>,
        to: ExtentState,
        min_replicas: usize,
    },
    /// Make the stale (or syncing) copy on `drive` in sync and every in-sync copy stale: a mirror slab
    /// whose in-sync copies are all away is served from a stale copy that holds every
    /// acked write. The control plane refuses it (nothing changes) unless its record marks
    /// that copy so (docs/adr/0014).
    Promote { drive: DriveId },
    /// Replace the extent on `old` (if still there) by `new` (rebuild elsewhere).
    Replace { old: DriveId, new: ExtentLoc },
    /// Add `new` beside the others, if no extent of the slab is on its node (an
    /// evacuation's new copy).
    Add { new: ExtentLoc },
    /// Remove the extent on `drive`, if at least `keep` in-sync extents remain without it
    /// (the drop half of an evacuation).
    Remove { drive: DriveId, keep: usize },
}

impl SlabChange {
    /// Applies the change to a slab's extents where its precondition holds; whether
    /// anything changed. Every [`SlabAllocator`] applies changes with this.
    pub fn apply(&self, extents: &mut Vec<ExtentLoc>) -> bool {
        match self {
            SlabChange::State {
                drive, from, to, ..
            } => {
                let mut changed = false;
                for e in extents.iter_mut() {
                    if e.drive == *drive && from.contains(&e.state) && e.state != *to {
                        e.state = *to;
                        changed = true;
                    }
                }
                changed
            }
            SlabChange::Replace { old, new } => {
                let mut changed = false;
                for e in extents.iter_mut() {
                    if e.drive == *old {
                        *e = *new;
                        changed = true;
                    }
                }
                changed
            }
            SlabChange::Promote { drive } => {
                if !extents
                    .iter()
                    .any(|e| e.drive == *drive && e.state != ExtentState::InSync)
                {
                    return false;
                }
                for e in extents.iter_mut() {
                    if e.drive == *drive {
                        e.state = ExtentState::InSync;
                    } else if e.state == ExtentState::InSync {
                        e.state = ExtentState::Stale;
                    }
                }
                true
            }
            SlabChange::Add { new } => {
                if extents.iter().any(|e| e.node == new.node) {
                    return false;
                }
                extents.push(*new);
                true
            }
            SlabChange::Remove { drive, keep } => {
                let staying = extents
                    .iter()
                    .filter(|e| e.drive != *drive && e.state == ExtentState::InSync)
                    .count();
                let before = extents.len();
                if staying >= *keep {
                    extents.retain(|e| e.drive != *drive);
                }
                extents.len() != before
            }
        }
    }
}

/// Places the extents of a slab on first write (thin provisioning). Implemented over etcd
/// by the node; must return the same placement to concurrent callers for the same slab.
pub trait SlabAllocator: Send + Sync + 'static {
    /// Places a new slab's `copies` and records it if it has no record yet (else returns
    /// the record another allocation made). Only the owner at `epoch` may allocate: a
    /// deposed owner gets [`VolumeError::Fenced`].
    /// `thin`: the volume is compressed (placed by extent slots, docs/adr/0010).
    fn allocate(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
        copies: usize,
        thin: bool,
    ) -> impl Future<Output = Result<Vec<ExtentLoc>, VolumeError>> + Send;

    /// The slab's record if it is allocated, asked as the owner at `epoch` (a deposed
    /// owner gets [`VolumeError::Fenced`]). An owner asks before answering a zero of a
    /// slab its own map lacks: another term may have allocated it since.
    fn lookup(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
    ) -> impl Future<Output = Result<Option<Vec<ExtentLoc>>, VolumeError>> + Send;

    /// Applies `change` to the slab's record (atomically, against concurrent changers) and
    /// returns the record's extents afterwards. A change whose precondition no longer holds
    /// is not an error: the current extents are returned and the caller re-checks.
    /// Only the owner at `epoch` may change the record: a deposed owner gets
    /// [`VolumeError::Fenced`].
    fn change(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
        change: SlabChange,
    ) -> impl Future<Output = Result<Vec<ExtentLoc>, VolumeError>> + Send;

    /// Deletes the slabs' records, all or none (thin reclaim: the owner zeroed a slab whole
    /// and frees its copies; a rotation of mirror-accelerated parity: the span's data is in
    /// its parity slab, docs/adr/0009), so a slab reads as never written and its space
    /// counts as free. Only the owner at `epoch` may: a deposed owner gets
    /// [`VolumeError::Fenced`]. A slab with no record is `Ok`.
    fn release(
        &self,
        volume: VolumeId,
        slabs: &[SlabIndex],
        epoch: Epoch,
    ) -> impl Future<Output = Result<(), VolumeError>> + Send;
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error(
        "I/O at offset {offset} length {len} is beyond the end of volume {volume} ({size} bytes)"
    )]
    OutOfRange {
        volume: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("volume {volume}: a read or write of {len} bytes is longer than one request may be ({max} bytes); split it")]
    TooLong { volume: String, len: u64, max: u64 },
    /// No room for the write: its new slab could not be placed, or the drives of its
    /// copies refused it for lack of space. Nothing was acked; the client gets ENOSPC.
    #[error("volume {volume}: no space for the write: {why}")]
    NoSpace { volume: String, why: String },
    /// A new slab could not be placed because nodes that would hold its copies are down
    /// (not for lack of room: with them back it fits). The write waited
    /// `degraded_write_wait` for them and was not acked; a client gets an I/O error, not
    /// ENOSPC.
    #[error(
        "volume {volume}: slab {slab} cannot be placed while nodes are down ({why}); the \
         write was not acked"
    )]
    NodesDown {
        volume: String,
        slab: SlabIndex,
        why: String,
    },
    #[error("volume {volume}: replica on node {node} drive {drive} failed: {error}")]
    Replica {
        volume: String,
        node: NodeId,
        drive: DriveId,
        error: ReplicaError,
    },
    #[error("volume {volume}: no copy of slab {slab} could be read: {why}")]
    Unreadable {
        volume: String,
        slab: SlabIndex,
        why: String,
    },
    #[error("volume {volume}: control plane: {0}", volume = .1)]
    Control(String, String),
    #[error("volume {volume} cannot shrink from {from} to {to} bytes")]
    Shrink { volume: String, from: u64, to: u64 },
    #[error(
        "volume {volume}: slab {slab} has {in_sync} in-sync copies reachable, below min_replicas {min_replicas}; the write was not acked (waiting for copies to return or be rebuilt)"
    )]
    Degraded {
        volume: String,
        slab: SlabIndex,
        in_sync: usize,
        min_replicas: usize,
    },
    #[error("volume {volume}: this node's term (epoch {epoch}) is over: another node took ownership ({why})")]
    Fenced {
        volume: String,
        epoch: Epoch,
        why: String,
    },
    /// A snapshot operation that cannot be done (docs/SNAPSHOTS.md says what is supported).
    #[error("volume {volume}: {why}")]
    Snapshot { volume: String, why: String },
}

impl VolumeError {
    /// The write failed for lack of space (placement, or a drive of a copy), whichever
    /// layer said so: the one test every front end (NBD, vhost, redirected I/O) uses to
    /// answer "no space" rather than an I/O error.
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            VolumeError::NoSpace { .. }
                | VolumeError::Replica {
                    error: ReplicaError::NoSpace(_),
                    ..
                }
        )
    }
}

/// What the owner needs to serve a volume.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    pub id: VolumeId,
    pub name: String,
    pub size_bytes: u64,
    pub slab_size_bytes: u64,
    pub resiliency: Resiliency,
    /// Mirror-accelerated parity (docs/adr/0009): volume bytes the mirror part may hold,
    /// whole extents; 0 for none (and for anything but parity-K+1 or parity-K+2).
    pub mirror_part_bytes: u64,
    /// This owner's term when it took the volume; stamped on every replica request. A
    /// snapshot moves the owner on to the next ([`Volume::epoch`]).
    pub epoch: Epoch,
    /// The node this owner runs on: its extents are read first (data locality).
    pub local_node: NodeId,
    /// In-sync copies a write must reach to be acked.
    pub min_replicas: usize,
    /// How long a write waits for `min_replicas` in-sync copies before failing.
    pub degraded_write_wait: std::time::Duration,
    /// How long a read keeps trying the in-sync copies (with the slab's state read afresh
    /// each round) before it fails: a read rides through the faults a write waits out.
    pub read_wait: std::time::Duration,
    /// A copy that has not answered a read within this long is joined by the next copy
    /// (a hedged read): the first good answer wins, so one hung node costs this much.
    pub read_hedge: std::time::Duration,
    /// This node's right to serve in time (its lease); no I/O is answered past it.
    pub tenure: Arc<Tenure>,
    /// How the copies compress what this owner writes (docs/adr/0010; changed live with
    /// [`Volume::set_compression`]). Mirror volumes only: parity chunks are stored as is.
    pub compression: Compression,
    /// Encryption at rest (docs/adr/0011): the volume's data key. The owner seals what
    /// clients write and opens what they read; the copies only ever hold ciphertext.
    pub cipher: Option<Arc<crypt::VolumeCipher>>,
    /// QoS limits and reservation (changed live with [`Volume::set_qos`]).
    pub qos: converge_types::Qos,
    /// The node's gate for volumes without a reservation (its contention controller
    /// narrows it while a reserved volume falls short); `None`: no such gate.
    pub gate: Option<Arc<qos::SharedGate>>,
}

pub(crate) struct Slab {
    /// The copies and their states; replaced (not mutated) on every state change, so an
    /// I/O works on one consistent snapshot.
    extents: RwLock<Arc<[ExtentLoc]>>,
    /// Sequence within this epoch; the version is `epoch << 32 | seq`, so a new owner's
    /// writes always carry higher versions than anything an older term wrote.
    seq: AtomicU64,
    /// Writes hold it shared while they run; a state change that must see no write in
    /// flight with an older snapshot (stale → syncing) takes it exclusively.
    gate: tokio::sync::RwLock<()>,
    /// Serialises control-plane changes of this slab.
    change: tokio::sync::Mutex<()>,
    /// A write failed on every in-sync copy, so they may disagree on its blocks and none
    /// could be marked stale; the slab is reconciled (like at a takeover) when they answer.
    pub(crate) suspect: std::sync::atomic::AtomicBool,
    /// Copies left `syncing` by a copy job that failed and could not mark them stale (the
    /// control plane was unreachable): no job fills them, so resync takes them up again.
    pub(crate) abandoned: std::sync::Mutex<std::collections::BTreeSet<DriveId>>,
    /// A change of the slab's record failed with no answer from the control plane, so it
    /// may have been applied: `extents` may lag the record until it is read again.
    pub(crate) unsure: std::sync::atomic::AtomicBool,
    /// Released (thin reclaim): its copies are freed and it left the slab map. Whoever
    /// waited on the gate with this handle starts again from the map.
    released: AtomicBool,
    /// Which blocks smaller zeroes (TRIMs of part of the slab) left zero, so that the slab
    /// is released when they add up to all of it: see [`Zeroed`].
    zeroed: Zeroed,
    /// Parity slabs: the rows a write (or a degraded read) is working on; one at a time
    /// per row (docs/adr/0008).
    rows: RowLocks,
    /// Parity slabs: row writes in flight, for the version up to which chunks may drop
    /// their priors (settle).
    row_writes: RowWrites,
    /// Mirror-part slabs: when this owner last wrote it (ms on the volume's clock; 0:
    /// not since it took the volume), for which span a rotation moves first.
    touched_ms: AtomicU64,
}

/// The blocks of a slab known to read zeros since this owner's zeroes, built by TRIMs that
/// cover part of a slab (a guest's `fstrim` sends one range per free extent, each within a
/// file-system block group, often smaller than a slab). It may know fewer blocks than are
/// zero, never more: a write clears its blocks, and a zero marks its blocks only if no write
/// of the slab started while it ran.
#[derive(Default)]
struct Zeroed {
    /// Writes of the slab started (each adds one before it checks `tracking`).
    writes: AtomicU64,
    /// Set once a zero has marked blocks; until then writes skip the lock.
    tracking: AtomicBool,
    /// One bit per block of the slab, allocated by the first zero that marks blocks.
    bits: std::sync::Mutex<Vec<u64>>,
}

impl Zeroed {
    /// A write of blocks `[first, first + n)` is starting (under the slab's gate).
    fn write(&self, first: u64, n: u64) {
        self.writes.fetch_add(1, Ordering::SeqCst);
        if self.tracking.load(Ordering::SeqCst) {
            let mut bits = self.bits.lock().expect("zeroed-blocks lock poisoned");
            set_bits(&mut bits, first, n, false);
        }
    }

    /// A zero of blocks `[first, first + n)` succeeded; `writes_before` is `writes` as it
    /// started. Returns whether every one of the slab's `blocks` is now known zero.
    fn zeroed(&self, first: u64, n: u64, writes_before: u64, blocks: u64) -> bool {
        let mut bits = self.bits.lock().expect("zeroed-blocks lock poisoned");
        self.tracking.store(true, Ordering::SeqCst);
        if self.writes.load(Ordering::SeqCst) != writes_before {
            // A write of the slab ran meanwhile, maybe over these blocks with a later
            // version: mark nothing.
            return false;
        }
        if bits.is_empty() {
            bits.resize(blocks.div_ceil(64) as usize, 0);
        }
        set_bits(&mut bits, first, n, true);
        all_set(&bits, blocks)
    }

    /// Whether every one of `blocks` is known zero.
    fn all(&self, blocks: u64) -> bool {
        all_set(
            &self.bits.lock().expect("zeroed-blocks lock poisoned"),
            blocks,
        )
    }
}

fn set_bits(bits: &mut [u64], first: u64, n: u64, on: bool) {
    for b in first..first + n {
        let Some(w) = bits.get_mut((b / 64) as usize) else {
            return;
        };
        if on {
            *w |= 1 << (b % 64);
        } else {
            *w &= !(1 << (b % 64));
        }
    }
}

fn all_set(bits: &[u64], blocks: u64) -> bool {
    !bits.is_empty() && (0..blocks).all(|b| bits[(b / 64) as usize] & (1 << (b % 64)) != 0)
}

impl Slab {
    /// `seq`: where this incarnation's version sequence starts (above every version an
    /// earlier incarnation of a released slab used in this term).
    fn new(extents: Vec<ExtentLoc>, seq: u64) -> Slab {
        Slab {
            extents: RwLock::new(extents.into()),
            seq: AtomicU64::new(seq),
            gate: tokio::sync::RwLock::new(()),
            change: tokio::sync::Mutex::new(()),
            suspect: std::sync::atomic::AtomicBool::new(false),
            abandoned: std::sync::Mutex::new(std::collections::BTreeSet::new()),
            unsure: std::sync::atomic::AtomicBool::new(false),
            released: AtomicBool::new(false),
            zeroed: Zeroed::default(),
            rows: RowLocks::default(),
            row_writes: RowWrites::default(),
            touched_ms: AtomicU64::new(0),
        }
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    pub(crate) fn extents(&self) -> Arc<[ExtentLoc]> {
        self.extents
            .read()
            .expect("slab extents lock poisoned")
            .clone()
    }

    /// A record change failed: unless the control plane refused it (fenced), it may have
    /// been applied with the answer lost, so the record is read again (`reconcile_suspect`).
    pub(crate) fn note_failed_change(&self, e: &VolumeError) {
        if !matches!(e, VolumeError::Fenced { .. }) {
            self.unsure.store(true, Ordering::Release);
        }
    }

    fn set_extents(&self, v: Vec<ExtentLoc>) {
        *self.extents.write().expect("slab extents lock poisoned") = v.into();
    }

    pub(crate) fn in_sync(&self) -> usize {
        self.extents()
            .iter()
            .filter(|e| e.state == ExtentState::InSync)
            .count()
    }
}

/// One volume served by its owner.
pub struct Volume<R, A> {
    cfg: VolumeConfig,
    size_bytes: AtomicU64,
    slabs: RwLock<BTreeMap<SlabIndex, Arc<Slab>>>,
    alloc_lock: tokio::sync::Mutex<()>,
    /// Held while snapshots are taken or deleted, and while a fill copies a slab's
    /// snapshots into the copy it fills and promotes it (docs/adr/0012, step 4): the
    /// snapshots it copies stay the volume's. Taken before `alloc_lock` and slab gates.
    pub(crate) history: tokio::sync::Mutex<()>,
    /// Serialises read-modify-write of partial blocks (rare: clients that negotiated block
    /// sizes never send them).
    rmw_lock: tokio::sync::Mutex<()>,
    io: Arc<R>,
    alloc: Arc<A>,
    counters: VolumeCounters,
    /// Set when this node stops serving the volume (deposed, moved, deleted, lease lost):
    /// handles still held by clients then fail with [`VolumeError::Fenced`] and re-route.
    retired: AtomicBool,
    /// The codec writes carry ([`Compression::code`]): the config's, until changed live.
    compression: std::sync::atomic::AtomicU8,
    /// QoS: the volume's limits, and its settings as last set.
    limiter: qos::Limiter,
    qos: std::sync::Mutex<converge_types::Qos>,
    /// The settings have a reservation: this volume skips its node's best-effort gate (read
    /// by every I/O, so kept apart from the settings' lock).
    reserved: AtomicBool,
    /// The highest version sequence a released slab used in this term: a slab allocated
    /// afterwards starts above it, so nothing an earlier incarnation sent can outrank it.
    seq_floor: AtomicU64,
    /// Parity volumes: where volume bytes live in a slab's chunks.
    geometry: Option<Geometry>,
    /// Parity volumes: codecs (each keeps its work buffers), taken by one I/O at a time.
    codecs: std::sync::Mutex<Vec<Codec>>,
    /// Parity volumes: rows of held writes in flight, bounded ([`parity_io::HELD_ROWS_IN_FLIGHT`]).
    held_rows: tokio::sync::Semaphore,
    /// Volumes with a mirror part (mirror-accelerated parity).
    map: Option<mirror_part::MirrorPart>,
    /// This owner's term: the config's, until a snapshot moves it on (docs/adr/0012: a
    /// snapshot closes an epoch; the owner goes on in the next).
    epoch: AtomicU64,
    /// The volume's snapshots' epochs, oldest first (new slabs' copies get the newest as
    /// their floor before their first write).
    snapshots: std::sync::Mutex<Vec<Epoch>>,
    /// A clone's parent snapshot: what its never-written blocks read as (docs/adr/0012,
    /// step 5). `None`: not a clone, or flattened.
    parent: std::sync::RwLock<Option<Arc<dyn ParentRead>>>,
}

/// Zero operations a large TRIM or WRITE_ZEROES has in flight at once.
const ZERO_PIECES_IN_FLIGHT: usize = 16;

/// One slab-sized piece of a client request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    slab: SlabIndex,
    /// Offset within the slab.
    offset: u64,
    len: u64,
    /// Offset within the client request.
    at: u64,
}

/// Cuts a request into pieces that each lie within one slab and are at most
/// [`MAX_IO_BYTES`] long, the most one extent operation may cover: a TRIM of 4 GiB, or an
/// unaligned 32 MiB write widened to whole blocks, becomes several operations.
fn split(offset: u64, len: u64, slab_size: u64) -> impl Iterator<Item = Piece> {
    let mut pos = offset;
    let end = offset + len;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let slab = pos / slab_size;
        let in_slab = pos % slab_size;
        let n = (slab_size - in_slab)
            .min(end - pos)
            .min(MAX_IO_BYTES as u64);
        let p = Piece {
            slab: SlabIndex(slab),
            offset: in_slab,
            len: n,
            at: pos - offset,
        };
        pos += n;
        Some(p)
    })
}

/// The copies (or chunks) a write goes to: every one of `extents` that is not stale
/// (`syncing` ones too: a fill copies only what they lack).
pub(crate) fn writable(extents: &[ExtentLoc]) -> Vec<ExtentLoc> {
    extents
        .iter()
        .filter(|e| e.state != ExtentState::Stale)
        .copied()
        .collect()
}

/// crc32c of every block of `data` (a multiple of the block size).
pub fn block_crcs(data: &[u8]) -> Arc<[u32]> {
    data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect()
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    pub fn new(
        cfg: VolumeConfig,
        slabs: BTreeMap<SlabIndex, Vec<ExtentLoc>>,
        io: Arc<R>,
        alloc: Arc<A>,
    ) -> Self {
        assert!(
            cfg.slab_size_bytes >= BS && cfg.slab_size_bytes.is_multiple_of(BS),
            "slab size must be a multiple of the block size"
        );
        let geometry = match cfg.resiliency {
            Resiliency::Parity { data, parity } => Some(
                Geometry::new(data, parity, cfg.slab_size_bytes)
                    .expect("a parity resiliency and a whole-block slab size make a geometry"),
            ),
            _ => None,
        };
        let slabs = slabs
            .into_iter()
            .map(|(i, extents)| (i, Arc::new(Slab::new(extents, 0))))
            .collect();
        let map = (cfg.mirror_part_bytes > 0 && cfg.resiliency.mirror_part().is_some())
            .then(|| mirror_part::MirrorPart::new(cfg.mirror_part_bytes));
        let cfg_epoch = cfg.epoch;
        Volume {
            map,
            geometry,
            codecs: std::sync::Mutex::new(Vec::new()),
            held_rows: tokio::sync::Semaphore::new(parity_io::HELD_ROWS_IN_FLIGHT),
            size_bytes: AtomicU64::new(cfg.size_bytes),
            compression: std::sync::atomic::AtomicU8::new(cfg.compression.code()),
            limiter: qos::Limiter::new(&cfg.qos),
            qos: std::sync::Mutex::new(cfg.qos),
            reserved: AtomicBool::new(cfg.qos.iops_reserve.is_some()),
            cfg,
            slabs: RwLock::new(slabs),
            alloc_lock: tokio::sync::Mutex::new(()),
            history: tokio::sync::Mutex::new(()),
            rmw_lock: tokio::sync::Mutex::new(()),
            io,
            alloc,
            counters: VolumeCounters::default(),
            retired: AtomicBool::new(false),
            seq_floor: AtomicU64::new(0),
            epoch: AtomicU64::new(cfg_epoch.0),
            snapshots: std::sync::Mutex::new(Vec::new()),
            parent: std::sync::RwLock::new(None),
        }
    }

    /// This owner's current term, stamped on every replica request.
    pub fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    /// Stops serving: every later request (and every one in flight, before it answers)
    /// fails with [`VolumeError::Fenced`], so clients look the owner up again.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// How the copies compress this owner's writes, resyncs and repairs: the volume's
    /// setting for a mirror (or simple) volume, none for parity (chunks are stored as is).
    pub fn compression(&self) -> Compression {
        if self.geometry.is_some() {
            return Compression::None;
        }
        Compression::from_code(self.compression.load(Ordering::Relaxed)).unwrap_or_default()
    }

    /// Changes how later writes are compressed (what is stored keeps its form until it is
    /// written again).
    pub fn set_compression(&self, c: Compression) {
        self.compression.store(c.code(), Ordering::Relaxed);
    }

    /// The QoS settings in force.
    pub fn qos(&self) -> converge_types::Qos {
        *self.qos.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// New QoS settings, in force for the next I/O.
    pub fn set_qos(&self, q: converge_types::Qos) {
        self.limiter.set(&q);
        self.reserved
            .store(q.iops_reserve.is_some(), Ordering::Relaxed);
        *self.qos.lock().unwrap_or_else(|p| p.into_inner()) = q;
    }

    /// Waits for a client I/O's turn: the volume's own limits, then, for a volume without a
    /// reservation, its node's best-effort gate.
    async fn admit(&self, bytes: u64) {
        let mut waited = self.limiter.admit(bytes).await;
        if let Some(g) = &self.cfg.gate {
            if !self.reserved.load(Ordering::Relaxed) {
                waited += g.admit().await;
            }
        }
        if !waited.is_zero() {
            let c = &self.counters;
            c.qos_throttled.fetch_add(1, Ordering::Relaxed);
            c.qos_waited_us
                .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        }
    }

    /// Whether this owner may answer a client now: not retired, and its tenure (lease)
    /// holds. Checked before a request starts and again before it answers, so no answer
    /// leaves after the lease could have expired (a read answered then could be older
    /// than a write a new owner has acked).
    fn check_serving(&self) -> Result<(), VolumeError> {
        if self.is_retired() {
            return Err(self.fenced("this node no longer serves the volume".into()));
        }
        if !self.cfg.tenure.holds() {
            return Err(self.fenced(
                "this node's lease is not confirmed by the control plane and may have expired"
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn config(&self) -> &VolumeConfig {
        &self.cfg
    }

    /// Volume bytes one slab holds: the extent size, times the data chunks of a parity
    /// slab.
    pub fn slab_span(&self) -> u64 {
        self.cfg.resiliency.slab_span(self.cfg.slab_size_bytes)
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Grow the volume. Shrinking is refused: it would drop data a VM may still use.
    pub fn grow(&self, new_size: u64) -> Result<(), VolumeError> {
        let cur = self.size_bytes();
        if new_size < cur {
            return Err(VolumeError::Shrink {
                volume: self.cfg.name.clone(),
                from: cur,
                to: new_size,
            });
        }
        self.size_bytes.store(new_size, Ordering::Release);
        Ok(())
    }

    pub fn stats(&self) -> VolumeStats {
        self.counters.snapshot()
    }

    /// The extents of every allocated slab, as this owner knows them.
    pub fn slab_map(&self) -> BTreeMap<SlabIndex, Vec<ExtentLoc>> {
        self.slabs
            .read()
            .expect("slab map lock poisoned")
            .iter()
            .map(|(i, s)| (*i, s.extents().to_vec()))
            .collect()
    }

    /// A read or write longer than [`MAX_IO_BYTES`] is refused before anything is allocated
    /// for it (its length may come from a peer's request).
    fn check_len(&self, len: u64) -> Result<(), VolumeError> {
        if len > MAX_IO_BYTES as u64 {
            return Err(VolumeError::TooLong {
                volume: self.cfg.name.clone(),
                len,
                max: MAX_IO_BYTES as u64,
            });
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        let size = self.size_bytes();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(VolumeError::OutOfRange {
                volume: self.cfg.name.clone(),
                offset,
                len,
                size,
            }),
        }
    }

    pub(crate) fn slab(&self, idx: SlabIndex) -> Option<Arc<Slab>> {
        self.slabs
            .read()
            .expect("slab map lock poisoned")
            .get(&idx)
            .cloned()
    }

    async fn slab_or_allocate(&self, idx: SlabIndex) -> Result<Arc<Slab>, VolumeError> {
        if let Some(s) = self.slab(idx) {
            return Ok(s);
        }
        let _g = self.alloc_lock.lock().await;
        if let Some(s) = self.slab(idx) {
            return Ok(s);
        }
        self.allocate_locked(idx).await
    }

    /// Places slab `idx` (its copies or chunks) and takes it up. The caller holds
    /// `alloc_lock`.
    async fn allocate_locked(&self, idx: SlabIndex) -> Result<Arc<Slab>, VolumeError> {
        let copies = self.cfg.resiliency.of_slab(idx).copies();
        // Nodes down (a restart): wait for them as a degraded write waits for its copies.
        let deadline = Instant::now() + self.cfg.degraded_write_wait;
        let extents = loop {
            let r = self
                .alloc
                .allocate(
                    self.cfg.id,
                    idx,
                    self.epoch(),
                    copies,
                    !self.compression().is_none(),
                )
                .await;
            // The allocator knows the volume by id; the client and the log by name.
            let volume = self.cfg.name.clone();
            match r {
                Ok(e) => break e,
                Err(VolumeError::NodesDown { slab, why, .. }) if Instant::now() < deadline => {
                    log::debug!("volume {volume}: slab {slab} waits for nodes: {why}");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(VolumeError::NodesDown { slab, why, .. }) => {
                    return Err(VolumeError::NodesDown { volume, slab, why })
                }
                Err(VolumeError::NoSpace { why, .. }) => {
                    return Err(VolumeError::NoSpace { volume, why })
                }
                Err(e) => return Err(e),
            }
        };
        self.floor_new_slab(idx, &extents).await;
        self.adopt(idx, extents).await
    }

    /// Zeroes every block of the slab on each copy that is not stale, at one new version,
    /// which it returns (settled like a write). The caller holds the slab's gate.
    async fn zero_whole(&self, idx: SlabIndex, slab: &Slab) -> Result<Version, VolumeError> {
        let version = self.next_version(slab);
        let key = self.key(idx);
        let epoch = self.epoch();
        let size = self.cfg.slab_size_bytes;
        let targets = writable(&slab.extents());
        self.replicate(idx, slab, targets, |at| async move {
            // One operation covers at most MAX_IO_BYTES.
            let mut off = 0;
            while off < size {
                let len = (size - off).min(MAX_IO_BYTES as u64);
                let op = ExtentOp::Zero {
                    key,
                    epoch,
                    version,
                    offset: off,
                    len,
                };
                self.ask(at, op, ExtentReply::into_ok).await?;
                off += len;
            }
            Ok(())
        })
        .await?;
        Ok(version)
    }

    fn next_version(&self, slab: &Slab) -> Version {
        let seq = slab.seq.fetch_add(1, Ordering::Relaxed) + 1;
        assert!(seq < 1 << 32, "version sequence exhausted within one epoch");
        Version(self.epoch().0 << 32 | seq)
    }

    /// In-sync copies a write of slab `idx` must reach (a mirror-part slab's own count).
    fn min_replicas_of(&self, idx: SlabIndex) -> usize {
        self.cfg
            .resiliency
            .min_replicas_of_slab(idx, self.cfg.min_replicas)
    }

    /// Where volume bytes live in slab `idx`'s chunks, if it is a parity slab.
    pub(crate) fn geometry_of(&self, idx: SlabIndex) -> Option<Geometry> {
        if idx.is_mirror_part() {
            None
        } else {
            self.geometry
        }
    }

    pub(crate) fn key(&self, slab: SlabIndex) -> ExtentKey {
        ExtentKey {
            volume: self.cfg.id,
            slab,
        }
    }

    /// Client write. Acked (returns Ok) only when every copy has made it durable.
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<(), VolumeError> {
        let start = Instant::now();
        let len = data.len() as u64;
        self.check_len(len)?;
        self.check_range(offset, len)?;
        self.check_serving()?;
        self.admit(len).await;
        self.check_serving()?;
        let r = if offset.is_multiple_of(BS) && len.is_multiple_of(BS) {
            let data = match &self.cfg.cipher {
                Some(c) => {
                    let mut buf = BytesMut::from(&data[..]);
                    c.seal(offset / BS, &mut buf);
                    buf.freeze()
                }
                None => data,
            };
            self.write_aligned(offset, data).await
        } else {
            self.write_unaligned(offset, data).await
        }
        .and_then(|()| self.check_serving());
        self.account(&r, start, true, len);
        r
    }

    fn account<T>(&self, r: &Result<T, VolumeError>, start: Instant, write: bool, len: u64) {
        let c = &self.counters;
        if let Err(e) = r {
            c.errors.fetch_add(1, Ordering::Relaxed);
            if e.is_no_space() {
                c.no_space_errors.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let us = start.elapsed().as_micros() as u64;
        if write {
            c.write_ops.fetch_add(1, Ordering::Relaxed);
            c.write_bytes.fetch_add(len, Ordering::Relaxed);
            c.write_latency.record_us(us);
        } else {
            c.read_ops.fetch_add(1, Ordering::Relaxed);
            c.read_bytes.fetch_add(len, Ordering::Relaxed);
            c.read_latency.record_us(us);
        }
    }

    async fn write_aligned(&self, offset: u64, data: Bytes) -> Result<(), VolumeError> {
        let pieces: Vec<Piece> = split(offset, data.len() as u64, self.slab_span()).collect();
        if pieces.len() == 1 {
            return self.write_piece(pieces[0], data).await;
        }
        let mut tasks = Vec::with_capacity(pieces.len());
        for p in pieces {
            let part = data.slice(p.at as usize..(p.at + p.len) as usize);
            tasks.push(self.write_piece(p, part));
        }
        join_all_ok(tasks).await
    }

    async fn write_piece(&self, p: Piece, data: Bytes) -> Result<(), VolumeError> {
        if let Some(g) = self.geometry {
            if self.map.is_some() {
                return self.map_write_piece(g, p, data).await;
            }
            return self.parity_write_piece(g, p, data).await;
        }
        self.mirror_write_piece(p, data).await.map(|_| ())
    }

    /// A write within one mirror slab; the slab it went to.
    async fn mirror_write_piece(&self, p: Piece, data: Bytes) -> Result<Arc<Slab>, VolumeError> {
        loop {
            let slab = self.slab_or_allocate(p.slab).await?;
            self.wait_min_replicas(p.slab, &slab).await?;
            let _gate = slab.gate.read().await;
            // A snapshot may have ended this owner's serving while the write waited for
            // the gate (`Volume::snapshot`): it must not write at that epoch any more.
            self.check_serving()?;
            if slab.is_released() {
                // A TRIM released it while this write waited: the next one is allocated.
                continue;
            }
            self.write_gated(&slab, p, data).await?;
            return Ok(slab.clone());
        }
    }

    /// A mirror write of piece `p` with the slab's gate already held by the caller.
    pub(crate) async fn write_gated(
        &self,
        slab: &Slab,
        p: Piece,
        data: Bytes,
    ) -> Result<(), VolumeError> {
        slab.zeroed.write(p.offset / BS, p.len.div_ceil(BS));
        let extents = slab.extents();
        let version = self.next_version(slab);
        let crcs = block_crcs(&data);
        let key = self.key(p.slab);
        let epoch = self.epoch();
        self.replicate(p.slab, slab, writable(&extents), |at| {
            let op = ExtentOp::Write {
                key,
                epoch,
                version,
                offset: p.offset,
                crcs: crcs.clone(),
                data: data.clone(),
                codec: self.compression(),
            };
            self.ask(at, op, ExtentReply::into_ok)
        })
        .await
    }

    /// Runs `op` on the copy at `at` and unpacks the answer with `unpack` (the
    /// `ExtentReply::into_*` of the kind of answer `op` gets). The answer is checked against
    /// the operation first, whichever path it took, so the owner may index what it got.
    pub(crate) async fn ask<T>(
        &self,
        at: ExtentLoc,
        op: ExtentOp,
        unpack: fn(ExtentReply) -> Option<T>,
    ) -> Result<T, ReplicaError> {
        let shape = op.reply_shape();
        let what = op.name();
        let reply = self.io.call(at, op).await?;
        if let Err(e) = shape.check(&reply) {
            return Err(ReplicaError::Io(format!(
                "node {} drive {}: {what} {e}",
                at.node, at.drive
            )));
        }
        Ok(unpack(reply).expect("the answer fits its operation (checked), so unpacks as its kind"))
    }

    /// Runs `op` on every target copy in parallel and settles the outcome. While fewer
    /// than `min_replicas` in-sync copies succeeded, the copies that failed are retried
    /// (the same version: idempotent) until `degraded_write_wait` — a slow or briefly
    /// unreachable copy does not fail the write. A copy whose drive has no room is not
    /// retried: space does not come back in a moment, and the client is owed a prompt
    /// "no space" (a VM may pause on it, an application free space and retry).
    async fn replicate<F, Fut>(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        targets: Vec<ExtentLoc>,
        op: F,
    ) -> Result<(), VolumeError>
    where
        F: Fn(ExtentLoc) -> Fut,
        Fut: Future<Output = Result<(), ReplicaError>>,
    {
        let deadline = Instant::now() + self.cfg.degraded_write_wait;
        let mut pending = targets;
        let mut ok_in_sync = 0;
        // Every copy the operation reached, whatever its state then: whether it counts
        // toward the ack is decided against the record when the operation settles.
        let mut held: Vec<DriveId> = Vec::with_capacity(pending.len());
        // Copies that failed and are not tried again: they are marked stale when the
        // operation settles, however the retries go. (A `syncing` copy whose write failed
        // must not be forgotten: its copy job may make it `in-sync` before this settles.)
        let mut given_up: Vec<(ExtentLoc, ReplicaError)> = Vec::new();
        loop {
            let results = join_all(
                pending
                    .iter()
                    .map(|&at| {
                        let f = op(at);
                        async move { (at, f.await) }
                    })
                    .collect(),
            )
            .await;
            let mut failed = Vec::new();
            for (at, r) in results {
                match r {
                    Ok(()) => {
                        held.push(at.drive);
                        if at.state == ExtentState::InSync {
                            ok_in_sync += 1;
                        }
                    }
                    Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                    Err(e) => failed.push((at, e)),
                }
            }
            let in_sync_failed = failed
                .iter()
                .any(|(at, e)| at.state == ExtentState::InSync && retryable(e));
            if failed.is_empty()
                || ok_in_sync >= self.min_replicas_of(idx)
                || !in_sync_failed
                || Instant::now() >= deadline
            {
                failed.append(&mut given_up);
                return self.settle(idx, slab, &held, failed).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            // Retry only in-sync copies still in sync (one marked stale meanwhile is out).
            let now = slab.extents();
            let (retry, rest): (Vec<_>, Vec<_>) = failed.into_iter().partition(|(at, e)| {
                at.state == ExtentState::InSync
                    && retryable(e)
                    && now
                        .iter()
                        .any(|e| e.drive == at.drive && e.state == ExtentState::InSync)
            });
            given_up.extend(rest);
            pending = retry.into_iter().map(|(at, _)| at).collect();
        }
    }

    /// Decides a replicated operation's outcome from every copy's answer: copies that
    /// failed are marked stale in the control plane *before* anything is acked; the
    /// operation is acked if at least `min_replicas` copies that made it durable are in
    /// sync in the record *now*. A copy that was in sync when the operation started but
    /// was marked stale meanwhile (another write failed on it) does not count: once the
    /// slab is below `min_replicas`, only the copies marked as holding every acked write
    /// may be promoted if the rest are lost (ADR 0014), and this write must not depend
    /// on a copy nobody will trust.
    async fn settle(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        held: &[DriveId],
        failed: Vec<(ExtentLoc, ReplicaError)>,
    ) -> Result<(), VolumeError> {
        let in_sync_holding = |slab: &Slab| {
            slab.extents()
                .iter()
                .filter(|e| e.state == ExtentState::InSync && held.contains(&e.drive))
                .count()
        };
        if in_sync_holding(slab) == 0 && !failed.is_empty() {
            // No in-sync copy is known to hold this write, and some may: marking them all
            // stale would leave no copy to read or resync from. Keep them in sync, fail the
            // write, and make them agree as soon as they answer.
            slab.suspect.store(true, Ordering::Release);
            log::warn!(
                "volume {}: slab {idx}: a write failed on every in-sync copy ({}); the slab will be reconciled",
                self.cfg.name,
                failed[0].1
            );
        } else {
            for (at, e) in &failed {
                log::warn!(
                    "volume {}: slab {} copy on node {} drive {} failed ({e}); marking it stale",
                    self.cfg.name,
                    idx,
                    at.node,
                    at.drive
                );
                self.mark_stale(idx, slab, at.drive).await?;
                self.counters
                    .extents_marked_stale
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let ok_in_sync = in_sync_holding(slab);
        if ok_in_sync < self.min_replicas_of(idx) {
            // Short of copies because drives had no room: the client is told so.
            if let Some((at, e)) = failed
                .iter()
                .find(|(_, e)| matches!(e, ReplicaError::NoSpace(_)))
            {
                return Err(VolumeError::NoSpace {
                    volume: self.cfg.name.clone(),
                    why: format!(
                        "slab {idx}: the drive of its copy on node {} ({}) has no room: {e}",
                        at.node, at.drive
                    ),
                });
            }
            return Err(VolumeError::Degraded {
                volume: self.cfg.name.clone(),
                slab: idx,
                in_sync: ok_in_sync,
                min_replicas: self.min_replicas_of(idx),
            });
        }
        Ok(())
    }

    fn fenced(&self, why: String) -> VolumeError {
        VolumeError::Fenced {
            volume: self.cfg.name.clone(),
            epoch: self.epoch(),
            why,
        }
    }

    /// Below `min_replicas` in-sync copies a write waits (bounded) for resync or rebuild to
    /// bring copies back, then fails: nothing is acked on fewer copies than the policy says.
    async fn wait_min_replicas(&self, idx: SlabIndex, slab: &Slab) -> Result<(), VolumeError> {
        if slab.in_sync() >= self.min_replicas_of(idx) {
            return Ok(());
        }
        let deadline = Instant::now() + self.cfg.degraded_write_wait;
        loop {
            let n = slab.in_sync();
            if n >= self.min_replicas_of(idx) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(VolumeError::Degraded {
                    volume: self.cfg.name.clone(),
                    slab: idx,
                    in_sync: n,
                    min_replicas: self.min_replicas_of(idx),
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Marks the copy on `drive` stale (in the control plane first, then in memory).
    pub(crate) async fn mark_stale(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
    ) -> Result<(), VolumeError> {
        self.change_state(
            idx,
            slab,
            drive,
            &[ExtentState::InSync, ExtentState::Syncing],
            ExtentState::Stale,
        )
        .await
    }

    /// Changes one copy's state through the control plane and adopts the record's
    /// extents; a no-op if the copy is not in one of `from` (any more).
    pub(crate) async fn change_state(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        from: &[ExtentState],
        to: ExtentState,
    ) -> Result<(), VolumeError> {
        let _c = slab.change.lock().await;
        let current = slab.extents();
        if !current
            .iter()
            .any(|e| e.drive == drive && from.contains(&e.state))
        {
            return Ok(());
        }
        if let (None, ExtentState::Stale) = (self.geometry_of(idx), to) {
            // A mirror's last in-sync copy stays so, whoever asks (the repair policy marks
            // the copies of a node that went down): with none in sync, no copy could be
            // resynced or rebuilt from any other, even once every node is back. It stays in
            // sync, out of reach: I/O waits for it (`settle`, `fence_and_compare`).
            let leaving = current
                .iter()
                .any(|e| e.drive == drive && e.state == ExtentState::InSync);
            let staying = current
                .iter()
                .any(|e| e.drive != drive && e.state == ExtentState::InSync);
            if leaving && !staying {
                return Err(self.copy_error(
                    idx,
                    format!(
                        "the copy on drive {drive} is the slab's last in-sync copy and stays so"
                    ),
                ));
            }
        }
        if let (Some(g), ExtentState::Stale) = (self.geometry_of(idx), to) {
            // A parity slab keeps K chunks in sync, as a mirror keeps its last in-sync copy
            // (above): below K no chunk can be resynced or rebuilt
            // (each is filled from K others) and none could ever come back, even once every
            // chunk's node does. Such a chunk stays in sync, out of reach: I/O waits for it.
            let leaving = current
                .iter()
                .any(|e| e.drive == drive && e.state == ExtentState::InSync);
            let staying = current
                .iter()
                .filter(|e| e.drive != drive && e.state == ExtentState::InSync)
                .count();
            if leaving && staying < usize::from(g.k()) {
                return Err(self.copy_error(
                    idx,
                    format!(
                        "the chunk on drive {drive} stays in sync: without it {staying} chunks are, and {} are needed to bring any back",
                        g.k()
                    ),
                ));
            }
        }
        self.apply_change(
            idx,
            slab,
            SlabChange::State {
                drive,
                from: from.to_vec(),
                to,
                min_replicas: self.min_replicas_of(idx),
            },
        )
        .await
    }

    /// Applies `change` to the slab's record through the control plane and adopts the
    /// extents it answers with. The caller holds `slab.change`.
    pub(crate) async fn apply_change(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        change: SlabChange,
    ) -> Result<(), VolumeError> {
        let extents = self
            .alloc
            .change(self.cfg.id, idx, self.epoch(), change)
            .await
            .inspect_err(|e| slab.note_failed_change(e))?;
        slab.set_extents(extents);
        Ok(())
    }

    /// Partial blocks: read the covering blocks, patch, write back whole blocks.
    async fn write_unaligned(&self, offset: u64, data: Bytes) -> Result<(), VolumeError> {
        let _g = self.rmw_lock.lock().await;
        let start = offset / BS * BS;
        let end = (offset + data.len() as u64).div_ceil(BS) * BS;
        let mut buf = BytesMut::from(&self.read_inner(start, end - start).await?[..]);
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(&data);
        if let Some(c) = &self.cfg.cipher {
            c.seal(start / BS, &mut buf);
        }
        self.write_aligned(start, buf.freeze()).await
    }

    /// Client read. Never returns a block whose checksum failed: bad blocks are read from
    /// another copy and rewritten on the bad one.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let start = Instant::now();
        self.check_len(len)?;
        self.check_range(offset, len)?;
        self.check_serving()?;
        self.admit(len).await;
        self.check_serving()?;
        let r = match self.read_inner(offset, len).await {
            Ok(data) => self.check_serving().map(|()| data),
            Err(e) => Err(e),
        };
        self.account(&r, start, false, len);
        r
    }

    /// Which parts of `[offset, offset + len)` may hold data, slab by slab: runs of
    /// `(length, allocated)` covering the range, neighbours of one kind merged. A slab never
    /// written (thin provisioning: no record) reads as zeros and is not allocated; an
    /// allocated slab counts as data throughout, even where its blocks read as zeros.
    /// Answered from this owner's slab map, as a read of such a slab is (and, like a read,
    /// only while this node serves the volume).
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, VolumeError> {
        self.check_range(offset, len)?;
        self.check_serving()?;
        if self.parent().is_some() {
            // A clone's unwritten slabs read as its parent: data, as far as it knows.
            return Ok(vec![(len, true)]);
        }
        let mut runs: Vec<(u64, bool)> = Vec::new();
        for p in split(offset, len, self.slab_span()) {
            let parts = if self.map.is_some() {
                self.map_allocated(p)
            } else {
                vec![(p.len, self.slab(p.slab).is_some())]
            };
            for (n_bytes, allocated) in parts {
                match runs.last_mut() {
                    Some((n, a)) if *a == allocated => *n += n_bytes,
                    _ => runs.push((n_bytes, allocated)),
                }
            }
        }
        self.check_serving()?;
        Ok(runs)
    }

    /// What clients read: whole blocks fetched, opened when the volume is encrypted, and
    /// cut to the range.
    async fn read_inner(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        // Widen to whole blocks; replicas only deal in blocks.
        let a_start = offset / BS * BS;
        let a_end = (offset + len).div_ceil(BS) * BS;
        let slab = self.slab_span();
        let whole =
            if a_start / slab == (a_end - 1) / slab && a_end - a_start <= MAX_IO_BYTES as u64 {
                // One piece (nearly every read): no list of pieces.
                let mut one = split(a_start, a_end - a_start, slab);
                let p = one.next().expect("a non-empty range has a piece");
                self.read_piece(p).await?
            } else {
                let pieces: Vec<Piece> = split(a_start, a_end - a_start, slab).collect();
                let parts = join_all_ok_vec(pieces.iter().map(|p| self.read_piece(*p))).await?;
                let mut buf = BytesMut::with_capacity((a_end - a_start) as usize);
                for part in parts {
                    buf.extend_from_slice(&part);
                }
                buf.freeze()
            };
        let whole = match &self.cfg.cipher {
            Some(c) => {
                let mut buf = BytesMut::from(&whole[..]);
                c.open(a_start / BS, &mut buf);
                buf.freeze()
            }
            None => whole,
        };
        let skip = (offset - a_start) as usize;
        Ok(whole.slice(skip..skip + len as usize))
    }

    /// Copies to read from, best first: in-sync only, the local node's first.
    fn read_order(&self, slab: &Slab) -> Vec<ExtentLoc> {
        let mut v: Vec<ExtentLoc> = slab
            .extents()
            .iter()
            .filter(|e| e.state == ExtentState::InSync)
            .copied()
            .collect();
        v.sort_by_key(|e| e.node != self.cfg.local_node);
        v
    }

    /// Reads one piece of a slab. Each round takes the slab's extents afresh; a round in
    /// which no copy (or, for parity, not enough chunks) could answer is tried again, with
    /// a growing pause, until `read_wait`. A read fails only when nothing answered within
    /// it, or when a block is bad everywhere it could come from.
    async fn read_piece(&self, p: Piece) -> Result<Bytes, VolumeError> {
        match self.geometry {
            Some(g) if self.map.is_some() => self.map_read_piece(g, p).await,
            Some(g) => self.parity_read_piece(g, p).await,
            None => self.mirror_read_piece(p).await,
        }
    }

    async fn parity_read_piece(&self, g: Geometry, p: Piece) -> Result<Bytes, VolumeError> {
        // Each round takes the slab afresh: a TRIM may release it meanwhile (it reads
        // as zeros from then on), and a write take it up again, a new incarnation
        // whose chunks may be on the same drives in other places of the row.
        self.read_with_retries(p.slab, || async move {
            match self.slab(p.slab) {
                Some(slab) => self.parity_read_round(g, p, &slab).await,
                None => Ok(Bytes::from(vec![0u8; p.len as usize])),
            }
        })
        .await
    }

    async fn mirror_read_piece(&self, p: Piece) -> Result<Bytes, VolumeError> {
        if let Some(parent) = self.parent() {
            return self.clone_read_piece(&parent, p, None).await;
        }
        let Some(slab) = self.slab(p.slab) else {
            // Never written: thin provisioning reads zeros.
            return Ok(Bytes::from(vec![0u8; p.len as usize]));
        };
        self.read_with_retries(p.slab, || self.mirror_read_round(p, &slab))
            .await
    }

    /// Runs rounds of a read until one answers, one fails for good, or `read_wait` is over.
    pub(crate) async fn read_with_retries<T, F, Fut>(
        &self,
        idx: SlabIndex,
        mut round: F,
    ) -> Result<T, VolumeError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Retry>>,
    {
        let started = Instant::now();
        let deadline = started + self.cfg.read_wait;
        let mut pause = std::time::Duration::from_millis(20);
        loop {
            let why = match round().await {
                Ok(v) => return Ok(v),
                Err(Retry::Fail(e)) => return Err(e),
                Err(Retry::Again(why)) => why,
            };
            // A lost lease or a retired term ends the retries with the error that makes
            // the client (or the node forwarding to us) re-route to the new owner, never
            // an I/O error: a partitioned owner's read must not fail what the next owner
            // can serve (thrash seed 2001: a parity owner cut off from its chunks).
            self.check_serving()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(VolumeError::Unreadable {
                    volume: self.cfg.name.clone(),
                    slab: idx,
                    why: format!(
                        "{why} (kept trying for {} ms)",
                        now.duration_since(started).as_millis()
                    ),
                });
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(500));
            self.check_serving()?;
        }
    }

    /// One round of a mirror read: the in-sync copies, this node's first, hedged; bad
    /// blocks are read from the others and repaired.
    async fn mirror_read_round(&self, p: Piece, slab: &Slab) -> Result<Bytes, Retry> {
        let order = self.read_order(slab);
        if order.is_empty() {
            return Err(Retry::Again("no in-sync copy".into()));
        }
        match self.read_hedged(p, &order).await {
            // The copy that answered left the slab meanwhile (an evacuation dropped it, and
            // its extent may have been freed before the read ran there): its answer may be
            // zeros, so it is not used.
            Ok((i, _)) if !slab.extents().iter().any(|e| e.drive == order[i].drive) => {
                Err(Retry::Again(format!(
                    "the copy on drive {} left the slab",
                    order[i].drive
                )))
            }
            Ok((_, reply)) if reply.bad_blocks.is_empty() && reply.suspect.is_empty() => {
                Ok(reply.data)
            }
            Ok((i, reply)) => {
                let others: Vec<ExtentLoc> = order
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, e)| *e)
                    .collect();
                match self.repair(p, order[i], reply, &others).await {
                    Ok(data) => Ok(data),
                    Err(RepairFailed::Lost(e)) => Err(Retry::Fail(e)),
                    Err(RepairFailed::Unavailable(why)) => Err(Retry::Again(why)),
                }
            }
            Err(ReadFailed::Fenced(why)) => Err(Retry::Fail(self.fenced(why))),
            Err(ReadFailed::All(why)) => Err(Retry::Again(why)),
        }
    }

    /// One round of a read over `order` (best first): asks the first copy; when it fails,
    /// or has not answered within `read_hedge`, asks the next one too. The first answer
    /// wins (the others are abandoned: reads change nothing).
    async fn read_hedged(
        &self,
        p: Piece,
        order: &[ExtentLoc],
    ) -> Result<(usize, ReadReply), ReadFailed> {
        use std::task::Poll;
        enum Event {
            Answer(usize, Result<ReadReply, ReplicaError>),
            Hedge,
        }
        let key = self.key(p.slab);
        let epoch = self.epoch();
        let read = |at: ExtentLoc| {
            let op = ExtentOp::Read {
                key,
                epoch,
                offset: p.offset,
                len: p.len as u32,
            };
            self.ask(at, op, ExtentReply::into_read)
        };
        // The usual case — the first copy answers — needs no allocation, nor a timer: the
        // hedge timer starts when the first copy has not answered at once.
        let mut first = Some(std::pin::pin!(read(order[0])));
        let mut more = hedge_set(&read);
        let mut next = 1;
        let mut errors: Vec<String> = Vec::new();
        let hedge_after = self.cfg.read_hedge;
        let mut hedge: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        loop {
            let event = std::future::poll_fn(|cx| {
                if let Some(f) = first.as_mut() {
                    if let Poll::Ready(r) = f.as_mut().poll(cx) {
                        return Poll::Ready(Event::Answer(0, r));
                    }
                }
                for (k, (i, f)) in more.iter_mut().enumerate() {
                    if let Poll::Ready(r) = f.as_mut().poll(cx) {
                        let i = *i;
                        drop(more.swap_remove(k));
                        return Poll::Ready(Event::Answer(i, r));
                    }
                }
                if next < order.len() {
                    let h = hedge.get_or_insert_with(|| Box::pin(tokio::time::sleep(hedge_after)));
                    if h.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Event::Hedge);
                    }
                }
                Poll::Pending
            })
            .await;
            let launch = match event {
                Event::Answer(i, Ok(reply)) => return Ok((i, reply)),
                Event::Answer(_, Err(ReplicaError::StaleEpoch(why))) => {
                    return Err(ReadFailed::Fenced(why))
                }
                Event::Answer(i, Err(e)) => {
                    if i == 0 {
                        first = None;
                    }
                    let at = order[i];
                    log::warn!(
                        "volume {}: read of slab {} from node {} drive {} failed: {e}; trying another copy",
                        self.cfg.name, p.slab, at.node, at.drive
                    );
                    errors.push(format!("node {} drive {}: {e}", at.node, at.drive));
                    true
                }
                Event::Hedge => true,
            };
            if launch && next < order.len() {
                more.push((next, Box::pin(read(order[next]))));
                next += 1;
                if let Some(h) = hedge.as_mut() {
                    h.as_mut().reset(Instant::now() + self.cfg.read_hedge);
                }
            }
            if first.is_none() && more.is_empty() && next >= order.len() {
                return Err(ReadFailed::All(errors.join("; ")));
            }
        }
    }

    /// Replaces each bad block of `reply` with a good copy's, and rewrites it on `bad_at`.
    ///
    /// A *suspect* block of `reply` (its replica's recovery rolled it back after a power
    /// loss; docs/FORMAT-engine.md, "Recovery") reads soundly but may be older than an acked
    /// write, so it is checked the same way: the first other copy holding the block neither
    /// bad nor suspect gives it. Only when every copy answered and none does is a suspect
    /// version served: the newest one any copy holds (a write that every copy's recovery
    /// took back was never acked), and `bad_at` is rewritten with it, which clears its mark.
    async fn repair(
        &self,
        p: Piece,
        bad_at: ExtentLoc,
        reply: ReadReply,
        others: &[ExtentLoc],
    ) -> Result<Bytes, RepairFailed> {
        let key = self.key(p.slab);
        let mut buf = BytesMut::from(&reply.data[..]);
        let mut blocks: Vec<(u32, bool)> = reply.bad_blocks.iter().map(|&b| (b, false)).collect();
        blocks.extend(
            reply
                .suspect
                .iter()
                .filter(|b| !reply.bad_blocks.contains(b))
                .map(|&b| (b, true)),
        );
        let read_one = |at: ExtentLoc, boff: u64| {
            let op = ExtentOp::Read {
                key,
                epoch: self.epoch(),
                offset: boff,
                len: BLOCK_SIZE as u32,
            };
            self.ask(at, op, ExtentReply::into_read)
        };
        for (b, suspect) in blocks {
            let boff = p.offset + b as u64 * BS;
            let mut unanswered = Vec::new();
            // The first intact copy; else the newest sound suspect one (own copy included).
            let mut intact: Option<(ExtentLoc, ReadReply)> = None;
            let mut newest_suspect: Option<(ExtentLoc, ReadReply)> = None;
            let own = suspect.then_some(bad_at);
            for &src in others.iter().chain(own.iter()) {
                let got = match read_one(src, boff).await {
                    Ok(got) => got,
                    Err(ReplicaError::StaleEpoch(why)) => {
                        return Err(RepairFailed::Lost(self.fenced(why)))
                    }
                    Err(e) => {
                        unanswered.push(format!("node {}: {e}", src.node));
                        continue;
                    }
                };
                if !got.bad_blocks.is_empty() {
                    continue;
                }
                if got.suspect.is_empty() && src.drive != bad_at.drive {
                    intact = Some((src, got));
                    break;
                }
                if newest_suspect
                    .as_ref()
                    .is_none_or(|(_, n)| got.version > n.version)
                {
                    newest_suspect = Some((src, got));
                }
            }
            let what = if suspect {
                "was rolled back by a power loss"
            } else {
                "fails its checksum"
            };
            let (src, good) = match (intact, newest_suspect) {
                (Some(i), _) => i,
                (None, Some(n)) if unanswered.is_empty() => {
                    log::warn!(
                        "volume {}: block at slab {} offset {boff} {what} on node {} and no copy \
                         holds it unsuspected: serving the newest version the copies hold ({})",
                        self.cfg.name,
                        p.slab,
                        bad_at.node,
                        n.1.version.0
                    );
                    n
                }
                (None, _) => {
                    let why = format!("block at offset {boff} {what} on node {}", bad_at.node);
                    if unanswered.is_empty() {
                        // Every other in-sync copy answered, and none has the block intact.
                        return Err(RepairFailed::Lost(VolumeError::Unreadable {
                            volume: self.cfg.name.clone(),
                            slab: p.slab,
                            why: format!("{why} and no other copy has it intact"),
                        }));
                    }
                    return Err(RepairFailed::Unavailable(format!(
                        "{why}; the other copies did not answer ({})",
                        unanswered.join("; ")
                    )));
                }
            };
            let at = b as usize * BLOCK_SIZE;
            buf[at..at + BLOCK_SIZE].copy_from_slice(&good.data);
            // Rewrite with the source's version so the repaired block is not newer than
            // the write it holds (an equal version is taken: it clears a suspect mark).
            let op = ExtentOp::Write {
                key,
                epoch: self.epoch(),
                version: good.version,
                offset: boff,
                crcs: block_crcs(&good.data),
                data: good.data,
                codec: self.compression(),
            };
            match self.ask(bad_at, op, ExtentReply::into_ok).await {
                Ok(()) => {
                    self.counters
                        .repaired_blocks
                        .fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "volume {}: repaired block at slab {} offset {boff} ({what}) on node {} drive {} from node {}",
                        self.cfg.name, p.slab, bad_at.node, bad_at.drive, src.node
                    );
                }
                Err(e) => log::error!(
                    "volume {}: could not rewrite block on node {} drive {}: {e}",
                    self.cfg.name,
                    bad_at.node,
                    bad_at.drive
                ),
            }
        }
        Ok(buf.freeze())
    }

    /// TRIM and WRITE_ZEROES. Whole blocks become zero (metadata only on the replicas);
    /// partial blocks at the edges are written as zeros for WRITE_ZEROES and left alone
    /// for TRIM (a hint).
    pub async fn zero(&self, offset: u64, len: u64, trim: bool) -> Result<(), VolumeError> {
        self.check_range(offset, len)?;
        self.check_serving()?;
        self.admit(0).await;
        self.check_serving()?;
        let r = self
            .zero_inner(offset, len, trim)
            .await
            .and_then(|()| self.check_serving());
        self.counters.zero_ops.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &r {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            if e.is_no_space() {
                self.counters
                    .no_space_errors
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        r
    }

    async fn zero_inner(&self, offset: u64, len: u64, trim: bool) -> Result<(), VolumeError> {
        let end_all = offset + len;
        // Whole blocks inside the range.
        let start = offset.div_ceil(BS) * BS;
        let end = end_all / BS * BS;
        if end <= start {
            // No whole block: only partial edges.
            if !trim && len > 0 {
                self.write_unaligned(offset, Bytes::from(vec![0u8; len as usize]))
                    .await?;
            }
            return Ok(());
        }
        if !trim && start > offset {
            self.write_unaligned(offset, Bytes::from(vec![0u8; (start - offset) as usize]))
                .await?;
        }
        if !trim && end < end_all {
            self.write_unaligned(end, Bytes::from(vec![0u8; (end_all - end) as usize]))
                .await?;
        }
        // A guest's `fstrim` or `mkfs` sends ranges of up to 4 GiB: a few dozen operations at
        // a time, not hundreds in flight at once. A slab the range covers whole is released
        // (its space returns to the pool); the rest is zeroed block by block. A parity
        // slab's partial TRIMs are dropped (a hint; zeroing part of a row is a row write),
        // its WRITE_ZEROES written as rows of zeros.
        let size = self.slab_span();
        let mut tasks: Vec<ZeroTask> = Vec::new();
        for s in start / size..=(end - 1) / size {
            let (s_start, s_end) = (s * size, (s + 1) * size);
            let (from, to) = (start.max(s_start), end.min(s_end));
            if from == s_start && to == s_end {
                tasks.push(ZeroTask::Release(SlabIndex(s)));
            } else {
                tasks.extend(split(from, to - from, size).map(ZeroTask::Piece));
            }
        }
        for group in tasks.chunks(ZERO_PIECES_IN_FLIGHT) {
            join_all_ok(group.iter().map(|t| async move {
                if let (Some(g), Some(_)) = (self.geometry, &self.map) {
                    return match *t {
                        ZeroTask::Piece(p) => self.map_zero(g, p, false, trim).await,
                        ZeroTask::Release(idx) => {
                            let p = Piece {
                                slab: idx,
                                offset: 0,
                                len: size,
                                at: 0,
                            };
                            self.map_zero(g, p, true, trim).await
                        }
                    };
                }
                match (*t, self.geometry) {
                    (ZeroTask::Piece(p), None) => self.zero_piece(p).await,
                    (ZeroTask::Release(idx), None) => self.release_slab(idx, false).await,
                    (ZeroTask::Piece(_), Some(_)) if trim => Ok(()),
                    (ZeroTask::Piece(p), Some(g)) => self.parity_zero_piece(g, p).await,
                    (ZeroTask::Release(idx), Some(g)) => {
                        if self.parity_release(idx).await? || trim {
                            return Ok(());
                        }
                        // Not released now: the zeros are written.
                        for p in split(idx.0 * size, size, size) {
                            self.parity_zero_piece(g, p).await?;
                        }
                        Ok(())
                    }
                }
            }))
            .await?;
        }
        Ok(())
    }

    /// The slab from this owner's map or, if the map lacks it, from its record (another
    /// term may have allocated it since this owner loaded the map: then this owner is
    /// deposed, and the lookup says so). `None`: never written, it reads as zeros.
    async fn known_slab(&self, idx: SlabIndex) -> Result<Option<Arc<Slab>>, VolumeError> {
        if let Some(s) = self.slab(idx) {
            return Ok(Some(s));
        }
        if self.parent().is_some() {
            // A clone's slab that was never written reads as its parent, not as zeros: a
            // zero of it is a write like any other.
            return self.slab_or_allocate(idx).await.map(Some);
        }
        let Some(extents) = self.alloc.lookup(self.cfg.id, idx, self.epoch()).await? else {
            return Ok(None);
        };
        let _g = self.alloc_lock.lock().await;
        if let Some(s) = self.slab(idx) {
            return Ok(Some(s));
        }
        self.adopt(idx, extents).await.map(Some)
    }

    /// Takes up a slab this owner's map lacks, from its record (new or found), and puts it
    /// in the map. The caller holds `alloc_lock`.
    ///
    /// A drive may hold blocks under the slab's key from an earlier incarnation that a
    /// TRIM released: a write of that term (or an older one) still in flight then,
    /// arriving after the free, created the extent again. So the slab starts by zeroing
    /// itself whole on every copy, at a version above all of those (metadata only):
    /// nothing of theirs is ever read, and the late ones are refused.
    async fn adopt(
        &self,
        idx: SlabIndex,
        extents: Vec<ExtentLoc>,
    ) -> Result<Arc<Slab>, VolumeError> {
        let slab = Arc::new(Slab::new(extents, self.seq_floor.load(Ordering::Acquire)));
        if self.parent().is_some() {
            // A clone's slab is not zeroed: its never-written blocks read as the parent's
            // (`clone.rs`). No older incarnation can be under it: a clone's slabs are never
            // released (zeroed instead), so the slab is new on every copy.
            self.slabs
                .write()
                .expect("slab map lock poisoned")
                .insert(idx, slab.clone());
            return Ok(slab);
        }
        let zeroed = {
            let _gate = slab.gate.read().await;
            self.zero_whole(idx, &slab).await
        };
        // Deposed, or no copy is known to have the zero: not taken up (the next write
        // starts again from the record, zero first). Otherwise taken up even if the zero
        // failed on some copies: they are marked stale, and repair resyncs them (from a
        // zeroed copy) as after any failed write.
        if let Err(e) = &zeroed {
            if e.is_no_space() {
                // Drives of its copies had no room for it: it holds nothing yet, so it is
                // given back, and a later write places it afresh where there is room then
                // (space freed later may be on other drives than these).
                self.give_back_new_slab(idx, &slab).await;
                return Err(e.clone());
            }
            if matches!(e, VolumeError::Fenced { .. }) || slab.suspect.load(Ordering::Acquire) {
                return Err(e.clone());
            }
        }
        self.slabs
            .write()
            .expect("slab map lock poisoned")
            .insert(idx, slab.clone());
        zeroed.map(|_| slab)
    }

    /// Deletes the record of a slab this owner just placed and that was never taken up
    /// (its first zero found no room), and frees whatever copies took the zero. The
    /// caller holds `alloc_lock`, so no write can use the slab meanwhile. If the record
    /// cannot be deleted now, it stays: the next write takes it up again and zeroes first.
    async fn give_back_new_slab(&self, idx: SlabIndex, slab: &Arc<Slab>) {
        let extents = slab.extents();
        let upto = Version(self.epoch().0 << 32 | slab.seq.load(Ordering::Acquire));
        match self.alloc.release(self.cfg.id, &[idx], self.epoch()).await {
            Ok(()) => {
                self.forget_released(idx, slab);
                self.free_extents(idx, &extents, upto).await;
            }
            Err(e) => log::warn!(
                "volume {}: new slab {idx} found no room and could not be given back ({e}); \
                 the next write to it tries its copies again",
                self.cfg.name
            ),
        }
    }

    /// Zeroes part of a slab; when the zeroes of this term add up to the whole slab, it is
    /// released.
    async fn zero_piece(&self, p: Piece) -> Result<(), VolumeError> {
        if self.zero_part(p).await? {
            // The zero is done; giving the slab back is a bonus that may wait for a later
            // TRIM (a deposed owner still learns it is).
            match self.release_slab(p.slab, true).await {
                Ok(()) => {}
                Err(e @ VolumeError::Fenced { .. }) => return Err(e),
                Err(e) => log::info!(
                    "volume {}: slab {} is all zeros but was not released now: {e}",
                    self.cfg.name,
                    p.slab
                ),
            }
        }
        Ok(())
    }

    /// Zeroes part of a slab; whether every block of it is now known zero.
    async fn zero_part(&self, p: Piece) -> Result<bool, VolumeError> {
        loop {
            let Some(slab) = self.known_slab(p.slab).await? else {
                return Ok(false);
            };
            self.wait_min_replicas(p.slab, &slab).await?;
            let _gate = slab.gate.read().await;
            self.check_serving()?;
            if slab.is_released() {
                continue;
            }
            let writes_before = slab.zeroed.writes.load(Ordering::SeqCst);
            let extents = slab.extents();
            let version = self.next_version(&slab);
            let key = self.key(p.slab);
            let targets = writable(&extents);
            self.replicate(p.slab, &slab, targets, |at| {
                let op = ExtentOp::Zero {
                    key,
                    epoch: self.epoch(),
                    version,
                    offset: p.offset,
                    len: p.len,
                };
                self.ask(at, op, ExtentReply::into_ok)
            })
            .await?;
            let blocks = self.cfg.slab_size_bytes / BS;
            return Ok(slab
                .zeroed
                .zeroed(p.offset / BS, p.len / BS, writes_before, blocks));
        }
    }

    /// Thin reclaim of a slab a TRIM or WRITE_ZEROES covers whole. With no write in flight
    /// (the gate), every copy is zeroed at one version V, like any zero: from here the
    /// request is done, whatever follows. Then, if all copies are in sync and settled, the
    /// slab's record is deleted (fenced: only this term may), the slab leaves the map, and
    /// each copy frees its extent unless it holds something newer than V
    /// ([`ExtentOp::Release`]: a late release never frees a later incarnation). A crash
    /// anywhere in between leaves either the zeroed slab or no record and extents no
    /// record names (orphans, which their node reclaims). A slab that cannot be released
    /// now stays allocated, zeroed.
    ///
    /// `if_zeroed`: only if every block is still known zero (the zeroes of parts of the slab
    /// added up to it; a write since then cleared some).
    async fn release_slab(&self, idx: SlabIndex, if_zeroed: bool) -> Result<(), VolumeError> {
        let Some(slab) = self.known_slab(idx).await? else {
            return Ok(());
        };
        if self.shadows_parity(idx) || !self.snapshots().is_empty() || self.parent().is_some() {
            // Zeroed below, but kept: see `shadows_parity`; and a snapshot still reads
            // the slab's states before the zero (its copies' extents keep them).
            let _gate = slab.gate.read().await;
            self.check_serving()?;
            if !slab.is_released() && !if_zeroed {
                self.zero_whole(idx, &slab).await?;
            }
            return Ok(());
        }
        self.wait_min_replicas(idx, &slab).await?;
        let _gate = slab.gate.write().await;
        self.check_serving()?;
        if slab.is_released() || (if_zeroed && !slab.zeroed.all(self.cfg.slab_size_bytes / BS)) {
            return Ok(());
        }
        if !self.snapshots().is_empty() {
            // A snapshot was taken while this waited for the slab (it holds every slab's
            // writes, this one's too, until it is in the list): it reads the states
            // before the zero, which a release would free.
            if !if_zeroed {
                self.zero_whole(idx, &slab).await?;
            }
            return Ok(());
        }
        let upto = self.zero_whole(idx, &slab).await?;
        let _c = slab.change.lock().await;
        let extents = slab.extents();
        let settled = extents.iter().all(|e| e.state == ExtentState::InSync)
            && !slab.suspect.load(Ordering::Acquire)
            && !slab.unsure.load(Ordering::Acquire)
            && abandoned_none(&slab);
        if !settled {
            log::info!(
                "volume {}: slab {idx} was zeroed whole but stays allocated: not all of its copies are in sync",
                self.cfg.name
            );
            return Ok(());
        }
        let epoch = self.epoch();
        let deleted = match self.alloc.release(self.cfg.id, &[idx], epoch).await {
            Err(e @ VolumeError::Fenced { .. }) => return Err(e),
            r => r,
        };
        // The record may be gone (deleted, or the answer was lost): no write may go to
        // these copies under it any more. If it is still there, the next write or zero
        // takes the slab up again from it, as a new incarnation.
        self.forget_released(idx, &slab);
        if let Err(e) = deleted {
            log::warn!(
                "volume {}: slab {idx} was zeroed, but whether its record was deleted is unknown ({e}); its copies stay until the next write takes it up or their nodes reclaim them",
                self.cfg.name
            );
            return Ok(());
        }
        self.free_released(idx, &extents, upto).await;
        Ok(())
    }

    /// A released slab's handle is done: no write may go to its copies under it (whoever
    /// waited on its gate starts again from the map), the next incarnation's versions
    /// start above its own, and it leaves the map.
    pub(crate) fn forget_released(&self, idx: SlabIndex, slab: &Arc<Slab>) {
        slab.released.store(true, Ordering::Release);
        self.seq_floor
            .fetch_max(slab.seq.load(Ordering::Acquire), Ordering::AcqRel);
        let mut map = self.slabs.write().expect("slab map lock poisoned");
        if map.get(&idx).is_some_and(|s| Arc::ptr_eq(s, slab)) {
            map.remove(&idx);
        }
    }

    /// Counts a slab whose record was deleted and frees its copies (each unless it holds
    /// something newer than `upto`); a copy not freed is left to its node's orphan reclaim.
    pub(crate) async fn free_released(&self, idx: SlabIndex, extents: &[ExtentLoc], upto: Version) {
        self.counters.slabs_released.fetch_add(1, Ordering::Relaxed);
        self.free_extents(idx, extents, upto).await;
    }

    /// Frees the copies of a slab whose record was deleted (each unless it holds something
    /// newer than `upto`); a copy not freed is left to its node's orphan reclaim.
    pub(crate) async fn free_extents(&self, idx: SlabIndex, extents: &[ExtentLoc], upto: Version) {
        let key = self.key(idx);
        let epoch = self.epoch();
        let answers = join_all(
            extents
                .iter()
                .map(|&at| async move {
                    let op = ExtentOp::Release { key, epoch, upto };
                    (at, self.ask(at, op, ExtentReply::into_ok).await)
                })
                .collect(),
        )
        .await;
        for (at, r) in answers {
            if let Err(e) = r {
                log::warn!(
                    "volume {}: slab {idx} was released, but its copy on node {} drive {} was not freed ({e}); that node reclaims it as an orphan",
                    self.cfg.name, at.node, at.drive
                );
            }
        }
    }
}

/// What a zero of a range does to one slab.
#[derive(Clone, Copy)]
enum ZeroTask {
    /// Zero part of a slab.
    Piece(Piece),
    /// The range covers the slab whole: release it.
    Release(SlabIndex),
}

fn abandoned_none(slab: &Slab) -> bool {
    slab.abandoned
        .lock()
        .expect("abandoned-copies lock poisoned")
        .is_empty()
}

/// An empty set of further reads of a hedged read, typed after the read it repeats.
type Hedged<F> = Vec<(usize, std::pin::Pin<Box<F>>)>;
fn hedge_set<F: Future>(_read: &impl Fn(ExtentLoc) -> F) -> Hedged<F> {
    Vec::new()
}

/// Why a round of a read did not answer.
pub(crate) enum Retry {
    /// Nothing could answer this time (the reason): another round may.
    Again(String),
    /// For good (data lost, or this owner deposed).
    Fail(VolumeError),
}

/// Why a round of a hedged read got no answer.
enum ReadFailed {
    /// A copy refused this owner's epoch: another node owns the volume now.
    Fenced(String),
    /// Every copy asked failed (each one's error).
    All(String),
}

/// Why a bad block could not be repaired.
enum RepairFailed {
    /// For good: no copy has it intact (or this owner is deposed).
    Lost(VolumeError),
    /// Some copy did not answer: try again.
    Unavailable(String),
}

/// Run futures concurrently; the first error wins, but all are driven to completion so no
/// replica request is abandoned half-way.
async fn join_all_ok<F>(futs: impl IntoIterator<Item = F>) -> Result<(), VolumeError>
where
    F: Future<Output = Result<(), VolumeError>>,
{
    join_all_ok_vec(futs).await.map(|_| ())
}

async fn join_all_ok_vec<F, T>(futs: impl IntoIterator<Item = F>) -> Result<Vec<T>, VolumeError>
where
    F: Future<Output = Result<T, VolumeError>>,
{
    let results = join_all(futs.into_iter().collect()).await;
    let mut out = Vec::with_capacity(results.len());
    let mut first_err = None;
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// A small join-all: polls every future each wake-up (the sets here are tiny: one future
/// per copy or per slab touched; the node's API uses it for one request per node).
/// Whether a copy's failure may pass if the operation is asked again shortly (a slow or
/// briefly unreachable copy); a drive with no room does not.
fn retryable(e: &ReplicaError) -> bool {
    !matches!(e, ReplicaError::NoSpace(_))
}

pub async fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    use std::pin::Pin;
    use std::task::Poll;
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut outs: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(outs.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outs.into_iter()
        .map(|o| o.expect("every future completed"))
        .collect()
}

#[cfg(test)]
mod tests;
