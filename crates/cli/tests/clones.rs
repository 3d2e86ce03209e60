//! End-to-end: clones (docs/SNAPSHOTS.md "Clones") on a real lab — real etcd, real
//! `converged` processes, real clients (nbdcopy, qemu-img, fio with crc32c verify, libnbd)
//! and kill -9 of every node. One golden image, 50 clones written independently (owned by
//! every node, so most read their parent through another), each reading as the golden
//! image plus its own writes; the parent snapshot stays however the parent changes, and
//! cannot be deleted while a clone reads it; a clone has snapshots of its own; flatten cuts
//! the link while the data stays.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

const CLONES: usize = 50;
const SIZE: usize = 64 << 20;

/// Where clone `i` writes its own bytes: 64 KiB at a place of its own, and 512 bytes inside
/// a block (the owner reads, patches and writes the block back).
fn patches(i: usize) -> [(usize, Vec<u8>); 2] {
    let at = (i * 1_237 + 17) % (SIZE / 65_536 - 1) * 65_536;
    let small = (i * 7_919 % (SIZE / 4096)) * 4096 + 1_000;
    [
        (at, vec![(i as u8).wrapping_mul(3).wrapping_add(1); 65_536]),
        (small, vec![0xa5 ^ i as u8; 512]),
    ]
}

fn expected(golden: &[u8], i: usize) -> Vec<u8> {
    let mut v = golden.to_vec();
    for (at, bytes) in patches(i) {
        v[at..at + bytes.len()].copy_from_slice(&bytes);
    }
    v
}

#[test]
fn fifty_clones_of_one_image_written_independently_survive_kill_9_and_flatten() {
    require_tools();
    // 16 MiB slabs: each clone's first write to a slab takes a whole extent on each copy
    // (docs/SNAPSHOTS.md "Clones", space), and 50 clones share 6 GiB of lab drives.
    let lab = Lab::up(3, &["--ram", "--slab-size", "16M"]);
    // 51 volumes of 64 MiB as mirror-2 provision 6.4 GiB of raw capacity on 5.6 GiB: thin
    // clones overcommit the pool by design, which the operator allows (docs/CAPACITY.md).
    lab.must(&["cluster", "set", "--overcommit-ratio", "2"]);
    let tmp = tempfile::tempdir().unwrap();
    lab.create_owned("golden", "64M", "mirror-2", 1);
    let golden_img = random_file(tmp.path(), "golden.img", SIZE, 21);
    must(
        Command::new("nbdcopy")
            .arg(&golden_img)
            .arg(lab.uri("golden")),
    );
    lab.must(&["volume", "snapshot", "create", "golden", "base"]);
    let golden = std::fs::read(&golden_img).unwrap();

    // 50 clones, owned round the nodes: creating one copies nothing.
    for i in 0..CLONES {
        let owner = (i % 3 + 1).to_string();
        let out = lab.must(&[
            "volume",
            "clone",
            "golden@base",
            &format!("vm{i:02}"),
            "--owner",
            &owner,
        ]);
        assert!(out.contains("as a clone of golden@base"), "{out}");
    }
    let v = lab.json(&["volume", "show", "vm07"]);
    assert_eq!(v["parent"], "golden@base", "{v}");
    let s = lab.json(&["volume", "snapshot", "list", "golden"]);
    assert_eq!(s[0]["clones"].as_array().map(Vec::len), Some(CLONES), "{s}");
    assert_eq!(v["slabs_allocated"], 0, "a new clone holds nothing: {v}");

    // The parent moves on after the snapshot: the clones do not see it.
    must(
        Command::new("nbdcopy")
            .arg(random_file(tmp.path(), "other.img", SIZE, 22))
            .arg(lab.uri("golden")),
    );

    // Each clone writes its own bytes, then reads back its patches and a stretch it did not
    // write, through its own owner (libnbd).
    let uris: Vec<String> = (0..CLONES).map(|i| lab.uri(&format!("vm{i:02}"))).collect();
    let mut plan = String::new();
    for (i, uri) in uris.iter().enumerate() {
        for (at, bytes) in patches(i) {
            plan.push_str(&format!("{uri} {at} {} {}\n", bytes.len(), bytes[0]));
        }
    }
    std::fs::write(tmp.path().join("plan"), &plan).unwrap();
    let script = r#"
import nbd, sys, hashlib
golden = open(sys.argv[2], "rb").read()
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()]
by = {}
for uri, at, n, b in rows:
    by.setdefault(uri, []).append((int(at), int(n), int(b)))
for uri, ps in by.items():
    h = nbd.NBD()
    # No block-size negotiation: the 512-byte write is then allowed (the owner reads,
    # patches and writes back the block).
    h.set_strict_mode(0)
    h.set_request_block_size(False)
    h.connect_uri(uri)
    for at, n, b in ps:
        h.pwrite(bytes([b]) * n, at)
    h.flush()
    for at, n, b in ps:
        got = h.pread(n + 8192, max(0, at - 4096))
        want = bytearray(golden[max(0, at - 4096):max(0, at - 4096) + n + 8192])
        for q, m, c in ps:
            lo, hi = max(q, max(0, at - 4096)), min(q + m, max(0, at - 4096) + n + 8192)
            if lo < hi:
                want[lo - max(0, at - 4096):hi - max(0, at - 4096)] = bytes([c]) * (hi - lo)
        assert got == bytes(want), f"{uri}: around {at}"
    far = (ps[0][0] + (32 << 20)) % ((64 << 20) - (1 << 20))
    far -= far % 4096
    got = h.pread(1 << 20, far)
    clean = all(q + m <= far or q >= far + (1 << 20) for q, m, c in ps)
    if clean:
        assert got == golden[far:far + (1 << 20)], f"{uri}: unwritten stretch at {far}"
    h.shutdown()
print("ok")
"#;
    let out = must(
        Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .arg(tmp.path().join("plan"))
            .arg(&golden_img),
    );
    assert!(out.trim_end().ends_with("ok"), "{out}");

    // Whole clones, byte for byte, on every owner.
    let check = |i: usize, what: &str| {
        let want = tmp.path().join(format!("want{i}.img"));
        std::fs::write(&want, expected(&golden, i)).unwrap();
        compare(&lab.uri(&format!("vm{i:02}")), &want, what);
    };
    for i in [0, 1, 2, 49] {
        check(i, "a clone after its writes");
    }

    // TRIM and WRITE_ZEROES of a clone's never-written slabs read as zeros afterwards,
    // not as the parent.
    lab.must(&["volume", "clone", "golden@base", "zt", "--owner", "2"]);
    let script = r#"
import nbd, sys
golden = open(sys.argv[2], "rb").read()
h = nbd.NBD()
h.connect_uri(sys.argv[1])
assert h.pread(1 << 20, 60 << 20) == golden[60 << 20:61 << 20]
h.zero(1 << 20, 60 << 20)
h.trim(1 << 20, 50 << 20)
h.flush()
assert h.pread(1 << 20, 60 << 20) == bytes(1 << 20), "zeroed"
assert h.pread(1 << 20, 50 << 20) == bytes(1 << 20), "trimmed"
assert h.pread(1 << 20, 40 << 20) == golden[40 << 20:41 << 20], "untouched"
h.shutdown()
print("ok")
"#;
    let out = must(
        Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .arg(lab.uri("zt"))
            .arg(&golden_img),
    );
    assert!(out.trim_end().ends_with("ok"), "{out}");
    lab.must(&["volume", "delete", "zt"]);

    // A verifying fio load on one clone.
    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--offset=16M",
        "--size=16M",
        "--io_size=8M",
        "--randrepeat=0",
    ];
    let v = fio(&lab.uri("vm03"), &verify_pass(&job, false));
    assert_eq!(fio_errors(&v), 0, "fio verify on a clone: {v}");

    // The parent snapshot and volume cannot go while clones read them.
    let e = lab.fails(&["volume", "snapshot", "delete", "golden", "base"]);
    assert!(e.contains("clones") && e.contains("vm00"), "{e}");
    let e = lab.fails(&["volume", "delete", "golden"]);
    assert!(e.contains("snapshots"), "{e}");

    // Everything survives kill -9 of every node.
    lab.kill_all_and_restart(3);
    for i in [0, 1, 49] {
        check(i, "a clone after kill -9 of every node");
    }

    // A clone's own snapshot reads as the clone did; later writes do not show in it.
    lab.must(&["volume", "snapshot", "create", "vm01", "mine"]);
    must(
        Command::new("nbdcopy")
            .arg(random_file(tmp.path(), "late.img", 1 << 20, 23))
            .arg(lab.uri("vm01")),
    );
    let want1 = tmp.path().join("want1.img");
    let v = lab.json(&["volume", "snapshot", "list", "vm01"]);
    let snap_uri = v[0]["uri"].as_str().unwrap().to_string();
    compare(
        &snap_uri,
        &want1,
        "a clone's snapshot after the clone was overwritten",
    );
    let e = lab.fails(&["volume", "flatten", "vm01"]);
    assert!(e.contains("snapshots"), "{e}");

    // Flatten: the data stays, the link goes.
    let out = lab.must(&["volume", "flatten", "vm00"]);
    assert!(out.contains("flattened"), "{out}");
    assert!(lab.json(&["volume", "show", "vm00"])["parent"].is_null());
    check(0, "a clone after flatten");

    // Once no clone reads it, the snapshot can go.
    for i in 2..CLONES {
        lab.must(&["volume", "delete", &format!("vm{i:02}")]);
    }
    let e = lab.fails(&["volume", "snapshot", "delete", "golden", "base"]);
    assert!(e.contains("vm01") && !e.contains("vm00"), "{e}");
    lab.must(&["volume", "snapshot", "delete", "vm01", "mine"]);
    lab.must(&["volume", "flatten", "vm01"]);
    lab.must(&["volume", "snapshot", "delete", "golden", "base"]);
    check(0, "a flattened clone after its parent snapshot was deleted");
    let late = std::fs::read(tmp.path().join("late.img")).unwrap();
    let mut want = expected(&golden, 1);
    want[..late.len()].copy_from_slice(&late);
    let p = tmp.path().join("want1-late.img");
    std::fs::write(&p, want).unwrap();
    compare(&lab.uri("vm01"), Path::new(&p), "the other flattened clone");

    // Refused, with the reason.
    let e = lab.fails(&["volume", "clone", "golden@base", "again"]);
    assert!(e.contains("no snapshot named base"), "{e}");
    let e = lab.fails(&["volume", "clone", "golden", "again"]);
    assert!(e.contains("VOLUME@SNAPSHOT"), "{e}");
    let e = lab.fails(&["volume", "flatten", "golden"]);
    assert!(e.contains("not a clone"), "{e}");
}

/// A clone's copy rebuilt on another node keeps which blocks are the clone's own (written,
/// trimmed, zeroed) and which are still its parent's: the clone, served from that copy,
/// reads the same.
#[test]
fn a_clone_copy_rebuilt_elsewhere_keeps_which_blocks_are_its_own() {
    require_tools();
    let lab = Lab::up(4, &["--ram", "--slab-size", "32M"]);
    lab.must(&["cluster", "set", "--repair-delay", "3s"]);
    let tmp = tempfile::tempdir().unwrap();
    lab.create_owned("gold", "64M", "mirror-2", 1);
    let golden_img = random_file(tmp.path(), "gold.img", 64 << 20, 31);
    must(
        Command::new("nbdcopy")
            .arg(&golden_img)
            .arg(lab.uri("gold")),
    );
    lab.must(&["volume", "snapshot", "create", "gold", "base"]);
    lab.must(&["volume", "clone", "gold@base", "c", "--owner", "1"]);
    // Its own: 1 MiB written at 2 MiB, 1 MiB trimmed at 8 MiB, 1 MiB zeroed at 40 MiB (the
    // second slab); the rest is the parent's.
    let script = r#"
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(b"\x5a" * (1 << 20), 2 << 20)
h.trim(1 << 20, 8 << 20)
h.zero(1 << 20, 40 << 20)
h.flush()
h.shutdown()
print("ok")
"#;
    nbd_script(script, &lab.uri("c"));
    let mut want = std::fs::read(&golden_img).unwrap();
    want[2 << 20..3 << 20].fill(0x5a);
    want[8 << 20..9 << 20].fill(0);
    want[40 << 20..41 << 20].fill(0);
    let want_img = tmp.path().join("want.img");
    std::fs::write(&want_img, &want).unwrap();
    compare(&lab.uri("c"), &want_img, "the clone before the rebuild");

    // A node with a copy of the clone (not its owner) dies past the repair delay: its
    // copies are rebuilt on the others.
    let before = lab.extents("c");
    let victim = (2..=4u64)
        .find(|n| before.iter().any(|e| e.1 == *n))
        .unwrap();
    lab.must(&["lab", "fault", "kill", &victim.to_string()]);
    lab.wait_for("rebuild", std::time::Duration::from_secs(180), || {
        let e = lab.extents("c");
        e.len() == before.len() && e.iter().all(|x| x.1 != victim && x.2 == "in-sync")
    });
    // Serve the clone from a node holding a rebuilt copy: its reads ask that copy first.
    let after = lab.extents("c");
    let rebuilt = after
        .iter()
        .map(|e| e.1)
        .find(|n| !before.iter().any(|b| b.1 == *n) && *n != 1)
        .or_else(|| after.iter().map(|e| e.1).find(|n| *n != 1))
        .unwrap();
    lab.must(&["volume", "move", "c", "--to", &rebuilt.to_string()]);
    compare(
        &lab.uri("c"),
        &want_img,
        "the clone served from its rebuilt copy",
    );
}

/// Clones of clones chain: each level reads what no level below it wrote from the one
/// above; a chain holds at most 16 clones (then flatten is needed).
#[test]
fn clones_of_clones_chain_up_to_sixteen_levels() {
    require_tools();
    let lab = Lab::up(3, &["--ram", "--slab-size", "16M"]);
    let tmp = tempfile::tempdir().unwrap();
    lab.create_owned("c0", "16M", "simple", 1);
    let img = random_file(tmp.path(), "c0.img", 16 << 20, 41);
    must(Command::new("nbdcopy").arg(&img).arg(lab.uri("c0")));
    let mut want = std::fs::read(&img).unwrap();
    for level in 1..=16usize {
        let (up, this) = (format!("c{}", level - 1), format!("c{level}"));
        lab.must(&["volume", "snapshot", "create", &up, "s"]);
        lab.must(&["volume", "clone", &format!("{up}@s"), &this]);
        // Each level writes its own 4 KiB block.
        let script = format!(
            "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\n\
             h.pwrite(bytes([{level}]) * 4096, {at})\nh.flush()\nh.shutdown()\nprint('ok')\n",
            at = level * 65536
        );
        nbd_script(&script, &lab.uri(&this));
        want[level * 65536..level * 65536 + 4096].fill(level as u8);
    }
    let p = tmp.path().join("want.img");
    std::fs::write(&p, &want).unwrap();
    compare(&lab.uri("c16"), &p, "the 16th clone of the chain");
    lab.must(&["volume", "snapshot", "create", "c16", "s"]);
    let e = lab.fails(&["volume", "clone", "c16@s", "c17"]);
    assert!(e.contains("at most 16"), "{e}");
}
