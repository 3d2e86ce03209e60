//! Format, probe and open: reads the superblock and metadata, replays the journal, decides
//! for each block the journal touched last whether its data is the new or the old version,
//! and checkpoints the result before serving I/O.

use crate::drive::{CommitState, Drive, Extent, FormatOptions, LeaderState, Slot, Table};
use crate::error::EngineError;
use crate::file::{AlignedBuf, BlockFile};
use crate::layout::{
    batch_crc_ok, batch_header, decode_meta_sector, decode_table_sector, BlockMeta, DriveIdentity,
    ExtentEntry, Layout, Record, Superblock, BATCH_HEADER, BLOCK, BLOCKS_PER_META_PAGE,
    EXT_PER_PAGE, EXT_PER_SECTOR, META_PER_SECTOR, RECORD, SECTOR,
};
use crate::stats::Counters;
use converge_types::ExtentKey;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};

/// Upper bound of records per journal batch (bytes), whatever the journal size.
const BATCH_RECORDS_MAX_BYTES: usize = 1 << 20;
/// Checkpoint writes are coalesced up to this many bytes.
const PAGE_BUF_BYTES: usize = 256 << 10;

fn default_journal_bytes(len: u64) -> u64 {
    (len / 128).clamp(1 << 20, 128 << 20) / BLOCK * BLOCK
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
struct RExtent {
    key: ExtentKey,
    epoch: u64,
    blocks: Vec<BlockMeta>,
}

/// Picks the metadata a block gets after a crash. `cands` are its states in order: the
/// checkpointed one, then one per journal record. Data candidates are proven by their crc
/// matching what is on disk; a metadata-only state (zero) is proven when the data it was
/// applied over is still on disk (no later write reached the block). If nothing is proven,
/// the latest state is kept and its crc mismatch reports the block as bad on read (a torn
/// write, or rot: never silently an older state, which could be an acked write's loss).
pub(crate) fn choose(cands: &[BlockMeta], disk_crc: u32) -> BlockMeta {
    let last = *cands.last().expect("a touched block has candidates");
    if !last.has_data() {
        return last;
    }
    for i in (0..cands.len()).rev() {
        let c = cands[i];
        if c.is_bad() {
            break;
        }
        if c.has_data() {
            if c.crc == disk_crc {
                return c;
            }
            continue;
        }
        let before = cands[..i].iter().rev().find(|p| p.has_data() || p.is_bad());
        if before.is_some_and(|p| p.has_data() && p.crc == disk_crc) {
            return c;
        }
    }
    last
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
        let layout = Layout::compute(len, id.slab_size_bytes, jlen)?;
        let js = probe_journal_sector(&*file, layout.journal_off);
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
                            blocks: Vec::new(),
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
        let mut cands: HashMap<(u32, u32), Vec<BlockMeta>> = HashMap::new();
        let mut last_batch: HashSet<(u32, u32)> = HashSet::new();

        let mut reset_slots: BTreeSet<u32> = BTreeSet::new();
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
            last_batch.clear();
            let recs = &jbuf[BATCH_HEADER..BATCH_HEADER + nrec as usize * RECORD];
            for raw in recs.chunks_exact(RECORD) {
                let rec = Record::decode(raw).ok_or_else(|| {
                    EngineError::Corrupt(format!(
                        "journal batch {seq} holds an unknown record kind {}",
                        raw[0]
                    ))
                })?;
                let mut touch = |slot: u32, block: u32, meta: BlockMeta| {
                    let Some(Some(e)) = exts.get_mut(slot as usize) else {
                        return;
                    };
                    let Some(cur) = e.blocks.get_mut(block as usize) else {
                        return;
                    };
                    cands
                        .entry((slot, block))
                        .or_insert_with(|| vec![*cur])
                        .push(meta);
                    *cur = meta;
                    last_batch.insert((slot, block));
                };
                match rec {
                    Record::Data {
                        slot,
                        block,
                        crc,
                        version,
                        intent: _,
                    } => touch(
                        slot,
                        block,
                        BlockMeta {
                            version,
                            crc,
                            flags: crate::layout::F_DATA,
                        },
                    ),
                    Record::Zero {
                        slot,
                        block,
                        count,
                        version,
                    } => {
                        for b in block..block.saturating_add(count) {
                            touch(
                                slot,
                                b,
                                BlockMeta {
                                    version,
                                    crc: 0,
                                    flags: 0,
                                },
                            );
                        }
                    }
                    Record::Alloc { slot, key, epoch } => {
                        if (slot as usize) < e_total {
                            exts[slot as usize] = Some(RExtent {
                                key,
                                epoch: epoch.0,
                                blocks: vec![BlockMeta::default(); bpe],
                            });
                            cands.retain(|k, _| k.0 != slot);
                            last_batch.retain(|k| k.0 != slot);
                            reset_slots.insert(slot);
                        }
                    }
                    Record::Epoch { slot, epoch } => {
                        if let Some(Some(e)) = exts.get_mut(slot as usize) {
                            e.epoch = e.epoch.max(epoch.0);
                        }
                    }
                    Record::Free { slot } => {
                        if (slot as usize) < e_total {
                            exts[slot as usize] = None;
                            cands.retain(|k, _| k.0 != slot);
                            last_batch.retain(|k| k.0 != slot);
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

        // Only the last batch can be unsynced: every earlier one was synced after the data
        // of its first writes (written before their records) and of its overwrites (written
        // after the batch, before its sync). So only blocks the last batch touched need
        // their data checked against their states; read them in disk order.
        let mut check: Vec<(u32, u32)> = last_batch.iter().copied().collect();
        check.sort_unstable();
        let mut dbuf = AlignedBuf::new(BLOCK as usize);
        for key in &check {
            let Some(list) = cands.get(key) else { continue };
            let Some(Some(e)) = exts.get_mut(key.0 as usize) else {
                continue;
            };
            let chosen = if list.last().is_some_and(|m| m.has_data()) {
                read(&mut dbuf, layout.data_block_off(key.0, key.1))?;
                choose(list, crc32c::crc32c(&dbuf))
            } else {
                *list.last().expect("non-empty")
            };
            e.blocks[key.1 as usize] = chosen;
        }

        // Build the live state.
        let mut dirty_meta: BTreeSet<(u32, u32)> = BTreeSet::new();
        for &(slot, block) in cands.keys() {
            dirty_meta.insert((slot, block / BLOCKS_PER_META_PAGE));
        }
        for &slot in &reset_slots {
            for p in 0..layout.meta_pages_per_extent() {
                dirty_meta.insert((slot, p));
            }
        }
        let mut slots = Vec::with_capacity(e_total);
        let mut by_key = HashMap::new();
        let mut free = Vec::new();
        for (slot, e) in exts.into_iter().enumerate() {
            match e {
                Some(e) => {
                    if by_key.insert(e.key, slot as u32).is_some() {
                        return Err(EngineError::Corrupt(format!(
                            "extent {:?} appears twice in the extent table",
                            e.key
                        )));
                    }
                    let ext = Arc::new(Extent::new(e.key, slot as u32, e.epoch, 0, e.blocks));
                    slots.push(Slot {
                        live: Some(ext.clone()),
                        durable: Some(ext),
                        entry: ExtentEntry {
                            in_use: true,
                            key: Some(e.key),
                            epoch: e.epoch,
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
                free,
            }),
            commit: Mutex::new(CommitState {
                pending: Vec::with_capacity(batch_records_max),
                open_seq: seq,
                durable_seq: seq - 1,
                leader_active: false,
                failed: None,
                written_seq: seq - 1,
                unsettled: Vec::new(),
            }),
            commit_cv: Condvar::new(),
            leader: Mutex::new(LeaderState {
                sb: new_sb,
                head: 0,
                used: 0,
                next_seq: seq,
                spare: Vec::with_capacity(batch_records_max),
                batch_buf: AlignedBuf::new(batch_records_max + BATCH_HEADER + BLOCK as usize),
                page_buf: AlignedBuf::new(PAGE_BUF_BYTES),
                dirty_meta,
                dirty_table,
            }),
            counters,
            journal_sector: js_now,
            batch_records_max,
        };
        if batches > 0 {
            log::info!(
                "drive {}: replayed {batches} journal batches ({} blocks touched, {} checked)",
                drive.id.drive,
                cands.len(),
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
    use crate::layout::F_DATA;

    fn d(crc: u32, v: u64) -> BlockMeta {
        BlockMeta {
            version: v,
            crc,
            flags: F_DATA,
        }
    }
    fn z(v: u64) -> BlockMeta {
        BlockMeta {
            version: v,
            crc: 0,
            flags: 0,
        }
    }

    #[test]
    fn choose_prefers_newest_proven_state() {
        // New data landed.
        assert_eq!(choose(&[d(1, 1), d(2, 2)], 2), d(2, 2));
        // New data did not land: keep old.
        assert_eq!(choose(&[d(1, 1), d(2, 2)], 1), d(1, 1));
        // Torn: nothing proven, keep newest so the read reports it bad.
        assert_eq!(choose(&[d(1, 1), d(2, 2)], 9), d(2, 2));
        // A zero over d1, then an unlanded write: the zero is proven by d1 still on disk.
        assert_eq!(choose(&[d(1, 1), z(2), d(3, 3)], 1), z(2));
        // Zero over d1, then d3 acked and torn by a later write: zero is NOT proven.
        assert_eq!(choose(&[d(1, 1), z(2), d(3, 3)], 9), d(3, 3));
        // Unwritten base with nothing before it cannot be proven.
        assert_eq!(choose(&[z(0), d(3, 3)], 0), d(3, 3));
        // Latest is metadata-only: nothing to check.
        assert_eq!(choose(&[d(1, 1), z(2)], 7), z(2));
        // Bad base stops the search.
        assert_eq!(choose(&[BlockMeta::BAD, d(3, 3)], 5), d(3, 3));
        // An intent whose data did not land (the old data is there) / did land / tore.
        assert_eq!(choose(&[d(1, 1), d(2, 2), d(4, 4)], 2), d(2, 2));
        assert_eq!(choose(&[d(1, 1), d(2, 2), d(4, 4)], 4), d(4, 4));
        assert_eq!(choose(&[d(1, 1), d(2, 2), d(4, 4)], 7), d(4, 4));
    }
}
