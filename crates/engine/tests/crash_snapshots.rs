//! Crash test of snapshots (docs/adr/0012): writers at one epoch per phase, a snapshot
//! (the snapshot floor set on every extent) between phases, now and then a snapshot
//! deleted (its states merged down or freed), checkpoints throughout, and a crash at a
//! random moment of any of it: power loss tearing writes into 512-byte sectors or 4 KiB
//! units, or the process killed. After reopening, every snapshot whose floor was acked on
//! every extent, and whose deletion was never asked, reads exactly what the volume held
//! when it was taken (every write before it was acked), block for block; the live volume
//! holds acked data (old or new where a write was cut short); and every physical block is
//! free or named by one live or one preserved state.

use converge_engine::{
    BlockFile, CrashMode, Drive, DriveIdentity, EngineError, FaultyFile, FormatOptions,
};
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex, Version,
    VolumeId,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const B: usize = 4096;
const SLAB: u64 = 64 << 10; // 16 blocks
const BLOCKS: u32 = (SLAB / B as u64) as u32;
const KEYS: u64 = 3;
const PHASES: u64 = 8;

#[derive(Clone, Copy, Debug)]
struct Op {
    key: ExtentKey,
    first: u32,
    n: u32,
    version: u64,
    zero: bool,
    acked: bool,
}

/// Slabs from this one hold compressible content, in extents with codecs.
const COMPRESSED_BASE: u64 = 100;

fn key_at(s: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(9),
        slab: SlabIndex(s),
    }
}

fn content(k: ExtentKey, block: u32, version: u64) -> Vec<u8> {
    let mut rng =
        StdRng::seed_from_u64(k.slab.0 ^ (u64::from(block) << 20) ^ version.rotate_left(17));
    let mut b = vec![0u8; B];
    if k.slab.0 >= COMPRESSED_BASE {
        // A 64-byte pattern repeated: a group of four compresses to one block.
        let mut pat = [0u8; 64];
        rng.fill(&mut pat[..]);
        for (j, x) in b.iter_mut().enumerate() {
            *x = pat[j % 64];
        }
    } else {
        rng.fill(&mut b[..]);
    }
    b[16..20].copy_from_slice(&block.to_le_bytes());
    b[20..28].copy_from_slice(&version.to_le_bytes());
    b
}

fn ident() -> DriveIdentity {
    DriveIdentity {
        cluster: ClusterId(1),
        node: NodeId(1),
        drive: DriveId(1),
        slab_size_bytes: SLAB,
        role: DriveRole::Capacity,
        media: MediaType::Ram,
    }
}

fn fatal(e: &EngineError) -> bool {
    matches!(e, EngineError::Io { .. } | EngineError::Failed { .. })
}

/// The content block `b` of `k` must hold given the ops up to (and including) `upto`
/// epochs, all acked: the newest version's write, or zeros.
fn expected(ops: &[Op], k: ExtentKey, b: u32, upto: u64) -> Option<Vec<u8>> {
    ops.iter()
        .filter(|o| o.key == k && (o.first..o.first + o.n).contains(&b) && o.version >> 32 <= upto)
        .max_by_key(|o| o.version)
        .filter(|o| !o.zero)
        .map(|o| content(k, b, o.version))
}

/// Returns (snapshots checked, preserved bytes seen at reopen).
/// `compressed`: the extents have codecs (lz4, zstd, none) and the content compresses,
/// so writes replace packed states the snapshots read (copied out of their streams).
fn round(seed: u64, mode: CrashMode, compressed: bool) -> (usize, u64) {
    let base = if compressed { COMPRESSED_BASE } else { 0 };
    let key = move |s: u64| key_at(s + base);
    let mut rng = StdRng::seed_from_u64(seed);
    let f = FaultyFile::new(4 << 20);
    f.set_crash_mode(mode);
    let d = Arc::new(
        Drive::format_with(
            Arc::new(f.clone()),
            ident(),
            FormatOptions {
                journal_bytes: Some(64 << 10),
                ..Default::default()
            },
        )
        .expect("format"),
    );
    if compressed {
        use converge_types::Compression;
        for (k, c) in [Compression::Lz4, Compression::Zstd, Compression::None]
            .into_iter()
            .enumerate()
        {
            d.set_codec(key(k as u64), Epoch(1), c).expect("codec");
        }
    }
    f.crash_after_writes(rng.gen_range(1..2500), seed);
    let log: Arc<Mutex<Vec<Op>>> = Arc::default();
    let seq = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let checkpointer = {
        let (d, stop) = (d.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if d.checkpoint().is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_micros(400));
            }
        })
    };
    // Snapshots whose floor every extent acked, and those a deletion was asked for.
    let mut taken: BTreeSet<u64> = BTreeSet::new();
    let mut deleted: BTreeSet<u64> = BTreeSet::new();
    let mut epoch = 1u64;
    // Every extent exists before the first snapshot (see the engine's unit tests for
    // copies made after one).
    for k in 0..KEYS {
        let version = epoch << 32 | seq.fetch_add(1, Ordering::SeqCst);
        let data = content(key(k), 0, version);
        let crc = crc32c::crc32c(&data);
        let r = d.write(key(k), Epoch(1), Version(version), 0, &data, &[crc]);
        log.lock().expect("log").push(Op {
            key: key(k),
            first: 0,
            n: 1,
            version,
            zero: false,
            acked: r.is_ok(),
        });
    }
    // A deletion to run while the next phase writes (its writes then race the floor
    // moving down and the shadow's retirement).
    let mut racing: Option<(u64, Option<u64>)> = None;
    'phases: for _ in 0..PHASES {
        let mut writers = Vec::new();
        for t in 0..3u64 {
            let (d, log, seq) = (d.clone(), log.clone(), seq.clone());
            let mut trng = StdRng::seed_from_u64(seed * 131 + epoch * 7 + t);
            writers.push(std::thread::spawn(move || {
                for _ in 0..30 {
                    let k = key(trng.gen_range(0..KEYS));
                    let first = trng.gen_range(0..BLOCKS);
                    let n = trng.gen_range(1..=(BLOCKS - first).min(4));
                    let zero = trng.gen_bool(0.15);
                    let version = epoch << 32 | seq.fetch_add(1, Ordering::SeqCst);
                    let idx = {
                        let mut l = log.lock().expect("log");
                        l.push(Op {
                            key: k,
                            first,
                            n,
                            version,
                            zero,
                            acked: false,
                        });
                        l.len() - 1
                    };
                    let off = u64::from(first) * B as u64;
                    let r = if zero {
                        d.zero(
                            k,
                            Epoch(epoch),
                            Version(version),
                            off,
                            u64::from(n) * B as u64,
                        )
                    } else {
                        let mut data = Vec::with_capacity(n as usize * B);
                        for b in first..first + n {
                            data.extend_from_slice(&content(k, b, version));
                        }
                        let crcs: Vec<u32> = data.chunks(B).map(crc32c::crc32c).collect();
                        d.write(k, Epoch(epoch), Version(version), off, &data, &crcs)
                    };
                    match r {
                        Ok(()) => log.lock().expect("log")[idx].acked = true,
                        Err(e) if fatal(&e) => return false,
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
                true
            }));
        }
        if let Some((s, below)) = racing.take() {
            for k in 0..KEYS {
                match d.drop_snapshot(key(k), Epoch(epoch), Epoch(s), below.map(Epoch)) {
                    Ok(()) => {}
                    Err(e) if fatal(&e) => break,
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }
        // Every writer joined before looking at their results.
        let results: Vec<bool> = writers
            .into_iter()
            .map(|w| w.join().expect("writer"))
            .collect();
        let all_ok = results.iter().all(|&ok| ok);
        if !all_ok {
            break;
        }
        // The snapshot: every write of this epoch is acked.
        let previous = taken.difference(&deleted).max().copied().map(Epoch);
        for s in 0..KEYS {
            let cont = converge_types::FloorHistory::Continues;
            match d.set_snapshot_floor(key(s), Epoch(epoch), Epoch(epoch), previous, cont) {
                Ok(()) => {}
                Err(e) if fatal(&e) => break 'phases,
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        taken.insert(epoch);
        if rng.gen_bool(0.35) {
            let live: Vec<u64> = taken.difference(&deleted).copied().collect();
            let s = live[rng.gen_range(0..live.len())];
            let below = live.iter().copied().filter(|&x| x < s).max();
            deleted.insert(s);
            if rng.gen_bool(0.5) {
                racing = Some((s, below));
            } else {
                for k in 0..KEYS {
                    match d.drop_snapshot(key(k), Epoch(epoch + 1), Epoch(s), below.map(Epoch)) {
                        Ok(()) => {}
                        Err(e) if fatal(&e) => break 'phases,
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
            }
        }
        epoch += 1;
    }
    f.crash(seed ^ 0xbeef); // no-op on the image if the armed crash already fired
    stop.store(true, Ordering::Relaxed);
    checkpointer.join().expect("checkpointer");
    drop(d);

    let file: Arc<dyn BlockFile> = Arc::new(f.reattach());
    let d = Drive::open(file).expect("reopen after crash");
    let log = log.lock().expect("log").clone();
    let cap = d.capacity();
    assert_eq!(
        cap.bytes_free + cap.bytes_stored + cap.bytes_preserved,
        d.layout().data_blocks * B as u64,
        "{mode:?} seed {seed}: physical blocks leaked or counted twice: {cap:?}"
    );
    let read_epoch = Epoch(epoch + 1);
    let mut checked = 0;
    for &s in taken.difference(&deleted) {
        checked += 1;
        for k in 0..KEYS {
            let k = key(k);
            let mut buf = vec![0u8; SLAB as usize];
            let info = d
                .read_at(k, read_epoch, Epoch(s), 0, &mut buf)
                .expect("read at");
            for b in 0..BLOCKS {
                let ctx = || {
                    let ops: Vec<&Op> = log
                        .iter()
                        .filter(|o| o.key == k && (o.first..o.first + o.n).contains(&b))
                        .collect();
                    let got = &buf[b as usize * B..(b as usize + 1) * B];
                    let v = u64::from_le_bytes(got[20..28].try_into().expect("8 bytes"));
                    format!(
                        "{mode:?} seed {seed} snapshot {s} (taken {taken:?}, deleted {deleted:?}) \
                         key {k:?} block {b}: read version {v:#x} (zeros: {}), ops {ops:?}",
                        got.iter().all(|&x| x == 0)
                    )
                };
                assert!(
                    !info.bad_blocks.contains(&b),
                    "bad block in a snapshot: {}",
                    ctx()
                );
                let got = &buf[b as usize * B..(b as usize + 1) * B];
                match expected(&log, k, b, s) {
                    Some(want) => assert!(
                        got == &want[..],
                        "snapshot holds the wrong state: {}",
                        ctx()
                    ),
                    None => assert!(
                        got.iter().all(|&x| x == 0),
                        "snapshot should read zeros: {}",
                        ctx()
                    ),
                }
            }
        }
    }
    // The live volume: acked data, or a newer write that was cut short.
    for k in 0..KEYS {
        let k = key(k);
        let mut buf = vec![0u8; SLAB as usize];
        let info = d.read(k, read_epoch, 0, &mut buf).expect("read");
        for b in 0..BLOCKS {
            let ops: Vec<&Op> = log
                .iter()
                .filter(|o| o.key == k && (o.first..o.first + o.n).contains(&b))
                .collect();
            let ctx = || format!("{mode:?} seed {seed} live key {k:?} block {b} ops {ops:?}");
            assert!(!info.bad_blocks.contains(&b), "bad live block: {}", ctx());
            let floor = ops
                .iter()
                .filter(|o| o.acked)
                .map(|o| o.version)
                .max()
                .unwrap_or(0);
            let got = &buf[b as usize * B..(b as usize + 1) * B];
            let ok = ops.iter().any(|o| {
                o.version >= floor
                    && if o.zero {
                        got.iter().all(|&x| x == 0)
                    } else {
                        got == &content(k, b, o.version)[..]
                    }
            }) || (floor == 0 && got.iter().all(|&x| x == 0));
            assert!(
                ok,
                "live block holds neither the acked state nor a newer one: {}",
                ctx()
            );
        }
    }
    // Deleting every snapshot left returns all preserved space.
    let preserved = cap.bytes_preserved;
    let mut left: Vec<u64> = taken.union(&deleted).copied().collect();
    left.sort_unstable();
    for &s in left.iter().rev() {
        for k in 0..KEYS {
            d.drop_snapshot(key(k), read_epoch, Epoch(s), None)
                .expect("drop after recovery");
        }
    }
    assert_eq!(
        d.capacity().bytes_preserved,
        0,
        "{mode:?} seed {seed}: preserved space after deleting every snapshot"
    );
    (checked, preserved)
}

fn rounds(mode: CrashMode, compressed: bool) {
    let rounds: u64 = std::env::var("CONVERGE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(80);
    let first: u64 = std::env::var("CONVERGE_CRASH_FIRST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (mut snaps, mut with_preserved) = (0, 0);
    for seed in first..first + rounds {
        let (n, p) = round(seed, mode, compressed);
        snaps += n;
        with_preserved += usize::from(p > 0);
    }
    eprintln!(
        "snapshot crash test ({mode:?}, compressed {compressed}): {rounds} rounds, {snaps} snapshots checked, \
         {with_preserved} rounds crashed with preserved states"
    );
    assert!(
        snaps > 0 && with_preserved > 0,
        "the test must check snapshots with preserved states"
    );
}

#[test]
fn power_loss_keeps_every_acked_snapshot_exact() {
    rounds(CrashMode::PowerLoss { tear_bytes: 512 }, false);
}

#[test]
fn power_loss_with_atomic_4k_writes_keeps_every_acked_snapshot_exact() {
    rounds(CrashMode::PowerLoss { tear_bytes: 4096 }, false);
}

#[test]
fn a_killed_process_keeps_every_acked_snapshot_exact() {
    rounds(CrashMode::ProcessKill, false);
}

/// The same on compressed extents: a state a snapshot reads that shares its stream with
/// its group is copied out (PreserveCopy), and a torn copy takes its write back with it.
#[test]
fn power_loss_keeps_every_acked_snapshot_of_compressed_extents_exact() {
    rounds(CrashMode::PowerLoss { tear_bytes: 512 }, true);
}

#[test]
fn a_killed_process_keeps_every_acked_snapshot_of_compressed_extents_exact() {
    rounds(CrashMode::ProcessKill, true);
}
