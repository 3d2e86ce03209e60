//! Crash test: concurrent writers on a simulated drive, a crash at a random moment
//! (including mid-checkpoint), reopen, and check every block against what was acked.
//! Three kinds of crash: power loss tearing writes into 512-byte sectors, power loss on a
//! device with atomic 4 KiB writes, and the process killed (every issued write persists).
//! In every kind, every block must read back whole: an acked version or a newer unacked
//! one, or zeros where that is allowed; never a bad block (writes go out of place, so the
//! previous content of a block survives whatever happens to its new write). The same holds
//! for compressed extents (docs/adr/0010), whose writes rewrite whole groups.

use converge_engine::{
    BlockFile, CrashMode, Drive, DriveIdentity, EngineError, FaultyFile, FormatOptions,
};
use converge_types::{
    ClusterId, Compression, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex,
    Version, VolumeId,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const B: usize = 4096;
const SLAB: u64 = 64 << 10; // 16 blocks: writers collide often
const BLOCKS: u32 = (SLAB / B as u64) as u32;
const KEYS: u64 = 3;

#[derive(Clone, Copy, Debug)]
struct Op {
    key: ExtentKey,
    first: u32,
    n: u32,
    version: u64,
    zero: bool,
    held: bool,
    acked: bool,
}

fn key(s: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(s),
    }
}

/// The content a write of `version` puts in `block`: self-describing, so a read tells
/// exactly which write (if any) it came from. With `packed`, compressible: a 64-byte
/// pattern repeated.
fn content(k: ExtentKey, block: u32, version: u64, packed: bool) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(k.slab.0 ^ (u64::from(block) << 20) ^ (version << 32));
    let mut b = vec![0u8; B];
    if packed {
        let mut pat = [0u8; 64];
        rng.fill(&mut pat[..]);
        for (i, x) in b.iter_mut().enumerate() {
            *x = pat[i % 64];
        }
    } else {
        rng.fill(&mut b[..]);
    }
    b[0..8].copy_from_slice(&0xC0FF_EE00_u64.to_le_bytes());
    b[8..16].copy_from_slice(&k.slab.0.to_le_bytes());
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

struct RoundResult {
    acked: usize,
    checkpoints: u64,
}

/// `held`: half the writes keep priors (parity chunks' writes) and settles run among
/// them; after the crash every prior must still be whole, and a revert must restore it.
/// `codec`: every extent compresses its writes (compressible data, writes up to 8 blocks:
/// whole groups and parts of groups).
fn round(seed: u64, mode: CrashMode, held: bool, codec: Compression) -> RoundResult {
    let packed = !codec.is_none();
    let mut rng = StdRng::seed_from_u64(seed);
    let f = FaultyFile::new(4 << 20);
    f.set_crash_mode(mode);
    let d = Drive::format_with(
        Arc::new(f.clone()),
        ident(),
        FormatOptions {
            // Smallest journal: checkpoints every few dozen batches, so crashes hit them.
            journal_bytes: Some(64 << 10),
            ..Default::default()
        },
    )
    .expect("format");
    if packed {
        for s in 0..KEYS {
            d.set_codec(key(s), Epoch(1), codec).expect("codec");
        }
    }
    let d = Arc::new(d);
    let log: Arc<Mutex<Vec<Op>>> = Arc::new(Mutex::new(Vec::new()));
    // Per extent, the highest version a settle was sent for (it may have applied).
    let settled: Arc<Mutex<HashMap<ExtentKey, u64>>> = Arc::default();
    let next_version = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let by_writes = rng.gen_bool(0.6);
    if by_writes {
        f.crash_after_writes(rng.gen_range(1..600), seed);
    }
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let (d, log, next_version, stop, settled) = (
            d.clone(),
            log.clone(),
            next_version.clone(),
            stop.clone(),
            settled.clone(),
        );
        let mut trng = StdRng::seed_from_u64(seed * 31 + t);
        threads.push(std::thread::spawn(move || {
            for _ in 0..400 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let k = key(trng.gen_range(0..KEYS));
                let first = trng.gen_range(0..BLOCKS);
                let n = trng.gen_range(1..=(BLOCKS - first).min(if packed { 8 } else { 4 }));
                let zero = trng.gen_bool(0.15);
                // Sometimes an old version, as a resync racing new writes would send.
                let mut version = next_version.fetch_add(1, Ordering::SeqCst);
                if trng.gen_bool(0.1) {
                    version = version.saturating_sub(trng.gen_range(1..20)).max(1);
                }
                let idx = {
                    let mut l = log.lock().expect("log");
                    l.push(Op {
                        key: k,
                        first,
                        n,
                        version,
                        zero,
                        held: false,
                        acked: false,
                    });
                    l.len() - 1
                };
                let r = if zero {
                    d.zero(
                        k,
                        Epoch(1),
                        Version(version),
                        u64::from(first) * B as u64,
                        u64::from(n) * B as u64,
                    )
                } else {
                    let mut data = Vec::with_capacity(n as usize * B);
                    for b in first..first + n {
                        data.extend_from_slice(&content(k, b, version, packed));
                    }
                    let crcs: Vec<u32> = data.chunks(B).map(crc32c::crc32c).collect();
                    let off = u64::from(first) * B as u64;
                    if held && trng.gen_bool(0.1) {
                        // Settle what is well behind (the owner settles completed rows).
                        let upto = next_version.load(Ordering::SeqCst).saturating_sub(30);
                        note_settle(&settled, k, upto);
                        match d.settle(k, Epoch(1), Version(upto), &[]) {
                            Ok(()) => {}
                            Err(EngineError::Io { .. } | EngineError::Failed { .. }) => break,
                            Err(e) => panic!("unexpected error {e}"),
                        }
                    }
                    if held && trng.gen_bool(0.5) {
                        log.lock().expect("log")[idx].held = true;
                        match d.write_held(k, Epoch(1), Version(version), off, &data, &crcs) {
                            // Too many priors: settle everything and go on (not acked).
                            Err(EngineError::HeldFull { .. }) => {
                                note_settle(&settled, k, u64::MAX);
                                let _ = d.settle(k, Epoch(1), Version(u64::MAX), &[]);
                                continue;
                            }
                            r => r,
                        }
                    } else {
                        d.write(k, Epoch(1), Version(version), off, &data, &crcs)
                    }
                };
                match r {
                    Ok(()) => log.lock().expect("log")[idx].acked = true,
                    Err(EngineError::Io { .. } | EngineError::Failed { .. }) => break,
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }));
    }
    // A thread forcing checkpoints, so crashes land inside them too.
    {
        let (d, stop) = (d.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if d.checkpoint().is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        }));
    }
    if !by_writes {
        std::thread::sleep(std::time::Duration::from_micros(rng.gen_range(0..20_000)));
        f.crash(seed);
    } else {
        while !f.crashed() && !threads[..4].iter().all(|t| t.is_finished()) {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        f.crash(seed ^ 0xdead); // no-op on the image if the armed crash already fired
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("thread");
    }
    let checkpoints = d.stats().checkpoints;
    drop(d);

    let file: Arc<dyn BlockFile> = Arc::new(f.reattach());
    let d = Drive::open(file.clone()).expect("reopen after crash");
    let log = log.lock().expect("log").clone();
    // Every physical block is free, or held by exactly one state (a stream once) or prior.
    let cap = d.capacity();
    assert_eq!(
        cap.bytes_free + cap.bytes_stored + cap.bytes_held,
        d.layout().data_blocks * B as u64,
        "{mode:?} seed {seed}: physical blocks leaked or counted twice"
    );
    for s in 0..KEYS {
        let k = key(s);
        let mut buf = vec![0u8; SLAB as usize];
        let info = d.read(k, Epoch(1), 0, &mut buf).expect("read");
        let versions = d.block_versions(k, 0, BLOCKS as usize).expect("versions");
        for b in 0..BLOCKS {
            let ops: Vec<&Op> = log
                .iter()
                .filter(|o| o.key == k && (o.first..o.first + o.n).contains(&b))
                .collect();
            let max_acked = ops.iter().filter(|o| o.acked).map(|o| o.version).max();
            let unacked_write = ops.iter().any(|o| !o.acked && !o.zero);
            let ctx = || format!("{mode:?} seed {seed} key {s} block {b} ops {ops:?}");
            assert!(
                !info.bad_blocks.contains(&b),
                "bad block after a crash (under an unacked write: {unacked_write}): {}",
                ctx()
            );
            let got = &buf[b as usize * B..(b as usize + 1) * B];
            let ver = versions[b as usize].0;
            let floor = max_acked.unwrap_or(0);
            if got.iter().all(|&x| x == 0) {
                let ok = (max_acked.is_none() && ver == 0)
                    || ops
                        .iter()
                        .any(|o| o.zero && o.version == ver && ver >= floor);
                assert!(ok, "zeros at version {ver} not allowed: {}", ctx());
            } else {
                let v = u64::from_le_bytes(got[20..28].try_into().expect("8 bytes"));
                assert_eq!(
                    got,
                    &content(k, b, v, packed)[..],
                    "wrong bytes with good crc: {}",
                    ctx()
                );
                assert_eq!(ver, v, "version metadata disagrees with data: {}", ctx());
                assert!(
                    ops.iter().any(|o| !o.zero && o.version == v) && v >= floor,
                    "block holds version {v}, older than acked {floor}: {}",
                    ctx()
                );
            }
        }
    }
    // Every prior is whole: older than its block, and a revert restores it exactly; and a
    // block whose version came from a held write no settle reached still has its prior.
    let settled = settled.lock().expect("settled").clone();
    let mut priors = 0;
    for s in 0..KEYS {
        let k = key(s);
        let pv = d.priors(k, 0, BLOCKS as usize).expect("priors");
        for (b, &(cur, prior)) in pv.iter().enumerate() {
            let writers: Vec<&Op> = log
                .iter()
                .filter(|o| o.key == k && o.version == cur.0)
                .filter(|o| (o.first..o.first + o.n).contains(&(b as u32)))
                .collect();
            if let [w] = writers[..] {
                if w.held && settled.get(&k).is_none_or(|&u| u < cur.0) {
                    assert!(
                        prior.is_some(),
                        "{mode:?} seed {seed} key {s} block {b}: held write {cur:?} lost its prior"
                    );
                }
            }
            let Some(prior) = prior else { continue };
            priors += 1;
            let b = b as u32;
            let ctx =
                || format!("{mode:?} seed {seed} key {s} block {b} prior {prior:?} cur {cur:?}");
            assert!(held, "a prior without held writes: {}", ctx());
            assert!(prior < cur, "prior not older than its block: {}", ctx());
            let n = d
                .revert(k, Epoch(1), cur, u64::from(b) * B as u64, B as u64)
                .expect("revert");
            assert_eq!(n, 1, "revert did not apply: {}", ctx());
            let mut got = vec![0u8; B];
            let info = d
                .read(k, Epoch(1), u64::from(b) * B as u64, &mut got)
                .expect("read");
            assert!(
                info.bad_blocks.is_empty(),
                "reverted block is bad: {}",
                ctx()
            );
            assert_eq!(info.versions, prior, "reverted version: {}", ctx());
            let covers = |o: &&Op| o.key == k && (o.first..o.first + o.n).contains(&b);
            if got.iter().all(|&x| x == 0) {
                assert!(
                    prior.0 == 0
                        || log
                            .iter()
                            .filter(covers)
                            .any(|o| o.zero && o.version == prior.0),
                    "reverted to zeros at a version no zero had: {}",
                    ctx()
                );
            } else {
                assert_eq!(
                    got,
                    content(k, b, prior.0, packed),
                    "reverted to wrong bytes: {}",
                    ctx()
                );
                assert!(
                    log.iter()
                        .filter(covers)
                        .any(|o| !o.zero && o.version == prior.0),
                    "reverted to a version never written here: {}",
                    ctx()
                );
            }
        }
    }
    if held {
        PRIORS_CHECKED.fetch_add(priors, Ordering::Relaxed);
    }
    // The recovered drive keeps working and survives a clean reopen.
    let data = content(key(0), 0, 1 << 40, packed);
    d.write(
        key(0),
        Epoch(1),
        Version(1 << 40),
        0,
        &data,
        &[crc32c::crc32c(&data)],
    )
    .expect("write after recovery");
    drop(d);
    let d = Drive::open(file).expect("clean reopen");
    let mut buf = vec![0u8; B];
    let info = d.read(key(0), Epoch(1), 0, &mut buf).expect("read");
    assert!(
        info.bad_blocks.is_empty() && buf == data,
        "seed {seed}: write after recovery lost"
    );
    RoundResult {
        acked: log.iter().filter(|o| o.acked).count(),
        checkpoints,
    }
}

fn note_settle(settled: &Mutex<HashMap<ExtentKey, u64>>, k: ExtentKey, upto: u64) {
    let mut m = settled.lock().expect("settled");
    let e = m.entry(k).or_insert(0);
    *e = (*e).max(upto);
}

static PRIORS_CHECKED: AtomicU64 = AtomicU64::new(0);

fn rounds(mode: CrashMode, held: bool) {
    rounds_with(mode, held, false)
}

/// Rounds on compressed extents (lz4 and zstd in turn).
fn rounds_with(mode: CrashMode, held: bool, packed: bool) {
    let rounds: u64 = std::env::var("CONVERGE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let first: u64 = std::env::var("CONVERGE_CRASH_FIRST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (mut acked, mut cps) = (0, 0);
    for seed in first..first + rounds {
        let codec = match (packed, seed % 2) {
            (false, _) => Compression::None,
            (true, 0) => Compression::Lz4,
            (true, _) => Compression::Zstd,
        };
        let r = round(seed, mode, held, codec);
        acked += r.acked;
        cps += r.checkpoints;
    }
    let priors = PRIORS_CHECKED.load(Ordering::Relaxed);
    eprintln!(
        "crash test ({mode:?}, held {held}, compressed {packed}): {rounds} rounds, \
         {acked} acked ops, {cps} checkpoints, {priors} priors reverted"
    );
    assert!(
        acked > 0 && cps > 0,
        "the test must exercise acks and checkpoints"
    );
    assert!(
        !held || priors > 0,
        "the test must revert priors after crashes"
    );
}

#[test]
fn power_loss_returns_acked_old_or_new_never_wrong() {
    rounds(CrashMode::PowerLoss { tear_bytes: 512 }, false);
}

#[test]
fn power_loss_keeps_every_prior_of_held_writes_whole() {
    rounds(CrashMode::PowerLoss { tear_bytes: 512 }, true);
}

#[test]
fn power_loss_with_atomic_4k_writes_returns_acked_old_or_new_never_wrong() {
    rounds(CrashMode::PowerLoss { tear_bytes: 4096 }, false);
}

#[test]
fn a_killed_process_leaves_every_block_whole_old_or_new() {
    rounds(CrashMode::ProcessKill, false);
}

#[test]
fn a_killed_process_keeps_every_prior_of_held_writes_whole() {
    rounds(CrashMode::ProcessKill, true);
}

#[test]
fn power_loss_keeps_compressed_groups_whole() {
    rounds_with(CrashMode::PowerLoss { tear_bytes: 512 }, false, true);
}

#[test]
fn power_loss_with_atomic_4k_writes_keeps_compressed_groups_whole() {
    rounds_with(CrashMode::PowerLoss { tear_bytes: 4096 }, false, true);
}

#[test]
fn a_killed_process_keeps_compressed_groups_whole() {
    rounds_with(CrashMode::ProcessKill, false, true);
}
