//! Format, probe and open: reads the superblock and metadata, replays the journal, decides
//! for each block the journal touched last whether its data is the new or the old version,
//! and checkpoints the result before serving I/O.

use crate::drive::{CommitState, Drive, Extent, FormatOptions, LeaderState, Slot, Table};
use crate::error::EngineError;
use crate::file::{AlignedBuf, BlockFile};
use crate::layout::{
    batch_crc_ok, batch_header, decode_meta_sector, decode_table_sector, BlockMeta, DriveIdentity,
    ExtentEntry, Layout, Record, Superblock, BATCH_HEADER, BLOCK, BLOCKS_PER_META_PAGE,
    DEFAULT_OVERCOMMIT, EXT_PER_PAGE, EXT_PER_SECTOR, FORMAT_VERSION, META_PER_SECTOR, RECORD,
    SECTOR,
};
use crate::pool::Pool;
use crate::stats::Counters;
use converge_types::{Compression, ExtentKey};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Upper bound of records per journal batch (bytes), whatever the journal size.
const BATCH_RECORDS_MAX_BYTES: usize = 1 << 20;
/// Checkpoint writes are coalesced up to this many bytes.
const PAGE_BUF_BYTES: usize = 256 << 10;

/// The metadata journal by default: 1/32 of the drive, between 1 MiB and 2 GiB. Its size
/// sets how often the durable metadata is checkpointed in place, and so what checkpoints
/// add to every write: random 4 KiB writes dirty a metadata page each (4 KiB for 192
/// blocks), so a journal that holds few writes between checkpoints costs a page per write
/// or so. At 1/128 (the old default) checkpoints added 0.045 to mirror-3's write
/// amplification on the lab's 2 GiB drives at QD 32, at 1/32 0.011 (docs/PERFORMANCE.md).
/// The cap bounds replay at open (at most half the journal is read).
fn default_journal_bytes(len: u64) -> u64 {
    (len / 32).clamp(1 << 20, 2 << 30) / BLOCK * BLOCK
}

/// Reads both superblock copies; the valid one with the highest generation wins.
fn read_superblock(file: &dyn BlockFile) -> Result<Option<Superblock>, EngineError> {
    if file.len_bytes() < 2 * BLOCK {
        return Ok(None);
    }
    let mut b = AlignedBuf::new(2 * BLOCK as usize);
    file.read_at(&mut b, 0)
        .map_err(EngineError::io("read superblock"))?;
    let a = Superblock::decode(&b[..BLOCK as usize]);
    let c = Superblock::decode(&b[BLOCK as usize..]);
    match (a, c) {
        (Ok(Some(x)), Ok(Some(y))) => Ok(Some(if y.generation > x.generation { y } else { x })),
        (Ok(Some(x)), _) | (_, Ok(Some(x))) => Ok(Some(x)),
        (Ok(None), Ok(None)) => Ok(None),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

/// Journal I/O unit: 512 if the device takes 512-byte O_DIRECT I/O, else 4096.
/// A read probe has the same alignment rules as a write and cannot damage anything.
fn probe_journal_sector(file: &dyn BlockFile, journal_off: u64) -> usize {
    let mut b = AlignedBuf::new(SECTOR);
    match file.read_at(&mut b[..SECTOR], journal_off + SECTOR as u64) {
        Ok(()) => SECTOR,
        Err(_) => BLOCK as usize,
    }
}

/// Per-slot state while replaying.
type State = (BlockMeta, Option<BlockMeta>);

/// Sets a block's state (and prior) during replay, remembering the states the current
/// journal batch gave it (each list starting with its state before that batch).
fn touch(
    exts: &mut [Option<RExtent>],
    cands: &mut HashMap<(u32, u32), Vec<State>>,
    dirty_meta: &mut BTreeSet<(u32, u32)>,
    slot: u32,
    block: u32,
    meta: BlockMeta,
    prior: Option<BlockMeta>,
) {
    let Some(Some(e)) = exts.get_mut(slot as usize) else {
        return;
    };
    let Some(cur) = e.blocks.get_mut(block as usize) else {
        return;
    };
    let before = (*cur, e.held.get(&block).copied());
    cands
        .entry((slot, block))
        .or_insert_with(|| vec![before])
        .push((meta, prior));
    *cur = meta;
    match prior {
        Some(p) => e.held.insert(block, p),
        None => e.held.remove(&block),
    };
    dirty_meta.insert((slot, block / BLOCKS_PER_META_PAGE));
}

/// The prior block `block` of extent `slot` holds during replay.
fn held_of(exts: &[Option<RExtent>], slot: u32, block: u32) -> Option<BlockMeta> {
    exts.get(slot as usize)?.as_ref()?.held.get(&block).copied()
}

struct RExtent {
    key: ExtentKey,
    epoch: u64,
    codec: Compression,
    /// 0: live. Else a shadow: its snapshot's epoch (docs/adr/0012).
    shadow: u32,
    /// A live extent's snapshot floor, and the oldest snapshot it holds.
    floor: u32,
    since: u32,
    blocks: Vec<BlockMeta>,
    /// Priors of held writes (docs/adr/0008): from Prior records only, never in pages.
    held: HashMap<u32, BlockMeta>,
}

/// Picks the metadata a block gets after a crash. `cands` are its states in order: the one
/// before the last journal batch (durable: every earlier batch was synced), then one per
/// record of the last batch, which may not have been synced. `crc_of(state)` is the crc of
/// the content the state names as the device holds it now: its physical block's, or its
/// slice of its compressed stream (None: out of range, or a stream that does not
/// decompress).
///
/// Writes go out of place and a block's previous physical block is not reused before the
/// record replacing it is durable, so every state's data is still where it names unless
/// its own write was lost or torn. The newest proven state wins: a zero (metadata only,
/// in a batch that is on the device), a data state whose crc matches its block; if no
/// state of the last batch is proven, the state before it, when proven. If none is (rot
/// on top of a lost write), the newest is kept and reads report the block as bad, never
/// silently an older state.
/// Returns the index of the chosen state.
pub(crate) fn choose(
    cands: &[BlockMeta],
    crc_of: &mut dyn FnMut(&BlockMeta) -> Result<Option<u32>, EngineError>,
) -> Result<usize, EngineError> {
    let last = cands
        .len()
        .checked_sub(1)
        .expect("a touched block has candidates");
    for (i, c) in cands.iter().enumerate().skip(1).rev() {
        if !c.has_data() || crc_of(c)? == Some(c.crc) {
            return Ok(i);
        }
    }
    let pre = cands[0];
    if !pre.has_data() || crc_of(&pre)? == Some(pre.crc) {
        return Ok(0);
    }
    Ok(last)
}

/// Marks the storage of state `m` used in `pool`: its block, or its stream (once for all
/// the members naming it: `streams` holds the streams marked). False when it is out of
/// range or overlaps storage another state names.
fn mark_state(pool: &mut Pool, streams: &mut HashMap<u32, u32>, m: &BlockMeta) -> bool {
    let Some((first, len)) = m.run() else {
        return true;
    };
    if m.is_packed() {
        if let Some(&l) = streams.get(&first) {
            return l == len;
        }
        let Some(end) = first.checked_add(len) else {
            return false;
        };
        if end > pool.total() || (first..end).any(|p| pool.is_used(p)) {
            return false;
        }
        for p in first..end {
            pool.mark(p);
        }
        streams.insert(first, len);
        true
    } else {
        pool.mark(first)
    }
}

impl Drive {
    /// Formats with default options (see [`FormatOptions`]).
    pub fn format(file: Arc<dyn BlockFile>, id: DriveIdentity) -> Result<Drive, EngineError> {
        Self::format_with(file, id, FormatOptions::default())
    }

    /// Writes a fresh layout (empty extent table, new superblocks) and opens the drive.
    /// Whatever the drive held is gone.
    pub fn format_with(
        file: Arc<dyn BlockFile>,
        id: DriveIdentity,
        opts: FormatOptions,
    ) -> Result<Drive, EngineError> {
        let len = file.len_bytes();
        let jlen = opts
            .journal_bytes
            .unwrap_or_else(|| default_journal_bytes(len));
        let overcommit = opts.overcommit.unwrap_or(DEFAULT_OVERCOMMIT);
        let layout = Layout::compute(len, id.slab_size_bytes, jlen, overcommit)?;
        let js = probe_journal_sector(&*file, layout.journal_off);
        if file.is_regular_file() {
            // Overwrites go to the spare blocks first: allocate them in the file now, so
            // the file system does not on the data path (on a sparse file the first write
            // of a block costs an allocation and a file-system journal commit at the sync).
            let spare = layout.spare_blocks();
            let start = layout.phys_off((layout.data_blocks - spare) as u32);
            let zero = AlignedBuf::new(1 << 20);
            let end = start + spare * BLOCK;
            let mut off = start;
            while off < end {
                let n = (end - off).min(zero.len() as u64) as usize;
                file.write_at(&zero[..n], off)
                    .map_err(EngineError::io("format: write the spare blocks"))?;
                off += n as u64;
            }
        }
        // A reused device may hold an old extent table: zero ours.
        let zero = AlignedBuf::new((layout.table_len as usize).min(1 << 20));
        let mut off = 0;
        while off < layout.table_len {
            let n = (layout.table_len - off).min(zero.len() as u64) as usize;
            file.write_at(&zero[..n], layout.table_off + off)
                .map_err(EngineError::io("format: zero extent table"))?;
            off += n as u64;
        }
        // A random journal generation: batches left by an earlier format never replay.
        let mut sb = Superblock {
            identity: id,
            layout,
            generation: 0,
            journal_gen: rand::random::<u64>(),
            journal_tail: 0,
            journal_tail_seq: 1,
            journal_sector: js as u32,
            format_version: FORMAT_VERSION,
        };
        let mut b = AlignedBuf::new(BLOCK as usize);
        for g in 0..2u64 {
            sb.generation = g;
            sb.encode(&mut b);
            file.write_at(&b, g * BLOCK)
                .map_err(EngineError::io("format: write superblock"))?;
        }
        file.sync().map_err(EngineError::io("format: sync"))?;
        Self::open(file)
    }

    /// Ok(None): no converge superblock (blank or foreign). Err: converge but damaged.
    pub fn probe(file: &dyn BlockFile) -> Result<Option<DriveIdentity>, EngineError> {
        Ok(read_superblock(file)?.map(|sb| sb.identity))
    }

    /// Opens a formatted drive, recovering from a crash if there was one. The caller
    /// compares `identity()` with what it expects (cluster, node, drive id).
    pub fn open(file: Arc<dyn BlockFile>) -> Result<Drive, EngineError> {
        let sb = read_superblock(&*file)?.ok_or(EngineError::NotFormatted)?;
        let layout = sb.layout.clone();
        if file.len_bytes() < layout.len_bytes {
            return Err(EngineError::Corrupt(format!(
                "device has {} bytes but was formatted with {}",
                file.len_bytes(),
                layout.len_bytes
            )));
        }
        let counters = Counters::new();
        let read = |buf: &mut [u8], off: u64| -> Result<(), EngineError> {
            file.read_at(buf, off)
                .map_err(EngineError::io("open: read metadata"))?;
            counters
                .read_bytes
                .fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        };
        let e_total = layout.extents_total as usize;
        let bpe = layout.blocks_per_extent as usize;

        // Extent table.
        let mut exts: Vec<Option<RExtent>> = (0..e_total).map(|_| None).collect();
        let mut tb = AlignedBuf::new(layout.table_len as usize);
        read(&mut tb, layout.table_off)?;
        let mut entries = [ExtentEntry::default(); EXT_PER_SECTOR as usize];
        for (sector, raw) in tb.chunks_exact(SECTOR).enumerate() {
            if !decode_table_sector(raw, sector as u32, &mut entries) {
                return Err(EngineError::Corrupt(format!(
                    "extent table sector {sector} is damaged; the drive's extents must be rebuilt from other copies"
                )));
            }
            for (i, e) in entries.iter().enumerate() {
                let slot = sector * EXT_PER_SECTOR as usize + i;
                match (e.in_use, e.key) {
                    (true, Some(key)) if slot < e_total => {
                        exts[slot] = Some(RExtent {
                            key,
                            epoch: e.epoch,
                            codec: e.codec,
                            shadow: if e.shadow { e.aux.max(1) } else { 0 },
                            floor: if e.shadow { 0 } else { e.aux },
                            since: e.since,
                            blocks: Vec::new(),
                            held: HashMap::new(),
                        })
                    }
                    (true, _) => {
                        return Err(EngineError::Corrupt(format!(
                            "extent table names slot {slot} beyond the {e_total} slots"
                        )))
                    }
                    _ => {}
                }
            }
        }

        // Per-block metadata of allocated extents.
        let spe = layout.meta_sectors_per_extent as usize;
        let mut mb = AlignedBuf::new(spe * SECTOR);
        let mut sector_metas = [BlockMeta::default(); META_PER_SECTOR as usize];
        for (slot, e) in exts.iter_mut().enumerate() {
            let Some(e) = e else { continue };
            read(&mut mb, layout.meta_page_off(slot as u32, 0))?;
            e.blocks = vec![BlockMeta::default(); bpe];
            for (sector, raw) in mb.chunks_exact(SECTOR).enumerate() {
                let first = sector * META_PER_SECTOR as usize;
                if first >= bpe {
                    break;
                }
                let end = (first + META_PER_SECTOR as usize).min(bpe);
                if decode_meta_sector(raw, slot as u32, sector as u32, &mut sector_metas) {
                    e.blocks[first..end].copy_from_slice(&sector_metas[..end - first]);
                } else {
                    // Lost metadata: report these blocks as bad until rewritten or resynced.
                    log::warn!(
                        "drive {}: metadata sector {sector} of extent {:?} is damaged; \
                         its {} blocks will read as bad",
                        sb.identity.drive,
                        e.key,
                        end - first
                    );
                    e.blocks[first..end].fill(BlockMeta::BAD);
                }
            }
        }

        // Journal replay.
        let js = sb.journal_sector as u64;
        let jlen = layout.journal_len;
        let mut pos = sb.journal_tail;
        let mut seq = sb.journal_tail_seq;
        let mut jbuf = AlignedBuf::new(js as usize);
        // States (metadata, prior) of the blocks the current (finally: the last) batch
        // touched, each list starting with the block's state before that batch.
        let mut cands: HashMap<(u32, u32), Vec<State>> = HashMap::new();
        let mut dirty_meta: BTreeSet<(u32, u32)> = BTreeSet::new();

        let mut reset_slots: BTreeSet<u32> = BTreeSet::new();
        // Shadow extents by (key, snapshot), as replay goes.
        let mut shadow_slots: BTreeMap<(ExtentKey, u32), u32> = exts
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e.as_ref()?;
                (e.shadow != 0).then_some(((e.key, e.shadow), i as u32))
            })
            .collect();
        // Blocks the current batch preserved: (live slot, block) → (shadow slot, the
        // shadow's state of the block before), to undo if the block goes back to its state
        // before the batch.
        let mut preserved: HashMap<(u32, u32), (u32, BlockMeta)> = HashMap::new();
        // Copies the current batch kept for a snapshot (PreserveCopy): (live slot, block) →
        // the copy, whose data is checked as the batch's writes are.
        let mut copied: HashMap<(u32, u32), BlockMeta> = HashMap::new();
        let mut batches = 0u64;
        let read_batch =
            |at: u64, seq: u64, jbuf: &mut AlignedBuf| -> Result<Option<(u64, u32)>, EngineError> {
                if at + js > jlen {
                    return Ok(None);
                }
                jbuf.set_len(js as usize);
                read(&mut jbuf[..], layout.journal_off + at)?;
                let Some((len, nrec)) = batch_header(jbuf, sb.journal_gen, seq) else {
                    return Ok(None);
                };
                let len64 = len as u64;
                if !len64.is_multiple_of(js) || at + len64 > jlen {
                    return Ok(None);
                }
                if jbuf.capacity() < len {
                    let mut bigger = AlignedBuf::new(len);
                    bigger[..js as usize].copy_from_slice(&jbuf[..js as usize]);
                    *jbuf = bigger;
                }
                jbuf.set_len(len);
                if len64 > js {
                    read(&mut jbuf[js as usize..len], layout.journal_off + at + js)?;
                }
                Ok(batch_crc_ok(jbuf, len).then_some((len64, nrec)))
            };
        loop {
            let (at, len, nrec) = match read_batch(pos, seq, &mut jbuf)? {
                Some((len, n)) => (pos, len, n),
                None if pos != 0 => match read_batch(0, seq, &mut jbuf)? {
                    Some((len, n)) => (0, len, n),
                    None => break,
                },
                None => break,
            };
            cands.clear();
            preserved.clear();
            copied.clear();
            let recs = &jbuf[BATCH_HEADER..BATCH_HEADER + nrec as usize * RECORD];
            let decoded = recs
                .chunks_exact(RECORD)
                .map(|raw| {
                    Record::decode(raw).ok_or_else(|| {
                        EngineError::Corrupt(format!(
                            "journal batch {seq} holds an unknown record kind {}",
                            raw[0]
                        ))
                    })
                })
                .collect::<Result<Vec<Record>, EngineError>>()?;
            // Epochs stay below 2^32 (a version's upper half; the extent table keeps the
            // extent's snapshot range in the rest of the field).
            if let Some(e) = decoded.iter().find_map(|r| match r {
                Record::Alloc { epoch, .. } | Record::Epoch { epoch, .. }
                    if epoch.0 > u64::from(u32::MAX) =>
                {
                    Some(*epoch)
                }
                _ => None,
            }) {
                return Err(EngineError::Corrupt(format!(
                    "journal batch {seq} names epoch {e}, beyond 2^32"
                )));
            }
            let mut i = 0;
            while i < decoded.len() {
                let rec = decoded[i];
                i += 1;
                match rec {
                    Record::Data {
                        slot,
                        block,
                        crc,
                        version,
                        phys,
                        hold,
                        pack,
                    } => {
                        let prior = hold.then(|| held_of(&exts, slot, block)).flatten();
                        touch(
                            &mut exts,
                            &mut cands,
                            &mut dirty_meta,
                            slot,
                            block,
                            BlockMeta::data_packed(version, crc, phys, pack),
                            prior,
                        );
                    }
                    Record::Prior { slot, block, meta } => {
                        // Paired with the held write that follows it (queued together),
                        // or a checkpoint's re-log of a prior.
                        match decoded.get(i) {
                            Some(&Record::Data {
                                slot: s2,
                                block: b2,
                                crc,
                                version,
                                phys,
                                hold: true,
                                pack,
                            }) if s2 == slot && b2 == block => {
                                i += 1;
                                let m = BlockMeta::data_packed(version, crc, phys, pack);
                                touch(
                                    &mut exts,
                                    &mut cands,
                                    &mut dirty_meta,
                                    slot,
                                    block,
                                    m,
                                    Some(meta),
                                );
                            }
                            _ => {
                                if let Some(Some(e)) = exts.get_mut(slot as usize) {
                                    if (block as usize) < e.blocks.len() {
                                        e.held.insert(block, meta);
                                    }
                                }
                            }
                        }
                    }
                    Record::Revert {
                        slot,
                        block,
                        version,
                    } => {
                        let Some(Some(e)) = exts.get(slot as usize) else {
                            continue;
                        };
                        let at = e.blocks.get(block as usize).map(|c| c.version);
                        if let (Some(p), Some(v)) = (e.held.get(&block).copied(), at) {
                            if v == version {
                                touch(&mut exts, &mut cands, &mut dirty_meta, slot, block, p, None);
                            }
                        }
                    }
                    Record::Settle {
                        slot,
                        upto,
                        first,
                        count,
                    } => {
                        let Some(Some(e)) = exts.get(slot as usize) else {
                            continue;
                        };
                        let rows = (count > 0).then_some((first, count));
                        let drop: Vec<u32> = e
                            .held
                            .keys()
                            .copied()
                            .filter(|&b| {
                                crate::drive::settles(rows, b)
                                    && e.blocks.get(b as usize).is_none_or(|c| c.version <= upto)
                            })
                            .collect();
                        for b in drop {
                            if cands.contains_key(&(slot, b)) {
                                let cur =
                                    exts[slot as usize].as_ref().map(|e| e.blocks[b as usize]);
                                if let Some(cur) = cur {
                                    touch(
                                        &mut exts,
                                        &mut cands,
                                        &mut dirty_meta,
                                        slot,
                                        b,
                                        cur,
                                        None,
                                    );
                                }
                            } else if let Some(Some(e)) = exts.get_mut(slot as usize) {
                                e.held.remove(&b);
                            }
                        }
                    }
                    Record::Zero {
                        slot,
                        block,
                        count,
                        version,
                    } => {
                        // `touch` ignores blocks past the extent: do not visit them, or a
                        // damaged count keeps open busy for up to 2^32 iterations.
                        let end = block.saturating_add(count).min(bpe as u32);
                        for b in block..end {
                            touch(
                                &mut exts,
                                &mut cands,
                                &mut dirty_meta,
                                slot,
                                b,
                                BlockMeta::zero(version),
                                None,
                            );
                        }
                    }
                    Record::Alloc { slot, key, epoch } => {
                        if (slot as usize) < e_total {
                            shadow_slots.retain(|_, s| *s != slot);
                            exts[slot as usize] = Some(RExtent {
                                key,
                                epoch: epoch.0,
                                codec: Compression::None,
                                shadow: 0,
                                floor: 0,
                                since: crate::layout::SINCE_NONE,
                                blocks: vec![BlockMeta::default(); bpe],
                                held: HashMap::new(),
                            });
                            cands.retain(|k, _| k.0 != slot);
                            preserved.retain(|_, v| v.0 != slot);
                            reset_slots.insert(slot);
                        }
                    }
                    Record::Shadow { slot, key, epoch } => {
                        if (slot as usize) < e_total && epoch > 0 {
                            shadow_slots.retain(|_, s| *s != slot);
                            exts[slot as usize] = Some(RExtent {
                                key,
                                epoch: 0,
                                codec: Compression::None,
                                shadow: epoch,
                                floor: 0,
                                since: 0,
                                blocks: vec![BlockMeta::default(); bpe],
                                held: HashMap::new(),
                            });
                            shadow_slots.insert((key, epoch), slot);
                            cands.retain(|k, _| k.0 != slot);
                            preserved.retain(|_, v| v.0 != slot);
                            reset_slots.insert(slot);
                        }
                    }
                    Record::Floor { slot, floor, since } => {
                        if let Some(Some(e)) = exts.get_mut(slot as usize) {
                            if e.shadow == 0 {
                                e.floor = floor;
                                e.since = since;
                            }
                        }
                    }
                    Record::Preserve {
                        slot,
                        block,
                        snapshot,
                        meta,
                    } => {
                        let Some(Some(live)) = exts.get(slot as usize) else {
                            continue;
                        };
                        if live.shadow != 0 {
                            continue;
                        }
                        // As `apply_preserve`: the snapshot's shadow, else the floor's.
                        let target = crate::drive::preserve_target(snapshot, live.floor, |e| {
                            shadow_slots.get(&(live.key, e)).copied()
                        });
                        let Some((tslot, upto)) = target else {
                            continue;
                        };
                        let Some(&cur) = live.blocks.get(block as usize) else {
                            continue;
                        };
                        if meta == BlockMeta::default()
                            || crate::drive::epoch_of(&meta) > u64::from(upto)
                        {
                            continue;
                        }
                        // The record names the state it preserves: replayed over metadata
                        // pages newer than it (a checkpoint cut short), the live block may
                        // hold a later state already, which stays; the shadow gets the
                        // state either way.
                        let moves = cur == meta;
                        let before = (cur, live.held.get(&block).copied());
                        let Some(Some(sh)) = exts.get_mut(tslot as usize) else {
                            continue;
                        };
                        let prev = sh.blocks[block as usize];
                        if crate::drive::shadow_takes(&prev, &meta) {
                            sh.blocks[block as usize] = meta;
                        }
                        preserved.entry((slot, block)).or_insert((tslot, prev));
                        if moves {
                            cands.entry((slot, block)).or_insert_with(|| vec![before]);
                            if let Some(Some(live)) = exts.get_mut(slot as usize) {
                                live.blocks[block as usize] = BlockMeta::default();
                            }
                        }
                        dirty_meta.insert((slot, block / BLOCKS_PER_META_PAGE));
                        dirty_meta.insert((tslot, block / BLOCKS_PER_META_PAGE));
                    }
                    Record::PreserveCopy {
                        slot,
                        block,
                        snapshot,
                        meta,
                    } => {
                        let Some(Some(live)) = exts.get(slot as usize) else {
                            continue;
                        };
                        if live.shadow != 0 || (block as usize) >= live.blocks.len() {
                            continue;
                        }
                        let target = crate::drive::preserve_target(snapshot, live.floor, |e| {
                            shadow_slots.get(&(live.key, e)).copied()
                        });
                        let Some((tslot, upto)) = target else {
                            continue;
                        };
                        if (meta.run().is_none() && !meta.is_bad())
                            || crate::drive::epoch_of(&meta) > u64::from(upto)
                        {
                            continue;
                        }
                        // The live block keeps its state (other members name its stream);
                        // the shadow gets the copy, whatever newer pages say of the live
                        // block (as for Preserve). A rollback of the live block to that
                        // state undoes it (`preserved`).
                        let Some(Some(sh)) = exts.get_mut(tslot as usize) else {
                            continue;
                        };
                        let prev = sh.blocks[block as usize];
                        if crate::drive::shadow_takes(&prev, &meta) {
                            sh.blocks[block as usize] = meta;
                        }
                        preserved.entry((slot, block)).or_insert((tslot, prev));
                        copied.insert((slot, block), meta);
                        dirty_meta.insert((tslot, block / BLOCKS_PER_META_PAGE));
                    }
                    Record::Retire { slot } => {
                        if let Some(Some(sh)) = exts.get(slot as usize) {
                            if sh.shadow != 0
                                && shadow_slots.get(&(sh.key, sh.shadow)) == Some(&slot)
                            {
                                shadow_slots.remove(&(sh.key, sh.shadow));
                            }
                        }
                    }
                    Record::Keep {
                        slot,
                        block,
                        from,
                        meta,
                    } => {
                        let is_shadow_of = |e: &Option<RExtent>, key: Option<ExtentKey>| {
                            e.as_ref()
                                .is_some_and(|e| e.shadow != 0 && key.is_none_or(|k| k == e.key))
                        };
                        let Some(dst) = exts.get(slot as usize) else {
                            continue;
                        };
                        if !is_shadow_of(dst, None) || from == slot {
                            continue;
                        }
                        let key = dst.as_ref().map(|e| e.key);
                        // The state goes into the shadow whatever the source's pages say
                        // (they may be newer than the record); the source lets it go if
                        // it still holds it.
                        if let Some(Some(d)) = exts.get_mut(slot as usize) {
                            if let Some(prev) = d.blocks.get(block as usize).copied() {
                                if crate::drive::shadow_takes(&prev, &meta) {
                                    d.blocks[block as usize] = meta;
                                }
                                dirty_meta.insert((slot, block / BLOCKS_PER_META_PAGE));
                            }
                        }
                        if exts
                            .get(from as usize)
                            .is_some_and(|e| is_shadow_of(e, key))
                        {
                            if let Some(Some(src)) = exts.get_mut(from as usize) {
                                if src.blocks.get(block as usize) == Some(&meta) {
                                    src.blocks[block as usize] = BlockMeta::default();
                                    dirty_meta.insert((from, block / BLOCKS_PER_META_PAGE));
                                }
                            }
                        }
                    }
                    Record::DropShadow { slot } => {
                        if exts
                            .get(slot as usize)
                            .is_some_and(|e| e.as_ref().is_some_and(|e| e.shadow != 0))
                        {
                            shadow_slots.retain(|_, s| *s != slot);
                            exts[slot as usize] = None;
                            cands.retain(|k, _| k.0 != slot);
                            preserved.retain(|_, v| v.0 != slot);
                        }
                    }
                    Record::Epoch { slot, epoch } => {
                        if let Some(Some(e)) = exts.get_mut(slot as usize) {
                            e.epoch = e.epoch.max(epoch.0);
                        }
                    }
                    Record::Codec { slot, codec } => {
                        if let Some(Some(e)) = exts.get_mut(slot as usize) {
                            e.codec = codec;
                        }
                    }
                    Record::Free { slot } => {
                        if (slot as usize) < e_total {
                            shadow_slots.retain(|_, s| *s != slot);
                            exts[slot as usize] = None;
                            cands.retain(|k, _| k.0 != slot);
                            preserved.retain(|_, v| v.0 != slot);
                        }
                    }
                }
            }
            batches += 1;
            pos = at + len;
            seq += 1;
            if batches > jlen / js + 1 {
                return Err(EngineError::Corrupt(
                    "journal replay does not terminate".into(),
                ));
            }
        }

        // Only the last batch can be unsynced: each earlier one was synced after the data
        // its records name (written before they were queued). So only blocks the last
        // batch touched need their data checked against their states.
        let mut check: Vec<(u32, u32)> = cands.keys().copied().collect();
        check.sort_unstable();
        let mut dbuf = AlignedBuf::new(BLOCK as usize);
        // Streams read so far (compressed groups' members share one), decompressed.
        let mut streams_read: HashMap<(u32, u32), Option<Vec<u8>>> = HashMap::new();
        let mut crc_of = |m: &BlockMeta| -> Result<Option<u32>, EngineError> {
            let Some((first, len)) = m.run() else {
                return Ok(None);
            };
            if u64::from(first) + u64::from(len) > layout.data_blocks {
                return Ok(None);
            }
            if !m.is_packed() {
                read(&mut dbuf, layout.phys_off(first))?;
                return Ok(Some(crc32c::crc32c(&dbuf)));
            }
            if let std::collections::hash_map::Entry::Vacant(e) =
                streams_read.entry((first, m.flags))
            {
                let mut raw = AlignedBuf::new(len as usize * BLOCK as usize);
                read(&mut raw, layout.phys_off(first))?;
                let mut plain = vec![0u8; m.group_blocks() as usize * BLOCK as usize];
                let ok = crate::codec::decompress(
                    m.codec(),
                    &raw[..m.stream_len() as usize],
                    &mut plain,
                );
                e.insert(ok.then_some(plain));
            }
            let at = m.member() as usize * BLOCK as usize;
            Ok(streams_read
                .get(&(first, m.flags))
                .and_then(|p| p.as_ref())
                .and_then(|p| p.get(at..at + BLOCK as usize))
                .map(crc32c::crc32c))
        };
        let mut rolled_back = 0u64;
        for key in &check {
            let Some(list) = cands.get(key) else { continue };
            let Some(Some(e)) = exts.get_mut(key.0 as usize) else {
                continue;
            };
            let metas: Vec<BlockMeta> = list.iter().map(|c| c.0).collect();
            let mut chosen = choose(&metas, &mut crc_of)?;
            // A copy kept for a snapshot whose data did not reach the device: the batch
            // was never acked, so its write of the block goes too, back to the state the
            // copy was of (its stream is whole: nothing reused it after this batch).
            if let Some(copy) = copied.get(key) {
                if chosen > 0 && copy.run().is_some() && crc_of(copy)? != Some(copy.crc) {
                    chosen = 0;
                }
            }
            // A newer state of the batch did not match its crc: the crash cut its write
            // short, or its block rotted after an acked write. Keep the proven older state
            // but mark it, so the owner checks it against the other copies first.
            e.blocks[key.1 as usize] = if chosen + 1 < metas.len() {
                rolled_back += 1;
                metas[chosen].suspect()
            } else {
                metas[chosen]
            };
            match list[chosen].1 {
                Some(p) => e.held.insert(key.1, p),
                None => e.held.remove(&key.1),
            };
            // Back to its state before the batch: a Preserve of that state in the batch is
            // undone too (the state is the live one again).
            if chosen == 0 {
                if let Some(&(tslot, prev)) = preserved.get(key) {
                    if let Some(Some(sh)) = exts.get_mut(tslot as usize) {
                        if sh.shadow != 0 {
                            sh.blocks[key.1 as usize] = prev;
                        }
                    }
                }
            }
        }
        // A shadow whose live extent is gone (never left by this build: a live extent's
        // free frees its shadows in the same batch) holds nothing anyone reads.
        let live_keys: std::collections::HashSet<ExtentKey> = exts
            .iter()
            .flatten()
            .filter(|e| e.shadow == 0)
            .map(|e| e.key)
            .collect();
        for (slot, e) in exts.iter_mut().enumerate() {
            if e.as_ref()
                .is_some_and(|e| e.shadow != 0 && !live_keys.contains(&e.key))
            {
                log::warn!(
                    "drive {}: shadow extent in slot {slot} has no live extent; dropped",
                    sb.identity.drive
                );
                *e = None;
                reset_slots.insert(slot as u32);
            }
        }

        counters
            .rolled_back_at_open
            .store(rolled_back, Ordering::Relaxed);
        if rolled_back > 0 {
            log::warn!(
                "drive {}: {rolled_back} blocks of the journal's last batch did not match \
                 their checksum and went back to their previous state; they read as suspect \
                 until their owner checks them against the other copies",
                sb.identity.drive
            );
        }
        // The free-block map, from the metadata. A block naming a physical block that is
        // out of range or already named by another has lost its metadata: bad (resync
        // rewrites it).
        let mut pool = Pool::new(
            layout.data_blocks as u32,
            layout.data_extents * layout.blocks_per_extent,
        );
        let mut lost = 0u64;
        // Streams marked (first block → blocks): a stream's members all name it.
        let mut streams: HashMap<u32, u32> = HashMap::new();
        for (slot, e) in exts.iter_mut().enumerate() {
            let Some(e) = e else { continue };
            // The homes of an allocated extent are (nearly always) written: relocated
            // blocks may go there without the file system allocating space.
            let home = layout.home_block(slot as u32, 0);
            if home != u32::MAX {
                pool.note_written(home, layout.blocks_per_extent);
            }
            for (b, m) in e.blocks.iter_mut().enumerate() {
                if !mark_state(&mut pool, &mut streams, m) {
                    *m = BlockMeta::BAD;
                    lost += 1;
                    dirty_meta.insert((slot as u32, b as u32 / BLOCKS_PER_META_PAGE));
                }
            }
        }
        if lost > 0 {
            log::warn!(
                "drive {}: {lost} blocks name a physical block out of range or named twice; \
                 they will read as bad",
                sb.identity.drive
            );
        }
        // Priors, after every block's current state: a prior is only kept when it is
        // older than its block and its physical block is named by nothing else (replay
        // over metadata pages newer than a record can leave one that no longer is).
        let mut held_total = 0u64;
        let mut priors_dropped = 0u64;
        for e in exts.iter_mut().flatten() {
            let blocks = &e.blocks;
            e.held.retain(|&b, p| {
                let keep = blocks
                    .get(b as usize)
                    .is_some_and(|c| p.version < c.version)
                    && !p.is_bad()
                    && mark_state(&mut pool, &mut streams, p);
                if !keep {
                    priors_dropped += 1;
                }
                keep
            });
            held_total += e.held.len() as u64;
        }
        if priors_dropped > 0 {
            log::info!(
                "drive {}: {priors_dropped} priors no longer apply after replay; dropped",
                sb.identity.drive
            );
        }

        // Build the live state.
        for &slot in &reset_slots {
            for p in 0..layout.meta_pages_per_extent() {
                dirty_meta.insert((slot, p));
            }
        }
        let (mut plain_extents, mut plain_stored, mut thin_stored) = (0u64, 0u64, 0u64);
        let mut shadow_stored = 0u64;
        let mut slots = Vec::with_capacity(e_total);
        let mut by_key = HashMap::new();
        let mut shadows = BTreeMap::new();
        let mut free = Vec::new();
        for (slot, e) in exts.into_iter().enumerate() {
            match e {
                Some(e) if e.shadow != 0 => {
                    if shadows.insert((e.key, e.shadow), slot as u32).is_some() {
                        return Err(EngineError::Corrupt(format!(
                            "extent {:?} has two shadows of snapshot {}",
                            e.key, e.shadow
                        )));
                    }
                    let ext = Arc::new(Extent::new_shadow(e.key, slot as u32, e.shadow, e.blocks));
                    shadow_stored +=
                        u64::from(ext.meta.lock().expect("fresh extent lock").stored_blocks);
                    slots.push(Slot {
                        live: Some(ext.clone()),
                        durable: Some(ext),
                        entry: ExtentEntry {
                            in_use: true,
                            key: Some(e.key),
                            epoch: 0,
                            codec: Compression::None,
                            shadow: true,
                            aux: e.shadow,
                            since: 0,
                        },
                    });
                }
                Some(e) => {
                    if by_key.insert(e.key, slot as u32).is_some() {
                        return Err(EngineError::Corrupt(format!(
                            "extent {:?} appears twice in the extent table",
                            e.key
                        )));
                    }
                    let ext = Arc::new(Extent::new(e.key, slot as u32, e.epoch, 0, e.blocks));
                    ext.meta.lock().expect("fresh extent lock").held = e.held;
                    ext.codec.store(e.codec.code(), Ordering::Relaxed);
                    ext.floor.store(e.floor, Ordering::Relaxed);
                    ext.since.store(e.since, Ordering::Relaxed);
                    let stored =
                        u64::from(ext.meta.lock().expect("fresh extent lock").stored_blocks);
                    if e.codec.is_none() {
                        plain_extents += 1;
                        plain_stored += stored;
                    } else {
                        thin_stored += stored;
                    }
                    slots.push(Slot {
                        live: Some(ext.clone()),
                        durable: Some(ext),
                        entry: ExtentEntry {
                            in_use: true,
                            key: Some(e.key),
                            epoch: e.epoch,
                            codec: e.codec,
                            shadow: false,
                            aux: e.floor,
                            since: e.since,
                        },
                    });
                }
                None => slots.push(Slot {
                    live: None,
                    durable: None,
                    entry: ExtentEntry::default(),
                }),
            }
        }
        for slot in (0..e_total as u32).rev() {
            if slots[slot as usize].live.is_none() {
                free.push(slot);
            }
        }
        let js_now = probe_journal_sector(&*file, layout.journal_off);
        let journal_len = layout.journal_len as usize;
        let batch_records_max =
            (BATCH_RECORDS_MAX_BYTES.min(journal_len / 4) - BATCH_HEADER) / RECORD * RECORD;
        let dirty_table: BTreeSet<u32> = (0..(e_total as u32).div_ceil(EXT_PER_PAGE)).collect();
        // A new journal generation for this mount: batches of the previous one are done.
        let mut new_sb = sb.clone();
        new_sb.journal_gen = sb.journal_gen.wrapping_add(1);
        let drive = Drive {
            file,
            id: sb.identity.clone(),
            layout,
            table: Mutex::new(Table {
                slots,
                by_key,
                durable_shadows: shadows.clone(),
                shadows,
                free,
            }),
            pool: Mutex::new(pool),
            commit: Mutex::new(CommitState {
                pending: Vec::with_capacity(batch_records_max),
                open_seq: seq,
                durable_seq: seq - 1,
                leader_active: false,
                failed: None,
                pool_waiters: 0,
                wakers: Vec::new(),
                cv_waiters: 0,
            }),
            commit_cv: Condvar::new(),
            leader: Mutex::new(LeaderState {
                sb: new_sb,
                // The new generation starts where the replayed window ends, so the
                // checkpoint below can re-log priors without touching that window.
                head: if pos >= jlen { 0 } else { pos },
                used: 0,
                used_at_checkpoint: 0,
                next_seq: seq,
                jseq_skew: 0,
                spare: Vec::with_capacity(batch_records_max),
                batch_buf: AlignedBuf::new(batch_records_max + BATCH_HEADER + BLOCK as usize),
                page_buf: AlignedBuf::new(PAGE_BUF_BYTES),
                dirty_meta,
                dirty_table,
                gone: Vec::new(),
                orphans: Vec::new(),
            }),
            counters,
            journal_sector: js_now,
            batch_records_max,
            held_blocks: AtomicU64::new(held_total),
            packing: sb.format_version >= 3,
            plain_extents: AtomicU64::new(plain_extents),
            plain_stored: AtomicU64::new(plain_stored),
            thin_stored: AtomicU64::new(thin_stored),
            shadow_stored: AtomicU64::new(shadow_stored),
            snapshot_ops: Mutex::new(()),
            batches_written: AtomicU64::new(0),
            batches_seen_quiet: AtomicU64::new(0),
        };
        if batches > 0 {
            log::info!(
                "drive {}: replayed {batches} journal batches ({} blocks of the last checked)",
                drive.id.drive,
                check.len()
            );
        }
        // Persist the recovery decisions before any new write can change the data they
        // were based on; this also starts the new journal generation.
        {
            let mut ld = crate::drive::lock(&drive.leader);
            drive.checkpoint_locked(&mut ld)?;
        }
        Ok(drive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data at version `v` with crc `crc`, in physical block `crc` (so a test's disk is a
    /// map from physical block to the crc it holds).
    fn d(crc: u32, v: u64) -> BlockMeta {
        BlockMeta::data(v, crc, crc)
    }
    fn z(v: u64) -> BlockMeta {
        BlockMeta::zero(v)
    }
    /// Picks with a disk on which exactly the physical blocks `landed` hold their data.
    fn pick(cands: &[BlockMeta], landed: &[u32]) -> BlockMeta {
        let i = choose(cands, &mut |m| {
            Ok(Some(if landed.contains(&m.phys) {
                m.phys
            } else {
                0xdead
            }))
        })
        .unwrap();
        cands[i]
    }

    #[test]
    fn choose_prefers_newest_proven_state() {
        // New data landed.
        assert_eq!(pick(&[d(1, 1), d(2, 2)], &[1, 2]), d(2, 2));
        // New data did not land or tore: the old is still in its own block.
        assert_eq!(pick(&[d(1, 1), d(2, 2)], &[1]), d(1, 1));
        // A first write that did not land: the block stays unwritten.
        assert_eq!(pick(&[z(0), d(3, 3)], &[]), z(0));
        // A zero, then a write that did not land: the zero.
        assert_eq!(pick(&[d(1, 1), z(2), d(3, 3)], &[1]), z(2));
        // Latest is metadata-only: nothing to check.
        assert_eq!(pick(&[d(1, 1), z(2)], &[]), z(2));
        // Two writes in the batch: the newest that landed.
        assert_eq!(pick(&[d(1, 1), d(2, 2), d(4, 4)], &[1, 2]), d(2, 2));
        assert_eq!(pick(&[d(1, 1), d(2, 2), d(4, 4)], &[1, 2, 4]), d(4, 4));
        // Nothing proven (rot under a lost write): keep the newest, reads report it bad.
        assert_eq!(pick(&[d(1, 1), d(2, 2)], &[]), d(2, 2));
        // A bad block before the batch and a write that did not land: still bad.
        assert_eq!(pick(&[BlockMeta::BAD, d(3, 3)], &[]), BlockMeta::BAD);
        assert_eq!(pick(&[BlockMeta::BAD, d(3, 3)], &[3]), d(3, 3));
        // An out-of-range block proves nothing.
        assert_eq!(
            choose(&[d(1, 1), d(2, 2)], &mut |m| Ok((m.phys == 1).then_some(1))).unwrap(),
            0
        );
    }
}
