//! Orphan extents: copies on this node's drives that no slab record places here any more.
//! A volume deleted, or a copy rebuilt elsewhere, while this node was down or cut off
//! leaves its extents behind: they hold space that nothing accounts for. This node frees
//! them at start-up and after every scrub it runs.
//!
//! Safe against a copy being placed here again meanwhile: each candidate is first
//! *condemned* (writes to it are refused), then its record is read afresh, and only an
//! extent that record does not place on this drive is freed. Whoever places a copy changes
//! the record before writing to it, so a write that got in before the condemnation shows
//! in the fresh read.

use crate::node::Node;
use converge_types::{DriveId, ExtentKey, ExtentOp};
use std::collections::HashSet;
use std::sync::atomic::Ordering;

/// Frees this node's orphan extents; returns how many were freed.
pub async fn reclaim(node: &Node) -> Result<u64, String> {
    // The drives first: an extent created after this listing is not a candidate.
    let mut candidates: Vec<(DriveId, ExtentKey)> = Vec::new();
    for (id, t) in &node.drives {
        if t.failure().is_some() {
            continue;
        }
        candidates.extend(t.extents().into_iter().map(|e| (*id, e.key)));
    }
    if candidates.is_empty() {
        return Ok(0);
    }
    let mut placed: HashSet<(DriveId, ExtentKey)> = HashSet::new();
    for v in node.cluster.volumes().await.map_err(|e| e.to_string())? {
        for (slab, (rec, _)) in node.cluster.slabs(v.id).await.map_err(|e| e.to_string())? {
            let key = ExtentKey { volume: v.id, slab };
            placed.extend(rec.extents.iter().map(|e| (e.drive, key)));
        }
    }
    let local = &node.replicas.local;
    let mut freed = 0;
    for (drive, key) in candidates {
        if placed.contains(&(drive, key)) {
            continue;
        }
        let condemn = |on: bool| {
            let mut c = local.condemned.lock().expect("condemned lock poisoned");
            if on {
                c.insert((drive, key));
            } else {
                c.remove(&(drive, key));
            }
            local.condemned_count.store(c.len(), Ordering::Release);
        };
        condemn(true);
        let fresh = node.cluster.slab(key.volume, key.slab).await;
        let r = match fresh {
            Ok(Some((rec, _))) if rec.extents.iter().any(|e| e.drive == drive) => Ok(false),
            Ok(_) => local
                .call(
                    converge_allocator::admission::Caller::Local,
                    drive,
                    ExtentOp::Free { key },
                )
                .await
                .map(|_| true)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        condemn(false);
        match r {
            Ok(true) => {
                freed += 1;
                log::info!(
                    "freed orphan extent: slab {} of volume {} on drive {:016x} (no slab record places it here)",
                    key.slab,
                    key.volume,
                    drive.0
                );
            }
            Ok(false) => {}
            Err(e) => return Err(format!("freeing orphan extents: {e}")),
        }
    }
    node.orphans_freed.fetch_add(freed, Ordering::Relaxed);
    Ok(freed)
}

/// Runs [`reclaim`] and logs the outcome (for start-up and after scrubs).
pub async fn reclaim_logged(node: &Node, when: &str) {
    match reclaim(node).await {
        Ok(0) => {}
        Ok(n) => log::info!("{when}: freed {n} orphan extents"),
        Err(e) => log::warn!("{when}: {e}; orphans are looked for again after the next scrub"),
    }
}
