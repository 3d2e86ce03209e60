//! End-to-end: compressed volumes (docs/adr/0010) on a real lab — real etcd, real
//! `converged` processes, real clients (nbdcopy, qemu-img, fio with crc32c verify) and
//! real faults (kill -9 of a copy's node and of every node). The data must read back byte
//! for byte, the copies must agree, and what the copies store must be less than what they
//! hold when the data compresses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

const MIN: Duration = Duration::from_secs(60);

/// A file of `len` bytes that compresses: each 4 KiB block a random 64-byte pattern
/// repeated (a group of four blocks shrinks to one), with the block's number in front.
fn compressible_file(
    dir: &std::path::Path,
    name: &str,
    len: usize,
    seed: u64,
) -> std::path::PathBuf {
    use rand::{RngCore, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    for (i, blk) in v.chunks_mut(4096).enumerate() {
        let mut pat = [0u8; 64];
        r.fill_bytes(&mut pat);
        for (j, x) in blk.iter_mut().enumerate() {
            *x = pat[j % 64];
        }
        blk[..8].copy_from_slice(&(i as u64 + seed * 1_000_000).to_le_bytes());
    }
    let p = dir.join(name);
    std::fs::write(&p, v).unwrap();
    p
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// Every copy of every slab of `vol` stores at most `max_ratio` of what it holds.
fn copies_store_at_most(lab: &Lab, vol: &str, max_ratio: f64) {
    let v = lab.json(&["volume", "show", vol]);
    for e in v["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["extents"].as_array().unwrap())
    {
        let (w, st) = (u(e, "written_bytes"), u(e, "stored_bytes"));
        assert!(w > 0, "{v}");
        assert!(
            (st as f64) <= w as f64 * max_ratio,
            "a copy stores {st} of {w} written: {v}"
        );
    }
}

/// A mirror-2 volume with zstd: nbdcopy and qemu-img see exactly what was written, each
/// copy stores a quarter of it, `status` and `/metrics` count the saving; fio's
/// verifying 4 KiB random writes (read-modify-writes of compressed groups) pass; a copy
/// whose node was killed is resynced compressed; kill -9 of every node loses nothing;
/// `volume set` switches the codec for later writes; bad requests are refused with the
/// reason.
#[test]
fn compressed_volumes_store_less_read_back_exactly_and_survive_kill_9() {
    let lab = Lab::up(3, &["--ram"]);
    // Refused, with what to do.
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "64M",
        "--resiliency",
        "parity-2+1",
        "--compression",
        "zstd",
    ]);
    assert!(e.contains("parity") && e.contains("mirror"), "{e}");
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "64M",
        "--compression",
        "gzip",
    ]);
    assert!(e.contains("unknown compression"), "{e}");
    lab.must(&[
        "volume",
        "create",
        "cz",
        "--size",
        "256M",
        "--resiliency",
        "mirror-2",
        "--compression",
        "zstd",
        "--owner",
        "1",
    ]);
    let v = lab.json(&["volume", "show", "cz"]);
    assert_eq!(v["compression"], "zstd", "{v}");
    let uri = lab.uri("cz");

    // 128 MiB that compresses, in and out with nbdcopy, compared with qemu-img.
    let tmp = tempfile::tempdir().unwrap();
    let img = compressible_file(tmp.path(), "cz.img", 256 << 20, 1);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap(),
        "nbdcopy round trip differs"
    );
    compare(&uri, &img, "after nbdcopy");
    let v = lab.json(&["volume", "show", "cz"]);
    assert_eq!(u(&v, "written_bytes"), 256 << 20, "{v}");
    assert!(u(&v, "stored_bytes") <= 64 << 20, "{v}");
    copies_store_at_most(&lab, "cz", 0.26);
    let st = lab.json(&["status"]);
    let saved = u(&st["capacity"], "compression_saved_bytes");
    assert!(saved >= 2 * (192 << 20), "two copies each save 3/4: {st}");
    let stored_pool = u(&st["capacity"], "stored_bytes");
    assert!(stored_pool <= 2 * (64 << 20) + (1 << 20), "{st}");
    // The drives' own counters say the same.
    let (mut data, mut stored) = (0u64, 0u64);
    for n in 1..=3 {
        data += lab.metric(n, "converge_drive_data_bytes");
        stored += lab.metric(n, "converge_drive_stored_bytes");
    }
    assert_eq!(data, 2 * (256 << 20));
    assert_eq!(stored, stored_pool);

    // fio: 4 KiB random writes of half-compressible buffers into compressed groups,
    // verified while writing and again by a read-back pass.
    let job = |only: bool| {
        let a = vec![
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=64M",
            "--io_size=8M",
            "--randseed=7",
            "--buffer_compress_percentage=50",
            "--refill_buffers",
        ];
        verify_pass(&a, only)
    };
    let w = fio(&uri, &job(false));
    assert_eq!(fio_errors(&w), 0, "fio write+verify: {w}\n{}", lab.logs());
    let r = fio(&uri, &job(true));
    assert_eq!(fio_errors(&r), 0, "fio read-back verify: {r}");
    // Keep the image in step: re-read what fio wrote over its first 64 MiB.
    must(Command::new("nbdcopy").arg(&uri).arg(&img));

    // The copy on another node is killed and misses writes; it comes back through a
    // resync, which writes compressed too.
    let other = lab.json(&["volume", "show", "cz"])["slabs"][0]["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["node"].as_u64().unwrap())
        .find(|&n| n != 1)
        .unwrap();
    lab.must(&["lab", "fault", "kill", &other.to_string()]);
    let img = compressible_file(tmp.path(), "more.img", 256 << 20, 2);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    compare(&uri, &img, "written with a copy down");
    lab.must(&["lab", "fault", "restart", &other.to_string()]);
    lab.wait_for("the copies to catch up", 3 * MIN, || {
        all_in_sync(&lab, "cz")
    });
    assert_copies_agree(&lab, "cz");
    copies_store_at_most(&lab, "cz", 0.5);

    // kill -9 of every node, then everything back: nothing lost.
    lab.kill_all_and_restart(3);
    lab.wait_for("the volume to be served again", 2 * MIN, || {
        run(Command::new("nbdinfo").arg(&uri)).status.success()
    });
    compare(&uri, &img, "after kill -9 of every node");
    assert_copies_agree(&lab, "cz");

    // Switched off live: later writes are stored as written; what is stored stays read
    // back exactly. lz4 then compresses again.
    let e = lab.fails(&["volume", "set", "cz", "--compression", "gzip"]);
    assert!(e.contains("unknown compression"), "{e}");
    let out = lab.must(&["volume", "set", "cz", "--compression", "none"]);
    assert!(out.contains("compression none"), "{out}");
    let img = compressible_file(tmp.path(), "plain.img", 256 << 20, 3);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    compare(&uri, &img, "after compression was switched off");
    let v = lab.json(&["volume", "show", "cz"]);
    assert_eq!(v["compression"], "none", "{v}");
    assert_eq!(
        u(&v, "stored_bytes"),
        u(&v, "written_bytes"),
        "rewritten whole with compression off, stored as written: {v}"
    );
    lab.must(&["volume", "set", "cz", "--compression", "lz4"]);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let v = lab.json(&["volume", "show", "cz"]);
    assert_eq!(v["compression"], "lz4", "{v}");
    copies_store_at_most(&lab, "cz", 0.26);
    compare(&uri, &img, "after lz4");
    // A parity volume cannot be switched to compression.
    lab.create_owned("p", "64M", "parity-2+1", 1);
    let e = lab.fails(&["volume", "set", "p", "--compression", "zstd"]);
    assert!(e.contains("parity"), "{e}");
}

/// Thin drives (docs/adr/0010): a compressed volume may be provisioned up to the drives'
/// extent slots (twice what they hold plain; with the overcommit ratio at 2, as
/// docs/CAPACITY.md says), and once its data is written compressed,
/// placement counts its extents by what they store, so plain volumes still find room; a
/// plain volume larger than what the drives hold is refused, as is one more slab than
/// there are slots.
#[test]
fn compressed_volumes_hold_more_than_the_drives_hold_plain() {
    // Two drives of 160 MiB per node (the lab's), slabs of 32 MiB.
    let lab = Lab::up(3, &["--ram", "--drive-size", "160M", "--slab-size", "32M"]);
    let drives = lab.json(&["drive", "list"]);
    let per_node = |d: &serde_json::Value, node: u64, k: &str| -> u64 {
        d.as_array()
            .unwrap()
            .iter()
            .filter(|x| x["node"].as_u64() == Some(node) && x["role"] == "capacity")
            .map(|x| x[k].as_u64().unwrap_or(0))
            .sum()
    };
    let plain_extents = per_node(&drives, 1, "extents_total");
    let slots = per_node(&drives, 1, "slots_total");
    assert_eq!(slots, 2 * plain_extents, "{drives}");
    // More than the drives hold plain: refused for a plain volume...
    let too_big = format!("{}M", (plain_extents + 1) * 32);
    let e = lab.fails(&[
        "volume",
        "create",
        "plain",
        "--size",
        &too_big,
        "--resiliency",
        "mirror-3",
    ]);
    assert!(e.contains("cannot create volume"), "{e}");
    // ... but provisioned for a compressed one, up to the slots, once the overcommit
    // ratio allows twice the raw capacity (the default, 1.0, allows none beyond it).
    lab.must(&["cluster", "set", "--overcommit-ratio", "2"]);
    let slabs = slots - 2;
    let size = format!("{}M", slabs * 32);
    lab.must(&[
        "volume",
        "create",
        "big",
        "--size",
        &size,
        "--resiliency",
        "mirror-3",
        "--compression",
        "zstd",
        "--owner",
        "1",
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let img = compressible_file(tmp.path(), "big.img", ((slabs * 32) as usize) << 20, 5);
    let uri = lab.uri("big");
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    compare(&uri, &img, "the compressed volume, written whole");
    // Every drive holds more extents than it could plain, in a quarter of their room,
    // once its node has reported it.
    lab.wait_for("the drives' usage to be reported", MIN, || {
        let d = lab.json(&["drive", "list"]);
        (1..=3).all(|n| {
            per_node(&d, n, "committed_bytes") == slabs * (8 << 20)
                && per_node(&d, n, "extents_used") == slabs
        })
    });
    let st = lab.json(&["status"]);
    assert_eq!(
        u(&st["capacity"], "used_bytes"),
        3 * slabs * (8 << 20),
        "{st}"
    );
    // A plain volume fits in the room compression left (two slabs: the slots left).
    lab.must(&[
        "volume",
        "create",
        "p2",
        "--size",
        "64M",
        "--resiliency",
        "mirror-3",
    ]);
    let img2 = random_file(tmp.path(), "p2.img", 64 << 20, 6);
    let uri2 = lab.uri("p2");
    must(Command::new("nbdcopy").arg(&img2).arg(&uri2));
    compare(&uri2, &img2, "the plain volume beside it");
    // Every slot is taken now: one more slab of anything is refused.
    let e = lab.fails(&[
        "volume",
        "create",
        "more",
        "--size",
        "32M",
        "--resiliency",
        "mirror-3",
        "--compression",
        "lz4",
    ]);
    assert!(e.contains("cannot create volume"), "{e}");
    compare(&uri, &img, "the compressed volume, at the end");
    assert_copies_agree(&lab, "big");
}

/// Snapshots of a compressed volume (docs/SNAPSHOTS.md): a state a snapshot reads that is
/// a member of a compressed group is copied out of its stream when it is replaced. The
/// snapshot holds the image acked before it through fio's verifying 4 KiB writes into
/// compressed groups, through a whole overwrite after the codec was turned off (plain
/// writes of blocks still packed), and through kill -9 of every node; every copy keeps
/// each replaced block once; a rollback brings the image back, and deleting the snapshot
/// returns its space. A compressed clone of the snapshot reads as it, keeps its own
/// (unaligned) write, and keeps both through a flatten.
#[test]
fn snapshots_of_a_compressed_volume_hold_what_was_acked_through_overwrites_and_kill_9() {
    require_tools();
    let lab = Lab::up(3, &["--ram"]);
    lab.must(&[
        "volume",
        "create",
        "cs",
        "--size",
        "64M",
        "--resiliency",
        "mirror-3",
        "--compression",
        "lz4",
        "--owner",
        "2",
    ]);
    let uri = lab.uri("cs");
    let tmp = tempfile::tempdir().unwrap();
    let a = compressible_file(tmp.path(), "a.img", 64 << 20, 21);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));
    copies_store_at_most(&lab, "cs", 0.5);
    lab.must(&["volume", "snapshot", "create", "cs", "s1"]);
    let s1 = snap_uri(&lab, "cs", "s1");

    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=64M",
        "--io_size=16M",
        "--randrepeat=0",
    ];
    let v = fio(&uri, &verify_pass(&job, false));
    assert_eq!(fio_errors(&v), 0, "fio verify into compressed groups: {v}");
    compare(&s1, &a, "s1 after 4 KiB writes into its compressed groups");

    lab.must(&["volume", "set", "cs", "--compression", "none"]);
    let b = compressible_file(tmp.path(), "b.img", 64 << 20, 22);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    compare(&s1, &a, "s1 after an overwrite with the codec off");
    compare(&uri, &b, "the volume after the overwrite");
    // Every block of the image was replaced: each of the three copies keeps it once.
    let preserved = |lab: &Lab| -> u64 {
        (1..=3)
            .map(|n| lab.metric(n, "converge_drive_preserved_bytes"))
            .sum()
    };
    assert_eq!(preserved(&lab), 3 * (64 << 20));

    lab.kill_all_and_restart(3);
    compare(&s1, &a, "s1 after kill -9 of every node");
    compare(&uri, &b, "the volume after kill -9 of every node");

    // A compressed clone of it: reads as s1, stores its own writes compressed, and keeps
    // them through a flatten.
    let e = lab.fails(&["volume", "clone", "cs@s1", "cc", "--compression", "gzip"]);
    assert!(e.contains("unknown compression"), "{e}");
    lab.must(&[
        "volume",
        "clone",
        "cs@s1",
        "cc",
        "--compression",
        "zstd",
        "--owner",
        "1",
    ]);
    let v = lab.json(&["volume", "show", "cc"]);
    assert_eq!(v["compression"], "zstd", "{v}");
    let cc = lab.uri("cc");
    compare(&cc, &a, "the clone reads as s1");
    // 1 MiB of a short repeating pattern, at an unaligned offset.
    let (off, len) = ((3 << 20) + 512, 1 << 20);
    let script = format!(
        r#"
import nbd, sys
h = nbd.NBD()
# No block-size negotiation: the unaligned write is allowed (the owner reads, patches
# and writes back its edge blocks).
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_uri(sys.argv[1])
h.pwrite(bytes((i * 7) % 251 for i in range({len})), {off})
h.flush()
h.shutdown()
print("ok")
"#
    );
    nbd_script(&script, &cc);
    let mut want = std::fs::read(&a).unwrap();
    for i in 0..len {
        want[off + i] = ((i * 7) % 251) as u8;
    }
    let expected = tmp.path().join("cc.img");
    std::fs::write(&expected, &want).unwrap();
    compare(&cc, &expected, "the clone after its write");
    lab.must(&["volume", "flatten", "cc"]);
    compare(&cc, &expected, "the clone after its flatten");
    lab.must(&["volume", "delete", "cc"]);

    lab.must(&["volume", "snapshot", "rollback", "cs", "s1", "--yes"]);
    compare(&uri, &a, "the volume rolled back to s1");
    lab.must(&["volume", "snapshot", "delete", "cs", "s1"]);
    assert_eq!(
        preserved(&lab),
        0,
        "deleting the snapshot returns its space"
    );
    compare(&uri, &a, "the volume after deleting its snapshot");
}
