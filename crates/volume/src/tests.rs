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
}

impl MemReplicas {
    fn rot(&self, drive: DriveId, key: ExtentKey, block: u64) {
        let mut m = self.blocks.lock().unwrap();
        let e = m.get_mut(&(drive, key, block)).expect("block exists");
        e.2[7] ^= 0x10;
    }
    fn is_failed(&self, n: NodeId) -> bool {
        self.failed.lock().unwrap().contains(&n)
    }
}

impl ReplicaIo for MemReplicas {
    async fn write(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        _epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
    ) -> Result<(), ReplicaError> {
        if self.is_failed(at.node) {
            return Err(ReplicaError::Unreachable(format!("node {} down", at.node)));
        }
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
            }
        }
        Ok(())
    }

    async fn read(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        _epoch: Epoch,
        offset: u64,
        len: u32,
    ) -> Result<ReadReply, ReplicaError> {
        if self.is_failed(at.node) {
            return Err(ReplicaError::Unreachable(format!("node {} down", at.node)));
        }
        let m = self.blocks.lock().unwrap();
        let mut data = Vec::with_capacity(len as usize);
        let mut bad = Vec::new();
        let mut version = Version(0);
        for i in 0..(len as u64 / BS) {
            match m.get(&(at.drive, key, offset / BS + i)) {
                Some((v, crc, d)) => {
                    if crc32c::crc32c(d) != *crc {
                        bad.push(i as u32);
                    }
                    version = version.max(*v);
                    data.extend_from_slice(d);
                }
                None => data.extend_from_slice(&[0u8; BLOCK_SIZE]),
            }
        }
        Ok(ReadReply {
            data: Bytes::from(data),
            bad_blocks: bad,
            version,
        })
    }

    async fn zero(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        _epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        let zero = vec![0u8; BLOCK_SIZE];
        let crc = crc32c::crc32c(&zero);
        let mut m = self.blocks.lock().unwrap();
        for b in offset / BS..(offset + len) / BS {
            m.insert((at.drive, key, b), (version, crc, zero.clone()));
        }
        Ok(())
    }
}

/// Places copy i of every slab on node i+1, drive (node*10).
struct FixedAlloc {
    calls: AtomicU64,
}

impl SlabAllocator for FixedAlloc {
    async fn allocate(
        &self,
        _volume: VolumeId,
        _slab: SlabIndex,
        copies: usize,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok((1..=copies as u32)
            .map(|n| ExtentLoc {
                node: NodeId(n),
                drive: DriveId(n as u64 * 10),
                state: ExtentState::InSync,
            })
            .collect())
    }
}

fn volume(size: u64, slab: u64) -> (Volume<MemReplicas, FixedAlloc>, Arc<MemReplicas>) {
    let io = Arc::new(MemReplicas::default());
    let cfg = VolumeConfig {
        id: VolumeId(7),
        name: "vm01".into(),
        size_bytes: size,
        slab_size_bytes: slab,
        resiliency: Resiliency::Mirror3,
        epoch: Epoch(3),
        local_node: NodeId(2),
    };
    let alloc = Arc::new(FixedAlloc {
        calls: AtomicU64::new(0),
    });
    (Volume::new(cfg, BTreeMap::new(), io.clone(), alloc), io)
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
        let r = io.read(at, key, Epoch(3), 0, 64 << 10).await.unwrap();
        assert_eq!(&r.data[..], &data[(32 << 10)..(96 << 10)]);
    }
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
    let at = ExtentLoc {
        node: NodeId(2),
        drive: DriveId(20),
        state: ExtentState::InSync,
    };
    let r = io.read(at, key, Epoch(3), 0, 64 << 10).await.unwrap();
    assert!(r.bad_blocks.is_empty());
    assert_eq!(&r.data[8192..8192 + 16384], &data[..]);
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
async fn failed_replica_fails_the_write_and_reads_go_elsewhere() {
    let (v, io) = volume(1 << 20, 64 << 10);
    let data = pattern(4096, 8);
    v.write(0, data.clone()).await.unwrap();
    io.failed.lock().unwrap().push(NodeId(2));
    // Reads fall back to another in-sync copy.
    assert_eq!(v.read(0, 4096).await.unwrap(), data);
    // Writes are not acked unless every copy has them (degraded mode comes with failures).
    assert!(matches!(
        v.write(0, data).await,
        Err(VolumeError::Replica { .. })
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
