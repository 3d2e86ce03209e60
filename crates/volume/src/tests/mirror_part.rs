//! Mirror-accelerated parity (docs/adr/0009): writes land in the mirror part while it has
//! room, the coldest spans rotate into parity, and the data reads the same throughout.

use super::*;
use crate::resync::{Progress, Throttle};

/// Extent size of these tests: 16 blocks.
const EXTENT: u64 = 64 << 10;

/// A parity-2+1 volume of `spans` spans with a mirror part of `mirror_extents` extents.
fn map_volume(spans: u64, mirror_extents: u64) -> (TestVol, Arc<MemReplicas>, Arc<FixedAlloc>) {
    let io = Arc::new(MemReplicas::default());
    let alloc = Arc::new(FixedAlloc::default());
    let mut cfg = config(spans * 2 * EXTENT, EXTENT, 3);
    cfg.resiliency = Resiliency::parity(2, 1).unwrap();
    cfg.min_replicas = cfg.resiliency.default_min_replicas();
    cfg.mirror_part_bytes = mirror_extents * EXTENT;
    (
        Volume::new(cfg, BTreeMap::new(), io.clone(), alloc.clone()),
        io,
        alloc,
    )
}

fn throttle() -> Throttle {
    Throttle::new(u64::MAX)
}

/// The slab map as (index text, copies).
fn layout_of(v: &TestVol) -> Vec<(String, usize)> {
    v.slab_map()
        .iter()
        .map(|(i, e)| (i.to_string(), e.len()))
        .collect()
}

#[tokio::test]
async fn writes_land_mirrored_while_the_part_has_room_then_in_parity() {
    let (v, io, _) = map_volume(4, 2);
    let span = v.slab_span();
    let a = pattern(span as usize, 1);
    v.write(0, a.clone()).await.unwrap();
    // Span 0: two mirror-part slabs of two copies (mirror-2 beside parity-2+1).
    assert_eq!(layout_of(&v), [("m0".into(), 2), ("m1".into(), 2)]);
    assert_eq!(io.held_writes.load(Ordering::Relaxed), 0, "mirror writes");
    // The part is full: span 2 goes to parity (three chunks).
    let b = pattern(4096, 2);
    v.write(2 * span + 8192, b.clone()).await.unwrap();
    assert_eq!(
        layout_of(&v),
        [("2".into(), 3), ("m0".into(), 2), ("m1".into(), 2)]
    );
    let u = v.mirror_part_usage().unwrap();
    assert_eq!(
        (u.limit_bytes, u.mirror_bytes, u.parity_bytes),
        (2 * EXTENT, 2 * EXTENT, span)
    );
    assert_eq!(v.read(0, span).await.unwrap(), a);
    assert_eq!(v.read(2 * span + 8192, 4096).await.unwrap(), b);
    // A read across both layouts and a hole.
    let all = v.read(0, 4 * span).await.unwrap();
    assert_eq!(&all[..span as usize], &a[..]);
    assert!(all[span as usize..2 * span as usize]
        .iter()
        .all(|&x| x == 0));
    assert_eq!(
        &all[(2 * span + 8192) as usize..(2 * span + 8192 + 4096) as usize],
        &b[..]
    );
    // Block status: the mirror span and the parity span hold data, the rest not.
    assert_eq!(
        v.allocation(0, 4 * span).unwrap(),
        [(span, true), (span, false), (span, true), (span, false)]
    );
}

// Paused time: the writes below are a known number of milliseconds apart.
#[tokio::test(start_paused = true)]
async fn the_coldest_span_rotates_into_parity_and_reads_the_same() {
    let (v, io, alloc) = map_volume(4, 4);
    let span = v.slab_span();
    let size = 4 * span;
    let mut model = vec![0u8; size as usize];
    // Span 1 first (so the colder), then span 0, which fill the mirror part; then part of
    // span 3, which finds no room and lands in parity.
    for (off, len, seed) in [
        (span, span, 1),
        (0, span, 2),
        (3 * span + 4096, 3 * 4096, 3),
    ] {
        let d = pattern(len as usize, seed);
        v.write(off, d.clone()).await.unwrap();
        model[off as usize..(off + len) as usize].copy_from_slice(&d);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(v.mirror_part_usage().unwrap().mirror_bytes, 4 * EXTENT);
    let progress = Progress::default();
    // 100 % full, above the high watermark: span 1 (written least recently) moves.
    let r = v.rotate_once(false, &throttle(), &progress).await.unwrap();
    assert_eq!(
        r,
        Rotated::Span {
            span: 1,
            bytes: span
        }
    );
    assert_eq!(progress.bytes_done.load(Ordering::Relaxed), span);
    assert_eq!(
        layout_of(&v),
        [
            ("1".into(), 3),
            ("3".into(), 3),
            ("m0".into(), 2),
            ("m1".into(), 2)
        ]
    );
    // The mirror-part records are gone and their copies freed.
    let records: Vec<SlabIndex> = alloc.records.lock().unwrap().keys().copied().collect();
    assert!(!records.contains(&SlabIndex::mirror_part(2)));
    assert!(!records.contains(&SlabIndex::mirror_part(3)));
    assert_eq!(io.released.load(Ordering::Relaxed), 4, "2 slabs × 2 copies");
    assert_eq!(v.stats().rotations, 1);
    assert_eq!(v.stats().rotated_bytes, span);
    assert_eq!(&v.read(0, size).await.unwrap()[..], &model[..]);
    // 50 %: at or below the low watermark, nothing more moves.
    let r = v.rotate_once(true, &throttle(), &progress).await.unwrap();
    assert_eq!(r, Rotated::Nothing);
    // Writes to the rotated span now take the parity path (whole rows, held).
    let held = io.held_writes.load(Ordering::Relaxed);
    let d = pattern(4096, 4);
    v.write(span + 4096, d.clone()).await.unwrap();
    model[(span + 4096) as usize..(span + 8192) as usize].copy_from_slice(&d);
    assert_eq!(io.held_writes.load(Ordering::Relaxed) - held, 3);
    assert_eq!(&v.read(0, size).await.unwrap()[..], &model[..]);
    // A new span has room in the mirror part again.
    let d = pattern(4096, 5);
    v.write(2 * span, d.clone()).await.unwrap();
    model[(2 * span) as usize..(2 * span + 4096) as usize].copy_from_slice(&d);
    assert!(v.slab_map().contains_key(&SlabIndex::mirror_part(4)));
    assert_eq!(&v.read(0, size).await.unwrap()[..], &model[..]);
}

#[tokio::test]
async fn writes_during_a_rotation_wait_and_land_in_the_new_layout() {
    let (v, io, _) = map_volume(2, 2);
    let span = v.slab_span();
    v.write(0, pattern(span as usize, 1)).await.unwrap();
    let late = pattern(8192, 2);
    // The rotation's reads of the mirror (this node's copy first) wait in flight.
    let arrived = Arc::new(AtomicBool::new(false));
    let go = Arc::new(tokio::sync::Notify::new());
    *io.paused_reads.lock().unwrap() = Some((NodeId(2), arrived.clone(), go.clone()));
    let (progress, t) = (Progress::default(), throttle());
    let wrote = AtomicBool::new(false);
    let write = async {
        v.write(EXTENT - 4096, late.clone()).await.unwrap();
        wrote.store(true, Ordering::Release);
    };
    let control = async {
        while !arrived.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        // The rotation is copying; the write has had every chance to run.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            !wrote.load(Ordering::Acquire),
            "a write to a span being rotated waits for the flip"
        );
        *io.paused_reads.lock().unwrap() = None;
        go.notify_waiters();
    };
    let (r, (), ()) = tokio::join!(v.rotate_span(0, &t, &progress), write, control);
    assert!(wrote.load(Ordering::Acquire));
    assert_eq!(r.unwrap(), Some(span));
    let mut model = pattern(span as usize, 1).to_vec();
    model[(EXTENT - 4096) as usize..(EXTENT + 4096) as usize].copy_from_slice(&late);
    assert_eq!(&v.read(0, span).await.unwrap()[..], &model[..]);
    assert_eq!(layout_of(&v), [("0".into(), 3)]);
}

#[tokio::test]
async fn a_rotation_that_did_not_flip_leaves_the_mirror_the_truth() {
    // A crash between the copy and the flip: the next owner finds both layouts.
    let (v, io, alloc) = map_volume(2, 4);
    let span = v.slab_span();
    let a = pattern(span as usize, 1);
    v.write(0, a.clone()).await.unwrap();
    // The leftover parity slab holds other data (an older copy, or nothing yet).
    let mut leftover = v.slab_map();
    leftover.insert(
        SlabIndex(0),
        (1..=3)
            .map(|n| ExtentLoc {
                node: NodeId(n),
                drive: DriveId(u64::from(n) * 10),
                state: ExtentState::InSync,
            })
            .collect(),
    );
    alloc
        .records
        .lock()
        .unwrap()
        .insert(SlabIndex(0), leftover[&SlabIndex(0)].clone());
    let mut cfg = v.config().clone();
    cfg.epoch = Epoch(4);
    let next: TestVol = Volume::new(cfg, leftover, io.clone(), alloc.clone());
    assert_eq!(next.read(0, span).await.unwrap(), a, "the mirror is read");
    // Half full, below the watermark: nothing rotates, but the leftover goes.
    let progress = Progress::default();
    let r = next
        .rotate_once(false, &throttle(), &progress)
        .await
        .unwrap();
    assert_eq!(r, Rotated::Nothing);
    assert_eq!(layout_of(&next), [("m0".into(), 2), ("m1".into(), 2)]);
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(0)));
    assert_eq!(next.read(0, span).await.unwrap(), a);
    // And a rotation now writes a parity slab of its own.
    assert_eq!(
        next.rotate_span(0, &throttle(), &progress).await.unwrap(),
        Some(span)
    );
    assert_eq!(layout_of(&next), [("0".into(), 3)]);
    assert_eq!(next.read(0, span).await.unwrap(), a);
}

#[tokio::test]
async fn trims_release_mirror_part_slabs_and_whole_spans() {
    let (v, _io, alloc) = map_volume(4, 4);
    let span = v.slab_span();
    v.write(0, pattern(2 * span as usize, 1)).await.unwrap();
    assert_eq!(v.mirror_part_usage().unwrap().mirror_bytes, 4 * EXTENT);
    // One extent of span 0 whole: its mirror-part slab goes.
    v.zero(0, EXTENT, true).await.unwrap();
    assert!(!v.slab_map().contains_key(&SlabIndex::mirror_part(0)));
    // Span 1 whole: both of its slabs go.
    v.zero(span, span, true).await.unwrap();
    assert_eq!(layout_of(&v), [("m1".into(), 2)]);
    assert_eq!(alloc.records.lock().unwrap().len(), 1);
    let all = v.read(0, 2 * span).await.unwrap();
    assert!(all[..EXTENT as usize].iter().all(|&x| x == 0));
    assert_eq!(
        &all[EXTENT as usize..span as usize],
        &pattern(2 * span as usize, 1)[EXTENT as usize..span as usize]
    );
    assert!(all[span as usize..].iter().all(|&x| x == 0));
    // WRITE_ZEROES of part of an extent zeroes it in place.
    v.zero(EXTENT + 4096, 4096, false).await.unwrap();
    assert!(v
        .read(EXTENT + 4096, 4096)
        .await
        .unwrap()
        .iter()
        .all(|&x| x == 0));
}

/// A whole-span TRIM of a span held in the mirror part beside a parity slab that cannot be
/// released (a chunk out of sync): the mirror-part slabs are zeroed but kept, so the span
/// reads zeros, never the parity slab's stale rows (found by the simulator, seed 43 of the
/// mirror-part sweep).
#[tokio::test]
async fn a_trim_never_leaves_a_stale_parity_slab_the_truth() {
    let (v, io, alloc) = map_volume(2, 4);
    let span = v.slab_span();
    v.write(0, pattern(span as usize, 1)).await.unwrap();
    // A rotation's leftover, with other content: written by an owner of the same volume
    // without a mirror part (same keys, same drives).
    let mut plain = v.config().clone();
    plain.mirror_part_bytes = 0;
    let p: TestVol = Volume::new(plain, BTreeMap::new(), io.clone(), alloc.clone());
    p.write(0, pattern(span as usize, 2)).await.unwrap();
    let mut slabs = v.slab_map();
    let mut chunks = p.slab_map()[&SlabIndex(0)].clone();
    chunks[2].state = ExtentState::Stale;
    slabs.insert(SlabIndex(0), chunks);
    let mut cfg = v.config().clone();
    cfg.epoch = Epoch(4);
    let next: TestVol = Volume::new(cfg, slabs, io.clone(), alloc.clone());
    assert_eq!(next.read(0, span).await.unwrap(), pattern(span as usize, 1));
    next.zero(0, span, true).await.unwrap();
    assert!(
        next.read(0, span).await.unwrap().iter().all(|&b| b == 0),
        "the TRIMmed span reads zeros, not the leftover's rows"
    );
    assert_eq!(
        layout_of(&next),
        [("0".into(), 3), ("m0".into(), 2), ("m1".into(), 2)],
        "the mirror part's slabs stay while the parity slab does"
    );
}
