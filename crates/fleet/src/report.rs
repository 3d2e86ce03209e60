//! The human report of a run, built once as sections of text, tables and charts, and
//! rendered as Markdown (`report.md`), a self-contained HTML page (`report.html`, charts as
//! inline SVG) and terminal text; plus `summary.csv` and `summary.json`.

use crate::endurance::{RatingSource, DUTY_HOURS};
use crate::format as fmt;
use crate::hist::{CURVE_PERCENTILES, PERCENTILES};
use crate::model::{PointStats, RunStatus, RunSummary, WaBasis, WriteAmp};
use crate::profile::{Point, SATURATION_GAIN};
use crate::svg::{Chart, CurveChart, GroupedChart, Series};
use crate::table::{blocks, html_escape as esc, ra_tables, Block, Table};
use converge_types::{format_size, DriveRole, Resiliency, BLOCK_SIZE};
use std::fmt::Write as _;
use std::path::Path;

/// Percentiles of the tail tables: indexes into `hist::PERCENTILES`.
const TAIL: [(usize, &str); 4] = [(2, "99"), (3, "99.9"), (4, "99.99"), (5, "99.999")];

#[derive(Clone, Debug)]
pub enum Item {
    Text(String),
    Table(Table),
    Chart(Chart),
    /// Small charts laid out side by side.
    Charts(Vec<Chart>),
    /// Colour key shared by the charts that follow: (name, colour).
    Legend(Vec<(String, String)>),
}

#[derive(Clone, Debug)]
pub struct Section {
    pub id: String,
    pub title: String,
    pub items: Vec<Item>,
}

impl Section {
    pub(crate) fn new(id: &str, title: &str) -> Section {
        Section {
            id: id.into(),
            title: title.into(),
            items: Vec::new(),
        }
    }
    pub(crate) fn text(&mut self, s: impl Into<String>) {
        self.items.push(Item::Text(s.into()));
    }
    pub(crate) fn table(&mut self, t: Table) {
        self.items.push(Item::Table(t));
    }
    fn tables(&mut self, ts: Vec<Table>) {
        self.items.extend(ts.into_iter().map(Item::Table));
    }
    pub(crate) fn chart(&mut self, c: Chart) {
        self.items.push(Item::Chart(c));
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` from unix seconds (civil calendar from day count).
pub fn utc(unix: u64) -> String {
    let days = (unix / 86400) as i64;
    let secs = unix % 86400;
    // Days since 1970-01-01 to a civil date, in 400-year eras of 146097 days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        (secs % 3600) / 60,
        secs % 60
    )
}

fn status_text(s: &RunSummary) -> String {
    let n = s.measured().count();
    match &s.status {
        RunStatus::Complete => format!("complete: {n} of {} points", s.points_planned),
        RunStatus::Running => format!("running: {n} of {} points so far", s.points_planned),
        RunStatus::Interrupted(r) => format!(
            "INTERRUPTED ({r}): {n} of {} points measured; the rest show {}",
            s.points_planned,
            crate::table::NOT_MEASURED
        ),
        RunStatus::Failed(r) => {
            format!("FAILED ({r}): {n} of {} points measured", s.points_planned)
        }
    }
}

fn kv(title: &str, rows: Vec<(&str, String)>) -> Table {
    let mut t = Table::new(title, &["", "value"]);
    for (k, v) in rows {
        t.row(vec![k.to_string(), v]);
    }
    t
}

fn list(v: &[impl ToString]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn configuration(s: &RunSummary) -> Section {
    let c = &s.config;
    let st = &c.settings;
    let mut sec = Section::new("configuration", "Configuration");
    let max_out = crate::profile::points(st)
        .iter()
        .map(|p| p.outstanding(c.worker_nodes()))
        .max()
        .unwrap_or(0);
    sec.table(kv(
        "Run",
        vec![
            (
                "profile",
                format!("{} — {}", st.profile, st.profile.description()),
            ),
            ("status", status_text(s)),
            ("started", utc(c.started_unix)),
            ("wall time", fmt::duration_s(s.wall_s)),
            ("command", c.command.clone()),
            (
                "per point",
                format!(
                    "{} s warm-up, {} s measured, {} s cool-down, {} repeat{}{}",
                    st.warmup_s,
                    st.duration_s,
                    st.cooldown_s,
                    st.repeat,
                    if st.repeat == 1 { "" } else { "s" },
                    if st.quick { " (--quick)" } else { "" }
                ),
            ),
            (
                "block size",
                list(
                    &st.block_sizes
                        .iter()
                        .map(|b| format_size(*b))
                        .collect::<Vec<_>>(),
                ),
            ),
            ("pattern", st.pattern()),
            ("queue depth per worker", list(&st.queue_depths)),
            ("write %", list(&st.write_pcts)),
            ("workers per node", list(&st.workers_per_node)),
            (
                "working set per worker",
                format!(
                    "{} (each worker's own volume, pre-filled once)",
                    format_size(st.working_set_bytes)
                ),
            ),
            (
                "fleet",
                format!(
                    "{} nodes run workers; {} volumes of {}, {}; at most {} I/Os outstanding",
                    c.worker_nodes(),
                    c.volumes.len(),
                    format_size(st.working_set_bytes),
                    st.resiliency,
                    max_out
                ),
            ),
            ("resiliency", st.resiliency.to_string()),
            ("compression", st.compression.to_string()),
            (
                "encryption",
                if st.encrypt {
                    "aes-256-xts (on the volumes' owners)".to_string()
                } else {
                    "none".to_string()
                },
            ),
            (
                "workers",
                match &st.vm {
                    Some(vm) => format!(
                        "guests: fio inside a qemu guest each ({}, {} MiB, 1 vCPU), its disk \
                         a vhost-user-blk disk of its node",
                        vm.accel, vm.memory_mib
                    ),
                    None => "fio on each node, over NBD on the node's socket".to_string(),
                },
            ),
            (
                "data pattern",
                format!(
                    "{} (fio buffer_compress_percentage {}, dedupe_percentage {})",
                    st.data_pattern(),
                    st.compress_pct,
                    st.dedupe_pct
                ),
            ),
            ("cache mode", c.cluster.cache_mode.clone()),
            (
                "load generator",
                format!(
                    "fio ({}), nbd engine, 1 job per worker, json+ histograms",
                    c.fio_version()
                ),
            ),
            (
                "versions",
                format!(
                    "converge CLI {}, converged {}",
                    c.cli_version,
                    c.converged_version()
                ),
            ),
        ],
    ));
    let cap: u64 = c
        .drives
        .iter()
        .filter(|d| d.role == DriveRole::Capacity)
        .map(|d| d.size_bytes)
        .sum();
    sec.table(kv(
        "Cluster",
        vec![
            ("name", format!("{} ({})", c.cluster.name, c.cluster.id)),
            ("health at start", c.cluster.health.clone()),
            (
                "nodes",
                format!(
                    "{} on {} host{}",
                    c.nodes.len(),
                    c.hosts(),
                    if c.hosts() == 1 { "" } else { "s" }
                ),
            ),
            (
                "drives",
                format!(
                    "{} capacity ({} raw), {} cache",
                    c.capacity_drives(),
                    format_size(cap),
                    c.drives.len() - c.capacity_drives()
                ),
            ),
            ("slab size", format_size(c.cluster.slab_size_bytes)),
            (
                "copies on nodes",
                if c.copy_nodes.is_empty() {
                    "not recorded".into()
                } else {
                    c.copy_nodes
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            ),
        ],
    ));
    let mut nodes = Table::new(
        "Nodes",
        &[
            "node",
            "name",
            "host",
            "kernel",
            "CPUs",
            "converged",
            "fio",
            "workers",
        ],
    );
    for n in &c.nodes {
        nodes.row(vec![
            n.id.to_string(),
            n.name.clone(),
            n.hostname.clone(),
            n.kernel.clone(),
            n.cpus.to_string(),
            n.converged_version.clone(),
            n.fio_version.clone(),
            if n.runs_workers { "yes" } else { "no" }.into(),
        ]);
    }
    sec.table(nodes);
    let mut drives = Table::new(
        "Drives and their endurance ratings",
        &[
            "node",
            "drive",
            "path",
            "role",
            "media",
            "size",
            "TBW",
            "warranty",
            "DWPD",
            "rating from",
        ],
    );
    for d in &c.drives {
        let (tbw, years, dwpd, src) = match &d.rating {
            Some(r) => (
                format!("{:.1} TB", r.tbw_bytes as f64 / 1e12),
                format!("{} y", fmt::sig3(r.warranty_years)),
                fmt::sig3(r.dwpd(d.size_bytes)),
                match r.source {
                    RatingSource::Config => "node config",
                    RatingSource::Flag => "fleet flag",
                    RatingSource::Default => "media default",
                }
                .to_string(),
            ),
            None => (
                "no wear".into(),
                "no wear".into(),
                "no wear".into(),
                "RAM drive".into(),
            ),
        };
        drives.row(vec![
            d.node.to_string(),
            format!("{:016x}", d.id.0),
            d.path.clone(),
            format!("{:?}", d.role).to_lowercase(),
            format!("{:?}", d.media).to_lowercase(),
            format_size(d.size_bytes),
            tbw,
            years,
            dwpd,
            src,
        ]);
    }
    sec.table(drives);
    if c.hosts() < c.nodes.len() {
        sec.text(format!(
            "{} nodes share {} host{}: they are a lab, not separate servers. Host CPU is that \
             machine's, counted once per host, and includes the workers' (fio's) CPU, as in \
             a hyper-converged host where the VMs run beside the storage.",
            c.nodes.len(),
            c.hosts(),
            if c.hosts() == 1 { "" } else { "s" }
        ));
    }
    sec
}

fn short(p: &Point) -> String {
    format!("QD {}, read {} %", p.qd, p.read_pct())
}

fn block_points<'a>(s: &'a RunSummary, b: &Block) -> Vec<(&'a Point, &'a PointStats)> {
    s.measured().filter(|(p, _)| b.contains(p)).collect()
}

/// Bars by QD (groups) and read % (series) of `bar`, lines of `line` per read %.
#[allow(clippy::too_many_arguments)]
fn ra_chart(
    s: &RunSummary,
    b: &Block,
    title: &str,
    bar_unit: &str,
    bar: impl Fn(&PointStats) -> Option<f64>,
    line_name: &str,
    line_unit: Option<&str>,
    line: impl Fn(&PointStats) -> Option<f64>,
    fmt_bar: fn(f64) -> String,
    fmt_line: fn(f64) -> String,
) -> Chart {
    let pts = block_points(s, b);
    let val = |qd: u32, r: u8, f: &dyn Fn(&PointStats) -> Option<f64>| {
        pts.iter()
            .find(|(p, _)| p.qd == qd && p.read_pct() == r)
            .and_then(|(_, st)| f(st))
    };
    let many = blocks(s).len() > 1;
    Chart::Grouped(GroupedChart {
        title: if many {
            format!("{title} — {}", b.label())
        } else {
            title.to_string()
        },
        x_label: "queue depth per worker".into(),
        groups: b.qds.iter().map(|q| format!("QD {q}")).collect(),
        bars: b
            .read_pcts
            .iter()
            .map(|&r| Series {
                name: format!("read {r} %"),
                values: b.qds.iter().map(|&q| val(q, r, &bar)).collect(),
            })
            .collect(),
        bar_unit: bar_unit.into(),
        lines: if line_name.is_empty() {
            Vec::new()
        } else {
            b.read_pcts
                .iter()
                .map(|&r| Series {
                    name: format!("{line_name}, read {r} %"),
                    values: b.qds.iter().map(|&q| val(q, r, &line)).collect(),
                })
                .collect()
        },
        line_unit: line_unit.map(String::from),
        fmt: fmt_bar,
        line_fmt: fmt_line,
    })
}

fn f_iops(v: f64) -> String {
    fmt::iops(v)
}
fn f_sig(v: f64) -> String {
    fmt::sig3(v)
}
fn f_ms(v: f64) -> String {
    fmt::sig3(v)
}

fn headline(s: &RunSummary) -> Section {
    let mut sec = Section::new("headline", "Results");
    let tp = s.throughput_first();
    sec.text(format!(
        "Fleet totals at each point: the sum over all {} workers' fio results for IOPS and \
         MB/s (MB = 10^6 bytes); latency is per I/O, submission to completion, as a VM \
         sees it, averaged over all I/Os of all workers.",
        s.config.worker_nodes()
            * s.config
                .settings
                .workers_per_node
                .iter()
                .copied()
                .max()
                .unwrap_or(1) as usize
    ));
    if tp {
        sec.tables(ra_tables(s, "MB/s", |_, st| fmt::sig3(st.mb_per_s)));
        sec.tables(ra_tables(s, "IOPS", |_, st| fmt::iops(st.iops)));
    } else {
        sec.tables(ra_tables(s, "IOPS", |_, st| fmt::iops(st.iops)));
        sec.tables(ra_tables(s, "MB/s", |_, st| fmt::sig3(st.mb_per_s)));
    }
    sec.tables(ra_tables(s, "Mean latency", |_, st| {
        fmt::lat_opt(st.lat_mean_us)
    }));
    for b in blocks(s) {
        let c = if tp {
            ra_chart(
                s,
                &b,
                "Throughput by queue depth and read % (mean latency as lines)",
                "MB/s",
                |st| Some(st.mb_per_s),
                "mean latency",
                Some("ms"),
                |st| st.lat_mean_us.map(|u| u / 1000.0),
                f_sig,
                f_ms,
            )
        } else {
            ra_chart(
                s,
                &b,
                "IOPS by queue depth and read % (mean latency as lines)",
                "IOPS",
                |st| Some(st.iops),
                "mean latency",
                Some("ms"),
                |st| st.lat_mean_us.map(|u| u / 1000.0),
                f_iops,
                f_ms,
            )
        };
        sec.chart(c);
    }
    sec
}

fn latency(s: &RunSummary) -> Section {
    let mut sec = Section::new("latency", "Tail latency");
    sec.text(
        "Percentiles of all I/Os of all workers (reads and writes together), read off the \
         workers' fio latency histograms merged bucket by bucket — never averaged across \
         workers. Reads and writes separately are in the per-point table below. A \
         percentile is printed only from 10 / (1 − p) I/Os or more (p99 from 1,000, p99.9 \
         from 10,000, p99.99 from 100,000, p99.999 from 1,000,000); with fewer the cell \
         says \"too few I/Os\": a longer --duration or more workers measure it.",
    );
    for (i, label) in TAIL {
        sec.tables(ra_tables(
            s,
            &format!("{label}th percentile latency"),
            move |_, st| {
                fmt::tail(
                    st.all_pct_us.get(i).copied().flatten(),
                    st.read_samples + st.write_samples,
                )
            },
        ));
    }
    for b in blocks(s) {
        sec.chart(ra_chart(
            s,
            &b,
            "99.9th percentile latency (99.99th as lines)",
            "ms",
            |st| st.all_pct_us.get(3).copied().flatten().map(|u| u / 1000.0),
            "99.99th",
            None,
            |st| st.all_pct_us.get(4).copied().flatten().map(|u| u / 1000.0),
            f_ms,
            f_ms,
        ));
    }
    let mut header = vec!["point", "I/O", "mean"];
    let labels: Vec<String> = PERCENTILES.iter().map(|p| format!("p{p}")).collect();
    header.extend(labels.iter().map(String::as_str));
    let mut t = Table::new("Latency by direction", &header);
    for (p, st) in s.measured() {
        for (dir, mean, pcts, n) in [
            (
                "read",
                st.read_lat_mean_us,
                &st.read_pct_us,
                st.read_samples,
            ),
            (
                "write",
                st.write_lat_mean_us,
                &st.write_pct_us,
                st.write_samples,
            ),
        ] {
            if mean.is_none() {
                continue;
            }
            let mut row = vec![p.label(), dir.to_string(), fmt::lat_opt(mean)];
            row.extend(pcts.iter().map(|v| fmt::tail(*v, n)));
            t.row(row);
        }
    }
    sec.table(t);
    // Per-worker latency curves, one small chart per point.
    let mut charts = Vec::new();
    for rec in &s.points {
        let Some(last) = rec.repeats.last() else {
            continue;
        };
        let series = last
            .workers
            .iter()
            .map(|w| {
                (
                    format!("node {} worker {} ({})", w.node, w.worker, w.volume),
                    CURVE_PERCENTILES
                        .iter()
                        .zip(&w.curve_ns)
                        .filter_map(|(p, v)| v.map(|ns| (*p, ns as f64 / 1000.0)))
                        .collect(),
                )
            })
            .collect();
        charts.push(Chart::Curves(CurveChart {
            title: short(&rec.point),
            series,
            width: 360.0,
            height: 230.0,
        }));
    }
    if !charts.is_empty() {
        if let Some(last) = s.points.iter().rev().find_map(|r| r.repeats.last()) {
            sec.items.push(Item::Legend(
                last.workers
                    .iter()
                    .enumerate()
                    .map(|(i, w)| {
                        (
                            format!("node {} worker {}", w.node, w.worker),
                            crate::svg::color(i).to_string(),
                        )
                    })
                    .collect(),
            ));
        }
        sec.text(
            "Latency distribution of each worker at each point (one line per worker, last \
             repeat): x is the percentile on a \"nines\" scale, y the latency (log scale). A \
             worker far from the others is a VM with a worse experience than the fleet \
             average shows.",
        );
        sec.items.push(Item::Charts(charts));
    }
    sec
}

fn cpu(s: &RunSummary) -> Section {
    let mut sec = Section::new("cpu", "CPU");
    sec.text(
        "Host CPU is the busy share of all the host's CPUs over the measured window (from \
         /proc/stat), averaged over hosts. CPU per I/O is the CPU time of every converged \
         (user + system) divided by the client I/Os the volumes served in the same window: \
         the storage stack's cost per I/O.",
    );
    sec.tables(ra_tables(s, "Host CPU", |_, st| {
        st.host_cpu_pct
            .map(fmt::pct)
            .unwrap_or_else(|| "n/a".into())
    }));
    sec.tables(ra_tables(s, "converged CPU per I/O", |_, st| {
        st.cpu_us_per_io
            .map(|v| format!("{} µs", fmt::sig3(v)))
            .unwrap_or_else(|| "no I/O".into())
    }));
    sec.tables(ra_tables(s, "CPU cores used: converged / fio", |_, st| {
        format!(
            "{} / {}",
            fmt::sig3(st.converged_cores),
            fmt::sig3(st.fio_cores)
        )
    }));
    for b in blocks(s) {
        sec.chart(ra_chart(
            s,
            &b,
            "Host CPU by queue depth and read % (converged CPU per I/O as lines)",
            "host CPU %",
            |st| st.host_cpu_pct,
            "µs per I/O",
            Some("µs per I/O"),
            |st| st.cpu_us_per_io,
            f_sig,
            f_sig,
        ));
    }
    sec
}

/// Outstanding drive operations per capacity drive, both tiers together: with a write
/// cache, writes wait in the cache drives' queues (acked from the log) and reach the
/// capacity drives only at destage, which may fall after the window.
fn drive_queue_all_tiers(st: &PointStats) -> f64 {
    let cache = st.cache_ql_mean.unwrap_or(0.0) * st.cache_drives as f64;
    if st.drives > 0 {
        st.drive_ql_mean + cache / st.drives as f64
    } else {
        st.drive_ql_mean
    }
}

/// "capacity X + cache Y" when the run has cache drives, else the capacity queue alone.
fn queue_split(st: &PointStats) -> String {
    match st.cache_ql_mean {
        Some(c) => format!(
            "{} (capacity drives {} each, plus {} cache drives at {} each)",
            fmt::sig3(drive_queue_all_tiers(st)),
            fmt::sig3(st.drive_ql_mean),
            st.cache_drives,
            fmt::sig3(c)
        ),
        None => fmt::sig3(st.drive_ql_mean),
    }
}

/// What the queue lengths say about where I/Os wait.
pub fn wait_analysis(s: &RunSummary) -> Vec<String> {
    let pts: Vec<(&Point, &PointStats)> = s
        .measured()
        .filter(|(_, st)| st.drive_ql_expected > 0.0)
        .collect();
    let Some((p, st)) = pts.iter().max_by(|a, b| {
        (a.1.drive_ql_expected, a.1.iops)
            .partial_cmp(&(b.1.drive_ql_expected, b.1.iops))
            .unwrap_or(std::cmp::Ordering::Equal)
    }) else {
        return vec!["No point measured yet.".into()];
    };
    let ratios: Vec<f64> = pts
        .iter()
        .map(|(_, st)| drive_queue_all_tiers(st) / st.drive_ql_expected)
        .collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(0.0, f64::max);
    let below = ratios.iter().filter(|r| **r < 0.5).count();
    let mut out = vec![format!(
        "Measured drive queue length was {}–{} of the expected across the {} points \
         ({} of them below half of it).",
        fmt::pct(100.0 * lo),
        fmt::pct(100.0 * hi),
        pts.len(),
        below
    )];
    let r = drive_queue_all_tiers(st) / st.drive_ql_expected;
    let verdict = if r < 0.5 {
        "most outstanding I/Os are not in drive queues: they wait above the drives — in \
         the client and its attach path (NBD, or vhost-user-blk for guests), the volume \
         layer (versioning, checksums, replication) and the peer RPC. Faster drives would \
         change little; a leaner software path would."
    } else if r <= 1.5 {
        "the drives hold about the queue the load puts on them: the drives are where I/Os wait."
    } else {
        "drives queue more than the client load alone explains: each write goes to every \
         copy and the journal adds operations, so drive operations outnumber client I/Os."
    };
    out.push(format!(
        "At the heaviest point ({}: {} I/Os outstanding in the fleet, {} per drive expected \
         over {} capacity drives), the drives averaged {} outstanding I/Os per capacity \
         drive (busiest capacity drive {}): {verdict}",
        p.label(),
        p.outstanding(s.config.worker_nodes()),
        fmt::sig3(st.drive_ql_expected),
        st.drives,
        queue_split(st),
        fmt::sig3(st.drive_ql_max),
    ));
    // Writes: the formula counts client I/Os, the drives see one operation per copy (a
    // parity write: one on each chunk of its rows).
    let (copies, whose) = match s.config.settings.resiliency {
        r @ Resiliency::Parity { .. } => (r.copies() as f64, "chunks' drives"),
        r => (r.copies() as f64, "copies' drives"),
    };
    let heaviest_write = pts.iter().filter(|(p, _)| p.write_pct > 0).max_by(|a, b| {
        (a.1.drive_ql_expected, a.0.write_pct)
            .partial_cmp(&(b.1.drive_ql_expected, b.0.write_pct))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    if let Some((p, st)) = heaviest_write.filter(|_| copies > 1.0) {
        let w = f64::from(p.write_pct) / 100.0;
        let fanned = st.drive_ql_expected * ((1.0 - w) + w * copies);
        let held = drive_queue_all_tiers(st);
        out.push(format!(
            "Writes fan out: each client write is one operation on each of {copies} {whose}. At the heaviest write point ({}), the drives held {} outstanding \
             operations per capacity drive against {} expected by the formula, or {} once \
             each write counts {copies} times ({} of that): {}.",
            p.label(),
            queue_split(st),
            fmt::sig3(st.drive_ql_expected),
            fmt::sig3(fanned),
            fmt::pct(100.0 * held / fanned),
            if held < 0.5 * fanned {
                "writes too spend most of their time above the drives"
            } else {
                "the drives are a large part of a write's wait"
            }
        ));
    }
    if st.drive_iops_min == 0.0 && st.drive_iops_max > 0.0 {
        out.push(format!(
            "The load is uneven: at that point some capacity drives served no I/O at all \
             while the busiest held {} outstanding. Reads go to the local copy first, and \
             {} volumes of {} span few slabs of {}: a larger --working-set spreads the load.",
            fmt::sig3(st.drive_ql_max),
            s.config.volumes.len(),
            format_size(s.config.settings.working_set_bytes),
            format_size(s.config.cluster.slab_size_bytes),
        ));
    }
    out
}

fn queues(s: &RunSummary) -> Section {
    let mut sec = Section::new("queues", "Where I/Os wait: drive queue length");
    sec.text(
        "Measured: the time-averaged number of operations outstanding in each capacity \
         drive's engine over the window, averaged over drives. Expected: nodes × workers × QD \
         ÷ drives — the queue each drive would hold if the drives were the only place I/Os \
         wait. Measured below expected means the software stack is where I/Os wait. (A \
         mirrored write is one operation on each copy's drive.)",
    );
    let cached = s.measured().any(|(_, st)| st.cache_ql_mean.is_some());
    if cached {
        sec.text(
            "With cache drives, writes in mode write or read-write are acked from the cache \
             drive's log and reach the capacity drives later, at destage — often after the \
             window, so a write point's capacity queue can be 0 while its writes waited on \
             the cache drives. The cache drives' queue is shown beside it, and the reading \
             below counts both tiers' outstanding operations per capacity drive.",
        );
    }
    for line in wait_analysis(s) {
        sec.text(line);
    }
    sec.tables(ra_tables(
        s,
        "Drive queue length: measured / expected",
        |_, st| {
            format!(
                "{} / {}",
                fmt::sig3(st.drive_ql_mean),
                fmt::sig3(st.drive_ql_expected)
            )
        },
    ));
    for b in blocks(s) {
        let mut c = ra_chart(
            s,
            &b,
            "Measured drive queue length (expected as a line)",
            "outstanding I/Os per drive",
            |st| Some(st.drive_ql_mean),
            "",
            None,
            |_| None,
            f_sig,
            f_sig,
        );
        if let Chart::Grouped(g) = &mut c {
            let pts = block_points(s, &b);
            g.lines = vec![Series {
                name: "expected".into(),
                values: b
                    .qds
                    .iter()
                    .map(|&q| {
                        pts.iter()
                            .find(|(p, _)| p.qd == q)
                            .map(|(_, st)| st.drive_ql_expected)
                    })
                    .collect(),
            }];
        }
        sec.chart(c);
    }
    let mut header = vec![
        "point",
        "drive IOPS",
        "drive write MB/s (mean / max)",
        "queue length",
        "expected",
    ];
    if cached {
        header.push("cache drive queue length");
    }
    let mut t = Table::new(
        "Per-drive load over the capacity drives (min / mean / max)",
        &header,
    );
    for (p, st) in s.measured() {
        let mut row = vec![
            p.label(),
            format!(
                "{} / {} / {}",
                fmt::iops(st.drive_iops_min),
                fmt::iops(st.drive_iops_mean),
                fmt::iops(st.drive_iops_max)
            ),
            format!(
                "{} / {}",
                fmt::sig3(st.drive_write_mb_per_s_mean),
                fmt::sig3(st.drive_write_mb_per_s_max)
            ),
            format!(
                "{} / {} / {}",
                fmt::sig3(st.drive_ql_min),
                fmt::sig3(st.drive_ql_mean),
                fmt::sig3(st.drive_ql_max)
            ),
            fmt::sig3(st.drive_ql_expected),
        ];
        if cached {
            row.push(match (st.cache_ql_min, st.cache_ql_mean, st.cache_ql_max) {
                (Some(lo), Some(m), Some(hi)) => {
                    format!("{} / {} / {}", fmt::sig3(lo), fmt::sig3(m), fmt::sig3(hi))
                }
                _ => crate::table::NOT_MEASURED.into(),
            });
        }
        t.row(row);
    }
    sec.table(t);
    sec
}

fn write_points(s: &RunSummary) -> Vec<(&Point, &PointStats)> {
    s.measured().filter(|(p, _)| p.write_pct > 0).collect()
}

/// The data write amplification a resiliency cannot go below for writes of `bs` bytes
/// (aligned): a mirror writes every block once per copy; a parity-K+M slab writes every
/// row a write touches whole, its K data and M parity blocks (docs/adr/0008).
pub fn wa_floor(r: Resiliency, bs: u64) -> f64 {
    match r {
        Resiliency::Parity { data, parity } => {
            let n = bs.div_ceil(BLOCK_SIZE as u64).max(1);
            let rows = n.div_ceil(u64::from(data));
            (rows * u64::from(data + parity)) as f64 / n as f64
        }
        _ => r.copies() as f64,
    }
}

/// The floor in words, for the WA section.
fn wa_floor_text(s: &RunSummary) -> String {
    let r = s.config.settings.resiliency;
    match r {
        Resiliency::Parity { data, parity } => {
            let floors: Vec<String> = s
                .config
                .settings
                .block_sizes
                .iter()
                .map(|b| format!("{:.2} at {}", wa_floor(r, *b), format_size(*b)))
                .collect();
            format!(
                "{r} writes every row a write touches whole, {data} data and {parity} parity \
                 block{} (docs/adr/0008): a floor of {} for a 4 KiB write, \
                 ({data}+{parity})/{data} = {:.2} for whole rows; this run's floors: {}",
                if parity == 1 { "" } else { "s" },
                data + parity,
                f64::from(data + parity) / f64::from(data),
                floors.join(", ")
            )
        }
        _ => format!(
            "{r} ({} copies) has a floor of {}.0",
            r.copies(),
            r.copies()
        ),
    }
}

fn write_amp(s: &RunSummary) -> Section {
    let mut sec = Section::new("wa", "Write amplification");
    sec.text(format!(
        "Bytes written to drives per byte the workers wrote, by tier. {} The capacity \
         tier counts every byte (data + journal + metadata); its data share alone is what \
         the resiliency costs: {}. The cache tier: {}.",
        wa_basis_text(s),
        wa_floor_text(s),
        if s.config.drives.iter().any(|d| d.role == DriveRole::Cache) {
            format!(
                "cache drives, bytes written to them per byte the workers wrote, in the last \
                 column below (cache mode {})",
                s.config.cluster.cache_mode
            )
        } else {
            format!(
                "none measured — no cache drive is among the run's drives (cache mode {})",
                s.config.cluster.cache_mode
            )
        }
    ));
    let wp = write_points(s);
    if wp.is_empty() {
        sec.text("No point of this run writes: there is no write amplification to report.");
        return sec;
    }
    let mut qds: Vec<u32> = wp.iter().map(|(p, _)| p.qd).collect();
    qds.sort_unstable();
    qds.dedup();
    let mut wps: Vec<u8> = wp.iter().map(|(p, _)| p.write_pct).collect();
    wps.sort_unstable();
    wps.dedup();
    let mut header = vec!["QD".to_string()];
    header.extend(wps.iter().map(|w| format!("write {w} %")));
    let mut t = Table {
        title: "Write amplification, capacity tier: total (data only)".into(),
        header,
        rows: Vec::new(),
    };
    for &q in &qds {
        let mut row = vec![q.to_string()];
        for &w in &wps {
            let cells: Vec<String> = wp
                .iter()
                .filter(|(p, _)| p.qd == q && p.write_pct == w)
                .map(|(_, st)| format!("{} ({})", fmt::ratio(st.wa.total), fmt::ratio(st.wa.data)))
                .collect();
            row.push(if cells.is_empty() {
                crate::table::NOT_MEASURED.into()
            } else {
                cells.join("; ")
            });
        }
        t.row(row);
    }
    sec.table(t);
    let mut b = Table::new(
        "Breakdown per point",
        &[
            "point",
            "written over the point: workers / capacity / cache drives",
            "window: workers write MB/s (volumes / fio)",
            "window: drives write MB/s",
            "total",
            "data",
            "journal",
            "metadata",
            "cache tier",
        ],
    );
    for (p, st) in &wp {
        b.row(vec![
            p.label(),
            point_bytes_cell(&st.wa),
            format!(
                "{} / {}",
                fmt::sig3(st.wa.client_write_mb_per_s),
                fmt::sig3(st.wa.fio_write_mb_per_s)
            ),
            fmt::sig3(st.wa.capacity_write_mb_per_s),
            fmt::ratio(st.wa.total),
            fmt::ratio(st.wa.data),
            fmt::ratio(st.wa.journal),
            fmt::ratio(st.wa.metadata),
            st.wa
                .cache
                .map(|c| format!("{c:.2}"))
                .unwrap_or_else(|| "none".into()),
        ]);
    }
    sec.table(b);
    let totals: Vec<f64> = wp.iter().filter_map(|(_, st)| st.wa.total).collect();
    let datas: Vec<f64> = wp.iter().filter_map(|(_, st)| st.wa.data).collect();
    if !totals.is_empty() {
        let m = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let floors: Vec<f64> = wp
            .iter()
            .map(|(p, _)| wa_floor(s.config.settings.resiliency, p.bs_bytes))
            .collect();
        let floor = m(&floors);
        sec.text(format!(
            "Mean over the write points: total {:.2} ({:+.1} % over the {floor:.1} floor), \
             data only {:.2} ({:+.1} %). {}",
            m(&totals),
            100.0 * (m(&totals) - floor) / floor,
            m(&datas),
            100.0 * (m(&datas) - floor) / floor,
            wa_tier_note(s)
        ));
    }
    sec
}

/// Whether the run's writes went through a cache tier: cache drives in a mode that
/// absorbs writes (`write`, `read-write`, or a mix of modes).
fn cache_absorbs_writes(s: &RunSummary) -> bool {
    let mode = s.config.cluster.cache_mode.as_str();
    !(mode.is_empty() || mode.starts_with("none"))
}

/// How the run's WA was counted: in bytes over whole points (with the caches flushed at
/// both ends), or — runs from before that — in rates over the measured window.
fn wa_basis_text(s: &RunSummary) -> &'static str {
    let old = write_points(s)
        .iter()
        .any(|(_, st)| st.wa.basis == WaBasis::WindowRates);
    if old {
        "This run predates counting WA over whole points: its figures are rates over the \
         measured window (drives' bytes/s ÷ workers' bytes/s), which for the capacity tier \
         behind a write cache follow destage, not the window's writes. Runs made since count \
         bytes over the whole point, caches flushed at both ends."
    } else {
        "WA counts every byte the point's writes cost on the drives, over warm-up + window: \
         every cache is flushed and the counters sampled before the point's workers start, \
         and again after they have all finished, so the destage of what the cache held \
         (flushed at the end of each point) is included and the ratio means the same with \
         or without a cache tier. The workers' bytes are those converge's volumes received \
         in that interval (client writes over NBD, before replication). The window's write \
         rates (volumes, fio, drives) are shown beside it; they are not what WA divides."
    }
}

/// Bytes over the whole point, or why there are none.
fn point_bytes_cell(wa: &WriteAmp) -> String {
    if wa.basis == WaBasis::WindowRates {
        return "not counted (older run: window rates)".into();
    }
    format!(
        "{} / {} / {}",
        format_size(wa.client_write_bytes),
        format_size(wa.capacity_write_bytes),
        wa.cache_write_bytes
            .map_or_else(|| "none".to_string(), format_size)
    )
}

/// What the gap between total and data-only capacity WA is, with or without a cache tier.
fn wa_tier_note(s: &RunSummary) -> String {
    if cache_absorbs_writes(s) {
        format!(
            "With cache drives (cache mode {}), writes are acked once durable in the cache \
             drive's log and destaged to the capacity drives once; the flush at the end of \
             each point destages what the cache still held, so the capacity tier's WA counts \
             every byte of it. It can still sit below the floor: a block written again while \
             its last write is dirty in the cache is destaged once, so a working set small \
             next to what a point writes saves capacity writes (a real saving, not a \
             measurement gap). What the cache tier costs is its own WA, shown separately \
             (last column).",
            s.config.cluster.cache_mode
        )
    } else {
        "The difference is the engine's metadata journal and checkpoints, written to the \
         capacity drives because no cache drive absorbed the writes; with a cache tier \
         (cache mode write or read-write), writes are acked from the cache drive's log and \
         destaged to capacity once, and the cache tier's WA is shown separately."
            .to_string()
    }
}

/// Usable bytes per raw byte of a resiliency: 1 ÷ copies, or K ÷ (K+M).
pub fn usable_per_raw(r: Resiliency) -> f64 {
    1.0 / r.capacity_multiplier()
}

/// What the run's resiliency and data cost in capacity: the density half of density vs
/// performance.
fn capacity(s: &RunSummary) -> Section {
    let mut sec = Section::new("capacity", "Capacity");
    let r = s.config.settings.resiliency;
    let Some(c) = &s.config.capacity else {
        sec.text(format!(
            "{r} keeps {} usable bytes per raw byte in theory. This run has no capacity \
             figures (made before they were recorded, or stopped before its volumes were pre-filled).",
            fmt::sig3(usable_per_raw(r))
        ));
        return sec;
    };
    let opt = |v: Option<f64>| v.map_or_else(|| "unknown".to_string(), |v| format!("{v:.2}"));
    sec.table(kv(
        "Capacity",
        vec![
            (
                "usable per raw byte",
                format!(
                    "{} measured by the pool (usable at {r} ÷ raw), {:.2} in theory \
                     ({} ÷ {}); a volume byte costs {:.2} raw bytes",
                    opt(c.usable_per_raw()),
                    usable_per_raw(r),
                    r.needed(),
                    r.copies(),
                    r.capacity_multiplier()
                ),
            ),
            (
                "pool",
                format!(
                    "{} raw; {} usable at {r} when empty (every copy or chunk of a slab on \
                     its own node)",
                    format_size(c.pool_raw_bytes),
                    format_size(c.pool_usable_bytes)
                ),
            ),
            (
                "the fleet's volumes after pre-fill",
                format!(
                    "{} provisioned, {} allocated, {} written, {} raw used on the drives \
                     ({} raw per written byte)",
                    format_size(c.provisioned_bytes),
                    format_size(c.allocated_bytes),
                    c.written_bytes
                        .map_or_else(|| "unknown".to_string(), format_size),
                    format_size(c.raw_used_bytes),
                    opt(c.raw_per_written())
                ),
            ),
            ("data pattern", s.config.settings.data_pattern()),
            ("saved by compression", compression_text(s)),
        ],
    ));
    sec
}

/// What compression saved the fleet's volumes, in words.
fn compression_text(s: &RunSummary) -> String {
    let codec = s.config.settings.compression;
    let Some(c) = &s.config.capacity else {
        return "-".into();
    };
    if codec.is_none() {
        return format!(
            "{} — the volumes do not compress (--compression none): every block is stored \
             as written",
            format_size(c.compression_saved_bytes)
        );
    }
    match (c.written_bytes, c.stored_bytes) {
        (Some(w), Some(st)) if w > 0 => format!(
            "{} on the drives (every copy) with {codec}: a copy stores {} for {} written \
             ({:.2} : 1)",
            format_size(c.compression_saved_bytes),
            format_size(st),
            format_size(w),
            w as f64 / st.max(1) as f64
        ),
        _ => format!(
            "{} with {codec} (what each copy stores was not reported)",
            format_size(c.compression_saved_bytes)
        ),
    }
}

/// Client write MB/s per node by drive class (`model::warrantable`), one row per write
/// point with a WA.
fn warrantable_table(s: &RunSummary) -> Option<Table> {
    use crate::model::{warrantable, WearBound, DWPD_CLASSES};
    let heads: Vec<String> = DWPD_CLASSES
        .iter()
        .map(|d| format!("{d} DWPD: client MB/s per node"))
        .collect();
    let mut header = vec!["point", "WA (capacity)"];
    header.extend(heads.iter().map(String::as_str));
    let mut t = Table::new("Warrantable client writes by drive class", &header);
    for (p, st) in write_points(s) {
        let Some(total) = st.wa.total else { continue };
        let mut row = vec![p.label(), fmt::sig3(total)];
        for d in DWPD_CLASSES {
            row.push(match warrantable(&s.config, &st.wa, d) {
                Some((r, WearBound::Capacity)) => fmt::sig3(r / 1e6),
                Some((r, WearBound::Cache)) => format!("{} (cache-bound)", fmt::sig3(r / 1e6)),
                None => "-".into(),
            });
        }
        t.row(row);
    }
    (!t.rows.is_empty()).then_some(t)
}

fn endurance(s: &RunSummary) -> Section {
    let mut sec = Section::new("endurance", "Endurance");
    sec.text(
        "Each drive's rating (TBW over its warranty, see the drives table) sustains a write \
         rate of TBW ÷ warranty seconds around the clock, twice that at 12 h of load a day and \
         three times at 8 h. The table compares it with the measured write rate of the drive \
         that wears fastest at each point: the years until its rating is used up if the \
         workload ran that many hours a day, and the drive writes per day (DWPD) a drive \
         would need to last (read-intensive drives are rated ~1 DWPD, mixed-use ~3, \
         write-intensive ~10).",
    );
    if let Some(t) = warrantable_table(s) {
        sec.text(
            "Warrantable throughput: the client writes per node this cluster's drives would \
             sustain for their whole warranty if every one were of the class named (drive \
             writes per day), at each point's measured write amplification (the bytes of \
             the WA table): the capacity drives' daily budget over the capacity tier's WA, \
             and a flash cache tier's over its own, whichever is lower.",
        );
        sec.table(t);
    }
    let wp: Vec<_> = write_points(s)
        .into_iter()
        .filter(|(_, st)| st.endurance.is_some())
        .collect();
    if wp.is_empty() {
        sec.text(if write_points(s).is_empty() {
            "No point of this run writes: reads do not wear drives."
        } else {
            "No drive has an endurance rating (RAM drives): nothing wears."
        });
        return sec;
    }
    let mut t = Table::new(
        "Endurance by duty cycle (drive that wears fastest)",
        &[
            "point",
            "drive write MB/s",
            "sustainable MB/s 24/12/8 h",
            "life at 24 h",
            "life at 12 h",
            "life at 8 h",
            "DWPD needed 24/12/8 h",
            "warranty",
        ],
    );
    for (p, st) in &wp {
        let Some(e) = &st.endurance else { continue };
        let within = |y: Option<f64>| match y {
            Some(y) if y < e.warranty_years => format!("{} (short)", fmt::years(Some(y))),
            other => fmt::years(other),
        };
        t.row(vec![
            p.label(),
            fmt::sig3(e.write_mb_per_s),
            e.sustainable_mb_per_s
                .iter()
                .map(|v| fmt::sig3(*v))
                .collect::<Vec<_>>()
                .join(" / "),
            within(e.years[0]),
            within(e.years[1]),
            within(e.years[2]),
            e.dwpd_needed
                .iter()
                .map(|v| fmt::sig3(*v))
                .collect::<Vec<_>>()
                .join(" / "),
            format!(
                "{} y, {:.1} TB",
                fmt::sig3(e.warranty_years),
                e.tbw_bytes as f64 / 1e12
            ),
        ]);
    }
    sec.table(t);
    if let Some((p, st)) = wp.iter().max_by(|a, b| {
        let w = |x: &PointStats| {
            x.endurance
                .as_ref()
                .map(|e| e.write_mb_per_s)
                .unwrap_or(0.0)
        };
        w(a.1)
            .partial_cmp(&w(b.1))
            .unwrap_or(std::cmp::Ordering::Equal)
    }) {
        if let Some(e) = &st.endurance {
            sec.text(format!(
                "Hardest point: {} writes {} MB/s to drive {:016x} (node {}); 24/7 this wears \
                 it out in {} ({} at 8 h a day) against a {}-year warranty.",
                p.label(),
                fmt::sig3(e.write_mb_per_s),
                e.drive.0,
                e.node,
                fmt::years(e.years[0]),
                fmt::years(e.years[2]),
                fmt::sig3(e.warranty_years),
            ));
        }
    }
    debug_assert_eq!(DUTY_HOURS, [24, 12, 8]);
    sec
}

/// Every drive of one node and every node's CPU, second by second through the run.
fn timeline(s: &RunSummary) -> Option<Section> {
    let tl = s.timeline.as_ref().filter(|t| !t.ticks.is_empty())?;
    let nodes = tl.nodes();
    // The drives of one node: the first that runs workers (its volumes' owner side).
    let node = s
        .config
        .nodes
        .iter()
        .find(|n| n.runs_workers && nodes.contains(&n.id))
        .map(|n| n.id)
        .or_else(|| nodes.first().copied())?;
    let drives = tl.drives_of(node);
    let role = |id: converge_types::DriveId| match s.config.drive(id).map(|d| d.role) {
        Some(DriveRole::Cache) => "cache",
        _ => "capacity",
    };
    let mut sec = Section::new("timeline", "Timeline");
    sec.text(format!(
        "Second by second through the whole run (one tick every {} s), from the same \
         counters as the points' windows: each drive of node {node} — engine operations per \
         second, the mean time an operation was outstanding (Little's law: queue ÷ IOPS) \
         and the queue length — and each node's converged CPU and host CPU. Dashed lines \
         mark where the pre-fill and each point (repeat) began; hover for which. \
         summary.json keeps every node's drives.",
        tl.interval_s
    ));
    let chart = |title: &str, unit: &str, series, f: fn(f64) -> String| {
        Chart::Time(crate::svg::TimeChart {
            title: title.into(),
            unit: unit.into(),
            series,
            marks: tl.marks.clone(),
            fmt: f,
            gap_s: 1.5 * tl.interval_s,
            width: 1100.0,
            height: 260.0,
        })
    };
    let name = |id| format!("drive {id} ({})", role(id));
    sec.items.push(Item::Legend(
        drives
            .iter()
            .enumerate()
            .map(|(i, &id)| (name(id), crate::svg::color(i).to_string()))
            .collect(),
    ));
    type Fig = fn(&crate::timeline::DriveTick) -> Option<f64>;
    type Figure<'a> = (&'a str, &'a str, Fig, fn(f64) -> String);
    let figs: [Figure; 3] = [
        ("IOPS", "IOPS", |d| Some(d.iops), f_iops),
        ("latency", "µs", |d| d.lat_us, f_sig),
        ("queue length", "outstanding", |d| Some(d.queue), f_sig),
    ];
    for (what, unit, f, vf) in figs {
        let series = drives
            .iter()
            .map(|&id| (name(id), tl.drive_series(id, f)))
            .collect();
        sec.chart(chart(
            &format!("Node {node}: each drive's {what}"),
            unit,
            series,
            vf,
        ));
    }
    sec.items.push(Item::Legend(
        nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("node {n}"), crate::svg::color(i).to_string()))
            .collect(),
    ));
    let cores = nodes
        .iter()
        .map(|&n| {
            (
                format!("node {n}"),
                tl.node_series(n, |x| Some(x.converged_cores)),
            )
        })
        .collect();
    sec.chart(chart("converged CPU of each node", "cores", cores, f_sig));
    let host = nodes
        .iter()
        .map(|&n| (format!("node {n}"), tl.node_series(n, |x| x.host_busy_pct)))
        .collect();
    sec.chart(chart(
        "Host CPU busy, as each node sees it (lab nodes share a host)",
        "%",
        host,
        f_sig,
    ));
    Some(sec)
}

/// Where each series' throughput stopped rising as the queue depth grew.
fn saturation(s: &RunSummary) -> Option<Section> {
    let rows = crate::model::saturation(s);
    if rows.is_empty() {
        return None;
    }
    let mut sec = Section::new("saturation", "Saturation");
    let gain = format!("{:.0} %", 100.0 * SATURATION_GAIN);
    sec.text(if s.config.settings.saturate {
        format!(
            "A saturation search: each series ran its queue depths (per worker) in rising \
             order and stopped at the first that added less than {gain} IOPS over the best \
             below it; the knee is the depth before it. Depths past the knee were not run."
        )
    } else {
        format!(
            "The sweep's queue depths were fixed (run with --saturate to search 1 → 64 and \
             stop at the knee). The knee is the depth before the first that added less than \
             {gain} IOPS over the best below it."
        )
    });
    let mut t = Table::new(
        "",
        &[
            "series",
            "IOPS by queue depth",
            "saturated at",
            "IOPS there",
            "mean latency",
            "p99",
        ],
    );
    for r in &rows {
        t.row(vec![
            format!(
                "{}, {} worker{}/node, read {} %",
                format_size(r.bs_bytes),
                r.workers_per_node,
                if r.workers_per_node == 1 { "" } else { "s" },
                100 - r.write_pct
            ),
            r.curve
                .iter()
                .map(|(qd, iops)| format!("{qd}: {}", fmt::iops(*iops)))
                .collect::<Vec<_>>()
                .join(", "),
            match r.knee {
                Some(k) => format!("QD {k}"),
                None => format!(
                    "not by QD {} (still rising)",
                    r.curve.last().map_or(0, |c| c.0)
                ),
            },
            fmt::iops(r.at_iops),
            fmt::lat_opt(r.at_lat_mean_us),
            r.at_p99_us
                .map(|v| fmt::lat_opt(Some(v)))
                .unwrap_or_else(|| "too few I/Os".into()),
        ]);
    }
    sec.table(t);
    Some(sec)
}

/// I/O counted where the volumes saw it and where the drives did it.
fn io_layers(s: &RunSummary) -> Option<Section> {
    let pts: Vec<(&Point, &PointStats, &crate::model::IoLayers)> = s
        .measured()
        .filter_map(|(p, st)| st.io_layers.as_ref().map(|l| (p, st, l)))
        .collect();
    if pts.is_empty() {
        return None;
    }
    let r = s.config.settings.resiliency;
    let fan = crate::model::write_fan_out(r);
    let cache = pts.iter().any(|(_, _, l)| l.cache_read_iops.is_some());
    let mut sec = Section::new("io-layers", "I/O at two layers");
    sec.text(format!(
        "Operations per second over the measured window where the volumes served them \
         (client I/O, before replication) and where the drives did them (engine operations, \
         all drives together). {r} alone needs reads + {} × writes at the drives{}. A ratio \
         above that is the stack's own work (repairs, a cache's destage); below it, I/O \
         {}.",
        fmt::sig3(fan),
        if r.is_parity() {
            " (every chunk of the row a write touches; reads of the row's other chunks \
             come on top)"
        } else {
            ""
        },
        if cache {
            "the cache tier absorbed: a write cache logs each copy once and destages after \
             the window, a read cache serves hits"
        } else {
            "that did not reach the drives in the window"
        }
    ));
    let mut head = vec![
        "point",
        "volume reads/s",
        "volume writes/s",
        "capacity reads/s",
        "capacity writes/s",
    ];
    if cache {
        head.extend(["cache reads/s", "cache writes/s"]);
    }
    head.extend(["drive ops ÷ volume ops", "expected"]);
    let mut t = Table::new("", &head);
    for (p, _, l) in &pts {
        let mut row = vec![
            p.label(),
            fmt::iops(l.volume_read_iops),
            fmt::iops(l.volume_write_iops),
            fmt::iops(l.capacity_read_iops),
            fmt::iops(l.capacity_write_iops),
        ];
        if cache {
            row.push(fmt::iops(l.cache_read_iops.unwrap_or(0.0)));
            row.push(fmt::iops(l.cache_write_iops.unwrap_or(0.0)));
        }
        let v = l.volume_iops();
        row.push(if v > 0.0 {
            format!("{:.2}", l.drive_iops() / v)
        } else {
            "no I/O".into()
        });
        row.push(if v > 0.0 {
            format!("{:.2}", l.expected_drive_iops / v)
        } else {
            "–".into()
        });
        t.row(row);
    }
    sec.table(t);
    Some(sec)
}

fn repeats(s: &RunSummary) -> Option<Section> {
    if s.config.settings.repeat <= 1 {
        return None;
    }
    let mut sec = Section::new("repeats", "Repeatability");
    sec.text("Each point ran several times; the tables show the mean. IOPS across repeats:");
    sec.tables(ra_tables(
        s,
        "IOPS min – max (coefficient of variation)",
        |_, st| {
            format!(
                "{} – {} ({})",
                fmt::iops(st.iops_min),
                fmt::iops(st.iops_max),
                fmt::pct(st.iops_cv_pct)
            )
        },
    ));
    Some(sec)
}

fn notes(s: &RunSummary) -> Option<Section> {
    let errors: i64 = s.measured().map(|(_, st)| st.errors).sum();
    if s.notes.is_empty() && errors == 0 {
        return None;
    }
    let mut sec = Section::new("notes", "Notes");
    if errors != 0 {
        sec.text(format!(
            "fio reported errors (sum of error codes {errors}): see the raw results in raw/."
        ));
    }
    for n in &s.notes {
        sec.text(n.clone());
    }
    Some(sec)
}

pub fn sections(s: &RunSummary) -> Vec<Section> {
    let mut v = vec![configuration(s), headline(s), latency(s), cpu(s), queues(s)];
    v.extend(timeline(s));
    v.extend([write_amp(s), capacity(s), endurance(s)]);
    v.extend(saturation(s));
    v.extend(io_layers(s));
    v.extend(repeats(s));
    v.extend(notes(s));
    v
}

fn title(s: &RunSummary) -> String {
    format!(
        "converge fleet: {} on {} ({} nodes, {})",
        s.config.settings.profile,
        s.config.cluster.name,
        s.config.nodes.len(),
        s.config.settings.resiliency
    )
}

pub fn markdown(s: &RunSummary) -> String {
    let mut o = format!("# {}\n\n{}\n\n", title(s), status_text(s));
    o.push_str("Charts are in `report.html`; every number is in `summary.json` and `summary.csv`, fio's raw output in `raw/`.\n\n");
    o.push_str(&sections_markdown(&sections(s)));
    o
}

/// Sections as Markdown: their texts and tables (charts are in the HTML only).
pub(crate) fn sections_markdown(secs: &[Section]) -> String {
    let mut o = String::new();
    for sec in secs {
        let _ = write!(o, "## {}\n\n", sec.title);
        for it in &sec.items {
            match it {
                Item::Text(t) => {
                    o.push_str(t);
                    o.push_str("\n\n");
                }
                Item::Table(t) => {
                    o.push_str(&t.to_markdown());
                    o.push('\n');
                }
                Item::Chart(_) | Item::Charts(_) | Item::Legend(_) => {}
            }
        }
    }
    o
}

const CSS: &str = "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 16px}\
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:36px}\
table{border-collapse:collapse;margin:12px 0 18px;font-size:13px}caption{text-align:left;font-weight:bold;padding:4px 0;white-space:nowrap}\
.legend span{display:inline-block;margin-right:14px;font-size:12px}.legend i{display:inline-block;width:18px;height:3px;margin-right:5px;vertical-align:middle}\
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right;white-space:nowrap}thead th{background:#f2f4f8;text-align:center}\
tbody th{text-align:left;font-weight:normal;background:#fafafa}p{line-height:1.45;max-width:980px}\
.status{font-weight:bold}.interrupted{color:#b00}.charts{display:flex;flex-wrap:wrap;gap:8px}\
nav a{margin-right:14px}svg{max-width:100%;height:auto}.chart{margin:8px 0}";

pub fn html(s: &RunSummary) -> String {
    html_page(
        &title(s),
        &status_text(s),
        !matches!(s.status, RunStatus::Complete),
        &sections(s),
    )
}

pub fn html_page(title: &str, status: &str, alert: bool, secs: &[Section]) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><link rel=\"icon\" href=\"data:,\"><title>{}</title><style>{CSS}</style></head><body>\n",
        esc(title)
    );
    let _ = write!(
        o,
        "<h1>{}</h1><p class=\"status{}\">{}</p>\n<nav>",
        esc(title),
        if alert { " interrupted" } else { "" },
        esc(status)
    );
    for sec in secs {
        let _ = write!(o, "<a href=\"#{}\">{}</a>", esc(&sec.id), esc(&sec.title));
    }
    o.push_str("</nav>\n");
    for sec in secs {
        let _ = writeln!(
            o,
            "<section id=\"{}\"><h2>{}</h2>",
            esc(&sec.id),
            esc(&sec.title)
        );
        for it in &sec.items {
            match it {
                Item::Text(t) => {
                    let _ = writeln!(o, "<p>{}</p>", esc(t));
                }
                Item::Table(t) => o.push_str(&t.to_html()),
                Item::Chart(c) => {
                    let _ = writeln!(o, "<div class=\"chart\">{}</div>", c.render());
                }
                Item::Legend(keys) => {
                    o.push_str("<div class=\"legend\">");
                    for (name, col) in keys {
                        let _ = write!(
                            o,
                            "<span><i style=\"background:{}\"></i>{}</span>",
                            esc(col),
                            esc(name)
                        );
                    }
                    o.push_str("</div>\n");
                }
                Item::Charts(cs) => {
                    o.push_str("<div class=\"charts\">");
                    for c in cs {
                        o.push_str(&c.render());
                    }
                    o.push_str("</div>\n");
                }
            }
        }
        o.push_str("</section>\n");
    }
    o.push_str("</body></html>\n");
    o
}

/// A byte count of the whole point; empty for runs that did not count them.
fn bytes_opt(basis: WaBasis, v: u64) -> String {
    match basis {
        WaBasis::PointBytes => v.to_string(),
        WaBasis::WindowRates => String::new(),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.3}")).unwrap_or_default()
}

/// One row per measured point; empty cells where a value does not apply.
pub fn csv(s: &RunSummary) -> String {
    let mut header: Vec<String> = [
        "point",
        "profile",
        "bs_bytes",
        "workers_per_node",
        "qd",
        "read_pct",
        "write_pct",
        "random_pct",
        "outstanding",
        "repeats",
        "iops",
        "iops_min",
        "iops_max",
        "iops_cv_pct",
        "read_iops",
        "write_iops",
        "mb_per_s",
        "read_mb_per_s",
        "write_mb_per_s",
        "lat_mean_us",
        "read_lat_mean_us",
        "write_lat_mean_us",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for d in ["read", "write", "all"] {
        for p in PERCENTILES {
            header.push(format!("{d}_p{}_us", p.to_string().replace('.', "_")));
        }
    }
    header.extend(
        [
            "host_cpu_pct",
            "hosts",
            "converged_cores",
            "cpu_us_per_io",
            "fio_cores",
            "drives",
            "drive_iops_mean",
            "drive_iops_min",
            "drive_iops_max",
            "drive_write_mb_per_s_mean",
            "drive_write_mb_per_s_max",
            "drive_ql_mean",
            "drive_ql_min",
            "drive_ql_max",
            "drive_ql_expected",
            "cache_ql_mean",
            "client_write_mb_per_s",
            "fio_write_mb_per_s",
            "capacity_write_mb_per_s",
            "wa_total",
            "wa_data",
            "wa_journal",
            "wa_metadata",
            "wa_cache",
            "wa_basis",
            "point_client_write_bytes",
            "point_capacity_write_bytes",
            "point_cache_write_bytes",
            "endurance_drive",
            "endurance_write_mb_per_s",
            "endurance_years_24h",
            "endurance_years_12h",
            "endurance_years_8h",
            "dwpd_needed_24h",
            "dwpd_needed_12h",
            "dwpd_needed_8h",
            "errors",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let mut o = header.join(",") + "\n";
    let n = s.config.worker_nodes();
    for (p, st) in s.measured() {
        let mut r: Vec<String> = vec![
            p.slug(),
            s.config.settings.profile.to_string(),
            p.bs_bytes.to_string(),
            p.workers_per_node.to_string(),
            p.qd.to_string(),
            p.read_pct().to_string(),
            p.write_pct.to_string(),
            p.random_pct.to_string(),
            p.outstanding(n).to_string(),
            st.repeats.to_string(),
            format!("{:.1}", st.iops),
            format!("{:.1}", st.iops_min),
            format!("{:.1}", st.iops_max),
            format!("{:.2}", st.iops_cv_pct),
            format!("{:.1}", st.read_iops),
            format!("{:.1}", st.write_iops),
            format!("{:.3}", st.mb_per_s),
            format!("{:.3}", st.read_mb_per_s),
            format!("{:.3}", st.write_mb_per_s),
            opt(st.lat_mean_us),
            opt(st.read_lat_mean_us),
            opt(st.write_lat_mean_us),
        ];
        for v in [&st.read_pct_us, &st.write_pct_us, &st.all_pct_us] {
            r.extend(v.iter().map(|x| opt(*x)));
        }
        let e = st.endurance.as_ref();
        r.extend([
            opt(st.host_cpu_pct),
            st.hosts.to_string(),
            format!("{:.4}", st.converged_cores),
            opt(st.cpu_us_per_io),
            format!("{:.4}", st.fio_cores),
            st.drives.to_string(),
            format!("{:.1}", st.drive_iops_mean),
            format!("{:.1}", st.drive_iops_min),
            format!("{:.1}", st.drive_iops_max),
            format!("{:.4}", st.drive_write_mb_per_s_mean),
            format!("{:.4}", st.drive_write_mb_per_s_max),
            format!("{:.4}", st.drive_ql_mean),
            format!("{:.4}", st.drive_ql_min),
            format!("{:.4}", st.drive_ql_max),
            format!("{:.4}", st.drive_ql_expected),
            st.cache_ql_mean
                .map(|q| format!("{q:.4}"))
                .unwrap_or_default(),
            format!("{:.4}", st.wa.client_write_mb_per_s),
            format!("{:.4}", st.wa.fio_write_mb_per_s),
            format!("{:.4}", st.wa.capacity_write_mb_per_s),
            opt(st.wa.total),
            opt(st.wa.data),
            opt(st.wa.journal),
            opt(st.wa.metadata),
            opt(st.wa.cache),
            match st.wa.basis {
                WaBasis::PointBytes => "point-bytes".into(),
                WaBasis::WindowRates => "window-rates".into(),
            },
            bytes_opt(st.wa.basis, st.wa.client_write_bytes),
            bytes_opt(st.wa.basis, st.wa.capacity_write_bytes),
            st.wa
                .cache_write_bytes
                .map(|b| b.to_string())
                .unwrap_or_default(),
            e.map(|e| format!("{:016x}", e.drive.0)).unwrap_or_default(),
            opt(e.map(|e| e.write_mb_per_s)),
            opt(e.and_then(|e| e.years[0])),
            opt(e.and_then(|e| e.years[1])),
            opt(e.and_then(|e| e.years[2])),
            opt(e.map(|e| e.dwpd_needed[0])),
            opt(e.map(|e| e.dwpd_needed[1])),
            opt(e.map(|e| e.dwpd_needed[2])),
            st.errors.to_string(),
        ]);
        o.push_str(&r.join(","));
        o.push('\n');
    }
    o
}

/// The terminal's view: IOPS (or MB/s), mean and 99.9th percentile latency in the RA layout.
pub fn headline_text(s: &RunSummary) -> String {
    let mut o = String::new();
    let first = if s.throughput_first() {
        ra_tables(s, "MB/s", |_, st| fmt::sig3(st.mb_per_s))
    } else {
        ra_tables(s, "IOPS", |_, st| fmt::iops(st.iops))
    };
    let cell = |_: &Point, st: &PointStats| {
        format!(
            "{} / {}",
            fmt::lat_opt(st.lat_mean_us),
            fmt::tail(
                st.all_pct_us.get(3).copied().flatten(),
                st.read_samples + st.write_samples
            )
        )
    };
    for t in first
        .into_iter()
        .chain(ra_tables(s, "Latency: mean / 99.9th percentile", cell))
    {
        o.push_str(&t.to_text());
        o.push('\n');
    }
    o
}

/// Every table of the report (for checks that they are filled).
pub fn all_tables(s: &RunSummary) -> Vec<Table> {
    sections(s)
        .into_iter()
        .flat_map(|sec| sec.items)
        .filter_map(|it| match it {
            Item::Table(t) => Some(t),
            _ => None,
        })
        .collect()
}

/// Write `summary.json`, `summary.csv`, `report.md` and `report.html` into `dir`.
pub fn write_all(dir: &Path, s: &RunSummary) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(s).map_err(std::io::Error::other)?;
    write_atomic(&dir.join("summary.json"), &json)?;
    write_atomic(&dir.join("summary.csv"), csv(s).as_bytes())?;
    write_atomic(&dir.join("report.md"), markdown(s).as_bytes())?;
    write_atomic(&dir.join("report.html"), html(s).as_bytes())?;
    Ok(())
}

/// Write through a temporary file and rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Read a run's `summary.json` (from its directory or the file itself) and derive its
/// statistics again.
pub fn load(path: &Path) -> Result<RunSummary, String> {
    let file = if path.is_dir() {
        path.join("summary.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| {
        format!(
            "cannot read {}: {e} (a fleet run directory holds summary.json)",
            file.display()
        )
    })?;
    let mut s: RunSummary = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a fleet summary: {e}", file.display()))?;
    if s.config.format_version > crate::model::FORMAT_VERSION {
        return Err(format!(
            "{} has format {} but this converge reads up to {}: use a newer converge",
            file.display(),
            s.config.format_version,
            crate::model::FORMAT_VERSION
        ));
    }
    s.restat();
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{config, repeat};
    use crate::model::PointRecord;
    use crate::profile::points;

    #[test]
    fn the_timeline_charts_one_nodes_drives_and_every_nodes_cpu() {
        use crate::timeline::{DriveTick, NodeTick, Tick, Timeline};
        let cfg = config(vec![100], vec![1]);
        let mut sum = crate::model::tests::summary_at(&cfg, &[100.0]);
        assert!(
            !markdown(&sum).contains("## Timeline"),
            "no timeline, no section"
        );
        let mut tl = Timeline::new();
        tl.mark(0.0, "pre-fill");
        tl.mark(2.0, "4 KiB, 1 worker/node, QD 1, read 0 %");
        for i in 1..=5 {
            tl.push(Tick {
                t_s: f64::from(i),
                nodes: (1..=4)
                    .map(|n| NodeTick {
                        node: n,
                        converged_cores: 0.5,
                        host_busy_pct: Some(80.0),
                    })
                    .collect(),
                drives: cfg
                    .drives
                    .iter()
                    .map(|d| DriveTick {
                        node: d.node,
                        id: d.id,
                        iops: 100.0 * f64::from(i),
                        lat_us: Some(50.0),
                        queue: 0.5,
                    })
                    .collect(),
            });
        }
        sum.timeline = Some(tl);
        let md = markdown(&sum);
        assert!(
            md.contains("## Timeline") && md.contains("each drive of node 1"),
            "{md}"
        );
        let page = html(&sum);
        for c in [
            "Node 1: each drive&#39;s IOPS",
            "Node 1: each drive&#39;s latency",
        ] {
            assert!(page.contains(c), "{c}");
        }
        assert!(page.contains("Node 1: each drive&#39;s queue length"));
        assert!(page.contains("converged CPU of each node"));
        // Node 1's two drives in the legend, not the other nodes'.
        let sec = sections(&sum)
            .into_iter()
            .find(|s| s.id == "timeline")
            .unwrap();
        let Item::Legend(keys) = &sec.items[1] else {
            panic!("a legend first")
        };
        assert_eq!(keys.len(), 2, "{keys:?}");
    }

    #[test]
    fn a_saturation_search_and_the_two_layers_are_reported() {
        let mut cfg = config(vec![100], vec![1, 2, 4]);
        cfg.settings.saturate = true;
        let mut sum = crate::model::tests::summary_at(&cfg, &[100.0, 200.0, 205.0]);
        for p in &mut sum.points {
            for r in &mut p.repeats {
                for n in &mut r.nodes {
                    n.volume_write_ops = 1000;
                    n.volume_ops = 1000;
                }
            }
        }
        sum.restat();
        let md = markdown(&sum);
        assert!(md.contains("## Saturation"), "{md}");
        assert!(md.contains("A saturation search"), "{md}");
        assert!(md.contains("| QD 2 |"), "{md}");
        assert!(md.contains("## I/O at two layers"), "{md}");
        assert!(md.contains("| 3.00 |"), "mirror-3's expected ratio: {md}");
        // Fixed depths still show the knee, and say how to search.
        cfg.settings.saturate = false;
        let sum = crate::model::tests::summary_at(&cfg, &[100.0, 200.0, 400.0]);
        let md = markdown(&sum);
        assert!(md.contains("run with --saturate"), "{md}");
        assert!(md.contains("not by QD 4 (still rising)"), "{md}");
        assert!(
            !md.contains("## I/O at two layers"),
            "no counts by direction: {md}"
        );
    }

    pub fn summary(write: Vec<u64>, qd: Vec<u64>) -> RunSummary {
        let cfg = config(write, qd);
        let ps = points(&cfg.settings);
        let mut s = RunSummary {
            config: cfg.clone(),
            status: RunStatus::Complete,
            wall_s: 100.0,
            points_planned: ps.len(),
            points: ps
                .iter()
                .map(|p| PointRecord {
                    point: p.clone(),
                    repeats: vec![repeat(&cfg, p, 1000.0 * f64::from(p.qd), 3.0, 0.6)],
                    stats: None,
                })
                .collect(),
            notes: vec![],
            timeline: None,
        };
        s.restat();
        s
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
    }

    #[test]
    fn every_table_is_filled_and_html_is_self_contained() {
        let s = summary(vec![0, 10, 30, 100], vec![1, 2, 4, 8]);
        for t in all_tables(&s) {
            assert_eq!(t.empty_cells(), 0, "{}", t.to_text());
            for r in &t.rows {
                assert!(
                    !r.iter().any(|c| c == crate::table::NOT_MEASURED),
                    "{}",
                    t.to_text()
                );
            }
        }
        let h = html(&s);
        assert!(h.starts_with("<!DOCTYPE html>"));
        assert!(!h.contains("<script"), "no scripts");
        assert!(
            !h.contains("http://") || !h.contains("src=\"http"),
            "no external assets"
        );
        assert!(!h.contains("NaN"));
        // IOPS, tail, CPU, queue charts + 16 per-point curve charts.
        assert_eq!(h.matches("<svg").count(), 4 + 16);
        let md = markdown(&s);
        assert!(md.contains("| QD | read 100 % | read 90 % | read 70 % | read 0 % |"));
        assert!(md.contains("## Write amplification"));
        assert!(md.contains("## Endurance"));
        let c = csv(&s);
        assert_eq!(c.lines().count(), 17);
        let cols = c.lines().next().unwrap().split(',').count();
        assert!(c.lines().all(|l| l.split(',').count() == cols));
    }

    #[test]
    fn interrupted_runs_say_so_and_mark_missing_points() {
        let mut s = summary(vec![0, 100], vec![1, 2]);
        s.points.truncate(3);
        s.status = RunStatus::Interrupted("Ctrl-C".into());
        let md = markdown(&s);
        assert!(
            md.contains("INTERRUPTED (Ctrl-C): 3 of 4 points measured"),
            "{md}"
        );
        assert!(md.contains(crate::table::NOT_MEASURED));
        assert!(headline_text(&s).contains("IOPS"));
    }

    #[test]
    fn wa_text_says_what_the_cache_tier_does() {
        let mut s = summary(vec![100], vec![1]);
        s.config.cluster.cache_mode = "none (no cache drives)".into();
        let md = markdown(&s);
        assert!(md.contains("no cache drive absorbed the writes"), "{md}");
        assert!(!md.contains("will move"), "{md}");
        s.config.cluster.cache_mode = "write (4 cache drives, 256 MiB each, bound 1:1)".into();
        let md = markdown(&s);
        assert!(
            md.contains("With cache drives (cache mode write (4 cache drives"),
            "{md}"
        );
        assert!(md.contains("destaged to the capacity drives once"), "{md}");
        assert!(md.contains("shown separately"), "{md}");
        assert!(
            md.contains("the flush at the end of each point destages"),
            "{md}"
        );
        // Cache drives in mode none absorb nothing.
        s.config.cluster.cache_mode = "none (4 cache drives, 256 MiB each, bound 1:1)".into();
        assert!(markdown(&s).contains("no cache drive absorbed the writes"));
    }

    #[test]
    fn wa_floors_follow_copies_or_rows() {
        let p = |k, m| Resiliency::Parity { data: k, parity: m };
        assert_eq!(wa_floor(Resiliency::Mirror3, 4096), 3.0);
        assert_eq!(wa_floor(Resiliency::Mirror2, 128 << 10), 2.0);
        // Whole rows: a 4 KiB write costs K+M blocks, 8 KiB on 4+2 one row of 6 for 2.
        assert_eq!(wa_floor(p(2, 1), 4096), 3.0);
        assert_eq!(wa_floor(p(2, 1), 128 << 10), 1.5);
        assert_eq!(wa_floor(p(4, 2), 4096), 6.0);
        assert_eq!(wa_floor(p(4, 2), 8192), 3.0);
        assert_eq!(wa_floor(p(4, 2), 128 << 10), 1.5);
        assert!((usable_per_raw(p(4, 2)) - 2.0 / 3.0).abs() < 1e-12);
        assert!((usable_per_raw(Resiliency::Mirror3) - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn wa_text_says_how_it_was_counted() {
        let mut s = summary(vec![100], vec![1]);
        let md = markdown(&s);
        assert!(
            md.contains(
                "WA counts every byte the point's writes cost on the drives, over warm-up + window"
            ),
            "{md}"
        );
        assert!(md.contains("flushed at the end of each point"), "{md}");
        assert!(!md.contains("predates"), "{md}");
        assert!(!md.contains("not counted (older run"), "{md}");
        // Bytes over the point, per tier, in the breakdown and the CSV.
        let st = s.points[0].stats.clone().unwrap();
        assert!(md.contains(&format!(
            "| {} / {} / none |",
            format_size(st.wa.client_write_bytes),
            format_size(st.wa.capacity_write_bytes)
        )));
        let c = csv(&s);
        assert!(c.lines().next().unwrap().contains(",wa_basis,"), "{c}");
        assert!(c.contains(",point-bytes,"), "{c}");
        // A run from before: its WA came from the window's rates, and the report says so.
        for p in &mut s.points {
            for r in &mut p.repeats {
                r.point_bytes = None;
            }
        }
        s.restat();
        let md = markdown(&s);
        assert!(
            md.contains("This run predates counting WA over whole points"),
            "{md}"
        );
        assert!(md.contains("not counted (older run: window rates)"), "{md}");
        assert!(csv(&s).contains(",window-rates,,,"));
    }

    #[test]
    fn queue_analysis_names_the_software_stack() {
        let s = summary(vec![0], vec![8]);
        let w = wait_analysis(&s).join(" ");
        // 4 × 1 × 8 / 8 drives = 4 expected vs 0.5 measured.
        assert!(w.contains("wait above the drives"), "{w}");
        assert!(w.contains("12.5 %"), "{w}");
        assert!(!w.contains("fan out"), "no write point: {w}");
        // A write point: mirror-3 puts 3 operations on the drives per client write.
        let s = summary(vec![100], vec![8]);
        let w = wait_analysis(&s).join(" ");
        assert!(
            w.contains("or 12.0 once each write counts 3 times (4.2 % of that)"),
            "{w}"
        );
        assert!(
            w.contains("writes too spend most of their time above the drives"),
            "{w}"
        );
    }
}
