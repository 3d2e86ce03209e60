//! The thrash test: a 4-node lab (each node in its own network namespace), several
//! mirror-3 volumes owned by nodes 2-4, and a checker client per volume writing and
//! verifying every acked write, while a nemesis hits every node, node 1 included: kill -9
//! and restart (owners and the nodes the checkers go through), pause, a cut network link,
//! a cut link between two nodes only (both still reach etcd), flipped bits in the drives,
//! and once per run a failed drive (its copies are rebuilt on other drives); one fault at
//! a time, letting the cluster heal in between.
//!
//! The checkers are clients of the cluster, not of one node: each knows every node's NBD
//! socket (any node serves any volume) and starts on node 1 (checker 2 on its volume's
//! owner, so local I/O is checked too). When its node is killed it reconnects through the
//! next live node and carries on; the write in flight then is unacked, and reads accept
//! the old or the new content of that block until it is written again. Every acked write
//! is verified exactly.
//!
//! Pass: zero verify failures; zero client-visible I/O errors (an error reply on a live
//! connection, or a connection closed by a node that still runs: only one node is ever
//! faulted, so min_replicas copies stay reachable); afterwards every copy is in sync and
//! a scrub finds nothing to repair.
//!
//! The runs without cache drives also keep a snapshot (of a mirror-3 volume, or of a
//! parity-2+1 one in the parity run), a mirror-3 clone of it with its own writes, and a
//! snapshot of the clone through all of it (docs/SNAPSHOTS.md), and read them back byte
//! for byte afterwards.
//!
//! `CONVERGE_THRASH_SECS` sets how long the nemesis runs (default 80 s, 60 s with cache drives; `bench/thrash`
//! runs it for as long as asked), `CONVERGE_THRASH_SEED` the fault sequence.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const VOLUMES: u32 = 3;
const BLOCKS: u32 = 16384; // 64 MiB of each volume is written and checked

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The lab's replica RPC timeout (`replica_timeout_ms = 3000` in the node configs `converge lab up` writes).
const REPLICA_TIMEOUT: Duration = Duration::from_millis(3000);

fn healed(lab: &Lab) -> bool {
    let nodes = run(&mut lab.cmd(&["node", "list", "--json"]));
    if !nodes.status.success() {
        return false;
    }
    let n: serde_json::Value = serde_json::from_slice(&nodes.stdout).unwrap_or_default();
    let all_live = n
        .as_array()
        .is_some_and(|a| a.iter().all(|x| x["live"] == true));
    all_live
        && (1..=VOLUMES).all(|i| {
            let o = run(&mut lab.cmd(&["volume", "show", &format!("t{i}"), "--json"]));
            o.status.success()
                && serde_json::from_slice::<serde_json::Value>(&o.stdout).is_ok_and(|v| {
                    v["slabs"].as_array().is_some_and(|s| {
                        s.iter().all(|s| {
                            s["extents"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .all(|e| e["state"] == "in-sync")
                        })
                    })
                })
        })
}

#[test]
fn thrash() {
    let secs = env_u64("CONVERGE_THRASH_SECS", 80);
    let seed = env_u64("CONVERGE_THRASH_SEED", 1);
    thrash_run(secs, seed, false, "mirror-3");
}

/// A snapshot, a clone of it written over in places, and the clone's own snapshot, made
/// before the faults; returns the images each must read as.
fn snapshots_and_clones(lab: &Lab, resiliency: &str) -> Vec<(String, std::path::PathBuf)> {
    let dir = lab.path().join("images");
    std::fs::create_dir_all(&dir).unwrap();
    lab.must(&[
        "volume",
        "create",
        "golden",
        "--size",
        "32M",
        "--resiliency",
        resiliency,
        "--owner",
        "2",
    ]);
    let golden = random_file(&dir, "golden.img", 32 << 20, 77);
    must(Command::new("nbdcopy").arg(&golden).arg(lab.uri("golden")));
    lab.must(&["volume", "snapshot", "create", "golden", "base"]);
    lab.must(&[
        "volume",
        "clone",
        "golden@base",
        "cl",
        "--owner",
        "3",
        "--resiliency",
        "mirror-3",
    ]);
    // The clone's own bytes over its first 4 MiB; the rest is the parent's.
    let own = random_file(&dir, "own.img", 4 << 20, 78);
    must(Command::new("nbdcopy").arg(&own).arg(lab.uri("cl")));
    lab.must(&["volume", "snapshot", "create", "cl", "cs"]);
    let mut want = std::fs::read(&golden).unwrap();
    want[..4 << 20].copy_from_slice(&std::fs::read(&own).unwrap());
    let clone_img = dir.join("clone.img");
    std::fs::write(&clone_img, &want).unwrap();
    // The parent moves on after its snapshot: neither the snapshot nor the clone sees it.
    must(
        Command::new("nbdcopy")
            .arg(random_file(&dir, "later.img", 32 << 20, 79))
            .arg(lab.uri("golden")),
    );
    vec![
        ("golden@base".into(), golden),
        ("cl".into(), clone_img.clone()),
        ("cl@cs".into(), clone_img),
    ]
}

/// The same with a RAM cache drive per node (write-back: acked writes sit in the caches
/// when nodes are killed, paused and partitioned) and the pool's cache mode switched among
/// none, write and read-write as one more fault.
#[test]
fn thrash_with_cache_drives() {
    let secs = env_u64("CONVERGE_THRASH_CACHE_SECS", 60);
    let seed = env_u64("CONVERGE_THRASH_SEED", 1) + 1000;
    thrash_run(secs, seed, true, "mirror-3");
}

/// The same with parity-2+1 volumes (docs/adr/0008): rows are written whole with held
/// priors, reads decode around the faulted node, a failed drive's chunks are rebuilt on the
/// one node that holds none of their slab (with the snapshot's rows, for the kept
/// parity volume).
#[test]
fn thrash_parity() {
    let secs = env_u64("CONVERGE_THRASH_PARITY_SECS", 45);
    let seed = env_u64("CONVERGE_THRASH_SEED", 1) + 2000;
    thrash_run(secs, seed, false, "parity-2+1");
}

fn thrash_run(secs: u64, seed: u64, cache: bool, resiliency: &str) {
    let mut args = vec!["--netns", "--repair-delay", "3600"];
    // Without caches the drives are RAM drives, which the daemon drives inline from its
    // tasks; the cache run's capacity drives are files on disk, driven from I/O threads:
    // the two runs cover both ways a node does its drive I/O.
    if !cache {
        args.push("--ram");
    }
    if cache {
        args.extend([
            "--cache-drives",
            "1",
            "--cache-size",
            "128M",
            "--cache-in-ram",
        ]);
    }
    let lab = Lab::up(4, &args);
    let kept = if !cache {
        snapshots_and_clones(&lab, resiliency)
    } else {
        Vec::new()
    };
    for i in 1..=VOLUMES {
        lab.must(&[
            "volume",
            "create",
            &format!("t{i}"),
            "--size",
            "128M",
            "--resiliency",
            resiliency,
            "--owner",
            &(i + 1).to_string(),
        ]);
    }
    let checker = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/thrash/checker.py")
        .canonicalize()
        .unwrap();
    let stop = lab.path().join("thrash.stop");
    let nodes = 4u32;
    let clients: Vec<_> = (1..=VOLUMES)
        .map(|i| {
            // Checker 2 starts on its volume's owner (node 3), the others on node 1.
            let first = if i == 2 { i + 1 } else { 1 };
            let mut c = Command::new("/usr/bin/python3");
            c.arg(&checker);
            for n in 1..=nodes {
                c.args(["--uri", &lab.uri_on(&format!("t{i}"), n)]);
            }
            c.args(["--first", &(first - 1).to_string()])
                .args(["--tag", &i.to_string()])
                .args(["--blocks", &BLOCKS.to_string()])
                .args(["--seed", &(seed + u64::from(i)).to_string()])
                .arg("--stop-file")
                .arg(&stop)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start checker")
        })
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut faults: BTreeMap<&str, u64> = BTreeMap::new();
    let start = Instant::now();
    let kinds: &[&str] = if cache {
        &[
            "kill",
            "cache-mode",
            "pause",
            "partition",
            "cut",
            "cache-mode",
            "corrupt",
        ]
    } else {
        &["kill", "pause", "partition", "cut", "corrupt"]
    };
    let mut k = 0;
    let mut killed_node1 = false;
    // The fourth fault fails a drive (once: the lab has two per node, and a failed drive
    // stays out until its node restarts).
    let mut drive_failed = false;
    // Faults per node ("cut" counts the first end, "corrupt" the node asked first).
    let mut nodes_faulted: BTreeMap<u32, u64> = BTreeMap::new();
    std::thread::sleep(Duration::from_secs(3));
    while start.elapsed() < Duration::from_secs(secs) {
        let kind = if k == 3 && !drive_failed {
            drive_failed = true;
            "fail-drive"
        } else {
            kinds[k % kinds.len()]
        };
        k += 1;
        // The first kill hits node 1, which the checkers go through, so every run
        // exercises their reconnecting; after that any node.
        let node = if kind == "kill" && !killed_node1 {
            1
        } else {
            rng.gen_range(1..=nodes)
        };
        killed_node1 |= kind == "kill" && node == 1;
        if kind != "cache-mode" {
            *nodes_faulted.entry(node).or_default() += 1;
        }
        let node = node.to_string();
        // Sometimes shorter than the replica timeout, sometimes past the lease TTL.
        let hold = Duration::from_millis(rng.gen_range(1000..12000));
        let elapsed = start.elapsed().as_secs();
        match kind {
            "kill" => {
                eprintln!("thrash {elapsed:>4}s: kill node {node} for {hold:?}");
                lab.must(&["lab", "fault", "kill", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "restart", &node]);
            }
            "pause" => {
                eprintln!("thrash {elapsed:>4}s: pause node {node} for {hold:?}");
                lab.must(&["lab", "fault", "pause", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "resume", &node]);
            }
            "partition" => {
                eprintln!("thrash {elapsed:>4}s: partition node {node} for {hold:?}");
                lab.must(&["lab", "fault", "partition", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "heal", &node]);
            }
            "cut" => {
                // Only the link between two nodes: both still reach etcd and the others.
                let other = ((node.parse::<u32>().unwrap() - 1 + rng.gen_range(1..nodes)) % nodes
                    + 1)
                .to_string();
                eprintln!("thrash {elapsed:>4}s: cut node {node} from node {other} for {hold:?}");
                lab.must(&["lab", "fault", "partition", &node, "--from", &other]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "heal", &node, "--from", &other]);
            }
            "fail-drive" => {
                let out = lab.json(&["lab", "fault", "fail-drive", &node]);
                let drive = out["drive"].clone();
                eprintln!("thrash {elapsed:>4}s: fail drive {drive} of node {node}");
                // Healed means more here: the drive is marked failed and no copy is left
                // on it.
                lab.wait_for(
                    "the failed drive's copies to be rebuilt",
                    Duration::from_secs(240),
                    || {
                        let failed = run(&mut lab.cmd(&["drive", "list", "--json"]));
                        let marked = failed.status.success()
                            && serde_json::from_slice::<serde_json::Value>(&failed.stdout)
                                .ok()
                                .and_then(|v| v.as_array().cloned())
                                .is_some_and(|a| {
                                    a.iter().any(|d| d["id"] == drive && !d["failed"].is_null())
                                });
                        marked
                            && (1..=VOLUMES).all(|i| {
                                let o = run(&mut lab.cmd(&[
                                    "volume",
                                    "show",
                                    &format!("t{i}"),
                                    "--json",
                                ]));
                                o.status.success()
                                    && serde_json::from_slice::<serde_json::Value>(&o.stdout)
                                        .is_ok_and(|v| {
                                            v["slabs"].as_array().is_some_and(|s| {
                                                s.iter().all(|s| {
                                                    s["extents"].as_array().is_some_and(|e| {
                                                        e.iter().all(|e| e["drive"] != drive)
                                                    })
                                                })
                                            })
                                        })
                            })
                    },
                );
            }
            "cache-mode" => {
                let mode = ["none", "write", "read-write"][rng.gen_range(0..3usize)];
                eprintln!("thrash {elapsed:>4}s: cache mode {mode} for {hold:?}");
                lab.must(&["cache", "mode", mode]);
                std::thread::sleep(hold);
            }
            _ => {
                // A node that holds written blocks (placement decides which do).
                let first = node.parse::<u32>().unwrap() - 1;
                let hit = (0..nodes).map(|i| (first + i) % nodes + 1).find(|n| {
                    run(&mut lab.cmd(&["lab", "fault", "corrupt", &n.to_string(), "--blocks", "4"]))
                        .status
                        .success()
                });
                eprintln!("thrash {elapsed:>4}s: corrupt 4 blocks on node {hit:?}");
                assert!(hit.is_some(), "no node has written blocks to corrupt");
            }
        }
        *faults.entry(kind).or_default() += 1;
        // Copies' states are only settled once every replica request sent during the fault
        // has been answered or has timed out: a write sent to a node just before its
        // partition healed marks that copy stale up to one replica timeout later. Judging
        // "healed" before that let the next fault hit a slab whose copy was about to go
        // stale (seed 1: a failed drive 0.3 s after a healed partition left one in-sync
        // copy, and writes failed with min_replicas 2).
        let ended = Instant::now();
        lab.wait_for("the cluster to heal", Duration::from_secs(240), || {
            ended.elapsed() >= REPLICA_TIMEOUT && healed(&lab)
        });
    }
    std::fs::write(&stop, b"").unwrap();
    let mut totals: BTreeMap<String, u64> = BTreeMap::new();
    let mut errors = Vec::new();
    for c in clients {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "checker failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "checker output: {e}: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        for (key, val) in v.as_object().unwrap() {
            if let Some(n) = val.as_u64() {
                *totals.entry(key.clone()).or_default() += n;
            }
        }
        errors.extend(v["errors"].as_array().cloned().unwrap_or_default());
    }
    // A scrub repairs what the corruption left on copies no read touched; a second one,
    // repair off, must find every copy intact and identical.
    let mut scrubbed = BTreeMap::new();
    for i in 1..=VOLUMES {
        let v = format!("t{i}");
        let r = &lab.json(&["scrub", "start", &v, "--wait"])[0];
        scrubbed.insert(v.clone(), r["repaired"].as_u64().unwrap_or(0));
        let r = &lab.json(&["scrub", "start", &v, "--wait", "--no-repair"])[0];
        assert_eq!(r["bad_checksums"], 0, "{v}: {r}");
        assert_eq!(
            r["mismatches"],
            0,
            "{v}: copies differ after healing: {r}\n{}",
            lab.logs()
        );
    }
    if totals.get("io_errors").copied().unwrap_or(0) > 0 {
        for n in 1..=4 {
            let log = std::fs::read_to_string(lab.path().join(format!("node{n}/converged.log")))
                .unwrap_or_default();
            for l in log
                .lines()
                .filter(|l| l.contains("nbd: ") || l.contains("Degraded"))
            {
                eprintln!("node{n}: {l}");
            }
        }
    }
    println!(
        "thrash{} ({resiliency}): {} s of faults, seed {seed}: {faults:?}, per node {nodes_faulted:?}; \
         clients {totals:?}; scrub repaired {scrubbed:?}",
        if cache { " (cache drives)" } else { "" },
        start.elapsed().as_secs()
    );
    assert_eq!(
        totals.get("verify_failures").copied().unwrap_or(0),
        0,
        "verify failures (seed {seed}): {errors:#?}\n{}",
        lab.logs()
    );
    assert_eq!(
        totals.get("io_errors").copied().unwrap_or(0),
        0,
        "client-visible I/O errors with one node faulted at a time (seed {seed}): {errors:#?}\n{}",
        lab.logs()
    );
    assert!(totals["writes"] > 0 && totals["reads"] > 0);
    // The snapshot, the clone and the clone's snapshot read exactly as before the faults.
    for (export, image) in &kept {
        let (vol, snap) = export.split_once('@').unwrap_or((export, ""));
        let uri = lab.uri(vol);
        let uri = if snap.is_empty() {
            uri
        } else {
            uri.replacen(&format!("/{vol}?"), &format!("/{vol}@{snap}?"), 1)
        };
        compare(
            &uri,
            image,
            &format!("{export} after the thrash (seed {seed})"),
        );
    }
    if killed_node1 {
        assert!(
            totals["lost_connections"] > 0 && totals["reconnects"] > 0,
            "node 1 was killed under the checkers, yet none lost its connection: {totals:?}"
        );
    }
    assert!(healed(&lab));
}
