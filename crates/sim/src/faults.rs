//! The nemesis: at random moments it injects one fault, drawn by weight, if the fault
//! budget allows it (see `World::may_impair`).

use crate::owner::{crash_owner, depose_owner};
use crate::world::{lock, World};
use converge_types::{NodeId, VolumeId};
use rand::Rng;
use std::collections::BTreeSet;
use std::sync::Arc;
use tokio::time::Instant;

/// Relative weights of the faults the nemesis draws from.
#[derive(Clone, Debug)]
pub struct FaultWeights {
    /// Power loss of a node (armed inside an engine write, or immediate).
    pub node_crash: u32,
    /// A node cut off from all others and from the control plane for a while.
    pub partition: u32,
    /// One bit flipped at rest in a written data block.
    pub rot: u32,
    /// The owner's process dies; another node takes over after the lease expires.
    pub owner_crash: u32,
    /// The owner loses its lease without noticing and keeps serving as a zombie.
    pub depose: u32,
    /// A period during which messages are lost (requests or replies).
    pub flaky_network: u32,
    /// A node whose messages are slow (still under the RPC timeout).
    pub slow_node: u32,
    /// A capacity drive fails for good (until its node restarts), at most
    /// `Options::drive_failures_max` times a run.
    pub drive_failure: u32,
}

impl Default for FaultWeights {
    fn default() -> Self {
        FaultWeights {
            node_crash: 4,
            partition: 2,
            rot: 3,
            owner_crash: 1,
            depose: 1,
            flaky_network: 2,
            slow_node: 1,
            drive_failure: 1,
        }
    }
}

pub(crate) async fn nemesis(w: Arc<World>, until: Instant) {
    while Instant::now() < until && !w.stopping() {
        tokio::time::sleep(w.ms(w.opts.fault_interval_ms.0, w.opts.fault_interval_ms.1)).await;
        if Instant::now() >= until {
            break;
        }
        inject_one(&w);
    }
}

/// Seeds that lose a drive for good in a targeted way watch for the moment a drive holds a
/// slab's only in-sync copy beside a stale copy the record marks as holding every acked
/// write, and one that the budget lets go (the marked copy's node back, before its
/// resync): then it is lost (docs/adr/0014).
pub(crate) async fn targeted_loss(w: Arc<World>, until: Instant) {
    while Instant::now() < until && !w.stopping() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        for n in w.node_ids() {
            if let Some(what) = w.fail_drive(n) {
                w.trace(|| format!("nemesis (targeted): {what}"));
                return;
            }
        }
    }
}

/// After `after`, marks one random node draining (variant `drain`), as `converge node
/// remove` does: the repair policy then moves its copies elsewhere, copy before drop.
pub(crate) async fn drain_one(w: Arc<World>, after: std::time::Duration) {
    tokio::time::sleep(after).await;
    if w.stopping() {
        return;
    }
    let mut n = random_node(&w);
    // With parity volumes, a drain takes one chunk of each slab on the node out of its
    // redundancy while it is rebuilt elsewhere (see `World::within_budget`): only a node
    // the fault budget allows, as for any fault (tried again a little later).
    let parity = lock(&w.vols).iter().any(|r| r.spec.resiliency.is_parity());
    while parity && !w.may_impair(n) {
        w.trace(|| format!("operator: drain of node {n} put off (fault budget)"));
        tokio::time::sleep(w.ms(10, 50)).await;
        if w.stopping() {
            return;
        }
        n = random_node(&w);
    }
    lock(&w.ctl).drain(n);
    w.count("nodes drained");
    w.trace(|| format!("operator: node {n} is drained for removal"));
}

fn random_node(w: &World) -> NodeId {
    let ids = w.node_ids();
    ids[w.rng(|r| r.gen_range(0..ids.len()))]
}

fn inject_one(w: &Arc<World>) {
    let f = w.opts.faults.clone();
    let table = [
        f.node_crash,
        f.partition,
        f.rot,
        f.owner_crash,
        f.depose,
        f.flaky_network,
        f.slow_node,
        f.drive_failure,
    ];
    let total: u32 = table.iter().sum();
    if total == 0 {
        return;
    }
    let mut pick = w.rng(|r| r.gen_range(0..total));
    let mut kind = 0;
    for (i, &wt) in table.iter().enumerate() {
        if pick < wt {
            kind = i;
            break;
        }
        pick -= wt;
    }
    let n = random_node(w);
    let vols = lock(&w.vols).len();
    let v = w.rng(|r| r.gen_range(0..vols.max(1)));
    match kind {
        0 => {
            if !w.may_impair(n) {
                w.trace(|| format!("nemesis: crash of node {n} skipped (fault budget)"));
                return;
            }
            if w.chance(0.7) {
                w.arm_crash(n);
            } else {
                w.crash_node(n, "power cut");
            }
        }
        1 => {
            // Volumes with an owner (or a takeover) on `n`. When it may outlive a short cut
            // (variant short-owner-partitions), the cut hits their copies on every *other*
            // node: they all fail for that owner, which marks them stale once it reaches
            // etcd again, while its own node's copies stay in sync.
            let owned: BTreeSet<VolumeId> = lock(&w.vols)
                .iter()
                .filter(|r| {
                    r.current.as_ref().is_some_and(|o| o.node == n)
                        || r.pending.as_ref().is_some_and(|o| o.node == n)
                })
                .map(|r| r.id)
                .collect();
            let owns = !owned.is_empty();
            let short = w.opts.short_owner_partitions;
            let within = if short && owns {
                w.within_budget(|key, e| (e.node == n) != owned.contains(&key.volume))
            } else {
                w.may_impair(n)
            };
            if !within {
                w.trace(|| format!("nemesis: partition of node {n} skipped (fault budget)"));
                return;
            }
            let mut d = w.ms(w.opts.partition_ms.0, w.opts.partition_ms.1);
            if owns && short {
                // The variant's cut is shorter than the lease: the owner keeps its term (a
                // longer one deposes it, and the budget above would not hold: the new
                // owner could not reach the old owner's copies either).
                d = d.min(w.opts.lease_ttl);
            }
            if owns && !w.opts.short_owner_partitions {
                // Cut off longer than its lease: the owner is deposed (shorter cuts are
                // the variant `Options::short_owner_partitions`).
                // (with a margin: the new owner must have claimed the volume, bumping the
                // epoch, before the old one can reach etcd again).
                d = d.max(w.opts.lease_ttl + w.opts.rpc_timeout);
            }
            w.isolate(n, d);
            if short {
                let end = Instant::now() + d;
                let copies: Vec<(VolumeId, NodeId)> = lock(&w.ctl)
                    .all()
                    .into_iter()
                    .filter(|((v, _), _)| owned.contains(v))
                    .flat_map(|((v, _), ex)| ex.into_iter().map(move |e| (v, e.node)))
                    .filter(|(_, node)| *node != n)
                    .collect();
                for (v, node) in copies {
                    w.hit_copies(v, node, end);
                }
            }
            w.count("partitions");
            w.trace(|| format!("node {n} PARTITIONED for {d:?}"));
            // An owner cut off longer than its lease loses it: another node takes over
            // while the cut-off one keeps going until it notices.
            if d > w.opts.lease_ttl {
                let owned: Vec<usize> = lock(&w.vols)
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.current.as_ref().is_some_and(|o| o.node == n))
                    .map(|(i, _)| i)
                    .collect();
                for v in owned {
                    depose_owner(w, v, w.opts.lease_ttl);
                }
                // A takeover running there loses its claim with its lease: it is abandoned
                // (and retried elsewhere) before it can mark copies it cannot reach.
                if !w.opts.short_owner_partitions {
                    crate::owner::abandon_pending_on(w, n);
                }
            }
        }
        2 => match w.inject_rot(n) {
            Some(what) => w.trace(|| what),
            None => w.trace(|| format!("nemesis: no block to rot on node {n} (or fault budget)")),
        },
        3 => {
            crash_owner(w, v);
        }
        4 => {
            let delay = w.ms(0, 20);
            depose_owner(w, v, delay);
        }
        5 => {
            let d = w.ms(w.opts.partition_ms.0, w.opts.partition_ms.1);
            let p = w.rng(|r| r.gen_range(0.02..0.2));
            let mut net = lock(&w.net);
            net.flaky_until = Some(Instant::now() + d);
            net.drop_p = p;
            drop(net);
            w.count("flaky periods");
            w.trace(|| format!("network FLAKY for {d:?}: each message lost with p={p:.2}"));
        }
        6 => {
            let d = w.ms(w.opts.partition_ms.0, w.opts.partition_ms.1);
            lock(&w.net).slow.insert(n, Instant::now() + d);
            w.trace(|| format!("node {n} SLOW for {d:?}"));
        }
        _ => match w.fail_drive(n) {
            Some(what) => w.trace(|| what),
            None => w.trace(|| {
                format!("nemesis: no drive to fail on node {n} (or used up, or fault budget)")
            }),
        },
    }
}
