//! The on-disk format, byte by byte (docs/FORMAT-engine.md): superblock, extent table,
//! per-block metadata sectors, journal batches and records. Decoders never panic on bad bytes.

use crate::error::EngineError;
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex, VolumeId,
    BLOCK_SIZE,
};
use serde::{Deserialize, Serialize};

/// Engine on-disk format version; bumped on any incompatible change.
pub const FORMAT_VERSION: u32 = 2;
pub const SB_MAGIC: [u8; 8] = *b"CVGDRIV1";
/// Bytes of the superblock covered by its crc (the rest of block 0/1 is zero).
pub const SB_BYTES: usize = 256;
pub const SECTOR: usize = 512;
pub const BLOCK: u64 = BLOCK_SIZE as u64;
/// Per-block metadata entries in one 512-byte sector (24 x 20 B, then a trailer at 496).
pub const META_PER_SECTOR: u32 = 24;
/// Bytes of one per-block metadata entry.
pub const META_ENTRY: usize = 20;
/// Extent-table entries per 512-byte sector (15 x 32 B + 32 B trailer).
pub const EXT_PER_SECTOR: u32 = 15;
pub const SECTORS_PER_PAGE: u32 = (BLOCK_SIZE / SECTOR) as u32;
/// Blocks whose metadata one 4 KiB metadata page holds.
pub const BLOCKS_PER_META_PAGE: u32 = META_PER_SECTOR * SECTORS_PER_PAGE;
pub const EXT_PER_PAGE: u32 = EXT_PER_SECTOR * SECTORS_PER_PAGE;
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"CVJB");
pub const BATCH_HEADER: usize = 32;
pub const RECORD: usize = 32;
/// Smallest journal we accept: room for a few batches of one big write's records.
pub const JOURNAL_MIN_BYTES: u64 = 64 << 10;
/// Bounds of the spare data blocks (beyond one per block of every extent slot): the room
/// out-of-place writes need while the old copy of a block they replace is still the durable
/// one. 1/128 of the device, at least 1 MiB and at most 1 GiB.
pub const SPARE_MIN_BLOCKS: u64 = 256;
pub const SPARE_MAX_BLOCKS: u64 = 1 << 18;

/// Block metadata flag: the data region holds this block's content (else it reads as zeros).
pub const F_DATA: u32 = 1;
/// Block metadata flag: the metadata itself was lost (rotted sector); contents untrusted.
pub const F_BAD: u32 = 2;

/// Who this drive is, written in the superblock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveIdentity {
    pub cluster: ClusterId,
    pub node: NodeId,
    pub drive: DriveId,
    pub slab_size_bytes: u64,
    pub role: DriveRole,
    pub media: MediaType,
}

/// Where every region lives; derived from (device length, slab size, journal length).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub len_bytes: u64,
    pub slab_size_bytes: u64,
    pub blocks_per_extent: u32,
    pub extents_total: u32,
    pub table_off: u64,
    pub table_len: u64,
    pub journal_off: u64,
    pub journal_len: u64,
    pub meta_off: u64,
    /// 512-byte metadata sectors reserved per extent slot (a multiple of 8: whole pages).
    pub meta_sectors_per_extent: u32,
    pub data_off: u64,
    /// Physical 4 KiB blocks of the data region: one per block of every extent slot plus
    /// the spare ones. Any block of any extent may live in any of them.
    pub data_blocks: u64,
}

/// Spare data blocks for a device of `len` bytes (see [`SPARE_MIN_BLOCKS`]).
pub fn spare_blocks(len: u64) -> u64 {
    (len / 128 / BLOCK).clamp(SPARE_MIN_BLOCKS, SPARE_MAX_BLOCKS)
}

impl Layout {
    pub fn compute(len_bytes: u64, slab: u64, journal_len: u64) -> Result<Layout, EngineError> {
        if slab == 0 || !slab.is_multiple_of(BLOCK) || slab / BLOCK > u64::from(u32::MAX / 2) {
            return Err(EngineError::InvalidArgument(format!(
                "slab size {slab} must be a non-zero multiple of {BLOCK} bytes"
            )));
        }
        if journal_len < JOURNAL_MIN_BYTES || !journal_len.is_multiple_of(BLOCK) {
            return Err(EngineError::InvalidArgument(format!(
                "journal size {journal_len} must be a multiple of {BLOCK} and at least {JOURNAL_MIN_BYTES}"
            )));
        }
        let bpe = (slab / BLOCK) as u32;
        let spe = bpe
            .div_ceil(META_PER_SECTOR)
            .div_ceil(SECTORS_PER_PAGE)
            .saturating_mul(SECTORS_PER_PAGE);
        let spare = spare_blocks(len_bytes);
        // Saturating: the sizes may come from a damaged superblock. Past the `needed`
        // check, everything below is bounded by `len_bytes`.
        let fixed = (2 * BLOCK + spare * BLOCK).saturating_add(journal_len);
        let per_extent = slab + u64::from(spe) * SECTOR as u64;
        let needed = fixed.saturating_add(BLOCK + per_extent);
        if len_bytes < needed {
            return Err(EngineError::TooSmall {
                len_bytes,
                needed_bytes: needed,
            });
        }
        // Physical data blocks are numbered with a u32 (16 TiB of data per drive).
        let max_e = (u64::from(u32::MAX) - spare) / u64::from(bpe);
        let mut e = ((len_bytes - fixed) / per_extent)
            .min(u64::from(u32::MAX / 2))
            .min(max_e);
        loop {
            let table_len = e.div_ceil(u64::from(EXT_PER_PAGE)) * BLOCK;
            if fixed.saturating_add(table_len + e * per_extent) <= len_bytes || e == 0 {
                break;
            }
            e -= 1;
        }
        if e == 0 {
            return Err(EngineError::TooSmall {
                len_bytes,
                needed_bytes: needed,
            });
        }
        let table_len = e.div_ceil(u64::from(EXT_PER_PAGE)) * BLOCK;
        let table_off = 2 * BLOCK;
        let journal_off = table_off + table_len;
        let meta_off = journal_off + journal_len;
        let data_off = meta_off + e * u64::from(spe) * SECTOR as u64;
        Ok(Layout {
            len_bytes,
            slab_size_bytes: slab,
            blocks_per_extent: bpe,
            extents_total: e as u32,
            table_off,
            table_len,
            journal_off,
            journal_len,
            meta_off,
            meta_sectors_per_extent: spe,
            data_off,
            data_blocks: e * u64::from(bpe) + spare,
        })
    }

    pub fn meta_pages_per_extent(&self) -> u32 {
        self.meta_sectors_per_extent / SECTORS_PER_PAGE
    }

    pub fn meta_page_off(&self, slot: u32, page: u32) -> u64 {
        self.meta_off
            + (u64::from(slot) * u64::from(self.meta_sectors_per_extent)
                + u64::from(page) * u64::from(SECTORS_PER_PAGE))
                * SECTOR as u64
    }

    pub fn table_page_off(&self, page: u32) -> u64 {
        self.table_off + u64::from(page) * BLOCK
    }

    /// Where a block of an extent slot is placed when it can be (its first write, if
    /// that physical block is free): extents then start out laid out sequentially.
    pub fn home_block(&self, slot: u32, block: u32) -> u32 {
        slot * self.blocks_per_extent + block
    }

    /// Device offset of physical data block `phys`.
    pub fn phys_off(&self, phys: u32) -> u64 {
        self.data_off + u64::from(phys) * BLOCK
    }
}

pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}

/// The superblock: identity, layout and the journal checkpoint (where replay starts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub identity: DriveIdentity,
    pub layout: Layout,
    /// Bumped at every superblock write; the copy with the highest valid generation wins.
    pub generation: u64,
    /// Changes at every open: batches of another mount (or format) are never replayed.
    pub journal_gen: u64,
    /// Offset within the journal region where replay starts.
    pub journal_tail: u64,
    /// Sequence number of the first batch to replay.
    pub journal_tail_seq: u64,
    /// Unit (512 or 4096) in which journal batches were padded and written.
    pub journal_sector: u32,
}

fn role_code(r: DriveRole) -> u8 {
    match r {
        DriveRole::Capacity => 0,
        DriveRole::Cache => 1,
    }
}
pub(crate) fn media_code(m: MediaType) -> u8 {
    match m {
        MediaType::Ssd => 0,
        MediaType::Nvme => 1,
        MediaType::Hdd => 2,
        MediaType::Ram => 3,
    }
}

pub(crate) fn media_of(c: u8) -> Result<MediaType, EngineError> {
    Ok(match c {
        0 => MediaType::Ssd,
        1 => MediaType::Nvme,
        2 => MediaType::Hdd,
        3 => MediaType::Ram,
        x => return Err(EngineError::Corrupt(format!("unknown media code {x}"))),
    })
}

impl Superblock {
    /// Encodes into the first SB_BYTES of `b` (which must be at least that long; rest untouched).
    pub fn encode(&self, b: &mut [u8]) {
        b[..SB_BYTES].fill(0);
        let id = &self.identity;
        let l = &self.layout;
        b[0..8].copy_from_slice(&SB_MAGIC);
        put_u32(b, 8, FORMAT_VERSION);
        put_u32(b, 12, SB_BYTES as u32);
        put_u64(b, 16, self.generation);
        b[24..40].copy_from_slice(&id.cluster.0.to_le_bytes());
        put_u32(b, 40, id.node.0);
        b[44] = role_code(id.role);
        b[45] = media_code(id.media);
        put_u64(b, 48, id.drive.0);
        put_u64(b, 56, id.slab_size_bytes);
        put_u64(b, 64, l.len_bytes);
        put_u32(b, 72, l.extents_total);
        put_u32(b, 76, l.blocks_per_extent);
        put_u64(b, 80, l.table_off);
        put_u64(b, 88, l.table_len);
        put_u64(b, 96, l.journal_off);
        put_u64(b, 104, l.journal_len);
        put_u64(b, 112, l.meta_off);
        put_u32(b, 120, l.meta_sectors_per_extent);
        put_u32(b, 124, self.journal_sector);
        put_u64(b, 128, l.data_off);
        put_u64(b, 136, self.journal_gen);
        put_u64(b, 144, self.journal_tail);
        put_u64(b, 152, self.journal_tail_seq);
        put_u64(b, 160, l.data_blocks);
        let crc = crc32c::crc32c(&b[..SB_BYTES - 4]);
        put_u32(b, SB_BYTES - 4, crc);
    }

    /// Ok(None): no converge magic (blank or foreign). Err: ours but damaged or unsupported.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, EngineError> {
        if b.len() < SB_BYTES || b[0..8] != SB_MAGIC {
            return Ok(None);
        }
        let version = get_u32(b, 8);
        if crc32c::crc32c(&b[..SB_BYTES - 4]) != get_u32(b, SB_BYTES - 4) {
            return Err(EngineError::Corrupt("superblock checksum mismatch".into()));
        }
        if version != FORMAT_VERSION {
            return Err(EngineError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let role = match b[44] {
            0 => DriveRole::Capacity,
            1 => DriveRole::Cache,
            x => return Err(EngineError::Corrupt(format!("unknown drive role code {x}"))),
        };
        let media = media_of(b[45])?;
        let identity = DriveIdentity {
            cluster: ClusterId(u128::from_le_bytes(
                b[24..40].try_into().expect("16-byte slice"),
            )),
            node: NodeId(get_u32(b, 40)),
            drive: DriveId(get_u64(b, 48)),
            slab_size_bytes: get_u64(b, 56),
            role,
            media,
        };
        let layout = Layout {
            len_bytes: get_u64(b, 64),
            slab_size_bytes: identity.slab_size_bytes,
            extents_total: get_u32(b, 72),
            blocks_per_extent: get_u32(b, 76),
            table_off: get_u64(b, 80),
            table_len: get_u64(b, 88),
            journal_off: get_u64(b, 96),
            journal_len: get_u64(b, 104),
            meta_off: get_u64(b, 112),
            meta_sectors_per_extent: get_u32(b, 120),
            data_off: get_u64(b, 128),
            data_blocks: get_u64(b, 160),
        };
        // The layout is a pure function of three numbers: recomputing it validates every
        // offset at once, so later code can trust them.
        let expect = Layout::compute(layout.len_bytes, layout.slab_size_bytes, layout.journal_len)
            .map_err(|e| EngineError::Corrupt(format!("superblock layout invalid: {e}")))?;
        if expect != layout {
            return Err(EngineError::Corrupt(
                "superblock layout does not match its sizes".into(),
            ));
        }
        let journal_sector = get_u32(b, 124);
        let journal_tail = get_u64(b, 144);
        let generation = get_u64(b, 16);
        let journal_tail_seq = get_u64(b, 152);
        // Generations and sequence numbers only count up from 0 and 1: the next
        // checkpoint and replay must be able to add to them.
        if !(journal_sector == SECTOR as u32 || journal_sector == BLOCK as u32)
            || journal_tail >= layout.journal_len
            || !journal_tail.is_multiple_of(u64::from(journal_sector))
            || generation == u64::MAX
            || !(1..=u64::MAX / 2).contains(&journal_tail_seq)
        {
            return Err(EngineError::Corrupt(
                "superblock journal fields invalid".into(),
            ));
        }
        Ok(Some(Superblock {
            identity,
            layout,
            generation,
            journal_gen: get_u64(b, 136),
            journal_tail,
            journal_tail_seq,
            journal_sector,
        }))
    }
}

/// Metadata of one 4 KiB block of an extent: crc32c of its content, version, flags, and
/// the physical data block holding it (meaningful with [`F_DATA`] only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockMeta {
    pub version: u64,
    pub crc: u32,
    pub flags: u32,
    pub phys: u32,
}

impl BlockMeta {
    pub const BAD: BlockMeta = BlockMeta {
        version: 0,
        crc: 0,
        flags: F_BAD,
        phys: 0,
    };
    /// The block holds `crc`'s content at `version` in physical block `phys`.
    pub fn data(version: u64, crc: u32, phys: u32) -> BlockMeta {
        BlockMeta {
            version,
            crc,
            flags: F_DATA,
            phys,
        }
    }
    /// The block reads as zeros at `version`.
    pub fn zero(version: u64) -> BlockMeta {
        BlockMeta {
            version,
            ..BlockMeta::default()
        }
    }
    pub fn has_data(&self) -> bool {
        self.flags & F_DATA != 0
    }
    pub fn is_bad(&self) -> bool {
        self.flags & F_BAD != 0
    }
}

/// Encodes one metadata sector: entries for blocks [sector*24, sector*24+24) of `slot`.
pub fn encode_meta_sector(out: &mut [u8], slot: u32, sector: u32, metas: &[BlockMeta]) {
    out[..SECTOR].fill(0);
    for (i, m) in metas.iter().take(META_PER_SECTOR as usize).enumerate() {
        let at = i * META_ENTRY;
        put_u64(out, at, m.version);
        put_u32(out, at + 8, m.crc);
        put_u32(out, at + 12, m.flags);
        put_u32(out, at + 16, if m.has_data() { m.phys } else { 0 });
    }
    put_u32(out, 496, slot);
    put_u32(out, 500, sector);
    let crc = crc32c::crc32c(&out[..508]);
    put_u32(out, 508, crc);
}

/// Decodes one metadata sector into `metas` (24 entries). An all-zero sector is a fresh
/// one (never written). Returns false if the sector is damaged or belongs elsewhere.
pub fn decode_meta_sector(b: &[u8], slot: u32, sector: u32, metas: &mut [BlockMeta]) -> bool {
    if b[..SECTOR].iter().all(|&x| x == 0) {
        metas.iter_mut().for_each(|m| *m = BlockMeta::default());
        return true;
    }
    if crc32c::crc32c(&b[..508]) != get_u32(b, 508)
        || get_u32(b, 496) != slot
        || get_u32(b, 500) != sector
    {
        return false;
    }
    for (i, m) in metas.iter_mut().take(META_PER_SECTOR as usize).enumerate() {
        let at = i * META_ENTRY;
        *m = BlockMeta {
            version: get_u64(b, at),
            crc: get_u32(b, at + 8),
            flags: get_u32(b, at + 12) & (F_DATA | F_BAD),
            phys: get_u32(b, at + 16),
        };
    }
    true
}

/// One extent-table entry as stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtentEntry {
    pub in_use: bool,
    pub key: Option<ExtentKey>,
    pub epoch: u64,
}

/// Encodes one extent-table sector: entries for slots [sector*15, sector*15+15).
pub fn encode_table_sector(out: &mut [u8], sector: u32, entries: &[ExtentEntry]) {
    out[..SECTOR].fill(0);
    for (i, e) in entries.iter().take(EXT_PER_SECTOR as usize).enumerate() {
        if let (true, Some(k)) = (e.in_use, e.key) {
            let at = i * 32;
            put_u64(out, at, k.volume.0);
            put_u64(out, at + 8, k.slab.0);
            put_u64(out, at + 16, e.epoch);
            put_u32(out, at + 24, 1);
        }
    }
    put_u32(out, 480, sector);
    let crc = crc32c::crc32c(&out[..508]);
    put_u32(out, 508, crc);
}

pub fn decode_table_sector(b: &[u8], sector: u32, entries: &mut [ExtentEntry]) -> bool {
    if b[..SECTOR].iter().all(|&x| x == 0) {
        entries.iter_mut().for_each(|e| *e = ExtentEntry::default());
        return true;
    }
    if crc32c::crc32c(&b[..508]) != get_u32(b, 508) || get_u32(b, 480) != sector {
        return false;
    }
    for (i, e) in entries.iter_mut().take(EXT_PER_SECTOR as usize).enumerate() {
        let at = i * 32;
        let in_use = get_u32(b, at + 24) & 1 == 1;
        *e = ExtentEntry {
            in_use,
            key: in_use.then(|| ExtentKey {
                volume: VolumeId(get_u64(b, at)),
                slab: SlabIndex(get_u64(b, at + 8)),
            }),
            epoch: get_u64(b, at + 16),
        };
    }
    true
}

/// A journal record: one metadata change, 32 bytes on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// Block `block` of extent `slot` now holds data with this crc, at this version, in
    /// physical data block `phys` (written before the record was queued; the block it
    /// held before is free once this record is durable). `hold` (a parity chunk's write):
    /// the block's previous state is kept as its *prior* (named by the [`Record::Prior`]
    /// just before this record) until settled or reverted, instead of being freed.
    Data {
        slot: u32,
        block: u32,
        crc: u32,
        version: u64,
        phys: u32,
        hold: bool,
    },
    /// Blocks [block, block+count) read as zeros at this version (TRIM / WRITE_ZEROES).
    Zero {
        slot: u32,
        block: u32,
        count: u32,
        version: u64,
    },
    /// Slot `slot` now holds extent `key` at `epoch`, all blocks unwritten.
    Alloc {
        slot: u32,
        key: ExtentKey,
        epoch: Epoch,
    },
    /// The extent in `slot` moved to a newer epoch (fencing).
    Epoch { slot: u32, epoch: Epoch },
    /// Slot `slot` is free again.
    Free { slot: u32 },
    /// Block `block` of extent `slot` keeps `meta` as its prior: queued just before a
    /// held [`Record::Data`] (the block's state before that write), and again for every
    /// prior when a checkpoint moves the journal tail (priors are not in the metadata
    /// pages). Self-contained, so replaying it over newer metadata pages is exact.
    Prior {
        slot: u32,
        block: u32,
        meta: BlockMeta,
    },
    /// The priors of extent `slot`'s blocks whose current version is at most `upto`
    /// are dropped (those writes completed on every chunk of their row): of blocks
    /// `[first, first + count)` only, or of every block when `count` is 0.
    Settle {
        slot: u32,
        upto: u64,
        first: u32,
        count: u32,
    },
    /// Block `block` of extent `slot` goes back to its prior if its current version is
    /// `version` (a write that did not complete on its row is undone).
    Revert { slot: u32, block: u32, version: u64 },
}

impl Record {
    pub fn encode(&self, out: &mut [u8]) {
        out[..RECORD].fill(0);
        match *self {
            Record::Data {
                slot,
                block,
                crc,
                version,
                phys,
                hold,
            } => {
                out[0] = 1;
                out[1] = u8::from(hold);
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, crc);
                put_u64(out, 16, version);
                put_u32(out, 24, phys);
            }
            Record::Zero {
                slot,
                block,
                count,
                version,
            } => {
                out[0] = 2;
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, count);
                put_u64(out, 16, version);
            }
            Record::Alloc { slot, key, epoch } => {
                out[0] = 3;
                put_u32(out, 4, slot);
                put_u64(out, 8, key.volume.0);
                put_u64(out, 16, key.slab.0);
                put_u64(out, 24, epoch.0);
            }
            Record::Epoch { slot, epoch } => {
                out[0] = 4;
                put_u32(out, 4, slot);
                put_u64(out, 8, epoch.0);
            }
            Record::Free { slot } => {
                out[0] = 5;
                put_u32(out, 4, slot);
            }
            Record::Prior { slot, block, meta } => {
                out[0] = 6;
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, meta.crc);
                put_u64(out, 16, meta.version);
                put_u32(out, 24, meta.phys);
                put_u32(out, 28, meta.flags);
            }
            Record::Settle {
                slot,
                upto,
                first,
                count,
            } => {
                out[0] = 7;
                put_u32(out, 4, slot);
                put_u64(out, 8, upto);
                put_u32(out, 16, first);
                put_u32(out, 20, count);
            }
            Record::Revert {
                slot,
                block,
                version,
            } => {
                out[0] = 8;
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u64(out, 16, version);
            }
        }
    }

    /// Appends the encoded record to `v`.
    pub fn push(&self, v: &mut Vec<u8>) {
        let at = v.len();
        v.resize(at + RECORD, 0);
        self.encode(&mut v[at..]);
    }

    pub fn decode(b: &[u8]) -> Option<Record> {
        if b.len() < RECORD {
            return None;
        }
        let slot = get_u32(b, 4);
        Some(match b[0] {
            1 => Record::Data {
                slot,
                block: get_u32(b, 8),
                crc: get_u32(b, 12),
                version: get_u64(b, 16),
                phys: get_u32(b, 24),
                hold: b[1] & 1 != 0,
            },
            2 => Record::Zero {
                slot,
                block: get_u32(b, 8),
                count: get_u32(b, 12),
                version: get_u64(b, 16),
            },
            3 => Record::Alloc {
                slot,
                key: ExtentKey {
                    volume: VolumeId(get_u64(b, 8)),
                    slab: SlabIndex(get_u64(b, 16)),
                },
                epoch: Epoch(get_u64(b, 24)),
            },
            4 => Record::Epoch {
                slot,
                epoch: Epoch(get_u64(b, 8)),
            },
            5 => Record::Free { slot },
            6 => Record::Prior {
                slot,
                block: get_u32(b, 8),
                meta: BlockMeta {
                    crc: get_u32(b, 12),
                    version: get_u64(b, 16),
                    phys: get_u32(b, 24),
                    flags: get_u32(b, 28),
                },
            },
            7 => Record::Settle {
                slot,
                upto: get_u64(b, 8),
                first: get_u32(b, 16),
                count: get_u32(b, 20),
            },
            8 => Record::Revert {
                slot,
                block: get_u32(b, 8),
                version: get_u64(b, 16),
            },
            _ => return None,
        })
    }
}

/// Writes a batch header in front of `len - 32` bytes of records already in `b[32..len]`
/// (padding zeroed by the caller) and seals it with a crc over bytes [8, len).
pub fn seal_batch(b: &mut [u8], journal_gen: u64, seq: u64, len: usize, records: u32) {
    put_u32(b, 0, BATCH_MAGIC);
    put_u64(b, 8, journal_gen);
    put_u64(b, 16, seq);
    put_u32(b, 24, len as u32);
    put_u32(b, 28, records);
    let crc = crc32c::crc32c(&b[8..len]);
    put_u32(b, 4, crc);
}

/// Header fields of a batch that looks like the one we expect (gen, seq), before its crc is checked.
pub fn batch_header(b: &[u8], journal_gen: u64, seq: u64) -> Option<(usize, u32)> {
    if b.len() < BATCH_HEADER
        || get_u32(b, 0) != BATCH_MAGIC
        || get_u64(b, 8) != journal_gen
        || get_u64(b, 16) != seq
    {
        return None;
    }
    let len = get_u32(b, 24) as usize;
    let records = get_u32(b, 28);
    if len < BATCH_HEADER || (records as usize) > (len - BATCH_HEADER) / RECORD {
        return None;
    }
    Some((len, records))
}

pub fn batch_crc_ok(b: &[u8], len: usize) -> bool {
    b.len() >= len && crc32c::crc32c(&b[8..len]) == get_u32(b, 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb() -> Superblock {
        let layout = Layout::compute(64 << 20, 1 << 20, 1 << 20).unwrap();
        Superblock {
            identity: DriveIdentity {
                cluster: ClusterId(0xabc),
                node: NodeId(3),
                drive: DriveId(42),
                slab_size_bytes: 1 << 20,
                role: DriveRole::Cache,
                media: MediaType::Nvme,
            },
            layout,
            generation: 9,
            journal_gen: 77,
            journal_tail: 4096,
            journal_tail_seq: 12,
            journal_sector: 512,
        }
    }

    #[test]
    fn layout_fits_and_regions_do_not_overlap() {
        for (len, slab, j) in [
            (64u64 << 20, 1u64 << 20, 1u64 << 20),
            (1 << 40, 256 << 20, 128 << 20),
            (10 << 20, 4096, 64 << 10),
        ] {
            let l = Layout::compute(len, slab, j).unwrap();
            assert!(l.table_off + l.table_len <= l.journal_off);
            assert!(l.journal_off + l.journal_len <= l.meta_off);
            assert!(
                l.meta_off
                    + u64::from(l.extents_total) * u64::from(l.meta_sectors_per_extent) * 512
                    <= l.data_off
            );
            assert!(l.data_off + l.data_blocks * BLOCK <= len);
            assert!(l.data_blocks >= u64::from(l.extents_total) * slab / BLOCK + SPARE_MIN_BLOCKS);
            assert_eq!(l.data_off % 4096, 0);
            assert!(
                u64::from(l.meta_sectors_per_extent) * u64::from(META_PER_SECTOR)
                    >= u64::from(l.blocks_per_extent)
            );
        }
        assert!(matches!(
            Layout::compute(1 << 20, 1 << 20, 1 << 20),
            Err(EngineError::TooSmall { .. })
        ));
    }

    #[test]
    fn superblock_round_trip_and_damage() {
        let s = sb();
        let mut b = vec![0u8; 4096];
        s.encode(&mut b);
        assert_eq!(Superblock::decode(&b).unwrap().unwrap(), s);
        assert!(Superblock::decode(&[0u8; 4096]).unwrap().is_none());
        for i in [9usize, 30, 100, 200] {
            let mut d = b.clone();
            d[i] ^= 4;
            assert!(Superblock::decode(&d).is_err(), "byte {i}");
        }
    }

    /// Found by fuzz target engine_open: fields with a valid crc that open could not
    /// use (a generation of u64::MAX overflowed the next checkpoint's, a tail sequence
    /// of 0 the durable one's, a huge journal length the layout's sums).
    #[test]
    fn superblock_fields_that_cannot_be_used_are_refused() {
        let bad: [fn(&mut Superblock); 4] = [
            |s| s.generation = u64::MAX,
            |s| s.journal_tail_seq = 0,
            |s| s.journal_tail_seq = u64::MAX,
            |s| s.layout.journal_len = u64::MAX - 4095,
        ];
        for (i, f) in bad.iter().enumerate() {
            let mut s = sb();
            f(&mut s);
            let mut b = vec![0u8; 4096];
            s.encode(&mut b);
            assert!(Superblock::decode(&b).is_err(), "case {i}");
        }
        for (len, j) in [(u64::MAX, 1 << 20), (64 << 20, u64::MAX - 4095)] {
            let _ = Layout::compute(len, 1 << 20, j);
        }
    }

    #[test]
    fn records_round_trip() {
        let key = ExtentKey {
            volume: VolumeId(5),
            slab: SlabIndex(6),
        };
        for r in [
            Record::Data {
                slot: 1,
                block: 2,
                crc: 3,
                version: 4,
                phys: 0,
                hold: false,
            },
            Record::Data {
                slot: 1,
                block: 2,
                crc: 3,
                version: 4,
                phys: 0x8765_4321,
                hold: true,
            },
            Record::Prior {
                slot: 3,
                block: 4,
                meta: BlockMeta::data(0x1234_5678_9abc, 0xdead_beef, 77),
            },
            Record::Prior {
                slot: 3,
                block: 5,
                meta: BlockMeta::zero(9),
            },
            Record::Settle {
                slot: 3,
                upto: 99,
                first: 0,
                count: 0,
            },
            Record::Settle {
                slot: 3,
                upto: 99,
                first: 17,
                count: 5,
            },
            Record::Revert {
                slot: 3,
                block: 4,
                version: 0x1234_5678_9abd,
            },
            Record::Zero {
                slot: 1,
                block: 2,
                count: 3,
                version: 4,
            },
            Record::Alloc {
                slot: 9,
                key,
                epoch: Epoch(8),
            },
            Record::Epoch {
                slot: 9,
                epoch: Epoch(10),
            },
            Record::Free { slot: 11 },
        ] {
            let mut v = Vec::new();
            r.push(&mut v);
            assert_eq!(v.len(), RECORD);
            assert_eq!(Record::decode(&v), Some(r));
        }
        assert_eq!(Record::decode(&[0u8; 32]), None);
    }

    #[test]
    fn meta_sector_round_trip_and_damage() {
        let metas: Vec<BlockMeta> = (0..24)
            .map(|i| BlockMeta::data(i, i as u32 * 7, 1000 + i as u32))
            .collect();
        let mut b = [0u8; 512];
        encode_meta_sector(&mut b, 4, 2, &metas);
        let mut back = vec![BlockMeta::default(); 24];
        assert!(decode_meta_sector(&b, 4, 2, &mut back));
        assert_eq!(back, metas);
        assert!(!decode_meta_sector(&b, 5, 2, &mut back), "misdirected");
        b[17] ^= 1;
        assert!(!decode_meta_sector(&b, 4, 2, &mut back), "rotted");
    }
}
