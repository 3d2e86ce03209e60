//! Cache tier tests on simulated files (power loss, torn writes) and one on real O_DIRECT
//! files.

use super::*;
use crate::{FaultyFile, FormatOptions};
use converge_types::MediaType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SLAB: u64 = 1 << 20;
const NB: u64 = SLAB / BS;

fn ident(drive: u64, role: DriveRole) -> DriveIdentity {
    DriveIdentity {
        cluster: ClusterId(0x1234),
        node: NodeId(2),
        drive: DriveId(drive),
        slab_size_bytes: SLAB,
        role,
        media: MediaType::Ssd,
    }
}

fn key(v: u64, s: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(v),
        slab: SlabIndex(s),
    }
}

fn block(seed: u64) -> (Vec<u8>, u32) {
    let mut d = vec![0u8; BLOCK_SIZE];
    StdRng::seed_from_u64(seed).fill(&mut d[..]);
    let c = crc32c::crc32c(&d);
    (d, c)
}

struct Rig {
    capf: FaultyFile,
    cachef: FaultyFile,
    cap: Arc<Drive>,
    cache: Arc<Cache>,
    tier: Tier,
}

fn rig_with(capf: FaultyFile, cachef: FaultyFile, fresh: bool) -> (Rig, OpenReport) {
    let cap = if fresh {
        Drive::format_with(
            Arc::new(capf.clone()),
            ident(7, DriveRole::Capacity),
            FormatOptions {
                journal_bytes: Some(1 << 20),
                ..Default::default()
            },
        )
        .expect("format capacity")
    } else {
        Drive::open(Arc::new(capf.reattach())).expect("open capacity")
    };
    let cap = Arc::new(cap);
    let mut caps = HashMap::new();
    caps.insert(DriveId(7), cap.clone());
    let (cache, report) = Cache::open(
        Arc::new(cachef.reattach()),
        ident(9, DriveRole::Cache),
        &caps,
    )
    .expect("open cache");
    let tier = Tier::new(cap.clone());
    tier.bind(cache.clone());
    (
        Rig {
            capf,
            cachef,
            cap,
            cache,
            tier,
        },
        report,
    )
}

fn rig(cache_bytes: u64) -> Rig {
    rig_with(
        FaultyFile::new(16 << 20),
        FaultyFile::new(cache_bytes),
        true,
    )
    .0
}

fn reopen(r: Rig, seed: u64) -> (Rig, OpenReport) {
    r.cache.stop();
    r.capf.crash(seed);
    r.cachef.crash(seed + 1);
    let (capf, cachef) = (r.capf.clone(), r.cachef.clone());
    drop(r);
    rig_with(capf, cachef, false)
}

fn write(t: &Tier, k: ExtentKey, b: u64, version: u64, seed: u64) {
    let (d, c) = block(seed);
    t.write(k, Epoch(1), Version(version), b * BS, &d, &[c])
        .expect("write");
}

fn read_block(t: &Tier, k: ExtentKey, b: u64) -> (Vec<u8>, ReadInfo) {
    let mut buf = vec![0u8; BLOCK_SIZE];
    let info = t.read(k, Epoch(1), b * BS, &mut buf).expect("read");
    (buf, info)
}

fn read_cap(d: &Drive, k: ExtentKey, b: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK_SIZE];
    let info = d.read(k, Epoch(1), b * BS, &mut buf).expect("read");
    assert!(info.bad_blocks.is_empty(), "capacity block {b} is bad");
    buf
}

#[test]
fn writes_land_in_the_log_then_destage_to_capacity_once() {
    let r = rig(32 << 20);
    let k = key(1, 0);
    // 50 rewrites of each of 8 blocks: only the newest of each reaches capacity.
    for round in 0..50u64 {
        for b in 0..8u64 {
            write(&r.tier, k, b, round * 8 + b + 1, round * 100 + b);
        }
    }
    let cap_data_before = r.cap.stats().data_write_bytes;
    assert_eq!(
        cap_data_before, 0,
        "nothing reached capacity before destage"
    );
    for b in 0..8u64 {
        let (d, info) = read_block(&r.tier, k, b);
        assert_eq!(d, block(49 * 100 + b).0, "block {b} reads its newest write");
        assert_eq!(info.versions, Version(49 * 8 + b + 1));
    }
    assert!(r.cache.stats().dirty_bytes == 8 * BS);
    r.cache.flush().expect("flush");
    assert_eq!(r.cache.stats().dirty_bytes, 0);
    assert_eq!(
        r.cap.stats().data_write_bytes,
        8 * BS,
        "each block reached capacity exactly once"
    );
    for b in 0..8u64 {
        assert_eq!(read_cap(&r.cap, k, b), block(49 * 100 + b).0);
        assert_eq!(read_block(&r.tier, k, b).0, block(49 * 100 + b).0);
    }
    let v = r.tier.block_versions(k, 0, 8).expect("versions");
    assert_eq!(v[3], Version(49 * 8 + 4));
}

/// A compressed extent's writes land in the log as written and are compressed when they
/// are destaged (by a flush, or by the replay after a crash): the capacity drive stores
/// less than was written, and every read returns what was written.
#[test]
fn destage_compresses_the_writes_of_compressed_extents() {
    for (seed, flush) in [(1u64, true), (2, false)] {
        let r = rig(32 << 20);
        let k = key(1, 0);
        r.tier
            .set_codec(k, Epoch(1), converge_types::Compression::Zstd)
            .expect("codec");
        let mut data = vec![0u8; 64 * BLOCK_SIZE];
        let mut rng = StdRng::seed_from_u64(seed);
        for blk in data.chunks_mut(BLOCK_SIZE) {
            let mut pat = [0u8; 32];
            rng.fill(&mut pat[..]);
            for (i, x) in blk.iter_mut().enumerate() {
                *x = pat[i % 32];
            }
        }
        let crcs: Vec<u32> = data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect();
        r.tier
            .write(k, Epoch(1), Version(1), 0, &data, &crcs)
            .expect("write");
        assert_eq!(r.cap.stats().data_write_bytes, 0, "in the log only");
        let r = if flush {
            r.cache.flush().expect("flush");
            r
        } else {
            let (r, _) = reopen(r, seed);
            r.cache.flush().expect("flush");
            r
        };
        let e = r
            .cap
            .extents()
            .into_iter()
            .find(|e| e.key == k)
            .expect("extent");
        assert_eq!(e.bytes_written, 64 * BS);
        assert_eq!(e.bytes_stored, 16 * BS, "each group of four in one block");
        assert_eq!(r.tier.codec_of(k), converge_types::Compression::Zstd);
        assert!(r.cap.stats().data_write_bytes <= 16 * BS);
        for b in 0..64u64 {
            let at = b as usize * BLOCK_SIZE;
            assert_eq!(read_cap(&r.cap, k, b), &data[at..at + BLOCK_SIZE]);
            assert_eq!(read_block(&r.tier, k, b).0, &data[at..at + BLOCK_SIZE]);
        }
    }
}

#[test]
fn a_crash_loses_no_acked_write_and_replay_destages_them() {
    for seed in 0..20u64 {
        let r = rig(16 << 20);
        let k = key(1, seed % 3);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut model: HashMap<u64, (u64, u64)> = HashMap::new();
        for v in 1..=120u64 {
            let b = rng.gen_range(0..64u64);
            write(&r.tier, k, b, v, v * 1000 + seed);
            model.insert(b, (v, v * 1000 + seed));
            if v % 40 == 0 {
                r.cache.flush().expect("flush");
            }
        }
        // An unacked write in flight at the crash: torn or lost, never harmful.
        let (d, c) = block(99);
        let b = rng.gen_range(0..64u64);
        let _ = r.tier.write(k, Epoch(1), Version(500), b * BS, &d, &[c]);
        let torn_block = b;
        let (r, report) = reopen(r, seed * 7);
        assert!(report.blocks_lost == 0);
        for (&b, &(v, s)) in &model {
            let got = read_cap(&r.cap, k, b);
            if b == torn_block {
                assert!(
                    got == block(s).0 || got == d,
                    "seed {seed}: block {b} is neither its old nor its new content"
                );
            } else {
                assert_eq!(
                    got,
                    block(s).0,
                    "seed {seed}: acked version {v} of block {b} lost"
                );
            }
        }
    }
}

#[test]
fn a_torn_newest_batch_keeps_the_older_logged_version() {
    // Crash right after the second write's batch is issued but before it is synced.
    for seed in 0..16u64 {
        let r = rig(16 << 20);
        let k = key(2, 0);
        write(&r.tier, k, 5, 5, 1);
        let (d, c) = block(2);
        // Drop everything not synced: issue a write whose sync we pretend never happened.
        r.cachef.crash_after_writes(2, seed);
        let _ = r.tier.write(k, Epoch(1), Version(6), 5 * BS, &d, &[c]);
        let (r, _) = reopen(r, seed);
        let got = read_cap(&r.cap, k, 5);
        assert!(
            got == block(1).0 || got == d,
            "seed {seed}: block holds neither v5 nor v6"
        );
        assert_eq!(
            got,
            block(1).0,
            "seed {seed}: the v6 batch was never written"
        );
    }
}

#[test]
fn a_freed_extent_is_not_resurrected_by_replay() {
    let r = rig(16 << 20);
    let k = key(3, 0);
    write(&r.tier, k, 1, 50, 1);
    r.tier.free_extent(k).expect("free");
    // Reallocated with older versions (a copy coming back from a replica).
    let (d, c) = block(2);
    r.tier
        .write_blocks(k, Epoch(1), BS, &d, &[c], &[Version(10)], &[Version(0)])
        .expect("copy in");
    let (r, _) = reopen(r, 3);
    assert_eq!(
        read_cap(&r.cap, k, 1),
        d,
        "the freed extent's v50 came back"
    );
}

#[test]
fn zero_and_compare_and_set_copies_see_logged_versions() {
    let r = rig(16 << 20);
    let k = key(4, 0);
    write(&r.tier, k, 0, 7, 1);
    write(&r.tier, k, 1, 7, 2);
    // A copy expecting the capacity version (0) is refused: the log holds v7.
    let (d, c) = block(3);
    let n = r
        .tier
        .write_blocks(k, Epoch(1), 0, &d, &[c], &[Version(9)], &[Version(0)])
        .expect("copy");
    assert_eq!(n, 0);
    let n = r
        .tier
        .write_blocks(k, Epoch(1), 0, &d, &[c], &[Version(9)], &[Version(7)])
        .expect("copy");
    assert_eq!(n, 1);
    assert_eq!(read_block(&r.tier, k, 0).0, d);
    // Zero at v8 hides block 1's v7.
    r.tier.zero(k, Epoch(1), Version(8), BS, BS).expect("zero");
    assert_eq!(read_block(&r.tier, k, 1).0, vec![0u8; BLOCK_SIZE]);
    let v = r.tier.block_versions(k, 0, 2).expect("versions");
    assert_eq!(v, vec![Version(9), Version(8)]);
    r.cache.flush().expect("flush");
    assert_eq!(read_cap(&r.cap, k, 0), d);
    assert_eq!(read_cap(&r.cap, k, 1), vec![0u8; BLOCK_SIZE]);
    let (r, _) = reopen(r, 1);
    assert_eq!(read_cap(&r.cap, k, 1), vec![0u8; BLOCK_SIZE]);
}

#[test]
fn the_digest_is_the_same_with_or_without_the_cache() {
    let r = rig(16 << 20);
    let plain = Drive::format_with(
        Arc::new(FaultyFile::new(16 << 20)),
        ident(8, DriveRole::Capacity),
        FormatOptions {
            journal_bytes: Some(1 << 20),
            ..Default::default()
        },
    )
    .expect("format");
    let k = key(5, 0);
    for (b, v) in [(0u64, 3u64), (9, 4), (0, 5), (200, 6)] {
        let (d, c) = block(b * 10 + v);
        r.tier
            .write(k, Epoch(1), Version(v), b * BS, &d, &[c])
            .expect("write");
        plain
            .write(k, Epoch(1), Version(v), b * BS, &d, &[c])
            .expect("write");
    }
    let want = plain.fence_and_digest(k, Epoch(2)).expect("digest");
    assert_eq!(r.tier.fence_and_digest(k, Epoch(2)).expect("digest"), want);
    r.cache.flush().expect("flush");
    assert_eq!(r.tier.fence_and_digest(k, Epoch(2)).expect("digest"), want);
    // The fence holds for the tier: an older epoch is refused.
    let (d, c) = block(1);
    assert!(matches!(
        r.tier.write(k, Epoch(1), Version(9), 0, &d, &[c]),
        Err(EngineError::StaleEpoch { .. })
    ));
}

#[test]
fn mode_none_writes_capacity_and_drains_the_log() {
    let r = rig(16 << 20);
    let k = key(6, 0);
    write(&r.tier, k, 0, 1, 1);
    write(&r.tier, k, 1, 2, 2);
    r.cache.set_mode(CacheMode::None);
    // Block 1 still has a logged version: written through the log; block 2 goes direct.
    write(&r.tier, k, 1, 3, 3);
    write(&r.tier, k, 2, 4, 4);
    assert_eq!(read_cap(&r.cap, k, 2), block(4).0, "direct write");
    assert_eq!(read_block(&r.tier, k, 1).0, block(3).0);
    r.cache.start();
    r.cache.flush().expect("flush");
    for (b, s) in [(0, 1), (1, 3), (2, 4)] {
        assert_eq!(read_cap(&r.cap, k, b), block(s).0);
    }
    r.cache.set_mode(CacheMode::Write);
    write(&r.tier, k, 2, 5, 5);
    assert_eq!(read_block(&r.tier, k, 2).0, block(5).0);
    r.cache.stop();
}

#[test]
fn read_write_mode_admits_on_the_second_miss_and_hits_after() {
    let r = rig(16 << 20);
    let k = key(7, 0);
    r.cache.set_mode(CacheMode::None);
    for b in 0..16 {
        write(&r.tier, k, b, b + 1, b);
    }
    r.cache.set_mode(CacheMode::ReadWrite);
    r.cache.start();
    for _ in 0..2 {
        for b in 0..16 {
            assert_eq!(read_block(&r.tier, k, b).0, block(b).0);
        }
    }
    // Admission happens in the background.
    for _ in 0..200 {
        if r.cache.stats().clean_bytes == 16 * BS {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(r.cache.stats().clean_bytes, 16 * BS, "16 blocks admitted");
    let hits = r.cache.stats().read_hit_blocks;
    for b in 0..16 {
        assert_eq!(read_block(&r.tier, k, b).0, block(b).0);
    }
    assert_eq!(r.cache.stats().read_hit_blocks, hits + 16);
    // A write replaces the clean copy; reads see the new data.
    write(&r.tier, k, 3, 100, 77);
    assert_eq!(read_block(&r.tier, k, 3).0, block(77).0);
    r.cache.stop();
}

#[test]
fn a_full_log_slows_writes_down_instead_of_failing_them() {
    let r = rig(CACHE_MIN_BYTES);
    r.cache.set_destage(64 << 20, 25, 80);
    r.cache.start();
    let k = key(8, 0);
    let mut v = 0;
    // 4 x the log's size in 64 KiB writes.
    let (d, c) = block(1);
    let mut data = Vec::new();
    let mut crcs = Vec::new();
    for _ in 0..16 {
        data.extend_from_slice(&d);
        crcs.push(c);
    }
    for round in 0..(4 * CACHE_MIN_BYTES / (16 * BS)) {
        v += 1;
        let off = (round % (NB / 16)) * 16 * BS;
        r.tier
            .write(k, Epoch(1), Version(v), off, &data, &crcs)
            .expect("write waits, never fails");
    }
    r.cache.flush().expect("flush");
    assert_eq!(r.cache.stats().dirty_bytes, 0);
    assert!(r.cache.stats().write_stalls > 0, "the log did fill up");
    assert_eq!(read_cap(&r.cap, k, 5), d);
    r.cache.stop();
}

#[test]
fn random_writes_reach_capacity_with_little_amplification() {
    let r = rig(16 << 20);
    r.cache.start();
    let k = key(9, 0);
    let mut rng = StdRng::seed_from_u64(5);
    let n = 2000u64;
    for v in 1..=n {
        let b = rng.gen_range(0..NB);
        write(&r.tier, k, b, v, v);
    }
    r.cache.flush().expect("flush");
    let s = r.cap.stats();
    let client = n * BS;
    // Rewrites are coalesced, so capacity may see less data than the client sent; what it
    // does see costs little beyond the data (journal records and checkpoints).
    assert!(s.data_write_bytes <= client);
    let wa = s.write_bytes as f64 / s.data_write_bytes as f64;
    assert!(
        wa <= 1.02,
        "capacity write amplification {wa:.3} over its data"
    );
    r.cache.stop();
}

#[test]
fn real_files_round_trip_with_o_direct() {
    let dir = std::env::temp_dir().join(format!("cvg-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let capf = Arc::new(crate::DirectFile::open(&dir.join("cap"), Some(16 << 20)).expect("cap"));
    let cachef: Arc<dyn BlockFile> =
        Arc::new(crate::DirectFile::open(&dir.join("cache"), Some(16 << 20)).expect("cache"));
    let cap = Arc::new(Drive::format(capf, ident(7, DriveRole::Capacity)).expect("format"));
    let mut caps = HashMap::new();
    caps.insert(DriveId(7), cap.clone());
    let (cache, rep) = Cache::open(cachef, ident(9, DriveRole::Cache), &caps).expect("open");
    assert!(rep.formatted);
    let tier = Tier::new(cap.clone());
    tier.bind(cache.clone());
    let k = key(1, 1);
    for b in 0..32 {
        write(&tier, k, b, b + 1, b);
    }
    for b in 0..32 {
        assert_eq!(read_block(&tier, k, b).0, block(b).0);
    }
    cache.flush().expect("flush");
    for b in 0..32 {
        assert_eq!(read_cap(&cap, k, b), block(b).0);
    }
    drop(tier);
    drop(cache);
    std::fs::remove_dir_all(&dir).ok();
}

/// Found by the cluster simulation (variant `cache`, seed 199): resync rolls a block back
/// from a deposed owner's unacked write (newer version) to the acked one (older version)
/// with a compare-and-set copy. Through the log, destage ("newest version wins") and
/// replay (highest logged version) both brought the rolled-back write back.
#[test]
fn a_copy_that_rolls_a_block_back_survives_destage_and_replay() {
    for destaged_before in [false, true] {
        for crash in [false, true] {
            let r = rig(16 << 20);
            let k = key(10, 0);
            write(&r.tier, k, 3, 5, 1);
            // An unacked write of a deposed owner that reached only this copy.
            write(&r.tier, k, 3, 10, 2);
            if destaged_before {
                r.cache.flush().expect("flush");
            }
            // Resync copies the acked version back from another copy.
            let (d, c) = block(1);
            let n = r
                .tier
                .write_blocks(k, Epoch(1), 3 * BS, &d, &[c], &[Version(5)], &[Version(10)])
                .expect("copy");
            assert_eq!(n, 1, "the copy expected version 10 and applies");
            assert_eq!(read_block(&r.tier, k, 3).0, d);
            let r = if crash {
                reopen(r, 11).0
            } else {
                r.cache.flush().expect("flush");
                r
            };
            let case = format!("destaged before: {destaged_before}, crash: {crash}");
            assert!(
                read_block(&r.tier, k, 3).0 == d,
                "{case}: the rolled-back write came back"
            );
            assert!(
                read_cap(&r.cap, k, 3) == d,
                "{case}: capacity holds the wrong data"
            );
            assert_eq!(
                r.tier.block_versions(k, 3 * BS, 1).expect("versions"),
                vec![Version(5)],
                "{case}"
            );
        }
    }
}

#[test]
fn a_flush_keeps_the_logged_copies_as_read_cache_and_replay_is_harmless() {
    let r = rig(16 << 20);
    r.cache.set_mode(CacheMode::ReadWrite);
    let k = key(11, 0);
    for b in 0..8u64 {
        write(&r.tier, k, b, b + 1, b);
    }
    r.cache.flush().expect("flush");
    let s = r.cache.stats();
    assert_eq!(s.dirty_bytes, 0);
    assert_eq!(s.clean_bytes, 8 * BS, "flushed blocks stay as clean copies");
    for b in 0..8u64 {
        assert_eq!(
            read_cap(&r.cap, k, b),
            block(b).0,
            "capacity holds block {b}"
        );
    }
    let hits = r.cache.stats().read_hit_blocks;
    for b in 0..8u64 {
        assert_eq!(read_block(&r.tier, k, b).0, block(b).0);
    }
    assert_eq!(
        r.cache.stats().read_hit_blocks,
        hits + 8,
        "reads hit the clean copies"
    );
    // A newer write after the flush, then power loss: replay keeps the newest version.
    write(&r.tier, k, 2, 100, 50);
    let (r, rep) = reopen(r, 4);
    assert_eq!(
        rep.blocks_destaged, 1,
        "only the write after the flush was replayed"
    );
    assert_eq!(read_cap(&r.cap, k, 2), block(50).0);
    assert_eq!(read_cap(&r.cap, k, 3), block(3).0);
}

/// A superblock whose crc is right but whose log fields are not what `format` wrote is
/// refused, not used to size log reads (fuzz/corpus cache_replay: a tail past the log
/// overflowed `log_len - pos`, a sector of 0 divided by zero).
#[test]
fn superblock_with_impossible_log_fields_is_refused() {
    let f = FaultyFile::new(16 << 20);
    Cache::format(&f, ident(9, DriveRole::Cache)).expect("format");
    let good = read_sb(&f).expect("read").expect("formatted");
    let mut b = vec![0u8; SB_BLOCK as usize];
    good.encode(&mut b);
    assert_eq!(CacheSb::decode(&b).expect("valid"), Some(good.clone()));
    let bad: [fn(&mut CacheSb); 9] = [
        |sb| sb.generation = u64::MAX,
        |sb| sb.tail_seq = 0,
        |sb| sb.tail_seq = u64::MAX,
        |sb| sb.sector = 0,
        |sb| sb.sector = 1000,
        |sb| sb.tail = sb.log_len + 4096,
        |sb| sb.tail = u64::MAX - 100,
        |sb| sb.tail = 100,
        |sb| sb.log_len += BS,
    ];
    for (i, f) in bad.iter().enumerate() {
        let mut sb = good.clone();
        f(&mut sb);
        sb.encode(&mut b);
        assert!(CacheSb::decode(&b).is_err(), "case {i}: {sb:?}");
    }
    // The tail may sit at the very end of the log (the head of a full log).
    let mut sb = good.clone();
    sb.tail = sb.log_len;
    sb.encode(&mut b);
    assert!(CacheSb::decode(&b).is_ok());
}

/// A parity chunk's held writes go around the cache: a logged block not yet destaged
/// reaches capacity first (so it is the prior), the write lands on capacity, and neither
/// a cached copy nor a replayed log record can bring back what a revert undid.
#[test]
fn held_writes_go_around_the_cache_and_reverts_stay_reverted() {
    for crash in [false, true] {
        for cached_copy in [false, true] {
            let case = format!("crash {crash}, cached copy of the held write {cached_copy}");
            let r = rig(16 << 20);
            let k = key(12, 0);
            // Version 1 is in the log only (dirty, not destaged).
            write(&r.tier, k, 2, 1, 1);
            assert_eq!(r.cache.stats().dirty_bytes, BS, "{case}");
            let (d2, c2) = block(2);
            r.tier
                .write_held(k, Epoch(1), Version(2), 2 * BS, &d2, &[c2])
                .expect("held write");
            assert_eq!(r.cache.stats().dirty_bytes, 0, "{case}: drained first");
            assert_eq!(read_cap(&r.cap, k, 2), d2, "{case}: on capacity");
            assert_eq!(read_block(&r.tier, k, 2).0, d2, "{case}");
            assert_eq!(
                r.tier.priors(k, Epoch(1), 2 * BS, 1).expect("priors"),
                vec![(Version(2), Some(Version(1)))],
                "{case}: the logged version is the prior"
            );
            if cached_copy {
                // The read cache keeps a clean copy of the held write (second miss).
                r.cache.set_mode(CacheMode::ReadWrite);
                r.cache.start();
                for _ in 0..2 {
                    read_block(&r.tier, k, 2);
                }
                for _ in 0..200 {
                    if r.cache.stats().clean_bytes >= BS {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                assert_eq!(r.cache.stats().clean_bytes, BS, "{case}: admitted");
            }
            let n = r
                .tier
                .revert(k, Epoch(1), Version(2), 2 * BS, BS)
                .expect("revert");
            assert_eq!(n, 1, "{case}");
            assert_eq!(read_block(&r.tier, k, 2).0, block(1).0, "{case}: reverted");
            let r = if crash { reopen(r, 5).0 } else { r };
            assert_eq!(
                read_block(&r.tier, k, 2).0,
                block(1).0,
                "{case}: stays reverted"
            );
            assert_eq!(read_cap(&r.cap, k, 2), block(1).0, "{case}");
            assert_eq!(
                r.tier.block_versions(k, 2 * BS, 1).expect("versions"),
                vec![Version(1)],
                "{case}"
            );
            r.tier
                .settle_held(k, Epoch(1), Version(1), &[])
                .expect("settle");
            r.cache.stop();
        }
    }
}

/// Snapshots through a cache drive (docs/adr/0012): a block still in the log when the
/// snapshot is taken reaches the capacity drive first, so a later write through the log
/// cannot replace it unpreserved; after destage the snapshot still reads it, and across a
/// power loss of both drives too.
#[test]
fn snapshots_through_the_cache_keep_what_was_logged_before_them() {
    let r = rig(16 << 20);
    let k = key(3, 0);
    let v = |epoch: u64, seq: u64| Version(epoch << 32 | seq);
    let (a, ac) = block(1);
    let (b, bc) = block(2);
    // `a` is logged at epoch 1 and not destaged.
    r.tier.write(k, Epoch(1), v(1, 1), 0, &a, &[ac]).unwrap();
    assert!(
        read_cap(&r.cap, k, 0).iter().all(|&x| x == 0),
        "still only in the log"
    );
    r.tier
        .set_snapshot_floor(
            k,
            Epoch(1),
            Epoch(1),
            None,
            converge_types::FloorHistory::Continues,
        )
        .unwrap();
    assert_eq!(
        read_cap(&r.cap, k, 0),
        a,
        "the floor drained the extent's log"
    );
    // `b` replaces it in the log at epoch 2.
    r.tier.write(k, Epoch(2), v(2, 2), 0, &b, &[bc]).unwrap();
    let at = |t: &Tier| {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let info = t.read_at(k, Epoch(2), Epoch(1), 0, &mut buf).unwrap();
        assert!(info.bad_blocks.is_empty());
        buf
    };
    assert_eq!(at(&r.tier), a);
    let mut buf = vec![0u8; BLOCK_SIZE];
    r.tier.read(k, Epoch(2), 0, &mut buf).unwrap();
    assert_eq!(buf, b);
    r.cache.flush().unwrap();
    r.cap.read(k, Epoch(2), 0, &mut buf).unwrap();
    assert_eq!(buf, b, "destaged");
    assert_eq!(r.cap.shadows(k).len(), 1, "preserved at destage");
    assert_eq!(at(&r.tier), a);
    let (r, _) = reopen(r, 11);
    assert_eq!(at(&r.tier), a, "after a power loss");
    r.tier.drop_snapshot(k, Epoch(2), Epoch(1), None).unwrap();
    assert_eq!(r.cap.capacity().bytes_preserved, 0);
}

fn capacity(f: &FaultyFile, id: u64, fresh: bool) -> Arc<Drive> {
    Arc::new(if fresh {
        Drive::format_with(
            Arc::new(f.clone()),
            ident(id, DriveRole::Capacity),
            FormatOptions {
                journal_bytes: Some(1 << 20),
                ..Default::default()
            },
        )
        .expect("format capacity")
    } else {
        Drive::open(Arc::new(f.reattach())).expect("open capacity")
    })
}

/// Issue 42: a capacity drive failing behind a cache failed the whole cache drive at the
/// next destage step that met one of its logged blocks (every copy behind the cache was
/// then resynced). Its blocks are now carried in the log, lap after lap, while the cache
/// goes on for the other drive; when the failed drive opens again at the restart (a
/// transient failure), replay destages them, and none of its acked writes is lost. (If it
/// is replaced instead, replay drops them as blocks of an unknown drive, as before.)
#[test]
fn a_failed_capacity_drive_s_logged_blocks_are_carried_not_the_cache_failed() {
    let (fa, fb, fc) = (
        FaultyFile::new(16 << 20),
        FaultyFile::new(16 << 20),
        FaultyFile::new(CACHE_MIN_BYTES),
    );
    let (a, b) = (capacity(&fa, 7, true), capacity(&fb, 8, true));
    let caps: HashMap<DriveId, Arc<Drive>> =
        [(DriveId(7), a.clone()), (DriveId(8), b.clone())].into();
    let (cache, _) =
        Cache::open(Arc::new(fc.reattach()), ident(9, DriveRole::Cache), &caps).expect("open");
    cache.set_mode(CacheMode::Write);
    let (ta, tb) = (Tier::new(a.clone()), Tier::new(b.clone()));
    ta.bind(cache.clone());
    tb.bind(cache.clone());
    let (ka, kb) = (key(1, 0), key(2, 0));
    for blk in 0..16u64 {
        write(&ta, ka, blk, 100 + blk, 7000 + blk);
    }
    a.fail_now("the test");
    // Rewrites of drive 8 lap the 16 MiB log many times; each lap meets drive 7's blocks.
    let mut v = 1000;
    for round in 0..40u64 {
        for blk in 0..(NB.min(64)) {
            v += 1;
            write(&tb, kb, blk, v, round * 1000 + blk);
        }
        while cache.used_pct() >= 50 {
            cache
                .background_step(true)
                .expect("destage goes on past the failed drive's blocks");
        }
    }
    assert_eq!(cache.failure(), None, "the cache drive did not fail");
    assert!(
        cache.stats().carried_blocks >= 16,
        "the failed drive's blocks were carried: {:?}",
        cache.stats()
    );
    let flush = cache.flush();
    assert!(
        flush.is_err(),
        "a flush that leaves acked blocks in the log says so"
    );
    // Power loss; the node restarts and drive 7 opens again (its failure was the
    // process's, not the media's): replay destages its carried blocks.
    cache.stop();
    drop((ta, tb, cache, a, b));
    fa.crash(1);
    fb.crash(2);
    fc.crash(3);
    let (a, b) = (capacity(&fa, 7, false), capacity(&fb, 8, false));
    let caps: HashMap<DriveId, Arc<Drive>> =
        [(DriveId(7), a.clone()), (DriveId(8), b.clone())].into();
    let (_cache, report) =
        Cache::open(Arc::new(fc.reattach()), ident(9, DriveRole::Cache), &caps).expect("reopen");
    assert_eq!(report.blocks_lost, 0);
    assert!(report.blocks_destaged >= 16, "{report:?}");
    for blk in 0..16u64 {
        assert_eq!(
            read_cap(&a, ka, blk),
            block(7000 + blk).0,
            "drive 7 block {blk}"
        );
    }
}
