//! Failures on a real lab: real etcd, real `converged` processes killed with SIGKILL, real
//! clients (nbdcopy, qemu-io, qemu-img). Every test checks the data byte for byte, and that
//! copies converge (a scrub that compares every copy finds nothing).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

const MIN: Duration = Duration::from_secs(60);

/// `qemu-io` command on `uri` (e.g. "write -P 0xab 4096 8192"); must succeed.
fn qemu_io(uri: &str, cmd: &str) -> String {
    let out = must(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, uri]));
    assert!(
        !out.contains("error") && !out.contains("failed"),
        "qemu-io {cmd}: {out}"
    );
    out
}

/// Applies `pattern` bytes at [off, off+len) of the local expected image.
fn patch(path: &std::path::Path, off: u64, len: usize, pattern: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![pattern; len], off).unwrap();
}

/// The highest epoch granted for `vol`, read from etcd with node 2's certificate.
/// Whether every copy of `vol` is in sync and on none of `drives` (ids as `drive list`
/// prints them).
fn in_sync_off(lab: &Lab, vol: &str, drives: &[&serde_json::Value]) -> bool {
    let v = lab.json(&["volume", "show", vol]);
    v["slabs"].as_array().unwrap().iter().all(|s| {
        s["extents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| !drives.contains(&&e["drive"]) && e["state"] == "in-sync")
    })
}

fn granted_epoch(lab: &Lab, vol: &str) -> u64 {
    let id = lab.json(&["volume", "show", vol])["id"].as_u64().unwrap();
    let endpoint = lab.lab_json()["etcd_endpoint"]
        .as_str()
        .unwrap()
        .to_string();
    let p = lab.path();
    let out = must(
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &endpoint, "--cacert"])
            .arg(p.join("pki/ca.crt"))
            .arg("--cert")
            .arg(p.join("node2/pki/node.crt"))
            .arg("--key")
            .arg(p.join("node2/pki/node.key"))
            .args([
                "get",
                "--print-value-only",
                &format!("/converge/epochs/{id}"),
            ]),
    );
    out.trim().parse().unwrap_or(0)
}

/// Any node serves any volume: I/O on a non-owner is forwarded to the owner; `volume
/// move` hands ownership over, and clients of the old owner keep working.
#[test]
fn redirected_io_and_volume_move() {
    let lab = Lab::up(3, &[]);
    lab.must(&[
        "volume",
        "create",
        "y",
        "--size",
        "64M",
        "--resiliency",
        "mirror-2",
        "--owner",
        "2",
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let a = random_file(tmp.path(), "a.img", 64 << 20, 7);
    // Written through node 1 (not the owner), read through node 3.
    must(Command::new("nbdcopy").arg(&a).arg(lab.uri_on("y", 1)));
    compare(&lab.uri_on("y", 3), &a, "read via node 3");
    let info = must(Command::new("nbdinfo").arg(lab.uri_on("y", 1)));
    assert!(info.contains("forwarded to owner node 2"), "{info}");

    lab.must(&["volume", "move", "y", "--to", "3"]);
    assert_eq!(lab.json(&["volume", "show", "y"])["owner"], 3);
    compare(
        &lab.uri_on("y", 2),
        &a,
        "read via the old owner after the move",
    );
    qemu_io(&lab.uri_on("y", 2), "write -P 0x5a 1048576 65536");
    patch(&a, 1 << 20, 65536, 0x5a);
    compare(&lab.uri_on("y", 3), &a, "read via the new owner");
    let info = must(Command::new("nbdinfo").arg(lab.uri_on("y", 3)));
    assert!(info.contains("served here"), "{info}");
    // Unknown node: a clear error.
    let e = lab.fails(&["volume", "move", "y", "--to", "9"]);
    assert!(e.contains("not a live node"), "{e}");
}

/// A node dies: writes continue on the other copies (acked on min_replicas), its copies
/// turn stale; when it returns, only the blocks written meanwhile are copied back.
#[test]
fn degraded_writes_then_resync_copies_only_what_was_missed() {
    let lab = Lab::up(4, &[]);
    lab.must(&[
        "volume",
        "create",
        "d",
        "--size",
        "256M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("d");
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "d.img", 256 << 20, 3);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    // A node other than the owner that holds copies.
    let ext = lab.extents("d");
    let victim = (2..=4u64)
        .max_by_key(|n| ext.iter().filter(|e| e.1 == *n).count())
        .unwrap();
    let victim_slabs: Vec<u64> = ext.iter().filter(|e| e.1 == victim).map(|e| e.0).collect();
    assert!(!victim_slabs.is_empty());
    lab.must(&["lab", "fault", "kill", &victim.to_string()]);

    // Writes while it is away: 3 x 8 KiB in every 64 MiB slab, distinct blocks.
    let mut expected_blocks = 0;
    for slab in 0..4u64 {
        for k in 0..3u64 {
            let off = slab * (64 << 20) + k * (5 << 20) + 4096;
            qemu_io(&uri, &format!("write -P 0x{:x} {off} 8192", 0x40 + k));
            patch(&img, off, 8192, 0x40 + k as u8);
            if victim_slabs.contains(&slab) {
                expected_blocks += 2;
            }
        }
    }
    compare(&uri, &img, "degraded volume");
    let stale: Vec<_> = lab
        .extents("d")
        .into_iter()
        .filter(|e| e.2 != "in-sync")
        .collect();
    assert!(
        !stale.is_empty() && stale.iter().all(|e| e.1 == victim),
        "only the dead node's copies are stale: {stale:?}"
    );
    let status = lab.json(&["status"]);
    assert!(
        status["health"].as_str().unwrap().contains("not in sync"),
        "{status}"
    );

    lab.must(&["lab", "fault", "restart", &victim.to_string()]);
    lab.wait_for("resync", 2 * MIN, || all_in_sync(&lab, "d"));
    assert_eq!(
        lab.metric(1, "converge_repair_blocks_written_total"),
        expected_blocks,
        "resync copied exactly the blocks written while the node was away\n{}",
        lab.logs()
    );
    assert_eq!(
        lab.metric(1, "converge_resync_jobs_done_total"),
        victim_slabs.len() as u64
    );
    compare(&uri, &img, "after resync");
    assert_copies_agree(&lab, "d");
}

/// The owner is killed: a client asking another node gets the volume served there (new
/// epoch, copies fenced and reconciled); the old owner's copies resync when it returns.
#[test]
fn owner_killed_another_node_takes_over() {
    let lab = Lab::up(4, &[]);
    lab.must(&[
        "volume",
        "create",
        "o",
        "--size",
        "128M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "o.img", 128 << 20, 5);
    must(Command::new("nbdcopy").arg(&img).arg(lab.uri_on("o", 1)));
    // And a volume with its one copy on node 1 (the owner's node takes a copy of each new
    // slab), which nothing can serve while node 1 is down.
    lab.create_owned("lone", "64M", "simple", 1);
    qemu_io(&lab.uri_on("lone", 1), "write -P 0x55 0 65536");
    let ext = lab.extents("lone");
    assert!(
        ext.iter().all(|e| e.1 == 1),
        "lone's copy is on node 1: {ext:?}"
    );
    lab.must(&["lab", "fault", "kill", "1"]);
    // Node 2 is asked: it waits out the dead owner's lease, takes over, serves.
    compare(
        &lab.uri_on("o", 2),
        &img,
        "read via node 2 after the owner died",
    );
    // The leader leaves "lone" unowned instead of claiming it every second, each claim a
    // new epoch that fails: no epoch is spent over three of its passes.
    let deferred = || {
        (2..=4)
            .map(|n| lab.metric(n, "converge_takeovers_deferred_total"))
            .sum::<u64>()
    };
    lab.wait_for("the leader to defer lone", MIN, || deferred() >= 1);
    let epoch = granted_epoch(&lab, "lone");
    let seen = deferred();
    lab.wait_for("three more passes of the leader", MIN, || {
        deferred() >= seen + 3
    });
    assert_eq!(
        granted_epoch(&lab, "lone"),
        epoch,
        "epochs spent on a volume no takeover can serve"
    );
    // Nor does a client asking another node for it: it is told the volume cannot be
    // served now (before, each attempt claimed it with a new epoch that failed).
    for _ in 0..3 {
        let out = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 4096", &lab.uri_on("lone", 3)])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}");
        assert!(text.contains("cannot be served now"), "{text}");
    }
    assert_eq!(
        granted_epoch(&lab, "lone"),
        epoch,
        "epochs spent on client opens of a volume no takeover can serve"
    );
    qemu_io(&lab.uri_on("o", 2), "write -P 0x77 0 1048576");
    patch(&img, 0, 1 << 20, 0x77);
    qemu_io(&lab.uri_on("o", 3), "write -P 0x78 67108864 4096");
    patch(&img, 64 << 20, 4096, 0x78);
    compare(&lab.uri_on("o", 4), &img, "after the takeover");
    lab.must(&["lab", "fault", "restart", "1"]);
    lab.wait_for("resync of node 1", 2 * MIN, || all_in_sync(&lab, "o"));
    // The restarted node 1 serves nothing now: its clients are forwarded.
    compare(&lab.uri_on("o", 1), &img, "via the old owner");
    assert_copies_agree(&lab, "o");
    // "lone" is served again, from its copy.
    let out = qemu_io(&lab.uri_on("lone", 2), "read -P 0x55 0 65536");
    assert!(out.contains("read 65536/65536"), "{out}");
}

/// A node stays dead past the repair delay: its copies are rebuilt on other nodes.
#[test]
fn copies_of_a_node_gone_past_the_repair_delay_are_rebuilt() {
    let lab = Lab::up(4, &[]);
    // The lab's knob says 60 s; the cluster-wide setting overrides it.
    let e = lab.fails(&["cluster", "set", "--repair-delay", "3x"]);
    assert!(e.contains("not a duration"), "{e}");
    lab.must(&["cluster", "set", "--repair-delay", "3s"]);
    assert_eq!(lab.json(&["cluster", "settings"])["repair_delay_s"], 3);
    lab.must(&[
        "volume",
        "create",
        "r",
        "--size",
        "128M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("r");
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "r.img", 128 << 20, 9);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let ext = lab.extents("r");
    let victim = (2..=4u64).find(|n| ext.iter().any(|e| e.1 == *n)).unwrap();
    lab.must(&["lab", "fault", "kill", &victim.to_string()]);
    qemu_io(&uri, "write -P 0x33 0 65536");
    patch(&img, 0, 65536, 0x33);
    lab.wait_for("rebuild", 3 * MIN, || {
        let e = lab.extents("r");
        e.iter().all(|x| x.1 != victim && x.2 == "in-sync")
    });
    let e = lab.extents("r");
    for slab in 0..2u64 {
        let mut nodes: Vec<u64> = e.iter().filter(|x| x.0 == slab).map(|x| x.1).collect();
        nodes.sort();
        nodes.dedup();
        assert_eq!(
            nodes.len(),
            3,
            "slab {slab} has 3 copies on distinct nodes: {e:?}"
        );
    }
    assert!(lab.metric(1, "converge_rebuild_jobs_done_total") >= 1);
    compare(&uri, &img, "after rebuild");
    assert_copies_agree(&lab, "r");
}

/// Bits flipped in a copy that reads do not touch are found by the scrub and repaired.
#[test]
fn scrub_finds_and_repairs_flipped_bits() {
    let lab = Lab::up(3, &[]);
    lab.must(&[
        "volume",
        "create",
        "s",
        "--size",
        "64M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let (img, flipped) = write_marked_and_flip(&lab, "s", tmp.path(), 2, 200..205);
    assert_eq!(flipped.len(), 5);
    let r = &lab.json(&["scrub", "start", "s", "--wait"])[0];
    assert_eq!(r["bad_checksums"], 5, "{r}\n{}", lab.logs());
    assert_eq!(r["repaired"], 5, "{r}");
    assert_copies_agree(&lab, "s");
    compare(&lab.uri("s"), &img, "after scrub");
    let st = lab.must(&["scrub", "status"]);
    assert!(
        st.contains("LAST RESULTS") && st.lines().any(|l| l.starts_with("s ")),
        "{st}"
    );
}

/// Maintenance: a node's copies go stale and its volumes move away while writes go on;
/// a second node is refused while that would leave slabs below min_replicas; `off`
/// resyncs only what the node missed.
#[test]
fn maintenance_moves_volumes_refuses_when_unsafe_and_resyncs() {
    let lab = Lab::up(4, &[]);
    lab.must(&[
        "volume",
        "create",
        "m",
        "--size",
        "128M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "2",
    ]);
    let uri = lab.uri_on("m", 1);
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "m.img", 128 << 20, 11);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let ext = lab.extents("m");
    // A node holding a copy of slab 0 serves the volume, then goes into maintenance.
    let victim = (2..=4u64)
        .find(|n| ext.iter().any(|e| e.0 == 0 && e.1 == *n))
        .unwrap();
    let vs = victim.to_string();
    lab.must(&["volume", "move", "m", "--to", &vs]);
    lab.must(&["node", "maintenance", &vs, "on"]);
    lab.wait_for("the node's copies to turn stale", MIN, || {
        lab.extents("m")
            .iter()
            .all(|e| (e.1 == victim) == (e.2 == "stale"))
    });
    assert_ne!(
        lab.json(&["volume", "show", "m"])["owner"],
        victim,
        "moved off the node"
    );
    let nodes = lab.json(&["node", "list"]);
    assert!(
        nodes
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == victim && n["maintenance"] == true),
        "{nodes}"
    );
    qemu_io(&uri, "write -P 0x21 8192 16384");
    patch(&img, 8192, 16384, 0x21);
    compare(&uri, &img, "in maintenance");
    // Another node holding slab 0 would leave it one in-sync copy.
    let other = ext.iter().find(|e| e.0 == 0 && e.1 != victim).unwrap().1;
    let e = lab.fails(&["node", "maintenance", &other.to_string(), "on"]);
    assert!(e.contains("below its min_replicas"), "{e}");
    lab.must(&["node", "maintenance", &vs, "off"]);
    lab.wait_for("resync after maintenance", 2 * MIN, || {
        all_in_sync(&lab, "m")
    });
    // Only the 4 blocks written meanwhile were copied back.
    let copied: u64 = (1..=4)
        .map(|n| lab.metric(n, "converge_repair_blocks_written_total"))
        .sum();
    assert_eq!(copied, 4, "{}", lab.logs());
    compare(&uri, &img, "after maintenance");
    assert_copies_agree(&lab, "m");
}

/// A drive whose writes fail (here: its file sits on a full tmpfs, so writes get ENOSPC)
/// is marked failed; its copies are rebuilt on other nodes at once, and no write is lost.
#[test]
fn a_drive_that_fails_is_marked_failed_and_its_copies_rebuilt() {
    let lab = Lab::up(4, &[]);
    // Move node 4's first drive onto a small tmpfs: the file stays sparse, so writes fail with
    // ENOSPC once the tmpfs is full.
    let lj = lab.lab_json();
    let drive = lj["nodes"][3]["drives"][0].as_str().unwrap().to_string();
    lab.must(&["lab", "fault", "stop", "4"]);
    let mnt = tempfile::tempdir().unwrap();
    let m = mnt.path().display().to_string();
    must(Command::new("mount").args(["-t", "tmpfs", "-o", "size=40m", "tmpfs", &m]));
    struct Unmount(String);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").args(["-l", &self.0]).status();
        }
    }
    let _u = Unmount(m.clone());
    let small = format!("{m}/drive.img");
    must(Command::new("cp").args(["--sparse=always", &drive, &small]));
    std::fs::remove_file(&drive).unwrap();
    std::os::unix::fs::symlink(&small, &drive).unwrap();
    lab.must(&["lab", "fault", "restart", "4"]);

    lab.must(&[
        "volume",
        "create",
        "f",
        "--size",
        "256M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("f");
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "f.img", 256 << 20, 13);
    must(Command::new("nbdcopy").arg(&img).arg(&uri));
    let failed_drive = || {
        lab.json(&["drive", "list"])
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["node"] == 4 && !d["failed"].is_null())
            .map(|d| d["id"].clone())
    };
    lab.wait_for("node 4's drive to be marked failed", MIN, || {
        failed_drive().is_some()
    });
    let bad = failed_drive().unwrap();
    let st = lab.json(&["status"]);
    assert!(
        st["health"].as_str().unwrap().contains("drives failed"),
        "{st}"
    );
    lab.wait_for("copies rebuilt off the failed drive", 3 * MIN, || {
        in_sync_off(&lab, "f", &[&bad])
    });
    compare(&uri, &img, "after the drive failed");
    assert_copies_agree(&lab, "f");

    // Node 4's drives are replaced while it is down (blank devices at their paths): the
    // failed one, and the other one, which nobody saw fail. The node formats both under new
    // ids and records the missing one failed at start-up, so its copies are rebuilt too.
    let other = lj["nodes"][3]["drives"][1].as_str().unwrap().to_string();
    let ids_before: Vec<serde_json::Value> = lab
        .json(&["drive", "list"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["node"] == 4 && d["failed"].is_null())
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(ids_before.len(), 1, "{ids_before:?}");
    let replaced = ids_before[0].clone();
    lab.must(&["lab", "fault", "stop", "4"]);
    std::fs::remove_file(&other).unwrap();
    std::fs::remove_file(&drive).unwrap();
    std::fs::remove_file(&small).unwrap();
    lab.must(&["lab", "fault", "restart", "4"]);
    lab.wait_for("the replaced drive recorded failed", MIN, || {
        lab.json(&["drive", "list"])
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["id"] == replaced && !d["failed"].is_null())
    });
    lab.wait_for("copies rebuilt off the replaced drive", 3 * MIN, || {
        in_sync_off(&lab, "f", &[&bad, &replaced])
    });
    compare(&uri, &img, "after the drive was replaced");
    assert_copies_agree(&lab, "f");
}

/// A mirror-3 slab whose in-sync copies are all away is served from the stale copy the
/// record marks as holding every acked write, and from no other (docs/adr/0014): copy A
/// goes stale first (two stay in sync, so writes are acked without it), copy B second
/// (one left: nothing is acked without B from then on, and the record marks it); then
/// C's node dies too. A, back first, is not promoted; with B's node back, B is made the
/// in-sync copy, and every acked write reads back, the one A lacks included.
#[test]
fn a_stale_copy_that_holds_every_acked_write_serves_when_the_in_sync_one_is_gone() {
    let lab = Lab::up(4, &[]);
    lab.create_owned("p", "64M", "mirror-3", 1);
    let tmp = tempfile::tempdir().unwrap();
    let img = random_file(tmp.path(), "p.img", 64 << 20, 21);
    must(Command::new("nbdcopy").arg(&img).arg(lab.uri("p")));
    // One slab on three of the four nodes; the fourth serves it.
    let copies: Vec<u64> = lab.extents("p").iter().map(|e| e.1).collect();
    assert_eq!(copies.len(), 3, "{copies:?}");
    let owner = (1..=4u64).find(|n| !copies.contains(n)).unwrap();
    if owner != 1 {
        lab.must(&["volume", "move", "p", "--to", &owner.to_string()]);
    }
    // Clients use the owner's node, which no fault touches.
    let uri = lab.uri_on("p", owner as u32);
    let (a, b, c) = (copies[0], copies[1], copies[2]);
    let state_of = |node: u64| {
        let v = lab.json(&["volume", "show", "p"]);
        let e = v["slabs"][0]["extents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["node"] == node)
            .cloned()
            .unwrap();
        (
            e["state"].as_str().unwrap().to_string(),
            e["holds_acked"].as_bool().unwrap_or(false),
        )
    };

    lab.must(&["lab", "fault", "kill", &a.to_string()]);
    lab.wait_for("A's copy stale", MIN, || state_of(a).0 == "stale");
    assert_eq!(state_of(a), ("stale".to_string(), false));
    // Acked on B and C, not on A.
    qemu_io(&uri, "write -P 0x5a 1048576 65536");
    patch(&img, 1 << 20, 65536, 0x5a);

    lab.must(&["lab", "fault", "kill", &b.to_string()]);
    lab.wait_for("B's copy stale", MIN, || state_of(b).0 == "stale");
    assert_eq!(state_of(b), ("stale".to_string(), true));
    let shown = lab.must(&["volume", "show", "p"]);
    assert!(shown.contains("stale (holds every acked write)"), "{shown}");

    // C, the last in-sync copy, goes away too. A comes back first: the owner's repair
    // rounds try to promote it (refused: unmarked) and to resync it (no in-sync copy
    // answers: a failed job), and it stays stale. Then B comes back and is promoted.
    lab.must(&["lab", "fault", "kill", &c.to_string()]);
    let failed_jobs = lab.metric(owner as u32, "converge_repair_jobs_failed_total");
    lab.must(&["lab", "fault", "restart", &a.to_string()]);
    lab.wait_for("a round with A back and no in-sync copy", MIN, || {
        lab.metric(owner as u32, "converge_repair_jobs_failed_total") > failed_jobs
    });
    assert_eq!(state_of(a), ("stale".to_string(), false));
    lab.must(&["lab", "fault", "restart", &b.to_string()]);
    lab.wait_for("B's copy promoted", MIN, || state_of(b).0 == "in-sync");
    assert_eq!(state_of(c).0, "stale");
    assert_eq!(
        lab.metric(owner as u32, "converge_volume_copies_promoted_total"),
        1
    );
    compare(&uri, &img, "served from the promoted copy");

    // Everyone back: A and C are resynced from B.
    lab.must(&["lab", "fault", "restart", &c.to_string()]);
    lab.wait_for("every copy in sync", 2 * MIN, || all_in_sync(&lab, "p"));
    compare(&uri, &img, "after resync from the promoted copy");
    assert_copies_agree(&lab, "p");
}
