//! End-to-end: deleting a volume leaves nothing behind, even with clients attached or a
//! node down.
//!
//! * A client still attached to a deleted volume (on the owner, and on another node that
//!   forwards to it) gets an error for its next write; no slab record and no extent comes
//!   back (before, the owner's live handle re-allocated the freed extents).
//! * Extents of a volume deleted while their node was down are freed when the node
//!   starts again (orphan reclaim), so the drive's space returns.

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
