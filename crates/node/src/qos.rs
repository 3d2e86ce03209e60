//! The node's QoS contention controller (docs/QOS.md). Every [`TICK`] it looks at the
//! volumes this node serves: a volume with a reservation that is *backlogged* (it keeps at
//! least about one I/O in flight, so it would take more if served faster) and gets less
//! than its reservation makes the controller narrow the gate every volume without a
//! reservation passes (`converge_volume::qos::SharedGate`) to 70 % of what they did
//! together; while every reserved volume has what it asks for, the cap grows back by a
//! tenth per tick, and is lifted once it no longer binds. Per-volume limits are enforced
//! by the volumes themselves.
//!
//! Backlog comes from the latency counters the volumes keep anyway (Little's law: the
//! latency summed over the I/Os done in a tick, divided by the tick, is the mean number in
//! flight), so the data path pays nothing for it.

use crate::node::Node;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often the controller looks.
pub const TICK: Duration = Duration::from_millis(250);
/// A reserved volume with at least this many I/Os in flight on average wants more.
const BACKLOGGED: f64 = 0.8;
/// The best-effort cap never goes below this many I/Os per second in all.
pub const FLOOR_IOPS: f64 = 50.0;
/// Narrowing: the best-effort volumes keep this share of what they did.
const DECREASE: f64 = 0.7;
/// Widening, per tick, while every reservation is met.
const INCREASE: f64 = 1.1;

/// A volume's counters at a tick (cumulative).
#[derive(Clone, Debug)]
pub struct Sample {
    pub name: String,
    pub reserve: Option<u64>,
    /// Client reads and writes done.
    pub ops: u64,
    /// Their latencies summed (µs), QoS waits included.
    pub latency_us: u64,
}

/// What the controller remembers between ticks.
#[derive(Debug, Default)]
pub struct Controller {
    prev: HashMap<String, (u64, u64)>,
    cap: Option<f64>,
}

/// One tick's view of a volume.
#[derive(Debug, PartialEq)]
struct Rate {
    iops: f64,
    in_flight: f64,
}

impl Controller {
    /// The best-effort cap after a tick of `secs` seconds ending with `now`'s counters
    /// (`None`: no cap).
    pub fn step(&mut self, secs: f64, now: &[Sample]) -> Option<u64> {
        let mut short = false;
        let mut all_met = true;
        let mut best_effort = 0.0;
        let mut next = HashMap::new();
        for s in now {
            next.insert(s.name.clone(), (s.ops, s.latency_us));
            // A volume first seen this tick has no rate yet.
            let Some(&(ops, lat)) = self.prev.get(&s.name) else {
                continue;
            };
            let r = Rate {
                iops: s.ops.saturating_sub(ops) as f64 / secs,
                in_flight: s.latency_us.saturating_sub(lat) as f64 / (secs * 1e6),
            };
            match s.reserve {
                Some(want) => {
                    let want = want as f64;
                    if r.in_flight >= BACKLOGGED && r.iops < 0.95 * want {
                        short = true;
                    }
                    if r.in_flight >= BACKLOGGED && r.iops < 1.05 * want {
                        all_met = false;
                    }
                }
                None => best_effort += r.iops,
            }
        }
        self.prev = next;
        self.cap = if short {
            let base = self.cap.map_or(best_effort, |c| c.min(best_effort));
            Some((base * DECREASE).max(FLOOR_IOPS))
        } else {
            match self.cap {
                Some(c) if all_met => {
                    let c = c * INCREASE + 10.0;
                    // No longer binding: the best-effort volumes do well below it.
                    (c <= 2.0 * best_effort + 100.0).then_some(c)
                }
                other => other,
            }
        };
        self.cap.map(|c| c.round() as u64)
    }
}

/// Runs the controller for as long as the node runs.
pub async fn run(node: Arc<Node>) {
    let mut c = Controller::default();
    let mut last = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let samples: Vec<Sample> = node
            .volumes
            .lock()
            .await
            .iter()
            .map(|(name, v)| {
                let s = v.stats();
                Sample {
                    name: name.clone(),
                    reserve: v.qos().iops_reserve,
                    ops: s.read_ops + s.write_ops,
                    latency_us: s.read_latency.sum_us + s.write_latency.sum_us,
                }
            })
            .collect();
        let now = tokio::time::Instant::now();
        let secs = now.duration_since(last).as_secs_f64().max(1e-3);
        last = now;
        let before = node.qos_gate.cap();
        let cap = c.step(secs, &samples);
        if cap != before {
            match cap {
                Some(i) if before.is_none() => log::info!(
                    "qos: a volume with a reservation falls short; volumes without one capped at {i} IOPS on this node"
                ),
                None => log::info!("qos: reservations met; best-effort cap lifted"),
                _ => {}
            }
            node.qos_gate.set_cap(cap);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str, reserve: Option<u64>, ops: u64, latency_us: u64) -> Sample {
        Sample {
            name: name.into(),
            reserve,
            ops,
            latency_us,
        }
    }

    /// A reserved volume with 4 I/Os in flight getting 200 of its 500 IOPS: the noisy
    /// neighbour (8000 IOPS) is capped at 70 % of it, then lower while the reservation is
    /// short, never below the floor; once met, the cap widens; once the neighbour does far
    /// less than the cap, it is lifted.
    #[test]
    fn narrows_while_a_reservation_is_short_and_lifts_when_met() {
        let mut c = Controller::default();
        let mut t = (0u64, 0u64, 0u64);
        // Counters over one-second ticks: (reserved ops, reserved latency, noisy ops).
        let mut tick = |c: &mut Controller, res_ops: u64, inflight: f64, noisy_ops: u64| {
            t.0 += res_ops;
            t.1 += (inflight * 1e6) as u64;
            t.2 += noisy_ops;
            c.step(
                1.0,
                &[
                    s("gold", Some(500), t.0, t.1),
                    s("noisy", None, t.2, t.2 * 2000),
                ],
            )
        };
        assert_eq!(tick(&mut c, 0, 0.0, 0), None, "first sight: no rates yet");
        assert_eq!(tick(&mut c, 200, 4.0, 8000), Some(5600));
        assert_eq!(tick(&mut c, 300, 4.0, 5600), Some(3920));
        // Short again, the neighbour already below the cap: 70 % of what it did.
        assert_eq!(tick(&mut c, 400, 4.0, 1000), Some(700));
        for _ in 0..20 {
            tick(&mut c, 100, 4.0, 10);
        }
        assert_eq!(
            tick(&mut c, 100, 4.0, 10),
            Some(FLOOR_IOPS as u64),
            "the floor"
        );
        // Met (600 of 500): widens by a tenth (+10) per tick.
        assert_eq!(tick(&mut c, 600, 4.0, 50), Some(65));
        assert_eq!(tick(&mut c, 600, 4.0, 65), Some(82));
        // Met and the neighbour quiet: far below the cap, which is lifted.
        let mut lifted = false;
        for _ in 0..40 {
            if tick(&mut c, 600, 4.0, 1).is_none() {
                lifted = true;
                break;
            }
        }
        assert!(lifted);
    }

    /// A reserved volume that is idle or lightly loaded (under one I/O in flight) asks for
    /// nothing, however far below its reservation it runs; in between "short" and "met" the
    /// cap holds.
    #[test]
    fn an_idle_reservation_takes_nothing_and_the_band_between_holds() {
        let mut c = Controller::default();
        c.step(1.0, &[s("gold", Some(500), 0, 0), s("noisy", None, 0, 0)]);
        let cap = c.step(
            1.0,
            &[s("gold", Some(500), 10, 200_000), s("noisy", None, 9000, 0)],
        );
        assert_eq!(cap, None);
        let cap = c.step(
            1.0,
            &[
                s("gold", Some(500), 110, 4_200_000),
                s("noisy", None, 18000, 0),
            ],
        );
        assert_eq!(cap, Some(6300));
        // 500 done of 500 wanted: not short (≥ 95 %), not met (< 105 %): held.
        let cap = c.step(
            1.0,
            &[
                s("gold", Some(500), 610, 8_200_000),
                s("noisy", None, 24300, 0),
            ],
        );
        assert_eq!(cap, Some(6300));
    }
}
