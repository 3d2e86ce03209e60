//! Target `engine_open`: recovery of a damaged capacity drive (crates/engine, recover.rs;
//! docs/FORMAT-engine.md).
//!
//! Once per process a small drive (2 MiB, 64 KiB slabs, 64 KiB journal) is formatted on an
//! in-memory file and written to: extents allocated, fenced, written, zeroed, freed, with
//! checkpoints along the way and a tail of journal batches left to replay. Its random
//! journal generation is replaced by a constant, so an input means the same everywhere.
//!
//! The input damages a copy-on-write view of that image, then `Drive::open` runs on it:
//! * byte 0: which checksums to recompute after the damage (bit 0 superblocks, bit 1
//!   extent-table and metadata sectors, bit 2 journal batches), so the fuzzer gets past
//!   crc checks to the validation behind them;
//! * then ops `[op u8][offset u32 LE][len u8][bytes]`: `op % 8` picks the region
//!   (superblock A, superblock B, extent table, whole journal, metadata, data, anywhere,
//!   the journal batches that replay), the offset is taken modulo its length, and up to
//!   `len % 64 + 1` bytes are written there.
//!
//! Properties: `Drive::open` returns Ok or an error, never panics or hangs. If Ok: every
//! extent reads (bad blocks reported, not panics); a new write reads back; the drive, now
//! checkpointed, opens again with the same extents (or refuses to, only when its
//! superblock generation is exhausted).

use crate::input::Input;
use crate::memfile::CowFile;
use converge_engine::layout::{
    batch_header, Layout, Superblock, BATCH_HEADER, BATCH_MAGIC, BLOCK, SB_BYTES, SB_MAGIC, SECTOR,
};
use converge_engine::{Drive, DriveIdentity, EngineError, FormatOptions};
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SettleRows, SlabIndex,
    Version, VolumeId,
};
use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

pub const SLAB: u64 = 64 << 10;
const BLOCKS: u64 = SLAB / BLOCK;
pub const DRIVE_BYTES: usize = 2 << 20;
pub const JOURNAL_BYTES: u64 = 64 << 10;
/// Every fixture's journal generation after normalisation.
pub const JOURNAL_GEN: u64 = 0x6a6f_7572_6e61_6c31;

pub fn ident(drive: u64, role: DriveRole) -> DriveIdentity {
    DriveIdentity {
        cluster: ClusterId(0x1234),
        node: NodeId(2),
        drive: DriveId(drive),
        slab_size_bytes: SLAB,
        role,
        media: MediaType::Ssd,
    }
}

pub fn key(v: u64, s: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(v),
        slab: SlabIndex(s),
    }
}

/// Deterministic block contents and their crcs.
pub fn blocks(seed: u64, n: usize) -> (Vec<u8>, Vec<u32>) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let data: Vec<u8> = (0..n * BLOCK as usize)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let crcs = data.chunks(BLOCK as usize).map(crc32c::crc32c).collect();
    (data, crcs)
}

/// The base image and what the harness needs to know about it.
pub struct Fixture {
    pub image: Arc<Vec<u8>>,
    pub layout: Layout,
    /// Journal bytes [tail, tail + live) hold the batches that replay.
    pub journal_tail: u64,
    pub journal_live: u64,
    pub batches: u64,
}

pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let file = Arc::new(CowFile::zeroed(DRIVE_BYTES));
        let d = Drive::format_with(
            file.clone(),
            ident(7, DriveRole::Capacity),
            FormatOptions {
                journal_bytes: Some(JOURNAL_BYTES),
                ..Default::default()
            },
        )
        .expect("format the fixture drive");
        populate(&d);
        drop(d);
        let mut image = file.image();
        let (journal_tail, journal_live, batches) = normalize(&mut image);
        let layout = Superblock::decode(&image[..SB_BYTES])
            .expect("fixture superblock")
            .expect("fixture is formatted")
            .layout;
        Fixture {
            image: Arc::new(image),
            layout,
            journal_tail,
            journal_live,
            batches,
        }
    })
}

/// The writes that make the fixture: enough journal traffic for checkpoints, and a
/// varied last stretch of batches (alloc, data, zero, epoch, free) left to replay.
pub fn populate(d: &Drive) {
    let (a, b, c) = (key(1, 0), key(1, 1), key(2, 5));
    let mut v = 1u64;
    let mut write = |k: ExtentKey, e: u64, block: u64, n: usize| {
        let (data, crcs) = blocks(v, n);
        d.write(k, Epoch(e), Version(v), block * BLOCK, &data, &crcs)
            .expect("fixture write");
        v += 1;
    };
    for round in 0..6 {
        for blk in 0..BLOCKS {
            write(a, 1, blk, 1);
        }
        write(b, 1, (round * 3) % (BLOCKS - 4), 4);
    }
    write(c, 1, 0, 8);
    d.zero(c, Epoch(1), Version(500), 2 * BLOCK, 3 * BLOCK)
        .expect("fixture zero");
    d.fence(b, Epoch(3)).expect("fixture fence");
    write(b, 3, 8, 2);
    d.free_extent(c).expect("fixture free");
    write(key(3, 9), 2, 5, 1);
    write(a, 1, 3, 1);
    write(a, 1, 3, 1);
    // A parity chunk's held writes: priors, a settle and a revert left to replay.
    let h = key(4, 2);
    write(h, 1, 0, 4);
    let mut held = |block: u64, n: usize| {
        let (data, crcs) = blocks(v, n);
        d.write_held(h, Epoch(1), Version(v), block * BLOCK, &data, &crcs)
            .expect("fixture held write");
        v += 1;
        v - 1
    };
    let first = held(0, 4);
    let second = held(2, 2);
    let rows = [SettleRows {
        first: 2,
        count: 1,
        upto: Version(second),
    }];
    d.settle(h, Epoch(1), Version(first), &rows)
        .expect("fixture settle");
    d.revert(h, Epoch(1), Version(second), 0, 4 * BLOCK)
        .expect("fixture revert");
    held(1, 1);
    // A snapshot of a compressed extent: members of its groups copied out of their stream
    // (PreserveCopy), a plain state moved (Preserve), left to replay.
    let z = key(5, 1);
    d.set_codec(z, Epoch(1), converge_types::Compression::Lz4)
        .expect("fixture codec");
    let text = |n: usize, seed: u8| {
        let data: Vec<u8> = (0..n * BLOCK as usize)
            .map(|i| (i % 64) as u8 ^ seed ^ (i / BLOCK as usize) as u8)
            .collect();
        let crcs: Vec<u32> = data.chunks(BLOCK as usize).map(crc32c::crc32c).collect();
        (data, crcs)
    };
    let (data, crcs) = text(8, 1);
    d.write(z, Epoch(1), Version(1 << 32 | 1), 0, &data, &crcs)
        .expect("fixture compressed write");
    let (data, crcs) = text(1, 2);
    d.write(z, Epoch(1), Version(1 << 32 | 2), 9 * BLOCK, &data, &crcs)
        .expect("fixture plain member");
    d.set_snapshot_floor(
        z,
        Epoch(1),
        Epoch(1),
        None,
        converge_types::FloorHistory::Continues,
    )
    .expect("fixture floor");
    let (data, crcs) = text(2, 3);
    d.write(z, Epoch(2), Version(2 << 32 | 1), BLOCK, &data, &crcs)
        .expect("fixture write into a group");
    d.zero(z, Epoch(2), Version(2 << 32 | 2), 5 * BLOCK, BLOCK)
        .expect("fixture zero of a member");
    let (data, crcs) = text(1, 4);
    d.write(z, Epoch(2), Version(2 << 32 | 3), 9 * BLOCK, &data, &crcs)
        .expect("fixture write of a plain state");
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Replaces the random journal generation by [`JOURNAL_GEN`] (superblocks and every batch
/// of that generation, resealed). Returns (tail, live bytes, batches) of the replay chain.
fn normalize(img: &mut [u8]) -> (u64, u64, u64) {
    let sbs: Vec<Superblock> = (0..2)
        .filter_map(|c| {
            Superblock::decode(&img[c * BLOCK as usize..])
                .ok()
                .flatten()
        })
        .collect();
    let sb = sbs
        .iter()
        .max_by_key(|s| s.generation)
        .expect("a valid superblock")
        .clone();
    let gen = sb.journal_gen;
    let l = &sb.layout;
    let js = sb.journal_sector as u64;
    let j0 = l.journal_off as usize;
    // Every batch of this generation anywhere in the journal, stale ones included.
    let mut pos = 0;
    while pos + BATCH_HEADER as u64 <= l.journal_len {
        let at = j0 + pos as usize;
        if get_u32(img, at) == BATCH_MAGIC && get_u64(img, at + 8) == gen {
            let len = get_u32(img, at + 24) as usize;
            if len >= BATCH_HEADER && pos + len as u64 <= l.journal_len {
                let crc_ok = crc32c::crc32c(&img[at + 8..at + len]) == get_u32(img, at + 4);
                img[at + 8..at + 16].copy_from_slice(&JOURNAL_GEN.to_le_bytes());
                if crc_ok {
                    let crc = crc32c::crc32c(&img[at + 8..at + len]);
                    img[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
                }
            }
        }
        pos += SECTOR as u64;
    }
    for s in sbs {
        let copy = (s.generation % 2) as usize;
        let s = Superblock {
            journal_gen: if s.journal_gen == gen {
                JOURNAL_GEN
            } else {
                JOURNAL_GEN - 1
            },
            ..s
        };
        s.encode(&mut img[copy * BLOCK as usize..]);
    }
    // The chain that replays, as open walks it.
    let (mut pos, mut seq, mut batches) = (sb.journal_tail, sb.journal_tail_seq, 0u64);
    let tail = pos;
    let mut end = pos;
    loop {
        let at = j0 + pos as usize;
        let hdr = &img[at..at + js as usize];
        match batch_header(hdr, JOURNAL_GEN, seq) {
            Some((len, _)) if pos + len as u64 <= l.journal_len => {
                pos += len as u64;
                end = pos;
                seq += 1;
                batches += 1;
            }
            _ => break,
        }
    }
    (tail, end - tail, batches)
}

/// Recomputes the checksums `what` asks for (see the module docs), over what the file
/// holds now: the fuzzer's bytes then pass the crc checks and reach the checks behind.
pub fn reseal(f: &CowFile, l: &Layout, what: u8) {
    let mut s = [0u8; SECTOR];
    if what & 1 != 0 {
        for copy in 0..2usize {
            let at = copy * BLOCK as usize;
            f.get(&mut s[..SB_BYTES], at);
            if s[..8] == SB_MAGIC {
                let crc = crc32c::crc32c(&s[..SB_BYTES - 4]);
                f.put(&crc.to_le_bytes(), at + SB_BYTES - 4);
            }
        }
    }
    if what & 2 != 0 {
        let regions = [
            (l.table_off, l.table_len),
            (l.meta_off, l.data_off - l.meta_off),
        ];
        for (off, len) in regions {
            for at in (off..off + len).step_by(SECTOR) {
                f.get(&mut s, at as usize);
                if s.iter().any(|&x| x != 0) {
                    let crc = crc32c::crc32c(&s[..508]);
                    f.put(&crc.to_le_bytes(), at as usize + 508);
                }
            }
        }
    }
    if what & 4 != 0 {
        // From the end: a header inside a longer batch is sealed before the batch is.
        let mut buf = Vec::new();
        for pos in (0..l.journal_len / SECTOR as u64)
            .rev()
            .map(|i| i * SECTOR as u64)
        {
            let at = (l.journal_off + pos) as usize;
            f.get(&mut s[..BATCH_HEADER], at);
            if get_u32(&s, 0) != BATCH_MAGIC {
                continue;
            }
            let len = get_u32(&s, 24) as u64;
            if len < BATCH_HEADER as u64 || pos + len > l.journal_len {
                continue;
            }
            buf.resize(len as usize, 0);
            f.get(&mut buf, at);
            let crc = crc32c::crc32c(&buf[8..]);
            f.put(&crc.to_le_bytes(), at + 4);
        }
    }
}

/// Applies the input's ops to `f`; `regions` are (offset, length) pairs picked by `op % n`.
pub fn damage(f: &CowFile, inp: &mut Input<'_>, regions: &[(u64, u64)]) {
    while !inp.is_empty() {
        let op = inp.u8() as usize;
        let off = u64::from(inp.u32());
        let len = usize::from(inp.u8() % 64) + 1;
        let bytes = inp.bytes(len);
        let (start, size) = regions[op % regions.len()];
        if size == 0 {
            continue;
        }
        let at = start + off % size;
        let room = (f.len() as u64 - at) as usize;
        let n = bytes.len().min(room);
        f.put(&bytes[..n], at as usize);
    }
}

pub fn engine_open(data: &[u8]) {
    let fx = fixture();
    let l = &fx.layout;
    let file = Arc::new(CowFile::new(fx.image.clone()));
    let mut inp = Input::new(data);
    let what = inp.u8();
    let regions = [
        (0, SB_BYTES as u64),
        (BLOCK, SB_BYTES as u64),
        (l.table_off, l.table_len),
        (l.journal_off, l.journal_len),
        (l.meta_off, l.data_off - l.meta_off),
        (l.data_off, l.data_blocks * BLOCK),
        (0, file.len() as u64),
        (l.journal_off + fx.journal_tail, fx.journal_live.max(1)),
    ];
    damage(&file, &mut inp, &regions);
    reseal(&file, l, what);

    let Ok(d) = Drive::open(file.clone()) else {
        return;
    };
    exercise(&d);
    let before = extents(&d);
    drop(d);
    let d = match Drive::open(file.clone()) {
        Ok(d) => d,
        // A superblock two generations short of u64::MAX: the first open's checkpoint
        // wrote the last usable one, the reopen's refuses to go further (as it should).
        Err(EngineError::Corrupt(m)) if m.contains("generation exhausted") => return,
        Err(e) => panic!("a drive that opened (and was checkpointed) fails to reopen: {e}"),
    };
    assert_eq!(extents(&d), before, "reopen sees other extents");
}

fn extents(d: &Drive) -> BTreeSet<(ExtentKey, Epoch)> {
    d.extents().into_iter().map(|e| (e.key, e.epoch)).collect()
}

/// Reads every extent, then writes one block and reads it back.
pub fn exercise(d: &Drive) {
    let slab = d.layout().slab_size_bytes;
    let mut buf = vec![0u8; slab as usize];
    let list = d.extents();
    for e in &list {
        let _ = d.read(e.key, e.epoch, 0, &mut buf);
        let _ = d.block_versions(e.key, 0, (slab / BLOCK) as usize);
    }
    let Some(e) = list.first() else {
        return;
    };
    let Ok(cur) = d.block_versions(e.key, BLOCK, 1) else {
        return;
    };
    let Some(v) = cur[0].0.checked_add(1) else {
        return;
    };
    let (data, crcs) = blocks(v, 1);
    if d.write(e.key, e.epoch, Version(v), BLOCK, &data, &crcs)
        .is_ok()
    {
        let mut back = vec![0u8; BLOCK as usize];
        let info = d
            .read(e.key, e.epoch, BLOCK, &mut back)
            .expect("a block just written reads");
        assert!(
            info.bad_blocks.is_empty(),
            "a block just written reads as bad"
        );
        assert!(back == data, "a block just written reads back other data");
    }
    let _ = d.fence_and_digest(e.key, e.epoch);
}
