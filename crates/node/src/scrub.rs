//! Scrub: every block of every in-sync copy is read at a throttled rate, checksums are
//! verified, copies are compared (version and bytes), and bad or disagreeing blocks are
//! rewritten from a good copy. A volume is scrubbed by its owner (a node asked for an
//! unowned volume takes it over first). Results are kept in etcd per volume; the leader
//! starts a volume's scrub when its last one is older than `scrub_interval_h`, on its
//! owner, without waiting for it: the owner marks it running in etcd (bound to its lease)
//! until it records the result.

use crate::node::{Node, OpenError, Route};
use crate::repair::unix_now;
use converge_api::{ScrubRequest, ScrubResult};
use converge_control::model::VolumeRecord;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub const SCRUBS_PREFIX: &str = "/converge/scrubs/";
/// A volume's scrub running on its owner: `<prefix><volume>`, bound to the owner's lease
/// (a dead owner's mark goes with its lease, and the leader starts the scrub again).
pub const SCRUBS_RUNNING_PREFIX: &str = "/converge/scrubs-running/";

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
    // In a task of its own: a caller that stops waiting (a request cut off) must not cut
    // the scrub short, which would leave its running mark until the node's lease ends and
    // record nothing.
    let (n, name) = (node.clone(), name.to_string());
    tokio::spawn(async move { scrub_here(&n, v, &name, repair).await })
        .await
        .map_err(|e| format!("the scrub task ended abnormally: {e}"))
}

/// Scrubs `name`, which this node serves as `v`, and records the result.
async fn scrub_here(
    node: &Arc<Node>,
    v: Arc<crate::node::Vol>,
    name: &str,
    repair: bool,
) -> ScrubResult {
    let started = unix_now();
    let running = format!("{SCRUBS_RUNNING_PREFIX}{name}");
    let me = node.cfg.node_id.to_string();
    if let Err(e) = node
        .cluster
        .etcd()
        .put(&running, me.as_bytes(), Some(node.lease()))
        .await
    {
        log::warn!("marking the scrub of {name} running: {e}");
    }
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
    if let Err(e) = node.cluster.etcd().delete(&running).await {
        log::warn!("clearing the running mark of the scrub of {name}: {e}");
    }
    crate::orphans::reclaim_logged(node, "after the scrub").await;
    result
}

/// Starts the scrub of `name` on its owner and returns at once: here in a task of its own,
/// or asked of the owner without waiting (a scrub outlasts any request's timeout; a
/// forwarded wait that timed out cancelled the owner's scrub before it recorded anything).
pub async fn start_scrub(node: &Arc<Node>, name: &str, repair: bool) -> Result<(), String> {
    match node.open_volume(name).await {
        Ok(Route::Local(_)) => {
            let n = node.clone();
            let name = name.to_string();
            tokio::spawn(async move {
                if let Err(e) = scrub_volume(&n, &name, repair).await {
                    log::warn!("scrub of volume {name}: {e}");
                }
            });
            Ok(())
        }
        Ok(Route::Remote { owner, .. }) => {
            let live = node.cluster.live_nodes().await.map_err(|e| e.to_string())?;
            let n = live
                .iter()
                .find(|n| n.id == owner)
                .ok_or_else(|| format!("volume {name}: owner node {owner} is not live"))?;
            let body = serde_json::to_vec(&ScrubRequest {
                wait: false,
                repair,
            })
            .map_err(|e| e.to_string())?;
            let path = format!("/v1/volumes/{name}/scrub");
            let (status, bytes) = crate::http_client::request(node, n, "POST", &path, &body)
                .await
                .map_err(|e| format!("asking node {owner} to scrub: {e}"))?;
            if status != 200 {
                return Err(format!("node {owner}: {}", String::from_utf8_lossy(&bytes)));
            }
            Ok(())
        }
        Err(OpenError::Unknown) => Err(format!("no volume named {name}")),
        Err(OpenError::Unavailable(e)) => Err(e),
    }
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

/// Volumes whose scrub is running on their owner now.
async fn running(node: &Node) -> Result<HashSet<String>, String> {
    let (kvs, _) = node
        .cluster
        .etcd()
        .get_prefix(SCRUBS_RUNNING_PREFIX)
        .await
        .map_err(|e| e.to_string())?;
    Ok(kvs
        .iter()
        .filter_map(|kv| kv.key.strip_prefix(SCRUBS_RUNNING_PREFIX))
        .map(str::to_string)
        .collect())
}

/// The volume whose scheduled scrub is due first: its last scrub (or, never scrubbed, its
/// creation) is `interval_s` old or more, and no scrub of it is running (one the leader
/// started on another node runs there for hours, and its result comes only at its end).
fn due<'a>(
    vols: &'a [VolumeRecord],
    done: &[ScrubResult],
    running: &HashSet<String>,
    now_unix: u64,
    interval_s: u64,
) -> Option<&'a str> {
    vols.iter()
        .filter(|v| !running.contains(&v.name))
        .find(|v| {
            let last = done
                .iter()
                .find(|r| r.volume == v.name)
                .map_or(v.created_unix, |r| r.finished_unix);
            now_unix.saturating_sub(last) >= interval_s
        })
        .map(|v| v.name.as_str())
}

/// Leader duty: start the scrub of the first volume whose last one is older than the
/// schedule, on its owner (one a round; the leader does not wait for it). Costs two
/// etcd range reads a round (the results and the running marks: one key per volume).
pub async fn scheduled(node: &Arc<Node>) {
    let h = node.cfg.knobs.scrub_interval_h;
    if h == 0 {
        return;
    }
    let Ok(vols) = node.cluster.volumes().await else {
        return;
    };
    let Ok(running) = running(node).await else {
        return;
    };
    let done = results(node).await;
    if let Some(name) = due(&vols, &done, &running, unix_now(), h * 3600) {
        log::info!("scheduled scrub of volume {name}");
        if let Err(e) = start_scrub(node, name, true).await {
            log::warn!("scheduled scrub of volume {name}: {e}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str, created_unix: u64) -> VolumeRecord {
        serde_json::from_value(serde_json::json!({
            "id": 7, "name": name, "size_bytes": 1u64 << 30, "resiliency": "mirror-2",
            "min_replicas": 1, "slab_size_bytes": 1u64 << 28, "owner": 2,
            "created_unix": created_unix,
        }))
        .expect("a volume record")
    }

    fn result(name: &str, finished_unix: u64) -> ScrubResult {
        ScrubResult {
            volume: name.into(),
            node: converge_types::NodeId(2),
            started_unix: finished_unix.saturating_sub(10),
            finished_unix,
            blocks_checked: 0,
            bytes_read: 0,
            bad_checksums: 0,
            mismatches: 0,
            repaired: 0,
            snapshot_blocks_checked: 0,
            snapshot_blocks_lost: 0,
            error: None,
        }
    }

    #[test]
    fn a_scrub_running_on_the_owner_is_not_started_again() {
        let day = 86_400;
        let vols = [vol("a", 0), vol("b", 0), vol("c", 9 * day)];
        // "a" was scrubbed yesterday, "b" never; "c" is new.
        let done = [result("a", 9 * day)];
        let mut running = HashSet::new();
        assert_eq!(due(&vols, &done, &running, 10 * day, 7 * day), Some("b"));
        // The leader started "b" on its owner, which scrubs it for hours: "b" stays due
        // by its last result until that scrub records one, and must not be started again
        // (each start cancelled or doubled the one before, so "b" was never done).
        running.insert("b".to_string());
        assert_eq!(due(&vols, &done, &running, 10 * day, 7 * day), None);
        // Its result recorded and its mark cleared, nothing is due until the next week.
        let done = [result("a", 9 * day), result("b", 10 * day)];
        assert_eq!(
            due(&vols, &done, &HashSet::new(), 10 * day + 1, 7 * day),
            None
        );
        assert_eq!(
            due(&vols, &done, &HashSet::new(), 16 * day, 7 * day),
            Some("a")
        );
    }
}
