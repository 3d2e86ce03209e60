//! `converge fleet report A B ...`: runs side by side — cache modes, working sets,
//! resiliencies, node counts — with the % change of each against the first. Points are
//! matched by what defines them (block size, workers per node, QD, write %).

use crate::format as fmt;
use crate::model::{PointStats, RunSummary};
use crate::profile::{Point, PointKey};
use crate::report::{html_page, Item, Section};
use crate::svg::{Chart, GroupedChart, Series};
use crate::table::{Table, NOT_MEASURED};
use converge_types::format_size;

/// A run and the name it goes by in the comparison.
pub struct Run {
    pub label: String,
    pub source: String,
    pub summary: RunSummary,
}

type Attr = (&'static str, fn(&RunSummary) -> String);

/// What may differ between runs, in the order labels name it.
const ATTRS: [Attr; 12] = [
    ("profile", |s| s.config.settings.profile.to_string()),
    ("resiliency", |s| s.config.settings.resiliency.to_string()),
    ("compression", |s| {
        format!("compression {}", s.config.settings.compression)
    }),
    ("encryption", |s| {
        if s.config.settings.encrypt {
            "encrypted".into()
        } else {
            "not encrypted".into()
        }
    }),
    ("data", |s| s.config.settings.data_pattern()),
    ("cache", |s| s.config.cluster.cache_mode.clone()),
    ("working set", |s| {
        format_size(s.config.settings.working_set_bytes)
    }),
    ("nodes", |s| format!("{} nodes", s.config.worker_nodes())),
    ("drives", |s| {
        format!("{} drives", s.config.capacity_drives())
    }),
    ("workers", |s| {
        let w: Vec<String> = s
            .config
            .settings
            .workers_per_node
            .iter()
            .map(|w| w.to_string())
            .collect();
        format!("{}/node", w.join(","))
    }),
    ("duration", |s| {
        format!("{} s", s.config.settings.duration_s)
    }),
    ("converged", |s| s.config.converged_version()),
];

/// Labels from what differs between the runs; the source names runs alike in all of it.
pub fn labels(runs: &[(String, RunSummary)]) -> Vec<String> {
    let differing: Vec<&Attr> = ATTRS
        .iter()
        .filter(|(_, f)| {
            let first = runs.first().map(|(_, s)| f(s));
            runs.iter().any(|(_, s)| Some(f(s)) != first)
        })
        .collect();
    let mut out: Vec<String> = runs
        .iter()
        .map(|(src, s)| {
            if differing.is_empty() {
                src.clone()
            } else {
                differing
                    .iter()
                    .map(|(name, f)| match *name {
                        "working set" => format!("ws {}", f(s)),
                        _ => f(s),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        })
        .collect();
    // Runs alike in every attribute: number them.
    for i in 0..out.len() {
        if out.iter().filter(|l| **l == out[i]).count() > 1 {
            let base = out[i].clone();
            for (k, l) in (1..).zip(out.iter_mut().filter(|l| **l == base)) {
                *l = format!("{base} #{k}");
            }
        }
    }
    out
}

fn keys(runs: &[Run]) -> Vec<(PointKey, Point)> {
    let mut out: Vec<(PointKey, Point)> = Vec::new();
    for r in runs {
        for (p, _) in r.summary.measured() {
            if !out.iter().any(|(k, _)| *k == p.key()) {
                out.push((p.key(), p.clone()));
            }
        }
    }
    out
}

fn stat<'a>(r: &'a Run, k: &PointKey) -> Option<&'a PointStats> {
    r.summary
        .measured()
        .find(|(p, _)| p.key() == *k)
        .map(|(_, s)| s)
}

type Metric = (
    &'static str,
    fn(&PointStats) -> Option<f64>,
    fn(f64) -> String,
);

const METRICS: [Metric; 10] = [
    ("IOPS", |s| Some(s.iops), fmt::iops),
    ("MB/s", |s| Some(s.mb_per_s), fmt::sig3),
    ("Mean latency", |s| s.lat_mean_us, fmt::lat_us),
    (
        "99.9th percentile latency",
        |s| s.all_pct_us.get(3).copied().flatten(),
        fmt::lat_us,
    ),
    ("Host CPU %", |s| s.host_cpu_pct, fmt::sig3),
    ("converged CPU µs per I/O", |s| s.cpu_us_per_io, fmt::sig3),
    ("Drive queue length", |s| Some(s.drive_ql_mean), fmt::sig3),
    ("Cache drive queue length", |s| s.cache_ql_mean, fmt::sig3),
    (
        "Write amplification (total)",
        |s| s.wa.total,
        |v| format!("{v:.2}"),
    ),
    (
        "Write amplification (data)",
        |s| s.wa.data,
        |v| format!("{v:.2}"),
    ),
];

fn point_label(p: &Point, many_blocks: bool) -> String {
    if many_blocks {
        p.label()
    } else {
        format!("QD {}, read {} %", p.qd, p.read_pct())
    }
}

pub fn sections(runs: &[Run]) -> Vec<Section> {
    let mut out = Vec::new();
    let mut sec = Section {
        id: "runs".into(),
        title: "Runs".into(),
        items: Vec::new(),
    };
    let mut t = Table::new(
        "",
        &[
            "run",
            "directory",
            "profile",
            "resiliency",
            "cache",
            "working set",
            "workers/node",
            "nodes",
            "drives",
            "per point",
            "started",
            "status",
        ],
    );
    for r in runs {
        let s = &r.summary;
        let st = &s.config.settings;
        t.row(vec![
            r.label.clone(),
            r.source.clone(),
            st.profile.to_string(),
            st.resiliency.to_string(),
            s.config.cluster.cache_mode.clone(),
            format_size(st.working_set_bytes),
            st.workers_per_node
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(","),
            s.config.worker_nodes().to_string(),
            s.config.capacity_drives().to_string(),
            format!("{} s + {} s x{}", st.warmup_s, st.duration_s, st.repeat),
            crate::report::utc(s.config.started_unix),
            format!("{} of {} points", s.measured().count(), s.points_planned),
        ]);
    }
    sec.items.push(Item::Table(t));
    sec.items.push(Item::Text(format!(
        "Each cell is a run's value and its change against the first run ({}). Points are \
         matched by block size, workers per node, QD and write %; {NOT_MEASURED} marks a \
         point a run did not measure.",
        runs.first().map(|r| r.label.as_str()).unwrap_or("")
    )));
    out.push(sec);
    out.push(density(runs));
    let ks = keys(runs);
    let many = {
        let mut b: Vec<(u64, u32)> = ks
            .iter()
            .map(|(k, _)| (k.bs_bytes, k.workers_per_node))
            .collect();
        b.sort_unstable();
        b.dedup();
        b.len() > 1
    };
    let mut msec = Section {
        id: "metrics".into(),
        title: "Side by side".into(),
        items: Vec::new(),
    };
    for (name, f, show) in METRICS {
        let mut header = vec!["point".to_string()];
        header.extend(runs.iter().map(|r| r.label.clone()));
        let mut t = Table {
            title: name.to_string(),
            header,
            rows: Vec::new(),
        };
        let mut any = false;
        for (k, p) in &ks {
            let base = runs.first().and_then(|r| stat(r, k)).and_then(f);
            let mut row = vec![point_label(p, many)];
            for (i, r) in runs.iter().enumerate() {
                let v = stat(r, k).and_then(f);
                any |= v.is_some();
                row.push(match (v, base) {
                    (None, _) => NOT_MEASURED.to_string(),
                    (Some(v), Some(b)) if i > 0 => format!("{} ({})", show(v), fmt::change(b, v)),
                    (Some(v), _) => show(v),
                });
            }
            t.row(row);
        }
        if any {
            msec.items.push(Item::Table(t));
        }
    }
    let chart =
        |title: &str, unit: &str, f: fn(&PointStats) -> Option<f64>, fm: fn(f64) -> String| {
            Chart::Grouped(GroupedChart {
                title: title.into(),
                x_label: "point".into(),
                groups: ks.iter().map(|(_, p)| point_label(p, many)).collect(),
                bars: runs
                    .iter()
                    .map(|r| Series {
                        name: r.label.clone(),
                        values: ks.iter().map(|(k, _)| stat(r, k).and_then(f)).collect(),
                    })
                    .collect(),
                bar_unit: unit.into(),
                lines: Vec::new(),
                line_unit: None,
                fmt: fm,
                line_fmt: fm,
            })
        };
    msec.items.push(Item::Chart(chart(
        "IOPS by run",
        "IOPS",
        |s| Some(s.iops),
        fmt::iops,
    )));
    msec.items.push(Item::Chart(chart(
        "Mean latency by run",
        "ms",
        |s| s.lat_mean_us.map(|u| u / 1000.0),
        fmt::sig3,
    )));
    out.push(msec);
    out
}

/// Mean of `f` over a run's measured points (a point where it is `None` does not count).
fn mean_of(r: &Run, f: impl Fn(&Point, &PointStats) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = r.summary.measured().filter_map(|(p, s)| f(p, s)).collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Density vs performance, one row per run: what each resiliency (and data pattern) keeps
/// of the raw capacity beside what it costs in IOPS, latency, CPU and write amplification
/// — the table vendors publish for their storage policies.
fn density(runs: &[Run]) -> Section {
    let mut t = Table::new(
        "Density vs performance",
        &[
            "run",
            "resiliency",
            "data",
            "usable / raw",
            "raw per written byte",
            "read IOPS",
            "write IOPS",
            "mean latency",
            "CPU µs per I/O",
            "WA total (floor)",
        ],
    );
    let opt = |v: Option<f64>, f: fn(f64) -> String| v.map_or(NOT_MEASURED.to_string(), f);
    for r in runs {
        let st = &r.summary.config.settings;
        let cap = r.summary.config.capacity.as_ref();
        let floor = mean_of(r, |p, _| {
            (p.write_pct > 0).then(|| crate::report::wa_floor(st.resiliency, p.bs_bytes))
        });
        t.row(vec![
            r.label.clone(),
            if st.compression.is_none() {
                st.resiliency.to_string()
            } else {
                format!("{} + {}", st.resiliency, st.compression)
            },
            st.data_pattern(),
            format!(
                "{} ({:.2} in theory)",
                opt(cap.and_then(|c| c.usable_per_raw()), |v| format!("{v:.2}")),
                crate::report::usable_per_raw(st.resiliency)
            ),
            opt(cap.and_then(|c| c.raw_per_written()), |v| format!("{v:.2}")),
            opt(
                mean_of(r, |p, s| (p.write_pct == 0).then_some(s.iops)),
                fmt::iops,
            ),
            opt(
                mean_of(r, |p, s| (p.write_pct == 100).then_some(s.iops)),
                fmt::iops,
            ),
            opt(mean_of(r, |_, s| s.lat_mean_us), fmt::lat_us),
            opt(mean_of(r, |_, s| s.cpu_us_per_io), fmt::sig3),
            format!(
                "{} ({})",
                opt(
                    mean_of(r, |p, s| s.wa.total.filter(|_| p.write_pct > 0)),
                    |v| format!("{v:.2}")
                ),
                opt(floor, |v| format!("{v:.2}"))
            ),
        ]);
    }
    Section {
        id: "density".into(),
        title: "Density vs performance".into(),
        items: vec![
            Item::Table(t),
            Item::Text(
                "Usable / raw: what the pool holds at the run's resiliency when empty, over \
                 its raw bytes (measured by the cluster; in theory 1 ÷ copies, or K ÷ (K+M)). \
                 Raw per written byte: the drives' bytes the fleet's volumes took after \
                 pre-fill over the bytes they hold (whole slabs for plain volumes, what the \
                 copies store for compressed ones). Read and write IOPS: means over the \
                 read-only and write-only points; latency, CPU and WA: means over all \
                 points (WA: over the write points, with the mean data floor of the \
                 resiliency at those points' block sizes; a compressed volume writes less \
                 than the floor when its data compresses, and a 4 KiB write into a \
                 compressed group rewrites the group). Compression saves only what the data \
                 pattern lets it: random bytes (fio's default) do not compress."
                    .into(),
            ),
        ],
    }
}

pub fn title(runs: &[Run]) -> String {
    format!(
        "converge fleet: {} runs compared ({})",
        runs.len(),
        runs.iter()
            .map(|r| r.label.as_str())
            .collect::<Vec<_>>()
            .join(" vs ")
    )
}

pub fn markdown(runs: &[Run]) -> String {
    let mut o = format!("# {}\n\n", title(runs));
    o.push_str(&crate::report::sections_markdown(&sections(runs)));
    o
}

pub fn html(runs: &[Run]) -> String {
    html_page(&title(runs), "", false, &sections(runs))
}

/// Terminal view: IOPS and mean latency side by side.
pub fn text(runs: &[Run]) -> String {
    let mut o = String::new();
    for sec in sections(runs) {
        for it in sec.items {
            if let Item::Table(t) = it {
                if t.title.is_empty() || t.title == "IOPS" || t.title == "Mean latency" {
                    o.push_str(&t.to_text());
                    o.push('\n');
                }
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{config, summary_from};
    use converge_types::Resiliency;

    fn run(res: Resiliency, iops: f64) -> RunSummary {
        let mut cfg = config(vec![0, 100], vec![1, 4]);
        cfg.settings.resiliency = res;
        summary_from(&cfg, usize::MAX, |_, _| iops)
    }

    #[test]
    fn labels_name_what_differs() {
        let a = run(Resiliency::Mirror3, 1000.0);
        let b = run(Resiliency::Mirror2, 1000.0);
        let l = labels(&[("a".into(), a.clone()), ("b".into(), b)]);
        assert_eq!(l, vec!["mirror-3", "mirror-2"]);
        let l = labels(&[("x/run1".into(), a.clone()), ("y/run2".into(), a.clone())]);
        assert_eq!(l, vec!["x/run1", "y/run2"]);
        let l = labels(&[("same".into(), a.clone()), ("same".into(), a)]);
        assert_eq!(l, vec!["same #1", "same #2"]);
    }

    #[test]
    fn side_by_side_with_percent_change() {
        let runs = vec![
            Run {
                label: "mirror-3".into(),
                source: "a".into(),
                summary: run(Resiliency::Mirror3, 1000.0),
            },
            Run {
                label: "mirror-2".into(),
                source: "b".into(),
                summary: run(Resiliency::Mirror2, 1250.0),
            },
        ];
        let md = markdown(&runs);
        assert!(md.contains("| point | mirror-3 | mirror-2 |"), "{md}");
        // 4 workers × 1000 vs × 1250: +25 %.
        assert!(
            md.contains("| QD 1, read 100 % | 4,000 | 5,000 (+25.0 %) |"),
            "{md}"
        );
        let h = html(&runs);
        assert_eq!(h.matches("<svg").count(), 2);
        assert!(text(&runs).contains("+25.0 %"));
    }
}
