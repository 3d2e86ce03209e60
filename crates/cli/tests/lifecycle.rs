//! End-to-end: deleting a volume leaves nothing behind, even with clients attached or a
//! node down; and a pool that fills up says so and loses nothing.
//!
//! * A client still attached to a deleted volume (on the owner, and on another node that
//!   forwards to it) gets an error for its next write; no slab record and no extent comes
//!   back (before, the owner's live handle re-allocated the freed extents).
//! * Extents of a volume deleted while their node was down are freed when the node
//!   starts again (orphan reclaim), so the drive's space returns.
//! * etcd stays bounded: an idle cluster writes (next to) nothing to etcd, and an etcd out of
//!   space (NOSPACE) is a health fault the cluster serves I/O through and recovers from by
//!   itself once room returns.
//! * A full pool (issue 42): provisioning beyond the overcommit ratio is refused; fio
//!   filling a volume gets ENOSPC, not EIO, and promptly; every acked block verifies;
//!   `status` says full; a TRIM of another volume frees space and writes resume.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Connects to the export, writes block 0 (must succeed), then waits for a line on stdin
/// and writes block 1: prints `OK` or `ERR <why>`.
const CLIENT: &str = r#"
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(b"\x11" * 4096, 0)
print("ready", flush=True)
sys.stdin.readline()
try:
    h.pwrite(b"\x22" * 65536, 1 << 20)
    print("OK", flush=True)
except nbd.Error as e:
    print("ERR " + str(e).replace("\n", " "), flush=True)
"#;

fn extents_used(lab: &Lab, nodes: u32) -> Vec<u64> {
    (1..=nodes)
        .map(|n| lab.metric(n, "converge_drive_extents_used"))
        .collect()
}

#[test]
fn a_deleted_volume_fails_its_attached_clients_and_leaves_no_extent_behind() {
    let lab = Lab::up(3, &[]);
    lab.create_owned("gone", "256M", "mirror-3", 1);
    // One client on the owner, one forwarded through node 2.
    let mut clients = Vec::new();
    for node in [1, 2] {
        let mut c = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(CLIENT)
            .arg(lab.uri_on("gone", node))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the client");
        let mut line = String::new();
        use std::io::BufRead;
        let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "client on node {node}");
        clients.push((node, c, out));
    }
    assert!(extents_used(&lab, 3).iter().all(|&n| n > 0));

    lab.must(&["volume", "delete", "gone"]);
    for (node, mut c, mut out) in clients {
        use std::io::{BufRead, Write};
        c.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(
            line.starts_with("ERR"),
            "a write through node {node} to the deleted volume answered {line:?}\n{}",
            lab.logs()
        );
        drop(c.stdin.take());
        c.wait().unwrap();
    }
    // Nothing came back: no volume, no slab, no extent on any drive.
    let e = lab.fails(&["volume", "show", "gone"]);
    assert!(e.contains("gone"), "{e}");
    assert_eq!(extents_used(&lab, 3), vec![0, 0, 0], "{}", lab.logs());
    lab.must(&["lab", "down"]);
}

#[test]
fn extents_of_a_volume_deleted_while_their_node_was_down_are_freed_when_it_returns() {
    let lab = Lab::up(3, &[]);
    let uri = lab.create_volume("orphan", "192M", "mirror-3");
    fio(
        &uri,
        &["--rw=write", "--bs=1M", "--size=192M", "--iodepth=4"],
    );
    let before = extents_used(&lab, 3);
    assert!(before.iter().all(|&n| n >= 3), "{before:?}");
    lab.must(&["lab", "fault", "kill", "3"]);
    lab.must(&["volume", "delete", "orphan"]);
    let now = extents_used(&lab, 2);
    assert_eq!(now, vec![0, 0], "the live nodes free their copies at once");
    lab.must(&["lab", "fault", "restart", "3"]);
    lab.wait_for("node 3 is live", Duration::from_secs(120), || {
        lab.json(&["node", "list"])
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == 3 && n["live"] == true)
    });
    lab.wait_for(
        "node 3 to free the orphaned extents",
        Duration::from_secs(120),
        || extents_used(&lab, 3)[2] == 0,
    );
    assert!(
        lab.metric(3, "converge_orphan_extents_freed_total") >= before[2],
        "{}",
        lab.logs()
    );
    lab.must(&["lab", "down"]);
}

/// etcdctl as node 1 reaches etcd (its certificate, the lab's CA), with `args`; the
/// value to put, if any, on stdin.
fn etcdctl(lab: &Lab, args: &[&str], stdin: Option<&[u8]>) -> std::process::Output {
    let conf = std::fs::read_to_string(lab.path().join("node1/converged.toml")).unwrap();
    let field = |name: &str| -> String {
        conf.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = ")))
            .unwrap_or_else(|| panic!("{name} in node 1's config:\n{conf}"))
            .trim_matches('"')
            .to_string()
    };
    let endpoint = lab.lab_json()["etcd_endpoint"]
        .as_str()
        .unwrap()
        .to_string();
    let mut c = Command::new("etcdctl");
    c.env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .arg(format!(
            "--cacert={}",
            lab.path().join("pki/ca.crt").display()
        ))
        .arg(format!("--cert={}", field("cert_file")))
        .arg(format!("--key={}", field("key_file")))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("etcdctl (package etcd-client)");
    {
        use std::io::Write;
        let mut input = child.stdin.take().unwrap();
        if let Some(v) = stdin {
            input.write_all(v).unwrap();
        }
    }
    child.wait_with_output().unwrap()
}

/// etcd's store revision: every write (put, delete, transaction) raises it by one.
fn etcd_revision(lab: &Lab) -> i64 {
    let o = etcdctl(lab, &["endpoint", "status", "-w", "json"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v[0]["Status"]["header"]["revision"].as_i64().unwrap()
}

/// Writes an idle cluster may make to etcd per node per minute. Before, every node with a
/// cache drive rewrote its cache record every second and each drive's wear record every
/// `wear_record_s` (5 s in the lab): ~100 writes per node-minute. Now records are written
/// when they change, so an idle lab writes none; one per node-minute leaves room for a
/// rewrite that falls in the window.
const IDLE_WRITES_PER_NODE_MINUTE_MAX: i64 = 1;

#[test]
fn an_idle_cluster_leaves_etcd_alone_and_a_full_etcd_is_survived_and_recovered() {
    let lab = Lab::up(
        4,
        &[
            "--ram",
            "--cache-drives",
            "1",
            "--cache-size",
            "64M",
            "--cache-in-ram",
            "--etcd-quota",
            "16M",
        ],
    );
    lab.create_owned("v", "256M", "mirror-2", 1);
    let uri = lab.uri("v");
    // The first two slabs: written, cached, destaged.
    let w = fio(
        &uri,
        &["--rw=write", "--bs=256k", "--size=128M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&w), 0);
    lab.must(&["cache", "flush"]);

    // Idle: the caches' counters settle (published at most every 30 s), then a minute
    // of nothing happening is counted.
    std::thread::sleep(Duration::from_secs(35));
    let before = etcd_revision(&lab);
    std::thread::sleep(Duration::from_secs(60));
    let writes = etcd_revision(&lab) - before;
    assert!(
        writes <= 4 * IDLE_WRITES_PER_NODE_MINUTE_MAX,
        "an idle 4-node lab wrote {writes} times to etcd in a minute"
    );

    // etcd out of space: live data past 90 % of the quota (16 MiB), which compaction cannot
    // free. A put past the quota is refused and raises NOSPACE; the leader then compacts all
    // history and defragments, and if the live data left is under 90 % of the quota there is
    // room, so it disarms (as designed). More junk then goes in, until the leader keeps the
    // alarm and says so in its log.
    let junk = vec![b'j'; 1 << 20];
    let kept = || {
        (1..=4).any(|n| {
            std::fs::read_to_string(lab.path().join(format!("node{n}/converged.log")))
                .unwrap_or_default()
                .contains("etcd is still out of space after compaction")
        })
    };
    let mut i = 0;
    for _round in 0..10 {
        let mut full = false;
        for _ in 0..40 {
            let o = etcdctl(&lab, &["put", &format!("/junk/{i}")], Some(&junk));
            i += 1;
            if !o.status.success() {
                let e = String::from_utf8_lossy(&o.stderr);
                assert!(e.contains("database space exceeded"), "{e}");
                full = true;
                break;
            }
        }
        assert!(full, "40 MiB more of keys fill a 16 MiB quota");
        lab.wait_for(
            "the leader to disarm NOSPACE (room left) or keep it (none)",
            Duration::from_secs(60),
            || {
                kept()
                    || lab.json(&["status"])["etcd"]["alarms"]
                        .as_array()
                        .is_some_and(|a| a.is_empty())
            },
        );
        if kept() {
            break;
        }
    }
    assert!(
        kept(),
        "the leader never found etcd still full after compaction"
    );
    lab.wait_for(
        "status to say etcd is out of space",
        Duration::from_secs(60),
        || {
            let st = lab.json(&["status"]);
            st["health"].as_str().unwrap().contains("etcd out of space")
                && st["etcd"]["alarms"][0]
                    .as_str()
                    .is_some_and(|a| a.starts_with("NOSPACE"))
        },
    );
    // Allocated slabs keep serving reads and writes.
    let w = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--size=128M",
            "--io_size=16M",
            "--verify=crc32c",
        ],
    );
    assert_eq!(fio_errors(&w), 0, "{}", lab.logs());
    assert!(
        lab.json(&["status"])["health"]
            .as_str()
            .unwrap()
            .contains("etcd out of space"),
        "the alarm stays while etcd is still full"
    );

    // Room returns (the junk goes; deletes are allowed while etcd is full): the leader
    // compacts, defragments and disarms by itself, and new slabs can be allocated again.
    let o = etcdctl(&lab, &["del", "--prefix", "/junk/"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    lab.wait_for(
        "the cluster to be healthy again",
        Duration::from_secs(60),
        || lab.json(&["status"])["health"] == "healthy",
    );
    let w = fio(
        &uri,
        &[
            "--rw=write",
            "--bs=256k",
            "--offset=128M",
            "--size=128M",
            "--verify=crc32c",
        ],
    );
    assert_eq!(fio_errors(&w), 0, "{}", lab.logs());
    let slabs = lab.json(&["volume", "show", "v"])["slabs"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(
        slabs, 4,
        "the last two slabs were allocated after the recovery"
    );
    lab.must(&["lab", "down"]);
}

/// Runs fio on `uri` (its nbd engine) to the end or its first error, and returns its JSON.
/// Fails if fio has not returned within `deadline`: a write that hangs instead of failing
/// is what this catches (a generous bound, not a timing assertion).
fn fio_to_first_error(
    dir: &std::path::Path,
    uri: &str,
    args: &[&str],
    deadline: Duration,
) -> serde_json::Value {
    let out = dir.join("fio.json");
    let mut child = Command::new("fio")
        .arg("--name=t")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--output-format=json")
        .arg("--verify_state_save=0")
        .args(args)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start fio");
    let end = std::time::Instant::now() + deadline;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fio did not return within {deadline:?}: a write hangs");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&out).unwrap();
    let start = text.find('{').expect("fio JSON output");
    serde_json::from_str(&text[start..]).expect("fio JSON parses")
}

#[test]
fn a_full_pool_answers_enospc_loses_no_acked_write_and_writes_resume_after_a_trim() {
    const M: u64 = 1 << 20;
    // Two 384 MiB drives a node hold 5 extents of 64 MiB each: 10 mirror-3 slabs in all.
    let lab = Lab::up(3, &["--ram", "--drive-size", "384M"]);
    let tmp = tempfile::tempdir().unwrap();
    let slabs_per_node = |lab: &Lab| -> u64 {
        lab.json(&["drive", "list"])
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["node"] == 1 && d["role"] == "capacity")
            .map(|d| d["extents_total"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(slabs_per_node(&lab), 10, "the lab's layout changed");
    let status = |lab: &Lab| lab.json(&["status"]);
    let state = |lab: &Lab| {
        status(lab)["capacity"]["state"]
            .as_str()
            .unwrap()
            .to_string()
    };

    // "snap": 2 slabs, then a snapshot and a whole slab rewritten: the copies keep the old
    // blocks, one more extent's worth of room on every node. Placement must count it.
    lab.create_owned("snap", "128M", "mirror-3", 1);
    let snap = lab.uri("snap");
    fio(&snap, &["--rw=write", "--bs=1M", "--size=128M"]);
    lab.must(&["volume", "snapshot", "create", "snap", "s1"]);
    fio(&snap, &["--rw=write", "--bs=1M", "--size=64M"]);
    lab.wait_for(
        "the kept blocks to be reported",
        Duration::from_secs(120),
        || status(&lab)["capacity"]["used_bytes"].as_u64().unwrap() >= 3 * 3 * 64 * M,
    );
    // "vm" (6 slabs) fits what is free now (7 slabs a node).
    lab.create_owned("vm", "384M", "mirror-3", 1);
    let vm = lab.uri("vm");
    // "other" (3 slabs, freed by a TRIM later) fits what is free too, but would provision
    // 2.1 GiB in all on 1.9 GiB raw: refused at the default overcommit ratio, with the
    // numbers and what to do; accepted at 1.5.
    let e = lab.fails(&[
        "volume",
        "create",
        "other",
        "--size",
        "192M",
        "--resiliency",
        "mirror-3",
    ]);
    for part in [
        "cannot create volume other",
        "overcommit ratio allows 1.00×",
        "--overcommit-ratio",
    ] {
        assert!(e.contains(part), "{e} lacks {part}");
    }
    lab.must(&["cluster", "set", "--overcommit-ratio", "1.5"]);
    lab.create_owned("other", "192M", "mirror-3", 1);
    let other = lab.uri("other");
    fio(&other, &["--rw=write", "--bs=1M", "--size=192M"]);

    // Fill "vm": 4 slabs fit (3 + 3 taken of 10), the fifth gets ENOSPC, at once.
    let job = ["--rw=write", "--bs=1M", "--iodepth=1", "--size=384M"];
    let mut write = verify_pass(&job, false);
    write.retain(|a| *a != "--do_verify=1");
    write.push("--do_verify=0");
    let v = fio_to_first_error(tmp.path(), &vm, &write, Duration::from_secs(300));
    let j = &v["jobs"][0];
    assert_eq!(
        j["error"].as_u64(),
        Some(28),
        "fio's error must be ENOSPC (28), not EIO (5): {j}\n{}",
        lab.logs()
    );
    let acked = j["write"]["io_bytes"].as_u64().unwrap();
    assert_eq!(
        acked,
        4 * 64 * M,
        "every write before the full slab was acked: {j}"
    );
    assert!(lab.metric_where(1, "converge_volume_no_space_errors_total", "volume=\"vm\"") >= 1.0);
    // Every acked block reads back as written.
    let size = format!("--size={acked}");
    let verify = verify_pass(&["--rw=write", "--bs=1M", &size], true);
    assert_eq!(fio_errors(&fio(&vm, &verify)), 0);
    lab.wait_for("status to say full", Duration::from_secs(120), || {
        state(&lab) == "full"
    });
    let st = status(&lab);
    assert!(
        st["health"].as_str().unwrap().starts_with("full: "),
        "{}",
        st["health"]
    );
    let shown = lab.must(&["status"]);
    assert!(shown.contains("warning: the pool is full"), "{shown}");

    // A TRIM of all of "other" gives its 3 slabs back: no longer full, and the rest of
    // "vm" (2 slabs) is written and verified, beside everything acked before.
    nbd_script(
        "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nh.trim(h.get_size(), 0)\nprint('ok')\n",
        &other,
    );
    lab.wait_for(
        "status to say the pool has room",
        Duration::from_secs(120),
        || state(&lab) == "ok",
    );
    let offset = format!("--offset={acked}");
    let rest = format!("--size={}", 384 * M - acked);
    let more = ["--rw=write", "--bs=1M", "--iodepth=1", &offset, &rest];
    assert_eq!(fio_errors(&fio(&vm, &verify_pass(&more, false))), 0);
    assert_eq!(
        fio_errors(&fio(&vm, &verify)),
        0,
        "the first fill still reads back"
    );
    assert_eq!(
        fio_errors(&fio(&snap, &["--rw=read", "--bs=1M", "--size=128M"])),
        0
    );
    // 9 of 10 slabs' room taken a node: near full.
    assert_eq!(state(&lab), "near-full", "{}", status(&lab));
    lab.must(&["lab", "down"]);
}
