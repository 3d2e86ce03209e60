//! One measured window of one point (one repeat), reduced from what was collected: every
//! worker's fio result, every node's counter samples taken before and after the window, and
//! the samples that bracket the whole point (after flushing the caches before its workers
//! start and after they all finish) from which write amplification is counted in bytes.

use crate::fio::FioJob;
use crate::hist::{Histogram, CURVE_PERCENTILES};
use converge_api::fleet::FleetSample;
use converge_types::DriveId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeasureError {
    #[error(
        "node {node}'s counters went backwards during the window (did converged restart?); \
         this point cannot be measured"
    )]
    CounterReset { node: u32 },
    #[error("node {node}: its two samples are from different nodes or hosts")]
    Mismatch { node: u32 },
    #[error("node {node}: the measured window is empty (samples {ns} ns apart)")]
    EmptyWindow { node: u32, ns: u64 },
}

/// One worker's fio result, as collected.
#[derive(Clone, Debug)]
pub struct WorkerRun {
    pub node: u32,
    /// 1-based index of the worker on its node.
    pub worker: u32,
    pub volume: String,
    pub job: FioJob,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerMeasure {
    pub node: u32,
    pub worker: u32,
    pub volume: String,
    pub read_ios: u64,
    pub write_ios: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    pub read_lat_mean_ns: f64,
    pub write_lat_mean_ns: f64,
    pub error: i64,
    /// CPU fio itself used, in cores.
    pub cpu_cores: f64,
    /// Latency (ns) at `hist::CURVE_PERCENTILES` of all this worker's I/Os.
    pub curve_ns: Vec<Option<u64>>,
}

/// Differences of one node's counters over the window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeMeasure {
    pub node: u32,
    pub host_id: String,
    pub window_s: f64,
    pub host_busy_ticks: u64,
    pub host_total_ticks: u64,
    pub converged_cpu_s: f64,
    /// Client I/O the node's volumes served over the window (all its volumes).
    #[serde(default)]
    pub volume_ops: u64,
    /// `volume_ops` by direction (both 0 in runs made before they were kept).
    #[serde(default)]
    pub volume_read_ops: u64,
    #[serde(default)]
    pub volume_write_ops: u64,
    #[serde(default)]
    pub volume_write_bytes: u64,
}

/// Differences of one drive's counters over its node's window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DriveMeasure {
    pub node: u32,
    pub id: DriveId,
    pub window_s: f64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub data_write_bytes: u64,
    pub journal_write_bytes: u64,
    pub metadata_write_bytes: u64,
    /// Time-averaged outstanding engine operations over the window.
    pub queue_len: f64,
}

impl DriveMeasure {
    pub fn iops(&self) -> f64 {
        per_s(self.read_ops + self.write_ops, self.window_s)
    }
    pub fn write_bytes_per_s(&self) -> f64 {
        per_s(self.write_bytes, self.window_s)
    }
}

pub(crate) fn per_s(n: u64, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Bytes one drive wrote over the whole point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DriveBytes {
    pub node: u32,
    pub id: DriveId,
    /// Every byte: data + journal + metadata.
    pub write_bytes: u64,
    pub data_write_bytes: u64,
    pub journal_write_bytes: u64,
    pub metadata_write_bytes: u64,
}

/// What the whole point wrote, clients and drives, counted between two samples taken with
/// every cache flushed: before the point's workers start and after they have all finished
/// (warm-up and window included). A write the cache held is destaged by the second flush,
/// so each client byte's full cost on the drives falls inside, whatever the cache mode.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PointBytes {
    /// Seconds between the two samples (the longest over nodes).
    pub seconds: f64,
    /// Client bytes the volumes received, before replication (all nodes).
    pub volume_write_bytes: u64,
    pub drives: Vec<DriveBytes>,
}

/// One repeat of one point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RepeatMeasure {
    /// 1-based.
    pub repeat: u32,
    pub workers: Vec<WorkerMeasure>,
    /// All workers' read latencies, merged.
    pub read_hist: Histogram,
    pub write_hist: Histogram,
    pub nodes: Vec<NodeMeasure>,
    pub drives: Vec<DriveMeasure>,
    /// Bytes over the whole point, for write amplification. None in runs made before it
    /// was counted this way (their WA is computed from the window's rates).
    #[serde(default)]
    pub point_bytes: Option<PointBytes>,
}

fn delta(node: u32, a: u64, b: u64) -> Result<u64, MeasureError> {
    b.checked_sub(a).ok_or(MeasureError::CounterReset { node })
}

/// Client bytes written to the volumes between two samples of one node; a volume first
/// opened after `a` counts from zero.
fn volume_write_bytes(node: u32, a: &FleetSample, b: &FleetSample) -> Result<u64, MeasureError> {
    let mut n = 0;
    for vb in &b.volumes {
        let bytes0 = a
            .volumes
            .iter()
            .find(|v| v.name == vb.name)
            .map_or(0, |v| v.write_bytes);
        n += delta(node, bytes0, vb.write_bytes)?;
    }
    Ok(n)
}

/// Reduce the samples that bracket a whole point: (start, end) per node, each taken with
/// that node's caches flushed.
pub fn point_bytes(samples: &[(FleetSample, FleetSample)]) -> Result<PointBytes, MeasureError> {
    let mut p = PointBytes::default();
    for (a, b) in samples {
        let node = a.node.0;
        if a.node != b.node || a.host_id != b.host_id {
            return Err(MeasureError::Mismatch { node });
        }
        let ns = delta(node, a.mono_ns, b.mono_ns)?;
        if ns == 0 {
            return Err(MeasureError::EmptyWindow { node, ns });
        }
        p.seconds = p.seconds.max(ns as f64 / 1e9);
        p.volume_write_bytes += volume_write_bytes(node, a, b)?;
        for da in &a.drives {
            let Some(db) = b.drives.iter().find(|d| d.id == da.id) else {
                continue;
            };
            let d = |x: u64, y: u64| delta(node, x, y);
            p.drives.push(DriveBytes {
                node,
                id: da.id,
                write_bytes: d(da.write_bytes, db.write_bytes)?,
                data_write_bytes: d(da.data_write_bytes, db.data_write_bytes)?,
                journal_write_bytes: d(da.journal_write_bytes, db.journal_write_bytes)?,
                metadata_write_bytes: d(da.metadata_write_bytes, db.metadata_write_bytes)?,
            });
        }
    }
    p.drives.sort_by_key(|d| (d.node, d.id));
    Ok(p)
}

/// Reduce a repeat. `samples` holds (before, after) per node.
pub fn measure(
    repeat: u32,
    runs: &[WorkerRun],
    samples: &[(FleetSample, FleetSample)],
) -> Result<RepeatMeasure, MeasureError> {
    let mut m = RepeatMeasure {
        repeat,
        ..Default::default()
    };
    for r in runs {
        let (rd, wr) = (&r.job.read, &r.job.write);
        let all = Histogram::merged([&rd.hist, &wr.hist]);
        m.workers.push(WorkerMeasure {
            node: r.node,
            worker: r.worker,
            volume: r.volume.clone(),
            read_ios: rd.ios,
            write_ios: wr.ios,
            read_bytes: rd.bytes,
            write_bytes: wr.bytes,
            read_iops: rd.iops,
            write_iops: wr.iops,
            read_bytes_per_s: rd.bytes_per_s,
            write_bytes_per_s: wr.bytes_per_s,
            read_lat_mean_ns: rd.lat_mean_ns,
            write_lat_mean_ns: wr.lat_mean_ns,
            error: r.job.error,
            cpu_cores: r.job.cpu_cores,
            curve_ns: all.percentiles(&CURVE_PERCENTILES),
        });
        m.read_hist.merge(&rd.hist);
        m.write_hist.merge(&wr.hist);
    }
    m.workers.sort_by_key(|w| (w.node, w.worker));
    for (a, b) in samples {
        let node = a.node.0;
        if a.node != b.node || a.host_id != b.host_id {
            return Err(MeasureError::Mismatch { node });
        }
        let ns = delta(node, a.mono_ns, b.mono_ns)?;
        if ns == 0 {
            return Err(MeasureError::EmptyWindow { node, ns });
        }
        let window_s = ns as f64 / 1e9;
        let cpu = b.converged_cpu_s - a.converged_cpu_s;
        if cpu < 0.0 {
            return Err(MeasureError::CounterReset { node });
        }
        // A volume first opened inside the window counts from zero.
        let (mut volume_read_ops, mut volume_write_ops) = (0u64, 0u64);
        for vb in &b.volumes {
            let (r0, w0) = a
                .volumes
                .iter()
                .find(|v| v.name == vb.name)
                .map_or((0, 0), |v| (v.read_ops, v.write_ops));
            volume_read_ops += delta(node, r0, vb.read_ops)?;
            volume_write_ops += delta(node, w0, vb.write_ops)?;
        }
        let volume_write_bytes = volume_write_bytes(node, a, b)?;
        m.nodes.push(NodeMeasure {
            node,
            host_id: a.host_id.clone(),
            window_s,
            host_busy_ticks: delta(node, a.host_busy_ticks, b.host_busy_ticks)?,
            host_total_ticks: delta(node, a.host_total_ticks, b.host_total_ticks)?,
            converged_cpu_s: cpu,
            volume_ops: volume_read_ops + volume_write_ops,
            volume_read_ops,
            volume_write_ops,
            volume_write_bytes,
        });
        for da in &a.drives {
            let Some(db) = b.drives.iter().find(|d| d.id == da.id) else {
                continue;
            };
            let d = |x: u64, y: u64| delta(node, x, y);
            m.drives.push(DriveMeasure {
                node,
                id: da.id,
                window_s,
                read_ops: d(da.read_ops, db.read_ops)?,
                write_ops: d(da.write_ops, db.write_ops)?,
                read_bytes: d(da.read_bytes, db.read_bytes)?,
                write_bytes: d(da.write_bytes, db.write_bytes)?,
                data_write_bytes: d(da.data_write_bytes, db.data_write_bytes)?,
                journal_write_bytes: d(da.journal_write_bytes, db.journal_write_bytes)?,
                metadata_write_bytes: d(da.metadata_write_bytes, db.metadata_write_bytes)?,
                queue_len: d(da.inflight_time_ns, db.inflight_time_ns)? as f64 / ns as f64,
            });
        }
    }
    m.nodes.sort_by_key(|n| n.node);
    m.drives.sort_by_key(|d| (d.node, d.id));
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_api::fleet::{DriveCounters, VolumeIoCounters};
    use converge_types::NodeId;

    fn sample(node: u32, ns: u64, vols: &[(&str, u64)], drives: &[(u64, [u64; 3])]) -> FleetSample {
        FleetSample {
            node: NodeId(node),
            host_id: "h1".into(),
            mono_ns: ns,
            volumes: vols
                .iter()
                .map(|(name, b)| VolumeIoCounters {
                    name: (*name).into(),
                    write_bytes: *b,
                    write_ops: b / 4096,
                    ..Default::default()
                })
                .collect(),
            drives: drives
                .iter()
                .map(|(id, [d, j, m])| DriveCounters {
                    id: DriveId(*id),
                    write_bytes: d + j + m,
                    data_write_bytes: *d,
                    journal_write_bytes: *j,
                    metadata_write_bytes: *m,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn point_bytes_are_the_differences_over_every_node() {
        let pairs = vec![
            (
                sample(1, 1_000_000_000, &[("v1", 100)], &[(11, [10, 1, 0])]),
                sample(1, 9_000_000_000, &[("v1", 1100)], &[(11, [3010, 51, 7])]),
            ),
            (
                // A volume opened after the first sample counts from zero.
                sample(2, 0, &[], &[(21, [0, 0, 0]), (29, [5, 0, 0])]),
                sample(
                    2,
                    7_500_000_000,
                    &[("v2", 500)],
                    &[(21, [1500, 20, 0]), (29, [505, 0, 0])],
                ),
            ),
        ];
        let p = point_bytes(&pairs).unwrap();
        assert_eq!(p.volume_write_bytes, 1500);
        assert_eq!(p.seconds, 8.0, "the longest node's interval");
        let d: Vec<(u64, u64, u64, u64)> = p
            .drives
            .iter()
            .map(|d| {
                (
                    d.id.0,
                    d.write_bytes,
                    d.data_write_bytes,
                    d.journal_write_bytes,
                )
            })
            .collect();
        assert_eq!(
            d,
            vec![
                (11, 3057, 3000, 50),
                (21, 1520, 1500, 20),
                (29, 500, 500, 0)
            ]
        );
        assert_eq!(p.drives[0].metadata_write_bytes, 7);
    }

    #[test]
    fn point_bytes_refuse_counters_that_went_backwards() {
        let pairs = vec![(
            sample(3, 1, &[("v", 100)], &[(31, [10, 0, 0])]),
            sample(3, 2, &[("v", 100)], &[(31, [9, 0, 0])]),
        )];
        assert_eq!(
            point_bytes(&pairs),
            Err(MeasureError::CounterReset { node: 3 })
        );
        let pairs = vec![(sample(3, 5, &[], &[]), sample(4, 6, &[], &[]))];
        assert_eq!(point_bytes(&pairs), Err(MeasureError::Mismatch { node: 3 }));
    }
}
