//! Snapshots in the engine (docs/adr/0012): preserved states, reads at a snapshot, deleting
//! snapshots (merge-down) and the space they return, reopen and checkpoints, and what is
//! refused. The model is bytes per block: the live volume and a copy of it at each snapshot.

use super::*;
use converge_types::Compression;
use converge_types::FloorHistory::{Continues, Copied, Full, Joining};
use std::collections::BTreeMap;

/// Version of write `seq` by an owner at `epoch` (ADR 0003: epoch in the upper half).
fn ver(epoch: u64, seq: u64) -> Version {
    Version(epoch << 32 | seq)
}

/// Bytes of the drive's extents: the volume's copy of `k` as the model holds it.
type Model = HashMap<ExtentKey, Vec<u8>>;

fn slab_of(m: &Model, k: ExtentKey) -> Vec<u8> {
    m.get(&k)
        .cloned()
        .unwrap_or_else(|| vec![0u8; SLAB as usize])
}

/// With no write in flight and no priors, every physical block is free, or stored by one
/// live state or one preserved state; the per-extent counts add up to the drive's.
fn check_accounting(d: &Drive, keys: &[ExtentKey]) {
    let cap = d.capacity();
    assert_eq!(
        cap.bytes_free + cap.bytes_stored + cap.bytes_preserved,
        d.layout().data_blocks * BLOCK,
        "physical blocks leaked or counted twice: {cap:?}"
    );
    let preserved: u64 = d.extents().iter().map(|e| e.bytes_preserved).sum();
    assert_eq!(
        preserved, cap.bytes_preserved,
        "extents vs drive preserved bytes"
    );
    let shadows: u64 = keys
        .iter()
        .flat_map(|&k| d.shadows(k))
        .map(|s| s.bytes_stored)
        .sum();
    assert_eq!(
        shadows, cap.bytes_preserved,
        "shadows vs drive preserved bytes"
    );
}

fn check_reads(
    d: &Drive,
    keys: &[ExtentKey],
    epoch: u64,
    live: &Model,
    snaps: &BTreeMap<u64, Model>,
    ctx: &str,
) {
    for &k in keys {
        let mut buf = vec![0u8; SLAB as usize];
        let info = d.read(k, Epoch(epoch), 0, &mut buf).expect("read");
        assert!(
            info.bad_blocks.is_empty(),
            "{ctx}: live bad blocks {:?}",
            info.bad_blocks
        );
        assert!(buf == slab_of(live, k), "{ctx}: live content of {k:?}");
        for (&s, m) in snaps {
            let info = d
                .read_at(k, Epoch(epoch), Epoch(s), 0, &mut buf)
                .expect("read at");
            assert!(info.bad_blocks.is_empty(), "{ctx}: snapshot {s} bad blocks");
            let want = slab_of(m, k);
            if buf != want {
                let b = (0..SLAB as usize / B)
                    .find(|&b| buf[b * B..(b + 1) * B] != want[b * B..(b + 1) * B])
                    .expect("a block differs");
                panic!("{ctx}: snapshot {s} of {k:?} differs first at block {b}");
            }
        }
    }
}

/// Random writes, zeros, snapshots, deletes, checkpoints and reopens against the model;
/// every snapshot reads what the volume held when it was taken.
/// Per extent, the sequence of the write each block's state came from (0: never written),
/// negated for a zeroing: two states read differently exactly when these differ and are
/// not both zeros (never written or zeroed).
type Versions = HashMap<ExtentKey, Vec<i64>>;

fn vers_of(m: &Versions, k: ExtentKey) -> Vec<i64> {
    m.get(&k)
        .cloned()
        .unwrap_or_else(|| vec![0; (SLAB / BLOCK) as usize])
}

/// `Drive::changed` between every pair of snapshots and from each to the live extent is
/// exactly the set of blocks whose states differ in the model.
fn check_changes(
    d: &Drive,
    keys: &[ExtentKey],
    epoch: u64,
    live: &Versions,
    snaps: &BTreeMap<u64, Versions>,
    ctx: &str,
) {
    let all: Vec<u64> = snaps.keys().copied().collect();
    for &k in keys {
        for (i, &a) in all.iter().enumerate() {
            let va = vers_of(&snaps[&a], k);
            let tos = all[i + 1..].iter().map(|&b| Some(b)).chain([None]);
            for b in tos {
                let vb = match b {
                    Some(b) => vers_of(&snaps[&b], k),
                    None => vers_of(live, k),
                };
                let bits = d
                    .changed(k, Epoch(epoch), Epoch(a), b.map(Epoch), 0, SLAB)
                    .expect("changed");
                for blk in 0..va.len() {
                    let got = bits[blk / 64] >> (blk % 64) & 1 == 1;
                    assert_eq!(
                        got,
                        va[blk] != vb[blk] && !(va[blk] <= 0 && vb[blk] <= 0),
                        "{ctx}: {k:?} block {blk} changed from {a} to {b:?}"
                    );
                }
            }
        }
    }
}

/// Compressible blocks: a random 64-byte pattern repeated in each (a group of four
/// shrinks to one block).
fn text(rng: &mut StdRng, n: usize) -> (Vec<u8>, Vec<u32>) {
    let mut d = vec![0u8; n * B];
    for blk in d.chunks_mut(B) {
        let mut pat = [0u8; 64];
        rng.fill(&mut pat[..]);
        for (j, x) in blk.iter_mut().enumerate() {
            *x = pat[j % 64];
        }
    }
    let crcs = d.chunks(B).map(crc32c::crc32c).collect();
    (d, crcs)
}

/// `compressed`: the extents have codecs (lz4, zstd, none), changed now and then, and
/// most writes are compressible, so snapshots keep states packed in compressed groups.
fn snapshot_model(seed: u64, ops: usize, compressed: bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    const CODECS: [Compression; 3] = [Compression::Lz4, Compression::Zstd, Compression::None];
    let f = FaultyFile::new(48 << 20);
    let mut d = Drive::format_with(
        Arc::new(f.clone()),
        ident(SLAB),
        FormatOptions {
            // Small: checkpoints come often, so pages carry shadows.
            journal_bytes: Some(256 << 10),
            ..Default::default()
        },
    )
    .expect("format");
    let keys: Vec<ExtentKey> = (0..3).map(|s| key(4, s)).collect();
    let mut live: Model = HashMap::new();
    let mut snaps: BTreeMap<u64, Model> = BTreeMap::new();
    let mut live_v: Versions = HashMap::new();
    let mut snaps_v: BTreeMap<u64, Versions> = BTreeMap::new();
    let nb = (SLAB / BLOCK) as usize;
    let mut epoch = 1u64;
    let mut seq = 1u64;
    let nblocks = (SLAB / BLOCK) as u32;
    if compressed {
        for (i, &k) in keys.iter().enumerate() {
            d.set_codec(k, Epoch(epoch), CODECS[i % 3]).expect("codec");
        }
    }
    // Every extent exists before the first snapshot (an owner places a new slab's copies
    // holding every snapshot; `a_copy_filled_after_a_snapshot_refuses_to_read_it` covers
    // the rest).
    for &k in &keys {
        let (data, crcs) = blocks(&mut rng, 1);
        d.write(k, Epoch(epoch), ver(epoch, seq), 0, &data, &crcs)
            .expect("write");
        live_v.entry(k).or_insert_with(|| vec![0; nb])[0] = seq as i64;
        seq += 1;
        let m = live.entry(k).or_insert_with(|| vec![0u8; SLAB as usize]);
        m[..B].copy_from_slice(&data);
    }
    for op in 0..ops {
        let ctx = format!("seed {seed} op {op}");
        let k = keys[rng.gen_range(0..keys.len())];
        match rng.gen_range(0..100) {
            0..=54 => {
                let first = rng.gen_range(0..nblocks);
                let n = rng.gen_range(1..=(nblocks - first).min(24));
                let (data, crcs) = if compressed && rng.gen_bool(0.7) {
                    text(&mut rng, n as usize)
                } else {
                    blocks(&mut rng, n as usize)
                };
                seq += 1;
                let off = u64::from(first) * BLOCK;
                d.write(k, Epoch(epoch), ver(epoch, seq), off, &data, &crcs)
                    .expect("write");
                live_v.entry(k).or_insert_with(|| vec![0; nb])
                    [first as usize..(first + n) as usize]
                    .fill(seq as i64);
                let m = live.entry(k).or_insert_with(|| vec![0u8; SLAB as usize]);
                m[off as usize..off as usize + data.len()].copy_from_slice(&data);
            }
            55..=64 => {
                let first = rng.gen_range(0..nblocks);
                let n = rng.gen_range(1..=(nblocks - first).min(40));
                seq += 1;
                let (off, len) = (u64::from(first) * BLOCK, u64::from(n) * BLOCK);
                d.zero(k, Epoch(epoch), ver(epoch, seq), off, len)
                    .expect("zero");
                live_v.entry(k).or_insert_with(|| vec![0; nb])
                    [first as usize..(first + n) as usize]
                    .fill(-(seq as i64));
                let m = live.entry(k).or_insert_with(|| vec![0u8; SLAB as usize]);
                m[off as usize..(off + len) as usize].fill(0);
            }
            65..=72 => {
                // A snapshot at the owner's epoch; the owner then writes at the next.
                let previous = snaps.keys().next_back().copied().map(Epoch);
                for &k in &keys {
                    d.set_snapshot_floor(k, Epoch(epoch), Epoch(epoch), previous, Continues)
                        .expect("floor");
                }
                snaps.insert(epoch, live.clone());
                snaps_v.insert(epoch, live_v.clone());
                epoch += 1;
            }
            73..=80 if !snaps.is_empty() => {
                let all: Vec<u64> = snaps.keys().copied().collect();
                let s = all[rng.gen_range(0..all.len())];
                let below = all.iter().copied().filter(|&x| x < s).max();
                for &k in &keys {
                    d.drop_snapshot(k, Epoch(epoch), Epoch(s), below.map(Epoch))
                        .expect("drop");
                }
                snaps.remove(&s);
                snaps_v.remove(&s);
            }
            81..=86 => d.checkpoint().expect("checkpoint"),
            87..=90 => {
                drop(d);
                d = Drive::open(Arc::new(f.reattach())).expect("reopen");
            }
            91..=94 if compressed => {
                let c = CODECS[rng.gen_range(0..3)];
                d.set_codec(k, Epoch(epoch), c).expect("codec");
            }
            _ => {}
        }
        if op % 16 == 0 || op + 1 == ops {
            check_reads(&d, &keys, epoch, &live, &snaps, &ctx);
            check_changes(&d, &keys, epoch, &live_v, &snaps_v, &ctx);
            check_accounting(&d, &keys);
        }
    }
    // Deleting every snapshot returns all their space.
    while let Some((&s, _)) = snaps.iter().next_back() {
        let below = snaps.keys().copied().filter(|&x| x < s).max();
        for &k in &keys {
            d.drop_snapshot(k, Epoch(epoch), Epoch(s), below.map(Epoch))
                .expect("drop");
        }
        snaps.remove(&s);
        snaps_v.remove(&s);
        check_changes(
            &d,
            &keys,
            epoch,
            &live_v,
            &snaps_v,
            &format!("seed {seed} drop {s}"),
        );
        check_reads(
            &d,
            &keys,
            epoch,
            &live,
            &snaps,
            &format!("seed {seed} drop {s}"),
        );
    }
    check_accounting(&d, &keys);
    assert_eq!(
        d.capacity().bytes_preserved,
        0,
        "seed {seed}: preserved bytes after deleting every snapshot"
    );
    for &k in &keys {
        assert!(d.shadows(k).is_empty(), "seed {seed}: shadows left");
        assert_eq!(d.snapshot_floor(k), 0, "seed {seed}: floor left");
    }
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).expect("reopen");
    check_reads(
        &d,
        &keys,
        epoch,
        &live,
        &snaps,
        &format!("seed {seed} final reopen"),
    );
    check_accounting(&d, &keys);
}

#[test]
fn snapshots_read_what_was_acked_before_them_through_writes_deletes_and_reopens() {
    for seed in 0..12 {
        snapshot_model(seed, 400, false);
    }
}

/// The same with compressed groups: a state a snapshot reads that is a member of a
/// compressed group is copied out of its stream (the other members keep it), by writes
/// into the group, whole-group writes, zeros, and writes after the codec was turned off.
#[test]
fn snapshots_of_compressed_extents_read_what_was_acked_before_them() {
    for seed in 100..110 {
        snapshot_model(seed, 400, true);
    }
}

#[test]
fn a_snapshot_preserves_by_moving_states_not_copying_data() {
    let (_f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(5);
    let (a, ac) = blocks(&mut rng, 8);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    let data_before = d.stats().data_write_bytes;
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    assert_eq!(d.snapshot_floor(k), 1);
    // Nothing is written by taking the snapshot, nothing preserved yet.
    assert_eq!(d.stats().data_write_bytes, data_before);
    assert!(d.shadows(k).is_empty());
    let (b, bc) = blocks(&mut rng, 2);
    d.write(k, Epoch(2), ver(2, 2), 2 * BLOCK, &b, &bc).unwrap();
    // The two replaced blocks moved into the snapshot's shadow; only the new data was
    // written.
    assert_eq!(d.stats().data_write_bytes, data_before + 2 * BLOCK);
    let sh = d.shadows(k);
    assert_eq!(sh.len(), 1);
    assert_eq!(
        (sh[0].snapshot, sh[0].blocks, sh[0].bytes_stored),
        (1, 2, 2 * BLOCK)
    );
    // A second write of the same blocks after the snapshot preserves nothing more.
    let (c, cc) = blocks(&mut rng, 2);
    d.write(k, Epoch(2), ver(2, 3), 2 * BLOCK, &c, &cc).unwrap();
    assert_eq!(d.shadows(k)[0].blocks, 2);
    let mut buf = vec![0u8; 8 * B];
    d.read_at(k, Epoch(2), Epoch(1), 0, &mut buf).unwrap();
    assert!(buf == a, "the snapshot reads the first write");
    d.read(k, Epoch(2), 0, &mut buf).unwrap();
    assert!(buf[..2 * B] == a[..2 * B] && buf[2 * B..4 * B] == c[..] && buf[4 * B..] == a[4 * B..]);
    // A block first written after the snapshot reads as never written in it.
    let (e, ec) = blocks(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 4), 100 * BLOCK, &e, &ec)
        .unwrap();
    let mut one = vec![1u8; B];
    d.read_at(k, Epoch(2), Epoch(1), 100 * BLOCK, &mut one)
        .unwrap();
    assert!(one.iter().all(|&x| x == 0));
    let preserved = d.capacity().bytes_preserved;
    assert_eq!(preserved, 2 * BLOCK);
    // Deleting it returns the space.
    d.drop_snapshot(k, Epoch(2), Epoch(1), None).unwrap();
    assert_eq!(d.capacity().bytes_preserved, 0);
    assert!(d.shadows(k).is_empty());
    assert_eq!(d.snapshot_floor(k), 0);
}

#[test]
fn deleting_a_newer_snapshot_merges_what_an_older_one_reads() {
    let (f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(6);
    let (a, ac) = blocks(&mut rng, 1);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    // Snapshots 1 and 2 both read `a`; it is preserved into 2's shadow (the newest).
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    d.set_snapshot_floor(k, Epoch(2), Epoch(2), Some(Epoch(1)), Continues)
        .unwrap();
    let (b, bc) = blocks(&mut rng, 1);
    d.write(k, Epoch(3), ver(3, 2), 0, &b, &bc).unwrap();
    assert_eq!(
        d.shadows(k).iter().map(|s| s.snapshot).collect::<Vec<_>>(),
        [2]
    );
    // Deleting 2 moves `a` down to 1, which still reads it.
    d.drop_snapshot(k, Epoch(3), Epoch(2), Some(Epoch(1)))
        .unwrap();
    assert_eq!(d.snapshot_floor(k), 1);
    let sh = d.shadows(k);
    assert_eq!((sh.len(), sh[0].snapshot, sh[0].blocks), (1, 1, 1));
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let mut buf = vec![0u8; B];
    d.read_at(k, Epoch(3), Epoch(1), 0, &mut buf).unwrap();
    assert!(buf == a);
    d.read(k, Epoch(3), 0, &mut buf).unwrap();
    assert!(buf == b);
    assert_eq!(d.snapshot_floor(k), 1, "the floor survives a reopen");
}

#[test]
fn a_floor_whose_snapshot_never_was_does_not_cost_the_older_snapshots() {
    let (f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(7);
    let (a, ac) = blocks(&mut rng, 2);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    // Snapshot 2's floor is set, but its commit fails and nothing undoes it: the copy's
    // floor is 2, the volume's newest snapshot still 1. A write then preserves `a` into
    // 2's shadow, which is what snapshot 1 reads too.
    d.set_snapshot_floor(k, Epoch(2), Epoch(2), Some(Epoch(1)), Continues)
        .unwrap();
    let (b, bc) = blocks(&mut rng, 1);
    d.write(k, Epoch(3), ver(3, 1), 0, &b, &bc).unwrap();
    // The next snapshot names 1 as the one before it: 2 is dropped, its states move
    // down to 1, and the copy still holds 1.
    d.set_snapshot_floor(k, Epoch(3), Epoch(3), Some(Epoch(1)), Continues)
        .unwrap();
    assert_eq!(d.snapshot_floor(k), 3);
    assert_eq!(
        d.shadows(k).iter().map(|s| s.snapshot).collect::<Vec<_>>(),
        [1]
    );
    let check = |d: &Drive| {
        let mut buf = vec![0u8; 2 * B];
        d.read_at(k, Epoch(3), Epoch(1), 0, &mut buf)
            .expect("snapshot 1 is still held");
        assert!(buf == a, "snapshot 1 reads what was written before it");
    };
    check(&d);
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    check(&d);
    check_accounting(&d, &[k]);
}

#[test]
fn what_snapshots_cannot_do_yet_is_refused_with_the_reason() {
    let (_f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(7);
    let (a, ac) = blocks(&mut rng, 1);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.set_snapshot_floor(k, Epoch(1), Epoch(3), None, Continues)
        .unwrap();
    let err = d
        .set_snapshot_floor(k, Epoch(1), Epoch(2), None, Continues)
        .unwrap_err();
    assert!(err.to_string().contains("only rises"), "{err}");
    let err = d
        .set_snapshot_floor(k, Epoch(1), Epoch(0), None, Continues)
        .unwrap_err();
    assert!(err.to_string().contains("between 1 and"), "{err}");
    let err = d
        .drop_snapshot(k, Epoch(4), Epoch(3), Some(Epoch(3)))
        .unwrap_err();
    assert!(err.to_string().contains("older"), "{err}");
    // An extent the drive does not hold has nothing to preserve.
    d.set_snapshot_floor(key(9, 9), Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    assert_eq!(d.snapshot_floor(key(9, 9)), 0);
    // Changes: a snapshot the copy does not hold, a range off the slab or unaligned, and
    // "to" not newer than "from" are refused; an extent not held changed nowhere.
    let err = d.changed(k, Epoch(4), Epoch(4), None, 0, SLAB).unwrap_err();
    assert!(matches!(err, EngineError::NoSnapshot { .. }), "{err}");
    let err = d
        .changed(k, Epoch(4), Epoch(3), Some(Epoch(3)), 0, SLAB)
        .unwrap_err();
    assert!(err.to_string().contains("newer"), "{err}");
    let err = d
        .changed(k, Epoch(4), Epoch(3), None, BLOCK, SLAB)
        .unwrap_err();
    assert!(err.to_string().contains("within the slab"), "{err}");
    let err = d.changed(k, Epoch(4), Epoch(3), None, 0, 100).unwrap_err();
    assert!(err.to_string().contains("4096"), "{err}");
    assert!(d
        .changed(key(9, 9), Epoch(4), Epoch(3), None, 0, SLAB)
        .unwrap()
        .iter()
        .all(|&w| w == 0));
}

#[test]
fn preserving_past_the_drive_capacity_is_refused_as_full() {
    // A drive with one data extent: the live extent fills it whole, so nothing can be
    // preserved beside it.
    let f = FaultyFile::new(3 << 20);
    let d = Drive::format_with(
        Arc::new(f),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(128 << 10),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(d.layout().data_extents, 1);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(8);
    let (a, ac) = blocks(&mut rng, 4);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    let (b, bc) = blocks(&mut rng, 4);
    let err = d.write(k, Epoch(2), ver(2, 2), 0, &b, &bc).unwrap_err();
    assert!(matches!(err, EngineError::Full { .. }), "{err}");
    // Nothing changed: the refused write left the block and the snapshot as they were.
    let mut buf = vec![0u8; 4 * B];
    d.read(k, Epoch(2), 0, &mut buf).unwrap();
    assert!(buf == a);
    // Once the snapshot is gone the write goes through.
    d.drop_snapshot(k, Epoch(2), Epoch(1), None).unwrap();
    d.write(k, Epoch(2), ver(2, 3), 0, &b, &bc).unwrap();
}

/// A copy filled after a snapshot (a rebuild, a resync) lacks the states it kept: it must
/// refuse to read it rather than answer with later data. A new slab's copy holds every
/// snapshot; one that missed a snapshot holds only those from the next on.
#[test]
fn a_copy_filled_after_a_snapshot_refuses_to_read_it() {
    let (f, d) = faulty(16 << 20);
    let mut rng = StdRng::seed_from_u64(9);
    let (a, ac) = blocks(&mut rng, 1);
    let mut buf = vec![0u8; B];
    let holds = |d: &Drive, k: ExtentKey, s: u64| {
        let mut b = vec![0u8; B];
        d.read_at(k, Epoch(9), Epoch(s), 0, &mut b).is_ok()
    };
    // The original copy: written before snapshot 1, floors 1 and 2 in turn.
    let orig = key(1, 0);
    d.write(orig, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.set_snapshot_floor(orig, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    d.set_snapshot_floor(orig, Epoch(2), Epoch(2), Some(Epoch(1)), Continues)
        .unwrap();
    assert!(holds(&d, orig, 1) && holds(&d, orig, 2));
    assert!(!holds(&d, orig, 3), "a snapshot past its floor");
    // A rebuilt copy: filled (write_blocks) after snapshots 1 and 2, no floor yet.
    let rebuilt = key(1, 1);
    d.write_blocks(rebuilt, Epoch(3), 0, &a, &ac, &[ver(1, 1)], &[Version(0)])
        .unwrap();
    let e = d
        .read_at(rebuilt, Epoch(3), Epoch(2), 0, &mut buf)
        .unwrap_err();
    assert!(e.to_string().contains("does not hold snapshot 2"), "{e}");
    // Still being filled at snapshot 3: it holds none.
    d.set_snapshot_floor(rebuilt, Epoch(3), Epoch(3), Some(Epoch(2)), Joining)
        .unwrap();
    assert!(!holds(&d, rebuilt, 3));
    // In sync at snapshot 4: from 4 on, never the older ones.
    d.set_snapshot_floor(rebuilt, Epoch(4), Epoch(4), Some(Epoch(3)), Continues)
        .unwrap();
    assert!(holds(&d, rebuilt, 4));
    assert!(!holds(&d, rebuilt, 3) && !holds(&d, rebuilt, 1));
    // The original copy missed snapshot 3 (it was stale): from 4 on.
    d.set_snapshot_floor(orig, Epoch(4), Epoch(4), Some(Epoch(3)), Continues)
        .unwrap();
    assert!(holds(&d, orig, 4) && !holds(&d, orig, 2));
    // A new slab's copy, placed after snapshot 4: every snapshot (zeros before it).
    let fresh = key(1, 2);
    d.set_snapshot_floor(fresh, Epoch(5), Epoch(4), Some(Epoch(3)), Full)
        .unwrap();
    assert!(d.has_extent(fresh), "a full floor places the copy");
    assert!(holds(&d, fresh, 1) && holds(&d, fresh, 4));
    // A new slab's copy on a drive that still holds an earlier incarnation's blocks (its
    // release never reached it): they are no snapshot's, so it holds none until the next.
    let leftover = key(1, 3);
    d.write(leftover, Epoch(5), ver(5, 1), 0, &a, &ac).unwrap();
    d.set_snapshot_floor(leftover, Epoch(6), Epoch(4), Some(Epoch(3)), Full)
        .unwrap();
    assert!(!holds(&d, leftover, 1) && !holds(&d, leftover, 4));
    d.set_snapshot_floor(leftover, Epoch(6), Epoch(6), Some(Epoch(4)), Continues)
        .unwrap();
    assert!(holds(&d, leftover, 6) && !holds(&d, leftover, 4));
    // What it holds survives a reopen.
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert!(!holds(&d, leftover, 4) && holds(&d, leftover, 6));
    assert!(holds(&d, fresh, 1) && holds(&d, rebuilt, 4) && !holds(&d, rebuilt, 3));
    assert!(holds(&d, orig, 4) && !holds(&d, orig, 2));
}

#[test]
fn absent_blocks_are_those_never_written_as_of_the_snapshot() {
    let (_f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(11);
    let (a, ac) = blocks(&mut rng, 2);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.zero(k, Epoch(1), ver(1, 2), 5 * BLOCK, BLOCK).unwrap();
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    let (b, bc) = blocks(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 3), 10 * BLOCK, &b, &bc)
        .unwrap();
    let set = |bits: &[u64]| -> Vec<usize> {
        (0..70)
            .filter(|i| bits[i / 64] >> (i % 64) & 1 == 1)
            .collect()
    };
    let now = d.absent(k, Epoch(2), None, 0, 70 * BLOCK).unwrap();
    let want: Vec<usize> = (0..70).filter(|i| ![0, 1, 5, 10].contains(i)).collect();
    assert_eq!(
        set(&now),
        want,
        "now: written and zeroed blocks are present"
    );
    let then = d
        .absent(k, Epoch(2), Some(Epoch(1)), 0, 70 * BLOCK)
        .unwrap();
    let want: Vec<usize> = (0..70).filter(|i| ![0, 1, 5].contains(i)).collect();
    assert_eq!(
        set(&then),
        want,
        "at the snapshot, block 10 was not written yet"
    );
    // An extent the drive does not hold: absent throughout, no bit past the range.
    let none = d.absent(key(9, 9), Epoch(2), None, 0, 70 * BLOCK).unwrap();
    assert_eq!(set(&none), (0..70).collect::<Vec<_>>());
    assert_eq!(none[1] >> 6, 0);
    let err = d.absent(k, Epoch(2), Some(Epoch(7)), 0, BLOCK).unwrap_err();
    assert!(matches!(err, EngineError::NoSnapshot { .. }), "{err}");
}

/// What a fill does for one copy (docs/adr/0012, step 4, as the owner runs it): snapshots
/// newest first, the blocks where the target reads differently at the snapshot than the
/// source copied into the target's shadow of it; then the target says what it holds.
fn fill_snapshots(src: (&Drive, ExtentKey), dst: (&Drive, ExtentKey), epoch: u64, snaps: &[u64]) {
    let n = (SLAB / BLOCK) as u32;
    for &s in snaps.iter().rev() {
        let sv = src
            .0
            .versions_at(src.1, Epoch(epoch), Epoch(s), 0, n, false)
            .expect("source versions");
        let tv = dst
            .0
            .versions_at(dst.1, Epoch(epoch), Epoch(s), 0, n, true)
            .expect("target versions");
        for b in (0..n as usize).filter(|&b| sv[b] != tv[b]) {
            let mut buf = vec![0u8; B];
            let mut v = Vec::new();
            let off = b as u64 * BLOCK;
            src.0
                .read_blocks_at(src.1, Epoch(epoch), Epoch(s), off, &mut buf, &mut v)
                .expect("source read");
            let crc = [crc32c::crc32c(&buf)];
            dst.0
                .write_shadow(dst.1, Epoch(epoch), Epoch(s), off, &buf, &crc, &v)
                .expect("shadow write");
        }
    }
    let (newest, oldest) = (snaps[snaps.len() - 1], snaps[0]);
    dst.0
        .set_snapshot_floor(
            dst.1,
            Epoch(epoch),
            Epoch(newest),
            Some(Epoch(oldest)),
            Copied,
        )
        .expect("copied");
}

fn same_at(a: (&Drive, ExtentKey), b: (&Drive, ExtentKey), epoch: u64, s: u64, ctx: &str) {
    let mut x = vec![0u8; SLAB as usize];
    let mut y = vec![0u8; SLAB as usize];
    a.0.read_at(a.1, Epoch(epoch), Epoch(s), 0, &mut x)
        .expect("source read");
    b.0.read_at(b.1, Epoch(epoch), Epoch(s), 0, &mut y)
        .unwrap_or_else(|e| panic!("{ctx}: the filled copy refuses snapshot {s}: {e}"));
    if x != y {
        let blk = (0..SLAB as usize / B)
            .find(|&i| x[i * B..(i + 1) * B] != y[i * B..(i + 1) * B])
            .expect("a block differs");
        panic!("{ctx}: snapshot {s} differs first at block {blk}");
    }
    for to in [None, Some(s + 1)] {
        if to.is_some_and(|t| a.0.read_at(a.1, Epoch(epoch), Epoch(t), 0, &mut x).is_err()) {
            continue;
        }
        let n = SLAB;
        let ca =
            a.0.changed(a.1, Epoch(epoch), Epoch(s), to.map(Epoch), 0, n);
        let cb =
            b.0.changed(b.1, Epoch(epoch), Epoch(s), to.map(Epoch), 0, n);
        assert_eq!(ca.ok(), cb.ok(), "{ctx}: changes from {s} to {to:?}");
    }
}

#[test]
fn a_fill_copies_every_snapshot_into_a_copy_holding_junk() {
    let (f, d) = faulty(32 << 20);
    let mut rng = StdRng::seed_from_u64(11);
    let src = key(2, 0);
    let dst = key(2, 1);
    let w = |k: ExtentKey, e: u64, s: u64, b: u64, data: &[u8]| {
        let crcs: Vec<u32> = data.chunks(B).map(crc32c::crc32c).collect();
        d.write(k, Epoch(e), ver(e, s), b * BLOCK, data, &crcs)
            .expect("write");
    };
    let (a, _) = blocks(&mut rng, 3);
    let (c, _) = blocks(&mut rng, 3);
    let (z, _) = blocks(&mut rng, 3);
    // The source: [a0 a1 a2] at snapshot 1; block 0 rewritten, block 2 zeroed at epoch 2;
    // snapshot 2; block 1 rewritten, block 5 written first at epoch 3.
    w(src, 1, 1, 0, &a);
    d.set_snapshot_floor(src, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    w(src, 2, 1, 0, &c[..B]);
    d.zero(src, Epoch(2), ver(2, 2), 2 * BLOCK, BLOCK).unwrap();
    d.set_snapshot_floor(src, Epoch(2), Epoch(2), Some(Epoch(1)), Continues)
        .unwrap();
    w(src, 3, 1, 1, &c[B..2 * B]);
    w(src, 3, 2, 5, &z[..B]);
    // The target: an old history of its own (junk for these snapshots), then the fill of
    // its live blocks with floor 2 set first, which preserves its junk into shadow 2.
    w(dst, 1, 9, 5, &z[B..2 * B]);
    w(dst, 1, 10, 7, &z[2 * B..]);
    d.set_snapshot_floor(dst, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    w(dst, 2, 11, 7, &z[..B]);
    assert_eq!(
        d.shadows(dst).len(),
        1,
        "the target kept a state of its own"
    );
    d.set_snapshot_floor(dst, Epoch(3), Epoch(2), Some(Epoch(1)), Joining)
        .unwrap();
    assert!(d.shadows(dst).is_empty(), "joining drops what it kept");
    let n = (SLAB / BLOCK) as usize;
    let mut buf = vec![0u8; SLAB as usize];
    let mut v = Vec::new();
    d.read_blocks(src, Epoch(3), 0, &mut buf, &mut v).unwrap();
    let crcs: Vec<u32> = buf.chunks(B).map(crc32c::crc32c).collect();
    let expect = d.block_versions(dst, 0, n).unwrap();
    d.write_blocks(dst, Epoch(3), 0, &buf, &crcs, &v, &expect)
        .unwrap();
    assert!(
        d.shadows(dst)
            .iter()
            .any(|s| s.snapshot == 2 && s.blocks > 0),
        "the fill preserved the target's junk"
    );
    let mut one = vec![0u8; B];
    assert!(
        d.read_at(dst, Epoch(3), Epoch(2), 0, &mut one).is_err(),
        "a copy being filled holds no snapshot"
    );
    fill_snapshots((&d, src), (&d, dst), 3, &[1, 2]);
    for s in [1, 2] {
        same_at((&d, src), (&d, dst), 3, s, "filled");
    }
    check_accounting(&d, &[src, dst]);
    // A second fill finds nothing to copy.
    for s in [1u64, 2] {
        let a = d.versions_at(src, Epoch(3), Epoch(s), 0, n as u32, false);
        let b = d.versions_at(dst, Epoch(3), Epoch(s), 0, n as u32, false);
        assert_eq!(a.unwrap(), b.unwrap(), "versions at {s}");
    }
    // It survives a reopen, and writes after it preserve alike on both copies.
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    for s in [1, 2] {
        same_at((&d, src), (&d, dst), 3, s, "reopened");
    }
    let (x, xc) = blocks(&mut rng, 8);
    for k in [src, dst] {
        d.write(k, Epoch(3), ver(3, 20), 0, &x, &xc).unwrap();
    }
    for s in [1, 2] {
        same_at((&d, src), (&d, dst), 3, s, "written after");
    }
    // Deleting snapshot 2 merges down alike; then deleting 1 frees everything.
    for k in [src, dst] {
        d.drop_snapshot(k, Epoch(3), Epoch(2), Some(Epoch(1)))
            .unwrap();
    }
    same_at((&d, src), (&d, dst), 3, 1, "after deleting 2");
    for k in [src, dst] {
        d.drop_snapshot(k, Epoch(3), Epoch(1), None).unwrap();
    }
    check_accounting(&d, &[src, dst]);
    assert_eq!(
        d.capacity().bytes_preserved,
        0,
        "every preserved block freed"
    );
}

#[test]
fn a_fill_is_refused_what_would_make_a_wrong_copy() {
    let (_f, d) = faulty(16 << 20);
    let mut rng = StdRng::seed_from_u64(12);
    let (a, ac) = blocks(&mut rng, 1);
    let k = key(3, 0);
    let e = |r: Result<u32, EngineError>| r.unwrap_err().to_string();
    // No extent yet: the floor comes first.
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(1), 0, &a, &ac, &[ver(1, 1)]));
    assert!(msg.contains("sets the copy's snapshot floor"), "{msg}");
    d.set_snapshot_floor(k, Epoch(2), Epoch(1), None, Joining)
        .unwrap();
    // Above the floor, or a state newer than the snapshot.
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(2), 0, &a, &ac, &[ver(1, 1)]));
    assert!(msg.contains("above the extent's floor"), "{msg}");
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(1), 0, &a, &ac, &[ver(2, 1)]));
    assert!(msg.contains("of its epoch or older"), "{msg}");
    // A bad crc, a missing version.
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(1), 0, &a, &[ac[0] ^ 1], &[ver(1, 1)]));
    assert!(msg.contains("crc"), "{msg}");
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(1), 0, &a, &ac, &[]));
    assert!(msg.contains("one version per"), "{msg}");
    // A stale owner.
    d.fence(k, Epoch(3)).unwrap();
    let msg = e(d.write_shadow(k, Epoch(2), Epoch(1), 0, &a, &ac, &[ver(1, 1)]));
    assert!(msg.contains("epoch"), "{msg}");
    // Copied must end at the floor.
    let r = d.set_snapshot_floor(k, Epoch(3), Epoch(2), Some(Epoch(1)), Copied);
    assert!(r.is_err(), "copied past the floor");
    d.set_snapshot_floor(k, Epoch(3), Epoch(1), Some(Epoch(1)), Copied)
        .unwrap();
    let mut one = vec![0u8; B];
    d.read_at(k, Epoch(3), Epoch(1), 0, &mut one)
        .expect("it holds snapshot 1 now");
    // A floor left above the newest snapshot (one whose commit failed, or deleted while
    // the copy was stale): joining lowers it, and a fill's Copied leaves a floor above.
    d.set_snapshot_floor(k, Epoch(3), Epoch(3), Some(Epoch(1)), Continues)
        .unwrap();
    d.set_snapshot_floor(k, Epoch(3), Epoch(2), Some(Epoch(1)), Joining)
        .unwrap();
    assert_eq!(d.snapshot_floor(k), 2, "joining lowers a floor");
    d.set_snapshot_floor(k, Epoch(3), Epoch(3), Some(Epoch(2)), Continues)
        .unwrap();
    d.set_snapshot_floor(k, Epoch(3), Epoch(2), Some(Epoch(1)), Copied)
        .unwrap();
    assert_eq!(d.snapshot_floor(k), 3, "copied leaves the floor");
    d.read_at(k, Epoch(3), Epoch(1), 0, &mut one)
        .expect("it holds snapshot 1 again");
}

/// States a snapshot reads that are members of compressed groups are copied out of their
/// streams (the other members keep them) by every kind of write that replaces them: a
/// zero, a write into part of the group, a whole-group write, and a write after the
/// codec was turned off (the plain path hands such a piece to the group path). The
/// snapshot reads them through checkpoints and reopens; a member whose stream is
/// damaged is kept as a bad state (read from another copy), never as wrong data; deleting
/// the snapshot returns every copy.
#[test]
fn packed_states_a_snapshot_reads_are_copied_out_of_their_streams() {
    let (f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(11);
    d.set_codec(k, Epoch(1), Compression::Lz4).unwrap();
    let (a, ac) = text(&mut rng, 12);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    assert_eq!(d.extents()[0].bytes_stored, 3 * BLOCK, "three streams");
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    let mut live = a.clone();
    // A zero of a member.
    d.zero(k, Epoch(2), ver(2, 1), BLOCK, BLOCK).unwrap();
    live[B..2 * B].fill(0);
    // A write into part of the group.
    let (x, xc) = text(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 2), 2 * BLOCK, &x, &xc).unwrap();
    live[2 * B..3 * B].copy_from_slice(&x);
    // A whole group.
    let (y, yc) = text(&mut rng, 4);
    d.write(k, Epoch(2), ver(2, 3), 4 * BLOCK, &y, &yc).unwrap();
    live[4 * B..8 * B].copy_from_slice(&y);
    // The codec off: a plain write of a member still packed.
    d.set_codec(k, Epoch(2), Compression::None).unwrap();
    let (z, zc) = blocks(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 4), 3 * BLOCK, &z, &zc).unwrap();
    live[3 * B..4 * B].copy_from_slice(&z);
    // Blocks 1 to 7 copied (block 0 was rewritten plainly with its group: same version).
    assert_eq!(d.shadows(k)[0].blocks, 7);
    assert_eq!(d.shadows(k)[0].bytes_stored, 7 * BLOCK);
    // A damaged stream: block 8's part of its group's stream rots, then block 8 is
    // written.
    let at = d.block_offset(k, 8).expect("packed");
    f.rot(at + 10, 1);
    let (w, wc) = blocks(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 5), 8 * BLOCK, &w, &wc).unwrap();
    live[8 * B..9 * B].copy_from_slice(&w);
    let check = |d: &Drive, ctx: &str| {
        let mut buf = vec![0u8; 12 * B];
        let info = d.read_at(k, Epoch(2), Epoch(1), 0, &mut buf).unwrap();
        // The rot struck block 8's part of the stream: bad, never wrong.
        assert_eq!(info.bad_blocks, vec![8], "{ctx}");
        assert!(
            buf[..8 * B] == a[..8 * B],
            "{ctx}: the snapshot's blocks 0 to 7"
        );
        assert!(
            buf[9 * B..] == a[9 * B..],
            "{ctx}: the snapshot's blocks 9 to 11"
        );
        let (got, info) = read_all(d, k, 0, 12 * B);
        assert!(info.bad_blocks.is_empty(), "{ctx}: {:?}", info.bad_blocks);
        assert!(got == live, "{ctx}: the live blocks");
    };
    check(&d, "now");
    d.checkpoint().unwrap();
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    check(&d, "after a checkpoint and a reopen");
    check_accounting(&d, &[k]);
    d.drop_snapshot(k, Epoch(2), Epoch(1), None).unwrap();
    assert_eq!(d.capacity().bytes_preserved, 0);
    check_accounting(&d, &[k]);
}

/// A write into a compressed group replacing a state a snapshot reads copies that state
/// out of the group's stream (PreserveCopy), in the write's batch. If a power loss leaves
/// that batch on the device but not the copy's data, the write was never acked: recovery
/// takes it back with the copy, and the snapshot reads the state from the live block
/// again, never a bad or wrong block.
#[test]
fn a_torn_copy_kept_for_a_snapshot_takes_its_unacked_write_back() {
    let (f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(23);
    d.set_codec(k, Epoch(1), Compression::Lz4).unwrap();
    let (a, ac) = text(&mut rng, 4);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    assert_eq!(
        d.extents()[0].bytes_stored,
        BLOCK,
        "one stream for the group"
    );
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    d.checkpoint().unwrap();
    let (x, xc) = text(&mut rng, 1);
    d.write(k, Epoch(2), ver(2, 1), 0, &x, &xc).unwrap();
    assert_eq!(d.shadows(k)[0].bytes_stored, BLOCK, "block 0 copied out");
    // The copy is the only place block 0's old content is stored plainly.
    let mut img = vec![0u8; B];
    let copy_at = (0..f.len_bytes() / BLOCK)
        .map(|i| i * BLOCK)
        .find(|&o| {
            f.read_at(&mut img, o).unwrap();
            img[..] == a[..B]
        })
        .expect("the copy is on the device");
    f.rot(copy_at + 100, 3);
    f.set_crash_mode(crate::CrashMode::PowerLoss { tear_bytes: 512 });
    f.crash(5);
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.stats().rolled_back_at_open, 1, "the write went back");
    let mut buf = vec![0u8; 4 * B];
    let info = d.read_at(k, Epoch(2), Epoch(1), 0, &mut buf).unwrap();
    assert!(info.bad_blocks.is_empty(), "bad {:?}", info.bad_blocks);
    assert!(
        buf == a,
        "the snapshot reads its state from the live block again"
    );
    let (live, info) = read_all(&d, k, 0, 4 * B);
    assert_eq!(info.suspect, vec![0], "the rolled-back block is suspect");
    assert!(
        live == a,
        "the live block holds its state before the unacked write"
    );
    assert!(
        d.shadows(k).iter().all(|s| s.blocks == 0),
        "the copy is gone"
    );
    check_accounting(&d, &[k]);
}

/// Parity chunks (docs/adr/0008) take held writes, whose replaced states stay as priors a
/// revert brings back. A floor is refused while priors are held (the owner settles the
/// rows first); after it, a held write replacing a state the snapshot reads copies that
/// state for the snapshot (the prior keeps naming its block). The snapshot reads the same
/// through reverts, settles, rewrites, checkpoints and reopens; deleting it returns every
/// copy, and the blocks the settled priors held are free.
#[test]
fn held_writes_keep_what_a_snapshot_reads_through_reverts_and_settles() {
    let (f, d) = faulty(16 << 20);
    let k = key(1, 0);
    let mut rng = StdRng::seed_from_u64(31);
    let (a, ac) = blocks(&mut rng, 8);
    d.write(k, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    let (b, bc) = blocks(&mut rng, 4);
    d.write_held(k, Epoch(1), ver(1, 2), 0, &b, &bc).unwrap();
    let err = d
        .set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap_err();
    assert!(err.to_string().contains("settled first"), "{err}");
    // A copy that will hold none of the snapshots (joining a fill, or placed over an
    // earlier incarnation's blocks) keeps nothing a revert could hide: taken.
    let j = key(1, 1);
    d.write(j, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.write_held(j, Epoch(1), ver(1, 2), 0, &b, &bc).unwrap();
    d.set_snapshot_floor(j, Epoch(1), Epoch(1), None, Joining)
        .unwrap();
    let k2 = key(1, 2);
    d.write(k2, Epoch(1), ver(1, 1), 0, &a, &ac).unwrap();
    d.write_held(k2, Epoch(1), ver(1, 2), 0, &b, &bc).unwrap();
    d.set_snapshot_floor(k2, Epoch(1), Epoch(1), None, Full)
        .unwrap();
    d.settle(j, Epoch(1), ver(1, 2), &[]).unwrap();
    d.settle(k2, Epoch(1), ver(1, 2), &[]).unwrap();
    d.settle(k, Epoch(1), ver(1, 2), &[]).unwrap();
    d.set_snapshot_floor(k, Epoch(1), Epoch(1), None, Continues)
        .unwrap();
    let mut snap = a.clone();
    snap[..4 * B].copy_from_slice(&b);
    let mut live = snap.clone();
    let check = |d: &Drive, live: &[u8], ctx: &str| {
        let mut buf = vec![0u8; 8 * B];
        let info = d.read_at(k, Epoch(2), Epoch(1), 0, &mut buf).unwrap();
        assert!(info.bad_blocks.is_empty(), "{ctx}: {:?}", info.bad_blocks);
        assert!(buf == snap, "{ctx}: the snapshot");
        let (got, info) = read_all(d, k, 0, 8 * B);
        assert!(
            info.bad_blocks.is_empty(),
            "{ctx}: live {:?}",
            info.bad_blocks
        );
        assert!(got == live, "{ctx}: the live blocks");
    };
    // A held write over blocks 2..6: four states copied, four priors.
    let (c, cc) = blocks(&mut rng, 4);
    d.write_held(k, Epoch(2), ver(2, 1), 2 * BLOCK, &c, &cc)
        .unwrap();
    live[2 * B..6 * B].copy_from_slice(&c);
    check(&d, &live, "after a held write");
    assert_eq!(d.shadows(k)[0].blocks, 4);
    // Reverted: the priors are the live states again; the snapshot reads as before.
    d.revert(k, Epoch(2), ver(2, 1), 2 * BLOCK, 4 * BLOCK)
        .unwrap();
    live[2 * B..6 * B].copy_from_slice(&snap[2 * B..6 * B]);
    check(&d, &live, "after the revert");
    // Written again over 4..8 and settled: the priors' blocks are free, the copies stay.
    let (e, ec) = blocks(&mut rng, 4);
    d.write_held(k, Epoch(2), ver(2, 2), 4 * BLOCK, &e, &ec)
        .unwrap();
    live[4 * B..8 * B].copy_from_slice(&e);
    check(&d, &live, "after a second held write");
    d.settle(k, Epoch(2), ver(2, 2), &[]).unwrap();
    check(&d, &live, "after the settle");
    d.checkpoint().unwrap();
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    check(&d, &live, "after a checkpoint and a reopen");
    check_accounting(&d, &[k]);
    let sh = d.shadows(k);
    assert_eq!(sh[0].blocks, 6, "blocks 2 to 7 kept");
    assert_eq!(sh[0].bytes_stored, 6 * BLOCK);
    d.drop_snapshot(k, Epoch(2), Epoch(1), None).unwrap();
    assert_eq!(d.capacity().bytes_preserved, 0);
    check_accounting(&d, &[k]);
}
