//! Images written by earlier releases open and read back whole with this build: a
//! capacity drive (plain, compressed and parity extents, a snapshot, trimmed blocks, held
//! writes, an unfolded journal) and a capacity drive behind a cache drive whose log holds
//! writes never destaged. They were written by `examples/compat_images.rs` of the release
//! named by their directory and left as kill -9 leaves them (tests/compat/README.md). A
//! change to the formats that cannot read them fails here: bump the format version and
//! keep reading the old one (docs/OPERATIONS.md, "Upgrades").

#![allow(clippy::unwrap_used)] // tests: a failed step is the failure we want to see

use converge_engine::{BlockFile, Cache, DirectFile, Drive, Tier};
use converge_types::{DriveId, Epoch, ExtentKey, SlabIndex, Version, VolumeId};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const B: usize = 4096;

/// Every release whose images this build must open.
const RELEASES: &[&str] = &["v0.1.0"];

fn key(slab: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(42),
        slab: SlabIndex(slab),
    }
}

/// The generator's content function, restated: a block's bytes from its key, block and
/// version (compressible every other version).
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

fn v(epoch: u64, n: u64) -> u64 {
    (epoch << 32) | n
}

/// What a block must read as: written at a version, or zeros (trimmed or never written).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    At(u64),
    Zero,
}

/// Expected state of `count` blocks: `base`, then each (first, end, want) over it.
fn expect(count: u32, base: Want, over: &[(u32, u32, Want)]) -> Vec<Want> {
    let mut w = vec![base; count as usize];
    for &(a, b, x) in over {
        for s in &mut w[a as usize..b as usize] {
            *s = x;
        }
    }
    w
}

fn check(what: &str, k: ExtentKey, buf: &[u8], want: &[Want]) {
    for (b, w) in want.iter().enumerate() {
        let got = &buf[b * B..(b + 1) * B];
        let ok = match w {
            Want::At(ver) => got == content(k, b as u32, *ver).as_slice(),
            Want::Zero => got.iter().all(|&x| x == 0),
        };
        assert!(
            ok,
            "{what}: block {b} should be {w:?}, reads version {:#x} of slab {} block {}",
            u64::from_le_bytes(got[16..24].try_into().unwrap()),
            u64::from_le_bytes(got[..8].try_into().unwrap()),
            u64::from_le_bytes(got[8..16].try_into().unwrap()),
        );
    }
}

/// The image, decompressed into a file of its own (it is opened read-write: replay
/// writes).
fn unpack(dir: &Path, release: &str, name: &str) -> Arc<dyn BlockFile> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/compat")
        .join(release)
        .join(format!("{name}.zst"));
    let packed = std::fs::read(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let bytes = zstd::decode_all(packed.as_slice()).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    Arc::new(DirectFile::open(&path, None).unwrap())
}

fn read(d: &Drive, k: ExtentKey, epoch: u64, blocks: u32) -> Vec<u8> {
    let mut buf = vec![0u8; blocks as usize * B];
    let info = d.read(k, Epoch(epoch), 0, &mut buf).unwrap();
    assert!(info.bad_blocks.is_empty(), "{k:?}: bad blocks {info:?}");
    buf
}

#[test]
fn drive_and_journal_images_of_earlier_releases_read_back_whole() {
    for release in RELEASES {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let d = Drive::open(unpack(dir.path(), release, "drive.img"))
            .unwrap_or_else(|e| panic!("{release}: drive.img does not open: {e}"));
        // Slab 0: live state, and snapshot 1's.
        let live = expect(
            64,
            Want::At(v(1, 1)),
            &[
                (0, 16, Want::At(v(1, 2))),
                (8, 24, Want::At(v(2, 1))),
                (32, 40, Want::Zero),
                (40, 48, Want::Zero),
            ],
        );
        check(
            &format!("{release} slab 0"),
            key(0),
            &read(&d, key(0), 3, 64),
            &live,
        );
        let mut buf = vec![0u8; 64 * B];
        let info = d.read_at(key(0), Epoch(3), Epoch(1), 0, &mut buf).unwrap();
        assert!(info.bad_blocks.is_empty());
        let snap = expect(
            64,
            Want::At(v(1, 1)),
            &[(0, 16, Want::At(v(1, 2))), (32, 40, Want::Zero)],
        );
        check(
            &format!("{release} slab 0 at snapshot 1"),
            key(0),
            &buf,
            &snap,
        );
        // Slab 1, compressed.
        let lz4 = expect(
            64,
            Want::At(v(2, 4)),
            &[(8, 12, Want::At(v(2, 5))), (48, 64, Want::Zero)],
        );
        check(
            &format!("{release} slab 1 (lz4)"),
            key(1),
            &read(&d, key(1), 3, 64),
            &lz4,
        );
        // Slab 2: the held writes read, and their priors are still held.
        let held = expect(
            64,
            Want::At(v(2, 6)),
            &[(4, 8, Want::At(v(2, 7))), (16, 64, Want::Zero)],
        );
        check(
            &format!("{release} slab 2"),
            key(2),
            &read(&d, key(2), 3, 64),
            &held,
        );
        let priors = d.priors(key(2), 0, 8).unwrap();
        for (b, (cur, prior)) in priors.iter().enumerate() {
            let want = if (4..8).contains(&b) {
                (Version(v(2, 7)), Some(Version(v(2, 6))))
            } else {
                (Version(v(2, 6)), None)
            };
            assert_eq!((*cur, *prior), want, "{release} slab 2 block {b}");
        }
        // Reverting the row brings the priors back, as an owner would after a crash.
        assert_eq!(
            d.revert(key(2), Epoch(3), Version(v(2, 7)), 0, 8 * B as u64)
                .unwrap(),
            4
        );
        check(
            &format!("{release} slab 2 reverted"),
            key(2),
            &read(&d, key(2), 3, 64),
            &expect(64, Want::At(v(2, 6)), &[(16, 64, Want::Zero)]),
        );
        // And the drive takes new writes and reopens with them.
        let data = content(key(0), 63, v(3, 1));
        d.write(
            key(0),
            Epoch(3),
            Version(v(3, 1)),
            63 * B as u64,
            &data,
            &[crc32c::crc32c(&data)],
        )
        .unwrap();
        drop(d);
        let d = Drive::open(Arc::new(
            DirectFile::open(&dir.path().join("drive.img"), None).unwrap(),
        ))
        .unwrap();
        let mut after = live.clone();
        after[63] = Want::At(v(3, 1));
        check(
            &format!("{release} slab 0 reopened"),
            key(0),
            &read(&d, key(0), 3, 64),
            &after,
        );
    }
}

#[test]
fn cache_images_of_earlier_releases_destage_their_log() {
    for release in RELEASES {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let cap = Arc::new(
            Drive::open(unpack(dir.path(), release, "cached.img"))
                .unwrap_or_else(|e| panic!("{release}: cached.img does not open: {e}")),
        );
        let mut caps = HashMap::new();
        caps.insert(DriveId(12), cap.clone());
        let cache_file = unpack(dir.path(), release, "cache.img");
        let blank = converge_engine::DriveIdentity {
            drive: DriveId(99),
            ..cap.identity().clone()
        };
        let (cache, report) = Cache::open(cache_file, blank, &caps)
            .unwrap_or_else(|e| panic!("{release}: cache.img does not open: {e}"));
        assert!(!report.formatted, "{release}: the cache kept its log");
        let want = expect(
            64,
            Want::At(v(3, 1)),
            &[(16, 24, Want::At(v(3, 2))), (32, 64, Want::Zero)],
        );
        // Opening destaged the log: the capacity drive alone holds every acked write.
        check(
            &format!("{release} cached.img after the cache opened"),
            key(5),
            &read(&cap, key(5), 4, 64),
            &want,
        );
        let tier = Tier::new(cap.clone());
        tier.bind(cache.clone());
        let mut buf = vec![0u8; 64 * B];
        tier.read(key(5), Epoch(4), 0, &mut buf).unwrap();
        check(&format!("{release} through the cache"), key(5), &buf, &want);
        cache.stop();
    }
}

/// docs/FORMAT.md names this build's drive and cache format versions.
#[test]
fn format_md_names_this_builds_drive_and_cache_formats() {
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/FORMAT.md"),
    )
    .unwrap();
    let row = |what: &str| {
        doc.lines()
            .find(|l| l.starts_with(&format!("| {what}")))
            .unwrap_or_else(|| panic!("docs/FORMAT.md has no row for {what}"))
            .to_string()
    };
    let drive = row("drive layout");
    assert!(
        drive.contains(&format!(
            "| engine format {} | engine formats {}–{} |",
            converge_engine::FORMAT_VERSION,
            converge_engine::layout::FORMAT_VERSION_MIN,
            converge_engine::FORMAT_VERSION
        )),
        "docs/FORMAT.md's drive row disagrees with the code: {drive}"
    );
    let cache = row("cache drive");
    let v = converge_engine::CACHE_FORMAT_VERSION;
    assert!(
        cache.contains(&format!("| cache format {v} | cache format {v} |")),
        "docs/FORMAT.md's cache row disagrees with the code: {cache}"
    );
}
