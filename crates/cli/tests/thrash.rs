//! The thrash test: a 4-node lab (each node in its own network namespace), several
//! mirror-3 volumes owned by nodes 2-4, a checker client per volume writing and verifying
//! every acked write through node 1, and a nemesis that kills -9 and restarts nodes
//! (owners included), pauses them, cuts their network link and flips bits in their
//! drives, one fault at a time, letting the cluster heal in between.
//!
//! Pass: zero verify failures; zero client-visible I/O errors (only one node is ever
//! faulted, so min_replicas copies stay reachable); afterwards every copy is in sync and
//! a scrub finds nothing to repair.
//!
//! `CONVERGE_THRASH_SECS` sets how long the nemesis runs (default 120 s; `bench/thrash`
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
    let secs = env_u64("CONVERGE_THRASH_SECS", 120);
    let seed = env_u64("CONVERGE_THRASH_SEED", 1);
    thrash_run(secs, seed, false);
}

/// The same with a RAM cache drive per node (write-back: acked writes sit in the caches
/// when nodes are killed, paused and partitioned) and the pool's cache mode switched among
/// none, write and read-write as one more fault.
#[test]
fn thrash_with_cache_drives() {
    let secs = env_u64("CONVERGE_THRASH_CACHE_SECS", 90);
    let seed = env_u64("CONVERGE_THRASH_SEED", 1) + 1000;
    thrash_run(secs, seed, true);
}

fn thrash_run(secs: u64, seed: u64, cache: bool) {
    let mut args = vec!["--netns", "--repair-delay", "3600"];
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
    for i in 1..=VOLUMES {
        lab.must(&[
            "volume",
            "create",
            &format!("t{i}"),
            "--size",
            "128M",
            "--resiliency",
            "mirror-3",
            "--owner",
            &(i + 1).to_string(),
        ]);
    }
    let checker = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/thrash/checker.py")
        .canonicalize()
        .unwrap();
    let stop = lab.path().join("thrash.stop");
    let clients: Vec<_> = (1..=VOLUMES)
        .map(|i| {
            Command::new("/usr/bin/python3")
                .arg(&checker)
                .args(["--uri", &lab.uri_on(&format!("t{i}"), 1)])
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
            "cache-mode",
            "corrupt",
        ]
    } else {
        &["kill", "pause", "partition", "corrupt"]
    };
    let mut k = 0;
    std::thread::sleep(Duration::from_secs(3));
    while start.elapsed() < Duration::from_secs(secs) {
        let kind = kinds[k % kinds.len()];
        k += 1;
        let node = rng.gen_range(2..=4u32).to_string();
        // Sometimes shorter than the replica timeout, sometimes past the lease TTL.
        let hold = Duration::from_millis(rng.gen_range(1000..12000));
        eprintln!(
            "thrash {:>4}s: {kind} node {node} for {hold:?}",
            start.elapsed().as_secs()
        );
        match kind {
            "kill" => {
                lab.must(&["lab", "fault", "kill", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "restart", &node]);
            }
            "pause" => {
                lab.must(&["lab", "fault", "pause", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "resume", &node]);
            }
            "partition" => {
                lab.must(&["lab", "fault", "partition", &node]);
                std::thread::sleep(hold);
                lab.must(&["lab", "fault", "heal", &node]);
            }
            "cache-mode" => {
                let mode = ["none", "write", "read-write"][rng.gen_range(0..3usize)];
                eprintln!("thrash: cache mode {mode}");
                lab.must(&["cache", "mode", mode]);
                std::thread::sleep(hold);
            }
            _ => {
                // A node that holds written blocks (placement decides which do).
                let first = rng.gen_range(0..4u32);
                let hit = (0..4u32).map(|i| (first + i) % 4 + 1).find(|n| {
                    run(&mut lab.cmd(&["lab", "fault", "corrupt", &n.to_string(), "--blocks", "4"]))
                        .status
                        .success()
                });
                assert!(hit.is_some(), "no node has written blocks to corrupt");
            }
        }
        *faults.entry(kind).or_default() += 1;
        lab.wait_for("the cluster to heal", Duration::from_secs(240), || {
            healed(&lab)
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
        "thrash{}: {} s of faults, seed {seed}: {faults:?}; clients {totals:?}; scrub repaired {scrubbed:?}",
        if cache { " (cache drives)" } else { "" },
        start.elapsed().as_secs()
    );
    assert_eq!(
        totals.get("verify_failures").copied().unwrap_or(0),
        0,
        "verify failures: {errors:#?}\n{}",
        lab.logs()
    );
    assert_eq!(
        totals.get("io_errors").copied().unwrap_or(0),
        0,
        "client-visible I/O errors with one node faulted at a time: {errors:#?}\n{}",
        lab.logs()
    );
    assert!(totals["writes"] > 0 && totals["reads"] > 0);
    assert!(healed(&lab));
}
