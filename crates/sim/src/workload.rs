//! Clients and the background repairer.
//!
//! Clients write random block ranges with self-describing content, read random ranges
//! (every block checked against the history), and zero some ranges. Every write is
//! recorded before it is issued and its outcome after, including "aborted" when its owner
//! died under it.

use crate::control::SimKv;
use crate::history::Outcome;
use crate::owner::{is_current, span_blocks, volume_blocks, Owner};
use crate::replicas::SimReplicas;
use crate::world::{lock, World};
use converge_allocator::drive_loads;
use converge_allocator::repair::{self, Cause, DownClock, Step, View};
use converge_control::Cluster;
use converge_types::{ExtentKey, ExtentOp, NodeId, SlabIndex, BLOCK_SIZE};
use converge_volume::resync::{Progress, Throttle};
use converge_volume::{ExtentLoc, ReplicaIo, VolumeError};
use rand::Rng;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const BS: u64 = BLOCK_SIZE as u64;

/// The owner a client sends its next request to: the zombie it is still attached to, or
/// the current owner.
fn owner_for(w: &World, v: usize, c: usize) -> Option<Arc<Owner>> {
    let mut vols = lock(&w.vols);
    let r = &mut vols[v];
    if let Some(z) = r.pins[c].clone() {
        if z.alive() {
            return Some(z);
        }
        r.pins[c] = None;
    }
    r.current.clone().filter(|o| o.alive())
}

enum Op {
    Write,
    Zero,
    Trim,
    Read,
}

pub(crate) async fn client(w: Arc<World>, v: usize, c: usize) {
    let (blocks, tag, slab_blocks, parity) = {
        let vols = lock(&w.vols);
        let spec = &vols[v].spec;
        (
            volume_blocks(&w, spec),
            vols[v].id.0,
            span_blocks(&w, spec),
            spec.resiliency.is_parity(),
        )
    };
    while !w.stopping() {
        tokio::time::sleep(w.us(0, w.opts.think_us)).await;
        let Some(owner) = owner_for(&w, v, c) else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let (op, first, n) = w.rng(|r| {
            let n = r.gen_range(1..=w.opts.io_blocks_max.min(blocks));
            let first = r.gen_range(0..=blocks - n);
            match r.gen_range(0..100) {
                0..=54 => (Op::Write, first, n),
                55..=61 => (Op::Zero, first, n),
                // A TRIM of one or two whole slabs (a guest's fstrim): thin reclaim
                // releases them.
                62..=64 if blocks >= slab_blocks => {
                    let slabs = blocks / slab_blocks;
                    let k = r.gen_range(1..=2.min(slabs));
                    let s = r.gen_range(0..=slabs - k);
                    (Op::Trim, s * slab_blocks, k * slab_blocks)
                }
                62..=64 => (Op::Zero, first, n),
                _ => (Op::Read, first, n),
            }
        });
        match op {
            Op::Write | Op::Zero | Op::Trim => {
                let zero = !matches!(op, Op::Write);
                let trim = matches!(op, Op::Trim);
                let id = lock(&w.hist).issue(v, first, n, zero, owner.epoch);
                let vol = owner.vol.clone();
                let h = if zero {
                    owner.spawn(async move { vol.zero(first * BS, n * BS, trim).await })
                } else {
                    let mut data = Vec::with_capacity((n * BS) as usize);
                    for b in first..first + n {
                        crate::content::push_block(&mut data, tag, b, id);
                    }
                    let data = bytes::Bytes::from(data);
                    owner.spawn(async move { vol.write(first * BS, data).await })
                };
                let r = match h {
                    Some(h) => h.await.ok(),
                    None => None,
                };
                let outcome = match &r {
                    Some(Ok(())) => Outcome::Acked,
                    Some(Err(e)) => Outcome::Failed(e.to_string()),
                    None => Outcome::Aborted,
                };
                let issue = lock(&w.hist).get(id).map_or(0, |r| r.issue);
                w.trace(|| {
                    format!(
                        "c{v}.{c} w{id} {} blocks {first}..{} epoch {}: {}",
                        if zero { "zero" } else { "write" },
                        first + n,
                        owner.epoch,
                        match &r {
                            Some(Ok(())) => "ACKED".to_string(),
                            Some(Err(e)) => format!("failed: {e}"),
                            None => "aborted (owner died)".to_string(),
                        }
                    )
                });
                let mut outcome = outcome;
                if trim && parity && outcome == Outcome::Acked {
                    // A TRIM of a parity slab is a hint: the slab is released (reads zeros)
                    // only with every chunk in sync, else left as it is (a zero of part of
                    // a row would be a row write). Either may be read back: it is recorded
                    // as an unacked zero. (So a deposed owner may ack one: it changed
                    // nothing, since releasing the slab is fenced by the owner's epoch.)
                    w.count("parity TRIMs acked (hints: recorded as unacked)");
                    outcome = Outcome::Failed("a TRIM of a parity volume is a hint".into());
                }
                let hint = trim && parity;
                if let (Some(Ok(())), Some(t), false) = (&r, owner.superseded_at(), hint) {
                    let known = owner.vol.slab_map();
                    let untouched = zero
                        && (first / slab_blocks..=(first + n - 1) / slab_blocks)
                            .all(|s| !known.contains_key(&converge_types::SlabIndex(s)));
                    if issue > t && untouched && !w.opts.check_unallocated_zero_fencing {
                        // Known issue: a zero of a slab this owner never allocated is acked
                        // from its own slab map, with no replica I/O, so nothing fences it.
                        // It changed nothing: record it as failed.
                        w.count(
                            "zeroes acked by a deposed owner without replica I/O (known issue)",
                        );
                        w.trace(|| format!("c{v}.{c} w{id}: acked by a deposed owner without touching any copy (known issue 3)"));
                        outcome =
                            Outcome::Failed("acked by a deposed owner without replica I/O".into());
                    } else if issue > t {
                        w.fail(format!(
                            "deposed owner (epoch {}) acked w{id} (vol{v} blocks {first}..{}) issued at tick {issue}, after the takeover completed at tick {t}",
                            owner.epoch,
                            first + n
                        ));
                    }
                }
                if trim && matches!(r, Some(Ok(()))) {
                    let map = owner.vol.slab_map();
                    if (first / slab_blocks..(first + n) / slab_blocks)
                        .any(|s| !map.contains_key(&converge_types::SlabIndex(s)))
                    {
                        w.count("whole-slab trims acked with a slab released");
                    }
                }
                match &r {
                    Some(Ok(())) => w.count("writes acked"),
                    Some(Err(VolumeError::Fenced { .. })) => w.count("writes fenced"),
                    Some(Err(VolumeError::Degraded { .. })) => w.count("writes degraded"),
                    Some(Err(_)) => w.count("writes failed"),
                    None => w.count("writes aborted"),
                }
                lock(&w.hist).finish(id, outcome);
            }
            Op::Read => {
                // Reads through a superseded owner are only checked for garbage: a deposed
                // owner may serve old data from a copy the takeover could not fence.
                let strict = owner.superseded_at().is_none();
                let issue = lock(&w.hist).tick();
                let vol = owner.vol.clone();
                let r = match owner.spawn(async move { vol.read(first * BS, n * BS).await }) {
                    Some(h) => h.await.ok(),
                    None => None,
                };
                let end = lock(&w.hist).tick();
                match r {
                    Some(Ok(data)) => {
                        w.count("reads ok");
                        if lock(&w.vols)[v].clone.is_some() {
                            w.count("clone reads ok");
                        }
                        let bad =
                            lock(&w.hist).check_read(v, tag, first, &data, issue, end, strict);
                        w.trace(|| {
                            format!(
                                "c{v}.{c} read blocks {first}..{} epoch {}: ok{}",
                                first + n,
                                owner.epoch,
                                if bad.is_empty() { "" } else { " BAD" }
                            )
                        });
                        for (blk, why) in bad {
                            let writes = crate::describe_block(&w, v, blk);
                            w.fail(format!(
                                "read via owner epoch {}: {why}\n{writes}",
                                owner.epoch
                            ));
                        }
                    }
                    Some(Err(e)) => {
                        w.count("reads failed");
                        if lock(&w.vols)[v].clone.is_some() {
                            w.count("clone reads failed");
                        }
                        w.trace(|| {
                            format!(
                                "c{v}.{c} read blocks {first}..{} epoch {}: failed: {e}",
                                first + n,
                                owner.epoch
                            )
                        });
                    }
                    None => w.count("reads aborted"),
                }
            }
        }
    }
}

/// What the daemon's repair loop does: reconcile slabs flagged after failed writes or
/// failed record changes (`Volume::reconcile_suspect`), run the repair policy
/// (`converge_allocator::repair`: mark the copies of nodes without a lease stale, resync
/// the copies of nodes that are back, rebuild elsewhere the copies of nodes down past the
/// repair delay), and now and then scrub (repairing rot) — always through the current
/// owner, on the owner's node's own view of the control plane.
pub(crate) async fn repairer(w: Arc<World>) {
    let throttle = Arc::new(Throttle::new(u64::MAX));
    // Each node's repair loop keeps its own down clock, which dies with its process.
    let mut clocks: HashMap<NodeId, (u64, DownClock)> = HashMap::new();
    let mut round = 0u64;
    while !w.stopping() {
        tokio::time::sleep(w.ms(w.opts.repair_period_ms.0, w.opts.repair_period_ms.1)).await;
        round += 1;
        let owners: Vec<(usize, Arc<Owner>)> = lock(&w.vols)
            .iter()
            .enumerate()
            .filter_map(|(v, r)| r.current.clone().map(|o| (v, o)))
            .collect();
        crate::check_copies(&w, "during the run", false);
        report_failed_drives(&w).await;
        // As the daemon's usage loop: drives that wrote nothing since the last round
        // checkpoint their journal.
        w.checkpoint_quiet_drives();
        for (v, o) in owners {
            if is_current(&w, v, &o) {
                let vol = o.vol.clone();
                if let Some(h) = o.spawn(async move { vol.reconcile_suspect().await }) {
                    match h.await {
                        Ok(Ok(0)) | Err(_) => {}
                        Ok(Ok(n)) => w.trace(|| {
                            format!(
                                "vol{v} epoch {}: reconciled suspect slabs: {n} blocks written",
                                o.epoch
                            )
                        }),
                        Ok(Err(e)) => w.trace(|| {
                            format!(
                                "vol{v} epoch {}: reconciling suspect slabs failed: {e}",
                                o.epoch
                            )
                        }),
                    }
                }
            }
            let incarnation = w.incarnation(o.node);
            let clock = clocks
                .entry(o.node)
                .or_insert_with(|| (incarnation, DownClock::default()));
            if clock.0 != incarnation {
                *clock = (incarnation, DownClock::default());
            }
            repair_volume(&w, v, &o, &mut clock.1, &throttle).await;
            rotate_volume(&w, v, &o, &throttle).await;
            if round.is_multiple_of(w.opts.scrub_every_rounds) && is_current(&w, v, &o) {
                scrub(&w, v, &o, true, &throttle).await;
                if w.is_up(o.node) {
                    w.reclaim_orphans(o.node);
                }
            }
        }
    }
}

/// What each node's repair loop does first: record its failed drives in the control plane
/// (through its own view of it: a cut-off node cannot, and tries again next round).
pub(crate) async fn report_failed_drives(w: &Arc<World>) {
    for (node, drive, reason) in w.unreported_failures() {
        let cluster = Cluster::new(SimKv {
            world: w.clone(),
            node,
        });
        let r = cluster.set_drive_failed(drive, Some(&reason)).await;
        if r.is_ok() {
            lock(&w.failures_reported).insert(drive);
        }
        w.trace(|| format!("node {node}: reporting drive {drive} failed ({reason}): {r:?}"));
    }
    // A node that started with a blank drive in the place of a lost one records the
    // missing drive failed, as the daemon's start-up does.
    for (node, present) in w.replaced_unreported() {
        let cluster = Cluster::new(SimKv {
            world: w.clone(),
            node,
        });
        let r = cluster.fail_missing_drives(node, &present).await;
        if let Ok(drives) = &r {
            if !drives.is_empty() {
                w.count("missing drives recorded failed at a start");
            }
            lock(&w.replaced_on).remove(&node);
            lock(&w.failures_reported).extend(drives.iter().copied());
        }
        w.trace(|| format!("node {node}: recording its missing drives failed: {r:?}"));
    }
}

/// Runs `f` as one of `o`'s tasks and waits for it; None if the owner died meanwhile.
async fn on_owner<T: Send + 'static>(
    o: &Owner,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    o.spawn(f)?.await.ok()
}

/// The owner's rotation job (mirror-accelerated parity): while the mirror part is above its
/// watermarks, its coldest spans move into parity, each as one of the owner's tasks (so a
/// crash of the owner cuts it wherever it is).
async fn rotate_volume(w: &Arc<World>, v: usize, o: &Arc<Owner>, throttle: &Arc<Throttle>) {
    if o.vol.mirror_part_usage().is_none() {
        return;
    }
    let mut continuing = false;
    while is_current(w, v, o) {
        let (vol, t) = (o.vol.clone(), throttle.clone());
        let r = on_owner(o, async move {
            let progress = converge_volume::resync::Progress::default();
            vol.rotate_once(continuing, &t, &progress).await
        })
        .await;
        w.trace(|| format!("vol{v} epoch {}: rotation: {r:?}", o.epoch));
        match r {
            Some(Ok(converge_volume::Rotated::Span { .. })) => {
                w.count("spans rotated into parity");
                if !o.vol.snapshots().is_empty() {
                    w.count("spans rotated with their snapshots");
                }
                continuing = true;
            }
            Some(Ok(converge_volume::Rotated::Nothing)) => return,
            Some(Err(_)) => {
                w.count("rotations stopped by an error");
                return;
            }
            None => {
                w.count("rotations cut by the owner's end");
                return;
            }
        }
    }
}

/// One round of the repair policy for volume `v`, as its owner's node runs it.
pub(crate) async fn repair_volume(
    w: &Arc<World>,
    v: usize,
    o: &Arc<Owner>,
    down: &mut DownClock,
    throttle: &Arc<Throttle>,
) {
    if !is_current(w, v, o) {
        return;
    }
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node: o.node,
    });
    let Some(Ok(view)) = on_owner(o, async move { View::read(&cluster).await }).await else {
        return;
    };
    if !view.live.contains(&o.node) {
        return;
    }
    let now = Instant::now();
    down.observe(&view, now);
    for (idx, e) in repair::copies_to_mark_stale(&o.vol.slab_map(), &view) {
        let vol = o.vol.clone();
        let r = on_owner(o, async move { vol.copy_failed(idx, e.drive).await }).await;
        w.count("copies marked stale by repair");
        w.trace(|| {
            format!(
                "vol{v} epoch {}: repair marks slab {idx} node {} drive {} stale: {r:?}",
                o.epoch, e.node, e.drive
            )
        });
    }
    let stale = o.vol.stale_extents();
    let job = Job { w, v, o, throttle };
    let resiliency = o.vol.config().resiliency;
    let slabs = o.vol.slab_map();
    let steps = repair::round(
        &slabs,
        &stale,
        &view,
        down,
        w.opts.repair_delay,
        now,
        resiliency,
    );
    for step in steps {
        if !is_current(w, v, o) {
            return;
        }
        match step {
            // The daemon pings the copy's node first; here, whether it is up and reachable.
            Step::Resync(idx, e) if w.ready(e.node) => {
                // As the daemon: a copy whose drive has no room for it is placed elsewhere.
                if resync_one(&job, idx, e).await {
                    w.count("stale copies without room rebuilt elsewhere");
                    rebuild_one(&job, idx, e, Some(Cause::NoRoom)).await
                }
            }
            Step::Resync(..) => {}
            Step::Rebuild(idx, e, cause) => rebuild_one(&job, idx, e, Some(cause)).await,
            Step::Evacuate(idx, e) => rebuild_one(&job, idx, e, None).await,
            Step::Drop(idx, e) => drop_one(&job, idx, e).await,
            Step::Promote(idx, e) => promote_one(&job, idx, e).await,
        }
    }
}

/// Makes the stale copy `e` the slab's in-sync copy if the record marks it as holding
/// every acked write (docs/adr/0014), as the daemon does.
async fn promote_one(j: &Job<'_>, idx: SlabIndex, e: ExtentLoc) {
    let Job { w, v, o, .. } = *j;
    let vol = o.vol.clone();
    let r = on_owner(o, async move { vol.promote(idx, e.drive).await }).await;
    if matches!(r, Some(Ok(true))) {
        w.count("stale copies promoted (held every acked write)");
    }
    w.trace(|| {
        format!(
            "vol{v} epoch {}: PROMOTE slab {idx} node {} drive {}: {r:?}",
            o.epoch, e.node, e.drive
        )
    });
}

/// One repair job's surroundings: the world, the volume, its owner, the throttle.
struct Job<'a> {
    w: &'a Arc<World>,
    v: usize,
    o: &'a Arc<Owner>,
    throttle: &'a Arc<Throttle>,
}

/// Resyncs the stale copy `e`; whether it failed for want of room on its drive.
async fn resync_one(j: &Job<'_>, idx: SlabIndex, e: ExtentLoc) -> bool {
    let Job { w, v, o, throttle } = *j;
    let (vol, t) = (o.vol.clone(), throttle.clone());
    let drive = e.drive;
    let r = on_owner(o, async move {
        vol.resync(idx, drive, &t, &Progress::default()).await
    })
    .await;
    w.count("resyncs");
    if matches!(r, Some(Ok(_))) && o.vol.config().resiliency.is_parity() {
        w.count("parity chunks resynced");
    }
    if matches!(r, Some(Ok(_))) {
        // As the daemon does after a resync.
        crate::owner::release_stray_floors(w, v, o).await;
    }
    w.trace(|| match &r {
        Some(Ok(rep)) => format!(
            "vol{v} epoch {}: RESYNC slab {idx} node {} drive {drive}: {} differed, {} written",
            o.epoch, e.node, rep.blocks_differing, rep.blocks_written
        ),
        Some(Err(err)) => format!(
            "vol{v} epoch {}: resync slab {idx} node {} failed: {err}",
            o.epoch, e.node
        ),
        None => format!("vol{v} epoch {}: resync slab {idx} aborted", o.epoch),
    });
    matches!(r, Some(Err(err)) if err.is_no_space())
}

/// Rebuilds the copy `e` elsewhere (placed by the policy's `rebuild_target` over the
/// drive loads the owner's node reads), or with no `cause` evacuates it (copy before
/// drop), then frees the old extent if its node answers, as the daemon does.
async fn rebuild_one(j: &Job<'_>, idx: SlabIndex, e: ExtentLoc, cause: Option<Cause>) {
    let Job { w, v, o, throttle } = *j;
    let Some(copies) = o.vol.slab_map().get(&idx).cloned() else {
        return;
    };
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node: o.node,
    });
    let Some(Ok(loads)) = on_owner(o, async move { drive_loads(&cluster).await }).await else {
        return;
    };
    let replacing = cause.and_then(|c| c.replacing(&e));
    let new = match repair::rebuild_target(&copies, replacing, &loads) {
        Ok(n) => n,
        Err(err) => {
            w.count("rebuilds without a target");
            w.trace(|| {
                format!(
                    "vol{v} epoch {}: slab {idx} cannot be rebuilt: {err}",
                    o.epoch
                )
            });
            return;
        }
    };
    let (vol, t) = (o.vol.clone(), throttle.clone());
    let r = on_owner(o, async move {
        let p = Progress::default();
        match cause {
            Some(_) => vol.rebuild(idx, e.drive, new, &t, &p).await,
            None => vol.evacuate(idx, e.drive, new, &t, &p).await,
        }
    })
    .await;
    w.count(if cause.is_some() {
        "rebuilds"
    } else {
        "evacuations"
    });
    let cause = cause.map_or_else(|| "Evacuate".to_string(), |c| format!("{c:?}"));
    w.trace(|| match &r {
        Some(Ok(rep)) => format!(
            "vol{v} epoch {}: REBUILD ({cause}) slab {idx}: node {} drive {} -> node {} drive {}: {} written",
            o.epoch, e.node, e.drive, new.node, new.drive, rep.blocks_written
        ),
        Some(Err(err)) => format!(
            "vol{v} epoch {}: rebuild ({cause}) slab {idx} node {} -> node {} failed: {err}",
            o.epoch, e.node, new.node
        ),
        None => format!("vol{v} epoch {}: rebuild of slab {idx} aborted", o.epoch),
    });
    if let Some(Ok(_)) = r {
        w.count(if cause != "Evacuate" {
            "rebuilds done"
        } else {
            "evacuations done"
        });
        if o.vol.config().resiliency.is_parity() {
            // A parity chunk's evacuation is a rebuild in its place (`Volume::evacuate`).
            w.count(if cause != "Evacuate" {
                "parity chunks rebuilt"
            } else {
                "parity chunks evacuated"
            });
        }
        free_one(j, idx, e).await;
    }
}

/// Frees a replaced or dropped copy's extent, if its node answers.
async fn free_one(j: &Job<'_>, idx: SlabIndex, e: ExtentLoc) {
    let Job { w, v, o, .. } = *j;
    let io = SimReplicas {
        world: w.clone(),
        from: o.node,
    };
    let key = ExtentKey {
        volume: o.vol.config().id,
        slab: idx,
    };
    let freed = on_owner(o, async move { io.call(e, ExtentOp::Free { key }).await }).await;
    w.trace(|| format!("vol{v}: freeing the replaced copy of slab {idx}: {freed:?}"));
}

/// Drops a draining node's copy the slab no longer needs, then frees it.
async fn drop_one(j: &Job<'_>, idx: SlabIndex, e: ExtentLoc) {
    let Job { w, v, o, .. } = *j;
    let vol = o.vol.clone();
    let r = on_owner(o, async move { vol.drop_copy(idx, e.drive).await }).await;
    w.count("draining copies dropped");
    w.trace(|| {
        format!(
            "vol{v} epoch {}: DROP slab {idx} node {} drive {}: {r:?}",
            o.epoch, e.node, e.drive
        )
    });
    if let Some(Ok(())) = r {
        free_one(j, idx, e).await;
    }
}

/// Copies left on draining nodes that could move: their slab has a rebuild target (a
/// drive with room on a live node without a copy). Copies with nowhere to go stay, in
/// sync, and are counted; the daemon's drain refuses to start without the room, but thin
/// volumes may fill it later.
pub(crate) async fn movable_copies_on_draining_nodes(w: &Arc<World>) -> Vec<String> {
    let left = w.copies_on_draining_nodes();
    if left.is_empty() {
        return Vec::new();
    }
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node: w.node_ids()[0],
    });
    let Ok(loads) = drive_loads(&cluster).await else {
        return vec!["the drive loads could not be read".into()];
    };
    let mut out = Vec::new();
    for ((v, s), e, copies) in left {
        if repair::rebuild_target(&copies, None, &loads).is_ok() {
            out.push(format!(
                "vol {v} slab {s} node {} drive {}",
                e.node, e.drive
            ));
        } else {
            w.count("drained copies with nowhere to go");
        }
    }
    out
}

/// Scrubs the volume through `o`. Copies that are in sync must never disagree (a bad
/// checksum is rot or a torn write; a mismatch is divergence).
pub(crate) async fn scrub(
    w: &Arc<World>,
    v: usize,
    o: &Arc<Owner>,
    repair: bool,
    throttle: &Arc<Throttle>,
) -> Option<converge_volume::resync::ScrubReport> {
    let (vol, t) = (o.vol.clone(), throttle.clone());
    let r = match o.spawn(async move { vol.scrub(repair, &t, &Progress::default()).await }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    match r {
        Some(Ok(rep)) => {
            w.trace(|| format!("vol{v} epoch {}: SCRUB (repair {repair}): {rep:?}", o.epoch));
            if rep.snapshot_blocks_checked > 0 {
                *lock(&w.stats)
                    .entry("snapshot blocks scrubbed")
                    .or_insert(0) += rep.snapshot_blocks_checked;
            }
            // Scrub holds the slab's writes back, so in-sync copies must agree. They may
            // only differ on an unacked write whose failed copies could not be marked stale
            // because etcd was unreachable: a short partition of the owner's node, which
            // the default fault model leaves out.
            // A deposed owner's view of which copies are in sync is out of date.
            if rep.mismatches > 0 && is_current(w, v, o) {
                if w.opts.short_owner_partitions {
                    w.count("scrub mismatches (unacked writes)");
                } else {
                    w.fail(format!(
                        "vol{v}: scrub through epoch {} found {} blocks whose in-sync copies disagree",
                        o.epoch, rep.mismatches
                    ));
                }
            }
            Some(rep)
        }
        Some(Err(e)) => {
            w.trace(|| format!("vol{v} epoch {}: scrub failed: {e}", o.epoch));
            None
        }
        None => None,
    }
}

/// Variant `snapshot`: takes, reads and deletes snapshots of volume `v` through its current
/// owner, the way the daemon's API does (docs/SNAPSHOTS.md), among the faults. A snapshot
/// read is judged against the history as a read over the window the snapshot was taken in:
/// it must hold every write acked before the window and none issued after it.
pub(crate) async fn snapshotter(w: Arc<World>, v: usize) {
    let mut n = 0u64;
    while !w.stopping() {
        tokio::time::sleep(w.ms(20, 150)).await;
        let Some(o) = lock(&w.vols)[v].current.clone().filter(|o| o.alive()) else {
            continue;
        };
        // Each snapshot keeps what is overwritten after it: a few at a time fit the
        // simulation's small drives.
        let kept = lock(&w.vols)[v].snaps.len();
        match w.rng(|r| r.gen_range(0..10)) {
            _ if kept >= 3 => delete_snapshot(&w, v, &o).await,
            0..=3 => {
                take_snapshot(&w, v, &o, n).await;
                n += 1;
            }
            4..=7 => {
                read_snapshot(&w, v, &o).await;
            }
            _ => delete_snapshot(&w, v, &o).await,
        }
    }
}

async fn take_snapshot(w: &Arc<World>, v: usize, o: &Arc<crate::owner::Owner>, n: u64) {
    let name = lock(&w.vols)[v].name.clone();
    let snap = format!("s{n}");
    let start = lock(&w.hist).tick();
    let node = o.node;
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node,
    });
    let vol = o.vol.clone();
    let (vname, sname) = (name.clone(), snap.clone());
    let noter = Cluster::new(SimKv {
        world: w.clone(),
        node,
    });
    let r = match o.spawn(async move {
        let nname = vname.clone();
        let note = |e| {
            let (noter, name) = (&noter, &nname);
            async move { converge_allocator::snapshots::note_snapshot(noter, name, node, e).await }
        };
        vol.snapshot_noted(note, |e| async move {
            cluster
                .take_snapshot(&vname, node, crate::control::lease_of(node), e, &sname, 0)
                .await
                .map_err(|err| match err {
                    converge_control::ControlError::Etcd(_) => {
                        VolumeError::Control(err.to_string(), vname.clone())
                    }
                    _ => VolumeError::Snapshot {
                        volume: vname.clone(),
                        why: err.to_string(),
                    },
                })
        })
        .await
    }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    let end = lock(&w.hist).tick();
    if matches!(r, Some(Err(_))) && !o.vol.is_retired() {
        crate::owner::release_stray_floors(w, v, o).await;
    }
    // An owner that could not tell what the copies hold stops serving (a commit whose
    // answer was lost, a failed snapshot's floor it could neither drop nor mark stale):
    // as in the daemon, its clients are fenced, and the volume gets a new term.
    if o.vol.is_retired() && is_current(w, v, o) {
        w.count("owners that stopped serving after a snapshot");
        w.trace(|| format!("vol{v}: the owner at epoch {} stopped serving", o.epoch));
        crate::owner::crash_owner(w, v);
    }
    // Whatever the owner saw, the record says whether it was taken.
    let recorded = lock(&w.ctl).snapshot_of(&name, &snap);
    match (&r, recorded) {
        (_, Some((epoch, _))) => {
            w.count("snapshots taken");
            w.trace(|| format!("vol{v}: snapshot {snap} at epoch {epoch} (ticks {start}..{end})"));
            lock(&w.vols)[v].snaps.push(crate::owner::SnapRec {
                name: snap,
                epoch,
                start,
                end,
                deleting: false,
            });
        }
        (Some(Err(e)), None) => {
            w.count("snapshots refused");
            w.trace(|| format!("vol{v}: snapshot {snap} refused: {e}"));
        }
        (_, None) => w.count("snapshots aborted"),
    }
}

async fn read_snapshot(w: &Arc<World>, v: usize, o: &Arc<crate::owner::Owner>) {
    let (blocks, tag) = {
        let vols = lock(&w.vols);
        (volume_blocks(w, &vols[v].spec), vols[v].id.0)
    };
    let live: Vec<crate::owner::SnapRec> = lock(&w.vols)[v]
        .snaps
        .iter()
        .filter(|s| !s.deleting)
        .cloned()
        .collect();
    if live.is_empty() {
        return;
    }
    let s = live[w.rng(|r| r.gen_range(0..live.len()))].clone();
    let n = w.rng(|r| r.gen_range(1..=w.opts.io_blocks_max.min(blocks)));
    let first = w.rng(|r| r.gen_range(0..=blocks - n));
    let strict = o.superseded_at().is_none();
    let vol = o.vol.clone();
    let epoch = s.epoch;
    let r = match o.spawn(async move { vol.read_at(epoch, first * BS, n * BS).await }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    match r {
        Some(Ok(data)) => {
            w.count("snapshot reads ok");
            if o.vol.config().resiliency.is_parity() {
                w.count("parity snapshot reads ok");
            }
            if o.vol.mirror_part_usage().is_some() {
                w.count("mirror-part snapshot reads ok");
            }
            let bad = lock(&w.hist).check_read(v, tag, first, &data, s.start, s.end, strict);
            for (blk, why) in bad {
                let writes = crate::describe_block(w, v, blk);
                w.fail(format!(
                    "read of snapshot {} (epoch {}, taken over ticks {}..{}) via the owner on node {}: {why}\n{writes}",
                    s.name, s.epoch, s.start, s.end, o.node
                ));
            }
        }
        Some(Err(e)) => {
            w.count("snapshot reads failed");
            w.trace(|| format!("vol{v}: read of snapshot {} failed: {e}", s.name));
        }
        None => w.count("snapshot reads aborted"),
    }
}

async fn delete_snapshot(w: &Arc<World>, v: usize, o: &Arc<crate::owner::Owner>) {
    let name = lock(&w.vols)[v].name.clone();
    let snaps = lock(&w.vols)[v].snaps.clone();
    if snaps.is_empty() {
        return;
    }
    // A delete cut short is finished first.
    let s = snaps
        .iter()
        .find(|s| s.deleting)
        .cloned()
        .unwrap_or_else(|| snaps[w.rng(|r| r.gen_range(0..snaps.len()))].clone());
    for r in lock(&w.vols)[v]
        .snaps
        .iter_mut()
        .filter(|r| r.name == s.name)
    {
        r.deleting = true;
    }
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node: o.node,
    });
    let vol = o.vol.clone();
    let (vname, sname) = (name.clone(), s.name.clone());
    // As the daemon's delete: clones the snapshot records that no longer read it are
    // taken off first; a live one refuses the delete (nothing changes).
    let r = match o.spawn(async move {
        crate::clones::prune_pins(&cluster, &vname, &sname)
            .await
            .map_err(|e| Some(e.to_string()))?;
        let Some(epoch) = cluster
            .mark_snapshot_deleting(&vname, &sname)
            .await
            .map_err(|e| match e {
                converge_control::ControlError::Refused(_) => None,
                e => Some(e.to_string()),
            })?
        else {
            return Ok(false);
        };
        vol.drop_snapshot(epoch)
            .await
            .map_err(|e| Some(e.to_string()))?;
        let left_on_copies = vol.has_copies_out_of_sync();
        cluster
            .remove_snapshot_left_on(&vname, &sname, left_on_copies)
            .await
            .map_err(|e| Some(e.to_string()))?;
        Ok::<bool, Option<String>>(true)
    }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    match r {
        Some(Ok(_)) => {
            w.count("snapshots deleted");
            w.trace(|| format!("vol{v}: snapshot {} (epoch {}) deleted", s.name, s.epoch));
            lock(&w.vols)[v].snaps.retain(|r| r.name != s.name);
        }
        Some(Err(None)) => {
            w.count("snapshot deletes refused (a clone reads it)");
            w.trace(|| {
                format!(
                    "vol{v}: delete of snapshot {} refused: a clone reads it",
                    s.name
                )
            });
            for r in lock(&w.vols)[v]
                .snaps
                .iter_mut()
                .filter(|r| r.name == s.name)
            {
                r.deleting = false;
            }
        }
        Some(Err(Some(e))) => {
            w.count("snapshot deletes failed");
            w.trace(|| format!("vol{v}: delete of snapshot {} failed: {e}", s.name));
        }
        None => w.count("snapshot deletes aborted"),
    }
}

/// After healing: every snapshot left is read whole through the current owner and judged.
pub(crate) async fn check_snapshots(w: &Arc<World>, v: usize, o: &Arc<crate::owner::Owner>) {
    let (blocks, tag) = {
        let vols = lock(&w.vols);
        (volume_blocks(w, &vols[v].spec), vols[v].id.0)
    };
    let mut snaps: Vec<crate::owner::SnapRec> = lock(&w.vols)[v]
        .snaps
        .iter()
        .filter(|s| !s.deleting)
        .cloned()
        .collect();
    snaps.sort_by_key(|s| s.epoch);
    // Each snapshot's image, where every read of it succeeded.
    let mut images: Vec<(crate::owner::SnapRec, Option<Vec<u8>>)> = Vec::new();
    for s in snaps {
        let mut first = 0;
        let mut image = Some(Vec::with_capacity((blocks * BS) as usize));
        while first < blocks {
            let n = (blocks - first).min(64);
            let vol = o.vol.clone();
            let epoch = s.epoch;
            match vol.read_at(epoch, first * BS, n * BS).await {
                Ok(data) => {
                    if let Some(img) = image.as_mut() {
                        img.extend_from_slice(&data);
                    }
                    w.count("final snapshot reads");
                    if o.vol.config().resiliency.is_parity() {
                        w.count("final parity snapshot reads");
                    }
                    if o.vol.mirror_part_usage().is_some() {
                        w.count("final mirror-part snapshot reads");
                    }
                    let bad = lock(&w.hist).check_read(v, tag, first, &data, s.start, s.end, true);
                    for (blk, why) in bad {
                        let writes = crate::describe_block(w, v, blk);
                        w.fail(format!(
                            "after healing, snapshot {} (epoch {}, ticks {}..{}): {why}\n{writes}",
                            s.name, s.epoch, s.start, s.end
                        ));
                    }
                }
                // A slab none of whose copies holds the snapshot any more (every copy
                // rebuilt since: docs/SNAPSHOTS.md, "Limits") is refused, never wrong.
                Err(e) => {
                    image = None;
                    w.count("final snapshot reads refused");
                    lock(&w.vols)[v].snaps_refused.push(s.name.clone());
                    w.trace(|| format!("vol{v}: snapshot {} blocks {first}..: {e}", s.name));
                }
            }
            first += n;
        }
        images.push((s, image));
    }
    // The changes between consecutive snapshots (incremental backup) name every block
    // whose content differs between them.
    for pair in images.windows(2) {
        let ((a, Some(ia)), (b, Some(ib))) = (&pair[0], &pair[1]) else {
            continue;
        };
        let bits = match o.vol.changed(a.epoch, Some(b.epoch), 0, blocks * BS).await {
            Ok(bits) => bits,
            Err(e) => {
                w.count("final snapshot changes refused");
                w.trace(|| format!("vol{v}: changes {}..{}: {e}", a.name, b.name));
                continue;
            }
        };
        w.count("final snapshot changes");
        for blk in 0..blocks as usize {
            let r = blk * BS as usize..(blk + 1) * BS as usize;
            if ia[r.clone()] != ib[r] && bits[blk / 64] >> (blk % 64) & 1 == 0 {
                w.fail(format!(
                    "after healing, vol{v} block {blk} differs between snapshots {} (epoch {}) \
                     and {} (epoch {}) but their changes do not list it",
                    a.name, a.epoch, b.name, b.epoch
                ));
            }
        }
    }
}
