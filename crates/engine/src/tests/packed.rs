//! Compressed block groups (docs/adr/0010): round trips, read-modify-write of part of a
//! group, zeros, reopen and checkpoints, the accounting of stored blocks against the free
//! map, damaged streams, thin drives, and version-2 drives that store everything plainly.

use super::*;
use crate::layout::Superblock;
use converge_types::Compression;

/// Compressible blocks: each a random 64-byte pattern repeated (a group of four shrinks to
/// one block), with the block's index in the first bytes.
fn text_blocks(rng: &mut StdRng, n: usize) -> (Vec<u8>, Vec<u32>) {
    let mut d = vec![0u8; n * B];
    for (i, blk) in d.chunks_mut(B).enumerate() {
        let mut pat = [0u8; 64];
        rng.fill(&mut pat[..]);
        for (j, x) in blk.iter_mut().enumerate() {
            *x = pat[j % 64];
        }
        blk[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    let crcs = d.chunks(B).map(crc32c::crc32c).collect();
    (d, crcs)
}

fn info(d: &Drive, k: ExtentKey) -> crate::ExtentInfo {
    d.extents()
        .into_iter()
        .find(|e| e.key == k)
        .expect("extent held")
}

/// With no write in flight and no priors, every physical block is free or stored by
/// exactly one state (a stream once), and the drive's counts agree with its extents'.
fn check_accounting(d: &Drive) {
    let cap = d.capacity();
    let per_extent: u64 = d.extents().iter().map(|e| e.bytes_stored).sum();
    assert_eq!(cap.bytes_stored, per_extent, "drive vs extents stored");
    assert_eq!(
        cap.bytes_free + cap.bytes_stored,
        d.layout().data_blocks * BLOCK,
        "free + stored = the data region"
    );
}

fn check_content(d: &Drive, k: ExtentKey, model: &[u8]) {
    let (buf, info) = read_all(d, k, 0, model.len());
    assert!(
        info.bad_blocks.is_empty(),
        "bad blocks {:?}",
        info.bad_blocks
    );
    for (b, (got, want)) in buf.chunks(B).zip(model.chunks(B)).enumerate() {
        assert!(got == want, "block {b} differs");
    }
}

#[test]
fn compressed_groups_round_trip_read_modify_write_and_reopen() {
    for (seed, codec) in [(1, Compression::Lz4), (2, Compression::Zstd)] {
        let (f, d) = faulty(16 << 20);
        let mut rng = StdRng::seed_from_u64(seed);
        let k = key(1, 0);
        d.set_codec(k, Epoch(1), codec).unwrap();
        assert_eq!(d.codec_of(k), codec);
        let mut model = vec![0u8; 128 * B];
        let mut v = 0;
        let mut write =
            |d: &Drive, model: &mut Vec<u8>, first: usize, data: &[u8], crcs: &[u32]| {
                v += 1;
                d.write(k, Epoch(1), Version(v), (first * B) as u64, data, crcs)
                    .unwrap();
                model[first * B..first * B + data.len()].copy_from_slice(data);
                check_content(d, k, model);
                check_accounting(d);
            };
        // 64 compressible blocks: 16 groups, a block each.
        let (x, xc) = text_blocks(&mut rng, 64);
        write(&d, &mut model, 0, &x, &xc);
        let e = info(&d, k);
        assert_eq!(e.bytes_written, 64 * BLOCK);
        assert_eq!(e.bytes_stored, 16 * BLOCK, "{codec}");
        assert_eq!(e.compression, codec);
        // Incompressible blocks are stored as they are.
        let (r, rc) = blocks(&mut rng, 16);
        write(&d, &mut model, 64, &r, &rc);
        assert_eq!(info(&d, k).bytes_stored, 32 * BLOCK);
        // One block into a compressed group: the group is rewritten, still one block.
        let (y, yc) = text_blocks(&mut rng, 1);
        write(&d, &mut model, 5, &y, &yc);
        assert_eq!(info(&d, k).bytes_stored, 32 * BLOCK);
        // An incompressible block into a compressed group: 2 blocks for 4.
        let (z, zc) = blocks(&mut rng, 1);
        write(&d, &mut model, 9, &z, &zc);
        assert_eq!(info(&d, k).bytes_stored, 33 * BLOCK);
        // A write across groups, starting and ending inside one.
        let (w, wc) = text_blocks(&mut rng, 6);
        write(&d, &mut model, 14, &w, &wc);
        assert_eq!(info(&d, k).bytes_stored, 33 * BLOCK);
        // Zeros in part of a group: the other members keep the stream.
        v += 1;
        d.zero(k, Epoch(1), Version(v), 20 * BLOCK, 2 * BLOCK)
            .unwrap();
        model[20 * B..22 * B].fill(0);
        check_content(&d, k, &model);
        check_accounting(&d);
        assert_eq!(info(&d, k).bytes_written, 78 * BLOCK);
        assert_eq!(info(&d, k).bytes_stored, 33 * BLOCK);
        // Zeros over a whole group give its stream back.
        v += 1;
        d.zero(k, Epoch(1), Version(v), 24 * BLOCK, 4 * BLOCK)
            .unwrap();
        model[24 * B..28 * B].fill(0);
        check_content(&d, k, &model);
        check_accounting(&d);
        assert_eq!(info(&d, k).bytes_stored, 32 * BLOCK);
        // Reopen (replay), then checkpoint and reopen (metadata pages): the same.
        let before = info(&d, k);
        drop(d);
        let d = Drive::open(Arc::new(f.reattach())).unwrap();
        check_content(&d, k, &model);
        check_accounting(&d);
        assert_eq!(info(&d, k), before);
        d.checkpoint().unwrap();
        drop(d);
        let d = Drive::open(Arc::new(f.reattach())).unwrap();
        check_content(&d, k, &model);
        check_accounting(&d);
        assert_eq!(info(&d, k), before);
        assert_eq!(d.codec_of(k), codec, "the codec is durable");
        // Freeing the extent gives every stream back once.
        d.free_extent(k).unwrap();
        check_accounting(&d);
        assert_eq!(d.capacity().bytes_stored, 0);
    }
}

/// Random writes (compressible or not, aligned or not), zeros, compare-and-set copies and
/// codec changes against a byte model, with reopens: content, written and stored bytes,
/// and the free map agree throughout.
#[test]
fn random_ops_on_compressed_extents_match_a_model() {
    for seed in 0..6u64 {
        let (f, d) = faulty(16 << 20);
        let mut d = d;
        let mut rng = StdRng::seed_from_u64(100 + seed);
        let codecs = [Compression::Lz4, Compression::Zstd];
        let mut model: HashMap<ExtentKey, Vec<u8>> = HashMap::new();
        let blocks_per = (SLAB / BLOCK) as usize;
        for op in 0..300u64 {
            let version = op + 1;
            let k = key(2, rng.gen_range(0..3));
            if !model.contains_key(&k) {
                d.set_codec(k, Epoch(1), codecs[(seed as usize + k.slab.0 as usize) % 2])
                    .unwrap();
            }
            let m = model.entry(k).or_insert_with(|| vec![0; SLAB as usize]);
            let first = rng.gen_range(0..blocks_per);
            let n = rng.gen_range(1..=(blocks_per - first).min(24));
            let at = first * B;
            match rng.gen_range(0..20) {
                0..=2 => {
                    d.zero(k, Epoch(1), Version(version), at as u64, (n * B) as u64)
                        .unwrap();
                    m[at..at + n * B].fill(0);
                }
                3 => {
                    // A codec change applies to later writes only.
                    let c = [Compression::None, Compression::Lz4, Compression::Zstd]
                        [rng.gen_range(0..3)];
                    d.set_codec(k, Epoch(1), c).unwrap();
                }
                4..=5 => {
                    // A resync's copy: only blocks still at the version the copier saw.
                    let (data, crcs) = text_blocks(&mut rng, n);
                    let cur = d.block_versions(k, at as u64, n).unwrap();
                    let expect: Vec<Version> = cur
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| if i % 3 == 2 { Version(v.0 + 1000) } else { v })
                        .collect();
                    let vs = vec![Version(version); n];
                    d.write_blocks(k, Epoch(1), at as u64, &data, &crcs, &vs, &expect)
                        .unwrap();
                    for i in (0..n).filter(|i| i % 3 != 2) {
                        m[at + i * B..at + (i + 1) * B].copy_from_slice(&data[i * B..(i + 1) * B]);
                    }
                }
                _ => {
                    let (data, crcs) = if rng.gen_bool(0.7) {
                        text_blocks(&mut rng, n)
                    } else {
                        blocks(&mut rng, n)
                    };
                    d.write(k, Epoch(1), Version(version), at as u64, &data, &crcs)
                        .unwrap();
                    m[at..at + n * B].copy_from_slice(&data);
                }
            }
            if op % 100 == 99 {
                check_accounting(&d);
                if op % 200 == 199 {
                    d.checkpoint().unwrap();
                }
                drop(d);
                d = Drive::open(Arc::new(f.reattach())).unwrap();
                check_accounting(&d);
            }
        }
        for (k, m) in &model {
            check_content(&d, *k, m);
            let e = info(&d, *k);
            let nonzero = m.chunks(B).filter(|b| b.iter().any(|&x| x != 0)).count() as u64;
            // Written counts every block holding data (zeros written as data included).
            assert!(e.bytes_written >= nonzero * BLOCK, "seed {seed} {k:?}");
            assert!(
                e.bytes_stored <= e.bytes_written + 3 * BLOCK * 8,
                "seed {seed}"
            );
        }
        check_accounting(&d);
    }
}

/// A stream that rots never yields wrong bytes: a stream that no longer decompresses makes
/// every member it holds bad; damage inside one member's bytes makes that member bad. A
/// write into the group keeps the members it cannot read as they are (still bad, never
/// rewritten from bytes it cannot trust); rewriting the group whole repairs it.
#[test]
fn a_damaged_stream_reports_its_members_bad() {
    for (codec, rot_at) in [(Compression::Zstd, 1u64), (Compression::Lz4, 100)] {
        let (f, d) = faulty(8 << 20);
        let mut rng = StdRng::seed_from_u64(12);
        let k = key(3, 0);
        d.set_codec(k, Epoch(1), codec).unwrap();
        let (x, xc) = text_blocks(&mut rng, 8);
        d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
        assert_eq!(info(&d, k).bytes_stored, 2 * BLOCK);
        // Zstd: the frame's magic number (nothing decompresses); lz4: a literal byte.
        f.rot(d.block_offset(k, 5).unwrap() + rot_at, 3);
        let (buf, got) = read_all(&d, k, 0, 8 * B);
        assert!(!got.bad_blocks.is_empty(), "{codec}");
        assert!(got.bad_blocks.iter().all(|b| (4..8).contains(b)), "{codec}");
        if codec == Compression::Zstd {
            assert_eq!(got.bad_blocks, vec![4, 5, 6, 7]);
        }
        for b in 0..8 {
            if !got.bad_blocks.contains(&b) {
                let at = b as usize * B;
                assert_eq!(&buf[at..at + B], &x[at..at + B], "{codec} block {b}");
            }
        }
        let bad_after_write: Vec<u32> =
            got.bad_blocks.iter().copied().filter(|&b| b != 4).collect();
        d.write(k, Epoch(1), Version(2), 4 * BLOCK, &x[..B], &xc[..1])
            .unwrap();
        let (_, got) = read_all(&d, k, 0, 8 * B);
        assert_eq!(got.bad_blocks, bad_after_write, "{codec}");
        check_accounting(&d);
        d.write(k, Epoch(1), Version(3), 4 * BLOCK, &x[4 * B..], &xc[4..])
            .unwrap();
        let (buf, got) = read_all(&d, k, 0, 8 * B);
        assert!(got.bad_blocks.is_empty());
        assert_eq!(buf, x);
        check_accounting(&d);
    }
}

/// A thin drive holds more compressed extents than its data region holds plain ones; a
/// plain extent still claims its whole size; when compressed data stops compressing, its
/// writes fail with `Full` (the owner rebuilds the copy elsewhere) instead of taking the
/// room the plain extents may still need, and nothing hangs.
#[test]
fn a_thin_drive_holds_more_compressed_extents_and_refuses_what_it_cannot_hold() {
    let (_f, d) = faulty(8 << 20);
    let cap = d.capacity();
    let data_extents = cap.extents_total;
    assert_eq!(cap.slots_total, 2 * data_extents);
    let mut rng = StdRng::seed_from_u64(13);
    let bpe = (SLAB / BLOCK) as usize;
    // One plain extent, written whole.
    let (p, pc) = blocks(&mut rng, bpe);
    d.write(key(9, 0), Epoch(1), Version(1), 0, &p, &pc)
        .unwrap();
    // Compressed extents, written whole, in more slots than there are data extents.
    let (x, xc) = text_blocks(&mut rng, bpe);
    for s in 0..2 * data_extents - 1 {
        d.set_codec(key(4, s), Epoch(1), Compression::Zstd).unwrap();
        d.write(key(4, s), Epoch(1), Version(1), 0, &x, &xc)
            .unwrap();
    }
    let cap = d.capacity();
    assert_eq!(cap.extents_used, 2 * data_extents);
    assert!(cap.extents_used > data_extents);
    check_accounting(&d);
    // Every slot is taken now.
    assert!(matches!(
        d.set_codec(key(5, 0), Epoch(1), Compression::Zstd),
        Err(EngineError::NoSpace { .. })
    ));
    // Incompressible data into the compressed extents: some write fails with Full before
    // the plain extent's room is touched; the plain extent can still be rewritten whole.
    let (r, rc) = blocks(&mut rng, bpe);
    let mut full = false;
    for s in 0..2 * data_extents - 1 {
        match d.write(key(4, s), Epoch(1), Version(2), 0, &r, &rc) {
            Ok(()) => {}
            Err(EngineError::Full { .. }) => {
                full = true;
                break;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(full, "incompressible data cannot fit twice the extents");
    let (q, qc) = blocks(&mut rng, bpe);
    d.write(key(9, 0), Epoch(1), Version(2), 0, &q, &qc)
        .unwrap();
    check_content(&d, key(9, 0), &q);
    check_accounting(&d);
}

/// A version-2 drive (formatted before compressed groups) opens, keeps extents' codecs,
/// and stores every block as is: an older build can still read what it holds.
#[test]
fn a_version_2_drive_stores_compressed_extents_plainly() {
    let f = FaultyFile::new(8 << 20);
    let d = Drive::format_with(
        Arc::new(f.clone()),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(256 << 10),
            overcommit: Some(1),
        },
    )
    .unwrap();
    drop(d);
    // Rewrite both superblock copies as version 2.
    let mut b = vec![0u8; 2 * B];
    f.read_at(&mut b, 0).unwrap();
    for copy in 0..2 {
        let at = copy * B;
        let mut sb = Superblock::decode(&b[at..at + B]).unwrap().unwrap();
        sb.format_version = 2;
        sb.encode(&mut b[at..at + B]);
    }
    f.write_at(&b, 0).unwrap();
    f.sync().unwrap();
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let k = key(6, 0);
    d.set_codec(k, Epoch(1), Compression::Lz4).unwrap();
    let mut rng = StdRng::seed_from_u64(14);
    let (x, xc) = text_blocks(&mut rng, 8);
    d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    let e = info(&d, k);
    assert_eq!(e.bytes_stored, e.bytes_written);
    check_content(&d, k, &x);
    check_accounting(&d);
}
