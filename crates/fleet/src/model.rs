//! A run as data: its full configuration (a report without it is not a result), every
//! point's raw measurements, and the statistics derived from them — fleet totals, merged
//! percentiles, CPU cost, per-drive load and queue length, write amplification by tier,
//! and endurance. `summary.json` is this, serialized; reports are rendered from it.

use crate::endurance::{self, Rating, DUTY_HOURS};
use crate::hist::{Histogram, PERCENTILES};
use crate::measure::{per_s, NodeMeasure, RepeatMeasure};
use crate::profile::{Point, Settings};
use converge_types::{DriveId, DriveRole, MediaType, Resiliency};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of `summary.json`'s layout.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterConfig {
    pub name: String,
    pub id: String,
    pub slab_size_bytes: u64,
    /// Health when the run started.
    pub health: String,
    /// The cache tier in effect for the run, as `converge fleet run` read it: mode(s),
    /// cache drives, their size and binding, e.g. `write (4 cache drives, 256 MiB each,
    /// bound 1:1)`, or `none (no cache drives)`.
    pub cache_mode: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeConfig {
    pub id: u32,
    pub name: String,
    pub hostname: String,
    pub host_id: String,
    pub kernel: String,
    pub cpus: u32,
    pub converged_version: String,
    pub fio_version: String,
    /// Whether this node runs fleet workers (all nodes serve replicas either way).
    pub runs_workers: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriveConfig {
    pub id: DriveId,
    pub node: u32,
    pub path: String,
    pub role: DriveRole,
    pub media: MediaType,
    pub size_bytes: u64,
    /// None: the drive does not wear (RAM) and has no rating.
    pub rating: Option<Rating>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub format_version: u32,
    /// The command line that made the run.
    pub command: String,
    pub cli_version: String,
    pub started_unix: u64,
    pub cluster: ClusterConfig,
    pub nodes: Vec<NodeConfig>,
    pub drives: Vec<DriveConfig>,
    pub settings: Settings,
    /// Volumes the fleet created (one per worker slot per node).
    pub volumes: Vec<String>,
    /// What the fleet's volumes cost in capacity, read after pre-fill (absent in runs
    /// made before it was recorded, and in runs stopped before pre-fill ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<RunCapacity>,
    /// Nodes whose drives hold the fleet's volumes' copies or chunks, read from their slab
    /// records after pre-fill (empty in runs made before it was recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_nodes: Vec<u32>,
}

/// The density side of a run: what its resiliency (and data) cost in capacity, from the
/// cluster's own accounting (`/v1/status`) once every volume was pre-filled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunCapacity {
    /// Raw bytes of the pool's capacity drives.
    pub pool_raw_bytes: u64,
    /// Volume data the empty pool holds at the run's resiliency (every copy or chunk of a
    /// slab on its own node).
    pub pool_usable_bytes: u64,
    /// Sum of the fleet's volume sizes.
    pub provisioned_bytes: u64,
    /// The fleet's volume bytes in allocated slabs.
    pub allocated_bytes: u64,
    /// The fleet's volume bytes holding data; `None` if a node did not answer.
    pub written_bytes: Option<u64>,
    /// Raw bytes the pool's drives gave the fleet's volumes (every copy or chunk): whole
    /// slabs for plain volumes, what the copies store for compressed ones.
    pub raw_used_bytes: u64,
    /// Bytes compression saved on the drives, every copy counted (0 for volumes that do
    /// not compress, or data that does not).
    pub compression_saved_bytes: u64,
    /// Bytes one copy of the fleet's volumes takes on its drive (less than written where
    /// compression saves); `None` from runs before compression or when a node did not
    /// answer.
    #[serde(default)]
    pub stored_bytes: Option<u64>,
}

impl RunCapacity {
    /// Usable bytes per raw byte as the pool measured it (pool usable ÷ raw).
    pub fn usable_per_raw(&self) -> Option<f64> {
        ratio(self.pool_usable_bytes as f64, self.pool_raw_bytes as f64)
    }

    /// Raw bytes per written volume byte, as the fleet's volumes measured it.
    pub fn raw_per_written(&self) -> Option<f64> {
        ratio(self.raw_used_bytes as f64, self.written_bytes? as f64)
    }
}

impl RunConfig {
    pub fn worker_nodes(&self) -> usize {
        self.nodes.iter().filter(|n| n.runs_workers).count()
    }

    pub fn hosts(&self) -> usize {
        let mut h: Vec<&str> = self.nodes.iter().map(|n| n.host_id.as_str()).collect();
        h.sort_unstable();
        h.dedup();
        h.len()
    }

    pub fn drive(&self, id: DriveId) -> Option<&DriveConfig> {
        self.drives.iter().find(|d| d.id == id)
    }

    pub fn capacity_drives(&self) -> usize {
        self.drives
            .iter()
            .filter(|d| d.role == DriveRole::Capacity)
            .count()
    }

    pub fn fio_version(&self) -> String {
        let mut v: Vec<&str> = self.nodes.iter().map(|n| n.fio_version.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v.join(", ")
    }

    pub fn converged_version(&self) -> String {
        let mut v: Vec<&str> = self
            .nodes
            .iter()
            .map(|n| n.converged_version.as_str())
            .collect();
        v.sort_unstable();
        v.dedup();
        v.join(", ")
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "reason")]
pub enum RunStatus {
    Running,
    Complete,
    /// Stopped by the user (Ctrl-C): the points measured so far are in.
    Interrupted(String),
    Failed(String),
}

/// How a point's write amplification was counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WaBasis {
    /// Bytes over the whole point (warm-up + window), between two samples each taken with
    /// every cache flushed: destage of what the cache held included.
    PointBytes,
    /// Rates over the measured window only: runs made before the point's bytes were
    /// counted. Meaningless for the capacity tier behind a write cache (destage does not
    /// follow the window).
    #[default]
    WindowRates,
}

/// Write amplification: bytes written to drives per byte the workers wrote, by tier.
/// Counted in bytes over the whole point, from a sample taken with every cache flushed
/// before the workers start to one taken with every cache flushed after they all finish,
/// so the ratio is the same thing with or without a cache tier. The workers' bytes are
/// counted by converge's volumes (fio does not count its warm-up); the window's rates are
/// kept beside it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WriteAmp {
    #[serde(default)]
    pub basis: WaBasis,
    /// Over the whole point: what the workers wrote (as the volumes counted it; fio's
    /// figure extended over the warm-up if the volumes did not count), what the capacity
    /// drives wrote (every byte), and the cache drives (None: no cache drive). Zero with
    /// basis `window-rates`.
    #[serde(default)]
    pub client_write_bytes: u64,
    #[serde(default)]
    pub capacity_write_bytes: u64,
    #[serde(default)]
    pub cache_write_bytes: Option<u64>,
    /// What the workers wrote per second over the measured window, as the volumes counted
    /// it (fio's figure if unavailable).
    pub client_write_mb_per_s: f64,
    /// What the workers wrote, as fio measured it over its own window.
    #[serde(default)]
    pub fio_write_mb_per_s: f64,
    /// What the capacity drives wrote per second over the measured window.
    pub capacity_write_mb_per_s: f64,
    /// Capacity tier, every byte (data + journal + metadata).
    pub total: Option<f64>,
    /// Capacity tier, data region only: the resiliency's share.
    pub data: Option<f64>,
    pub journal: Option<f64>,
    pub metadata: Option<f64>,
    /// Cache tier; None while the cluster has no cache drives.
    pub cache: Option<f64>,
}

/// What the point's write rate does to the drive that wears fastest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Endurance {
    pub drive: DriveId,
    pub node: u32,
    pub size_bytes: u64,
    pub tbw_bytes: u64,
    pub warranty_years: f64,
    /// The drive's measured write rate while loaded.
    pub write_mb_per_s: f64,
    /// Mean over rated drives.
    pub mean_write_mb_per_s: f64,
    /// Rate the rating sustains over the warranty at 24, 12 and 8 h of load a day.
    pub sustainable_mb_per_s: [f64; 3],
    /// Years until the rating is used up at 24, 12 and 8 h a day (None: no writes).
    pub years: [Option<f64>; 3],
    /// Drive writes per day the load needs at 24, 12 and 8 h a day.
    pub dwpd_needed: [f64; 3],
}

/// Statistics of a point: the mean of its repeats, with percentiles from the merged
/// histograms of all repeats.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PointStats {
    pub repeats: u32,
    pub iops: f64,
    pub iops_min: f64,
    pub iops_max: f64,
    /// Coefficient of variation of IOPS across repeats, %.
    pub iops_cv_pct: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    /// MB = 10^6 bytes.
    pub mb_per_s: f64,
    pub read_mb_per_s: f64,
    pub write_mb_per_s: f64,
    pub lat_mean_us: Option<f64>,
    pub read_lat_mean_us: Option<f64>,
    pub write_lat_mean_us: Option<f64>,
    /// At `hist::PERCENTILES`, µs.
    /// A percentile the I/Os measured do not support (fewer than
    /// [`crate::hist::samples_needed`]) is `None`, as is one of a direction with no I/O:
    /// the sample counts below tell them apart.
    pub read_pct_us: Vec<Option<f64>>,
    pub write_pct_us: Vec<Option<f64>>,
    pub all_pct_us: Vec<Option<f64>>,
    /// I/Os behind the percentiles (0 in runs made before they were kept).
    #[serde(default)]
    pub read_samples: u64,
    #[serde(default)]
    pub write_samples: u64,
    /// Mean over hosts of host CPU utilisation.
    pub host_cpu_pct: Option<f64>,
    pub hosts: usize,
    /// CPU of every converged together, in cores.
    pub converged_cores: f64,
    pub cpu_us_per_io: Option<f64>,
    /// CPU of the workers (fio) together, in cores.
    pub fio_cores: f64,
    /// Capacity drives.
    pub drives: usize,
    pub drive_iops_mean: f64,
    pub drive_iops_min: f64,
    pub drive_iops_max: f64,
    pub drive_write_mb_per_s_mean: f64,
    pub drive_write_mb_per_s_max: f64,
    pub drive_ql_mean: f64,
    pub drive_ql_min: f64,
    pub drive_ql_max: f64,
    /// nodes × workers × QD ÷ drives: the queue each drive would have if the drives were
    /// the only place I/Os wait.
    pub drive_ql_expected: f64,
    /// Cache drives' queue length over the window (min / mean / max); None when the run has
    /// no cache drives. With a write cache this is where writes wait at the drives: they are
    /// acked from the cache drive's log and reach the capacity drives at destage, which may
    /// fall after the window (so the capacity drives' queue can be 0 at a write point).
    #[serde(default)]
    pub cache_ql_mean: Option<f64>,
    #[serde(default)]
    pub cache_ql_min: Option<f64>,
    #[serde(default)]
    pub cache_ql_max: Option<f64>,
    /// Cache drives.
    #[serde(default)]
    pub cache_drives: usize,
    pub wa: WriteAmp,
    pub endurance: Option<Endurance>,
    /// Sum of fio error codes of the workers (0 = none).
    pub errors: i64,
    /// I/O counted at two layers over the window: what the volumes served and what the
    /// drives did. None in runs made before the volumes' counts were kept by direction.
    #[serde(default)]
    pub io_layers: Option<IoLayers>,
}

/// Operations per second at the volumes (client I/O before replication) and at the drives
/// (engine operations: a mirrored write is one on each copy's drive), over the same window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IoLayers {
    pub volume_read_iops: f64,
    pub volume_write_iops: f64,
    /// Capacity drives together.
    pub capacity_read_iops: f64,
    pub capacity_write_iops: f64,
    /// Cache drives together; None without cache drives.
    pub cache_read_iops: Option<f64>,
    pub cache_write_iops: Option<f64>,
    /// Drive operations the resiliency alone needs for the volumes' I/O: reads + copies ×
    /// writes for a mirror, reads + (K+M) × writes for parity-K+M (every chunk of the row a
    /// write touches; reads of a row's other chunks come on top).
    pub expected_drive_iops: f64,
}

impl IoLayers {
    pub fn volume_iops(&self) -> f64 {
        self.volume_read_iops + self.volume_write_iops
    }
    /// Both tiers' operations together.
    pub fn drive_iops(&self) -> f64 {
        self.capacity_read_iops
            + self.capacity_write_iops
            + self.cache_read_iops.unwrap_or(0.0)
            + self.cache_write_iops.unwrap_or(0.0)
    }
}

/// Drive operations per volume write the resiliency alone costs (see
/// [`IoLayers::expected_drive_iops`]).
pub fn write_fan_out(r: Resiliency) -> f64 {
    match r {
        Resiliency::Parity { data, parity } => f64::from(data + parity),
        _ => r.copies() as f64,
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PointRecord {
    pub point: Point,
    pub repeats: Vec<RepeatMeasure>,
    pub stats: Option<PointStats>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub config: RunConfig,
    pub status: RunStatus,
    pub wall_s: f64,
    /// Points planned, measured or not.
    pub points_planned: usize,
    pub points: Vec<PointRecord>,
    pub notes: Vec<String>,
    /// Every drive and node second by second through the run (None in runs made before
    /// timelines were kept).
    #[serde(default)]
    pub timeline: Option<crate::timeline::Timeline>,
}

impl RunSummary {
    /// Derive every point's statistics from its measurements again.
    pub fn restat(&mut self) {
        let cfg = &self.config;
        for p in &mut self.points {
            p.stats = point_stats(cfg, &p.point, &p.repeats);
        }
    }

    pub fn measured(&self) -> impl Iterator<Item = (&Point, &PointStats)> {
        self.points
            .iter()
            .filter_map(|p| p.stats.as_ref().map(|s| (&p.point, s)))
    }

    /// Large blocks are reported in MB/s first, small ones in IOPS.
    pub fn throughput_first(&self) -> bool {
        self.config
            .settings
            .block_sizes
            .iter()
            .all(|&b| b >= 64 << 10)
    }
}

/// Per-repeat figures, averaged into `PointStats`.
#[derive(Default)]
struct RepeatFigures {
    iops: f64,
    read_iops: f64,
    write_iops: f64,
    bytes_per_s: f64,
    read_bytes_per_s: f64,
    write_bytes_per_s: f64,
    host_cpu_pct: Option<f64>,
    hosts: usize,
    converged_cores: f64,
    /// Client I/Os and written bytes per second as the volumes counted them.
    volume_iops: f64,
    volume_write_bps: f64,
    /// By direction; None when the run did not count them so.
    volume_dir_iops: Option<(f64, f64)>,
    cap_read_iops: f64,
    cap_write_iops: f64,
    cache_read_iops: f64,
    cache_write_iops: f64,
    fio_cores: f64,
    drive_iops: Vec<f64>,
    drive_write_bps: Vec<f64>,
    drive_ql: Vec<f64>,
    cache_ql: Vec<f64>,
    cap_write_bps: f64,
    cap_data_bps: f64,
    cap_journal_bps: f64,
    cap_meta_bps: f64,
    cache_write_bps: Option<f64>,
    /// Per rated drive: (id, write bytes/s).
    drive_rates: Vec<(DriveId, f64)>,
}

fn figures(cfg: &RunConfig, r: &RepeatMeasure) -> RepeatFigures {
    let mut f = RepeatFigures::default();
    for w in &r.workers {
        f.read_iops += w.read_iops;
        f.write_iops += w.write_iops;
        f.read_bytes_per_s += w.read_bytes_per_s;
        f.write_bytes_per_s += w.write_bytes_per_s;
        f.fio_cores += w.cpu_cores;
    }
    f.iops = f.read_iops + f.write_iops;
    f.bytes_per_s = f.read_bytes_per_s + f.write_bytes_per_s;
    // One CPU figure per host: lab nodes on one machine share it.
    let mut by_host: BTreeMap<&str, f64> = BTreeMap::new();
    for n in &r.nodes {
        if n.host_total_ticks > 0 {
            by_host
                .entry(n.host_id.as_str())
                .or_insert(100.0 * n.host_busy_ticks as f64 / n.host_total_ticks as f64);
        }
        if n.window_s > 0.0 {
            f.converged_cores += n.converged_cpu_s / n.window_s;
        }
        f.volume_iops += per_s(n.volume_ops, n.window_s);
        f.volume_write_bps += per_s(n.volume_write_bytes, n.window_s);
    }
    let by_dir = |n: &NodeMeasure| n.volume_read_ops + n.volume_write_ops == n.volume_ops;
    if r.nodes.iter().any(|n| n.volume_ops > 0) && r.nodes.iter().all(by_dir) {
        f.volume_dir_iops = Some(r.nodes.iter().fold((0.0, 0.0), |(rd, wr), n| {
            (
                rd + per_s(n.volume_read_ops, n.window_s),
                wr + per_s(n.volume_write_ops, n.window_s),
            )
        }));
    }
    f.hosts = by_host.len();
    if !by_host.is_empty() {
        f.host_cpu_pct = Some(by_host.values().sum::<f64>() / by_host.len() as f64);
    }
    let mut cache = 0.0;
    let mut have_cache = false;
    // Wear: every byte the point cost a drive — its destage after the window included —
    // over the time the point's load ran (warm-up and window), the basis of the WA table.
    // A drive behind a write cache writes little in the window and the rest at the flush.
    let load_s = (cfg.settings.warmup_s + cfg.settings.duration_s) as f64;
    match (&r.point_bytes, load_s > 0.0) {
        (Some(pb), true) => {
            for d in &pb.drives {
                if cfg.drive(d.id).is_some_and(|dc| dc.rating.is_some()) {
                    f.drive_rates.push((d.id, d.write_bytes as f64 / load_s));
                }
            }
        }
        // Runs from before the point's bytes were counted: the window's rates.
        _ => {
            for d in &r.drives {
                if cfg.drive(d.id).is_some_and(|dc| dc.rating.is_some()) {
                    f.drive_rates.push((d.id, d.write_bytes_per_s()));
                }
            }
        }
    }
    for d in &r.drives {
        let Some(dc) = cfg.drive(d.id) else { continue };
        match dc.role {
            DriveRole::Cache => {
                have_cache = true;
                cache += d.write_bytes_per_s();
                f.cache_ql.push(d.queue_len);
                f.cache_read_iops += per_s(d.read_ops, d.window_s);
                f.cache_write_iops += per_s(d.write_ops, d.window_s);
            }
            DriveRole::Capacity => {
                f.drive_iops.push(d.iops());
                f.cap_read_iops += per_s(d.read_ops, d.window_s);
                f.cap_write_iops += per_s(d.write_ops, d.window_s);
                f.drive_write_bps.push(d.write_bytes_per_s());
                f.drive_ql.push(d.queue_len);
                f.cap_write_bps += d.write_bytes_per_s();
                f.cap_data_bps += per_s(d.data_write_bytes, d.window_s);
                f.cap_journal_bps += per_s(d.journal_write_bytes, d.window_s);
                f.cap_meta_bps += per_s(d.metadata_write_bytes, d.window_s);
            }
        }
    }
    f.cache_write_bps = have_cache.then_some(cache);
    f
}

/// Bytes over whole points, summed over repeats.
#[derive(Default)]
struct ByteTotals {
    client: u64,
    cap: u64,
    cap_data: u64,
    cap_journal: u64,
    cap_meta: u64,
    cache: Option<u64>,
}

/// The point's bytes over all its repeats; None unless every repeat counted them.
fn byte_totals(cfg: &RunConfig, reps: &[RepeatMeasure]) -> Option<ByteTotals> {
    let s = &cfg.settings;
    let mut t = ByteTotals::default();
    for r in reps {
        let pb = r.point_bytes.as_ref()?;
        t.client += if pb.volume_write_bytes > 0 {
            pb.volume_write_bytes
        } else {
            // Daemons without volume counters: fio's bytes, which leave out its ramp,
            // extended over the warm-up at the measured rate.
            let fio: u64 = r.workers.iter().map(|w| w.write_bytes).sum();
            if s.duration_s > 0 {
                (fio as f64 * (s.warmup_s + s.duration_s) as f64 / s.duration_s as f64) as u64
            } else {
                fio
            }
        };
        for d in &pb.drives {
            let Some(dc) = cfg.drive(d.id) else { continue };
            match dc.role {
                DriveRole::Cache => *t.cache.get_or_insert(0) += d.write_bytes,
                DriveRole::Capacity => {
                    t.cap += d.write_bytes;
                    t.cap_data += d.data_write_bytes;
                    t.cap_journal += d.journal_write_bytes;
                    t.cap_meta += d.metadata_write_bytes;
                }
            }
        }
    }
    Some(t)
}

fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = v
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

fn mean_opt(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let xs: Vec<f64> = v.into_iter().flatten().collect();
    (!xs.is_empty()).then(|| mean(xs))
}

fn min_max(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

fn ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0 && num.is_finite()).then(|| num / den)
}

/// A latency mean weighted by I/O count across workers and repeats, µs.
fn weighted_lat_us(reps: &[RepeatMeasure], read: bool) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0u64);
    for r in reps {
        for w in &r.workers {
            let (ios, lat) = if read {
                (w.read_ios, w.read_lat_mean_ns)
            } else {
                (w.write_ios, w.write_lat_mean_ns)
            };
            sum += ios as f64 * lat;
            n += ios;
        }
    }
    (n > 0).then(|| sum / n as f64 / 1000.0)
}

fn pct_us(h: &Histogram) -> Vec<Option<f64>> {
    let n = h.count();
    h.percentiles(&PERCENTILES)
        .into_iter()
        .zip(PERCENTILES)
        .map(|(v, p)| v.filter(|_| crate::hist::supported(p, n)))
        .map(|v| v.map(|ns| ns as f64 / 1000.0))
        .collect()
}

/// Statistics of a point from its repeats; None before any repeat was measured.
pub fn point_stats(cfg: &RunConfig, point: &Point, reps: &[RepeatMeasure]) -> Option<PointStats> {
    if reps.is_empty() {
        return None;
    }
    let figs: Vec<RepeatFigures> = reps.iter().map(|r| figures(cfg, r)).collect();
    let iops: Vec<f64> = figs.iter().map(|f| f.iops).collect();
    let (iops_min, iops_max) = min_max(&iops);
    let iops_mean = mean(iops.iter().copied());
    let iops_sd = (mean(iops.iter().map(|x| (x - iops_mean).powi(2)))).sqrt();
    let read_hist = Histogram::merged(reps.iter().map(|r| &r.read_hist));
    let write_hist = Histogram::merged(reps.iter().map(|r| &r.write_hist));
    let all_hist = Histogram::merged([&read_hist, &write_hist]);
    let read_lat = weighted_lat_us(reps, true);
    let write_lat = weighted_lat_us(reps, false);
    let (rn, wn) = (read_hist.count() as f64, write_hist.count() as f64);
    let lat_mean_us = match (read_lat, write_lat) {
        (Some(r), Some(w)) if rn + wn > 0.0 => Some((r * rn + w * wn) / (rn + wn)),
        (r, w) => r.or(w),
    };
    let converged_cores = mean(figs.iter().map(|f| f.converged_cores));
    let drives_all: Vec<f64> = figs.iter().flat_map(|f| f.drive_iops.clone()).collect();
    let (drive_iops_min, drive_iops_max) = min_max(&drives_all);
    let ql_all: Vec<f64> = figs.iter().flat_map(|f| f.drive_ql.clone()).collect();
    let (drive_ql_min, drive_ql_max) = min_max(&ql_all);
    let cache_ql_all: Vec<f64> = figs.iter().flat_map(|f| f.cache_ql.clone()).collect();
    let have_cache_ql = !cache_ql_all.is_empty();
    let (cache_ql_min, cache_ql_max) = min_max(&cache_ql_all);
    let wbps_all: Vec<f64> = figs
        .iter()
        .flat_map(|f| f.drive_write_bps.clone())
        .collect();
    let fio_w = mean(figs.iter().map(|f| f.write_bytes_per_s));
    let vol_w = mean(figs.iter().map(|f| f.volume_write_bps));
    let client_w = if vol_w > 0.0 { vol_w } else { fio_w };
    // CPU per I/O over the same window as the CPU time, like WA.
    let vol_iops = mean(figs.iter().map(|f| f.volume_iops));
    let io_rate = if vol_iops > 0.0 { vol_iops } else { iops_mean };
    let cap_w = mean(figs.iter().map(|f| f.cap_write_bps));
    let capacity_drives = cfg.capacity_drives();
    let wa = match byte_totals(cfg, reps) {
        Some(b) => {
            let c = b.client as f64;
            WriteAmp {
                basis: WaBasis::PointBytes,
                client_write_bytes: b.client,
                capacity_write_bytes: b.cap,
                cache_write_bytes: b.cache,
                client_write_mb_per_s: client_w / 1e6,
                fio_write_mb_per_s: fio_w / 1e6,
                capacity_write_mb_per_s: cap_w / 1e6,
                total: ratio(b.cap as f64, c),
                data: ratio(b.cap_data as f64, c),
                journal: ratio(b.cap_journal as f64, c),
                metadata: ratio(b.cap_meta as f64, c),
                cache: b.cache.and_then(|x| ratio(x as f64, c)),
            }
        }
        None => {
            // Runs from before the point's bytes were counted: the window's rates.
            let cache_w = mean_opt(figs.iter().map(|f| f.cache_write_bps));
            WriteAmp {
                basis: WaBasis::WindowRates,
                client_write_bytes: 0,
                capacity_write_bytes: 0,
                cache_write_bytes: None,
                client_write_mb_per_s: client_w / 1e6,
                fio_write_mb_per_s: fio_w / 1e6,
                capacity_write_mb_per_s: cap_w / 1e6,
                total: ratio(cap_w, client_w),
                data: ratio(mean(figs.iter().map(|f| f.cap_data_bps)), client_w),
                journal: ratio(mean(figs.iter().map(|f| f.cap_journal_bps)), client_w),
                metadata: ratio(mean(figs.iter().map(|f| f.cap_meta_bps)), client_w),
                cache: cache_w.and_then(|c| ratio(c, client_w)),
            }
        }
    };
    Some(PointStats {
        repeats: reps.len() as u32,
        iops: iops_mean,
        iops_min,
        iops_max,
        iops_cv_pct: if iops_mean > 0.0 {
            100.0 * iops_sd / iops_mean
        } else {
            0.0
        },
        read_iops: mean(figs.iter().map(|f| f.read_iops)),
        write_iops: mean(figs.iter().map(|f| f.write_iops)),
        mb_per_s: mean(figs.iter().map(|f| f.bytes_per_s)) / 1e6,
        read_mb_per_s: mean(figs.iter().map(|f| f.read_bytes_per_s)) / 1e6,
        write_mb_per_s: fio_w / 1e6,
        lat_mean_us,
        read_lat_mean_us: read_lat,
        write_lat_mean_us: write_lat,
        read_pct_us: pct_us(&read_hist),
        write_pct_us: pct_us(&write_hist),
        all_pct_us: pct_us(&all_hist),
        read_samples: read_hist.count(),
        write_samples: write_hist.count(),
        host_cpu_pct: mean_opt(figs.iter().map(|f| f.host_cpu_pct)),
        hosts: figs.iter().map(|f| f.hosts).max().unwrap_or(0),
        converged_cores,
        cpu_us_per_io: ratio(converged_cores * 1e6, io_rate),
        fio_cores: mean(figs.iter().map(|f| f.fio_cores)),
        drives: capacity_drives,
        drive_iops_mean: mean(drives_all.iter().copied()),
        drive_iops_min,
        drive_iops_max,
        drive_write_mb_per_s_mean: mean(wbps_all.iter().copied()) / 1e6,
        drive_write_mb_per_s_max: min_max(&wbps_all).1 / 1e6,
        drive_ql_mean: mean(ql_all.iter().copied()),
        drive_ql_min,
        drive_ql_max,
        drive_ql_expected: if capacity_drives > 0 {
            point.outstanding(cfg.worker_nodes()) as f64 / capacity_drives as f64
        } else {
            0.0
        },
        cache_ql_mean: have_cache_ql.then(|| mean(cache_ql_all.iter().copied())),
        cache_ql_min: have_cache_ql.then_some(cache_ql_min),
        cache_ql_max: have_cache_ql.then_some(cache_ql_max),
        cache_drives: cfg
            .drives
            .iter()
            .filter(|d| d.role == DriveRole::Cache)
            .count(),
        wa,
        endurance: endurance_of(cfg, &figs),
        errors: reps
            .iter()
            .flat_map(|r| r.workers.iter().map(|w| w.error))
            .sum(),
        io_layers: io_layers(cfg, &figs),
    })
}

/// The two layers' operation rates, averaged over repeats; None unless every repeat
/// counted the volumes' operations by direction.
fn io_layers(cfg: &RunConfig, figs: &[RepeatFigures]) -> Option<IoLayers> {
    let dirs: Vec<(f64, f64)> = figs
        .iter()
        .map(|f| f.volume_dir_iops)
        .collect::<Option<_>>()?;
    let volume_read_iops = mean(dirs.iter().map(|d| d.0));
    let volume_write_iops = mean(dirs.iter().map(|d| d.1));
    let cache = cfg.drives.iter().any(|d| d.role == DriveRole::Cache);
    Some(IoLayers {
        volume_read_iops,
        volume_write_iops,
        capacity_read_iops: mean(figs.iter().map(|f| f.cap_read_iops)),
        capacity_write_iops: mean(figs.iter().map(|f| f.cap_write_iops)),
        cache_read_iops: cache.then(|| mean(figs.iter().map(|f| f.cache_read_iops))),
        cache_write_iops: cache.then(|| mean(figs.iter().map(|f| f.cache_write_iops))),
        expected_drive_iops: volume_read_iops
            + write_fan_out(cfg.settings.resiliency) * volume_write_iops,
    })
}

/// One series of a queue-depth sweep (block size, workers per node and write share fixed)
/// and where its throughput stopped rising ([`crate::profile::saturated_at`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SaturationRow {
    pub bs_bytes: u64,
    pub workers_per_node: u32,
    pub write_pct: u8,
    /// (queue depth per worker, IOPS) of the measured points, in rising depth.
    pub curve: Vec<(u32, f64)>,
    /// The knee: None while every doubling measured added at least the gain.
    pub knee: Option<u32>,
    /// The knee's point (else the highest depth measured).
    pub at_iops: f64,
    pub at_lat_mean_us: Option<f64>,
    /// p99 of all I/Os at that point, where the I/Os support it.
    pub at_p99_us: Option<f64>,
}

/// Every series of the run with at least two queue depths measured, in run order.
pub fn saturation(s: &RunSummary) -> Vec<SaturationRow> {
    let mut rows: Vec<(SaturationRow, Vec<&PointStats>)> = Vec::new();
    for (p, st) in s.measured() {
        let key = crate::profile::series_of(p);
        let i = match rows
            .iter()
            .position(|(r, _)| (r.bs_bytes, r.workers_per_node, r.write_pct) == key)
        {
            Some(i) => i,
            None => {
                rows.push((
                    SaturationRow {
                        bs_bytes: p.bs_bytes,
                        workers_per_node: p.workers_per_node,
                        write_pct: p.write_pct,
                        curve: Vec::new(),
                        knee: None,
                        at_iops: 0.0,
                        at_lat_mean_us: None,
                        at_p99_us: None,
                    },
                    Vec::new(),
                ));
                rows.len() - 1
            }
        };
        rows[i].0.curve.push((p.qd, st.iops));
        rows[i].1.push(st);
    }
    rows.into_iter()
        .filter(|(r, _)| r.curve.len() >= 2)
        .map(|(mut r, mut sts)| {
            let mut order: Vec<usize> = (0..r.curve.len()).collect();
            order.sort_by_key(|&i| r.curve[i].0);
            r.curve = order.iter().map(|&i| r.curve[i]).collect();
            sts = order.iter().map(|&i| sts[i]).collect();
            r.knee = crate::profile::saturated_at(&r.curve);
            let at = match r.knee {
                Some(k) => r.curve.iter().position(|c| c.0 == k).unwrap_or(0),
                None => r.curve.len() - 1,
            };
            r.at_iops = r.curve[at].1;
            r.at_lat_mean_us = sts[at].lat_mean_us;
            r.at_p99_us = sts[at].all_pct_us.get(2).copied().flatten();
            r
        })
        .collect()
}

/// Drive classes the warrantable-throughput table compares, in drive writes per day.
pub const DWPD_CLASSES: [f64; 3] = [1.0, 3.0, 10.0];

/// What limits a warrantable write rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WearBound {
    Capacity,
    Cache,
}

/// The client writes per node (bytes/s) the run's drives would sustain for their warranty
/// if every one were rated `dwpd` drive writes per day, at a point's measured write
/// amplification: the capacity drives' daily writes (size × DWPD, all of them, as
/// placement spreads the copies) over the capacity tier's WA, and likewise for flash
/// cache drives over the cache tier's WA when there are any (RAM caches do not wear);
/// the lower of the two, per node holding capacity drives. `None` without a WA (a point
/// that writes nothing) or capacity drives.
pub fn warrantable(cfg: &RunConfig, wa: &WriteAmp, dwpd: f64) -> Option<(f64, WearBound)> {
    let nodes: std::collections::BTreeSet<u32> = cfg
        .drives
        .iter()
        .filter(|d| d.role == DriveRole::Capacity)
        .map(|d| d.node)
        .collect();
    let total = wa.total.filter(|w| *w > 0.0)?;
    if nodes.is_empty() {
        return None;
    }
    let day = 86_400.0;
    let bytes = |role: DriveRole| -> f64 {
        cfg.drives
            .iter()
            .filter(|d| d.role == role && d.media != converge_types::MediaType::Ram)
            .map(|d| d.size_bytes as f64)
            .sum()
    };
    let cap_all: f64 = cfg
        .drives
        .iter()
        .filter(|d| d.role == DriveRole::Capacity)
        .map(|d| d.size_bytes as f64)
        .sum();
    let cap = cap_all * dwpd / day / total;
    let cache = match (bytes(DriveRole::Cache), wa.cache) {
        (b, Some(c)) if b > 0.0 && c > 0.0 => Some(b * dwpd / day / c),
        _ => None,
    };
    let (rate, bound) = match cache {
        Some(c) if c < cap => (c, WearBound::Cache),
        _ => (cap, WearBound::Capacity),
    };
    Some((rate / nodes.len() as f64, bound))
}

/// The rated drive that wears fastest (shortest life), averaged over repeats.
fn endurance_of(cfg: &RunConfig, figs: &[RepeatFigures]) -> Option<Endurance> {
    let mut rates: BTreeMap<DriveId, Vec<f64>> = BTreeMap::new();
    for f in figs {
        for (id, r) in &f.drive_rates {
            rates.entry(*id).or_default().push(*r);
        }
    }
    let mut best: Option<(f64, &DriveConfig, Rating, f64)> = None;
    let mut all = Vec::new();
    for (id, rs) in &rates {
        let Some(dc) = cfg.drive(*id) else { continue };
        let Some(rating) = dc.rating else { continue };
        let rate = mean(rs.iter().copied());
        all.push(rate);
        // Wear speed: the share of the rating used per second.
        let wear = rate / rating.tbw_bytes as f64;
        if best.as_ref().is_none_or(|b| wear > b.0) {
            best = Some((wear, dc, rating, rate));
        }
    }
    let (_, dc, rating, rate) = best?;
    let sustain = rating.sustainable_bytes_per_s();
    Some(Endurance {
        drive: dc.id,
        node: dc.node,
        size_bytes: dc.size_bytes,
        tbw_bytes: rating.tbw_bytes,
        warranty_years: rating.warranty_years,
        write_mb_per_s: rate / 1e6,
        mean_write_mb_per_s: mean(all) / 1e6,
        sustainable_mb_per_s: DUTY_HOURS.map(|h| sustain * 24.0 / f64::from(h) / 1e6),
        years: DUTY_HOURS.map(|h| {
            let y = endurance::lifetime_years(&rating, rate, h);
            y.is_finite().then_some(y)
        }),
        dwpd_needed: DUTY_HOURS.map(|h| endurance::dwpd_needed(rate, h, dc.size_bytes)),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::endurance::RatingSource;
    use crate::measure::{DriveBytes, DriveMeasure, PointBytes, WorkerMeasure};
    use crate::profile::{points, resolve, Overrides};

    /// A 4-node config with 2 capacity drives of 1 GB each per node.
    pub fn config(write_pcts: Vec<u64>, qds: Vec<u64>) -> RunConfig {
        let settings = resolve(
            "small-block",
            &Overrides {
                quick: true,
                write_pct: Some(write_pcts),
                qd: Some(qds),
                ..Default::default()
            },
        )
        .unwrap();
        let mut drives = Vec::new();
        let mut nodes = Vec::new();
        for n in 1..=4u32 {
            nodes.push(NodeConfig {
                id: n,
                name: format!("node{n}"),
                hostname: "lab".into(),
                host_id: "h1".into(),
                kernel: "6.1".into(),
                cpus: 2,
                converged_version: "0.1.0".into(),
                fio_version: "fio-3.33".into(),
                runs_workers: true,
            });
            for d in 0..2u64 {
                drives.push(DriveConfig {
                    id: DriveId(u64::from(n) * 10 + d),
                    node: n,
                    path: format!("/lab/node{n}/drive{d}.img"),
                    role: DriveRole::Capacity,
                    media: MediaType::Ssd,
                    size_bytes: 1_000_000_000,
                    rating: Some(Rating {
                        tbw_bytes: 1_825_000_000_000,
                        warranty_years: 5.0,
                        source: RatingSource::Default,
                    }),
                });
            }
        }
        RunConfig {
            format_version: FORMAT_VERSION,
            command: "converge fleet run --profile small-block --quick".into(),
            cli_version: "0.1.0".into(),
            started_unix: 1_700_000_000,
            cluster: ClusterConfig {
                name: "lab".into(),
                id: "00".into(),
                slab_size_bytes: 256 << 20,
                health: "healthy".into(),
                cache_mode: "none".into(),
            },
            nodes,
            drives,
            settings,
            volumes: vec![],
            capacity: None,
            copy_nodes: Vec::new(),
        }
    }

    /// A synthetic repeat: 4 workers at `iops` each (`write_pct` of them writes, 4 KiB),
    /// capacity drives writing `wa_data`× the client bytes as data and `journal`× as
    /// journal, cache drives (if any) 1×; the whole point's bytes at the window's rates.
    pub fn repeat(
        cfg: &RunConfig,
        p: &Point,
        iops: f64,
        wa_data: f64,
        journal: f64,
    ) -> RepeatMeasure {
        let w_iops = iops * f64::from(p.write_pct) / 100.0;
        let r_iops = iops - w_iops;
        let secs = 10.0;
        let mut m = RepeatMeasure {
            repeat: 1,
            ..Default::default()
        };
        for n in 1..=4 {
            let mut h = Histogram::default();
            h.add(100_000 * n as u64, 100);
            m.workers.push(WorkerMeasure {
                node: n,
                worker: 1,
                volume: format!("fleet-n{n}-w1"),
                read_ios: (r_iops * secs) as u64,
                write_ios: (w_iops * secs) as u64,
                read_iops: r_iops,
                write_iops: w_iops,
                read_bytes: (r_iops * secs) as u64 * 4096,
                write_bytes: (w_iops * secs) as u64 * 4096,
                read_bytes_per_s: r_iops * 4096.0,
                write_bytes_per_s: w_iops * 4096.0,
                read_lat_mean_ns: 200_000.0,
                write_lat_mean_ns: 400_000.0,
                curve_ns: vec![Some(100_000); 14],
                ..Default::default()
            });
            if r_iops > 0.0 {
                m.read_hist.merge(&h);
            }
            if w_iops > 0.0 {
                m.write_hist.merge(&h);
            }
            m.nodes.push(NodeMeasure {
                node: n,
                host_id: "h1".into(),
                window_s: secs,
                host_busy_ticks: 500,
                host_total_ticks: 1000,
                converged_cpu_s: 2.0,
                ..Default::default()
            });
        }
        let client_bytes = 4.0 * w_iops * 4096.0 * secs;
        let ndrives = cfg.capacity_drives() as f64;
        let ncaches = cfg.drives.len() as f64 - ndrives;
        for d in &cfg.drives {
            // Cache drives log each client byte once.
            let (data, journal) = match d.role {
                DriveRole::Capacity => (
                    (client_bytes * wa_data / ndrives) as u64,
                    (client_bytes * journal / ndrives) as u64,
                ),
                DriveRole::Cache => ((client_bytes / ncaches) as u64, 0),
            };
            m.drives.push(DriveMeasure {
                node: d.node,
                id: d.id,
                window_s: secs,
                read_ops: (4.0 * r_iops * secs / ndrives) as u64,
                write_ops: (4.0 * w_iops * 3.0 * secs / ndrives) as u64,
                read_bytes: 0,
                write_bytes: data + journal,
                data_write_bytes: data,
                journal_write_bytes: journal,
                metadata_write_bytes: 0,
                queue_len: 0.5,
            });
        }
        // The whole point (warm-up included) at the window's rates.
        let point_s = secs + cfg.settings.warmup_s as f64;
        let scale = point_s / secs;
        m.point_bytes = Some(PointBytes {
            seconds: point_s,
            volume_write_bytes: (client_bytes * scale) as u64,
            drives: m
                .drives
                .iter()
                .map(|d| DriveBytes {
                    node: d.node,
                    id: d.id,
                    write_bytes: (d.write_bytes as f64 * scale) as u64,
                    data_write_bytes: (d.data_write_bytes as f64 * scale) as u64,
                    journal_write_bytes: (d.journal_write_bytes as f64 * scale) as u64,
                    metadata_write_bytes: 0,
                })
                .collect(),
        });
        m
    }

    #[test]
    fn totals_wa_cpu_and_queue_length() {
        let cfg = config(vec![0, 100], vec![4]);
        let ps = points(&cfg.settings);
        let r = repeat(&cfg, &ps[1], 1000.0, 3.0, 0.75);
        let s = point_stats(&cfg, &ps[1], &[r]).unwrap();
        assert!((s.iops - 4000.0).abs() < 1e-9);
        assert!((s.write_mb_per_s - 4000.0 * 4096.0 / 1e6).abs() < 1e-9);
        assert!((s.wa.data.unwrap() - 3.0).abs() < 1e-6, "{:?}", s.wa);
        assert!((s.wa.journal.unwrap() - 0.75).abs() < 1e-6);
        assert!((s.wa.total.unwrap() - 3.75).abs() < 1e-6);
        assert_eq!(s.wa.cache, None, "no cache tier");
        // 4 nodes × 1 worker × QD 4 over 8 drives.
        assert_eq!(s.drive_ql_expected, 2.0);
        assert_eq!(s.drive_ql_mean, 0.5);
        // One host at 50 %; 4 daemons × 0.2 cores for 4000 IOPS = 200 µs per I/O.
        assert_eq!(s.hosts, 1);
        assert_eq!(s.host_cpu_pct, Some(50.0));
        assert!((s.converged_cores - 0.8).abs() < 1e-9);
        assert!((s.cpu_us_per_io.unwrap() - 200.0).abs() < 1e-6);
        assert_eq!(s.read_lat_mean_us, None);
        assert_eq!(s.write_lat_mean_us, Some(400.0));
        // Read-only point: no WA (nothing written by the workers).
        let r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.75);
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        assert_eq!(s.wa.total, None);
        assert_eq!(s.write_lat_mean_us, None);
        assert_eq!(s.read_pct_us.len(), PERCENTILES.len());
        // Percentiles merged across workers: 100..400 µs, p50 = 200 µs; 400 I/Os support
        // p99 (1,000 needed: no), p90 (100: yes), and nothing beyond.
        assert_eq!(s.read_samples, 400);
        assert_eq!(s.read_pct_us[0], Some(200.0));
        assert_eq!(s.read_pct_us[1], Some(400.0));
        assert_eq!(s.read_pct_us[2..], [None, None, None, None]);
    }

    /// 4 nodes × 2 capacity drives of 1 GB at WA 3.75: 8 GB a day at 1 DWPD is 92.6 KB/s
    /// of drive writes, 24.7 KB/s of client writes, 6.17 KB/s per node; a flash cache tier
    /// that writes each byte once binds only when it is the smaller budget.
    #[test]
    fn warrantable_client_writes_by_drive_class() {
        let cfg = config(vec![100], vec![1]);
        let ps = points(&cfg.settings);
        let r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.75);
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        let (rate, bound) = warrantable(&cfg, &s.wa, 1.0).unwrap();
        let cap_bytes: f64 = cfg.drives.iter().map(|d| d.size_bytes as f64).sum();
        assert!(
            (rate - cap_bytes / 86_400.0 / 3.75 / 4.0).abs() < 1e-6,
            "{rate}"
        );
        assert_eq!(bound, WearBound::Capacity);
        let (r10, _) = warrantable(&cfg, &s.wa, 10.0).unwrap();
        assert!((r10 - 10.0 * rate).abs() < 1e-6);
        // A tiny flash cache tier with a heavy WA binds.
        let mut cfg2 = cfg.clone();
        cfg2.drives.push(DriveConfig {
            id: DriveId(999),
            node: 1,
            path: "c".into(),
            role: DriveRole::Cache,
            media: converge_types::MediaType::Ssd,
            size_bytes: 1 << 20,
            rating: None,
        });
        let mut wa = s.wa.clone();
        wa.cache = Some(1.0);
        let (rc, bound) = warrantable(&cfg2, &wa, 1.0).unwrap();
        assert_eq!(bound, WearBound::Cache);
        assert!((rc - (1u64 << 20) as f64 / 86_400.0 / 4.0).abs() < 1e-9);
        // A read-only point: nothing to say.
        let r = repeat(&cfg, &ps[0], 1000.0, 0.0, 0.0);
        let mut s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        s.wa.total = None;
        assert_eq!(warrantable(&cfg, &s.wa, 1.0), None);
    }

    /// A percentile is kept only from 10 / (1 − p) I/Os: p99.999 from a million.
    #[test]
    fn percentiles_beyond_the_data_are_left_out() {
        use crate::hist::{samples_needed, supported};
        assert_eq!(samples_needed(99.0), 1_000);
        assert_eq!(samples_needed(99.9), 10_000);
        assert_eq!(samples_needed(99.999), 1_000_000);
        assert!(supported(50.0, 20) && !supported(50.0, 19));
        let mut h = Histogram::default();
        h.add(1_000, 9_995);
        h.add(5_000_000, 5);
        let p = pct_us(&h);
        assert_eq!(p[3], Some(1.0), "p99.9 of 10,000 I/Os");
        assert_eq!(p[4], None, "p99.99 needs 100,000");
        assert_eq!(p[5], None);
    }

    /// Behind a write cache the capacity drives write little in the window and the rest
    /// when the point's end flushes the cache: their wear comes from every byte of the
    /// point over its load time, never from the window alone.
    #[test]
    fn wear_counts_what_destage_wrote_after_the_window() {
        let cfg = config(vec![10], vec![1]);
        let ps = points(&cfg.settings);
        let mut r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        for d in &mut r.drives {
            d.write_bytes = 0;
            d.data_write_bytes = 0;
        }
        let s = point_stats(&cfg, &ps[0], &[r.clone()]).unwrap();
        let e = s.endurance.expect("the drives wore");
        let point_bytes: u64 = r.point_bytes.as_ref().unwrap().drives[0].write_bytes;
        let load = (cfg.settings.warmup_s + cfg.settings.duration_s) as f64;
        assert!(e.write_mb_per_s > 0.0);
        assert!((e.write_mb_per_s - point_bytes as f64 / load / 1e6).abs() < 1e-9);
        assert!(e.years[0].is_some());
        // A run from before: the window's rates, zero here.
        r.point_bytes = None;
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        assert_eq!(s.endurance.unwrap().years[0], None);
    }

    #[test]
    fn old_runs_count_wa_from_the_window_rates_of_the_volumes() {
        let cfg = config(vec![100], vec![1]);
        let ps = points(&cfg.settings);
        let mut r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        // A run from before the point's bytes were counted.
        r.point_bytes = None;
        // fio saw 4000 writes/s over its own window; the volumes counted 2 % more in the
        // drives' window — the drives wrote 3× what the volumes got, exactly.
        let fio_bytes_per_s = 4000.0 * 4096.0;
        let drive_bytes: u64 = r.drives.iter().map(|d| d.data_write_bytes).sum();
        for n in &mut r.nodes {
            n.volume_write_bytes = drive_bytes / 3 / 4;
            n.volume_ops = (1.02 * 1000.0 * n.window_s) as u64;
        }
        // Make the fio figure disagree by 2 %.
        for w in &mut r.workers {
            w.write_bytes_per_s *= 0.98;
        }
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        assert_eq!(s.wa.basis, WaBasis::WindowRates);
        assert_eq!(s.wa.client_write_bytes, 0);
        assert!((s.wa.data.unwrap() - 3.0).abs() < 1e-6, "{:?}", s.wa);
        assert!((s.wa.fio_write_mb_per_s - 0.98 * fio_bytes_per_s / 1e6).abs() < 1e-6);
        // CPU per I/O uses the volumes' I/O rate too: 0.8 cores / 4080 I/O/s.
        assert!((s.cpu_us_per_io.unwrap() - 0.8e6 / 4080.0).abs() < 1e-6);
    }

    /// `config` with one 256 MB RAM cache drive per node in front of the capacity drives.
    fn config_with_caches(write_pcts: Vec<u64>) -> RunConfig {
        let mut cfg = config(write_pcts, vec![1]);
        for n in 1..=4u32 {
            cfg.drives.push(DriveConfig {
                id: DriveId(u64::from(n) * 10 + 9),
                node: n,
                path: format!("/dev/shm/lab/node{n}/cache1.img"),
                role: DriveRole::Cache,
                media: MediaType::Ram,
                size_bytes: 256_000_000,
                rating: None,
            });
        }
        cfg.cluster.cache_mode = "write (4 cache drives, 244 MiB each, bound 1:2)".into();
        cfg
    }

    /// Bytes of a whole point: the volumes got `client`; each capacity drive wrote its
    /// share of `data`, `journal` and `metadata`; each cache drive its share of `cache`.
    fn point_bytes(cfg: &RunConfig, client: u64, cap: [u64; 3], cache: u64) -> PointBytes {
        let caps = cfg.capacity_drives() as u64;
        let caches = cfg.drives.len() as u64 - caps;
        PointBytes {
            seconds: 7.5,
            volume_write_bytes: client,
            drives: cfg
                .drives
                .iter()
                .map(|d| {
                    let (data, journal, metadata) = match d.role {
                        DriveRole::Capacity => (cap[0] / caps, cap[1] / caps, cap[2] / caps),
                        DriveRole::Cache => (cache / caches, 0, 0),
                    };
                    DriveBytes {
                        node: d.node,
                        id: d.id,
                        write_bytes: data + journal + metadata,
                        data_write_bytes: data,
                        journal_write_bytes: journal,
                        metadata_write_bytes: metadata,
                    }
                })
                .collect(),
        }
    }

    #[test]
    fn wa_is_counted_in_bytes_over_the_whole_point_whatever_the_window_saw() {
        let cfg = config_with_caches(vec![100]);
        let ps = points(&cfg.settings);
        let mut r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.25);
        // Inside the window destage did not run: the capacity drives wrote nothing.
        for d in &mut r.drives {
            d.write_bytes = 0;
            d.data_write_bytes = 0;
            d.journal_write_bytes = 0;
        }
        // Over the whole point, flushes included: 80 MB from the workers, 3 copies of it
        // destaged to capacity with a little journal and metadata, and the cache logs.
        r.point_bytes = Some(point_bytes(
            &cfg,
            80_000_000,
            [240_000_000, 4_000_000, 800_000],
            84_000_000,
        ));
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        let wa = &s.wa;
        assert_eq!(wa.basis, WaBasis::PointBytes);
        assert_eq!(wa.client_write_bytes, 80_000_000);
        assert_eq!(wa.capacity_write_bytes, 244_800_000);
        assert_eq!(wa.cache_write_bytes, Some(84_000_000));
        assert!((wa.total.unwrap() - 3.06).abs() < 1e-9, "{wa:?}");
        assert!((wa.data.unwrap() - 3.0).abs() < 1e-9, "{wa:?}");
        assert!((wa.journal.unwrap() - 0.05).abs() < 1e-9, "{wa:?}");
        assert!((wa.metadata.unwrap() - 0.01).abs() < 1e-9, "{wa:?}");
        assert!((wa.cache.unwrap() - 1.05).abs() < 1e-9, "{wa:?}");
        // The window's rates stay as they were measured.
        assert_eq!(wa.capacity_write_mb_per_s, 0.0);
        assert_eq!(s.drive_write_mb_per_s_mean, 0.0);
        assert!((wa.client_write_mb_per_s - 4000.0 * 4096.0 / 1e6).abs() < 1e-6);
    }

    /// A write point with a write cache: inside the window the writes wait in the cache
    /// drives' queues and the capacity drives see nothing (destage comes after). Each tier's
    /// queue is reported on its own, so the cache tier's is not lost.
    #[test]
    fn queue_length_is_reported_per_tier() {
        let cfg = config_with_caches(vec![100]);
        let ps = points(&cfg.settings);
        let mut r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        for d in &mut r.drives {
            d.queue_len = match cfg.drive(d.id).unwrap().role {
                DriveRole::Capacity => 0.0,
                DriveRole::Cache => 0.25 * f64::from(d.node),
            };
        }
        let s = point_stats(&cfg, &ps[0], &[r.clone()]).unwrap();
        assert_eq!(s.drive_ql_mean, 0.0);
        assert_eq!(s.cache_drives, 4);
        assert_eq!(s.cache_ql_mean, Some(0.625));
        assert_eq!((s.cache_ql_min, s.cache_ql_max), (Some(0.25), Some(1.0)));
        // Without cache drives there is no cache queue, not a queue of 0.
        let plain = config(vec![100], vec![1]);
        r.drives.retain(|d| plain.drive(d.id).is_some());
        let s = point_stats(&plain, &ps[0], &[r]).unwrap();
        assert_eq!((s.cache_ql_mean, s.cache_drives), (None, 0));
    }

    #[test]
    fn repeats_add_their_bytes_before_dividing() {
        let cfg = config_with_caches(vec![100]);
        let ps = points(&cfg.settings);
        let mut a = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        a.point_bytes = Some(point_bytes(&cfg, 10_000_000, [40_000_000, 0, 0], 0));
        let mut b = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        b.repeat = 2;
        b.point_bytes = Some(point_bytes(&cfg, 30_000_000, [80_000_000, 0, 0], 0));
        let s = point_stats(&cfg, &ps[0], &[a.clone(), b]).unwrap();
        // (40 + 80) / (10 + 30) = 3.0, not the mean of 4.0 and 2.67.
        assert!((s.wa.total.unwrap() - 3.0).abs() < 1e-9, "{:?}", s.wa);
        assert_eq!(
            s.wa.cache,
            Some(0.0),
            "cache drives measured, nothing written"
        );
        // One repeat without bytes: the point falls back to the window's rates.
        let mut c = a.clone();
        c.repeat = 2;
        c.point_bytes = None;
        let s = point_stats(&cfg, &ps[0], &[a, c]).unwrap();
        assert_eq!(s.wa.basis, WaBasis::WindowRates);
        assert!((s.wa.total.unwrap() - 3.0).abs() < 1e-6, "{:?}", s.wa);
    }

    #[test]
    fn without_volume_counters_wa_counts_fios_bytes_over_the_warm_up_too() {
        let cfg = config(vec![100], vec![1]);
        let ps = points(&cfg.settings);
        let mut r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        let fio: u64 = r.workers.iter().map(|w| w.write_bytes).sum();
        let mut pb = point_bytes(&cfg, 0, [0, 0, 0], 0);
        // fio's bytes leave out its warm-up: the point lasted (warm-up + duration).
        let (w, d) = (cfg.settings.warmup_s as f64, cfg.settings.duration_s as f64);
        let client = fio as f64 * (w + d) / d;
        for x in &mut pb.drives {
            x.data_write_bytes = (3.0 * client / 8.0) as u64;
            x.write_bytes = x.data_write_bytes;
        }
        r.point_bytes = Some(pb);
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        assert_eq!(s.wa.client_write_bytes, client as u64);
        assert!((s.wa.data.unwrap() - 3.0).abs() < 1e-6, "{:?}", s.wa);
    }

    /// A summary of `cfg`'s sweep whose first `measured` points ran, point `i` at
    /// `iops(i, point)`.
    pub fn summary_from(
        cfg: &RunConfig,
        measured: usize,
        iops: impl Fn(usize, &Point) -> f64,
    ) -> RunSummary {
        let ps = points(&cfg.settings);
        let mut sum = RunSummary {
            config: cfg.clone(),
            status: RunStatus::Complete,
            wall_s: 1.0,
            points_planned: ps.len(),
            points: ps
                .iter()
                .take(measured)
                .enumerate()
                .map(|(i, p)| PointRecord {
                    point: p.clone(),
                    repeats: vec![repeat(cfg, p, iops(i, p), 3.0, 0.5)],
                    stats: None,
                })
                .collect(),
            notes: vec![],
            timeline: None,
        };
        sum.restat();
        sum
    }

    /// A summary whose points ran at the given IOPS (in `points` order).
    pub fn summary_at(cfg: &RunConfig, iops: &[f64]) -> RunSummary {
        summary_from(cfg, iops.len(), |i, _| iops[i])
    }

    #[test]
    fn saturation_finds_each_series_knee_from_its_points() {
        let cfg = config(vec![0, 100], vec![1, 2, 4, 8]);
        // Reads rise to 8; writes stop rising after 2 (4 adds 5 %), and 8 was not run.
        let sum = summary_at(&cfg, &[100.0, 200.0, 380.0, 700.0, 50.0, 90.0, 94.5]);
        let rows = saturation(&sum);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].write_pct, 0);
        assert_eq!(rows[0].knee, None);
        assert_eq!(rows[0].curve.len(), 4);
        assert!((rows[0].at_iops - 4.0 * 700.0).abs() < 1e-6, "4 workers");
        assert_eq!(rows[1].write_pct, 100);
        assert_eq!(rows[1].knee, Some(2));
        assert_eq!(
            rows[1].curve.iter().map(|c| c.0).collect::<Vec<_>>(),
            [1, 2, 4]
        );
        assert!((rows[1].at_iops - 4.0 * 90.0).abs() < 1e-6);
        assert!(rows[1].at_lat_mean_us.is_some());
        // A single depth is no series.
        let one = config(vec![0, 100], vec![4]);
        assert!(saturation(&summary_at(&one, &[1.0, 2.0])).is_empty());
    }

    #[test]
    fn io_layers_put_the_volumes_ops_beside_the_drives_ops() {
        let cfg = config(vec![30], vec![1]);
        let p = &points(&cfg.settings)[0];
        let mut r = repeat(&cfg, p, 1000.0, 3.0, 0.5);
        // Without the volumes' counts by direction (older runs): no figures.
        assert!(point_stats(&cfg, p, std::slice::from_ref(&r))
            .unwrap()
            .io_layers
            .is_none());
        // Each node's volumes: 700 reads/s and 300 writes/s over 10 s.
        for n in &mut r.nodes {
            n.volume_read_ops = 7000;
            n.volume_write_ops = 3000;
            n.volume_ops = 10_000;
        }
        let l = point_stats(&cfg, p, &[r]).unwrap().io_layers.unwrap();
        assert!((l.volume_read_iops - 2800.0).abs() < 1e-6, "{l:?}");
        assert!((l.volume_write_iops - 1200.0).abs() < 1e-6, "{l:?}");
        // The synthetic drives did reads once and writes three times (mirror-3).
        assert!((l.capacity_read_iops - 2800.0).abs() < 1.0, "{l:?}");
        assert!((l.capacity_write_iops - 3600.0).abs() < 1.0, "{l:?}");
        assert_eq!(l.cache_read_iops, None);
        assert!((l.expected_drive_iops - (2800.0 + 3.0 * 1200.0)).abs() < 1e-6);
        assert!((l.drive_iops() / l.volume_iops() - 1.6).abs() < 1e-3);
        assert_eq!(write_fan_out("parity-4+2".parse().unwrap()), 6.0);
        assert_eq!(write_fan_out("mirror-2".parse().unwrap()), 2.0);
    }

    #[test]
    fn summaries_from_before_point_bytes_load_and_fall_back_to_window_rates() {
        let cfg = config(vec![0, 100], vec![1]);
        let ps = points(&cfg.settings);
        let mut sum = RunSummary {
            config: cfg.clone(),
            status: RunStatus::Complete,
            wall_s: 12.5,
            points_planned: ps.len(),
            points: ps
                .iter()
                .map(|p| {
                    let mut r = repeat(&cfg, p, 500.0, 3.0, 0.5);
                    // Bytes that would say 2.0: only a fallback can give 3.5.
                    r.point_bytes = Some(point_bytes(&cfg, 1_000_000, [2_000_000, 0, 0], 0));
                    PointRecord {
                        point: p.clone(),
                        repeats: vec![r],
                        stats: None,
                    }
                })
                .collect(),
            notes: vec![],
            timeline: None,
        };
        sum.restat();
        // summary.json as a run before this change wrote it: no point bytes, no basis.
        let mut v = serde_json::to_value(&sum).unwrap();
        for p in v["points"].as_array_mut().unwrap() {
            for r in p["repeats"].as_array_mut().unwrap() {
                r.as_object_mut().unwrap().remove("point_bytes").unwrap();
            }
            let wa = p["stats"]["wa"].as_object_mut().unwrap();
            for k in [
                "basis",
                "client_write_bytes",
                "capacity_write_bytes",
                "cache_write_bytes",
            ] {
                wa.remove(k).unwrap();
            }
        }
        let mut old: RunSummary = serde_json::from_value(v).unwrap();
        assert!(old.points[1].repeats[0].point_bytes.is_none());
        old.restat();
        let (p, st) = old.measured().nth(1).unwrap();
        assert_eq!(p.write_pct, 100);
        assert_eq!(st.wa.basis, WaBasis::WindowRates);
        assert!((st.wa.total.unwrap() - 3.5).abs() < 1e-6, "{:?}", st.wa);
        assert!((st.wa.data.unwrap() - 3.0).abs() < 1e-6, "{:?}", st.wa);
        // The same run with its bytes: counted from them.
        let (_, st) = sum.measured().nth(1).unwrap();
        assert_eq!(st.wa.basis, WaBasis::PointBytes);
        assert!((st.wa.total.unwrap() - 2.0).abs() < 1e-9, "{:?}", st.wa);
    }

    #[test]
    fn endurance_of_the_fastest_wearing_drive() {
        let cfg = config(vec![100], vec![1]);
        let ps = points(&cfg.settings);
        let r = repeat(&cfg, &ps[0], 1000.0, 3.0, 0.0);
        let s = point_stats(&cfg, &ps[0], &[r]).unwrap();
        let e = s.endurance.unwrap();
        // Client writes 4000 × 4096 B/s, ×3 over 8 drives, in the 10 s window and the
        // warm-up before it, over the point's load time (warm-up + duration).
        let st = &cfg.settings;
        let rate = 4000.0 * 4096.0 * 3.0 / 8.0 * (10.0 + st.warmup_s as f64)
            / (st.warmup_s + st.duration_s) as f64;
        assert!((e.write_mb_per_s - rate / 1e6).abs() < 1e-3, "{e:?}");
        // 1 DWPD-class 1 GB drive over 5 years = 1.825 TB.
        let years = 1.825e12 / (rate * 86400.0 * 365.0);
        assert!((e.years[0].unwrap() - years).abs() < 1e-6 * years);
        assert!((e.years[1].unwrap() - 2.0 * years).abs() < 1e-6 * years);
        assert!((e.years[2].unwrap() - 3.0 * years).abs() < 1e-6 * years);
        assert!((e.dwpd_needed[0] - rate * 86400.0 / 1e9).abs() < 1e-3);
        let sus = 1.825e12 / (5.0 * 365.0 * 86400.0) / 1e6;
        assert!((e.sustainable_mb_per_s[0] - sus).abs() < 1e-12);
        assert!((e.sustainable_mb_per_s[2] - 3.0 * sus).abs() < 1e-12);
    }

    #[test]
    fn repeats_are_averaged_with_their_spread() {
        let cfg = config(vec![0], vec![1]);
        let ps = points(&cfg.settings);
        let a = repeat(&cfg, &ps[0], 900.0, 3.0, 0.0);
        let mut b = repeat(&cfg, &ps[0], 1100.0, 3.0, 0.0);
        b.repeat = 2;
        let s = point_stats(&cfg, &ps[0], &[a, b]).unwrap();
        assert_eq!(s.repeats, 2);
        assert!((s.iops - 4000.0).abs() < 1e-9);
        assert!((s.iops_min - 3600.0).abs() < 1e-9);
        assert!((s.iops_max - 4400.0).abs() < 1e-9);
        assert!((s.iops_cv_pct - 10.0).abs() < 1e-9);
        assert!(point_stats(&cfg, &ps[0], &[]).is_none());
    }

    #[test]
    fn summary_round_trips_through_json() {
        let cfg = config(vec![0, 100], vec![1, 2]);
        let ps = points(&cfg.settings);
        let mut sum = RunSummary {
            config: cfg.clone(),
            status: RunStatus::Interrupted("Ctrl-C".into()),
            wall_s: 12.5,
            points_planned: ps.len(),
            points: ps
                .iter()
                .map(|p| PointRecord {
                    point: p.clone(),
                    repeats: vec![repeat(&cfg, p, 500.0, 3.0, 0.5)],
                    stats: None,
                })
                .collect(),
            notes: vec![],
            timeline: None,
        };
        sum.restat();
        let j = serde_json::to_string(&sum).unwrap();
        let back: RunSummary = serde_json::from_str(&j).unwrap();
        assert_eq!(back, sum);
    }
}
