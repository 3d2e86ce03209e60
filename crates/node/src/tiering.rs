//! This node's drives as tiers: capacity drives (each a [`Tier`]), cache drives bound to
//! them, the cache mode in effect, what the caches publish to etcd, and what happens when a
//! cache drive is lost (DESIGN.md "Cache tier"; docs/CACHE.md).

use crate::config::Config;
use crate::node::Node;
use anyhow::{bail, Context, Result};
use converge_api::CacheInfo;
use converge_control::model::{Cluster, DriveRecord};
use converge_engine::{BlockFile, Cache, DirectFile, Drive, DriveIdentity, Tier};
use converge_types::{CacheMode, ClusterId, DriveId, DriveRole, ExtentState, MediaType, NodeId};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::cache_api::CACHES_PREFIX;
/// Cache drives this node flushed at its last clean shutdown (their loss costs nothing).
pub const CACHE_CLEAN_PREFIX: &str = "/converge/cache-clean/";

/// This node's drives, opened.
pub struct Opened {
    pub tiers: HashMap<DriveId, Arc<Tier>>,
    pub caches: HashMap<DriveId, Arc<Cache>>,
    pub records: Vec<DriveRecord>,
}

fn blank_identity(
    cfg: &Config,
    cluster: ClusterId,
    role: DriveRole,
    media: MediaType,
) -> DriveIdentity {
    DriveIdentity {
        cluster,
        node: cfg.node_id,
        drive: DriveId(rand::random::<u64>() >> 1),
        slab_size_bytes: cfg.slab_size_bytes,
        role,
        media,
    }
}

fn check_owner(
    path: &std::path::Path,
    id: &DriveIdentity,
    cluster: ClusterId,
    me: NodeId,
) -> Result<()> {
    if id.cluster != cluster {
        bail!(
            "drive {} belongs to another cluster ({}), not this one ({cluster}); \
             it still holds that cluster's data. Use another path, or wipe it \
             (e.g. `truncate -s 0`) only if that data is no longer wanted",
            path.display(),
            id.cluster
        );
    }
    if id.node != me {
        bail!(
            "drive {} belongs to node {} of this cluster, not to node {me}; \
             give each node its own drives",
            path.display(),
            id.node,
        );
    }
    Ok(())
}

/// Opens (or formats, if blank) every configured drive, refusing drives of another cluster
/// or node. Capacity drives first; then each cache drive replays its log into them (so
/// every acked write is on capacity before anything else), and the capacity drives are
/// bound to the cache drives round-robin.
pub fn open_drives(cfg: &Config, cluster: ClusterId) -> Result<Opened> {
    let mut caps: HashMap<DriveId, Arc<Drive>> = HashMap::new();
    let mut records = Vec::new();
    let mut record = |id: &DriveIdentity,
                      d: &crate::config::DriveConfig,
                      size: u64,
                      extents: u64,
                      slots: u64| {
        records.push(DriveRecord {
            id: id.drive,
            node: cfg.node_id,
            path: d.path.display().to_string(),
            role: id.role,
            media: id.media,
            size_bytes: size,
            extents_total: extents,
            slab_size_bytes: id.slab_size_bytes,
            tbw_bytes: d.tbw_bytes,
            warranty_years: d.warranty_years,
            // A thin drive's slots beyond its data extents (docs/adr/0010).
            slots_total: (slots > extents).then_some(slots),
        });
    };
    let mut ids = BTreeSet::new();
    for d in cfg.drives.iter().filter(|d| d.role == DriveRole::Capacity) {
        let file = DirectFile::open(&d.path, d.size_bytes)
            .with_context(|| format!("opening drive {}", d.path.display()))?;
        let file: Arc<dyn BlockFile> = Arc::new(file);
        let drive = match Drive::probe(file.as_ref())
            .with_context(|| format!("reading the superblock of {}", d.path.display()))?
        {
            None => {
                if Cache::probe(file.as_ref()).ok().flatten().is_some() {
                    bail!(
                        "drive {} is a cache drive (it holds a cache log) but is configured with \
                         role \"capacity\"; set role = \"cache\" or use another path",
                        d.path.display()
                    );
                }
                let id = blank_identity(cfg, cluster, DriveRole::Capacity, d.media);
                log::info!(
                    "formatting new drive {} as {:016x}",
                    d.path.display(),
                    id.drive.0
                );
                Drive::format(file, id)
                    .with_context(|| format!("formatting {}", d.path.display()))?
            }
            Some(id) => {
                check_owner(&d.path, &id, cluster, cfg.node_id)?;
                Drive::open(file).with_context(|| format!("opening drive {}", d.path.display()))?
            }
        };
        let id = drive.identity().clone();
        if !ids.insert(id.drive) {
            bail!(
                "drive {} has the same id as another drive of this node (a copied file?)",
                d.path.display()
            );
        }
        let cap = drive.capacity();
        record(&id, d, cap.bytes_total, cap.extents_total, cap.slots_total);
        caps.insert(id.drive, Arc::new(drive));
    }
    let mut caches: HashMap<DriveId, Arc<Cache>> = HashMap::new();
    for d in cfg.drives.iter().filter(|d| d.role == DriveRole::Cache) {
        let file = DirectFile::open(&d.path, d.size_bytes)
            .with_context(|| format!("opening cache drive {}", d.path.display()))?;
        let file: Arc<dyn BlockFile> = Arc::new(file);
        match Drive::probe(file.as_ref()) {
            Ok(Some(id)) if id.role == DriveRole::Capacity => bail!(
                "drive {} holds a capacity drive's extents but is configured with role \
                 \"cache\"; formatting it as a cache would destroy them. Set role = \"capacity\", \
                 or wipe it only if that data is no longer wanted",
                d.path.display()
            ),
            _ => {}
        }
        match Cache::probe(file.as_ref()) {
            Ok(Some(id)) => check_owner(&d.path, &id, cluster, cfg.node_id)?,
            Ok(None) => {}
            Err(e) => bail!(
                "cache drive {}: {e}. Its un-destaged writes cannot be recovered from it; \
                 remove the file (or wipe the device) and start again: the node resyncs what \
                 it missed from the other copies",
                d.path.display()
            ),
        }
        let blank = blank_identity(cfg, cluster, DriveRole::Cache, d.media);
        let t = Instant::now();
        let (cache, report) = Cache::open(file, blank, &caps)
            .with_context(|| format!("opening cache drive {}", d.path.display()))?;
        let id = cache.identity().clone();
        if report.formatted {
            log::info!(
                "formatted new cache drive {} as {}",
                d.path.display(),
                id.drive
            );
        } else {
            log::info!(
                "cache drive {} ({}): replayed {} batches, destaged {} blocks in {:.1?}",
                d.path.display(),
                id.drive,
                report.batches_replayed,
                report.blocks_destaged,
                t.elapsed()
            );
        }
        if report.blocks_of_unknown_drives > 0 {
            log::warn!(
                "cache drive {}: {} logged blocks belong to capacity drives no longer configured; dropped",
                d.path.display(),
                report.blocks_of_unknown_drives
            );
        }
        if report.blocks_lost > 0 {
            bail!(
                "cache drive {}: {} logged blocks fail their checksum (media error); remove the \
                 file (or replace the device) so the node resyncs them from other copies",
                d.path.display(),
                report.blocks_lost
            );
        }
        if !ids.insert(id.drive) {
            bail!(
                "cache drive {} has the same id as another drive of this node (a copied file?)",
                d.path.display()
            );
        }
        cache.set_destage(
            cfg.knobs.cache_destage_bytes_per_s,
            cfg.knobs.cache_low_watermark_pct,
            cfg.knobs.cache_high_watermark_pct,
        );
        record(&id, d, cache.log_bytes(), 0, 0);
        caches.insert(id.drive, cache);
    }
    // Bind: capacity drives round-robin over cache drives, both in id order.
    let mut cap_ids: Vec<DriveId> = caps.keys().copied().collect();
    cap_ids.sort();
    let mut cache_ids: Vec<DriveId> = caches.keys().copied().collect();
    cache_ids.sort();
    let mut tiers = HashMap::new();
    for (i, id) in cap_ids.iter().enumerate() {
        let tier = Arc::new(Tier::new(caps[id].clone()));
        if !cache_ids.is_empty() {
            let c = &caches[&cache_ids[i % cache_ids.len()]];
            tier.bind(c.clone());
            c.set_mode(CacheMode::default_for(caps[id].identity().media));
        }
        tiers.insert(*id, tier);
    }
    for c in caches.values() {
        c.start();
    }
    Ok(Opened {
        tiers,
        caches,
        records,
    })
}

/// Capacity drives whose cache drive was lost since the last run: the cache drive this
/// node published last time (with drives bound) is gone or was formatted anew, and was
/// not flushed at a clean shutdown. Their copies may miss acked writes.
pub async fn lost_cache_drives(cluster: &Cluster, me: NodeId, opened: &Opened) -> Vec<DriveId> {
    let etcd = cluster.etcd();
    let prev: Vec<CacheInfo> = match etcd.get(&format!("{CACHES_PREFIX}{me}")).await {
        Ok(Some(kv)) => serde_json::from_slice(&kv.value).unwrap_or_default(),
        _ => Vec::new(),
    };
    let clean: Vec<DriveId> = match etcd.get(&format!("{CACHE_CLEAN_PREFIX}{me}")).await {
        Ok(Some(kv)) => serde_json::from_slice(&kv.value).unwrap_or_default(),
        _ => Vec::new(),
    };
    let _ = etcd.delete(&format!("{CACHE_CLEAN_PREFIX}{me}")).await;
    let mut lost = BTreeSet::new();
    for c in prev {
        if opened.caches.contains_key(&c.drive) || clean.contains(&c.drive) {
            continue;
        }
        for d in c.bound {
            if opened.tiers.contains_key(&d) {
                lost.insert(d);
            }
        }
    }
    lost.into_iter().collect()
}

/// Keeps this node out of the cluster until the copies on `drives` are no longer in sync
/// (owners mark the copies of a node that is down stale, and resync them when it returns):
/// waits for the previous run's registration to expire, then for the stale marks. Reads
/// therefore never reach a copy that lost writes with its cache drive.
pub async fn fence_out(cluster: &Cluster, me: NodeId, drives: &[DriveId], limit: Duration) {
    log::warn!(
        "the cache drive of capacity drives {drives:?} was lost: their copies may miss acked \
         writes; staying out of the cluster until those copies are marked stale (then they \
         are resynced from the other copies)"
    );
    let start = Instant::now();
    loop {
        let registered = matches!(
            cluster.live_nodes().await,
            Ok(ns) if ns.iter().any(|n| n.id == me)
        );
        let in_sync = if registered {
            usize::MAX
        } else {
            in_sync_copies(cluster, drives).await.unwrap_or(usize::MAX)
        };
        if in_sync == 0 {
            log::info!("copies on the lost cache's drives are stale; joining (they resync)");
            return;
        }
        if start.elapsed() > limit {
            log::error!(
                "after {limit:?}, {} copies on drives {drives:?} are still in sync (no other \
                 copy could take over, or no owner is running); joining anyway: blocks that \
                 were only in the lost cache are lost on those copies",
                if in_sync == usize::MAX {
                    "some".to_string()
                } else {
                    in_sync.to_string()
                }
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn in_sync_copies(cluster: &Cluster, drives: &[DriveId]) -> Result<usize> {
    let mut n = 0;
    for v in cluster
        .volumes()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
    {
        for (rec, _) in cluster
            .slabs(v.id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .values()
        {
            n += rec
                .extents
                .iter()
                .filter(|e| drives.contains(&e.drive) && e.state == ExtentState::InSync)
                .count();
        }
    }
    Ok(n)
}

/// The mode a cache drive should be in: the node's setting, else the pool's, else the
/// default for the media of the capacity drives bound to it.
pub fn effective_mode(
    settings: &converge_api::Settings,
    me: NodeId,
    bound_media: Option<MediaType>,
) -> CacheMode {
    settings
        .node_cache_modes
        .get(&me)
        .copied()
        .or(settings.cache_mode)
        .unwrap_or_else(|| CacheMode::default_for(bound_media.unwrap_or(MediaType::Ssd)))
}

/// A cache drive's counters (used, dirty, clean, destage rate, hit ratio) reach etcd at most
/// this often; its mode, binding and failure at once. An idle cache writes nothing.
const COUNTERS_PUBLISH_EVERY: Duration = Duration::from_secs(30);

/// Whether `now` must be published, given what was published last and when.
fn publish_due(last: Option<&(Vec<CacheInfo>, Instant)>, now: &[CacheInfo]) -> bool {
    let Some((prev, at)) = last else {
        return true;
    };
    let settled = |c: &CacheInfo| {
        (
            c.node,
            c.drive,
            c.path.clone(),
            c.media,
            c.mode,
            c.bound.clone(),
            c.log_bytes,
            c.failed.clone(),
        )
    };
    if prev.len() != now.len() || prev.iter().zip(now).any(|(a, b)| settled(a) != settled(b)) {
        return true;
    }
    prev.as_slice() != now && at.elapsed() >= COUNTERS_PUBLISH_EVERY
}

/// Applies the cache mode settings every second, and publishes this node's caches when
/// they change ([`publish_due`]).
pub async fn run(node: Arc<Node>) {
    if node.caches.is_empty() {
        // Still clear what an earlier run with cache drives published.
        let _ = node
            .cluster
            .etcd()
            .delete(&format!("{CACHES_PREFIX}{}", node.cfg.node_id))
            .await;
        return;
    }
    let mut last: HashMap<DriveId, (u64, Instant)> = HashMap::new();
    let mut published: Option<(Vec<CacheInfo>, Instant)> = None;
    loop {
        for (id, c) in &node.caches {
            if let Some(why) = c.failure() {
                let bound: Vec<DriveId> = node
                    .drives
                    .iter()
                    .filter(|(_, t)| t.cache().is_some_and(|b| Arc::ptr_eq(&b, c)))
                    .map(|(d, _)| *d)
                    .collect();
                if !bound.is_empty() {
                    cache_failed(&node, *id, &why, &bound).await;
                }
            }
        }
        let settings = crate::repair::settings(&node).await;
        let infos = infos(&node, &settings, &mut last);
        if publish_due(published.as_ref(), &infos) {
            if let Ok(b) = serde_json::to_vec(&infos) {
                match node
                    .cluster
                    .etcd()
                    .put(&format!("{CACHES_PREFIX}{}", node.cfg.node_id), &b, None)
                    .await
                {
                    Ok(_) => published = Some((infos, Instant::now())),
                    Err(e) => log::debug!("publishing cache state: {e}"),
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A cache drive failed at run time: its bound drives' copies may miss the writes it held.
/// The node leaves the cluster (its volumes fail over, owners mark its copies stale, as for
/// any node that is down), unbinds the cache from those drives once the copies are stale,
/// and joins again: the copies are then delta-resynced from the other copies.
async fn cache_failed(node: &Node, cache: DriveId, why: &str, bound: &[DriveId]) {
    use std::sync::atomic::Ordering;
    log::error!(
        "cache drive {cache} failed ({why}); leaving the cluster until the copies on drives          {bound:?} are stale, then they run without a cache and are resynced"
    );
    node.fenced.store(true, Ordering::Release);
    node.tenure.revoke();
    node.drop_all_volumes().await;
    let etcd = node.cluster.etcd();
    if let Err(e) = etcd.lease_revoke(node.lease()).await {
        log::warn!("revoking the node lease: {e}; waiting for it to expire");
    }
    let limit = Duration::from_secs(node.cfg.knobs.node_lease_ttl_s * 3 + 60);
    fence_out(&node.cluster, node.cfg.node_id, bound, limit).await;
    for d in bound {
        if let Some(t) = node.drives.get(d) {
            t.unbind();
        }
    }
    loop {
        match node.grant_lease().await {
            Ok(l) => match node.cluster.register_node(&node.node_record(), l).await {
                Ok(()) => break,
                Err(e) => log::error!("registering again after the cache failure: {e}"),
            },
            Err(e) => log::error!("etcd lease grant failed: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    node.fenced.store(false, Ordering::Release);
    log::info!("joined again without cache drive {cache}; drives {bound:?} resync");
}

fn infos(
    node: &Node,
    settings: &converge_api::Settings,
    last: &mut HashMap<DriveId, (u64, Instant)>,
) -> Vec<CacheInfo> {
    let mut out = Vec::new();
    for (id, c) in &node.caches {
        let bound = c.bound();
        let media = bound
            .first()
            .and_then(|d| node.drives.get(d))
            .map(|t| t.identity().media);
        let mode = effective_mode(settings, node.cfg.node_id, media);
        c.set_mode(mode);
        // The advisor simulates the tier in the mode it is in (one mode per node: with
        // several cache drives, the last one's).
        node.sampler.set_tier(
            node.caches.values().map(|c| c.log_bytes()).sum(),
            node.cfg.knobs.cache_low_watermark_pct,
            node.cfg.knobs.cache_high_watermark_pct,
            mode,
        );
        let s = c.stats();
        let now = Instant::now();
        let rate = match last.insert(*id, (s.destaged_bytes, now)) {
            Some((b, t)) if now > t => {
                s.destaged_bytes.saturating_sub(b) as f64 / (now - t).as_secs_f64()
            }
            _ => 0.0,
        };
        let reads = s.read_hit_blocks + s.read_miss_blocks;
        out.push(CacheInfo {
            node: node.cfg.node_id,
            drive: *id,
            path: node.cache_paths.get(id).cloned().unwrap_or_default(),
            media: c.identity().media,
            mode,
            bound,
            log_bytes: s.log_bytes,
            used_bytes: s.used_bytes,
            dirty_bytes: s.dirty_bytes,
            clean_bytes: s.clean_bytes,
            destage_bytes_per_s: rate,
            read_hit_ratio: (reads > 0).then(|| s.read_hit_blocks as f64 / reads as f64),
            failed: s.failed,
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Destages everything this node's caches hold (`POST /v1/cache/flush`).
pub async fn flush_local(node: &Node) -> Result<serde_json::Value, String> {
    let t = Instant::now();
    let caches: Vec<Arc<Cache>> = node.caches.values().cloned().collect();
    let n = caches.len();
    let mut flushed = 0u64;
    for c in caches {
        let before = c.stats().dirty_bytes;
        tokio::task::spawn_blocking(move || c.flush())
            .await
            .map_err(|e| format!("flush task failed: {e}"))?
            .map_err(|e| e.to_string())?;
        flushed += before;
    }
    if n > 0 {
        node.sampler.flushed();
    }
    Ok(serde_json::json!({
        "node": node.cfg.node_id,
        "caches": n,
        "dirty_bytes_before": flushed,
        "seconds": t.elapsed().as_secs_f64(),
    }))
}

/// At a clean shutdown: destage everything (bounded by `limit`) and record which cache
/// drives are clean, so removing one afterwards costs no resync.
pub async fn shutdown(node: &Node, limit: Duration) {
    if node.caches.is_empty() {
        return;
    }
    let mut clean = Vec::new();
    for (id, c) in &node.caches {
        let c2 = c.clone();
        let r = tokio::time::timeout(limit, tokio::task::spawn_blocking(move || c2.flush())).await;
        match r {
            Ok(Ok(Ok(()))) => clean.push(*id),
            _ => log::warn!(
                "cache drive {id} was not fully destaged at shutdown; it replays at the next start"
            ),
        }
        c.stop();
    }
    if let Ok(b) = serde_json::to_vec(&clean) {
        let _ = node
            .cluster
            .etcd()
            .put(
                &format!("{CACHE_CLEAN_PREFIX}{}", node.cfg.node_id),
                &b,
                None,
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(dirty: u64) -> CacheInfo {
        CacheInfo {
            node: NodeId(1),
            drive: DriveId(7),
            path: "/dev/nvme0n1".into(),
            media: MediaType::Nvme,
            mode: CacheMode::Write,
            bound: vec![DriveId(8)],
            log_bytes: 1 << 30,
            used_bytes: dirty,
            dirty_bytes: dirty,
            clean_bytes: 0,
            destage_bytes_per_s: 0.0,
            read_hit_ratio: None,
            failed: None,
        }
    }

    #[test]
    fn an_idle_cache_is_not_republished_and_counters_wait_their_turn() {
        let now = vec![cache(4096)];
        assert!(publish_due(None, &now), "the first state is published");
        let just = (now.clone(), Instant::now());
        assert!(!publish_due(Some(&just), &now), "nothing changed");
        assert!(
            !publish_due(Some(&just), &[cache(8192)]),
            "counters wait for their interval"
        );
        let long_ago = (
            now.clone(),
            Instant::now() - COUNTERS_PUBLISH_EVERY - Duration::from_secs(1),
        );
        assert!(publish_due(Some(&long_ago), &[cache(8192)]));
        assert!(
            !publish_due(Some(&long_ago), &now),
            "an idle cache writes nothing"
        );
        let mut failed = cache(4096);
        failed.failed = Some("I/O error".into());
        assert!(
            publish_due(Some(&just), &[failed]),
            "a failure goes out at once"
        );
        let mut mode = cache(4096);
        mode.mode = CacheMode::ReadWrite;
        assert!(
            publish_due(Some(&just), &[mode]),
            "a mode change goes out at once"
        );
        assert!(
            publish_due(Some(&just), &[]),
            "a cache gone goes out at once"
        );
    }
}
