//! The cache tier (DESIGN.md "Cache tier"; byte layout in docs/FORMAT-cache.md).
//!
//! A cache drive is a circular **log** of batches in front of the capacity drives of its
//! node that are bound to it. In `write` and `read-write` mode a write lands in the log
//! (data and a 48-byte record per block, one write and one flush per group-commit batch)
//! and is acked once that batch is durable; the **destage** thread later writes each
//! block's newest version to its capacity drive, sorted by address and with rewrites
//! coalesced (a block rewritten while it waited is destaged once), so data reaches the
//! capacity drive once. `read-write` also keeps hot reads in the log (admission on the
//! second miss, FIFO eviction with a second chance). `none` writes go straight to
//! capacity; what the log still holds drains.
//!
//! Which version of a block is current is decided by the same rule as everywhere else in
//! converge: the newest version wins. The in-memory index maps a block to its newest
//! version in the log; the capacity drive holds the rest. After a crash the log is
//! replayed from its tail and every block whose logged version is newer than the capacity
//! drive's is destaged before the node serves I/O, so nothing acked is lost and the index
//! starts empty (see [`Cache::open`]).

use crate::drive::{lock, Capacity, DestageRun, Drive, ExtentInfo, ReadInfo};
use crate::durable::Durable;
use crate::error::EngineError;
use crate::file::{AlignedBuf, BlockFile};
use crate::layout::{get_u32, get_u64, media_code, media_of, put_u32, put_u64, DriveIdentity};
use crate::stats::{Counters, DriveStats, OpKind};
use converge_types::{
    CacheMode, ClusterId, DriveId, DriveRole, Epoch, ExtentKey, NodeId, SlabIndex, Version,
    VolumeId, BLOCK_SIZE,
};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

const MAGIC: [u8; 8] = *b"CVGCACH1";
pub const CACHE_FORMAT_VERSION: u32 = 1;
const SB_CRC_BYTES: usize = 256;
const SB_BLOCK: u64 = 4096;
/// The log starts after the two superblock copies.
const LOG_OFF: u64 = 2 * SB_BLOCK;
const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"CVCB");
const HDR: usize = 40;
const REC: usize = 48;
const BS: u64 = BLOCK_SIZE as u64;
/// Most data blocks one batch carries (1 MiB): bounds batch latency and wrap waste.
const BATCH_BLOCKS_MAX: usize = 256;
/// Smallest cache drive: room for the superblocks and a few dozen batches.
pub const CACHE_MIN_BYTES: u64 = 16 << 20;
/// Destage works through the log in chunks of at most this many bytes.
const DESTAGE_CHUNK_BYTES: u64 = 8 << 20;
/// Read blocks waiting for admission into the read cache (bounded; more are dropped).
const ADMIT_QUEUE_MAX: usize = 1024;

const K_DIRTY: u8 = 1;
const K_CLEAN: u8 = 2;
const K_DROP: u8 = 3;

/// The cache drive's superblock (two copies, like the engine's).
#[derive(Clone, Debug, PartialEq, Eq)]
struct CacheSb {
    id: DriveIdentity,
    len: u64,
    log_len: u64,
    sector: u32,
    generation: u64,
    log_gen: u64,
    tail: u64,
    tail_seq: u64,
}

impl CacheSb {
    fn encode(&self, b: &mut [u8]) {
        b[..SB_BLOCK as usize].fill(0);
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(b, 8, CACHE_FORMAT_VERSION);
        put_u32(b, 12, SB_CRC_BYTES as u32);
        put_u64(b, 16, self.generation);
        b[24..40].copy_from_slice(&self.id.cluster.0.to_le_bytes());
        put_u32(b, 40, self.id.node.0);
        b[44] = 1;
        b[45] = media_code(self.id.media);
        put_u64(b, 48, self.id.drive.0);
        put_u64(b, 56, self.len);
        put_u64(b, 64, LOG_OFF);
        put_u64(b, 72, self.log_len);
        put_u32(b, 80, self.sector);
        put_u64(b, 88, self.log_gen);
        put_u64(b, 96, self.tail);
        put_u64(b, 104, self.tail_seq);
        put_u64(b, 112, self.id.slab_size_bytes);
        let crc = crc32c::crc32c(&b[..SB_CRC_BYTES - 4]);
        put_u32(b, SB_CRC_BYTES - 4, crc);
    }

    fn decode(b: &[u8]) -> Result<Option<CacheSb>, EngineError> {
        if b[0..8] != MAGIC {
            return Ok(None);
        }
        if crc32c::crc32c(&b[..SB_CRC_BYTES - 4]) != get_u32(b, SB_CRC_BYTES - 4) {
            return Err(EngineError::Corrupt(
                "cache superblock checksum mismatch".into(),
            ));
        }
        let version = get_u32(b, 8);
        if version != CACHE_FORMAT_VERSION {
            return Err(EngineError::UnsupportedVersion {
                found: version,
                supported: CACHE_FORMAT_VERSION,
            });
        }
        if get_u64(b, 64) != LOG_OFF {
            return Err(EngineError::Corrupt("cache log offset is not 8192".into()));
        }
        let sb = CacheSb {
            id: DriveIdentity {
                cluster: ClusterId(u128::from_le_bytes(
                    b[24..40].try_into().expect("16-byte slice"),
                )),
                node: NodeId(get_u32(b, 40)),
                drive: DriveId(get_u64(b, 48)),
                slab_size_bytes: get_u64(b, 112),
                role: DriveRole::Cache,
                media: media_of(b[45])?,
            },
            generation: get_u64(b, 16),
            len: get_u64(b, 56),
            log_len: get_u64(b, 72),
            sector: get_u32(b, 80),
            log_gen: get_u64(b, 88),
            tail: get_u64(b, 96),
            tail_seq: get_u64(b, 104),
        };
        // Sector, log length and tail size every read of the log: only what `format`
        // and `write_sb` write is accepted (a tail may equal the log length: the head).
        // Generations and sequence numbers count up from 1: there must be room to add.
        let sector = u64::from(sb.sector);
        if !(sector == 512 || sector == BS)
            || sb.len.checked_sub(LOG_OFF).map(|l| l / BS * BS) != Some(sb.log_len)
            || sb.tail > sb.log_len
            || !sb.tail.is_multiple_of(sector)
            || sb.generation == u64::MAX
            || !(1..=u64::MAX / 2).contains(&sb.tail_seq)
        {
            return Err(EngineError::Corrupt(
                "cache superblock log fields invalid".into(),
            ));
        }
        Ok(Some(sb))
    }
}

/// One log record: a block's new content (dirty), a read-cached copy (clean), or "forget
/// every earlier record of this extent" (drop, written before the extent is freed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rec {
    kind: u8,
    block: u32,
    drive: DriveId,
    key: ExtentKey,
    version: u64,
    crc: u32,
}

impl Rec {
    fn has_data(&self) -> bool {
        self.kind != K_DROP
    }
    fn encode(&self, b: &mut [u8]) {
        b[..REC].fill(0);
        b[0] = self.kind;
        put_u32(b, 4, self.block);
        put_u64(b, 8, self.drive.0);
        put_u64(b, 16, self.key.volume.0);
        put_u64(b, 24, self.key.slab.0);
        put_u64(b, 32, self.version);
        put_u32(b, 40, self.crc);
    }
    fn decode(b: &[u8]) -> Option<Rec> {
        let kind = b[0];
        if !(K_DIRTY..=K_DROP).contains(&kind) {
            return None;
        }
        Some(Rec {
            kind,
            block: get_u32(b, 4),
            drive: DriveId(get_u64(b, 8)),
            key: ExtentKey {
                volume: VolumeId(get_u64(b, 16)),
                slab: SlabIndex(get_u64(b, 24)),
            },
            version: get_u64(b, 32),
            crc: get_u32(b, 40),
        })
    }
}

/// A batch's block buffer: room for BATCH_BLOCKS_MAX blocks, empty.
fn empty_batch_buf() -> AlignedBuf {
    let mut b = AlignedBuf::new(BATCH_BLOCKS_MAX * BLOCK_SIZE);
    b.set_len(0);
    b
}

fn hdr_len(records: usize, sector: u64) -> u64 {
    ((HDR + records * REC) as u64).div_ceil(sector) * sector
}

/// What an append does when the log has no room.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Room {
    /// Wait for destage to free space (writes slow down, never fail).
    Wait,
    /// Give up (read-cache admissions).
    Skip,
    /// Never wait (a drop record, appended while destage is held off).
    Force,
}

/// A batch written to the log and not yet reclaimed.
struct Batch {
    seq: u64,
    off: u64,
    hdr_len: u64,
    recs: Vec<Rec>,
}

/// Where a batch sits; kept from the moment the leader places it until destage reclaims it.
struct Placed {
    seq: u64,
    off: u64,
    /// Bytes skipped at the end of the log before it (it wrapped to offset 0).
    waste: u64,
    len: u64,
}

struct LogState {
    recs: Vec<Rec>,
    /// The open batch's blocks, already in an O_DIRECT-aligned buffer (the leader writes
    /// it as is: no second copy).
    data: AlignedBuf,
    /// Bytes the pending records and data will take (excluding header padding).
    pending_bytes: u64,
    open_seq: u64,
    durable_seq: u64,
    leader_active: bool,
    failed: Option<String>,
    head: u64,
    used: u64,
    placed: VecDeque<Placed>,
}

struct LeaderBufs {
    recs: Vec<Rec>,
    data: AlignedBuf,
    hdr: AlignedBuf,
}

/// A block's newest version in the log.
#[derive(Clone, Copy, Debug)]
struct Entry {
    loc: u64,
    version: u64,
    crc: u32,
    dirty: bool,
    referenced: bool,
}

#[derive(Default)]
struct ExtState {
    entries: HashMap<u32, Entry>,
    /// Block ranges [first, first+count) with a write in progress through the tier.
    busy: Vec<(u32, u32)>,
    /// The extent was freed or released while a write held this entry: the write is
    /// refused ([`EngineError::Released`]) instead of logging into a forgotten index.
    dropped: bool,
}

impl ExtState {
    fn overlaps(&self, first: u32, count: u32) -> bool {
        self.busy
            .iter()
            .any(|&(f, c)| f < first + count && first < f + c)
    }
}

#[derive(Default)]
struct ExtIdx {
    m: Mutex<ExtState>,
    cv: Condvar,
}

impl ExtIdx {
    /// Claims blocks `[first, first + count)` for an operation through the tier: waits
    /// until no other claim overlaps them; refused if the extent was dropped meanwhile.
    /// Returns the index lock, still held.
    fn claim(
        &self,
        key: ExtentKey,
        first: u32,
        count: u32,
    ) -> Result<std::sync::MutexGuard<'_, ExtState>, EngineError> {
        let mut m = lock(&self.m);
        while m.overlaps(first, count) {
            m = self.cv.wait(m).expect("cache index lock poisoned");
        }
        if m.dropped {
            return Err(EngineError::Released { key });
        }
        m.busy.push((first, count));
        Ok(m)
    }

    /// Ends a claim, under the index lock `m`, and wakes the operations waiting for it.
    fn unclaim(&self, mut m: std::sync::MutexGuard<'_, ExtState>, first: u32, count: u32) {
        if let Some(p) = m.busy.iter().position(|&r| r == (first, count)) {
            m.busy.swap_remove(p);
        }
        drop(m);
        self.cv.notify_all();
    }
}

type IdxKey = (DriveId, ExtentKey);
/// A live dirty block: (capacity drive, extent, block, log offset, version, crc).
type LiveBlock = (DriveId, ExtentKey, u32, u64, u64, u32);
/// A logged block found by replay: (log offset of its data, version, crc).
type Logged = (u64, u64, u32);

#[derive(Default)]
struct Ctl {
    stop: bool,
    /// Destage everything logged before this batch sequence number.
    drain_to: u64,
    admit: Vec<Rec>,
    admit_data: Vec<u8>,
}

#[derive(Default)]
struct Ghost {
    set: std::collections::HashSet<(DriveId, ExtentKey, u32)>,
    fifo: VecDeque<(DriveId, ExtentKey, u32)>,
}

/// Counters of one cache drive beyond the device counters ([`DriveStats`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CacheStats {
    pub mode: Option<CacheMode>,
    pub log_bytes: u64,
    pub used_bytes: u64,
    pub dirty_bytes: u64,
    pub clean_bytes: u64,
    /// Blocks read through the tier that came from the cache / from capacity.
    pub read_hit_blocks: u64,
    pub read_miss_blocks: u64,
    /// Bytes written to capacity drives by destage.
    pub destaged_bytes: u64,
    /// Blocks admitted into the read cache, re-admitted (second chance) and evicted.
    pub admitted_blocks: u64,
    pub evicted_blocks: u64,
    /// Writes that waited for log space (the cache was full of dirty data).
    pub write_stalls: u64,
    /// Blocks of failed capacity drives logged again at the head instead of destaged
    /// (`Cache::carry`).
    pub carried_blocks: u64,
    pub failed: Option<String>,
}

#[derive(Default)]
struct Extra {
    hits: AtomicU64,
    misses: AtomicU64,
    destaged_bytes: AtomicU64,
    admitted: AtomicU64,
    evicted: AtomicU64,
    stalls: AtomicU64,
    carried: AtomicU64,
    dirty: AtomicI64,
    clean: AtomicI64,
}

/// What [`Cache::open`] found and did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OpenReport {
    pub batches_replayed: u64,
    /// Blocks whose logged version was newer than the capacity drive's: destaged at open.
    pub blocks_destaged: u64,
    /// Logged blocks of capacity drives this node does not have (removed from its config).
    pub blocks_of_unknown_drives: u64,
    /// Logged blocks whose data failed its checksum in a batch that had been synced (media
    /// error): those acked writes are lost on this node's copies.
    pub blocks_lost: u64,
    /// The drive had no cache superblock and was formatted.
    pub formatted: bool,
}

/// One cache drive. `Send + Sync`; shared by the [`Tier`]s bound to it.
pub struct Cache {
    file: Arc<dyn BlockFile>,
    id: DriveIdentity,
    len: u64,
    log_len: u64,
    sector: u64,
    log_gen: u64,
    sb_gen: Mutex<u64>,
    st: Mutex<LogState>,
    cv: Condvar,
    leader: Mutex<LeaderBufs>,
    batches: Mutex<VecDeque<Batch>>,
    index: RwLock<HashMap<IdxKey, Arc<ExtIdx>>>,
    capacity: RwLock<HashMap<DriveId, Arc<Drive>>>,
    mode: AtomicU8,
    destage_bps: AtomicU64,
    low_pct: AtomicU8,
    high_pct: AtomicU8,
    counters: Counters,
    extra: Extra,
    destage_gate: Mutex<()>,
    ctl: Mutex<Ctl>,
    ctl_cv: Condvar,
    ghost: Mutex<Ghost>,
    running: AtomicBool,
}

fn mode_code(m: CacheMode) -> u8 {
    match m {
        CacheMode::None => 0,
        CacheMode::Write => 1,
        CacheMode::ReadWrite => 2,
    }
}
fn mode_of(c: u8) -> CacheMode {
    match c {
        0 => CacheMode::None,
        1 => CacheMode::Write,
        _ => CacheMode::ReadWrite,
    }
}

fn probe_sector(file: &dyn BlockFile) -> u64 {
    let mut b = AlignedBuf::new(512);
    match file.read_at(&mut b[..512], LOG_OFF + 512) {
        Ok(()) => 512,
        Err(_) => BS,
    }
}

impl Cache {
    /// Reads the identity of a cache drive; `Ok(None)` if it has no cache superblock.
    pub fn probe(file: &dyn BlockFile) -> Result<Option<DriveIdentity>, EngineError> {
        Ok(read_sb(file)?.map(|sb| sb.id))
    }

    /// Formats `file` as an empty cache drive.
    pub fn format(file: &dyn BlockFile, id: DriveIdentity) -> Result<(), EngineError> {
        let len = file.len_bytes();
        if len < CACHE_MIN_BYTES {
            return Err(EngineError::TooSmall {
                len_bytes: len,
                needed_bytes: CACHE_MIN_BYTES,
            });
        }
        let sector = probe_sector(file);
        let log_len = (len - LOG_OFF) / BS * BS;
        let mut sb = CacheSb {
            id: DriveIdentity {
                role: DriveRole::Cache,
                ..id
            },
            len,
            log_len,
            sector: sector as u32,
            generation: 1,
            log_gen: rand_gen(),
            tail: 0,
            tail_seq: 1,
        };
        let mut b = AlignedBuf::new(SB_BLOCK as usize);
        for copy in 0..2u64 {
            sb.generation = copy + 1;
            sb.encode(&mut b);
            file.write_at(&b, copy * SB_BLOCK)
                .map_err(EngineError::io("write"))?;
        }
        file.sync().map_err(EngineError::io("sync"))?;
        Ok(())
    }

    /// Opens a cache drive: replays its log from the tail, destages every logged block
    /// that is newer than its capacity drive's copy (`capacity`: this node's capacity
    /// drives, already open), then starts an empty log with a new generation. Acked
    /// writes are therefore on capacity before anything else happens, whatever the cache
    /// binding is now. A blank file is formatted with `blank_id`.
    pub fn open(
        file: Arc<dyn BlockFile>,
        blank_id: DriveIdentity,
        capacity: &HashMap<DriveId, Arc<Drive>>,
    ) -> Result<(Arc<Cache>, OpenReport), EngineError> {
        let mut report = OpenReport::default();
        let sb = match read_sb(&*file)? {
            Some(sb) => sb,
            None => {
                Cache::format(&*file, blank_id)?;
                report.formatted = true;
                read_sb(&*file)?.ok_or_else(|| {
                    EngineError::Corrupt("cache superblock unreadable after format".into())
                })?
            }
        };
        if sb.len > file.len_bytes() {
            return Err(EngineError::Corrupt(format!(
                "cache drive was formatted with {} bytes but has {}",
                sb.len,
                file.len_bytes()
            )));
        }
        let sector = u64::from(sb.sector);
        let cache = Cache {
            file: file.clone(),
            id: sb.id.clone(),
            len: sb.len,
            log_len: sb.log_len,
            sector,
            log_gen: sb.log_gen,
            sb_gen: Mutex::new(sb.generation),
            st: Mutex::new(LogState {
                recs: Vec::new(),
                data: empty_batch_buf(),
                pending_bytes: 0,
                open_seq: 1,
                durable_seq: 0,
                leader_active: false,
                failed: None,
                head: 0,
                used: 0,
                placed: VecDeque::new(),
            }),
            cv: Condvar::new(),
            leader: Mutex::new(LeaderBufs {
                recs: Vec::new(),
                data: empty_batch_buf(),
                hdr: AlignedBuf::new(hdr_len(BATCH_BLOCKS_MAX * 2, sector) as usize),
            }),
            batches: Mutex::new(VecDeque::new()),
            index: RwLock::new(HashMap::new()),
            capacity: RwLock::new(HashMap::new()),
            mode: AtomicU8::new(mode_code(CacheMode::Write)),
            destage_bps: AtomicU64::new(256 << 20),
            low_pct: AtomicU8::new(25),
            high_pct: AtomicU8::new(80),
            counters: Counters::new(),
            extra: Extra::default(),
            destage_gate: Mutex::new(()),
            ctl: Mutex::new(Ctl::default()),
            ctl_cv: Condvar::new(),
            ghost: Mutex::new(Ghost::default()),
            running: AtomicBool::new(false),
        };
        cache.replay_and_drain(&sb, capacity, &mut report)?;
        // A fresh, empty log: a new generation so no batch of this or an earlier mount
        // can ever be replayed again.
        let log_gen = rand_gen();
        let cache = Cache { log_gen, ..cache };
        cache.write_sb(0, 1)?;
        Ok((Arc::new(cache), report))
    }

    pub fn identity(&self) -> &DriveIdentity {
        &self.id
    }

    /// Bytes of the log.
    pub fn log_bytes(&self) -> u64 {
        self.log_len
    }

    pub fn mode(&self) -> CacheMode {
        mode_of(self.mode.load(Ordering::Acquire))
    }

    /// Changes the mode; takes effect for the next I/O (nothing stops). Switching to
    /// `none` drains the log in the background.
    pub fn set_mode(&self, m: CacheMode) {
        let old = self.mode.swap(mode_code(m), Ordering::AcqRel);
        if old != mode_code(m) {
            log::info!("cache {}: mode {} -> {m}", self.id.drive, mode_of(old));
            self.ctl_cv.notify_all();
        }
    }

    /// Destage rate between the watermarks and the watermarks (percent of the log).
    pub fn set_destage(&self, bytes_per_s: u64, low_pct: u8, high_pct: u8) {
        self.destage_bps
            .store(bytes_per_s.max(1 << 20), Ordering::Relaxed);
        self.low_pct.store(low_pct.min(100), Ordering::Relaxed);
        self.high_pct
            .store(high_pct.clamp(low_pct.min(100), 100), Ordering::Relaxed);
    }

    /// Capacity drives bound to this cache.
    pub fn bound(&self) -> Vec<DriveId> {
        let mut v: Vec<DriveId> = read(&self.capacity).keys().copied().collect();
        v.sort();
        v
    }

    /// Why the cache failed, if it did (then every bound drive's I/O fails too).
    pub fn failure(&self) -> Option<String> {
        lock(&self.st).failed.clone()
    }

    fn check_failed(&self) -> Result<(), EngineError> {
        match &lock(&self.st).failed {
            Some(r) => Err(EngineError::Failed {
                reason: format!("cache drive {}: {r}", self.id.drive),
            }),
            None => Ok(()),
        }
    }

    fn fail(&self, why: &str) {
        let mut st = lock(&self.st);
        if st.failed.is_none() {
            log::error!("cache drive {} failed: {why}", self.id.drive);
            st.failed = Some(why.to_string());
        }
        drop(st);
        self.cv.notify_all();
        self.ctl_cv.notify_all();
    }

    /// Device counters (bytes written by kind, flushes, queue depth) like a drive's:
    /// `data_write_bytes` is block data, `journal_write_bytes` batch headers,
    /// `metadata_write_bytes` superblocks.
    pub fn drive_stats(&self) -> DriveStats {
        self.counters.snapshot()
    }

    pub fn stats(&self) -> CacheStats {
        let st = lock(&self.st);
        let used = st.used;
        let failed = st.failed.clone();
        drop(st);
        let e = &self.extra;
        CacheStats {
            mode: Some(self.mode()),
            log_bytes: self.log_len,
            used_bytes: used,
            dirty_bytes: e.dirty.load(Ordering::Relaxed).max(0) as u64 * BS,
            clean_bytes: e.clean.load(Ordering::Relaxed).max(0) as u64 * BS,
            read_hit_blocks: e.hits.load(Ordering::Relaxed),
            read_miss_blocks: e.misses.load(Ordering::Relaxed),
            destaged_bytes: e.destaged_bytes.load(Ordering::Relaxed),
            admitted_blocks: e.admitted.load(Ordering::Relaxed),
            evicted_blocks: e.evicted.load(Ordering::Relaxed),
            write_stalls: e.stalls.load(Ordering::Relaxed),
            carried_blocks: e.carried.load(Ordering::Relaxed),
            failed,
        }
    }

    fn write_sb(&self, tail: u64, tail_seq: u64) -> Result<(), EngineError> {
        let mut g = lock(&self.sb_gen);
        // Never write a superblock the decoder refuses (generation u64::MAX).
        *g = g
            .checked_add(1)
            .filter(|&n| n < u64::MAX)
            .ok_or_else(|| EngineError::Corrupt(crate::error::GENERATION_EXHAUSTED.into()))?;
        let sb = CacheSb {
            id: self.id.clone(),
            len: self.len,
            log_len: self.log_len,
            sector: self.sector as u32,
            generation: *g,
            log_gen: self.log_gen,
            tail,
            tail_seq,
        };
        let mut b = AlignedBuf::new(SB_BLOCK as usize);
        sb.encode(&mut b);
        self.file
            .write_at(&b, (*g % 2) * SB_BLOCK)
            .map_err(EngineError::io("write"))?;
        self.file.sync().map_err(EngineError::io("sync"))?;
        self.counters
            .metadata_write_bytes
            .fetch_add(SB_BLOCK, Ordering::Relaxed);
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    // ---- replay ------------------------------------------------------------------

    fn replay_and_drain(
        &self,
        sb: &CacheSb,
        capacity: &HashMap<DriveId, Arc<Drive>>,
        report: &mut OpenReport,
    ) -> Result<(), EngineError> {
        // Read the batches from the tail, in sequence.
        let mut pos = sb.tail;
        let mut seq = sb.tail_seq;
        let mut hdr = AlignedBuf::new(self.sector as usize);
        let mut found: Vec<(u64, u64, Vec<Rec>)> = Vec::new();
        let mut scanned = 0u64;
        loop {
            let (at, recs, hl) = match self.read_batch(pos, seq, sb.log_gen, &mut hdr)? {
                Some(x) => (pos, x.0, x.1),
                None if pos != 0 => match self.read_batch(0, seq, sb.log_gen, &mut hdr)? {
                    Some(x) => {
                        scanned += self.log_len - pos;
                        (0, x.0, x.1)
                    }
                    None => break,
                },
                None => break,
            };
            let len = hl + recs.iter().filter(|r| r.has_data()).count() as u64 * BS;
            scanned += len;
            if scanned > self.log_len {
                return Err(EngineError::Corrupt(
                    "cache log replay ran past the log's length".into(),
                ));
            }
            found.push((at, hl, recs));
            report.batches_replayed += 1;
            seq += 1;
            pos = at + len;
        }
        // Every batch but the newest was followed by a sync. The newest may be torn: its
        // blocks whose data does not match their crc were never acked and are skipped (the
        // older logged or capacity version stays).
        let mut torn: std::collections::HashSet<u64> = Default::default();
        if let Some((at, hl, recs)) = found.last() {
            let mut blk = AlignedBuf::new(BLOCK_SIZE);
            for (di, r) in recs.iter().filter(|r| r.has_data()).enumerate() {
                let loc = at + hl + di as u64 * BS;
                self.file
                    .read_at(&mut blk, LOG_OFF + loc)
                    .map_err(EngineError::io("read"))?;
                if crc32c::crc32c(&blk) != r.crc {
                    torn.insert(loc);
                }
            }
        }
        // Newest logged version per block, in log order; a drop forgets an extent's past.
        let mut latest: HashMap<IdxKey, HashMap<u32, Logged>> = HashMap::new();
        for (at, hl, recs) in &found {
            let mut di = 0u64;
            for r in recs {
                let k = (r.drive, r.key);
                if r.kind == K_DROP {
                    latest.remove(&k);
                    continue;
                }
                let loc = at + hl + di * BS;
                di += 1;
                if r.kind != K_DIRTY || torn.contains(&loc) {
                    continue;
                }
                let e = latest.entry(k).or_default();
                if e.get(&r.block).is_none_or(|&(_, v, _)| r.version >= v) {
                    e.insert(r.block, (loc, r.version, r.crc));
                }
            }
        }
        // Destage what is newer than capacity, extent by extent, in address order.
        let mut keys: Vec<_> = latest.keys().copied().collect();
        keys.sort();
        for k in keys {
            let Some(cap) = capacity.get(&k.0) else {
                report.blocks_of_unknown_drives += latest[&k].len() as u64;
                continue;
            };
            let mut blocks: Vec<(u32, u64, u64, u32)> = latest[&k]
                .iter()
                .map(|(&b, &(loc, v, crc))| (b, loc, v, crc))
                .collect();
            blocks.sort_unstable();
            for chunk in blocks.chunks(BATCH_BLOCKS_MAX) {
                let (lost, n) = self.destage_blocks(cap, k.1, chunk, true)?;
                report.blocks_lost += lost;
                report.blocks_destaged += n;
            }
        }
        Ok(())
    }

    /// Reads and checks the batch header at `pos`: its records and header length.
    fn read_batch(
        &self,
        pos: u64,
        seq: u64,
        log_gen: u64,
        hdr: &mut AlignedBuf,
    ) -> Result<Option<(Vec<Rec>, u64)>, EngineError> {
        if pos + self.sector > self.log_len {
            return Ok(None);
        }
        let s = self.sector as usize;
        if hdr.capacity() < s {
            *hdr = AlignedBuf::new(s);
        }
        hdr.set_len(s);
        self.file
            .read_at(&mut hdr[..s], LOG_OFF + pos)
            .map_err(EngineError::io("read"))?;
        if get_u32(hdr, 0) != BATCH_MAGIC || get_u64(hdr, 8) != log_gen || get_u64(hdr, 16) != seq {
            return Ok(None);
        }
        let len = u64::from(get_u32(hdr, 24));
        let n = get_u32(hdr, 28) as usize;
        let hl = hdr_len(n, self.sector);
        if n == 0 || len < hl || pos + len > self.log_len || u64::from(get_u32(hdr, 32)) != hl {
            return Ok(None);
        }
        if hl as usize > hdr.capacity() {
            *hdr = AlignedBuf::new(hl as usize);
        }
        hdr.set_len(hl as usize);
        self.file
            .read_at(&mut hdr[..hl as usize], LOG_OFF + pos)
            .map_err(EngineError::io("read"))?;
        if crc32c::crc32c(&hdr[8..HDR + n * REC]) != get_u32(hdr, 4) {
            return Ok(None);
        }
        let mut recs = Vec::with_capacity(n);
        for i in 0..n {
            match Rec::decode(&hdr[HDR + i * REC..HDR + (i + 1) * REC]) {
                Some(r) => recs.push(r),
                None => return Ok(None),
            }
        }
        let data = recs.iter().filter(|r| r.has_data()).count() as u64;
        if hl + data * BS != len {
            return Ok(None);
        }
        Ok(Some((recs, hl)))
    }

    /// Writes logged blocks `(block, loc, version, crc)` of one extent to `cap` (those newer
    /// than what it holds, if `only_newer`). Returns (blocks whose logged data failed its
    /// crc, blocks written).
    fn destage_blocks(
        &self,
        cap: &Drive,
        key: ExtentKey,
        blocks: &[(u32, u64, u64, u32)],
        only_newer: bool,
    ) -> Result<(u64, u64), EngineError> {
        let mut keep: Vec<(u32, u64, u64, u32)> = Vec::with_capacity(blocks.len());
        for &b in blocks {
            if only_newer {
                let cur = cap.block_versions(key, u64::from(b.0) * BS, 1)?;
                if cur[0].0 >= b.2 {
                    continue;
                }
            }
            keep.push(b);
        }
        if keep.is_empty() {
            return Ok((0, 0));
        }
        let mut data = AlignedBuf::new(keep.len() * BLOCK_SIZE);
        let mut lost = 0;
        self.read_locs(keep.iter().map(|b| b.1), &mut data)?;
        let mut good: Vec<usize> = Vec::with_capacity(keep.len());
        for (i, b) in keep.iter().enumerate() {
            if crc32c::crc32c(&data[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]) == b.3 {
                good.push(i);
            } else {
                lost += 1;
                log::error!(
                    "cache {}: logged block {} of extent {:?} fails its checksum; this copy lost that write",
                    self.id.drive,
                    b.0,
                    key
                );
            }
        }
        let crcs: Vec<u32> = keep.iter().map(|b| b.3).collect();
        let versions: Vec<u64> = keep.iter().map(|b| b.2).collect();
        let mut runs = Vec::new();
        let mut i = 0;
        while i < good.len() {
            let s = good[i];
            let mut e = s + 1;
            i += 1;
            while i < good.len() && good[i] == e && keep[e].0 == keep[e - 1].0 + 1 {
                e += 1;
                i += 1;
            }
            runs.push(DestageRun {
                key,
                first: keep[s].0,
                data: &data[s * BLOCK_SIZE..e * BLOCK_SIZE],
                crcs: &crcs[s..e],
                versions: &versions[s..e],
            });
        }
        let n = cap.destage(&runs)?;
        self.extra
            .destaged_bytes
            .fetch_add(n * BS, Ordering::Relaxed);
        Ok((lost, n))
    }

    /// Reads 4 KiB blocks at log offsets `locs` into consecutive slots of `out`, one
    /// read per run of adjacent offsets.
    fn read_locs(
        &self,
        locs: impl Iterator<Item = u64>,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let locs: Vec<u64> = locs.collect();
        let mut i = 0;
        while i < locs.len() {
            let s = i;
            i += 1;
            while i < locs.len() && locs[i] == locs[i - 1] + BS {
                i += 1;
            }
            let t = self.counters.begin();
            let r = self
                .file
                .read_at(&mut out[s * BLOCK_SIZE..i * BLOCK_SIZE], LOG_OFF + locs[s])
                .map_err(EngineError::io("read"));
            self.counters.end(OpKind::Read, t);
            r?;
            self.counters
                .read_bytes
                .fetch_add(((i - s) * BLOCK_SIZE) as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    // ---- the log: group commit -----------------------------------------------------

    /// Appends records (data: one 4 KiB block per record that carries data, in order).
    /// Returns the batch sequence holding the last of them, or None if `wait_room` is
    /// false and the log has no room now.
    fn append(
        &self,
        recs: &[Rec],
        data: &[u8],
        room_policy: Room,
    ) -> Result<Option<u64>, EngineError> {
        let mut st = lock(&self.st);
        let mut seq = 0;
        let mut di = 0usize;
        let mut ri = 0usize;
        let mut stalled = false;
        while ri < recs.len() {
            // Take as many records as fit in one batch.
            let mut end = ri;
            let mut blocks = 0;
            while end < recs.len() && blocks < BATCH_BLOCKS_MAX {
                if recs[end].has_data() {
                    blocks += 1;
                }
                end += 1;
            }
            let need = ((end - ri) * REC + blocks * BLOCK_SIZE) as u64;
            let reserve = 2 * (BATCH_BLOCKS_MAX * BLOCK_SIZE) as u64
                + hdr_len(2 * BATCH_BLOCKS_MAX, self.sector);
            loop {
                if let Some(r) = &st.failed {
                    return Err(EngineError::Failed {
                        reason: format!("cache drive {}: {r}", self.id.drive),
                    });
                }
                let pending_blocks = st.data.len() / BLOCK_SIZE;
                let fits_batch = pending_blocks + blocks <= BATCH_BLOCKS_MAX;
                let room = room_policy == Room::Force
                    || st.used + st.pending_bytes + need + reserve <= self.log_len;
                if fits_batch && room {
                    break;
                }
                if !room && room_policy == Room::Skip {
                    return Ok(None);
                }
                if !room && !stalled {
                    stalled = true;
                    self.extra.stalls.fetch_add(1, Ordering::Relaxed);
                    self.ctl_cv.notify_all();
                }
                st = if !st.recs.is_empty() && !st.leader_active {
                    self.lead_one(st)
                } else {
                    self.cv
                        .wait_timeout(st, Duration::from_millis(50))
                        .expect("cache lock poisoned")
                        .0
                };
            }
            for r in &recs[ri..end] {
                st.recs.push(*r);
                if r.has_data() {
                    let at = st.data.len();
                    st.data.set_len(at + BLOCK_SIZE);
                    st.data[at..].copy_from_slice(&data[di * BLOCK_SIZE..(di + 1) * BLOCK_SIZE]);
                    di += 1;
                }
            }
            st.pending_bytes += need;
            seq = st.open_seq;
            ri = end;
        }
        Ok(Some(seq))
    }

    fn wait_durable(&self, seq: u64) -> Result<(), EngineError> {
        let mut st = lock(&self.st);
        loop {
            if let Some(r) = &st.failed {
                return Err(EngineError::Failed {
                    reason: format!("cache drive {}: {r}", self.id.drive),
                });
            }
            if st.durable_seq >= seq {
                return Ok(());
            }
            st = if st.leader_active || st.recs.is_empty() {
                self.cv.wait(st).expect("cache lock poisoned")
            } else {
                self.lead_one(st)
            };
        }
    }

    /// Writes the open batch: header and data, one flush; then indexes its records.
    fn lead_one<'a>(&'a self, mut st: MutexGuard<'a, LogState>) -> MutexGuard<'a, LogState> {
        st.leader_active = true;
        let seq = st.open_seq;
        st.open_seq += 1;
        let mut ld = lock(&self.leader);
        std::mem::swap(&mut st.recs, &mut ld.recs);
        std::mem::swap(&mut st.data, &mut ld.data);
        let nrec = ld.recs.len();
        let hl = hdr_len(nrec, self.sector);
        let len = hl + ld.data.len() as u64;
        let mut pos = st.head;
        let mut waste = 0;
        if pos + len > self.log_len {
            waste = self.log_len - pos;
            pos = 0;
        }
        st.pending_bytes = st
            .pending_bytes
            .saturating_sub((nrec * REC) as u64 + ld.data.len() as u64);
        st.used += waste + len;
        st.head = pos + len;
        st.placed.push_back(Placed {
            seq,
            off: pos,
            waste,
            len,
        });
        drop(st);
        let res = self.write_batch(&mut ld, seq, pos, hl, len);
        if res.is_ok() {
            let LeaderBufs { recs, .. } = &mut *ld;
            let recs = std::mem::take(recs);
            self.index_batch(&recs, pos, hl);
            lock(&self.batches).push_back(Batch {
                seq,
                off: pos,
                hdr_len: hl,
                recs,
            });
        }
        ld.recs.clear();
        ld.data.set_len(0);
        drop(ld);
        let mut st = lock(&self.st);
        match res {
            Ok(()) => st.durable_seq = seq,
            Err(e) => {
                log::error!("cache {} failed writing batch {seq}: {e}", self.id.drive);
                st.failed.get_or_insert_with(|| e.to_string());
            }
        }
        st.leader_active = false;
        self.cv.notify_all();
        st
    }

    fn write_batch(
        &self,
        ld: &mut LeaderBufs,
        seq: u64,
        pos: u64,
        hl: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let n = ld.recs.len();
        if ld.hdr.capacity() < hl as usize {
            ld.hdr = AlignedBuf::new(hl as usize);
        }
        ld.hdr.set_len(hl as usize);
        ld.hdr.fill(0);
        put_u32(&mut ld.hdr, 0, BATCH_MAGIC);
        put_u64(&mut ld.hdr, 8, self.log_gen);
        put_u64(&mut ld.hdr, 16, seq);
        put_u32(&mut ld.hdr, 24, len as u32);
        put_u32(&mut ld.hdr, 28, n as u32);
        put_u32(&mut ld.hdr, 32, hl as u32);
        for (i, r) in ld.recs.iter().enumerate() {
            r.encode(&mut ld.hdr[HDR + i * REC..HDR + (i + 1) * REC]);
        }
        let crc = crc32c::crc32c(&ld.hdr[8..HDR + n * REC]);
        put_u32(&mut ld.hdr, 4, crc);
        let t = self.counters.begin();
        let r = (|| {
            self.file
                .write_at(&ld.hdr, LOG_OFF + pos)
                .map_err(EngineError::io("write"))?;
            if !ld.data.is_empty() {
                self.file
                    .write_at(&ld.data, LOG_OFF + pos + hl)
                    .map_err(EngineError::io("write"))?;
            }
            self.file.sync().map_err(EngineError::io("sync"))
        })();
        self.counters.end(OpKind::Write, t);
        r?;
        let c = &self.counters;
        c.journal_write_bytes.fetch_add(hl, Ordering::Relaxed);
        c.data_write_bytes
            .fetch_add(ld.data.len() as u64, Ordering::Relaxed);
        c.flushes.fetch_add(1, Ordering::Relaxed);
        c.journal_batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Points the index at a durable batch's blocks. Dirty records were admitted under
    /// the block claim (their version check is done); clean ones only fill a gap.
    fn index_batch(&self, recs: &[Rec], off: u64, hl: u64) {
        let mut di = 0u64;
        for r in recs {
            if !r.has_data() {
                continue;
            }
            let loc = off + hl + di * BS;
            di += 1;
            let idx = self.ext((r.drive, r.key), true).expect("created");
            let mut m = lock(&idx.m);
            if r.kind == K_DIRTY {
                if m.entries
                    .get(&r.block)
                    .is_some_and(|e| e.version > r.version)
                {
                    // Logged versions of a block only rise, but for a carried block
                    // (`Cache::carry`), which must never hide a newer write.
                    continue;
                }
                let old = m.entries.insert(
                    r.block,
                    Entry {
                        loc,
                        version: r.version,
                        crc: r.crc,
                        dirty: true,
                        referenced: false,
                    },
                );
                self.account_replace(old, true);
            } else {
                let busy = m.overlaps(r.block, 1);
                let newest = self.capacity_version(r.drive, r.key, r.block) == Some(r.version);
                if !busy && newest && !m.entries.contains_key(&r.block) {
                    m.entries.insert(
                        r.block,
                        Entry {
                            loc,
                            version: r.version,
                            crc: r.crc,
                            dirty: false,
                            referenced: false,
                        },
                    );
                    self.extra.clean.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn account_replace(&self, old: Option<Entry>, new_dirty: bool) {
        let e = &self.extra;
        match old {
            Some(o) if o.dirty => {
                e.dirty.fetch_sub(1, Ordering::Relaxed);
            }
            Some(_) => {
                e.clean.fetch_sub(1, Ordering::Relaxed);
            }
            None => {}
        }
        if new_dirty {
            e.dirty.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn account_remove(&self, old: &Entry) {
        if old.dirty {
            self.extra.dirty.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.extra.clean.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn capacity_version(&self, drive: DriveId, key: ExtentKey, block: u32) -> Option<u64> {
        let cap = read(&self.capacity).get(&drive).cloned()?;
        cap.block_versions(key, u64::from(block) * BS, 1)
            .ok()
            .map(|v| v[0].0)
    }

    fn ext(&self, k: IdxKey, create: bool) -> Option<Arc<ExtIdx>> {
        if let Some(e) = read(&self.index).get(&k) {
            return Some(e.clone());
        }
        if !create {
            return None;
        }
        let mut w = self.index.write().unwrap_or_else(|p| p.into_inner());
        Some(w.entry(k).or_default().clone())
    }

    // ---- destage -------------------------------------------------------------------

    /// Starts the destage thread (once).
    pub fn start(self: &Arc<Self>) {
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("destage-{:x}", self.id.drive.0 & 0xffff))
            .spawn(move || me.destage_loop())
            .expect("spawning the destage thread");
    }

    /// Stops the destage thread (dirty data stays in the log; it is replayed at open).
    pub fn stop(&self) {
        lock(&self.ctl).stop = true;
        self.ctl_cv.notify_all();
    }

    /// Destages everything logged so far (dirty blocks reach capacity); returns when done.
    /// Destages every dirty block logged so far (capacity then holds every acked write).
    /// In read-write mode the logged copies stay as clean read-cache blocks, so a flush
    /// does not empty the read cache; in the other modes they are dropped. Returns when
    /// done.
    pub fn flush(&self) -> Result<(), EngineError> {
        self.check_failed()?;
        let _gate = lock(&self.destage_gate);
        let mut dirty: Vec<LiveBlock> = Vec::new();
        {
            let b = lock(&self.batches);
            for bt in b.iter() {
                for (di, r) in bt.recs.iter().filter(|r| r.has_data()).enumerate() {
                    let loc = bt.off + bt.hdr_len + di as u64 * BS;
                    if r.kind != K_DIRTY {
                        continue;
                    }
                    let Some(idx) = self.ext((r.drive, r.key), false) else {
                        continue;
                    };
                    let m = lock(&idx.m);
                    if let Some(e) = m.entries.get(&r.block) {
                        if e.loc == loc && e.dirty {
                            dirty.push((r.drive, r.key, r.block, loc, e.version, e.crc));
                        }
                    }
                }
            }
        }
        // Only read-write mode keeps a read cache; the other modes drop the copies.
        let mut carried = Vec::new();
        self.destage_live(
            &mut dirty,
            self.mode() == CacheMode::ReadWrite,
            &mut carried,
        )?;
        match carried.first() {
            None => Ok(()),
            // Not flushed: those acked writes are still only in the log (a clean shutdown
            // must not count this cache drive as holding nothing).
            Some(b) => Err(EngineError::Failed {
                reason: format!(
                    "cache {}: {} logged blocks of failed capacity drive {} stay in the log \
                     (they are destaged if the drive opens again at the node's restart)",
                    self.id.drive,
                    carried.len(),
                    b.0
                ),
            }),
        }
    }

    /// Writes live dirty blocks (capacity drive, extent, block, log offset, version, crc)
    /// to their capacity drives, per extent in address order, then marks each one not
    /// rewritten meanwhile clean (`keep_clean`: it stays as a read-cache copy) or forgets
    /// it. Blocks of a drive no longer bound are dropped. Blocks of a bound drive that has
    /// failed are left dirty and listed in `carried` (`Cache::carry`: the cache goes on
    /// for the other drives). A logged block failing its crc fails the cache (that acked
    /// write is lost on this node). Returns the bytes written.
    fn destage_live(
        &self,
        dirty: &mut [LiveBlock],
        keep_clean: bool,
        carried: &mut Vec<LiveBlock>,
    ) -> Result<u64, EngineError> {
        dirty.sort_unstable();
        let caps = read(&self.capacity).clone();
        let mut bytes = 0;
        let mut i = 0;
        while i < dirty.len() {
            let (drive, key) = (dirty[i].0, dirty[i].1);
            let s = i;
            while i < dirty.len() && (dirty[i].0, dirty[i].1) == (drive, key) {
                i += 1;
            }
            let blocks: Vec<(u32, u64, u64, u32)> =
                dirty[s..i].iter().map(|d| (d.2, d.3, d.4, d.5)).collect();
            let cap = caps.get(&drive);
            if cap.is_some_and(|c| c.failure().is_some()) {
                carried.extend_from_slice(&dirty[s..i]);
                continue;
            }
            match cap {
                Some(cap) => {
                    let mut failed_under = false;
                    for part in blocks.chunks(BATCH_BLOCKS_MAX) {
                        let (lost, _) = match self.destage_blocks(cap, key, part, false) {
                            // The drive failed under this destage: carry the extent's
                            // blocks (written or not: the log keeps them, newest wins).
                            Err(_) if cap.failure().is_some() => {
                                failed_under = true;
                                break;
                            }
                            r => r?,
                        };
                        if lost > 0 {
                            let e = EngineError::Corrupt(format!(
                                "{lost} logged blocks of extent {key:?} fail their checksum"
                            ));
                            self.fail(&e.to_string());
                            return Err(e);
                        }
                        bytes += part.len() as u64 * BS;
                    }
                    if failed_under {
                        carried.extend_from_slice(&dirty[s..i]);
                        continue;
                    }
                }
                None => log::warn!(
                    "cache {}: blocks of drive {} which is no longer bound are dropped",
                    self.id.drive,
                    drive
                ),
            }
            let Some(idx) = self.ext((drive, key), false) else {
                continue;
            };
            let mut m = lock(&idx.m);
            for d in &dirty[s..i] {
                let Some(e) = m.entries.get_mut(&d.2) else {
                    continue;
                };
                if e.loc != d.3 || !e.dirty {
                    continue;
                }
                if keep_clean && cap.is_some() {
                    e.dirty = false;
                    e.referenced = false;
                    self.extra.dirty.fetch_sub(1, Ordering::Relaxed);
                    self.extra.clean.fetch_add(1, Ordering::Relaxed);
                } else if let Some(e) = m.entries.remove(&d.2) {
                    self.account_remove(&e);
                }
            }
        }
        Ok(bytes)
    }

    /// Destages everything logged so far and reclaims its log space: afterwards no logged
    /// record older than this call can be replayed (a copy that rolls a block back to an
    /// older version needs that). Returns when done.
    pub fn drain(&self) -> Result<(), EngineError> {
        let target = {
            let st = lock(&self.st);
            if let Some(r) = &st.failed {
                return Err(EngineError::Failed { reason: r.clone() });
            }
            st.open_seq
        };
        {
            let mut c = lock(&self.ctl);
            c.drain_to = c.drain_to.max(target);
        }
        self.ctl_cv.notify_all();
        loop {
            self.check_failed()?;
            let done = {
                let b = lock(&self.batches);
                let st = lock(&self.st);
                let first_unreclaimed = b.front().map(|b| b.seq).unwrap_or(st.open_seq);
                let pending_before = st.placed.front().is_some_and(|p| p.seq < target);
                first_unreclaimed >= target && !pending_before
            };
            if done {
                return Ok(());
            }
            if !self.running.load(Ordering::Acquire) {
                self.destage_once(true)?;
                continue;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn destage_loop(self: Arc<Self>) {
        let mut last = Instant::now();
        loop {
            let (stop, drain) = {
                let c = lock(&self.ctl);
                (c.stop, c.drain_to)
            };
            if stop || self.failure().is_some() {
                self.running.store(false, Ordering::Release);
                return;
            }
            self.admit_pending();
            let s = self.stats();
            let used_pct = s.used_bytes * 100 / self.log_len.max(1);
            let dirty_pct = s.dirty_bytes * 100 / self.log_len.max(1);
            let high = u64::from(self.high_pct.load(Ordering::Relaxed));
            let low = u64::from(self.low_pct.load(Ordering::Relaxed));
            let first_seq = lock(&self.batches).front().map(|b| b.seq);
            let draining = first_seq.is_some_and(|s| s < drain);
            let stalled = s.write_stalls > 0 && used_pct >= high.saturating_sub(10);
            let full_speed = draining || used_pct >= high || dirty_pct >= high || stalled;
            let wanted = full_speed
                || dirty_pct >= low
                || (self.mode() == CacheMode::None && s.dirty_bytes > 0);
            if !wanted || first_seq.is_none() {
                let c = lock(&self.ctl);
                let _ = self
                    .ctl_cv
                    .wait_timeout(c, Duration::from_millis(100))
                    .expect("ctl lock poisoned");
                continue;
            }
            match self.destage_once(full_speed) {
                Ok(bytes) => {
                    if !full_speed && bytes > 0 {
                        let rate = self.destage_bps.load(Ordering::Relaxed).max(1) as f64;
                        let want = Duration::from_secs_f64(bytes as f64 / rate);
                        let spent = last.elapsed();
                        if want > spent {
                            let c = lock(&self.ctl);
                            let _ = self.ctl_cv.wait_timeout(c, want - spent);
                        }
                    }
                }
                Err(e) => {
                    self.fail(&format!("destage: {e}"));
                }
            }
            last = Instant::now();
        }
    }

    /// One step of background work without the destage thread, for deterministic
    /// simulation: queued read-cache admissions go into the log, then one chunk of the
    /// log's tail is reclaimed (destaged/evicted) if anything is logged. Returns the
    /// bytes destaged.
    pub fn background_step(&self, pressure: bool) -> Result<u64, EngineError> {
        self.admit_pending();
        self.destage_once(pressure)
    }

    /// Percent of the log in use (a simulation calls [`Cache::background_step`] before a
    /// write when this is high, as the destage thread would).
    pub fn used_pct(&self) -> u64 {
        lock(&self.st).used * 100 / self.log_len.max(1)
    }

    /// Moves read-cache admissions queued by readers into the log (never waits for room).
    fn admit_pending(&self) {
        let (recs, data) = {
            let mut c = lock(&self.ctl);
            if c.admit.is_empty() {
                return;
            }
            (
                std::mem::take(&mut c.admit),
                std::mem::take(&mut c.admit_data),
            )
        };
        if let Ok(Some(seq)) = self.append(&recs, &data, Room::Skip) {
            if self.wait_durable(seq).is_ok() {
                self.extra
                    .admitted
                    .fetch_add(recs.len() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Reclaims the oldest chunk of the log: destages its live dirty blocks, gives hot
    /// clean blocks a second chance (read-write mode) and evicts the rest, then moves the
    /// tail. Returns the bytes destaged.
    fn destage_once(&self, pressure: bool) -> Result<u64, EngineError> {
        let _gate = lock(&self.destage_gate);
        // The chunk: whole batches from the front, up to DESTAGE_CHUNK_BYTES.
        let mut chunk: Vec<(u64, Vec<Rec>, u64, u64)> = Vec::new();
        {
            let b = lock(&self.batches);
            let mut bytes = 0;
            for bt in b.iter() {
                let data = bt.recs.iter().filter(|r| r.has_data()).count() as u64 * BS;
                if !chunk.is_empty() && bytes + data > DESTAGE_CHUNK_BYTES {
                    break;
                }
                bytes += data;
                chunk.push((bt.seq, bt.recs.clone(), bt.off, bt.hdr_len));
            }
        }
        if chunk.is_empty() {
            return Ok(0);
        }
        let rw = self.mode() == CacheMode::ReadWrite;
        // Live records of the chunk.
        let mut dirty: Vec<LiveBlock> = Vec::new();
        let mut readmit: Vec<(Rec, u64)> = Vec::new();
        for (_, recs, off, hl) in &chunk {
            let mut di = 0u64;
            for r in recs {
                if !r.has_data() {
                    continue;
                }
                let loc = off + hl + di * BS;
                di += 1;
                let Some(idx) = self.ext((r.drive, r.key), false) else {
                    continue;
                };
                let mut m = lock(&idx.m);
                let Some(e) = m.entries.get(&r.block).copied() else {
                    continue;
                };
                if e.loc != loc {
                    continue;
                }
                if e.dirty {
                    dirty.push((r.drive, r.key, r.block, loc, e.version, e.crc));
                } else if rw && e.referenced && !pressure {
                    readmit.push((
                        Rec {
                            kind: K_CLEAN,
                            ..*r
                        },
                        loc,
                    ));
                    m.entries.remove(&r.block);
                    self.account_remove(&e);
                } else {
                    m.entries.remove(&r.block);
                    self.account_remove(&e);
                    self.extra.evicted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Destage: per drive and extent, in address order; a failed drive's blocks are
        // carried to the head of the log instead, before the tail moves past them.
        let mut carried = Vec::new();
        let bytes = self.destage_live(&mut dirty, false, &mut carried)?;
        self.carry(&carried)?;
        // Second chance for hot read-cached blocks: read them before their space goes.
        let mut readmit_data = Vec::new();
        if !readmit.is_empty() {
            let mut buf = AlignedBuf::new(readmit.len() * BLOCK_SIZE);
            self.read_locs(readmit.iter().map(|r| r.1), &mut buf)?;
            readmit_data.extend_from_slice(&buf);
        }
        // Move the tail past the chunk; durable before the space can be reused.
        let last_seq = chunk.last().map(|c| c.0).unwrap_or(0);
        let (tail, tail_seq, freed) = {
            let st = lock(&self.st);
            let mut freed = 0;
            let mut next = None;
            for p in st.placed.iter() {
                if p.seq <= last_seq {
                    freed += p.waste + p.len;
                } else {
                    next = Some((p.off, p.seq));
                    break;
                }
            }
            let (t, ts) = next.unwrap_or((st.head, st.open_seq));
            (t, ts, freed)
        };
        self.write_sb(tail, tail_seq)?;
        {
            let mut b = lock(&self.batches);
            while b.front().is_some_and(|x| x.seq <= last_seq) {
                b.pop_front();
            }
        }
        {
            let mut st = lock(&self.st);
            while st.placed.front().is_some_and(|p| p.seq <= last_seq) {
                st.placed.pop_front();
            }
            st.used = st.used.saturating_sub(freed);
        }
        self.cv.notify_all();
        if !readmit.is_empty() {
            let recs: Vec<Rec> = readmit.iter().map(|r| r.0).collect();
            // Only still-newest blocks get in (index_batch checks capacity's version).
            if let Ok(Some(seq)) = self.append(&recs, &readmit_data, Room::Skip) {
                let _ = self.wait_durable(seq);
            }
        }
        Ok(bytes)
    }

    // ---- binding ---------------------------------------------------------------------

    fn bind(&self, cap: Arc<Drive>) {
        let id = cap.identity().drive;
        self.capacity
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, cap);
    }

    /// Queues a block that missed twice for admission into the read cache.
    fn consider_admit(
        &self,
        drive: DriveId,
        key: ExtentKey,
        block: u32,
        version: u64,
        data: &[u8],
    ) {
        let k = (drive, key, block);
        {
            let mut g = lock(&self.ghost);
            if !g.set.remove(&k) {
                let cap = (self.log_len / BS / 4).max(1024) as usize;
                if g.set.insert(k) {
                    g.fifo.push_back(k);
                }
                while g.fifo.len() > cap {
                    if let Some(old) = g.fifo.pop_front() {
                        g.set.remove(&old);
                    }
                }
                return;
            }
        }
        let mut c = lock(&self.ctl);
        if c.admit.len() >= ADMIT_QUEUE_MAX {
            return;
        }
        c.admit.push(Rec {
            kind: K_CLEAN,
            block,
            drive,
            key,
            version,
            crc: crc32c::crc32c(data),
        });
        c.admit_data.extend_from_slice(data);
        drop(c);
        self.ctl_cv.notify_all();
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn rand_gen() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish() | 1
}

fn read_sb(file: &dyn BlockFile) -> Result<Option<CacheSb>, EngineError> {
    if file.len_bytes() < LOG_OFF {
        return Ok(None);
    }
    let mut b = AlignedBuf::new(SB_BLOCK as usize);
    let mut best: Option<CacheSb> = None;
    let mut any_magic = false;
    let mut err = None;
    for copy in 0..2u64 {
        file.read_at(&mut b, copy * SB_BLOCK)
            .map_err(EngineError::io("read"))?;
        match CacheSb::decode(&b) {
            Ok(Some(sb)) => {
                any_magic = true;
                if best.as_ref().is_none_or(|x| sb.generation > x.generation) {
                    best = Some(sb);
                }
            }
            Ok(None) => {}
            Err(e) => {
                any_magic = true;
                err = Some(e);
            }
        }
    }
    match (best, any_magic) {
        (Some(sb), _) => Ok(Some(sb)),
        (None, true) => Err(err.unwrap_or_else(|| EngineError::Corrupt("cache superblock".into()))),
        (None, false) => Ok(None),
    }
}

// ---- the tier: a capacity drive with its cache ------------------------------------------

/// A capacity drive as the node uses it: with a bound cache drive, writes go through the
/// cache's log (mode `write`/`read-write`) and reads see the newest version of each block
/// wherever it is. Without one, every call goes straight to the drive. Same contract as
/// [`Drive`]'s methods of the same names.
pub struct Tier {
    cap: Arc<Drive>,
    cache: RwLock<Option<Arc<Cache>>>,
    /// The node's working-set estimator, fed with the client I/O this drive serves
    /// ([`Tier::sample`]); unset in tools and tests that do not ask.
    sampler: std::sync::OnceLock<Arc<crate::shards::AccessSampler>>,
}

/// How a write through the tier decides per block (plain write vs. compare-and-set copy).
enum Accept<'a> {
    Newer(u64),
    Expect(&'a [Version], &'a [Version]),
}

impl Accept<'_> {
    fn version(&self, i: usize) -> u64 {
        match self {
            Accept::Newer(v) => *v,
            Accept::Expect(vs, _) => vs[i].0,
        }
    }
    fn ok(&self, i: usize, cur: u64) -> bool {
        match self {
            Accept::Newer(v) => *v >= cur,
            Accept::Expect(_, ex) => cur == ex[i].0,
        }
    }
}

impl Tier {
    pub fn new(cap: Arc<Drive>) -> Tier {
        Tier {
            cap,
            cache: RwLock::new(None),
            sampler: std::sync::OnceLock::new(),
        }
    }

    /// Feeds the client I/O of this drive to `sampler` from now on (once; later calls are
    /// ignored).
    pub fn set_sampler(&self, sampler: Arc<crate::shards::AccessSampler>) {
        let _ = self.sampler.set(sampler);
    }

    /// A client read or write of `len` bytes at `offset` of extent `key`: each 4 KiB block
    /// it covers is one access for the working-set estimator, if one is set.
    pub fn sample(&self, key: ExtentKey, offset: u64, len: u64, read: bool) {
        if let Some(s) = self.sampler.get() {
            s.io(key, offset, len, read);
        }
    }

    /// Binds this capacity drive to `cache` (at start-up, before I/O).
    pub fn bind(&self, cache: Arc<Cache>) {
        cache.bind(self.cap.clone());
        *self.cache.write().unwrap_or_else(|p| p.into_inner()) = Some(cache);
    }

    pub fn drive(&self) -> &Arc<Drive> {
        &self.cap
    }

    pub fn cache(&self) -> Option<Arc<Cache>> {
        read(&self.cache).clone()
    }

    pub fn identity(&self) -> &DriveIdentity {
        self.cap.identity()
    }

    /// Why the capacity drive itself failed, if it did. A failed cache drive is reported
    /// apart ([`Tier::cache_failure`]): until it is unbound, I/O through the tier fails.
    pub fn failure(&self) -> Option<String> {
        self.cap.failure()
    }

    /// Why the bound cache drive failed, if it did.
    pub fn cache_failure(&self) -> Option<String> {
        self.cache().and_then(|c| c.failure())
    }

    /// Drops the cache binding (after the cache drive failed and the copies that may miss
    /// its writes were marked stale): I/O goes straight to the capacity drive from now on.
    pub fn unbind(&self) {
        if let Some(c) = self.cache.write().unwrap_or_else(|p| p.into_inner()).take() {
            c.capacity
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.me());
        }
    }

    pub fn extents(&self) -> Vec<ExtentInfo> {
        self.cap.extents()
    }

    /// Sets how the capacity drive compresses the extent's later writes, destaged ones
    /// included ([`Drive::set_codec`]); the cache drive's log keeps blocks as written.
    pub fn set_codec(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        codec: converge_types::Compression,
    ) -> Result<(), EngineError> {
        self.cap.set_codec(key, epoch, codec)
    }

    /// How the extent's later writes are compressed.
    pub fn codec_of(&self, key: ExtentKey) -> converge_types::Compression {
        self.cap.codec_of(key)
    }

    /// Whether the capacity drive holds the extent.
    pub fn has_extent(&self, key: ExtentKey) -> bool {
        self.cap.has_extent(key)
    }

    pub fn capacity(&self) -> Capacity {
        self.cap.capacity()
    }

    pub fn stats(&self) -> DriveStats {
        self.cap.stats()
    }

    fn me(&self) -> DriveId {
        self.cap.identity().drive
    }

    /// Whether this tier's I/O is best driven inline from the thread (or task) that asks
    /// for it: a RAM capacity drive (a pread or pwrite of a few KiB there costs about a
    /// microsecond, less than handing it to another thread) with no cache drive bound (a
    /// write through a cache may wait for its log to make room, which is destage's work).
    pub fn inline_io(&self) -> bool {
        self.cap.identity().media == converge_types::MediaType::Ram && self.cache().is_none()
    }

    /// [`Tier::write`] up to the wait for durability: the data is written and its records
    /// queued; the write is durable (may be acked) once the returned [`Durable`] is waited
    /// for. Through a cache drive the whole write is done here (the `Durable` is done).
    #[allow(clippy::too_many_arguments)]
    pub fn write_begin(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<Durable, EngineError> {
        if self.cache().is_some() {
            return self
                .write(key, epoch, version, offset, data, crcs)
                .map(|()| Durable::done());
        }
        let (seq, t) = self
            .cap
            .write_nowait(key, epoch, version, offset, data, crcs)?;
        Ok(Durable::on(self.cap.clone(), seq, OpKind::Write, t))
    }

    /// [`Tier::write_blocks`] up to the wait for durability: (blocks written, what to wait
    /// for), as [`Tier::write_begin`].
    #[allow(clippy::too_many_arguments)]
    pub fn write_blocks_begin(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        versions: &[Version],
        expect: &[Version],
    ) -> Result<(u32, Durable), EngineError> {
        if self.cache().is_some() {
            return self
                .write_blocks(key, epoch, offset, data, crcs, versions, expect)
                .map(|n| (n, Durable::done()));
        }
        let (n, seq, t) = self
            .cap
            .write_blocks_nowait(key, epoch, offset, data, crcs, versions, expect)?;
        Ok((n, Durable::on(self.cap.clone(), seq, OpKind::Write, t)))
    }

    /// [`Tier::zero`] up to the wait for durability, as [`Tier::write_begin`].
    pub fn zero_begin(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<Durable, EngineError> {
        if self.cache().is_some() {
            return self
                .zero(key, epoch, version, offset, len)
                .map(|()| Durable::done());
        }
        let (seq, t) = self.cap.zero_nowait(key, epoch, version, offset, len)?;
        Ok(Durable::on(self.cap.clone(), seq, OpKind::Zero, t))
    }

    pub fn write(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(), EngineError> {
        match self.cache() {
            None => self.cap.write(key, epoch, version, offset, data, crcs),
            Some(c) => self
                .through(&c, key, epoch, offset, data, crcs, Accept::Newer(version.0))
                .map(|_| ()),
        }
    }

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
        let n = data.len() / BLOCK_SIZE;
        match self.cache() {
            Some(c) if versions.len() == n && expect.len() == n => self.through(
                &c,
                key,
                epoch,
                offset,
                data,
                crcs,
                Accept::Expect(versions, expect),
            ),
            _ => self
                .cap
                .write_blocks(key, epoch, offset, data, crcs, versions, expect),
        }
    }

    /// A write with a cache bound: claims the blocks in the cache's index, decides each
    /// block against the newest version (logged or on capacity), and logs the accepted
    /// ones — or, in mode `none` with nothing logged for these blocks, writes capacity.
    #[allow(clippy::too_many_arguments)]
    fn through(
        &self,
        c: &Cache,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        accept: Accept<'_>,
    ) -> Result<u32, EngineError> {
        let (first, count) = self.cap.checked_write_range(key, offset, data, crcs)?;
        c.check_failed()?;
        self.cap.prepare_write(key, epoch)?;
        let idx = c.ext((self.me(), key), true).expect("created");
        let m = idx.claim(key, first, count)?;
        let logged: Vec<Option<u64>> = (first..first + count)
            .map(|b| m.entries.get(&b).map(|e| e.version))
            .collect();
        drop(m);
        let release = || idx.unclaim(lock(&idx.m), first, count);
        let res = (|| {
            // A compare-and-set copy may roll a block back to an older version (resync and
            // reconcile replacing a deposed owner's unacked write with the acked one). The
            // log is reconciled with capacity by "newest version wins" (replay keeps a
            // block's highest logged version, destage and replay never lower capacity's),
            // which would bring the rolled-back write back. So such a copy does not go
            // through the log: everything logged is destaged first (no logged record can
            // outrank it any more), then capacity is written directly and the blocks'
            // cached copies are forgotten.
            if let Accept::Expect(vs, ex) = &accept {
                let capv = self.cap.block_versions(key, offset, count as usize)?;
                let lowers = (0..count as usize).any(|i| {
                    let cur = logged[i].unwrap_or(0).max(capv[i].0);
                    cur == ex[i].0 && vs[i].0 < cur
                });
                if lowers {
                    c.drain()?;
                    let n = self
                        .cap
                        .write_blocks(key, epoch, offset, data, crcs, vs, ex)?;
                    let mut m = lock(&idx.m);
                    for b in first..first + count {
                        if let Some(e) = m.entries.remove(&b) {
                            c.account_remove(&e);
                        }
                    }
                    return Ok(n);
                }
            }
            let direct = c.mode() == CacheMode::None && logged.iter().all(Option::is_none);
            if direct {
                return match &accept {
                    Accept::Newer(v) => self
                        .cap
                        .write(key, epoch, Version(*v), offset, data, crcs)
                        .map(|_| count),
                    Accept::Expect(vs, ex) => self
                        .cap
                        .write_blocks(key, epoch, offset, data, crcs, vs, ex),
                };
            }
            let capv = self.cap.block_versions(key, offset, count as usize)?;
            let mut recs = Vec::with_capacity(count as usize);
            let mut buf: Vec<u8> = Vec::new();
            let mut all = true;
            for i in 0..count as usize {
                let cur = logged[i].unwrap_or(0).max(capv[i].0);
                if accept.ok(i, cur) {
                    recs.push(Rec {
                        kind: K_DIRTY,
                        block: first + i as u32,
                        drive: self.me(),
                        key,
                        version: accept.version(i),
                        crc: crcs[i],
                    });
                    if !all {
                        buf.extend_from_slice(&data[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
                    }
                } else if all {
                    all = false;
                    buf.extend_from_slice(&data[..i * BLOCK_SIZE]);
                }
            }
            let n = recs.len() as u32;
            if n > 0 {
                let payload: &[u8] = if all { data } else { &buf };
                let t = c.counters.begin();
                let r = c
                    .append(&recs, payload, Room::Wait)
                    .and_then(|s| c.wait_durable(s.unwrap_or(0)));
                c.counters.end(OpKind::Write, t);
                r?;
            }
            Ok(n)
        })();
        release();
        res
    }

    pub fn read(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<ReadInfo, EngineError> {
        match self.cache() {
            None => self.cap.read(key, epoch, offset, buf),
            Some(c) => self.read_through(&c, key, epoch, offset, buf, None),
        }
    }

    pub fn read_blocks(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: &mut Vec<Version>,
    ) -> Result<ReadInfo, EngineError> {
        match self.cache() {
            None => self.cap.read_blocks(key, epoch, offset, buf, versions),
            Some(c) => self.read_through(&c, key, epoch, offset, buf, Some(versions)),
        }
    }

    fn read_through(
        &self,
        c: &Cache,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
        mut versions: Option<&mut Vec<Version>>,
    ) -> Result<ReadInfo, EngineError> {
        let (first, count) = self.cap.range(key, offset, buf.len() as u64)?;
        let rw = c.mode() == CacheMode::ReadWrite;
        let Some(idx) = c.ext((self.me(), key), false) else {
            c.extra
                .misses
                .fetch_add(u64::from(count), Ordering::Relaxed);
            return self.read_capacity(c, key, epoch, offset, buf, versions, first, rw);
        };
        c.check_failed()?;
        for _attempt in 0..4 {
            let hits: Vec<(usize, Entry)> = {
                let mut m = lock(&idx.m);
                (0..count as usize)
                    .filter_map(|i| {
                        m.entries.get_mut(&(first + i as u32)).map(|e| {
                            e.referenced = true;
                            (i, *e)
                        })
                    })
                    .collect()
            };
            if hits.is_empty() {
                c.extra
                    .misses
                    .fetch_add(u64::from(count), Ordering::Relaxed);
                return self.read_capacity(c, key, epoch, offset, buf, versions, first, rw);
            }
            let mut info = if hits.len() == count as usize {
                self.cap.check_epoch_of(key, epoch)?;
                if let Some(v) = versions.as_deref_mut() {
                    v.clear();
                    v.resize(count as usize, Version(0));
                }
                ReadInfo::default()
            } else {
                match versions.as_deref_mut() {
                    Some(v) => self.cap.read_blocks(key, epoch, offset, buf, v)?,
                    None => self.cap.read(key, epoch, offset, buf)?,
                }
            };
            // One read per run of blocks adjacent both in the request and in the log (a
            // logged write reads back with one pread), then each block's crc.
            let mut r = 0;
            while r < hits.len() {
                let s = r;
                r += 1;
                while r < hits.len()
                    && hits[r].0 == hits[r - 1].0 + 1
                    && hits[r].1.loc == hits[r - 1].1.loc + BS
                {
                    r += 1;
                }
                let (i0, i1) = (hits[s].0, hits[r - 1].0 + 1);
                c.read_locs(
                    (0..(i1 - i0) as u64).map(|k| hits[s].1.loc + k * BS),
                    &mut buf[i0 * BLOCK_SIZE..i1 * BLOCK_SIZE],
                )?;
            }
            let mut moved = false;
            let mut bad_cache = Vec::new();
            for &(i, e) in &hits {
                let out = &buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
                if crc32c::crc32c(out) != e.crc {
                    let still = lock(&idx.m)
                        .entries
                        .get(&(first + i as u32))
                        .is_some_and(|x| x.loc == e.loc);
                    if still {
                        bad_cache.push(i as u32);
                    } else {
                        moved = true;
                        break;
                    }
                }
            }
            if moved {
                continue;
            }
            // `hits` is in request order: drop capacity's verdict on the blocks it did not serve.
            let served_by_capacity =
                |b: &u32| hits.binary_search_by_key(&(*b as usize), |h| h.0).is_err();
            info.bad_blocks.retain(served_by_capacity);
            info.suspect.retain(served_by_capacity);
            info.bad_blocks.extend(bad_cache);
            info.bad_blocks.sort_unstable();
            let hv = hits.iter().map(|h| h.1.version).max().unwrap_or(0);
            info.versions = Version(info.versions.0.max(hv));
            if let Some(v) = versions.as_deref_mut() {
                for &(i, e) in &hits {
                    v[i] = Version(e.version);
                }
            }
            c.extra.hits.fetch_add(hits.len() as u64, Ordering::Relaxed);
            c.extra
                .misses
                .fetch_add(u64::from(count) - hits.len() as u64, Ordering::Relaxed);
            return Ok(info);
        }
        // The log kept moving under us (heavy destage): read without the cache's help is
        // not possible for blocks only it holds, so report them as an I/O retry.
        Err(EngineError::Failed {
            reason: "cache log reclaimed blocks while they were read; retry".into(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn read_capacity(
        &self,
        c: &Cache,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: Option<&mut Vec<Version>>,
        first: u32,
        rw: bool,
    ) -> Result<ReadInfo, EngineError> {
        if !rw {
            return match versions {
                Some(v) => self.cap.read_blocks(key, epoch, offset, buf, v),
                None => self.cap.read(key, epoch, offset, buf),
            };
        }
        let mut local = Vec::new();
        let v = versions.unwrap_or(&mut local);
        let info = self.cap.read_blocks(key, epoch, offset, buf, v)?;
        for (i, ver) in v.iter().enumerate() {
            // A suspect block is not admitted: a hit would no longer say so.
            if ver.0 > 0
                && !info.bad_blocks.contains(&(i as u32))
                && !info.suspect.contains(&(i as u32))
            {
                c.consider_admit(
                    self.me(),
                    key,
                    first + i as u32,
                    ver.0,
                    &buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE],
                );
            }
        }
        Ok(info)
    }

    pub fn zero(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let Some(c) = self.cache() else {
            return self.cap.zero(key, epoch, version, offset, len);
        };
        let (first, count) = self.cap.range(key, offset, len)?;
        c.check_failed()?;
        let idx = c.ext((self.me(), key), true).expect("created");
        drop(idx.claim(key, first, count)?);
        let r = self.cap.zero(key, epoch, version, offset, len);
        let mut m = lock(&idx.m);
        if r.is_ok() {
            for b in first..first + count {
                if m.entries.get(&b).is_some_and(|e| e.version <= version.0) {
                    if let Some(e) = m.entries.remove(&b) {
                        c.account_remove(&e);
                    }
                }
            }
        }
        idx.unclaim(m, first, count);
        r
    }

    /// Parity chunks' held writes, reverts and priors go around the cache (docs/CACHE.md,
    /// "Parity chunks"): priors live on the capacity drive, so it must hold the newest
    /// version of each block first. Under the blocks' claim (no write through the log
    /// joins meanwhile), a range with a logged block not yet destaged is drained first;
    /// then `op` runs on the capacity drive, and with `forget` the range's cached copies
    /// (clean by now, older than what `op` wrote) are dropped so reads see capacity.
    /// A logged record can never outrank a held write or its revert after that: every
    /// logged version is at most capacity's when the held write saved it as the prior.
    fn around<T>(
        &self,
        key: ExtentKey,
        offset: u64,
        len: u64,
        forget: bool,
        op: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let Some(c) = self.cache() else {
            return op();
        };
        // The range as blocks (`op` validates it; a revert or priors may span a slab).
        let first = u32::try_from(offset / BS).unwrap_or(u32::MAX);
        let count = u32::try_from(len.div_ceil(BS))
            .unwrap_or(u32::MAX)
            .min(u32::MAX - first);
        c.check_failed()?;
        let idx = c.ext((self.me(), key), true).expect("created");
        let m = idx.claim(key, first, count)?;
        let within = |b: u32| b >= first && b - first < count;
        let dirty = m.entries.iter().any(|(&b, e)| within(b) && e.dirty);
        drop(m);
        let res = (|| {
            if dirty {
                c.drain()?;
            }
            op()
        })();
        let mut m = lock(&idx.m);
        if forget && res.is_ok() {
            m.entries.retain(|&b, e| {
                if within(b) {
                    c.account_remove(e);
                }
                !within(b)
            });
        }
        idx.unclaim(m, first, count);
        res
    }

    /// [`Drive::set_snapshot_floor`]. Through a cache drive, around it ([`Tier::around`],
    /// the whole extent): every block logged before the snapshot reaches the capacity
    /// drive first, so a logged block of the snapshot's can never be replaced in the log
    /// by a later write before the capacity drive preserved it. Later writes through the
    /// log preserve on the capacity drive as they are destaged.
    pub fn set_snapshot_floor(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        previous: Option<Epoch>,
        history: converge_types::FloorHistory,
    ) -> Result<(), EngineError> {
        let slab = self.cap.layout().slab_size_bytes;
        self.around(key, 0, slab, false, || {
            self.cap
                .set_snapshot_floor(key, epoch, snapshot, previous, history)
        })
    }

    /// [`Drive::drop_snapshot`]: preserved states live on the capacity drive only.
    pub fn drop_snapshot(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        below: Option<Epoch>,
    ) -> Result<(), EngineError> {
        self.cap.drop_snapshot(key, epoch, snapshot, below)
    }

    /// [`Drive::read_at`]. Blocks still in a bound cache drive's log were written after
    /// the floor was set (see [`Tier::set_snapshot_floor`]), so no snapshot reads them;
    /// a range holding a logged block is drained first all the same (around it), so the
    /// answer never depends on that.
    pub fn read_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<ReadInfo, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, buf.len() as u64, false, || {
            self.cap.read_at(key, epoch, snapshot, offset, buf)
        })
    }

    /// [`Drive::changed`], around a bound cache drive: blocks still in the log were written
    /// after every snapshot (a floor drains the log), so the live side must see them; a
    /// range holding one is drained first ([`Tier::around`]).
    pub fn changed(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        from: Epoch,
        to: Option<Epoch>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, len, false, || {
            self.cap.changed(key, epoch, from, to, offset, len)
        })
    }

    /// [`Drive::versions_at`], around a bound cache drive ([`Tier::around`]), as
    /// [`Tier::read_at`].
    #[allow(clippy::too_many_arguments)]
    pub fn versions_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        count: u32,
        any: bool,
    ) -> Result<Vec<Version>, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, u64::from(count) * BS, false, || {
            self.cap
                .versions_at(key, epoch, snapshot, offset, count, any)
        })
    }

    /// [`Drive::read_blocks_at`], around a bound cache drive, as [`Tier::read_at`].
    pub fn read_blocks_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: &mut Vec<Version>,
    ) -> Result<ReadInfo, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, buf.len() as u64, false, || {
            self.cap
                .read_blocks_at(key, epoch, snapshot, offset, buf, versions)
        })
    }

    /// [`Drive::write_shadow`]: preserved states live on the capacity drive only.
    #[allow(clippy::too_many_arguments)]
    pub fn write_shadow(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        versions: &[Version],
    ) -> Result<u32, EngineError> {
        self.cap
            .write_shadow(key, epoch, snapshot, offset, data, crcs, versions)
    }

    /// [`Drive::kept_blocks`]: what snapshots keep is on the capacity drive (a floor
    /// destages the extent's logged blocks first).
    pub fn kept_blocks(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshots: &[Epoch],
    ) -> Result<Vec<(u64, u64)>, EngineError> {
        self.cap.kept_blocks(key, epoch, snapshots)
    }

    /// [`Drive::absent`], around a bound cache drive: a block still in the log was
    /// written, so a range holding one is drained first ([`Tier::around`]).
    pub fn absent(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        at: Option<Epoch>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, len, false, || {
            self.cap.absent(key, epoch, at, offset, len)
        })
    }

    /// [`Drive::write_held`], around a bound cache drive ([`Tier::around`]).
    pub fn write_held(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
    ) -> Result<(), EngineError> {
        self.around(key, offset, data.len() as u64, true, || {
            self.cap.write_held(key, epoch, version, offset, data, crcs)
        })
    }

    /// [`Drive::settle`]: drops priors only, so the cache has nothing to do with it.
    pub fn settle_held(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
        rows: &[converge_types::SettleRows],
    ) -> Result<(), EngineError> {
        self.cap.settle(key, epoch, upto, rows)
    }

    /// [`Drive::revert`], around a bound cache drive ([`Tier::around`]).
    pub fn revert(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<u32, EngineError> {
        self.around(key, offset, len, true, || {
            self.cap.revert(key, epoch, version, offset, len)
        })
    }

    /// [`Drive::priors`], refused below the extent's epoch; around a bound cache drive
    /// ([`Tier::around`]), so the current versions are capacity's and the newest.
    pub fn priors(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        count: usize,
    ) -> Result<Vec<(Version, Option<Version>)>, EngineError> {
        self.cap.check_epoch_of(key, epoch)?;
        self.around(key, offset, count as u64 * BS, false, || {
            self.cap.priors(key, offset, count)
        })
    }

    pub fn block_versions(
        &self,
        key: ExtentKey,
        offset: u64,
        count: usize,
    ) -> Result<Vec<Version>, EngineError> {
        let mut v = self.cap.block_versions(key, offset, count)?;
        if let Some(c) = self.cache() {
            if let Some(idx) = c.ext((self.me(), key), false) {
                let first = (offset / BS) as u32;
                let m = lock(&idx.m);
                for (i, x) in v.iter_mut().enumerate() {
                    if let Some(e) = m.entries.get(&(first + i as u32)) {
                        *x = Version(x.0.max(e.version));
                    }
                }
            }
        }
        Ok(v)
    }

    pub fn fence(&self, key: ExtentKey, epoch: Epoch) -> Result<(), EngineError> {
        self.cap.fence(key, epoch)?;
        self.settle(key);
        Ok(())
    }

    /// Waits for writes through the tier that passed the epoch check before a fence.
    fn settle(&self, key: ExtentKey) {
        if let Some(c) = self.cache() {
            if let Some(idx) = c.ext((self.me(), key), false) {
                let mut m = lock(&idx.m);
                while !m.busy.is_empty() {
                    m = idx.cv.wait(m).expect("cache index lock poisoned");
                }
            }
        }
    }

    pub fn fence_and_digest(&self, key: ExtentKey, epoch: Epoch) -> Result<u64, EngineError> {
        let Some(c) = self.cache() else {
            return self.cap.fence_and_digest(key, epoch);
        };
        self.cap.fence(key, epoch)?;
        self.settle(key);
        let overrides: Vec<(u32, u64)> = match c.ext((self.me(), key), false) {
            Some(idx) => {
                let m = lock(&idx.m);
                let blocks: Vec<u32> = m.entries.keys().copied().collect();
                let mut o = Vec::with_capacity(blocks.len());
                for b in blocks {
                    let e = m.entries[&b];
                    let capv = self.cap.block_versions(key, u64::from(b) * BS, 1)?[0].0;
                    o.push((b, e.version.max(capv)));
                }
                o
            }
            None => Vec::new(),
        };
        self.cap.fence_and_digest_with(key, epoch, &overrides)
    }

    /// Frees the extent: its logged blocks are forgotten durably first (a drop record),
    /// so a crash can never replay them into a later extent of the same key.
    pub fn free_extent(&self, key: ExtentKey) -> Result<(), EngineError> {
        if let Some(c) = self.cache() {
            let _gate = lock(&c.destage_gate);
            let k = (self.me(), key);
            let removed = c
                .index
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&k);
            if let Some(idx) = removed {
                let mut m = lock(&idx.m);
                m.dropped = true;
                for e in m.entries.values() {
                    c.account_remove(e);
                }
            }
            self.log_drop(&c, key)?;
        }
        self.cap.free_extent(key)
    }

    /// Forgets the extent's logged blocks durably (a drop record), so a crash can never
    /// replay them into a later extent of the same key.
    fn log_drop(&self, c: &Cache, key: ExtentKey) -> Result<(), EngineError> {
        let rec = Rec {
            kind: K_DROP,
            block: 0,
            drive: self.me(),
            key,
            version: 0,
            crc: 0,
        };
        let seq = c.append(&[rec], &[], Room::Force)?;
        c.wait_durable(seq.unwrap_or(0))
    }

    /// Frees the extent if it holds nothing newer than `upto`, as
    /// [`Drive::release_extent`]; through a cache drive, the log's entries count too, and
    /// they are forgotten durably (a drop record) before the capacity drive frees the
    /// extent. Writes through the tier to this extent are held off meanwhile (its index
    /// entry is locked, destage is paused); one that was waiting is refused afterwards.
    pub fn release_extent(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        upto: Version,
    ) -> Result<bool, EngineError> {
        let Some(c) = self.cache() else {
            return self.cap.release_extent(key, epoch, upto);
        };
        let _gate = lock(&c.destage_gate);
        let k = (self.me(), key);
        let idx = c.ext(k, true).expect("created");
        let mut m = lock(&idx.m);
        if !m.busy.is_empty()
            || m.entries.values().any(|e| e.version > upto.0)
            || !self.cap.releasable(key, epoch, upto)?
        {
            return Ok(false);
        }
        self.log_drop(&c, key)?;
        // Nothing can have changed the capacity extent since the check: every write
        // through the tier marks this entry busy first, and destage is paused.
        let freed = self.cap.release_extent(key, epoch, upto)?;
        m.dropped = true;
        for e in m.entries.values() {
            c.account_remove(e);
        }
        m.entries.clear();
        drop(m);
        idx.cv.notify_all();
        let mut w = c.index.write().unwrap_or_else(|p| p.into_inner());
        if w.get(&k).is_some_and(|cur| Arc::ptr_eq(cur, &idx)) {
            w.remove(&k);
        }
        Ok(freed)
    }
}

mod carry;
#[cfg(test)]
mod tests;
