//! The presets of METHODOLOGY.md as data, the user's overrides, their validation, and the
//! expansion of a profile into the sweep points a run measures. Everything a run does is
//! decided here, before anything touches the cluster.

use converge_types::{format_size, Compression, Resiliency, BLOCK_SIZE, MAX_IO_BYTES};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Highest queue depth per worker accepted (nodes may allow less: their
/// `knobs.nbd_inflight_max`, checked before a run starts).
pub const QD_MAX: u32 = 1024;
/// Most workers ("VMs") per node.
pub const WORKERS_PER_NODE_MAX: u32 = 64;
/// Most repeats of a point.
pub const REPEAT_MAX: u32 = 100;
/// Longest measured duration of a point, seconds (a day).
pub const DURATION_S_MAX: u64 = 24 * 3600;
/// Longest warm-up or cool-down, seconds (a day).
pub const PAUSE_S_MAX: u64 = 24 * 3600;
/// Most points in one run.
pub const POINTS_MAX: usize = 10_000;
/// Queue depths a saturation search (`--saturate`) doubles through unless `--qd` names
/// others: 1 → 64 per worker, as the reference architectures sweep them.
pub const SATURATION_QDS: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// A doubling of the queue depth that adds less than this share of IOPS over the best
/// lower queue depth ends the search: throughput stopped rising. 10 %: above the spread of
/// repeated points on a quiet cluster, well below what a doubling gives before the knee.
pub const SATURATION_GAIN: f64 = 0.10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "unknown profile {0:?}: choose one of small-block, large-block, vm-scaling, oltp, \
         exchange, seq (see docs/FLEET.md)"
    )]
    UnknownProfile(String),
    #[error("{what} {value}: {rule}")]
    Invalid {
        what: &'static str,
        value: String,
        rule: String,
    },
    #[error("{0}")]
    Parse(String),
}

fn invalid(what: &'static str, value: impl fmt::Display, rule: impl Into<String>) -> PlanError {
    PlanError::Invalid {
        what,
        value: value.to_string(),
        rule: rule.into(),
    }
}

/// A named preset of METHODOLOGY.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    SmallBlock,
    LargeBlock,
    VmScaling,
    Oltp,
    Exchange,
    Seq,
    /// The same per-node load on N nodes, then on 2N: the scale-out factor (a study of two
    /// runs, [`Profile::is_scale_out`]).
    ScaleOut,
}

impl Profile {
    pub const ALL: [Profile; 7] = [
        Profile::SmallBlock,
        Profile::LargeBlock,
        Profile::VmScaling,
        Profile::Oltp,
        Profile::Exchange,
        Profile::Seq,
        Profile::ScaleOut,
    ];

    /// Runs twice, on half the nodes and then on all of them (`converge fleet run` makes
    /// it a scale-out study, docs/FLEET.md).
    pub fn is_scale_out(self) -> bool {
        self == Profile::ScaleOut
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::SmallBlock => "small-block",
            Profile::LargeBlock => "large-block",
            Profile::VmScaling => "vm-scaling",
            Profile::Oltp => "oltp",
            Profile::Exchange => "exchange",
            Profile::Seq => "seq",
            Profile::ScaleOut => "scale-out",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Profile::SmallBlock => {
                "4 KiB random, QD 1-8 x read 100/90/70/0 %: the headline IOPS table"
            }
            Profile::LargeBlock => "128 KiB random, QD 1-8 x read 100/0 %: throughput in MB/s",
            Profile::VmScaling => "4 KiB random, QD 1 and 8, workers per node swept 1..max",
            Profile::Oltp => "8 KiB random, 10 % writes, QD sweep: database-like",
            Profile::Exchange => {
                "32 KiB, 80 % random / 20 % sequential, 40 % writes, QD sweep: mail-server-like"
            }
            Profile::Seq => "512 KiB sequential, QD 1, read and write: decision-support bandwidth",
            Profile::ScaleOut => {
                "4 KiB random, QD 1 and 8 x read 100/70/0 %, on half the nodes then on all: \
                 the scale-out factor"
            }
        }
    }

    /// The preset's own parameters: what a laptop lab finishes in minutes.
    pub fn defaults(self) -> Settings {
        let base = Settings {
            profile: self,
            block_sizes: vec![4 << 10],
            random_pct: 100,
            queue_depths: vec![1, 2, 4, 8],
            write_pcts: vec![0, 10, 30, 100],
            workers_per_node: vec![2],
            working_set_bytes: 256 << 20,
            resiliency: Resiliency::Mirror3,
            warmup_s: 10,
            duration_s: 30,
            cooldown_s: 0,
            repeat: 1,
            quick: false,
            compress_pct: 0,
            dedupe_pct: 0,
            compression: Compression::None,
            encrypt: false,
            saturate: false,
            vm: None,
        };
        match self {
            Profile::SmallBlock => base,
            Profile::LargeBlock => Settings {
                block_sizes: vec![128 << 10],
                write_pcts: vec![0, 100],
                workers_per_node: vec![1],
                working_set_bytes: 512 << 20,
                ..base
            },
            Profile::VmScaling => Settings {
                queue_depths: vec![1, 8],
                workers_per_node: vec![1, 2, 3, 4],
                ..base
            },
            Profile::Oltp => Settings {
                block_sizes: vec![8 << 10],
                queue_depths: vec![1, 2, 4, 8, 16],
                write_pcts: vec![10],
                ..base
            },
            Profile::Exchange => Settings {
                block_sizes: vec![32 << 10],
                random_pct: 80,
                queue_depths: vec![1, 2, 4, 8, 16],
                write_pcts: vec![40],
                ..base
            },
            Profile::Seq => Settings {
                block_sizes: vec![512 << 10],
                random_pct: 0,
                queue_depths: vec![1],
                write_pcts: vec![0, 100],
                workers_per_node: vec![1],
                working_set_bytes: 512 << 20,
                ..base
            },
            Profile::ScaleOut => Settings {
                queue_depths: vec![1, 8],
                write_pcts: vec![0, 30, 100],
                ..base
            },
        }
    }

    /// `--quick`: one worker per node, a small working set, seconds per point.
    fn quick(self, s: Settings) -> Settings {
        let large = s.block_sizes.iter().any(|b| *b >= 64 << 10);
        Settings {
            workers_per_node: if self == Profile::VmScaling {
                vec![1, 2]
            } else {
                vec![1]
            },
            working_set_bytes: if large { 128 << 20 } else { 64 << 20 },
            warmup_s: 2,
            duration_s: 5,
            cooldown_s: 0,
            repeat: 1,
            quick: true,
            ..s
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| PlanError::UnknownProfile(s.to_string()))
    }
}

/// The fully resolved parameters of a run (preset, then `--quick`, then overrides).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub profile: Profile,
    pub block_sizes: Vec<u64>,
    /// 100 = random offsets, 0 = sequential, between = fio's percentage_random.
    pub random_pct: u8,
    pub queue_depths: Vec<u32>,
    pub write_pcts: Vec<u8>,
    /// Swept when it has several values (vm-scaling).
    pub workers_per_node: Vec<u32>,
    /// Bytes each worker touches: its volume's size.
    pub working_set_bytes: u64,
    pub resiliency: Resiliency,
    pub warmup_s: u64,
    pub duration_s: u64,
    pub cooldown_s: u64,
    pub repeat: u32,
    pub quick: bool,
    /// The data the workers write (fio's `buffer_compress_percentage`): this share of
    /// every buffer is a fixed pattern a compressor removes; 0 = fio's default, random
    /// bytes that do not compress.
    #[serde(default)]
    pub compress_pct: u8,
    /// Share of written buffers that repeat an earlier one (fio's `dedupe_percentage`).
    #[serde(default)]
    pub dedupe_pct: u8,
    /// How the workers' volumes compress their data (docs/adr/0010).
    #[serde(default)]
    pub compression: Compression,
    /// The workers' volumes are encrypted at rest (docs/adr/0011).
    #[serde(default)]
    pub encrypt: bool,
    /// Saturation search: each series (block size, workers, write share) runs its queue
    /// depths in rising order and stops at the first that adds less than
    /// [`SATURATION_GAIN`] IOPS over the best below it ([`saturated_at`]).
    #[serde(default)]
    pub saturate: bool,
    /// The workers run fio inside guests on vhost-user-blk disks (`--vms`), not on the
    /// hosts over NBD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<converge_api::fleet::VmWorker>,
}

impl Settings {
    /// The data pattern in words, as the report and comparisons show it.
    pub fn data_pattern(&self) -> String {
        match (self.compress_pct, self.dedupe_pct) {
            (0, 0) => "random (incompressible)".into(),
            (c, 0) => format!("{c} % compressible"),
            (0, d) => format!("random, {d} % duplicate buffers"),
            (c, d) => format!("{c} % compressible, {d} % duplicate buffers"),
        }
    }

    /// Volumes each node needs: the most workers any point runs there.
    pub fn volumes_per_node(&self) -> u32 {
        self.workers_per_node.iter().copied().max().unwrap_or(1)
    }

    pub fn pattern(&self) -> String {
        match self.random_pct {
            100 => "random".into(),
            0 => "sequential".into(),
            r => format!("{r} % random, {} % sequential", 100 - r),
        }
    }
}

/// What the user may change on the command line; `None` keeps the preset's value.
/// Numbers arrive wide (u64) so that a bad value is reported, not wrapped.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub workers_per_node: Option<Vec<u64>>,
    pub qd: Option<Vec<u64>>,
    pub write_pct: Option<Vec<u64>>,
    pub bs: Option<Vec<u64>>,
    pub working_set: Option<u64>,
    pub resiliency: Option<Resiliency>,
    pub warmup_s: Option<u64>,
    pub duration_s: Option<u64>,
    pub cooldown_s: Option<u64>,
    pub repeat: Option<u64>,
    pub quick: bool,
    pub compress_pct: Option<u64>,
    pub dedupe_pct: Option<u64>,
    pub compression: Option<Compression>,
    pub encrypt: bool,
    pub saturate: bool,
}

fn sorted_unique<T: Ord + Copy>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// Preset → `--quick` → overrides, then every value checked.
pub fn resolve(profile: &str, o: &Overrides) -> Result<Settings, PlanError> {
    let p: Profile = profile.parse()?;
    let mut s = p.defaults();
    if o.quick {
        s = p.quick(s);
    }
    if let Some(v) = &o.workers_per_node {
        if v.is_empty() {
            return Err(invalid(
                "--workers-per-node",
                "(empty)",
                "give at least one value",
            ));
        }
        for &w in v {
            if w == 0 || w > WORKERS_PER_NODE_MAX as u64 {
                return Err(invalid(
                    "--workers-per-node",
                    w,
                    format!("must be 1..={WORKERS_PER_NODE_MAX}"),
                ));
            }
        }
        s.workers_per_node = sorted_unique(&v.iter().map(|&w| w as u32).collect::<Vec<_>>());
    }
    if let Some(v) = &o.qd {
        if v.is_empty() {
            return Err(invalid("--qd", "(empty)", "give at least one queue depth"));
        }
        for &q in v {
            if q == 0 || q > QD_MAX as u64 {
                return Err(invalid(
                    "--qd",
                    q,
                    format!("a queue depth must be 1..={QD_MAX} outstanding I/Os per worker"),
                ));
            }
        }
        s.queue_depths = sorted_unique(&v.iter().map(|&q| q as u32).collect::<Vec<_>>());
    }
    if let Some(v) = &o.write_pct {
        if v.is_empty() {
            return Err(invalid("--write-pct", "(empty)", "give at least one value"));
        }
        for &w in v {
            if w > 100 {
                return Err(invalid(
                    "--write-pct",
                    w,
                    "a write share is a percentage, 0..=100 (0 = all reads, 100 = all writes)",
                ));
            }
        }
        s.write_pcts = sorted_unique(&v.iter().map(|&w| w as u8).collect::<Vec<_>>());
    }
    if let Some(v) = &o.bs {
        if v.is_empty() {
            return Err(invalid("--bs", "(empty)", "give at least one block size"));
        }
        s.block_sizes = sorted_unique(v);
    }
    let bs = BLOCK_SIZE as u64;
    for &b in &s.block_sizes {
        if b == 0 || !b.is_multiple_of(bs) || b > MAX_IO_BYTES as u64 {
            return Err(invalid(
                "--bs",
                format_size(b),
                format!(
                    "a block size must be a multiple of 4 KiB and at most {}",
                    format_size(MAX_IO_BYTES as u64)
                ),
            ));
        }
    }
    if let Some(w) = o.working_set {
        s.working_set_bytes = w;
    }
    let max_bs = s.block_sizes.iter().copied().max().unwrap_or(bs);
    if s.working_set_bytes < max_bs || !s.working_set_bytes.is_multiple_of(bs) {
        return Err(invalid(
            "--working-set",
            format_size(s.working_set_bytes),
            format!(
                "must be a multiple of 4 KiB and at least the largest block size ({})",
                format_size(max_bs)
            ),
        ));
    }
    if s.working_set_bytes > 1 << 50 {
        return Err(invalid(
            "--working-set",
            format_size(s.working_set_bytes),
            "must be at most 1 PiB",
        ));
    }
    if let Some(r) = o.resiliency {
        s.resiliency = r;
    }
    if let Some(c) = o.compression {
        s.compression = c;
    }
    if s.resiliency.is_parity() && !s.compression.is_none() {
        return Err(invalid(
            "--compression",
            s.compression,
            format!(
                "{} volumes store their chunks as written; compression works on mirror and simple volumes",
                s.resiliency
            ),
        ));
    }
    s.encrypt |= o.encrypt;
    if s.encrypt && !s.compression.is_none() {
        return Err(invalid(
            "--encrypt",
            "with --compression",
            "ciphertext does not compress: choose one of them",
        ));
    }
    if let Some(w) = o.warmup_s {
        s.warmup_s = w;
    }
    if let Some(d) = o.duration_s {
        s.duration_s = d;
    }
    if let Some(c) = o.cooldown_s {
        s.cooldown_s = c;
    }
    if s.duration_s == 0 || s.duration_s > DURATION_S_MAX {
        return Err(invalid(
            "--duration",
            format!("{} s", s.duration_s),
            "the measured time of a point must be 1 s to 24 h",
        ));
    }
    if s.warmup_s > PAUSE_S_MAX || s.cooldown_s > PAUSE_S_MAX {
        return Err(invalid(
            "--warmup/--cooldown",
            format!("{} s / {} s", s.warmup_s, s.cooldown_s),
            "must be at most 24 h",
        ));
    }
    for (flag, v, out) in [
        ("--compressible", o.compress_pct, &mut s.compress_pct),
        ("--dedupe", o.dedupe_pct, &mut s.dedupe_pct),
    ] {
        if let Some(v) = v {
            if v > 100 {
                return Err(invalid(
                    flag,
                    v,
                    "a share of the written data in %: 0..=100",
                ));
            }
            *out = v as u8;
        }
    }
    if let Some(r) = o.repeat {
        if r == 0 || r > REPEAT_MAX as u64 {
            return Err(invalid("--repeat", r, format!("must be 1..={REPEAT_MAX}")));
        }
        s.repeat = r as u32;
    }
    if o.saturate {
        s.saturate = true;
        if o.qd.is_none() {
            s.queue_depths = SATURATION_QDS.to_vec();
        }
        if s.queue_depths.len() < 2 {
            return Err(invalid(
                "--saturate",
                format!("--qd {}", s.queue_depths[0]),
                "a saturation search doubles the queue depth: give at least two --qd values, \
                 or none for 1,2,4,8,16,32,64",
            ));
        }
    }
    let n = points(&s).len();
    if n > POINTS_MAX {
        return Err(invalid(
            "the sweep",
            format!("{n} points"),
            format!("at most {POINTS_MAX}: give fewer --qd, --write-pct, --bs or --workers-per-node values"),
        ));
    }
    Ok(s)
}

/// One point of a sweep: what every worker does for one measured window.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Point {
    pub index: usize,
    pub bs_bytes: u64,
    pub workers_per_node: u32,
    pub qd: u32,
    pub write_pct: u8,
    pub random_pct: u8,
}

/// What makes two points (of two runs) the same point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PointKey {
    pub bs_bytes: u64,
    pub workers_per_node: u32,
    pub qd: u32,
    pub write_pct: u8,
}

impl Point {
    pub fn read_pct(&self) -> u8 {
        100 - self.write_pct
    }

    pub fn key(&self) -> PointKey {
        PointKey {
            bs_bytes: self.bs_bytes,
            workers_per_node: self.workers_per_node,
            qd: self.qd,
            write_pct: self.write_pct,
        }
    }

    /// For people: "4 KiB, 1 worker/node, QD 4, read 70 %".
    pub fn label(&self) -> String {
        format!(
            "{}, {} worker{}/node, QD {}, read {} %",
            format_size(self.bs_bytes),
            self.workers_per_node,
            if self.workers_per_node == 1 { "" } else { "s" },
            self.qd,
            self.read_pct()
        )
    }

    /// For file names: "p03-4k-w1-qd4-r70".
    pub fn slug(&self) -> String {
        format!(
            "p{:02}-{}k-w{}-qd{}-r{}",
            self.index + 1,
            self.bs_bytes >> 10,
            self.workers_per_node,
            self.qd,
            self.read_pct()
        )
    }

    /// Outstanding I/Os of the whole fleet at this point.
    pub fn outstanding(&self, nodes: usize) -> u64 {
        nodes as u64 * u64::from(self.workers_per_node) * u64::from(self.qd)
    }
}

/// The sweep, in run order: block size, then workers per node, then write share, then QD.
pub fn points(s: &Settings) -> Vec<Point> {
    let mut out = Vec::new();
    for &bs in &s.block_sizes {
        for &w in &s.workers_per_node {
            for &wp in &s.write_pcts {
                for &qd in &s.queue_depths {
                    out.push(Point {
                        index: out.len(),
                        bs_bytes: bs,
                        workers_per_node: w,
                        qd,
                        write_pct: wp,
                        random_pct: s.random_pct,
                    });
                }
            }
        }
    }
    out
}

/// What makes points one series of a saturation search: all but the queue depth.
pub fn series_of(p: &Point) -> (u64, u32, u8) {
    (p.bs_bytes, p.workers_per_node, p.write_pct)
}

/// Where a series' throughput stopped rising: given its measured (queue depth, IOPS) in
/// rising queue depth, the queue depth at the knee — the last before the first that adds
/// less than [`SATURATION_GAIN`] over the best IOPS below it — or None while every step
/// still added at least that much (the series is not saturated by its highest depth).
pub fn saturated_at(series: &[(u32, f64)]) -> Option<u32> {
    let mut best: Option<(u32, f64)> = None;
    let mut prev_qd = None;
    for &(qd, iops) in series {
        if let Some((_, b)) = best {
            if b > 0.0 && iops / b - 1.0 < SATURATION_GAIN || b <= 0.0 && iops <= 0.0 {
                return prev_qd;
            }
        }
        if best.is_none_or(|(_, b)| iops > b) {
            best = Some((qd, iops));
        }
        prev_qd = Some(qd);
    }
    None
}

/// Seconds: `90`, `90s`, `5m`, `1h`, `1h30m`.
pub fn parse_duration_s(text: &str) -> Result<u64, PlanError> {
    let t = text.trim();
    let err = || {
        PlanError::Parse(format!(
            "duration {text:?} is not a duration: use seconds (90), or 90s, 5m, 1h, 1h30m"
        ))
    };
    if t.is_empty() {
        return Err(err());
    }
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let mut total: u64 = 0;
    let mut num = String::new();
    for c in t.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let mult = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => return Err(err()),
        };
        let n: u64 = num.parse().map_err(|_| err())?;
        total = n
            .checked_mul(mult)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(err)?;
        num.clear();
    }
    if !num.is_empty() {
        return Err(err());
    }
    Ok(total)
}

/// The points a run measures and how long it takes, for the plan line and the ETA.
pub fn estimated_s(s: &Settings) -> u64 {
    let per = s.warmup_s + s.duration_s + s.cooldown_s + 2;
    points(s).len() as u64 * u64::from(s.repeat) * per
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o() -> Overrides {
        Overrides::default()
    }

    #[test]
    fn small_block_is_the_sixteen_point_ra_sweep() {
        let s = resolve("small-block", &o()).unwrap();
        let p = points(&s);
        assert_eq!(p.len(), 16);
        assert!(p.iter().all(|x| x.bs_bytes == 4096 && x.random_pct == 100));
        // Write share outer, QD inner: a read % column is measured in one go.
        let order: Vec<(u8, u32)> = p.iter().map(|x| (x.write_pct, x.qd)).collect();
        assert_eq!(&order[..5], &[(0, 1), (0, 2), (0, 4), (0, 8), (10, 1)]);
        assert_eq!(p[15].write_pct, 100);
        assert_eq!(p[15].qd, 8);
        assert!(p.iter().enumerate().all(|(i, x)| x.index == i));
        assert_eq!(p[5].slug(), "p06-4k-w2-qd2-r90");
        assert_eq!(p[5].label(), "4 KiB, 2 workers/node, QD 2, read 90 %");
    }

    #[test]
    fn saturate_doubles_the_queue_depth_from_1_to_64_unless_told() {
        let s = resolve(
            "small-block",
            &Overrides {
                saturate: true,
                ..o()
            },
        )
        .unwrap();
        assert!(s.saturate);
        assert_eq!(s.queue_depths, SATURATION_QDS.to_vec());
        // 4 write shares x 7 depths, each series contiguous in rising depth.
        let p = points(&s);
        assert_eq!(p.len(), 28);
        for w in p.windows(2) {
            if series_of(&w[0]) == series_of(&w[1]) {
                assert!(w[0].qd < w[1].qd);
            }
        }
        let s = resolve(
            "small-block",
            &Overrides {
                saturate: true,
                qd: Some(vec![16, 4, 1]),
                ..o()
            },
        )
        .unwrap();
        assert_eq!(s.queue_depths, vec![1, 4, 16]);
        let e = resolve(
            "small-block",
            &Overrides {
                saturate: true,
                qd: Some(vec![8]),
                ..o()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--saturate") && e.contains("at least two"),
            "{e}"
        );
    }

    #[test]
    fn saturation_is_the_depth_before_the_first_doubling_that_adds_under_10_pct() {
        // Rising by more than 10 % at every step: not saturated.
        assert_eq!(saturated_at(&[(1, 100.0), (2, 190.0), (4, 300.0)]), None);
        // 4 → 8 adds 5 %: the knee is 4.
        assert_eq!(
            saturated_at(&[(1, 100.0), (2, 190.0), (4, 300.0), (8, 315.0)]),
            Some(4)
        );
        // Falling counts as not rising.
        assert_eq!(saturated_at(&[(1, 100.0), (2, 80.0)]), Some(1));
        // Exactly 10 % more still rises.
        assert_eq!(saturated_at(&[(1, 100.0), (2, 110.0)]), None);
        assert_eq!(saturated_at(&[(1, 100.0)]), None);
        assert_eq!(saturated_at(&[]), None);
    }

    #[test]
    fn every_preset_expands() {
        let n = |name: &str| points(&resolve(name, &o()).unwrap()).len();
        assert_eq!(n("large-block"), 8);
        assert_eq!(n("vm-scaling"), 2 * 4 * 4);
        assert_eq!(n("oltp"), 5);
        assert_eq!(n("exchange"), 5);
        assert_eq!(n("seq"), 2);
        let ex = resolve("exchange", &o()).unwrap();
        assert_eq!(ex.random_pct, 80);
        assert_eq!(ex.pattern(), "80 % random, 20 % sequential");
        assert_eq!(resolve("seq", &o()).unwrap().pattern(), "sequential");
        let vm = resolve("vm-scaling", &o()).unwrap();
        assert_eq!(vm.volumes_per_node(), 4);
    }

    #[test]
    fn quick_shrinks_and_overrides_win() {
        let q = resolve("small-block", &Overrides { quick: true, ..o() }).unwrap();
        assert_eq!(q.workers_per_node, vec![1]);
        assert_eq!(q.working_set_bytes, 64 << 20);
        assert!(q.warmup_s + q.duration_s <= 10);
        assert_eq!(points(&q).len(), 16);
        let q = resolve(
            "small-block",
            &Overrides {
                quick: true,
                qd: Some(vec![8, 1, 8]),
                write_pct: Some(vec![100, 0]),
                duration_s: Some(3),
                ..o()
            },
        )
        .unwrap();
        assert_eq!(q.queue_depths, vec![1, 8]);
        assert_eq!(q.write_pcts, vec![0, 100]);
        assert_eq!(q.duration_s, 3);
        assert_eq!(q.data_pattern(), "random (incompressible)");
        let d = |c, d| Overrides {
            compress_pct: c,
            dedupe_pct: d,
            ..o()
        };
        let s = resolve("small-block", &d(Some(50), Some(20))).unwrap();
        assert_eq!((s.compress_pct, s.dedupe_pct), (50, 20));
        assert_eq!(
            s.data_pattern(),
            "50 % compressible, 20 % duplicate buffers"
        );
        for (c, dd) in [(Some(101), None), (None, Some(300))] {
            let e = resolve("small-block", &d(c, dd)).unwrap_err().to_string();
            assert!(e.contains("0..=100"), "{e}");
        }
        // Runs recorded before the setting existed read as random data.
        let mut v = serde_json::to_value(&s).unwrap();
        let m = v.as_object_mut().unwrap();
        m.remove("compress_pct");
        m.remove("dedupe_pct");
        let old: Settings = serde_json::from_value(v).unwrap();
        assert_eq!(old.data_pattern(), "random (incompressible)");
        assert_eq!(points(&q).len(), 4);
    }

    #[test]
    fn impossible_overrides_are_refused_with_the_rule() {
        let e = resolve(
            "small-block",
            &Overrides {
                qd: Some(vec![0]),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("--qd 0"), "{e}");
        assert!(e.to_string().contains("1..=1024"), "{e}");
        let e = resolve(
            "small-block",
            &Overrides {
                write_pct: Some(vec![150]),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("--write-pct 150"), "{e}");
        assert!(e.to_string().contains("0..=100"), "{e}");
        let e = resolve(
            "small-block",
            &Overrides {
                bs: Some(vec![1000]),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("multiple of 4 KiB"), "{e}");
        let e = resolve(
            "seq",
            &Overrides {
                working_set: Some(64 << 10),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("largest block size"), "{e}");
        let e = resolve(
            "oltp",
            &Overrides {
                duration_s: Some(0),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("--duration"), "{e}");
        let e = resolve(
            "oltp",
            &Overrides {
                repeat: Some(0),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("--repeat"), "{e}");
        let e = resolve(
            "oltp",
            &Overrides {
                workers_per_node: Some(vec![0]),
                ..o()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("--workers-per-node"), "{e}");
        let e = resolve("bogus", &o()).unwrap_err();
        assert!(e.to_string().contains("unknown profile \"bogus\""), "{e}");
        assert!(e.to_string().contains("small-block"), "{e}");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration_s("90").unwrap(), 90);
        assert_eq!(parse_duration_s("90s").unwrap(), 90);
        assert_eq!(parse_duration_s("5m").unwrap(), 300);
        assert_eq!(parse_duration_s("1h30m").unwrap(), 5400);
        for bad in ["", "m", "5x", "5m3", "-1"] {
            assert!(parse_duration_s(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn profile_names_round_trip() {
        for p in Profile::ALL {
            assert_eq!(p.name().parse::<Profile>().unwrap(), p);
            let j = serde_json::to_string(&p).unwrap();
            assert_eq!(j, format!("\"{}\"", p.name()));
        }
    }
}
