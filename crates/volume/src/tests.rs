//! Unit tests of the owner logic against in-memory replicas that can rot blocks and fail.

use super::*;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Mutex;

/// (drive, key, block index in slab) -> (version, crc, data)
type Blocks = HashMap<(DriveId, ExtentKey, u64), (Version, u32, Vec<u8>)>;

#[derive(Default)]
struct MemReplicas {
    blocks: Mutex<Blocks>,
    failed: Mutex<Vec<NodeId>>,
    writes: AtomicU64,
    copied: AtomicU64,
    blocks_copied: AtomicU64,
    digests: AtomicU64,
    /// Extents freed by a release.
    released: AtomicU64,
    /// Highest epoch seen per copy (fencing).
    epochs: Mutex<HashMap<(DriveId, ExtentKey), Epoch>>,
    /// Nodes that take reads and never answer (a paused process, a cut link).
    hung: Mutex<Vec<NodeId>>,
    /// Nodes whose read answers name a bad block past the end of the read (a broken or
    /// hostile peer).
    garbled: Mutex<Vec<NodeId>>,
    /// A node whose client reads (`Read`) wait, once they arrived (the flag), until the
    /// notify lets them run: a read delayed in flight.
    paused_reads: Mutex<Option<PausedReads>>,
    /// The same for `ReadBlocks` (scrub, resync, degraded parity reads).
    paused_read_blocks: Mutex<Option<PausedReads>>,
    /// The same for `Write`: a write delayed in flight.
    paused_writes: Mutex<Option<PausedReads>>,
    /// Held blocks' priors (parity chunks), as the engine keeps them: (version, crc,
    /// data); a block never written has version 0 and zeros.
    priors: Mutex<Blocks>,
    held_writes: AtomicU64,
    settles: AtomicU64,
    reverts: AtomicU64,
    /// Blocks a replica's recovery rolled back (reads list them as suspect until written).
    suspect: Mutex<std::collections::HashSet<(DriveId, ExtentKey, u64)>>,
    /// Nodes whose drives have no room for a new extent (they refuse the first write or
    /// zero of a copy they do not hold), and how many times they refused.
    full: Mutex<Vec<NodeId>>,
    refused_for_room: AtomicU64,
}

/// The node whose reads wait, the flag a read sets on arrival, and what lets it go on.
type PausedReads = (NodeId, Arc<AtomicBool>, Arc<tokio::sync::Notify>);

impl MemReplicas {
    /// What a power loss whose recovery took back the block's last write does: the block
    /// holds `(version, data)` again, marked suspect.
    fn roll_back(&self, drive: DriveId, key: ExtentKey, block: u64, version: Version, data: &[u8]) {
        let crc = crc32c::crc32c(data);
        let mut m = self.blocks.lock().unwrap();
        m.insert((drive, key, block), (version, crc, data.to_vec()));
        self.suspect.lock().unwrap().insert((drive, key, block));
    }
    fn rot(&self, drive: DriveId, key: ExtentKey, block: u64) {
        let mut m = self.blocks.lock().unwrap();
        let e = m.get_mut(&(drive, key, block)).expect("block exists");
        e.2[7] ^= 0x10;
    }
    fn is_failed(&self, n: NodeId) -> bool {
        self.failed.lock().unwrap().contains(&n)
    }
    fn check(&self, at: ExtentLoc, key: ExtentKey, epoch: Epoch) -> Result<(), ReplicaError> {
        if self.is_failed(at.node) {
            return Err(ReplicaError::Unreachable(format!("node {} down", at.node)));
        }
        let mut e = self.epochs.lock().unwrap();
        let cur = e.entry((at.drive, key)).or_insert(epoch);
        if epoch < *cur {
            return Err(ReplicaError::StaleEpoch(format!("{epoch} < {cur}")));
        }
        *cur = epoch;
        Ok(())
    }
    fn version(&self, drive: DriveId, key: ExtentKey, block: u64) -> Version {
        let m = self.blocks.lock().unwrap();
        m.get(&(drive, key, block)).map_or(Version(0), |e| e.0)
    }
    /// Every block of `key` on `drive`: (block, version, data).
    fn copy_of(&self, drive: DriveId, key: ExtentKey) -> Vec<(u64, Version, Vec<u8>)> {
        let m = self.blocks.lock().unwrap();
        let mut v: Vec<_> = m
            .iter()
            .filter(|((d, k, _), _)| *d == drive && *k == key)
            .map(|((_, _, b), (ver, _, data))| (*b, *ver, data.clone()))
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }
}

impl MemReplicas {
    /// A read of whole blocks, after the checks.
    fn read_now(&self, at: ExtentLoc, key: ExtentKey, offset: u64, len: u32) -> ReadReply {
        let m = self.blocks.lock().unwrap();
        let sus = self.suspect.lock().unwrap();
        let mut data = Vec::with_capacity(len as usize);
        let mut bad = Vec::new();
        let mut suspect = Vec::new();
        let mut version = Version(0);
        for i in 0..(len as u64 / BS) {
            match m.get(&(at.drive, key, offset / BS + i)) {
                Some((v, crc, d)) => {
                    if crc32c::crc32c(d) != *crc {
                        bad.push(i as u32);
                    } else if sus.contains(&(at.drive, key, offset / BS + i)) {
                        suspect.push(i as u32);
                    }
                    version = version.max(*v);
                    data.extend_from_slice(d);
                }
                None => data.extend_from_slice(&[0u8; BLOCK_SIZE]),
            }
        }
        ReadReply {
            data: Bytes::from(data),
            bad_blocks: bad,
            suspect,
            version,
        }
    }

    /// Every operation in one place, as a replica serves them.
    async fn serve(&self, at: ExtentLoc, op: ExtentOp) -> Result<ExtentReply, ReplicaError> {
        if matches!(op, ExtentOp::Read { .. } | ExtentOp::ReadBlocks { .. })
            && self.hung.lock().unwrap().contains(&at.node)
        {
            std::future::pending::<()>().await;
        }
        let pause = match op {
            ExtentOp::Read { .. } => self.paused_reads.lock().unwrap().clone(),
            ExtentOp::ReadBlocks { .. } => self.paused_read_blocks.lock().unwrap().clone(),
            ExtentOp::Write { .. } => self.paused_writes.lock().unwrap().clone(),
            _ => None,
        };
        if let Some((node, arrived, go)) = pause {
            if node == at.node {
                let released = go.notified();
                arrived.store(true, Ordering::Release);
                released.await;
            }
        }
        let key = op.key();
        self.check(at, key, op.epoch().expect("the owner never frees unfenced"))?;
        if matches!(
            op,
            ExtentOp::Write { .. }
                | ExtentOp::Zero { .. }
                | ExtentOp::WriteHeld { .. }
                | ExtentOp::WriteBlocks { .. }
        ) && self.full.lock().unwrap().contains(&at.node)
            && !self
                .blocks
                .lock()
                .unwrap()
                .keys()
                .any(|k| k.0 == at.drive && k.1 == key)
        {
            self.refused_for_room.fetch_add(1, Ordering::Relaxed);
            return Err(ReplicaError::NoSpace(format!(
                "drive {} has no room for another extent",
                at.drive
            )));
        }
        Ok(match op {
            ExtentOp::Write {
                version,
                offset,
                crcs,
                data,
                ..
            } => {
                assert_eq!(offset % BS, 0);
                assert_eq!(data.len() % BLOCK_SIZE, 0);
                self.writes.fetch_add(1, Ordering::Relaxed);
                let mut m = self.blocks.lock().unwrap();
                for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
                    if crc32c::crc32c(chunk) != crcs[i] {
                        return Err(ReplicaError::Checksum("end-to-end".into()));
                    }
                    let b = offset / BS + i as u64;
                    let cur = m
                        .get(&(at.drive, key, b))
                        .map(|e| e.0)
                        .unwrap_or(Version(0));
                    if version >= cur {
                        m.insert((at.drive, key, b), (version, crcs[i], chunk.to_vec()));
                        self.priors.lock().unwrap().remove(&(at.drive, key, b));
                        self.suspect.lock().unwrap().remove(&(at.drive, key, b));
                    }
                }
                ExtentReply::Ok
            }
            ExtentOp::WriteHeld {
                version,
                offset,
                crcs,
                data,
                ..
            } => {
                self.held_writes.fetch_add(1, Ordering::Relaxed);
                let mut m = self.blocks.lock().unwrap();
                let mut priors = self.priors.lock().unwrap();
                for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
                    if crc32c::crc32c(chunk) != crcs[i] {
                        return Err(ReplicaError::Checksum("end-to-end".into()));
                    }
                    let k = (at.drive, key, offset / BS + i as u64);
                    let cur = m.get(&k).cloned().unwrap_or_else(|| {
                        (
                            Version(0),
                            crc32c::crc32c(&[0u8; BLOCK_SIZE]),
                            vec![0u8; BLOCK_SIZE],
                        )
                    });
                    // A retry at the version the block has keeps its prior.
                    if cur.0 != version {
                        priors.insert(k, cur);
                    }
                    m.insert(k, (version, crcs[i], chunk.to_vec()));
                }
                ExtentReply::Ok
            }
            ExtentOp::Settle { upto, rows, .. } => {
                self.settles.fetch_add(1, Ordering::Relaxed);
                let m = self.blocks.lock().unwrap();
                // As the engine: below `upto` everywhere, and each range below its own.
                let settled = |b: u64, v: Version| {
                    v <= upto
                        || rows.iter().any(|r| {
                            (u64::from(r.first)..u64::from(r.first) + u64::from(r.count))
                                .contains(&b)
                                && v <= r.upto
                        })
                };
                self.priors.lock().unwrap().retain(|k, _| {
                    k.0 != at.drive || k.1 != key || m.get(k).is_some_and(|b| !settled(k.2, b.0))
                });
                ExtentReply::Ok
            }
            ExtentOp::Revert {
                version,
                offset,
                len,
                ..
            } => {
                let mut m = self.blocks.lock().unwrap();
                let mut priors = self.priors.lock().unwrap();
                let mut n = 0;
                for b in offset / BS..(offset + u64::from(len)) / BS {
                    let k = (at.drive, key, b);
                    if m.get(&k).is_some_and(|c| c.0 == version) {
                        if let Some(p) = priors.remove(&k) {
                            m.insert(k, p);
                            n += 1;
                        }
                    }
                }
                self.reverts.fetch_add(u64::from(n), Ordering::Relaxed);
                ExtentReply::Written(n)
            }
            ExtentOp::Priors { offset, count, .. } => {
                // Blocks before priors, as every operation takes them.
                let m = self.blocks.lock().unwrap();
                let priors = self.priors.lock().unwrap();
                ExtentReply::Priors(
                    (0..u64::from(count))
                        .map(|i| {
                            let k = (at.drive, key, offset / BS + i);
                            (
                                m.get(&k).map_or(Version(0), |b| b.0),
                                priors.get(&k).map(|p| p.0),
                            )
                        })
                        .collect(),
                )
            }
            ExtentOp::SnapshotFloor { .. }
            | ExtentOp::DropSnapshot { .. }
            | ExtentOp::ReadAt { .. }
            | ExtentOp::Changed { .. }
            | ExtentOp::Absent { .. }
            | ExtentOp::VersionsAt { .. }
            | ExtentOp::ReadBlocksAt { .. }
            | ExtentOp::WriteShadow { .. }
            | ExtentOp::KeptBlocks { .. } => {
                panic!("this fake replica keeps no snapshots: {}", op.name())
            }
            ExtentOp::Read { offset, len, .. } => {
                let mut r = self.read_now(at, key, offset, len);
                if self.garbled.lock().unwrap().contains(&at.node) {
                    r.bad_blocks.push(len / BLOCK_SIZE as u32);
                }
                ExtentReply::Read(r)
            }
            ExtentOp::Zero {
                version,
                offset,
                len,
                ..
            } => {
                let zero = vec![0u8; BLOCK_SIZE];
                let crc = crc32c::crc32c(&zero);
                let mut m = self.blocks.lock().unwrap();
                for b in offset / BS..(offset + len) / BS {
                    let cur = m.get(&(at.drive, key, b)).map_or(Version(0), |e| e.0);
                    if version >= cur {
                        m.insert((at.drive, key, b), (version, crc, zero.clone()));
                        self.priors.lock().unwrap().remove(&(at.drive, key, b));
                        self.suspect.lock().unwrap().remove(&(at.drive, key, b));
                    }
                }
                ExtentReply::Ok
            }
            ExtentOp::ReadBlocks { offset, len, .. } => {
                let r = self.read_now(at, key, offset, len);
                let versions = (0..len as u64 / BS)
                    .map(|i| self.version(at.drive, key, offset / BS + i))
                    .collect();
                ExtentReply::Blocks(BlocksReply {
                    data: r.data,
                    bad_blocks: r.bad_blocks,
                    suspect: r.suspect,
                    versions,
                })
            }
            ExtentOp::WriteBlocks {
                offset,
                crcs,
                versions,
                expect,
                data,
                ..
            } => {
                self.copied.fetch_add(1, Ordering::Relaxed);
                let mut m = self.blocks.lock().unwrap();
                let mut n = 0;
                for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
                    let b = offset / BS + i as u64;
                    let cur = m.get(&(at.drive, key, b)).map_or(Version(0), |e| e.0);
                    if cur == expect[i] {
                        m.insert((at.drive, key, b), (versions[i], crcs[i], chunk.to_vec()));
                        self.priors.lock().unwrap().remove(&(at.drive, key, b));
                        self.suspect.lock().unwrap().remove(&(at.drive, key, b));
                        n += 1;
                    }
                }
                self.blocks_copied.fetch_add(n as u64, Ordering::Relaxed);
                ExtentReply::Written(n)
            }
            ExtentOp::Digest { .. } => {
                self.digests.fetch_add(1, Ordering::Relaxed);
                // Any order-independent function of the version map will do here.
                ExtentReply::Digest(
                    self.copy_of(at.drive, key)
                        .iter()
                        .filter(|(_, v, _)| v.0 != 0)
                        .fold(0u64, |d, (b, v, _)| {
                            d.wrapping_add(
                                (b ^ v.0.rotate_left(23)).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                            )
                        }),
                )
            }
            ExtentOp::Versions { offset, count, .. } => ExtentReply::Versions(
                (0..count as u64)
                    .map(|i| self.version(at.drive, key, offset / BS + i))
                    .collect(),
            ),
            ExtentOp::Free { .. } => unreachable!("the owner never frees unfenced"),
            ExtentOp::Release { upto, .. } => {
                let mut m = self.blocks.lock().unwrap();
                let mine = |k: &(DriveId, ExtentKey, u64)| k.0 == at.drive && k.1 == key;
                if m.iter().all(|(k, v)| !mine(k) || v.0 <= upto) {
                    m.retain(|k, _| !mine(k));
                    self.priors.lock().unwrap().retain(|k, _| !mine(k));
                    self.released.fetch_add(1, Ordering::Relaxed);
                }
                ExtentReply::Ok
            }
        })
    }
}

impl ReplicaIo for MemReplicas {
    async fn call(&self, at: ExtentLoc, op: ExtentOp) -> Result<ExtentReply, ReplicaError> {
        self.serve(at, op).await
    }
}

/// The first `len` bytes of one copy, read at epoch 3 as the tests' owner.
async fn read_copy(io: &MemReplicas, at: ExtentLoc, key: ExtentKey, len: u32) -> ReadReply {
    let op = ExtentOp::Read {
        key,
        epoch: Epoch(3),
        offset: 0,
        len,
    };
    io.call(at, op).await.unwrap().into_read().unwrap()
}

/// Writes `data` into one copy directly, at epoch 3 as the tests' owner (a write that
/// reached only that copy).
async fn write_copy(
    io: &MemReplicas,
    at: ExtentLoc,
    key: ExtentKey,
    version: Version,
    offset: u64,
    data: Bytes,
) {
    let op = ExtentOp::Write {
        key,
        epoch: Epoch(3),
        version,
        offset,
        crcs: block_crcs(&data),
        data,
        codec: converge_types::Compression::None,
    };
    assert_eq!(io.call(at, op).await, Ok(ExtentReply::Ok));
}

/// Places copy i of every slab on node i+1, drive (node*10); keeps the slab records.
#[derive(Default)]
struct FixedAlloc {
    calls: AtomicU64,
    records: Mutex<HashMap<SlabIndex, Vec<ExtentLoc>>>,
    /// How many more record changes reach the control plane (None: all of them); the
    /// others fail as if it were unreachable.
    changes_left: Mutex<Option<u64>>,
    /// Record changes are applied but their answer is lost (the caller sees an error).
    lose_answers: std::sync::atomic::AtomicBool,
    /// The nodes allocations place extents on, in order (None: 1, 2, 3, ...).
    nodes_next: Mutex<Option<Vec<u32>>>,
}

impl SlabAllocator for FixedAlloc {
    async fn allocate(
        &self,
        _volume: VolumeId,
        _slab: SlabIndex,
        _epoch: Epoch,
        copies: usize,
        _thin: bool,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let nodes = self.nodes_next.lock().unwrap().clone();
        let v: Vec<ExtentLoc> = nodes
            .unwrap_or_else(|| (1..=copies as u32).collect())
            .into_iter()
            .map(|n| ExtentLoc {
                node: NodeId(n),
                drive: DriveId(n as u64 * 10),
                state: ExtentState::InSync,
            })
            .collect();
        self.records.lock().unwrap().insert(_slab, v.clone());
        Ok(v)
    }

    async fn lookup(
        &self,
        _volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
    ) -> Result<Option<Vec<ExtentLoc>>, VolumeError> {
        Ok(self.records.lock().unwrap().get(&slab).cloned())
    }

    async fn change(
        &self,
        _volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
        change: SlabChange,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        if let Some(left) = self.changes_left.lock().unwrap().as_mut() {
            if *left == 0 {
                return Err(VolumeError::Control(
                    "etcd unreachable".into(),
                    "vm01".into(),
                ));
            }
            *left -= 1;
        }
        let mut r = self.records.lock().unwrap();
        let ex = r.get_mut(&slab).expect("slab recorded");
        change.apply(ex);
        if self.lose_answers.load(Ordering::Relaxed) {
            return Err(VolumeError::Control(
                "etcd did not answer".into(),
                "vm01".into(),
            ));
        }
        Ok(ex.clone())
    }

    async fn release(
        &self,
        _volume: VolumeId,
        slabs: &[SlabIndex],
        _epoch: Epoch,
    ) -> Result<(), VolumeError> {
        let mut r = self.records.lock().unwrap();
        for s in slabs {
            r.remove(s);
        }
        Ok(())
    }
}

type TestVol = Volume<MemReplicas, FixedAlloc>;

/// The states of slab `slab`'s copies, as the control plane records them.
fn recorded_states(alloc: &FixedAlloc, slab: u64) -> Vec<ExtentState> {
    alloc.records.lock().unwrap()[&SlabIndex(slab)]
        .iter()
        .map(|e| e.state)
        .collect()
}

fn config(size: u64, slab: u64, epoch: u64) -> VolumeConfig {
    VolumeConfig {
        id: VolumeId(7),
        name: "vm01".into(),
        size_bytes: size,
        slab_size_bytes: slab,
        resiliency: Resiliency::Mirror3,
        mirror_part_bytes: 0,
        epoch: Epoch(epoch),
        local_node: NodeId(2),
        min_replicas: 2,
        degraded_write_wait: std::time::Duration::from_millis(200),
        read_wait: std::time::Duration::from_millis(200),
        read_hedge: std::time::Duration::from_millis(20),
        tenure: Arc::new(crate::Tenure::unbounded()),
        compression: converge_types::Compression::None,
        cipher: None,
        qos: converge_types::Qos::default(),
        gate: None,
    }
}

fn volume(size: u64, slab: u64) -> (TestVol, Arc<MemReplicas>) {
    let (v, io, _) = volume_with_alloc(size, slab);
    (v, io)
}

fn volume_with_alloc(size: u64, slab: u64) -> (TestVol, Arc<MemReplicas>, Arc<FixedAlloc>) {
    let io = Arc::new(MemReplicas::default());
    let alloc = Arc::new(FixedAlloc::default());
    (
        Volume::new(
            config(size, slab, 3),
            BTreeMap::new(),
            io.clone(),
            alloc.clone(),
        ),
        io,
        alloc,
    )
}

fn pattern(len: usize, seed: u64) -> Bytes {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    Bytes::from((0..len).map(|_| r.gen::<u8>()).collect::<Vec<u8>>())
}

#[test]
fn split_at_slab_boundaries() {
    let v: Vec<Piece> = split(60, 100, 64).collect();
    assert_eq!(
        v,
        vec![
            Piece {
                slab: SlabIndex(0),
                offset: 60,
                len: 4,
                at: 0
            },
            Piece {
                slab: SlabIndex(1),
                offset: 0,
                len: 64,
                at: 4
            },
            Piece {
                slab: SlabIndex(2),
                offset: 0,
                len: 32,
                at: 68
            },
        ]
    );
    assert_eq!(split(0, 0, 64).count(), 0);
}

#[test]
fn split_cuts_what_one_extent_operation_may_not_cover() {
    let max = MAX_IO_BYTES as u64;
    let slab = 1 << 30;
    // A 4 GiB TRIM from 4 KiB into a volume of 1 GiB slabs.
    let v: Vec<Piece> = split(4096, 4 << 30, slab).collect();
    assert!(v.iter().all(|p| p.len <= max && p.offset + p.len <= slab));
    assert_eq!(v.iter().map(|p| p.len).sum::<u64>(), 4 << 30);
    for w in v.windows(2) {
        assert_eq!(w[0].at + w[0].len, w[1].at, "pieces are contiguous");
    }
    assert_eq!(v[0].len, max);
    assert_eq!(
        v.len(),
        129,
        "128 whole pieces and the 4 KiB past the last boundary"
    );
}

#[tokio::test]
async fn thin_volume_reads_zeros() {
    let (v, _) = volume(1 << 20, 64 << 10);
    let d = v.read(4096, 8192).await.unwrap();
    assert_eq!(&d[..], &[0u8; 8192][..]);
    assert!(v.slab_map().is_empty(), "reads must not allocate");
}

#[tokio::test]
async fn writes_cross_slabs_and_reach_every_copy() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let data = pattern(3 * (64 << 10), 1);
    v.write(32 << 10, data.clone()).await.unwrap();
    assert_eq!(v.read(32 << 10, data.len() as u64).await.unwrap(), data);
    let map = v.slab_map();
    assert_eq!(map.len(), 4, "slabs 0..=3 allocated");
    for extents in map.values() {
        let nodes: std::collections::BTreeSet<_> = extents.iter().map(|e| e.node).collect();
        assert_eq!(nodes.len(), 3);
    }
    // Every copy holds the data: read each one directly.
    for n in 1..=3u64 {
        let at = ExtentLoc {
            node: NodeId(n as u32),
            drive: DriveId(n * 10),
            state: ExtentState::InSync,
        };
        let key = ExtentKey {
            volume: VolumeId(7),
            slab: SlabIndex(1),
        };
        let r = read_copy(&io, at, key, 64 << 10).await;
        assert_eq!(&r.data[..], &data[(32 << 10)..(96 << 10)]);
    }
}

#[tokio::test]
async fn allocation_reports_slabs_never_written_as_holes() {
    let (v, _io) = volume(1 << 20, 256 << 10);
    assert_eq!(v.allocation(0, 1 << 20).unwrap(), vec![(1 << 20, false)]);
    v.write((256 << 10) + 4096, pattern(4096, 1)).await.unwrap();
    v.write(3 << 18, pattern(4096, 2)).await.unwrap();
    assert_eq!(
        v.allocation(0, 1 << 20).unwrap(),
        vec![
            (256 << 10, false),
            (256 << 10, true),
            (256 << 10, false),
            (256 << 10, true)
        ]
    );
    // Any sub-range, unaligned too.
    assert_eq!(
        v.allocation(100, 300 << 10).unwrap(),
        vec![
            ((256 << 10) - 100, false),
            ((300 << 10) - (256 << 10) + 100, true)
        ]
    );
    assert!(v.allocation(1 << 20, 1).is_err(), "past the end");
}

#[tokio::test]
async fn unaligned_io_round_trips() {
    let (v, _) = volume(1 << 20, 64 << 10);
    let base = pattern(64 << 10, 2);
    v.write(0, base.clone()).await.unwrap();
    let patch = pattern(1000, 3);
    v.write(4000, patch.clone()).await.unwrap();
    let mut want = base.to_vec();
    want[4000..5000].copy_from_slice(&patch);
    assert_eq!(&v.read(0, 64 << 10).await.unwrap()[..], &want[..]);
    assert_eq!(&v.read(3999, 1002).await.unwrap()[..], &want[3999..5001]);
}

#[tokio::test]
async fn versions_increase_and_carry_the_epoch() {
    let (v, _) = volume(1 << 20, 64 << 10);
    v.write(0, pattern(4096, 4)).await.unwrap();
    let s = v.slab(SlabIndex(0)).unwrap();
    let a = v.next_version(&s);
    let b = v.next_version(&s);
    assert!(b > a);
    assert_eq!(a.0 >> 32, 3);
}

#[tokio::test]
async fn out_of_range_is_refused() {
    let (v, _) = volume(1 << 20, 64 << 10);
    assert!(matches!(
        v.write((1 << 20) - 4096, pattern(8192, 5)).await,
        Err(VolumeError::OutOfRange { .. })
    ));
    assert!(matches!(
        v.read(u64::MAX, 2).await,
        Err(VolumeError::OutOfRange { .. })
    ));
    v.grow(2 << 20).unwrap();
    v.write((1 << 20) - 4096, pattern(8192, 5)).await.unwrap();
    assert!(matches!(v.grow(1 << 20), Err(VolumeError::Shrink { .. })));
}

#[tokio::test]
async fn a_read_longer_than_one_request_is_refused_before_anything_is_read() {
    let (v, io) = volume(1 << 30, 64 << 20);
    v.write(0, pattern(8192, 5)).await.unwrap();
    let before = io.writes.load(Ordering::Relaxed);
    assert!(matches!(
        v.read(0, 512 << 20).await,
        Err(VolumeError::TooLong { len, .. }) if len == 512 << 20
    ));
    assert!(matches!(
        v.write(0, Bytes::from(vec![0u8; MAX_IO_BYTES + 4096]))
            .await,
        Err(VolumeError::TooLong { .. })
    ));
    assert_eq!(io.writes.load(Ordering::Relaxed), before);
    assert_eq!(&v.read(0, 8192).await.unwrap()[..], &pattern(8192, 5)[..]);
}

/// The owner's own copy (node 2, drive 20): the one its reads ask first.
fn local_copy() -> ExtentLoc {
    ExtentLoc {
        node: NodeId(2),
        drive: DriveId(20),
        state: ExtentState::InSync,
    }
}

#[tokio::test]
async fn bad_block_is_served_from_another_copy_and_repaired() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let data = pattern(16384, 6);
    v.write(8192, data.clone()).await.unwrap();
    // The local copy (node 2) is read first: rot one of its blocks.
    let key = ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(0),
    };
    io.rot(DriveId(20), key, 3);
    assert_eq!(v.read(8192, 16384).await.unwrap(), data);
    assert_eq!(v.stats().repaired_blocks, 1);
    // Repaired in place: the local copy now reads clean.
    let at = local_copy();
    let r = read_copy(&io, at, key, 64 << 10).await;
    assert!(r.bad_blocks.is_empty());
    assert_eq!(&r.data[8192..8192 + 16384], &data[..]);
}

/// A power loss whose recovery took a block back to its previous state (the write of the
/// journal's last batch did not check out: cut short, or acked and rotted) marks it suspect.
/// The owner must not serve it from that copy when another holds it unsuspected: the read
/// returns the acked write and rewrites the rolled-back copy, which clears its mark.
#[tokio::test]
async fn a_rolled_back_block_is_taken_from_a_copy_that_holds_it_unsuspected() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let old = pattern(16384, 8);
    let new = pattern(16384, 9);
    v.write(8192, old.clone()).await.unwrap();
    let key = v.key(SlabIndex(0));
    let before = io.version(DriveId(20), key, 3);
    v.write(8192, new.clone()).await.unwrap();
    // The local copy (node 2, read first) loses power and takes block 3 back.
    io.roll_back(DriveId(20), key, 3, before, &old[4096..8192]);
    assert_eq!(
        v.read(8192, 16384).await.unwrap(),
        new,
        "never the older state"
    );
    assert_eq!(v.stats().repaired_blocks, 1);
    let at = local_copy();
    let r = read_copy(&io, at, key, 64 << 10).await;
    assert!(r.suspect.is_empty() && r.bad_blocks.is_empty());
    assert_eq!(&r.data[8192..8192 + 16384], &new[..]);
    assert_copies_identical(&v, &io);
}

/// When every copy took the write back (a power loss of every node before it was acked),
/// no copy holds the block unsuspected: the read serves the newest version the copies
/// hold, never an error, and clears the read copy's mark.
#[tokio::test]
async fn a_block_every_copy_rolled_back_reads_its_newest_sound_version() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let (a, b) = (pattern(4096, 10), pattern(4096, 11));
    v.write(0, a.clone()).await.unwrap();
    let key = v.key(SlabIndex(0));
    let va = io.version(DriveId(10), key, 0);
    v.write(0, b.clone()).await.unwrap();
    let vb = io.version(DriveId(10), key, 0);
    v.write(0, pattern(4096, 12)).await.unwrap();
    // Nodes 2 and 3 went back to `a`, node 1 to `b` (the newest any copy proves).
    io.roll_back(DriveId(10), key, 0, vb, &b);
    io.roll_back(DriveId(20), key, 0, va, &a);
    io.roll_back(DriveId(30), key, 0, va, &a);
    assert_eq!(v.read(0, 4096).await.unwrap(), b);
    let local = local_copy();
    let r = read_copy(&io, local, key, 4096).await;
    assert!(r.suspect.is_empty(), "the read copy was rewritten");
    assert_eq!(r.data, b);
}

/// Scrub takes its reference from an unsuspected copy and rewrites every suspect one, also
/// one that agrees (its mark goes); a suspect copy behind the others is not a divergence.
#[tokio::test]
async fn scrub_rewrites_suspect_copies_from_an_unsuspected_one() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let old = pattern(8192, 13);
    let new = pattern(8192, 14);
    v.write(0, old.clone()).await.unwrap();
    let key = v.key(SlabIndex(0));
    let before = io.version(DriveId(30), key, 0);
    v.write(0, new.clone()).await.unwrap();
    let now = io.version(DriveId(30), key, 1);
    io.roll_back(DriveId(30), key, 0, before, &old[..4096]);
    io.roll_back(DriveId(10), key, 1, now, &new[4096..]);
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let r = v.scrub(true, &t, &p).await.unwrap();
    assert_eq!((r.bad_checksums, r.mismatches, r.repaired), (0, 0, 2));
    assert!(io.suspect.lock().unwrap().is_empty());
    assert_copies_identical(&v, &io);
    assert_eq!(v.read(0, 8192).await.unwrap(), new);
}

#[tokio::test]
async fn all_copies_bad_is_an_error_not_bad_data() {
    let (v, io) = volume(1 << 20, 64 << 10);
    v.write(0, pattern(4096, 7)).await.unwrap();
    let key = ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(0),
    };
    for d in [10, 20, 30] {
        io.rot(DriveId(d), key, 0);
    }
    assert!(matches!(
        v.read(0, 4096).await,
        Err(VolumeError::Unreadable { .. })
    ));
}

#[tokio::test]
async fn zeroes_and_trim() {
    let (v, _) = volume(1 << 20, 64 << 10);
    let data = pattern(64 << 10, 9);
    v.write(0, data.clone()).await.unwrap();
    v.zero(1000, 10000, false).await.unwrap();
    let mut want = data.to_vec();
    want[1000..11000].fill(0);
    assert_eq!(&v.read(0, 64 << 10).await.unwrap()[..], &want[..]);
    // Trim only drops whole blocks.
    v.zero(20000, 10000, true).await.unwrap();
    want[20480..28672].fill(0);
    assert_eq!(&v.read(0, 64 << 10).await.unwrap()[..], &want[..]);
    // Small zero inside one block.
    v.zero(40000, 10, false).await.unwrap();
    want[40000..40010].fill(0);
    assert_eq!(&v.read(0, 64 << 10).await.unwrap()[..], &want[..]);
}

#[tokio::test]
async fn a_zero_covering_whole_slabs_releases_them_and_they_read_zeros() {
    let slab = 64u64 << 10;
    let (v, io, alloc) = volume_with_alloc(1 << 20, slab);
    let data = pattern(3 * slab as usize, 21);
    v.write(0, data.clone()).await.unwrap();
    assert_eq!(alloc.records.lock().unwrap().len(), 3);
    // Slab 1 whole, and the first half of slab 2.
    v.zero(slab, slab + slab / 2, true).await.unwrap();
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(1)));
    assert!(!v.slab_map().contains_key(&SlabIndex(1)));
    assert!(v.slab_map().contains_key(&SlabIndex(2)));
    assert_eq!(
        io.released.load(Ordering::Relaxed),
        3,
        "every copy of slab 1 freed"
    );
    assert_eq!(v.stats().slabs_released, 1);
    let key = v.key(SlabIndex(1));
    for d in [10, 20, 30] {
        assert!(io.copy_of(DriveId(d), key).is_empty());
    }
    let mut want = data.to_vec();
    want[slab as usize..(2 * slab + slab / 2) as usize].fill(0);
    assert_eq!(&v.read(0, 3 * slab).await.unwrap()[..], &want[..]);
    assert_eq!(
        v.allocation(0, 3 * slab).unwrap(),
        vec![(slab, true), (slab, false), (slab, true)]
    );
    // Written again, the slab is allocated afresh.
    v.write(slab + 8192, pattern(4096, 22)).await.unwrap();
    want[(slab + 8192) as usize..(slab + 12288) as usize].copy_from_slice(&pattern(4096, 22));
    assert_eq!(&v.read(0, 3 * slab).await.unwrap()[..], &want[..]);
    assert!(alloc.records.lock().unwrap().contains_key(&SlabIndex(1)));
    // A zero of a slab never written releases nothing and allocates nothing.
    v.zero(5 * slab, slab, false).await.unwrap();
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(5)));
}

#[tokio::test]
async fn zeroes_of_parts_of_a_slab_release_it_once_they_cover_it_and_writes_undo_them() {
    let slab = 64u64 << 10;
    let (v, io, alloc) = volume_with_alloc(1 << 20, slab);
    v.write(0, pattern(2 * slab as usize, 51)).await.unwrap();
    // Slab 1 in three TRIMs, with a write into the first part after it was trimmed.
    v.zero(slab, slab / 2, true).await.unwrap();
    v.write(slab + 4096, pattern(4096, 52)).await.unwrap();
    v.zero(slab + slab / 2, slab / 2, true).await.unwrap();
    assert!(
        alloc.records.lock().unwrap().contains_key(&SlabIndex(1)),
        "the block written after the first TRIM holds data"
    );
    let mut want = vec![0u8; slab as usize];
    want[4096..8192].copy_from_slice(&pattern(4096, 52));
    assert_eq!(&v.read(slab, slab).await.unwrap()[..], &want[..]);
    // The last block with data goes: now all of the slab has been zeroed.
    v.zero(slab + 4096, 4096, true).await.unwrap();
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(1)));
    assert_eq!(io.released.load(Ordering::Relaxed), 3);
    assert_eq!(
        &v.read(slab, slab).await.unwrap()[..],
        &vec![0u8; slab as usize][..]
    );
    // Slab 0 was never trimmed: untouched.
    assert_eq!(
        &v.read(0, slab).await.unwrap()[..],
        &pattern(2 * slab as usize, 51)[..slab as usize]
    );
}

#[tokio::test]
async fn a_late_write_of_a_released_slab_never_shows_in_its_next_incarnation() {
    let slab = 64u64 << 10;
    let (v, io, _) = volume_with_alloc(1 << 20, slab);
    v.write(0, pattern(slab as usize, 31)).await.unwrap();
    v.zero(0, slab, true).await.unwrap();
    assert!(!v.slab_map().contains_key(&SlabIndex(0)));
    // A write of the first incarnation, still in flight when the slab was released,
    // lands on one copy afterwards (a retried write's first attempt): the drive creates
    // the extent again under the same key.
    let key = v.key(SlabIndex(0));
    let late = local_copy();
    write_copy(
        &io,
        late,
        key,
        Version(3 << 32 | 1),
        0,
        pattern(slab as usize, 32),
    )
    .await;
    // The next incarnation writes one block; every other block must read zeros, from
    // every copy.
    v.write(4096, pattern(4096, 33)).await.unwrap();
    let mut want = vec![0u8; slab as usize];
    want[4096..8192].copy_from_slice(&pattern(4096, 33));
    for at in v.slab_map()[&SlabIndex(0)].clone() {
        let r = read_copy(&io, at, key, slab as u32).await;
        assert!(
            r.data[..] == want[..],
            "the copy on drive {} shows what the released incarnation wrote",
            at.drive
        );
    }
    // And a write of the first incarnation arriving later still is refused by its version.
    write_copy(&io, late, key, Version(3 << 32 | 2), 0, pattern(4096, 34)).await;
    assert_eq!(&v.read(0, slab).await.unwrap()[..], &want[..]);
}

#[tokio::test]
async fn a_slab_with_a_stale_copy_is_zeroed_whole_but_kept() {
    let slab = 64u64 << 10;
    let (v, io, alloc) = volume_with_alloc(1 << 20, slab);
    v.write(0, pattern(slab as usize, 41)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    v.write(0, pattern(4096, 42)).await.unwrap();
    assert_eq!(state_of(&v, 0, 3), ExtentState::Stale);
    v.zero(0, slab, false).await.unwrap();
    assert!(alloc.records.lock().unwrap().contains_key(&SlabIndex(0)));
    assert_eq!(io.released.load(Ordering::Relaxed), 0);
    assert_eq!(
        &v.read(0, slab).await.unwrap()[..],
        &vec![0u8; slab as usize][..]
    );
}

#[tokio::test]
async fn concurrent_first_writes_allocate_once() {
    let (v, _) = volume(1 << 20, 64 << 10);
    let v = Arc::new(v);
    let mut hs = Vec::new();
    for i in 0..16u64 {
        let v = v.clone();
        hs.push(tokio::spawn(async move {
            v.write(i * 4096, pattern(4096, i)).await
        }));
    }
    for h in hs {
        h.await.unwrap().unwrap();
    }
    assert_eq!(v.alloc.calls.load(Ordering::Relaxed), 1);
}

fn state_of(v: &TestVol, slab: u64, node: u32) -> ExtentState {
    v.slab_map()[&SlabIndex(slab)]
        .iter()
        .find(|e| e.node == NodeId(node))
        .unwrap()
        .state
}

/// Every copy of every slab holds the same versions and bytes.
fn assert_copies_identical(v: &TestVol, io: &MemReplicas) {
    for (idx, ex) in v.slab_map() {
        let key = v.key(idx);
        let first = io.copy_of(ex[0].drive, key);
        for e in &ex[1..] {
            assert_eq!(
                io.copy_of(e.drive, key),
                first,
                "slab {idx}: drive {} differs from drive {}",
                e.drive,
                ex[0].drive
            );
        }
    }
}

#[tokio::test]
async fn a_failed_copy_is_marked_stale_and_writes_continue_on_min_replicas() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 64 << 10);
    let data = pattern(4096, 8);
    v.write(0, data.clone()).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(2));
    // Two of three copies answer: the write is acked, the third is stale (in the control
    // plane too) and no longer written or read.
    let data2 = pattern(4096, 9);
    v.write(0, data2.clone()).await.unwrap();
    assert_eq!(state_of(&v, 0, 2), ExtentState::Stale);
    assert_eq!(
        alloc.records.lock().unwrap()[&SlabIndex(0)][1].state,
        ExtentState::Stale
    );
    assert_eq!(v.stats().extents_marked_stale, 1);
    assert_eq!(v.read(0, 4096).await.unwrap(), data2);
    let before = io.writes.load(Ordering::Relaxed);
    v.write(0, data2.clone()).await.unwrap();
    assert_eq!(io.writes.load(Ordering::Relaxed) - before, 2);
}

#[tokio::test]
async fn below_min_replicas_nothing_is_acked() {
    let (v, io) = volume(1 << 20, 64 << 10);
    v.write(0, pattern(4096, 1)).await.unwrap();
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(2)]);
    let e = v.write(0, pattern(4096, 2)).await.unwrap_err();
    assert!(
        matches!(
            e,
            VolumeError::Degraded {
                in_sync: 1,
                min_replicas: 2,
                ..
            }
        ),
        "{e}"
    );
    // Later writes wait (bounded) and fail the same way; reads still work from node 3.
    let e = v.write(4096, pattern(4096, 3)).await.unwrap_err();
    assert!(matches!(e, VolumeError::Degraded { .. }), "{e}");
    assert_eq!(v.read(0, 4096).await.unwrap().len(), 4096);
}

/// The degraded-write wait is measured on the runtime's clock: under paused (virtual) time
/// it lasts exactly `degraded_write_wait` instead of spinning until the wall clock catches
/// up, which made simulated runs depend on the machine's speed.
/// Was a bug (simulator, drain variant, seed 1106): a write that failed on a `syncing`
/// copy and on an in-sync one was retried on the in-sync one only; when that retry
/// succeeded the syncing copy's failure was forgotten, and its resync, finishing
/// meanwhile, made it `in-sync` without the write.
#[tokio::test(start_paused = true)]
async fn a_syncing_copy_whose_write_failed_is_marked_stale_even_when_the_retry_succeeds() {
    use ExtentState::*;
    let (v, io) = volume(1 << 20, 256 << 10);
    v.write(0, pattern(4096, 1)).await.unwrap();
    let slab = v.slab(SlabIndex(0)).unwrap();
    v.copy_failed(SlabIndex(0), DriveId(30)).await.unwrap();
    v.change_state(SlabIndex(0), &slab, DriveId(30), &[Stale], Syncing)
        .await
        .unwrap();
    // Node 1 (in sync) and node 3 (syncing) fail; node 1 is back before the retry.
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(3)]);
    let back = {
        let io = io.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            io.failed.lock().unwrap().retain(|n| *n != NodeId(1));
        })
    };
    v.write(4096, pattern(4096, 2)).await.unwrap();
    back.await.unwrap();
    assert_eq!(state_of(&v, 0, 1), InSync, "its retry made it");
    assert_eq!(state_of(&v, 0, 3), Stale, "it missed the write");
}

#[tokio::test(start_paused = true)]
async fn degraded_write_wait_follows_the_runtime_clock() {
    let (v, io) = volume(1 << 20, 64 << 10);
    v.write(0, pattern(4096, 1)).await.unwrap();
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(2)]);
    assert!(v.write(0, pattern(4096, 2)).await.is_err());
    let t0 = tokio::time::Instant::now();
    let e = v.write(4096, pattern(4096, 3)).await.unwrap_err();
    assert!(matches!(e, VolumeError::Degraded { .. }), "{e}");
    let waited = t0.elapsed();
    let wait = config(0, 4096, 0).degraded_write_wait;
    assert!(
        waited >= wait && waited < wait + std::time::Duration::from_millis(100),
        "waited {waited:?} of virtual time for a {wait:?} wait"
    );
}

#[tokio::test]
async fn resync_copies_only_the_blocks_missed() {
    let (v, io) = volume(1 << 20, 256 << 10);
    // 64 blocks written everywhere.
    v.write(0, pattern(256 << 10, 1)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    // While node 3 is away: 3 single-block writes and one 2-block zero.
    for (i, b) in [5u64, 17, 40].iter().enumerate() {
        v.write(b * 4096, pattern(4096, 10 + i as u64))
            .await
            .unwrap();
    }
    v.zero(50 * 4096, 8192, false).await.unwrap();
    assert_eq!(state_of(&v, 0, 3), ExtentState::Stale);
    io.failed.lock().unwrap().clear();
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let stale = v.stale_extents();
    assert_eq!(stale.len(), 1);
    let r = v
        .resync(stale[0].0, stale[0].1.drive, &t, &p)
        .await
        .unwrap();
    assert_eq!(r.blocks_compared, 64);
    assert_eq!(r.blocks_differing, 5);
    assert_eq!(r.blocks_written, 5);
    assert_eq!(io.blocks_copied.load(Ordering::Relaxed), 5);
    assert_eq!(p.bytes_done.load(Ordering::Relaxed), 5 * 4096);
    assert_eq!(state_of(&v, 0, 3), ExtentState::InSync);
    assert_copies_identical(&v, &io);
    // Nothing to do a second time.
    assert!(v.stale_extents().is_empty());
}

/// A resync whose copy fails while the control plane is unreachable cannot mark the copy
/// stale again: it stays `syncing` with no job filling it. Resync must take it up again
/// (it once stayed `syncing` until the next takeover: simulation seed 238, variant
/// short-owner-partitions).
#[tokio::test]
async fn a_copy_left_syncing_by_a_failed_resync_is_resynced_again() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    v.write(0, pattern(256 << 10, 1)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    v.write(4 * 4096, pattern(4096, 2)).await.unwrap();
    assert_eq!(state_of(&v, 0, 3), ExtentState::Stale);
    io.failed.lock().unwrap().clear();
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let (idx, e) = v.stale_extents()[0];
    // stale -> syncing reaches etcd; then every source fails, and so does etcd.
    *alloc.changes_left.lock().unwrap() = Some(1);
    io.failed.lock().unwrap().extend([NodeId(1), NodeId(2)]);
    assert!(v.resync(idx, e.drive, &t, &p).await.is_err());
    assert_eq!(state_of(&v, 0, 3), ExtentState::Syncing);
    assert_eq!(
        v.stale_extents(),
        vec![(
            idx,
            ExtentLoc {
                state: ExtentState::Syncing,
                ..e
            }
        )],
        "the abandoned copy is a resync candidate"
    );
    // While etcd is still away, a retry fails and keeps it a candidate.
    io.failed.lock().unwrap().clear();
    assert!(v.resync(idx, e.drive, &t, &p).await.is_err());
    assert_eq!(v.stale_extents().len(), 1);
    *alloc.changes_left.lock().unwrap() = None;
    let r = v.resync(idx, e.drive, &t, &p).await.unwrap();
    assert_eq!(r.blocks_written, 1);
    assert_eq!(state_of(&v, 0, 3), ExtentState::InSync);
    assert!(v.stale_extents().is_empty());
    assert_copies_identical(&v, &io);
}

/// A stale mark that reached etcd but whose answer was lost: the write fails, etcd has
/// the copy stale, and the owner's map still has it in sync. The owner must re-read the
/// record, or it never resyncs that copy (simulation seed 2478, variant
/// short-owner-partitions: the copy stayed stale in etcd for the rest of the run).
#[tokio::test]
async fn a_change_with_a_lost_answer_is_read_back() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    v.write(0, pattern(256 << 10, 1)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    alloc.lose_answers.store(true, Ordering::Relaxed);
    assert!(v.write(4 * 4096, pattern(4096, 2)).await.is_err());
    alloc.lose_answers.store(false, Ordering::Relaxed);
    io.failed.lock().unwrap().clear();
    assert_eq!(
        alloc.records.lock().unwrap()[&SlabIndex(0)][2].state,
        ExtentState::Stale
    );
    assert_eq!(state_of(&v, 0, 3), ExtentState::InSync, "the map lags");
    assert!(v.stale_extents().is_empty());
    v.reconcile_suspect().await.unwrap();
    assert_eq!(state_of(&v, 0, 3), ExtentState::Stale);
    let (idx, e) = v.stale_extents()[0];
    let t = resync::Throttle::new(1 << 30);
    v.resync(idx, e.drive, &t, &resync::Progress::default())
        .await
        .unwrap();
    assert_eq!(state_of(&v, 0, 3), ExtentState::InSync);
    assert_copies_identical(&v, &io);
}

#[tokio::test]
async fn resync_under_concurrent_writes_converges() {
    let (v, io) = volume(1 << 20, 1 << 20);
    let v = Arc::new(v);
    v.write(0, pattern(1 << 20, 1)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(1));
    for i in 0..64u64 {
        v.write(i * 8192, pattern(4096, 100 + i)).await.unwrap();
    }
    io.failed.lock().unwrap().clear();
    let writer = {
        let v = v.clone();
        tokio::spawn(async move {
            for i in 0..400u64 {
                let b = (i * 37) % 256;
                v.write(b * 4096, pattern(4096, 1000 + i)).await.unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let t = resync::Throttle::new(64 << 20);
    let p = resync::Progress::default();
    let (idx, e) = v.stale_extents()[0];
    v.resync(idx, e.drive, &t, &p).await.unwrap();
    writer.await.unwrap();
    assert_eq!(state_of(&v, 0, 1), ExtentState::InSync);
    assert_copies_identical(&v, &io);
}

#[tokio::test]
async fn rebuild_fills_a_replacement_copy() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    v.write(0, pattern(128 << 10, 1)).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(3));
    v.write(4096, pattern(4096, 2)).await.unwrap();
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let new = ExtentLoc {
        node: NodeId(4),
        drive: DriveId(40),
        state: ExtentState::Syncing,
    };
    let r = v
        .rebuild(SlabIndex(0), DriveId(30), new, &t, &p)
        .await
        .unwrap();
    // Every block: the 32 written, and the rest, which the slab zeroed at its allocation
    // (so that nothing of an earlier incarnation can show through).
    assert_eq!(r.blocks_written, 64);
    let ex = &alloc.records.lock().unwrap()[&SlabIndex(0)];
    assert!(ex.iter().all(|e| e.state == ExtentState::InSync));
    assert!(ex.iter().any(|e| e.drive == DriveId(40)));
    assert!(!ex.iter().any(|e| e.drive == DriveId(30)));
    assert_copies_identical(&v, &io);
}

#[tokio::test]
async fn evacuation_copies_before_it_drops_and_never_drops_below_the_copy_count() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    let v = Arc::new(v);
    v.write(0, pattern(256 << 10, 1)).await.unwrap();
    let new = ExtentLoc {
        node: NodeId(4),
        drive: DriveId(40),
        state: ExtentState::Syncing,
    };
    // Writes go on while node 3's copy moves to node 4.
    let writer = {
        let v = v.clone();
        tokio::spawn(async move {
            for i in 0..200u64 {
                v.write((i * 13 % 64) * 4096, pattern(4096, 500 + i))
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    v.evacuate(SlabIndex(0), DriveId(30), new, &t, &p)
        .await
        .unwrap();
    writer.await.unwrap();
    let ex = alloc.records.lock().unwrap()[&SlabIndex(0)].clone();
    assert_eq!(ex.len(), 3, "{ex:?}");
    assert!(ex.iter().all(|e| e.state == ExtentState::InSync));
    assert!(ex.iter().any(|e| e.drive == DriveId(40)));
    assert!(!ex.iter().any(|e| e.drive == DriveId(30)));
    assert_copies_identical(&v, &io);
    // A copy is not dropped while the others lack the count: with node 2's stale, node 1's
    // is refused and stays.
    io.failed.lock().unwrap().push(NodeId(2));
    v.write(0, pattern(4096, 9)).await.unwrap();
    io.failed.lock().unwrap().clear();
    assert_eq!(state_of(&v, 0, 2), ExtentState::Stale);
    assert!(v.drop_copy(SlabIndex(0), DriveId(10)).await.is_err());
    assert!(alloc.records.lock().unwrap()[&SlabIndex(0)]
        .iter()
        .any(|e| e.drive == DriveId(10)));
    // Nor is an evacuation started from a copy that is not in sync.
    let other = ExtentLoc {
        node: NodeId(5),
        drive: DriveId(50),
        state: ExtentState::Syncing,
    };
    assert!(v
        .evacuate(SlabIndex(0), DriveId(20), other, &t, &p)
        .await
        .is_err());
    assert_eq!(alloc.records.lock().unwrap()[&SlabIndex(0)].len(), 3);
}

/// Was a bug (simulator, drain variant, seeds 685, 709, 1113): a read sent to a copy that
/// an evacuation then dropped and freed ran after the free and returned zeros, which the
/// owner served. An answer from a copy that left the slab is not used.
#[tokio::test]
async fn a_read_answered_by_a_copy_dropped_meanwhile_is_read_again_elsewhere() {
    let (v, io, _alloc) = volume_with_alloc(1 << 20, 256 << 10);
    let v = Arc::new(v);
    let data = pattern(4096, 7);
    v.write(0, data.clone()).await.unwrap();
    // The read goes to node 2 (local) and waits there; the other copies do not answer it.
    let arrived = Arc::new(AtomicBool::new(false));
    let go = Arc::new(tokio::sync::Notify::new());
    *io.paused_reads.lock().unwrap() = Some((NodeId(2), arrived.clone(), go.clone()));
    io.hung.lock().unwrap().extend([NodeId(1), NodeId(3)]);
    let read = {
        let v = v.clone();
        tokio::spawn(async move { v.read(0, 4096).await })
    };
    while !arrived.load(Ordering::Acquire) {
        tokio::task::yield_now().await;
    }
    // Node 2's copy moves to node 4 and its extent is freed while the read waits there.
    let new = ExtentLoc {
        node: NodeId(4),
        drive: DriveId(40),
        state: ExtentState::Syncing,
    };
    let t = resync::Throttle::new(1 << 30);
    v.evacuate(
        SlabIndex(0),
        DriveId(20),
        new,
        &t,
        &resync::Progress::default(),
    )
    .await
    .unwrap();
    io.blocks
        .lock()
        .unwrap()
        .retain(|(d, _, _), _| *d != DriveId(20));
    io.hung.lock().unwrap().clear();
    *io.paused_reads.lock().unwrap() = None;
    go.notify_one();
    assert_eq!(read.await.unwrap().unwrap(), data);
}

/// Was a bug (simulator, ADR 0014, seed 71): a write counted a copy toward its ack by the
/// state the copy had when the write started. Another write failing on that copy meanwhile
/// had marked it stale, leaving one copy in sync, and this write was acked with that one:
/// below min_replicas, on a copy set the record's "holds every acked write" mark did not
/// describe. A write is acked only on copies in sync when it settles.
#[tokio::test]
async fn a_copy_marked_stale_while_a_write_is_in_flight_does_not_count_toward_its_ack() {
    let (v, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    let v = Arc::new(v);
    v.write(0, pattern(4096, 1)).await.unwrap();
    // The next write reaches nodes 2 and 3 at once and waits on its way to node 1.
    let arrived = Arc::new(AtomicBool::new(false));
    let go = Arc::new(tokio::sync::Notify::new());
    *io.paused_writes.lock().unwrap() = Some((NodeId(1), arrived.clone(), go.clone()));
    let write = {
        let v = v.clone();
        tokio::spawn(async move { v.write(0, pattern(4096, 2)).await })
    };
    while !arrived.load(Ordering::Acquire) {
        tokio::task::yield_now().await;
    }
    // Meanwhile other writes failed on nodes 2 and 3: both are marked stale, node 1's copy
    // alone stays in sync.
    let slab = v.slab(SlabIndex(0)).unwrap();
    v.mark_stale(SlabIndex(0), &slab, DriveId(20))
        .await
        .unwrap();
    v.mark_stale(SlabIndex(0), &slab, DriveId(30))
        .await
        .unwrap();
    *io.paused_writes.lock().unwrap() = None;
    go.notify_one();
    // Three copies took the write, one of them in sync: not acked.
    match write.await.unwrap() {
        Err(VolumeError::Degraded {
            in_sync: 1,
            min_replicas: 2,
            ..
        }) => {}
        other => panic!("acked on fewer than min_replicas in-sync copies: {other:?}"),
    }
    assert_eq!(
        recorded_states(&alloc, 0),
        vec![ExtentState::InSync, ExtentState::Stale, ExtentState::Stale]
    );
}

#[tokio::test]
async fn takeover_fences_the_old_owner_and_makes_copies_agree() {
    let (old, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    old.write(0, pattern(64 << 10, 1)).await.unwrap();
    // The old owner crashed mid-write: block 3 reached only node 1's copy.
    let key = old.key(SlabIndex(0));
    let stray = pattern(4096, 99);
    let at = old.slab_map()[&SlabIndex(0)][0];
    write_copy(
        &io,
        at,
        key,
        Version(3 << 32 | 1000),
        3 * 4096,
        stray.clone(),
    )
    .await;
    // A new owner at epoch 4 reconciles before serving.
    let slabs = alloc.records.lock().unwrap().clone().into_iter().collect();
    let new = Volume::new(
        config(1 << 20, 256 << 10, 4),
        slabs,
        io.clone(),
        alloc.clone(),
    );
    let r = new.reconcile().await.unwrap();
    assert_eq!(r.blocks_differing, 2, "two copies lacked the stray write");
    assert_copies_identical(&new, &io);
    assert_eq!(new.read(3 * 4096, 4096).await.unwrap(), stray);
    // The deposed owner can neither write nor read any more.
    let e = old.write(0, pattern(4096, 5)).await.unwrap_err();
    assert!(matches!(e, VolumeError::Fenced { .. }), "{e}");
    let e = old.read(0, 4096).await.unwrap_err();
    assert!(matches!(e, VolumeError::Fenced { .. }), "{e}");
    // The new owner writes on.
    new.write(0, pattern(4096, 6)).await.unwrap();
    assert_copies_identical(&new, &io);
}

#[tokio::test]
async fn scrub_finds_rot_and_disagreement_and_repairs_them() {
    let (v, io) = volume(1 << 20, 256 << 10);
    v.write(0, pattern(64 << 10, 1)).await.unwrap();
    let key = v.key(SlabIndex(0));
    io.rot(DriveId(30), key, 2);
    // A copy that silently holds other bytes under the same version.
    {
        let mut m = io.blocks.lock().unwrap();
        let e = m.get_mut(&(DriveId(10), key, 7)).unwrap();
        e.2[0] ^= 1;
        e.1 = crc32c::crc32c(&e.2);
    }
    let t = resync::Throttle::new(1 << 30);
    let p = resync::Progress::default();
    let r = v.scrub(true, &t, &p).await.unwrap();
    assert_eq!(r.blocks_checked, 64);
    assert_eq!(r.bad_checksums, 1);
    assert_eq!(r.mismatches, 1);
    assert_eq!(r.repaired, 2);
    let r = v.scrub(true, &t, &p).await.unwrap();
    assert_eq!((r.bad_checksums, r.mismatches, r.repaired), (0, 0, 0));
    assert_copies_identical(&v, &io);
}

#[tokio::test]
async fn takeover_compares_only_slabs_whose_copies_differ() {
    let (old, io, alloc) = volume_with_alloc(1 << 20, 256 << 10);
    old.write(0, pattern(1 << 20, 1)).await.unwrap();
    let slabs = alloc.records.lock().unwrap().clone().into_iter().collect();
    let new = Volume::new(
        config(1 << 20, 256 << 10, 4),
        slabs,
        io.clone(),
        alloc.clone(),
    );
    let r = new.reconcile().await.unwrap();
    assert_eq!(
        r,
        resync::CopyReport::default(),
        "4 slabs, all copies agree"
    );
    assert_eq!(io.digests.load(Ordering::Relaxed), 12);
}

#[tokio::test]
async fn a_write_failing_everywhere_stales_nothing_and_is_reconciled() {
    let (v, io) = volume(1 << 20, 256 << 10);
    v.write(0, pattern(8192, 1)).await.unwrap();
    io.failed
        .lock()
        .unwrap()
        .extend([NodeId(1), NodeId(2), NodeId(3)]);
    let e = v.write(0, pattern(4096, 2)).await.unwrap_err();
    assert!(matches!(e, VolumeError::Degraded { in_sync: 0, .. }), "{e}");
    // Every copy stays in sync: nothing says which one is good.
    assert!(v.slab_map()[&SlabIndex(0)]
        .iter()
        .all(|e| e.state == ExtentState::InSync));
    // Meanwhile the write landed on one copy only (as a timed-out write may).
    let key = v.key(SlabIndex(0));
    let late = pattern(4096, 3);
    io.failed.lock().unwrap().clear();
    let at = v.slab_map()[&SlabIndex(0)][2];
    write_copy(&io, at, key, Version(3 << 32 | 99), 0, late.clone()).await;
    assert_eq!(v.reconcile_suspect().await.unwrap(), 2);
    assert_copies_identical(&v, &io);
    assert_eq!(v.read(0, 4096).await.unwrap(), late);
    assert_eq!(v.reconcile_suspect().await.unwrap(), 0);
}

/// A copy that never answers (a paused node) costs a read `read_hedge`, not an error or a
/// replica timeout: the next copy is asked meanwhile.
#[tokio::test(start_paused = true)]
async fn a_read_is_hedged_past_a_copy_that_does_not_answer() {
    let (v, io) = volume(1 << 20, 1 << 20);
    let data = pattern(8192, 1);
    v.write(0, data.clone()).await.unwrap();
    // Node 2 is this owner's node: its copy is asked first.
    io.hung.lock().unwrap().push(NodeId(2));
    let t0 = Instant::now();
    let got = tokio::time::timeout(std::time::Duration::from_secs(5), v.read(0, 8192))
        .await
        .expect("the read must not wait for the hung copy")
        .unwrap();
    assert_eq!(got, data);
    assert!(t0.elapsed() < std::time::Duration::from_secs(1));
    // Every copy but one hung: still answered.
    io.hung.lock().unwrap().push(NodeId(1));
    let got = tokio::time::timeout(std::time::Duration::from_secs(5), v.read(0, 8192))
        .await
        .expect("one copy answers")
        .unwrap();
    assert_eq!(got, data);
}

/// An answer that does not fit its question (here: a bad block past the end of the read,
/// which a repair would index) fails that copy like an I/O error; the owner reads another.
#[tokio::test(start_paused = true)]
async fn an_answer_that_does_not_fit_its_question_fails_that_copy() {
    let (v, io) = volume(1 << 20, 1 << 20);
    let data = pattern(8192, 1);
    v.write(0, data.clone()).await.unwrap();
    // Node 2 is this owner's node: its copy is asked first.
    io.garbled.lock().unwrap().push(NodeId(2));
    assert_eq!(v.read(0, 8192).await.unwrap(), data);
    // No copy answers sensibly: the read fails, it does not panic or return bad data.
    io.garbled.lock().unwrap().extend([NodeId(1), NodeId(3)]);
    let e = v.read(0, 8192).await.unwrap_err();
    assert!(
        matches!(&e, VolumeError::Unreadable { why, .. } if why.contains("where 8192 bytes of read data was asked")),
        "{e}"
    );
}

/// Reads wait out a fault the way writes do: with every copy unreachable for a while, a
/// read keeps trying (fresh slab state each round) and answers once one comes back.
#[tokio::test(start_paused = true)]
async fn a_read_rides_through_every_copy_being_away_for_a_while() {
    let (v, io) = volume(1 << 20, 1 << 20);
    let data = pattern(4096, 2);
    v.write(4096, data.clone()).await.unwrap();
    let copies: Vec<NodeId> = v.slab_map()[&SlabIndex(0)].iter().map(|e| e.node).collect();
    *io.failed.lock().unwrap() = copies.clone();
    let io2 = io.clone();
    let back = copies[2];
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        io2.failed.lock().unwrap().retain(|n| *n != back);
    });
    assert_eq!(v.read(4096, 4096).await.unwrap(), data);
}

/// ... and fails, naming every copy's error, only when none answered within `read_wait`.
#[tokio::test(start_paused = true)]
async fn a_read_fails_once_no_copy_answered_within_read_wait() {
    let (v, io) = volume(1 << 20, 1 << 20);
    v.write(0, pattern(4096, 3)).await.unwrap();
    *io.failed.lock().unwrap() = vec![NodeId(1), NodeId(2), NodeId(3), NodeId(4)];
    let t0 = Instant::now();
    let e = v.read(0, 4096).await.unwrap_err();
    assert!(t0.elapsed() >= v.config().read_wait, "gave up early");
    match e {
        VolumeError::Unreadable { why, .. } => {
            assert!(why.contains("down") && why.contains("kept trying"), "{why}")
        }
        other => panic!("{other}"),
    }
}

/// A read that waits for copies while its owner's term ends (retired, as after a lost
/// lease) fails with `Fenced`, which makes the client or the forwarding node re-route to
/// the new owner, never with an I/O error (thrash seed 2001: a parity owner cut off from
/// its chunks answered a redirected read with EIO).
#[tokio::test(start_paused = true)]
async fn a_read_waiting_for_copies_when_the_term_ends_is_re_routed_not_failed() {
    let (v, io) = volume(1 << 20, 1 << 20);
    v.write(0, pattern(4096, 5)).await.unwrap();
    // Every copy but node 1's is down; node 1's read is held in flight.
    *io.failed.lock().unwrap() = vec![NodeId(2), NodeId(3)];
    let (arrived, go) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(tokio::sync::Notify::new()),
    );
    *io.paused_reads.lock().unwrap() = Some((NodeId(1), arrived.clone(), go.clone()));
    let v = Arc::new(v);
    let (v2, io2) = (v.clone(), io.clone());
    tokio::spawn(async move {
        while !arrived.load(Ordering::Acquire) {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        // The term ends while the round waits; then its last copy fails too.
        v2.retire();
        io2.failed.lock().unwrap().push(NodeId(1));
        go.notify_one();
    });
    match v.read(0, 4096).await {
        Err(VolumeError::Fenced { .. }) => {}
        other => panic!("expected Fenced, got {other:?}"),
    }
}

/// An owner answers nothing once its tenure (lease) may have ended or it was retired:
/// a partitioned owner must not serve reads from its own copy after a new owner could
/// have taken over.
#[tokio::test(start_paused = true)]
async fn an_owner_past_its_tenure_or_retired_answers_nothing() {
    let io = Arc::new(MemReplicas::default());
    let alloc = Arc::new(FixedAlloc::default());
    let mut cfg = config(1 << 20, 1 << 20, 3);
    let tenure = Arc::new(crate::Tenure::new());
    tenure.extend(Instant::now() + std::time::Duration::from_secs(2));
    cfg.tenure = tenure.clone();
    let v: TestVol = Volume::new(cfg, BTreeMap::new(), io, alloc);
    let data = pattern(4096, 4);
    v.write(0, data.clone()).await.unwrap();
    assert_eq!(v.read(0, 4096).await.unwrap(), data);
    tokio::time::advance(std::time::Duration::from_secs(3)).await;
    assert!(matches!(
        v.read(0, 4096).await,
        Err(VolumeError::Fenced { .. })
    ));
    assert!(matches!(
        v.write(0, data.clone()).await,
        Err(VolumeError::Fenced { .. })
    ));
    assert!(matches!(
        v.zero(0, 4096, false).await,
        Err(VolumeError::Fenced { .. })
    ));
    // A confirmed keepalive extends it again...
    tenure.extend(Instant::now() + std::time::Duration::from_secs(2));
    assert_eq!(v.read(0, 4096).await.unwrap(), data);
    // ... but a retired volume stays retired.
    v.retire();
    assert!(matches!(
        v.read(0, 4096).await,
        Err(VolumeError::Fenced { .. })
    ));
}

mod mirror_part;
mod parity;

/// Simulator, seed 16 of `compress` (issue 42's sweeps): the repair policy marks the
/// copies of a node without a lease stale through `copy_failed`, and marked a slab's last
/// in-sync copy stale after a lost answer had marked the other one; with no copy in sync
/// no resync had a source, for ever. The last in-sync copy stays in sync, whoever asks.
#[tokio::test]
async fn the_repair_policy_never_marks_a_mirror_s_last_in_sync_copy_stale() {
    let (v, _io) = volume(1 << 20, 64 << 10);
    v.write(0, pattern(4096, 1)).await.unwrap();
    let drives: Vec<(NodeId, DriveId)> = v.slab_map()[&SlabIndex(0)]
        .iter()
        .map(|e| (e.node, e.drive))
        .collect();
    v.copy_failed(SlabIndex(0), drives[0].1).await.unwrap();
    v.copy_failed(SlabIndex(0), drives[1].1).await.unwrap();
    let e = v.copy_failed(SlabIndex(0), drives[2].1).await.unwrap_err();
    assert!(e.to_string().contains("last in-sync copy"), "{e}");
    assert_eq!(state_of(&v, 0, drives[2].0 .0), ExtentState::InSync);
    assert_eq!(state_of(&v, 0, drives[0].0 .0), ExtentState::Stale);
}

/// A full pool (issue 42): a write that finds no room on its copies' drives fails at once
/// with "no space" (the client's ENOSPC), not an I/O error after `degraded_write_wait` of
/// retries; the new slab is given back, so a later write places it afresh once there is
/// room; and what was acked before reads back. (The clock is paused: waits pass at once,
/// so a retry loop shows as refusals counted, not as time.)
#[tokio::test(start_paused = true)]
async fn a_write_finding_no_room_fails_at_once_with_no_space_and_loses_nothing() {
    let slab = 64 * 1024;
    let (mut vol, io, alloc) = volume_with_alloc(4 * slab, slab);
    vol.cfg.degraded_write_wait = std::time::Duration::from_secs(600);
    let first = pattern(slab as usize, 1);
    vol.write(0, first.clone()).await.unwrap();

    // No drive has room: the new slab's first zero is refused once by each copy.
    *io.full.lock().unwrap() = vec![NodeId(1), NodeId(2), NodeId(3)];
    let e = vol.write(slab, pattern(4096, 2)).await.unwrap_err();
    assert!(e.is_no_space(), "{e}");
    assert!(e.to_string().contains("no room"), "{e}");
    assert_eq!(
        io.refused_for_room.load(Ordering::Relaxed),
        3,
        "asked once each"
    );
    assert!(
        !alloc.records.lock().unwrap().contains_key(&SlabIndex(1)),
        "the new slab was given back"
    );

    // Two of three copies without room: below min_replicas 2, so no space either; the
    // copy that took the zero is freed with the slab.
    *io.full.lock().unwrap() = vec![NodeId(2), NodeId(3)];
    let e = vol.write(slab, pattern(4096, 3)).await.unwrap_err();
    assert!(e.is_no_space(), "{e}");
    assert!(!alloc.records.lock().unwrap().contains_key(&SlabIndex(1)));
    let key = ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(1),
    };
    assert!(
        io.copy_of(DriveId(10), key).is_empty(),
        "node 1's copy freed"
    );
    assert_eq!(vol.stats().no_space_errors, 2);

    // Room again: the slab is placed afresh and the write acked; nothing acked was lost.
    io.full.lock().unwrap().clear();
    let calls = alloc.calls.load(Ordering::Relaxed);
    let second = pattern(4096, 4);
    vol.write(slab, second.clone()).await.unwrap();
    assert_eq!(alloc.calls.load(Ordering::Relaxed), calls + 1);
    assert_eq!(vol.read(0, slab).await.unwrap(), first);
    assert_eq!(vol.read(slab, 4096).await.unwrap(), second);
}

/// A copy whose drive had no room for the slab's first write is stale without an extent;
/// its resync finds no room either and says so (`is_no_space`): the repair policy then
/// rebuilds it on another drive instead of resyncing it for ever (`Cause::NoRoom`).
#[tokio::test(start_paused = true)]
async fn a_stale_copy_whose_drive_has_no_room_fails_its_resync_with_no_space() {
    let slab = 64 * 1024;
    let (vol, io, alloc) = volume_with_alloc(4 * slab, slab);
    *io.full.lock().unwrap() = vec![NodeId(3)];
    let data = pattern(4096, 1);
    vol.write(0, data.clone()).await.unwrap();
    assert_eq!(
        recorded_states(&alloc, 0),
        vec![ExtentState::InSync, ExtentState::InSync, ExtentState::Stale]
    );
    let t = resync::Throttle::new(1 << 30);
    let e = vol
        .resync(SlabIndex(0), DriveId(30), &t, &resync::Progress::default())
        .await
        .unwrap_err();
    assert!(e.is_no_space(), "{e}");
    // With room, the same resync brings it back.
    io.full.lock().unwrap().clear();
    vol.resync(SlabIndex(0), DriveId(30), &t, &resync::Progress::default())
        .await
        .unwrap();
    assert_eq!(
        io.copy_of(
            DriveId(30),
            ExtentKey {
                volume: VolumeId(7),
                slab: SlabIndex(0)
            }
        )
        .len(),
        io.copy_of(
            DriveId(10),
            ExtentKey {
                volume: VolumeId(7),
                slab: SlabIndex(0)
            }
        )
        .len()
    );
}
