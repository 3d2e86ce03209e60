//! End-to-end: per-volume QoS (docs/QOS.md) on a real lab with fio's nbd engine. A limit is
//! an upper bound on a rate, so a slow machine can only make it hold more easily: the
//! tests assert that fio never did better than the limit allows (with its burst), never
//! that anything is fast. The reservation's effect under contention is measured in
//! docs/QOS.md; here the controller's reaction is checked through its counters.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// fio's IOPS and runtime (s) of a job, reads and writes together.
fn iops_and_secs(v: &serde_json::Value) -> (f64, f64) {
    let j = &v["jobs"][0];
    let iops = j["read"]["iops"].as_f64().unwrap() + j["write"]["iops"].as_f64().unwrap();
    let ms = j["read"]["runtime"]
        .as_f64()
        .unwrap()
        .max(j["write"]["runtime"].as_f64().unwrap());
    (iops, ms / 1000.0)
}

/// Limits set at creation and changed live hold: IOPS and bytes per second never above
/// the limit plus its burst spread over the run; the throttled I/Os are counted; `--qos
/// none` lifts them. A reservation that cannot be met makes the owner hold back the
/// volumes without one (and never the reserved one). Bad settings are refused with the
/// reason.
#[test]
fn limits_hold_change_live_and_a_short_reservation_holds_back_the_others() {
    let lab = Lab::up(3, &["--ram"]);
    // Refused, saying why.
    for (args, want) in [
        (vec!["--iops-limit", "0"], "would stop the volume"),
        (
            vec!["--iops-limit", "100", "--iops-reserve", "500"],
            "above iops_limit",
        ),
        (vec!["--iops-limit", "100", "--burst", "90"], "--burst 90"),
        (vec!["--bw-limit", "1K"], "bytes_limit below 4096"),
    ] {
        let mut a = vec!["volume", "create", "x", "--size", "64M"];
        a.extend(args.iter().copied());
        let e = lab.fails(&a);
        assert!(e.contains(want), "{args:?}: {e}");
    }
    lab.must(&[
        "volume",
        "create",
        "lim",
        "--size",
        "256M",
        "--resiliency",
        "mirror-2",
        "--owner",
        "1",
        "--iops-limit",
        "200",
        "--burst",
        "0.5",
    ]);
    let v = lab.json(&["volume", "show", "lim"]);
    assert_eq!(v["qos"]["iops_limit"], 200, "{v}");
    assert_eq!(v["qos"]["burst_ms"], 500, "{v}");
    let uri = lab.uri("lim");
    let job = |rw: &str, bs: &str| {
        vec![
            format!("--rw={rw}"),
            format!("--bs={bs}"),
            "--iodepth=16".into(),
            "--size=128M".into(),
            "--time_based".into(),
            "--runtime=4".into(),
        ]
    };
    let j = job("randread", "4k");
    let r = fio(&uri, &args(&j));
    assert_eq!(fio_errors(&r), 0, "{r}");
    let (iops, secs) = iops_and_secs(&r);
    // At most 200/s, plus the 0.5 s burst (100) and the I/O due at once, over the run.
    let most = (200.0 * secs + 101.0) / secs;
    assert!(
        iops <= most * 1.02,
        "{iops} IOPS over {secs} s with a 200 limit"
    );
    let held = lab.metric(1, "converge_volume_qos_throttled_total");
    assert!(held > 0, "throttled I/Os are counted");

    // Live: a bandwidth limit (the IOPS limit raised out of the way).
    let out = lab.must(&[
        "volume",
        "set",
        "lim",
        "--iops-limit",
        "100000",
        "--bw-limit",
        "2M",
        "--burst",
        "0",
    ]);
    assert!(out.contains("limit 2 MiB/s"), "{out}");
    let j = job("randwrite", "64k");
    let r = fio(&uri, &args(&j));
    assert_eq!(fio_errors(&r), 0, "{r}");
    let w = &r["jobs"][0]["write"];
    let (bytes, secs) = (
        w["io_bytes"].as_f64().unwrap(),
        w["runtime"].as_f64().unwrap() / 1000.0,
    );
    // 2 MiB/s, no burst: one 64 KiB write due at once, then the rate.
    let most = 2.0 * 1048576.0 * secs + 65536.0;
    assert!(bytes <= most * 1.02, "{bytes} bytes in {secs} s at 2 MiB/s");
    let e = lab.fails(&["volume", "set", "lim"]);
    assert!(e.contains("nothing to change"), "{e}");
    let e = lab.fails(&["volume", "set", "lim", "--qos", "none", "--iops-limit", "5"]);
    assert!(e.contains("give it alone"), "{e}");
    let out = lab.must(&["volume", "set", "lim", "--qos", "none"]);
    assert!(out.contains("qos none"), "{out}");
    // Lifted: fio runs unthrottled (the count does not move).
    let before = lab.metric(1, "converge_volume_qos_throttled_total");
    let r = fio(&uri, &args(&job("randread", "4k")));
    assert_eq!(fio_errors(&r), 0, "{r}");
    assert_eq!(lab.metric(1, "converge_volume_qos_throttled_total"), before);

    // A reservation no node could meet: while the reserved volume is busy, the node caps
    // the volumes without one (here `lim` and `noisy`), and holds back their I/Os; the
    // reserved volume itself never waits.
    for (name, extra) in [
        ("gold", vec!["--iops-reserve", "1000000"]),
        ("noisy", vec![]),
    ] {
        let mut a = vec![
            "volume",
            "create",
            name,
            "--size",
            "256M",
            "--resiliency",
            "mirror-2",
            "--owner",
            "1",
        ];
        a.extend(extra);
        lab.must(&a);
    }
    let gold = lab.uri("gold");
    let noisy = lab.uri("noisy");
    let t = std::thread::spawn(move || {
        fio(
            &noisy,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=128M",
                "--time_based",
                "--runtime=8",
            ],
        )
    });
    // Writes: a read of a slab never written is answered at once, without the copies.
    let g = fio(
        &gold,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=128M",
            "--time_based",
            "--runtime=6",
        ],
    );
    let n = t.join().unwrap();
    assert_eq!(fio_errors(&g) + fio_errors(&n), 0, "{g}\n{n}");
    let node_held = lab.metric(1, "converge_node_qos_best_effort_throttled_total");
    assert!(
        node_held > 0,
        "the best-effort gate held nothing back\n{}",
        lab.logs()
    );
    let gold_held = lab.metric_where(1, "converge_volume_qos_throttled_total", "volume=\"gold\"");
    assert_eq!(gold_held, 0.0, "the reserved volume waited");
    let noisy_held = lab.metric_where(1, "converge_volume_qos_throttled_total", "volume=\"noisy\"");
    assert!(noisy_held > 0.0);
    // Quiet again: the cap is lifted.
    lab.wait_for(
        "the best-effort cap to be lifted",
        Duration::from_secs(60),
        || lab.metric(1, "converge_node_qos_best_effort_cap_iops") == 0,
    );
    for v in ["gold", "noisy", "lim"] {
        lab.must(&["volume", "delete", v]);
    }

    // The noisy-neighbour study, short: four phases, its report, and limits that hold (an
    // upper bound: whatever the machine's speed, a neighbour never beats its limit).
    let out = lab.path().join("qos-study");
    let o = out.to_str().unwrap();
    let printed = lab.must(&[
        "fleet",
        "qos",
        "--out",
        o,
        "--warmup",
        "1s",
        "--duration",
        "3s",
        "--noisy",
        "1",
        "--limit",
        "300",
        "--reserve",
        "500",
    ]);
    assert!(printed.contains("Reservation 500 IOPS"), "{printed}");
    let st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("qos.json")).unwrap()).unwrap();
    let phases = st["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 4, "{st}");
    assert_eq!(phases[2]["victim"]["qos"], "reserve 500 IOPS", "{st}");
    assert_eq!(
        phases[3]["noisy"][0]["qos"], "limit 300 IOPS, burst 1 s",
        "{st}"
    );
    for r in st["limit_ratios"].as_array().unwrap() {
        assert!(
            r.as_f64().unwrap() <= 1.1,
            "a neighbour beat its limit: {st}"
        );
    }
    assert!(out.join("qos.md").exists());
    // The study leaves nothing behind.
    let vols = lab.json(&["volume", "list"]);
    assert_eq!(vols.as_array().unwrap().len(), 0, "{vols}");
}
