//! End-to-end: a rolling upgrade from the previous release to this build, under a
//! verifying client.
//!
//! A lab is started by the previous release's own `converge lab up` (its configs, its
//! etcd records, its daemons: the binaries `scripts/prev-release.sh` builds from the
//! commit in RELEASES). A mirror-3 volume is written and read by the thrash checker (every
//! acked write verified; it reconnects through another node when its node restarts).
//! Then this build's `converge cluster rolling-restart` upgrades the nodes one at a time:
//! each node goes into maintenance (its volumes move), restarts as this build's
//! `converged` with the configuration and drives the previous release left, comes back,
//! leaves maintenance and resyncs; the previous release's nodes and this build's serve
//! side by side meanwhile. Pass: every node reports this build's version afterwards, the
//! checker saw 0 verify failures and 0 I/O errors, every copy is in sync and a scrub
//! finds nothing to repair.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The previous release's bin directory: `$CONVERGE_PREV_BIN` (scripts/test.sh sets it),
/// else what scripts/prev-release.sh builds (minutes, once).
fn prev_bin() -> PathBuf {
    if let Ok(d) = std::env::var("CONVERGE_PREV_BIN") {
        return PathBuf::from(d);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/prev-release.sh");
    let out = must(&mut Command::new(script));
    PathBuf::from(out.lines().last().expect("the bin directory").trim())
}

#[test]
fn a_rolling_upgrade_from_the_previous_release_loses_nothing() {
    require_tools();
    let prev = prev_bin();
    let prev_version = must(Command::new(prev.join("converged")).arg("--version"));
    let dir = tempfile::Builder::new()
        .prefix("cvlab")
        .tempdir_in("/tmp")
        .unwrap();
    let lab = Lab { dir };
    // The previous release's lab: its CLI writes the configs and starts its converged.
    must(
        Command::new(prev.join("converge"))
            .args([
                "lab",
                "up",
                "--nodes",
                "3",
                "--drives-per-node",
                "2",
                "--drive-size",
                "1G",
                "--slab-size",
                "64M",
                "--ram",
            ])
            .env("CONVERGE_LAB_DIR", lab.path())
            .env_remove("CONVERGE_API"),
    );
    lab.create_owned("up", "256M", "mirror-3", 2);
    let versions = |lab: &Lab| -> Vec<String> {
        lab.json(&["node", "list"])
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["version"].as_str().unwrap_or("?").to_string())
            .collect()
    };
    let before = versions(&lab);
    assert!(
        before.iter().all(|v| prev_version.contains(v.as_str())),
        "the lab runs {prev_version}: {before:?}"
    );

    // The checker writes and verifies 64 MiB of the volume, starting on node 1.
    let checker = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/thrash/checker.py")
        .canonicalize()
        .unwrap();
    let stop = lab.path().join("upgrade.stop");
    let mut c = Command::new("/usr/bin/python3");
    c.arg(&checker);
    for n in 1..=3 {
        c.args(["--uri", &lab.uri_on("up", n)]);
    }
    let client = c
        .args(["--tag", "1", "--blocks", "16384", "--seed", "42"])
        .arg("--stop-file")
        .arg(&stop)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the checker");
    std::thread::sleep(Duration::from_secs(3));

    // Every node restarts as this build, one at a time.
    let mut lab_json = lab.lab_json();
    let head = converge_bin().with_file_name("converged");
    for n in lab_json["nodes"].as_array_mut().unwrap() {
        n["proc"]["argv"][0] = serde_json::Value::String(head.display().to_string());
    }
    std::fs::write(
        lab.path().join("lab.json"),
        serde_json::to_vec_pretty(&lab_json).unwrap(),
    )
    .unwrap();
    let steps = lab.json(&["cluster", "rolling-restart", "--timeout", "300"]);

    std::fs::write(&stop, b"").unwrap();
    let out = client.wait_with_output().unwrap();
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "checker output ({e}): {}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            lab.logs()
        )
    });
    let head_version = must(Command::new(&head).arg("--version"));
    let after = versions(&lab);
    assert!(
        after
            .iter()
            .all(|v| head_version.contains(v.as_str()) && !prev_version.contains(v.as_str())),
        "every node runs {head_version} now: {after:?}; steps {steps}"
    );
    assert_eq!(summary["verify_failures"], 0, "{summary}\n{}", lab.logs());
    assert_eq!(summary["io_errors"], 0, "{summary}\n{}", lab.logs());
    assert!(summary["writes"].as_u64().unwrap() > 0, "{summary}");
    assert!(all_in_sync(&lab, "up"), "{}", lab.logs());
    let r = &lab.json(&["scrub", "start", "up", "--wait", "--no-repair"])[0];
    assert_eq!(r["mismatches"], 0, "{r}");
    assert_eq!(r["bad_checksums"], 0, "{r}");
    println!("rolling upgrade {before:?} -> {after:?}: {steps}; checker {summary}");
    lab.must(&["lab", "down"]);
}
