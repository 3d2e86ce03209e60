//! End-to-end: incremental backup (docs/SNAPSHOTS.md "Incremental backup") on a real lab —
//! real etcd, real `converged` processes, real clients (fio, nbdcopy, nbdinfo, libnbd,
//! qemu-img). The changes between two snapshots cover every block that differs and little
//! else; the same runs come through NBD's `qemu:dirty-bitmap` context; a full export plus
//! an incremental one, imported into a new volume, reproduce both snapshots byte for byte
//! (`qemu-img compare`); damaged diffs and out-of-order imports are refused and change
//! nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

const BS: u64 = 4096;

/// Changed runs as the API gives them.
fn runs(v: &serde_json::Value) -> Vec<(u64, u64)> {
    v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
        .collect()
}

fn covered(runs: &[(u64, u64)], block: u64) -> bool {
    let at = block * BS;
    runs.iter().any(|&(o, l)| at >= o && at < o + l)
}

/// `nbdinfo --map=CONTEXT`: the runs whose flags have bit 0 set (dirty).
fn dirty_map(uri: &str, context: &str) -> Vec<(u64, u64)> {
    let out = must(
        Command::new("nbdinfo")
            .arg(format!("--map={context}"))
            .arg(uri),
    );
    let mut v: Vec<(u64, u64)> = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let (o, l, flags): (u64, u64, u32) = (
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        );
        if flags & 1 == 1 {
            match v.last_mut() {
                Some(last) if last.0 + last.1 == o => last.1 += l,
                _ => v.push((o, l)),
            }
        }
    }
    v
}

#[test]
fn incremental_backups_restore_snapshots_byte_for_byte() {
    require_tools();
    let lab = Lab::up(3, &["--ram"]);
    let tmp = tempfile::tempdir().unwrap();
    let size: u64 = 96 << 20; // two slabs
    lab.create_owned("vm", "96M", "mirror-3", 2);
    let uri = lab.uri("vm");
    // s0: 40 MiB of random data; the rest never written.
    let a = random_file(tmp.path(), "a.img", 40 << 20, 7);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));
    lab.must(&["volume", "snapshot", "create", "vm", "s0"]);
    // Then random 4 KiB writes all over, a TRIM and a WRITE_ZEROES, and s1.
    let v = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--size=96M",
            "--io_size=4M",
            "--randrepeat=0",
        ],
    );
    assert_eq!(fio_errors(&v), 0, "{v}");
    let script = r#"
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.trim(1 << 20, 8 << 20)
h.zero(1 << 20, 60 << 20)
h.flush()
h.shutdown()
print("ok")
"#;
    nbd_script(script, &uri);
    lab.must(&["volume", "snapshot", "create", "vm", "s1"]);
    // And more after s1 (the live volume moves on; s1 stays).
    let v = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--bs=64k",
            "--size=96M",
            "--io_size=2M",
            "--randrepeat=0",
        ],
    );
    assert_eq!(fio_errors(&v), 0, "{v}");

    let (s0, s1) = (snap_uri(&lab, "vm", "s0"), snap_uri(&lab, "vm", "s1"));
    let img0 = tmp.path().join("s0.img");
    let img1 = tmp.path().join("s1.img");
    must(Command::new("nbdcopy").arg(&s0).arg(&img0));
    must(Command::new("nbdcopy").arg(&s1).arg(&img1));
    let (d0, d1) = (std::fs::read(&img0).unwrap(), std::fs::read(&img1).unwrap());
    assert_eq!((d0.len() as u64, d1.len() as u64), (size, size));
    let differ: Vec<u64> = (0..size / BS)
        .filter(|&b| {
            let r = (b * BS) as usize..((b + 1) * BS) as usize;
            d0[r.clone()] != d1[r]
        })
        .collect();
    assert!(
        differ.len() > 256,
        "the writes changed blocks: {}",
        differ.len()
    );

    // The changes from s0 to s1: every block that differs, and no more than was written
    // (4 MiB of fio, 1 MiB trimmed and 1 MiB zeroed).
    let c = lab.json(&["volume", "changes", "vm", "--from", "s0", "--to", "s1"]);
    let r01 = runs(&c);
    for &b in &differ {
        assert!(
            covered(&r01, b),
            "block {b} differs between s0 and s1 but is not listed"
        );
    }
    let changed = c["changed_bytes"].as_u64().unwrap();
    assert!(
        changed >= differ.len() as u64 * BS && changed <= (4 + 1 + 1) << 20,
        "changed bytes {changed} for {} differing blocks",
        differ.len()
    );
    // The same runs through NBD: s1's export offers s0 as a dirty bitmap.
    assert_eq!(
        dirty_map(&s1, "qemu:dirty-bitmap:s0"),
        r01,
        "nbdinfo --map on vm@s1"
    );
    // Since s1, on the live volume: what the 64 KiB writes touched.
    let now = lab.json(&["volume", "changes", "vm", "--from", "s1"]);
    let live = now["changed_bytes"].as_u64().unwrap();
    assert!(live > 0 && live <= 2 << 20, "changed since s1: {live}");
    assert_eq!(
        dirty_map(&uri, "qemu:dirty-bitmap:s1"),
        runs(&now),
        "live map"
    );

    // Back up: s0 whole, then s0 → s1.
    let full = tmp.path().join("full.diff");
    let incr = tmp.path().join("incr.diff");
    let p = |x: &Path| x.display().to_string();
    lab.must(&["volume", "export-diff", "vm", "--to", "s0", &p(&full)]);
    lab.must(&[
        "volume",
        "export-diff",
        "vm",
        "--from",
        "s0",
        "--to",
        "s1",
        &p(&incr),
    ]);
    let incr_len = std::fs::metadata(&incr).unwrap().len();
    assert!(
        incr_len < changed + (1 << 20),
        "the incremental diff ({incr_len} bytes) holds the changes ({changed}), not the volume"
    );
    let e = lab.fails(&["volume", "export-diff", "vm", "--to", "s0", &p(&full)]);
    assert!(e.contains("exists"), "{e}");

    // Restore into a new volume, owned by another node: each import reproduces its
    // snapshot exactly and takes it on the target.
    lab.create_owned("restored", "96M", "mirror-2", 3);
    let ruri = lab.uri("restored");
    // Out of order: the incremental needs s0 on the target.
    let e = lab.fails(&["volume", "import-diff", "restored", &p(&incr)]);
    assert!(e.contains("no snapshot named s0"), "{e}");
    let out = lab.must(&["volume", "import-diff", "restored", &p(&full)]);
    assert!(out.contains("snapshot restored@s0 taken"), "{out}");
    compare(&ruri, Path::new(&s0), "restored after the full import");
    // A damaged diff is refused before anything is written.
    let mut bad = std::fs::read(&incr).unwrap();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x01;
    let badp = tmp.path().join("bad.diff");
    std::fs::write(&badp, &bad).unwrap();
    let e = lab.fails(&["volume", "import-diff", "restored", &p(&badp)]);
    assert!(e.contains("damaged") || e.contains("mismatch"), "{e}");
    compare(
        &ruri,
        Path::new(&s0),
        "restored after a damaged import was refused",
    );
    // Written since s0: refused unless forced.
    must(
        Command::new("nbdcopy")
            .arg(random_file(tmp.path(), "x.img", 1 << 20, 9))
            .arg(&ruri),
    );
    let e = lab.fails(&["volume", "import-diff", "restored", &p(&incr)]);
    assert!(e.contains("was written since its snapshot s0"), "{e}");
    lab.must(&["volume", "snapshot", "rollback", "restored", "s0", "--yes"]);
    let out = lab.must(&["volume", "import-diff", "restored", &p(&incr)]);
    assert!(out.contains("snapshot restored@s1 taken"), "{out}");
    compare(
        &ruri,
        Path::new(&s1),
        "restored after the incremental import",
    );
    compare(
        &snap_uri(&lab, "restored", "s0"),
        Path::new(&s0),
        "the restored volume's own s0",
    );
    // Applied already: refused.
    let e = lab.fails(&["volume", "import-diff", "restored", &p(&incr)]);
    assert!(e.contains("already has a snapshot named s1"), "{e}");
    // Through a pipe too: export to standard output, import from standard input.
    lab.create_owned("piped", "96M", "mirror-2", 1);
    let sh = format!(
        "{bin} volume export-diff vm --to s1 - | {bin} volume import-diff piped -",
        bin = converge_bin().display()
    );
    must(
        Command::new("sh")
            .arg("-c")
            .arg(&sh)
            .env("CONVERGE_LAB_DIR", lab.path())
            .env_remove("CONVERGE_API"),
    );
    compare(
        &lab.uri("piped"),
        Path::new(&s1),
        "a full image through a pipe",
    );
}
