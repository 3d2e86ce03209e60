//! `converge node remove ID`: drains a node (its copies move to other nodes, copy before
//! drop, so no slab loses redundancy on the way), waits until it holds nothing, then
//! removes it: its volumes move to other nodes and its records leave etcd. The node's
//! `converged` then stops by itself, and its id can never register again.

use crate::http;
use anyhow::{bail, Result};
use converge_api::{Drain, DriveInfo, NodeInfo, NodeRemoved};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(500);
/// How often an unchanged count is printed again while waiting.
const REPORT_EVERY: Duration = Duration::from_secs(15);

/// Copies still on `node`'s drives, as the slab records say.
pub fn copies_on(base: &str, node: u32) -> Result<u64> {
    let drives: Vec<DriveInfo> = http::call(base, "GET", "/v1/drives", None)?;
    Ok(drives
        .iter()
        .filter(|d| d.node.0 == node)
        .map(|d| d.extents_used)
        .sum())
}

/// Starts draining `node`: placement skips it from now on, and its copies move away.
pub fn drain(base: &str, node: u32) -> Result<Vec<NodeInfo>> {
    let body = serde_json::to_value(Drain { on: true })?;
    http::call(
        base,
        "POST",
        &format!("/v1/nodes/{node}/drain"),
        Some(&body),
    )
}

/// Stops draining `node`: what moved stays moved.
pub fn cancel(base: &str, node: u32) -> Result<Vec<NodeInfo>> {
    let body = serde_json::to_value(Drain { on: false })?;
    http::call(
        base,
        "POST",
        &format!("/v1/nodes/{node}/drain"),
        Some(&body),
    )
}

/// Drains `node`, and unless `wait` is false waits up to `timeout` until it holds nothing
/// and removes it. Progress goes to stderr (stdout is for the result).
pub fn run(base: &str, node: u32, wait: bool, timeout: Duration) -> Result<Option<NodeRemoved>> {
    drain(base, node)?;
    let mut left = copies_on(base, node)?;
    eprintln!("node {node}: draining; {left} copies to move to other nodes");
    if !wait {
        eprintln!(
            "run `converge node remove {node}` again to wait and remove it, or `converge \
             node remove {node} --cancel` to stop"
        );
        return Ok(None);
    }
    let started = Instant::now();
    let mut reported = Instant::now();
    while left > 0 {
        if started.elapsed() > timeout {
            bail!(
                "node {node} still holds {left} copies after {} s; the drain goes on (see \
                 `converge status`): run `converge node remove {node}` again to wait for it, \
                 or `converge node remove {node} --cancel` to stop it",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
        let now = match copies_on(base, node) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("node {node}: asking for progress: {e:#}");
                continue;
            }
        };
        if now != left || reported.elapsed() > REPORT_EVERY {
            eprintln!("node {node}: {now} copies left to move");
            reported = Instant::now();
        }
        left = now;
    }
    let removed: NodeRemoved = http::call(base, "DELETE", &format!("/v1/nodes/{node}"), None)?;
    Ok(Some(removed))
}
