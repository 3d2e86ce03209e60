//! The cache tier in the HTTP API: `GET /v1/caches`, `POST /v1/cache/mode`, and the cache
//! parts of `/v1/status`, `/v1/drives` and `/v1/settings`. Kept apart from `api.rs` so the
//! operator API reads as before and the cache tier's views sit in one place.
//!
//! Each node publishes its cache drives (`Vec<CacheInfo>`) under `/converge/caches/<node>`
//! about every second, without a lease: a down node's entry stays behind with its last
//! numbers, so the listings here only show entries of live nodes. Modes are settings
//! (`/converge/settings`): the node runtime reads `node_cache_modes[node]`, else
//! `cache_mode`, else the media default, and applies it.

use crate::node::Node;
use crate::repair::SETTINGS_KEY;
use converge_api::{CacheInfo, DriveInfo, SetCacheMode, Settings};
use converge_types::{DriveId, DriveRole, NodeId};
use hyper::StatusCode;
use std::collections::{BTreeMap, BTreeSet};

/// Prefix of the keys each node publishes its cache drives under (`<prefix><node id>`).
pub const CACHES_PREFIX: &str = "/converge/caches/";

/// Read-modify-write of the settings retries this often when another writer got in between.
const SETTINGS_CAS_TRIES_MAX: u32 = 8;

pub type CacheApiError = (StatusCode, String);

fn unavailable(e: impl std::fmt::Display) -> CacheApiError {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("control plane unavailable: {e}"),
    )
}

/// Every node's published cache drives, with whether the publishing node is live.
pub struct Caches {
    /// Entries of every node that ever published (down nodes' entries are stale).
    pub all: Vec<CacheInfo>,
    pub live: BTreeSet<NodeId>,
}

impl Caches {
    /// What the API shows: entries of live nodes, sorted by node then path.
    pub fn current(&self) -> Vec<CacheInfo> {
        self.all
            .iter()
            .filter(|c| self.live.contains(&c.node))
            .cloned()
            .collect()
    }
}

/// Decodes the published values (key, JSON) into one sorted list. A value that does not
/// decode is skipped with a warning: one node with a newer format must not hide the rest.
pub fn decode_caches<'a>(kvs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Vec<CacheInfo> {
    let mut out = Vec::new();
    for (key, value) in kvs {
        match serde_json::from_slice::<Vec<CacheInfo>>(value) {
            Ok(v) => out.extend(v),
            Err(e) => log::warn!("cache state at {key} in etcd is not readable: {e}"),
        }
    }
    out.sort_by(|a, b| (a.node, &a.path).cmp(&(b.node, &b.path)));
    out
}

pub async fn read(node: &Node) -> Result<Caches, CacheApiError> {
    let (kvs, _) = node
        .cluster
        .etcd()
        .get_prefix(CACHES_PREFIX)
        .await
        .map_err(unavailable)?;
    let all = decode_caches(kvs.iter().map(|kv| (kv.key.as_str(), kv.value.as_slice())));
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(unavailable)?
        .into_iter()
        .map(|n| n.id)
        .collect();
    Ok(Caches { all, live })
}

/// Fills `DriveInfo.cache` of capacity drives from the cache drives' bindings, and lists
/// cache drives that have no drive record (the node may keep them out of the pool's
/// drive records, which are for placement) from what their node published — for nodes
/// the cluster knows (live, or holding drives), not for leftovers of removed nodes.
pub fn annotate_drives(drives: &mut Vec<DriveInfo>, caches: &Caches) {
    let known: BTreeSet<NodeId> = drives
        .iter()
        .map(|d| d.node)
        .chain(caches.live.iter().copied())
        .collect();
    let bound: BTreeMap<DriveId, DriveId> = caches
        .all
        .iter()
        .flat_map(|c| c.bound.iter().map(move |cap| (*cap, c.drive)))
        .collect();
    for d in drives.iter_mut() {
        if d.role == DriveRole::Capacity {
            d.cache = bound.get(&d.id).copied();
        }
    }
    for c in &caches.all {
        if !known.contains(&c.node) || drives.iter().any(|d| d.id == c.drive) {
            continue;
        }
        drives.push(DriveInfo {
            id: c.drive,
            node: c.node,
            path: c.path.clone(),
            role: DriveRole::Cache,
            media: c.media,
            size_bytes: c.log_bytes,
            extents_total: 0,
            extents_used: 0,
            slab_size_bytes: 0,
            failed: c.failed.clone(),
            cache: None,
            written_bytes: None,
            stored_bytes: None,
            slots_total: None,
            committed_bytes: None,
            wear: None,
        });
    }
    drives.sort_by(|a, b| (a.node, &a.path).cmp(&(b.node, &b.path)));
}

/// Health problems of the cache tier, for `Status.health`.
pub fn problems(caches: &[CacheInfo]) -> Vec<String> {
    let failed: Vec<String> = caches
        .iter()
        .filter_map(|c| {
            c.failed
                .as_ref()
                .map(|why| format!("{} on node {} ({why})", c.path, c.node))
        })
        .collect();
    if failed.is_empty() {
        Vec::new()
    } else {
        vec![format!("cache drives failed: {}", failed.join(", "))]
    }
}

/// Applies a `SetCacheMode` to the settings: `mode` absent removes the setting (the pool's,
/// or the node's override).
pub fn apply_mode(s: &mut Settings, req: &SetCacheMode) {
    match (req.node, req.mode) {
        (None, m) => s.cache_mode = m,
        (Some(n), Some(m)) => {
            s.node_cache_modes.insert(n, m);
        }
        (Some(n), None) => {
            s.node_cache_modes.remove(&n);
        }
    }
}

/// Merges a partial `POST /v1/settings` body into the current settings: fields present
/// replace, per-node cache modes are added (removing one is `POST /v1/cache/mode`).
pub fn merge_settings(cur: &mut Settings, new: &Settings) {
    if new.repair_delay_s.is_some() {
        cur.repair_delay_s = new.repair_delay_s;
    }
    if new.cache_mode.is_some() {
        cur.cache_mode = new.cache_mode;
    }
    if new.overcommit_pct.is_some() {
        cur.overcommit_pct = new.overcommit_pct;
    }
    for (n, m) in &new.node_cache_modes {
        cur.node_cache_modes.insert(*n, *m);
    }
}

/// The node ids of the cluster: live ones and those with drives (down nodes).
async fn cluster_node_ids(node: &Node) -> Result<BTreeSet<NodeId>, CacheApiError> {
    let mut ids: BTreeSet<NodeId> = node
        .cluster
        .live_nodes()
        .await
        .map_err(unavailable)?
        .into_iter()
        .map(|n| n.id)
        .collect();
    ids.extend(
        node.cluster
            .drives()
            .await
            .map_err(unavailable)?
            .into_iter()
            .map(|d| d.node),
    );
    Ok(ids)
}

/// Refuses per-node settings for nodes the cluster does not have.
pub async fn check_nodes(
    node: &Node,
    wanted: impl IntoIterator<Item = NodeId>,
) -> Result<(), CacheApiError> {
    let wanted: Vec<NodeId> = wanted.into_iter().collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let ids = cluster_node_ids(node).await?;
    if let Some(n) = wanted.iter().find(|n| !ids.contains(n)) {
        return Err((
            StatusCode::NOT_FOUND,
            format!(
                "no node {n} in this cluster (nodes: {}); `converge node list` shows them",
                ids.iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    Ok(())
}

/// Read-modify-write of `/converge/settings` with compare-and-swap, so two concurrent
/// changes (a mode here, a repair delay there) do not undo each other.
pub async fn update_settings(
    node: &Node,
    change: impl Fn(&mut Settings),
) -> Result<Settings, CacheApiError> {
    let etcd = node.cluster.etcd();
    for _ in 0..SETTINGS_CAS_TRIES_MAX {
        let (mut cur, rev) = match etcd.get(SETTINGS_KEY).await.map_err(unavailable)? {
            Some(kv) => (
                serde_json::from_slice(&kv.value).unwrap_or_default(),
                kv.mod_revision,
            ),
            None => (Settings::default(), 0),
        };
        change(&mut cur);
        let b = serde_json::to_vec(&cur)
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        if etcd.cas(SETTINGS_KEY, &b, rev).await.map_err(unavailable)? {
            return Ok(cur);
        }
    }
    Err((
        StatusCode::CONFLICT,
        format!(
            "the settings changed {SETTINGS_CAS_TRIES_MAX} times while this change was \
             applied; try again"
        ),
    ))
}

/// `POST /v1/cache/mode`.
pub async fn set_mode(node: &Node, body: &[u8]) -> Result<Settings, CacheApiError> {
    let req: SetCacheMode = serde_json::from_slice(body).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!(
                "bad cache mode request: {e}; send {{\"mode\": \"none\"|\"write\"|\"read-write\"|null, \"node\": N}}"
            ),
        )
    })?;
    check_nodes(node, req.node).await?;
    let s = update_settings(node, |s| apply_mode(s, &req)).await?;
    match (req.node, req.mode) {
        (None, Some(m)) => log::info!("pool cache mode set to {m}"),
        (None, None) => log::info!("pool cache mode cleared (media defaults)"),
        (Some(n), Some(m)) => log::info!("cache mode of node {n} set to {m}"),
        (Some(n), None) => log::info!("cache mode override of node {n} cleared"),
    }
    Ok(s)
}

/// `GET /v1/cache/advice`: this node's working-set curves and its cache drives.
pub fn advice(node: &Node) -> converge_api::CacheAdvice {
    let (mrc, volumes) = node.sampler.curves();
    let mut ids: Vec<_> = node.caches.keys().copied().collect();
    ids.sort();
    converge_api::CacheAdvice {
        node: node.cfg.node_id,
        cache_bytes: node.caches.values().map(|c| c.log_bytes()).sum(),
        cache_drives: node.caches.len(),
        cache_modes: ids
            .iter()
            .map(|id| node.caches[id].mode().to_string())
            .collect(),
        accesses: node.sampler.accesses(),
        tier: node.sampler.tier(),
        mrc,
        volumes: volumes
            .into_iter()
            .map(|(volume, mrc)| converge_api::VolumeMrc { volume, mrc })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::{CacheMode, MediaType};

    fn cache(node: u32, drive: u64, path: &str, bound: &[u64]) -> CacheInfo {
        CacheInfo {
            node: NodeId(node),
            drive: DriveId(drive),
            path: path.into(),
            media: MediaType::Nvme,
            mode: CacheMode::Write,
            bound: bound.iter().map(|b| DriveId(*b)).collect(),
            log_bytes: 1 << 30,
            used_bytes: 0,
            dirty_bytes: 0,
            clean_bytes: 0,
            destage_bytes_per_s: 0.0,
            read_hit_ratio: None,
            failed: None,
        }
    }

    fn drive(node: u32, id: u64, path: &str) -> DriveInfo {
        DriveInfo {
            id: DriveId(id),
            node: NodeId(node),
            path: path.into(),
            role: DriveRole::Capacity,
            media: MediaType::Ssd,
            size_bytes: 2 << 30,
            extents_total: 7,
            extents_used: 0,
            slab_size_bytes: 256 << 20,
            failed: None,
            cache: None,
            written_bytes: None,
            stored_bytes: None,
            slots_total: None,
            committed_bytes: None,
            wear: None,
        }
    }

    #[test]
    fn decodes_flattens_sorts_and_skips_garbage() {
        let n2 = serde_json::to_vec(&vec![cache(2, 9, "/b", &[]), cache(2, 8, "/a", &[])]).unwrap();
        let n1 = serde_json::to_vec(&vec![cache(1, 7, "/z", &[])]).unwrap();
        let v = decode_caches([
            ("/converge/caches/2", n2.as_slice()),
            ("/converge/caches/3", b"not json".as_slice()),
            ("/converge/caches/1", n1.as_slice()),
        ]);
        let got: Vec<(u32, &str)> = v.iter().map(|c| (c.node.0, c.path.as_str())).collect();
        assert_eq!(got, vec![(1, "/z"), (2, "/a"), (2, "/b")]);
    }

    #[test]
    fn current_hides_down_nodes() {
        let c = Caches {
            all: vec![cache(1, 1, "/a", &[]), cache(2, 2, "/a", &[])],
            live: [NodeId(2)].into_iter().collect(),
        };
        let v = c.current();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].node, NodeId(2));
    }

    #[test]
    fn drives_learn_their_cache_and_cache_drives_are_listed() {
        let mut ds = vec![
            drive(1, 10, "/d1"),
            drive(1, 11, "/d2"),
            drive(2, 20, "/d1"),
        ];
        let caches = Caches {
            // Node 9 left the cluster long ago: its entry is a leftover.
            all: vec![cache(1, 99, "/c1", &[10, 11]), cache(9, 98, "/c1", &[])],
            live: [NodeId(1), NodeId(2)].into_iter().collect(),
        };
        annotate_drives(&mut ds, &caches);
        let by: BTreeMap<u64, Option<DriveId>> = ds.iter().map(|d| (d.id.0, d.cache)).collect();
        assert_eq!(by[&10], Some(DriveId(99)));
        assert_eq!(by[&11], Some(DriveId(99)));
        assert_eq!(by[&20], None);
        let c = ds
            .iter()
            .find(|d| d.id == DriveId(99))
            .expect("cache drive listed");
        assert_eq!(c.role, DriveRole::Cache);
        assert_eq!(c.extents_total, 0, "a cache drive offers no slabs");
        // Sorted by node then path, the cache drive first on node 1.
        assert_eq!(ds[0].id, DriveId(99));
        assert!(
            !ds.iter().any(|d| d.id == DriveId(98)),
            "no ghost of node 9"
        );
        // A cache drive with a drive record is not listed twice.
        let before = ds.len();
        annotate_drives(&mut ds, &caches);
        assert_eq!(ds.len(), before);
        // A down node still holding drives keeps its cache drive listed and bound.
        let mut ds = vec![drive(3, 30, "/d1")];
        let down = Caches {
            all: vec![cache(3, 97, "/c1", &[30])],
            live: BTreeSet::new(),
        };
        annotate_drives(&mut ds, &down);
        assert_eq!(ds.len(), 2);
        assert_eq!(ds[1].cache, Some(DriveId(97)));
    }

    #[test]
    fn failed_cache_is_a_problem() {
        assert!(problems(&[cache(1, 1, "/a", &[])]).is_empty());
        let mut c = cache(3, 1, "/c", &[]);
        c.failed = Some("I/O error".into());
        let p = problems(&[c]);
        assert_eq!(p, vec!["cache drives failed: /c on node 3 (I/O error)"]);
    }

    #[test]
    fn mode_requests_set_and_clear() {
        let mut s = Settings::default();
        apply_mode(
            &mut s,
            &SetCacheMode {
                mode: Some(CacheMode::ReadWrite),
                node: None,
            },
        );
        apply_mode(
            &mut s,
            &SetCacheMode {
                mode: Some(CacheMode::None),
                node: Some(NodeId(2)),
            },
        );
        assert_eq!(s.cache_mode, Some(CacheMode::ReadWrite));
        assert_eq!(s.node_cache_modes.get(&NodeId(2)), Some(&CacheMode::None));
        apply_mode(
            &mut s,
            &SetCacheMode {
                mode: None,
                node: Some(NodeId(2)),
            },
        );
        assert!(s.node_cache_modes.is_empty());
        assert_eq!(s.cache_mode, Some(CacheMode::ReadWrite), "pool mode kept");
        apply_mode(
            &mut s,
            &SetCacheMode {
                mode: None,
                node: None,
            },
        );
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn settings_merge_keeps_what_is_absent() {
        let mut cur = Settings {
            repair_delay_s: Some(60),
            cache_mode: Some(CacheMode::Write),
            node_cache_modes: [(NodeId(1), CacheMode::None)].into_iter().collect(),
            overcommit_pct: Some(150),
        };
        merge_settings(
            &mut cur,
            &Settings {
                repair_delay_s: Some(90),
                ..Default::default()
            },
        );
        assert_eq!(cur.repair_delay_s, Some(90));
        assert_eq!(cur.cache_mode, Some(CacheMode::Write));
        assert_eq!(cur.node_cache_modes.len(), 1);
        merge_settings(
            &mut cur,
            &Settings {
                node_cache_modes: [(NodeId(2), CacheMode::ReadWrite)].into_iter().collect(),
                ..Default::default()
            },
        );
        assert_eq!(cur.node_cache_modes.len(), 2);
        assert_eq!(cur.repair_delay_s, Some(90));
        assert_eq!(cur.overcommit_pct, Some(150));
        merge_settings(
            &mut cur,
            &Settings {
                overcommit_pct: Some(200),
                ..Default::default()
            },
        );
        assert_eq!(cur.overcommit_pct, Some(200));
        assert_eq!(cur.repair_delay_s, Some(90));
    }
}
