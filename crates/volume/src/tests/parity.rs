//! The owner's parity data path (docs/adr/0008) against in-memory chunks that can rot,
//! fail and hold priors as the engine does.

use super::*;
use crate::parity::Codec;

/// Extent (chunk) size of these tests: 16 blocks, so a slab is 16 rows.
const CHUNK: u64 = 64 << 10;

fn parity_volume(k: u8, m: u8, size: u64) -> (TestVol, Arc<MemReplicas>, Arc<FixedAlloc>) {
    let io = Arc::new(MemReplicas::default());
    let alloc = Arc::new(FixedAlloc::default());
    let mut cfg = config(size, CHUNK, 3);
    cfg.resiliency = Resiliency::parity(k, m).unwrap();
    cfg.min_replicas = cfg.resiliency.default_min_replicas();
    (
        Volume::new(cfg, BTreeMap::new(), io.clone(), alloc.clone()),
        io,
        alloc,
    )
}

fn key(slab: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(slab),
    }
}

/// Chunk `c` of every slab is on node c+1, drive (c+1)·10 (FixedAlloc).
fn chunk_drive(c: usize) -> DriveId {
    DriveId((c as u64 + 1) * 10)
}

/// Every row of every allocated slab: the in-sync chunks agree on its version, and its
/// parity matches its data. Returns the rows checked.
fn assert_rows_consistent(v: &TestVol, io: &MemReplicas, k: u8, m: u8) -> u64 {
    let mut codec = Codec::new(k, m).unwrap();
    let mut rows = 0;
    for (idx, ex) in v.slab_map() {
        assert_eq!(ex.len(), usize::from(k + m));
        for r in 0..CHUNK / BS {
            let blocks: Vec<(Version, Vec<u8>)> = ex
                .iter()
                .filter(|e| e.state == ExtentState::InSync)
                .map(|e| {
                    let m = io.blocks.lock().unwrap();
                    m.get(&(e.drive, key(idx.0), r))
                        .map_or((Version(0), vec![0u8; BLOCK_SIZE]), |b| (b.0, b.2.clone()))
                })
                .collect();
            assert!(
                blocks.iter().all(|b| b.0 == blocks[0].0),
                "slab {idx} row {r}: chunks disagree on the version: {:?}",
                blocks.iter().map(|b| b.0).collect::<Vec<_>>()
            );
            if blocks.len() == usize::from(k + m) {
                let shards: Vec<&[u8]> = blocks.iter().map(|b| &b.1[..]).collect();
                assert!(codec.verify(&shards).unwrap(), "slab {idx} row {r}: parity");
            }
            rows += 1;
        }
    }
    rows
}

#[tokio::test]
async fn parity_volumes_round_trip_every_request_shape() {
    for (k, m) in [(2, 1), (4, 2), (3, 1)] {
        let size = 4 * CHUNK * u64::from(k);
        let (v, io, _) = parity_volume(k, m, size);
        assert_eq!(v.slab_span(), CHUNK * u64::from(k));
        let mut model = vec![0u8; size as usize];
        let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(k) * 10 + u64::from(m));
        for i in 0..120u64 {
            let len = match i % 4 {
                0 => 4096,
                1 => rng.gen_range(1..3 * BS),
                2 => BS * rng.gen_range(1..40),
                _ => rng.gen_range(1..2 * v.slab_span()),
            }
            .min(size);
            let off = rng.gen_range(0..=size - len);
            let off = if i % 2 == 0 { off / BS * BS } else { off };
            if i % 9 == 8 {
                v.zero(off, len, false).await.unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            } else {
                let data = pattern(len as usize, i);
                v.write(off, data.clone()).await.unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            let (ro, rl) = (rng.gen_range(0..size), rng.gen_range(1..3 * v.slab_span()));
            let rl = rl.min(size - ro);
            assert_eq!(
                &v.read(ro, rl).await.unwrap()[..],
                &model[ro as usize..(ro + rl) as usize],
                "parity-{k}+{m} request {i}: read {ro}+{rl}"
            );
        }
        assert_eq!(&v.read(0, size).await.unwrap()[..], &model[..]);
        assert!(io.held_writes.load(Ordering::Relaxed) > 0);
        assert_eq!(
            io.writes.load(Ordering::Relaxed),
            0,
            "parity writes are held"
        );
        let rows = assert_rows_consistent(&v, &io, k, m);
        assert!(
            rows >= 4 * CHUNK / BS,
            "parity-{k}+{m}: {rows} rows checked"
        );
    }
}

#[tokio::test]
async fn a_small_write_costs_a_whole_row_and_reads_ask_one_chunk() {
    let (v, io, _) = parity_volume(4, 2, 4 * CHUNK);
    v.write(0, pattern(4 * CHUNK as usize, 1)).await.unwrap();
    let held = io.held_writes.load(Ordering::Relaxed);
    // One 4 KiB write: one held write on each of the 6 chunks (the row at one version).
    v.write(5 * BS, pattern(4096, 2)).await.unwrap();
    assert_eq!(io.held_writes.load(Ordering::Relaxed) - held, 6);
    let before = v.stats().repaired_blocks;
    assert_eq!(
        &v.read(5 * BS, 4096).await.unwrap()[..],
        &pattern(4096, 2)[..]
    );
    assert_eq!(v.stats().repaired_blocks, before);
    assert_rows_consistent(&v, &io, 4, 2);
}

#[tokio::test]
async fn parity_reads_decode_with_up_to_m_chunks_down_and_fail_beyond() {
    let (v, io, _) = parity_volume(4, 2, 2 * 4 * CHUNK);
    let data = pattern(2 * 4 * CHUNK as usize, 3);
    v.write(0, data.clone()).await.unwrap();
    // Two data chunks' nodes down: every read decodes their blocks from the others.
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(3)]);
    assert_eq!(v.read(0, data.len() as u64).await.unwrap(), data);
    assert_eq!(&v.read(BS, 100).await.unwrap()[..], &data[4096..4196]);
    // Writes go on with 4 of 6 chunks (below min_replicas 5: not acked, nothing lost).
    assert!(matches!(
        v.write(0, pattern(4096, 4)).await,
        Err(VolumeError::Degraded { .. })
    ));
    // A third chunk down: too few to decode, an error rather than wrong data.
    io.failed.lock().unwrap().push(NodeId(5));
    assert!(matches!(
        v.read(0, 4096).await,
        Err(VolumeError::Unreadable { .. })
    ));
}

#[tokio::test]
async fn writes_with_a_chunk_down_mark_it_stale_and_reads_decode_around_it() {
    let (v, io, _) = parity_volume(2, 1, 2 * 2 * CHUNK);
    let old = pattern(2 * CHUNK as usize, 5);
    v.write(0, old.clone()).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(2));
    let new = pattern(3 * BS as usize, 6);
    v.write(BS, new.clone()).await.unwrap();
    assert_eq!(state_of(&v, 0, 2), ExtentState::Stale);
    io.failed.lock().unwrap().clear();
    let mut want = old.to_vec();
    want[BS as usize..4 * BS as usize].copy_from_slice(&new);
    // Chunk 1 is stale (it missed the write): its blocks come from chunk 0 and parity.
    assert_eq!(&v.read(0, 2 * CHUNK).await.unwrap()[..], &want[..]);
    assert_rows_consistent(&v, &io, 2, 1);
}

#[tokio::test]
async fn a_rotten_chunk_block_is_decoded_and_repaired() {
    let (v, io, _) = parity_volume(2, 1, 2 * CHUNK);
    let data = pattern(2 * CHUNK as usize, 7);
    v.write(0, data.clone()).await.unwrap();
    // Row 3's data block on chunk 1 (volume block 7), and row 5's parity block.
    io.rot(chunk_drive(1), key(0), 3);
    io.rot(chunk_drive(2), key(0), 5);
    assert_eq!(
        &v.read(7 * BS, 4096).await.unwrap()[..],
        &data[7 * 4096..8 * 4096]
    );
    assert_eq!(v.stats().repaired_blocks, 1);
    // A read-modify-write of row 5 reads it whole, data chunks first: the parity block's
    // rot is not read, and the rewrite replaces it.
    v.write(10 * BS, pattern(4096, 8)).await.unwrap();
    for c in 0..3 {
        let at = ExtentLoc {
            node: NodeId(c as u32 + 1),
            drive: chunk_drive(c),
            state: ExtentState::InSync,
        };
        let r = read_copy(&io, at, key(0), CHUNK as u32).await;
        assert!(r.bad_blocks.is_empty(), "chunk {c}: {:?}", r.bad_blocks);
    }
    assert_rows_consistent(&v, &io, 2, 1);
}

#[tokio::test]
async fn every_chunk_bad_at_a_row_is_an_error_not_bad_data() {
    let (v, io, _) = parity_volume(2, 1, 2 * CHUNK);
    v.write(0, pattern(2 * CHUNK as usize, 9)).await.unwrap();
    io.rot(chunk_drive(0), key(0), 2);
    io.rot(chunk_drive(1), key(0), 2);
    assert!(matches!(
        v.read(4 * BS, 4096).await,
        Err(VolumeError::Unreadable { .. })
    ));
}

#[tokio::test]
async fn settles_keep_the_priors_bounded() {
    let (v, io, _) = parity_volume(2, 1, 2 * CHUNK);
    for i in 0..200u64 {
        v.write((i % 32) * BS, pattern(4096, i)).await.unwrap();
    }
    assert!(io.settles.load(Ordering::Relaxed) >= 3 * (200 / 16 - 1));
    // At most the rows written since the last settle hold priors, on each chunk.
    let held = io.priors.lock().unwrap().len();
    assert!(held <= 3 * 16, "{held} priors held");
}

#[tokio::test]
async fn trim_of_a_whole_parity_slab_releases_it_and_partial_zeroes_write_zeros() {
    let (v, io, alloc) = parity_volume(2, 1, 2 * 2 * CHUNK);
    let span = 2 * CHUNK;
    v.write(0, pattern(2 * span as usize, 10)).await.unwrap();
    // A partial TRIM is a hint: nothing changes.
    v.zero(BS, 2 * BS, true).await.unwrap();
    assert_eq!(
        &v.read(BS, BS).await.unwrap()[..],
        &pattern(2 * span as usize, 10)[4096..8192]
    );
    // WRITE_ZEROES of part of a row reads back zeros.
    v.zero(BS + 100, 300, false).await.unwrap();
    let got = v.read(BS, BS).await.unwrap();
    assert!(got[100..400].iter().all(|b| *b == 0));
    // A TRIM of slab 1 whole gives it back: no record, chunks freed, reads zeros.
    v.zero(span, span, true).await.unwrap();
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(1)));
    assert_eq!(io.released.load(Ordering::Relaxed), 3);
    assert!(v.read(span, span).await.unwrap().iter().all(|b| *b == 0));
    assert_rows_consistent(&v, &io, 2, 1);
    // Written again: a new incarnation.
    v.write(span, pattern(4096, 11)).await.unwrap();
    assert_eq!(
        &v.read(span, 4096).await.unwrap()[..],
        &pattern(4096, 11)[..]
    );
}
