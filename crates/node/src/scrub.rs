//! Scrub: every block of every in-sync copy is read at a throttled rate, checksums are
//! verified, copies are compared (version and bytes), and bad or disagreeing blocks are
//! rewritten from a good copy. A volume is scrubbed by its owner (a node asked for an
//! unowned volume takes it over first). Results are kept in etcd per volume; the leader
//! starts a volume's scrub when its last one is older than `scrub_interval_h`.

use crate::node::{Node, OpenError, Route};
use crate::repair::unix_now;
use converge_api::{ScrubRequest, ScrubResult};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub const SCRUBS_PREFIX: &str = "/converge/scrubs/";

/// Scrubs `name` on its owner (here, or forwarded) and returns the result.
pub async fn scrub_volume(
    node: &Arc<Node>,
    name: &str,
    repair: bool,
) -> Result<ScrubResult, String> {
    let route = match node.open_volume(name).await {
        Ok(r) => r,
        Err(OpenError::Unknown) => return Err(format!("no volume named {name}")),
        Err(OpenError::Unavailable(e)) => return Err(e),
    };
    let v = match route {
        Route::Local(v) => v,
        Route::Remote { owner, .. } => return forward(node, owner, name, repair).await,
    };
    let started = unix_now();
    let job = node.jobs.begin(
        node.cfg.node_id,
        "scrub",
        name,
        converge_types::SlabIndex(0),
        format!(
            "reads and compares every copy (repair {})",
            if repair { "on" } else { "off" }
        ),
    );
    let r = v.scrub(repair, &node.scrub_throttle, &job.progress).await;
    drop(job);
    let (rep, error) = match r {
        Ok(rep) => (rep, None),
        Err(e) => (Default::default(), Some(e.to_string())),
    };
    let result = ScrubResult {
        volume: name.to_string(),
        node: node.cfg.node_id,
        started_unix: started,
        finished_unix: unix_now(),
        blocks_checked: rep.blocks_checked,
        bytes_read: rep.bytes_read,
        bad_checksums: rep.bad_checksums,
        mismatches: rep.mismatches,
        repaired: rep.repaired,
        snapshot_blocks_checked: rep.snapshot_blocks_checked,
        snapshot_blocks_lost: rep.snapshot_blocks_lost,
        error,
    };
    node.scrub_stats
        .blocks
        .fetch_add(rep.blocks_checked, Ordering::Relaxed);
    node.scrub_stats
        .bad
        .fetch_add(rep.bad_checksums, Ordering::Relaxed);
    node.scrub_stats
        .mismatches
        .fetch_add(rep.mismatches, Ordering::Relaxed);
    node.scrub_stats
        .repaired
        .fetch_add(rep.repaired, Ordering::Relaxed);
    node.scrub_stats
        .snapshot_lost
        .fetch_add(rep.snapshot_blocks_lost, Ordering::Relaxed);
    log::info!(
        "scrub of volume {name}: {} blocks checked, {} bad checksums, {} mismatches, {} repaired{}",
        rep.blocks_checked,
        rep.bad_checksums,
        rep.mismatches,
        rep.repaired,
        result
            .error
            .as_deref()
            .map(|e| format!(", stopped: {e}"))
            .unwrap_or_default()
    );
    if let Ok(b) = serde_json::to_vec(&result) {
        if let Err(e) = node
            .cluster
            .etcd()
            .put(&format!("{SCRUBS_PREFIX}{name}"), &b, None)
            .await
        {
            log::warn!("recording the scrub result of {name}: {e}");
        }
    }
    crate::orphans::reclaim_logged(node, "after the scrub").await;
    Ok(result)
}

async fn forward(
    node: &Node,
    owner: converge_types::NodeId,
    name: &str,
    repair: bool,
) -> Result<ScrubResult, String> {
    let live = node.cluster.live_nodes().await.map_err(|e| e.to_string())?;
    let n = live
        .iter()
        .find(|n| n.id == owner)
        .ok_or_else(|| format!("volume {name}: owner node {owner} is not live"))?;
    let body =
        serde_json::to_vec(&ScrubRequest { wait: true, repair }).map_err(|e| e.to_string())?;
    let (status, bytes) =
        crate::http_client::request(node, n, "POST", &format!("/v1/volumes/{name}/scrub"), &body)
            .await
            .map_err(|e| format!("forwarding the scrub to node {owner}: {e}"))?;
    if status != 200 {
        return Err(format!("node {owner}: {}", String::from_utf8_lossy(&bytes)));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("node {owner} answered: {e}"))
}

/// The last scrub result of every volume.
pub async fn results(node: &Node) -> Vec<ScrubResult> {
    match node.cluster.etcd().get_prefix(SCRUBS_PREFIX).await {
        Ok((kvs, _)) => kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice(&kv.value).ok())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Leader duty: start the scrub of every volume whose last one is older than the
/// schedule (one at a time).
pub async fn scheduled(node: &Arc<Node>) {
    let h = node.cfg.knobs.scrub_interval_h;
    if h == 0 {
        return;
    }
    let Ok(vols) = node.cluster.volumes().await else {
        return;
    };
    let done = results(node).await;
    let now = unix_now();
    for v in vols {
        let last = done
            .iter()
            .find(|r| r.volume == v.name)
            .map_or(v.created_unix, |r| r.finished_unix);
        if now.saturating_sub(last) >= h * 3600 {
            log::info!("scheduled scrub of volume {}", v.name);
            if let Err(e) = scrub_volume(node, &v.name, true).await {
                log::warn!("scheduled scrub of volume {}: {e}", v.name);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            return;
        }
    }
}
