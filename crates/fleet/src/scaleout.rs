//! The scale-out study (docs/FLEET.md, "Scale-out"): the same per-node load — the same
//! workers per node, queue depth, block size and read/write mix — on N nodes, then on 2N,
//! every copy of the N-node run's volumes on those N nodes. Per workload it reports the
//! factor (IOPS on 2N ÷ IOPS on N: 2.0 when the cluster scales linearly) and, at each size,
//! the distribution of the workers' ("VMs'") own latencies: scaling that holds the total
//! but lets some VMs starve shows there, not in the factor.

use crate::format as fmt;
use crate::hist::{self, CURVE_PERCENTILES};
use crate::model::{PointStats, RunSummary};
use crate::profile::{Point, PointKey};
use crate::report::{html_page, Section};
use crate::svg::{Chart, GroupedChart, Series};
use crate::table::Table;
use serde::Serialize;
use std::collections::BTreeMap;

/// One size of the study: a run and where it is.
pub struct Size<'a> {
    /// The run's directory, relative to the study's.
    pub dir: String,
    pub summary: &'a RunSummary,
}

impl Size<'_> {
    /// Nodes that ran workers.
    pub fn nodes(&self) -> usize {
        self.summary.config.worker_nodes()
    }
}

/// One workload on both sizes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FactorRow {
    pub point: Point,
    pub small: PointStats,
    pub large: PointStats,
    /// IOPS on the large size ÷ IOPS on the small one.
    pub factor: f64,
    /// What linear scaling gives: the large size's worker nodes ÷ the small one's.
    pub ideal: f64,
}

/// The workloads both runs measured, in the small run's order.
pub fn factors(small: &RunSummary, large: &RunSummary) -> Vec<FactorRow> {
    let ideal = large.config.worker_nodes() as f64 / small.config.worker_nodes().max(1) as f64;
    let big: BTreeMap<PointKey, &PointStats> =
        large.measured().map(|(p, s)| (p.key(), s)).collect();
    small
        .measured()
        .filter_map(|(p, s)| {
            let l = big.get(&p.key())?;
            (s.iops > 0.0).then(|| FactorRow {
                point: p.clone(),
                small: s.clone(),
                large: (*l).clone(),
                factor: l.iops / s.iops,
                ideal,
            })
        })
        .collect()
}

/// The distribution over a run's workers of each worker's own latency at one point: its
/// mean over all its I/Os (every repeat), and its p99 (the worst repeat's, where the
/// repeat's I/Os support a p99).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VmLatency {
    pub vms: usize,
    /// Each VM's mean latency, µs, ascending.
    pub mean_us: Vec<f64>,
    /// Each VM's p99, µs, ascending; VMs whose I/Os do not support one are left out.
    pub p99_us: Vec<f64>,
}

impl VmLatency {
    /// Nearest-rank percentile `p` (0–100) of `v` (ascending).
    pub fn rank(v: &[f64], p: f64) -> Option<f64> {
        if v.is_empty() {
            return None;
        }
        let i = ((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        Some(v[i])
    }
}

pub fn vm_latency(s: &RunSummary, key: PointKey) -> Option<VmLatency> {
    let rec = s.points.iter().find(|r| r.point.key() == key)?;
    let p99 = CURVE_PERCENTILES.iter().position(|&p| p == 99.0)?;
    // (node, worker) → (I/Os, Σ latency ns, worst p99 ns).
    let mut vms: BTreeMap<(u32, u32), (u64, f64, Option<u64>)> = BTreeMap::new();
    for r in &rec.repeats {
        for w in &r.workers {
            let e = vms.entry((w.node, w.worker)).or_default();
            let ios = w.read_ios + w.write_ios;
            e.0 += ios;
            e.1 +=
                w.read_lat_mean_ns * w.read_ios as f64 + w.write_lat_mean_ns * w.write_ios as f64;
            if hist::supported(99.0, ios) {
                if let Some(Some(v)) = w.curve_ns.get(p99) {
                    e.2 = Some(e.2.map_or(*v, |x: u64| x.max(*v)));
                }
            }
        }
    }
    let mut out = VmLatency::default();
    for (ios, sum, p) in vms.into_values() {
        if ios == 0 {
            continue;
        }
        out.vms += 1;
        out.mean_us.push(sum / ios as f64 / 1000.0);
        if let Some(p) = p {
            out.p99_us.push(p as f64 / 1000.0);
        }
    }
    if out.vms == 0 {
        return None;
    }
    out.mean_us.sort_by(f64::total_cmp);
    out.p99_us.sort_by(f64::total_cmp);
    Some(out)
}

/// The study's result, as `scale-out.json` keeps it.
#[derive(Clone, Debug, Serialize)]
pub struct Study {
    pub sizes: Vec<StudySize>,
    pub workloads: Vec<StudyRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct StudySize {
    pub dir: String,
    pub worker_nodes: Vec<u32>,
    pub copy_nodes: Vec<u32>,
    pub status: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct StudyRow {
    pub workload: String,
    pub point: Point,
    pub iops: [f64; 2],
    pub factor: f64,
    pub ideal: f64,
    pub lat_mean_us: [Option<f64>; 2],
    /// Mean over the size's hosts of their CPU use.
    pub host_cpu_pct: [Option<f64>; 2],
    pub vm_latency: [Option<VmLatency>; 2],
}

fn workload(p: &Point) -> String {
    format!(
        "{} {}, QD {}, read {} %, {} worker{}/node",
        fmt_bs(p.bs_bytes),
        if p.random_pct == 100 {
            "random"
        } else {
            "mixed"
        },
        p.qd,
        p.read_pct(),
        p.workers_per_node,
        if p.workers_per_node == 1 { "" } else { "s" }
    )
}

fn fmt_bs(b: u64) -> String {
    converge_types::format_size(b).replace(' ', "")
}

pub fn study(small: &Size, large: &Size) -> Study {
    let size = |s: &Size| StudySize {
        dir: s.dir.clone(),
        worker_nodes: s
            .summary
            .config
            .nodes
            .iter()
            .filter(|n| n.runs_workers)
            .map(|n| n.id)
            .collect(),
        copy_nodes: s.summary.config.copy_nodes.clone(),
        status: format!("{:?}", s.summary.status).to_lowercase(),
    };
    Study {
        sizes: vec![size(small), size(large)],
        workloads: factors(small.summary, large.summary)
            .into_iter()
            .map(|r| StudyRow {
                workload: workload(&r.point),
                iops: [r.small.iops, r.large.iops],
                factor: r.factor,
                ideal: r.ideal,
                lat_mean_us: [r.small.lat_mean_us, r.large.lat_mean_us],
                host_cpu_pct: [r.small.host_cpu_pct, r.large.host_cpu_pct],
                vm_latency: [
                    vm_latency(small.summary, r.point.key()),
                    vm_latency(large.summary, r.point.key()),
                ],
                point: r.point,
            })
            .collect(),
    }
}

pub fn title(small: &Size, large: &Size) -> String {
    format!(
        "converge fleet: scale-out, {} nodes to {} ({})",
        small.nodes(),
        large.nodes(),
        small.summary.config.settings.resiliency
    )
}

fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    VmLatency::rank(v, 50.0)
}

pub fn sections(small: &Size, large: &Size) -> Vec<Section> {
    let st = study(small, large);
    let (n, n2) = (small.nodes(), large.nodes());
    let mut out = Vec::new();

    let mut runs = Section::new("runs", "Runs");
    let mut t = Table::new(
        "",
        &[
            "size",
            "directory",
            "nodes with workers",
            "copies on nodes",
            "status",
        ],
    );
    let ids = |v: &[u32]| {
        if v.is_empty() {
            "not recorded".to_string()
        } else {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    for (s, label) in st.sizes.iter().zip([n, n2]) {
        t.row(vec![
            format!("{label} nodes"),
            s.dir.clone(),
            ids(&s.worker_nodes),
            ids(&s.copy_nodes),
            s.status.clone(),
        ]);
    }
    runs.table(t);
    let set = &small.summary.config.settings;
    runs.text(format!(
        "Both sizes ran the same per-node load: each point {} s of warm-up and {} s \
         measured (×{}), every worker on its own {} volume of {}. For the {n}-node run the \
         other nodes were draining, so placement put none of its copies on them: each run \
         is a whole cluster of its size.",
        set.warmup_s,
        set.duration_s,
        set.repeat,
        set.resiliency,
        converge_types::format_size(set.working_set_bytes),
    ));
    let hosts = |s: &RunSummary| {
        let mut h: Vec<&str> = s.config.nodes.iter().map(|n| n.host_id.as_str()).collect();
        h.sort_unstable();
        h.dedup();
        h.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let (h1, h2) = (hosts(small.summary), hosts(large.summary));
    if h2.len() < n2 {
        runs.text(format!(
            "Caution: the {n2} nodes run on {} host{} ({} of the {n}-node run's {} also \
             serve the larger size), so the larger size shares CPUs, memory and drives with \
             the smaller one instead of adding its own. Here the factor measures what the \
             software costs on shared hardware, not how a cluster of separate servers \
             scales: run the study with one node per server for that.",
            h2.len(),
            if h2.len() == 1 { "" } else { "s" },
            h1.iter().filter(|h| h2.contains(h)).count(),
            if h1.len() == 1 { "host" } else { "hosts" },
        ));
    }
    out.push(runs);

    let mut fac = Section::new("factor", "Scale-out factor");
    let mut factors: Vec<f64> = st.workloads.iter().map(|w| w.factor).collect();
    let ideal = st.workloads.first().map_or(2.0, |w| w.ideal);
    match median(&mut factors) {
        Some(m) => fac.text(format!(
            "IOPS on {n2} nodes ÷ IOPS on {n} nodes, per workload; {} is linear scaling. \
             Median over the {} workloads: {m:.2} (range {:.2}–{:.2}).",
            fmt::sig3(ideal),
            factors.len(),
            factors.first().copied().unwrap_or(0.0),
            factors.last().copied().unwrap_or(0.0),
        )),
        None => fac.text("No workload was measured on both sizes."),
    }
    let mut t = Table::new(
        "",
        &[
            "workload",
            &format!("IOPS, {n} nodes"),
            &format!("IOPS, {n2} nodes"),
            "factor",
            &format!("per node, {n}"),
            &format!("per node, {n2}"),
            &format!("mean latency, {n}"),
            &format!("mean latency, {n2}"),
            &format!("host CPU, {n}"),
            &format!("host CPU, {n2}"),
        ],
    );
    let cpu = |v: Option<f64>| v.map_or("not measured".to_string(), fmt::pct);
    for w in &st.workloads {
        t.row(vec![
            w.workload.clone(),
            fmt::iops(w.iops[0]),
            fmt::iops(w.iops[1]),
            format!("{:.2}", w.factor),
            fmt::iops(w.iops[0] / n.max(1) as f64),
            fmt::iops(w.iops[1] / n2.max(1) as f64),
            fmt::lat_opt(w.lat_mean_us[0]),
            fmt::lat_opt(w.lat_mean_us[1]),
            cpu(w.host_cpu_pct[0]),
            cpu(w.host_cpu_pct[1]),
        ]);
    }
    fac.table(t);
    let groups: Vec<String> = st
        .workloads
        .iter()
        .map(|w| format!("QD {} r{}", w.point.qd, w.point.read_pct()))
        .collect();
    fac.chart(Chart::Grouped(GroupedChart {
        title: "IOPS on each size, and the factor".into(),
        x_label: "workload (QD, read %)".into(),
        groups: groups.clone(),
        bars: vec![
            Series {
                name: format!("{n} nodes"),
                values: st.workloads.iter().map(|w| Some(w.iops[0])).collect(),
            },
            Series {
                name: format!("{n2} nodes"),
                values: st.workloads.iter().map(|w| Some(w.iops[1])).collect(),
            },
        ],
        bar_unit: "IOPS".into(),
        lines: vec![Series {
            name: "factor".into(),
            values: st.workloads.iter().map(|w| Some(w.factor)).collect(),
        }],
        line_unit: Some("×".into()),
        fmt: fmt::iops,
        line_fmt: |v| format!("{v:.2}"),
    }));
    out.push(fac);

    let mut vm = Section::new("vm-latency", "Per-VM latency at each size");
    vm.text(
        "Each worker (a VM's disk) has its own mean latency over its I/Os, and its own p99 \
         (the worst repeat's; a worker with under 1,000 I/Os has none). The columns give \
         the distribution over the workers: the fastest, the median, the 90th percentile \
         and the slowest. A cluster that scales the total by starving some VMs shows a wide \
         spread here.",
    );
    let mut t = Table::new(
        "",
        &[
            "workload",
            "size",
            "VMs",
            "mean: min",
            "median",
            "p90",
            "max",
            "p99: median",
            "max",
        ],
    );
    let cell = |v: &[f64], p: f64| fmt::lat_opt(VmLatency::rank(v, p));
    for w in &st.workloads {
        for (i, size) in [n, n2].into_iter().enumerate() {
            let Some(l) = &w.vm_latency[i] else { continue };
            let tail = |p: f64| {
                if l.p99_us.is_empty() {
                    "too few I/Os".to_string()
                } else {
                    cell(&l.p99_us, p)
                }
            };
            t.row(vec![
                w.workload.clone(),
                format!("{size} nodes"),
                l.vms.to_string(),
                cell(&l.mean_us, 0.0),
                cell(&l.mean_us, 50.0),
                cell(&l.mean_us, 90.0),
                cell(&l.mean_us, 100.0),
                tail(50.0),
                tail(100.0),
            ]);
        }
    }
    vm.table(t);
    let series = |i: usize, p: f64, name: String| Series {
        name,
        values: st
            .workloads
            .iter()
            .map(|w| {
                w.vm_latency[i]
                    .as_ref()
                    .and_then(|l| VmLatency::rank(&l.mean_us, p))
            })
            .collect(),
    };
    vm.chart(Chart::Grouped(GroupedChart {
        title: "Per-VM mean latency: median VM (bars) and slowest VM (lines)".into(),
        x_label: "workload (QD, read %)".into(),
        groups,
        bars: vec![
            series(0, 50.0, format!("median VM, {n} nodes")),
            series(1, 50.0, format!("median VM, {n2} nodes")),
        ],
        bar_unit: "µs".into(),
        lines: vec![
            series(0, 100.0, format!("slowest VM, {n} nodes")),
            series(1, 100.0, format!("slowest VM, {n2} nodes")),
        ],
        line_unit: None,
        fmt: fmt::lat_us,
        line_fmt: fmt::lat_us,
    }));
    out.push(vm);
    out
}

pub fn markdown(small: &Size, large: &Size) -> String {
    let mut o = format!("# {}\n\n", title(small, large));
    o.push_str(
        "Charts are in `scale-out.html`; each size's own report is in its directory, the \
         numbers of this page in `scale-out.json`.\n\n",
    );
    o.push_str(&crate::report::sections_markdown(&sections(small, large)));
    o
}

pub fn html(small: &Size, large: &Size) -> String {
    html_page(&title(small, large), "", false, &sections(small, large))
}

/// The factor table for a terminal.
pub fn text(small: &Size, large: &Size) -> String {
    let secs = sections(small, large);
    let mut o = String::new();
    for sec in secs.iter().filter(|s| s.id == "factor") {
        for it in &sec.items {
            match it {
                crate::report::Item::Text(t) => {
                    o.push_str(t);
                    o.push('\n');
                }
                crate::report::Item::Table(t) => o.push_str(&t.to_text()),
                _ => {}
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{config, summary_from};

    fn run(nodes: usize, iops: f64) -> RunSummary {
        let mut cfg = config(vec![0, 100], vec![1, 8]);
        cfg.nodes.truncate(nodes);
        for n in &mut cfg.nodes {
            n.runs_workers = true;
        }
        cfg.copy_nodes = cfg.nodes.iter().map(|n| n.id).collect();
        summary_from(&cfg, usize::MAX, |_, _| iops)
    }

    #[test]
    fn the_factor_is_the_ratio_of_the_sizes_iops_per_workload() {
        let small = run(2, 1000.0);
        let large = run(4, 1500.0);
        assert_eq!(small.config.worker_nodes(), 2);
        let rows = factors(&small, &large);
        assert_eq!(rows.len(), 4);
        for r in &rows {
            // The synthetic repeats have 4 workers at 1000, then at 1500 IOPS each.
            assert!((r.factor - 1.5).abs() < 1e-9, "{}", r.factor);
            assert_eq!(r.ideal, 2.0);
        }
        let (a, b) = (
            Size {
                dir: "nodes-2".into(),
                summary: &small,
            },
            Size {
                dir: "nodes-4".into(),
                summary: &large,
            },
        );
        let md = markdown(&a, &b);
        assert!(md.contains("| nodes-2 |"), "{md}");
        assert!(md.contains("Median over the 4 workloads: 1.50"), "{md}");
        assert!(md.contains("| 1.50 |"), "{md}");
        // Every node of the test config is on host h1: the factor is not a cluster's.
        assert!(md.contains("Caution: the 4 nodes run on 1 host"), "{md}");
        // Each VM's latency, from its own I/Os: every worker of the test runs has one.
        let vl = vm_latency(&small, rows[0].point.key()).unwrap();
        assert_eq!(vl.vms, small.points[0].repeats[0].workers.len());
        assert!(vl.mean_us.windows(2).all(|w| w[0] <= w[1]));
        let h = html(&a, &b);
        assert_eq!(h.matches("<svg").count(), 2);
        assert!(text(&a, &b).contains("factor"));
    }

    #[test]
    fn a_workload_measured_on_one_size_only_has_no_factor() {
        let small = run(2, 1000.0);
        let mut large = run(4, 2000.0);
        large.points.truncate(1);
        assert_eq!(factors(&small, &large).len(), 1);
    }

    #[test]
    fn nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        assert_eq!(VmLatency::rank(&v, 0.0), Some(1.0));
        assert_eq!(VmLatency::rank(&v, 50.0), Some(5.0));
        assert_eq!(VmLatency::rank(&v, 90.0), Some(9.0));
        assert_eq!(VmLatency::rank(&v, 100.0), Some(10.0));
        assert_eq!(VmLatency::rank(&[], 50.0), None);
    }
}
