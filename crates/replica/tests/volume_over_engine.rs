//! A `Volume` over real engine drives (`Tier`s on drive files), driven by random requests
//! of every shape a client may send: unaligned, longer than one extent operation may be
//! (32 MiB), crossing slabs, TRIMs and WRITE_ZEROES of whole slabs and more. After every
//! request the volume must read back exactly what a plain byte array would hold, and the
//! engine must never have refused an operation the owner sent as malformed. Run for a
//! mirror and for parity-2+1 (whose chunks hold the rows' blocks and their parity).

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use converge_engine::{DirectFile, Drive, DriveIdentity, EngineError, FormatOptions, Tier};
use converge_types::{
    ClusterId, Compression, DriveId, DriveRole, Epoch, ExtentOp, ExtentReply, ExtentState,
    MediaType, NodeId, Resiliency, SlabIndex, VolumeId, BLOCK_SIZE, MAX_IO_BYTES,
};
use converge_volume::crypt::{VolumeCipher, KEY_BYTES};
use converge_volume::{
    ExtentLoc, ReplicaError, ReplicaIo, SlabAllocator, SlabChange, Tenure, Volume, VolumeConfig,
    VolumeError,
};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BS: u64 = BLOCK_SIZE as u64;
/// Larger than one extent operation, so whole-slab requests must be cut.
const SLAB: u64 = 40 << 20;
const SLABS: u64 = 3;

/// Each copy on its own drive (node n, drive n), served the way the daemon serves a RAM
/// drive: the engine call, then the wait for its journal batch.
struct Drives {
    tiers: HashMap<DriveId, Tier>,
    /// Operations the engine refused as malformed: the owner must never send one.
    refused: Mutex<Vec<String>>,
    /// A drive whose answers to snapshot floors are lost (the floor is set all the same).
    lose_floor_answers: Mutex<Option<DriveId>>,
}

impl ReplicaIo for Drives {
    async fn call(&self, at: ExtentLoc, op: ExtentOp) -> Result<ExtentReply, ReplicaError> {
        let what = op.name();
        let floor = matches!(op, ExtentOp::SnapshotFloor { .. });
        let tier = &self.tiers[&at.drive];
        let r = match converge_replica::start(tier, op) {
            Ok((reply, durable)) => converge_replica::durable(durable).await.map(|()| reply),
            Err(e) => Err(e),
        };
        if floor && *self.lose_floor_answers.lock().unwrap() == Some(at.drive) {
            return Err(ReplicaError::Unreachable("the answer was lost".into()));
        }
        r.map_err(|e| {
            if matches!(
                e,
                EngineError::InvalidIo { .. } | EngineError::InvalidArgument(_)
            ) {
                self.refused.lock().unwrap().push(format!("{what}: {e}"));
            }
            converge_replica::replica_error(e)
        })
    }
}

/// Copy i of every slab on drive i+1; the records kept as the control plane would.
#[derive(Default)]
struct Records(Mutex<BTreeMap<SlabIndex, Vec<ExtentLoc>>>);

impl SlabAllocator for Records {
    async fn allocate(
        &self,
        _volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
        copies: usize,
        _thin: bool,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let v: Vec<ExtentLoc> = (1..=copies as u32)
            .map(|n| ExtentLoc {
                node: NodeId(n),
                drive: DriveId(u64::from(n)),
                state: ExtentState::InSync,
            })
            .collect();
        self.0.lock().unwrap().insert(slab, v.clone());
        Ok(v)
    }

    async fn lookup(
        &self,
        _volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
    ) -> Result<Option<Vec<ExtentLoc>>, VolumeError> {
        Ok(self.0.lock().unwrap().get(&slab).cloned())
    }

    async fn change(
        &self,
        _volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
        change: SlabChange,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let mut r = self.0.lock().unwrap();
        let ex = r.get_mut(&slab).expect("slab recorded");
        change.apply(ex);
        Ok(ex.clone())
    }

    async fn release(
        &self,
        _volume: VolumeId,
        slabs: &[SlabIndex],
        _epoch: Epoch,
    ) -> Result<(), VolumeError> {
        let mut r = self.0.lock().unwrap();
        for s in slabs {
            r.remove(s);
        }
        Ok(())
    }
}

/// `n` blocks of byte `f`.
fn filled(n: u64, f: u8) -> Bytes {
    Bytes::from(vec![f; (n * BS) as usize])
}

/// What every drive keeps for snapshots, in bytes (the drives' own count).
fn preserved_bytes(io: &Drives) -> u64 {
    io.tiers
        .values()
        .map(|t| t.capacity().bytes_preserved)
        .sum()
}

/// `copies` drives of `len` bytes (sparse files).
fn drives(dir: &std::path::Path, copies: u32, len: u64) -> Drives {
    let mut tiers = HashMap::new();
    for n in 1..=copies {
        let path = dir.join(format!("drive{n}"));
        let file = DirectFile::open(&path, Some(len)).expect("drive file");
        let ident = DriveIdentity {
            cluster: ClusterId(1),
            node: NodeId(n),
            drive: DriveId(u64::from(n)),
            slab_size_bytes: SLAB,
            role: DriveRole::Capacity,
            media: MediaType::Ram,
        };
        let opts = FormatOptions {
            journal_bytes: Some(2 << 20),
            ..Default::default()
        };
        let drive = Drive::format_with(Arc::new(file), ident, opts).expect("format");
        tiers.insert(DriveId(u64::from(n)), Tier::new(Arc::new(drive)));
    }
    Drives {
        tiers,
        refused: Mutex::new(Vec::new()),
        lose_floor_answers: Mutex::new(None),
    }
}

/// What a request does, for the failure message.
#[derive(Debug)]
enum Req {
    Write { offset: u64, len: u64 },
    Trim { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64 },
    Read { offset: u64, len: u64 },
}

/// An offset, often on a slab or block boundary (where the edge cases are); `span` is the
/// volume bytes of one slab.
fn offset(rng: &mut impl Rng, size: u64, span: u64) -> u64 {
    match rng.gen_range(0..4) {
        0 => rng.gen_range(0..SLABS) * span,
        1 => rng.gen_range(0..size / BS) * BS,
        2 => (rng.gen_range(1..=SLABS) * span).saturating_sub(rng.gen_range(1..3 * BS)),
        _ => rng.gen_range(0..size),
    }
}

/// A length, often beyond one extent operation.
fn length(rng: &mut impl Rng, max: u64, span: u64) -> u64 {
    let l = match rng.gen_range(0..5) {
        0 => rng.gen_range(1..2 * BS),
        1 => MAX_IO_BYTES as u64 + rng.gen_range(0..3) * 512,
        2 => rng.gen_range(1..=MAX_IO_BYTES as u64),
        3 => span,
        _ => rng.gen_range(1..=2 * span),
    };
    l.min(max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_of_every_size_read_back_as_written() {
    // CONVERGE_TEST_SEED=N runs that seed alone (to reproduce a failure).
    let seeds: Vec<u64> = match std::env::var("CONVERGE_TEST_SEED") {
        Ok(s) => vec![s.parse().expect("CONVERGE_TEST_SEED is a number")],
        Err(_) => vec![0x5eed_0b1a, 1, 2, 3],
    };
    for seed in seeds {
        one_run(seed, Resiliency::Mirror2, Compression::None, None).await;
    }
}

/// The same on a compressed mirror (docs/adr/0010): every copy's engine stores the
/// writes in compressed groups (the payloads compress), reads back every byte, and holds
/// less than was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_on_a_compressed_volume_read_back_as_written() {
    let seeds: Vec<u64> = match std::env::var("CONVERGE_TEST_SEED") {
        Ok(s) => vec![s.parse().expect("CONVERGE_TEST_SEED is a number")],
        Err(_) => vec![0x5eed_0b1a, 1, 2],
    };
    for (i, seed) in seeds.into_iter().enumerate() {
        let codec = [Compression::Zstd, Compression::Lz4][i % 2];
        one_run(seed, Resiliency::Mirror2, codec, None).await;
    }
}

/// The same over parity-2+1: rows written whole with held priors on real drives, chunks
/// laid out as docs/adr/0008 says, parity that matches. The drives are small: they hold
/// 128 priors each, fewer than one large request's rows (the owner writes and settles
/// them in groups, and asks a busy drive again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_on_a_parity_volume_read_back_as_written() {
    let seeds: Vec<u64> = match std::env::var("CONVERGE_TEST_SEED") {
        Ok(s) => vec![s.parse().expect("CONVERGE_TEST_SEED is a number")],
        Err(_) => vec![0x5eed_0b1a, 1],
    };
    for seed in seeds {
        one_run(
            seed,
            Resiliency::parity(2, 1).unwrap(),
            Compression::None,
            None,
        )
        .await;
    }
}

/// The same on encrypted volumes (docs/adr/0011), mirror and parity: clients read back
/// what they wrote, and every copy or chunk holds its blocks sealed at their volume
/// offsets (the drives' data opened with the key equals the model; a block that holds
/// data never equals the plaintext).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_on_encrypted_volumes_read_back_and_the_drives_hold_ciphertext() {
    let seeds: Vec<u64> = match std::env::var("CONVERGE_TEST_SEED") {
        Ok(s) => vec![s.parse().expect("CONVERGE_TEST_SEED is a number")],
        Err(_) => vec![0x5eed_0b1a, 1],
    };
    for seed in seeds {
        for r in [Resiliency::Mirror2, Resiliency::parity(2, 1).unwrap()] {
            let key: Vec<u8> = (0..KEY_BYTES as u64)
                .map(|i| (i * 37 + seed) as u8)
                .collect();
            let cipher = Arc::new(VolumeCipher::new(&key).unwrap());
            one_run(seed, r, Compression::None, Some(cipher)).await;
        }
    }
}

/// `data` read from a drive, as the client sees it: opened with `cipher` when the volume
/// is encrypted, block `i` of it being volume block `block_of(i)`. A block that opens to
/// data must not have held it in plaintext.
fn as_client_sees(
    cipher: Option<&VolumeCipher>,
    data: &[u8],
    block_of: impl Fn(u64) -> u64,
) -> Vec<u8> {
    let mut v = data.to_vec();
    if let Some(c) = cipher {
        for (i, b) in v.chunks_mut(BS as usize).enumerate() {
            let stored = b.to_vec();
            c.open(block_of(i as u64), b);
            assert!(
                b.iter().all(|&x| x == 0) || b[..] != stored[..],
                "a drive holds a block of an encrypted volume in plaintext"
            );
        }
    }
    v
}

async fn one_run(
    seed: u64,
    resiliency: Resiliency,
    compression: Compression,
    cipher: Option<Arc<VolumeCipher>>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().expect("tempdir");
    let copies = resiliency.copies() as u32;
    let io = Arc::new(drives(dir.path(), copies, SLAB * SLABS + (8 << 20)));
    let span = resiliency.slab_span(SLAB);
    let size = span * SLABS;
    let cfg = VolumeConfig {
        id: VolumeId(7),
        name: "prop".into(),
        size_bytes: size,
        slab_size_bytes: SLAB,
        resiliency,
        mirror_part_bytes: 0,
        epoch: Epoch(1),
        local_node: NodeId(1),
        min_replicas: copies as usize,
        degraded_write_wait: Duration::from_secs(5),
        read_wait: Duration::from_secs(5),
        read_hedge: Duration::from_secs(1),
        tenure: Arc::new(Tenure::unbounded()),
        compression,
        cipher: cipher.clone(),
        qos: converge_types::Qos::default(),
        gate: None,
    };
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let mut model = vec![0u8; size as usize];
    let mut fill: u8 = 0;
    for step in 0..60 {
        let at = offset(&mut rng, size, span);
        let req = match rng.gen_range(0..4) {
            // Writes carry a payload: at most what the NBD front end accepts (32 MiB).
            0 => Req::Write {
                offset: at,
                len: length(&mut rng, (size - at).min(MAX_IO_BYTES as u64), span).max(1),
            },
            1 => Req::Trim {
                offset: at,
                len: length(&mut rng, size - at, span),
            },
            2 => Req::WriteZeroes {
                offset: at,
                len: length(&mut rng, size - at, span),
            },
            _ => Req::Read {
                offset: at,
                len: length(&mut rng, (size - at).min(MAX_IO_BYTES as u64), span),
            },
        };
        let r = match req {
            Req::Write { offset, len } => {
                fill = fill.wrapping_add(1).max(1);
                let data: Vec<u8> = (0..len).map(|i| fill ^ (i as u8)).collect();
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                vol.write(offset, Bytes::from(data)).await
            }
            Req::Trim { offset, len } => {
                // A hint: whole blocks read as zeros, partial edges keep their data. A
                // parity volume drops all but whole slabs (zeroing part of a row would be a
                // row write).
                let unit = if resiliency.is_parity() { span } else { BS };
                let a = offset.div_ceil(unit) * unit;
                let b = (offset + len) / unit * unit;
                if b > a {
                    model[a as usize..b as usize].fill(0);
                }
                vol.zero(offset, len, true).await
            }
            Req::WriteZeroes { offset, len } => {
                model[offset as usize..(offset + len) as usize].fill(0);
                vol.zero(offset, len, false).await
            }
            Req::Read { offset, len } => match vol.read(offset, len).await {
                Ok(got) => {
                    let want = &model[offset as usize..(offset + len) as usize];
                    assert!(
                        got[..] == want[..],
                        "seed {seed:#x} step {step}: {req:?} read other bytes than were written"
                    );
                    Ok(())
                }
                Err(e) => Err(e),
            },
        };
        if let Err(e) = r {
            panic!("seed {seed:#x} step {step}: {req:?} failed: {e}");
        }
        let refused = io.refused.lock().unwrap().clone();
        assert!(
            refused.is_empty(),
            "seed {seed:#x} step {step}: {req:?}: the engine refused {refused:?}"
        );
    }
    // The whole volume, in pieces the front end allows, equals the model.
    for p in 0..size / MAX_IO_BYTES as u64 {
        let off = p * MAX_IO_BYTES as u64;
        let got = vol.read(off, MAX_IO_BYTES as u64).await.expect("read");
        assert!(
            got[..] == model[off as usize..off as usize + MAX_IO_BYTES],
            "seed {seed:#x}: the volume differs from what was written at {off}"
        );
    }
    if resiliency.is_parity() {
        check_chunks(&io, &model, resiliency, span, seed, cipher.as_deref());
        return;
    }
    // A compressed volume's copies store less than they hold written (the payloads are a
    // short pattern), and each extent remembers the codec.
    if !compression.is_none() {
        for (d, tier) in &io.tiers {
            let (written, stored): (u64, u64) = tier
                .extents()
                .iter()
                .inspect(|e| assert_eq!(e.compression, compression, "drive {d}"))
                .fold((0, 0), |(w, s), e| {
                    (w + e.bytes_written, s + e.bytes_stored)
                });
            assert!(
                written == 0 || stored * 2 <= written,
                "seed {seed:#x}: drive {d} stores {stored} bytes of {written} written"
            );
        }
    }
    // And each copy holds the same: read every slab from each drive directly.
    for s in 0..SLABS {
        for (d, tier) in &io.tiers {
            for piece in 0..SLAB.div_ceil(MAX_IO_BYTES as u64) {
                let off = piece * MAX_IO_BYTES as u64;
                let len = (SLAB - off).min(MAX_IO_BYTES as u64);
                let op = ExtentOp::Read {
                    key: converge_types::ExtentKey {
                        volume: VolumeId(7),
                        slab: SlabIndex(s),
                    },
                    epoch: Epoch(1),
                    offset: off,
                    len: len as u32,
                };
                let want = &model[(s * SLAB + off) as usize..(s * SLAB + off + len) as usize];
                match converge_replica::execute(tier, op) {
                    Ok(ExtentReply::Read(r)) => {
                        assert!(r.bad_blocks.is_empty(), "drive {d}: bad blocks");
                        let first = (s * SLAB + off) / BS;
                        let data = as_client_sees(cipher.as_deref(), &r.data, |i| first + i);
                        assert!(
                            data[..] == want[..],
                            "seed {seed:#x}: drive {d} slab {s} differs at {off}"
                        );
                    }
                    other => panic!("drive {d} slab {s}: {other:?}"),
                }
            }
        }
    }
}

/// Each data chunk holds its blocks of every row (block j of row r is volume byte
/// (r·K + j)·4096 of the slab), and every row's parity matches, read from the drives
/// directly.
fn check_chunks(
    io: &Drives,
    model: &[u8],
    resiliency: Resiliency,
    span: u64,
    seed: u64,
    cipher: Option<&VolumeCipher>,
) {
    let Resiliency::Parity { data: k, parity: m } = resiliency else {
        unreachable!("a parity resiliency")
    };
    let all = usize::from(k + m);
    let mut codec = converge_volume::parity::Codec::new(k, m).unwrap();
    for s in 0..SLABS {
        for piece in 0..SLAB.div_ceil(MAX_IO_BYTES as u64) {
            let off = piece * MAX_IO_BYTES as u64;
            let len = (SLAB - off).min(MAX_IO_BYTES as u64);
            let chunks: Vec<Vec<u8>> = (1..=all as u64)
                .map(|d| {
                    let op = ExtentOp::Read {
                        key: converge_types::ExtentKey {
                            volume: VolumeId(7),
                            slab: SlabIndex(s),
                        },
                        epoch: Epoch(1),
                        offset: off,
                        len: len as u32,
                    };
                    match converge_replica::execute(&io.tiers[&DriveId(d)], op) {
                        Ok(ExtentReply::Read(r)) => {
                            assert!(r.bad_blocks.is_empty(), "drive {d}: bad blocks");
                            r.data.to_vec()
                        }
                        other => panic!("drive {d} slab {s}: {other:?}"),
                    }
                })
                .collect();
            for i in 0..(len / BS) as usize {
                let row = off / BS + i as u64;
                for (j, chunk) in chunks.iter().take(usize::from(k)).enumerate() {
                    let at = (s * span + (row * u64::from(k) + j as u64) * BS) as usize;
                    let block = as_client_sees(cipher, &chunk[i * 4096..(i + 1) * 4096], |_| {
                        at as u64 / BS
                    });
                    assert!(
                        block[..] == model[at..at + 4096],
                        "seed {seed:#x}: slab {s} row {row} data chunk {j} differs"
                    );
                }
                let shards: Vec<&[u8]> = chunks
                    .iter()
                    .map(|c| &c[i * 4096..(i + 1) * 4096])
                    .collect();
                assert!(
                    codec.verify(&shards).unwrap(),
                    "seed {seed:#x}: slab {s} row {row}: parity does not match"
                );
            }
        }
    }
}

/// A clone's parent snapshot, in memory: `data`, zeros past its end.
struct MemParent(Arc<Vec<u8>>);

impl converge_volume::ParentRead for MemParent {
    fn read(
        &self,
        offset: u64,
        len: u64,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, VolumeError>> + Send + '_>>
    {
        let mut v = vec![0u8; len as usize];
        let (a, b) = (offset as usize, ((offset + len) as usize).min(self.0.len()));
        if a < b {
            v[..b - a].copy_from_slice(&self.0[a..b]);
        }
        Box::pin(async move { Ok(Bytes::from(v)) })
    }

    fn name(&self) -> String {
        "parent@base".into()
    }
}

/// A clone (docs/SNAPSHOTS.md "Clones") over real engine drives, driven by random requests
/// of every shape: it reads as its parent (shorter than the clone: zeros past it) where it
/// never wrote and as its own writes, TRIMs and zeroes elsewhere; its snapshots read as the
/// clone did when taken; and a flatten racing more writes leaves exactly the same bytes
/// with the parent gone (a client write is never overwritten by the parent's content).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_on_a_clone_read_as_its_parent_plus_its_writes_through_flatten() {
    let seeds: Vec<u64> = match std::env::var("CONVERGE_TEST_SEED") {
        Ok(s) => vec![s.parse().expect("CONVERGE_TEST_SEED is a number")],
        Err(_) => vec![0xc10e, 1, 2],
    };
    for seed in seeds {
        clone_run(seed).await;
    }
}

async fn clone_run(seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().expect("tempdir");
    // Room for the snapshots' preserved blocks too (sparse files).
    let io = Arc::new(drives(dir.path(), 2, 4 * SLAB * SLABS));
    let size = SLAB * SLABS;
    let mut parent = vec![0u8; (size - SLAB / 2) as usize];
    rng.fill(&mut parent[..]);
    let parent = Arc::new(parent);
    let cfg = VolumeConfig {
        id: VolumeId(8),
        name: "clone".into(),
        size_bytes: size,
        slab_size_bytes: SLAB,
        resiliency: Resiliency::Mirror2,
        mirror_part_bytes: 0,
        epoch: Epoch(1),
        local_node: NodeId(1),
        min_replicas: 2,
        degraded_write_wait: Duration::from_secs(5),
        read_wait: Duration::from_secs(5),
        read_hedge: Duration::from_secs(1),
        tenure: Arc::new(Tenure::unbounded()),
        compression: Compression::None,
        cipher: None,
        qos: converge_types::Qos::default(),
        gate: None,
    };
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    vol.set_parent(Some(Arc::new(MemParent(parent.clone()))));
    let mut model = vec![0u8; size as usize];
    model[..parent.len()].copy_from_slice(&parent);
    let mut snaps: Vec<(Epoch, Vec<u8>)> = Vec::new();
    let mut fill: u8 = 0;
    let ctx = |step: usize| format!("seed {seed:#x} step {step}");
    // Blocks the clone made its own (a partial block is read, patched and written whole).
    let mut own = vec![false; (size / BS) as usize];
    let mark = |own: &mut Vec<bool>, a: u64, b: u64| {
        for blk in own.iter_mut().take(b as usize).skip(a as usize) {
            *blk = true;
        }
    };
    for step in 0..50 {
        let at = offset(&mut rng, size, SLAB);
        match rng.gen_range(0..7) {
            0 | 1 => {
                let len = clone_len(&mut rng, (size - at).min(MAX_IO_BYTES as u64)).max(1);
                fill = fill.wrapping_add(1).max(1);
                let data: Vec<u8> = (0..len).map(|i| fill ^ (i as u8)).collect();
                model[at as usize..(at + len) as usize].copy_from_slice(&data);
                mark(&mut own, at / BS, (at + len).div_ceil(BS));
                vol.write(at, Bytes::from(data)).await.expect("write");
            }
            2 => {
                let len = clone_len(&mut rng, size - at);
                let (a, b) = (at.div_ceil(BS) * BS, (at + len) / BS * BS);
                if b > a {
                    model[a as usize..b as usize].fill(0);
                    mark(&mut own, a / BS, b / BS);
                }
                vol.zero(at, len, true).await.expect("trim");
            }
            3 => {
                let len = clone_len(&mut rng, size - at);
                model[at as usize..(at + len) as usize].fill(0);
                mark(&mut own, at / BS, (at + len).div_ceil(BS));
                vol.zero(at, len, false).await.expect("write zeroes");
            }
            4 if snaps.len() < 3 => {
                let e = vol
                    .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
                    .await
                    .expect("snapshot");
                snaps.push((e, model.clone()));
            }
            _ => {
                let len = length(&mut rng, (size - at).min(MAX_IO_BYTES as u64), SLAB);
                let got = vol.read(at, len).await.expect("read");
                assert!(
                    got[..] == model[at as usize..(at + len) as usize],
                    "{}: read of {len} at {at} differs",
                    ctx(step)
                );
                for (e, m) in &snaps {
                    let got = vol.read_at(*e, at, len).await.expect("snapshot read");
                    assert!(
                        got[..] == m[at as usize..(at + len) as usize],
                        "{}: read of {len} at {at} of the snapshot at epoch {e} differs",
                        ctx(step)
                    );
                }
            }
        }
        assert!(io.refused.lock().unwrap().is_empty(), "{}", ctx(step));
    }
    // A clone with snapshots is not flattened; without them it is, while writes go on.
    if !snaps.is_empty() {
        let e = vol.flatten().await.unwrap_err();
        assert!(e.to_string().contains("snapshots"), "{e}");
        for (e, _) in snaps.drain(..).rev() {
            vol.drop_snapshot(e).await.expect("drop snapshot");
        }
    }
    let mut writes = Vec::new();
    for _ in 0..12 {
        let at = rng.gen_range(0..size / BS - 64) * BS + rng.gen_range(0..2) * 1000;
        let len = rng.gen_range(1..64 * BS);
        fill = fill.wrapping_add(1).max(1);
        let data: Vec<u8> = (0..len).map(|i| fill ^ (i as u8)).collect();
        model[at as usize..(at + len) as usize].copy_from_slice(&data);
        mark(&mut own, at / BS, (at + len).div_ceil(BS));
        writes.push((at, data));
    }
    // Blocks still the parent's whatever the writes during the flatten do: it copies them.
    let parents = own
        .iter()
        .take(parent.len() / BS as usize)
        .filter(|o| !**o)
        .count() as u64;
    let writer = async {
        for (at, data) in writes {
            vol.write(at, Bytes::from(data))
                .await
                .expect("write during flatten");
            tokio::task::yield_now().await;
        }
    };
    let (copied, ()) = tokio::join!(vol.flatten(), writer);
    let copied = copied.expect("flatten");
    assert!(
        copied >= parents * BS,
        "seed {seed:#x}: flatten copied {copied} bytes, {parents} blocks were the parent's"
    );
    vol.set_parent(None);
    for p in 0..size / MAX_IO_BYTES as u64 {
        let off = p * MAX_IO_BYTES as u64;
        let got = vol.read(off, MAX_IO_BYTES as u64).await.expect("read");
        assert!(
            got[..] == model[off as usize..off as usize + MAX_IO_BYTES],
            "seed {seed:#x}: the flattened clone differs from the model at {off}"
        );
    }
}

/// A clone's request length: mostly up to 2 MiB (so some of the parent stays unwritten for
/// the flatten to copy), now and then one of every size.
fn clone_len(rng: &mut impl Rng, max: u64) -> u64 {
    if rng.gen_bool(0.1) {
        length(rng, max, SLAB)
    } else {
        rng.gen_range(1..=2u64 << 20).min(max)
    }
}

/// Every snapshot the model holds reads back exactly from the volume.
/// A mirror-2 volume's configuration, owned on node 1 at epoch 1 (min_replicas 1).
fn mirror2(id: u64, name: &str, size_bytes: u64) -> VolumeConfig {
    VolumeConfig {
        id: VolumeId(id),
        name: name.into(),
        size_bytes,
        slab_size_bytes: SLAB,
        resiliency: Resiliency::Mirror2,
        mirror_part_bytes: 0,
        epoch: Epoch(1),
        local_node: NodeId(1),
        min_replicas: 1,
        degraded_write_wait: Duration::from_secs(5),
        read_wait: Duration::from_secs(5),
        read_hedge: Duration::from_secs(1),
        tenure: Arc::new(Tenure::unbounded()),
        compression: Compression::None,
        cipher: None,
        qos: converge_types::Qos::default(),
        gate: None,
    }
}

async fn check_snapshots<R: ReplicaIo, A: SlabAllocator>(
    vol: &Volume<R, A>,
    snaps: &[(Epoch, Vec<u8>)],
    ctx: &str,
) {
    let size = vol.size_bytes();
    for (e, m) in snaps {
        let mut off = 0;
        while off < size {
            let len = (MAX_IO_BYTES as u64).min(size - off);
            let got = vol
                .read_at(*e, off, len)
                .await
                .unwrap_or_else(|err| panic!("{ctx}: snapshot {e} at {off}: {err}"));
            if got[..] != m[off as usize..(off + len) as usize] {
                let i = (0..len as usize)
                    .find(|&i| got[i] != m[off as usize + i])
                    .unwrap();
                panic!("{ctx}: snapshot {e} differs at byte {}", off as usize + i);
            }
            off += len;
        }
    }
}

/// Step 4 of ADR 0012: a copy rebuilt, or resynced, while snapshots exist holds them once
/// in sync, exactly: with the other copies gone stale, every snapshot reads back from it
/// alone. Writes, a snapshot and a delete run during the copies. Also on compressed
/// volumes (the payloads compress): there a write replacing a state a snapshot reads
/// copies it out of its group's stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_and_a_resynced_copy_hold_every_snapshot() {
    use converge_volume::resync::{Progress, Throttle};
    for (seed, codec) in [
        (0x5eed4_u64, Compression::None),
        (0x5eed5, Compression::None),
        (0x5eed6, Compression::Lz4),
        (0x5eed7, Compression::Zstd),
    ] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let dir = tempfile::tempdir().expect("tempdir");
        let io = Arc::new(drives(dir.path(), 3, 6 * SLAB * SLABS));
        let size = SLAB * SLABS;
        let mut cfg = mirror2(9, "history", size);
        cfg.compression = codec;
        let records = Arc::new(Records::default());
        let vol = Volume::new(cfg, BTreeMap::new(), io.clone(), records.clone());
        let mut model = vec![0u8; size as usize];
        let mut snaps: Vec<(Epoch, Vec<u8>)> = Vec::new();
        let mut fill = 0u8;
        // Random writes, zeroes and snapshots; each slab written first, so all exist.
        let mut ops: Vec<(u64, u64, u8)> = (0..SLABS).map(|s| (s * SLAB, 3 * BS, 1)).collect();
        for _ in 0..36 {
            let at = rng.gen_range(0..size / BS - 300) * BS + rng.gen_range(0..2) * 700;
            let len = rng.gen_range(1..256 * BS);
            ops.push((at, len, rng.gen_range(0..8)));
        }
        let apply = |model: &mut Vec<u8>, fill: &mut u8, at: u64, len: u64, kind: u8| {
            if kind == 0 {
                model[at as usize..(at + len) as usize].fill(0);
                None
            } else {
                *fill = fill.wrapping_add(1).max(1);
                let f = *fill;
                let data: Vec<u8> = (0..len).map(|i| f ^ (i as u8)).collect();
                model[at as usize..(at + len) as usize].copy_from_slice(&data);
                Some(Bytes::from(data))
            }
        };
        for (n, &(at, len, kind)) in ops.iter().enumerate() {
            match apply(&mut model, &mut fill, at, len, kind) {
                Some(d) => vol.write(at, d).await.expect("write"),
                None => vol.zero(at, len, false).await.expect("zero"),
            }
            if n % 9 == 8 {
                let e = vol
                    .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
                    .await
                    .expect("snapshot");
                snaps.push((e, model.clone()));
            }
        }
        // The second of four goes (merged into the first on every copy).
        let (gone, _) = snaps.remove(1);
        vol.drop_snapshot(gone).await.expect("drop");
        check_snapshots(&vol, &snaps, "before the rebuild").await;

        // Drive 2's copies are rebuilt on drive 3, while writes and a snapshot go on.
        let throttle = Throttle::new(u64::MAX / 4);
        let mut during: Vec<(u64, u64, u8)> = Vec::new();
        for _ in 0..24 {
            let at = rng.gen_range(0..size / BS - 300) * BS;
            during.push((at, rng.gen_range(1..128 * BS), rng.gen_range(0..6)));
        }
        let planned: Vec<(u64, u64, Option<Bytes>)> = during
            .iter()
            .map(|&(at, len, kind)| (at, len, apply(&mut model, &mut fill, at, len, kind)))
            .collect();
        let after = model.clone();
        let rebuild = async {
            for s in 0..SLABS {
                let new = ExtentLoc {
                    node: NodeId(3),
                    drive: DriveId(3),
                    state: ExtentState::Syncing,
                };
                vol.rebuild(
                    SlabIndex(s),
                    DriveId(2),
                    new,
                    &throttle,
                    &Progress::default(),
                )
                .await
                .expect("rebuild");
            }
        };
        let writer = async {
            for (at, len, d) in planned {
                match d {
                    Some(d) => vol.write(at, d).await.expect("write"),
                    None => vol.zero(at, len, false).await.expect("zero"),
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::join!(rebuild, writer);
        let e = vol
            .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
            .await
            .expect("snapshot");
        snaps.push((e, after));
        // Drive 1's copies go stale: drive 3's alone serve the snapshots.
        for s in 0..SLABS {
            vol.copy_failed(SlabIndex(s), DriveId(1))
                .await
                .expect("stale");
        }
        check_snapshots(&vol, &snaps, &format!("seed {seed:#x}: rebuilt copy alone")).await;

        // While drive 1 is stale: writes, a snapshot deleted and one taken; then its resync,
        // with writes going on; then drive 3's copies go stale and drive 1's serve alone.
        for _ in 0..8 {
            let at = rng.gen_range(0..size / BS - 300) * BS;
            let len = rng.gen_range(1..128 * BS);
            let d = apply(&mut model, &mut fill, at, len, 1).unwrap();
            vol.write(at, d).await.expect("write");
        }
        let (gone, _) = snaps.remove(0);
        vol.drop_snapshot(gone).await.expect("drop");
        let e = vol
            .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
            .await
            .expect("snapshot");
        snaps.push((e, model.clone()));
        let planned: Vec<(u64, Bytes)> = (0..12)
            .map(|_| {
                let at = rng.gen_range(0..size / BS - 300) * BS;
                let len = rng.gen_range(1..128 * BS);
                (at, apply(&mut model, &mut fill, at, len, 1).unwrap())
            })
            .collect();
        let resync = async {
            for s in 0..SLABS {
                vol.resync(SlabIndex(s), DriveId(1), &throttle, &Progress::default())
                    .await
                    .expect("resync");
            }
        };
        let writer = async {
            for (at, d) in planned {
                vol.write(at, d).await.expect("write");
                tokio::task::yield_now().await;
            }
        };
        tokio::join!(resync, writer);
        for s in 0..SLABS {
            vol.copy_failed(SlabIndex(s), DriveId(3))
                .await
                .expect("stale");
        }
        check_snapshots(
            &vol,
            &snaps,
            &format!("seed {seed:#x}: resynced copy alone"),
        )
        .await;
        let got = vol.read(0, MAX_IO_BYTES as u64).await.expect("read");
        assert!(
            got[..] == model[..MAX_IO_BYTES],
            "seed {seed:#x}: live data"
        );
        assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
        if !codec.is_none() {
            // The copies did store compressed groups (which the snapshots then kept).
            let (written, stored) = io
                .tiers
                .values()
                .flat_map(|t| t.extents())
                .inspect(|e| assert_eq!(e.compression, codec))
                .fold((0, 0), |(w, s), e| {
                    (w + e.bytes_written, s + e.bytes_stored)
                });
            assert!(
                stored < written,
                "seed {seed:#x}: {stored} of {written} bytes"
            );
        }
    }
}

/// Scrub reads what the copies keep for snapshots too (docs/SNAPSHOTS.md, "Scrub"): a
/// preserved block rotted on one copy is found and written back from the other, and that
/// copy alone then reads the snapshot right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_repairs_a_snapshot_block_rotted_on_one_copy() {
    use converge_volume::resync::{Progress, Throttle};
    let dir = tempfile::tempdir().expect("tempdir");
    let len = 3 * SLAB;
    let io = Arc::new(drives(dir.path(), 2, len));
    let cfg = mirror2(11, "scrubbed", SLAB);
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let pattern = |seed: u8| -> Vec<u8> {
        (0..4 * BS)
            .map(|i| seed ^ (i as u8) ^ ((i >> 8) as u8))
            .collect()
    };
    let a = pattern(0x5a);
    vol.write(8 * BS, Bytes::from(a.clone()))
        .await
        .expect("write");
    let s = vol
        .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
        .await
        .expect("snapshot");
    vol.write(8 * BS, Bytes::from(pattern(0xa5)))
        .await
        .expect("overwrite");
    // The snapshot's first block now lives only in drive 2's keeping for it: flip a bit
    // wherever the drive file holds it.
    let path = dir.path().join("drive2");
    let mut file = std::fs::read(&path).expect("read drive file");
    let first = &a[..BS as usize];
    let mut rotted = 0;
    for off in (0..file.len()).step_by(BS as usize) {
        if file[off..off + BS as usize] == *first {
            file[off + 100] ^= 0x10;
            rotted += 1;
        }
    }
    assert!(rotted > 0, "the snapshot's block is on drive 2");
    std::fs::write(&path, &file).expect("write drive file");
    drop(file);

    let throttle = Throttle::new(u64::MAX / 4);
    let rep = vol
        .scrub(true, &throttle, &Progress::default())
        .await
        .expect("scrub");
    assert!(rep.snapshot_blocks_checked > 0, "{rep:?}");
    assert_eq!(
        (rep.bad_checksums, rep.repaired, rep.snapshot_blocks_lost),
        (1, 1, 0),
        "{rep:?}"
    );
    let rep = vol
        .scrub(false, &throttle, &Progress::default())
        .await
        .expect("scrub");
    assert_eq!((rep.bad_checksums, rep.mismatches), (0, 0), "{rep:?}");
    // Drive 1's copy goes stale: drive 2's alone reads the snapshot.
    vol.copy_failed(SlabIndex(0), DriveId(1))
        .await
        .expect("stale");
    let got = vol.read_at(s, 8 * BS, 4 * BS).await.expect("read at");
    assert!(got[..] == a[..], "the repaired copy reads the snapshot");
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// A snapshot that fails because one copy's answer to its floor was lost leaves that floor
/// on the copy, and the owner goes on writing at the same epoch: such a copy would take
/// those writes for the failed snapshot's own and not keep for the older snapshots what
/// they overwrite. It goes stale instead, and its resync sets its snapshots anew: alone,
/// it then reads the older snapshot right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_left_with_a_failed_snapshots_floor_keeps_no_wrong_snapshot() {
    use converge_volume::resync::{Progress, Throttle};
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 2, 3 * SLAB));
    let cfg = mirror2(12, "floors", SLAB);
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let a: Vec<u8> = (0..4 * BS).map(|i| 0x3c ^ (i as u8)).collect();
    vol.write(0, Bytes::from(a.clone())).await.expect("write");
    let s1 = vol
        .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
        .await
        .expect("snapshot");
    *io.lose_floor_answers.lock().unwrap() = Some(DriveId(2));
    let r = vol.snapshot(|e| async move { Ok(Epoch(e.0 + 1)) }).await;
    assert!(r.is_err(), "{r:?}");
    *io.lose_floor_answers.lock().unwrap() = None;
    // The owner writes on at the epoch the failed snapshot would have closed.
    let b: Vec<u8> = (0..4 * BS).map(|i| 0xc3 ^ (i as u8)).collect();
    vol.write(0, Bytes::from(b.clone()))
        .await
        .expect("overwrite");
    let throttle = Throttle::new(u64::MAX / 4);
    let stale = vol.slab_map()[&SlabIndex(0)]
        .iter()
        .any(|e| e.drive == DriveId(2) && e.state != ExtentState::InSync);
    if stale {
        vol.resync(SlabIndex(0), DriveId(2), &throttle, &Progress::default())
            .await
            .expect("resync");
    }
    vol.copy_failed(SlabIndex(0), DriveId(1))
        .await
        .expect("stale");
    let got = vol.read_at(s1, 0, 4 * BS).await.expect("read at");
    assert!(got[..] == a[..], "drive 2 alone reads the older snapshot");
    let got = vol.read(0, 4 * BS).await.expect("read");
    assert!(got[..] == b[..], "and the live data");
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// A snapshot whose commit answer was lost leaves its floors on the copies (its owner
/// stops serving: the snapshot may exist). It was noted before the floors were set, so the
/// next term, once it serves, releases them: what the copies kept for that epoch is
/// freed, the real snapshot keeps what it reads. Without the release the copies go on
/// keeping every state the next term overwrites (until the next snapshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floors_a_snapshot_never_recorded_left_are_released_by_the_next_term() {
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 2, 4 * SLAB));
    let records = Arc::new(Records::default());
    let vol = Volume::new(
        mirror2(14, "strays", SLAB),
        BTreeMap::new(),
        io.clone(),
        records.clone(),
    );
    let blocks = filled;
    let preserved = || preserved_bytes(&io);
    vol.write(0, blocks(8, 1)).await.expect("write");
    let s1 = vol
        .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
        .await
        .expect("snapshot");
    vol.write(0, blocks(8, 2)).await.expect("write");
    let copies = 2;
    assert_eq!(preserved(), copies * 8 * BS, "s1 keeps the first states");
    // Noted, floors set, and the control plane's answer lost.
    let noted = Arc::new(Mutex::new(Vec::new()));
    let n2 = noted.clone();
    let r = vol
        .snapshot_noted(
            |e| async move {
                n2.lock().unwrap().push(e);
                Ok(())
            },
            |_| async move { Err(VolumeError::Control("answer lost".into(), "strays".into())) },
        )
        .await;
    assert!(r.is_err() && vol.is_retired(), "{r:?}");
    let strays = noted.lock().unwrap().clone();
    assert_eq!(strays, [vol.epoch()]);
    // The next term writes at a higher epoch: the stray floor keeps what it overwrites.
    let mut cfg = mirror2(14, "strays", SLAB);
    cfg.epoch = Epoch(vol.epoch().0 + 1);
    let slabs = records.0.lock().unwrap().clone();
    let next = Volume::new(cfg, slabs, io.clone(), records.clone());
    next.set_snapshots(vec![s1]);
    next.reconcile().await.expect("takeover");
    next.write(0, blocks(8, 3)).await.expect("write");
    assert_eq!(
        preserved(),
        2 * copies * 8 * BS,
        "the stray floor keeps the second states"
    );
    assert_eq!(next.release_stray_floors(&strays).await, strays);
    assert_eq!(preserved(), copies * 8 * BS, "only s1's keeping is left");
    assert_eq!(
        &next.read_at(s1, 0, 8 * BS).await.expect("read")[..],
        &blocks(8, 1)[..]
    );
    assert_eq!(
        &next.read(0, 8 * BS).await.expect("read")[..],
        &blocks(8, 3)[..]
    );
    // Released on every copy: nothing is left to release.
    assert_eq!(next.release_stray_floors(&strays).await, strays);
    assert_eq!(preserved(), copies * 8 * BS);
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// A write that waited at a slab's gate while a snapshot held it does not write once that
/// snapshot ended the owner's serving (its commit answer lost: the snapshot may exist, and
/// a copy may hold its floor, which would take the write for the snapshot's own). Before
/// the check after the gate, the write went on at the old epoch and was acked.
#[tokio::test]
async fn a_write_waiting_behind_a_snapshot_that_ended_the_term_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 2, 4 * SLAB));
    let records = Arc::new(Records::default());
    let vol = Arc::new(Volume::new(
        mirror2(15, "gated", SLAB),
        BTreeMap::new(),
        io.clone(),
        records.clone(),
    ));
    let blocks = |n: u64, f: u8| Bytes::from(vec![f; (n * BS) as usize]);
    vol.write(0, blocks(4, 1)).await.expect("write");
    let (in_commit, mut committing) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (answer, answered) = tokio::sync::oneshot::channel::<()>();
    let snap = tokio::spawn({
        let vol = vol.clone();
        async move {
            vol.snapshot(|_| async move {
                in_commit.send(()).unwrap();
                answered.await.unwrap();
                Err(VolumeError::Control("answer lost".into(), "gated".into()))
            })
            .await
        }
    });
    committing
        .recv()
        .await
        .expect("the commit runs, every gate held");
    let write = tokio::spawn({
        let vol = vol.clone();
        async move { vol.write(0, blocks(4, 2)).await }
    });
    // One thread: the write runs until it waits for the gate.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    answer.send(()).unwrap();
    assert!(snap.await.unwrap().is_err() && vol.is_retired());
    let w = write.await.unwrap();
    assert!(matches!(w, Err(VolumeError::Fenced { .. })), "{w:?}");
    let mut cfg = mirror2(15, "gated", SLAB);
    cfg.epoch = Epoch(vol.epoch().0 + 1);
    let slabs = records.0.lock().unwrap().clone();
    let next = Volume::new(cfg, slabs, io.clone(), records.clone());
    next.reconcile().await.expect("takeover");
    assert_eq!(
        &next.read(0, 4 * BS).await.expect("read")[..],
        &blocks(4, 1)[..]
    );
}

/// Snapshots of a parity volume (docs/SNAPSHOTS.md, "Parity volumes") over real engines:
/// snapshots taken among unaligned writes, zeroes and sub-row writes read back exactly,
/// from the data chunks and, with a data chunk gone stale, decoded from the others; the
/// changes between snapshots cover every block that differs; a data chunk and then the
/// parity chunk resynced after the snapshots hold them too (their fills rebuild each
/// snapshot's rows from the other chunks): each alone with one other chunk reads every
/// snapshot; a rollback makes the volume a snapshot again; deletes return the space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_of_a_parity_volume_read_back_exactly_healthy_and_degraded() {
    use converge_volume::resync::{Progress, Throttle};
    let resiliency = Resiliency::parity(2, 1).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_9a71);
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 3, 6 * SLAB * SLABS));
    let span = resiliency.slab_span(SLAB);
    let size = span * SLABS;
    let mut cfg = mirror2(11, "par", size);
    cfg.resiliency = resiliency;
    cfg.min_replicas = 2;
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let mut model = vec![0u8; size as usize];
    let mut snaps: Vec<(Epoch, Vec<u8>)> = Vec::new();
    let mut fill = 0u8;
    let mut step = |model: &mut Vec<u8>, rng: &mut rand::rngs::StdRng| {
        let at = rng.gen_range(0..size - 1);
        let len = rng.gen_range(1..=(size - at).min(300 * BS));
        fill = fill.wrapping_add(1).max(1);
        let f = fill;
        if rng.gen_bool(0.2) {
            model[at as usize..(at + len) as usize].fill(0);
            (at, len, None)
        } else {
            let data: Vec<u8> = (0..len).map(|i| f ^ (i as u8).rotate_left(3)).collect();
            model[at as usize..(at + len) as usize].copy_from_slice(&data);
            (at, len, Some(Bytes::from(data)))
        }
    };
    for n in 0..40 {
        let (at, len, d) = step(&mut model, &mut rng);
        match d {
            Some(d) => vol.write(at, d).await.expect("write"),
            None => vol.zero(at, len, false).await.expect("zero"),
        }
        if n % 10 == 9 {
            let e = vol
                .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
                .await
                .expect("snapshot of a parity volume");
            snaps.push((e, model.clone()));
        }
    }
    check_snapshots(&vol, &snaps, "healthy").await;
    // Changes between consecutive snapshots cover every block that differs.
    for w in snaps.windows(2) {
        let bits = vol
            .changed(w[0].0, Some(w[1].0), 0, size)
            .await
            .expect("changes");
        for b in 0..(size / BS) as usize {
            let r = b * BS as usize..(b + 1) * BS as usize;
            if w[0].1[r.clone()] != w[1].1[r] {
                assert!(
                    bits[b / 64] >> (b % 64) & 1 == 1,
                    "block {b} changed, not named"
                );
            }
        }
    }
    // A data chunk goes stale: every snapshot decodes from the other two.
    for s in 0..SLABS {
        vol.copy_failed(SlabIndex(s), DriveId(1))
            .await
            .expect("stale");
    }
    check_snapshots(&vol, &snaps, "a data chunk stale").await;
    // Writes while it is stale, then its resync: it holds only later snapshots.
    for _ in 0..6 {
        let (at, len, d) = step(&mut model, &mut rng);
        match d {
            Some(d) => vol.write(at, d).await.expect("write"),
            None => vol.zero(at, len, false).await.expect("zero"),
        }
    }
    let throttle = Throttle::new(u64::MAX / 4);
    for s in 0..SLABS {
        vol.resync(SlabIndex(s), DriveId(1), &throttle, &Progress::default())
            .await
            .expect("resync");
    }
    let e = vol
        .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
        .await
        .expect("snapshot after the resync");
    snaps.push((e, model.clone()));
    check_snapshots(&vol, &snaps, "after the resync").await;
    // The parity chunk goes stale: the data chunks alone (the first one resynced after
    // the snapshots, which its fill rebuilt into it) read every snapshot.
    for s in 0..SLABS {
        vol.copy_failed(SlabIndex(s), DriveId(3))
            .await
            .expect("stale");
    }
    check_snapshots(&vol, &snaps, "the parity chunk stale").await;
    for s in 0..SLABS {
        vol.resync(SlabIndex(s), DriveId(3), &throttle, &Progress::default())
            .await
            .expect("resync");
    }
    // The first data chunk goes stale: every snapshot decodes from the second and the
    // parity chunk, resynced after them too.
    for s in 0..SLABS {
        vol.copy_failed(SlabIndex(s), DriveId(1))
            .await
            .expect("stale");
    }
    check_snapshots(&vol, &snaps, "decoded through the resynced parity chunk").await;
    // A rollback to the first snapshot, the first data chunk still stale.
    let (first, image) = snaps[0].clone();
    vol.rollback(first).await.expect("rollback");
    for s in 0..SLABS {
        vol.resync(SlabIndex(s), DriveId(1), &throttle, &Progress::default())
            .await
            .expect("resync");
    }
    let mut off = 0;
    while off < size {
        let len = (MAX_IO_BYTES as u64).min(size - off);
        let got = vol.read(off, len).await.expect("read");
        assert!(
            got[..] == image[off as usize..(off + len) as usize],
            "the volume rolled back, at {off}"
        );
        off += len;
    }
    for (e, _) in snaps.drain(..) {
        vol.drop_snapshot(e).await.expect("drop");
    }
    for t in io.tiers.values() {
        assert_eq!(t.capacity().bytes_preserved, 0, "space returned");
    }
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// Snapshots of a mirror-accelerated parity volume (docs/SNAPSHOTS.md, "Mirror-accelerated
/// parity") over real engines: snapshots taken while both spans are in the mirror part read
/// back exactly; after span 0 rotates into parity (its snapshots' rows written into the
/// parity chunks before the flip freed the mirror copies that kept them), and after span 1
/// rotates with a newer snapshot too, every snapshot still reads back exactly, healthy and
/// with a data chunk or the parity chunk stale; the changes between snapshots name every
/// block that differs and no row that no request touched; a rollback makes the volume the
/// first snapshot again; deletes return the space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_of_a_mirror_accelerated_parity_volume_hold_through_rotations() {
    use converge_volume::resync::{Progress, Throttle};
    let resiliency = Resiliency::parity(2, 1).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_03a9);
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 3, 8 * SLAB * 2));
    let span = resiliency.slab_span(SLAB);
    let size = 2 * span;
    let mut cfg = mirror2(12, "map", size);
    cfg.resiliency = resiliency;
    cfg.min_replicas = 2;
    // Both spans fit the mirror part.
    cfg.mirror_part_bytes = 4 * SLAB;
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let blocks = (size / BS) as usize;
    let mut model = vec![0u8; size as usize];
    // Blocks a request touched since the last snapshot.
    let mut touched = vec![false; blocks];
    let mut snaps: Vec<(Epoch, Vec<u8>)> = Vec::new();
    // Per window between consecutive snapshots: the blocks touched in it.
    let mut windows: Vec<Vec<bool>> = Vec::new();
    let mut fill = 0u8;
    let mut step = |model: &mut Vec<u8>, touched: &mut Vec<bool>, rng: &mut rand::rngs::StdRng| {
        let at = rng.gen_range(0..size - 1);
        let len = rng.gen_range(1..=(size - at).min(300 * BS));
        fill = fill.wrapping_add(1).max(1);
        let f = fill;
        for b in at / BS..(at + len).div_ceil(BS) {
            touched[b as usize] = true;
        }
        if rng.gen_bool(0.2) {
            model[at as usize..(at + len) as usize].fill(0);
            (at, len, None)
        } else {
            let data: Vec<u8> = (0..len).map(|i| f ^ (i as u8).rotate_left(3)).collect();
            model[at as usize..(at + len) as usize].copy_from_slice(&data);
            (at, len, Some(Bytes::from(data)))
        }
    };
    let mut requests =
        |n: usize, model: &mut Vec<u8>, touched: &mut Vec<bool>, rng: &mut rand::rngs::StdRng| {
            (0..n)
                .map(|_| step(model, touched, rng))
                .collect::<Vec<_>>()
        };
    async fn apply<R: ReplicaIo, A: SlabAllocator>(
        vol: &Volume<R, A>,
        reqs: Vec<(u64, u64, Option<Bytes>)>,
    ) {
        for (at, len, d) in reqs {
            match d {
                Some(d) => vol.write(at, d).await.expect("write"),
                None => vol.zero(at, len, false).await.expect("zero"),
            }
        }
    }
    let snapshot = || async {
        vol.snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
            .await
            .expect("snapshot of a mirror-accelerated parity volume")
    };
    for _ in 0..4 {
        apply(&vol, requests(10, &mut model, &mut touched, &mut rng)).await;
        let e = snapshot().await;
        snaps.push((e, model.clone()));
        windows.push(std::mem::replace(&mut touched, vec![false; blocks]));
    }
    assert!(
        vol.slab_map().keys().all(|i| i.is_mirror_part()),
        "both spans in the mirror part: {:?}",
        vol.slab_map().keys().collect::<Vec<_>>()
    );
    check_snapshots(&vol, &snaps, "in the mirror part").await;
    // Writes after the last snapshot, then span 0 rotates into parity.
    apply(&vol, requests(6, &mut model, &mut touched, &mut rng)).await;
    let throttle = Throttle::new(u64::MAX / 4);
    let copied = vol
        .rotate_span(0, &throttle, &Progress::default())
        .await
        .expect("rotation")
        .expect("span 0 rotated");
    assert_eq!(copied, span);
    assert!(vol.slab_map().contains_key(&SlabIndex(0)));
    assert!(!vol.slab_map().contains_key(&SlabIndex::mirror_part(0)));
    check_snapshots(&vol, &snaps, "span 0 rotated").await;
    assert!(
        read_all(&vol).await == model,
        "the live volume after the rotation"
    );
    // Changes: every block that differs is named; a row (span 0, rotated) or block (span
    // 1, mirrored) that no request touched is not.
    let rows_blocks = 2usize;
    let check_changes = |bits: &[u64], old: &[u8], new: &[u8], touched: &[bool], what: &str| {
        for b in 0..blocks {
            let r = b * BS as usize..(b + 1) * BS as usize;
            let named = bits[b / 64] >> (b % 64) & 1 == 1;
            if old[r.clone()] != new[r] {
                assert!(named, "{what}: block {b} changed, not named");
            }
            let unit = if (b as u64) < span / BS {
                let row = b / rows_blocks * rows_blocks;
                row..row + rows_blocks
            } else {
                b..b + 1
            };
            if named {
                assert!(
                    unit.clone().any(|x| touched[x]),
                    "{what}: block {b} named, though no request touched {unit:?}"
                );
            }
        }
    };
    for (i, w) in snaps.windows(2).enumerate() {
        let bits = vol
            .changed(w[0].0, Some(w[1].0), 0, size)
            .await
            .expect("changes");
        check_changes(
            &bits,
            &w[0].1,
            &w[1].1,
            &windows[i + 1],
            "between snapshots",
        );
    }
    let bits = vol
        .changed(snaps[3].0, None, 0, size)
        .await
        .expect("changes since the last snapshot");
    check_changes(
        &bits,
        &snaps[3].1,
        &model,
        &touched,
        "since the last snapshot",
    );
    // More writes, a fifth snapshot, writes after it; span 1 rotates too.
    apply(&vol, requests(6, &mut model, &mut touched, &mut rng)).await;
    let e = snapshot().await;
    snaps.push((e, model.clone()));
    apply(&vol, requests(6, &mut model, &mut touched, &mut rng)).await;
    vol.rotate_span(1, &throttle, &Progress::default())
        .await
        .expect("rotation")
        .expect("span 1 rotated");
    assert!(vol.slab_map().keys().all(|i| !i.is_mirror_part()));
    check_snapshots(&vol, &snaps, "both spans rotated").await;
    assert!(
        read_all(&vol).await == model,
        "the live volume after both rotations"
    );
    // A data chunk stale, then the parity chunk: every snapshot decodes from the others.
    for (drive, what) in [(1, "a data chunk stale"), (3, "the parity chunk stale")] {
        for s in 0..2 {
            vol.copy_failed(SlabIndex(s), DriveId(drive))
                .await
                .expect("stale");
        }
        check_snapshots(&vol, &snaps, what).await;
        for s in 0..2 {
            vol.resync(
                SlabIndex(s),
                DriveId(drive),
                &throttle,
                &Progress::default(),
            )
            .await
            .expect("resync");
        }
    }
    check_snapshots(&vol, &snaps, "after the resyncs").await;
    // A rollback to the first snapshot.
    let (first, image) = snaps[0].clone();
    vol.rollback(first).await.expect("rollback");
    assert!(read_all(&vol).await == image, "the volume rolled back");
    check_snapshots(&vol, &snaps, "after the rollback").await;
    for (e, _) in snaps.drain(..) {
        vol.drop_snapshot(e).await.expect("drop");
    }
    for t in io.tiers.values() {
        assert_eq!(t.capacity().bytes_preserved, 0, "space returned");
    }
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// The whole live volume.
async fn read_all<R: ReplicaIo, A: SlabAllocator>(vol: &Volume<R, A>) -> Vec<u8> {
    let size = vol.size_bytes();
    let mut out = Vec::with_capacity(size as usize);
    let mut off = 0;
    while off < size {
        let len = (MAX_IO_BYTES as u64).min(size - off);
        out.extend_from_slice(&vol.read(off, len).await.expect("read"));
        off += len;
    }
    out
}

/// The per-snapshot space figures (`Volume::snapshot_space`, docs/SNAPSHOTS.md "Space")
/// over real engines, mirror-2: a snapshot keeps what later writes replaced, on each copy;
/// what deleting the newer of two would free is what only it reads (states written after
/// the older one), not what the older one reads too; and deleting it frees exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_space_counts_what_each_keeps_and_what_a_delete_frees() {
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 2, 4 * SLAB));
    let vol = Volume::new(
        mirror2(13, "space", SLAB),
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let blocks = filled;
    let preserved = || preserved_bytes(&io);
    // X (8 blocks) and Y (5 blocks) written, then s1.
    let (x, y) = (0, 100 * BS);
    vol.write(x, blocks(8, 1)).await.expect("write");
    vol.write(y, blocks(5, 2)).await.expect("write");
    let snap = || async {
        vol.snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
            .await
            .expect("snapshot")
    };
    let s1 = snap().await;
    assert_eq!(
        vol.snapshot_space().await.expect("space").0[0],
        converge_volume::SnapshotSpace {
            snapshot: s1,
            kept_bytes: 0,
            freed_by_delete_bytes: 0
        },
        "nothing replaced yet"
    );
    // X overwritten: s1 keeps X's first states, on both copies.
    vol.write(x, blocks(8, 3)).await.expect("write");
    let s2 = snap().await;
    // X again and Y: s2 keeps X's second states (only it reads them) and Y's first (s1
    // reads those too).
    vol.write(x, blocks(8, 4)).await.expect("write");
    vol.write(y, blocks(5, 5)).await.expect("write");
    let (space, unanswered) = vol.snapshot_space().await.expect("space");
    assert_eq!(unanswered, 0);
    let copies = 2;
    assert_eq!(
        space,
        [
            converge_volume::SnapshotSpace {
                snapshot: s1,
                kept_bytes: copies * 8 * BS,
                freed_by_delete_bytes: copies * 8 * BS,
            },
            converge_volume::SnapshotSpace {
                snapshot: s2,
                kept_bytes: copies * 13 * BS,
                freed_by_delete_bytes: copies * 8 * BS,
            }
        ]
    );
    assert_eq!(
        preserved(),
        copies * 21 * BS,
        "the drives' own count agrees"
    );
    // Deleting s2 frees what it said; Y's first states move to s1.
    vol.drop_snapshot(s2).await.expect("drop");
    assert_eq!(preserved(), copies * 13 * BS);
    let (space, _) = vol.snapshot_space().await.expect("space");
    assert_eq!(
        space,
        [converge_volume::SnapshotSpace {
            snapshot: s1,
            kept_bytes: copies * 13 * BS,
            freed_by_delete_bytes: copies * 13 * BS,
        }]
    );
    assert_eq!(
        &vol.read_at(s1, y, 5 * BS).await.expect("read")[..],
        &blocks(5, 2)[..],
        "s1 still reads Y's first states"
    );
    vol.drop_snapshot(s1).await.expect("drop");
    assert_eq!(preserved(), 0);
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}

/// Scrub reads what a parity volume's chunks keep for snapshots too (docs/SNAPSHOTS.md,
/// "Scrub"): a kept block rotted on one data chunk is found, decoded from the other chunks
/// and written back into its keeping; that chunk with the parity chunk alone then reads
/// the snapshot right (without the repair, the row would have one intact data block and
/// the parity: fewer than K = 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_repairs_a_parity_snapshot_block_rotted_on_one_chunk() {
    use converge_volume::resync::{Progress, Throttle};
    let dir = tempfile::tempdir().expect("tempdir");
    let io = Arc::new(drives(dir.path(), 3, 3 * SLAB));
    let resiliency = Resiliency::parity(2, 1).unwrap();
    let mut cfg = mirror2(14, "pscrub", resiliency.slab_span(SLAB));
    cfg.resiliency = resiliency;
    cfg.min_replicas = 2;
    let vol = Volume::new(
        cfg,
        BTreeMap::new(),
        io.clone(),
        Arc::new(Records::default()),
    );
    let pattern = |seed: u8| -> Vec<u8> {
        (0..4 * BS)
            .map(|i| seed ^ (i as u8) ^ ((i >> 8) as u8))
            .collect()
    };
    // Volume blocks 8..12: rows 4 and 5, chunk 0 holds blocks 8 and 10.
    let a = pattern(0x5a);
    vol.write(8 * BS, Bytes::from(a.clone()))
        .await
        .expect("write");
    let s = vol
        .snapshot(|e| async move { Ok(Epoch(e.0 + 1)) })
        .await
        .expect("snapshot");
    vol.write(8 * BS, Bytes::from(pattern(0xa5)))
        .await
        .expect("overwrite");
    let throttle = Throttle::new(u64::MAX / 4);
    let rep = vol
        .scrub(false, &throttle, &Progress::default())
        .await
        .expect("scrub");
    assert!(rep.snapshot_blocks_checked > 0, "{rep:?}");
    assert_eq!((rep.bad_checksums, rep.mismatches), (0, 0), "{rep:?}");
    // Volume block 8 (chunk 0's block of row 4) at the snapshot is now kept only by
    // drive 1: flip a bit wherever the drive file holds it.
    let path = dir.path().join("drive1");
    let mut file = std::fs::read(&path).expect("read drive file");
    let first = &a[..BS as usize];
    let mut rotted = 0;
    for off in (0..file.len()).step_by(BS as usize) {
        if file[off..off + BS as usize] == *first {
            file[off + 100] ^= 0x10;
            rotted += 1;
        }
    }
    assert!(rotted > 0, "the snapshot's block is on drive 1");
    std::fs::write(&path, &file).expect("write drive file");
    drop(file);
    let rep = vol
        .scrub(true, &throttle, &Progress::default())
        .await
        .expect("scrub");
    assert_eq!(
        (rep.bad_checksums, rep.repaired, rep.snapshot_blocks_lost),
        (1, 1, 0),
        "{rep:?}"
    );
    let rep = vol
        .scrub(false, &throttle, &Progress::default())
        .await
        .expect("scrub");
    assert_eq!((rep.bad_checksums, rep.mismatches), (0, 0), "{rep:?}");
    // Chunk 1 goes stale: chunk 0 (repaired) and the parity chunk read the snapshot.
    vol.copy_failed(SlabIndex(0), DriveId(2))
        .await
        .expect("stale");
    let got = vol.read_at(s, 8 * BS, 4 * BS).await.expect("read at");
    assert!(got[..] == a[..], "the repaired chunk reads the snapshot");
    assert!(io.refused.lock().unwrap().is_empty(), "{:?}", io.refused);
}
