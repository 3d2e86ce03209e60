//! End-to-end: parity volumes (docs/adr/0008) on a real lab — real etcd, real `converged`
//! processes, real clients (fio with crc32c verify, nbdcopy, qemu-img, qemu-io) and real
//! faults (kill -9, bits flipped in drive files). Every test checks the data byte for
//! byte, and that the chunks agree (a scrub that checks versions, checksums and parity
//! finds nothing).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

const MIN: Duration = Duration::from_secs(60);

fn qemu_io(uri: &str, cmd: &str) {
    let out = must(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, uri]));
    assert!(
        !out.contains("error") && !out.contains("failed"),
        "qemu-io {cmd}: {out}"
    );
}

/// Applies `pattern` bytes at [off, off+len) of the local expected image.
fn patch(path: &std::path::Path, off: u64, len: usize, pattern: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![pattern; len], off).unwrap();
}

/// Per slab, its chunks' nodes in chunk order (data chunks first).
fn chunk_nodes(lab: &Lab, vol: &str) -> Vec<Vec<u64>> {
    let v = lab.json(&["volume", "show", vol]);
    v["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s["extents"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["node"].as_u64().unwrap())
                .collect()
        })
        .collect()
}

/// parity-2+1 and parity-2+2 volumes on 4 nodes: real clients' writes verify; each
/// slab's chunks are on distinct nodes; reads decode around one node down (2+1) and two
/// (2+2), writes go on with one down, and the down node's chunks catch up when it returns.
#[test]
fn parity_volumes_serve_real_clients_and_lose_nothing_with_m_nodes_down() {
    let lab = Lab::up(4, &["--ram"]);
    for (r, why) in [
        ("parity-4+2", "parity-4+2 needs 6 nodes"),
        ("parity-1+1", "parity"),
    ] {
        let e = lab.fails(&["volume", "create", "x", "--size", "64M", "--resiliency", r]);
        assert!(e.contains(why), "{e}");
    }
    lab.create_owned("p21", "256M", "parity-2+1", 1);
    lab.create_owned("p22", "128M", "parity-2+2", 1);
    let v = lab.json(&["volume", "show", "p21"]);
    assert_eq!(v["resiliency"], "parity-2+1", "{v}");
    assert_eq!(v["min_replicas"], 2, "{v}");
    let uri = lab.uri("p21");
    let info = must(Command::new("nbdinfo").arg("--json").arg(&uri));
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["exports"][0]["export-size"].as_u64(), Some(256 << 20));

    // fio random writes with crc32c verify, then a separate read-back verify pass.
    let args = |only: bool| {
        let a = vec![
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=256M",
            "--io_size=16M",
            "--randseed=43",
        ];
        verify_pass(&a, only)
    };
    let w = fio(&uri, &args(false));
    assert_eq!(fio_errors(&w), 0, "fio write+verify: {w}\n{}", lab.logs());
    let r = fio(&uri, &args(true));
    assert_eq!(fio_errors(&r), 0, "fio read-back verify: {r}");
    assert!(r["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0) >= 16 << 20);

    // nbdcopy in and out, qemu-img compare; a 128 KiB-unaligned qemu-io write on top.
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "p21.img", 256 << 20, 21);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap(),
        "nbdcopy round trip differs"
    );
    qemu_io(&uri, "write -P 0x5a 12288 135168");
    patch(&img, 12288, 135168, 0x5a);
    compare(&uri, &img, "after writes");
    let img22 = random_file(tmp.path(), "p22.img", 128 << 20, 22);
    let uri22 = lab.uri("p22");
    must(Command::new("nbdcopy").arg(&img22).arg(&uri22));

    // Two slabs of 128 MiB (2 × 64 MiB extents of data each), 3 chunks on 3 nodes; the
    // 2+2 volume's one slab has 4 chunks on the 4 nodes.
    let p21 = chunk_nodes(&lab, "p21");
    assert_eq!(p21.len(), 2, "{p21:?}");
    for s in &p21 {
        assert_eq!(s.iter().collect::<BTreeSet<_>>().len(), 3, "{p21:?}");
    }
    let p22 = chunk_nodes(&lab, "p22");
    assert_eq!(p22.len(), 1, "{p22:?}");
    assert_eq!(p22[0].iter().collect::<BTreeSet<_>>().len(), 4, "{p22:?}");
    assert!(all_in_sync(&lab, "p21") && all_in_sync(&lab, "p22"));
    let st = lab.json(&["status"]);
    assert_eq!(st["health"], "healthy", "{st}");
    // Written bytes count volume data once, from the data chunks (every chunk of every
    // slab was written whole: parity chunks hold as much, and are not counted).
    assert_eq!(st["capacity"]["written_bytes"], 384 << 20, "{st}");
    let v = lab.json(&["volume", "show", "p21"]);
    assert_eq!(v["written_bytes"], 256 << 20, "{v}");
    // Two slabs of two 64 MiB data chunks each.
    assert_eq!(v["allocated_bytes"], 256 << 20, "{v}");
    assert_eq!(v["slabs_allocated"], 2, "{v}");
    for e in v["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["extents"].as_array().unwrap())
    {
        assert_eq!(e["written_bytes"], 64 << 20, "{v}");
    }

    // Node 2 and 3 down (the owner, node 1, stays): 2+2 reads decode around both.
    lab.must(&["lab", "fault", "kill", "2"]);
    lab.must(&["lab", "fault", "kill", "3"]);
    compare(&uri22, &img22, "parity-2+2 with two nodes down");
    lab.must(&["lab", "fault", "restart", "3"]);
    // One node down: 2+1 reads decode around it, and writes go on.
    compare(&uri, &img, "parity-2+1 with node 2 down");
    qemu_io(&uri, "write -P 0x77 1048576 4194304");
    patch(&img, 1 << 20, 4 << 20, 0x77);
    qemu_io(&uri22, "write -P 0x78 0 65536");
    patch(&img22, 0, 65536, 0x78);
    compare(&uri, &img, "parity-2+1 written with node 2 down");
    compare(&uri22, &img22, "parity-2+2 written with node 2 down");
    lab.must(&["lab", "fault", "restart", "2"]);
    lab.wait_for("the chunks to catch up", 3 * MIN, || {
        all_in_sync(&lab, "p21") && all_in_sync(&lab, "p22")
    });
    assert!(lab.metric(1, "converge_resync_jobs_done_total") >= 1);
    // Node 2's chunks alone with parity now: with the other nodes down the data must come
    // from what the resync wrote.
    compare(&uri, &img, "after the resync");
    compare(&uri22, &img22, "after the resync");
    assert_copies_agree(&lab, "p21");
    assert_copies_agree(&lab, "p22");
}

/// Bits flipped in a data chunk are found by scrub, exactly, and repaired from the other
/// chunks; a node gone past the repair delay has its chunk rebuilt on the fourth node,
/// every row of it.
#[test]
fn scrub_and_rebuild_of_parity_chunks_count_exactly() {
    let lab = Lab::up(4, &[]);
    lab.create_owned("s", "64M", "parity-2+1", 1);
    let tmp = tempfile::tempdir().unwrap();
    // The node of data chunk 0 (even volume blocks).
    qemu_io(&lab.uri("s"), "write -P 1 0 4096");
    let chunks = chunk_nodes(&lab, "s");
    assert_eq!(chunks.len(), 1, "{chunks:?}");
    let node = chunks[0][0] as u32;
    let (img, flipped) = write_marked_and_flip(&lab, "s", tmp.path(), node, 200..206);
    // Blocks 200, 202 and 204 are data chunk 0's rows 100-102.
    assert_eq!(flipped.len(), 3, "{flipped:?}");
    let r = &lab.json(&["scrub", "start", "s", "--wait", "--no-repair"])[0];
    assert_eq!(r["bad_checksums"], 3, "{r}\n{}", lab.logs());
    assert_eq!(r["repaired"], 0, "{r}");
    // Scrub checks a slab's rows: 16384 (a 64 MiB chunk's blocks), half of them data.
    assert_eq!(r["blocks_checked"], 16384, "{r}");
    let r = &lab.json(&["scrub", "start", "s", "--wait"])[0];
    assert_eq!(
        (&r["bad_checksums"], &r["repaired"]),
        (&3.into(), &3.into()),
        "{r}"
    );
    assert_copies_agree(&lab, "s");
    compare(&lab.uri("s"), &img, "after scrub");

    // A chunk's node gone past the repair delay: rebuilt on the node without a chunk.
    lab.must(&["cluster", "set", "--repair-delay", "3s"]);
    let victim = *chunks[0].iter().find(|&&n| n != 1).unwrap();
    let spare = (1..=4u64).find(|n| !chunks[0].contains(n)).unwrap();
    let before = lab.metric(1, "converge_repair_blocks_written_total");
    lab.must(&["lab", "fault", "kill", &victim.to_string()]);
    let uri = lab.uri("s");
    qemu_io(&uri, "write -P 0x33 65536 65536");
    patch(&img, 65536, 65536, 0x33);
    lab.wait_for("the rebuild", 3 * MIN, || {
        let c = chunk_nodes(&lab, "s");
        !c[0].contains(&victim) && all_in_sync(&lab, "s")
    });
    let c = chunk_nodes(&lab, "s");
    let pos = chunks[0].iter().position(|&n| n == victim).unwrap();
    assert_eq!(
        c[0][pos], spare,
        "the chunk keeps its place: {chunks:?} -> {c:?}"
    );
    assert_eq!(
        lab.metric(1, "converge_repair_blocks_written_total") - before,
        16384,
        "a 64 MiB chunk rebuilt row by row"
    );
    compare(&uri, &img, "after the rebuild");
    assert_copies_agree(&lab, "s");
    lab.must(&["lab", "fault", "restart", &victim.to_string()]);
}

/// Mirror-accelerated parity (docs/adr/0009) on 3 nodes: parity-2+1 with a mirror part of
/// half the volume (4 extents of 64 MiB, mirror-2). New data lands mirrored; when the part
/// is full the coldest span rotates into parity in the background (a job of its owner),
/// and every byte fio wrote verifies before, after, and with a node killed.
#[test]
fn mirror_accelerated_parity_lands_writes_mirrored_and_rotates_cold_data_into_parity() {
    let lab = Lab::up(3, &["--ram"]);
    for (args, why) in [
        (
            vec!["--resiliency", "mirror-3", "--mirror-part", "64M"],
            "needs a parity-K+1 or parity-K+2",
        ),
        (
            vec!["--resiliency", "parity-2+1", "--mirror-part", "1G"],
            "larger than the volume",
        ),
        (
            vec!["--resiliency", "parity-2+1", "--mirror-part", "150%"],
            "at most 100 %",
        ),
        (
            vec!["--resiliency", "parity-2+1", "--mirror-part", "x%"],
            "is not a share",
        ),
    ] {
        let mut a = vec!["volume", "create", "bad", "--size", "512M"];
        a.extend(args);
        let e = lab.fails(&a);
        assert!(e.contains(why), "{a:?}: {e}");
    }
    lab.must(&[
        "volume",
        "create",
        "map",
        "--size",
        "512M",
        "--resiliency",
        "parity-2+1",
        "--mirror-part",
        "50%",
        "--owner",
        "1",
    ]);
    let v = lab.json(&["volume", "show", "map"]);
    assert_eq!(v["mirror_part"]["size_bytes"], 256 << 20, "{v}");
    assert_eq!(v["mirror_part"]["resiliency"], "mirror-2", "{v}");
    let uri = lab.uri("map");
    // fio jobs that write (and verify) one 128 MiB span each, and read it back alone.
    let job = |offset: &'static str, rw: &'static str, only: bool| {
        let a = vec![
            rw,
            "--bs=64k",
            "--iodepth=8",
            offset,
            "--size=128M",
            "--randseed=7",
        ];
        verify_pass(&a, only)
    };
    // Span 0 (128 MiB): two extents in the mirror part, half of it.
    let a = fio(&uri, &job("--offset=0", "--rw=write", false));
    assert_eq!(fio_errors(&a), 0, "{a}\n{}", lab.logs());
    assert_eq!(
        slab_layout(&lab, "map"),
        [("m0".to_string(), 2), ("m1".to_string(), 2)]
    );
    let v = lab.json(&["volume", "show", "map"]);
    assert_eq!(v["mirror_part"]["mirror_bytes"], 128 << 20, "{v}");
    assert_eq!(v["mirror_part"]["parity_bytes"], 0, "{v}");
    assert_eq!(v["allocated_bytes"], 128 << 20, "{v}");
    // Span 1 fills the part: above 85 %, span 0 (written longer ago) rotates into
    // parity, down to 50 %.
    let b = fio(&uri, &job("--offset=128M", "--rw=randwrite", false));
    assert_eq!(fio_errors(&b), 0, "{b}\n{}", lab.logs());
    lab.wait_for("the rotation of span 0", 3 * MIN, || {
        lab.json(&["volume", "show", "map"])["mirror_part"]["rotations"] == 1
    });
    assert_eq!(
        slab_layout(&lab, "map"),
        [
            ("0".to_string(), 3),
            ("m2".to_string(), 2),
            ("m3".to_string(), 2)
        ]
    );
    let v = lab.json(&["volume", "show", "map"]);
    let mp = &v["mirror_part"];
    assert_eq!(
        (
            &mp["mirror_bytes"],
            &mp["parity_bytes"],
            &mp["rotated_bytes"]
        ),
        (
            &(128u64 << 20).into(),
            &(128u64 << 20).into(),
            &(128u64 << 20).into()
        ),
        "{v}"
    );
    assert_eq!(v["allocated_bytes"], 256 << 20, "{v}");
    assert_eq!(v["written_bytes"], 256 << 20, "{v}");
    assert_eq!(lab.metric(1, "converge_volume_rotations_total"), 1);
    assert_eq!(
        lab.metric_where(1, "converge_volume_mirror_part_bytes", "part=\"mirror\"") as u64,
        128 << 20
    );
    // The mirror part's copies were freed: 2 extents × 2 copies of span 1 and 3 chunks of
    // span 0 are all that the drives hold.
    let st = lab.json(&["status"]);
    assert_eq!(st["capacity"]["used_bytes"], 7 * (64u64 << 20), "{st}");
    for (off, what) in [
        ("--offset=0", "span 0, from parity"),
        ("--offset=128M", "span 1, mirrored"),
    ] {
        let r = fio(&uri, &job(off, "--rw=read", true));
        assert_eq!(fio_errors(&r), 0, "{what}: {r}");
        assert_eq!(r["jobs"][0]["read"]["io_bytes"], 128 << 20, "{what}: {r}");
    }
    // A node down: span 0 decodes around it, span 1 reads its other copy; a write to each
    // goes on.
    lab.must(&["lab", "fault", "kill", "3"]);
    for (off, what) in [("--offset=0", "span 0"), ("--offset=128M", "span 1")] {
        let r = fio(&uri, &job(off, "--rw=read", true));
        assert_eq!(fio_errors(&r), 0, "{what} with node 3 down: {r}");
    }
    qemu_io(&uri, "write -P 0x44 4096 8192");
    qemu_io(&uri, "write -P 0x45 134221824 8192");
    lab.must(&["lab", "fault", "restart", "3"]);
    lab.wait_for("the copies to catch up", 3 * MIN, || {
        all_in_sync(&lab, "map")
    });
    assert_copies_agree(&lab, "map");
    qemu_io(&uri, "read -P 0x44 4096 8192");
    qemu_io(&uri, "read -P 0x45 134221824 8192");
}

/// kill -9 of the owner while it rotates a span into parity (after the copy started,
/// before the flip): the next owner finds the span in both layouts, keeps the mirror (the
/// truth until the flip), releases the half-written parity slab and rotates the span
/// again; every byte fio wrote verifies.
#[test]
fn a_rotation_cut_by_kill_9_leaves_the_mirror_the_truth() {
    let lab = Lab::up(3, &["--ram"]);
    // Node 1 copies at 4 MiB/s: a 128 MiB span takes half a minute to rotate.
    let conf = lab.path().join("node1").join("converged.toml");
    let toml = std::fs::read_to_string(&conf).unwrap();
    let toml = toml.replacen("[knobs]\n", "[knobs]\nresync_bytes_per_s = 4194304\n", 1);
    std::fs::write(&conf, toml).unwrap();
    lab.must(&["lab", "fault", "kill", "1"]);
    lab.must(&["lab", "fault", "restart", "1"]);
    lab.must(&[
        "volume",
        "create",
        "cut",
        "--size",
        "256M",
        "--resiliency",
        "parity-2+1",
        "--mirror-part",
        "128M",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("cut");
    let job = |only: bool| {
        let a = vec![
            "--rw=randwrite",
            "--bs=16k",
            "--iodepth=8",
            "--size=128M",
            "--io_size=32M",
            "--randseed=9",
        ];
        verify_pass(&a, only)
    };
    let w = fio(&uri, &job(false));
    assert_eq!(fio_errors(&w), 0, "{w}\n{}", lab.logs());
    lab.wait_for("the rotation to be under way", 3 * MIN, || {
        lab.json(&["status"])["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["kind"] == "rotate" && j["bytes_done"].as_u64().unwrap_or(0) > 0)
    });
    lab.must(&["lab", "fault", "kill", "1"]);
    // Node 2 takes the volume over (a client opens it there) and reads it whole.
    let uri2 = lab.uri_on("cut", 2);
    let r = fio(&uri2, &job(true));
    assert_eq!(fio_errors(&r), 0, "after the kill: {r}\n{}", lab.logs());
    lab.wait_for("node 2 to rotate the span again", 3 * MIN, || {
        lab.metric(2, "converge_volume_rotations_total") == 1
    });
    assert!(
        lab.logs().contains("a rotation that did not finish"),
        "the leftover parity slab was released:\n{}",
        lab.logs()
    );
    assert_eq!(slab_layout(&lab, "cut"), [("0".to_string(), 3)]);
    let r = fio(&uri2, &job(true));
    assert_eq!(fio_errors(&r), 0, "after the new rotation: {r}");
    lab.must(&["lab", "fault", "restart", "1"]);
    assert_copies_agree(&lab, "cut");
}
