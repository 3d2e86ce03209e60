//! The cache tier's background work, driven from the seed instead of a destage thread:
//! destage steps at random moments (with and without pressure), run-time mode switches,
//! and power losses armed inside a destage step. With `Options::cache` every node has a
//! cache drive in front of its capacity drives (see `world::open_cache`).

use crate::world::{lock, random_mode, World};
use converge_types::{CacheMode, NodeId};
use rand::Rng;
use std::sync::Arc;

/// Runs until the fault phase ends.
pub(crate) async fn worker(w: Arc<World>) {
    let (lo, hi) = w.opts.cache_work_ms;
    while !w.stopping() {
        tokio::time::sleep(w.ms(lo, hi)).await;
        if w.stopping() {
            break;
        }
        let ids = w.node_ids();
        let n = ids[w.rng(|r| r.gen_range(0..ids.len()))];
        if !w.is_up(n) {
            continue;
        }
        let roll = w.rng(|r| r.gen::<f64>());
        let switch_p = w.opts.cache_mode_switch_p;
        if roll < switch_p {
            let mode = w.rng(random_mode);
            set_mode(&w, n, mode);
        } else if roll < switch_p + w.opts.cache_destage_crash_p {
            crash_inside_destage(&w, n);
        } else {
            let pressure = w.chance(0.3);
            step(&w, n, pressure);
        }
    }
}

/// The node's cache mode changes at run time (an operator's `SetCacheMode`); it sticks
/// across restarts.
pub(crate) fn set_mode(w: &World, n: NodeId, mode: CacheMode) {
    let changed = {
        let mut nodes = lock(&w.nodes);
        let Some(c) = nodes
            .iter_mut()
            .find(|x| x.id == n)
            .and_then(|x| x.cache.as_mut())
        else {
            return;
        };
        let old = c.mode;
        c.mode = mode;
        if let Some(cache) = &c.cache {
            cache.set_mode(mode);
        }
        old != mode
    };
    if changed {
        w.count("cache mode switches");
        w.trace(|| format!("node {n}: cache mode -> {mode}"));
    }
}

/// Dirty bytes in the node's cache log (0 if down).
fn dirty_bytes(w: &World, n: NodeId) -> u64 {
    lock(&w.nodes)
        .iter()
        .find(|x| x.id == n)
        .and_then(|x| x.cache.as_ref())
        .and_then(|c| c.cache.as_ref())
        .map_or(0, |c| c.stats().dirty_bytes)
}

fn step(w: &Arc<World>, n: NodeId, pressure: bool) {
    if let Some(bytes) = w.cache_step(n, pressure) {
        w.count("cache destage steps");
        if bytes > 0 {
            *lock(&w.stats)
                .entry("cache blocks destaged by steps")
                .or_insert(0) += bytes / converge_types::BLOCK_SIZE as u64;
            w.trace(|| {
                format!(
                    "node {n}: cache destaged {} blocks{}",
                    bytes / converge_types::BLOCK_SIZE as u64,
                    if pressure { " (pressure)" } else { "" }
                )
            });
        }
    }
}

/// A power loss armed on one of the node's files (a capacity drive being destaged to, or
/// the cache drive whose tail moves after) within the next few device writes, then a
/// destage step: the crash lands inside it when it has dirty blocks to write.
fn crash_inside_destage(w: &Arc<World>, n: NodeId) {
    if dirty_bytes(w, n) == 0 || !w.may_impair(n) {
        step(w, n, false);
        return;
    }
    let writes = w.rng(|r| r.gen_range(1..=4u64));
    if w.arm_crash_with(n, writes, None) {
        w.count("power losses armed before a destage step");
    }
    step(w, n, w.chance(0.5));
}
