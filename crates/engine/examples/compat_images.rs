//! Writes the drive, cache and journal images a release leaves behind, for the next
//! releases to open (`crates/engine/tests/compat.rs`, docs/OPERATIONS.md "Upgrades"). Run
//! it with the release being cut, then commit its output under
//! `crates/engine/tests/compat/<release>/`:
//!
//!   cargo run --release -p converge-engine --example compat_images -- OUTDIR
//!
//! It writes three images and stops as kill -9 would (no clean shutdown), so the newer
//! build must replay what was left:
//! * `drive.img`: a capacity drive holding a plain extent (written, overwritten, trimmed,
//!   and under a snapshot whose preserved blocks it keeps), an lz4 extent, and a parity
//!   chunk's extent with held writes (their priors kept, not settled); its metadata journal
//!   holds the latest records, unfolded;
//! * `cached.img` and `cache.img`: a capacity drive and the cache drive bound to it, with
//!   acked writes only in the cache's log (not destaged).
//!
//! Every block's content is `content(key, block, version)`; the reader recomputes it with
//! its own copy of that function, so nothing the old build says is taken on trust.
//! `manifest.txt` records the build and what was written.

use converge_engine::{Cache, DirectFile, Drive, DriveIdentity, FormatOptions, Tier};
use converge_types::{
    ClusterId, Compression, DriveId, DriveRole, Epoch, ExtentKey, FloorHistory, MediaType, NodeId,
    SlabIndex, Version, VolumeId,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

const B: usize = 4096;
/// 64 blocks a slab: small images.
const SLAB: u64 = 256 << 10;
const DRIVE_BYTES: u64 = 16 << 20;
const CACHE_BYTES: u64 = 16 << 20;

fn key(slab: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(42),
        slab: SlabIndex(slab),
    }
}

/// A block's bytes: its key, block and version in the first 24 bytes, then a pattern
/// drawn from them (compressible every other version, so lz4 groups shrink).
fn content(k: ExtentKey, block: u32, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; B];
    b[..8].copy_from_slice(&k.slab.0.to_le_bytes());
    b[8..16].copy_from_slice(&u64::from(block).to_le_bytes());
    b[16..24].copy_from_slice(&version.to_le_bytes());
    let mut x = k.slab.0 ^ (u64::from(block) << 24) ^ version.rotate_left(40) ^ 0x9E37_79B9;
    let period = if version.is_multiple_of(2) { 64 } else { B };
    for i in (24..B).step_by(8) {
        if (i - 24) % period == 0 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        let n = (B - i).min(8);
        b[i..i + n].copy_from_slice(&x.to_le_bytes()[..n]);
    }
    b
}

fn blocks(k: ExtentKey, first: u32, n: u32, version: u64) -> (Vec<u8>, Vec<u32>) {
    let mut data = Vec::with_capacity(n as usize * B);
    for b in first..first + n {
        data.extend_from_slice(&content(k, b, version));
    }
    let crcs = data.chunks(B).map(crc32c::crc32c).collect();
    (data, crcs)
}

fn v(epoch: u64, n: u64) -> u64 {
    (epoch << 32) | n
}

fn ident(drive: u64, role: DriveRole) -> DriveIdentity {
    DriveIdentity {
        cluster: ClusterId(0xC0_4E_12_6E),
        node: NodeId(3),
        drive: DriveId(drive),
        slab_size_bytes: SLAB,
        role,
        media: MediaType::Ssd,
    }
}

fn file(dir: &Path, name: &str, len: u64) -> Arc<DirectFile> {
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    Arc::new(DirectFile::open(&p, Some(len)).expect("create the image file"))
}

fn main() {
    let out = std::env::args()
        .nth(1)
        .expect("usage: compat_images OUTDIR");
    let dir = Path::new(&out);
    std::fs::create_dir_all(dir).expect("create OUTDIR");
    let mut manifest = vec![format!(
        "engine format {} written by converge-engine {}",
        converge_engine::FORMAT_VERSION,
        env!("CARGO_PKG_VERSION")
    )];

    // drive.img
    let d = Drive::format_with(
        file(dir, "drive.img", DRIVE_BYTES),
        ident(11, DriveRole::Capacity),
        FormatOptions {
            journal_bytes: Some(1 << 20),
            ..Default::default()
        },
    )
    .expect("format drive.img");
    let w = |k: ExtentKey, epoch: u64, n: u64, first: u32, count: u32| {
        let (data, crcs) = blocks(k, first, count, v(epoch, n));
        d.write(
            k,
            Epoch(epoch),
            Version(v(epoch, n)),
            u64::from(first) * B as u64,
            &data,
            &crcs,
        )
        .expect("write");
    };
    // Plain extent (slab 0): all 64 blocks at 1.1, blocks 0..16 at 1.2, 32..40 trimmed
    // at 1.3; snapshot 1; then blocks 8..24 at 2.1 and 40..48 trimmed at 2.2 (the
    // snapshot keeps what they held).
    w(key(0), 1, 1, 0, 64);
    w(key(0), 1, 2, 0, 16);
    d.zero(
        key(0),
        Epoch(1),
        Version(v(1, 3)),
        32 * B as u64,
        8 * B as u64,
    )
    .expect("zero");
    d.set_snapshot_floor(key(0), Epoch(1), Epoch(1), None, FloorHistory::Continues)
        .expect("snapshot floor");
    w(key(0), 2, 1, 8, 16);
    d.zero(
        key(0),
        Epoch(2),
        Version(v(2, 2)),
        40 * B as u64,
        8 * B as u64,
    )
    .expect("zero");
    manifest.push("drive.img slab 0: 1.1 all, 1.2 [0,16), 1.3 zero [32,40), snapshot 1, 2.1 [8,24), 2.2 zero [40,48)".into());
    // lz4 extent (slab 1): 48 blocks at 2.4 (compressible: even n), then 8..12 at 2.5.
    d.set_codec(key(1), Epoch(2), Compression::Lz4)
        .expect("set_codec");
    w(key(1), 2, 4, 0, 48);
    w(key(1), 2, 5, 8, 4);
    manifest.push("drive.img slab 1 (lz4): 2.4 [0,48), 2.5 [8,12)".into());
    // Parity chunk (slab 2): 16 blocks at 2.6, then held writes at 2.7 over 4..8 (their
    // priors kept: an owner that finds the row incomplete reverts them).
    w(key(2), 2, 6, 0, 16);
    let (data, crcs) = blocks(key(2), 4, 4, v(2, 7));
    d.write_held(
        key(2),
        Epoch(2),
        Version(v(2, 7)),
        4 * B as u64,
        &data,
        &crcs,
    )
    .expect("write_held");
    manifest.push("drive.img slab 2: 2.6 [0,16), held 2.7 [4,8) over 2.6".into());

    // cached.img + cache.img: the writes stay in the cache's log.
    let cap = Arc::new(
        Drive::format_with(
            file(dir, "cached.img", DRIVE_BYTES),
            ident(12, DriveRole::Capacity),
            FormatOptions {
                journal_bytes: Some(1 << 20),
                ..Default::default()
            },
        )
        .expect("format cached.img"),
    );
    let mut caps = HashMap::new();
    caps.insert(DriveId(12), cap.clone());
    let (cache, _) = Cache::open(
        file(dir, "cache.img", CACHE_BYTES),
        ident(13, DriveRole::Cache),
        &caps,
    )
    .expect("format cache.img");
    let tier = Tier::new(cap.clone());
    tier.bind(cache.clone());
    for (first, count, n) in [(0u32, 32u32, 1u64), (16, 8, 2)] {
        let (data, crcs) = blocks(key(5), first, count, v(3, n));
        tier.write(
            key(5),
            Epoch(3),
            Version(v(3, n)),
            u64::from(first) * B as u64,
            &data,
            &crcs,
        )
        .expect("write through the cache");
    }
    let dirty = cache.stats().dirty_bytes;
    assert!(dirty > 0, "the writes are in the cache's log");
    manifest.push(format!(
        "cached.img slab 5 via cache.img: 3.1 [0,32), 3.2 [16,24); {dirty} bytes dirty in the log"
    ));
    std::fs::write(dir.join("manifest.txt"), manifest.join("\n") + "\n").expect("manifest");
    // As kill -9: no checkpoint, no destage, no clean close.
    std::process::exit(0);
}
