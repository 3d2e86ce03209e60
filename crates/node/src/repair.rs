//! Restoring redundancy in the background. Every node runs [`run`], which carries out the
//! repair policy of `converge_allocator::repair` (the simulator runs the same policy):
//!
//! * For each volume it owns, a copy whose node lost its lease or is in maintenance, or
//!   whose drive failed, is marked stale.
//! * For each volume it owns, each `stale` copy whose node is live and answers is brought
//!   back by a delta resync (only the blocks that differ are copied).
//! * A stale copy on a failed drive, or whose node has been down longer than the repair
//!   delay, is rebuilt on another node's drive (placement excludes nodes that already hold a copy); if no drive
//!   has room, `status` says so.
//! * A copy on a node being drained (`converge node remove`) moves to another node, copy
//!   before drop: the new copy fills beside the old one, which is dropped and freed only
//!   once the slab has its full count of in-sync copies without it.
//! * The node holding the leader lease takes ownership of degraded volumes nobody serves,
//!   so they are repaired even when no client is connected, and of volumes nobody serves
//!   that still have copies on a draining node, so those are moved.
//!
//! Jobs run one at a time per node, throttled by `resync_bytes_per_s`, and are published
//! in etcd (under the node's lease) so `converge status` on any node shows them.

use crate::node::{drive_loads, Node, Route, Vol};
use converge_allocator::repair::{self, Cause, DownClock, Step, View};
use converge_api::JobInfo;
use converge_types::{ExtentKey, ExtentState, NodeId, SlabIndex, VolumeId, BLOCK_SIZE};
use converge_volume::resync::Progress;
use converge_volume::{ExtentLoc, VolumeError};
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const JOBS_PREFIX: &str = "/converge/jobs/";
pub const LEADER_KEY: &str = "/converge/leader";
pub const SETTINGS_KEY: &str = "/converge/settings";

/// Cluster-wide settings (defaults when absent or unreadable).
pub async fn settings(node: &Node) -> converge_api::Settings {
    match node.cluster.etcd().get(SETTINGS_KEY).await {
        Ok(Some(kv)) => serde_json::from_slice(&kv.value).unwrap_or_default(),
        _ => Default::default(),
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct Running {
    info: JobInfo,
    progress: Arc<Progress>,
    started: Instant,
}

/// This node's jobs and their totals (for /metrics).
#[derive(Default)]
pub struct Jobs {
    next: AtomicU64,
    running: Mutex<BTreeMap<u64, Running>>,
    pub resync_done: AtomicU64,
    pub rebuild_done: AtomicU64,
    pub failed: AtomicU64,
    pub bytes_copied: AtomicU64,
    pub blocks_written: AtomicU64,
}

/// Removes the job from the running list when dropped.
pub struct JobGuard<'a> {
    jobs: &'a Jobs,
    id: u64,
    pub progress: Arc<Progress>,
}

impl Drop for JobGuard<'_> {
    fn drop(&mut self) {
        self.jobs
            .running
            .lock()
            .expect("jobs lock poisoned")
            .remove(&self.id);
    }
}

impl Jobs {
    pub fn start(&self, info: JobInfo) -> JobGuard<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let progress = Arc::new(Progress::default());
        self.running.lock().expect("jobs lock poisoned").insert(
            id,
            Running {
                info,
                progress: progress.clone(),
                started: Instant::now(),
            },
        );
        JobGuard {
            jobs: self,
            id,
            progress,
        }
    }

    /// Starts a job of this node (`kind`: resync, rebuild, scrub) and lists it.
    pub fn begin(
        &self,
        node: NodeId,
        kind: &str,
        volume: &str,
        slab: SlabIndex,
        detail: String,
    ) -> JobGuard<'_> {
        self.start(JobInfo {
            kind: kind.into(),
            node,
            volume: volume.to_string(),
            slab: slab.0,
            detail,
            bytes_done: 0,
            bytes_total: 0,
            started_unix: unix_now(),
            eta_s: None,
        })
    }

    /// Counts what a finished resync or rebuild copied.
    fn copied(&self, r: &converge_volume::resync::CopyReport) {
        self.bytes_copied
            .fetch_add(r.blocks_differing * BLOCK_SIZE as u64, Ordering::Relaxed);
        self.blocks_written
            .fetch_add(r.blocks_written, Ordering::Relaxed);
    }

    /// Running jobs with their progress and ETA.
    pub fn list(&self) -> Vec<JobInfo> {
        let r = self.running.lock().expect("jobs lock poisoned");
        r.values()
            .map(|j| {
                let mut i = j.info.clone();
                i.bytes_done = j.progress.bytes_done.load(Ordering::Relaxed);
                i.bytes_total = j.progress.bytes_total.load(Ordering::Relaxed);
                let secs = j.started.elapsed().as_secs_f64();
                i.eta_s = (i.bytes_done > 0 && i.bytes_total >= i.bytes_done).then(|| {
                    let rate = i.bytes_done as f64 / secs.max(0.001);
                    ((i.bytes_total - i.bytes_done) as f64 / rate) as u64
                });
                i
            })
            .collect()
    }
}

/// A running job's progress reaches etcd at most this often; a job starting or ending at
/// once (within the publisher's second).
const PROGRESS_PUBLISH_EVERY: Duration = Duration::from_secs(5);

/// Publishes this node's jobs to etcd while any run: when the set of jobs changes, and
/// their progress every [`PROGRESS_PUBLISH_EVERY`].
pub async fn publish(node: Arc<Node>) {
    let key = format!("{JOBS_PREFIX}{}", node.cfg.node_id);
    // The jobs last published (by what identifies them) and when; None: nothing is.
    let mut published: Option<(Vec<JobKey>, std::time::Instant)> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let jobs = node.jobs.list();
        let etcd = node.cluster.etcd();
        if jobs.is_empty() {
            if published.is_some() && etcd.delete(&key).await.is_ok() {
                published = None;
            }
            continue;
        }
        let keys: Vec<JobKey> = jobs.iter().map(job_key).collect();
        let due = published
            .as_ref()
            .is_none_or(|(k, at)| *k != keys || at.elapsed() >= PROGRESS_PUBLISH_EVERY);
        if !due {
            continue;
        }
        match serde_json::to_vec(&jobs) {
            Ok(v) => match etcd.put(&key, &v, Some(node.lease())).await {
                Ok(_) => published = Some((keys, std::time::Instant::now())),
                Err(e) => log::debug!("publishing jobs: {e}"),
            },
            Err(e) => log::warn!("encoding jobs: {e}"),
        }
    }
}

/// What tells one job from another in the published list.
type JobKey = (String, String, u64);

fn job_key(j: &JobInfo) -> JobKey {
    (j.kind.clone(), j.volume.clone(), j.slab)
}

/// Every node's published jobs.
pub async fn all_jobs(node: &Node) -> Vec<JobInfo> {
    let Ok((kvs, _)) = node.cluster.etcd().get_prefix(JOBS_PREFIX).await else {
        return node.jobs.list();
    };
    let mut out: Vec<JobInfo> = kvs
        .iter()
        .filter_map(|kv| serde_json::from_slice::<Vec<JobInfo>>(&kv.value).ok())
        .flatten()
        .collect();
    out.sort_by(|a, b| (a.node, &a.volume, a.slab).cmp(&(b.node, &b.volume, b.slab)));
    out
}

/// The repair loop (see the module docs). The decisions are the shared repair policy's
/// (`converge_allocator::repair`, which the simulator runs too); this loop carries them
/// out with jobs that `converge status` lists.
pub async fn run(node: Arc<Node>) {
    let mut down = DownClock::default();
    // Unowned volumes the leader found it could not serve, each reported once.
    let mut unservable = HashSet::new();
    let mut warned: HashSet<(String, SlabIndex)> = HashSet::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        report_failed_drives(&node).await;
        let view = match View::read(&node.cluster).await {
            Ok(v) => v,
            Err(e) => {
                log::debug!("repair: etcd: {e}");
                continue;
            }
        };
        if !view.live.contains(&node.cfg.node_id) {
            if let Ok(true) = node.cluster.is_removed(node.cfg.node_id).await {
                // `converge node remove` finished: nothing of the cluster is here any more.
                log::warn!(
                    "node {} was removed from the cluster (converge node remove); stopping",
                    node.cfg.node_id
                );
                crate::creds::mark_removed(&node.cfg.tls_dir, node.cfg.node_id.0);
                node.drop_all_volumes().await;
                std::process::exit(0);
            }
            // Our own lease expired (we were paused or cut off): we may have been deposed;
            // judge nobody until the keepalive has registered us again.
            continue;
        }
        let now = tokio::time::Instant::now();
        down.observe(&view, now);
        if view.maintenance.contains(&node.cfg.node_id) && !node.volumes.lock().await.is_empty() {
            let names: Vec<String> = node.volumes.lock().await.keys().cloned().collect();
            log::info!("in maintenance: still serving {names:?} until they are moved");
        }
        if is_leader(&node).await {
            adopt_orphans(&node, &view, &mut unservable).await;
            if !scrub_running(&node) {
                let n = node.clone();
                tokio::spawn(async move { crate::scrub::scheduled(&n).await });
            }
        }
        let delay = settings(&node)
            .await
            .repair_delay_s
            .unwrap_or(node.cfg.knobs.repair_delay_s);
        let vols: Vec<Arc<Vol>> = node.volumes.lock().await.values().cloned().collect();
        for v in vols {
            if let Err(e) = v.reconcile_suspect().await {
                log::warn!(
                    "volume {}: reconciling after failed writes: {e}",
                    v.config().name
                );
            }
            for (idx, e) in repair::copies_to_mark_stale(&v.slab_map(), &view) {
                log::warn!(
                    "volume {}: node {} is down or in maintenance, or drive {} failed; its copy of slab {idx} is stale",
                    v.config().name,
                    e.node,
                    e.drive
                );
                if let Err(err) = v.copy_failed(idx, e.drive).await {
                    log::warn!("marking a copy stale: {err}");
                }
            }
            let stale = v.stale_extents();
            let resiliency = v.config().resiliency;
            let delay = Duration::from_secs(delay);
            let steps = repair::round(&v.slab_map(), &stale, &view, &down, delay, now, resiliency);
            for step in steps {
                match step {
                    Step::Resync(idx, e) => {
                        if node.replicas.call_peer_or_local_ping(e.node).await.is_ok()
                            && resync(&node, &v, idx, e)
                                .await
                                .is_err_and(|e| e.is_no_space())
                        {
                            // Its drive has no room for it: placed elsewhere now, not
                            // resynced there for ever.
                            let cause = Some(Cause::NoRoom);
                            rebuild(&node, &v, idx, e, cause, &mut warned).await;
                        }
                    }
                    Step::Rebuild(idx, e, cause) => {
                        rebuild(&node, &v, idx, e, Some(cause), &mut warned).await
                    }
                    Step::Evacuate(idx, e) => rebuild(&node, &v, idx, e, None, &mut warned).await,
                    Step::Drop(idx, e) => drop_copy(&node, &v, idx, e).await,
                    Step::Promote(idx, e) => {
                        if let Err(err) = v.promote(idx, e.drive).await {
                            log::warn!(
                                "volume {}: slab {idx}: promoting the copy on drive {}: {err}",
                                v.config().name,
                                e.drive
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Resyncs the stale copy `e`, logging how it went; the error, if it failed.
async fn resync(node: &Node, v: &Vol, idx: SlabIndex, e: ExtentLoc) -> Result<(), VolumeError> {
    let name = v.config().name.clone();
    let job = node.jobs.begin(
        node.cfg.node_id,
        "resync",
        &name,
        idx,
        format!("copy on node {} drive {}", e.node, e.drive),
    );
    let t = Instant::now();
    match v.resync(idx, e.drive, &node.throttle, &job.progress).await {
        Ok(r) => {
            node.jobs.resync_done.fetch_add(1, Ordering::Relaxed);
            node.jobs.copied(&r);
            // A copy filled while the volume had no snapshot kept what it held of deleted
            // ones: released now (one record read; nothing more if none is listed).
            crate::snapshots::release_stray_floors(&node.cluster, v).await;
            log::info!(
                "resync of volume {name} slab {idx} on node {} done in {:.1}s: {} of {} blocks differed",
                e.node,
                t.elapsed().as_secs_f64(),
                r.blocks_differing,
                r.blocks_compared
            );
            Ok(())
        }
        Err(err) => {
            node.jobs.failed.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "resync of volume {name} slab {idx} on node {}: {err}",
                e.node
            );
            Err(err)
        }
    }
}

/// Replaces the copy `e` by a new one on another node: a rebuild (`cause`), or with no
/// cause an evacuation of a draining node's in-sync copy (copy before drop).
async fn rebuild(
    node: &Node,
    v: &Vol,
    idx: SlabIndex,
    e: ExtentLoc,
    cause: Option<Cause>,
    warned: &mut HashSet<(String, SlabIndex)>,
) {
    let name = v.config().name.clone();
    let Some(map) = v.slab_map().get(&idx).cloned() else {
        return;
    };
    let loads = match drive_loads(&node.cluster).await {
        Ok(l) => l,
        Err(err) => {
            log::debug!("rebuild: {err}");
            return;
        }
    };
    // A failed drive's node may take the new copy on another of its drives.
    let replacing = cause.and_then(|c| c.replacing(&e));
    let new = match repair::rebuild_target(&map, replacing, &loads) {
        Ok(n) => n,
        Err(err) => {
            if warned.insert((name.clone(), idx)) {
                log::warn!(
                    "volume {name} slab {idx}: the copy on node {} cannot be rebuilt: {err}",
                    e.node
                );
            }
            return;
        }
    };
    let (kind, why) = match cause {
        Some(Cause::FailedDrive) => ("rebuild", "its drive failed"),
        Some(Cause::DownPastDelay) => ("rebuild", "down past the repair delay"),
        Some(Cause::Draining) => ("rebuild", "its node is being drained"),
        Some(Cause::NoRoom) => ("rebuild", "its drive has no room for it"),
        None => (
            "evacuate",
            "its node is being drained; copied before it is dropped",
        ),
    };
    let job = node.jobs.begin(
        node.cfg.node_id,
        kind,
        &name,
        idx,
        format!(
            "replaces the copy on node {} drive {} ({why}) with node {} drive {}",
            e.node, e.drive, new.node, new.drive
        ),
    );
    let t = Instant::now();
    let done = match cause {
        Some(_) => {
            v.rebuild(idx, e.drive, new, &node.throttle, &job.progress)
                .await
        }
        None => {
            v.evacuate(idx, e.drive, new, &node.throttle, &job.progress)
                .await
        }
    };
    match done {
        Ok(r) => {
            warned.remove(&(name.clone(), idx));
            node.jobs.rebuild_done.fetch_add(1, Ordering::Relaxed);
            node.jobs.copied(&r);
            log::info!(
                "{kind}: volume {name} slab {idx} now on node {} instead of node {}, in {:.1}s ({} blocks)",
                new.node,
                e.node,
                t.elapsed().as_secs_f64(),
                r.blocks_written
            );
            free_copy(node, v, idx, e).await;
        }
        Err(err) => {
            node.jobs.failed.fetch_add(1, Ordering::Relaxed);
            log::warn!("{kind} of volume {name} slab {idx}: {err}");
        }
    }
}

/// Frees a replaced or dropped copy's extent on its node. A down node's extent is freed
/// if it ever comes back (orphan extents are reclaimed at start-up).
async fn free_copy(node: &Node, v: &Vol, idx: SlabIndex, e: ExtentLoc) {
    let key = ExtentKey {
        volume: v.config().id,
        slab: idx,
    };
    if let Err(err) = node.replicas.free(e.node, e.drive, key).await {
        log::debug!("freeing the replaced copy on node {}: {err}", e.node);
    }
}

/// Drops a draining node's copy that the slab no longer needs (an evacuation stopped
/// between its copy and its drop), and frees it.
async fn drop_copy(node: &Node, v: &Vol, idx: SlabIndex, e: ExtentLoc) {
    match v.drop_copy(idx, e.drive).await {
        Ok(()) => {
            log::info!(
                "volume {}: slab {idx}: dropped the copy on draining node {}",
                v.config().name,
                e.node
            );
            free_copy(node, v, idx, e).await;
        }
        Err(err) => log::warn!(
            "volume {}: slab {idx}: dropping the copy on node {}: {err}",
            v.config().name,
            e.node
        ),
    }
}

/// Records this node's drives that failed (I/O errors) in etcd, once each.
async fn report_failed_drives(node: &Node) {
    for (id, d) in &node.drives {
        if let Some(reason) = d.failure() {
            let first = node
                .failed_reported
                .lock()
                .expect("lock poisoned")
                .insert(*id);
            if first {
                log::error!("drive {id} failed: {reason}; its copies will be rebuilt elsewhere");
                if let Err(e) = node.cluster.set_drive_failed(*id, Some(&reason)).await {
                    log::warn!("recording the failure of drive {id}: {e}");
                    node.failed_reported
                        .lock()
                        .expect("lock poisoned")
                        .remove(id);
                }
            }
        }
    }
}

fn scrub_running(node: &Node) -> bool {
    node.jobs.list().iter().any(|j| j.kind == "scrub")
}

/// Holds (or takes) the leader lease key.
pub(crate) async fn is_leader(node: &Node) -> bool {
    let etcd = node.cluster.etcd();
    let me = node.cfg.node_id.to_string();
    match etcd.get(LEADER_KEY).await {
        Ok(Some(kv)) => kv.value == me.as_bytes(),
        Ok(None) => etcd
            .create(LEADER_KEY, me.as_bytes(), Some(node.lease()))
            .await
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Leader duty: serve (and so repair) volumes that have no owner and are degraded, or
/// have copies on a node whose lease is gone (an owner that died with them marked nobody
/// stale: with no client I/O to claim the volume, nothing would rebuild them), or on a
/// draining node (so they are moved). One that no takeover could serve (a slab without
/// enough copies in sync on live nodes) is not claimed until it can be: a claim takes a new
/// epoch, and a failed one would take another the next second. `unservable` holds those
/// found so at the last pass, so each is logged once while it lasts.
async fn adopt_orphans(node: &Node, view: &View, unservable: &mut HashSet<VolumeId>) {
    let Ok(vols) = node.cluster.volumes().await else {
        return;
    };
    let Ok(draining) = node.cluster.draining_nodes().await else {
        return;
    };
    if draining.contains(&node.cfg.node_id) {
        // A node on its way out takes on no volumes.
        return;
    }
    let mut still = HashSet::new();
    for rec in vols {
        if matches!(node.cluster.owner(rec.id).await, Ok(Some(_)) | Err(_)) {
            continue;
        }
        let Ok(slabs) = node.cluster.slabs(rec.id).await else {
            continue;
        };
        let degraded = slabs
            .values()
            .any(|(s, _)| s.extents.iter().any(|e| e.state != ExtentState::InSync));
        let draining = slabs
            .values()
            .any(|(s, _)| s.extents.iter().any(|e| draining.contains(&e.node)));
        let on_dead = slabs
            .values()
            .any(|(s, _)| s.extents.iter().any(|e| !view.live.contains(&e.node)));
        if !(degraded || draining || on_dead) {
            continue;
        }
        let by_slab = slabs.iter().map(|(i, (s, _))| (*i, s.extents.as_slice()));
        if let Some((idx, answering, needed)) =
            converge_allocator::repair::unservable_slab(by_slab, rec.resiliency, view)
        {
            node.takeovers_deferred
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            still.insert(rec.id);
            if !unservable.contains(&rec.id) {
                log::warn!(
                    "leader: volume {} is unowned and cannot be served: {answering} of the \
                     {needed} copies of slab {idx} a read needs are in sync on a live node \
                     and drive; it is taken over once they are back (no epoch is spent until \
                     then)",
                    rec.name
                );
            }
            continue;
        }
        if unservable.contains(&rec.id) {
            log::info!("leader: volume {} can be served again", rec.name);
        }
        log::info!(
            "leader: volume {} is unowned and {}; taking it over",
            rec.name,
            if degraded {
                "degraded"
            } else if on_dead {
                "has copies on a node that is down"
            } else {
                "has copies on a draining node"
            }
        );
        match node.open_volume(&rec.name).await {
            Ok(Route::Local(_)) | Ok(Route::Remote { .. }) => {}
            Err(crate::node::OpenError::Unknown) => {}
            Err(crate::node::OpenError::Unavailable(e)) => {
                log::warn!("leader: volume {}: {e}", rec.name)
            }
        }
    }
    *unservable = still;
}
