//! Second-by-second timelines of a run: every drive's IOPS, latency and queue length and
//! every node's CPU, from the same cumulative counters the points' windows use
//! (`GET /v1/fleet/sample`), taken once a second from the first volume's creation to the
//! end of the sweep.

use converge_api::fleet::FleetSample;
use converge_types::DriveId;
use serde::{Deserialize, Serialize};

/// Ticks kept at most; past it, neighbouring ticks are merged and the interval doubles (a
/// 2-hour run at 1 s, a 4-hour run at 2 s, ...), so a long run's summary stays small.
pub const TICKS_MAX: usize = 7200;

/// One node's CPU over a tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeTick {
    pub node: u32,
    /// CPU of this `converged`, in cores.
    pub converged_cores: f64,
    /// Busy share of the host's CPUs, %; None when the host did not count.
    pub host_busy_pct: Option<f64>,
}

/// One drive over a tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DriveTick {
    pub node: u32,
    pub id: DriveId,
    /// Engine operations (reads, writes) per second.
    pub iops: f64,
    /// Mean time an operation was outstanding, µs: outstanding time over operations
    /// (Little's law, queue ÷ IOPS); None in a tick without operations.
    pub lat_us: Option<f64>,
    /// Time-averaged outstanding operations.
    pub queue: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    /// Seconds from the timeline's start to the tick's end.
    pub t_s: f64,
    pub nodes: Vec<NodeTick>,
    pub drives: Vec<DriveTick>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Seconds between ticks (1, doubled each time the ticks were thinned).
    pub interval_s: f64,
    pub ticks: Vec<Tick>,
    /// (seconds from the start, what began then): the pre-fill and each point's repeats.
    pub marks: Vec<(f64, String)>,
}

fn node_tick(a: &FleetSample, b: &FleetSample, ns: u64) -> NodeTick {
    let s = ns as f64 / 1e9;
    let busy = b.host_busy_ticks.saturating_sub(a.host_busy_ticks);
    let total = b.host_total_ticks.saturating_sub(a.host_total_ticks);
    NodeTick {
        node: b.node.0,
        converged_cores: ((b.converged_cpu_s - a.converged_cpu_s) / s).max(0.0),
        host_busy_pct: (total > 0).then(|| 100.0 * busy as f64 / total as f64),
    }
}

/// The tick between two samples of every node (matched by node; a node missing from
/// either, restarted in between or with no time passed is left out of it).
pub fn tick(t_s: f64, before: &[FleetSample], after: &[FleetSample]) -> Tick {
    let mut t = Tick {
        t_s,
        ..Tick::default()
    };
    for b in after {
        let Some(a) = before.iter().find(|a| a.node == b.node) else {
            continue;
        };
        let ns = b.mono_ns.saturating_sub(a.mono_ns);
        if ns == 0 || b.converged_cpu_s < a.converged_cpu_s {
            continue;
        }
        t.nodes.push(node_tick(a, b, ns));
        let s = ns as f64 / 1e9;
        for db in &b.drives {
            let Some(da) = a.drives.iter().find(|d| d.id == db.id) else {
                continue;
            };
            let ops = (db.read_ops + db.write_ops).saturating_sub(da.read_ops + da.write_ops);
            let busy_ns = db.inflight_time_ns.saturating_sub(da.inflight_time_ns);
            t.drives.push(DriveTick {
                node: b.node.0,
                id: db.id,
                iops: ops as f64 / s,
                lat_us: (ops > 0).then(|| busy_ns as f64 / ops as f64 / 1e3),
                queue: busy_ns as f64 / ns as f64,
            });
        }
    }
    t.nodes.sort_by_key(|n| n.node);
    t.drives.sort_by_key(|d| (d.node, d.id));
    t
}

/// Two ticks as one over both their times (rates averaged; latency weighted by operations).
fn merge(a: &Tick, b: &Tick) -> Tick {
    let mut t = b.clone();
    for n in &mut t.nodes {
        if let Some(x) = a.nodes.iter().find(|x| x.node == n.node) {
            n.converged_cores = (n.converged_cores + x.converged_cores) / 2.0;
            n.host_busy_pct = match (n.host_busy_pct, x.host_busy_pct) {
                (Some(p), Some(q)) => Some((p + q) / 2.0),
                (p, q) => p.or(q),
            };
        }
    }
    for d in &mut t.drives {
        if let Some(x) = a.drives.iter().find(|x| x.id == d.id) {
            let ops = d.iops + x.iops;
            let busy = d.lat_us.unwrap_or(0.0) * d.iops + x.lat_us.unwrap_or(0.0) * x.iops;
            d.lat_us = (ops > 0.0).then(|| busy / ops);
            d.iops = ops / 2.0;
            d.queue = (d.queue + x.queue) / 2.0;
        }
    }
    t
}

impl Timeline {
    pub fn new() -> Timeline {
        Timeline {
            interval_s: 1.0,
            ..Timeline::default()
        }
    }

    /// Adds a tick, thinning the timeline when it is full.
    pub fn push(&mut self, t: Tick) {
        self.ticks.push(t);
        if self.ticks.len() > TICKS_MAX {
            let old = std::mem::take(&mut self.ticks);
            self.ticks = old
                .chunks(2)
                .map(|c| {
                    if c.len() == 2 {
                        merge(&c[0], &c[1])
                    } else {
                        c[0].clone()
                    }
                })
                .collect();
            self.interval_s *= 2.0;
        }
    }

    pub fn mark(&mut self, t_s: f64, what: impl Into<String>) {
        self.marks.push((t_s, what.into()));
    }

    /// Nodes and drives that appear in any tick.
    pub fn drives_of(&self, node: u32) -> Vec<DriveId> {
        let mut v: Vec<DriveId> = self
            .ticks
            .iter()
            .flat_map(|t| t.drives.iter().filter(|d| d.node == node).map(|d| d.id))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn nodes(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .ticks
            .iter()
            .flat_map(|t| t.nodes.iter().map(|n| n.node))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// One drive's figure over time: (seconds, value) where the tick has one.
    pub fn drive_series(
        &self,
        id: DriveId,
        f: impl Fn(&DriveTick) -> Option<f64>,
    ) -> Vec<(f64, f64)> {
        self.ticks
            .iter()
            .filter_map(|t| {
                let d = t.drives.iter().find(|d| d.id == id)?;
                Some((t.t_s, f(d)?))
            })
            .collect()
    }

    /// One node's figure over time.
    pub fn node_series(&self, node: u32, f: impl Fn(&NodeTick) -> Option<f64>) -> Vec<(f64, f64)> {
        self.ticks
            .iter()
            .filter_map(|t| {
                let n = t.nodes.iter().find(|n| n.node == node)?;
                Some((t.t_s, f(n)?))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_api::fleet::DriveCounters;
    use converge_types::NodeId;

    fn sample(node: u32, ms: u64, cpu: f64, ops: u64, inflight_ns: u64) -> FleetSample {
        FleetSample {
            node: NodeId(node),
            host_id: "h".into(),
            mono_ns: ms * 1_000_000,
            host_busy_ticks: ms / 20,
            host_total_ticks: ms / 10,
            converged_cpu_s: cpu,
            drives: vec![DriveCounters {
                id: DriveId(u64::from(node) * 10),
                read_ops: ops / 4,
                write_ops: ops - ops / 4,
                inflight_time_ns: inflight_ns,
                ..Default::default()
            }],
            volumes: vec![],
        }
    }

    #[test]
    fn a_tick_is_the_rates_between_two_samples() {
        let a = [sample(1, 1000, 2.0, 1000, 0), sample(2, 5000, 1.0, 0, 0)];
        // Node 1: 2 s later, 0.5 CPU s, 4000 ops, 8 ms of outstanding time.
        // Node 2: restarted (CPU went back): left out.
        let b = [
            sample(1, 3000, 2.5, 5000, 8_000_000),
            sample(2, 6000, 0.1, 9, 9),
        ];
        let t = tick(7.0, &a, &b);
        assert_eq!(t.t_s, 7.0);
        assert_eq!(t.nodes.len(), 1);
        let n = &t.nodes[0];
        assert!((n.converged_cores - 0.25).abs() < 1e-9, "{n:?}");
        assert!((n.host_busy_pct.unwrap() - 50.0).abs() < 1e-9, "{n:?}");
        let d = &t.drives[0];
        assert!((d.iops - 2000.0).abs() < 1e-9, "{d:?}");
        assert!((d.queue - 0.004).abs() < 1e-9, "{d:?}");
        // 8 ms over 4000 operations: 2 µs each, and queue ÷ IOPS says the same.
        assert!((d.lat_us.unwrap() - 2.0).abs() < 1e-9, "{d:?}");
        assert!((d.queue / d.iops * 1e6 - 2.0).abs() < 1e-9);
        // No operations: no latency.
        let idle = tick(8.0, &b[..1], &[sample(1, 4000, 2.5, 5000, 8_000_000)]);
        assert_eq!(idle.drives[0].lat_us, None);
        assert_eq!(idle.drives[0].iops, 0.0);
    }

    #[test]
    fn a_full_timeline_merges_neighbours_and_doubles_its_interval() {
        let mut tl = Timeline::new();
        for i in 0..=TICKS_MAX {
            let iops = if i % 2 == 0 { 100.0 } else { 300.0 };
            tl.push(Tick {
                t_s: i as f64 + 1.0,
                nodes: vec![NodeTick {
                    node: 1,
                    converged_cores: 1.0,
                    host_busy_pct: Some(40.0),
                }],
                drives: vec![DriveTick {
                    node: 1,
                    id: DriveId(7),
                    iops,
                    lat_us: Some(if i % 2 == 0 { 10.0 } else { 30.0 }),
                    queue: 1.0,
                }],
            });
        }
        assert_eq!(tl.interval_s, 2.0);
        assert_eq!(tl.ticks.len(), TICKS_MAX / 2 + 1);
        let d = &tl.ticks[0].drives[0];
        assert_eq!(d.iops, 200.0);
        // Weighted by operations: (100 × 10 + 300 × 30) / 400.
        assert!((d.lat_us.unwrap() - 25.0).abs() < 1e-9, "{d:?}");
        assert_eq!(
            tl.ticks[0].t_s, 2.0,
            "a merged tick ends where its second did"
        );
        assert_eq!(tl.drives_of(1), vec![DriveId(7)]);
        assert_eq!(tl.nodes(), vec![1]);
        assert_eq!(
            tl.drive_series(DriveId(7), |d| Some(d.iops)).len(),
            tl.ticks.len()
        );
    }
}
