//! One measured window of one point (one repeat), reduced from what was collected: every
//! worker's fio result and every node's counter samples taken before and after the window.

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
}

fn delta(node: u32, a: u64, b: u64) -> Result<u64, MeasureError> {
    b.checked_sub(a).ok_or(MeasureError::CounterReset { node })
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
        let (mut volume_ops, mut volume_write_bytes) = (0u64, 0u64);
        for vb in &b.volumes {
            let va = a.volumes.iter().find(|v| v.name == vb.name);
            let (ops0, bytes0) = va
                .map(|v| (v.read_ops + v.write_ops, v.write_bytes))
                .unwrap_or((0, 0));
            volume_ops += delta(node, ops0, vb.read_ops + vb.write_ops)?;
            volume_write_bytes += delta(node, bytes0, vb.write_bytes)?;
        }
        m.nodes.push(NodeMeasure {
            node,
            host_id: a.host_id.clone(),
            window_s,
            host_busy_ticks: delta(node, a.host_busy_ticks, b.host_busy_ticks)?,
            host_total_ticks: delta(node, a.host_total_ticks, b.host_total_ticks)?,
            converged_cpu_s: cpu,
            volume_ops,
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
