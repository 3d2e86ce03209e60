//! `/metrics` in the Prometheus text format: per drive (ops, bytes, outstanding I/Os and
//! its time integral for queue length, latency histogram), per volume this node owns, and
//! the daemon's own CPU seconds (for CPU cost per I/O in the fleet).

use crate::node::Node;
use converge_volume::stats::HistogramSnapshot;
use std::fmt::Write as _;

/// CPU seconds (user + system) this process has used, from /proc/self/stat.
pub fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) start after ')'.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 after ')'.
    let ticks: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 }
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &HistogramSnapshot) {
    let mut cum = 0u64;
    for (i, c) in h.buckets.iter().enumerate() {
        cum += c;
        if *c == 0 && i + 1 != h.buckets.len() {
            continue;
        }
        let le = HistogramSnapshot::bucket_le_us(i) as f64 / 1e6;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cum}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum_us as f64 / 1e6);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

fn drive_histogram(
    out: &mut String,
    name: &str,
    labels: &str,
    h: &converge_engine::LatencyHistogram,
) {
    let mut cum = 0u64;
    for (upper, c) in h.bucket_upper_us.iter().zip(&h.counts) {
        cum += c;
        if *upper == u64::MAX {
            continue;
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{}\"}} {cum}",
            *upper as f64 / 1e6
        );
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cum}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {cum}");
}

pub async fn render(node: &Node) -> String {
    let mut o = String::new();
    let n = node.cfg.node_id;
    let _ = writeln!(
        o,
        "# HELP converge_process_cpu_seconds_total CPU seconds used by converged."
    );
    let _ = writeln!(o, "# TYPE converge_process_cpu_seconds_total counter");
    let _ = writeln!(
        o,
        "converge_process_cpu_seconds_total{{node=\"{n}\"}} {}",
        process_cpu_seconds()
    );
    // QoS (docs/QOS.md): the cap on this node's volumes without a reservation (0: none).
    let (held, waited_us) = node.qos_gate.throttled();
    let _ = writeln!(
        o,
        "converge_node_qos_best_effort_cap_iops{{node=\"{n}\"}} {}",
        node.qos_gate.cap().unwrap_or(0)
    );
    let _ = writeln!(
        o,
        "converge_node_qos_best_effort_throttled_total{{node=\"{n}\"}} {held}"
    );
    let _ = writeln!(
        o,
        "converge_node_qos_best_effort_wait_seconds_total{{node=\"{n}\"}} {:.6}",
        waited_us as f64 / 1e6
    );
    let forecasts = node.wear.forecasts();
    if !forecasts.is_empty() {
        let _ = writeln!(o, "# HELP converge_drive_lifetime_written_bytes Bytes written to the device since converge first counted it (kept across restarts).");
        let _ = writeln!(o, "# TYPE converge_drive_lifetime_written_bytes counter");
        let _ = writeln!(o, "# HELP converge_drive_write_rate_bytes_per_second Device writes per second over the last 1h, 24h or 7d.");
        let _ = writeln!(o, "# TYPE converge_drive_write_rate_bytes_per_second gauge");
        let _ = writeln!(o, "# HELP converge_drive_days_to_rated_tbw Days until the drive's rated TBW is written at its longest measured rate.");
        let _ = writeln!(o, "# TYPE converge_drive_days_to_rated_tbw gauge");
    }
    for (id, _, f) in &forecasts {
        let l = format!("node=\"{n}\",drive=\"{:016x}\"", id.0);
        let _ = writeln!(
            o,
            "converge_drive_lifetime_written_bytes{{{l}}} {}",
            f.lifetime_bytes
        );
        for ((name, _), r) in converge_fleet::endurance::RATE_WINDOWS.iter().zip(&f.rates) {
            if let Some(r) = r {
                let _ = writeln!(
                    o,
                    "converge_drive_write_rate_bytes_per_second{{{l},window=\"{name}\"}} {}",
                    r.bytes_per_s
                );
            }
        }
        if let Some(d) = f.days_to_rated {
            let _ = writeln!(o, "converge_drive_days_to_rated_tbw{{{l}}} {d}");
        }
    }
    let _ = writeln!(
        o,
        "# HELP converge_drive_read_ops_total Reads served by the drive."
    );
    let _ = writeln!(o, "# TYPE converge_drive_read_ops_total counter");
    let mut drives: Vec<_> = node.drives.iter().collect();
    drives.sort_by_key(|(id, _)| **id);
    for (id, d) in &drives {
        let s = d.stats();
        let l = format!("node=\"{n}\",drive=\"{:016x}\",tier=\"capacity\"", id.0);
        let _ = writeln!(o, "converge_drive_read_ops_total{{{l}}} {}", s.read_ops);
        let _ = writeln!(o, "converge_drive_write_ops_total{{{l}}} {}", s.write_ops);
        let _ = writeln!(o, "converge_drive_read_bytes_total{{{l}}} {}", s.read_bytes);
        let _ = writeln!(
            o,
            "converge_drive_written_bytes_total{{{l}}} {}",
            s.write_bytes
        );
        let _ = writeln!(
            o,
            "converge_drive_data_written_bytes_total{{{l}}} {}",
            s.data_write_bytes
        );
        let _ = writeln!(o, "converge_drive_flushes_total{{{l}}} {}", s.flushes);
        let _ = writeln!(
            o,
            "converge_drive_bad_blocks_reported_total{{{l}}} {}",
            s.bad_blocks_reported
        );
        let _ = writeln!(
            o,
            "converge_drive_suspect_blocks_reported_total{{{l}}} {}",
            s.suspect_blocks_reported
        );
        let _ = writeln!(
            o,
            "converge_drive_rolled_back_at_open{{{l}}} {}",
            s.rolled_back_at_open
        );
        let _ = writeln!(o, "converge_drive_inflight{{{l}}} {}", s.inflight);
        let _ = writeln!(
            o,
            "converge_drive_inflight_seconds_total{{{l}}} {}",
            s.inflight_time_ns as f64 / 1e9
        );
        drive_histogram(
            &mut o,
            "converge_drive_read_latency_seconds",
            &l,
            &s.read_latency_us,
        );
        drive_histogram(
            &mut o,
            "converge_drive_write_latency_seconds",
            &l,
            &s.write_latency_us,
        );
        let _ = writeln!(
            o,
            "converge_drive_journal_written_bytes_total{{{l}}} {}",
            s.journal_write_bytes
        );
        let _ = writeln!(
            o,
            "converge_drive_metadata_written_bytes_total{{{l}}} {}",
            s.metadata_write_bytes
        );
        let (data, stored) = d.extents().iter().fold((0u64, 0u64), |(w, st), e| {
            (w + e.bytes_written, st + e.bytes_stored)
        });
        let _ = writeln!(o, "converge_drive_data_bytes{{{l}}} {data}");
        // What that data takes on the drive, and what compression saves (docs/adr/0010).
        let _ = writeln!(o, "converge_drive_stored_bytes{{{l}}} {stored}");
        let _ = writeln!(
            o,
            "converge_drive_compression_saved_bytes{{{l}}} {}",
            data.saturating_sub(stored)
        );
        let c = d.capacity();
        let _ = writeln!(o, "converge_drive_extents_total{{{l}}} {}", c.extents_total);
        // Its raw capacity (data region, in whole extents): what `status` sums as raw.
        let _ = writeln!(o, "converge_drive_capacity_bytes{{{l}}} {}", c.bytes_total);
        let _ = writeln!(o, "converge_drive_extents_used{{{l}}} {}", c.extents_used);
        // Thin drives: slots, and the data bytes extents have claimed (plain ones whole,
        // compressed ones what they store) against what the data region holds.
        let _ = writeln!(o, "converge_drive_extent_slots{{{l}}} {}", c.slots_total);
        let _ = writeln!(
            o,
            "converge_drive_committed_bytes{{{l}}} {}",
            c.bytes_committed
        );
        let _ = writeln!(o, "converge_drive_free_bytes{{{l}}} {}", c.bytes_free);
        // Blocks kept for snapshots (docs/SNAPSHOTS.md): counted in committed bytes.
        let _ = writeln!(
            o,
            "converge_drive_preserved_bytes{{{l}}} {}",
            c.bytes_preserved
        );
    }
    let mut caches: Vec<_> = node.caches.iter().collect();
    caches.sort_by_key(|(id, _)| **id);
    if !caches.is_empty() {
        let _ = writeln!(
            o,
            "# HELP converge_cache_dirty_bytes Acked writes in a cache drive's log not yet destaged to capacity."
        );
        let _ = writeln!(o, "# TYPE converge_cache_dirty_bytes gauge");
    }
    for (id, c) in &caches {
        let s = c.stats();
        let d = c.drive_stats();
        let l = format!("node=\"{n}\",drive=\"{:016x}\",tier=\"cache\"", id.0);
        let _ = writeln!(o, "converge_cache_dirty_bytes{{{l}}} {}", s.dirty_bytes);
        let _ = writeln!(o, "converge_cache_clean_bytes{{{l}}} {}", s.clean_bytes);
        let _ = writeln!(o, "converge_cache_used_bytes{{{l}}} {}", s.used_bytes);
        let _ = writeln!(o, "converge_cache_log_bytes{{{l}}} {}", s.log_bytes);
        let _ = writeln!(
            o,
            "converge_cache_destaged_bytes_total{{{l}}} {}",
            s.destaged_bytes
        );
        let _ = writeln!(
            o,
            "converge_cache_read_hit_blocks_total{{{l}}} {}",
            s.read_hit_blocks
        );
        let _ = writeln!(
            o,
            "converge_cache_read_miss_blocks_total{{{l}}} {}",
            s.read_miss_blocks
        );
        let reads = s.read_hit_blocks + s.read_miss_blocks;
        if reads > 0 {
            let _ = writeln!(
                o,
                "converge_cache_read_hit_ratio{{{l}}} {}",
                s.read_hit_blocks as f64 / reads as f64
            );
        }
        let _ = writeln!(
            o,
            "converge_cache_admitted_blocks_total{{{l}}} {}",
            s.admitted_blocks
        );
        let _ = writeln!(
            o,
            "converge_cache_evicted_blocks_total{{{l}}} {}",
            s.evicted_blocks
        );
        let _ = writeln!(
            o,
            "converge_cache_write_stalls_total{{{l}}} {}",
            s.write_stalls
        );
        let _ = writeln!(
            o,
            "converge_cache_failed{{{l}}} {}",
            u8::from(s.failed.is_some())
        );
        let mode = s.mode.map(|m| m.to_string()).unwrap_or_default();
        let _ = writeln!(o, "converge_cache_mode{{{l},mode=\"{mode}\"}} 1");
        let _ = writeln!(
            o,
            "converge_drive_written_bytes_total{{{l}}} {}",
            d.write_bytes
        );
        let _ = writeln!(
            o,
            "converge_drive_data_written_bytes_total{{{l}}} {}",
            d.data_write_bytes
        );
        let _ = writeln!(o, "converge_drive_read_bytes_total{{{l}}} {}", d.read_bytes);
        let _ = writeln!(o, "converge_drive_flushes_total{{{l}}} {}", d.flushes);
    }
    let vols = node.volumes.lock().await;
    let mut names: Vec<&String> = vols.keys().collect();
    names.sort();
    for name in names {
        let s = vols[name].stats();
        let l = format!("node=\"{n}\",volume=\"{name}\"");
        let _ = writeln!(o, "converge_volume_read_ops_total{{{l}}} {}", s.read_ops);
        let _ = writeln!(o, "converge_volume_write_ops_total{{{l}}} {}", s.write_ops);
        let _ = writeln!(
            o,
            "converge_volume_read_bytes_total{{{l}}} {}",
            s.read_bytes
        );
        let _ = writeln!(
            o,
            "converge_volume_written_bytes_total{{{l}}} {}",
            s.write_bytes
        );
        let _ = writeln!(o, "converge_volume_errors_total{{{l}}} {}", s.errors);
        // Writes refused for lack of space (ENOSPC to the client; docs/CAPACITY.md).
        let _ = writeln!(
            o,
            "converge_volume_no_space_errors_total{{{l}}} {}",
            s.no_space_errors
        );
        let _ = writeln!(
            o,
            "converge_volume_repaired_blocks_total{{{l}}} {}",
            s.repaired_blocks
        );
        let _ = writeln!(
            o,
            "converge_volume_extents_marked_stale_total{{{l}}} {}",
            s.extents_marked_stale
        );
        let _ = writeln!(
            o,
            "converge_volume_copies_promoted_total{{{l}}} {}",
            s.copies_promoted
        );
        let _ = writeln!(o, "converge_volume_zero_ops_total{{{l}}} {}", s.zero_ops);
        let _ = writeln!(
            o,
            "converge_volume_slabs_released_total{{{l}}} {}",
            s.slabs_released
        );
        let _ = writeln!(
            o,
            "converge_volume_hedged_reads_total{{{l}}} {}",
            s.hedged_reads
        );
        // QoS (docs/QOS.md): I/Os held back by the volume's limits or its node's gate.
        let _ = writeln!(
            o,
            "converge_volume_qos_throttled_total{{{l}}} {}",
            s.qos_throttled
        );
        let _ = writeln!(
            o,
            "converge_volume_qos_wait_seconds_total{{{l}}} {:.6}",
            s.qos_waited_us as f64 / 1e6
        );
        let map = vols[name].slab_map();
        let cfg = vols[name].config();
        // Raw bytes the volume takes written full (size × its resiliency's multiplier).
        let part = cfg
            .resiliency
            .mirror_part()
            .filter(|_| cfg.mirror_part_bytes > 0)
            .map(|m| (m, cfg.mirror_part_bytes));
        let _ = writeln!(
            o,
            "converge_volume_provisioned_bytes{{{l}}} {}",
            crate::capacity::provisioned_bytes(cfg.resiliency, vols[name].size_bytes(), part)
        );
        let _ = writeln!(
            o,
            "converge_volume_allocated_bytes{{{l}}} {}",
            cfg.resiliency
                .allocated_bytes(cfg.slab_size_bytes, map.keys().copied())
        );
        if let Some(u) = vols[name].mirror_part_usage() {
            for (part, v) in [
                ("limit", u.limit_bytes),
                ("mirror", u.mirror_bytes),
                ("parity", u.parity_bytes),
            ] {
                let _ = writeln!(
                    o,
                    "converge_volume_mirror_part_bytes{{{l},part=\"{part}\"}} {v}"
                );
            }
            let _ = writeln!(o, "converge_volume_rotations_total{{{l}}} {}", s.rotations);
            let _ = writeln!(
                o,
                "converge_volume_rotated_bytes_total{{{l}}} {}",
                s.rotated_bytes
            );
        }
        let stale = map
            .values()
            .flatten()
            .filter(|e| e.state != converge_types::ExtentState::InSync)
            .count();
        let _ = writeln!(o, "converge_volume_extents_not_in_sync{{{l}}} {stale}");
        histogram(
            &mut o,
            "converge_volume_read_latency_seconds",
            &l,
            &s.read_latency,
        );
        histogram(
            &mut o,
            "converge_volume_write_latency_seconds",
            &l,
            &s.write_latency,
        );
    }
    let j = &node.jobs;
    let sc = &node.scrub_stats;
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    for (name, val) in [
        ("converge_resync_jobs_done_total", ld(&j.resync_done)),
        ("converge_rebuild_jobs_done_total", ld(&j.rebuild_done)),
        ("converge_repair_jobs_failed_total", ld(&j.failed)),
        ("converge_repair_bytes_copied_total", ld(&j.bytes_copied)),
        (
            "converge_repair_blocks_written_total",
            ld(&j.blocks_written),
        ),
        ("converge_scrub_blocks_checked_total", ld(&sc.blocks)),
        ("converge_scrub_bad_checksums_total", ld(&sc.bad)),
        ("converge_scrub_mismatches_total", ld(&sc.mismatches)),
        ("converge_scrub_repaired_blocks_total", ld(&sc.repaired)),
        (
            "converge_scrub_snapshot_blocks_lost_total",
            ld(&sc.snapshot_lost),
        ),
        ("converge_jobs_running", j.list().len() as u64),
        (
            "converge_orphan_extents_freed_total",
            ld(&node.orphans_freed),
        ),
        (
            "converge_takeovers_deferred_total",
            ld(&node.takeovers_deferred),
        ),
    ] {
        let _ = writeln!(o, "{name} {val}");
    }
    o
}
