//! Target `cache_replay`: opening a damaged cache drive (crates/engine/src/cache.rs,
//! docs/FORMAT-cache.md): superblock, log replay, and the destage of replayed blocks to
//! the capacity drive.
//!
//! Once per process a 16 MiB cache drive (the smallest allowed) in front of a 2 MiB
//! capacity drive gets a series of writes through the tier (several extents, rewrites, a
//! freed extent: dirty and drop records) and is left without destaging, so its log holds
//! batches to replay. Random generations are replaced by constants.
//!
//! The input damages a copy-on-write view of the cache image (the capacity image stays
//! intact), then `Cache::open` runs:
//! * byte 0: bit 0 recomputes superblock crcs, bit 1 batch-header crcs after the damage;
//! * then ops `[op u8][offset u32 LE][len u8][bytes]` as in `engine_open`, `op % 4` picking
//!   superblock A, superblock B, the logged batches, or the log's first megabytes.
//!
//! Properties: `Cache::open` returns Ok or an error, never panics or hangs; if Ok, every
//! extent reads through the tier without panicking.

use crate::engine::{blocks, ident, key, DRIVE_BYTES, JOURNAL_BYTES};
use crate::input::Input;
use crate::memfile::CowFile;
use converge_engine::layout::BLOCK;
use converge_engine::{Cache, Drive, FormatOptions, Tier};
use converge_types::{DriveId, DriveRole, Epoch, ExtentKey, Version};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

pub const CACHE_BYTES: usize = 16 << 20;
const LOG_OFF: usize = 8192;
const SB_CRC: usize = 252;
const HDR: usize = 40;
const REC: usize = 48;
const CACHE_MAGIC: &[u8; 8] = b"CVGCACH1";
const BATCH_MAGIC: &[u8; 4] = b"CVCB";
pub const LOG_GEN: u64 = 0x6361_6368_656c_6f67;
/// Log bytes the harness damages and reseals: the logged batches lie well inside.
const LOG_WINDOW: usize = 2 << 20;
const CAP_DRIVE: u64 = 7;
const CACHE_DRIVE: u64 = 9;

pub struct Fixture {
    pub cap: Arc<Vec<u8>>,
    pub cache: Arc<Vec<u8>>,
    /// Log bytes [0, logged) hold the batches.
    pub logged: u64,
    pub keys: Vec<ExtentKey>,
}

pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let capf = Arc::new(CowFile::zeroed(DRIVE_BYTES));
        let cachef = Arc::new(CowFile::zeroed(CACHE_BYTES));
        let cap = Arc::new(
            Drive::format_with(
                capf.clone(),
                ident(CAP_DRIVE, DriveRole::Capacity),
                FormatOptions {
                    journal_bytes: Some(JOURNAL_BYTES),
                    ..Default::default()
                },
            )
            .expect("format the fixture capacity drive"),
        );
        let caps = HashMap::from([(DriveId(CAP_DRIVE), cap.clone())]);
        let (cache, report) =
            Cache::open(cachef.clone(), ident(CACHE_DRIVE, DriveRole::Cache), &caps)
                .expect("format the fixture cache drive");
        assert!(report.formatted);
        let tier = Tier::new(cap.clone());
        tier.bind(cache.clone());
        let keys = populate(&tier);
        drop((tier, cache, caps, cap));
        let capi = normalize_cap(capf.image());
        let mut cachei = cachef.image();
        let logged = normalize_cache(&mut cachei);
        Fixture {
            cap: Arc::new(capi),
            cache: Arc::new(cachei),
            logged,
            keys,
        }
    })
}

/// Writes through the tier: they land in the cache log (no destage thread runs).
fn populate(t: &Tier) -> Vec<ExtentKey> {
    let (a, b, c) = (key(1, 0), key(1, 1), key(4, 2));
    let mut v = 1u64;
    let mut write = |k: ExtentKey, block: u64, n: usize| {
        let (data, crcs) = blocks(v, n);
        t.write(k, Epoch(1), Version(v), block * BLOCK, &data, &crcs)
            .expect("fixture write through the cache");
        v += 1;
    };
    for blk in 0..8 {
        write(a, blk, 1);
    }
    write(b, 0, 4);
    write(c, 2, 2);
    for blk in 0..4 {
        write(a, blk, 1);
    }
    t.free_extent(c).expect("fixture free");
    write(b, 6, 3);
    write(a, 7, 1);
    vec![a, b, c]
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The capacity drive opened once more: its own journal replayed and checkpointed, so
/// every input starts from the same durable capacity image (generation fixed below).
fn normalize_cap(img: Vec<u8>) -> Vec<u8> {
    let f = Arc::new(CowFile::new(Arc::new(img)));
    drop(Drive::open(f.clone()).expect("reopen the fixture capacity drive"));
    let mut img = f.image();
    // Drive::open bumps the generation by one on each open: fix it for determinism.
    for copy in 0..2usize {
        let at = copy * BLOCK as usize;
        if let Ok(Some(sb)) = converge_engine::layout::Superblock::decode(&img[at..]) {
            let sb = converge_engine::layout::Superblock {
                journal_gen: crate::engine::JOURNAL_GEN + copy as u64,
                ..sb
            };
            sb.encode(&mut img[at..]);
        }
    }
    img
}

/// Replaces the cache's random log generation by [`LOG_GEN`]; returns the log bytes the
/// batches of that generation span.
fn normalize_cache(img: &mut [u8]) -> u64 {
    let mut gen = None;
    let mut best = 0;
    for copy in 0..2usize {
        let at = copy * 4096;
        if &img[at..at + 8] == CACHE_MAGIC && get_u64(img, at + 16) >= best {
            best = get_u64(img, at + 16);
            gen = Some(get_u64(img, at + 88));
        }
    }
    let gen = gen.expect("a cache superblock");
    let mut end = 0;
    for pos in (0..LOG_WINDOW).step_by(512) {
        let at = LOG_OFF + pos;
        if &img[at..at + 4] != BATCH_MAGIC || get_u64(img, at + 8) != gen {
            continue;
        }
        let n = get_u32(img, at + 28) as usize;
        let hl = HDR + n * REC;
        img[at + 8..at + 16].copy_from_slice(&LOG_GEN.to_le_bytes());
        let crc = crc32c::crc32c(&img[at + 8..at + hl]);
        img[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        end = end.max(pos + get_u32(img, at + 24) as usize);
    }
    for copy in 0..2usize {
        let at = copy * 4096;
        if &img[at..at + 8] == CACHE_MAGIC && get_u64(img, at + 88) == gen {
            img[at + 88..at + 96].copy_from_slice(&LOG_GEN.to_le_bytes());
            let crc = crc32c::crc32c(&img[at..at + SB_CRC]);
            img[at + SB_CRC..at + SB_CRC + 4].copy_from_slice(&crc.to_le_bytes());
        }
    }
    end as u64
}

fn reseal(f: &CowFile, what: u8) {
    let mut b = [0u8; 256];
    if what & 1 != 0 {
        for copy in 0..2usize {
            let at = copy * 4096;
            f.get(&mut b, at);
            if &b[..8] == CACHE_MAGIC {
                let crc = crc32c::crc32c(&b[..SB_CRC]);
                f.put(&crc.to_le_bytes(), at + SB_CRC);
            }
        }
    }
    if what & 2 != 0 {
        let mut hdr = Vec::new();
        for pos in (0..LOG_WINDOW).step_by(512).rev() {
            let at = LOG_OFF + pos;
            f.get(&mut b[..HDR], at);
            if &b[..4] != BATCH_MAGIC {
                continue;
            }
            let n = get_u32(&b, 28) as usize;
            let Some(hl) = n.checked_mul(REC).map(|x| x + HDR) else {
                continue;
            };
            if pos + hl > LOG_WINDOW {
                continue;
            }
            hdr.resize(hl, 0);
            f.get(&mut hdr, at);
            let crc = crc32c::crc32c(&hdr[8..]);
            f.put(&crc.to_le_bytes(), at + 4);
        }
    }
}

pub fn cache_replay(data: &[u8]) {
    let fx = fixture();
    let capf = Arc::new(CowFile::new(fx.cap.clone()));
    let cachef = Arc::new(CowFile::new(fx.cache.clone()));
    let mut inp = Input::new(data);
    let what = inp.u8();
    let regions = [
        (0, 256),
        (4096, 256),
        (LOG_OFF as u64, fx.logged.max(1)),
        (LOG_OFF as u64, LOG_WINDOW as u64),
    ];
    crate::engine::damage(&cachef, &mut inp, &regions);
    reseal(&cachef, what);

    let cap = Arc::new(Drive::open(capf).expect("the undamaged capacity drive opens"));
    let caps = HashMap::from([(DriveId(CAP_DRIVE), cap.clone())]);
    let Ok((cache, _report)) = Cache::open(cachef, ident(CACHE_DRIVE, DriveRole::Cache), &caps)
    else {
        return;
    };
    let tier = Tier::new(cap);
    tier.bind(cache);
    let mut buf = vec![0u8; crate::engine::SLAB as usize];
    for k in &fx.keys {
        let _ = tier.read(*k, Epoch(1), 0, &mut buf);
    }
}
