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
    assert!(io.settles.load(Ordering::Relaxed) >= 3 * (200 / 32 - 1));
    // At most the rows written since the last settle hold priors, on each chunk.
    let held = io.priors.lock().unwrap().len();
    assert!(held <= 3 * 32, "{held} priors held");
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

fn chunk_at(c: usize) -> ExtentLoc {
    ExtentLoc {
        node: NodeId(c as u32 + 1),
        drive: chunk_drive(c),
        state: ExtentState::InSync,
    }
}

/// A held write of one row's chunk sent directly, as a crashed owner at epoch 3 left it.
async fn held_copy(io: &MemReplicas, c: usize, row: u64, version: Version, data: &[u8]) {
    let data = Bytes::copy_from_slice(data);
    let op = ExtentOp::WriteHeld {
        key: key(0),
        epoch: Epoch(3),
        version,
        offset: row * BS,
        crcs: block_crcs(&data),
        data,
    };
    assert_eq!(io.call(chunk_at(c), op).await, Ok(ExtentReply::Ok));
}

/// A new owner at `epoch` over the old one's records, reconciled.
async fn take_over(
    k: u8,
    m: u8,
    size: u64,
    epoch: u64,
    io: &Arc<MemReplicas>,
    alloc: &Arc<FixedAlloc>,
) -> (TestVol, resync::CopyReport) {
    let mut cfg = config(size, CHUNK, epoch);
    cfg.resiliency = Resiliency::parity(k, m).unwrap();
    cfg.min_replicas = cfg.resiliency.default_min_replicas();
    let slabs = alloc.records.lock().unwrap().clone().into_iter().collect();
    let v = Volume::new(cfg, slabs, io.clone(), alloc.clone());
    let r = v.reconcile().await.unwrap();
    (v, r)
}

/// The write hole: a crashed owner's row write reached one data chunk of 2+1, and the
/// other data chunk's node is gone. Decoding that chunk from the half-written row would
/// return garbage for acked data; the takeover reverts the row to its priors first.
#[tokio::test]
async fn a_takeover_reverts_a_half_written_row_so_a_lost_chunk_decodes_right() {
    let size = 2 * CHUNK;
    let (old, io, alloc) = parity_volume(2, 1, size);
    let acked = pattern(size as usize, 20);
    old.write(0, acked.clone()).await.unwrap();
    // Row 2's next write reached chunk 0 only, then the owner died.
    held_copy(&io, 0, 2, Version(3 << 32 | 1000), &pattern(4096, 21)).await;
    // Chunk 1's node is away at the takeover.
    io.failed.lock().unwrap().push(NodeId(2));
    let (new, r) = take_over(2, 1, size, 4, &io, &alloc).await;
    assert_eq!(r.blocks_differing, 1, "row 2 only");
    assert_eq!(io.reverts.load(Ordering::Relaxed), 1);
    assert_eq!(state_of(&new, 0, 2), ExtentState::Stale);
    // Chunk 1's blocks of every row decode from chunk 0 and parity: the acked data.
    assert_eq!(new.read(0, size).await.unwrap(), acked);
    assert_rows_consistent(&new, &io, 2, 1);
    // Every prior from the old term is dropped.
    assert!(io
        .priors
        .lock()
        .unwrap()
        .keys()
        .all(|k| k.0 == chunk_drive(1)));
}

/// A row write that reached K chunks is completed forward at the takeover.
#[tokio::test]
async fn a_takeover_completes_a_row_k_chunks_hold() {
    let size = 2 * 2 * CHUNK;
    let (old, io, alloc) = parity_volume(2, 1, size);
    old.write(0, pattern(size as usize, 22)).await.unwrap();
    // Row 5's write (both data blocks new) reached chunk 0 and the parity chunk.
    let row = pattern(2 * BS as usize, 23);
    let mut parity = vec![0u8; BS as usize];
    Codec::new(2, 1)
        .unwrap()
        .encode(&[&row[..4096], &row[4096..]], &mut [&mut parity[..]])
        .unwrap();
    let v = Version(3 << 32 | 1000);
    held_copy(&io, 0, 5, v, &row[..4096]).await;
    held_copy(&io, 2, 5, v, &parity).await;
    let (new, r) = take_over(2, 1, size, 4, &io, &alloc).await;
    assert_eq!((r.blocks_differing, r.blocks_written), (1, 1));
    assert_eq!(io.reverts.load(Ordering::Relaxed), 0);
    assert_eq!(&new.read(10 * BS, 2 * BS).await.unwrap()[..], &row[..]);
    assert_rows_consistent(&new, &io, 2, 1);
}

/// 4+2 with a row write that reached 3 of 6 chunks (neither K old nor K new): only the
/// priors can give the row back.
#[tokio::test]
async fn a_takeover_reverts_a_row_neither_version_could_decode() {
    let size = 4 * CHUNK;
    let (old, io, alloc) = parity_volume(4, 2, size);
    let acked = pattern(size as usize, 24);
    old.write(0, acked.clone()).await.unwrap();
    let v = Version(3 << 32 | 1000);
    for c in [0, 3, 5] {
        held_copy(&io, c, 7, v, &pattern(4096, 25 + c as u64)).await;
    }
    let (new, r) = take_over(4, 2, size, 4, &io, &alloc).await;
    assert_eq!(r.blocks_differing, 1);
    assert_eq!(io.reverts.load(Ordering::Relaxed), 3);
    // Two chunks lost for good: the rest still decodes to the acked data.
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(4)]);
    assert_eq!(new.read(0, size).await.unwrap(), acked);
}

#[tokio::test]
async fn resync_reconstructs_only_the_rows_a_chunk_missed() {
    let size = 2 * CHUNK;
    let (v, io, _) = parity_volume(2, 1, size);
    let mut model = pattern(size as usize, 30).to_vec();
    v.write(0, Bytes::from(model.clone())).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(2));
    // While chunk 1 is away: rows 1, 4 and 9 rewritten.
    for (i, b) in [2u64, 9, 18].iter().enumerate() {
        let d = pattern(4096, 31 + i as u64);
        v.write(b * BS, d.clone()).await.unwrap();
        model[(b * BS) as usize..((b + 1) * BS) as usize].copy_from_slice(&d);
    }
    io.failed.lock().unwrap().clear();
    assert_eq!(state_of(&v, 0, 2), ExtentState::Stale);
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let r = v
        .resync(SlabIndex(0), chunk_drive(1), &t, &p)
        .await
        .unwrap();
    assert_eq!(r.blocks_compared, CHUNK / BS);
    assert_eq!((r.blocks_differing, r.blocks_written), (3, 3));
    assert_eq!(state_of(&v, 0, 2), ExtentState::InSync);
    assert_rows_consistent(&v, &io, 2, 1);
    // Chunk 0 lost: chunk 1 and parity give every byte back.
    io.failed.lock().unwrap().push(NodeId(1));
    assert_eq!(&v.read(0, size).await.unwrap()[..], &model[..]);
}

#[tokio::test]
async fn rebuild_reconstructs_a_lost_chunk_on_another_node() {
    let size = 2 * 4 * CHUNK;
    let (v, io, alloc) = parity_volume(4, 2, size);
    let data = pattern(size as usize, 40);
    v.write(0, data.clone()).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let new = ExtentLoc {
        node: NodeId(7),
        drive: DriveId(70),
        state: ExtentState::Syncing,
    };
    for s in 0..2 {
        let r = v
            .rebuild(SlabIndex(s), chunk_drive(2), new, &t, &p)
            .await
            .unwrap();
        // Every row: the slab zeroed all of them at its allocation, then data.
        assert_eq!(r.blocks_written, CHUNK / BS, "slab {s}");
        let ex = &alloc.records.lock().unwrap()[&SlabIndex(s)];
        assert_eq!(ex[2].drive, DriveId(70), "the chunk keeps its place");
        assert!(ex.iter().all(|e| e.state == ExtentState::InSync));
    }
    // A node already holding a chunk is refused.
    let dup = ExtentLoc {
        node: NodeId(1),
        drive: DriveId(11),
        state: ExtentState::Syncing,
    };
    let e = v
        .rebuild(SlabIndex(0), DriveId(70), dup, &t, &p)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already holds a chunk"), "{e}");
    assert_rows_consistent(&v, &io, 4, 2);
    // Two more nodes lost: the rebuilt chunk serves.
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(2)]);
    assert_eq!(v.read(0, size).await.unwrap(), data);
}

#[tokio::test]
async fn scrub_finds_rot_and_wrong_parity_and_repairs_them() {
    let size = 2 * CHUNK;
    let (v, io, _) = parity_volume(2, 1, size);
    let data = pattern(size as usize, 50);
    v.write(0, data.clone()).await.unwrap();
    io.rot(chunk_drive(0), key(0), 1);
    io.rot(chunk_drive(2), key(0), 6);
    // Row 9's parity rewritten wrong, with a good checksum and the row's version.
    let ver = io.version(chunk_drive(2), key(0), 9);
    let junk = pattern(4096, 51);
    let op = ExtentOp::WriteBlocks {
        key: key(0),
        epoch: Epoch(3),
        offset: 9 * BS,
        crcs: block_crcs(&junk),
        versions: vec![ver],
        expect: vec![ver],
        data: junk,
        codec: converge_types::Compression::None,
    };
    assert_eq!(io.call(chunk_at(2), op).await, Ok(ExtentReply::Written(1)));
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let r = v.scrub(false, &t, &p).await.unwrap();
    assert_eq!(r.blocks_checked, CHUNK / BS);
    assert_eq!((r.bad_checksums, r.mismatches, r.repaired), (2, 1, 0));
    let r = v.scrub(true, &t, &p).await.unwrap();
    assert_eq!((r.bad_checksums, r.mismatches, r.repaired), (2, 1, 3));
    let r = v.scrub(false, &t, &p).await.unwrap();
    assert_eq!((r.bad_checksums, r.mismatches), (0, 0));
    assert_rows_consistent(&v, &io, 2, 1);
    assert_eq!(v.read(0, size).await.unwrap(), data);
}

/// A data chunk's block that its replica's recovery rolled back after a power loss (marked
/// suspect): a read compares the row's versions instead of trusting the chunk (its data
/// comes from the other chunks), and rewrites it; a suspect block that agrees with its row
/// is rewritten by scrub as it is, which clears the mark.
#[tokio::test]
async fn a_rolled_back_chunk_block_is_decoded_from_the_others_and_rewritten() {
    let size = 2 * CHUNK;
    let (v, io, _) = parity_volume(2, 1, size);
    let old = pattern(size as usize, 70);
    let new = pattern(size as usize, 71);
    v.write(0, old.clone()).await.unwrap();
    let before = io.version(chunk_drive(0), key(0), 3);
    let old_chunk_block = io.copy_of(chunk_drive(0), key(0))[3].2.clone();
    v.write(0, new.clone()).await.unwrap();
    // Chunk 0 takes row 3 back (its previous data at its previous version); chunk 1 keeps
    // row 5, marked suspect though it agrees with its row.
    io.roll_back(chunk_drive(0), key(0), 3, before, &old_chunk_block);
    let agree = io.copy_of(chunk_drive(1), key(0))[5].clone();
    io.roll_back(chunk_drive(1), key(0), 5, agree.1, &agree.2);
    // Row 3 alone (volume blocks 6 and 7 of a 2+1 layout).
    let row3 = 6 * BS as usize..8 * BS as usize;
    assert_eq!(
        v.read(row3.start as u64, 2 * BS).await.unwrap(),
        new.slice(row3),
        "never the rolled-back row"
    );
    assert_eq!(
        *io.suspect.lock().unwrap(),
        [(chunk_drive(1), key(0), 5)].into_iter().collect(),
        "the read rewrote the rolled-back block, and only it"
    );
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let r = v.scrub(true, &t, &p).await.unwrap();
    assert_eq!((r.bad_checksums, r.mismatches), (0, 0));
    assert!(
        io.suspect.lock().unwrap().is_empty(),
        "scrub cleared the agreeing mark"
    );
    assert_rows_consistent(&v, &io, 2, 1);
    assert_eq!(v.read(0, size).await.unwrap(), new);
}

/// A drain moves a parity chunk in its place, rebuilt from the others, and only from a
/// slab whose chunks are all in sync.
#[tokio::test]
async fn evacuating_a_parity_chunk_rebuilds_it_in_its_place() {
    let size = 2 * CHUNK;
    let (v, io, alloc) = parity_volume(2, 1, size);
    let data = pattern(size as usize, 60);
    v.write(0, data.clone()).await.unwrap();
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let new = ExtentLoc {
        node: NodeId(9),
        drive: DriveId(90),
        state: ExtentState::Syncing,
    };
    // Not while another chunk is stale.
    io.failed.lock().unwrap().push(NodeId(2));
    v.write(0, data[..4096].to_vec().into()).await.unwrap();
    io.failed.lock().unwrap().clear();
    let e = v
        .evacuate(SlabIndex(0), chunk_drive(0), new, &t, &p)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("repair comes first"), "{e}");
    v.resync(SlabIndex(0), chunk_drive(1), &t, &p)
        .await
        .unwrap();
    let r = v
        .evacuate(SlabIndex(0), chunk_drive(0), new, &t, &p)
        .await
        .unwrap();
    assert_eq!(r.blocks_written, CHUNK / BS);
    let ex = alloc.records.lock().unwrap()[&SlabIndex(0)].clone();
    assert_eq!(ex[0].drive, DriveId(90), "the chunk keeps its place");
    assert!(ex.iter().all(|e| e.state == ExtentState::InSync));
    assert_rows_consistent(&v, &io, 2, 1);
    // The old chunk's node gone for good, another lost: the moved chunk serves.
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(3)]);
    assert_eq!(v.read(0, size).await.unwrap(), data);
}

/// Was a bug (simulator, variant parity, seeds 56 and 93): a scrub step of a parity slab
/// held only its rows' lock, so a TRIM could release the slab and free its chunks while the
/// step read them. The step then saw chunks half freed (zeros at version 0 beside the data)
/// and reported in-sync chunks that disagree. The release now waits for the step.
#[tokio::test]
async fn a_release_waits_for_a_scrub_step_reading_the_slab() {
    let size = CHUNK * 2;
    let (v, io, _) = parity_volume(2, 1, size);
    let v = Arc::new(v);
    v.write(0, pattern(size as usize, 70)).await.unwrap();
    // The scrub's read of the parity chunk (node 3) waits there.
    let arrived = Arc::new(AtomicBool::new(false));
    let go = Arc::new(tokio::sync::Notify::new());
    *io.paused_read_blocks.lock().unwrap() = Some((NodeId(3), arrived.clone(), go.clone()));
    let scrub = {
        let v = v.clone();
        tokio::spawn(async move {
            let t = resync::Throttle::new(1 << 30);
            v.scrub(false, &t, &resync::Progress::default()).await
        })
    };
    while !arrived.load(Ordering::Acquire) {
        tokio::task::yield_now().await;
    }
    *io.paused_read_blocks.lock().unwrap() = None;
    // A TRIM of the whole slab, every chunk in sync: it releases the slab once it may.
    let trim = {
        let v = v.clone();
        tokio::spawn(async move { v.zero(0, size, true).await })
    };
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    go.notify_one();
    let r = scrub.await.unwrap().unwrap();
    assert_eq!((r.bad_checksums, r.mismatches), (0, 0), "{r:?}");
    trim.await.unwrap().unwrap();
    assert!(v.slab_map().is_empty(), "the slab was released");
    assert_eq!(io.released.load(Ordering::Relaxed), 3);
    assert_eq!(v.read(0, size).await.unwrap(), vec![0u8; size as usize]);
}

/// Was a bug (simulator, variant parity with drain, seed 25): a deposed owner's row write
/// was refused by a chunk the new owner had fenced and taken by one it had not yet; its
/// next write of the same row was taken by that chunk too, over the first. A chunk keeps
/// one prior per block, so the takeover could only take the row back to the first (failed)
/// write, which no other chunk held and which had no prior of its own: it zeroed the row,
/// acked data and all. A fenced write now leaves the slab to be reconciled before any of
/// its rows is written again, which a deposed owner cannot do.
#[tokio::test]
async fn a_deposed_owner_never_holds_a_row_over_its_fenced_write() {
    let size = 2 * CHUNK;
    let (old, io, alloc) = parity_volume(2, 1, size);
    let acked = pattern(size as usize, 80);
    old.write(0, acked.clone()).await.unwrap();
    // A new owner (epoch 4) has fenced chunk 0 so far; the parity chunk's node is away.
    let fence = ExtentOp::Versions {
        key: key(0),
        epoch: Epoch(4),
        offset: 0,
        count: 1,
    };
    io.call(chunk_at(0), fence).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    for seed in [81, 82] {
        let e = old.write(2 * 2 * BS, pattern(2 * BS as usize, seed)).await;
        assert!(matches!(e, Err(VolumeError::Fenced { .. })), "{e:?}");
    }
    io.failed.lock().unwrap().clear();
    let (new, _) = take_over(2, 1, size, 4, &io, &alloc).await;
    let read = new.read(0, size).await.unwrap();
    assert!(read == acked, "the acked rows came back other than written");
    assert_rows_consistent(&new, &io, 2, 1);
}

/// Was a bug (simulator, variant parity with caches, seed 125): a parity read kept the slab
/// it started with through a TRIM that released the slab and a write that took it up again
/// with its chunks' drives in other places of the row; the read then took the new parity
/// chunk for a data chunk and returned another block's data. A read whose slab was
/// released while the chunks answered starts again from the slab map.
#[tokio::test]
async fn a_read_across_a_release_reads_the_slab_again() {
    let size = 2 * CHUNK;
    let (v, io, alloc) = parity_volume(2, 1, size);
    let v = Arc::new(v);
    v.write(0, pattern(size as usize, 90)).await.unwrap();
    // A read of block 1 (data chunk 1, on node 2) waits there.
    let arrived = Arc::new(AtomicBool::new(false));
    let go = Arc::new(tokio::sync::Notify::new());
    *io.paused_reads.lock().unwrap() = Some((NodeId(2), arrived.clone(), go.clone()));
    let read = {
        let v = v.clone();
        tokio::spawn(async move { v.read(BS, BS).await })
    };
    while !arrived.load(Ordering::Acquire) {
        tokio::task::yield_now().await;
    }
    *io.paused_reads.lock().unwrap() = None;
    // Meanwhile the slab is trimmed whole (released), and written again: node 2 now holds
    // its parity chunk.
    v.zero(0, size, true).await.unwrap();
    assert!(v.slab_map().is_empty(), "released");
    *alloc.nodes_next.lock().unwrap() = Some(vec![1, 3, 2]);
    let new = pattern(size as usize, 91);
    v.write(0, new.clone()).await.unwrap();
    go.notify_one();
    let got = read.await.unwrap().unwrap();
    assert!(
        got == new[BS as usize..2 * BS as usize],
        "the read returned another block"
    );
}

/// The same with a live owner (simulator, variant parity with caches, seed 189): a row
/// write reached one chunk of 2+1, and the control plane could not be told that the other
/// two failed, so they stayed in sync; the next write of the row was held over it on that
/// chunk. The slab is now reconciled before its rows are written again.
#[tokio::test]
async fn a_row_is_not_held_over_a_write_that_left_it_unresolved() {
    let size = 2 * CHUNK;
    let (old, io, alloc) = parity_volume(2, 1, size);
    let acked = pattern(size as usize, 85);
    old.write(0, acked.clone()).await.unwrap();
    io.failed.lock().unwrap().extend([NodeId(2), NodeId(3)]);
    *alloc.changes_left.lock().unwrap() = Some(0);
    for seed in [86, 87] {
        let e = old.write(3 * 2 * BS, pattern(2 * BS as usize, seed)).await;
        assert!(matches!(e, Err(VolumeError::Control(..))), "{e:?}");
    }
    // The owner dies; a new one finds every node back.
    io.failed.lock().unwrap().clear();
    *alloc.changes_left.lock().unwrap() = None;
    let (new, _) = take_over(2, 1, size, 4, &io, &alloc).await;
    let read = new.read(0, size).await.unwrap();
    assert!(read == acked, "the acked rows came back other than written");
    assert_rows_consistent(&new, &io, 2, 1);
}

/// Was a limit the simulator met (variant parity with drain, seed 200): two chunks of a 2+1
/// slab went away one after the other (two nodes losing power) and writes marked both
/// stale. With one chunk in sync none can be filled again (each is filled from K others),
/// so the slab stayed unreadable after both nodes were back. The K-th chunk now stays in
/// sync while it is away (I/O waits for it, as for a mirror's last in-sync copy), and the
/// other one is resynced from it once it is back.
#[tokio::test]
async fn a_parity_slab_keeps_k_chunks_in_sync_and_comes_back() {
    let size = 2 * CHUNK;
    let (v, io, _) = parity_volume(2, 1, size);
    let mut model = pattern(size as usize, 95).to_vec();
    v.write(0, model.clone().into()).await.unwrap();
    // Data chunk 1 away: acked on the other two, it goes stale.
    io.failed.lock().unwrap().push(NodeId(2));
    let row0 = pattern(2 * BS as usize, 96);
    v.write(0, row0.clone()).await.unwrap();
    model[..2 * BS as usize].copy_from_slice(&row0);
    assert_eq!(state_of(&v, 0, 2), ExtentState::Stale);
    // The parity chunk away too: the write fails, and the parity chunk stays in sync.
    io.failed.lock().unwrap().push(NodeId(3));
    assert!(v.write(2 * BS, pattern(2 * BS as usize, 97)).await.is_err());
    assert_eq!(state_of(&v, 0, 3), ExtentState::InSync);
    // Both back: the half-written row is reconciled, the stale chunk resynced.
    io.failed.lock().unwrap().clear();
    v.reconcile_suspect().await.unwrap();
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    v.resync(SlabIndex(0), chunk_drive(1), &t, &p)
        .await
        .unwrap();
    assert!(v.slab_map()[&SlabIndex(0)]
        .iter()
        .all(|e| e.state == ExtentState::InSync));
    assert_rows_consistent(&v, &io, 2, 1);
    let read = v.read(0, size).await.unwrap();
    assert!(read == model, "the acked rows came back other than written");
}

/// A data chunk whose node takes reads and never answers (a paused process): a healthy
/// read of its blocks is hedged after `read_hedge` and decoded from the other chunks, so it
/// answers, with the right data, instead of waiting for the chunk.
#[tokio::test(start_paused = true)]
async fn a_parity_read_is_hedged_past_a_data_chunk_that_does_not_answer() {
    let (v, io, _) = parity_volume(2, 1, 2 * CHUNK);
    let data = pattern(2 * CHUNK as usize, 5);
    v.write(0, data.clone()).await.unwrap();
    // Chunk 0 (node 1) holds the even blocks: block 4's read asks it alone.
    io.hung.lock().unwrap().push(NodeId(1));
    let got = tokio::time::timeout(std::time::Duration::from_secs(30), v.read(4 * BS, 4096))
        .await
        .expect("the read is hedged, not left waiting for the hung chunk")
        .unwrap();
    assert_eq!(&got[..], &data[4 * BS as usize..5 * BS as usize]);
    // A read over both data chunks: the hung one's blocks decoded, the other's read.
    let got = v.read(0, 2 * CHUNK).await.unwrap();
    assert_eq!(got, data);
    assert_eq!(v.stats().hedged_reads, 2);
}
