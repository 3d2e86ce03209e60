//! End-to-end: snapshots (docs/SNAPSHOTS.md) on a real lab — real etcd, real `converged`
//! processes, real clients (nbdcopy, qemu-img, fio with crc32c verify, libnbd) and kill -9
//! of every node. A snapshot reads back byte for byte what was acked before it, while and
//! after the volume is overwritten, under a verifying fio load, across kill -9; a rollback
//! makes the volume the snapshot again; what cannot be done is refused with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::process::Command;

/// The first `len` bytes at `uri` into a file.
fn copy_out(uri: &str, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    must(Command::new("nbdcopy").arg(uri).arg(&p));
    p
}

#[test]
fn snapshots_hold_what_was_acked_before_them_through_overwrites_load_kill_9_and_rollback() {
    require_tools();
    let lab = Lab::up(3, &["--ram"]);
    let tmp = tempfile::tempdir().unwrap();
    // Owned by node 2: the CLI's requests to node 1 are forwarded to the owner.
    lab.create_owned("vm", "128M", "mirror-3", 2);
    let uri = lab.uri("vm");
    let a = random_file(tmp.path(), "a.img", 128 << 20, 1);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));

    // s1 holds A; the volume is then overwritten with B.
    let out = lab.must(&["volume", "snapshot", "create", "vm", "s1"]);
    assert!(out.contains("vm@s1"), "{out}");
    let s1 = snap_uri(&lab, "vm", "s1");
    assert!(s1.contains("/vm@s1?socket="), "{s1}");
    let b = random_file(tmp.path(), "b.img", 128 << 20, 2);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    compare(&s1, &a, "snapshot s1 after the overwrite");
    compare(&uri, &b, "the volume after the overwrite");
    // Every block of A was overwritten once: each of the three copies keeps it, moved, not
    // copied.
    let preserved = |lab: &Lab| -> u64 {
        (1..=3)
            .map(|n| lab.metric(n, "converge_drive_preserved_bytes"))
            .sum()
    };
    assert_eq!(preserved(&lab), 3 * (128 << 20));
    // The list says so per snapshot, and that deleting s1 would free all of it.
    let v = lab.json(&["volume", "snapshot", "list", "vm"]);
    assert_eq!(v[0]["kept_bytes"], 3 * (128u64 << 20), "{v}");
    assert_eq!(v[0]["freed_by_delete_bytes"], 3 * (128u64 << 20), "{v}");
    assert_eq!(v[0]["space_copies_unanswered"], 0, "{v}");
    let t = lab.must(&["volume", "snapshot", "list", "vm"]);
    assert!(t.contains("FREED BY DELETE") && t.contains("384"), "{t}");

    // s2 taken while fio writes (and verifies) the second half: the first half, written
    // and acked before, is exactly B's in it.
    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--offset=64M",
        "--size=64M",
        "--io_size=96M",
        "--randrepeat=0",
    ];
    let fio_uri = uri.clone();
    let load = std::thread::spawn(move || fio(&fio_uri, &verify_pass(&job, false)));
    std::thread::sleep(std::time::Duration::from_millis(700));
    lab.must(&["volume", "snapshot", "create", "vm", "s2"]);
    let v = load.join().unwrap();
    assert_eq!(fio_errors(&v), 0, "fio verify across the snapshot: {v}");
    let s2 = snap_uri(&lab, "vm", "s2");
    let got = copy_out(&s2, tmp.path(), "s2.img");
    let (got, bb) = (std::fs::read(&got).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(got.len(), 128 << 20);
    assert!(got[..64 << 20] == bb[..64 << 20], "s2's first half is B's");

    // Both survive kill -9 of every node.
    lab.kill_all_and_restart(3);
    compare(&s1, &a, "snapshot s1 after kill -9 of every node");
    let again = copy_out(&s2, tmp.path(), "s2-again.img");
    assert!(std::fs::read(&again).unwrap() == got, "s2 after kill -9");

    // Snapshots are read-only exports, listed by the server.
    let script = r#"
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
assert h.is_read_only(), "a snapshot export is read-only"
try:
    h.pwrite(b"x" * 4096, 0)
    raise SystemExit("a write to a snapshot was accepted")
except nbd.Error as e:
    print("refused:", e)
h.shutdown()
print("ok")
"#;
    nbd_script(script, &s1);
    let list = must(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(s1.replace("/vm@s1?", "/?")),
    );
    assert!(list.contains("vm@s1") && list.contains("vm@s2"), "{list}");

    // Refused, with the reason.
    let e = lab.fails(&["volume", "snapshot", "create", "vm", "s1"]);
    assert!(e.contains("already has a snapshot"), "{e}");
    let e = lab.fails(&["volume", "snapshot", "create", "vm", "bad@name"]);
    assert!(e.contains("invalid"), "{e}");
    let e = lab.fails(&["volume", "delete", "vm"]);
    assert!(e.contains("snapshots") && e.contains("s1"), "{e}");
    let e = lab.fails(&["volume", "snapshot", "rollback", "vm", "s1"]);
    assert!(e.contains("--yes"), "{e}");
    let e = lab.fails(&["volume", "snapshot", "delete", "vm", "nope"]);
    assert!(e.contains("no snapshot named nope"), "{e}");

    // Roll back to s1: the volume is A again; s2 still reads what it did.
    lab.must(&["volume", "snapshot", "rollback", "vm", "s1", "--yes"]);
    compare(&uri, &a, "the volume rolled back to s1");
    let after = copy_out(&s2, tmp.path(), "s2-after-rollback.img");
    assert!(
        std::fs::read(&after).unwrap() == got,
        "s2 after the rollback"
    );

    // Deleting s1 leaves s2 whole; deleting both lets the volume go.
    lab.must(&["volume", "snapshot", "delete", "vm", "s1"]);
    let after = copy_out(&s2, tmp.path(), "s2-after-delete.img");
    assert!(
        std::fs::read(&after).unwrap() == got,
        "s2 after deleting s1"
    );
    let e = run(Command::new("nbdinfo").arg(&s1));
    assert!(!e.status.success(), "a deleted snapshot's export is gone");
    lab.must(&["volume", "snapshot", "delete", "vm", "s2"]);
    let v = lab.json(&["volume", "snapshot", "list", "vm"]);
    assert_eq!(v.as_array().unwrap().len(), 0, "{v}");
    assert_eq!(
        preserved(&lab),
        0,
        "deleting every snapshot returns its space"
    );
    compare(&uri, &a, "the volume after deleting its snapshots");
    lab.must(&["volume", "delete", "vm"]);
}

/// A slab first written after a snapshot reads as zeros in it; a copy rebuilt onto another
/// node after a snapshot is filled with it (docs/SNAPSHOTS.md "Repair carries the
/// snapshots"): once every original copy of its data is gone, it reads from rebuilt copies
/// alone; and a snapshot taken after the rebuild is held by the new copy too.
#[test]
fn snapshots_read_right_across_new_slabs_and_a_rebuild() {
    require_tools();
    let lab = Lab::up(5, &["--ram", "--slab-size", "32M"]);
    lab.must(&["cluster", "set", "--repair-delay", "3s"]);
    lab.create_owned("rb", "64M", "mirror-2", 1);
    let uri = lab.uri("rb");
    let tmp = tempfile::tempdir().unwrap();
    // Only the first slab holds data at s1.
    let a = random_file(tmp.path(), "a.img", 32 << 20, 11);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));
    lab.must(&["volume", "snapshot", "create", "rb", "s1"]);
    let b = random_file(tmp.path(), "b.img", 64 << 20, 12);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    let mut want = std::fs::read(&a).unwrap();
    want.resize(64 << 20, 0);
    let expected = tmp.path().join("s1.img");
    std::fs::write(&expected, &want).unwrap();
    let s1 = snap_uri(&lab, "rb", "s1");
    compare(
        &s1,
        &expected,
        "s1: its slab written after it reads as zeros",
    );

    // A node with a copy dies past the repair delay: its copies are rebuilt elsewhere.
    let ext = lab.extents("rb");
    // A holder of slab 0 (the one with s1's data), not node 1 (the CLI's first node).
    let victim = (2..=5u64)
        .find(|n| ext.iter().any(|e| e.0 == 0 && e.1 == *n))
        .unwrap();
    lab.must(&["lab", "fault", "kill", &victim.to_string()]);
    lab.wait_for("rebuild", std::time::Duration::from_secs(180), || {
        let e = lab.extents("rb");
        e.len() == 4 && e.iter().all(|x| x.1 != victim && x.2 == "in-sync")
    });
    compare(&s1, &expected, "s1 after a rebuild");
    compare(&uri, &b, "the volume after a rebuild");
    // The other original copies of slab 0 (the one holding s1's data) go too, the owner's
    // included: s1 then reads from copies rebuilt after it only.
    let dead: Vec<u64> = ext
        .iter()
        .filter(|e| e.0 == 0 && e.1 != victim)
        .map(|e| e.1)
        .collect();
    for n in &dead {
        lab.must(&["lab", "fault", "kill", &n.to_string()]);
    }
    lab.wait_for(
        "second rebuild",
        std::time::Duration::from_secs(240),
        || {
            let e = lab.extents("rb");
            e.len() == 4
                && e.iter()
                    .all(|x| x.1 != victim && !dead.contains(&x.1) && x.2 == "in-sync")
        },
    );
    let s1 = snap_uri(&lab, "rb", "s1");
    compare(&s1, &expected, "s1 from rebuilt copies alone");
    // Any node serves the volume (its preferred owner, node 1, may be down).
    let live = (1..=5u32)
        .find(|n| u64::from(*n) != victim && !dead.contains(&u64::from(*n)))
        .unwrap();
    let uri = lab.uri_on("rb", live);
    compare(&uri, &b, "the volume after the second rebuild");
    // A snapshot after the rebuild is held by every copy, the new one too.
    lab.must(&["volume", "snapshot", "create", "rb", "s2"]);
    let c = random_file(tmp.path(), "c.img", 64 << 20, 13);
    must(Command::new("nbdcopy").arg(&c).arg(&uri));
    compare(&snap_uri(&lab, "rb", "s2"), &b, "s2 after the overwrite");
    compare(&s1, &expected, "s1 after the second overwrite");
}

/// Snapshots of a parity volume (docs/SNAPSHOTS.md, "Parity volumes"): the snapshot reads
/// the image acked before it through whole-row overwrites and fio's verifying 4 KiB
/// writes (read-modify-writes of rows), with a chunk's node killed (decoded from the other
/// two) and the volume written meanwhile, after kill -9 of every node, and from that
/// node's chunks once resynced (their fills rebuild the snapshot's rows) with another
/// node down; its changes since cover what was written; a rollback
/// brings the image back; deleting it returns the space.
#[test]
fn snapshots_of_a_parity_volume_hold_what_was_acked_through_overwrites_and_kill_9() {
    require_tools();
    let lab = Lab::up(3, &["--ram"]);
    lab.must(&["cluster", "set", "--repair-delay", "2s"]);
    lab.create_owned("par", "64M", "parity-2+1", 1);
    let uri = lab.uri("par");
    let tmp = tempfile::tempdir().unwrap();
    let a = random_file(tmp.path(), "a.img", 64 << 20, 31);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));
    lab.must(&["volume", "snapshot", "create", "par", "p1"]);
    let p1 = snap_uri(&lab, "par", "p1");
    let b = random_file(tmp.path(), "b.img", 64 << 20, 32);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    compare(&p1, &a, "p1 after a whole overwrite");
    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=64M",
        "--io_size=8M",
        "--randrepeat=0",
    ];
    let v = fio(&uri, &verify_pass(&job, false));
    assert_eq!(fio_errors(&v), 0, "fio verify on the parity volume: {v}");
    compare(&p1, &a, "p1 after sub-row writes");
    // Every row changed since p1.
    let c = lab.json(&["volume", "changes", "par", "--from", "p1"]);
    assert_eq!(c["changed_bytes"], 64 << 20, "{c}");

    // A node holding chunks dies (not the owner): p1 decodes from the other two, and
    // writes go on without it (its chunks go stale).
    lab.must(&["lab", "fault", "kill", "3"]);
    let p1_on_1 = snap_uri(&lab, "par", "p1");
    compare(&p1_on_1, &a, "p1 with a chunk's node down");
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    compare(&p1_on_1, &a, "p1 after writes with a chunk's node down");
    lab.must(&["lab", "fault", "restart", "3"]);
    lab.wait_for("resync", std::time::Duration::from_secs(120), || {
        all_in_sync(&lab, "par")
    });
    lab.kill_all_and_restart(3);
    compare(
        &snap_uri(&lab, "par", "p1"),
        &a,
        "p1 after kill -9 of every node",
    );
    // Node 1's chunks go: p1 reads from node 3's resynced chunks and node 2's.
    lab.must(&["lab", "fault", "kill", "1"]);
    let p1_on_2 = lab.uri_on("par", 2).replace("/par?", "/par@p1?");
    compare(&p1_on_2, &a, "p1 through node 3's resynced chunks");
    lab.must(&["lab", "fault", "restart", "1"]);
    lab.wait_for("resync", std::time::Duration::from_secs(120), || {
        all_in_sync(&lab, "par")
    });
    let uri = lab.uri("par");
    lab.must(&["volume", "snapshot", "rollback", "par", "p1", "--yes"]);
    compare(&uri, &a, "the parity volume rolled back to p1");
    lab.must(&["volume", "snapshot", "delete", "par", "p1"]);
    let preserved: u64 = (1..=3)
        .map(|n| lab.metric(n, "converge_drive_preserved_bytes"))
        .sum();
    assert_eq!(preserved, 0, "deleting the snapshot returns its space");
}

/// Snapshots of a mirror-accelerated parity volume (docs/SNAPSHOTS.md, "Mirror-accelerated
/// parity"): two snapshots taken while span 0 is in the mirror part read what was acked
/// before each; when span 1 fills the part, span 0 rotates into parity and its rotation
/// carries both snapshots into the parity chunks (the mirror copies that kept them are
/// freed): they read the same after it, after kill -9 of every node and with a chunk's
/// node down; the changes between them are exactly the rows rewritten; a rollback brings
/// the second back; deleting both returns the space.
#[test]
fn snapshots_of_a_mirror_accelerated_parity_volume_survive_its_rotation_and_kill_9() {
    require_tools();
    let lab = Lab::up(3, &["--ram"]);
    lab.must(&[
        "volume",
        "create",
        "map",
        "--size",
        "256M",
        "--resiliency",
        "parity-2+1",
        "--mirror-part",
        "100%",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("map");
    let tmp = tempfile::tempdir().unwrap();
    let mib = 1usize << 20;
    // Span 0 (the first 128 MiB): A, then snapshot m1.
    let a = random_file(tmp.path(), "a.img", 128 * mib, 41);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));
    lab.must(&["volume", "snapshot", "create", "map", "m1"]);
    let mut m1 = std::fs::read(&a).unwrap();
    m1.resize(256 * mib, 0);
    let m1_img = tmp.path().join("m1.img");
    std::fs::write(&m1_img, &m1).unwrap();
    // Its first 64 MiB rewritten with B, then snapshot m2.
    let b = random_file(tmp.path(), "b.img", 64 * mib, 42);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    lab.must(&["volume", "snapshot", "create", "map", "m2"]);
    let mut m2 = m1.clone();
    m2[..64 * mib].copy_from_slice(&std::fs::read(&b).unwrap());
    let m2_img = tmp.path().join("m2.img");
    std::fs::write(&m2_img, &m2).unwrap();
    // fio's verifying 4 KiB writes into span 0 after both.
    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=128M",
        "--io_size=8M",
        "--randrepeat=0",
    ];
    let v = fio(&uri, &verify_pass(&job, false));
    assert_eq!(fio_errors(&v), 0, "fio verify on span 0: {v}");
    let (s1, s2) = (snap_uri(&lab, "map", "m1"), snap_uri(&lab, "map", "m2"));
    compare(&s1, &m1_img, "m1 in the mirror part");
    compare(&s2, &m2_img, "m2 in the mirror part");
    assert_eq!(
        slab_layout(&lab, "map"),
        [("m0".to_string(), 2), ("m1".to_string(), 2)]
    );
    // Span 1 fills the part: span 0, written longer ago, rotates into parity.
    let job = [
        "--rw=write",
        "--bs=1M",
        "--iodepth=4",
        "--offset=128M",
        "--size=128M",
    ];
    let v = fio(&uri, &verify_pass(&job, false));
    assert_eq!(fio_errors(&v), 0, "fio verify on span 1: {v}");
    let min = std::time::Duration::from_secs(60);
    lab.wait_for("the rotation of span 0", 3 * min, || {
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
    compare(&s1, &m1_img, "m1 after span 0 rotated into parity");
    compare(&s2, &m2_img, "m2 after span 0 rotated into parity");
    // Rows carry their versions through the rotation: exactly B's rows changed.
    let c = lab.json(&["volume", "changes", "map", "--from", "m1", "--to", "m2"]);
    assert_eq!(c["changed_bytes"], 64 << 20, "{c}");
    // A mirror-2 clone of m2 reads it through the parent's rotated span.
    lab.must(&[
        "volume",
        "clone",
        "map@m2",
        "mc",
        "--resiliency",
        "mirror-2",
        "--owner",
        "2",
    ]);
    compare(&lab.uri("mc"), &m2_img, "a clone of m2 after the rotation");
    lab.must(&["volume", "delete", "mc"]);

    lab.kill_all_and_restart(3);
    compare(
        &snap_uri(&lab, "map", "m1"),
        &m1_img,
        "m1 after kill -9 of every node",
    );
    // A chunk's node down (not the owner): m2 decodes from the other two.
    lab.must(&["lab", "fault", "kill", "3"]);
    compare(
        &snap_uri(&lab, "map", "m2"),
        &m2_img,
        "m2 with a chunk's node down",
    );
    lab.must(&["lab", "fault", "restart", "3"]);
    lab.wait_for("resync", 2 * min, || all_in_sync(&lab, "map"));
    let uri = lab.uri("map");
    lab.must(&["volume", "snapshot", "rollback", "map", "m2", "--yes"]);
    compare(&uri, &m2_img, "the volume rolled back to m2");
    lab.must(&["volume", "snapshot", "delete", "map", "m1"]);
    lab.must(&["volume", "snapshot", "delete", "map", "m2"]);
    let preserved: u64 = (1..=3)
        .map(|n| lab.metric(n, "converge_drive_preserved_bytes"))
        .sum();
    assert_eq!(preserved, 0, "deleting both returns their space");
}
