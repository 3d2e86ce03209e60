//! The on-disk format, byte by byte (docs/FORMAT-engine.md): superblock, extent table,
//! per-block metadata sectors, journal batches and records. Decoders never panic on bad bytes.

use crate::error::EngineError;
use converge_types::{
    ClusterId, Compression, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex,
    VolumeId, BLOCK_SIZE,
};
use serde::{Deserialize, Serialize};

/// Engine on-disk format version; bumped on any incompatible change. Version 3 added
/// compressed block groups and thin drives (more extent slots than data extents); a
/// version-2 drive still opens, with one slot per data extent, and stores every block as is.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest format version this build opens.
pub const FORMAT_VERSION_MIN: u32 = 2;
/// Extent slots per data extent of a new drive by default (docs/adr/0010): a drive may
/// hold twice the extents its data region holds uncompressed, so what compression saves
/// can hold other data. Costs another 0.5 % of the drive for the slots' metadata.
pub const DEFAULT_OVERCOMMIT: u32 = 2;
/// Most extent slots per data extent a drive may be formatted with.
pub const MAX_OVERCOMMIT: u32 = 8;
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
/// Block metadata flag (format 3): the block is one member of a compressed group: its
/// content is slice `member` of the stream in physical blocks `[phys, phys + c)`,
/// c = ceil(stream bytes / 4096). The rest of the flags word says how (see [`BlockMeta`]).
pub const F_PACKED: u32 = 4;
/// Block metadata flag: recovery went back to this state because the newer one the
/// journal's last batch named did not match its crc. The batch may have been cut short by
/// the crash (the write was never acked) or synced and acked with the block rotting since;
/// recovery cannot tell which, so the block's content is a proven older state that other
/// copies may have newer. Reads report it ([`crate::ReadInfo::suspect`]) and the owner
/// checks it against the other copies; any write of the block clears it.
pub const F_SUSPECT: u32 = 8;
/// Bits 4..32 of a packed block's flags: codec (4..8), member index (8..12), group blocks
/// minus one (12..16), stream bytes (16..32).
const PACK_FIELDS: u32 = !0xf;

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
    /// Extent slots: the extents the drive may hold (table and metadata are sized for
    /// them). `overcommit` × `data_extents`.
    pub extents_total: u32,
    /// Extents the data region holds uncompressed: each has home blocks there.
    pub data_extents: u32,
    /// Extent slots per data extent (1 on a version-2 drive).
    pub overcommit: u32,
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
    /// The layout of a device of `len_bytes` with `overcommit` extent slots per extent its
    /// data region holds (1: a version-2 layout).
    pub fn compute(
        len_bytes: u64,
        slab: u64,
        journal_len: u64,
        overcommit: u32,
    ) -> Result<Layout, EngineError> {
        if !(1..=MAX_OVERCOMMIT).contains(&overcommit) {
            return Err(EngineError::InvalidArgument(format!(
                "overcommit {overcommit} must be between 1 and {MAX_OVERCOMMIT} extent slots per data extent"
            )));
        }
        let k = u64::from(overcommit);
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
        // Each data extent brings `overcommit` slots of metadata.
        let per_extent = slab + k * u64::from(spe) * SECTOR as u64;
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
            .min(u64::from(u32::MAX / 2) / k)
            .min(max_e);
        loop {
            let table_len = (k * e).div_ceil(u64::from(EXT_PER_PAGE)) * BLOCK;
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
        let slots = k * e;
        let table_len = slots.div_ceil(u64::from(EXT_PER_PAGE)) * BLOCK;
        let table_off = 2 * BLOCK;
        let journal_off = table_off + table_len;
        let meta_off = journal_off + journal_len;
        let data_off = meta_off + slots * u64::from(spe) * SECTOR as u64;
        Ok(Layout {
            len_bytes,
            slab_size_bytes: slab,
            blocks_per_extent: bpe,
            extents_total: slots as u32,
            data_extents: e as u32,
            overcommit,
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
    /// that physical block is free): extents then start out laid out sequentially. Slots
    /// beyond the data extents (a thin drive's) have no home: `u32::MAX`.
    pub fn home_block(&self, slot: u32, block: u32) -> u32 {
        if slot < self.data_extents {
            slot * self.blocks_per_extent + block
        } else {
            u32::MAX
        }
    }

    /// Physical blocks that are nobody's home: the room out-of-place writes need.
    pub fn spare_blocks(&self) -> u64 {
        self.data_blocks - u64::from(self.data_extents) * u64::from(self.blocks_per_extent)
    }

    /// Physical blocks the data extents have (the drive's capacity for volume data).
    pub fn extent_blocks(&self) -> u64 {
        u64::from(self.data_extents) * u64::from(self.blocks_per_extent)
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
    /// Format version the drive was written with (2 or 3); a version-2 drive keeps it.
    pub format_version: u32,
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
        put_u32(b, 8, self.format_version);
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
        if self.format_version >= 3 {
            put_u32(b, 168, l.overcommit);
        }
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
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&version) {
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
        let overcommit = if version >= 3 { get_u32(b, 168) } else { 1 };
        let layout = Layout {
            len_bytes: get_u64(b, 64),
            slab_size_bytes: identity.slab_size_bytes,
            extents_total: get_u32(b, 72),
            data_extents: get_u32(b, 72) / overcommit.max(1),
            overcommit,
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
        let expect = Layout::compute(
            layout.len_bytes,
            layout.slab_size_bytes,
            layout.journal_len,
            overcommit,
        )
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
            format_version: version,
        }))
    }
}

/// Metadata of one 4 KiB block of an extent: crc32c of its content, version, flags, and
/// the physical data block holding it (meaningful with [`F_DATA`] only).
///
/// A *packed* block ([`F_PACKED`], format 3) is one member of a compressed group: `phys`
/// is the first of the `c` consecutive physical blocks holding the group's stream, and
/// the flags say the rest: codec (bits 4..8), the member's index in its group (8..12),
/// the group's blocks minus one (12..16) and the stream's length in bytes (16..32). Every
/// member of a stream names it whole, so each block's metadata alone finds its content;
/// the stream's blocks are free once no member (and no prior) names them.
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
    /// A Data record's block: plain, or packed when `pack` ([`BlockMeta::pack_bits`]) is
    /// not 0.
    pub fn data_packed(version: u64, crc: u32, phys: u32, pack: u32) -> BlockMeta {
        BlockMeta {
            version,
            crc,
            flags: F_DATA | pack,
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
    /// Member `member` of a group of `group` blocks whose stream of `len` bytes, made by
    /// `codec`, starts at physical block `phys`.
    pub fn packed(
        version: u64,
        crc: u32,
        phys: u32,
        codec: Compression,
        member: u32,
        group: u32,
        len: u32,
    ) -> BlockMeta {
        debug_assert!(member < group && (2..=16).contains(&group));
        debug_assert!(len > 0 && len < group * BLOCK as u32 && len <= 0xffff);
        BlockMeta {
            version,
            crc,
            flags: F_DATA
                | F_PACKED
                | u32::from(codec.code()) << 4
                | member << 8
                | (group - 1) << 12
                | len << 16,
            phys,
        }
    }
    pub fn has_data(&self) -> bool {
        self.flags & F_DATA != 0
    }
    pub fn is_bad(&self) -> bool {
        self.flags & F_BAD != 0
    }
    /// Recovery rolled the block back to this state (see [`F_SUSPECT`]).
    pub fn is_suspect(&self) -> bool {
        self.flags & F_SUSPECT != 0
    }
    /// The same state, marked suspect.
    pub fn suspect(self) -> BlockMeta {
        BlockMeta {
            flags: self.flags | F_SUSPECT,
            ..self
        }
    }
    /// A member of a compressed group (see [`BlockMeta`]).
    pub fn is_packed(&self) -> bool {
        self.flags & (F_PACKED | F_DATA | F_BAD) == F_PACKED | F_DATA
    }
    /// The codec of a packed block's stream.
    pub fn codec(&self) -> Compression {
        Compression::from_code(((self.flags >> 4) & 0xf) as u8).unwrap_or(Compression::None)
    }
    /// A packed block's index in its group.
    pub fn member(&self) -> u32 {
        (self.flags >> 8) & 0xf
    }
    /// Blocks of a packed block's group.
    pub fn group_blocks(&self) -> u32 {
        ((self.flags >> 12) & 0xf) + 1
    }
    /// Bytes of a packed block's stream.
    pub fn stream_len(&self) -> u32 {
        self.flags >> 16
    }
    /// Physical blocks the block's content occupies: `(first, count)`; its own block, or
    /// its group's stream. None for a block without data (or with lost metadata).
    pub fn run(&self) -> Option<(u32, u32)> {
        if !self.has_data() || self.is_bad() {
            None
        } else if self.is_packed() {
            Some((self.phys, self.stream_len().div_ceil(BLOCK as u32)))
        } else {
            Some((self.phys, 1))
        }
    }
    /// Whether `other` holds its content in the same physical blocks (the same block, or
    /// the same stream).
    pub fn same_storage(&self, other: &BlockMeta) -> bool {
        match (self.run(), other.run()) {
            (Some((a, _)), Some((b, _))) => a == b && self.is_packed() == other.is_packed(),
            _ => false,
        }
    }
    /// Whether flags read from a drive describe a block this build understands (bits 0–3
    /// are DATA, BAD, PACKED and SUSPECT; bits 4–31 belong to packed blocks only): a
    /// packed block's codec is known, its member within its group, and its stream at least
    /// one block shorter than the group.
    pub fn flags_valid(flags: u32) -> bool {
        if flags & F_PACKED == 0 {
            return flags & PACK_FIELDS == 0;
        }
        let m = BlockMeta {
            flags,
            ..BlockMeta::default()
        };
        let group = m.group_blocks();
        flags & F_DATA != 0
            && !matches!(
                Compression::from_code(((flags >> 4) & 0xf) as u8),
                None | Some(Compression::None)
            )
            && group >= 2
            && m.member() < group
            && m.stream_len() > 0
            && m.stream_len().div_ceil(BLOCK as u32) < group
    }
    /// The packing part of a packed block's flags (0 for a plain one): what a Data record
    /// carries besides the block's crc, version and physical block.
    pub fn pack_bits(&self) -> u32 {
        if self.is_packed() {
            self.flags & (F_PACKED | PACK_FIELDS)
        } else {
            0
        }
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
        let flags = get_u32(b, at + 12);
        *m = if BlockMeta::flags_valid(flags) {
            BlockMeta {
                version: get_u64(b, at),
                crc: get_u32(b, at + 8),
                flags,
                phys: get_u32(b, at + 16),
            }
        } else {
            // Flags this build does not know: the block's content cannot be found.
            BlockMeta::BAD
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
    /// How the extent's volume asked its writes to be compressed (format 3; bits 8..16
    /// of the flags word): the cache tier's destage compresses with it.
    pub codec: Compression,
    /// A *shadow* extent (flags bit 1; docs/adr/0012): it holds the states of extent
    /// `key` that snapshot `aux` still reads and later writes replaced. Else a live one.
    pub shadow: bool,
    /// The entry's last four bytes: a shadow's snapshot epoch; a live extent's snapshot
    /// floor (its volume's newest snapshot epoch, 0 for none; [`Record::Floor`]).
    pub aux: u32,
    /// A live extent's oldest snapshot it holds (docs/adr/0012; `u32::MAX`: none), in the
    /// upper half of the epoch field (epochs stay below 2^32). 0 on drives written before.
    pub since: u32,
}

/// An extent that holds no snapshot (a new one, until its first floor).
pub const SINCE_NONE: u32 = u32::MAX;

/// Flags-word bit of an extent-table entry: the slot holds a shadow extent.
const ENTRY_SHADOW: u32 = 2;

/// Encodes one extent-table sector: entries for slots [sector*15, sector*15+15).
pub fn encode_table_sector(out: &mut [u8], sector: u32, entries: &[ExtentEntry]) {
    out[..SECTOR].fill(0);
    for (i, e) in entries.iter().take(EXT_PER_SECTOR as usize).enumerate() {
        if let (true, Some(k)) = (e.in_use, e.key) {
            let at = i * 32;
            put_u64(out, at, k.volume.0);
            put_u64(out, at + 8, k.slab.0);
            put_u64(
                out,
                at + 16,
                (e.epoch & 0xffff_ffff) | u64::from(e.since) << 32,
            );
            let shadow = if e.shadow { ENTRY_SHADOW } else { 0 };
            put_u32(out, at + 24, 1 | shadow | u32::from(e.codec.code()) << 8);
            put_u32(out, at + 28, e.aux);
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
        let flags = get_u32(b, at + 24);
        let in_use = flags & 1 == 1;
        *e = ExtentEntry {
            in_use,
            key: in_use.then(|| ExtentKey {
                volume: VolumeId(get_u64(b, at)),
                slab: SlabIndex(get_u64(b, at + 8)),
            }),
            epoch: get_u64(b, at + 16) & 0xffff_ffff,
            since: (get_u64(b, at + 16) >> 32) as u32,
            // An unknown codec (a newer build's) is treated as none: it only decides how
            // later writes are stored.
            codec: Compression::from_code((flags >> 8) as u8).unwrap_or_default(),
            shadow: in_use && flags & ENTRY_SHADOW != 0,
            aux: if in_use { get_u32(b, at + 28) } else { 0 },
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
        /// 0, or a packed block's packing flags ([`BlockMeta::pack_bits`]): the block is a
        /// member of the compressed stream starting at `phys` (format 3).
        pack: u32,
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
    /// Later writes of the extent in `slot` are compressed with `codec` (format 3): kept
    /// in the extent table for the cache tier's destage, which has no request in hand.
    Codec { slot: u32, codec: Compression },
    /// Slot `slot` now holds the shadow of extent `key` for snapshot `epoch`, every block
    /// absent (docs/adr/0012).
    Shadow {
        slot: u32,
        key: ExtentKey,
        epoch: u32,
    },
    /// The snapshot floor of the live extent in `slot` is `floor` (its volume's newest
    /// snapshot epoch; 0: none): later writes replacing a state of an epoch at most
    /// `floor` preserve it first; `since`: the oldest snapshot it holds (`u32::MAX`: none).
    Floor { slot: u32, floor: u32, since: u32 },
    /// Block `block` of the live extent in `slot` moves its durable state `meta`,
    /// physical block and all, into the extent's shadow for snapshot `snapshot`: queued
    /// just before the write (or zero) that replaces it, in the same batch. If that shadow
    /// is gone (the snapshot was deleted meanwhile), into the shadow of the extent's floor
    /// when that snapshot reads the state; else the state is not kept. Self-contained, as
    /// a Prior: replayed over metadata pages newer than it, it puts `meta` in the shadow
    /// and leaves a live block that moved on alone. `meta` is never packed (its flags fit
    /// a byte).
    Preserve {
        slot: u32,
        block: u32,
        snapshot: u32,
        meta: BlockMeta,
    },
    /// Block `block` of the live extent in `slot` is a member of a compressed group whose
    /// stream its other members still name, so its state cannot move: `meta` is a plain
    /// copy of it (its version and crc; `phys` a block written with its content before
    /// this record), kept in the shadow for `snapshot` (or the floor's, as for Preserve)
    /// if the live block still holds that state (version and crc), else `phys` is free.
    /// The live block keeps its state until the write that follows in the batch replaces
    /// it. Never packed.
    PreserveCopy {
        slot: u32,
        block: u32,
        snapshot: u32,
        meta: BlockMeta,
    },
    /// The shadow in `slot` is no longer a snapshot's (its snapshot is being deleted):
    /// Preserve records stop finding it, its states stay until [`Record::Keep`] moves
    /// them or [`Record::DropShadow`] frees them.
    Retire { slot: u32 },
    /// Block `block`'s state `meta` moves from the retired shadow in `from` into the
    /// shadow in `slot` (the next older snapshot also reads it): the merge-down of a
    /// deleted snapshot. Self-contained: replayed over newer pages it puts `meta` in the
    /// shadow and takes it out of `from` only if `from` still holds it. Never packed.
    Keep {
        slot: u32,
        block: u32,
        from: u32,
        meta: BlockMeta,
    },
    /// The retired shadow in `slot` goes: what it still holds is freed.
    DropShadow { slot: u32 },
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
                pack,
            } => {
                out[0] = 1;
                out[1] = u8::from(hold);
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, crc);
                put_u64(out, 16, version);
                put_u32(out, 24, phys);
                put_u32(out, 28, pack);
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
            Record::Codec { slot, codec } => {
                out[0] = 9;
                put_u32(out, 4, slot);
                out[8] = codec.code();
            }
            Record::Shadow { slot, key, epoch } => {
                out[0] = 10;
                put_u32(out, 4, slot);
                put_u64(out, 8, key.volume.0);
                put_u64(out, 16, key.slab.0);
                put_u32(out, 24, epoch);
            }
            Record::Floor { slot, floor, since } => {
                out[0] = 11;
                put_u32(out, 4, slot);
                put_u32(out, 8, floor);
                put_u32(out, 12, since);
            }
            Record::Preserve {
                slot,
                block,
                snapshot,
                meta,
            }
            | Record::PreserveCopy {
                slot,
                block,
                snapshot,
                meta,
            } => {
                debug_assert!(meta.flags <= 0xff, "a preserved state is never packed");
                out[0] = if matches!(self, Record::Preserve { .. }) {
                    12
                } else {
                    16
                };
                out[1] = meta.flags as u8;
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, snapshot);
                put_u64(out, 16, meta.version);
                put_u32(out, 24, meta.crc);
                put_u32(out, 28, meta.phys);
            }
            Record::DropShadow { slot } => {
                out[0] = 13;
                put_u32(out, 4, slot);
            }
            Record::Retire { slot } => {
                out[0] = 14;
                put_u32(out, 4, slot);
            }
            Record::Keep {
                slot,
                block,
                from,
                meta,
            } => {
                debug_assert!(meta.flags <= 0xff, "a preserved state is never packed");
                out[0] = 15;
                out[1] = meta.flags as u8;
                put_u32(out, 4, slot);
                put_u32(out, 8, block);
                put_u32(out, 12, from);
                put_u64(out, 16, meta.version);
                put_u32(out, 24, meta.crc);
                put_u32(out, 28, meta.phys);
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
            1 => {
                let pack = get_u32(b, 28);
                // A packing word this build does not understand is a record it cannot
                // apply: refuse it, as an unknown kind.
                if pack != 0 && !BlockMeta::flags_valid(pack | F_DATA) {
                    return None;
                }
                Record::Data {
                    slot,
                    block: get_u32(b, 8),
                    crc: get_u32(b, 12),
                    version: get_u64(b, 16),
                    phys: get_u32(b, 24),
                    hold: b[1] & 1 != 0,
                    pack,
                }
            }
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
                meta: {
                    let flags = get_u32(b, 28);
                    if BlockMeta::flags_valid(flags) {
                        BlockMeta {
                            crc: get_u32(b, 12),
                            version: get_u64(b, 16),
                            phys: get_u32(b, 24),
                            flags,
                        }
                    } else {
                        BlockMeta::BAD
                    }
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
            9 => Record::Codec {
                slot,
                codec: Compression::from_code(b[8])?,
            },
            10 => Record::Shadow {
                slot,
                key: ExtentKey {
                    volume: VolumeId(get_u64(b, 8)),
                    slab: SlabIndex(get_u64(b, 16)),
                },
                epoch: get_u32(b, 24),
            },
            11 => Record::Floor {
                slot,
                floor: get_u32(b, 8),
                since: get_u32(b, 12),
            },
            12 => Record::Preserve {
                slot,
                block: get_u32(b, 8),
                snapshot: get_u32(b, 12),
                meta: preserved_state(b),
            },
            13 => Record::DropShadow { slot },
            14 => Record::Retire { slot },
            15 => Record::Keep {
                slot,
                block: get_u32(b, 8),
                from: get_u32(b, 12),
                meta: preserved_state(b),
            },
            16 => Record::PreserveCopy {
                slot,
                block: get_u32(b, 8),
                snapshot: get_u32(b, 12),
                meta: preserved_state(b),
            },
            _ => return None,
        })
    }
}

/// The state a Preserve or Keep record names (flags in byte 1, version, crc, physical
/// block in bytes 16..32); flags this build does not know, or packed ones, are a lost state.
fn preserved_state(b: &[u8]) -> BlockMeta {
    let flags = u32::from(b[1]);
    if flags & F_PACKED == 0 && BlockMeta::flags_valid(flags) {
        BlockMeta {
            version: get_u64(b, 16),
            crc: get_u32(b, 24),
            flags,
            phys: get_u32(b, 28),
        }
    } else {
        BlockMeta::BAD
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
        let layout = Layout::compute(64 << 20, 1 << 20, 1 << 20, 2).unwrap();
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
            format_version: FORMAT_VERSION,
        }
    }

    #[test]
    fn layout_fits_and_regions_do_not_overlap() {
        for (len, slab, j, k) in [
            (64u64 << 20, 1u64 << 20, 1u64 << 20, 1),
            (64u64 << 20, 1u64 << 20, 1u64 << 20, 2),
            (1 << 40, 256 << 20, 128 << 20, 1),
            (1 << 40, 256 << 20, 128 << 20, 4),
            (10 << 20, 4096, 64 << 10, 2),
        ] {
            let l = Layout::compute(len, slab, j, k).unwrap();
            assert_eq!(l.extents_total, k * l.data_extents);
            assert!(l.table_len >= u64::from(l.extents_total).div_ceil(120) * 4096);
            assert!(l.table_off + l.table_len <= l.journal_off);
            assert!(l.journal_off + l.journal_len <= l.meta_off);
            assert!(
                l.meta_off
                    + u64::from(l.extents_total) * u64::from(l.meta_sectors_per_extent) * 512
                    <= l.data_off
            );
            assert!(l.data_off + l.data_blocks * BLOCK <= len);
            assert!(l.data_blocks >= u64::from(l.data_extents) * slab / BLOCK + SPARE_MIN_BLOCKS);
            assert_eq!(
                l.home_block(l.data_extents, 0),
                u32::MAX,
                "thin slots have no home"
            );
            assert_eq!(l.data_off % 4096, 0);
            assert!(
                u64::from(l.meta_sectors_per_extent) * u64::from(META_PER_SECTOR)
                    >= u64::from(l.blocks_per_extent)
            );
        }
        assert!(matches!(
            Layout::compute(1 << 20, 1 << 20, 1 << 20, 1),
            Err(EngineError::TooSmall { .. })
        ));
        assert!(Layout::compute(64 << 20, 1 << 20, 1 << 20, 0).is_err());
        assert!(Layout::compute(64 << 20, 1 << 20, 1 << 20, MAX_OVERCOMMIT + 1).is_err());
        // Twice the slots cost the data region only the extra slots' metadata.
        let one = Layout::compute(1 << 40, 256 << 20, 128 << 20, 1).unwrap();
        let two = Layout::compute(1 << 40, 256 << 20, 128 << 20, 2).unwrap();
        assert!(two.data_extents < one.data_extents);
        assert!(two.data_extents * 1000 > one.data_extents * 993);
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
            let _ = Layout::compute(len, 1 << 20, j, 2);
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
                pack: 0,
            },
            Record::Data {
                slot: 1,
                block: 2,
                crc: 3,
                version: 4,
                phys: 0x8765_4321,
                hold: true,
                pack: 0,
            },
            Record::Data {
                slot: 1,
                block: 7,
                crc: 3,
                version: 4,
                phys: 99,
                hold: false,
                pack: BlockMeta::packed(4, 3, 99, Compression::Zstd, 3, 4, 9000).pack_bits(),
            },
            Record::Codec {
                slot: 4,
                codec: Compression::Lz4,
            },
            Record::Shadow {
                slot: 9,
                key,
                epoch: 0xfeed_0001,
            },
            Record::Floor {
                slot: 9,
                floor: 0xfeed_0002,
                since: u32::MAX,
            },
            Record::Preserve {
                slot: 1,
                block: 15,
                snapshot: 9,
                meta: BlockMeta::data(0x1234_5678_9abc, 0xdead_beef, 77),
            },
            Record::Preserve {
                slot: 1,
                block: 16,
                snapshot: 9,
                meta: BlockMeta::zero(0x2_0000_0001),
            },
            Record::PreserveCopy {
                slot: 1,
                block: 17,
                snapshot: 9,
                meta: BlockMeta::data(0x1_0000_0003, 0xbeef, 4321),
            },
            Record::Retire { slot: 9 },
            Record::Keep {
                slot: 8,
                block: 3,
                from: 9,
                meta: BlockMeta::data(0x3_0000_0002, 0xfeed, 1234).suspect(),
            },
            Record::DropShadow { slot: 9 },
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
        // A packing word this build does not understand is refused, as an unknown kind.
        let mut v = Vec::new();
        Record::Data {
            slot: 1,
            block: 2,
            crc: 3,
            version: 4,
            phys: 5,
            hold: false,
            pack: F_PACKED | 0xf << 4 | 3 << 12 | 100 << 16,
        }
        .push(&mut v);
        assert_eq!(Record::decode(&v), None);
    }

    #[test]
    fn packed_metadata_describes_its_stream() {
        let m = BlockMeta::packed(7, 0xabc, 1000, Compression::Lz4, 2, 4, 8193);
        assert!(m.is_packed() && m.has_data() && !m.is_bad());
        assert_eq!(m.codec(), Compression::Lz4);
        assert_eq!((m.member(), m.group_blocks(), m.stream_len()), (2, 4, 8193));
        assert_eq!(m.run(), Some((1000, 3)));
        assert!(BlockMeta::flags_valid(m.flags));
        let other = BlockMeta::packed(8, 1, 1000, Compression::Lz4, 0, 4, 8193);
        assert!(m.same_storage(&other));
        assert!(!m.same_storage(&BlockMeta::data(7, 0xabc, 1000)));
        assert_eq!(BlockMeta::data(1, 2, 3).run(), Some((3, 1)));
        assert_eq!(BlockMeta::zero(1).run(), None);
        // A stream as long as its group saves nothing: never valid; nor an unknown codec.
        assert!(!BlockMeta::flags_valid(
            F_DATA | F_PACKED | 1 << 4 | 3 << 12 | 16384 << 16
        ));
        assert!(!BlockMeta::flags_valid(
            F_DATA | F_PACKED | 9 << 4 | 3 << 12 | 100 << 16
        ));
        assert!(!BlockMeta::flags_valid(
            F_DATA | F_PACKED | 1 << 4 | 5 << 8 | 3 << 12 | 1 << 16
        ));
        assert!(
            !BlockMeta::flags_valid(F_DATA | 1 << 20),
            "packing bits on a plain block"
        );
        // Round trip through a metadata sector; unknown flags read as a bad block.
        let metas = [m, BlockMeta::data(1, 2, 3), BlockMeta::zero(4)];
        let mut b = [0u8; 512];
        encode_meta_sector(&mut b, 1, 0, &metas);
        let mut back = vec![BlockMeta::default(); 24];
        assert!(decode_meta_sector(&b, 1, 0, &mut back));
        assert_eq!(&back[..3], &metas);
        put_u32(&mut b, 12, F_DATA | 1 << 30);
        let crc = crc32c::crc32c(&b[..508]);
        put_u32(&mut b, 508, crc);
        assert!(decode_meta_sector(&b, 1, 0, &mut back));
        assert_eq!(back[0], BlockMeta::BAD);
    }

    #[test]
    fn version_2_superblocks_still_open() {
        let mut s = sb();
        s.format_version = 2;
        s.layout = Layout::compute(64 << 20, 1 << 20, 1 << 20, 1).unwrap();
        let mut b = vec![0u8; 4096];
        s.encode(&mut b);
        let back = Superblock::decode(&b).unwrap().unwrap();
        assert_eq!(back, s);
        assert_eq!(back.layout.overcommit, 1);
        // A version-3 superblock whose overcommit does not fit its layout is refused.
        let mut t = sb();
        t.encode(&mut b);
        put_u32(&mut b, 168, 3);
        let crc = crc32c::crc32c(&b[..SB_BYTES - 4]);
        put_u32(&mut b, SB_BYTES - 4, crc);
        assert!(Superblock::decode(&b).is_err());
        t.format_version = 4;
        t.encode(&mut b);
        assert!(matches!(
            Superblock::decode(&b),
            Err(EngineError::UnsupportedVersion { .. })
        ));
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
