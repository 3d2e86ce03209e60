//! End-to-end: each drive's lifetime writes are counted, forecast against its rated
//! endurance, and kept across restarts (docs/ENDURANCE.md; issue 18, the live endurance
//! forecast).
//!
//! A 3-node lab whose capacity drives are rated 50 GiB written takes 96 MiB of writes on a
//! mirror-3 volume. `converge status` must then show every drive's writes (each node holds
//! one copy), rates, its rating and days left, which such a rate brings before the
//! warranty's end, but no warning from seconds of history (the fleet crate's unit tests
//! cover the warning from an hour on); `/metrics` the same counts. A clean restart of
//! every node keeps each count (it only grows by what the restart itself writes) and the
//! date each drive was first seen; a kill -9 of every node loses nothing counted before.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const TBW: u64 = 50 << 30;

/// Each capacity drive's wear as `converge status --json` shows it, by drive id.
fn wear(lab: &Lab) -> BTreeMap<u64, serde_json::Value> {
    let st = lab.json(&["status"]);
    st["drives"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["role"] == "capacity" && !d["wear"].is_null())
        .map(|d| (d["id"].as_u64().unwrap(), d["wear"].clone()))
        .collect()
}

fn lifetime(w: &serde_json::Value) -> u64 {
    w["lifetime_written_bytes"].as_u64().unwrap()
}

/// The capacity drives' lifetime writes summed per node.
fn per_node(lab: &Lab) -> BTreeMap<u64, u64> {
    let st = lab.json(&["status"]);
    let mut out = BTreeMap::new();
    for d in st["drives"].as_array().unwrap() {
        if d["role"] == "capacity" {
            *out.entry(d["node"].as_u64().unwrap()).or_insert(0) +=
                d["wear"]["lifetime_written_bytes"].as_u64().unwrap_or(0);
        }
    }
    out
}

/// When the newest of these drives' counts was taken (unix seconds).
fn newest_count(wear: &BTreeMap<u64, serde_json::Value>) -> u64 {
    wear.values()
        .map(|w| w["updated_unix"].as_u64().unwrap())
        .max()
        .unwrap()
}

/// Waits until the wall clock is past the second `t` (unix). Wear records are dated to
/// the second: one a node writes from then on (at its start, say) is dated after every
/// record of second `t`, so it can be told from them.
fn past_second(t: u64) {
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    while now() <= t {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until every capacity drive of `prior` was counted again: its record is dated
/// after the one `prior` holds.
fn counted_after(lab: &Lab, prior: &BTreeMap<u64, serde_json::Value>) {
    lab.wait_for("every drive counted again", Duration::from_secs(90), || {
        let w = wear(lab);
        w.len() == prior.len()
            && prior.iter().all(|(id, p)| {
                w.get(id).is_some_and(|w| {
                    w["updated_unix"].as_u64().unwrap() > p["updated_unix"].as_u64().unwrap()
                })
            })
    });
}

#[test]
fn drive_wear_is_counted_forecast_and_kept_across_restarts() {
    let lab = Lab::up(3, &["--drive-tbw", &TBW.to_string()]);
    lab.create_volume("w", "256M", "mirror-3");
    let r = fio(
        &lab.uri("w"),
        &["--rw=write", "--bs=1M", "--size=96M", "--iodepth=4"],
    );
    assert_eq!(fio_errors(&r), 0);
    // The lab counts every 5 s: each node's drives hold one copy of the 96 MiB.
    lab.wait_for("the writes counted", Duration::from_secs(90), || {
        let p = per_node(&lab);
        p.len() == 3 && p.values().all(|&b| b >= 96 * MIB)
    });
    let before = wear(&lab);
    assert_eq!(before.len(), 6, "two capacity drives per node: {before:?}");
    let mut forecast_seen = false;
    for (id, w) in &before {
        assert!(w["first_seen_unix"].as_u64().unwrap() > 0, "{id}: {w}");
        assert_eq!(w["rated_tbw_bytes"].as_u64(), Some(TBW), "{id}: {w}");
        assert_eq!(w["warranty_years"].as_f64(), Some(5.0), "{id}: {w}");
        let rates = w["write_rates"].as_array().unwrap();
        assert!(!rates.is_empty(), "{id}: no rate: {w}");
        // A drive holding copies wears out long before 5 years at 96 MiB a minute or so.
        if lifetime(w) >= 32 * MIB {
            forecast_seen = true;
            let days = w["days_to_rated_tbw"].as_f64().unwrap();
            assert!(days > 0.0 && days < 5.0 * 365.0, "{id}: {w}");
            assert_eq!(w["wears_out_before_warranty"], true, "{id}: {w}");
            let used = w["used_pct"].as_f64().unwrap();
            let want = 100.0 * lifetime(w) as f64 / TBW as f64;
            assert!((used - want).abs() < 1e-9, "{id}: {w}");
        }
    }
    assert!(forecast_seen, "no drive with writes: {before:?}");
    // Seconds of history: the forecast is shown, said to be young, and not warned on (a
    // burst in a drive's first minutes says little of its years; docs/ENDURANCE.md).
    let st = lab.json(&["status"]);
    assert!(
        !st["warnings"].to_string().contains("rated endurance"),
        "a warning from seconds of history: {}",
        st["warnings"]
    );
    for w in before.values() {
        assert!(w["forecast_span_s"].as_u64().unwrap() < 3600, "{w}");
    }
    let text = lab.must(&["status"]);
    assert!(
        text.contains("ENDURANCE") && text.contains("of history)"),
        "status shows no endurance table: {text}"
    );
    let on_1: u64 = before
        .iter()
        .filter(|(id, _)| {
            st["drives"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["id"].as_u64() == Some(**id) && d["node"] == 1)
        })
        .map(|(_, w)| lifetime(w))
        .sum();
    assert!(
        lab.metric(1, "converge_drive_lifetime_written_bytes") >= on_1,
        "metrics behind the record"
    );

    // A clean restart of every node keeps each count: it grows only by what the restart
    // itself writes (superblocks, the journal's checkpoint), and the first-seen date stays.
    // Nodes 1 and 2, then node 3, so that one always answers `status`.
    let mut stopped = BTreeMap::new();
    for group in [&["1", "2"][..], &["3"][..]] {
        for n in group {
            lab.must(&["lab", "fault", "stop", n]);
        }
        let nodes: Vec<u64> = group.iter().map(|n| n.parse().unwrap()).collect();
        let st = lab.json(&["status"]);
        let mut group_wear = BTreeMap::new();
        for d in st["drives"].as_array().unwrap() {
            if d["role"] == "capacity" && nodes.contains(&d["node"].as_u64().unwrap()) {
                group_wear.insert(d["id"].as_u64().unwrap(), d["wear"].clone());
            }
        }
        // Restarted in a later second than their last records, so that the records they
        // write at start are seen as new (a restart within the same second was not).
        past_second(newest_count(&group_wear));
        stopped.extend(group_wear);
        for n in group {
            lab.must(&["lab", "fault", "restart", n]);
        }
        lab.wait_for("the nodes back", Duration::from_secs(60), || {
            lab.json(&["status"])["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .all(|n| n["live"] == true)
        });
    }
    assert_eq!(stopped.len(), 6);
    counted_after(&lab, &stopped);
    let after = wear(&lab);
    for (id, w) in &after {
        let (b, s) = (&before[id], &stopped[id]);
        assert_eq!(w["first_seen_unix"], b["first_seen_unix"], "{id}");
        assert!(lifetime(s) >= lifetime(b), "{id}: the stop lost writes");
        assert!(
            lifetime(w) >= lifetime(s) && lifetime(w) - lifetime(s) < 16 * MIB,
            "{id}: {} before the restart, {} after",
            lifetime(s),
            lifetime(w)
        );
    }

    // kill -9 of every node: what was counted before stays counted.
    past_second(newest_count(&after));
    lab.kill_all_and_restart(3);
    counted_after(&lab, &after);
    for (id, w) in wear(&lab) {
        assert!(
            lifetime(&w) >= lifetime(&after[&id]),
            "{id}: the kill lost counts"
        );
        assert_eq!(w["first_seen_unix"], before[&id]["first_seen_unix"], "{id}");
    }
}
