//! Unit and property tests of the drive API on the simulated and on real O_DIRECT files.

use crate::layout::{BLOCK, SECTOR};
use crate::{BlockFile, DirectFile, Drive, DriveIdentity, EngineError, FaultyFile, FormatOptions};
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SettleRows, SlabIndex,
    Version, VolumeId,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SLAB: u64 = 1 << 20;
const B: usize = BLOCK as usize;

fn ident(slab: u64) -> DriveIdentity {
    DriveIdentity {
        cluster: ClusterId(0x1234),
        node: NodeId(2),
        drive: DriveId(77),
        slab_size_bytes: slab,
        role: DriveRole::Capacity,
        media: MediaType::Ssd,
    }
}

fn key(v: u64, s: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(v),
        slab: SlabIndex(s),
    }
}

fn blocks(rng: &mut StdRng, n: usize) -> (Vec<u8>, Vec<u32>) {
    let mut d = vec![0u8; n * B];
    rng.fill(&mut d[..]);
    let crcs = d.chunks(B).map(crc32c::crc32c).collect();
    (d, crcs)
}

fn faulty(len: u64) -> (FaultyFile, Drive) {
    let f = FaultyFile::new(len);
    let d = Drive::format_with(
        Arc::new(f.clone()),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(256 << 10),
            ..Default::default()
        },
    )
    .expect("format");
    (f, d)
}

fn read_all(d: &Drive, k: ExtentKey, off: u64, len: usize) -> (Vec<u8>, crate::ReadInfo) {
    let mut buf = vec![0u8; len];
    let info = d.read(k, Epoch(1000), off, &mut buf).expect("read");
    (buf, info)
}

/// Random writes/zeros against a byte model, with reopen in the middle.
fn model_round_trip(file: Arc<dyn BlockFile>, drive: Drive, seed: u64, ops: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model: HashMap<ExtentKey, Vec<u8>> = HashMap::new();
    // Blocks holding data per extent: what `extents()` must count as written.
    let mut written: HashMap<ExtentKey, std::collections::BTreeSet<u64>> = HashMap::new();
    let check_written =
        |drive: &Drive, written: &HashMap<ExtentKey, std::collections::BTreeSet<u64>>| {
            for e in drive.extents() {
                let want = written.get(&e.key).map_or(0, |w| w.len() as u64) * BLOCK;
                assert_eq!(e.bytes_written, want, "written bytes of {:?}", e.key);
            }
        };
    let mut drive = drive;
    for op in 0..ops {
        let version = op as u64 + 1;
        let k = key(1, rng.gen_range(0..3));
        let first = rng.gen_range(0..SLAB / BLOCK);
        let n = rng.gen_range(1..=(SLAB / BLOCK - first).min(40)) as usize;
        let m = model.entry(k).or_insert_with(|| vec![0; SLAB as usize]);
        let at = first as usize * B;
        if rng.gen_bool(0.15) {
            drive
                .zero(k, Epoch(1), Version(version), first * BLOCK, (n * B) as u64)
                .expect("zero");
            m[at..at + n * B].fill(0);
            let w = written.entry(k).or_default();
            (first..first + n as u64).for_each(|b| {
                w.remove(&b);
            });
        } else {
            let (data, crcs) = blocks(&mut rng, n);
            drive
                .write(k, Epoch(1), Version(version), first * BLOCK, &data, &crcs)
                .expect("write");
            m[at..at + n * B].copy_from_slice(&data);
            written
                .entry(k)
                .or_default()
                .extend(first..first + n as u64);
        }
        if op == ops / 2 {
            check_written(&drive, &written);
            drop(drive);
            drive = Drive::open(file.clone()).expect("reopen");
            check_written(&drive, &written);
        }
    }
    check_written(&drive, &written);
    drive.checkpoint().expect("checkpoint");
    drop(drive);
    let drive = Drive::open(file).expect("reopen at end");
    check_written(&drive, &written);
    for (k, m) in &model {
        let (buf, info) = read_all(&drive, *k, 0, SLAB as usize);
        assert!(info.bad_blocks.is_empty());
        assert!(buf == *m, "extent {k:?} differs from the model");
    }
}

#[test]
fn round_trip_random_faulty_with_reopen() {
    let (f, d) = faulty(16 << 20);
    model_round_trip(Arc::new(f.reattach()), d, 1, 400);
}

#[test]
fn round_trip_direct_file_tmp_and_shm() {
    let mut dirs = vec![tempfile::tempdir().expect("tempdir")];
    if std::path::Path::new("/dev/shm").is_dir() {
        dirs.push(tempfile::tempdir_in("/dev/shm").expect("shm tempdir"));
    }
    for dir in dirs {
        let path = dir.path().join("drive.img");
        let file: Arc<dyn BlockFile> =
            Arc::new(DirectFile::open(&path, Some(16 << 20)).expect("open direct"));
        let d = Drive::format_with(
            file.clone(),
            ident(SLAB),
            FormatOptions {
                journal_bytes: Some(256 << 10),
                ..Default::default()
            },
        )
        .expect("format");
        model_round_trip(file, d, 2, 200);
        // And through a fresh DirectFile (a new process).
        let file: Arc<dyn BlockFile> = Arc::new(DirectFile::open(&path, None).expect("reopen"));
        let d = Drive::open(file).expect("open");
        assert_eq!(d.identity(), &ident(SLAB));
    }
}

#[test]
fn unallocated_reads_zero_and_versions_zero() {
    let (_f, d) = faulty(8 << 20);
    let (buf, info) = read_all(&d, key(9, 9), 0, 8 * B);
    assert!(buf.iter().all(|&x| x == 0));
    assert_eq!(info.versions, Version(0));
    assert_eq!(
        d.block_versions(key(9, 9), 0, 3).unwrap(),
        vec![Version(0); 3]
    );
}

#[test]
fn older_versions_are_skipped_per_block() {
    let (_f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(3);
    let k = key(1, 0);
    let (new, nc) = blocks(&mut rng, 2);
    d.write(k, Epoch(1), Version(10), B as u64, &new, &nc)
        .unwrap();
    // An older resync write over blocks 0..4 must only land on blocks 0 and 3.
    let (old, oc) = blocks(&mut rng, 4);
    d.write(k, Epoch(1), Version(5), 0, &old, &oc).unwrap();
    let (buf, info) = read_all(&d, k, 0, 4 * B);
    assert!(info.bad_blocks.is_empty());
    assert_eq!(&buf[..B], &old[..B]);
    assert_eq!(&buf[B..3 * B], &new[..]);
    assert_eq!(&buf[3 * B..], &old[3 * B..]);
    assert_eq!(info.versions, Version(10));
    let v = d.block_versions(k, 0, 4).unwrap();
    assert_eq!(v, vec![Version(5), Version(10), Version(10), Version(5)]);
    assert_eq!(d.stats().skipped_blocks, 2);
    // Equal version is applied (idempotent retry).
    let (again, ac) = blocks(&mut rng, 1);
    d.write(k, Epoch(1), Version(10), B as u64, &again, &ac)
        .unwrap();
    assert_eq!(&read_all(&d, k, B as u64, B).0, &again);
}

#[test]
fn epoch_fencing_is_durable() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(4);
    let k = key(1, 0);
    let (x, xc) = blocks(&mut rng, 1);
    d.write(k, Epoch(5), Version(1), 0, &x, &xc).unwrap();
    let err = d.write(k, Epoch(4), Version(2), 0, &x, &xc).unwrap_err();
    assert!(matches!(
        err,
        EngineError::StaleEpoch {
            current: Epoch(5),
            requested: Epoch(4),
            ..
        }
    ));
    assert!(matches!(
        d.read(k, Epoch(4), 0, &mut vec![0; B]),
        Err(EngineError::StaleEpoch { .. })
    ));
    assert!(matches!(
        d.zero(k, Epoch(3), Version(9), 0, BLOCK),
        Err(EngineError::StaleEpoch { .. })
    ));
    // A newer epoch is recorded even if its write is skipped (older version).
    d.write(k, Epoch(7), Version(0), 0, &x, &xc).unwrap();
    assert_eq!(d.extents()[0].epoch, Epoch(7));
    drop(d);
    f.crash(1);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.extents()[0].epoch, Epoch(7));
    assert!(matches!(
        d.write(k, Epoch(6), Version(3), 0, &x, &xc),
        Err(EngineError::StaleEpoch { .. })
    ));
}

#[test]
fn zero_reads_zeros_with_version_and_no_data_write() {
    let (_f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(5);
    let k = key(1, 1);
    let (x, xc) = blocks(&mut rng, 4);
    d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    let before = d.stats().data_write_bytes;
    d.zero(k, Epoch(1), Version(2), BLOCK, 2 * BLOCK).unwrap();
    assert_eq!(d.stats().data_write_bytes, before, "zero is metadata only");
    let (buf, info) = read_all(&d, k, 0, 4 * B);
    assert!(info.bad_blocks.is_empty());
    assert_eq!(&buf[..B], &x[..B]);
    assert!(buf[B..3 * B].iter().all(|&b| b == 0));
    assert_eq!(&buf[3 * B..], &x[3 * B..]);
    assert_eq!(
        d.block_versions(k, 0, 4).unwrap(),
        vec![Version(1), Version(2), Version(2), Version(1)]
    );
    // An older zero is skipped too.
    d.zero(k, Epoch(1), Version(0), 0, BLOCK).unwrap();
    assert_eq!(&read_all(&d, k, 0, B).0, &x[..B]);
}

#[test]
fn free_realloc_and_no_space() {
    let (f, d) = faulty(8 << 20);
    let cap = d.capacity();
    assert!(cap.extents_total >= 2);
    assert_eq!(cap.bytes_total, cap.extents_total * SLAB);
    let mut rng = StdRng::seed_from_u64(6);
    let (x, xc) = blocks(&mut rng, 1);
    for s in 0..cap.extents_total {
        d.write(key(1, s), Epoch(1), Version(1), 0, &x, &xc)
            .unwrap();
    }
    assert_eq!(d.capacity().extents_used, cap.extents_total);
    // A thin drive has more slots, but a plain extent claims its whole size: no room.
    assert_eq!(cap.slots_total, 2 * cap.extents_total);
    assert!(matches!(
        d.write(key(2, 0), Epoch(1), Version(1), 0, &x, &xc),
        Err(EngineError::Full { .. })
    ));
    d.free_extent(key(1, 0)).unwrap();
    d.free_extent(key(1, 0)).unwrap(); // idempotent
    assert_eq!(d.capacity().extents_used, cap.extents_total - 1);
    // The freed slot is reused and reads as fresh (no data from the old extent).
    d.write(key(2, 0), Epoch(1), Version(1), BLOCK, &x, &xc)
        .unwrap();
    let (buf, info) = read_all(&d, key(2, 0), 0, 2 * B);
    assert!(info.bad_blocks.is_empty());
    assert!(buf[..B].iter().all(|&b| b == 0));
    assert_eq!(&buf[B..], &x[..]);
    assert_eq!(read_all(&d, key(1, 0), 0, B).1.versions, Version(0));
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let keys: Vec<_> = d.extents().iter().map(|e| e.key).collect();
    assert!(keys.contains(&key(2, 0)) && !keys.contains(&key(1, 0)));
    assert_eq!(&read_all(&d, key(2, 0), BLOCK, B).0, &x);
    assert!(read_all(&d, key(2, 0), 0, B).0.iter().all(|&b| b == 0));
}

#[test]
fn release_frees_only_what_holds_nothing_newer_and_refuses_older_owners() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(7);
    let (x, xc) = blocks(&mut rng, 2);
    let k = key(3, 0);
    d.write(k, Epoch(2), Version(5), 0, &x, &xc).unwrap();
    d.zero(k, Epoch(2), Version(9), 0, SLAB).unwrap();
    let used = d.capacity().extents_used;
    // An older owner may not release it.
    assert!(matches!(
        d.release_extent(k, Epoch(1), Version(9)),
        Err(EngineError::StaleEpoch { .. })
    ));
    // A release below the newest block keeps it (a later incarnation).
    assert!(!d.release_extent(k, Epoch(2), Version(8)).unwrap());
    assert!(d.has_extent(k));
    assert_eq!(d.capacity().extents_used, used);
    // At or above: freed, durably.
    assert!(d.release_extent(k, Epoch(2), Version(9)).unwrap());
    assert!(!d.has_extent(k));
    assert_eq!(d.capacity().extents_used, used - 1);
    assert!(
        d.release_extent(k, Epoch(2), Version(9)).unwrap(),
        "idempotent"
    );
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert!(!d.has_extent(k));
    assert!(read_all(&d, k, 0, 2 * B).0.iter().all(|&b| b == 0));
}

#[test]
fn probe_format_open_identity() {
    let f = FaultyFile::new(8 << 20);
    assert!(Drive::probe(&f).unwrap().is_none(), "blank drive");
    assert!(matches!(
        Drive::open(Arc::new(f.clone())),
        Err(EngineError::NotFormatted)
    ));
    let d = Drive::format(Arc::new(f.clone()), ident(SLAB)).unwrap();
    assert_eq!(d.identity(), &ident(SLAB));
    assert_eq!(Drive::probe(&f).unwrap(), Some(ident(SLAB)));
    drop(d);
    let d = Drive::open(Arc::new(f.clone())).unwrap();
    assert_eq!(d.identity(), &ident(SLAB));
    drop(d);
    // One damaged superblock copy: the other one is used.
    f.rot(20, 1);
    assert_eq!(Drive::probe(&f).unwrap(), Some(ident(SLAB)));
    // Both damaged: corrupt, not blank.
    f.rot(BLOCK + 20, 1);
    assert!(matches!(Drive::probe(&f), Err(EngineError::Corrupt(_))));
    // Foreign data (no magic) is "not ours".
    let g = FaultyFile::new(8 << 20);
    g.write_at(&[0xab; 8192], 0).unwrap();
    assert!(Drive::probe(&g).unwrap().is_none());
}

#[test]
fn invalid_input_is_rejected() {
    let (_f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(7);
    let (x, mut xc) = blocks(&mut rng, 2);
    xc[1] ^= 1;
    assert!(matches!(
        d.write(key(1, 0), Epoch(1), Version(1), 0, &x, &xc),
        Err(EngineError::ChecksumMismatch { block: 1, .. })
    ));
    assert!(
        d.extents().is_empty(),
        "nothing allocated on a rejected write"
    );
    xc[1] ^= 1;
    for (off, len) in [(1u64, 2 * B), (0, 100), (SLAB - BLOCK, 2 * B)] {
        let r = d.write(
            key(1, 0),
            Epoch(1),
            Version(1),
            off,
            &x[..len.min(x.len())],
            &xc,
        );
        assert!(
            matches!(r, Err(EngineError::InvalidIo { .. })),
            "{off} {len}"
        );
    }
    assert!(matches!(
        d.write(key(1, 0), Epoch(1), Version(1), 0, &x, &xc[..1]),
        Err(EngineError::InvalidIo { .. })
    ));
}

#[test]
fn bit_rot_in_data_is_reported() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(8);
    let k = key(3, 0);
    let (x, xc) = blocks(&mut rng, 4);
    d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    f.rot(d.block_offset(k, 2).unwrap() + 100, 5);
    let (buf, info) = read_all(&d, k, 0, 4 * B);
    assert_eq!(info.bad_blocks, vec![2]);
    assert_eq!(&buf[..2 * B], &x[..2 * B]);
    // Reads of a sub-range report indexes within the read.
    let (_, info) = read_all(&d, k, 2 * BLOCK, B);
    assert_eq!(info.bad_blocks, vec![0]);
    assert!(d.stats().bad_blocks_reported >= 2);
    // A rewrite repairs it.
    d.write(
        k,
        Epoch(1),
        Version(2),
        2 * BLOCK,
        &x[2 * B..3 * B],
        &xc[2..3],
    )
    .unwrap();
    assert!(read_all(&d, k, 0, 4 * B).1.bad_blocks.is_empty());
}

#[test]
fn bit_rot_in_metadata_marks_blocks_bad() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(9);
    let k = key(3, 0);
    let (x, xc) = blocks(&mut rng, 40);
    d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    d.checkpoint().unwrap();
    let meta = d.layout().meta_page_off(0, 0);
    drop(d);
    f.rot(meta + 20 * 3, 0); // entry of block 3, first sector (blocks 0..24)
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let (_, info) = read_all(&d, k, 0, 40 * B);
    assert_eq!(info.bad_blocks, (0..24).collect::<Vec<u32>>());
    let _ = SECTOR;
}

#[test]
fn group_commit_batches_concurrent_writers() {
    // A flush that takes as long as a real SSD's: writers arriving meanwhile must share the
    // next one (an instant in-memory sync would make batching depend on scheduling luck).
    struct SlowSync(FaultyFile);
    impl BlockFile for SlowSync {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            self.0.write_at(buf, offset)
        }
        fn sync(&self) -> std::io::Result<()> {
            std::thread::sleep(std::time::Duration::from_millis(1));
            self.0.sync()
        }
        fn len_bytes(&self) -> u64 {
            self.0.len_bytes()
        }
    }
    let d = Drive::format_with(
        Arc::new(SlowSync(FaultyFile::new(32 << 20))),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(1 << 20),
            ..Default::default()
        },
    )
    .expect("format");
    let d = Arc::new(d);
    let writes = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let d = d.clone();
            let writes = writes.clone();
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + t);
                for i in 0..50u64 {
                    let (x, xc) = blocks(&mut rng, 1);
                    let blk = (t * 50 + i) % (SLAB / BLOCK);
                    d.write(
                        key(1, t % 4),
                        Epoch(1),
                        Version(i + 1),
                        blk * BLOCK,
                        &x,
                        &xc,
                    )
                    .expect("write");
                    writes.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("writer thread");
    }
    let s = d.stats();
    assert_eq!(s.write_ops, 800);
    assert!(
        s.journal_batches < s.write_ops,
        "group commit must batch: {} batches for {} writes",
        s.journal_batches,
        s.write_ops
    );
    // Each write waits for a flush, and a flush takes 1 ms while 16 writers keep arriving:
    // without group commit there would be at least one flush per write.
    assert!(s.flushes < s.write_ops / 2, "{} flushes", s.flushes);
    assert_eq!(s.data_write_bytes, (800 - s.skipped_blocks) * BLOCK);
    assert!(s.write_bytes > s.data_write_bytes);
    let json = serde_json::to_string(&s).expect("stats serialize");
    assert!(json.contains("inflight_time_ns"));
}

#[test]
fn journal_wraps_through_many_checkpoints() {
    let (f, d) = faulty(16 << 20);
    let mut rng = StdRng::seed_from_u64(10);
    let k = key(4, 0);
    let mut model = vec![0u8; SLAB as usize];
    for v in 1..=600u64 {
        let blk = rng.gen_range(0..SLAB / BLOCK) as usize;
        let (x, xc) = blocks(&mut rng, 1);
        d.write(k, Epoch(1), Version(v), (blk * B) as u64, &x, &xc)
            .unwrap();
        model[blk * B..(blk + 1) * B].copy_from_slice(&x);
    }
    assert!(d.stats().checkpoints > 2, "{:?}", d.stats().checkpoints);
    drop(d);
    f.crash(3);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let (buf, info) = read_all(&d, k, 0, SLAB as usize);
    assert!(info.bad_blocks.is_empty());
    assert!(buf == model);
}

/// A file wrapper that can silently drop data-region writes (a write that never reached
/// the media) and hold or fail syncs, to stage exact crash interleavings.
struct Gate {
    inner: FaultyFile,
    data_off: AtomicU64,
    drop_data: std::sync::atomic::AtomicBool,
    hold_sync: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    in_sync: std::sync::atomic::AtomicBool,
    fail_sync: std::sync::atomic::AtomicBool,
}

impl Gate {
    fn new(inner: FaultyFile) -> Gate {
        Gate {
            inner,
            data_off: AtomicU64::new(u64::MAX),
            drop_data: false.into(),
            hold_sync: std::sync::Mutex::new(false),
            cv: std::sync::Condvar::new(),
            in_sync: false.into(),
            fail_sync: false.into(),
        }
    }
}

impl BlockFile for Gate {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if self.drop_data.load(Ordering::SeqCst) && offset >= self.data_off.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        let mut held = self.hold_sync.lock().expect("gate");
        while *held {
            self.in_sync.store(true, Ordering::SeqCst);
            held = self.cv.wait(held).expect("gate");
        }
        if self.fail_sync.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("gate: sync failed"));
        }
        self.inner.sync()
    }
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }
}

#[test]
fn unlanded_write_recovers_old_version_not_bad() {
    let f = FaultyFile::new(8 << 20);
    let gate = Arc::new(Gate::new(f.clone()));
    let d = Drive::format_with(
        gate.clone(),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(256 << 10),
            ..Default::default()
        },
    )
    .expect("format");
    gate.data_off.store(d.layout().data_off, Ordering::SeqCst);
    let mut rng = StdRng::seed_from_u64(11);
    let k = key(1, 0);
    let (old, oc) = blocks(&mut rng, 2);
    d.write(k, Epoch(1), Version(1), 0, &old, &oc).unwrap();
    // The next write's journal record becomes durable but its data never reaches the media
    // (as after power loss with the data write still in the drive's cache).
    gate.drop_data.store(true, Ordering::SeqCst);
    let (new, nc) = blocks(&mut rng, 2);
    d.write(k, Epoch(1), Version(2), 0, &new, &nc).unwrap();
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).expect("open");
    let (buf, info) = read_all(&d, k, 0, 2 * B);
    assert!(
        info.bad_blocks.is_empty(),
        "old data must be recognised, not reported bad"
    );
    assert_eq!(buf, old);
    assert_eq!(d.block_versions(k, 0, 2).unwrap(), vec![Version(1); 2]);
}

#[test]
fn skipped_write_is_not_acked_before_the_newer_claim_is_durable() {
    let f = FaultyFile::new(8 << 20);
    let gate = Arc::new(Gate::new(f));
    let d = Arc::new(
        Drive::format_with(
            gate.clone(),
            ident(SLAB),
            FormatOptions {
                journal_bytes: Some(256 << 10),
                ..Default::default()
            },
        )
        .expect("format"),
    );
    let mut rng = StdRng::seed_from_u64(12);
    let k = key(1, 0);
    let (x, xc) = blocks(&mut rng, 1);
    // A first write of the block: its data goes before its record, so the block is free
    // for the older write to be skipped against while the record waits for its sync. (An
    // overwrite keeps its blocks claimed until its record is durable and its data written:
    // an older write then waits in its claim.)
    *gate.hold_sync.lock().unwrap() = true;
    let (d2, x2, xc2) = (d.clone(), x.clone(), xc.clone());
    let newer = std::thread::spawn(move || d2.write(k, Epoch(1), Version(12), 0, &x2, &xc2));
    while !gate.in_sync.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // v12's record is queued (its sync is held); an older v10 is skipped against it and
    // must wait for v12 to be durable, because a crash now would lose both.
    let (d3, x3, xc3) = (d.clone(), x.clone(), xc.clone());
    let older = std::thread::spawn(move || d3.write(k, Epoch(1), Version(10), 0, &x3, &xc3));
    while d.stats().skipped_blocks == 0 {
        std::thread::yield_now();
    }
    gate.fail_sync.store(true, Ordering::SeqCst);
    *gate.hold_sync.lock().unwrap() = false;
    gate.cv.notify_all();
    assert!(newer.join().unwrap().is_err());
    assert!(
        older.join().unwrap().is_err(),
        "the skipped write was acked without its newer claim"
    );
}

/// Copying between replicas: each block lands only where its current version is the one
/// the copier saw, so a copy never overwrites a newer owner write; per-block versions are
/// kept (even lower ones, which is how a diverged block is made to agree).
#[test]
fn write_blocks_is_per_block_compare_and_set() {
    let (_f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(11);
    let k = key(1, 0);
    let (a, ac) = blocks(&mut rng, 4);
    d.write(k, Epoch(1), Version(20), 0, &a, &ac).unwrap();
    // Block 1 was rewritten by the owner (version 30) after the copier looked.
    let (b1, b1c) = blocks(&mut rng, 1);
    d.write(k, Epoch(1), Version(30), B as u64, &b1, &b1c)
        .unwrap();
    let (src, sc) = blocks(&mut rng, 4);
    let vers = [Version(7), Version(8), Version(25), Version(9)];
    let expect = [Version(20), Version(20), Version(20), Version(0)];
    let n = d
        .write_blocks(k, Epoch(1), 0, &src, &sc, &vers, &expect)
        .unwrap();
    // Block 0: expected 20, is 20 → copied with version 7 (lower is allowed);
    // block 1: now 30 → kept; block 2: copied; block 3: expected 0, is 20 → kept.
    assert_eq!(n, 2);
    let mut buf = vec![0u8; 4 * B];
    let mut v = Vec::new();
    let info = d.read_blocks(k, Epoch(1), 0, &mut buf, &mut v).unwrap();
    assert!(info.bad_blocks.is_empty());
    assert_eq!(v, vec![Version(7), Version(30), Version(25), Version(20)]);
    assert_eq!(&buf[..B], &src[..B]);
    assert_eq!(&buf[B..2 * B], &b1[..]);
    assert_eq!(&buf[2 * B..3 * B], &src[2 * B..3 * B]);
    assert_eq!(&buf[3 * B..], &a[3 * B..]);
    // Mismatched lengths are refused.
    assert!(matches!(
        d.write_blocks(k, Epoch(1), 0, &src, &sc, &vers[..3], &expect),
        Err(EngineError::InvalidIo { .. })
    ));
    // Unallocated extents read zeros with version 0 per block.
    let mut v = Vec::new();
    d.read_blocks(key(9, 9), Epoch(1), 0, &mut buf[..2 * B], &mut v)
        .unwrap();
    assert_eq!(v, vec![Version(0), Version(0)]);
}

/// A new owner fences every copy: older owners are refused afterwards, across a crash; an
/// extent the drive does not hold is not created by a fence.
#[test]
fn fence_raises_the_epoch_durably() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(12);
    let k = key(1, 0);
    let (x, xc) = blocks(&mut rng, 1);
    d.write(k, Epoch(3), Version(1), 0, &x, &xc).unwrap();
    d.fence(k, Epoch(4)).unwrap();
    assert!(matches!(
        d.write(k, Epoch(3), Version(2), 0, &x, &xc),
        Err(EngineError::StaleEpoch { .. })
    ));
    assert!(matches!(
        d.fence(k, Epoch(2)),
        Err(EngineError::StaleEpoch { .. })
    ));
    // An extent the drive does not hold yet is created fenced: a deposed owner's write
    // arriving later must not create it at its older epoch.
    d.fence(key(5, 5), Epoch(9)).unwrap();
    assert_eq!(d.extents().len(), 2);
    assert!(matches!(
        d.write(key(5, 5), Epoch(8), Version(1), 0, &x, &xc),
        Err(EngineError::StaleEpoch { .. })
    ));
    drop(d);
    f.crash(2);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    let epochs: Vec<(ExtentKey, Epoch)> = d.extents().iter().map(|e| (e.key, e.epoch)).collect();
    assert_eq!(epochs, vec![(k, Epoch(4)), (key(5, 5), Epoch(9))]);
}

/// The version digest follows every durable change and survives a reopen; copies with the
/// same versions have the same digest, and one differing block changes it.
#[test]
fn digest_tracks_the_version_map() {
    let (f, d) = faulty(8 << 20);
    let (_f2, d2) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(21);
    let k = key(1, 0);
    let empty = d.fence_and_digest(k, Epoch(1)).unwrap();
    let (x, xc) = blocks(&mut rng, 3);
    for dr in [&d, &d2] {
        dr.write(k, Epoch(1), Version(5), 0, &x, &xc).unwrap();
    }
    let a = d.fence_and_digest(k, Epoch(1)).unwrap();
    assert_ne!(a, empty);
    assert_eq!(a, d2.fence_and_digest(k, Epoch(1)).unwrap());
    d2.write(k, Epoch(1), Version(6), B as u64, &x[..B], &xc[..1])
        .unwrap();
    assert_ne!(a, d2.fence_and_digest(k, Epoch(1)).unwrap());
    // Same digest after a crash and recovery.
    drop(d);
    f.crash(3);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.fence_and_digest(k, Epoch(1)).unwrap(), a);
    // A never-written extent and a missing one look the same.
    assert_eq!(d.fence_and_digest(key(2, 2), Epoch(1)).unwrap(), empty);
}

/// A waker that counts its wakes, to see which waiting tasks a commit wakes.
struct CountingWaker(AtomicU64);

impl std::task::Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Arc<CountingWaker>, std::task::Waker) {
    let c = Arc::new(CountingWaker(AtomicU64::new(0)));
    (c.clone(), std::task::Waker::from(c))
}

fn poll(
    d: &mut crate::Durable,
    w: &std::task::Waker,
    lead: bool,
) -> std::task::Poll<Result<(), EngineError>> {
    d.poll_wait(&mut std::task::Context::from_waker(w), lead)
}

/// Writes begun by many tasks share one journal batch: the first task to lead writes and
/// syncs it once, and every other task waiting for it is woken, durable.
#[test]
fn tasks_share_one_batch_and_the_leader_wakes_the_rest() {
    let (_f, d) = faulty(8 << 20);
    let tier = crate::Tier::new(Arc::new(d));
    let mut rng = StdRng::seed_from_u64(21);
    let k = key(1, 0);
    // The extent's allocation record is a batch of its own; make it durable first.
    let (x, xc) = blocks(&mut rng, 1);
    tier.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    let before = tier.stats();
    let mut waiting = Vec::new();
    for i in 0..8u64 {
        let (data, crcs) = blocks(&mut rng, 1);
        let dur = tier
            .write_begin(k, Epoch(1), Version(2 + i), (1 + i) * BLOCK, &data, &crcs)
            .unwrap();
        assert!(!dur.is_done());
        waiting.push((dur, counting_waker(), data));
    }
    for (dur, (_, w), _) in &mut waiting {
        assert!(
            poll(dur, w, false).is_pending(),
            "nothing is durable before a lead"
        );
    }
    assert_eq!(tier.stats().journal_batches, before.journal_batches);
    assert_eq!(tier.stats().inflight, 8);
    let (first, (_, w0), _) = &mut waiting[0];
    assert!(matches!(
        poll(first, w0, true),
        std::task::Poll::Ready(Ok(()))
    ));
    assert_eq!(
        tier.stats().journal_batches,
        before.journal_batches + 1,
        "one batch for all eight writes"
    );
    for (i, (dur, (count, w), data)) in waiting.iter_mut().enumerate().skip(1) {
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "task {i} was not woken");
        assert!(matches!(
            poll(dur, w, false),
            std::task::Poll::Ready(Ok(()))
        ));
        let (buf, info) = read_all(tier.drive(), k, (1 + i as u64) * BLOCK, B);
        assert!(info.bad_blocks.is_empty());
        assert_eq!(&buf, data);
    }
    let s = tier.stats();
    assert_eq!(s.inflight, 0);
    assert_eq!(s.write_ops, before.write_ops + 8);
}

/// A task waiting for the batch after the one a thread is writing is woken when that
/// thread leaves its batch open (records queued, nobody leading), and leads it.
#[test]
fn a_batch_left_open_wakes_a_waiting_task_to_lead_it() {
    let f = FaultyFile::new(8 << 20);
    let gate = Arc::new(Gate::new(f));
    let d = Drive::format_with(
        gate.clone(),
        ident(SLAB),
        FormatOptions {
            journal_bytes: Some(256 << 10),
            ..Default::default()
        },
    )
    .expect("format");
    let tier = Arc::new(crate::Tier::new(Arc::new(d)));
    let mut rng = StdRng::seed_from_u64(22);
    let k = key(1, 0);
    let (x, xc) = blocks(&mut rng, 1);
    tier.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    *gate.hold_sync.lock().unwrap() = true;
    let (a, ac) = blocks(&mut rng, 1);
    let t2 = tier.clone();
    let leader = std::thread::spawn(move || t2.write(k, Epoch(1), Version(2), BLOCK, &a, &ac));
    while !gate.in_sync.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    let (b, bc) = blocks(&mut rng, 1);
    let mut dur = tier
        .write_begin(k, Epoch(1), Version(3), 2 * BLOCK, &b, &bc)
        .unwrap();
    let (count, w) = counting_waker();
    assert!(poll(&mut dur, &w, true).is_pending(), "a thread is leading");
    *gate.hold_sync.lock().unwrap() = false;
    gate.cv.notify_all();
    leader.join().unwrap().unwrap();
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "the open batch's waiter was not woken"
    );
    assert!(matches!(
        poll(&mut dur, &w, true),
        std::task::Poll::Ready(Ok(()))
    ));
    let (buf, _) = read_all(tier.drive(), k, 2 * BLOCK, B);
    assert_eq!(buf, b);
}

/// A drive that fails wakes every waiting task, and none of them is told it is durable;
/// an abandoned wait still closes the operation's counters.
#[test]
fn a_failed_drive_wakes_waiting_tasks_with_an_error() {
    let (_f, d) = faulty(8 << 20);
    let tier = crate::Tier::new(Arc::new(d));
    let mut rng = StdRng::seed_from_u64(23);
    let k = key(1, 0);
    let (x, xc) = blocks(&mut rng, 1);
    tier.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
    let (a, ac) = blocks(&mut rng, 1);
    let mut dur = tier
        .write_begin(k, Epoch(1), Version(2), BLOCK, &a, &ac)
        .unwrap();
    let abandoned = tier
        .write_begin(k, Epoch(1), Version(3), 2 * BLOCK, &a, &ac)
        .unwrap();
    let (count, w) = counting_waker();
    assert!(poll(&mut dur, &w, false).is_pending());
    tier.drive().fail_now("test");
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert!(matches!(
        poll(&mut dur, &w, true),
        std::task::Poll::Ready(Err(EngineError::Failed { .. }))
    ));
    drop(abandoned);
    assert_eq!(tier.stats().inflight, 0);
}

/// Found by fuzz target engine_open: a superblock one generation short of u64::MAX let
/// the next checkpoint write u64::MAX (refused by the decoder, so the drive could not be
/// opened again) or overflow. A checkpoint now refuses to, and the drive keeps its last
/// readable superblock.
#[test]
fn checkpoint_never_writes_a_generation_the_decoder_refuses() {
    use crate::layout::Superblock;
    let (f, d) = faulty(8 << 20);
    drop(d);
    let mut b = vec![0u8; 2 * BLOCK as usize];
    f.read_at(&mut b, 0).unwrap();
    for copy in 0..2 {
        let at = copy * BLOCK as usize;
        let mut sb = Superblock::decode(&b[at..]).unwrap().unwrap();
        sb.generation = u64::MAX - 3 + copy as u64;
        sb.encode(&mut b[at..]);
    }
    f.write_at(&b, 0).unwrap();
    // Copy 1 (MAX - 2) wins; this open's checkpoint writes MAX - 1 to copy 0.
    drop(Drive::open(Arc::new(f.clone())).expect("open at MAX - 2"));
    match Drive::open(Arc::new(f.clone())) {
        Err(EngineError::Corrupt(m)) => assert!(m.contains("generation exhausted"), "{m}"),
        other => panic!("expected exhaustion, got {:?}", other.map(|_| ())),
    }
    f.read_at(&mut b, 0).unwrap();
    let gens: Vec<u64> = (0..2)
        .map(|c| {
            Superblock::decode(&b[c * BLOCK as usize..])
                .unwrap()
                .unwrap()
                .generation
        })
        .collect();
    assert_eq!(gens, vec![u64::MAX - 1, u64::MAX - 2]);
}

fn free_phys(d: &Drive) -> u64 {
    crate::drive::lock(&d.pool).free()
}

/// Held writes (parity chunks, docs/adr/0008): each keeps the block's previous state as
/// its prior, data and all, across reopen and checkpoints, until settled or reverted.
#[test]
fn held_writes_keep_priors_until_settled_and_revert_to_them() {
    let (f, d) = faulty(8 << 20);
    let mut rng = StdRng::seed_from_u64(11);
    let k = key(4, 0);
    let (u, uc) = blocks(&mut rng, 4);
    let (v, vc) = blocks(&mut rng, 4);
    let (w, wc) = blocks(&mut rng, 2);
    // U everywhere (unheld), then V held over blocks 0..4.
    d.write(k, Epoch(1), Version(10), 0, &u, &uc).unwrap();
    let written = |d: &Drive| d.extents()[0].bytes_written / BLOCK;
    assert_eq!(written(&d), 4);
    let free0 = free_phys(&d);
    d.write_held(k, Epoch(1), Version(20), 0, &v, &vc).unwrap();
    assert_eq!(d.held_blocks(), 4);
    assert_eq!(
        free0 - free_phys(&d),
        4,
        "each prior keeps its physical block"
    );
    let p = d.priors(k, 0, 5).unwrap();
    assert_eq!(p[0], (Version(20), Some(Version(10))));
    assert_eq!(p[4], (Version(0), None));
    // A retry at the same version keeps the prior; a newer held write moves it up.
    d.write_held(k, Epoch(1), Version(20), 0, &v[..B], &vc[..1])
        .unwrap();
    assert_eq!(
        d.priors(k, 0, 1).unwrap()[0],
        (Version(20), Some(Version(10)))
    );
    d.write_held(k, Epoch(1), Version(30), 2 * BLOCK, &w, &wc)
        .unwrap();
    assert_eq!(
        d.priors(k, 2 * BLOCK, 1).unwrap()[0],
        (Version(30), Some(Version(20)))
    );
    assert_eq!(d.held_blocks(), 4);

    // Priors survive a reopen (replayed) and checkpoints (re-logged) ...
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    for _ in 0..3 {
        d.checkpoint().unwrap();
    }
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.held_blocks(), 4);
    let p = d.priors(k, 0, 4).unwrap();
    assert_eq!(
        p,
        vec![
            (Version(20), Some(Version(10))),
            (Version(20), Some(Version(10))),
            (Version(30), Some(Version(20))),
            (Version(30), Some(Version(20))),
        ]
    );

    // ... and a revert puts the prior back, data and version: only blocks at that version.
    assert_eq!(d.revert(k, Epoch(1), Version(30), 0, 4 * BLOCK).unwrap(), 2);
    let (buf, info) = read_all(&d, k, 0, 4 * B);
    assert!(info.bad_blocks.is_empty());
    assert_eq!(&buf[..2 * B], &v[..2 * B]);
    assert_eq!(&buf[2 * B..], &v[2 * B..4 * B], "blocks 2..4 are back at V");
    assert_eq!(d.held_blocks(), 2);
    assert_eq!(d.priors(k, 2 * BLOCK, 1).unwrap()[0], (Version(20), None));
    // An older owner may not revert or settle.
    assert!(matches!(
        d.revert(k, Epoch(0), Version(20), 0, BLOCK),
        Err(EngineError::StaleEpoch { .. })
    ));

    // Settle drops only priors of blocks at or below the version, and frees them; a
    // settle of rows only those of its blocks (and it survives a reopen).
    let before = free_phys(&d);
    d.settle(k, Epoch(1), Version(19), &[]).unwrap();
    assert_eq!(d.held_blocks(), 2);
    let rows = |first, count, upto| SettleRows {
        first,
        count,
        upto: Version(upto),
    };
    d.settle(k, Epoch(1), Version(0), &[rows(1, 3, 19), rows(2, 2, 40)])
        .unwrap();
    assert_eq!(
        d.held_blocks(),
        2,
        "block 1 is at 20, blocks 2 and 3 have none"
    );
    d.settle(k, Epoch(1), Version(0), &[rows(1, 1, 20)])
        .unwrap();
    assert_eq!(d.held_blocks(), 1);
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.held_blocks(), 1);
    assert_eq!(
        d.priors(k, 0, 2).unwrap(),
        vec![(Version(20), Some(Version(10))), (Version(20), None)]
    );
    for bad in [rows(0, 0, 1), rows(0, 1 << 20, 1), rows(u32::MAX, 1, 1)] {
        assert!(matches!(
            d.settle(k, Epoch(1), Version(0), &[bad]),
            Err(EngineError::InvalidArgument(_))
        ));
    }
    d.settle(k, Epoch(1), Version(20), &[]).unwrap();
    assert_eq!(d.held_blocks(), 0);
    assert_eq!(free_phys(&d) - before, 2);
    assert_eq!(d.revert(k, Epoch(1), Version(20), 0, BLOCK).unwrap(), 0);
    assert_eq!(&read_all(&d, k, 0, B).0, &v[..B]);

    // Written bytes count data blocks, not priors: a held write over never-written blocks
    // adds them, and its revert takes them away again (also after a reopen).
    assert_eq!(written(&d), 4);
    d.write_held(k, Epoch(1), Version(35), 8 * BLOCK, &w, &wc)
        .unwrap();
    assert_eq!(written(&d), 6);
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(written(&d), 6);
    assert_eq!(
        d.revert(k, Epoch(1), Version(35), 8 * BLOCK, 2 * BLOCK)
            .unwrap(),
        2
    );
    assert_eq!(written(&d), 4);
    d.zero(k, Epoch(1), Version(36), 0, BLOCK).unwrap();
    assert_eq!(written(&d), 3);
    d.zero(k, Epoch(1), Version(37), 0, BLOCK).unwrap();
    d.write(k, Epoch(1), Version(38), 0, &u[..B], &uc[..1])
        .unwrap();
    assert_eq!(written(&d), 4);

    // An unheld write drops a prior; freeing the extent frees its priors.
    d.write_held(k, Epoch(1), Version(40), 0, &u[..2 * B], &uc[..2])
        .unwrap();
    d.write(k, Epoch(1), Version(41), 0, &w[..B], &wc[..1])
        .unwrap();
    assert_eq!(d.held_blocks(), 1);
    let before = free_phys(&d);
    d.free_extent(k).unwrap();
    assert_eq!(d.held_blocks(), 0);
    assert_eq!(free_phys(&d) - before, 4 + 1, "4 blocks and 1 prior");
    drop(d);
    let d = Drive::open(Arc::new(f.reattach())).unwrap();
    assert_eq!(d.held_blocks(), 0);
}

/// A drive refuses held writes beyond its bound rather than running out of free blocks.
#[test]
fn held_writes_are_bounded() {
    let (_f, d) = faulty(8 << 20);
    let max = d.held_max();
    assert!(max >= 8, "{max}");
    let mut rng = StdRng::seed_from_u64(12);
    let (x, xc) = blocks(&mut rng, 1);
    let mut written = 0u64;
    let mut s = 0;
    let refused = loop {
        let k = key(5, s / (SLAB / BLOCK));
        let off = (s % (SLAB / BLOCK)) * BLOCK;
        d.write(k, Epoch(1), Version(1), off, &x, &xc).unwrap();
        match d.write_held(k, Epoch(1), Version(2), off, &x, &xc) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        s += 1;
    };
    assert!(matches!(refused, EngineError::HeldFull { .. }), "{refused}");
    assert_eq!(written, max);
    // Settling makes room again.
    for slab in 0..=s / (SLAB / BLOCK) {
        d.settle(key(5, slab), Epoch(1), Version(2), &[]).unwrap();
    }
    assert_eq!(d.held_blocks(), 0);
    let k = key(5, 0);
    d.write_held(k, Epoch(1), Version(3), 0, &x, &xc).unwrap();
}

mod packed;
mod snapshot;

/// Bit rot in a block written last, then a power loss. A drive gone quiet has checkpointed
/// its journal (`checkpoint_if_quiet`, called by the node every few seconds), so the rot is
/// reported as a bad block (the owner repairs it from another copy). Otherwise the block's
/// write is still in the journal's last batch, which recovery cannot tell from one the
/// crash cut short: the block goes back to its previous state *marked suspect*, reads say
/// so (the owner checks it against the other copies), the mark survives another reopen,
/// and a write of the block clears it.
#[test]
fn rot_in_the_last_batch_then_power_loss_reads_suspect_or_bad_never_silently_old() {
    let mut rng = StdRng::seed_from_u64(21);
    let (x, xc) = blocks(&mut rng, 2);
    let (y, yc) = blocks(&mut rng, 2);
    let power_loss = |f: &FaultyFile, d: Drive| {
        f.set_crash_mode(crate::CrashMode::PowerLoss { tear_bytes: 512 });
        f.crash(3);
        drop(d);
        Drive::open(Arc::new(f.reattach())).unwrap()
    };
    for quiet in [false, true] {
        let (f, d) = faulty(8 << 20);
        let k = key(5, 0);
        d.write(k, Epoch(1), Version(1), 0, &x, &xc).unwrap();
        d.checkpoint().unwrap();
        d.write(k, Epoch(1), Version(2), 0, &y, &yc).unwrap();
        if quiet {
            assert!(
                !d.checkpoint_if_quiet().unwrap(),
                "batches since the last look"
            );
            assert!(d.checkpoint_if_quiet().unwrap(), "quiet since: checkpoint");
            assert!(!d.checkpoint_if_quiet().unwrap(), "nothing new to fold in");
        }
        // Block 0 rots; block 1 (same batch) does not.
        f.rot(d.block_offset(k, 0).unwrap() + 7, 2);
        let d = power_loss(&f, d);
        let (buf, info) = read_all(&d, k, 0, 2 * B);
        assert_eq!(&buf[B..], &y[B..], "the sound block keeps the acked write");
        if quiet {
            assert_eq!(info.bad_blocks, vec![0], "reported bad");
            assert!(info.suspect.is_empty());
            continue;
        }
        // Taken for a cut write: version 1's bytes, and said to be suspect.
        assert_eq!(d.stats().rolled_back_at_open, 1);
        assert_eq!(d.stats().suspect_blocks_reported, 1);
        assert!(info.bad_blocks.is_empty());
        assert_eq!(info.suspect, vec![0]);
        assert_eq!(&buf[..B], &x[..B]);
        assert_eq!(
            d.block_versions(k, 0, 2).unwrap(),
            vec![Version(1), Version(2)]
        );
        // The mark is in the metadata the open checkpointed: another crash keeps it.
        let d = power_loss(&f, d);
        assert_eq!(read_all(&d, k, 0, 2 * B).1.suspect, vec![0]);
        // The owner's repair rewrites the block: no longer suspect, across a reopen too.
        d.write(k, Epoch(1), Version(2), 0, &y[..B], &yc[..1])
            .unwrap();
        let (buf, info) = read_all(&d, k, 0, 2 * B);
        assert!(info.suspect.is_empty() && info.bad_blocks.is_empty());
        assert_eq!(buf, y);
        d.checkpoint().unwrap();
        let d = power_loss(&f, d);
        let (buf, info) = read_all(&d, k, 0, 2 * B);
        assert!(info.suspect.is_empty() && info.bad_blocks.is_empty());
        assert_eq!(buf, y);
    }
}
