//! End-to-end: the lab's fault injector does what it says, with real mechanisms — a paused
//! daemon (SIGSTOP) loses its lease and comes back; a node whose link is cut (network
//! namespace + veth down) is unreachable and comes back when healed while the others keep
//! serving; two nodes cut from each other only (routes) stay live while the owner stales
//! and later resyncs the copy it cannot reach; flipped bits in a node's drive files are met by reads and repaired.
//! No assertion is on a timing: state changes are polled with generous deadlines.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// The lease TTL is 10 s; leave room for a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(120);

/// Polls `f` until it returns true; panics with `what` and the logs at the deadline.
fn eventually(lab: &Lab, what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(
            Instant::now() < end,
            "timed out waiting until {what}\n{}",
            lab.logs()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Node `id`'s `live` flag in `converge node list`, or None if the CLI got no answer.
fn live(lab: &Lab, id: u64) -> Option<bool> {
    let o = run(&mut lab.cmd(&["node", "list", "--json"]));
    if !o.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
    v.as_array()?
        .iter()
        .find(|n| n["id"].as_u64() == Some(id))
        .and_then(|n| n["live"].as_bool())
}

/// `lab ps --json` state of a process.
fn state(lab: &Lab, name: &str) -> String {
    let ps = lab.json(&["lab", "ps"]);
    ps.as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in lab ps: {ps}"))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Running (a zombie waiting for its reaper has an empty command line).
fn alive(pid: i64) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

fn node_api(lab: &Lab, id: usize) -> String {
    lab.lab_json()["nodes"][id - 1]["api"]
        .as_str()
        .unwrap()
        .to_string()
}

fn node_pid(lab: &Lab, id: usize) -> i64 {
    lab.lab_json()["nodes"][id - 1]["proc"]["pid"]
        .as_i64()
        .unwrap()
}

fn write_random(lab: &Lab, volume: &str, len: usize, seed: u64) -> (tempfile::TempDir, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let src = random_file(tmp.path(), "src.img", len, seed);
    must(Command::new("nbdcopy").arg(&src).arg(lab.uri(volume)));
    let data = std::fs::read(&src).unwrap();
    (tmp, data)
}

fn read_back(lab: &Lab, volume: &str, tmp: &tempfile::TempDir) -> Vec<u8> {
    let back = tmp.path().join("back.img");
    let _ = std::fs::remove_file(&back);
    must(Command::new("nbdcopy").arg(lab.uri(volume)).arg(&back));
    std::fs::read(&back).unwrap()
}

#[test]
fn paused_node_loses_its_lease_and_is_live_again_when_resumed() {
    let lab = Lab::up(3, &[]);
    let pid = node_pid(&lab, 2);
    let out = lab.must(&["lab", "fault", "pause", "2"]);
    assert!(out.contains("paused"), "{out}");
    assert_eq!(state(&lab, "node2"), "paused");
    // The kernel agrees: the process is stopped, not gone.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let st = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .next();
    assert_eq!(st, Some("T"), "{stat}");
    let e = lab.fails(&["lab", "fault", "pause", "2"]);
    assert!(e.contains("already paused"), "{e}");

    eventually(&lab, "paused node2 is down in `node list`", || {
        live(&lab, 2) == Some(false)
    });
    // The CLI picks a node that answers, so cluster commands keep working.
    let st = lab.json(&["status"]);
    assert!(
        st["health"].as_str().unwrap().contains("node2"),
        "status names the down node: {st}"
    );

    lab.must(&["lab", "fault", "resume", "2"]);
    assert_eq!(state(&lab, "node2"), "running");
    assert_eq!(node_pid(&lab, 2), pid, "the same process continues");
    eventually(&lab, "resumed node2 is live again", || {
        live(&lab, 2) == Some(true)
    });

    // Partitions need namespaces: a clear refusal without them.
    let e = lab.fails(&["lab", "fault", "partition", "1"]);
    assert!(e.contains("--netns"), "{e}");

    // `lab down` stops a paused node too.
    lab.must(&["lab", "fault", "pause", "3"]);
    let pid3 = node_pid(&lab, 3);
    let out = lab.must(&["lab", "down"]);
    assert!(out.contains("node3"), "{out}");
    assert!(!alive(pid3), "paused node3 (pid {pid3}) survived lab down");
    for n in ["etcd", "node1", "node2", "node3"] {
        assert_eq!(state(&lab, n), "dead", "{n}");
    }
}

/// The network namespace (its inode) of a process and of a named namespace.
fn netns_inode_of_pid(pid: i64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .ino()
}

fn netns_inode(name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/run/netns/{name}"))
        .unwrap()
        .ino()
}

#[test]
fn partitioned_node_is_cut_off_while_others_serve_and_rejoins_when_healed() {
    require_root();
    let lab = Lab::up(3, &["--netns"]);
    let lj = lab.lab_json();
    let net = &lj["net"];
    let bridge = net["bridge"].as_str().unwrap().to_string();
    let netns: Vec<String> = net["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["netns"].as_str().unwrap().to_string())
        .collect();
    let veths: Vec<String> = net["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["veth"].as_str().unwrap().to_string())
        .collect();
    // Every daemon really runs in its own namespace (the PID is the daemon's, not ip's).
    for (i, ns) in netns.iter().enumerate() {
        let pid = node_pid(&lab, i + 1);
        assert_eq!(netns_inode_of_pid(pid), netns_inode(ns), "node{}", i + 1);
        let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(
            cmd.starts_with(&format!(
                "{}\0",
                converge_bin().with_file_name("converged").display()
            )),
            "{cmd:?}"
        );
    }
    assert_eq!(state(&lab, "node3"), "running");

    // A volume owned by node 1, written before the cut.
    lab.must(&[
        "volume",
        "create",
        "part",
        "--size",
        "128M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let (tmp, data) = write_random(&lab, "part", 128 << 20, 11);

    let api3 = node_api(&lab, 3);
    let pid3 = node_pid(&lab, 3);
    let out = lab.must(&["lab", "fault", "partition", "3"]);
    assert!(out.contains(&veths[2]), "{out}");
    assert_eq!(state(&lab, "node3"), "partitioned");
    let e = lab.fails(&["lab", "fault", "partition", "3"]);
    assert!(e.contains("already partitioned"), "{e}");
    // Its API cannot be reached from the root namespace, though the process runs.
    let o = run(&mut lab.cmd(&["node", "list", "--api", &api3]));
    assert!(
        !o.status.success(),
        "node3's API answered while partitioned"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("cannot reach"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(alive(pid3), "node3 died when partitioned\n{}", lab.logs());
    // And it cannot reach etcd: the others see it down once its lease runs out.
    eventually(&lab, "partitioned node3 is down in `node list`", || {
        live(&lab, 3) == Some(false)
    });
    // The volume, served by node 1, stays readable and intact during the partition.
    assert!(
        read_back(&lab, "part", &tmp) == data,
        "volume read during the partition differs\n{}",
        lab.logs()
    );

    lab.must(&["lab", "fault", "heal", "3"]);
    assert_eq!(state(&lab, "node3"), "running");
    eventually(&lab, "healed node3 is live again", || {
        live(&lab, 3) == Some(true)
    });
    lab.must(&["node", "list", "--api", &api3]);
    assert_eq!(node_pid(&lab, 3), pid3, "the same process rejoined");

    // Cut only the link between the owner (node 1) and node 3: both still reach etcd, so
    // node 3 stays live, yet a write cannot reach node 3's copy and the owner marks it
    // stale; healing the link lets the owner resync it.
    let out = lab.must(&["lab", "fault", "partition", "1", "--from", "3"]);
    assert!(out.contains("cut from node3"), "{out}");
    assert_eq!(state(&lab, "node1"), "running, cut from 3");
    assert_eq!(state(&lab, "node3"), "running, cut from 1");
    assert_eq!(state(&lab, "node2"), "running");
    let ps = lab.json(&["lab", "ps"]);
    assert_eq!(ps[1]["cut_from"], serde_json::json!([3]), "{ps}");
    let e = lab.fails(&["lab", "fault", "partition", "3", "--from", "1"]);
    assert!(e.contains("already cut from node1"), "{e}");
    let (tmp, data) = write_random(&lab, "part", 128 << 20, 12);
    eventually(&lab, "node3's copy is stale while node3 is live", || {
        lab.extents("part")
            .iter()
            .any(|(_, node, st)| *node == 3 && st == "stale")
            && live(&lab, 3) == Some(true)
    });
    let out = lab.must(&["lab", "fault", "heal", "3", "--from", "1"]);
    assert!(out.contains("links with node1 restored"), "{out}");
    assert_eq!(state(&lab, "node1"), "running");
    eventually(&lab, "node3's copy is resynced after the cut heals", || {
        all_in_sync(&lab, "part")
    });
    assert!(read_back(&lab, "part", &tmp) == data);
    assert_copies_agree(&lab, "part");

    // kill -9 and restart keep working inside namespaces.
    lab.must(&["lab", "fault", "kill", "2"]);
    assert_eq!(state(&lab, "node2"), "dead");
    lab.must(&["lab", "fault", "restart", "2"]);
    let pid2 = node_pid(&lab, 2);
    assert_eq!(netns_inode_of_pid(pid2), netns_inode(&netns[1]));
    assert!(read_back(&lab, "part", &tmp) == data);

    // lab down (a node partitioned, another paused) removes every namespace and link.
    lab.must(&["lab", "fault", "partition", "2"]);
    lab.must(&["lab", "fault", "pause", "3"]);
    let out = lab.must(&["lab", "down"]);
    assert!(out.contains(&format!("bridge {bridge}")), "{out}");
    for ns in &netns {
        assert!(
            !std::path::Path::new(&format!("/run/netns/{ns}")).exists(),
            "{ns} left behind"
        );
    }
    for l in veths.iter().chain([&bridge]) {
        assert!(
            !std::path::Path::new(&format!("/sys/class/net/{l}")).exists(),
            "{l} left behind"
        );
    }
    // And `lab up` builds the network again for the same lab, data intact.
    lab.must(&["lab", "up"]);
    assert!(read_back(&lab, "part", &tmp) == data);
}

#[test]
fn corrupted_blocks_are_met_by_reads_and_repaired() {
    let lab = Lab::up(3, &[]);
    lab.must(&[
        "volume",
        "create",
        "rot",
        "--size",
        "64M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let e = lab.fails(&["lab", "fault", "corrupt", "1", "--blocks", "5"]);
    assert!(e.contains("no written data blocks"), "{e}");

    let (tmp, data) = write_random(&lab, "rot", 64 << 20, 5);
    // Node 1 owns the volume and reads its own copy first, so its bad blocks are met.
    let r = lab.json(&["lab", "fault", "corrupt", "1", "--blocks", "5"]);
    let flips = r["flips"].as_array().unwrap();
    assert_eq!(flips.len(), 5, "{r}");
    let mut blocks: Vec<(String, u64, u64)> = flips
        .iter()
        .map(|f| {
            (
                f["drive"].as_str().unwrap().to_string(),
                f["slab"].as_u64().unwrap(),
                f["block"].as_u64().unwrap(),
            )
        })
        .collect();
    blocks.sort();
    blocks.dedup();
    assert_eq!(blocks.len(), 5, "distinct blocks: {r}");
    let node1_drives: Vec<String> = lab.lab_json()["nodes"][0]["drives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    for f in flips {
        assert_eq!(f["volume"], "rot", "{f}");
        let path = f["path"].as_str().unwrap();
        assert!(node1_drives.iter().any(|d| d == path), "{path}");
        // The drive file holds the flipped byte.
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        std::fs::File::open(path)
            .unwrap()
            .read_exact_at(&mut b, f["offset_bytes"].as_u64().unwrap())
            .unwrap();
        assert_eq!(u64::from(b[0]), f["after"].as_u64().unwrap(), "{f}");
        assert_eq!(
            (f["before"].as_u64().unwrap() ^ f["after"].as_u64().unwrap()).count_ones(),
            1,
            "{f}"
        );
    }

    // Reads return the good data, and the daemon (O_DIRECT) met exactly those blocks.
    let repaired = "converge_volume_repaired_blocks_total";
    assert_eq!(lab.metric(1, repaired), 0);
    assert!(
        read_back(&lab, "rot", &tmp) == data,
        "a read returned damaged data\n{}",
        lab.logs()
    );
    assert_eq!(lab.metric(1, repaired), 5, "each flipped block repaired");
    // The repair rewrote them: a second read finds nothing to repair.
    assert!(read_back(&lab, "rot", &tmp) == data);
    assert_eq!(lab.metric(1, repaired), 5);

    // Human output names what was flipped.
    let out = lab.must(&["lab", "fault", "corrupt", "2", "--blocks", "2"]);
    assert!(
        out.contains("rot") && out.contains("flipped one bit"),
        "{out}"
    );
}
